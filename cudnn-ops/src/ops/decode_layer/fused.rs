//! The launch of `layer.cu`'s `decode_layer_<dtype>_d<head_dim / 32>`: a block of 256 threads per
//! SM, the phase's input vector in dynamic shared memory, its scratch, partials and barrier in
//! buffers the context owns.

use super::{DecodeLayerArgs, DecodeLayerOperands};
use crate::kernels::{launch_programmatic, Arg, Kernels, Owned};
use crate::{checked, Cudnn, DataType, Element, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

/// Threads per block (`LAYER_THREADS` in layer.cu).
const THREADS: u32 = 256;
/// Warps per block.
const WARPS: usize = THREADS as usize / 32;
/// Layers whose weights are at most this many bytes have every phase's weights prefetched into L2
/// at the start (a small fraction of a Hopper's 50-60 MB L2); larger ones each phase's before the
/// barrier before it.
const PREFETCH_ALL_BYTES: usize = 16 << 20;

/// q, o, x1 and act between the phases (16-bit elements).
const ACTIVATIONS: Owned<u16> = Owned::new("decode layer activations");
/// Attention's per-split partials (f32: d sums, the max and the sum of each split).
const PARTIALS: Owned<f32> = Owned::new("decode layer attention partials");
/// The global timer at the phases' ends in block 0 of the last launch ([`phase_times`]).
const CLOCKS: Owned<u64> = Owned::new("decode layer phase clocks");
/// The grid barrier (one word) and a split counter per query head.
const BARRIER: Owned<u32> = Owned::new("decode layer barrier and counters");

pub(super) fn launch<T: Element>(
    ctx: &Cudnn,
    a: DecodeLayerArgs,
    x: DecodeLayerOperands<'_, T>,
) -> Result<()> {
    let refused = |reason: String| Error::NotSupported { op: "decode layer".into(), reason };
    let info = ctx.info();
    if info.compute_capability.0 < 7 {
        return Err(refused(format!(
            "compute capability {}.{} (the grid barrier needs 7.0+)",
            info.compute_capability.0, info.compute_capability.1
        )));
    }
    let sfx = if T::DTYPE == DataType::BF16 { "bf16" } else { "f16" };
    let name = format!("decode_layer_{sfx}_d{}", a.head_dim / 32);
    let blocks = info.sm_count.max(1);
    let warps = blocks * WARPS;
    let max_splits = (warps / a.heads_q).max(1);
    let (hidden, attn_w, ffn) = (a.hidden, a.attn_width(), a.ffn);
    let widest = hidden.max(attn_w).max(ffn);
    let weight_bytes = 2 * (2 * hidden + a.qkv_width() * hidden + hidden * attn_w + 3 * ffn * hidden);
    let s = ctx.stream();
    let DecodeLayerOperands { x: xin, w, tables, position, k, v, y } = x;
    fn ptr<'a, T>(
        b: &'a cudarc::driver::CudaSlice<T>,
        s: &'a cudarc::driver::CudaStream,
    ) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        b.device_ptr(s)
    }
    let (xp, _g0) = ptr(xin, s);
    let (an, _g1) = ptr(w.attn_norm, s);
    let (qkv, _g2) = ptr(w.qkv, s);
    let (wo, _g3) = ptr(w.o, s);
    let (mn, _g4) = ptr(w.mlp_norm, s);
    let (wg, _g5) = ptr(w.gate, s);
    let (wu, _g6) = ptr(w.up, s);
    let (wd, _g7) = ptr(w.down, s);
    let (cos, sin) = tables.half_tables();
    let (cp, _g8) = cos.device_ptr(s);
    let (sp, _g9) = sin.device_ptr(s);
    let (pp, _g10) = position.device_ptr(s);
    let (kp, _g11) = k.device_ptr_mut(s);
    let (vp, _g12) = v.device_ptr_mut(s);
    let (yp, _g13) = y.device_ptr_mut(s);
    // Every buffer the kernel reads or writes 16 bytes at a time, checked before the op's own
    // buffers are allocated.
    let read16 = [
        ("x", xp),
        ("attn_norm", an),
        ("qkv", qkv),
        ("o", wo),
        ("mlp_norm", mn),
        ("gate", wg),
        ("up", wu),
        ("down", wd),
        ("k cache", kp),
        ("v cache", vp),
    ];
    if let Some((what, p)) = read16.into_iter().find(|&(_, p)| p % 16 != 0) {
        return Err(refused(format!("{what} pointer {p:#x} is not 16-byte aligned (16-byte loads)")));
    }
    let kernels = Kernels::get(ctx)?;
    let acts = checked::add("decode layer: activations", 2 * attn_w + hidden, ffn)?;
    let mut act = kernels.owned(ctx, ACTIVATIONS, acts)?;
    let mut part = kernels.owned(ctx, PARTIALS, a.heads_q * max_splits * (a.head_dim + 2))?;
    let mut bar = kernels.owned(ctx, BARRIER, a.heads_q + 1)?;
    let mut clocks = kernels.owned(ctx, CLOCKS, STAMPS)?;
    let (ap, _g14) = act.device_ptr_mut(s);
    let (prt, _g15) = part.device_ptr_mut(s);
    let (bp, _g16) = bar.device_ptr_mut(s);
    let (tp, _g17) = clocks.device_ptr_mut(s);
    // The activations: q [attn_w], o [attn_w], x1 [hidden], act [ffn]; every width a multiple of
    // 8 elements, so each starts 16-byte aligned.
    let at = |elems: usize| Arg::Ptr(ap + 2 * elems as u64);
    let i = |v: usize| Arg::I64(v as i64); // checked dims, all below 2^31
    let scale_log2 = std::f32::consts::LOG2_E / (a.head_dim as f32).sqrt();
    let args = [
        Arg::Ptr(xp),
        Arg::Ptr(an),
        Arg::Ptr(qkv),
        Arg::Ptr(wo),
        Arg::Ptr(mn),
        Arg::Ptr(wg),
        Arg::Ptr(wu),
        Arg::Ptr(wd),
        Arg::F32(a.eps),
        Arg::Ptr(cp),
        Arg::Ptr(sp),
        i(tables.positions()),
        Arg::Ptr(pp),
        Arg::Ptr(kp),
        Arg::Ptr(vp),
        i(a.max_seq),
        i(hidden),
        i(a.heads_q),
        i(a.heads_kv),
        i(a.head_dim),
        i(ffn),
        Arg::F32(scale_log2),
        i((weight_bytes <= PREFETCH_ALL_BYTES) as usize),
        at(0),
        at(attn_w),
        at(2 * attn_w),
        at(2 * attn_w + hidden),
        Arg::Ptr(prt),
        i(max_splits),
        Arg::Ptr(bp + 4),
        Arg::Ptr(bp),
        Arg::Ptr(yp),
        Arg::Ptr(tp),
    ];
    let cfg = LaunchConfig {
        grid_dim: (checked::launch_dim("decode layer: blocks", blocks)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (4 * widest) as u32,
    };
    // One entry per shape, dtype and grid (each has its own description).
    let mut key = DefaultHasher::new();
    ("decode layer", hidden, a.heads_q, a.heads_kv, a.head_dim, ffn, sfx, blocks).hash(&mut key);
    kernels.count_run(key.finish(), || {
        format!(
            "decode layer [1, {hidden}] heads {}/{}x{} ffn {ffn} {sfx} ({name}, {blocks} blocks)",
            a.heads_q, a.heads_kv, a.head_dim
        )
    });
    // Programmatic: before `pdl_wait` the kernel only prefetches weights into L2, and it lets the
    // next kernel start only after its last grid barrier (layer.cu).
    launch_programmatic(ctx, kernels, &name, cfg, &args)
}

/// Timer stamps a launch records (layer.cu `stamp`).
const STAMPS: usize = 7;

/// Where the last launch on `ctx`'s stream spent its time, in block 0 (ns, from the GPU's global
/// timer): waiting for the kernel before it (after its L2 prefetches), then each phase up to and
/// including the barrier after it (A qkv + RoPE, B attention, C o_proj, D gate/up), then E (down).
/// `None` before the first launch. Synchronizes the stream.
pub fn phase_times(ctx: &Cudnn) -> Result<Option<[u64; STAMPS - 1]>> {
    let kernels = Kernels::get(ctx)?;
    let clocks = kernels.owned(ctx, CLOCKS, STAMPS)?;
    let host = ctx.stream().clone_dtoh(&clocks.slice(0..STAMPS))?;
    if host[0] == 0 {
        return Ok(None);
    }
    let mut out = [0u64; STAMPS - 1];
    for i in 0..STAMPS - 1 {
        out[i] = host[i + 1].saturating_sub(host[i]);
    }
    Ok(Some(out))
}
