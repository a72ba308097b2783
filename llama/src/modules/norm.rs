//! RMSNorm.

use super::Pass;
use crate::backends::Site;
use crate::{Backend, Result};
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{rms_norm, Cudnn, Element, RmsNormArgs, RmsNormOperands};

/// `x / rms(x) · weight` over each row of `hidden` values; a prenorm of one layer or the output norm.
pub(crate) struct RmsNorm<T> {
    weight: CudaSlice<T>,
    hidden: usize,
    epsilon: f32,
    site: Site,
    layer: Option<usize>,
}

impl<T: Element> RmsNorm<T> {
    /// The norm at `site` of `layer` (`None`: the output norm).
    pub(crate) fn new(
        weight: CudaSlice<T>,
        hidden: usize,
        epsilon: f32,
        site: Site,
        layer: Option<usize>,
    ) -> Self {
        RmsNorm { weight, hidden, epsilon, site, layer }
    }

    /// `out = rms_norm(x) · weight`.
    pub(crate) fn forward(
        &self,
        p: &mut Pass<'_, T>,
        x: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (ctx, rows) = (p.ctx, p.tokens.rows());
        p.dispatch.run(self.site, self.layer, &p.shape, |b| self.apply(ctx, rows, x, out, b))
    }

    /// The norm folded into the projection after it ([`Normed::Folded`]): its range opens and closes
    /// with nothing in it, so that reports list it (empty) where the unfused step has it.
    pub(crate) fn folded(&self, p: &mut Pass<'_, T>) {
        p.dispatch.observe(self.site.range, self.layer, || ());
    }

    /// The op call on `backend`, outside any range: `out = rms_norm(x) · weight` over `rows` rows.
    pub(crate) fn apply(
        &self,
        ctx: &Cudnn,
        rows: usize,
        x: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        backend: Backend,
    ) -> cudnn_llm_ops::Result<()> {
        let args = RmsNormArgs::new(rows, self.hidden, self.epsilon);
        rms_norm(ctx, args, RmsNormOperands::new(x, &self.weight, out), backend)
    }

    /// The weight `[hidden]`.
    pub(crate) fn weight(&self) -> &CudaSlice<T> {
        &self.weight
    }

    /// ε.
    pub(crate) fn epsilon(&self) -> f32 {
        self.epsilon
    }
}

/// A projection's input: the normed rows, or the rows before a norm that the projection folds into
/// its decode GEMV (a fused one-token step, [`DecodeFusion`](super::DecodeFusion)).
pub(crate) enum Normed<'a, T> {
    /// `h = norm(x)`, already computed.
    Done(&'a CudaSlice<T>),
    /// `x` and its norm: fused, the GEMV normalizes x; on the naive backend (a fallback), the norm
    /// writes `h` first.
    Folded { x: &'a CudaSlice<T>, norm: &'a RmsNorm<T>, h: &'a mut CudaSlice<T> },
}
