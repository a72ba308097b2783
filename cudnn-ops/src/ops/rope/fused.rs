//! The fused half: one kernel (`fused.cu`), a few blocks per row, rotating Q and K in f32 with one
//! rounding; positions from the arguments or, per sequence, from the device.

use super::{suffix, KvAppend, RopeArgs, RopeOperands, RopeTables, TokenPositions};
use crate::checked;
use crate::dtype::Element;
use crate::kernels::{launch_programmatic, optional_ptr, Arg, Kernels};
use crate::ops::rows::CacheRows;
use crate::ops::Fused;
use crate::{Cudnn, Result};
use cudarc::driver::{DevicePtr, LaunchConfig};

impl<T: Element> Fused<T> for RopeArgs {
    fn fused(self, ctx: &Cudnn, x: RopeOperands<'_, T>) -> Result<()> {
        let RopeOperands { tables, qkv, starts, tokens, append } = x;
        let (x, _gx) = qkv.device_ptr_mut(ctx.stream());
        let (p, _gp) = optional_ptr(starts, ctx.stream());
        let (t, _gt) = optional_ptr(tokens.map(|t| t.at), ctx.stream());
        let per_token = Tokens { at: t, sequences: tokens.map_or(0, |t: TokenPositions<'_>| t.sequences) };
        let Some(KvAppend { k, v, rows }) = append else {
            return rotate(ctx, self, tables, x, (p, per_token), Rotation::Forward);
        };
        let (kc, _gk) = k.device_ptr_mut(ctx.stream());
        let (vc, _gv) = v.device_ptr_mut(ctx.stream());
        let RopeArgs { heads_q, heads_kv, head_dim: d, row_stride, seq, start, .. } = self;
        let i = |v: usize| Arg::I64(v as i64);
        let (c, _gc) = tables.cos_half.device_ptr(ctx.stream());
        let (s, _gs) = tables.sin_half.device_ptr(ctx.stream());
        let a = [Arg::Ptr(x), i(row_stride), i(seq), i(heads_q), i(heads_kv), i(d), i(start), Arg::Ptr(p)];
        let rest = [i(tables.positions), Arg::Ptr(c), Arg::Ptr(s), Arg::Ptr(kc), Arg::Ptr(vc)];
        // Per-token positions (checked to come with a paged append only).
        let tok = [Arg::Ptr(per_token.at), i(per_token.sequences)];
        let sfx = suffix(T::DTYPE)?;
        match rows {
            CacheRows::Contiguous { max_seq } => launch_programmatic(
                ctx,
                Kernels::get(ctx)?,
                &format!("rope_append_{sfx}"),
                row_blocks(self)?,
                &[a.as_slice(), &rest, &[i(max_seq)]].concat(),
            ),
            CacheRows::Paged { table, first } => {
                let sequences = if per_token.at != 0 { per_token.sequences } else { self.batch };
                let view = table.rows(first, sequences);
                let (t, _gt) = view.device_ptr(ctx.stream());
                let paged = [Arg::Ptr(t), i(table.shape().max_pages)];
                let addressing = table.shape().pages.kernel_args();
                launch_programmatic(
                    ctx,
                    Kernels::get(ctx)?,
                    &format!("rope_append_paged_{sfx}"),
                    row_blocks(self)?,
                    &[a.as_slice(), &tok, &rest, &paged, &addressing].concat(),
                )
            }
        }
    }
}

/// The direction of a rotation: by θ (the forward), or by −θ (its gradient).
#[derive(Clone, Copy)]
pub(super) enum Rotation {
    Forward,
    Backward,
}

/// Rows of one launch below which a row is split over several blocks.
const SPLIT_BELOW_ROWS: usize = 256;

/// One block per row, enough warps for the row's Q and K pairs (40 heads x 64 pairs: 256 threads,
/// looping); a launch of few rows (a decode step) instead splits each row over enough blocks for one
/// pair per thread, so that its one row is spread over the GPU (one block took 5 us on an H200). Split
/// always, a 16384-row prefill got slower (0.26 ms on an H200, against 0.21 ms unsplit on an H100).
fn row_blocks(a: RopeArgs) -> Result<LaunchConfig> {
    let (rows, pairs) = (a.batch * a.seq, (a.heads_q + a.heads_kv) * a.head_dim / 2);
    let threads = pairs.next_multiple_of(32).clamp(32, 256);
    // The kernels stride over what a grid's y leaves.
    let per_row = if rows < SPLIT_BELOW_ROWS { pairs.div_ceil(threads).min(65535) } else { 1 };
    Ok(LaunchConfig {
        grid_dim: (checked::launch_dim("rope: rows", rows)?, per_row as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Device per-token positions of a call ([`TokenPositions`]): their address (0: none) and sequences.
#[derive(Clone, Copy, Default)]
pub(super) struct Tokens {
    pub(super) at: u64,
    pub(super) sequences: usize,
}

/// `rope_fused_*` over the Q and K heads at device address `x` (positions from `args.start`, or per
/// sequence from the device starts at `starts` when non-zero, or per token from `tokens`); arguments
/// checked by the caller.
pub(super) fn rotate<T: Element>(
    ctx: &Cudnn,
    args: RopeArgs,
    tables: &RopeTables<T>,
    x: u64,
    (starts, tokens): (u64, Tokens),
    rotation: Rotation,
) -> Result<()> {
    let RopeArgs { seq, heads_q, heads_kv, head_dim: d, row_stride, start, .. } = args;
    let i = |v: usize| Arg::I64(v as i64);
    let (c, _gc) = tables.cos_half.device_ptr(ctx.stream());
    let (s, _gs) = tables.sin_half.device_ptr(ctx.stream());
    let sign = match rotation {
        Rotation::Forward => 1.0,
        Rotation::Backward => -1.0,
    };
    let a = [
        Arg::Ptr(x),
        i(row_stride),
        i(seq),
        i(heads_q + heads_kv),
        i(d),
        i(start),
        Arg::Ptr(starts),
        Arg::Ptr(tokens.at),
        i(tokens.sequences),
        i(tables.positions),
        Arg::Ptr(c),
        Arg::Ptr(s),
        Arg::F32(sign),
    ];
    launch_programmatic(
        ctx,
        Kernels::get(ctx)?,
        &format!("rope_fused_{}", suffix(T::DTYPE)?),
        row_blocks(args)?,
        &a,
    )
}
