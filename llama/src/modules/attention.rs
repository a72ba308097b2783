//! Grouped-query attention with RoPE and a KV cache.

use super::linear::{Linear, Then};
use super::norm::Normed;
use super::reduce::RankSum;
use super::{Pass, Positions, Tokens};
use crate::backends::Site;
use crate::{Backend, Result};
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{
    rope, sdpa, Element, KvLayer, Layout, Mask, RopeArgs, RopeOperands, Rotary, RotaryOperands, SdpaArgs,
    SdpaOperands,
};

/// Attention's scratch: the fused Q/K/V rows and the attention output.
pub(crate) struct AttnBuffers<T> {
    pub(crate) qkv: CudaSlice<T>,
    pub(crate) o: CudaSlice<T>,
}

/// `o_proj(gqa(rope(qkv_proj(h))))`, with `heads` query heads sharing `kv_heads` K/V heads.
pub(crate) struct Attention<T> {
    pub(crate) qkv_proj: Linear<T>,
    pub(crate) o_proj: Linear<T>,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) layer: usize,
    /// `o_proj`'s epilogue adds the residual `x`; false on the tensor-parallel ranks but the first,
    /// whose partial sums the all-reduce adds to the first rank's `x + o_proj(o)`. (A gathered pass
    /// adds `x` in the sum over the ranks instead, on every rank: [`RankSum::project`].)
    pub(crate) adds_residual: bool,
}

impl<T: Element> Attention<T> {
    /// `sum = x + attn(h)` (`attn(h)` alone without [`Attention::adds_residual`]; on a
    /// tensor-parallel rank the rank's part, [`RankSum::project`]), appending the
    /// pass's K and V to `cache`; with `fold_rope` (a fused one-token step on device positions,
    /// `Block::folds`) RoPE and the append run in `qkv_proj`'s GEMV and the RoPE range stays empty.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        p: &mut Pass<'_, T>,
        h: Normed<'_, T>,
        bufs: &mut AttnBuffers<T>,
        mut cache: KvLayer<'_, T>,
        x: &CudaSlice<T>,
        sum: &mut CudaSlice<T>,
        fold_rope: bool,
        ranks: Option<&RankSum<'_, T>>,
    ) -> Result<()> {
        let AttnBuffers { qkv, o } = bufs;
        if fold_rope {
            self.project_qkv_rotated(p, h, qkv, &mut cache)?;
            p.dispatch.observe(Site::ROPE.range, Some(self.layer), || ());
        } else {
            self.project_qkv(p, h, qkv)?;
            self.rope(p, qkv, &mut cache)?;
        }
        self.gqa(p, qkv, cache, o)?;
        self.project_o(p, o, x, sum, ranks)
    }

    /// The QKV projection of the pass's rows of `h` into `qkv` (`h` may be x with the prenorm
    /// folded into the projection).
    pub(super) fn project_qkv(
        &self,
        p: &mut Pass<'_, T>,
        mut h: Normed<'_, T>,
        qkv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (ctx, rows) = (p.ctx, p.tokens.rows());
        p.dispatch.run(Site::QKV_PROJ, Some(self.layer), &p.shape, |b| {
            self.qkv_proj.forward_normed(b, ctx, rows, &mut h, Then::Nothing, qkv)
        })
    }

    /// [`Attention::project_qkv`] of one token with RoPE and the K/V append in its epilogue: the
    /// position from the cache's device buffer, the rotated K and the V heads to that cache row.
    fn project_qkv_rotated(
        &self,
        p: &mut Pass<'_, T>,
        mut h: Normed<'_, T>,
        qkv: &mut CudaSlice<T>,
        cache: &mut KvLayer<'_, T>,
    ) -> Result<()> {
        let (ctx, rows, tables) = (p.ctx, p.tokens.rows(), p.rope);
        let rotary = Rotary::new(self.heads, self.kv_heads, self.head_dim, cache.max_seq);
        let KvLayer { k, v, positions, .. } = cache;
        p.dispatch.run(Site::QKV_PROJ, Some(self.layer), &p.shape, |b| {
            let then = Then::Rotate(rotary, RotaryOperands::new(tables, positions, &mut **k, &mut **v));
            self.qkv_proj.forward_normed(b, ctx, rows, &mut h, then, qkv)
        })
    }

    /// Whether the fused decode GEMV takes `qkv_proj` at one token with the prenorm folded in.
    pub(crate) fn takes_folded_norm(&self) -> bool {
        self.qkv_proj.takes_decode_form(true, false)
    }

    /// Whether the fused decode GEMV takes `qkv_proj` at one token with RoPE and the K/V append in
    /// its epilogue (and the prenorm folded in with `norm`).
    pub(crate) fn takes_rotary(&self, norm: bool) -> bool {
        self.qkv_proj.takes_rotary(norm, Rotary::new(self.heads, self.kv_heads, self.head_dim, 1))
    }

    /// `sum = x + o_proj(o)` (`o_proj(o)` alone without [`Attention::adds_residual`]); on a
    /// tensor-parallel rank through `ranks` ([`RankSum::project`]: gathered, the rank's part goes to
    /// a window slot, and `sum` is written when the sum over the ranks completes).
    pub(super) fn project_o(
        &self,
        p: &mut Pass<'_, T>,
        o: &CudaSlice<T>,
        x: &CudaSlice<T>,
        sum: &mut CudaSlice<T>,
        ranks: Option<&RankSum<'_, T>>,
    ) -> Result<()> {
        let (ctx, rows) = (p.ctx, p.tokens.rows());
        p.dispatch.run(Site::O_PROJ, Some(self.layer), &p.shape, |b| {
            RankSum::project(ranks, ctx, b, rows, x, self.adds_residual, sum, |b, r, residual, out| {
                self.o_proj.forward_rows(b, ctx, r, o, residual, out)
            })
        })
    }

    /// Elements of a Q/K/V row: `(h_q + 2·h_kv)·d`.
    pub(super) fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Rotates Q and K in place and appends the rotated K and V to the cache (one kernel fused, as
    /// serving decoders do; eager: HF's rotation, then `StaticCache.update`'s two row copies); fused
    /// decode steps read the position on the device.
    fn rope(&self, p: &mut Pass<'_, T>, qkv: &mut CudaSlice<T>, cache: &mut KvLayer<'_, T>) -> Result<()> {
        let Tokens { batch, seq, start } = p.tokens;
        let (heads_q, heads_kv, head_dim, row_stride) =
            (self.heads, self.kv_heads, self.head_dim, self.width());
        let args = RopeArgs::new(batch, seq, heads_q, heads_kv, head_dim)
            .with_row_stride(row_stride)
            .with_start(start);
        let (ctx, tables, on_device) = (p.ctx, p.rope, p.positions.on_device);
        let baked = &mut p.positions.baked;
        let KvLayer { k, v, max_seq, positions, .. } = cache;
        p.dispatch.run(Site::ROPE, Some(self.layer), &p.shape, |b| {
            let x = RopeOperands::new(tables, qkv).append(*k, *v, *max_seq);
            if b == Backend::Fused && on_device {
                return rope(ctx, args, x.starts(*positions), b);
            }
            *baked = true;
            rope(ctx, args, x, b)
        })
    }

    /// Attends over the cache (the pass's K and V rows are in it, see [`Attention::rope`]): prefill
    /// with a top-left causal mask, later passes (decode, chunked prefill) bottom-right aligned over the
    /// cache. Fused decode steps all run one attention plan: the whole cache is its capacity and the
    /// lengths are device values (cuDNN 9.15+), so a new cache length builds no plan; the first layer
    /// clamps the lengths into the cache for all.
    fn gqa(
        &self,
        p: &mut Pass<'_, T>,
        qkv: &CudaSlice<T>,
        cache: KvLayer<'_, T>,
        o: &mut CudaSlice<T>,
    ) -> Result<()> {
        let Tokens { batch, seq, start } = p.tokens;
        let (hq, hkv, d, w) = (self.heads, self.kv_heads, self.head_dim, self.width());
        let KvLayer { k, v, max_seq, kv_lens, q_lens, seq_lens, .. } = cache;
        let mask = if start == 0 { Mask::CausalTopLeft } else { Mask::CausalBottomRight };
        let mut attn = SdpaArgs::new(batch, hq, hkv, seq, start + seq, d, Layout::Bshd).with_mask(mask);
        attn.q_strides = [seq * w, d, w, 1];
        let kv = [max_seq * hkv * d, d, hkv * d, 1];
        (attn.k_strides, attn.v_strides) = (kv, kv);
        // The fallback key leaves s_kv out, so decode steps do not retry a shape that failed.
        let attn_shape = format!("{batch}x{seq} {}", mask.name());
        let (ctx, on_device) = (p.ctx, p.positions.on_device);
        let Positions { padded, baked, lens_clamped, .. } = &mut p.positions;
        p.dispatch.run(Site::GQA, Some(self.layer), &attn_shape, |b| {
            if b == Backend::Fused && on_device && *padded {
                // One plan for every decode step: the whole cache as capacity, the lengths on the
                // device, clamped once per step.
                if !*lens_clamped {
                    seq_lens.clamp(ctx, q_lens, kv_lens)?;
                    *lens_clamped = true;
                }
                let mut padded_args = attn.with_mask(Mask::None).with_seq_lens();
                padded_args.seq_kv = max_seq;
                let padded_args = padded_args.with_decode_choice(ctx.decode_attention(), ctx.features());
                let x = SdpaOperands::new(qkv, &*k, &*v, o).clamped_seq_lens(seq_lens);
                match sdpa(ctx, padded_args, x, Backend::Fused) {
                    Err(cudnn_llm_ops::Error::NotSupported { .. }) => *padded = false,
                    done => return done,
                }
            }
            *baked = true;
            sdpa(ctx, attn, SdpaOperands::new(qkv, &*k, &*v, o), b)
        })
    }
}
