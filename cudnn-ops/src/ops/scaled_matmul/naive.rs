//! What a framework without FP8 kernels runs for an FP8 Linear: dequantize the FP8 operands into a
//! 16-bit type (one elementwise kernel each, the scale multiplied in f32 and rounded once), then the
//! cuBLAS GEMM with f32 compute, as eager's `matmul` on the dequantized tensors. (PyTorch's own FP8 path,
//! `torch._scaled_mm`, is a cuBLASLt FP8 GEMM: the anchor the fused backend is compared with, not this.)

use super::{ScaledMatmulArgs, ScaledMatmulOperands};
use crate::dtype::{DataType, Element};
use crate::kernels::blas::gemm;
use crate::kernels::{elementwise, scratch, Arg, Kernels};
use crate::ops::matmul::naive::{dequant, gemm_config};
use crate::ops::matmul::MatmulArgs;
use crate::ops::Naive;
use crate::{Cudnn, Result};

/// Kernels launched per [`scaled_matmul`](super::scaled_matmul) call: two dequantizations and the GEMM.
pub const KERNEL_COUNT: usize = 3;

impl<A: Element, B: Element, O: Element> Naive<(A, B, O)> for ScaledMatmulArgs {
    fn naive(self, ctx: &Cudnn, x: ScaledMatmulOperands<'_, A, B, O>) -> Result<()> {
        let ScaledMatmulArgs { m, n, k, .. } = self;
        let (da, db) = (dequant(A::DTYPE, DataType::BF16)?, dequant(B::DTYPE, DataType::BF16)?);
        ctx.blas()?;
        let kernels = Kernels::get(ctx)?;
        // bf16 copies of A and B in the scratch (checked sizes: `check` bounded m·k and n·k), B's
        // 16-byte aligned.
        let a_elems = (m * k).next_multiple_of(8);
        let base = scratch(ctx, kernels, (a_elems + n * k).div_ceil(2))?;
        let (a16, b16) = (base, base + 2 * a_elems as u64);
        let s = ctx.stream();
        let (a, _ga) = x.a.device_ptr(s);
        let (b, _gb) = x.b.device_ptr(s);
        let (sa, _gsa) = x.a_scale.device_ptr(s);
        let (sb, _gsb) = x.b_scale.device_ptr(s);
        let per_row = (x.b_scale.len() > 1) as i64;
        let per_token = (x.a_scale.len() > 1) as i64;
        let args = [Arg::Ptr(a), Arg::Ptr(sa), Arg::I64(per_token), Arg::I64(k as i64), Arg::Ptr(a16)];
        elementwise(ctx, kernels, &da, m * k, &args)?;
        let args = [Arg::Ptr(b), Arg::Ptr(sb), Arg::I64(per_row), Arg::I64(k as i64), Arg::Ptr(b16)];
        elementwise(ctx, kernels, &db, n * k, &args)?;
        let (d, _gd) = x.d.device_ptr_mut(s);
        gemm(ctx, &gemm_config(&MatmulArgs::linear(m, k, n), a16, b16, d, DataType::BF16, O::DTYPE))
    }
}
