//! The cuBLAS calls: autotuning's L2 flush (a GEMV, safe: lengths checked here) and the naive
//! backend's GEMMs (`cublasGemmStridedBatchedEx` over raw addresses: its caller vouches for them).
//!
//! cuBLAS docs: <https://docs.nvidia.com/cuda/cublas/>.

use crate::{Error, Result};
use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys::{self, cublasOperation_t};
use cudarc::cublas::{result, CudaBlas, Gemv, GemvConfig};
use cudarc::driver::CudaSlice;
use std::ffi::c_void;

/// Whether libcublas can be opened; cudarc panics on its first call otherwise.
pub(crate) fn library_present() -> bool {
    super::library_present("cublas")
}

/// `y = A · x` in f32 on `blas`'s stream, `a` a column-major `rows × cols` matrix; an error if a
/// buffer is shorter than that or a size exceeds i32.
pub(crate) fn sgemv(
    blas: &CudaBlas,
    (rows, cols): (usize, usize),
    a: &CudaSlice<f32>,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let short = rows.checked_mul(cols).is_none_or(|n| a.len() < n) || x.len() < cols || y.len() < rows;
    let (Ok(m), Ok(n), false) = (i32::try_from(rows), i32::try_from(cols), short) else {
        return Err(Error::Blas(format!(
            "gemv {rows}x{cols}: buffers of {}, {} and {} elements do not fit (or a size exceeds i32)",
            a.len(),
            x.len(),
            y.len()
        )));
    };
    let cfg = GemvConfig {
        trans: cublasOperation_t::CUBLAS_OP_N,
        m,
        n,
        alpha: 1.0f32,
        lda: m,
        incx: 1,
        beta: 0.0,
        incy: 1,
    };
    // SAFETY: `a` holds `rows · cols` elements (ld `rows`), `x` `cols` and `y` `rows` (checked above,
    // unit increments); cudarc orders the three buffers against `blas`'s stream through their events.
    unsafe { blas.gemv(cfg, a, x, y) }.map_err(|e| Error::Blas(e.to_string()))
}

/// `cublasGemmStridedBatchedEx` with `blas`'s handle (and so on its stream).
///
/// # Safety
/// Every pointer must address device memory of this context covering what the GEMM reads or writes:
/// for `a` (`m × k`, or `k × m` transposed, in `lda`) plus `(batch − 1) · stride_a` elements, and
/// likewise `b` and `c`; `alpha` and `beta` must point to host values of the compute type's scalar
/// (f32 for `CUBLAS_COMPUTE_32F`). The buffers must stay alive until the work completes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_strided_batched_ex(
    blas: &CudaBlas,
    transa: cublasOperation_t,
    transb: cublasOperation_t,
    m: i32,
    n: i32,
    k: i32,
    alpha: *const c_void,
    a: *const c_void,
    a_type: sys::cudaDataType_t,
    lda: i32,
    stride_a: i64,
    b: *const c_void,
    b_type: sys::cudaDataType_t,
    ldb: i32,
    stride_b: i64,
    beta: *const c_void,
    c: *mut c_void,
    c_type: sys::cudaDataType_t,
    ldc: i32,
    stride_c: i64,
    batch_count: i32,
    compute_type: sys::cublasComputeType_t,
    algo: sys::cublasGemmAlgo_t,
) -> std::result::Result<(), CublasError> {
    // SAFETY: the handle is `blas`'s, live while it is borrowed; the rest is the caller's promise.
    unsafe {
        result::gemm_strided_batched_ex(
            *blas.handle(),
            transa,
            transb,
            m,
            n,
            k,
            alpha,
            a,
            a_type,
            lda,
            stride_a,
            b,
            b_type,
            ldb,
            stride_b,
            beta,
            c,
            c_type,
            ldc,
            stride_c,
            batch_count,
            compute_type,
            algo,
        )
    }
}
