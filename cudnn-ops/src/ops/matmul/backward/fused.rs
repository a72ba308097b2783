//! The fused halves: the gradients as the forward's matmul graphs ([`MatmulArgs::graph`], bound by its
//! named uids), the bias gradient as a reduction graph, the SwiGLU backward as one matmul + pointwise
//! graph or, where cuDNN refuses that, a matmul graph and a pointwise graph.

use super::{DataGrad, DataOf, LinearGradArgs, SwigluGrads, SwigluOf, WeightGrad, WeightOf};
use crate::dtype::{DataType, Element};
use crate::graph::{Binary, Graph, Unary};
use crate::kernels::{scratch, Kernels, View};
use crate::ops::matmul::fused::uid;
use crate::ops::matmul::MatmulArgs;
use crate::ops::Fused;
use crate::plan::{Bindings, Plan, Tuning};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

/// A second handle on a buffer this call already holds: its address and length, on its stream. The
/// accumulating graphs bind the gradient buffer as their residual R and their output D through two
/// of these; the borrow it was taken from holds cudarc's stream-ordering guard for the whole call, so
/// these record nothing themselves.
type Alias = View;

/// Two aliases of `buf` (one to read, one to write) and the guard of its one real borrow, which must
/// outlive every use of the aliases.
fn aliases<'a, O>(
    buf: &'a mut dyn DevicePtrMut<O>,
    stream: &'a CudaStream,
) -> (Alias, Alias, SyncOnDrop<'a>) {
    let (len, owner) = (buf.len(), buf.stream().clone());
    let (addr, guard) = buf.device_ptr_mut(stream);
    let alias = || Alias { addr, len, stream: owner.clone() };
    (alias(), alias(), guard)
}

/// The plan key of an in-place accumulating matmul (see [`execute_matmul`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct InPlace(crate::ops::matmul::Key);

/// Executes `m`'s matmul plan on A, B and the output `d`, which is also bound as the residual when
/// `m` accumulates.
fn execute_matmul<T: Element, O: Element>(
    ctx: &Cudnn,
    m: &MatmulArgs,
    a: &dyn DevicePtr<T>,
    b: &dyn DevicePtr<T>,
    d: &mut dyn DevicePtrMut<O>,
) -> Result<()> {
    let plan = if m.epilogue.residual {
        // Accumulating in place (the gradient is both the residual and the output): autotuning
        // executes the plan on the bound buffers, and every timed run would add dY·W again (the GPU
        // test caught it), so these plans take the heuristics' first engine, untimed, under a key of
        // their own.
        let (dtype, out) = (T::DTYPE, O::DTYPE);
        ctx.cache().get_or_build(&InPlace(m.key(dtype, out)), || {
            m.graph(dtype, out).build_tuned(ctx, Tuning::FIRST)
        })?
    } else {
        m.plan(ctx, T::DTYPE, O::DTYPE)?
    };
    let stream = ctx.stream();
    // The one guard of the output for the whole execution; the aliases only carry its address.
    let (read, mut write, _guard) = aliases(d, stream);
    let mut bind = Bindings::new(stream);
    bind.input(uid::A, a).input(uid::B, b);
    if m.epilogue.residual {
        bind.input::<O>(uid::RESIDUAL, &read);
    }
    bind.output::<O>(uid::D, &mut write);
    plan.execute(ctx, &bind)
}

impl<T: Element, O: Element> Fused<DataOf<T, O>> for LinearGradArgs {
    fn fused(self, ctx: &Cudnn, x: DataGrad<'_, T, O>) -> Result<()> {
        execute_matmul(ctx, &self.data_grad(), x.dy, x.weight, x.dx)
    }
}

impl<T: Element, O: Element> Fused<WeightOf<T, O>> for LinearGradArgs {
    fn fused(self, ctx: &Cudnn, x: WeightGrad<'_, T, O>) -> Result<()> {
        // Both plans first: a refused bias graph leaves dW untouched too.
        let bias_plan = match x.dbias {
            Some(_) => Some(self.bias_plan(ctx, T::DTYPE, O::DTYPE)?),
            None => None,
        };
        execute_matmul(ctx, &self.weight_grad(), x.dy, x.x, x.dw)?;
        let (Some(plan), Some(db)) = (bias_plan, x.dbias) else { return Ok(()) };
        let stream = ctx.stream();
        // The row of ones the graph's matmul sums dY's rows with (uploaded per call: Llama has no
        // bias, so this path is rare).
        let ones = stream.clone_htod(&vec![T::from_f64(1.0); self.tokens])?;
        let (read, mut write, _guard) = aliases(db, stream);
        let mut bind = Bindings::new(stream);
        bind.input(bias_uid::ONES, &ones).input(bias_uid::DY, x.dy);
        if self.accumulate {
            bind.input::<O>(bias_uid::OLD, &read);
        }
        bind.output::<O>(bias_uid::DBIAS, &mut write);
        plan.execute(ctx, &bind)
    }
}

/// The uids [`LinearGradArgs::bias_graph`] gives its bound tensors.
mod bias_uid {
    pub const DY: i64 = 1;
    pub const OLD: i64 = 2;
    pub const ONES: i64 = 3;
    pub const DBIAS: i64 = 100;
}

/// The uids of the SwiGLU backward graphs (fused: dY, W, gate, up in; split: d_act, gate, up in).
mod swiglu_uid {
    pub const DY: i64 = 1;
    pub const W: i64 = 2;
    pub const GATE: i64 = 3;
    pub const UP: i64 = 4;
    pub const D_ACT: i64 = 5;
    pub const D_GATE: i64 = 100;
    pub const D_UP: i64 = 101;
}

/// What identifies a bias-gradient plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct BiasGradKey {
    /// Rows summed.
    pub tokens: usize,
    /// Columns (the bias length).
    pub out_features: usize,
    /// Dtype of dY.
    pub dtype: DataType,
    /// Dtype of the bias gradient.
    pub out_dtype: DataType,
    /// Whether the old bias gradient is added.
    pub accumulate: bool,
}

/// How the SwiGLU backward runs on the fused backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SwigluForm {
    /// One graph: the data-gradient matmul with the SwiGLU backward's pointwise steps after it.
    Fused,
    /// Two graphs: the data-gradient matmul into an op-owned f32 buffer, then a pointwise graph.
    Split,
}

impl SwigluForm {
    /// `fused` or `split`.
    pub fn name(self) -> &'static str {
        match self {
            SwigluForm::Fused => "fused",
            SwigluForm::Split => "split",
        }
    }
}

/// What identifies a SwiGLU backward plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct SwigluKey {
    /// The down projection's shape.
    pub args: LinearGradArgs,
    /// I/O dtype.
    pub dtype: DataType,
    /// Which graph of the form: the fused one, or the split form's pointwise one.
    pub form: SwigluForm,
}

thread_local! {
    /// Fused SwiGLU graphs cuDNN refused, by key and cuDNN version (plan caches keep only plans; a
    /// refusal is tried once per thread, not on every call).
    static REFUSED: RefCell<HashSet<(SwigluKey, usize)>> = RefCell::new(HashSet::new());
}

impl LinearGradArgs {
    /// The bias gradient: the sum of dY's rows `[1, tokens, out]` into `[1, 1, out]` as a matmul with a
    /// bound row of ones `[1, 1, tokens]` (f32 accumulation; cuDNN 9.19 has no engine for a standalone
    /// reduction graph of this shape), then, when accumulating, a pointwise add of the old gradient;
    /// the last step's output is the bound gradient.
    pub fn bias_graph(&self, dtype: DataType, out: DataType) -> Graph {
        let (t, o) = (self.tokens as i64, self.out_features as i64);
        let extra = if self.accumulate { " accumulate" } else { "" };
        let mut g = Graph::new(format!("bias grad [{t}, {o}] {dtype}->{out}{extra}"));
        let dy = g.tensor(TensorSpec::new("dY", &[1, t, o], dtype).with_uid(bias_uid::DY));
        let old = self
            .accumulate
            .then(|| g.tensor(TensorSpec::new("dbias_old", &[1, 1, o], out).with_uid(bias_uid::OLD)));
        let ones = g.tensor(TensorSpec::new("ones", &[1, 1, t], dtype).with_uid(bias_uid::ONES));
        let mut db = g.matmul(ones, dy);
        if let Some(old) = old {
            db = g.binary(Binary::Add, db, old);
        }
        let spec = g.output(db);
        (spec.name, spec.uid, spec.dtype) = ("dbias".into(), bias_uid::DBIAS, out);
        g
    }

    /// The cached bias-gradient plan.
    pub fn bias_plan(&self, ctx: &Cudnn, dtype: DataType, out: DataType) -> Result<Rc<Plan>> {
        let key = BiasGradKey {
            tokens: self.tokens,
            out_features: self.out_features,
            dtype,
            out_dtype: out,
            accumulate: self.accumulate,
        };
        ctx.cache().get_or_build(&key, || self.bias_graph(dtype, out).build(ctx))
    }

    /// The SwiGLU backward's graph of `form`. Fused: dY `[1, tokens, hidden]` · W_down `[1, hidden,
    /// inter]` (as stored) gives d_act in f32, then `d_up = d_act ⊙ silu(gate)` and `d_gate =
    /// swish_bwd(d_act ⊙ up, gate)`. Split: the same pointwise steps on a bound f32 d_act `[1, tokens,
    /// inter]` (the plain data gradient written by the matmul graph before it).
    pub fn swiglu_graph(&self, dtype: DataType, form: SwigluForm) -> Graph {
        let (t, inter, hidden) = (self.tokens as i64, self.in_features as i64, self.out_features as i64);
        let mut g =
            Graph::new(format!("swiglu backward [{t}, {hidden}] -> [{t}, {inter}] {dtype} {}", form.name()));
        let io = |name: &str, uid: i64| TensorSpec::new(name, &[1, t, inter], dtype).with_uid(uid);
        let (gate, up, d_act) = match form {
            SwigluForm::Fused => {
                let m = self.data_grad();
                let spec = |l: &crate::MatrixLayout, name: &str, uid: i64| {
                    TensorSpec::new(name, &l.dims.map(|d| d as i64), dtype)
                        .with_strides(&l.strides.map(|s| s as i64))
                        .with_uid(uid)
                };
                let dy = g.tensor(spec(&m.a, "dY", swiglu_uid::DY));
                let w = g.tensor(spec(&m.b, "W_down", swiglu_uid::W));
                let gate = g.tensor(io("gate", swiglu_uid::GATE));
                let up = g.tensor(io("up", swiglu_uid::UP));
                (gate, up, g.matmul(dy, w))
            }
            SwigluForm::Split => {
                let d_act =
                    TensorSpec::new("d_act", &[1, t, inter], DataType::F32).with_uid(swiglu_uid::D_ACT);
                let d_act = g.tensor(d_act);
                (g.tensor(io("gate", swiglu_uid::GATE)), g.tensor(io("up", swiglu_uid::UP)), d_act)
            }
        };
        let silu = g.unary(Unary::Silu, gate);
        let d_up = g.binary(Binary::Mul, d_act, silu);
        let d_silu = g.binary(Binary::Mul, d_act, up);
        let d_gate = g.activation_backward(Unary::Silu, d_silu, gate);
        let s = g.output(d_gate);
        (s.name, s.uid, s.dtype) = ("d_gate".into(), swiglu_uid::D_GATE, dtype);
        let s = g.output(d_up);
        (s.name, s.uid, s.dtype) = ("d_up".into(), swiglu_uid::D_UP, dtype);
        g
    }

    /// The form the fused backend runs the SwiGLU backward of this shape in on `ctx`: the fused graph
    /// unless cuDNN refused it (building it, once, on first use).
    pub fn swiglu_form(&self, ctx: &Cudnn, dtype: DataType) -> Result<SwigluForm> {
        Ok(self.swiglu_fused_plan(ctx, dtype)?.map_or(SwigluForm::Split, |_| SwigluForm::Fused))
    }

    /// The fused SwiGLU plan, or `None` where cuDNN refuses the graph (remembered).
    fn swiglu_fused_plan(&self, ctx: &Cudnn, dtype: DataType) -> Result<Option<Rc<Plan>>> {
        let key = SwigluKey { args: *self, dtype, form: SwigluForm::Fused };
        let version = ctx.info().cudnn_version;
        if REFUSED.with(|r| r.borrow().contains(&(key, version))) {
            return Ok(None);
        }
        match ctx.cache().get_or_build(&key, || self.swiglu_graph(dtype, SwigluForm::Fused).build(ctx)) {
            Ok(plan) => Ok(Some(plan)),
            Err(Error::NotSupported { .. }) => {
                REFUSED.with(|r| r.borrow_mut().insert((key, version)));
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

impl<T: Element> Fused<SwigluOf<T>> for LinearGradArgs {
    fn fused(self, ctx: &Cudnn, x: SwigluGrads<'_, T>) -> Result<()> {
        let stream = ctx.stream();
        if let Some(plan) = self.swiglu_fused_plan(ctx, T::DTYPE)? {
            let mut b = Bindings::new(stream);
            b.input(swiglu_uid::DY, x.dy).input(swiglu_uid::W, x.w_down);
            b.input(swiglu_uid::GATE, x.gate).input(swiglu_uid::UP, x.up);
            b.output(swiglu_uid::D_GATE, x.d_gate).output(swiglu_uid::D_UP, x.d_up);
            return plan.execute(ctx, &b);
        }
        // Split: both plans before anything runs, then d_act (f32, op-owned) and the pointwise graph.
        let m = self.data_grad();
        let matmul_plan = m.plan(ctx, T::DTYPE, DataType::F32)?;
        let key = SwigluKey { args: self, dtype: T::DTYPE, form: SwigluForm::Split };
        let pointwise =
            ctx.cache().get_or_build(&key, || self.swiglu_graph(T::DTYPE, SwigluForm::Split).build(ctx))?;
        let len = m.d_len();
        let addr = scratch(ctx, Kernels::get(ctx)?, len)?;
        let d_act = Alias { addr, len, stream: stream.clone() };
        let mut d_act_out = Alias { addr, len, stream: stream.clone() };
        let mut b = Bindings::new(stream);
        b.input(uid::A, x.dy).input(uid::B, x.w_down).output::<f32>(uid::D, &mut d_act_out);
        matmul_plan.execute(ctx, &b)?;
        let mut b = Bindings::new(stream);
        b.input::<f32>(swiglu_uid::D_ACT, &d_act).input(swiglu_uid::GATE, x.gate).input(swiglu_uid::UP, x.up);
        b.output(swiglu_uid::D_GATE, x.d_gate).output(swiglu_uid::D_UP, x.d_up);
        pointwise.execute(ctx, &b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(g: &Graph) -> Vec<(String, i64, DataType)> {
        g.tensors().iter().filter(|t| !t.is_virtual).map(|t| (t.name.clone(), t.uid, t.dtype)).collect()
    }

    #[test]
    fn gradient_graphs_validate_with_named_uids_and_views() {
        let a = LinearGradArgs::new(32, 64, 128);
        for (dtype, out) in [
            (DataType::BF16, DataType::BF16),
            (DataType::F16, DataType::F16),
            (DataType::F32, DataType::F32),
            (DataType::BF16, DataType::F32),
        ] {
            for args in [a, a.accumulating()] {
                for (m, what) in [(args.data_grad(), "data"), (args.weight_grad(), "weight")] {
                    let g = m.graph(dtype, out);
                    g.validate().unwrap_or_else(|e| panic!("{what} {}: {e}", g.name()));
                    let mut expected =
                        vec![("A".to_string(), uid::A, dtype), ("B".to_string(), uid::B, dtype)];
                    if args.accumulate {
                        expected.push(("R".into(), uid::RESIDUAL, out));
                    }
                    expected.push(("D".into(), uid::D, out));
                    assert_eq!(bound(&g), expected, "{}", g.name());
                }
                let wg = args.weight_grad().graph(dtype, out);
                let dy = wg.tensors().iter().find(|t| t.name == "A").unwrap();
                // dYᵀ over dY's memory: [out, tokens] with unit stride along out.
                assert_eq!((dy.dims.clone(), dy.strides.clone()), (vec![1, 128, 32], vec![128 * 32, 1, 128]));
                let d = wg.tensors().iter().find(|t| t.name == "D").unwrap();
                assert_eq!((d.dims.clone(), d.strides.clone()), (vec![1, 128, 64], vec![128 * 64, 64, 1]));

                let bg = args.bias_graph(dtype, out);
                bg.validate().unwrap_or_else(|e| panic!("{}: {e}", bg.name()));
                let mut expected = vec![("dY".to_string(), bias_uid::DY, dtype)];
                if args.accumulate {
                    expected.push(("dbias_old".into(), bias_uid::OLD, out));
                }
                expected.push(("ones".into(), bias_uid::ONES, dtype));
                expected.push(("dbias".into(), bias_uid::DBIAS, out));
                assert_eq!(bound(&bg), expected, "{}", bg.name());
                let db = bg.tensors().iter().find(|t| t.name == "dbias").unwrap();
                assert_eq!(db.dims, vec![1, 1, 128]);
            }
        }
    }

    #[test]
    fn swiglu_graphs_validate_in_both_forms() {
        // The down projection of a tiny MLP: intermediate 64, hidden 32.
        let a = LinearGradArgs::new(16, 64, 32);
        for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
            for form in [SwigluForm::Fused, SwigluForm::Split] {
                let g = a.swiglu_graph(dtype, form);
                g.validate().unwrap_or_else(|e| panic!("{}: {e}", g.name()));
                let mut expected = match form {
                    SwigluForm::Fused => vec![
                        ("dY".to_string(), swiglu_uid::DY, dtype),
                        ("W_down".to_string(), swiglu_uid::W, dtype),
                    ],
                    SwigluForm::Split => vec![("d_act".to_string(), swiglu_uid::D_ACT, DataType::F32)],
                };
                expected.extend([
                    ("gate".to_string(), swiglu_uid::GATE, dtype),
                    ("up".to_string(), swiglu_uid::UP, dtype),
                    ("d_up".to_string(), swiglu_uid::D_UP, dtype),
                    ("d_gate".to_string(), swiglu_uid::D_GATE, dtype),
                ]);
                assert_eq!(bound(&g), expected, "{}", g.name());
                for name in ["d_gate", "d_up"] {
                    let t = g.tensors().iter().find(|t| t.name == name).unwrap();
                    assert_eq!((t.dims.clone(), t.strides.clone()), (vec![1, 16, 64], vec![16 * 64, 64, 1]));
                }
                // Every intermediate is f32: d_act (fused), silu(gate), d_act ⊙ up.
                let virtuals: Vec<DataType> =
                    g.tensors().iter().filter(|t| t.is_virtual).map(|t| t.dtype).collect();
                let n = if form == SwigluForm::Fused { 3 } else { 2 };
                assert_eq!(virtuals, vec![DataType::F32; n], "{}", g.name());
            }
        }
        // The weight as stored, [hidden, inter], is B of the fused matmul.
        let g = a.swiglu_graph(DataType::BF16, SwigluForm::Fused);
        let w = g.tensors().iter().find(|t| t.name == "W_down").unwrap();
        assert_eq!((w.dims.clone(), w.strides.clone()), (vec![1, 32, 64], vec![32 * 64, 64, 1]));
    }

    #[test]
    fn activation_backward_validation() {
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("x", &[1, 4, 8], DataType::BF16));
        let dy = g.tensor(TensorSpec::new("dy", &[1, 4, 8], DataType::BF16));
        let dx = g.activation_backward(Unary::Exp, dy, x);
        g.output(dx);
        let e = g.validate().unwrap_err().to_string();
        assert!(e.contains("exp has no cuDNN backward mode"), "{e}");
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("x", &[1, 4, 8], DataType::BF16));
        let dy = g.tensor(TensorSpec::new("dy", &[1, 4, 16], DataType::BF16));
        let dx = g.activation_backward(Unary::Silu, dy, x);
        g.output(dx);
        assert!(g.validate().unwrap_err().to_string().contains("do not broadcast"));
    }
}
