//! The decoder on the GPU: embedding, [`LlamaConfig::layers`] decoder layers, output norm and
//! `lm_head`, each module on the backend [`Backends`] gives its kind and layer (the modules themselves,
//! one screen each, are in `src/modules/`):
//!
//! ```text
//! x = embed(tokens)                         # fwd.embed
//! for each layer:
//!     x += attn(attn_norm(x))               # fwd.layer.attn.{prenorm, qkv_proj, rope, gqa, o_proj}
//!     x += mlp(mlp_norm(x))                 # fwd.layer.mlp.{prenorm, mlp}
//! y = output_norm(x)                        # fwd.output_norm
//! logits = lm_head(y)                       # fwd.lm_head (Llama::logits)
//! ```
//!
//! | range | fused | naive |
//! |---|---|---|
//! | `fwd.layer.attn.prenorm`, `fwd.layer.mlp.prenorm`, `fwd.output_norm` | RMSNorm graph | 8 eager kernels |
//! | `fwd.layer.attn.qkv_proj` | matmul graph (the decode GEMV at up to 8 tokens, as for every projection) | cuBLAS GEMM |
//! | `fwd.layer.attn.rope` | 1 kernel (RoPE and the K/V cache append) | 10 eager kernels, 2 row copies |
//! | `fwd.layer.attn.gqa` | SDPA graph (a decode step's first layer also clamps the lengths) | math-path attention |
//! | `fwd.layer.attn.o_proj` | matmul + residual graph | GEMM, add |
//! | `fwd.layer.mlp.mlp` | 3 graphs (SwiGLU, residual epilogues) | 3 GEMMs, silu, mul, add |
//!
//! Q, K and V live in one `[tokens, (h_q + 2·h_kv)·d]` buffer (one GEMM against the concatenated
//! weight, as gpt-fast's `wqkv`); RoPE rotates Q and K there and appends K and V rows to a
//! preallocated cache (one kernel fused), and attention reads Q and the cache through strides. Prefill uses a top-left
//! causal mask; later calls (decode, chunked prefill) attend bottom-right aligned over the cache.
//! Fused decode steps (one new token per sequence) all run one attention plan: the whole cache is its
//! capacity and the lengths are device values (cuDNN 9.15+), so a new cache length builds no plan.
//! A fused module that cuDNN cannot run for a shape runs naive instead; [`Llama::fallbacks`] says
//! which and why, and the shape is not retried.
//!
//! Over a paged KV cache ([`PagedCache`], `model/paged.rs`: [`Llama::forward_paged`],
//! [`Llama::capture_paged_decode`], [`Llama::decode_paged`]) the same modules run with RoPE's K/V
//! append and attention going through cudnn-ops' paged cache, each sequence at its own length: what
//! continuous batching ([`crate::batching`]) drives.
//!
//! A tensor-parallel rank with a copy-engine gather window runs a long single-sequence pass as two
//! halves of its rows interleaved module by module (`model/halves.rs`), so that each half's sums
//! over the ranks travel while the other half computes.

use crate::backends::{Backends, ModuleKind, Site};
use crate::config::LlamaConfig;
use crate::modules::attention::AttnBuffers;
use crate::modules::block::{Block, Scratch};
use crate::modules::dispatch::{Dispatch, Fallbacks};
use crate::modules::embedding::Embedding;
use crate::modules::linear::{Linear, Then};
use crate::modules::mlp::MlpBuffers;
use crate::modules::norm::RmsNorm;
use crate::modules::reduce::{Gather, RankSum};
use crate::modules::residual::Residual;
use crate::modules::{Pass, Tokens};
use crate::nccl::{Comm, WindowBuf};
use crate::weights::{self, Checkpoint, LayerWeights, Tensor, Weights};
use crate::{Backend, Error, Result};
use cudnn_llm_ops::cudarc::driver::{CudaSlice, CudaView, DevicePtrMut};
use cudnn_llm_ops::faults::Zeros;
use cudnn_llm_ops::staging::{Source, DEFAULT_STAGE_BYTES};
use cudnn_llm_ops::WeightScales;
use cudnn_llm_ops::{
    argmax, check_ids, ArgmaxArgs, ArgmaxOperands, Cudnn, Element, KvCacheShape, RopeTables, Uploader,
};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::modules::{
    DecodeFusion, Fallback, NoObserver, Observer, ATTN_ALLREDUCE_RANGE, EMBED_RANGE, MLP_ALLREDUCE_RANGE,
};
pub use cudnn_llm_ops::KvCache;
pub use paged::{PagedCache, PagedDecodeGraph};

mod halves;
mod paged;

/// The range of the all-gather of a tensor-parallel rank's logits (after `fwd.lm_head`).
pub const LM_HEAD_GATHER_RANGE: &str = "fwd.lm_head.allgather";

/// Identities of caches and activation buffers, so that a captured decode graph (which holds their
/// device addresses) refuses to run on others.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Tokens cached per sequence: the decoder runs sequences of one length.
pub(crate) fn cache_len<T: Element>(cache: &KvCache<T>) -> Result<usize> {
    cache.uniform_len().ok_or_else(|| {
        Error::Config(
            "the decoder runs sequences of one length; this cache's sequences hold different counts".into(),
        )
    })
}

/// Activation buffers for `rows` tokens.
struct Activations<T> {
    id: u64,
    rows: usize,
    /// Rows of the last forward.
    last: usize,
    ids: CudaSlice<u32>,
    x: Residual<T>,
    scratch: Scratch<T>,
    out: CudaSlice<T>,
}

impl<T: Element> Activations<T> {
    /// Zeroed buffers for `rows` tokens of `c`'s shapes, x with the symmetric `window` pair if any.
    fn new(ctx: &Cudnn, c: &LlamaConfig, rows: usize, window: Option<[WindowBuf<T>; 2]>) -> Result<Self> {
        let alloc = |n: usize| ctx.stream().zeros::<T>(rows * n);
        Ok(Activations {
            id: next_id(),
            rows,
            last: 0,
            ids: ctx.stream().zeros::<u32>(rows)?,
            x: Residual::new(alloc(c.hidden)?, alloc(c.hidden)?).with_window(window),
            scratch: Scratch {
                h: alloc(c.hidden)?,
                attn: AttnBuffers { qkv: alloc(c.qkv_width())?, o: alloc(c.attn_width())? },
                mlp: MlpBuffers { up: alloc(c.ffn)?, act: alloc(c.ffn)? },
            },
            out: alloc(c.hidden)?,
        })
    }
}

/// One decode step captured as a CUDA graph ([`Llama::capture_decode`], replayed by [`Llama::decode`]);
/// a greedy one ([`Llama::capture_greedy_decode`]) also picks each sequence's next id on the device.
pub struct DecodeGraph<T> {
    graph: cudnn_llm_ops::cudarc::driver::CudaGraph,
    logits: CudaSlice<T>,
    /// A greedy graph's pick words `[batch]` ([`cudnn_llm_ops::Pick`]); its argmax writes the ids into
    /// the model's input ids as well, where [`Llama::decode_next`] runs them.
    picks: Option<CudaSlice<u32>>,
    /// Tells this graph from others ([`Llama::decode_next`] runs the ids its last replay picked).
    serial: u64,
    batch: usize,
    cache_id: u64,
    acts_id: u64,
    /// The context's buffer epoch at capture ([`Cudnn::buffer_epoch`]).
    epoch: u64,
}

impl<T> std::fmt::Debug for DecodeGraph<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph").field("batch", &self.batch).finish_non_exhaustive()
    }
}

impl<T> DecodeGraph<T> {
    /// Kernels one replay launches, and the graph's nodes in all ([`Cudnn::graph_kernels`]).
    pub fn kernels(&self) -> Result<(usize, usize)> {
        Ok(Cudnn::graph_kernels(&self.graph)?)
    }

    /// A greedy graph's pick words `[batch]` as its last replay wrote them (read them with
    /// [`cudnn_llm_ops::Pick::from_word`]); `None` for a graph without the argmax.
    pub fn picks(&self) -> Option<&CudaSlice<u32>> {
        self.picks.as_ref()
    }
}

/// A Llama-3 decoder on one GPU (or one rank's shard of a tensor-parallel one, see [`crate::tp`]).
pub struct Llama<T: Element> {
    cfg: LlamaConfig,
    embed: Embedding<T>,
    blocks: Vec<Block<T>>,
    norm: RmsNorm<T>,
    /// `None`: tied to the embedding table.
    lm_head: Option<Linear<T>>,
    rope: RopeTables<T>,
    acts: Option<Activations<T>>,
    fallbacks: Fallbacks,
    /// Fused decode steps share one attention plan with run-time sequence lengths (cuDNN 9.15+);
    /// false once cuDNN refused it, and decode builds a plan per cache length instead.
    padded_decode: bool,
    /// A tensor-parallel rank's copy-engine gather window for long passes' sums (dropped before the
    /// communicator that owns its memory).
    gather: Option<RefCell<Gather<T>>>,
    /// The second half's buffers of a halved pass (`model/halves.rs`; the first half runs in
    /// `acts`).
    half: Option<Activations<T>>,
    /// Passes run halved so far.
    halved: u64,
    /// A tensor-parallel rank's communicator: layers all-reduce their residual sums and `lm_head`
    /// (the rank's rows of the vocabulary) all-gathers its logits.
    comm: Option<Comm>,
    /// What fused one-token steps fold together.
    decode_fusion: DecodeFusion,
    /// The greedy decode graph whose replay wrote the input ids last (nothing wrote them since):
    /// [`Llama::decode_next`] may replay it on them.
    chain: Option<u64>,
}

impl<T: Element> Llama<T> {
    /// Uploads `weights` (the Q, K and V projections concatenated into one matrix) and RoPE tables for
    /// positions `0..max_positions`.
    pub fn new(ctx: &Cudnn, cfg: &LlamaConfig, weights: &Weights<T>, max_positions: usize) -> Result<Self> {
        cudnn_llm_ops::startup::timed(
            "weights upload",
            || Self::upload_weights(ctx, cfg, weights, max_positions),
            |_| String::new(),
        )
    }

    fn upload_weights(
        ctx: &Cudnn,
        cfg: &LlamaConfig,
        weights: &Weights<T>,
        max_positions: usize,
    ) -> Result<Self> {
        Self::ensure_fits(ctx, cfg, max_positions)?;
        if weights.layers.len() != cfg.layers {
            return Err(Error::Weights(format!(
                "{} layers of weights for a {}-layer config",
                weights.layers.len(),
                cfg.layers
            )));
        }
        let mut up = Uploader::new(ctx, DEFAULT_STAGE_BYTES)?;
        let blocks = weights
            .layers
            .iter()
            .enumerate()
            .map(|(l, w)| Block::new(ctx, &mut up, cfg, l, w.sources(), [true, false]))
            .collect::<Result<_>>()?;
        let (embed, norm) = (&weights.embed as &dyn Source<T>, &weights.norm as &dyn Source<T>);
        let head = weights.lm_head.as_ref().map(|h| h as &dyn Source<T>);
        Self::assemble(ctx, &mut up, cfg, blocks, [embed, norm], head, max_positions, None)
    }

    /// Reads the Hugging Face checkpoint at `path` (as [`Weights::load`] takes it) straight into the
    /// device: every tensor's header is checked first (names, shapes, dtypes; nothing is uploaded on
    /// an error, which is [`Weights::load`]'s), then each tensor is converted from its file's bytes
    /// into the pinned staging buffers as it is uploaded, with no host copy of the model
    /// ([`Llama::new`] of [`Weights::load`] makes one). The same model as that, value for value. An
    /// FP8 checkpoint ([`LlamaConfig::fp8`]) is read as [`Weights::load`] reads it (dequantized on the
    /// host), then uploaded.
    pub fn load(
        ctx: &Cudnn,
        cfg: &LlamaConfig,
        path: &std::path::Path,
        max_positions: usize,
    ) -> Result<Self> {
        Self::ensure_fits(ctx, cfg, max_positions)?;
        if cfg.fp8.is_some() {
            return Self::new(ctx, cfg, &Weights::load(cfg, path)?, max_positions);
        }
        let checkpoint = Checkpoint::open(cfg, path)?;
        cudnn_llm_ops::startup::timed(
            "weights read and upload",
            || Self::upload_checkpoint(ctx, cfg, &checkpoint, max_positions),
            |_| "safetensors, mapped".into(),
        )
    }

    fn upload_checkpoint(
        ctx: &Cudnn,
        cfg: &LlamaConfig,
        checkpoint: &Checkpoint,
        max_positions: usize,
    ) -> Result<Self> {
        let mut up = Uploader::new(ctx, DEFAULT_STAGE_BYTES)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let w = checkpoint.layer(l)?;
            blocks.push(Block::new(
                ctx,
                &mut up,
                cfg,
                l,
                w.each_ref().map(|t| t as &dyn Source<T>),
                [true, false],
            )?);
        }
        let (embed, norm) = (checkpoint.mapped(weights::EMBED)?, checkpoint.mapped(weights::NORM)?);
        let head = if cfg.tie_embeddings { None } else { Some(checkpoint.mapped(weights::LM_HEAD)?) };
        let head = head.as_ref().map(|h| h as &dyn Source<T>);
        Self::assemble(ctx, &mut up, cfg, blocks, [&embed, &norm], head, max_positions, None)
    }

    /// Checks the config (as [`Llama::new`] does) and that its weights and RoPE tables for
    /// `max_positions` positions fit the device's free memory, before any weight is read or made:
    /// [`cudnn_llm_ops::Error::OutOfMemory`] with both sizes otherwise (70B in bf16 on one GPU, say).
    /// Activations and caches are checked when they are allocated.
    pub fn ensure_fits(ctx: &Cudnn, cfg: &LlamaConfig, max_positions: usize) -> Result<()> {
        check_model(cfg, max_positions)?;
        let bytes = model_bytes(cfg, T::DTYPE.size(), cfg.parameters(), max_positions)?;
        ctx.ensure_free(bytes, || {
            format!(
                "{} ({} layers, {} parameters in {}) with RoPE tables",
                cfg.name,
                cfg.layers,
                cfg.parameters(),
                T::DTYPE
            )
        })?;
        Ok(())
    }

    /// One rank's shard of a tensor-parallel model ([`crate::tp`] computes the shapes and slices):
    /// `cfg` holds the rank's shapes (its query and K/V heads, its MLP rows; hidden size and
    /// vocabulary whole), `layer(l)` gives layer `l`'s weights in those shapes (uploaded and dropped
    /// one at a time), `embed` is the whole table, `lm_head` the rank's `[vocab / ranks, hidden]`
    /// rows (`None`, tied to the embedding, on a single rank only). With `comm`, the first rank adds
    /// the residuals and [`Llama::logits`] returns every rank's vocabulary slice in rank order
    /// (`[ranks, rows, vocab / ranks]`, which is `[rows, vocab]` for one row); without it, the model
    /// is [`Llama::new`]'s.
    pub(crate) fn shard(
        ctx: &Cudnn,
        cfg: &LlamaConfig,
        layer: &mut dyn FnMut(usize) -> Result<LayerWeights<T>>,
        [embed, norm]: [&Tensor<T>; 2],
        lm_head: Option<&Tensor<T>>,
        max_positions: usize,
        comm: Option<Comm>,
    ) -> Result<Self> {
        check_model(cfg, max_positions)?;
        // The rank's parameters: its layers' shards, the whole embedding and its lm_head rows.
        let untied_head = if cfg.tie_embeddings { 0 } else { cfg.vocab.saturating_mul(cfg.hidden) };
        let params = cfg.parameters().saturating_sub(untied_head) + lm_head.map_or(0, |h| h.data.len());
        let bytes = model_bytes(cfg, T::DTYPE.size(), params, max_positions)?;
        ctx.ensure_free(bytes, || {
            format!("a rank's shard of {} ({params} parameters in {})", cfg.name, T::DTYPE)
        })?;
        if comm.is_some() && lm_head.is_none() {
            return Err(Error::Tp("a rank of several needs its own lm_head rows".into()));
        }
        let first = comm.as_ref().is_none_or(|c| c.rank() == 0);
        let mut up = Uploader::new(ctx, DEFAULT_STAGE_BYTES)?;
        let blocks = (0..cfg.layers)
            .map(|l| Block::new(ctx, &mut up, cfg, l, layer(l)?.sources(), [first, comm.is_some()]))
            .collect::<Result<_>>()?;
        let head = lm_head.map(|h| h as &dyn Source<T>);
        Self::assemble(ctx, &mut up, cfg, blocks, [embed, norm], head, max_positions, comm)
    }

    /// Row chunks whose sums over the ranks the copy engines gathered so far (a tensor-parallel
    /// rank's long passes; see [`crate::tp::TpOptions::gather_rows`]).
    pub fn chunks_gathered(&self) -> u64 {
        self.gather.as_ref().map_or(0, |g| g.borrow().chunks_gathered())
    }

    /// Passes run as two interleaved halves so far (a tensor-parallel rank's long single-sequence
    /// passes; see [`crate::tp::TpOptions::gather_rows`]).
    pub fn passes_halved(&self) -> u64 {
        self.halved
    }

    /// A tensor-parallel rank's communicator (`None` on a model of one GPU).
    pub fn comm(&self) -> Option<&Comm> {
        self.comm.as_ref()
    }

    /// The model around uploaded `blocks`: uploads the embedding, output norm and `lm_head` (`None`:
    /// tied), and RoPE tables for positions `0..max_positions`.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        ctx: &Cudnn,
        uploader: &mut Uploader,
        cfg: &LlamaConfig,
        blocks: Vec<Block<T>>,
        [embed, norm]: [&dyn Source<T>; 2],
        lm_head: Option<&dyn Source<T>>,
        max_positions: usize,
        comm: Option<Comm>,
    ) -> Result<Self> {
        let mut up = |t: &dyn Source<T>| uploader.upload_from(ctx, &[t]);
        let head_rows = cfg.vocab / comm.as_ref().map_or(1, Comm::ranks);
        let eps = cfg.rms_eps as f32;
        let gather = match &comm {
            Some(c) => Gather::new(ctx, c, cfg.hidden)?.map(RefCell::new),
            None => None,
        };
        Ok(Llama {
            cfg: cfg.clone(),
            embed: Embedding::new(up(embed)?, cfg.vocab, cfg.hidden),
            blocks,
            norm: RmsNorm::new(up(norm)?, cfg.hidden, eps, Site::OUTPUT_NORM, None),
            lm_head: lm_head
                .map(|w| Ok::<_, Error>(Linear::new(up(w)?, cfg.hidden, head_rows)))
                .transpose()?,
            rope: RopeTables::from_frequencies(ctx, &crate::rope::frequencies(cfg)?, max_positions)?,
            acts: None,
            fallbacks: Fallbacks::default(),
            padded_decode: ctx.features().sdpa_seq_lens(),
            gather,
            half: None,
            halved: 0,
            comm,
            decode_fusion: DecodeFusion::default(),
            chain: None,
        })
    }

    /// Quantizes every layer's projection weights (Q/K/V, O, gate, up, down) to FP8 E4M3 on the
    /// device, with one dequantization factor per output channel ([`WeightScales::PerChannel`]) or
    /// one per weight ([`WeightScales::PerTensor`]), and frees their 16-bit copies; the embedding,
    /// `lm_head` and the norms stay in the model's dtype. From then on a fused decode step streams the
    /// codes (the decode GEMV in every form: half the weight bytes of bf16); a fused longer pass
    /// quantizes each projection's input on the device, per token for per-channel weights, per
    /// tensor for per-tensor ones (scalar factors on both operands reach cuDNN's fastest FP8 engine,
    /// at the accuracy of one scale per tensor), and runs one FP8 cuDNN graph; the naive backend
    /// dequantizes the weight then runs cuBLAS. Decode graphs captured before are stale (capture
    /// again). Quantizing twice does nothing; a failure (out of memory) leaves each layer whole, in
    /// bf16 or in FP8.
    pub fn quantize_to_fp8(&mut self, ctx: &Cudnn, scales: WeightScales) -> Result<()> {
        // Graphs captured over the old weights must not replay, even if a layer fails below: new
        // activations, new graphs.
        self.acts = None;
        self.half = None;
        self.chain = None;
        for block in &mut self.blocks {
            block.quantize_to_fp8(ctx, scales)?;
        }
        Ok(())
    }

    /// Bytes of the layers' projection weights on the device (FP8 codes and factors after
    /// [`Llama::quantize_to_fp8`]).
    pub fn linear_weight_bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.linear_bytes()).sum()
    }

    /// What fused one-token steps fold together from now on ([`DecodeFusion::ALL`] unless set): a
    /// decode graph captured before keeps what it captured.
    pub fn set_decode_fusion(&mut self, fusion: DecodeFusion) {
        self.decode_fusion = fusion;
    }

    /// What fused one-token steps fold together.
    pub fn decode_fusion(&self) -> DecodeFusion {
        self.decode_fusion
    }

    /// The configuration (a tensor-parallel rank's shapes on a rank, see [`crate::tp::ShardPlan::local`]).
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Fused modules that ran naive, with the reason (each module, layer and shape once).
    pub fn fallbacks(&self) -> &[Fallback] {
        &self.fallbacks.list
    }

    /// An empty cache for `batch` sequences of up to `max_seq` tokens.
    pub fn cache(&self, ctx: &Cudnn, batch: usize, max_seq: usize) -> Result<KvCache<T>> {
        if max_seq > self.rope.positions() {
            return Err(Error::Config(format!(
                "a cache of {max_seq} exceeds the {} RoPE positions",
                self.rope.positions()
            )));
        }
        let c = &self.cfg;
        let shape = KvCacheShape::new(c.layers, batch, max_seq, c.kv_heads, c.head_dim)?;
        Ok(KvCache::new(ctx, shape)?)
    }

    fn activations(&mut self, ctx: &Cudnn, rows: usize) -> Result<()> {
        if self.acts.as_ref().is_some_and(|a| a.rows >= rows) {
            return Ok(());
        }
        let c = &self.cfg;
        // A rank's decode-sized passes keep x in its communicator's symmetric window, as many rows
        // as half of it holds (at most `rows`).
        let window = self.comm.as_ref().and_then(|comm| {
            let fits = (crate::nccl::WINDOW_BYTES / 2 / std::mem::size_of::<T>() / c.hidden).min(rows);
            (fits > 0).then(|| comm.window_pair::<T>(ctx.stream(), fits * c.hidden)).flatten()
        });
        self.acts = Some(Activations::new(ctx, c, rows, window)?);
        Ok(())
    }

    /// Runs the next `tokens` of every sequence (equal counts) through the model, appending their K/V
    /// to `cache`, and returns the buffer whose first `batch · seq` rows are the output-normed hidden
    /// states (`[rows, hidden]`; valid until the next call, longer than that after a longer call).
    /// `backends` naming a layer past the model's last is an [`Error::Backends`].
    pub fn forward(
        &mut self,
        ctx: &Cudnn,
        tokens: &[Vec<u32>],
        cache: &mut KvCache<T>,
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<&CudaSlice<T>> {
        backends.check_layers(self.cfg.layers)?;
        let (batch, seq) = self.upload(ctx, tokens, cache, false)?;
        self.run(ctx, batch, seq, cache, backends, obs)?;
        Ok(&self.acts.as_ref().expect("allocated by upload").out)
    }

    /// Captures one decode step (one token per sequence) and its logits as a CUDA graph that
    /// [`Llama::decode`] replays at every later position: fused RoPE with its K/V append and attention
    /// read the position and lengths on the device. Run a fused decode step and its logits with the
    /// same `backends` first, so that plans are built and kernels loaded outside the capture. It is an
    /// error when the step cannot be replayed at another position: RoPE or attention not fused in some
    /// layer (or fallen back to naive), or a cuDNN without run-time sequence lengths (< 9.15). The
    /// graph holds the addresses of `cache`, of the model's activation buffers and of the context's
    /// shared buffers; `decode` refuses another cache, another context, and a graph made stale by a
    /// longer forward or by anything that grew the context's workspace or cleared its plans
    /// ([`Cudnn::buffer_epoch`]).
    ///
    /// # Safety
    ///
    /// As [`Cudnn::capture`]: no other thread uses buffers or streams of `ctx`'s CUDA context while
    /// this runs.
    pub unsafe fn capture_decode(
        &mut self,
        ctx: &Cudnn,
        cache: &mut KvCache<T>,
        backends: &Backends,
    ) -> Result<DecodeGraph<T>> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.capture_decode_picking(ctx, cache, backends, false) }
    }

    /// [`Llama::capture_decode`] with greedy decoding inside the graph: after the logits, the argmax
    /// of each sequence's row ([`cudnn_llm_ops::argmax`]) writes its pick word
    /// ([`DecodeGraph::picks`]) and its id into the model's input ids, so [`Llama::decode_next`] can
    /// replay the next step without the host choosing (or even reading) the id. Same conditions and
    /// errors as [`Llama::capture_decode`] (the argmax kernel is loaded outside the capture first).
    ///
    /// # Safety
    ///
    /// As [`Cudnn::capture`]: no other thread uses buffers or streams of `ctx`'s CUDA context while
    /// this runs.
    pub unsafe fn capture_greedy_decode(
        &mut self,
        ctx: &Cudnn,
        cache: &mut KvCache<T>,
        backends: &Backends,
    ) -> Result<DecodeGraph<T>> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.capture_decode_picking(ctx, cache, backends, true) }
    }

    /// [`Llama::capture_decode`], with the argmax when `greedy`.
    ///
    /// # Safety
    ///
    /// As [`Cudnn::capture`].
    unsafe fn capture_decode_picking(
        &mut self,
        ctx: &Cudnn,
        cache: &mut KvCache<T>,
        backends: &Backends,
        greedy: bool,
    ) -> Result<DecodeGraph<T>> {
        backends.check_layers(self.cfg.layers)?;
        let (len, shape) = (cache_len(cache)?, cache.shape());
        if len == 0 || len >= shape.max_seq {
            return Err(Error::Config(format!(
                "capture_decode: needs a cache holding a prefill with room for a token (holds {len} of {})",
                shape.max_seq
            )));
        }
        let acts_id = match &self.acts {
            Some(a) if a.rows >= shape.batch => a.id,
            _ => return Err(Error::Config("capture_decode: run a forward first".into())),
        };
        let host_positions = || {
            Error::Config(
                "capture_decode: this step takes its position from the host (RoPE or attention not fused \
                 in every layer, a fallback, or cuDNN < 9.15): run decode steps with forward instead"
                    .into(),
            )
        };
        let fused = |l| {
            [ModuleKind::Rope, ModuleKind::Gqa].iter().all(|&k| backends.get(Some(l), k) == Backend::Fused)
        };
        if !self.padded_decode || !(0..self.cfg.layers).all(fused) {
            return Err(host_positions());
        }
        let mut logits = ctx.stream().zeros::<T>(shape.batch * self.cfg.vocab)?;
        let mut picks = match greedy {
            true => {
                let mut picks = ctx.stream().zeros::<u32>(shape.batch)?;
                // Loads the kernel outside the capture: the picks of the zeroed logits, all id 0.
                argmax(ctx, ArgmaxArgs::new(1, 1), ArgmaxOperands::new(&logits, &mut picks))?;
                Some(picks)
            }
            false => None,
        };
        let (batch, vocab) = (shape.batch, self.cfg.vocab);
        let epoch = ctx.buffer_epoch();
        // The step the capture records: its device values are uploaded before each replay.
        cache.begin_on_host(1)?;
        // SAFETY: the caller's promise (this function's contract is `Cudnn::capture`'s).
        let (baked, graph) = unsafe {
            ctx.capture(|| {
                let baked = self.run(ctx, batch, 1, cache, backends, &mut NoObserver)?;
                cache.truncate_to(len); // nothing ran: the capture only recorded the step
                self.head(ctx, 0..batch, backends, &mut NoObserver, &mut logits)?;
                if let Some(picks) = picks.as_mut() {
                    let acts = self.acts.as_mut().expect("checked above");
                    let x = ArgmaxOperands::new(&logits, picks).ids(&mut acts.ids);
                    argmax(ctx, ArgmaxArgs::new(batch, vocab), x)?;
                }
                Ok::<_, Error>(baked)
            })
        }?;
        if baked {
            return Err(host_positions());
        }
        if ctx.buffer_epoch() != epoch {
            // A buffer grew inside the capture: the graph would own a capture-time allocation.
            return Err(Error::Config(
                "capture_decode: a shared buffer grew during the capture; run the step (and its logits) \
                 plainly first"
                    .into(),
            ));
        }
        let serial = next_id();
        Ok(DecodeGraph {
            graph,
            logits,
            picks,
            serial,
            batch: shape.batch,
            cache_id: cache.id(),
            acts_id,
            epoch,
        })
    }

    /// Replays a captured decode step for `tokens` (one per sequence) at the cache's current length,
    /// appending to `cache`; returns the new tokens' logits `[batch, vocab]` (the graph's buffer,
    /// rewritten by the next replay). The output-normed hidden states are where [`Llama::forward`]
    /// leaves them, and [`Llama::logits`] works after it as after a forward of one token.
    pub fn decode<'g>(
        &mut self,
        ctx: &Cudnn,
        graph: &'g mut DecodeGraph<T>,
        tokens: &[u32],
        cache: &mut KvCache<T>,
    ) -> Result<&'g CudaSlice<T>> {
        if graph.cache_id != cache.id() || graph.batch != tokens.len() {
            return Err(Error::Config(format!(
                "decode: the graph was captured for another cache or batch ({} sequences, {} tokens given)",
                graph.batch,
                tokens.len()
            )));
        }
        self.check_current("decode", ctx, graph.acts_id, graph.epoch)?;
        if cache.is_empty() {
            return Err(Error::Config("decode: the cache holds no prefill".into()));
        }
        let step: Vec<Vec<u32>> = tokens.iter().map(|&t| vec![t]).collect();
        // The graph reads the step's device values whatever the model's padded-decode state is now.
        self.upload(ctx, &step, cache, true)?;
        self.replay(ctx, graph, cache)?;
        Ok(&graph.logits)
    }

    /// Replays a greedy decode graph ([`Llama::capture_greedy_decode`]) on the ids its last replay
    /// picked (in the model's input ids), at the cache's current length, appending to `cache`: the
    /// host enqueues the step without knowing the ids. Returns the new pick words `[batch]` (the
    /// graph's buffer, rewritten by its next replay; the logits are [`Llama::decode`]'s). An error,
    /// with nothing run, unless the graph is greedy and the last call that wrote the input ids was
    /// [`Llama::decode`] or [`Llama::decode_next`] with this graph, or when the cache is full. A
    /// pick that is not an id ([`cudnn_llm_ops::Pick`]) still feeds some valid id to the next step:
    /// the host reading the words decides what to keep.
    pub fn decode_next<'g>(
        &mut self,
        ctx: &Cudnn,
        graph: &'g mut DecodeGraph<T>,
        cache: &mut KvCache<T>,
    ) -> Result<&'g CudaSlice<u32>> {
        if graph.picks.is_none() || self.chain != Some(graph.serial) {
            return Err(Error::Config(
                "decode_next: the input ids are not this greedy graph's picks (replay it with decode first)"
                    .into(),
            ));
        }
        if graph.cache_id != cache.id() {
            return Err(Error::Config("decode_next: the graph was captured for another cache".into()));
        }
        self.check_current("decode_next", ctx, graph.acts_id, graph.epoch)?;
        let (len, max_seq) = (cache_len(cache)?, cache.shape().max_seq);
        if len == 0 || len >= max_seq {
            return Err(Error::Config(format!(
                "decode_next: needs a cache holding a prefill with room for a token (holds {len} of {max_seq})"
            )));
        }
        // The host never waits for the stream here: the step is enqueued ahead of the one running.
        cache.begin_on_device(ctx)?;
        self.replay(ctx, graph, cache)?;
        Ok(graph.picks.as_ref().expect("checked above"))
    }

    /// Launches `graph` (ids and positions uploaded) and counts its token in `cache`.
    fn replay(&mut self, ctx: &Cudnn, graph: &mut DecodeGraph<T>, cache: &mut KvCache<T>) -> Result<()> {
        cudnn_llm_ops::faults::hit(cudnn_llm_ops::faults::Site::Replay)?;
        graph.graph.launch().map_err(cudnn_llm_ops::Error::from)?;
        // The replay records no events: mark what it writes as written on this stream, so another
        // stream that reads them is ordered after the replay.
        drop(graph.logits.device_ptr_mut(ctx.stream()));
        if let Some(picks) = graph.picks.as_mut() {
            drop(picks.device_ptr_mut(ctx.stream()));
            drop(self.acts.as_mut().expect("checked by the caller").ids.device_ptr_mut(ctx.stream()));
        }
        self.chain = graph.picks.as_ref().map(|_| graph.serial);
        cache.finish()?;
        // Last, so that the bookkeeping above holds whatever this returns: the launch ran.
        if let Some(comm) = &self.comm {
            comm.graph_launched(ctx.stream())?;
        }
        Ok(())
    }

    /// False once `graph` is stale: a longer forward reallocated the activations it holds, or the
    /// context's shared buffers grew ([`Cudnn::buffer_epoch`]). Capture again then.
    pub fn is_current(&self, ctx: &Cudnn, graph: &DecodeGraph<T>) -> bool {
        self.holds(ctx, graph.acts_id, graph.epoch)
    }

    /// Whether a graph captured with activations `acts_id` at buffer epoch `epoch` still holds the
    /// model's and the context's buffers.
    fn holds(&self, ctx: &Cudnn, acts_id: u64, epoch: u64) -> bool {
        self.acts.as_ref().map(|a| a.id) == Some(acts_id) && ctx.buffer_epoch() == epoch
    }

    /// [`Llama::holds`], else an error saying to capture again (`what` names the call).
    fn check_current(&self, what: &str, ctx: &Cudnn, acts_id: u64, epoch: u64) -> Result<()> {
        if self.holds(ctx, acts_id, epoch) {
            return Ok(());
        }
        Err(Error::Config(format!(
            "{what}: a longer forward (or a larger op on this context) reallocated buffers the graph holds \
             since the capture; capture again"
        )))
    }

    /// Captures the forward of `tokens` as a CUDA graph (run [`Llama::forward`] with the same shapes
    /// and backends first, so that plans are built, autotuned and kernels loaded outside the capture).
    /// Replaying the graph recomputes the same positions (the cache rows are rewritten); `cache`
    /// counts the tokens once. The graph holds the activation buffers' addresses: a later forward with
    /// more tokens than any before reallocates them and invalidates the graph.
    ///
    /// # Safety
    ///
    /// As [`Cudnn::capture`]: no other thread uses buffers or streams of `ctx`'s CUDA context while
    /// this runs. An [`Error::Tp`] on a tensor-parallel rank, whose graphs must tell the
    /// communicator of each launch ([`Comm::graph_launched`]): capture its decode steps with
    /// [`Llama::capture_decode`], whose replays do.
    pub unsafe fn capture(
        &mut self,
        ctx: &Cudnn,
        tokens: &[Vec<u32>],
        cache: &mut KvCache<T>,
        backends: &Backends,
    ) -> Result<cudnn_llm_ops::cudarc::driver::CudaGraph> {
        if self.comm.is_some() {
            return Err(Error::Tp(
                "capture: a tensor-parallel rank captures its decode steps (capture_decode), whose replays \
                 tell its communicator of each launch"
                    .into(),
            ));
        }
        backends.check_layers(self.cfg.layers)?;
        let (batch, seq) = self.upload(ctx, tokens, cache, false)?;
        // SAFETY: the caller's promise (this function's contract is `Cudnn::capture`'s).
        let ((), graph) =
            unsafe { ctx.capture(|| self.run(ctx, batch, seq, cache, backends, &mut NoObserver).map(drop)) }?;
        Ok(graph)
    }

    /// Checks the tokens against the cache and vocabulary, sizes the activations, uploads the ids and
    /// begins the cache's step: with its device values for a decode step that reads them (a padded
    /// one, or any with `device_values`), else with the position from the host.
    fn upload(
        &mut self,
        ctx: &Cudnn,
        tokens: &[Vec<u32>],
        cache: &mut KvCache<T>,
        device_values: bool,
    ) -> Result<(usize, usize)> {
        let batch = tokens.len();
        let seq = tokens.first().map_or(0, Vec::len);
        if batch == 0 || seq == 0 || tokens.iter().any(|t| t.len() != seq) {
            return Err(Error::Config(
                "forward: give one or more sequences of equal, non-zero length".into(),
            ));
        }
        let (len, shape) = (cache_len(cache)?, cache.shape());
        if batch != shape.batch || len + seq > shape.max_seq {
            return Err(Error::Config(format!(
                "forward: {batch} x {seq} tokens do not fit a cache of {} x {} holding {len}",
                shape.batch, shape.max_seq
            )));
        }
        let ids: Vec<u32> = tokens.iter().flatten().copied().collect();
        check_ids(&ids, self.cfg.vocab)?;
        let c = &self.cfg;
        if (shape.layers, shape.heads_kv, shape.head_dim) != (c.layers, c.kv_heads, c.head_dim) {
            return Err(Error::Config(format!(
                "forward: a cache of {} layers of {} K/V heads of {} for a model of {} layers of {} of {}",
                shape.layers, shape.heads_kv, shape.head_dim, c.layers, c.kv_heads, c.head_dim
            )));
        }
        self.activations(ctx, batch * seq)?;
        self.chain = None;
        let acts = self.acts.as_mut().expect("allocated above");
        acts.last = batch * seq;
        ctx.stream()
            .memcpy_htod(&ids, &mut acts.ids.slice_mut(..ids.len()))
            .map_err(cudnn_llm_ops::Error::from)?;
        if seq == 1 && len > 0 && (device_values || self.padded_decode) {
            cache.begin(ctx, 1)?;
        } else {
            cache.begin_on_host(seq)?;
        }
        Ok((batch, seq))
    }

    /// The forward body over ids already uploaded: only kernel launches and cuDNN/cuBLAS calls, so it
    /// can be captured. Returns true when some launch took the cache position as a host value (a
    /// captured graph of it replays that position only); fused decode steps on the padded attention
    /// plan read every position on the device.
    fn run(
        &mut self,
        ctx: &Cudnn,
        batch: usize,
        seq: usize,
        cache: &mut KvCache<T>,
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<bool> {
        let tokens = Tokens { batch, seq, start: cache_len(cache)? };
        if let Some(baked) = self.run_halves(ctx, tokens, cache, backends, obs)? {
            return Ok(baked);
        }
        let dispatch = Dispatch::new(&mut self.fallbacks, backends, obs);
        let mut p = Pass::new(ctx, dispatch, tokens, &self.rope, self.padded_decode);
        p.fusion = self.decode_fusion;
        let acts = self.acts.as_mut().expect("allocated by upload");
        // x in the symmetric window where it fits and the GEMVs before the all-reduces run.
        let rows = batch * seq;
        let windowed =
            acts.x.has_window() && self.blocks.iter().all(|b| b.gemvs_before_reduces(backends, rows));
        let x = if windowed { acts.x.start(rows * self.cfg.hidden) } else { acts.x.first_mut() };
        self.embed.forward(&mut p, &acts.ids, x)?;
        let ranks = match &self.comm {
            Some(c) => Some(RankSum::new(ctx, c, self.gather.as_ref(), self.cfg.hidden)?),
            None => None,
        };
        for (l, block) in self.blocks.iter().enumerate() {
            block.forward(&mut p, &mut acts.x, &mut acts.scratch, cache.layer_step(l)?, ranks.as_ref())?;
        }
        self.norm.forward(&mut p, acts.x.get(), &mut acts.out)?;
        self.padded_decode = p.positions.padded;
        cache.finish()?;
        Ok(p.positions.baked)
    }

    /// Logits `[rows, vocab]` of the last forward's first `rows` output rows (`lm_head`, or the
    /// embedding when tied), on the backend chosen for [`ModuleKind::LmHead`].
    pub fn logits(
        &mut self,
        ctx: &Cudnn,
        rows: usize,
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<CudaSlice<T>> {
        self.logits_rows(ctx, 0..rows, backends, obs)
    }

    /// `lm_head` over output rows `rows` of the last forward into `out` (launches only, so it can be
    /// captured).
    fn head(
        &mut self,
        ctx: &Cudnn,
        rows: std::ops::Range<usize>,
        backends: &Backends,
        obs: &mut dyn Observer,
        out: &mut CudaSlice<T>,
    ) -> Result<()> {
        let acts = self.acts.as_ref().ok_or_else(|| Error::Config("logits: run forward first".into()))?;
        if rows.is_empty() || rows.end > acts.last {
            return Err(Error::Config(format!(
                "logits: rows {rows:?} asked, the last forward had {}",
                acts.last
            )));
        }
        let hidden = self.cfg.hidden;
        let x = acts.out.slice(rows.start * hidden..rows.end * hidden);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed.table);
        let dispatch = Dispatch::new(&mut self.fallbacks, backends, obs);
        lm_head(ctx, head, self.comm.as_ref(), dispatch, (&x, rows.len()), out)
    }

    /// Logits `[rows.len(), vocab]` of the last forward's output rows `rows`, in that order (any
    /// rows, e.g. the last token of each prompt of a packed prefill): the rows are copied together
    /// (one row copy each), then one `lm_head` runs over them. Same backend and observer range as
    /// [`Llama::logits`]; one row is [`Llama::logits_rows`].
    pub fn logits_of(
        &mut self,
        ctx: &Cudnn,
        rows: &[usize],
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<CudaSlice<T>> {
        let acts = self.acts.as_ref().ok_or_else(|| Error::Config("logits: run forward first".into()))?;
        if rows.is_empty() || rows.iter().any(|&r| r >= acts.last) {
            return Err(Error::Config(format!(
                "logits: rows {rows:?} asked, the last forward had {}",
                acts.last
            )));
        }
        if let [r] = rows {
            return self.logits_rows(ctx, *r..*r + 1, backends, obs); // r < acts.last
        }
        let (n, hidden) = (rows.len(), self.cfg.hidden);
        let s = ctx.stream();
        let mut x = s.zeros::<T>(n * hidden)?;
        for (i, &r) in rows.iter().enumerate() {
            let src = acts.out.slice(r * hidden..(r + 1) * hidden);
            s.memcpy_dtod(&src, &mut x.slice_mut(i * hidden..(i + 1) * hidden))
                .map_err(cudnn_llm_ops::Error::from)?;
        }
        let mut out = s.zeros::<T>(n * self.cfg.vocab)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed.table);
        let dispatch = Dispatch::new(&mut self.fallbacks, backends, obs);
        lm_head(ctx, head, self.comm.as_ref(), dispatch, (&x.as_view(), n), &mut out)?;
        Ok(out)
    }

    /// Logits `[rows.len(), vocab]` of the last forward's output rows `rows` only, e.g. the last
    /// position of a prefill (`n - 1..n`) without the other `n - 1` rows' `lm_head` work. Same backend
    /// and observer range as [`Llama::logits`]; the rows are read through a view of the output buffer.
    pub fn logits_rows(
        &mut self,
        ctx: &Cudnn,
        rows: std::ops::Range<usize>,
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<CudaSlice<T>> {
        let n = rows.len() * self.cfg.vocab;
        let mut out = ctx.stream().zeros::<T>(n)?;
        self.head(ctx, rows, backends, obs, &mut out)?;
        Ok(out)
    }
}

/// `head` (`lm_head`, or the tied embedding) over the `n` rows of `x` into `out`; a tensor-parallel
/// rank projects its vocabulary slice and gathers every rank's.
fn lm_head<T: Element>(
    ctx: &Cudnn,
    head: &Linear<T>,
    comm: Option<&Comm>,
    mut dispatch: Dispatch<'_>,
    (x, n): (&CudaView<'_, T>, usize),
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let shape = format!("{n} tokens");
    let Some(comm) = comm else {
        return dispatch.run(Site::LM_HEAD, None, &shape, |b| head.forward(b, ctx, n, x, Then::Nothing, out));
    };
    // This rank's vocabulary slice into its part of `out`, then every rank's part gathered.
    let part = n * head.out_features;
    let own = comm.rank() * part..(comm.rank() + 1) * part;
    dispatch.run(Site::LM_HEAD, None, &shape, |b| {
        head.forward(b, ctx, n, x, Then::Nothing, &mut out.slice_mut(own.clone()))
    })?;
    let gathered = dispatch.observe(LM_HEAD_GATHER_RANGE, None, || {
        comm.all_gather_in_place(ctx.stream(), &mut out.slice_mut(..part * comm.ranks()))
    });
    Ok(gathered?)
}

/// Bytes of `params` weights of `elem` bytes and the RoPE tables of `max_positions` rows (the f32
/// cos/sin of half a head each, and the full-width cos/sin in the model's dtype).
fn model_bytes(cfg: &LlamaConfig, elem: usize, params: usize, max_positions: usize) -> Result<usize> {
    let rope = max_positions.checked_mul(cfg.head_dim).and_then(|n| n.checked_mul(4 + 2 * elem));
    params
        .checked_mul(elem)
        .zip(rope)
        .and_then(|(w, r)| w.checked_add(r))
        .ok_or_else(|| Error::Config(format!("{}: the model's size in bytes overflows", cfg.name)))
}

/// Checks what every model needs before any upload: a config [`LlamaConfig::check`] accepts and
/// RoPE tables this crate builds.
fn check_model(cfg: &LlamaConfig, max_positions: usize) -> Result<()> {
    cfg.check()?;
    if max_positions > crate::config::MAX_POSITIONS {
        return Err(Error::Config(format!(
            "{max_positions} RoPE positions asked, more than the {} this crate builds tables for",
            crate::config::MAX_POSITIONS
        )));
    }
    Ok(())
}
