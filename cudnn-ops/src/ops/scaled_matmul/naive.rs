//! What a framework without FP8 kernels runs for an FP8 Linear: dequantize A and B into bf16 (one
//! elementwise kernel each, the scale multiplied in f32 and rounded once), then the bf16 cuBLAS GEMM
//! with f32 compute into D, as eager's `matmul` on the dequantized tensors. (PyTorch's own FP8 path,
//! `torch._scaled_mm`, is a cuBLASLt FP8 GEMM: the anchor the fused backend is compared with, not this.)

use super::{ScaledMatmulArgs, ScaledMatmulOperands};
use crate::dtype::{DataType, Element};
use crate::kernels::blas::{gemm, Gemm, Operand};
use crate::kernels::{elementwise, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Result};

/// Kernels launched per call: two dequantizations and the GEMM.
pub const KERNEL_COUNT: usize = 3;

/// The dequantization kernel of an FP8 dtype.
fn dequant(dtype: DataType) -> Result<&'static str> {
    match dtype {
        DataType::F8E4M3 => Ok("dequant_e4m3_bf16"),
        DataType::F8E5M2 => Ok("dequant_e5m2_bf16"),
        other => Err(crate::Error::invalid(format!("scaled_matmul: {other} is not an FP8 dtype"))),
    }
}

impl<A: Element, B: Element, O: Element> Naive<(A, B, O)> for ScaledMatmulArgs {
    fn naive(self, ctx: &Cudnn, x: ScaledMatmulOperands<'_, A, B, O>) -> Result<()> {
        let ScaledMatmulArgs { m, n, k, .. } = self;
        let (da, db) = (dequant(A::DTYPE)?, dequant(B::DTYPE)?);
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
        let args = [Arg::Ptr(a), Arg::Ptr(sa), Arg::I64(0), Arg::I64(k as i64), Arg::Ptr(a16)];
        elementwise(ctx, kernels, da, m * k, &args)?;
        let args = [Arg::Ptr(b), Arg::Ptr(sb), Arg::I64(per_row), Arg::I64(k as i64), Arg::Ptr(b16)];
        elementwise(ctx, kernels, db, n * k, &args)?;
        let (d, _gd) = x.d.device_ptr_mut(s);
        // Row-major D[m, n] = A[m, k] · B[n, k]ᵀ is the column-major Dᵀ = B · Aᵀ: B (a column-major
        // k x n, transposed) first, then A (a column-major k x m).
        let bf16 = DataType::BF16;
        gemm(
            ctx,
            &Gemm {
                transpose_a: true,
                transpose_b: false,
                m: n,
                n: m,
                k,
                a: Operand { ptr: b16, dtype: bf16, ld: k, batch_stride: 0 },
                b: Operand { ptr: a16, dtype: bf16, ld: k, batch_stride: 0 },
                c: Operand { ptr: d, dtype: O::DTYPE, ld: n, batch_stride: 0 },
                batch: 1,
                alpha: 1.0,
                beta: 0.0,
            },
        )
    }
}
