//! The fused half: one cuDNN `NORM_FORWARD` (LAYER_NORM) graph per shape, dtype and phase, bound by
//! the uids it gives its tensors by name ([`uid`]).

use super::{LayerNormArgs, LayerNormOperands};
use crate::dtype::{DataType, Element};
use crate::graph::{Graph, NormPhase};
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Result};
use std::rc::Rc;

/// The uids [`LayerNormArgs::graph`] gives the tensors a call binds.
mod uid {
    pub const X: i64 = 1;
    pub const SCALE: i64 = 2;
    pub const BIAS: i64 = 3;
    pub const EPSILON: i64 = 4;
    pub const Y: i64 = 5;
    pub const MEAN: i64 = 6;
    pub const INV_STD: i64 = 7;
}

impl LayerNormArgs {
    /// The cuDNN graph: X `[tokens, hidden, 1, 1]`, scale and bias `[1, hidden, 1, 1]`, ε by value, Y
    /// like X, and in training the mean and inverse standard deviation `[tokens, 1, 1, 1]` f32.
    pub fn graph(&self, dtype: DataType, phase: NormPhase) -> Graph {
        let (n, d) = (self.tokens as i64, self.hidden as i64);
        let mut g = Graph::new(format!("layernorm {n}x{d} {dtype} {}", phase.name()));
        let spec = |name: &str, dims: &[i64], uid: i64| {
            TensorSpec::new(name, dims, dtype).with_strides(&[d, 1, d, d]).with_uid(uid)
        };
        let x = g.tensor(spec("X", &[n, d, 1, 1], uid::X));
        let w = g.tensor(spec("scale", &[1, d, 1, 1], uid::SCALE));
        let b = g.tensor(spec("bias", &[1, d, 1, 1], uid::BIAS));
        let eps = g.tensor(TensorSpec::scalar("epsilon", DataType::F32, 4).with_uid(uid::EPSILON));
        let out = g.layernorm(x, w, b, eps, phase);
        let y = g.output(out.y);
        (y.name, y.uid) = ("Y".into(), uid::Y);
        if let (Some(mean), Some(inv)) = (out.mean, out.inv_std) {
            let mean = g.output(mean);
            (mean.name, mean.uid) = ("mean".into(), uid::MEAN);
            let inv = g.output(inv);
            (inv.name, inv.uid) = ("inv_std".into(), uid::INV_STD);
        }
        g
    }

    /// The cached plan for this shape, built on first use.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType, phase: NormPhase) -> Result<Rc<Plan>> {
        ctx.cache().get_or_build(&self.key(dtype, phase), || self.graph(dtype, phase).build(ctx))
    }
}

impl<T: Element> Fused<T> for LayerNormArgs {
    fn fused(self, ctx: &Cudnn, x: LayerNormOperands<'_, T>) -> Result<()> {
        let plan = self.plan(ctx, T::DTYPE, x.phase())?;
        let mut b = Bindings::new(ctx.stream());
        b.input(uid::X, x.x).input(uid::SCALE, x.weight).input(uid::BIAS, x.bias);
        b.scalar_f32(uid::EPSILON, self.epsilon);
        b.output(uid::Y, x.y);
        if let Some((mean, inv_std)) = x.stats {
            b.output(uid::MEAN, mean).output(uid::INV_STD, inv_std);
        }
        plan.execute(ctx, &b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_validates_and_binds_the_named_uids() {
        let a = LayerNormArgs::new(7, 768, 1e-5);
        for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
            for phase in [NormPhase::Inference, NormPhase::Training] {
                let g = a.graph(dtype, phase);
                g.validate().unwrap_or_else(|e| panic!("{}: {e}", g.name()));
                let bound: Vec<(String, i64)> =
                    g.tensors().iter().filter(|t| !t.is_virtual).map(|t| (t.name.clone(), t.uid)).collect();
                let mut expected = vec![
                    ("X".into(), uid::X),
                    ("scale".into(), uid::SCALE),
                    ("bias".into(), uid::BIAS),
                    ("epsilon".into(), uid::EPSILON),
                    ("Y".into(), uid::Y),
                ];
                if phase == NormPhase::Training {
                    expected.push(("mean".into(), uid::MEAN));
                    expected.push(("inv_std".into(), uid::INV_STD));
                }
                assert_eq!(bound, expected, "{}", g.name());
            }
        }
    }

    #[test]
    fn a_bias_of_another_shape_is_refused_naming_it() {
        let mut g = Graph::new("bad layernorm");
        let d = 64;
        let spec = |name: &str, dims: &[i64]| {
            TensorSpec::new(name, dims, DataType::BF16).with_strides(&[d, 1, d, d])
        };
        let x = g.tensor(spec("X", &[4, d, 1, 1]));
        let w = g.tensor(spec("scale", &[1, d, 1, 1]));
        let b = g.tensor(spec("bias", &[1, d / 2, 1, 1]));
        let eps = g.tensor(TensorSpec::scalar("epsilon", DataType::F32, 4));
        let y = g.layernorm(x, w, b, eps, NormPhase::Inference).y;
        g.output(y);
        let e = g.validate().unwrap_err().to_string();
        assert!(e.contains("bias") && e.contains("do not match X"), "{e}");
    }
}
