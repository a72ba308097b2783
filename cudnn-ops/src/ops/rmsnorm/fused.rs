//! The fused half: one cuDNN `NORM_FORWARD` (RMS_NORM) graph per shape, dtype and phase, bound by the
//! uids the graph gives its tensors by name ([`uid`]).

use super::{RmsNormArgs, RmsNormOperands};
use crate::dtype::{DataType, Element};
use crate::graph::{Graph, NormPhase};
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Result};
use std::rc::Rc;

/// The uids [`RmsNormArgs::graph`] gives the tensors a call binds.
mod uid {
    pub const X: i64 = 1;
    pub const SCALE: i64 = 2;
    pub const EPSILON: i64 = 3;
    pub const Y: i64 = 4;
    pub const INV_RMS: i64 = 5;
}

impl RmsNormArgs {
    /// The cuDNN graph: X `[tokens, hidden, 1, 1]`, scale `[1, hidden, 1, 1]`, ε by value, Y like X, and in
    /// training inv_rms `[tokens, 1, 1, 1]` f32.
    pub fn graph(&self, dtype: DataType, phase: NormPhase) -> Graph {
        let (n, d) = (self.tokens as i64, self.hidden as i64);
        let mut g = Graph::new(format!("rmsnorm {n}x{d} {dtype} {}", phase.name()));
        let spec = |name: &str, dims: &[i64], uid: i64| {
            TensorSpec::new(name, dims, dtype).with_strides(&[d, 1, d, d]).with_uid(uid)
        };
        let x = g.tensor(spec("X", &[n, d, 1, 1], uid::X));
        let w = g.tensor(spec("scale", &[1, d, 1, 1], uid::SCALE));
        let eps = g.tensor(TensorSpec::scalar("epsilon", DataType::F32, 4).with_uid(uid::EPSILON));
        let out = g.rmsnorm(x, w, eps, phase);
        let y = g.output(out.y);
        (y.name, y.uid) = ("Y".into(), uid::Y);
        if let Some(inv) = out.inv_rms {
            let inv = g.output(inv);
            (inv.name, inv.uid) = ("inv_rms".into(), uid::INV_RMS);
        }
        g
    }

    /// The cached plan for this shape, built on first use.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType, phase: NormPhase) -> Result<Rc<Plan>> {
        ctx.cache().get_or_build(&self.key(dtype, phase), || self.graph(dtype, phase).build(ctx))
    }
}

impl<T: Element> Fused<T> for RmsNormArgs {
    fn fused(self, ctx: &Cudnn, x: RmsNormOperands<'_, T>) -> Result<()> {
        let plan = self.plan(ctx, T::DTYPE, x.phase())?;
        let mut b = Bindings::new(ctx.stream());
        b.input(uid::X, x.x).input(uid::SCALE, x.weight).scalar_f32(uid::EPSILON, self.epsilon);
        b.output(uid::Y, x.y);
        if let Some(inv) = x.inv_rms {
            b.output(uid::INV_RMS, inv);
        }
        plan.execute(ctx, &b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_binds_the_named_uids() {
        let a = RmsNormArgs { tokens: 7, hidden: 768, epsilon: 1e-5 };
        for phase in [NormPhase::Inference, NormPhase::Training] {
            let g = a.graph(DataType::BF16, phase);
            g.validate().unwrap();
            let bound: Vec<(String, i64)> =
                g.tensors().iter().filter(|t| !t.is_virtual).map(|t| (t.name.clone(), t.uid)).collect();
            let mut expected = vec![
                ("X".into(), uid::X),
                ("scale".into(), uid::SCALE),
                ("epsilon".into(), uid::EPSILON),
                ("Y".into(), uid::Y),
            ];
            if phase == NormPhase::Training {
                expected.push(("inv_rms".into(), uid::INV_RMS));
            }
            assert_eq!(bound, expected);
        }
    }
}
