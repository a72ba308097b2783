//! The L2 flush autotuning runs before each timed execution.

use crate::{Cudnn, Error, Result};
use cudarc::cublas::{sys::cublasOperation_t, Gemv, GemvConfig};
use cudarc::driver::CudaSlice;

/// How autotuning empties L2 before each timed execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2Flush {
    /// Read twice the L2 size (a cuBLAS GEMV over a scratch matrix): L2 ends up holding clean lines,
    /// as after the kernels that run before a layer in a forward. The default.
    Read,
    /// Write twice the L2 size (a memset): L2 ends up full of dirty lines whose write-back the timed
    /// execution pays for.
    Write,
    /// No flush: what the warm-up left in L2 stays (hot timing, as in a microbenchmark's loop).
    Off,
}

impl L2Flush {
    /// `read`, `write` or `off`.
    pub fn name(self) -> &'static str {
        match self {
            L2Flush::Read => "read",
            L2Flush::Write => "write",
            L2Flush::Off => "off",
        }
    }

    /// The flush [`L2Flush::name`] names.
    pub fn parse(s: &str) -> Option<Self> {
        [L2Flush::Read, L2Flush::Write, L2Flush::Off].into_iter().find(|f| f.name() == s.trim())
    }
}

/// Columns of the GEMV's scratch matrix (its rows follow from the L2 size).
const FLUSH_COLS: usize = 4096;

/// The buffers of one flush mode, allocated once per autotuning.
pub(crate) enum Flusher {
    Read { a: CudaSlice<f32>, x: CudaSlice<f32>, y: CudaSlice<f32>, rows: usize },
    Write(CudaSlice<u8>),
    Off,
}

impl Flusher {
    /// Buffers of twice the L2 size for `mode`. Falls back to writing when cuBLAS is missing, and to
    /// no flush when the device has no L2 size or too little free memory.
    pub(crate) fn new(ctx: &Cudnn, mode: L2Flush) -> Self {
        let cuda = ctx.stream().context();
        let l2 = cuda
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_or(0, |b| b.max(0) as usize);
        if mode == L2Flush::Off || l2 == 0 || !ctx.memory_info().is_ok_and(|(free, _)| free > 4 * l2) {
            return Flusher::Off;
        }
        let rows = (2 * l2).div_ceil(4 * FLUSH_COLS);
        let stream = ctx.stream();
        if mode == L2Flush::Read && ctx.blas().is_ok() {
            if let (Ok(a), Ok(x), Ok(y)) = (
                stream.alloc_zeros(rows * FLUSH_COLS),
                stream.alloc_zeros(FLUSH_COLS),
                stream.alloc_zeros(rows),
            ) {
                return Flusher::Read { a, x, y, rows };
            }
        }
        stream.alloc_zeros::<u8>(2 * l2).map_or(Flusher::Off, Flusher::Write)
    }

    /// Enqueues the flush on the context's stream (autotuning carries on without one if this fails).
    pub(crate) fn run(&mut self, ctx: &Cudnn) -> Result<()> {
        match self {
            Flusher::Read { a, x, y, rows } => {
                let cfg = GemvConfig {
                    trans: cublasOperation_t::CUBLAS_OP_N,
                    m: *rows as i32,
                    n: FLUSH_COLS as i32,
                    alpha: 1.0f32,
                    lda: *rows as i32,
                    incx: 1,
                    beta: 0.0,
                    incy: 1,
                };
                // SAFETY: `a` is `rows` x FLUSH_COLS column-major, `x` FLUSH_COLS and `y` `rows` long,
                // all on the context's stream, which the cuBLAS handle is bound to.
                unsafe { ctx.blas()?.gemv(cfg, a, x, y) }.map_err(|e| Error::Blas(e.to_string()))
            }
            Flusher::Write(buf) => Ok(ctx.stream().memset_zeros(buf)?),
            Flusher::Off => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_names_round_trip() {
        for f in [L2Flush::Read, L2Flush::Write, L2Flush::Off] {
            assert_eq!(L2Flush::parse(f.name()), Some(f));
        }
        assert_eq!(L2Flush::parse(" write "), Some(L2Flush::Write));
        assert_eq!(L2Flush::parse("cold"), None);
    }
}
