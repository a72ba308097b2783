//! The eager decomposition of a dynamic FP8 quantization, a launch per step with f32 in between:
//! `x.float()` (not for f32 input), `abs`, `amax` (per row one kernel; per tensor torch's two-stage
//! reduction, the fused half's kernels), the factor (`amax / FP8_MAX`, 1 where 0), `x / factor`, the
//! cast to FP8.

use super::fused::{config, suffixes, tensor_blocks};
use super::{QuantizeArgs, QuantizeOperands, Scaling};
use crate::dtype::{DataType, Element};
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Result};

/// Kernels launched per call, per row with a 16-bit input (one fewer for f32 input).
pub const KERNEL_COUNT: usize = 6;

impl<T: Element, F: Element> Naive<(T, F)> for QuantizeArgs {
    fn naive(self, ctx: &Cudnn, x: QuantizeOperands<'_, T, F>) -> Result<()> {
        let (src, fmt) = suffixes(T::DTYPE, F::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let (rows, cols) = (self.rows, self.cols);
        let n = rows * cols; // checked by `check`
        let blocks = tensor_blocks(n);
        // f32 scratch: x.float() (n), |x| (n), the quotient (n), the row maxima or partials.
        let base = scratch(ctx, kernels, 3 * n + rows.max(blocks))?;
        let at = |i: usize| base + 4 * i as u64;
        let (xf, abs, quot, amax) = (at(0), at(n), at(2 * n), at(3 * n));
        let s = ctx.stream();
        let (xp, _gx) = x.x.device_ptr(s);
        let (fp, _gf) = x.factors.device_ptr_mut(s);
        let (qp, _gq) = x.q.device_ptr_mut(s);
        let xf = if T::DTYPE == DataType::F32 {
            xp
        } else {
            elementwise(ctx, kernels, &format!("cast_{src}_f32"), n, &[Arg::Ptr(xp), Arg::Ptr(xf)])?;
            xf
        };
        elementwise(ctx, kernels, "quant_naive_abs", n, &[Arg::Ptr(xf), Arg::Ptr(abs)])?;
        let per_row = match self.scaling {
            Scaling::PerRow => {
                let args = [Arg::Ptr(abs), Arg::I64(cols as i64), Arg::Ptr(fp)];
                launch(ctx, kernels, "quant_naive_amax_rows", config(rows)?, &args)?;
                elementwise(ctx, kernels, &format!("quant_naive_factor_{fmt}"), rows, &[Arg::Ptr(fp)])?;
                1
            }
            Scaling::PerTensor => {
                let args = [Arg::Ptr(abs), Arg::I64(n as i64), Arg::Ptr(amax)];
                launch(ctx, kernels, "quant_amax_f32", config(blocks)?, &args)?;
                let args = [Arg::Ptr(amax), Arg::I64(blocks as i64), Arg::Ptr(fp)];
                launch(ctx, kernels, &format!("quant_factor_{fmt}"), config(1)?, &args)?;
                0
            }
        };
        let args = [Arg::Ptr(xf), Arg::Ptr(fp), Arg::I64(per_row), Arg::I64(cols as i64), Arg::Ptr(quot)];
        elementwise(ctx, kernels, "quant_naive_div", n, &args)?;
        elementwise(ctx, kernels, &format!("quant_naive_cast_{fmt}"), n, &[Arg::Ptr(quot), Arg::Ptr(qp)])
    }
}
