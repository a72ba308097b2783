//! The SwiGLU MLP in training. The forward is inference's (the up projection, the gate projection
//! with the SwiGLU epilogue, the down projection with the residual epilogue) and keeps `up` and the
//! activation `silu(gate) ⊙ up`; the backward recomputes the gate projection (no epilogue writes it
//! beside the activation), then runs the SwiGLU backward fused into the down projection's data
//! gradient.

use super::linear::Linear;
use super::params::Layer;
use super::Pass;
use crate::backends::Site;
use crate::modules::linear::Then;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{swiglu_down_backward, Element, LinearGradArgs, SwigluGrads};

/// What the MLP's forward saves.
pub(crate) struct Saved<T> {
    /// The prenorm's output `[rows, hidden]` and its f32 inverse RMS per row.
    pub(crate) h: CudaSlice<T>,
    pub(crate) inv: CudaSlice<f32>,
    /// The up projection `[rows, ffn]`.
    pub(crate) up: CudaSlice<T>,
    /// `silu(gate) ⊙ up`, `[rows, ffn]` (the down projection's input).
    pub(crate) act: CudaSlice<T>,
}

/// The MLP's backward scratch, `[rows, ffn]` each.
pub(crate) struct Scratch<T> {
    /// The gate projection, recomputed.
    pub(crate) gate: CudaSlice<T>,
    pub(crate) d_gate: CudaSlice<T>,
    pub(crate) d_up: CudaSlice<T>,
}

/// The MLP of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mlp {
    pub(crate) layer: usize,
}

impl Mlp {
    /// `x_next = x_mid + down(silu(gate(s.h)) ⊙ up(s.h))`, keeping `up` and the activation.
    pub(crate) fn forward<T: Element>(
        &self,
        p: &mut Pass<'_, T>,
        w: &Layer<&CudaSlice<T>>,
        x_mid: &CudaSlice<T>,
        s: &mut Saved<T>,
        x_next: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (ctx, (hidden, ffn)) = (p.ctx, (p.cfg.hidden, p.cfg.ffn));
        let (inner, down) = (Linear::new(p.rows(), hidden, ffn), Linear::new(p.rows(), ffn, hidden));
        let Saved { h, up, act, .. } = s;
        p.dispatch.run(Site::MLP, Some(self.layer), &p.shape, |b| {
            inner.forward(ctx, b, &*h, w.up, Then::Nothing, &mut *up)?;
            inner.forward(ctx, b, &*h, w.gate, Then::SwiGlu(&*up), &mut *act)?;
            down.forward(ctx, b, &*act, w.down, Then::AddTo(x_mid), &mut *x_next)
        })
    }

    /// From `g`, the gradient of `x_next`: the gradients of the three weights (into their f32 sums)
    /// and `dh`, the gradient of the prenorm's output.
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
        let (ctx, acc, (hidden, ffn)) = (p.ctx, p.accumulate, (p.cfg.hidden, p.cfg.ffn));
        let rows = p.rows();
        let (inner, down) = (Linear::new(rows, hidden, ffn), Linear::new(rows, ffn, hidden));
        let Scratch { gate, d_gate, d_up } = scratch;
        let Saved { h, up, act, .. } = s;
        p.dispatch.run_each(Site::MLP.backward(), Some(self.layer), &p.shape, |ops| {
            ops.run(|b| inner.forward(ctx, b, h, w.gate, Then::Nothing, &mut *gate))?;
            ops.run(|b| {
                let x = SwigluGrads::new(g, w.down, &*gate, up, &mut *d_gate, &mut *d_up);
                swiglu_down_backward(ctx, &LinearGradArgs::new(rows, ffn, hidden), x, b)
            })?;
            ops.run(|b| down.weight_grad(ctx, b, g, act, &mut *grads.down, acc))?;
            ops.run(|b| inner.weight_grad(ctx, b, &*d_gate, h, &mut *grads.gate, acc))?;
            ops.run(|b| inner.weight_grad(ctx, b, &*d_up, h, &mut *grads.up, acc))?;
            ops.run(|b| inner.data_grad(ctx, b, &*d_gate, w.gate, &mut *dh, false))?;
            ops.run(|b| inner.data_grad(ctx, b, &*d_up, w.up, &mut *dh, true))
        })
    }
}
