//! Continuous batching: a [`BatchEngine`] owns a [`Llama`], a paged KV cache and a backend
//! selection, and serves many sequences at once, each at its own length, with three calls:
//!
//! * [`BatchEngine::add_many`] takes requests (prompt ids and [`SamplingParams`] each), prefills
//!   them together in one forward (their prompts packed back to back, each attending to its own
//!   tokens through ragged attention, the K/V into pages each gets from the pool), and returns each
//!   one's handle and first new id; [`BatchEngine::add`] is the one-request case (a plain prefill);
//! * [`BatchEngine::step`] runs one decode step for every live sequence together (each one's last id
//!   at its own position) and returns the next id of each;
//! * [`BatchEngine::remove`] ends a sequence (its end-of-sequence id, its budget, a cancelled request)
//!   and gives its pages back, so the next request reuses them.
//!
//! A step of `n` sequences runs as a launch of `bucket` rows, the smallest of
//! [`BatchConfig::buckets`] that holds them (rows past the `n` write nothing). In
//! [`DecodeMode::Graph`] each bucket's decode step is captured once as a CUDA graph (after one plain
//! step of that bucket, which builds its plans) and replayed for any sequences at any lengths: the page
//! table, positions and lengths are device values the cache uploads when a step begins. A graph made
//! stale (a longer prefill reallocated the activations, a shared buffer grew) is captured again; a
//! step that cannot be captured runs plainly and [`BatchEngine::graph_refusal`] says why.
//!
//! Greedy sequences get their next id on the device: after the step's logits, one argmax launch over
//! the rows ([`cudnn_llm_ops::argmax`]) and a copy of one pick word per row, instead of every row's
//! logits; a sampled sequence's row of logits alone is copied to the host and sampled there.
//!
//! Attention reads K and V through the page tables (cuDNN's paged SDPA, 9.15+, or the split-KV kernel
//! before); where that is refused the cache falls back to the contiguous form explicitly and records
//! why ([`BatchEngine::paged_refusal`]).

use crate::backends::Backends;
use crate::generate::DecodeMode;
use crate::model::{Llama, NoObserver, PagedCache, PagedDecodeGraph};
use crate::sampling::{pick_result, Sampler, SamplingParams};
use crate::{Error, Result};
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::faults::Zeros;
use cudnn_llm_ops::{argmax, ArgmaxArgs, ArgmaxOperands, Cudnn, Element, PageOrder, PagedForm, Pick, SeqId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The shape of a [`BatchEngine`]'s cache and launches.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchConfig {
    /// The most sequences live at once (rows of the page table, the largest bucket).
    pub max_batch: usize,
    /// The most positions one sequence holds (prompt and generated ids), rounded up to whole pages.
    pub max_seq: usize,
    /// Positions per page.
    pub page_size: usize,
    /// Pages of each layer's K and V pools.
    pub num_pages: usize,
    /// Storage order inside a page.
    pub order: PageOrder,
    /// Launch sizes of decode steps, ascending, the last `max_batch`: a step of `n` sequences runs
    /// as the smallest bucket `>= n` (one captured graph each in graph mode).
    pub buckets: Vec<usize>,
    /// Rows the activations are sized for up front (the longest prompt expected, at least
    /// `max_batch`), so that prefills up to it do not make captured graphs stale.
    pub reserve_rows: usize,
}

impl BatchConfig {
    /// `max_batch` sequences of up to `max_seq` positions in pages of `page_size`: a pool big enough
    /// for every sequence at full length, head-major pages, buckets 1, 2, 4, ... up to `max_batch`
    /// (and `max_batch` itself), activations for `max_batch` rows.
    pub fn new(max_batch: usize, max_seq: usize, page_size: usize) -> Self {
        let per_seq = max_seq.div_ceil(page_size.max(1));
        let mut buckets: Vec<usize> = std::iter::successors(Some(1usize), |b| b.checked_mul(2))
            .take_while(|&b| b < max_batch)
            .collect();
        buckets.push(max_batch);
        BatchConfig {
            max_batch,
            max_seq,
            page_size,
            num_pages: max_batch.saturating_mul(per_seq),
            order: PageOrder::HeadMajor,
            buckets,
            reserve_rows: max_batch,
        }
    }

    /// The same with a pool of `num_pages` pages per layer's K and V.
    pub fn with_pages(self, num_pages: usize) -> Self {
        BatchConfig { num_pages, ..self }
    }

    /// The same with pages stored in `order`.
    pub fn with_order(self, order: PageOrder) -> Self {
        BatchConfig { order, ..self }
    }

    /// The same with these launch sizes (ascending, the last `max_batch`).
    pub fn with_buckets(self, buckets: Vec<usize>) -> Self {
        BatchConfig { buckets, ..self }
    }

    /// The same with activations sized for `rows` tokens up front.
    pub fn with_reserve_rows(self, rows: usize) -> Self {
        BatchConfig { reserve_rows: rows, ..self }
    }

    /// Checks what the cache does not: the buckets (non-empty, ascending, each > 0, the last
    /// `max_batch`) and the rows reserved (at least `max_batch`).
    pub fn check(&self) -> Result<()> {
        let b = &self.buckets;
        let bad = |why: String| Err(Error::Config(format!("batch config: {why}")));
        if self.max_batch == 0 {
            return bad("max_batch 0".into());
        }
        if b.first() == Some(&0) || b.windows(2).any(|w| w[0] >= w[1]) || b.last() != Some(&self.max_batch) {
            return bad(format!("buckets {b:?} must ascend from 1 or more to max_batch {}", self.max_batch));
        }
        if self.reserve_rows < self.max_batch {
            return bad(format!(
                "reserve_rows {} is less than max_batch {}",
                self.reserve_rows, self.max_batch
            ));
        }
        Ok(())
    }

    /// The bucket a step of `n` sequences runs as (`None` past `max_batch`).
    pub fn bucket(&self, n: usize) -> Option<usize> {
        self.buckets.iter().copied().find(|&b| b >= n)
    }
}

/// One live sequence: its ids (prompt and generated; the last not run yet) and its sampler.
struct Live {
    tokens: Vec<u32>,
    sampler: Sampler,
}

/// Sequences served together over a paged KV cache (see the [module docs](self)).
pub struct BatchEngine<T: Element> {
    model: Llama<T>,
    cache: PagedCache<T>,
    backends: Backends,
    cfg: BatchConfig,
    mode: DecodeMode,
    live: BTreeMap<SeqId, Live>,
    /// Buckets that ran a plain decode step (their plans are built): the next one may capture.
    launched: HashSet<usize>,
    graphs: HashMap<usize, PagedDecodeGraph<T>>,
    /// Why decode steps launch plainly in graph mode, once a capture said so.
    refusal: Option<String>,
    /// The attention form of the last decode step's forward (a replay runs the captured one's).
    decode_form: Option<PagedForm>,
    /// The pick words of a step's greedy rows (`max_batch`, allocated by the first step).
    picks: Option<CudaSlice<u32>>,
    /// Graph captures so far, and how many of them replaced a stale graph.
    captures: GraphCounts,
    /// Where the last decode step's host time went.
    last_step: StepTimes,
}

/// Where a [`BatchEngine::step`]'s wall time went ([`BatchEngine::last_step_times`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct StepTimes {
    /// Host time before the launch: the rows' last ids and the cache's step begun (page table, positions
    /// and lengths built and uploaded).
    pub prepare: std::time::Duration,
    /// The launch to the picks (or sampled rows' logits) on the host: the ids' upload, a capture where
    /// one is made, the replay or plain launch, the argmax and the copies back (their wait on the GPU).
    pub run: std::time::Duration,
    /// After: the step counted, each row's next id made (host sampling of sampled rows).
    pub sample: std::time::Duration,
}

/// How often a [`BatchEngine`] captured decode graphs ([`BatchEngine::graph_counts`]): a serving loop
/// compares the counts before and after its timed part, where a capture is a stall of its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphCounts {
    /// Captures tried (each bucket's first, and every capture again; refused ones included).
    pub captures: usize,
    /// Of those, captures again of a bucket whose graph went stale ([`Llama::is_current_paged`]: a
    /// longer forward reallocated the activations, or the context's shared buffers grew).
    pub stale: usize,
    /// Captures refused (graph mode then launches plainly, [`BatchEngine::graph_refusal`]).
    pub refused: usize,
}

impl<T: Element> BatchEngine<T> {
    /// An engine serving with `model` on `backends`, its cache and launches as `cfg` says; the model
    /// must have RoPE tables for `cfg.max_seq` positions (rounded up to pages).
    pub fn new(ctx: &Cudnn, mut model: Llama<T>, backends: Backends, cfg: BatchConfig) -> Result<Self> {
        cfg.check()?;
        let cache =
            model.paged_cache(ctx, cfg.max_batch, cfg.max_seq, cfg.page_size, cfg.num_pages, cfg.order)?;
        model.reserve(ctx, cfg.reserve_rows)?;
        Ok(BatchEngine {
            model,
            cache,
            backends,
            cfg,
            mode: DecodeMode::default(),
            live: BTreeMap::new(),
            launched: HashSet::new(),
            graphs: HashMap::new(),
            refusal: None,
            decode_form: None,
            picks: None,
            captures: GraphCounts::default(),
            last_step: StepTimes::default(),
        })
    }

    /// The same engine running decode steps in `mode`.
    ///
    /// # Safety
    ///
    /// With [`DecodeMode::Graph`], a step may capture a CUDA graph ([`Llama::capture_paged_decode`]): no
    /// other thread may use buffers or streams of the context's CUDA context during a call of
    /// [`BatchEngine::step`] (the contract of [`Cudnn::capture`]). [`DecodeMode::Launch`] asks
    /// nothing.
    pub unsafe fn with_mode(mut self, mode: DecodeMode) -> Self {
        self.mode = mode;
        self
    }

    /// The model back (to serve it another way); the cache and the captured graphs are freed.
    pub fn into_model(self) -> Llama<T> {
        self.model
    }

    /// The configuration.
    pub fn config(&self) -> &BatchConfig {
        &self.cfg
    }

    /// The model (its config and fallbacks).
    pub fn model(&self) -> &Llama<T> {
        &self.model
    }

    /// The cache (sequences, lengths, free pages, the attention form).
    pub fn cache(&self) -> &PagedCache<T> {
        &self.cache
    }

    /// Live sequences, oldest first.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.live.keys().copied().collect()
    }

    /// Live sequences.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Sequence `id`'s ids: its prompt, then those generated (the last one not run yet).
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.get(id)?.tokens)
    }

    /// Pages free in the pool.
    pub fn free_pages(&self) -> usize {
        self.cache.free_pages()
    }

    /// Pages a sequence of `positions` positions holds.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.cfg.page_size)
    }

    /// Whether decode steps of `bucket` rows replay a captured graph now.
    pub fn replaying(&self, bucket: usize) -> bool {
        self.mode == DecodeMode::Graph && self.graphs.contains_key(&bucket)
    }

    /// Where the last [`BatchEngine::step`]'s wall time went (zero before the first).
    pub fn last_step_times(&self) -> StepTimes {
        self.last_step
    }

    /// Decode graphs captured so far (and captured again as stale, or refused).
    pub fn graph_counts(&self) -> GraphCounts {
        self.captures
    }

    /// Why decode steps launch plainly in [`DecodeMode::Graph`] (a capture's refusal), if they do.
    pub fn graph_refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// Why decode attention does not take the fused choice of paged attention (cuDNN's paged plan
    /// refused: the split-KV kernel reads the pages; both refused: the contiguous fallback), if so.
    pub fn paged_refusal(&self) -> Option<String> {
        self.cache.paged_refusal()
    }

    /// The attention form of the last forward that ran its modules (a prefill, a plain decode step or
    /// a capture; a replay runs what its capture recorded, see [`BatchEngine::decode_form`]).
    pub fn last_form(&self) -> Option<PagedForm> {
        self.cache.last_form()
    }

    /// The attention form of the decode steps: of the last plain step, or of the capture the last
    /// replayed step came from.
    pub fn decode_form(&self) -> Option<PagedForm> {
        self.decode_form
    }

    fn get(&self, id: SeqId) -> Result<&Live> {
        self.live.get(&id).ok_or_else(|| Error::Generate(format!("no live sequence {}", id.get())))
    }

    /// Takes a request: prefills `prompt` alone (its K/V into pages of the pool) and chooses its first
    /// new id with a sampler of `params`; returns the sequence's handle and that id. The one-request
    /// case of [`BatchEngine::add_many`], with its errors.
    pub fn add(&mut self, ctx: &Cudnn, prompt: &[u32], params: SamplingParams) -> Result<(SeqId, u32)> {
        let added = self.add_many(ctx, &[(prompt, params)])?;
        Ok(added[0])
    }

    /// Takes requests: prefills their prompts together in one forward (packed back to back, each
    /// attending to its own tokens: RoPE at each token's own position, the K/V into each one's pages,
    /// ragged causal attention; one request is a plain prefill) and chooses each one's first new id
    /// from the logits of its last prompt token with a sampler of its params; returns each sequence's
    /// handle and that id, in the order given. An error, with nothing kept, for no requests, an empty
    /// prompt, bad ids, a prompt that leaves no room for a decode step, more sequences than
    /// `max_batch` live together, or too few free pages for all of them
    /// ([`cudnn_llm_ops::Error::OutOfPages`] inside [`Error::Ops`]).
    pub fn add_many(
        &mut self,
        ctx: &Cudnn,
        requests: &[(&[u32], SamplingParams)],
    ) -> Result<Vec<(SeqId, u32)>> {
        if requests.is_empty() {
            return Err(Error::Generate("add: no requests".into()));
        }
        for (i, (prompt, _)) in requests.iter().enumerate() {
            if prompt.is_empty() {
                return Err(Error::Generate(format!(
                    "add: request {i} has an empty prompt (give at least one id, e.g. BOS)"
                )));
            }
            if prompt.len() >= self.cache.capacity() {
                return Err(Error::Generate(format!(
                    "add: request {i}'s prompt of {} ids leaves no room for a decode step in {} positions",
                    prompt.len(),
                    self.cache.capacity()
                )));
            }
        }
        if self.live.len() + requests.len() > self.cfg.max_batch {
            return Err(Error::Generate(format!(
                "add: {} sequences live and {} more asked, at most {}",
                self.live.len(),
                requests.len(),
                self.cfg.max_batch
            )));
        }
        let mut samplers =
            requests.iter().map(|(_, params)| Sampler::new(*params)).collect::<Result<Vec<_>>>()?;
        let ids: Vec<SeqId> = requests.iter().map(|_| self.cache.add()).collect();
        let prompts: Vec<&[u32]> = requests.iter().map(|(p, _)| *p).collect();
        let firsts = self.prefill(ctx, &ids, &prompts).and_then(|logits| {
            let vocab = self.model.config().vocab;
            let sampled =
                samplers.iter_mut().enumerate().map(|(i, s)| s.sample(&logits[i * vocab..(i + 1) * vocab]));
            sampled.collect::<Result<Vec<u32>>>()
        });
        let firsts = match firsts {
            Ok(f) => f,
            Err(e) => {
                self.cache.cancel();
                for &id in &ids {
                    self.cache.remove(id)?;
                }
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(ids.len());
        for (((id, prompt), sampler), first) in ids.into_iter().zip(prompts).zip(samplers).zip(firsts) {
            let mut tokens = prompt.to_vec();
            tokens.push(first);
            self.live.insert(id, Live { tokens, sampler });
            out.push((id, first));
        }
        Ok(out)
    }

    /// The prefill of sequences `ids` (holding nothing) with `prompts`, packed in one forward: the
    /// logits of each one's last prompt position, `[ids.len(), vocab]` on the host.
    fn prefill(&mut self, ctx: &Cudnn, ids: &[SeqId], prompts: &[&[u32]]) -> Result<Vec<f32>> {
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        self.cache.begin_packed(ctx, ids, &lens)?;
        let packed: Vec<u32> = prompts.concat();
        self.model.forward_paged(ctx, &mut self.cache, &packed, &self.backends, &mut NoObserver)?;
        let last: Vec<usize> = lens
            .iter()
            .scan(0, |end, &n| {
                *end += n;
                Some(*end - 1)
            })
            .collect();
        let dev = self.model.logits_of(ctx, &last, &self.backends, &mut NoObserver)?;
        self.cache.finish()?;
        to_host(ctx, &dev, ids.len(), self.model.config().vocab)
    }

    /// One decode step for every live sequence: runs each one's last id at its position, and
    /// chooses its next id with its sampler. Returns `(sequence, next id)` for each, oldest first. An
    /// error where a sequence has no room left (remove it first) or the pool has too few free pages
    /// ([`cudnn_llm_ops::Error::OutOfPages`] inside [`Error::Ops`]; nothing ran, remove or wait for a
    /// sequence and step again). A step that fails while it runs (a kernel, a plan, a replay) changes
    /// nothing: no sequence gains an id, the pages it took go back, and the next step carries on.
    pub fn step(&mut self, ctx: &Cudnn) -> Result<Vec<(SeqId, u32)>> {
        let ids = self.sequences();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let at = std::time::Instant::now();
        let n = ids.len();
        let rows = self.cfg.bucket(n).expect("at most max_batch sequences live (add checks)");
        let mut last: Vec<u32> =
            ids.iter().map(|id| *self.live[id].tokens.last().expect("a prompt")).collect();
        last.resize(rows, 0);
        let greedy: Vec<bool> = ids.iter().map(|id| self.live[id].sampler.params().is_greedy()).collect();
        self.cache.begin(ctx, &ids, 1, rows)?;
        let launched = std::time::Instant::now();
        let chosen = match self.decode(ctx, rows, &last, &greedy) {
            Ok(c) => c,
            Err(e) => {
                self.cache.cancel();
                return Err(e);
            }
        };
        let back = std::time::Instant::now();
        self.cache.finish()?;
        let mut out = Vec::with_capacity(n);
        for (id, row) in ids.into_iter().zip(chosen) {
            let live = self.live.get_mut(&id).expect("listed above");
            let next = match row {
                Row::Picked(word) => pick_result(Pick::from_word(word))?,
                Row::Logits(logits) => live.sampler.sample(&logits)?,
            };
            live.tokens.push(next);
            out.push((id, next));
        }
        self.last_step = StepTimes { prepare: launched - at, run: back - launched, sample: back.elapsed() };
        Ok(out)
    }

    /// Runs the step begun (`rows` rows of one id each) and returns what each live row's next id is
    /// chosen from ([`choose`]: a device pick where `greedy` says so, its logits on the host
    /// otherwise). Replays the bucket's graph where graph mode has one (capturing it after the
    /// bucket's first plain step), launches plainly otherwise.
    fn decode(&mut self, ctx: &Cudnn, rows: usize, ids: &[u32], greedy: &[bool]) -> Result<Vec<Row>> {
        let vocab = self.model.config().vocab;
        if self.mode == DecodeMode::Graph && self.refusal.is_none() && self.launched.contains(&rows) {
            if self.graphs.get(&rows).is_some_and(|g| !self.model.is_current_paged(ctx, g)) {
                self.graphs.remove(&rows); // stale: captured again below
                self.captures.stale += 1;
            }
            if !self.graphs.contains_key(&rows) {
                self.captures.captures += 1;
                // SAFETY: graph mode was chosen through `with_mode`, whose caller took on this contract.
                match unsafe { self.model.capture_paged_decode(ctx, &mut self.cache, &self.backends) } {
                    Ok(g) => {
                        self.graphs.insert(rows, g);
                        self.decode_form = self.cache.last_form();
                    }
                    Err(e) => {
                        self.captures.refused += 1;
                        self.refusal = Some(e.to_string());
                    }
                }
            }
            if let Some(graph) = self.graphs.get_mut(&rows) {
                let dev = self.model.decode_paged(ctx, graph, ids, &mut self.cache)?;
                return choose(ctx, dev, vocab, greedy, &mut self.picks);
            }
        }
        self.model.forward_paged(ctx, &mut self.cache, ids, &self.backends, &mut NoObserver)?;
        self.decode_form = self.cache.last_form();
        // Every row's logits, as the captured step computes them (so its plans exist before a capture).
        let dev = self.model.logits_rows(ctx, 0..rows, &self.backends, &mut NoObserver)?;
        self.launched.insert(rows);
        choose(ctx, &dev, vocab, greedy, &mut self.picks)
    }

    /// Ends sequence `id`: gives its pages back and returns its ids (prompt, then every id generated).
    pub fn remove(&mut self, id: SeqId) -> Result<Vec<u32>> {
        self.get(id)?;
        self.cache.remove(id)?;
        Ok(self.live.remove(&id).expect("checked above").tokens)
    }
}

/// What a live row's next id is chosen from.
enum Row {
    /// A greedy row's pick word, made on the device.
    Picked(u32),
    /// A sampled row's logits, on the host.
    Logits(Vec<f32>),
}

/// For each of the first `greedy.len()` rows of `dev` (`vocab` logits each): where `greedy`, its pick
/// word (one argmax launch over those rows into `picks`, grown as needed, then one copy of a word
/// per row); otherwise its logits, copied to the host alone.
fn choose<T: Element>(
    ctx: &Cudnn,
    dev: &CudaSlice<T>,
    vocab: usize,
    greedy: &[bool],
    picks: &mut Option<CudaSlice<u32>>,
) -> Result<Vec<Row>> {
    let n = greedy.len();
    let mut words = Vec::new();
    if greedy.iter().any(|&g| g) {
        if picks.as_ref().is_none_or(|p| p.len() < n) {
            *picks = Some(ctx.stream().zeros::<u32>(n)?);
        }
        let picks = picks.as_mut().expect("allocated above");
        argmax(ctx, ArgmaxArgs::new(n, vocab), ArgmaxOperands::new(dev, picks))?;
        words = ctx.stream().clone_dtoh(&picks.slice(..n)).map_err(cudnn_llm_ops::Error::from)?;
    }
    greedy
        .iter()
        .enumerate()
        .map(|(i, &g)| match g {
            true => Ok(Row::Picked(words[i])),
            false => {
                let row = dev.slice(i * vocab..(i + 1) * vocab);
                let host = ctx.stream().clone_dtoh(&row).map_err(cudnn_llm_ops::Error::from)?;
                Ok(Row::Logits(host.iter().map(|v| v.to_f64() as f32).collect()))
            }
        })
        .collect()
}

/// The first `rows · vocab` logits of `dev` as host `f32`.
fn to_host<T: Element>(
    ctx: &Cudnn,
    dev: &cudnn_llm_ops::cudarc::driver::CudaSlice<T>,
    rows: usize,
    vocab: usize,
) -> Result<Vec<f32>> {
    let host = ctx.stream().clone_dtoh(&dev.slice(..rows * vocab)).map_err(cudnn_llm_ops::Error::from)?;
    Ok(host.iter().map(|v| v.to_f64() as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_pick_buckets_and_are_checked() {
        let c = BatchConfig::new(48, 1000, 16);
        assert_eq!(c.buckets, vec![1, 2, 4, 8, 16, 32, 48]);
        assert_eq!((c.num_pages, c.reserve_rows, c.order), (48 * 63, 48, PageOrder::HeadMajor));
        assert_eq!(
            (c.bucket(1), c.bucket(3), c.bucket(33), c.bucket(48), c.bucket(49)),
            (Some(1), Some(4), Some(48), Some(48), None)
        );
        c.check().unwrap();
        assert_eq!(BatchConfig::new(1, 64, 16).buckets, vec![1]);
        assert_eq!(BatchConfig::new(64, 64, 16).buckets, vec![1, 2, 4, 8, 16, 32, 64]);
        for (bad, expected) in [
            (c.clone().with_buckets(vec![1, 4, 2, 48]), "must ascend"),
            (c.clone().with_buckets(vec![0, 48]), "must ascend"),
            (c.clone().with_buckets(vec![1, 32]), "to max_batch 48"),
            (c.clone().with_buckets(vec![]), "must ascend"),
            (c.clone().with_reserve_rows(8), "reserve_rows 8"),
            (BatchConfig::new(0, 64, 16), "max_batch 0"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        let custom = c.with_pages(10).with_order(PageOrder::TokenMajor).with_reserve_rows(512);
        assert_eq!((custom.num_pages, custom.order, custom.reserve_rows), (10, PageOrder::TokenMajor, 512));
    }
}
