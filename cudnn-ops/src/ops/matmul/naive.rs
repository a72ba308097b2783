//! A matmul with an epilogue as PyTorch eager runs it on bf16/f16/f32 tensors, one launch per line:
//!
//! ```python
//! y = x @ w.T           # cublasGemmStridedBatchedEx, f32 compute, writes the I/O dtype
//! y = y + bias          # epi_bias_*      (eager's F.linear would fuse this into a cuBLASLt epilogue;
//!                       #                  the baseline keeps it separate, one kernel per step)
//! y = F.silu(y)         # epi_silu_*, epi_gelu_*, epi_gelu_tanh_*, epi_relu_*
//! y = y * up            # epi_mul_*       (the SwiGLU gate)
//! y = residual + y      # epi_add_*
//! ```
//!
//! Each epilogue kernel reads and writes the output dtype and computes in f32, so the result is rounded
//! after every step, as eager's is. Steps run in place on D: the memory traffic equals eager's
//! out-of-place kernels (one read and one write of `[batch, m, n]` per step, plus U or R).

use super::{Epilogue, MatmulArgs, MatmulOperands, MatrixLayout};
use crate::dtype::{DataType, Element};
use crate::kernels::blas::{gemm, Gemm, Operand};
use crate::kernels::{elementwise, float_suffix, fp8_suffix, scratch, Arg, Kernels, View};
use crate::ops::Naive;
use crate::{Cudnn, Result};

/// Launches per call: one cuBLAS GEMM (cuBLAS may add a split-K reduction kernel of its own) plus one
/// kernel per epilogue step.
pub fn kernel_count(epilogue: Epilogue) -> usize {
    1 + epilogue.steps()
}

/// How cuBLAS (column-major) reads a `[rows, cols]` matrix so that `op(stored)` is its transpose
/// `[cols, rows]`: `(transpose, ld)`. Row-major storage read column-major already is the transpose;
/// column-major storage needs `op = T`. A leading dim of size 1 gets the smallest `ld` cuBLAS accepts.
fn transposed_view(l: &MatrixLayout) -> (bool, usize) {
    let [_, rows, cols] = l.dims;
    let [_, sr, sc] = l.strides;
    if sc == 1 {
        (false, if rows > 1 { sr } else { sr.max(cols) })
    } else {
        (true, if cols > 1 { sc } else { sc.max(rows) })
    }
}

/// The GEMM for row-major `D[M, N] = A[M, K] · B[K, N]`, batched: cuBLAS computes the column-major
/// `Dᵀ = Bᵀ · Aᵀ`, so B is cuBLAS's first operand and A its second.
pub(crate) fn gemm_config(args: &MatmulArgs, a: u64, b: u64, d: u64, dtype: DataType, out: DataType) -> Gemm {
    let (m, n, k) = (args.m(), args.n(), args.k());
    let (transpose_a, lda) = transposed_view(&args.b);
    let (transpose_b, ldb) = transposed_view(&args.a);
    let batch = args.batch();
    let stride = |l: &MatrixLayout| if l.dims[0] > 1 { l.strides[0] } else { 0 };
    Gemm {
        transpose_a,
        transpose_b,
        m: n,
        n: m,
        k,
        a: Operand { ptr: b, dtype, ld: lda, batch_stride: stride(&args.b) },
        b: Operand { ptr: a, dtype, ld: ldb, batch_stride: stride(&args.a) },
        c: Operand { ptr: d, dtype: out, ld: n, batch_stride: m * n },
        batch,
        alpha: 1.0,
        beta: 0.0,
    }
}

impl<T: Element, O: Element, W: Element> Naive<(T, O, W)> for MatmulArgs {
    fn naive(self, ctx: &Cudnn, x: MatmulOperands<'_, T, O, W>) -> Result<()> {
        if let Some(forms) = self.forms() {
            return Err(crate::Error::NotSupported {
                op: format!("naive matmul {forms}"),
                reason:
                    "the prologue and the up product are forms of the fused backend's decode GEMV; eager \
                         runs rms_norm and separate matmuls (as the decoder's naive modules do)"
                        .into(),
            });
        }
        if W::DTYPE != T::DTYPE {
            // Eager over an FP8 weight: dequantize it (one kernel), then the 16-bit GEMM; what can
            // fail without touching memory first.
            ready(ctx, &self)?;
            let b = dequantized(ctx, &self, &x)?;
            return run(ctx, &self, x.with_b(&b));
        }
        run(ctx, &self, x)
    }
}

/// What the eager decomposition checks before it touches memory: the epilogue kernels' 32-bit
/// indexing, cuBLAS.
fn ready(ctx: &Cudnn, args: &MatmulArgs) -> Result<()> {
    let total = args.d_len();
    crate::error::ensure!(
        args.epilogue.steps() == 0 || total <= u32::MAX as usize,
        "naive matmul: {total} output elements exceed the epilogue kernels' 32-bit indexing"
    );
    ctx.blas()?;
    Ok(())
}

/// The kernel dequantizing FP8 `codes` into `out` (bf16 or f16; others are refused by name).
pub(crate) fn dequant(codes: DataType, out: DataType) -> Result<String> {
    let fmt = fp8_suffix("FP8 dequantization", "codes", codes)?;
    Ok(format!("dequant_{fmt}_{}", float_suffix("FP8 dequantization", "output", out)?))
}

/// B's FP8 codes times their factors, in A's dtype in the context's scratch (the kernel launched,
/// ordered on the stream before whatever reads it): what eager runs before its GEMM, and the fused
/// backend's B over more tokens than the decode GEMV takes. B is a Linear's `[n, k]` weight
/// ([`MatmulArgs::check_weight`]).
pub(super) fn dequantized<T: Element, O: Element, W: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    x: &MatmulOperands<'_, T, O, W>,
) -> Result<View> {
    let (n, k) = (args.n(), args.k());
    let name = dequant(W::DTYPE, T::DTYPE)?;
    let scale =
        x.b_scale.ok_or_else(|| crate::Error::invalid("matmul: an FP8 weight without its factors"))?;
    let kernels = Kernels::get(ctx)?;
    let len = n * k;
    let addr = scratch(ctx, kernels, (len * T::DTYPE.size()).div_ceil(4))?;
    let stream = ctx.stream();
    let (b, _gb) = x.b.device_ptr(stream);
    let (s, _gs) = scale.device_ptr(stream);
    let per_row = i64::from(scale.len() > 1);
    let args = [Arg::Ptr(b), Arg::Ptr(s), Arg::I64(per_row), Arg::I64(k as i64), Arg::Ptr(addr)];
    elementwise(ctx, kernels, &name, len, &args)?;
    Ok(View { addr, len, stream: stream.clone() })
}

/// The eager decomposition: the GEMM, then the epilogue's steps in place on D.
fn run<T: Element, O: Element, W: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    x: MatmulOperands<'_, T, O, W>,
) -> Result<()> {
    let (epilogue, total) = (args.epilogue, args.d_len());
    let suffix = match O::DTYPE {
        DataType::BF16 => "bf16",
        DataType::F16 => "f16",
        _ => "f32",
    };
    // Everything that can fail without touching memory comes first: cuBLAS, NVRTC.
    ready(ctx, args)?;
    let kernels = if epilogue.steps() > 0 { Some(Kernels::get(ctx)?) } else { None };
    let stream = ctx.stream();
    let (a_ptr, _ga) = x.a.device_ptr(stream);
    let (b_ptr, _gb) = x.b.device_ptr(stream);
    let (d_ptr, _gd) = x.d.device_ptr_mut(stream);
    gemm(ctx, &gemm_config(args, a_ptr, b_ptr, d_ptr, T::DTYPE, O::DTYPE))?;
    let Some(kernels) = kernels else { return Ok(()) };
    let y = Arg::Ptr(d_ptr);
    if let Some(bias) = x.bias {
        let (p, _g) = bias.device_ptr(stream);
        let args = [y, Arg::Ptr(p), Arg::I64(args.n() as i64)];
        elementwise(ctx, kernels, &format!("epi_bias_{suffix}"), total, &args)?;
    }
    if let Some(act) = epilogue.activation {
        elementwise(ctx, kernels, &format!("epi_{}_{suffix}", act.name()), total, &[y])?;
    }
    if let Some(u) = x.up {
        let (p, _g) = u.device_ptr(stream);
        elementwise(ctx, kernels, &format!("epi_mul_{suffix}"), total, &[y, Arg::Ptr(p)])?;
    }
    if let Some(r) = x.residual {
        let (p, _g) = r.device_ptr(stream);
        elementwise(ctx, kernels, &format!("epi_add_{suffix}"), total, &[y, Arg::Ptr(p)])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_gemm_reads_the_weight_transposed() {
        // y[30, 6144] = x[30, 4096] · W[6144, 4096]ᵀ. Read column-major with ld 4096, the row-major W is
        // the 4096 x 6144 matrix Wᵀ = B; cuBLAS's first operand must be Bᵀ, hence op = T. x read the same
        // way is xᵀ, exactly cuBLAS's second operand, hence op = N.
        let args = MatmulArgs::linear(30, 4096, 6144);
        let g = gemm_config(&args, 0xa, 0xb, 0xd, DataType::BF16, DataType::BF16);
        assert_eq!((g.m, g.n, g.k, g.batch), (6144, 30, 4096, 1));
        assert!(g.transpose_a && !g.transpose_b);
        assert_eq!((g.a.ptr, g.a.ld, g.b.ptr, g.b.ld, g.c.ptr, g.c.ld), (0xb, 4096, 0xa, 4096, 0xd, 6144));
        assert_eq!((g.a.batch_stride, g.b.batch_stride), (0, 0));
    }

    #[test]
    fn batched_row_major_and_broadcast_weights() {
        let args = MatmulArgs::packed(3, 7, 64, 128);
        let g = gemm_config(&args, 1, 2, 3, DataType::F16, DataType::F32);
        assert!(!g.transpose_a && !g.transpose_b);
        assert_eq!((g.m, g.n, g.k, g.batch), (128, 7, 64, 3));
        assert_eq!((g.a.ld, g.b.ld, g.c.ld), (128, 64, 128));
        assert_eq!((g.a.batch_stride, g.b.batch_stride, g.c.batch_stride), (64 * 128, 7 * 64, 7 * 128));
        assert_eq!((g.a.dtype, g.c.dtype), (DataType::F16, DataType::F32));
        let shared = MatmulArgs { b: MatrixLayout::row_major(1, 64, 128), ..args };
        assert_eq!(gemm_config(&shared, 1, 2, 3, DataType::F16, DataType::F16).a.batch_stride, 0);
        // A column-major A (x stored transposed) is op = T on cuBLAS's second operand.
        let a_t = MatmulArgs { a: MatrixLayout::column_major(3, 7, 64), ..args };
        let g = gemm_config(&a_t, 1, 2, 3, DataType::F16, DataType::F16);
        assert!(g.transpose_b && g.b.ld == 7);
    }

    #[test]
    fn single_row_gets_a_valid_leading_dimension() {
        // m = 1 with an arbitrary row stride: cuBLAS still needs ld >= k.
        let l = MatrixLayout { dims: [1, 1, 64], strides: [64, 8, 1] };
        assert_eq!(transposed_view(&l), (false, 64));
        assert_eq!(kernel_count(Epilogue::NONE), 1);
        assert_eq!(kernel_count(Epilogue::SWIGLU.with_bias().with_residual()), 5);
    }
}
