//! The fused half: a block per row (amax, factor, codes), or per tensor the blocks' partial maxima,
//! the factor and the codes (`quantize.cu`).

use super::{QuantizeArgs, QuantizeOperands, Scaling};
use crate::dtype::{DataType, Element};
use crate::kernels::{float_suffix, fp8_suffix, launch, Arg, Kernels, Owned};
use crate::ops::Fused;
use crate::{Cudnn, Result};
use cudarc::driver::{DevicePtrMut, LaunchConfig};

/// Threads per block.
const BLOCK: u32 = 256;
/// The most blocks of the per-tensor passes (grid-stride loops cover the rest).
const MAX_BLOCKS: usize = 1024;
/// The per-tensor blocks' partial maxima.
const PARTIALS: Owned<f32> = Owned::new("fp8 quantization partial maxima");

/// The kernels' suffixes: the input dtype and the FP8 format.
pub(super) fn suffixes(x: DataType, q: DataType) -> Result<(&'static str, &'static str)> {
    Ok((float_suffix("quantize_fp8", "input", x)?, fp8_suffix("quantize_fp8", "codes", q)?))
}

/// The blocks of a per-tensor pass over `n` elements.
pub(super) fn tensor_blocks(n: usize) -> usize {
    n.div_ceil(BLOCK as usize).min(MAX_BLOCKS)
}

/// A grid of `blocks` blocks of [`BLOCK`] threads.
pub(super) fn config(blocks: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (crate::checked::launch_dim("quantize_fp8: blocks", blocks)?, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl<T: Element, F: Element> Fused<(T, F)> for QuantizeArgs {
    fn fused(self, ctx: &Cudnn, x: QuantizeOperands<'_, T, F>) -> Result<()> {
        let (src, fmt) = suffixes(T::DTYPE, F::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let (rows, cols) = (self.rows, self.cols);
        let n = rows * cols; // checked by `check`
        match self.scaling {
            Scaling::PerRow => {
                let s = ctx.stream();
                let (xp, _gx) = x.x.device_ptr(s);
                let (fp, _gf) = x.factors.device_ptr_mut(s);
                let (qp, _gq) = x.q.device_ptr_mut(s);
                let args = [Arg::Ptr(xp), Arg::I64(cols as i64), Arg::Ptr(fp), Arg::Ptr(qp)];
                launch(ctx, kernels, &format!("quant_rows_{src}_{fmt}"), config(rows)?, &args)
            }
            Scaling::PerTensor => {
                let blocks = tensor_blocks(n);
                let mut partials = kernels.owned(ctx, PARTIALS, blocks)?;
                let s = ctx.stream();
                let (xp, _gx) = x.x.device_ptr(s);
                let (pp, _gp) = partials.device_ptr_mut(s);
                let (fp, _gf) = x.factors.device_ptr_mut(s);
                let (qp, _gq) = x.q.device_ptr_mut(s);
                let amax = [Arg::Ptr(xp), Arg::I64(n as i64), Arg::Ptr(pp)];
                launch(ctx, kernels, &format!("quant_amax_{src}"), config(blocks)?, &amax)?;
                let factor = [Arg::Ptr(pp), Arg::I64(blocks as i64), Arg::Ptr(fp)];
                launch(ctx, kernels, &format!("quant_factor_{fmt}"), config(1)?, &factor)?;
                let codes = [Arg::Ptr(xp), Arg::I64(n as i64), Arg::Ptr(fp), Arg::Ptr(qp)];
                launch(ctx, kernels, &format!("quant_tensor_{src}_{fmt}"), config(blocks)?, &codes)
            }
        }
    }
}
