//! The decoder on the GPU. Each module runs on the backend [`Backends`] gives its kind and layer:
//!
//! ```text
//! x = embed(tokens)
//! for each layer:
//!     h   = prenorm(x)                      # fwd.layer.attn.prenorm  RMSNorm graph | 8 eager kernels
//!     qkv = qkv_proj(h)                     # fwd.layer.attn.qkv_proj matmul graph  | cuBLAS GEMM
//!     rope(qkv)                             # fwd.layer.attn.rope     1 kernel      | 10 eager kernels
//!     o   = gqa(qkv, cache)                 # fwd.layer.attn.gqa      SDPA graph    | math-path attention
//!     x   = x + o_proj(o)                   # fwd.layer.attn.o_proj   matmul+residual | GEMM, add
//!     h   = prenorm(x)                      # fwd.layer.mlp.prenorm
//!     x   = x + down(silu(gate(h)) * up(h)) # fwd.layer.mlp.mlp       3 graphs (SwiGLU, residual) | 3 GEMMs, silu, mul, add
//! y = output_norm(x)                        # fwd.output_norm
//! ```
//!
//! Q, K and V live in one `[tokens, (h_q + 2·h_kv)·d]` buffer (one GEMM against the concatenated
//! weight, as gpt-fast's `wqkv`); RoPE rotates Q and K there, K and V rows are copied into a
//! preallocated cache, and attention reads Q and the cache through strides. Prefill uses a top-left
//! causal mask; later calls (decode, chunked prefill) attend bottom-right aligned over the cache.
//! Fused decode steps (one new token per sequence) all run one attention plan: the whole cache is its
//! capacity and the lengths are device values (cuDNN 9.15+), so a new cache length builds no plan.
//! A fused module that cuDNN cannot run for a shape runs naive instead; [`Llama::fallbacks`] says
//! which and why, and the shape is not retried.

use crate::backends::{Backends, ModuleKind};
use crate::config::LlamaConfig;
use crate::weights::{Tensor, Weights};
use crate::{Backend, Error, Result};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use cudnn_ops::{
    check_ids, embedding, matmul, rms_norm, rope, sdpa, write_cache, CacheWrite, CacheWriteOperands, Cudnn,
    Element, EmbeddingArgs, EmbeddingOperands, Epilogue, Layout, Mask, MatmulArgs, MatmulOperands,
    RmsNormArgs, RmsNormOperands, RopeArgs, RopeOperands, RopeTables, SdpaArgs, SdpaOperands,
};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

/// Identities of caches and activation buffers, so that a captured decode graph (which holds their
/// device addresses) refuses to run on others.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// The range of the embedding lookup (one kernel on both backends).
pub const EMBED_RANGE: &str = "fwd.embed";

/// Called around every module call, for profilers (CUDA events, NVTX, kernel attribution).
pub trait Observer {
    /// A module call begins: its range name (e.g. `fwd.layer.attn.gqa`) and layer.
    fn begin(&mut self, _range: &'static str, _layer: Option<usize>) {}
    /// The call ends (its work is enqueued).
    fn end(&mut self, _range: &'static str, _layer: Option<usize>) {}
}

/// An observer that does nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// A fused module that ran naive instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// Range name of the module.
    pub range: &'static str,
    /// Its layer.
    pub layer: Option<usize>,
    /// The shape it failed for.
    pub shape: String,
    /// cuDNN's reason.
    pub reason: String,
}

struct Layer<T> {
    attn_norm: CudaSlice<T>,
    qkv: CudaSlice<T>,
    o_proj: CudaSlice<T>,
    mlp_norm: CudaSlice<T>,
    gate: CudaSlice<T>,
    up: CudaSlice<T>,
    down: CudaSlice<T>,
}

/// Per-layer K and V caches, `[batch, max_seq, h_kv · d]` each.
pub struct KvCache<T> {
    k: Vec<CudaSlice<T>>,
    v: Vec<CudaSlice<T>>,
    batch: usize,
    max_seq: usize,
    len: usize,
    /// Per sequence, the keys a decode step attends to (`len + 1`), and the query count (1): the
    /// run-time lengths of the one padded attention plan every decode step shares.
    kv_lens: CudaSlice<i32>,
    q_lens: CudaSlice<i32>,
    /// Per sequence, the position of the token a decode step writes (`len`): fused RoPE and the
    /// cache writes read it on the device, so a captured decode step serves every position.
    positions: CudaSlice<i32>,
    id: u64,
}

impl<T> KvCache<T> {
    /// Tokens cached per sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first forward.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the cached tokens (the memory is kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps only the first `len` cached tokens of each sequence (e.g. to time one decode step again).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// First cuDNN version whose unified SDPA takes run-time sequence lengths.
const PADDED_SDPA: usize = 91500;

/// Activation buffers for `rows` tokens.
struct Activations<T> {
    id: u64,
    rows: usize,
    /// Rows of the last forward.
    last: usize,
    ids: CudaSlice<u32>,
    x: [CudaSlice<T>; 2],
    h: CudaSlice<T>,
    qkv: CudaSlice<T>,
    attn: CudaSlice<T>,
    up: CudaSlice<T>,
    act: CudaSlice<T>,
    out: CudaSlice<T>,
}

/// One decode step captured as a CUDA graph ([`Llama::capture_decode`], replayed by [`Llama::decode`]).
pub struct DecodeGraph<T> {
    graph: cudarc::driver::CudaGraph,
    logits: CudaSlice<T>,
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

/// A Llama-3 decoder on one GPU.
pub struct Llama<T: Element> {
    cfg: LlamaConfig,
    embed: CudaSlice<T>,
    layers: Vec<Layer<T>>,
    norm: CudaSlice<T>,
    lm_head: Option<CudaSlice<T>>,
    rope: RopeTables<T>,
    acts: Option<Activations<T>>,
    fallbacks: Vec<Fallback>,
    unsupported: HashSet<(&'static str, Option<usize>, String)>,
    /// Fused decode steps share one attention plan with run-time sequence lengths (cuDNN 9.15+);
    /// false once cuDNN refused it, and decode builds a plan per cache length instead.
    padded_decode: bool,
}

impl<T: Element> Llama<T> {
    /// Uploads `weights` (the Q, K and V projections concatenated into one matrix) and RoPE tables for
    /// positions `0..max_positions`.
    pub fn new(ctx: &Cudnn, cfg: &LlamaConfig, weights: &Weights<T>, max_positions: usize) -> Result<Self> {
        cfg.check()?;
        if max_positions > crate::config::MAX_POSITIONS {
            return Err(Error::Config(format!(
                "{max_positions} RoPE positions asked, more than the {} this crate builds tables for",
                crate::config::MAX_POSITIONS
            )));
        }
        if weights.layers.len() != cfg.layers {
            return Err(Error::Weights(format!(
                "{} layers of weights for a {}-layer config",
                weights.layers.len(),
                cfg.layers
            )));
        }
        let s = ctx.stream();
        let up = |t: &Tensor<T>| -> Result<CudaSlice<T>> {
            Ok(s.clone_htod(&t.data).map_err(cudnn_ops::Error::from)?)
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in &weights.layers {
            let qkv: Vec<T> =
                [&l.q_proj, &l.k_proj, &l.v_proj].iter().flat_map(|t| t.data.iter().copied()).collect();
            layers.push(Layer {
                attn_norm: up(&l.attn_norm)?,
                qkv: s.clone_htod(&qkv).map_err(cudnn_ops::Error::from)?,
                o_proj: up(&l.o_proj)?,
                mlp_norm: up(&l.mlp_norm)?,
                gate: up(&l.gate_proj)?,
                up: up(&l.up_proj)?,
                down: up(&l.down_proj)?,
            });
        }
        let (cos, sin) = crate::rope::tables(cfg, 0, max_positions);
        Ok(Llama {
            cfg: cfg.clone(),
            embed: up(&weights.embed)?,
            layers,
            norm: up(&weights.norm)?,
            lm_head: weights.lm_head.as_ref().map(up).transpose()?,
            rope: RopeTables::new(ctx, &cos, &sin, cfg.head_dim)?,
            acts: None,
            fallbacks: Vec::new(),
            unsupported: HashSet::new(),
            padded_decode: ctx.info().cudnn_version >= PADDED_SDPA,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Fused modules that ran naive, with the reason (each module, layer and shape once).
    pub fn fallbacks(&self) -> &[Fallback] {
        &self.fallbacks
    }

    /// An empty cache for `batch` sequences of up to `max_seq` tokens.
    pub fn cache(&self, ctx: &Cudnn, batch: usize, max_seq: usize) -> Result<KvCache<T>> {
        if max_seq > self.rope.positions() {
            return Err(Error::Config(format!(
                "a cache of {max_seq} exceeds the {} RoPE positions",
                self.rope.positions()
            )));
        }
        let n = batch * max_seq * self.cfg.kv_heads * self.cfg.head_dim;
        let alloc = || ctx.stream().alloc_zeros::<T>(n).map_err(cudnn_ops::Error::from);
        let mut k = Vec::with_capacity(self.cfg.layers);
        let mut v = Vec::with_capacity(self.cfg.layers);
        for _ in 0..self.cfg.layers {
            k.push(alloc()?);
            v.push(alloc()?);
        }
        let s = ctx.stream();
        let kv_lens = s.alloc_zeros::<i32>(batch).map_err(cudnn_ops::Error::from)?;
        let q_lens = s.clone_htod(&vec![1i32; batch]).map_err(cudnn_ops::Error::from)?;
        let positions = s.alloc_zeros::<i32>(batch).map_err(cudnn_ops::Error::from)?;
        Ok(KvCache { k, v, batch, max_seq, len: 0, kv_lens, q_lens, positions, id: next_id() })
    }

    fn activations(&mut self, ctx: &Cudnn, rows: usize) -> Result<()> {
        if self.acts.as_ref().is_some_and(|a| a.rows >= rows) {
            return Ok(());
        }
        let c = &self.cfg;
        let alloc = |n: usize| ctx.stream().alloc_zeros::<T>(rows * n).map_err(cudnn_ops::Error::from);
        self.acts = Some(Activations {
            id: next_id(),
            rows,
            last: 0,
            ids: ctx.stream().alloc_zeros::<u32>(rows).map_err(cudnn_ops::Error::from)?,
            x: [alloc(c.hidden)?, alloc(c.hidden)?],
            h: alloc(c.hidden)?,
            qkv: alloc(c.qkv_width())?,
            attn: alloc(c.attn_width())?,
            up: alloc(c.ffn)?,
            act: alloc(c.ffn)?,
            out: alloc(c.hidden)?,
        });
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
        let (batch, seq) = self.upload(ctx, tokens, cache)?;
        self.run(ctx, batch, seq, cache, backends, obs)?;
        Ok(&self.acts.as_ref().expect("allocated by upload").out)
    }

    /// Captures one decode step (one token per sequence) and its logits as a CUDA graph that
    /// [`Llama::decode`] replays at every later position: fused RoPE, the cache writes and attention
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
        backends.check_layers(self.cfg.layers)?;
        if cache.is_empty() || cache.len >= cache.max_seq {
            return Err(Error::Config(format!(
                "capture_decode: needs a cache holding a prefill with room for a token (holds {} of {})",
                cache.len, cache.max_seq
            )));
        }
        let acts_id = match &self.acts {
            Some(a) if a.rows >= cache.batch => a.id,
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
        let mut logits =
            ctx.stream().alloc_zeros::<T>(cache.batch * self.cfg.vocab).map_err(cudnn_ops::Error::from)?;
        let epoch = ctx.buffer_epoch();
        // SAFETY: the caller's promise (this function's contract is `Cudnn::capture`'s).
        let (baked, graph) = unsafe {
            ctx.capture(|| {
                let baked = self.run(ctx, cache.batch, 1, cache, backends, &mut NoObserver)?;
                cache.len -= 1; // nothing ran: the capture only recorded the step
                self.head(ctx, 0..cache.batch, backends, &mut NoObserver, &mut logits)?;
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
        Ok(DecodeGraph { graph, logits, batch: cache.batch, cache_id: cache.id, acts_id, epoch })
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
        if graph.cache_id != cache.id || graph.batch != tokens.len() {
            return Err(Error::Config(format!(
                "decode: the graph was captured for another cache or batch ({} sequences, {} tokens given)",
                graph.batch,
                tokens.len()
            )));
        }
        if !self.is_current(ctx, graph) {
            return Err(Error::Config(
                "decode: a longer forward (or a larger op on this context) reallocated buffers the graph \
                 holds since the capture; capture again"
                    .into(),
            ));
        }
        if cache.is_empty() {
            return Err(Error::Config("decode: the cache holds no prefill".into()));
        }
        let step: Vec<Vec<u32>> = tokens.iter().map(|&t| vec![t]).collect();
        self.upload(ctx, &step, cache)?;
        // The graph reads these whatever the model's padded-decode state is now.
        Self::upload_positions(ctx, cache)?;
        graph.graph.launch().map_err(cudnn_ops::Error::from)?;
        // The replay records no events: mark the logits written on this stream, so another stream
        // that reads them is ordered after the replay.
        drop(graph.logits.device_ptr_mut(ctx.stream()));
        cache.len += 1;
        Ok(&graph.logits)
    }

    /// False once `graph` is stale: a longer forward reallocated the activations it holds, or the
    /// context's shared buffers grew ([`Cudnn::buffer_epoch`]). Capture again then.
    pub fn is_current(&self, ctx: &Cudnn, graph: &DecodeGraph<T>) -> bool {
        self.acts.as_ref().map(|a| a.id) == Some(graph.acts_id) && ctx.buffer_epoch() == graph.epoch
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
    /// this runs.
    pub unsafe fn capture(
        &mut self,
        ctx: &Cudnn,
        tokens: &[Vec<u32>],
        cache: &mut KvCache<T>,
        backends: &Backends,
    ) -> Result<cudarc::driver::CudaGraph> {
        backends.check_layers(self.cfg.layers)?;
        let (batch, seq) = self.upload(ctx, tokens, cache)?;
        // SAFETY: the caller's promise (this function's contract is `Cudnn::capture`'s).
        let ((), graph) =
            unsafe { ctx.capture(|| self.run(ctx, batch, seq, cache, backends, &mut NoObserver).map(drop)) }?;
        Ok(graph)
    }

    /// Checks the tokens against the cache and vocabulary, sizes the activations and uploads the ids.
    fn upload(&mut self, ctx: &Cudnn, tokens: &[Vec<u32>], cache: &mut KvCache<T>) -> Result<(usize, usize)> {
        let batch = tokens.len();
        let seq = tokens.first().map_or(0, Vec::len);
        if batch == 0 || seq == 0 || tokens.iter().any(|t| t.len() != seq) {
            return Err(Error::Config(
                "forward: give one or more sequences of equal, non-zero length".into(),
            ));
        }
        if batch != cache.batch || cache.len + seq > cache.max_seq {
            return Err(Error::Config(format!(
                "forward: {batch} x {seq} tokens do not fit a cache of {} x {} holding {}",
                cache.batch, cache.max_seq, cache.len
            )));
        }
        let ids: Vec<u32> = tokens.iter().flatten().copied().collect();
        check_ids(&ids, self.cfg.vocab)?;
        if cache.k.len() != self.cfg.layers {
            return Err(Error::Config(format!(
                "forward: a cache of {} layers for a {}-layer model",
                cache.k.len(),
                self.cfg.layers
            )));
        }
        self.activations(ctx, batch * seq)?;
        let acts = self.acts.as_mut().expect("allocated above");
        acts.last = batch * seq;
        ctx.stream()
            .memcpy_htod(&ids, &mut acts.ids.slice_mut(..ids.len()))
            .map_err(cudnn_ops::Error::from)?;
        if seq == 1 && cache.len > 0 && self.padded_decode {
            Self::upload_positions(ctx, cache)?;
        }
        Ok((batch, seq))
    }

    /// The device values of a decode step at the cache's length: each sequence attends to `len + 1`
    /// keys and writes position `len`.
    fn upload_positions(ctx: &Cudnn, cache: &mut KvCache<T>) -> Result<()> {
        let s = ctx.stream();
        let lens = vec![(cache.len + 1) as i32; cache.batch];
        s.memcpy_htod(&lens, &mut cache.kv_lens).map_err(cudnn_ops::Error::from)?;
        let positions = vec![cache.len as i32; cache.batch];
        s.memcpy_htod(&positions, &mut cache.positions).map_err(cudnn_ops::Error::from)?;
        Ok(())
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
        let rows = batch * seq;
        let c = self.cfg.clone();
        let mut me =
            Step { fallbacks: &mut self.fallbacks, unsupported: &mut self.unsupported, backends, obs };
        let acts = self.acts.as_mut().expect("allocated above");
        let (hid, d, hq, hkv, w) = (c.hidden, c.head_dim, c.heads, c.kv_heads, c.qkv_width());
        let start = cache.len;
        let mut padded_decode = self.padded_decode;
        // Fused decode steps read their position from the cache's device buffers (uploaded with the
        // ids), so one captured step serves every position.
        let device_positions = seq == 1 && start > 0 && padded_decode;
        let mut baked = !device_positions;
        me.obs.begin(EMBED_RANGE, None);
        let embed = EmbeddingArgs { rows, vocab: c.vocab, hidden: hid };
        let embedded = embedding(
            ctx,
            embed,
            EmbeddingOperands { ids: &acts.ids, table: &self.embed, y: &mut acts.x[0] },
        );
        me.obs.end(EMBED_RANGE, None);
        embedded?;
        let mut cur = 0;
        let norm = RmsNormArgs { tokens: rows, hidden: hid, epsilon: c.rms_eps as f32 };
        let wide = MatmulArgs::linear(rows, hid, c.ffn);
        for (l, layer) in self.layers.iter().enumerate() {
            let at = Some(l);
            let shape = format!("{rows} tokens");
            me.run(ModuleKind::Prenorm, 0, at, &shape, |b| {
                rms_norm(ctx, norm, RmsNormOperands::new(&acts.x[cur], &layer.attn_norm, &mut acts.h), b)
            })?;
            let qkv_lin = MatmulArgs::linear(rows, hid, w);
            me.run(ModuleKind::QkvProj, 0, at, &shape, |b| {
                matmul(ctx, &qkv_lin, MatmulOperands::new(&acts.h, &layer.qkv, &mut acts.qkv), b)
            })?;
            let rope_args =
                RopeArgs { batch, seq, heads_q: hq, heads_kv: hkv, head_dim: d, row_stride: w, start };
            me.run(ModuleKind::Rope, 0, at, &shape, |b| {
                let x = RopeOperands::new(&self.rope, &mut acts.qkv);
                if b == Backend::Fused && device_positions {
                    return rope(ctx, rope_args, x.starts(&cache.positions), b);
                }
                baked = true;
                rope(ctx, rope_args, x, b)
            })?;
            let mask = if start == 0 { Mask::CausalTopLeft } else { Mask::CausalBottomRight };
            let mut attn = SdpaArgs::new(batch, hq, hkv, seq, start + seq, d, Layout::Bshd).with_mask(mask);
            attn.q_strides = [seq * w, d, w, 1];
            let kv = [cache.max_seq * hkv * d, d, hkv * d, 1];
            (attn.k_strides, attn.v_strides) = (kv, kv);
            let (kc, vc) = (&mut cache.k[l], &mut cache.v[l]);
            // The fallback key leaves s_kv out, so decode steps do not retry a shape that failed.
            let attn_shape = format!("{batch}x{seq} {}", mask.name());
            let (kv_lens, q_lens, max_seq) = (&cache.kv_lens, &cache.q_lens, cache.max_seq);
            let positions = &cache.positions;
            me.run(ModuleKind::Gqa, 0, at, &attn_shape, |b| {
                let write = CacheWrite { batch, seq, cols: hkv * d, src_stride: w, max_seq, start };
                let (k_src, v_src) = (acts.qkv.slice(hq * d..), acts.qkv.slice((hq + hkv) * d..));
                if b == Backend::Fused && device_positions && padded_decode {
                    // One plan for every decode step: the whole cache as capacity, lengths and the
                    // written row on the device.
                    write_cache(ctx, write, CacheWriteOperands::new(&k_src, kc).starts(positions))?;
                    write_cache(ctx, write, CacheWriteOperands::new(&v_src, vc).starts(positions))?;
                    let padded = SdpaArgs { seq_kv: max_seq, ..attn }.with_mask(Mask::None).with_seq_lens();
                    let x =
                        SdpaOperands::new(&acts.qkv, &*kc, &*vc, &mut acts.attn).seq_lens(q_lens, kv_lens);
                    match sdpa(ctx, padded, x, Backend::Fused) {
                        Err(cudnn_ops::Error::NotSupported { .. }) => padded_decode = false,
                        done => return done,
                    }
                }
                baked = true;
                write_cache(ctx, write, CacheWriteOperands::new(&k_src, kc))?;
                write_cache(ctx, write, CacheWriteOperands::new(&v_src, vc))?;
                sdpa(ctx, attn, SdpaOperands::new(&acts.qkv, &*kc, &*vc, &mut acts.attn), b)
            })?;
            let (xa, xb) = acts.x.split_at_mut(1);
            let (src, dst) = if cur == 0 { (&xa[0], &mut xb[0]) } else { (&xb[0], &mut xa[0]) };
            let o_lin = MatmulArgs::linear(rows, hq * d, hid).with_epilogue(Epilogue::RESIDUAL);
            me.run(ModuleKind::OProj, 0, at, &shape, |b| {
                matmul(ctx, &o_lin, MatmulOperands::new(&acts.attn, &layer.o_proj, dst).residual(src), b)
            })?;
            cur = 1 - cur;
            me.run(ModuleKind::Prenorm, 1, at, &shape, |b| {
                rms_norm(ctx, norm, RmsNormOperands::new(&acts.x[cur], &layer.mlp_norm, &mut acts.h), b)
            })?;
            let (xa, xb) = acts.x.split_at_mut(1);
            let (src, dst) = if cur == 0 { (&xa[0], &mut xb[0]) } else { (&xb[0], &mut xa[0]) };
            let narrow = MatmulArgs::linear(rows, c.ffn, hid).with_epilogue(Epilogue::RESIDUAL);
            me.run(ModuleKind::Mlp, 0, at, &shape, |b| {
                matmul(ctx, &wide, MatmulOperands::new(&acts.h, &layer.up, &mut acts.up), b)?;
                let gate = MatmulOperands::new(&acts.h, &layer.gate, &mut acts.act).gate(&acts.up);
                matmul(ctx, &wide.with_epilogue(Epilogue::SWIGLU), gate, b)?;
                matmul(ctx, &narrow, MatmulOperands::new(&acts.act, &layer.down, dst).residual(src), b)
            })?;
            cur = 1 - cur;
        }
        me.run(ModuleKind::OutputNorm, 0, None, &format!("{rows} tokens"), |b| {
            rms_norm(ctx, norm, RmsNormOperands::new(&acts.x[cur], &self.norm, &mut acts.out), b)
        })?;
        self.padded_decode = padded_decode;
        cache.len += seq;
        Ok(baked)
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
        let c = &self.cfg;
        let n = rows.len();
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let x = acts.out.slice(rows.start * c.hidden..rows.end * c.hidden);
        let lin = MatmulArgs::linear(n, c.hidden, c.vocab);
        let mut me =
            Step { fallbacks: &mut self.fallbacks, unsupported: &mut self.unsupported, backends, obs };
        me.run(ModuleKind::LmHead, 0, None, &format!("{n} tokens"), |b| {
            matmul(ctx, &lin, MatmulOperands::new(&x, head, out), b)
        })
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
        let mut out = ctx.stream().alloc_zeros::<T>(n).map_err(cudnn_ops::Error::from)?;
        self.head(ctx, rows, backends, obs, &mut out)?;
        Ok(out)
    }
}

/// One forward's view of the model's bookkeeping: backends, observer, fallbacks.
struct Step<'a> {
    fallbacks: &'a mut Vec<Fallback>,
    unsupported: &'a mut HashSet<(&'static str, Option<usize>, String)>,
    backends: &'a Backends,
    obs: &'a mut dyn Observer,
}

impl Step<'_> {
    /// Runs module `kind` (its `which`-th range name) of `layer` on its backend inside the observer's
    /// range; a fused `NotSupported` is recorded once per shape and the module runs naive.
    fn run(
        &mut self,
        kind: ModuleKind,
        which: usize,
        layer: Option<usize>,
        shape: &str,
        mut f: impl FnMut(Backend) -> cudnn_ops::Result<()>,
    ) -> Result<()> {
        let range = kind.ranges()[which];
        self.obs.begin(range, layer);
        let mut backend = self.backends.get(layer, kind);
        let key = (range, layer, shape.to_string());
        if backend == Backend::Fused && self.unsupported.contains(&key) {
            backend = Backend::Naive;
        }
        let result = match f(backend) {
            Err(e) if backend == Backend::Fused && e.is_not_supported() => {
                self.fallbacks.push(Fallback {
                    range,
                    layer,
                    shape: shape.to_string(),
                    reason: e.to_string(),
                });
                self.unsupported.insert(key);
                f(Backend::Naive)
            }
            other => other,
        };
        self.obs.end(range, layer);
        Ok(result?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records which ranges opened and closed.
    #[derive(Default)]
    struct Log(Vec<String>);
    impl Observer for Log {
        fn begin(&mut self, range: &'static str, layer: Option<usize>) {
            self.0.push(format!("+{range}@{layer:?}"));
        }
        fn end(&mut self, range: &'static str, layer: Option<usize>) {
            self.0.push(format!("-{range}@{layer:?}"));
        }
    }

    #[test]
    fn unsupported_fused_modules_fall_back_once_per_shape_and_say_why() {
        let (mut fallbacks, mut unsupported, mut log) = (Vec::new(), HashSet::new(), Log::default());
        let backends = Backends::all(Backend::Fused);
        let mut tried = Vec::new();
        let not_supported =
            || cudnn_ops::Error::NotSupported { op: "sdpa".into(), reason: "head_dim 264".into() };
        for _ in 0..2 {
            let mut step = Step {
                fallbacks: &mut fallbacks,
                unsupported: &mut unsupported,
                backends: &backends,
                obs: &mut log,
            };
            step.run(ModuleKind::Gqa, 0, Some(3), "1x8 causal", |b| {
                tried.push(b);
                if b == Backend::Fused {
                    Err(not_supported())
                } else {
                    Ok(())
                }
            })
            .unwrap();
        }
        // Fused once, naive twice; one record; ranges balanced.
        assert_eq!(tried, vec![Backend::Fused, Backend::Naive, Backend::Naive]);
        assert_eq!(fallbacks.len(), 1);
        let f = &fallbacks[0];
        assert_eq!((f.range, f.layer, f.shape.as_str()), ("fwd.layer.attn.gqa", Some(3), "1x8 causal"));
        assert!(f.reason.contains("head_dim 264"), "{}", f.reason);
        assert_eq!(
            log.0,
            [
                "+fwd.layer.attn.gqa@Some(3)",
                "-fwd.layer.attn.gqa@Some(3)",
                "+fwd.layer.attn.gqa@Some(3)",
                "-fwd.layer.attn.gqa@Some(3)"
            ]
        );
        // Another error is not a fallback: it is returned, and the range still closes.
        let mut step = Step {
            fallbacks: &mut fallbacks,
            unsupported: &mut unsupported,
            backends: &backends,
            obs: &mut log,
        };
        let e = step.run(ModuleKind::Rope, 0, Some(0), "8 tokens", |_| {
            Err(cudnn_ops::Error::InvalidArgument("bad".into()))
        });
        assert!(matches!(e, Err(Error::Ops(cudnn_ops::Error::InvalidArgument(_)))));
        assert_eq!(log.0.last().unwrap(), "-fwd.layer.attn.rope@Some(0)");
        assert_eq!(fallbacks.len(), 1);
        // A naive selection never tries fused.
        let naive = Backends::all(Backend::Naive);
        let mut step = Step {
            fallbacks: &mut fallbacks,
            unsupported: &mut unsupported,
            backends: &naive,
            obs: &mut log,
        };
        let mut seen = Vec::new();
        step.run(ModuleKind::Prenorm, 1, Some(0), "8 tokens", |b| {
            seen.push(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![Backend::Naive]);
        assert_eq!(log.0.last().unwrap(), "-fwd.layer.mlp.prenorm@Some(0)");
    }
}
