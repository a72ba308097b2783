//! A contiguous KV cache for decoding: per layer, K and V buffers of `[batch, max_seq, h_kv · d]`,
//! per-sequence cached lengths on the host, and the device values a step's kernels read (each
//! sequence's first position, its key and query counts, and those lengths clamped for padded
//! attention).
//!
//! Recipe for one step (prefill or decode) of a decoder:
//! 1. `cache.begin(&ctx, seq)?`: `seq` new tokens per sequence, each sequence written from its own
//!    length on (sequences may be at different positions); uploads the step's positions and lengths.
//! 2. per layer, after the QKV projection: [`KvCache::append_rotated`] (RoPE on Q and K in place, and
//!    the rotated K and the V rows into the cache, one kernel fused) or [`KvCache::append`] (K and V rows
//!    as they are);
//! 3. per layer, [`KvCache::attend`]: the step's queries over the cache, on the one padded launch
//!    (split-KV kernel or cuDNN plan) when it can ([`AttendForm`]);
//! 4. `cache.finish()?`: the step's tokens count.
//!
//! K and V are read in place through strides ([`KvCacheShape::kv_strides`]): row `p` of sequence `b`
//! of a layer's K buffer starts at element `(b · max_seq + p) · h_kv · d`, its head `h` at `+ h · d`.
//!
//! ```no_run
//! use cudnn_llm_ops::cudarc::driver::CudaSlice;
//! use cudnn_llm_ops::half::bf16;
//! use cudnn_llm_ops::{Backend, Cudnn, KvCache, KvCacheShape, QkvRows, RopeFrequencies, RopeTables};
//! # fn main() -> cudnn_llm_ops::Result<()> {
//! let ctx = Cudnn::new(0)?;
//! // One layer of Llama-3.2-1B's attention (32 query heads, 8 K/V heads of 64), 2 sequences of 128.
//! let shape = KvCacheShape::new(1, 2, 128, 8, 64)?;
//! let mut cache = KvCache::<bf16>::new(&ctx, shape)?;
//! let rope = RopeTables::<bf16>::from_frequencies(&ctx, &RopeFrequencies::new(64, 500_000.0)?, 128)?;
//! let rows = QkvRows::packed(32, &shape);
//! // The QKV projection of one new token per sequence, and the attention output.
//! let mut qkv: CudaSlice<bf16> = ctx.stream().alloc_zeros(2 * rows.row_stride)?;
//! let mut o: CudaSlice<bf16> = ctx.stream().alloc_zeros(2 * 32 * 64)?;
//! cache.begin(&ctx, 1)?;
//! cache.append_rotated(&ctx, 0, &rope, rows, qkv.as_view_mut(), Backend::Fused)?;
//! let form = cache.attend(&ctx, 0, rows, qkv.as_view(), o.as_view_mut(), Backend::Fused)?;
//! cache.finish()?;
//! println!("{}: {:?} tokens cached", form.name(), cache.lens());
//! # Ok(())
//! # }
//! ```
//!
//! A decoder that runs its own kernels on the cache (e.g. `cudnn-llm-llama`'s, with RoPE and the append
//! fused into the QKV projection's GEMV, and its decode steps captured as CUDA graphs) begins and
//! finishes steps the same way and reads each layer's buffers and the step's device values through
//! [`KvCache::layer_step`]; [`KvCache::begin_on_device`] begins a one-token step without the host
//! (the device values copied on the device), [`KvCache::begin_on_host`] one whose kernels take the
//! position from the host (nothing uploaded).
//!
//! A paged cache ([`PagedKvCache`], `paged.rs`) keeps K and V in page pools read through a page table,
//! for sequences that come and go (continuous batching); its module docs have its recipe.
//!
//! `examples/downstream_block/` builds a whole Llama-3.2-1B-shaped decoder block on this (and
//! `tests/downstream_block.rs` checks it against an f64 reference on a GPU).

mod attend;
mod book;
mod paged;
mod pages;

pub use attend::AttendForm;
pub use book::{KvCacheShape, QkvRows};
pub use paged::{PagedForm, PagedKvCache, PagedKvShape};
pub use pages::{PageAllocator, SeqId};

use crate::dtype::Element;
use crate::error::ensure;
use crate::faults::Zeros;
use crate::ops::rope::{rope, RopeArgs, RopeOperands, RopeTables};
use crate::ops::rows::{write_cache, CacheWrite, CacheWriteOperands};
use crate::ops::sdpa::SeqLens;
use crate::{Backend, Cudnn, Error, Result};
use book::Lens;
use cudarc::driver::{CudaSlice, CudaViewMut, DevicePtr};
use std::sync::atomic::{AtomicU64, Ordering};

/// Identities of caches ([`KvCache::id`]).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Per-layer K and V caches and the bookkeeping of steps (see the [module docs](self)).
pub struct KvCache<T> {
    shape: KvCacheShape,
    k: Vec<CudaSlice<T>>,
    v: Vec<CudaSlice<T>>,
    lens: Lens,
    /// Per sequence, the first position the step begun writes (its length before the step).
    positions: CudaSlice<i32>,
    /// Per sequence, the keys the step's queries attend to (`len + seq`) and its queries (`seq`).
    kv_lens: CudaSlice<i32>,
    q_lens: CudaSlice<i32>,
    /// `q_lens` and `kv_lens` clamped into `(1, max_seq)` by the step's first padded attention on
    /// cuDNN's plan (the split-KV kernel clamps as it reads).
    seq_lens: SeqLens,
    clamped: bool,
    /// Why padded attention does not run here (the split-KV kernel does not take the shape and cuDNN
    /// is older than 9.15 or refused its padded plan); `None` while it may.
    padded_refusal: Option<String>,
    last_form: Option<AttendForm>,
    /// `[max_seq + 1, batch]`: row `p` is `p` for every sequence, the source of
    /// [`KvCache::begin_on_device`]'s device-to-device copies.
    ramp: CudaSlice<i32>,
    /// The query count `q_lens` holds on the device, when known (a step repeating it skips its upload).
    q_on_device: Option<usize>,
    /// The step begun has its device values (`begin`, `begin_on_device`; not `begin_on_host`).
    uploaded: bool,
    id: u64,
}

/// One layer's K and V buffers and the device values of the step begun, for a decoder that runs its
/// own kernels on the cache ([`KvCache::layer_step`]).
#[non_exhaustive]
pub struct KvLayer<'a, T> {
    /// K `[batch, max_seq, h_kv · d]` (strides in the [module docs](self)).
    pub k: &'a mut CudaSlice<T>,
    /// V, as K.
    pub v: &'a mut CudaSlice<T>,
    /// Rows per sequence.
    pub max_seq: usize,
    /// Per sequence, the keys the step's queries attend to (`len + seq`).
    pub kv_lens: &'a CudaSlice<i32>,
    /// Per sequence, the step's queries (`seq`).
    pub q_lens: &'a CudaSlice<i32>,
    /// Per sequence, the first position the step writes (`len`).
    pub positions: &'a CudaSlice<i32>,
    /// `q_lens` and `kv_lens` clamped into the cache, for padded attention on cuDNN's plan (the
    /// decoder clamps them once per step, [`SeqLens::clamp`]).
    pub seq_lens: &'a mut SeqLens,
}

impl<T: Element> KvCache<T> {
    /// An empty cache of `shape`, zero-filled, on `ctx`'s stream. Takes 16-bit elements (f16, bf16).
    pub fn new(ctx: &Cudnn, shape: KvCacheShape) -> Result<Self> {
        if T::DTYPE.size() != 2 {
            return Err(Error::NotSupported {
                op: "kv cache".into(),
                reason: format!("takes 16-bit elements, not {}", T::DTYPE),
            });
        }
        let KvCacheShape { layers, batch, max_seq, .. } = shape;
        let ramp_len = crate::checked::product("kv cache: ramp", &[max_seq + 1, batch])?;
        let bytes =
            crate::checked::product("kv cache: bytes", &[2, layers, shape.layer_len(), T::DTYPE.size()])?;
        let bytes = crate::checked::add("kv cache: bytes", bytes, 4 * ramp_len)?;
        ctx.ensure_free(bytes, || {
            format!("a KV cache of {layers} layers x {batch} sequences x {max_seq} positions")
        })?;
        let s = ctx.stream();
        // Each value is at most max_seq, which fits i32 (KvCacheShape::new).
        let ramp: Vec<i32> = (0..=max_seq as i32).flat_map(|p| std::iter::repeat_n(p, batch)).collect();
        let ramp = s.clone_htod(&ramp)?;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(s.zeros::<T>(shape.layer_len())?);
            v.push(s.zeros::<T>(shape.layer_len())?);
        }
        Ok(KvCache {
            shape,
            k,
            v,
            lens: Lens::new(batch, max_seq),
            positions: s.zeros::<i32>(batch)?,
            kv_lens: s.zeros::<i32>(batch)?,
            q_lens: s.zeros::<i32>(batch)?,
            seq_lens: SeqLens::new(ctx, batch, 1, max_seq)?,
            clamped: false,
            padded_refusal: None,
            last_form: None,
            ramp,
            q_on_device: None,
            uploaded: false,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Tells this cache from every other of the process: a CUDA graph captured over it holds its
    /// buffers' addresses and checks it before a replay.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Tokens cached per sequence where every sequence holds as many (a decoder of equal-length
    /// sequences), else `None`.
    pub fn uniform_len(&self) -> Option<usize> {
        self.lens.uniform()
    }

    /// True while no sequence holds a token.
    pub fn is_empty(&self) -> bool {
        self.lens.get().iter().all(|&l| l == 0)
    }

    /// Keeps at most `len` tokens of every sequence (e.g. to time one decode step again); drops a step
    /// begun.
    pub fn truncate_to(&mut self, len: usize) {
        self.lens.truncate_each(len);
    }

    /// The shape.
    pub fn shape(&self) -> KvCacheShape {
        self.shape
    }

    /// Tokens cached per sequence (the step begun not counted).
    pub fn lens(&self) -> &[usize] {
        self.lens.get()
    }

    /// New tokens per sequence of the step begun, if one is.
    pub fn step(&self) -> Option<usize> {
        self.lens.step().ok()
    }

    /// Forgets every cached token (the memory is kept) and a step begun.
    pub fn clear(&mut self) {
        self.lens.clear();
    }

    /// Keeps the first `lens[b]` tokens of sequence `b` (at most what it holds), e.g. each prompt's own
    /// length after a prefill padded to the longest; drops a step begun.
    pub fn truncate(&mut self, lens: &[usize]) -> Result<()> {
        self.lens.truncate(lens)
    }

    /// Begins a step of `seq` new tokens per sequence: sequence `b`'s tokens go to positions
    /// `lens()[b]..lens()[b] + seq` (an error, with nothing changed, where one has no room). Uploads
    /// each sequence's first position and its key and query counts on `ctx`'s stream, which the step's
    /// [`append_rotated`](KvCache::append_rotated), [`append`](KvCache::append) and
    /// [`attend`](KvCache::attend) read on the device. A step begun and not finished is dropped.
    pub fn begin(&mut self, ctx: &Cudnn, seq: usize) -> Result<()> {
        // Last step's clamped lengths are stale from here on, whatever happens below; the step counts
        // as begun only once its values are on the device.
        self.clamped = false;
        self.uploaded = false;
        let values = self.lens.values(seq)?;
        let s = ctx.stream();
        s.memcpy_htod(&values.positions, &mut self.positions)?;
        s.memcpy_htod(&values.kv_lens, &mut self.kv_lens)?;
        if self.q_on_device != Some(seq) {
            self.q_on_device = None;
            s.memcpy_htod(&values.q_lens, &mut self.q_lens)?;
            self.q_on_device = Some(seq);
        }
        self.lens.begin(seq)?;
        self.uploaded = true;
        Ok(())
    }

    /// [`begin`](KvCache::begin) of one token per sequence, every sequence at the same length, with the
    /// device values copied on the device from a table the cache keeps: the host never waits for the
    /// stream (a copy from pageable host memory may), so a decoder can enqueue a step ahead of the
    /// one running. An error, with nothing changed, where the lengths differ or the cache is full.
    pub fn begin_on_device(&mut self, ctx: &Cudnn) -> Result<()> {
        self.clamped = false;
        self.uploaded = false;
        let Some(len) = self.lens.uniform() else {
            return Err(Error::invalid("kv cache: begin_on_device needs every sequence at one length"));
        };
        self.lens.values(1)?; // room for the token
        let b = self.shape.batch;
        let row = |p: usize| self.ramp.slice(p * b..(p + 1) * b);
        let s = ctx.stream();
        s.memcpy_dtod(&row(len + 1), &mut self.kv_lens)?;
        s.memcpy_dtod(&row(len), &mut self.positions)?;
        if self.q_on_device != Some(1) {
            self.q_on_device = None;
            s.memcpy_dtod(&row(1), &mut self.q_lens)?;
            self.q_on_device = Some(1);
        }
        self.lens.begin(1)?;
        self.uploaded = true;
        Ok(())
    }

    /// Begins a step of `seq` new tokens per sequence, every sequence at the same length, whose kernels
    /// take that length from the host as the first position (a prefill): nothing is uploaded, the
    /// device values keep the last step's, and this cache's own calls take the host's length too
    /// (attention runs a plan per length). An error, with nothing changed, where the lengths differ
    /// or a sequence has no room.
    pub fn begin_on_host(&mut self, seq: usize) -> Result<()> {
        ensure!(self.lens.uniform().is_some(), "kv cache: begin_on_host needs every sequence at one length");
        self.clamped = false;
        self.uploaded = false;
        self.lens.begin(seq)?;
        Ok(())
    }

    /// Layer `layer`'s K and V buffers and the step's device values, for a decoder's own kernels.
    pub fn layer_step(&mut self, layer: usize) -> Result<KvLayer<'_, T>> {
        self.check_layer(layer)?;
        Ok(KvLayer {
            k: &mut self.k[layer],
            v: &mut self.v[layer],
            max_seq: self.shape.max_seq,
            kv_lens: &self.kv_lens,
            q_lens: &self.q_lens,
            positions: &self.positions,
            seq_lens: &mut self.seq_lens,
        })
    }

    /// Counts the step's tokens in [`lens`](KvCache::lens); returns how many each sequence got.
    pub fn finish(&mut self) -> Result<usize> {
        self.lens.finish()
    }

    /// Layer `layer`'s K and V buffers (`[batch, max_seq, h_kv · d]`; strides in the module docs).
    pub fn layer(&self, layer: usize) -> Result<(&CudaSlice<T>, &CudaSlice<T>)> {
        self.check_layer(layer)?;
        Ok((&self.k[layer], &self.v[layer]))
    }

    /// Layer `layer`'s K and V buffers, to write.
    pub fn layer_mut(&mut self, layer: usize) -> Result<(&mut CudaSlice<T>, &mut CudaSlice<T>)> {
        self.check_layer(layer)?;
        Ok((&mut self.k[layer], &mut self.v[layer]))
    }

    /// Device i32 per sequence: the first position the step begun writes (for RoPE's and
    /// `write_cache`'s device starts).
    pub fn positions(&self) -> &CudaSlice<i32> {
        &self.positions
    }

    /// Why attention here runs a plan per length instead of the one padded launch: the split-KV
    /// kernel does not take the shape, and cuDNN is older than 9.15 or refused its padded graph
    /// (recorded by the first [`attend`](KvCache::attend) it failed).
    pub fn padded_refusal(&self) -> Option<&str> {
        self.padded_refusal.as_deref()
    }

    /// The form the last [`attend`](KvCache::attend) ran.
    pub fn last_form(&self) -> Option<AttendForm> {
        self.last_form
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        ensure!(layer < self.shape.layers, "kv cache: layer {layer} of a {}-layer cache", self.shape.layers);
        Ok(())
    }

    /// RoPE on the step's Q and K heads in place in `qkv` (rows as `rows` says, each sequence's tokens
    /// at its own positions), and the rotated K and the V rows into layer `layer`'s cache. Fused: one
    /// kernel reading the positions on the device; naive: the eager rotation and two row copies, one
    /// call per sequence where their positions differ. An error, with nothing written, where a position
    /// falls outside `tables`.
    pub fn append_rotated(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        tables: &RopeTables<T>,
        rows: QkvRows,
        mut qkv: CudaViewMut<'_, T>,
        backend: Backend,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let seq = self.lens.step()?;
        let KvCacheShape { batch, max_seq, heads_kv, head_dim, .. } = self.shape;
        let args = rows.rope_args(batch, seq, heads_kv, head_dim);
        check_append("kv cache", &args, self.lens.get(), tables, qkv.len())?;
        // And the K and V sources against the caches.
        let write = args.cache_write(max_seq);
        let (k_at, v_at) = (args.heads_q * head_dim, (args.heads_q + heads_kv) * head_dim);
        write.check(qkv.len().saturating_sub(k_at), self.k[layer].len())?;
        write.check(qkv.len().saturating_sub(v_at), self.v[layer].len())?;
        let (k, v) = (&mut self.k[layer], &mut self.v[layer]);
        if backend == Backend::Fused && self.uploaded {
            let x = RopeOperands::new(tables, &mut qkv).append(k, v, max_seq).starts(&self.positions);
            return rope(ctx, args, x, backend);
        }
        if let Some(start) = self.lens.uniform() {
            let x = RopeOperands::new(tables, &mut qkv).append(k, v, max_seq);
            return rope(ctx, RopeArgs { start, ..args }, x, backend);
        }
        let (rows_len, cache_len, qkv_len) =
            (seq * rows.row_stride, max_seq * self.shape.row_width(), qkv.len());
        let range = |b: usize| b * cache_len..(b + 1) * cache_len;
        for (b, &start) in self.lens.get().iter().enumerate() {
            let mut q = within(qkv.try_slice_mut(b * rows_len..qkv_len))?;
            let mut kb = within(k.try_slice_mut(range(b)))?;
            let mut vb = within(v.try_slice_mut(range(b)))?;
            let x = RopeOperands::new(tables, &mut q).append(&mut kb, &mut vb, max_seq);
            rope(ctx, RopeArgs { batch: 1, start, ..args }, x, backend)?;
        }
        Ok(())
    }

    /// The step's K and V rows (`k_rows`, `v_rows`: `batch · seq` rows of `h_kv · d` elements,
    /// `row_stride` apart, e.g. views into a QKV buffer at the K and V heads) into layer `layer`'s cache
    /// at each sequence's positions, as they are (no rotation). One kernel per cache, the same on both
    /// backends.
    pub fn append(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        k_rows: &dyn DevicePtr<T>,
        v_rows: &dyn DevicePtr<T>,
        row_stride: usize,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let seq = self.lens.step()?;
        let KvCacheShape { batch, max_seq, .. } = self.shape;
        let cols = self.shape.row_width();
        let w = CacheWrite { batch, seq, cols, src_stride: row_stride, max_seq, start: 0 };
        w.check(k_rows.len(), self.k[layer].len())?;
        w.check(v_rows.len(), self.v[layer].len())?;
        let (k, v, p) = (&mut self.k[layer], &mut self.v[layer], &self.positions);
        if !self.uploaded {
            // begin_on_host: one length for every sequence, from the host.
            let start = self.lens.uniform().ok_or_else(|| Error::invalid("kv cache: lengths differ"))?;
            let w = CacheWrite { start, ..w };
            write_cache(ctx, w, CacheWriteOperands::new(k_rows, k))?;
            return write_cache(ctx, w, CacheWriteOperands::new(v_rows, v));
        }
        write_cache(ctx, w, CacheWriteOperands::new(k_rows, k).starts(p))?;
        write_cache(ctx, w, CacheWriteOperands::new(v_rows, v).starts(p))
    }
}

/// A sub-view, or an error (never a panic) where its range was outside the buffer (the whole step's
/// checks rule that out).
/// A step's append (`args`, each sequence from its `lens` on), checked as a whole before anything
/// runs (per-sequence calls are its parts): positions up to the longest sequence's `len + seq` within
/// `tables`, Q and K within `qkv_len` elements, and rows wide enough for V. `what` names the cache.
fn check_append<T: Element>(
    what: &str,
    args: &RopeArgs,
    lens: &[usize],
    tables: &RopeTables<T>,
    qkv_len: usize,
) -> Result<()> {
    let end = lens.iter().max().copied().unwrap_or(0) + args.seq;
    ensure!(
        end <= tables.positions(),
        "{what}: positions up to {end} exceed the RoPE tables' {}",
        tables.positions()
    );
    args.check(qkv_len, tables.positions(), tables.head_dim())?;
    args.check_append_rows()
}

pub(crate) fn within<V>(view: Option<V>) -> Result<V> {
    view.ok_or_else(|| Error::invalid("kv cache: a sequence's rows fall outside the buffer"))
}
