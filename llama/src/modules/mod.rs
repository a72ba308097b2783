//! The decoder's modules, each on one screen, and the state one forward pass hands them.
//!
//! ```text
//! Llama::run                                             # model.rs
//!     x = embed(ids)                                     # fwd.embed               Embedding
//!     for block in blocks:                               # Block::forward
//!         x += attn(attn_norm(x))                        # RmsNorm, Attention:
//!             qkv = qkv_proj(h)                          #   fwd.layer.attn.qkv_proj
//!             rope(qkv); cache += k, v                   #   fwd.layer.attn.rope    (and the K/V append)
//!             o   = gqa(qkv, cache)                      #   fwd.layer.attn.gqa
//!             x   = x + o_proj(o)                        #   fwd.layer.attn.o_proj  (residual epilogue)
//!         x += mlp(mlp_norm(x))                          # RmsNorm, Mlp:
//!             x   = x + down(silu(gate(h)) * up(h))      #   fwd.layer.mlp.mlp      (SwiGLU, residual epilogues)
//!     y = output_norm(x)                                 # fwd.output_norm
//! Llama::logits: lm_head(y)                              # fwd.lm_head             (the embedding when tied)
//! ```
//!
//! Every module call goes through the pass's [`Dispatch`](dispatch::Dispatch): it picks the call's
//! backend from the model's [`Backends`](crate::Backends) by [`Site`](crate::backends::Site) and layer,
//! opens the observer's range, and runs a fused call that cuDNN cannot do on the naive backend
//! instead (once per shape). `x` is a [`Residual`](residual::Residual): two buffers, an add reads one
//! and writes the other. Each cudnn-ops op is called in one method: `rms_norm_with` in
//! [`RmsNorm::forward`](norm::RmsNorm::forward), `linear` in [`Linear::forward`](linear::Linear::forward),
//! RoPE with the K/V append and SDPA in [`Attention`](attention::Attention), `embedding` in
//! [`Embedding::forward`](embedding::Embedding::forward).
//!
//! A fused decode step of one token can fold launches together ([`DecodeFusion`]): each prenorm
//! into the projection after it (`qkv_proj`, and the MLP's gate and up), whose decode GEMV
//! normalizes x itself; the prenorm's range then stays open but empty (its work is counted in
//! `fwd.layer.attn.qkv_proj` and `fwd.layer.mlp.mlp`); the MLP's gate and up in one GEMV that
//! streams both weights; and RoPE with the K/V append into `qkv_proj`'s GEMV (its rotary epilogue;
//! the `fwd.layer.attn.rope` range stays open but empty), where the step reads its position on the
//! device. The default folds all three ([`DecodeFusion::ALL`]). Prefill, batches, the naive backend,
//! paged steps, and modules of one fold on different backends run the modules as drawn above.
//!
//! Q, K and V live in one `[tokens, (h_q + 2·h_kv)·d]` buffer (one GEMM against the concatenated
//! weight, as gpt-fast's `wqkv`); RoPE rotates Q and K there, K and V rows are copied into a
//! preallocated cache, and attention reads Q and the cache through strides.

pub(crate) mod attention;
pub(crate) mod block;
pub(crate) mod dispatch;
pub(crate) mod embedding;
pub(crate) mod linear;
pub(crate) mod mlp;
pub(crate) mod norm;
pub(crate) mod paged;
pub(crate) mod reduce;
pub(crate) mod residual;

pub use block::{ATTN_ALLREDUCE_RANGE, MLP_ALLREDUCE_RANGE};
pub use dispatch::{Fallback, NoObserver, Observer};

pub use embedding::EMBED_RANGE;

use cudnn_llm_ops::{Cudnn, RopeTables};
use dispatch::Dispatch;

/// Which launches a fused one-token decode step folds together (`Llama::set_decode_fusion`); each
/// is measured against the unfused step by `examples/05-decode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct DecodeFusion {
    /// Each prenorm runs inside the projection after it (the decode GEMV's RMSNorm prologue): one
    /// launch less before `qkv_proj` and before the MLP, per layer.
    pub norm_into_projection: bool,
    /// The MLP's gate and up projections run as one GEMV that streams both weights and writes
    /// `silu(gate) · up` (the up product): one launch less per layer.
    pub gate_up: bool,
    /// RoPE and the K/V append run in `qkv_proj`'s decode GEMV (its rotary epilogue: each warp
    /// owns a head's pair of rotated rows), where the step reads its position on the device and the
    /// cache is contiguous: one launch less per layer.
    pub rope_into_qkv: bool,
    /// The whole layer in one launch where it takes the layer's shapes (bf16 or f16 weights, head
    /// dim 32-128, every phase's input within 12 Ki elements: SmolLM2-135M, Llama-3.2-1B; not 8B):
    /// the persistent kernel of [`cudnn_llm_ops::decode_layer`], a grid barrier between its phases,
    /// in place of the five or six launches the other folds leave. Layers it does not take run the
    /// other folds. Off by default: on an H200 it wins only where steps are launched plainly
    /// (SmolLM2-135M 0.824 ms a step against 1.740), and loses to the defaults in a replayed graph
    /// (0.728 against 0.592; Llama-3.2-1B 1.154 against 0.935; `cudnn_llm_ops::ops::decode_layer`).
    pub whole_layer: bool,
}

impl DecodeFusion {
    /// Nothing folded: every module as in prefill.
    pub const NONE: DecodeFusion = DecodeFusion {
        norm_into_projection: false,
        gate_up: false,
        rope_into_qkv: false,
        whole_layer: false,
    };
    /// The prenorms folded into the projections only.
    pub const NORM: DecodeFusion = DecodeFusion { norm_into_projection: true, ..DecodeFusion::NONE };
    /// Gate and up in one GEMV only.
    pub const GATE_UP: DecodeFusion = DecodeFusion { gate_up: true, ..DecodeFusion::NONE };
    /// The prenorms folded and gate and up in one GEMV; RoPE on its own (on an H200 the 8B step took
    /// 4.463 ms against 4.631 with gate and up alone and 4.883 unfolded, in one run;
    /// `benches/results/h200/decode-roofline.md`).
    pub const NORM_GATE_UP: DecodeFusion =
        DecodeFusion { norm_into_projection: true, gate_up: true, ..DecodeFusion::NONE };
    /// Everything folded, RoPE and the K/V append into `qkv_proj` too (the default: on an H200 the
    /// 8B step took 4.134 ms against 4.196 without RoPE folded and 4.520 with nothing folded, in one
    /// run).
    pub const ALL: DecodeFusion =
        DecodeFusion { norm_into_projection: true, gate_up: true, rope_into_qkv: true, whole_layer: false };
    /// [`DecodeFusion::ALL`] and each layer in one launch where the layer kernel takes it (for steps
    /// launched without a CUDA graph, [`DecodeFusion::whole_layer`]).
    pub const LAYER: DecodeFusion = DecodeFusion { whole_layer: true, ..DecodeFusion::ALL };
    /// Each choice, nothing folded first, for A/B tables.
    pub const EVERY: [DecodeFusion; 6] = [
        DecodeFusion::NONE,
        DecodeFusion::NORM,
        DecodeFusion::GATE_UP,
        DecodeFusion::NORM_GATE_UP,
        DecodeFusion::ALL,
        DecodeFusion::LAYER,
    ];

    /// `none`, `norm`, `gate_up` or `norm+gate_up`, then `+rope` with RoPE folded (`rope` alone),
    /// for tables.
    pub fn name(self) -> &'static str {
        if self.whole_layer {
            return "layer";
        }
        match (self.norm_into_projection, self.gate_up, self.rope_into_qkv) {
            (false, false, false) => "none",
            (true, false, false) => "norm",
            (false, true, false) => "gate_up",
            (true, true, false) => "norm+gate_up",
            (false, false, true) => "rope",
            (true, false, true) => "norm+rope",
            (false, true, true) => "gate_up+rope",
            (true, true, true) => "norm+gate_up+rope",
        }
    }
}

impl Default for DecodeFusion {
    fn default() -> Self {
        DecodeFusion::ALL
    }
}

/// The tokens of one pass: `batch` sequences of `seq` new tokens each, after `start` cached ones.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tokens {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) start: usize,
}

impl Tokens {
    /// Rows of the activations: `batch · seq`.
    pub(crate) fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// How a pass's launches learn the new tokens' positions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Positions {
    /// Fused RoPE and attention read them from the cache's device buffers (a fused decode step on
    /// the padded attention plan), so one captured step serves every position.
    pub(crate) on_device: bool,
    /// Decode steps share the padded attention plan (cuDNN 9.15+); false once cuDNN refused it.
    pub(crate) padded: bool,
    /// Some launch took the position as a host value: a captured graph of the pass replays it only.
    pub(crate) baked: bool,
    /// The decode step's sequence lengths are clamped into the cache (done by the first fused layer).
    pub(crate) lens_clamped: bool,
}

impl Positions {
    /// A pass of `tokens`; `padded` says whether the padded attention plan still works.
    pub(crate) fn new(tokens: Tokens, padded: bool) -> Self {
        let on_device = tokens.seq == 1 && tokens.start > 0 && padded;
        Positions { on_device, padded, baked: !on_device, lens_clamped: false }
    }
}

/// One forward pass's shared state, handed to every module's `forward`: the context, the dispatch,
/// the tokens, the RoPE tables, and how positions are read.
pub(crate) struct Pass<'a, T: cudnn_llm_ops::Element> {
    pub(crate) ctx: &'a Cudnn,
    pub(crate) dispatch: Dispatch<'a>,
    pub(crate) tokens: Tokens,
    /// `"{rows} tokens"`: the shape fallbacks are recorded for.
    pub(crate) shape: String,
    pub(crate) rope: &'a RopeTables<T>,
    pub(crate) positions: Positions,
    /// What a fused one-token step folds ([`DecodeFusion::NONE`] unless the model sets it).
    pub(crate) fusion: DecodeFusion,
}

impl<'a, T: cudnn_llm_ops::Element> Pass<'a, T> {
    /// A pass of `tokens`; `padded` as in [`Positions::new`].
    pub(crate) fn new(
        ctx: &'a Cudnn,
        dispatch: Dispatch<'a>,
        tokens: Tokens,
        rope: &'a RopeTables<T>,
        padded: bool,
    ) -> Self {
        let shape = format!("{} tokens", tokens.rows());
        let positions = Positions::new(tokens, padded);
        Pass { ctx, dispatch, tokens, shape, rope, positions, fusion: DecodeFusion::NONE }
    }

    /// The pass goes on over `tokens`, another part of its rows read the same way (the halves of a
    /// halved pass: several rows each, positions as host values).
    pub(crate) fn set_tokens(&mut self, tokens: Tokens) {
        debug_assert_eq!(Positions::new(tokens, self.positions.padded).on_device, self.positions.on_device);
        self.shape = format!("{} tokens", tokens.rows());
        self.tokens = tokens;
    }
}
