//! The fused half: one cuDNN `NORM_FORWARD` (RMS_NORM) graph per shape, dtype and phase, and one
//! `NORM_BACKWARD` (RMS_NORM) graph per shape and dtype, bound by the uids the graphs give their
//! tensors by name ([`uid`], [`grad_uid`]).

use super::{Grad, RmsNormArgs, RmsNormGrads, RmsNormOperands};
use crate::dtype::{DataType, Element};
use crate::graph::{Binary, Graph, NormPhase};
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Error, Result};
use std::rc::Rc;

/// The uids [`RmsNormArgs::graph`] gives the tensors a call binds.
mod uid {
    pub const X: i64 = 1;
    pub const SCALE: i64 = 2;
    pub const EPSILON: i64 = 3;
    pub const Y: i64 = 4;
    pub const INV_RMS: i64 = 5;
}

/// The uids [`RmsNormArgs::backward_graph`] gives the tensors a backward call binds (outputs from
/// 100, above the intermediates the builder numbers after the inputs).
mod grad_uid {
    pub const DY: i64 = 1;
    pub const X: i64 = 2;
    pub const SCALE: i64 = 3;
    pub const INV_RMS: i64 = 4;
    pub const D_RESIDUAL: i64 = 5;
    pub const DX: i64 = 100;
    pub const DSCALE: i64 = 101;
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

impl RmsNormArgs {
    /// The backward graph: dY and X `[tokens, hidden, 1, 1]`, scale `[1, hidden, 1, 1]` (the forward's
    /// layouts), the saved inverse RMS f32 `[tokens, 1, 1, 1]`; `NORM_BACKWARD` in RMS mode writes dX
    /// (like X) and dscale (like scale). With `d_residual`, dX stays an f32 intermediate and a pointwise
    /// add of the residual gradient `[tokens, hidden, 1, 1]` writes the bound dX.
    pub fn backward_graph(&self, dtype: DataType, d_residual: bool) -> Graph {
        let (n, d) = (self.tokens as i64, self.hidden as i64);
        let extra = if d_residual { " + d_residual" } else { "" };
        let mut g = Graph::new(format!("rmsnorm backward {n}x{d} {dtype}{extra}"));
        let spec = |name: &str, dims: &[i64], uid: i64| {
            TensorSpec::new(name, dims, dtype).with_strides(&[d, 1, d, d]).with_uid(uid)
        };
        let dy = g.tensor(spec("dY", &[n, d, 1, 1], grad_uid::DY));
        let x = g.tensor(spec("X", &[n, d, 1, 1], grad_uid::X));
        let w = g.tensor(spec("scale", &[1, d, 1, 1], grad_uid::SCALE));
        let inv = g.tensor(
            TensorSpec::new("inv_rms", &[n, 1, 1, 1], DataType::F32)
                .with_strides(&[1, 1, 1, 1])
                .with_uid(grad_uid::INV_RMS),
        );
        let res = d_residual.then(|| g.tensor(spec("d_residual", &[n, d, 1, 1], grad_uid::D_RESIDUAL)));
        let out = g.rmsnorm_backward(dy, x, w, inv);
        let dx = match res {
            Some(r) => {
                // The norm's dX is only read by the add: keep it in f32, round once.
                g.spec_mut(out.dx).dtype = DataType::F32;
                g.binary(Binary::Add, out.dx, r)
            }
            None => out.dx,
        };
        let dx = g.output(dx);
        (dx.name, dx.uid, dx.dtype, dx.strides) = ("dX".into(), grad_uid::DX, dtype, vec![d, 1, d, d]);
        let ds = g.output(out.dscale);
        (ds.name, ds.uid) = ("dscale".into(), grad_uid::DSCALE);
        g
    }

    /// The cached backward plan for this shape, built on first use.
    pub fn backward_plan(&self, ctx: &Cudnn, dtype: DataType, d_residual: bool) -> Result<Rc<Plan>> {
        ctx.cache().get_or_build(&self.backward_key(dtype, d_residual), || {
            self.backward_graph(dtype, d_residual).build(ctx)
        })
    }
}

impl<T: Element> Fused<Grad<T>> for RmsNormArgs {
    fn fused(self, ctx: &Cudnn, x: RmsNormGrads<'_, T>) -> Result<()> {
        let residual = x.d_residual.is_some();
        if residual && !ctx.features().rmsnorm_backward_add() {
            return Err(Error::NotSupported {
                op: format!("rmsnorm backward {}x{} {} + d_residual", self.tokens, self.hidden, T::DTYPE),
                reason: format!(
                    "cuDNN fuses a norm backward with the residual gradient's add from 9.21; this is {}: \
                     add it separately or use the naive backend",
                    ctx.info().cudnn_version_string()
                ),
            });
        }
        let plan = self.backward_plan(ctx, T::DTYPE, residual)?;
        let mut b = Bindings::new(ctx.stream());
        b.input(grad_uid::DY, x.dy).input(grad_uid::X, x.x).input(grad_uid::SCALE, x.weight);
        b.input(grad_uid::INV_RMS, x.inv_rms);
        if let Some(r) = x.d_residual {
            b.input(grad_uid::D_RESIDUAL, r);
        }
        b.output(grad_uid::DX, x.dx).output(grad_uid::DSCALE, x.dweight);
        plan.execute(ctx, &b)
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

    #[test]
    fn backward_graph_binds_the_named_uids() {
        let a = RmsNormArgs { tokens: 7, hidden: 768, epsilon: 1e-5 };
        for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
            for residual in [false, true] {
                let g = a.backward_graph(dtype, residual);
                g.validate().unwrap_or_else(|e| panic!("{}: {e}", g.name()));
                let bound: Vec<(String, i64, DataType)> = g
                    .tensors()
                    .iter()
                    .filter(|t| !t.is_virtual)
                    .map(|t| (t.name.clone(), t.uid, t.dtype))
                    .collect();
                let mut expected = vec![
                    ("dY".into(), grad_uid::DY, dtype),
                    ("X".into(), grad_uid::X, dtype),
                    ("scale".into(), grad_uid::SCALE, dtype),
                    ("inv_rms".into(), grad_uid::INV_RMS, DataType::F32),
                ];
                if residual {
                    expected.push(("d_residual".into(), grad_uid::D_RESIDUAL, dtype));
                }
                // Bound tensors in creation order: the norm's dscale comes before the add's dX.
                if residual {
                    expected.push(("dscale".into(), grad_uid::DSCALE, dtype));
                    expected.push(("dX".into(), grad_uid::DX, dtype));
                } else {
                    expected.push(("dX".into(), grad_uid::DX, dtype));
                    expected.push(("dscale".into(), grad_uid::DSCALE, dtype));
                }
                assert_eq!(bound, expected, "{}", g.name());
                let dx = g.tensors().iter().find(|t| t.name == "dX").unwrap();
                assert_eq!(
                    (dx.dims.clone(), dx.strides.clone()),
                    (vec![7, 768, 1, 1], vec![768, 1, 768, 768])
                );
                let ds = g.tensors().iter().find(|t| t.name == "dscale").unwrap();
                assert_eq!(ds.dims, vec![1, 768, 1, 1]);
                // With the residual add, the norm's dX is an f32 intermediate (one rounding).
                let virtuals: Vec<DataType> =
                    g.tensors().iter().filter(|t| t.is_virtual).map(|t| t.dtype).collect();
                assert_eq!(virtuals, if residual { vec![DataType::F32] } else { vec![] });
            }
        }
    }

    #[test]
    fn backward_graph_validation_names_the_bad_tensor() {
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("X", &[4, 64, 1, 1], DataType::BF16));
        let dy = g.tensor(TensorSpec::new("dY", &[4, 64, 1, 1], DataType::BF16));
        let w = g.tensor(TensorSpec::new("scale", &[1, 64, 1, 1], DataType::BF16));
        // A statistic of the wrong dtype (what a non-training forward would never have written).
        let inv = g.tensor(TensorSpec::new("inv_rms", &[4, 1, 1, 1], DataType::BF16));
        let out = g.rmsnorm_backward(dy, x, w, inv);
        g.output(out.dx);
        g.output(out.dscale);
        let e = g.validate().unwrap_err().to_string();
        assert!(e.contains("`inv_rms`") && e.contains("training forward"), "{e}");

        // A statistic with one entry per column instead of per row, and a dY of another shape.
        for (bad, dims) in [("inv_rms", [1i64, 64, 1, 1]), ("dY", [4, 32, 1, 1])] {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorSpec::new("X", &[4, 64, 1, 1], DataType::F16));
            let dy_dims = if bad == "dY" { dims } else { [4, 64, 1, 1] };
            let dy = g.tensor(TensorSpec::new("dY", &dy_dims, DataType::F16));
            let w = g.tensor(TensorSpec::new("scale", &[1, 64, 1, 1], DataType::F16));
            let inv_dims = if bad == "inv_rms" { dims } else { [4, 1, 1, 1] };
            let inv = g.tensor(TensorSpec::new("inv_rms", &inv_dims, DataType::F32));
            let out = g.rmsnorm_backward(dy, x, w, inv);
            g.output(out.dx);
            g.output(out.dscale);
            let e = g.validate().unwrap_err().to_string();
            assert!(e.contains(&format!("`{bad}`")), "{bad}: {e}");
        }

        // Unmarked gradients are named.
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("X", &[4, 64, 1, 1], DataType::F32));
        let dy = g.tensor(TensorSpec::new("dY", &[4, 64, 1, 1], DataType::F32));
        let w = g.tensor(TensorSpec::new("scale", &[1, 64, 1, 1], DataType::F32));
        let inv = g.tensor(TensorSpec::new("inv_rms", &[4, 1, 1, 1], DataType::F32));
        let out = g.rmsnorm_backward(dy, x, w, inv);
        g.output(out.dx);
        assert!(g.validate().unwrap_err().to_string().contains("g::dscale"));
    }
}
