//! The SwiGLU MLP.

use super::linear::{Linear, Then};
use super::Pass;
use crate::backends::Site;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::Element;

/// The MLP's scratch: `up(h)` and `silu(gate(h)) · up(h)`, `[rows, ffn]` each.
pub(crate) struct MlpBuffers<T> {
    pub(crate) up: CudaSlice<T>,
    pub(crate) act: CudaSlice<T>,
}

/// `down(silu(gate(h)) · up(h))`, as gpt-fast's `w2(silu(w1(x)) * w3(x))`.
pub(crate) struct Mlp<T> {
    pub(crate) gate: Linear<T>,
    pub(crate) up: Linear<T>,
    pub(crate) down: Linear<T>,
    pub(crate) layer: usize,
    /// `down`'s epilogue adds the residual `x` (as [`Attention::adds_residual`](super::attention::Attention::adds_residual)).
    pub(crate) adds_residual: bool,
}

impl<T: Element> Mlp<T> {
    /// `sum = x + mlp(h)` (`mlp(h)` alone without [`Mlp::adds_residual`]): three GEMMs, the SwiGLU
    /// and the residual add in their epilogues.
    pub(crate) fn forward(
        &self,
        p: &mut Pass<'_, T>,
        h: &CudaSlice<T>,
        bufs: &mut MlpBuffers<T>,
        x: &CudaSlice<T>,
        sum: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (ctx, rows) = (p.ctx, p.tokens.rows());
        let MlpBuffers { up, act } = bufs;
        p.dispatch.run(Site::MLP, Some(self.layer), &p.shape, |b| {
            self.up.forward(b, ctx, rows, h, Then::Nothing, up)?;
            self.gate.forward(b, ctx, rows, h, Then::SwiGlu(up), act)?;
            let then = if self.adds_residual { Then::AddTo(x) } else { Then::Nothing };
            self.down.forward(b, ctx, rows, act, then, sum)
        })
    }
}
