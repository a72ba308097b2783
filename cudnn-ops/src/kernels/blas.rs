//! cuBLAS GEMMs for the naive backend: the calls PyTorch eager makes for `matmul`/`Linear`
//! (`cublasGemmStridedBatchedEx` with f32 compute).

use crate::dtype::DataType;
use crate::exec::Exec;
use crate::{Error, Result};
use cudarc::cublas::sys;

/// One operand of a column-major GEMM: device address, dtype, leading dimension and batch stride
/// (elements).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: u64,
    pub dtype: DataType,
    pub ld: usize,
    pub batch_stride: usize,
}

/// `C = alpha · op(A) · op(B) + beta · C` in cuBLAS's column-major convention, `batch` times:
/// `op(A)` is `m × k`, `op(B)` is `k × n`, `C` is `m × n`. A row-major `C[M, N] = A[M, K] · B[K, N]`
/// is the column-major `Cᵀ = Bᵀ · Aᵀ`: pass B as `a` and A as `b` with `m = N`, `n = M`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub c: Operand,
    pub batch: usize,
    pub alpha: f32,
    pub beta: f32,
}

fn cuda_type(d: DataType) -> Result<sys::cudaDataType_t> {
    Ok(match d {
        DataType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DataType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DataType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        other => return Err(Error::invalid(format!("cuBLAS GEMM: dtype {other} is not supported"))),
    })
}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("cuBLAS GEMM: {what} = {v} exceeds i32")))
}

/// Enqueues the GEMM on the context's stream (f32 compute, default algorithm).
pub(crate) fn gemm(ctx: &Exec, g: &Gemm) -> Result<()> {
    let blas = ctx.blas()?;
    let op =
        |t: bool| if t { sys::cublasOperation_t::CUBLAS_OP_T } else { sys::cublasOperation_t::CUBLAS_OP_N };
    let (m, n, k) = (int(g.m, "m")?, int(g.n, "n")?, int(g.k, "k")?);
    let batch = int(g.batch, "batch")?;
    let (alpha, beta) = (g.alpha, g.beta);
    // SAFETY: the handle is bound to the context's stream; callers (the naive ops) checked that every
    // operand's buffer covers `ld`, `batch_stride` and the matrix extents; alpha and beta are host f32
    // values matching the f32 compute type and outlive the call.
    unsafe {
        crate::raw::cublas::gemm_strided_batched_ex(
            blas,
            op(g.transpose_a),
            op(g.transpose_b),
            m,
            n,
            k,
            (&alpha as *const f32).cast(),
            g.a.ptr as *const std::ffi::c_void,
            cuda_type(g.a.dtype)?,
            int(g.a.ld, "lda")?,
            g.a.batch_stride as i64,
            g.b.ptr as *const std::ffi::c_void,
            cuda_type(g.b.dtype)?,
            int(g.b.ld, "ldb")?,
            g.b.batch_stride as i64,
            (&beta as *const f32).cast(),
            g.c.ptr as *mut std::ffi::c_void,
            cuda_type(g.c.dtype)?,
            int(g.c.ld, "ldc")?,
            g.c.batch_stride as i64,
            batch,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Blas(format!("cublasGemmStridedBatchedEx {m}x{n}x{k} (batch {batch}): {e}")))
}
