//! PyTorch eager's `torch.nn.functional.layer_norm` on CUDA: one kernel (`naive.cu`), a block per row,
//! the row's mean and biased variance in f32, then `(x − mean) · rstd · weight + bias` in f32 rounded
//! once to the I/O type. Eager's own `vectorized_layer_norm_kernel` also runs one launch, with Welford
//! statistics and vector loads, so this baseline is not a chain of elementwise kernels as RMSNorm's is.
//! It reads each element three times with scalar loads, and on an H200 it is about 2x slower than
//! PyTorch's kernel on large inputs (`benches/results/h200/layernorm.md`): the bench's `torch ms` column,
//! not this one, is the eager anchor there.

use super::{LayerNormArgs, LayerNormOperands};
use crate::kernels::{float_suffix, launch, optional_ptr_mut, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Element, Result};
use cudarc::driver::LaunchConfig;

/// Kernels launched per call (the report checks its counts against this).
pub const KERNEL_COUNT: usize = 1;

/// Threads per row.
const BLOCK: u32 = 256;

impl<T: Element> Naive<T> for LayerNormArgs {
    fn naive(self, ctx: &Cudnn, x: LayerNormOperands<'_, T>) -> Result<()> {
        let LayerNormOperands { x, weight, bias, y, stats } = x;
        let name = format!("layer_norm_{}", float_suffix("layer_norm", "tensors", T::DTYPE)?);
        let kernels = Kernels::get(ctx)?;
        let cfg = LaunchConfig {
            grid_dim: (crate::checked::launch_dim("layer_norm: rows", self.tokens)?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = ctx.stream();
        let (x, _g1) = x.device_ptr(s);
        let (w, _g2) = weight.device_ptr(s);
        let (b, _g3) = bias.device_ptr(s);
        let (y, _g4) = y.device_ptr_mut(s);
        let (mean, inv_std) = match stats {
            Some((m, r)) => (Some(m), Some(r)),
            None => (None, None),
        };
        let (mean, _g5) = optional_ptr_mut(mean, s);
        let (rstd, _g6) = optional_ptr_mut(inv_std, s);
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::Ptr(b),
            Arg::I64(self.hidden as i64),
            Arg::F32(self.epsilon),
            Arg::Ptr(y),
            Arg::Ptr(mean),
            Arg::Ptr(rstd),
        ];
        launch(ctx, kernels, &name, cfg, &args)
    }
}
