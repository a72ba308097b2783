//! RMSNorm.

use super::Pass;
use crate::backends::Site;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{rms_norm, Element, RmsNormArgs, RmsNormOperands};

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
        let args = RmsNormArgs::new(p.tokens.rows(), self.hidden, self.epsilon);
        let ctx = p.ctx;
        p.dispatch.run(self.site, self.layer, &p.shape, |b| {
            rms_norm(ctx, args, RmsNormOperands::new(x, &self.weight, out), b)
        })
    }
}
