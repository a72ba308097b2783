//! Grouped-query attention in training: full causal sequences from position 0 (top-left mask), no
//! cache. The forward keeps the rotated Q, K and V in the fused QKV buffer, the attention output and
//! its log-sum-exp stats; the backward writes dQ, dK and dV interleaved into one fused gradient
//! buffer ([`QkvViews`]), which RoPE's backward rotates in place and the QKV projection's backward
//! reads.

use super::linear::Linear;
use super::params::Layer;
use super::views::QkvViews;
use super::Pass;
use crate::backends::Site;
use crate::modules::linear::Then;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{
    rope, rope_backward, sdpa, sdpa_backward, Element, Layout, Mask, RopeArgs, RopeBackwardOperands,
    RopeOperands, SdpaArgs, SdpaGrads, SdpaOperands,
};

/// What the attention's forward saves.
pub(crate) struct Saved<T> {
    /// The prenorm's output, `[rows, hidden]` (the QKV projection's input).
    pub(crate) h: CudaSlice<T>,
    /// The prenorm's f32 inverse RMS per row.
    pub(crate) inv: CudaSlice<f32>,
    /// Q, K and V rows `[rows, (h_q + 2·h_kv)·d]`, Q and K rotated.
    pub(crate) qkv: CudaSlice<T>,
    /// The attention output `[rows, h_q·d]`.
    pub(crate) o: CudaSlice<T>,
    /// The f32 log-sum-exp of each score row, `[batch, h_q, seq]`.
    pub(crate) stats: CudaSlice<f32>,
}

/// The attention's backward scratch.
pub(crate) struct Scratch<T> {
    /// dO `[rows, h_q·d]`.
    pub(crate) d_o: CudaSlice<T>,
    /// dQ, dK and dV rows, like the QKV buffer.
    pub(crate) dqkv: CudaSlice<T>,
}

/// The attention of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attention {
    pub(crate) layer: usize,
}

impl Attention {
    fn dims<T: Element>(p: &Pass<'_, T>) -> (usize, usize, usize, usize) {
        let c = p.cfg;
        (c.heads, c.kv_heads, c.head_dim, c.qkv_width())
    }

    /// The attention over the fused QKV rows: Q, K and V read through strides, O packed.
    fn sdpa_args<T: Element>(p: &Pass<'_, T>) -> SdpaArgs {
        let (hq, hkv, d, w) = Self::dims(p);
        let mut a =
            SdpaArgs::new(p.batch, hq, hkv, p.seq, p.seq, d, Layout::Bshd).with_mask(Mask::CausalTopLeft);
        let strides = [p.seq * w, d, w, 1];
        (a.q_strides, a.k_strides, a.v_strides) = (strides, strides, strides);
        a
    }

    fn rope_args<T: Element>(p: &Pass<'_, T>) -> RopeArgs {
        let (hq, hkv, d, _) = Self::dims(p);
        RopeArgs::new(p.batch, p.seq, hq, hkv, d)
    }

    /// The fallback key of the attention: its sequences and mask (as inference names it).
    fn attn_shape<T: Element>(p: &Pass<'_, T>) -> String {
        format!("{}x{} {}", p.batch, p.seq, Mask::CausalTopLeft.name())
    }

    /// `x_mid = x + o_proj(gqa(rope(qkv_proj(s.h))))`, keeping what the backward reads in `s`.
    pub(crate) fn forward<T: Element>(
        &self,
        p: &mut Pass<'_, T>,
        w: &Layer<&CudaSlice<T>>,
        x: &CudaSlice<T>,
        s: &mut Saved<T>,
        x_mid: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (ctx, at) = (p.ctx, Some(self.layer));
        let (hq, hkv, d, width) = Self::dims(p);
        let (rows, hidden) = (p.rows(), p.cfg.hidden);
        let Saved { h, qkv, o, stats, .. } = s;
        let proj = Linear::new(rows, hidden, width);
        p.dispatch
            .run(Site::QKV_PROJ, at, &p.shape, |b| proj.forward(ctx, b, &*h, w.qkv, Then::Nothing, qkv))?;
        let (rope_args, tables) = (Self::rope_args(p), p.rope);
        p.dispatch
            .run(Site::ROPE, at, &p.shape, |b| rope(ctx, rope_args, RopeOperands::new(tables, qkv), b))?;
        let (args, shape) = (Self::sdpa_args(p), Self::attn_shape(p));
        p.dispatch.run(Site::GQA, at, &shape, |b| {
            let (q, k, v) = (qkv.slice(..), qkv.slice(hq * d..), qkv.slice((hq + hkv) * d..));
            sdpa(ctx, args, SdpaOperands::new(&q, &k, &v, o).stats(stats), b)
        })?;
        let out = Linear::new(rows, hq * d, hidden);
        p.dispatch
            .run(Site::O_PROJ, at, &p.shape, |b| out.forward(ctx, b, &*o, w.o_proj, Then::AddTo(x), x_mid))
    }

    /// From `g`, the gradient of `x_mid`: the gradients of the O, QKV projections' weights (into
    /// their f32 sums) and `dh`, the gradient of the prenorm's output.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<T: Element>(
        &self,
        p: &mut Pass<'_, T>,
        w: &Layer<&CudaSlice<T>>,
        grads: &mut Layer<&mut CudaSlice<f32>>,
        s: &Saved<T>,
        g: &CudaSlice<T>,
        scratch: &mut Scratch<T>,
        dh: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (ctx, at, acc) = (p.ctx, Some(self.layer), p.accumulate);
        let (hq, hkv, d, width) = Self::dims(p);
        let (rows, hidden) = (p.rows(), p.cfg.hidden);
        let Scratch { d_o, dqkv } = scratch;
        let Saved { h, qkv, o, stats, .. } = s;
        let out = Linear::new(rows, hq * d, hidden);
        p.dispatch.run_each(Site::O_PROJ.backward(), at, &p.shape, |ops| {
            ops.run(|b| out.data_grad(ctx, b, g, w.o_proj, &mut *d_o, false))?;
            ops.run(|b| out.weight_grad(ctx, b, g, o, &mut *grads.o_proj, acc))
        })?;
        let (args, shape) = (Self::sdpa_args(p), Self::attn_shape(p));
        p.dispatch.run_each(Site::GQA.backward(), at, &shape, |ops| {
            ops.run(|b| {
                let (q, k, v) = (qkv.slice(..), qkv.slice(hq * d..), qkv.slice((hq + hkv) * d..));
                let mut views = QkvViews::new(&mut *dqkv, ctx.stream(), hq, hkv, d);
                let [dq, dk, dv] = &mut views.views;
                let x = SdpaGrads::new(&q, &k, &v, o, &*d_o, dq, dk, dv).stats(stats);
                sdpa_backward(ctx, args, x, b)
            })
        })?;
        let (rope_args, tables) = (Self::rope_args(p), p.rope);
        p.dispatch.run_each(Site::ROPE.backward(), at, &p.shape, |ops| {
            ops.run(|b| rope_backward(ctx, rope_args, RopeBackwardOperands::new(tables, &mut *dqkv), b))
        })?;
        let proj = Linear::new(rows, hidden, width);
        p.dispatch.run_each(Site::QKV_PROJ.backward(), at, &p.shape, |ops| {
            ops.run(|b| proj.data_grad(ctx, b, &*dqkv, w.qkv, &mut *dh, false))?;
            ops.run(|b| proj.weight_grad(ctx, b, &*dqkv, h, &mut *grads.qkv, acc))
        })
    }
}
