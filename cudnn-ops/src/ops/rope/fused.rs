//! The fused half: one kernel (`fused.cu`), one block per row, rotating Q and K in f32 with one
//! rounding; positions from the arguments or, per sequence, from the device.

use super::{suffix, KvAppend, RopeArgs, RopeOperands};
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
        let RopeOperands { tables, qkv, starts, append } = x;
        let rows = batch * seq;
        let (x, _gx) = qkv.device_ptr_mut(ctx.stream());
        let i = |v: usize| Arg::I64(v as i64);
        let (c, _gc) = tables.cos_half.device_ptr(ctx.stream());
        let (s, _gs) = tables.sin_half.device_ptr(ctx.stream());
        let heads = heads_q + heads_kv;
        let (p, _gp) = optional_ptr(starts, ctx.stream());
        // One block per row; enough warps for the row's pairs (40 heads x 64 pairs: 256 threads).
        let threads = (heads * d / 2).next_multiple_of(32).clamp(32, 256) as u32;
        let cfg = LaunchConfig {
            grid_dim: (checked::launch_dim("rope: rows", rows)?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let table = [i(tables.positions), Arg::Ptr(c), Arg::Ptr(s)];
        let Some(KvAppend { k, v, max_seq }) = append else {
            let shape = [Arg::Ptr(x), i(row_stride), i(seq), i(heads), i(d), i(start), Arg::Ptr(p)];
            return launch(
                ctx,
                kernels,
                &format!("rope_fused_{sfx}"),
                cfg,
                &[shape.as_slice(), &table].concat(),
            );
        };
        let (kc, _gk) = k.device_ptr_mut(ctx.stream());
        let (vc, _gv) = v.device_ptr_mut(ctx.stream());
        let shape =
            [Arg::Ptr(x), i(row_stride), i(seq), i(heads_q), i(heads_kv), i(d), i(start), Arg::Ptr(p)];
        let a = [shape.as_slice(), &table, &[Arg::Ptr(kc), Arg::Ptr(vc), i(max_seq)]].concat();
        launch(ctx, kernels, &format!("rope_append_{sfx}"), cfg, &a)
    }
}
