//! The fused half: one cuDNN graph per shape, dtypes and scale form, the FP8 matmul (f32
//! accumulation) and both dequantization multiplies fused after it, bound by the uids it gives its
//! tensors by name ([`uid`]).

use super::{ScaledMatmulArgs, ScaledMatmulOperands, WeightScales};
use crate::dtype::{DataType, Element};
use crate::graph::{Binary, Graph};
use crate::ops::quantize::Scaling;
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Result};
use std::rc::Rc;

/// The uids [`ScaledMatmulArgs::graph`] gives the tensors a call binds.
mod uid {
    pub const A: i64 = 1;
    pub const B: i64 = 2;
    pub const A_SCALE: i64 = 3;
    pub const B_SCALE: i64 = 4;
    pub const D: i64 = 100;
}

impl ScaledMatmulArgs {
    /// The cuDNN graph: A `[1, m, k]` row-major and B as `[1, k, n]` over the `[n, k]` row-major
    /// weight (both K-major, as FP8 tensor cores read them), the f32 product, times `a_scale`
    /// (`[1, 1, 1]`, or `[1, m, 1]` per token), times `b_scale` (`[1, 1, 1]`, or `[1, 1, n]` per
    /// channel), D `[1, m, n]` packed.
    pub fn graph(&self, a: DataType, b: DataType, out: DataType) -> Graph {
        let (m, n, k) = (self.m as i64, self.n as i64, self.k as i64);
        let form = match self.weight_scales {
            WeightScales::PerTensor => "per-tensor",
            WeightScales::PerChannel => "per-channel",
        };
        let per_token = if self.activation_scales == Scaling::PerRow { " per-token" } else { "" };
        let mut g = Graph::new(format!("scaled_matmul {m}x{n}x{k} {a}x{b}->{out} {form}{per_token}"));
        let ta = g.tensor(TensorSpec::new("A", &[1, m, k], a).with_strides(&[m * k, k, 1]).with_uid(uid::A));
        let tb = g.tensor(TensorSpec::new("B", &[1, k, n], b).with_strides(&[n * k, 1, k]).with_uid(uid::B));
        let a_dims = match self.activation_scales {
            Scaling::PerTensor => [1, 1, 1],
            Scaling::PerRow => [1, m, 1],
        };
        let sa = g.tensor(TensorSpec::new("a_scale", &a_dims, DataType::F32).with_uid(uid::A_SCALE));
        let b_dims = match self.weight_scales {
            WeightScales::PerTensor => [1, 1, 1],
            WeightScales::PerChannel => [1, 1, n],
        };
        let sb = g.tensor(TensorSpec::new("b_scale", &b_dims, DataType::F32).with_uid(uid::B_SCALE));
        let c = g.matmul(ta, tb);
        let c = g.binary(Binary::Mul, c, sa);
        let d = g.binary(Binary::Mul, c, sb);
        let spec = g.output(d);
        (spec.name, spec.dtype, spec.uid) = ("D".into(), out, uid::D);
        g
    }

    /// The cached plan, built on first use.
    pub fn plan(&self, ctx: &Cudnn, a: DataType, b: DataType, out: DataType) -> Result<Rc<Plan>> {
        ctx.cache().get_or_build(&self.key(a, b, out), || self.graph(a, b, out).build(ctx))
    }
}

impl<A: Element, B: Element, O: Element> Fused<(A, B, O)> for ScaledMatmulArgs {
    fn fused(self, ctx: &Cudnn, x: ScaledMatmulOperands<'_, A, B, O>) -> Result<()> {
        let plan = self.plan(ctx, A::DTYPE, B::DTYPE, O::DTYPE)?;
        let mut b = Bindings::new(ctx.stream());
        b.input(uid::A, x.a).input(uid::B, x.b);
        b.input(uid::A_SCALE, x.a_scale).input(uid::B_SCALE, x.b_scale);
        b.output(uid::D, x.d);
        plan.execute(ctx, &b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_validates_and_binds_the_named_uids() {
        let (e4, e5) = (DataType::F8E4M3, DataType::F8E5M2);
        for args in [
            ScaledMatmulArgs::new(16, 4096, 4096),
            ScaledMatmulArgs::new(1, 128, 64).per_channel(),
            ScaledMatmulArgs::new(32, 128, 64).per_channel().per_token(),
        ] {
            for (a, b) in [(e4, e4), (e5, e4), (e4, e5)] {
                for out in [DataType::BF16, DataType::F16, DataType::F32] {
                    let g = args.graph(a, b, out);
                    g.validate().unwrap_or_else(|e| panic!("{}: {e}", g.name()));
                    let bound: Vec<(String, i64, DataType)> = g
                        .tensors()
                        .iter()
                        .filter(|t| !t.is_virtual)
                        .map(|t| (t.name.clone(), t.uid, t.dtype))
                        .collect();
                    let expected = [
                        ("A".to_string(), uid::A, a),
                        ("B".into(), uid::B, b),
                        ("a_scale".into(), uid::A_SCALE, DataType::F32),
                        ("b_scale".into(), uid::B_SCALE, DataType::F32),
                        ("D".into(), uid::D, out),
                    ];
                    assert_eq!(bound, expected, "{}", g.name());
                }
            }
        }
        // Two E5M2 operands, or an FP8 operand beside a bf16 one, are refused naming B.
        for (a, b) in [(e5, e5), (DataType::BF16, e4)] {
            let e = ScaledMatmulArgs::new(16, 64, 64).graph(a, b, DataType::BF16).validate().unwrap_err();
            assert!(e.to_string().contains("FP8 matmul"), "{e}");
        }
    }
}
