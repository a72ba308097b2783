//! RMSNorm over row-major `[tokens, hidden]`: `y = x / sqrt(mean(x²) + ε) * weight`, f32 compute,
//! I/O in bf16, f16 or f32. One cuDNN `NORM_FORWARD` (RMS_NORM) graph per shape, dtype and phase.

use crate::cache::PlanKey;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::{Graph, NormPhase};
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Shape and epsilon of an RMSNorm call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormArgs {
    /// Rows (tokens).
    pub tokens: usize,
    /// Row length (hidden size).
    pub hidden: usize,
    /// Added to the mean square before the square root.
    pub epsilon: f32,
}

impl RmsNormArgs {
    /// Checks the arguments and the buffer lengths shared by every backend; nothing is touched on error.
    pub fn check(
        &self,
        x_len: usize,
        weight_len: usize,
        y_len: usize,
        inv_rms_len: Option<usize>,
    ) -> Result<()> {
        let RmsNormArgs { tokens, hidden, epsilon } = *self;
        ensure!(tokens > 0, "rms_norm: tokens must be > 0");
        ensure!(hidden > 0, "rms_norm: hidden must be > 0");
        ensure!(epsilon.is_finite() && epsilon >= 0.0, "rms_norm: epsilon {epsilon} must be finite and >= 0");
        let n = crate::checked::product("rms_norm: tokens * hidden", &[tokens, hidden])?;
        ensure!(weight_len == hidden, "rms_norm: weight has {weight_len} elements, hidden is {hidden}");
        ensure!(x_len >= n, "rms_norm: x has {x_len} elements, needs tokens*hidden = {n}");
        ensure!(y_len >= n, "rms_norm: output has {y_len} elements, needs tokens*hidden = {n}");
        if let Some(len) = inv_rms_len {
            ensure!(len >= tokens, "rms_norm: inv_rms has {len} elements, needs tokens = {tokens}");
        }
        Ok(())
    }

    /// The plan-cache key for this shape.
    pub fn key(&self, dtype: DataType, phase: NormPhase) -> PlanKey {
        PlanKey::RmsNorm { tokens: self.tokens, hidden: self.hidden, row_stride: self.hidden, dtype, phase }
    }

    /// The cuDNN graph: X `[tokens, hidden, 1, 1]`, scale `[1, hidden, 1, 1]`, ε by value, Y like X, and in
    /// training inv_rms `[tokens, 1, 1, 1]` f32.
    pub fn graph(&self, dtype: DataType, phase: NormPhase) -> Graph {
        let (n, d) = (self.tokens as i64, self.hidden as i64);
        let mut g = Graph::new(format!("rmsnorm {n}x{d} {dtype} {}", phase.name()));
        let x = g.tensor(TensorSpec::new("X", &[n, d, 1, 1], dtype).with_strides(&[d, 1, d, d]));
        let w = g.tensor(TensorSpec::new("scale", &[1, d, 1, 1], dtype).with_strides(&[d, 1, d, d]));
        let eps = g.tensor(TensorSpec::scalar("epsilon", DataType::F32, 4));
        let out = g.rmsnorm(x, w, eps, phase);
        g.output(out.y).name = "Y".into();
        if let Some(inv) = out.inv_rms {
            g.output(inv).name = "inv_rms".into();
        }
        g
    }

    /// The cached plan for this shape, built on first use.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType, phase: NormPhase) -> Result<std::rc::Rc<Plan>> {
        ctx.cache().get_or_build(&self.key(dtype, phase), || self.graph(dtype, phase).build(ctx))
    }
}

/// Fused RMSNorm, inference phase.
pub fn rms_norm<T: Element>(
    ctx: &Cudnn,
    args: RmsNormArgs,
    x: &(impl DevicePtr<T> + ?Sized),
    weight: &(impl DevicePtr<T> + ?Sized),
    y: &mut (impl DevicePtrMut<T> + ?Sized),
) -> Result<()> {
    fused::<T>(ctx, args, x, weight, y, None)
}

/// Fused RMSNorm, training phase: also writes the f32 inverse RMS of each row.
pub fn rms_norm_train<T: Element>(
    ctx: &Cudnn,
    args: RmsNormArgs,
    x: &(impl DevicePtr<T> + ?Sized),
    weight: &(impl DevicePtr<T> + ?Sized),
    y: &mut (impl DevicePtrMut<T> + ?Sized),
    inv_rms: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    fused::<T>(ctx, args, x, weight, y, Some(inv_rms))
}

/// RMSNorm on the chosen backend; `inv_rms` selects the training phase.
pub fn rms_norm_with<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: RmsNormArgs,
    x: &(impl DevicePtr<T> + ?Sized),
    weight: &(impl DevicePtr<T> + ?Sized),
    y: &mut (impl DevicePtrMut<T> + ?Sized),
    inv_rms: Option<&mut dyn DevicePtrMut<f32>>,
) -> Result<()> {
    match backend {
        Backend::Fused => fused::<T>(ctx, args, x, weight, y, inv_rms),
        Backend::Naive => crate::naive::rmsnorm::run::<T>(ctx, args, x, weight, y, inv_rms),
    }
}

fn fused<T: Element>(
    ctx: &Cudnn,
    args: RmsNormArgs,
    x: &(impl DevicePtr<T> + ?Sized),
    weight: &(impl DevicePtr<T> + ?Sized),
    y: &mut (impl DevicePtrMut<T> + ?Sized),
    inv_rms: Option<&mut dyn DevicePtrMut<f32>>,
) -> Result<()> {
    args.check(x.len(), weight.len(), y.len(), inv_rms.as_ref().map(|i| i.len()))?;
    let phase = if inv_rms.is_some() { NormPhase::Training } else { NormPhase::Inference };
    let plan = args.plan(ctx, T::DTYPE, phase)?;
    // The graph is built with uids in creation order: X 1, scale 2, epsilon 3, Y 4, inv_rms 5.
    let mut b = Bindings::new(ctx.stream());
    b.input(1, x).input(2, weight).scalar_f32(3, args.epsilon).output(4, y);
    if let Some(inv) = inv_rms {
        b.output(5, inv);
    }
    plan.execute(ctx, &b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_errors() {
        let a = RmsNormArgs { tokens: 4, hidden: 8, epsilon: 1e-5 };
        assert!(a.check(32, 8, 32, Some(4)).is_ok());
        let cases = [
            (RmsNormArgs { tokens: 0, ..a }.check(32, 8, 32, None), "tokens must be > 0"),
            (RmsNormArgs { hidden: 0, ..a }.check(32, 8, 32, None), "hidden must be > 0"),
            (RmsNormArgs { epsilon: f32::NAN, ..a }.check(32, 8, 32, None), "epsilon"),
            (RmsNormArgs { epsilon: -1.0, ..a }.check(32, 8, 32, None), "epsilon"),
            (a.check(32, 7, 32, None), "weight has 7 elements, hidden is 8"),
            (a.check(31, 8, 32, None), "x has 31 elements"),
            (a.check(32, 8, 31, None), "output has 31 elements"),
            (a.check(32, 8, 32, Some(3)), "inv_rms has 3 elements"),
            (RmsNormArgs { tokens: usize::MAX, ..a }.check(32, 8, 32, None), "overflows"),
        ];
        for (r, expected) in cases {
            let e = r.unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)) && e.to_string().contains(expected), "{e}");
        }
    }

    #[test]
    fn graph_binds_uids_in_creation_order() {
        let a = RmsNormArgs { tokens: 7, hidden: 768, epsilon: 1e-5 };
        for phase in [NormPhase::Inference, NormPhase::Training] {
            let g = a.graph(DataType::BF16, phase);
            g.validate().unwrap();
            let bound: Vec<(String, i64)> =
                g.tensors().iter().filter(|t| !t.is_virtual).map(|t| (t.name.clone(), t.uid)).collect();
            let mut expected =
                vec![("X".into(), 1), ("scale".into(), 2), ("epsilon".into(), 3), ("Y".into(), 4)];
            if phase == NormPhase::Training {
                expected.push(("inv_rms".into(), 5));
            }
            assert_eq!(bound, expected);
        }
    }
}
