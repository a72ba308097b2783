//! What this crate's GPU tests use, public so that a dependent's tests of its own ops can use it too:
//! opening GPU 0 (or skipping with a message), uploading f64 values rounded to an element type,
//! outputs poisoned with NaN so that unwritten elements show, and a check that bad input leaves an
//! output untouched. Helpers here panic on failure, as tests do; nothing else in the crate uses them.

use crate::{reference, Cudnn, Element, Result};
use cudarc::driver::CudaSlice;

/// Opens GPU 0, or prints why not (`SKIPPED: ...`) and returns `None`.
pub fn gpu_or_skip(what: &str) -> Option<Cudnn> {
    match Cudnn::new(0) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            eprintln!("SKIPPED {what}: {e}");
            None
        }
    }
}

/// For a test that needs `n` GPUs: whether this machine has them; if not, prints `SKIPPED what: ...`
/// with the count it found (a multi-GPU test on a machine with fewer GPUs skips, as the guide asks,
/// rather than failing on a device it cannot open).
pub fn gpus_or_skip(n: usize, what: &str) -> bool {
    match crate::device_count() {
        Ok(have) if have >= n => true,
        Ok(have) => {
            eprintln!("SKIPPED {what}: needs {n} CUDA GPUs, this machine has {have}");
            false
        }
        Err(e) => {
            eprintln!("SKIPPED {what}: needs {n} CUDA GPUs, none usable here: {e}");
            false
        }
    }
}

/// GPU 0 for a GPU test (one marked `#[ignore = "needs a CUDA GPU"]`): run on a machine without a
/// usable GPU, the test fails here and says why (tests that must pass without one use [`gpu_or_skip`]).
pub fn gpu() -> Cudnn {
    Cudnn::new(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU with cuDNN: {e}"))
}

/// Uploads `values` rounded to `T`; returns the device buffer and the rounded values as f64.
pub fn upload<T: Element>(ctx: &Cudnn, values: &[f64]) -> Result<(CudaSlice<T>, Vec<f64>)> {
    let host: Vec<T> = reference::to_elements(values);
    let rounded = host.iter().map(|v| v.to_f64()).collect();
    Ok((ctx.stream().clone_htod(&host)?, rounded))
}

/// A device buffer of `n` NaNs, so that unwritten output elements show.
pub fn poisoned<T: Element>(ctx: &Cudnn, n: usize) -> Result<CudaSlice<T>> {
    Ok(ctx.stream().clone_htod(&vec![T::nan(); n])?)
}

/// Fills `d` with 7.0, runs `f`, expects an error whose message contains `expected`, checks that `d`
/// still holds 7.0 everywhere (bad input touches no memory), and returns the error.
pub fn expect_untouched(
    ctx: &Cudnn,
    d: &mut CudaSlice<half::bf16>,
    expected: &str,
    f: impl FnOnce(&mut CudaSlice<half::bf16>) -> Result<()>,
) -> crate::Error {
    let sevens = vec![half::bf16::from_f32(7.0); d.len()];
    ctx.stream().memcpy_htod(&sevens, d).unwrap();
    let err = f(d).expect_err(expected);
    assert!(err.to_string().contains(expected), "{expected}: {err}");
    ctx.synchronize().unwrap();
    assert_eq!(download(ctx, d).unwrap(), sevens, "{expected}: output was written");
    err
}

/// Copies a device buffer back to the host.
pub fn download<T: Element>(ctx: &Cudnn, buf: &CudaSlice<T>) -> Result<Vec<T>> {
    Ok(ctx.stream().clone_dtoh(buf)?)
}

/// [`expect_untouched`], and the error must be an [`crate::Error::InvalidArgument`] (an argument the
/// checks refuse, not a failure of cuDNN or the driver).
pub fn expect_invalid(
    ctx: &Cudnn,
    d: &mut CudaSlice<half::bf16>,
    expected: &str,
    f: impl FnOnce(&mut CudaSlice<half::bf16>) -> Result<()>,
) {
    let err = expect_untouched(ctx, d, expected, f);
    assert!(matches!(err, crate::Error::InvalidArgument(_)), "{expected}: {err}");
}
