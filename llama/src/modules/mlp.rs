//! The SwiGLU MLP.

use super::linear::{Linear, Then};
use super::norm::Normed;
use super::reduce::RankSum;
use super::Pass;
use crate::backends::Site;
use crate::{Backend, Result};
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
    /// and the residual add in their epilogues; with `gate_up` (a fused one-token step), gate and up
    /// in one GEMV. `h` may be x with the prenorm folded into the gate and up projections. `down`
    /// runs through `ranks` on a tensor-parallel rank ([`RankSum::project`]: gathered, `sum` is
    /// written, `x` added, when the sum over the ranks completes).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        p: &mut Pass<'_, T>,
        mut h: Normed<'_, T>,
        bufs: &mut MlpBuffers<T>,
        x: &CudaSlice<T>,
        sum: &mut CudaSlice<T>,
        gate_up: bool,
        ranks: Option<&RankSum<'_, T>>,
    ) -> Result<()> {
        let (ctx, rows) = (p.ctx, p.tokens.rows());
        let MlpBuffers { up, act } = bufs;
        p.dispatch.run(Site::MLP, Some(self.layer), &p.shape, |b| {
            if gate_up && b == Backend::Fused {
                self.gate.forward_normed(b, ctx, rows, &mut h, Then::SwiGluOf(&self.up), act)?;
            } else {
                self.up.forward_normed(b, ctx, rows, &mut h, Then::Nothing, up)?;
                self.gate.forward_normed(b, ctx, rows, &mut h, Then::SwiGlu(up), act)?;
            }
            RankSum::project(ranks, ctx, b, rows, x, self.adds_residual, sum, |b, r, residual, out| {
                self.down.forward_rows(b, ctx, r, act, residual, out)
            })
        })
    }

    /// Whether the fused decode GEMV takes gate and up in one launch at one token.
    pub(crate) fn takes_gate_up(&self, norm: bool) -> bool {
        self.gate.takes_decode_form(norm, true)
    }

    /// Whether the fused decode GEMV takes the prenorm folded in at one token: into the one gate-up
    /// launch, or into each of up and gate.
    pub(crate) fn takes_folded_norm(&self, gate_up: bool) -> bool {
        if gate_up {
            self.takes_gate_up(true)
        } else {
            self.up.takes_decode_form(true, false) && self.gate.takes_decode_form(true, false)
        }
    }
}
