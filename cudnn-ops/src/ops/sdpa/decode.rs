//! The split-KV ("flash-decoding") kernel of fused attention, for a decode: one query per sequence
//! over a K/V cache, in one launch (`decode.cu`). cuDNN's SDPA gives a (sequence, head) one CTA that
//! walks every key, so a decode step, which reads only a few MB of K/V, is latency bound there. Here
//! the keys of each (sequence, K/V head) are split over enough CTAs to fill the GPU. A CTA per
//! (sequence, K/V head, chunk of its query heads, split of the keys) holds all query heads of the
//! chunk (the whole GQA group up to 8 heads, so each K/V element is read once per step) over the
//! split's keys (16-byte loads, f32 online softmax) and writes each head's f32 partial (unnormalized
//! output, running max, sum) to a buffer the op owns on the context; the last CTA of a (sequence, K/V
//! head, chunk) to finish, found by a counter it sets back to zero, merges the partials of the splits
//! that hold keys into O in a fixed order (deterministic whichever CTA is last). It launches as a
//! programmatic dependent launch where the context allows it: before waiting for the kernel before it,
//! each CTA only prefetches its first keys into L2.
//!
//! The launch is fixed per shape and device (splits from the key capacity and the SM count), never per
//! length: each sequence's key count is read on the device and divided among the splits there (so the
//! work follows the length, not the capacity), and one launch serves every decode step, as a CUDA
//! graph needs. Lengths are clamped into `0..=seq_kv` as they are read; a sequence with no keys gets a
//! zero output row (the reference's empty sum). Only `seq_len_kv` is read: a decode has one query.
//! With paged K/V ([`SdpaArgs::with_pages`]) key `t` of sequence `b` is read at slot `t % page_size`
//! of page `table[b][t / page_size]` (the batch strides are then the pools' page strides); the rest is
//! the same.
//!
//! From sm_80 on, head dims 64 and 128 take a tensor-core form of the same kernel: each warp takes
//! tiles of 8 keys, S = QK^T by `mma.m16n8k16` (the group's query heads padded to 16 rows), the
//! online softmax on the accumulator fragments, and O^T += V^T P^T by `mma.m16n8k8`; a tile's keys
//! come through one page-table read when the page size is a multiple of 8.
//!
//! Measured on an H200 (cuDNN 9.19, `examples/06-decode-attention`, Llama-3.1-8B heads, replayed in
//! a CUDA graph, 2026-11-24): the tensor-core form takes 7.0-7.1 us at 545 keys and 10.5-10.7 us at
//! 4096, against 8.4 and 9.1 us for cuDNN's padded graph (the CUDA-core form took 10.9 and 15.9);
//! as plain launches 11.1 and 11.4 us against cuDNN's 22.8 and 23.4. In the whole 8B decode step it
//! gains nothing over cuDNN's graph (4.161 against 4.133 ms), and at batch 64 over 128-4096 keys
//! (`examples/07-paged-decode`) it takes 178 us contiguous and 193-196 us paged against cuDNN's 144
//! and 149-158; so the fused backend takes this kernel only where that graph is not there
//! ([`crate::Exec::set_decode_attention`] forces it, to compare).

use super::{DeviceSeqLens, SdpaArgs, SdpaKernel, SdpaOperands};
use crate::dtype::{DataType, Element};
use crate::exec::DecodeAttention;
use crate::features::Features;
use crate::graph::Mask;
use crate::kernels::{launch_programmatic, optional_ptr, Arg, Kernels, Owned};
use crate::{checked, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Threads of a split CTA (`DECODE_WARPS` warps in `decode.cu`).
const THREADS: u32 = 128;
/// The partial results the split-KV CTAs write and the last CTA of each group reads (f32), owned by
/// the context. Allocated by the first call of a shape, so a CUDA graph captured after one plain call
/// allocates nothing.
const PARTIALS: Owned<f32> = Owned::new("split-KV decode attention partials");
/// Per group, the count of finished CTAs; the group's last CTA sets it back to zero, so the counters
/// are zero between launches (they are zero when allocated).
const COUNTERS: Owned<i32> = Owned::new("split-KV decode attention counters");
/// Most query heads a split CTA holds (the largest `sdpa_decode_*_h*` instance).
const MAX_HEADS: usize = 8;
/// Split CTAs per SM the split count aims for.
const CTAS_PER_SM: usize = 2;
/// Most splits of one (sequence, K/V head, chunk)'s keys (`DECODE_MAX_SPLITS` in `decode.cu`).
const MAX_SPLITS: usize = 64;
/// Fewest keys of the capacity per split, so a short cache is not cut into slivers.
const MIN_KEYS: usize = 32;
/// Most keys of the capacity per split: a large batch, which fills the GPU with one split per
/// sequence, still cuts a long cache, so a few long sequences do not leave the GPU idle behind them.
const MAX_KEYS: usize = 512;
/// Head dims the kernel reads: `d / 8` lanes per key, a power of two up to a warp.
const HEAD_DIMS: [usize; 6] = [8, 16, 32, 64, 128, 256];
/// Head dims of the tensor-core form (`sdpa_decode_mma_*`, compute capability 8.0 and later).
const MMA_HEAD_DIMS: [usize; 2] = [64, 128];

/// How a decode attention is spread over the GPU: fixed per shape and device, not per length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SplitKvLaunch {
    /// Query heads a split CTA holds: the GQA group rounded up to 1, 2, 4 or 8 (a kernel instance each).
    heads: usize,
    /// CTAs per K/V head for its group: `ceil(group / heads)` (1 unless the group exceeds 8 heads).
    chunks: usize,
    /// CTAs over the keys of one (sequence, K/V head, chunk).
    splits: usize,
    /// The tensor-core form (`sdpa_decode_mma_*`): a warp per tile of 8 keys through `mma.sync`,
    /// where the GPU has it (sm_80+) and the head dim is one of [`MMA_HEAD_DIMS`].
    mma: bool,
}

impl SplitKvLaunch {
    /// About [`CTAS_PER_SM`] split CTAs per SM and at least one split per [`MAX_KEYS`] keys of the
    /// capacity, but at most [`MAX_SPLITS`] splits and one per [`MIN_KEYS`] keys.
    fn new(a: &SdpaArgs, sm_count: usize, compute_capability: (i32, i32)) -> Self {
        let group = a.heads_q / a.heads_kv;
        let heads = group.min(MAX_HEADS).next_power_of_two();
        let chunks = group.div_ceil(heads);
        let ctas = a.batch.saturating_mul(a.heads_kv).saturating_mul(chunks);
        let want = (CTAS_PER_SM * sm_count.max(1)).div_ceil(ctas).max(a.seq_kv.div_ceil(MAX_KEYS));
        let splits = want.min(MAX_SPLITS).min(a.seq_kv.div_ceil(MIN_KEYS)).max(1);
        let mma = compute_capability.0 >= 8 && MMA_HEAD_DIMS.contains(&a.head_dim);
        SplitKvLaunch { heads, chunks, splits, mma }
    }

    /// The kernel instance for `sfx` (`bf16` or `f16`).
    fn kernel(&self, a: &SdpaArgs, sfx: &str) -> String {
        if self.mma {
            format!("sdpa_decode_mma_{sfx}_h{}_d{}", self.heads, a.head_dim)
        } else {
            format!("sdpa_decode_{sfx}_h{}", self.heads)
        }
    }

    /// Elements of the f32 partials: the outputs (`rows · d`, rows = `b · h_q · splits`), then a
    /// (max, sum) pair per row; returns where the pairs start and the total.
    fn partials(&self, a: &SdpaArgs) -> Result<(usize, usize)> {
        let what = "sdpa split-KV: partial results";
        let rows = checked::product(what, &[a.batch, a.heads_q, self.splits])?;
        let acc = checked::mul(what, rows, a.head_dim)?;
        Ok((acc, checked::add(what, acc, checked::mul(what, rows, 2)?)?))
    }

    /// CTA groups that combine their splits: `b · h_kv · chunks` (one counter each).
    fn groups(&self, a: &SdpaArgs) -> Result<usize> {
        checked::product("sdpa split-KV: CTA groups", &[a.batch, a.heads_kv, self.chunks])
    }
}

impl SdpaArgs {
    /// Why the split-KV kernel does not take these ([`SdpaArgs::normalized`]) arguments (training mode
    /// when `stats`), `None` where it does.
    pub(super) fn split_kv_refusal(&self, stats: bool) -> Option<String> {
        let a = self.normalized();
        if a.seq_q != 1 {
            return Some(format!("seq_q = {}: it takes one query per sequence", a.seq_q));
        }
        if a.mask != Mask::None {
            return Some(format!(
                "the {} mask (one query sees every key or it is not a decode)",
                a.mask.name()
            ));
        }
        if stats {
            return Some("training stats (it writes no log-sum-exp)".into());
        }
        if !HEAD_DIMS.contains(&a.head_dim) {
            return Some(format!("head_dim {} (it takes {HEAD_DIMS:?})", a.head_dim));
        }
        for (name, strides) in [("Q", &a.q_strides[..2]), ("K", &a.k_strides[..3]), ("V", &a.v_strides[..3])]
        {
            if strides.iter().any(|s| s % 8 != 0) {
                return Some(format!(
                    "{name} strides {strides:?}: its batch, head (and key) strides must be multiples of 8 \
                     elements (16-byte loads)"
                ));
            }
        }
        None
    }
}

impl SdpaArgs {
    /// These arguments of a fused decode attention over a cache with `choice` applied (what the KV
    /// caches and the Llama decoder do with [`crate::Exec::decode_attention`]): the split-KV kernel where it takes them, or cuDNN's
    /// graph where the running cuDNN has the padded (or paged) form; otherwise, or for `Auto` or a
    /// form already asked for, unchanged.
    pub fn with_decode_choice(self, choice: DecodeAttention, features: Features) -> Self {
        if self.form.is_some() {
            return self;
        }
        match choice {
            DecodeAttention::SplitKv if self.split_kv_refusal(false).is_none() => {
                self.with_form(SdpaKernel::SplitKv)
            }
            DecodeAttention::Cudnn => {
                let has = if self.pages.is_some() { features.sdpa_paged() } else { features.sdpa_seq_lens() };
                if has {
                    self.with_form(self.normalized().auto_form(features))
                } else {
                    self
                }
            }
            _ => self,
        }
    }
}

/// Launches the split-KV kernel on `ctx`'s stream (arguments already checked).
pub(super) fn split_kv<T: Element>(ctx: &Cudnn, a: SdpaArgs, x: SdpaOperands<'_, T>) -> Result<()> {
    let refused = |reason: String| Error::NotSupported { op: "sdpa split-KV".into(), reason };
    if let Some(reason) = a.split_kv_refusal(x.stats.is_some()) {
        return Err(refused(reason));
    }
    let sfx = match T::DTYPE {
        DataType::BF16 => "bf16",
        DataType::F16 => "f16",
        other => return Err(refused(format!("{other} I/O (it takes f16 and bf16)"))),
    };
    let info = ctx.info();
    let l = SplitKvLaunch::new(&a, info.sm_count, info.compute_capability);
    let (ml_at, total) = l.partials(&a)?;
    let groups = l.groups(&a)?;
    let ctas = checked::mul("sdpa split-KV: CTAs", groups, l.splits)?;
    let cfg = LaunchConfig {
        grid_dim: (checked::launch_dim("sdpa split-KV: CTAs", ctas)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let SdpaOperands { q, k, v, o, seq_lens, pages, .. } = x;
    let s = ctx.stream();
    let (qp, _gq) = q.device_ptr(s);
    let (kp, _gk) = k.device_ptr(s);
    let (vp, _gv) = v.device_ptr(s);
    for (name, p) in [("Q", qp), ("K", kp), ("V", vp)] {
        if p % 16 != 0 {
            // NotSupported, as the refusals above: KvCache::attend falls back on it.
            return Err(refused(format!("{name} pointer {p:#x} is not 16-byte aligned (16-byte loads)")));
        }
    }
    let clamped;
    let lens: Option<&dyn DevicePtr<i32>> = match seq_lens {
        Some(DeviceSeqLens::Raw(_, kv)) => Some(kv),
        Some(DeviceSeqLens::Clamped(lens)) => {
            clamped = lens.halves(a.batch).1;
            Some(&clamped)
        }
        None => None,
    };
    let (lens, _gl) = optional_ptr(lens, s);
    // Paged K/V: the table's first rows (checked against the arguments by the op), the pools' page
    // stride in the batch-stride slots.
    let table = pages.map(|t| t.rows(0, a.batch));
    let (tp, _gt) = optional_ptr(table.as_ref().map(|t| t as &dyn DevicePtr<i32>), s);
    let (max_pages, page_size, num_pages) = match a.pages {
        Some(p) => (a.seq_kv / p.page_size, p.page_size, p.num_pages),
        None => (0, 1, 0),
    };
    let kernels = Kernels::get(ctx)?;
    let mut part = kernels.owned(ctx, PARTIALS, total)?;
    let mut counters = kernels.owned(ctx, COUNTERS, groups)?;
    let (pp, _gp) = part.device_ptr_mut(s);
    let (cp, _gc) = counters.device_ptr_mut(s);
    let (op, _go) = o.device_ptr_mut(s);
    let i = |v: usize| Arg::I64(v as i64); // every value below is a checked dim, stride or count
    let [q_b, q_h, ..] = a.q_strides;
    let [k_b, k_h, k_s, _] = a.k_strides;
    let [v_b, v_h, v_s, _] = a.v_strides;
    let [o_b, o_h, ..] = a.o_strides;
    let group = a.heads_q / a.heads_kv;
    let args = [
        [Arg::Ptr(qp), Arg::Ptr(kp), Arg::Ptr(vp), i(q_b), i(q_h)].as_slice(),
        &[i(k_b), i(k_h), i(k_s), i(v_b), i(v_h), i(v_s), Arg::Ptr(lens), i(a.seq_kv), i(a.head_dim)],
        &[i(a.heads_kv), i(group), i(l.chunks), i(l.splits), Arg::F32(a.scale() * std::f32::consts::LOG2_E)],
        &[Arg::Ptr(pp), Arg::Ptr(pp + 4 * ml_at as u64), Arg::Ptr(cp), Arg::Ptr(op), i(o_b), i(o_h)],
        &[Arg::Ptr(tp), i(max_pages), i(page_size), i(num_pages)],
    ]
    .concat();
    // Programmatic: the kernel only prefetches before `pdl_wait` (decode.cu).
    launch_programmatic(ctx, kernels, &l.kernel(&a, sfx), cfg, &args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::SdpaForm;
    use crate::ops::sdpa::{Layout, SdpaKernel};
    use crate::Features;

    /// Llama-3.1-8B's decode attention as its model calls it: Q a view into the fused QKV rows, K/V
    /// the cache `[b, max_seq, h_kv · d]`, lengths on the device.
    fn llama_decode(batch: usize, capacity: usize) -> SdpaArgs {
        let (hq, hkv, d) = (32, 8, 128);
        let w = (hq + 2 * hkv) * d;
        let mut a = SdpaArgs::new(batch, hq, hkv, 1, capacity, d, Layout::Bshd).with_seq_lens();
        a.q_strides = [w, d, w, 1];
        let kv = [capacity * hkv * d, d, hkv * d, 1];
        (a.k_strides, a.v_strides) = (kv, kv);
        a
    }

    const HOPPER: (i32, i32) = (9, 0);

    #[test]
    fn splits_fill_the_gpu_and_follow_the_capacity() {
        let a = llama_decode(1, 4096);
        // 8 K/V heads x 33 splits: 264 CTAs, 2 per SM of an H100.
        assert_eq!(
            SplitKvLaunch::new(&a, 132, HOPPER),
            SplitKvLaunch { heads: 4, chunks: 1, splits: 33, mma: true }
        );
        assert_eq!(SplitKvLaunch::new(&llama_decode(3, 4096), 132, HOPPER).splits, 11);
        // A short cache is not cut finer than 32 keys a split; a huge batch takes one split.
        assert_eq!(SplitKvLaunch::new(&llama_decode(1, 642), 132, HOPPER).splits, 21);
        assert_eq!(SplitKvLaunch::new(&llama_decode(1, 20), 132, HOPPER).splits, 1);
        // A large batch fills the GPU with one split each, but a long cache is still cut every 512
        // keys of capacity.
        assert_eq!(SplitKvLaunch::new(&llama_decode(64, 4096), 132, HOPPER).splits, 8);
        assert_eq!(SplitKvLaunch::new(&llama_decode(64, 512), 132, HOPPER).splits, 1);
        assert_eq!(SplitKvLaunch::new(&llama_decode(64, 513), 132, HOPPER).splits, 2);
        // Few K/V heads: at most 64 splits.
        let mqa = SdpaArgs { heads_kv: 1, ..a };
        assert_eq!(
            SplitKvLaunch::new(&mqa, 132, HOPPER),
            SplitKvLaunch { heads: 8, chunks: 4, splits: 64, mma: true }
        );
        let one = SdpaArgs { heads_q: 1, heads_kv: 1, ..a };
        assert_eq!(
            SplitKvLaunch::new(&one, 132, HOPPER),
            SplitKvLaunch { heads: 1, chunks: 1, splits: 64, mma: true }
        );
        // Groups round up to a kernel instance: 3 -> 4, 6 -> 8, 12 -> two chunks of 8.
        for (group, heads, chunks) in [(1, 1, 1), (2, 2, 1), (3, 4, 1), (6, 8, 1), (8, 8, 1), (12, 8, 2)] {
            let g = SdpaArgs { heads_q: 8 * group, ..a };
            let l = SplitKvLaunch::new(&g, 132, HOPPER);
            assert_eq!((l.heads, l.chunks), (heads, chunks), "group {group}");
        }
        // The same launch for every length: it depends on the shape and the device alone.
        assert_eq!(SplitKvLaunch::new(&a, 0, HOPPER).splits, 8);
        let (ml_at, total) = SplitKvLaunch::new(&a, 132, HOPPER).partials(&a).unwrap();
        assert_eq!((ml_at, total), (32 * 33 * 128, 32 * 33 * 130));
        assert_eq!(ml_at % 4, 0, "the (max, sum) pairs start 16-byte aligned");
        // One counter per (sequence, K/V head, chunk): 8 here, 3 x 1 x 4 for a batch-3 MQA.
        assert_eq!(SplitKvLaunch::new(&a, 132, HOPPER).groups(&a).unwrap(), 8);
        let mqa3 = SdpaArgs { batch: 3, ..mqa };
        assert_eq!(SplitKvLaunch::new(&mqa3, 132, HOPPER).groups(&mqa3).unwrap(), 12);
    }

    #[test]
    fn the_tensor_core_form_takes_head_dims_64_and_128_from_sm_80() {
        let a = llama_decode(2, 642);
        let kernel = |a: &SdpaArgs, cc| SplitKvLaunch::new(a, 132, cc).kernel(a, "bf16");
        assert_eq!(kernel(&a, HOPPER), "sdpa_decode_mma_bf16_h4_d128");
        assert_eq!(kernel(&a, (8, 0)), "sdpa_decode_mma_bf16_h4_d128");
        assert_eq!(kernel(&a, (7, 5)), "sdpa_decode_bf16_h4");
        let d64 = SdpaArgs { head_dim: 64, ..a };
        assert_eq!(kernel(&d64, HOPPER), "sdpa_decode_mma_bf16_h4_d64");
        for d in [8, 16, 32, 256] {
            assert_eq!(kernel(&SdpaArgs { head_dim: d, ..a }, HOPPER), "sdpa_decode_bf16_h4", "head_dim {d}");
        }
        let mqa = SdpaArgs { heads_kv: 1, ..a };
        assert_eq!(kernel(&mqa, HOPPER), "sdpa_decode_mma_bf16_h8_d128");
    }

    #[test]
    fn decodes_take_the_split_kv_kernel_and_the_rest_a_graph() {
        let f = Features::for_version(91900, (9, 0));
        let a = llama_decode(1, 4096);
        // Device lengths on cuDNN 9.15+: the padded graph (measured faster); host lengths, or device
        // lengths on an older cuDNN: the split-KV kernel.
        assert_eq!(a.fused_kernel(f, false), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(a.fused_kernel(Features::for_version(91400, (9, 0)), false), SdpaKernel::SplitKv);
        assert_eq!(SdpaArgs { padded: false, ..a }.fused_kernel(f, false), SdpaKernel::SplitKv);
        // A bottom-right mask hides nothing from one query; on any cuDNN, the split-KV kernel runs.
        let masked = a.with_mask(Mask::CausalBottomRight);
        assert_eq!(masked.fused_kernel(Features::for_version(90100, (8, 0)), false), SdpaKernel::SplitKv);
        // A cuDNN form asked for keeps cuDNN (benches compare the two); so does the split-KV kernel.
        let unified = a.with_form(SdpaForm::Unified);
        assert_eq!(unified.fused_kernel(f, false), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(a.with_form(SdpaKernel::SplitKv).fused_kernel(f, false), SdpaKernel::SplitKv);
        // Otherwise the graph the version selects.
        let graph = |b: SdpaArgs, stats| SdpaArgs { padded: false, ..b }.fused_kernel(f, stats);
        assert_eq!(graph(a, true), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(graph(SdpaArgs { seq_q: 2, ..a }, false), SdpaKernel::Graph(SdpaForm::Unified));
        let top_left = a.with_mask(Mask::CausalTopLeft);
        assert_eq!(graph(top_left, false), SdpaKernel::Graph(SdpaForm::Composite));
        assert_eq!(graph(SdpaArgs { head_dim: 96, ..a }, false), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(SdpaKernel::SplitKv.name(), "split-kv");
        assert_eq!(SdpaKernel::from(SdpaForm::Composite).name(), "composite");
    }

    #[test]
    fn the_decode_choice_forces_a_kernel_only_where_it_runs() {
        let (new, old) = (Features::for_version(91900, (9, 0)), Features::for_version(91400, (9, 0)));
        let a = llama_decode(1, 4096);
        let kernel = |b: SdpaArgs, c, f| b.with_decode_choice(c, f).fused_kernel(f, false);
        assert_eq!(kernel(a, DecodeAttention::Auto, new), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(kernel(a, DecodeAttention::Cudnn, new), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(kernel(a, DecodeAttention::SplitKv, new), SdpaKernel::SplitKv);
        // No padded graph before cuDNN 9.15: the kernel whatever is asked.
        assert_eq!(kernel(a, DecodeAttention::Cudnn, old), SdpaKernel::SplitKv);
        // A head dim the kernel does not take stays on cuDNN; a form asked for stays.
        let wide = SdpaArgs { head_dim: 96, q_strides: [48 * 96, 96, 48 * 96, 1], ..a };
        assert_eq!(kernel(wide, DecodeAttention::SplitKv, new), SdpaKernel::Graph(SdpaForm::Unified));
        let forced = a.with_form(SdpaForm::Unified);
        assert_eq!(kernel(forced, DecodeAttention::SplitKv, new), SdpaKernel::Graph(SdpaForm::Unified));
    }

    #[test]
    fn refusals_name_what_the_kernel_does_not_take() {
        let a = llama_decode(2, 642);
        assert_eq!(a.split_kv_refusal(false), None);
        for d in HEAD_DIMS {
            let b = SdpaArgs { head_dim: d, q_strides: [8 * d, d, 8 * d, 1], ..a };
            assert_eq!(b.split_kv_refusal(false), None, "head_dim {d}");
        }
        let cases = [
            (SdpaArgs { head_dim: 96, ..a }, false, "head_dim 96"),
            (SdpaArgs { head_dim: 512, ..a }, false, "head_dim 512"),
            (SdpaArgs { head_dim: 24, ..a }, false, "head_dim 24"),
            (SdpaArgs { seq_q: 4, ..a }, false, "seq_q = 4"),
            (a.with_mask(Mask::CausalTopLeft), false, "the causal mask"),
            (a, true, "training stats"),
            (SdpaArgs { q_strides: [6148, 128, 6148, 1], ..a }, false, "Q strides [6148, 128]"),
            (SdpaArgs { k_strides: [8, 8, 1028, 1], ..a }, false, "K strides [8, 8, 1028]"),
            (SdpaArgs { v_strides: [8, 4, 8, 1], ..a }, false, "V strides"),
        ];
        for (b, stats, expected) in cases {
            let reason = b.split_kv_refusal(stats).unwrap_or_else(|| panic!("{expected}: taken"));
            assert!(reason.contains(expected), "{expected}: {reason}");
        }
        // Q's sequence stride and O's strides do not matter.
        let loose = SdpaArgs { q_strides: [6144, 128, 3, 1], o_strides: [4099, 129, 1, 1], ..a };
        assert_eq!(loose.split_kv_refusal(false), None);
    }
}
