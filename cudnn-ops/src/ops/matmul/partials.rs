//! The sum of a matmul's partial products: `y = base + Σ_r parts[r]`, the reduction a row-parallel
//! projection's ranks need after each computed its share of the inner dimension, with the residual
//! it is added to as the optional base. A tensor-parallel rank that gathered every rank's partial
//! `[rows, n]` block (one after another) sums them here in f32, base first, then in part order,
//! rounding once: the same bits on every rank; for two parts and no base, the bits of NCCL's bf16
//! sum all-reduce (f32 sum of two, rounded to nearest even).

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::kernels::{launch, optional_ptr, Arg, Kernels};
use crate::{Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Elements a thread sums (one 16-byte vector of bf16 or f16).
const PER_THREAD: usize = 8;
/// Threads a block.
const THREADS: u32 = 256;

/// `out = base + parts[0..n] + parts[n..2n] + ...` over the `count` parts of `n = out.len()`
/// elements that `parts` holds one after another (`count · n` elements) and the optional `base` of
/// `n` elements, summed in f32 in that order and rounded once to `T` (bf16, f16 or f32); one launch
/// on the context's stream. `count` of 0, or a `parts` or `base` of another length, is an
/// [`Error::InvalidArgument`] before any launch.
pub fn sum_partials<T: Element>(
    ctx: &Cudnn,
    parts: &impl DevicePtr<T>,
    count: usize,
    base: Option<&dyn DevicePtr<T>>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let sfx = suffix(T::DTYPE)?;
    let n = out.len();
    check(parts.len(), count, n)?;
    check_base(base.map(|b| b.len()), n)?;
    if n == 0 {
        return Ok(());
    }
    let kernels = Kernels::get(ctx)?;
    let cfg = LaunchConfig {
        grid_dim: (
            checked::launch_dim("sum_partials: blocks", n.div_ceil(PER_THREAD * THREADS as usize))?,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (count, len) =
        (checked::to_i64("sum_partials: parts", count)?, checked::to_i64("sum_partials: n", n)?);
    let s = ctx.stream();
    let (b, _gb) = optional_ptr(base, s);
    let (p, _gp) = parts.device_ptr(s);
    let (y, _gy) = out.device_ptr_mut(s);
    launch(
        ctx,
        kernels,
        &format!("sum_parts_{sfx}"),
        cfg,
        &[Arg::Ptr(b), Arg::Ptr(p), Arg::I64(count), Arg::Ptr(y), Arg::I64(len)],
    )
}

/// A `base` of [`sum_partials`] (its length, if any) has the output's `n` elements.
fn check_base(base: Option<usize>, n: usize) -> Result<()> {
    match base {
        Some(len) if len != n => {
            Err(Error::invalid(format!("sum_partials: a base of {len} elements for an output of {n}")))
        }
        _ => Ok(()),
    }
}

/// The lengths [`sum_partials`] takes: `count ≥ 1` parts of `n` elements.
fn check(parts: usize, count: usize, n: usize) -> Result<()> {
    if count == 0 {
        return Err(Error::invalid("sum_partials: no parts to sum"));
    }
    if count.checked_mul(n) != Some(parts) {
        return Err(Error::invalid(format!(
            "sum_partials: {parts} elements of parts are not {count} parts of the output's {n}"
        )));
    }
    Ok(())
}

fn suffix(dtype: DataType) -> Result<&'static str> {
    crate::kernels::float_suffix("sum_partials", "elements", dtype)
}

/// What [`sum_partials`] computes, on the host: the f32 sum of `base` (if any), then the parts in
/// order, from the first term (so -0 + -0 is -0, as NCCL's sum), rounded once (the reference its GPU
/// test compares against, bit for bit).
pub fn sum_partials_reference<T: Element>(parts: &[T], count: usize, base: Option<&[T]>) -> Result<Vec<T>> {
    let n = parts.len().checked_div(count).unwrap_or(0);
    check(parts.len(), count, n)?;
    check_base(base.map(<[T]>::len), n)?;
    let part = |r: usize, i: usize| parts[r * n + i].to_f64() as f32;
    let sum = |i: usize| {
        let first = base.map_or(part(0, i), |b| b[i].to_f64() as f32 + part(0, i));
        (1..count).fold(first, |a, r| a + part(r, i))
    };
    Ok((0..n).map(|i| T::from_f64(f64::from(sum(i)))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn lengths_are_checked_before_any_launch() {
        assert!(check(8, 2, 4).is_ok());
        assert!(check(0, 3, 0).is_ok());
        let e = check(8, 0, 4).unwrap_err().to_string();
        assert!(e.contains("no parts"), "{e}");
        let e = check(9, 2, 4).unwrap_err().to_string();
        assert!(e.contains("9 elements of parts are not 2 parts of the output's 4"), "{e}");
        assert!(check(usize::MAX, 3, usize::MAX / 2).is_err());
        assert!(matches!(suffix(DataType::I32), Err(Error::NotSupported { .. })));
        assert!(check_base(None, 4).is_ok() && check_base(Some(4), 4).is_ok());
        let e = check_base(Some(3), 4).unwrap_err().to_string();
        assert!(e.contains("a base of 3 elements for an output of 4"), "{e}");
    }

    #[test]
    fn the_reference_sums_in_f32_and_rounds_once() {
        // 256 + 1 + 1 in bf16 steps would stay 256 (1 is below half an ulp of 256 twice); in f32, 258.
        let parts: Vec<bf16> = [256.0f32, 1.0, 1.0].iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(sum_partials_reference(&parts, 3, None).unwrap(), [bf16::from_f32(258.0)]);
        // The same terms as a base and two parts: one rounding too.
        let base = [bf16::from_f32(256.0)];
        assert_eq!(sum_partials_reference(&parts[1..], 2, Some(&base)).unwrap(), [bf16::from_f32(258.0)]);
        let two: Vec<bf16> = [1.5f32, -2.0, 0.25, 8.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let sums = sum_partials_reference(&two, 2, None).unwrap();
        assert_eq!(sums, [bf16::from_f32(1.75), bf16::from_f32(6.0)]);
        let based = sum_partials_reference(&two, 2, Some(&[bf16::from_f32(-1.0), bf16::ONE])).unwrap();
        assert_eq!(based, [bf16::from_f32(0.75), bf16::from_f32(7.0)]);
        assert!(sum_partials_reference(&two, 3, None).is_err());
        assert!(sum_partials_reference(&two, 2, Some(&[bf16::ONE])).is_err());
        // -0 + -0 stays -0 (a sum seeded with +0 would give +0), with a -0 base too.
        let zeros = [bf16::NEG_ZERO, bf16::NEG_ZERO];
        assert_eq!(sum_partials_reference(&zeros, 2, None).unwrap()[0].to_bits(), bf16::NEG_ZERO.to_bits());
        let z = sum_partials_reference(&zeros, 2, Some(&[bf16::NEG_ZERO])).unwrap();
        assert_eq!(z[0].to_bits(), bf16::NEG_ZERO.to_bits());
    }
}
