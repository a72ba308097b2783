//! The decoder over a paged KV cache, for continuous batching ([`crate::batching`]): a
//! [`PagedCache`] holds the page pools of every layer and the sequences that come and go; a step
//! begun on it (`begin`: which sequences, how many new tokens each, how many rows the launch has; or
//! `begin_packed`: the prompts of several new sequences back to back, each of its own length) is run
//! by [`Llama::forward_paged`], each sequence at its own positions; a decode step can be captured
//! once per launch size ([`Llama::capture_paged_decode`]) and replayed for any sequences at any
//! lengths ([`Llama::decode_paged`]): positions, lengths and page tables are device values the
//! cache uploads when the step begins.

use super::{next_id, Llama, NoObserver, Observer};
use crate::backends::{Backends, ModuleKind};
use crate::modules::dispatch::Dispatch;
use crate::modules::{Pass, Tokens};
use crate::{Backend, Error, Result};
use cudnn_llm_ops::cudarc::driver::{CudaGraph, CudaSlice, DevicePtrMut};
use cudnn_llm_ops::faults::Zeros;
use cudnn_llm_ops::{check_ids, Cudnn, Element, PageOrder, PageShape, PagedKvCache, PagedKvShape, SeqId};

/// A paged KV cache made for a model ([`Llama::paged_cache`]): cudnn-ops' [`PagedKvCache`] (read
/// through `Deref`: sequences, lengths, free pages, the attention form and its refusal) with an
/// identity, so that a captured step refuses to run on another cache.
pub struct PagedCache<T> {
    inner: PagedKvCache<T>,
    id: u64,
}

impl<T: Element> PagedCache<T> {
    /// A new sequence, holding nothing.
    pub fn add(&mut self) -> SeqId {
        self.inner.add()
    }

    /// Removes sequence `id` and frees its pages ([`PagedKvCache::remove`]).
    pub fn remove(&mut self, id: SeqId) -> Result<()> {
        Ok(self.inner.remove(id)?)
    }

    /// Begins a step of `seq` new tokens for each of `ids` in a launch of `rows` rows
    /// ([`PagedKvCache::begin`]).
    pub fn begin(&mut self, ctx: &Cudnn, ids: &[SeqId], seq: usize, rows: usize) -> Result<()> {
        Ok(self.inner.begin(ctx, ids, seq, rows)?)
    }

    /// Begins a packed step: `lens[i]` new tokens for each of `ids` (holding nothing), back to back in
    /// one row ([`PagedKvCache::begin_packed`]); [`Llama::forward_paged`] takes their ids in that
    /// order.
    pub fn begin_packed(&mut self, ctx: &Cudnn, ids: &[SeqId], lens: &[usize]) -> Result<()> {
        Ok(self.inner.begin_packed(ctx, ids, lens)?)
    }

    /// Counts the step's tokens ([`PagedKvCache::finish`]).
    pub fn finish(&mut self) -> Result<usize> {
        Ok(self.inner.finish()?)
    }

    /// Drops the step begun ([`PagedKvCache::cancel`]).
    pub fn cancel(&mut self) {
        self.inner.cancel();
    }
}

impl<T> std::ops::Deref for PagedCache<T> {
    type Target = PagedKvCache<T>;
    fn deref(&self) -> &PagedKvCache<T> {
        &self.inner
    }
}

/// A decode step of a paged cache captured as a CUDA graph ([`Llama::capture_paged_decode`]) for one
/// launch size (`rows` sequences, fewer padded with rows that write nothing), replayed by
/// [`Llama::decode_paged`] for any sequences at any lengths.
pub struct PagedDecodeGraph<T> {
    graph: CudaGraph,
    logits: CudaSlice<T>,
    rows: usize,
    cache_id: u64,
    acts_id: u64,
    epoch: u64,
}

impl<T> PagedDecodeGraph<T> {
    /// Rows of the launch.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

impl<T> std::fmt::Debug for PagedDecodeGraph<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedDecodeGraph").field("rows", &self.rows).finish_non_exhaustive()
    }
}

impl<T: Element> Llama<T> {
    /// An empty paged cache for this model: per layer a K and a V pool of `num_pages` pages of
    /// `page_size` positions stored in `order`, and a page table of `max_batch` rows (the most
    /// sequences of one step) of enough pages for `max_seq` positions each (rounded up to whole pages;
    /// at most the model's RoPE positions). An [`Error::Tp`] on a tensor-parallel rank (paged steps
    /// run on one GPU).
    pub fn paged_cache(
        &self,
        ctx: &Cudnn,
        max_batch: usize,
        max_seq: usize,
        page_size: usize,
        num_pages: usize,
        order: PageOrder,
    ) -> Result<PagedCache<T>> {
        self.one_gpu()?;
        let c = &self.cfg;
        let pages = PageShape::new(num_pages, page_size, c.kv_heads, c.head_dim, order)?;
        let shape = PagedKvShape::new(c.layers, max_batch, max_seq, pages)?;
        if shape.capacity() > self.rope.positions() {
            return Err(Error::Config(format!(
                "a paged cache of {} positions per sequence ({max_seq} rounded up to pages of {page_size}) \
                 exceeds the {} RoPE positions",
                shape.capacity(),
                self.rope.positions()
            )));
        }
        Ok(PagedCache { inner: PagedKvCache::new(ctx, shape)?, id: next_id() })
    }

    /// Sizes the activation buffers for forwards of up to `rows` tokens now (they only grow), so that
    /// later forwards do not reallocate them: a reallocation makes every captured step stale.
    pub fn reserve(&mut self, ctx: &Cudnn, rows: usize) -> Result<()> {
        if rows == 0 {
            return Err(Error::Config("reserve: 0 rows".into()));
        }
        self.activations(ctx, rows)
    }

    /// Runs the step begun on `cache` (`rows` sequences' rows of `seq` tokens each, `ids` row-major:
    /// row `i`'s tokens are `ids[i·seq..(i+1)·seq]`, rows past the step's sequences any valid ids; a
    /// packed step's sequences' ids back to back, in the order begun)
    /// through the model, appending the new K/V to the cache's pages; returns the buffer whose first
    /// `rows · seq` rows are the output-normed hidden states (for [`Llama::logits_rows`]). The step
    /// stays begun (the caller finishes it).
    pub fn forward_paged(
        &mut self,
        ctx: &Cudnn,
        cache: &mut PagedCache<T>,
        ids: &[u32],
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<&CudaSlice<T>> {
        backends.check_layers(self.cfg.layers)?;
        let (rows, seq) = self.paged_step(cache, "forward_paged")?;
        self.upload_ids(ctx, ids, rows * seq)?;
        self.run_paged(ctx, rows, seq, &mut cache.inner, backends, obs)?;
        Ok(&self.acts.as_ref().expect("allocated by upload_ids").out)
    }

    /// Captures the decode step begun on `cache` (one token per row) and its logits as a CUDA graph
    /// that [`Llama::decode_paged`] replays for later steps of as many rows: the cache's pages, page
    /// table, positions and lengths are read on the device. Run a decode step of as many rows plainly
    /// first, with the same `backends` ([`Llama::forward_paged`] and its logits), so that plans are
    /// built and buffers grown outside the capture. An error (nothing captured) where the step cannot
    /// be replayed at other lengths: RoPE or attention not fused in some layer, or an append or
    /// attention of the step taking host positions or lengths ([`PagedKvCache::step_on_device`]: a
    /// fallback to naive, or the paged form refused, [`PagedKvCache::paged_refusal`]). The graph holds the addresses of the cache, of the model's
    /// activations and of the context's shared buffers: a longer forward or anything that grows the
    /// context's buffers makes it stale ([`Llama::is_current_paged`]).
    ///
    /// # Safety
    ///
    /// As [`Cudnn::capture`]: no other thread uses buffers or streams of `ctx`'s CUDA context while
    /// this runs.
    pub unsafe fn capture_paged_decode(
        &mut self,
        ctx: &Cudnn,
        cache: &mut PagedCache<T>,
        backends: &Backends,
    ) -> Result<PagedDecodeGraph<T>> {
        backends.check_layers(self.cfg.layers)?;
        let (rows, seq) = self.paged_step(cache, "capture_paged_decode")?;
        let refuse = |why: String| Err(Error::Config(format!("capture_paged_decode: {why}")));
        if seq != 1 {
            return refuse(format!("the step begun has {seq} tokens per sequence, a decode step has 1"));
        }
        let acts_id = match self.acts.as_mut() {
            Some(a) if a.rows >= rows => {
                a.last = rows; // the logits below read the step's rows
                a.id
            }
            _ => return refuse("run a decode step of as many rows plainly first".into()),
        };
        let fused = |l| {
            [ModuleKind::Rope, ModuleKind::Gqa].iter().all(|&k| backends.get(Some(l), k) == Backend::Fused)
        };
        if !(0..self.cfg.layers).all(fused) {
            return refuse(
                "RoPE or attention is not fused in every layer (positions would be host values)".into(),
            );
        }
        let mut logits = ctx.stream().zeros::<T>(rows * self.cfg.vocab)?;
        let epoch = ctx.buffer_epoch();
        // SAFETY: the caller's promise (this function's contract is `Cudnn::capture`'s).
        let ((), graph) = unsafe {
            ctx.capture(|| {
                self.run_paged(ctx, rows, 1, &mut cache.inner, backends, &mut NoObserver)?;
                self.head(ctx, 0..rows, backends, &mut NoObserver, &mut logits)
            })
        }?;
        if !cache.step_on_device() {
            let why = match cache.paged_refusal() {
                Some(r) if cache.last_form() == Some(cudnn_llm_ops::PagedForm::Gathered) => {
                    format!("the paged attention was refused: {r}")
                }
                _ => "a fallback to the naive backend".into(),
            };
            return refuse(format!("the step's appends or attention take host positions or lengths ({why})"));
        }
        if ctx.buffer_epoch() != epoch {
            return refuse("a shared buffer grew during the capture; run the step plainly first".into());
        }
        Ok(PagedDecodeGraph { graph, logits, rows, cache_id: cache.id, acts_id, epoch })
    }

    /// Replays a captured decode step for the step begun on `cache` (its rows as many as the graph's),
    /// with `ids` (one per row, rows past the step's sequences any valid id); returns the logits
    /// `[rows, vocab]` (the graph's buffer, rewritten by its next replay). The step stays begun.
    pub fn decode_paged<'g>(
        &mut self,
        ctx: &Cudnn,
        graph: &'g mut PagedDecodeGraph<T>,
        ids: &[u32],
        cache: &mut PagedCache<T>,
    ) -> Result<&'g CudaSlice<T>> {
        let (rows, seq) = self.paged_step(cache, "decode_paged")?;
        if graph.cache_id != cache.id || (rows, seq) != (graph.rows, 1) {
            return Err(Error::Config(format!(
                "decode_paged: the graph was captured for another cache or for {} rows of 1 token; the step \
                 begun has {rows} rows of {seq}",
                graph.rows
            )));
        }
        self.check_current("decode_paged", ctx, graph.acts_id, graph.epoch)?;
        self.upload_ids(ctx, ids, rows)?;
        cudnn_llm_ops::faults::hit(cudnn_llm_ops::faults::Site::Replay)?;
        graph.graph.launch().map_err(cudnn_llm_ops::Error::from)?;
        // The replay records no events: mark the logits written on this stream.
        drop(graph.logits.device_ptr_mut(ctx.stream()));
        Ok(&graph.logits)
    }

    /// False once `graph` is stale: a longer forward reallocated the activations it holds, or the
    /// context's shared buffers grew ([`Cudnn::buffer_epoch`]). Capture again then.
    pub fn is_current_paged(&self, ctx: &Cudnn, graph: &PagedDecodeGraph<T>) -> bool {
        self.holds(ctx, graph.acts_id, graph.epoch)
    }

    /// The step begun on `cache`, checked against the model (on one GPU, of the cache's shapes; `what`
    /// names the call in errors).
    fn paged_step(&self, cache: &PagedCache<T>, what: &str) -> Result<(usize, usize)> {
        self.one_gpu()?;
        let shape = cache.shape();
        let c = &self.cfg;
        if (shape.layers, shape.pages.heads_kv, shape.pages.head_dim) != (c.layers, c.kv_heads, c.head_dim) {
            return Err(Error::Config(format!(
                "{what}: a paged cache of {} layers of {} K/V heads of {} for a model of {} of {} of {}",
                shape.layers, shape.pages.heads_kv, shape.pages.head_dim, c.layers, c.kv_heads, c.head_dim
            )));
        }
        cache.step().ok_or_else(|| Error::Config(format!("{what}: no step begun on the cache")))
    }

    /// Checks `ids` (`n` of them) against the vocabulary, sizes the activations and uploads them.
    fn upload_ids(&mut self, ctx: &Cudnn, ids: &[u32], n: usize) -> Result<()> {
        if ids.len() != n {
            return Err(Error::Config(format!("{} ids for a step of {n} rows", ids.len())));
        }
        check_ids(ids, self.cfg.vocab)?;
        self.activations(ctx, n)?;
        self.chain = None;
        let acts = self.acts.as_mut().expect("allocated above");
        acts.last = n;
        ctx.stream().memcpy_htod(ids, &mut acts.ids.slice_mut(..n)).map_err(cudnn_llm_ops::Error::from)?;
        Ok(())
    }

    /// An [`Error::Tp`] on a tensor-parallel rank: paged steps run on one GPU (they do not sum a
    /// rank's partial results over the ranks).
    fn one_gpu(&self) -> Result<()> {
        match self.comm {
            None => Ok(()),
            Some(_) => Err(Error::Tp(
                "paged caches run on one GPU: a paged step does not sum a tensor-parallel rank's partial \
                 results over the ranks"
                    .into(),
            )),
        }
    }

    /// The forward body over ids already uploaded (launches only, so it can be captured).
    fn run_paged(
        &mut self,
        ctx: &Cudnn,
        rows: usize,
        seq: usize,
        cache: &mut PagedKvCache<T>,
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<()> {
        let tokens = Tokens { batch: rows, seq, start: 0 };
        let dispatch = Dispatch::new(&mut self.fallbacks, backends, obs);
        // Positions come from the cache's device values: the pass's own position state is unused.
        let mut p = Pass::new(ctx, dispatch, tokens, &self.rope, false);
        let acts = self.acts.as_mut().expect("allocated by upload_ids");
        self.embed.forward(&mut p, &acts.ids, acts.x.first_mut())?;
        for block in &self.blocks {
            block.forward_paged(&mut p, &mut acts.x, &mut acts.scratch, cache)?;
        }
        self.norm.forward(&mut p, acts.x.get(), &mut acts.out)
    }
}
