//! RMSNorm in training: the forward saves each row's inverse RMS; the backward adds the residual
//! stream's gradient to dx and sums the weight's gradient over micro-batches in f32.

use super::linear::add_into;
use super::Pass;
use crate::backends::Site;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{
    rms_norm, rms_norm_backward, Backend, Element, RmsNormArgs, RmsNormGrads, RmsNormOperands,
};

/// A norm's place in the model: a prenorm of layer `layer`, or the output norm (`None`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Norm {
    pub(crate) site: Site,
    pub(crate) layer: Option<usize>,
}

/// The buffers of a norm's backward.
pub(crate) struct NormGrad<'a, T> {
    /// The norm's weight, input and the forward's inverse RMS.
    pub(crate) w: &'a CudaSlice<T>,
    pub(crate) x: &'a CudaSlice<T>,
    pub(crate) inv: &'a CudaSlice<f32>,
    /// The gradient of the norm's output.
    pub(crate) dy: &'a CudaSlice<T>,
    /// The residual stream's gradient after the norm's layer half (a prenorm), added to dx.
    pub(crate) residual: Option<&'a CudaSlice<T>>,
    /// The gradient of x: the stream's gradient before the layer half (written).
    pub(crate) dx: &'a mut CudaSlice<T>,
    /// Scratch for the weight's gradient of this micro-batch, `[hidden]`.
    pub(crate) dweight: &'a mut CudaSlice<T>,
    /// The weight's f32 gradient, summed over the step's micro-batches.
    pub(crate) grad: &'a mut CudaSlice<f32>,
}

impl Norm {
    fn args<T: Element>(&self, p: &Pass<'_, T>) -> RmsNormArgs {
        RmsNormArgs::new(p.rows(), p.cfg.hidden, p.cfg.rms_eps as f32)
    }

    /// `y = rms_norm(x) · w`, saving the f32 inverse RMS of each row in `inv`.
    pub(crate) fn forward<T: Element>(
        &self,
        p: &mut Pass<'_, T>,
        w: &CudaSlice<T>,
        x: &CudaSlice<T>,
        y: &mut CudaSlice<T>,
        inv: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (ctx, args) = (p.ctx, self.args(p));
        p.dispatch.run(self.site, self.layer, &p.shape, |b| {
            rms_norm(ctx, args, RmsNormOperands::new(x, w, y).inv_rms(inv), b)
        })
    }

    /// `dx = norm'(dy) (+ residual)`, and the weight's gradient into its f32 sum. A fused norm
    /// backward adds the residual in its graph where cuDNN can (9.21); before, the add is a second
    /// call ([`add_into`]).
    pub(crate) fn backward<T: Element>(&self, p: &mut Pass<'_, T>, g: NormGrad<'_, T>) -> Result<()> {
        let (ctx, args, eye, accumulate) = (p.ctx, self.args(p), p.eye, p.accumulate);
        let NormGrad { w, x, inv, dy, residual, dx, dweight, grad } = g;
        let n = p.rows() * p.cfg.hidden;
        let hidden = p.cfg.hidden;
        let fused_add = ctx.features().rmsnorm_backward_add();
        p.dispatch.run_each(self.site.backward(), self.layer, &p.shape, |ops| {
            match residual {
                Some(r) if ops.backend() == Backend::Naive || fused_add => ops.run(|b| {
                    let x = RmsNormGrads::new(dy, x, w, inv, &mut *dx, &mut *dweight).d_residual(r);
                    rms_norm_backward(ctx, args, x, b)
                })?,
                _ => {
                    ops.run(|b| {
                        rms_norm_backward(
                            ctx,
                            args,
                            RmsNormGrads::new(dy, x, w, inv, &mut *dx, &mut *dweight),
                            b,
                        )
                    })?;
                    if let Some(r) = residual {
                        ops.run(|b| add_into(ctx, b, eye, r, &mut *dx, n, true))?;
                    }
                }
            }
            ops.run(|b| add_into(ctx, b, eye, &*dweight, &mut *grad, hidden, accumulate))
        })
    }
}
