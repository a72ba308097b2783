//! The fused half: one kernel (`fused.cu`), one block per row, rotating Q and K in f32 with one
//! rounding; positions from the arguments or, per sequence, from the device.

use super::{suffix, RopeArgs, RopeOperands};
use crate::checked;
use crate::dtype::Element;
use crate::kernels::{launch, optional_ptr, Arg, Kernels};
use crate::ops::Fused;
use crate::{Cudnn, Result};
use cudarc::driver::{DevicePtr, LaunchConfig};

impl<T: Element> Fused<T> for RopeArgs {
    fn fused(self, ctx: &Cudnn, x: RopeOperands<'_, T>) -> Result<()> {
        let sfx = suffix(T::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let RopeArgs { batch, seq, heads_q, heads_kv, head_dim: d, row_stride, start } = self;
        let RopeOperands { tables, qkv, starts } = x;
        let rows = batch * seq;
        let (x, _gx) = qkv.device_ptr_mut(ctx.stream());
        let i = |v: usize| Arg::I64(v as i64);
        let (c, _gc) = tables.cos_half.device_ptr(ctx.stream());
        let (s, _gs) = tables.sin_half.device_ptr(ctx.stream());
        let heads = heads_q + heads_kv;
        let (p, _gp) = optional_ptr(starts, ctx.stream());
        let a = [
            Arg::Ptr(x),
            i(row_stride),
            i(seq),
            i(heads),
            i(d),
            i(start),
            Arg::Ptr(p),
            i(tables.positions),
            Arg::Ptr(c),
            Arg::Ptr(s),
        ];
        // One block per row; enough warps for the row's pairs (40 heads x 64 pairs: 256 threads).
        let threads = (heads * d / 2).next_multiple_of(32).clamp(32, 256) as u32;
        let cfg = LaunchConfig {
            grid_dim: (checked::launch_dim("rope: rows", rows)?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(ctx, kernels, &format!("rope_fused_{sfx}"), cfg, &a)
    }
}
