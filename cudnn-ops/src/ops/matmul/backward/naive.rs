//! The Linear and SwiGLU backward as PyTorch eager autograd runs them, one launch per line:
//!
//! ```text
//! data gradient     dx = dy @ W                    cublasGemmStridedBatchedEx (f32 compute)
//!                   dx_buf += dx                   epi_add_*            (only when accumulating)
//! weight gradient   dW = dy.T @ x                  cublasGemmStridedBatchedEx
//!                   W.grad += dW                   epi_add_*            (AccumulateGrad, when accumulating)
//!                   db = dy.sum(0)                 colsum_*_*           (with a bias)
//!                   b.grad += db                   epi_add_*            (with a bias, when accumulating)
//! SwiGLU backward   d_act = dy @ W_down            cublasGemmStridedBatchedEx
//!                   s = F.silu(gate)               swiglu_bwd_silu_*    (recomputes what autograd saved)
//! MulBackward0      d_s = d_act * up               rms_bwd_mul_*
//!                   d_up = d_act * s               rms_bwd_mul_*
//! SiluBackward0     d_gate = silu_backward(d_s, gate)  swiglu_bwd_silu_backward_*
//! ```
//!
//! Accumulation computes the gradient into scratch memory first, as autograd computes a fresh
//! gradient before `AccumulateGrad` adds it. Every elementwise kernel computes in f32 and rounds to
//! the I/O dtype.

use super::{DataGrad, DataOf, LinearGradArgs, SwigluGrads, SwigluOf, WeightGrad, WeightOf};
use crate::dtype::{DataType, Element};
use crate::kernels::blas::gemm;
use crate::kernels::{elementwise, scratch, Arg, Kernels};
use crate::ops::matmul::naive::gemm_config;
use crate::ops::matmul::MatmulArgs;
use crate::ops::rmsnorm::naive::column_sum;
use crate::ops::Naive;
use crate::{Cudnn, Result};

/// Launches of a data gradient: the GEMM, plus the add when accumulating.
pub fn data_kernel_count(accumulate: bool) -> usize {
    1 + accumulate as usize
}

/// Launches of a weight gradient: the GEMM and, with a bias, the column sum; one add each when
/// accumulating.
pub fn weight_kernel_count(accumulate: bool, bias: bool) -> usize {
    (1 + bias as usize) * (1 + accumulate as usize)
}

/// Launches of the SwiGLU backward: the GEMM and four elementwise kernels.
pub const SWIGLU_KERNELS: usize = 5;

fn suffix(dtype: DataType) -> Result<&'static str> {
    crate::kernels::float_suffix("naive linear backward", "elements", dtype)
}

/// The f32 scratch elements that hold `len` elements of `dtype`.
fn f32s(len: usize, dtype: DataType) -> usize {
    (len * dtype.size()).div_ceil(4)
}

/// `d = A·B` for `m` (its epilogue ignored), or `d += A·B` through scratch when `accumulate`.
fn gemm_into<T: Element, O: Element>(
    ctx: &Cudnn,
    m: &MatmulArgs,
    (a, b, d): (u64, u64, u64),
    accumulate: bool,
) -> Result<()> {
    if !accumulate {
        return gemm(ctx, &gemm_config(m, a, b, d, T::DTYPE, O::DTYPE));
    }
    let kernels = Kernels::get(ctx)?;
    let len = m.d_len();
    let fresh = scratch(ctx, kernels, f32s(len, O::DTYPE))?;
    gemm(ctx, &gemm_config(m, a, b, fresh, T::DTYPE, O::DTYPE))?;
    elementwise(ctx, kernels, &format!("epi_add_{}", suffix(O::DTYPE)?), len, &[Arg::Ptr(d), Arg::Ptr(fresh)])
}

impl<T: Element, O: Element> Naive<DataOf<T, O>> for LinearGradArgs {
    fn naive(self, ctx: &Cudnn, x: DataGrad<'_, T, O>) -> Result<()> {
        // Everything that can fail without touching memory first: cuBLAS, NVRTC.
        ctx.blas()?;
        if self.accumulate {
            Kernels::get(ctx)?;
        }
        let s = ctx.stream();
        let (dy, _g1) = x.dy.device_ptr(s);
        let (w, _g2) = x.weight.device_ptr(s);
        let (dx, _g3) = x.dx.device_ptr_mut(s);
        gemm_into::<T, O>(ctx, &self.data_grad(), (dy, w, dx), self.accumulate)
    }
}

impl<T: Element, O: Element> Naive<WeightOf<T, O>> for LinearGradArgs {
    fn naive(self, ctx: &Cudnn, x: WeightGrad<'_, T, O>) -> Result<()> {
        ctx.blas()?;
        let kernels = if self.accumulate || x.dbias.is_some() { Some(Kernels::get(ctx)?) } else { None };
        let s = ctx.stream();
        let (dy, _g1) = x.dy.device_ptr(s);
        let (xp, _g2) = x.x.device_ptr(s);
        let (dw, _g3) = x.dw.device_ptr_mut(s);
        gemm_into::<T, O>(ctx, &self.weight_grad(), (dy, xp, dw), self.accumulate)?;
        let (Some(db), Some(kernels)) = (x.dbias, kernels) else { return Ok(()) };
        let (db, _g4) = db.device_ptr_mut(s);
        let (rows, cols) = (self.tokens, self.out_features);
        if !self.accumulate {
            return column_sum(ctx, kernels, (T::DTYPE, O::DTYPE), dy, rows, cols, db);
        }
        let fresh = scratch(ctx, kernels, f32s(cols, O::DTYPE))?;
        column_sum(ctx, kernels, (T::DTYPE, O::DTYPE), dy, rows, cols, fresh)?;
        elementwise(
            ctx,
            kernels,
            &format!("epi_add_{}", suffix(O::DTYPE)?),
            cols,
            &[Arg::Ptr(db), Arg::Ptr(fresh)],
        )
    }
}

impl<T: Element> Naive<SwigluOf<T>> for LinearGradArgs {
    fn naive(self, ctx: &Cudnn, x: SwigluGrads<'_, T>) -> Result<()> {
        ctx.blas()?;
        let kernels = Kernels::get(ctx)?;
        let sfx = suffix(T::DTYPE)?;
        let m = self.data_grad();
        let n = m.d_len();
        crate::error::ensure!(
            n <= u32::MAX as usize,
            "naive swiglu_down_backward: {n} elements exceed the kernels' 32-bit indexing"
        );
        // d_act, s and d_s, in the I/O dtype, as eager allocates them.
        let slot = f32s(n, T::DTYPE);
        let base = scratch(ctx, kernels, 3 * slot)?;
        let (d_act, silu, d_s) = (base, base + 4 * slot as u64, base + 8 * slot as u64);
        let s = ctx.stream();
        let (dy, _g1) = x.dy.device_ptr(s);
        let (w, _g2) = x.w_down.device_ptr(s);
        let (gate, _g3) = x.gate.device_ptr(s);
        let (up, _g4) = x.up.device_ptr(s);
        let (d_gate, _g5) = x.d_gate.device_ptr_mut(s);
        let (d_up, _g6) = x.d_up.device_ptr_mut(s);
        gemm(ctx, &gemm_config(&m, dy, w, d_act, T::DTYPE, T::DTYPE))?;
        let p = Arg::Ptr;
        let ew = |name: &str, a: &[Arg]| elementwise(ctx, kernels, &format!("{name}_{sfx}"), n, a);
        ew("swiglu_bwd_silu", &[p(gate), p(silu)])?;
        ew("rms_bwd_mul", &[p(d_act), p(up), p(d_s)])?;
        ew("rms_bwd_mul", &[p(d_act), p(silu), p(d_up)])?;
        ew("swiglu_bwd_silu_backward", &[p(d_s), p(gate), p(d_gate)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_gemm_reads_dy_transposed_and_data_gemm_reads_w_as_stored() {
        // dW[out, in] = dYᵀ · X: cuBLAS computes dWᵀ = Xᵀ · dY column-major; X read column-major is Xᵀ
        // already (op = N on cuBLAS's first operand), dY read column-major is dYᵀ, and cuBLAS needs dY
        // as its second operand: op = T with ld = out.
        let a = LinearGradArgs::new(32, 64, 128);
        let g = gemm_config(&a.weight_grad(), 0xa, 0xb, 0xd, DataType::BF16, DataType::F32);
        assert_eq!((g.m, g.n, g.k), (64, 128, 32));
        assert_eq!((g.transpose_a, g.a.ptr, g.a.ld), (false, 0xb, 64));
        assert_eq!((g.transpose_b, g.b.ptr, g.b.ld), (true, 0xa, 128));
        assert_eq!((g.c.ld, g.c.dtype), (64, DataType::F32));
        // dX[tokens, in] = dY · W with W [out, in] row-major: both op = N.
        let g = gemm_config(&a.data_grad(), 0xa, 0xb, 0xd, DataType::BF16, DataType::BF16);
        assert_eq!((g.m, g.n, g.k), (64, 32, 128));
        assert!(!g.transpose_a && !g.transpose_b);
        assert_eq!((g.a.ld, g.b.ld, g.c.ld), (64, 128, 64));
        assert_eq!(weight_kernel_count(true, true), 4);
        assert_eq!(weight_kernel_count(false, true), 2);
        assert_eq!(data_kernel_count(false), 1);
    }
}
