//! One decoder layer.

use super::attention::{Attention, AttnBuffers};
use super::linear::Linear;
use super::mlp::{Mlp, MlpBuffers};
use super::norm::{Normed, RmsNorm};
use super::reduce::RankSum;
use super::residual::Residual;
use super::Pass;
use crate::backends::Site;
use crate::config::LlamaConfig;
use crate::Backend;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::staging::Source;
use cudnn_llm_ops::{
    decode_layer, Cudnn, DecodeLayerArgs, DecodeLayerOperands, DecodeLayerWeights, Element, KvLayer,
    Uploader, WeightScales,
};

/// The range of a layer run in one launch ([`DecodeFusion::whole_layer`](super::DecodeFusion)).
pub const WHOLE_LAYER_RANGE: &str = "fwd.layer.whole";
/// The range of the all-reduce after attention on a tensor-parallel rank.
pub const ATTN_ALLREDUCE_RANGE: &str = "fwd.layer.attn.allreduce";
/// The range of the all-reduce after the MLP on a tensor-parallel rank.
pub const MLP_ALLREDUCE_RANGE: &str = "fwd.layer.mlp.allreduce";

/// The scratch buffers of a layer: the normed hidden state `h`, attention's and the MLP's.
pub(crate) struct Scratch<T> {
    pub(crate) h: CudaSlice<T>,
    pub(crate) attn: AttnBuffers<T>,
    pub(crate) mlp: MlpBuffers<T>,
}

/// A pre-norm decoder layer: `x += attn(attn_norm(x)); x += mlp(mlp_norm(x))`. On a tensor-parallel
/// rank each `+=` is the rank's partial sum (the residual on the first rank only) followed by an
/// all-reduce, or, in a gathered pass, the ranks' partial sums gathered and added to the residual
/// by every rank ([`RankSum`]).
pub(crate) struct Block<T> {
    attn_norm: RmsNorm<T>,
    attn: Attention<T>,
    mlp_norm: RmsNorm<T>,
    mlp: Mlp<T>,
    hidden: usize,
}

impl<T: Element> Block<T> {
    /// Uploads layer `layer`'s weights `w` (its nine tensors in [`Weights::names`] order: a host
    /// layer's [`LayerWeights::sources`], or a mapped checkpoint's) through `uploader`; Q, K and V
    /// projections become one `[(h_q + 2·h_kv)·d, hidden]` weight. `cfg` gives the shapes of `w` (a
    /// tensor-parallel rank's: its heads, its MLP rows); `adds_residual`: the two projections whose
    /// output is summed into `x` add `x` in their epilogue where they are all-reduced or alone (every
    /// rank but the first of a tensor-parallel model leaves it out; a gathered pass adds it in the sum
    /// on every rank); `reduced`: those two outputs are all-reduced (a tensor-parallel rank), so their
    /// GEMVs do not let the next kernel start early ([`Linear::before_collective`]).
    ///
    /// [`Weights::names`]: crate::weights::Weights::names
    /// [`LayerWeights::sources`]: crate::weights::LayerWeights::sources
    pub(crate) fn new(
        ctx: &Cudnn,
        uploader: &mut Uploader,
        cfg: &LlamaConfig,
        layer: usize,
        w: [&dyn Source<T>; 9],
        [adds_residual, reduced]: [bool; 2],
    ) -> Result<Self> {
        let [attn_norm, q, k, v, o, mlp_norm, gate, up, down] = w;
        let mut upload = |parts: &[&dyn Source<T>]| uploader.upload_from(ctx, parts);
        let (hidden, eps) = (cfg.hidden, cfg.rms_eps as f32);
        Ok(Block {
            attn_norm: RmsNorm::new(upload(&[attn_norm])?, hidden, eps, Site::ATTN_PRENORM, Some(layer)),
            attn: Attention {
                qkv_proj: Linear::new(upload(&[q, k, v])?, hidden, cfg.qkv_width()),
                o_proj: Linear::new(upload(&[o])?, cfg.attn_width(), hidden).before_collective(reduced),
                heads: cfg.heads,
                kv_heads: cfg.kv_heads,
                head_dim: cfg.head_dim,
                layer,
                adds_residual,
            },
            mlp_norm: RmsNorm::new(upload(&[mlp_norm])?, hidden, eps, Site::MLP_PRENORM, Some(layer)),
            mlp: Mlp {
                gate: Linear::new(upload(&[gate])?, hidden, cfg.ffn),
                up: Linear::new(upload(&[up])?, hidden, cfg.ffn),
                down: Linear::new(upload(&[down])?, cfg.ffn, hidden).before_collective(reduced),
                layer,
                adds_residual,
            },
            hidden,
        })
    }

    /// Quantizes the layer's five projections to E4M3 with `scales` factors
    /// ([`Linear::fp8_weight`]); the norms stay in the model's dtype. All five or none: a failure
    /// leaves the layer as it was (its gate and up must stay in one form for the gate-up GEMV).
    pub(crate) fn quantize_to_fp8(&mut self, ctx: &Cudnn, scales: WeightScales) -> Result<()> {
        let linears = [
            &mut self.attn.qkv_proj,
            &mut self.attn.o_proj,
            &mut self.mlp.gate,
            &mut self.mlp.up,
            &mut self.mlp.down,
        ];
        let quantized =
            linears.iter().map(|l| l.fp8_weight(ctx, scales)).collect::<cudnn_llm_ops::Result<Vec<_>>>()?;
        for (linear, weight) in linears.into_iter().zip(quantized) {
            if let Some(w) = weight {
                linear.set_weight(w);
            }
        }
        Ok(())
    }

    /// Bytes of the layer's projection weights on the device.
    pub(crate) fn linear_bytes(&self) -> usize {
        [&self.attn.qkv_proj, &self.attn.o_proj, &self.mlp.gate, &self.mlp.up, &self.mlp.down]
            .iter()
            .map(|l| l.weight_bytes())
            .sum()
    }

    /// The layer over the pass's tokens, appending their K and V to `cache`; with `ranks` (a
    /// tensor-parallel rank), each residual sum is summed over the ranks ([`RankSum`]). A fused one-token step
    /// folds what the pass's [`DecodeFusion`](super::DecodeFusion) asks for ([`Block::folds`]).
    pub(crate) fn forward(
        &self,
        p: &mut Pass<'_, T>,
        x: &mut Residual<T>,
        s: &mut Scratch<T>,
        cache: KvLayer<'_, T>,
        ranks: Option<&RankSum<'_, T>>,
    ) -> Result<()> {
        if ranks.is_none() && self.runs_whole(p, cache.max_seq) {
            return self.whole(p, x, cache);
        }
        self.attention(p, x, s, cache, ranks)?;
        self.sum_over_ranks(p, ranks, ATTN_ALLREDUCE_RANGE, x)?;
        self.mlp(p, x, s, ranks)?;
        self.sum_over_ranks(p, ranks, MLP_ALLREDUCE_RANGE, x)
    }

    /// `x += attn(attn_norm(x))`, on a tensor-parallel rank up to the rank's part of the sum:
    /// [`Block::sum_over_ranks`] with [`ATTN_ALLREDUCE_RANGE`] completes it (a halved pass runs the
    /// other half in between).
    pub(crate) fn attention(
        &self,
        p: &mut Pass<'_, T>,
        x: &mut Residual<T>,
        s: &mut Scratch<T>,
        cache: KvLayer<'_, T>,
        ranks: Option<&RankSum<'_, T>>,
    ) -> Result<()> {
        let Scratch { h, attn, .. } = s;
        let Folds { attn_norm: fold, rope, .. } = self.folds(p);
        if fold {
            self.attn_norm.folded(p);
        } else {
            self.attn_norm.forward(p, x.get(), h)?;
        }
        x.add(|x, sum| {
            let input = if fold { Normed::Folded { x, norm: &self.attn_norm, h } } else { Normed::Done(h) };
            self.attn.forward(p, input, attn, cache, x, sum, rope, ranks)
        })
    }

    /// `x += mlp(mlp_norm(x))`, on a tensor-parallel rank up to the rank's part of the sum (as
    /// [`Block::attention`], with [`MLP_ALLREDUCE_RANGE`]).
    pub(crate) fn mlp(
        &self,
        p: &mut Pass<'_, T>,
        x: &mut Residual<T>,
        s: &mut Scratch<T>,
        ranks: Option<&RankSum<'_, T>>,
    ) -> Result<()> {
        let Scratch { h, mlp, .. } = s;
        let Folds { mlp_norm: fold, gate_up, .. } = self.folds(p);
        if fold {
            self.mlp_norm.folded(p);
        } else {
            self.mlp_norm.forward(p, x.get(), h)?;
        }
        x.add(|x, sum| {
            let input = if fold { Normed::Folded { x, norm: &self.mlp_norm, h } } else { Normed::Done(h) };
            self.mlp.forward(p, input, mlp, x, sum, gate_up, ranks)
        })
    }

    /// Whether the two projections before this layer's all-reduces run the fused backend's decode
    /// GEMV under `backends` in a pass of `rows` rows: fused, at most
    /// [`DECODE_GEMV_AUTO_TOKENS`](cudnn_llm_ops::DECODE_GEMV_AUTO_TOKENS) rows, shapes the plain GEMV
    /// takes. Only then may the pass keep x in a symmetric window
    /// ([`crate::nccl::Comm::window_pair`]), whose all-reduces do not wait for the kernel before them
    /// (the GEMV, told so, lets nothing start before it ends; a cuDNN plan's or cuBLAS's kernels are
    /// not known not to).
    pub(crate) fn gemvs_before_reduces(&self, backends: &crate::Backends, rows: usize) -> bool {
        let layer = Some(self.attn.layer);
        rows <= cudnn_llm_ops::DECODE_GEMV_AUTO_TOKENS
            && [Site::O_PROJ, Site::MLP].iter().all(|s| backends.get(layer, s.kind) == Backend::Fused)
            && [&self.attn.o_proj, &self.mlp.down].iter().all(|l| l.takes_decode_form(false, false))
    }

    /// The layer's shapes as the one-launch decode layer takes them.
    fn layer_args(&self, max_seq: usize) -> DecodeLayerArgs {
        let a = &self.attn;
        DecodeLayerArgs::new(
            self.hidden,
            a.heads,
            a.kv_heads,
            a.head_dim,
            self.mlp.gate.out_features,
            self.attn_norm.epsilon(),
            max_seq,
        )
    }

    /// Whether this pass runs the layer in one launch ([`DecodeFusion::whole_layer`](super::DecodeFusion)):
    /// a one-token step on device positions, every module of the layer fused, 16-bit weights, both
    /// residuals added here (a single GPU's layer), shapes the kernel takes (over caches of
    /// `max_seq` rows).
    fn runs_whole(&self, p: &Pass<'_, T>, max_seq: usize) -> bool {
        let layer = Some(self.attn.layer);
        let linears = [&self.attn.qkv_proj, &self.attn.o_proj, &self.mlp.gate, &self.mlp.up, &self.mlp.down];
        p.fusion.whole_layer
            && p.tokens.rows() == 1
            && p.positions.on_device
            && self.attn.adds_residual
            && self.mlp.adds_residual
            && Site::ALL
                .iter()
                .filter(|s| s.range.starts_with("fwd.layer."))
                .all(|&s| p.dispatch.backend(s, layer) == Backend::Fused)
            && linears.iter().all(|l| l.plain().is_some())
            && self.layer_args(max_seq).refusal().is_none()
    }

    /// The layer in one launch ([`cudnn_llm_ops::decode_layer`]), inside the range
    /// [`WHOLE_LAYER_RANGE`]: `x` becomes `x1 + mlp(mlp_norm(x1))` with `x1 = x + attn(attn_norm(x))`.
    fn whole(&self, p: &mut Pass<'_, T>, x: &mut Residual<T>, cache: KvLayer<'_, T>) -> Result<()> {
        let (ctx, tables) = (p.ctx, p.rope);
        let KvLayer { k, v, max_seq, positions, .. } = cache;
        let args = self.layer_args(max_seq);
        fn plain<T: Element>(l: &Linear<T>) -> Result<&CudaSlice<T>> {
            l.plain().ok_or_else(|| crate::Error::Config("the one-launch decode layer: an FP8 weight".into()))
        }
        let w = DecodeLayerWeights {
            attn_norm: self.attn_norm.weight(),
            qkv: plain(&self.attn.qkv_proj)?,
            o: plain(&self.attn.o_proj)?,
            mlp_norm: self.mlp_norm.weight(),
            gate: plain(&self.mlp.gate)?,
            up: plain(&self.mlp.up)?,
            down: plain(&self.mlp.down)?,
        };
        p.dispatch.observe(WHOLE_LAYER_RANGE, Some(self.attn.layer), || {
            x.add(|x, y| {
                let ops = DecodeLayerOperands { x, w, tables, position: positions, k, v, y };
                decode_layer(ctx, args, ops).map_err(crate::Error::from)
            })
        })
    }

    /// What this layer folds in this pass ([`Folds`]). Only a one-token pass whose modules involved
    /// all run fused, with the decode GEMV taking the form, and as the pass's
    /// [`DecodeFusion`](super::DecodeFusion) asks; RoPE only where the step reads its position on the
    /// device (the rotary epilogue takes no host position).
    fn folds(&self, p: &Pass<'_, T>) -> Folds {
        let f = p.fusion;
        if p.tokens.rows() != 1 {
            return Folds::default();
        }
        let layer = Some(self.attn.layer);
        let fused = |site: Site| p.dispatch.backend(site, layer) == Backend::Fused;
        let norm = f.norm_into_projection;
        let attn_norm =
            norm && fused(Site::ATTN_PRENORM) && fused(Site::QKV_PROJ) && self.attn.takes_folded_norm();
        let gate_up = f.gate_up && fused(Site::MLP) && self.mlp.takes_gate_up(false);
        // Without gate_up, the up and the gate GEMV each normalize x.
        let mlp_norm =
            norm && fused(Site::MLP_PRENORM) && fused(Site::MLP) && self.mlp.takes_folded_norm(gate_up);
        let rope = f.rope_into_qkv
            && p.positions.on_device
            && fused(Site::QKV_PROJ)
            && fused(Site::ROPE)
            && self.attn.takes_rotary(attn_norm);
        Folds { attn_norm, mlp_norm, gate_up, rope }
    }

    /// Completes the sum of the pass's rows of `x` (the sum [`Block::attention`] or
    /// [`Block::mlp`] just wrote) over the ranks, inside `range` (nothing without `ranks`): their
    /// all-reduce, or the sums of the gathered chunks ([`RankSum::finish`]).
    pub(crate) fn sum_over_ranks(
        &self,
        p: &mut Pass<'_, T>,
        ranks: Option<&RankSum<'_, T>>,
        range: &'static str,
        x: &mut Residual<T>,
    ) -> Result<()> {
        let Some(ranks) = ranks else { return Ok(()) };
        let (ctx, n) = (p.ctx, p.tokens.rows() * self.hidden);
        let (x, sum) = x.last_add();
        p.dispatch.observe(range, Some(self.attn.layer), || ranks.finish(ctx, x, sum, n))
    }

    /// [`Block::forward`] over a paged KV cache's step begun (continuous batching;
    /// `modules/paged.rs`).
    pub(crate) fn forward_paged(
        &self,
        p: &mut Pass<'_, T>,
        x: &mut Residual<T>,
        s: &mut Scratch<T>,
        cache: &mut cudnn_llm_ops::PagedKvCache<T>,
    ) -> Result<()> {
        let Scratch { h, attn, mlp } = s;
        self.attn_norm.forward(p, x.get(), h)?;
        x.add(|x, sum| self.attn.forward_paged(p, h, attn, cache, x, sum))?;
        self.mlp_norm.forward(p, x.get(), h)?;
        x.add(|x, sum| self.mlp.forward(p, Normed::Done(h), mlp, x, sum, false, None))
    }
}

/// What a layer folds in a fused one-token step ([`Block::folds`]).
#[derive(Debug, Clone, Copy, Default)]
struct Folds {
    /// Attention's prenorm into `qkv_proj`.
    attn_norm: bool,
    /// The MLP's prenorm into gate and up.
    mlp_norm: bool,
    /// Gate and up in one GEMV.
    gate_up: bool,
    /// RoPE and the K/V append into `qkv_proj`.
    rope: bool,
}
