//! The fused half: the decode GEMV (`decode.rs`) for a Linear layer over a few tokens, else one cuDNN
//! graph per layouts, dtypes and epilogue, the epilogue's steps fused after the matmul, bound by the
//! uids the graph gives its tensors by name ([`uid`]). [`MatmulArgs::form`] fixes the choice.

use super::decode::launch_gemv;
use super::{MatmulArgs, MatmulKernel, MatmulOperands, MatrixLayout};
use crate::dtype::{DataType, Element};
use crate::graph::{Binary, Graph};
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::DevicePtr;
use std::rc::Rc;

/// The uids [`MatmulArgs::graph`] gives the tensors a call binds (graph intermediates take the ones
/// from 6, below D's).
pub(super) mod uid {
    pub const A: i64 = 1;
    pub const B: i64 = 2;
    pub const BIAS: i64 = 3;
    pub const GATE: i64 = 4;
    pub const RESIDUAL: i64 = 5;
    /// The FP8 graph's A factors (per token) and B factors (per output channel or one).
    pub const A_SCALE: i64 = 6;
    pub const B_SCALE: i64 = 7;
    pub const D: i64 = 100;
}

/// A matrix operand's tensor: its dims over its strides.
fn spec(l: &MatrixLayout, name: &str, dtype: DataType) -> TensorSpec {
    let dims = l.dims.map(|d| d as i64);
    let strides = l.strides.map(|s| s as i64);
    TensorSpec::new(name, &dims, dtype).with_strides(&strides)
}

impl MatmulArgs {
    /// The cuDNN graph: A, B, then the epilogue's inputs bias `[1, 1, n]`, U and R in the output dtype;
    /// matmul (f32), bias add, activation, gate multiply, residual add, all f32 virtual; the last step's
    /// output is D, packed `[batch, m, n]`. Each bound tensor carries its named uid.
    pub fn graph(&self, dtype: DataType, out: DataType) -> Graph {
        if let Some(folded) = self.folded() {
            return folded.graph(dtype, out);
        }
        let epilogue = self.epilogue;
        let mut g = Graph::new(format!("matmul {} {dtype}->{out} epilogue {epilogue}", self.describe()));
        let a = g.tensor(spec(&self.a, "A", dtype).with_uid(uid::A));
        let b = g.tensor(spec(&self.b, "B", dtype).with_uid(uid::B));
        // Every bound tensor before the first node: a node's output takes the next free uid.
        let inputs = self.epilogue_inputs(&mut g, out);
        let d = g.matmul(a, b);
        self.epilogue_steps(g, d, inputs, out)
    }

    /// The graph of a Linear over an FP8 weight past the decode GEMV (`fused` quantizes A first):
    /// A `[1, m, k]` E4M3 codes, B the `weight` codes with `b_factors` factors, the FP8 product in
    /// f32 times both factors, then the epilogue as [`MatmulArgs::graph`]'s. A weight with a factor
    /// per output channel (`[1, 1, n]`) takes A with one factor per token (`[1, m, 1]`); a weight
    /// with one factor (`[1, 1, 1]`) takes A with one factor too: scalar factors on both operands
    /// are what reach cuDNN's fastest FP8 engine on Hopper (measured 1.5x the per-token x
    /// per-channel one, `benches/results/h200/fp8/`), at the accuracy of one scale per tensor.
    pub fn fp8_graph(&self, weight: DataType, b_factors: usize, out: DataType) -> Graph {
        let (m, n) = (self.m() as i64, self.n() as i64);
        let name = format!("matmul {} e4m3 x {weight}->{out} epilogue {}", self.describe(), self.epilogue);
        let mut g = Graph::new(name);
        let a = g.tensor(spec(&self.a, "A", DataType::F8E4M3).with_uid(uid::A));
        let b = g.tensor(spec(&self.b, "B", weight).with_uid(uid::B));
        let a_dims = if b_factors > 1 { [1, m, 1] } else { [1, 1, 1] };
        let sa = g.tensor(TensorSpec::new("a_scale", &a_dims, DataType::F32).with_uid(uid::A_SCALE));
        let b_dims = if b_factors > 1 { [1, 1, n] } else { [1, 1, 1] };
        let sb = g.tensor(TensorSpec::new("b_scale", &b_dims, DataType::F32).with_uid(uid::B_SCALE));
        let inputs = self.epilogue_inputs(&mut g, out);
        let d = g.matmul(a, b);
        let d = g.binary(Binary::Mul, d, sa);
        let d = g.binary(Binary::Mul, d, sb);
        self.epilogue_steps(g, d, inputs, out)
    }

    /// The epilogue's inputs in `g`: bias `[1, 1, n]`, U and R `[batch, m, n]`, in `out`, each with
    /// its uid (added before any node, whose outputs take the next free uids).
    fn epilogue_inputs(&self, g: &mut Graph, out: DataType) -> [Option<crate::graph::TensorId>; 3] {
        let epilogue = self.epilogue;
        let (batch, m, n) = (self.batch() as i64, self.m() as i64, self.n() as i64);
        let bias =
            epilogue.bias.then(|| g.tensor(TensorSpec::new("bias", &[1, 1, n], out).with_uid(uid::BIAS)));
        let gate =
            epilogue.gate.then(|| g.tensor(TensorSpec::new("U", &[batch, m, n], out).with_uid(uid::GATE)));
        let residual = epilogue
            .residual
            .then(|| g.tensor(TensorSpec::new("R", &[batch, m, n], out).with_uid(uid::RESIDUAL)));
        [bias, gate, residual]
    }

    /// `g` with the epilogue's steps after the product `d` (bias add, activation, gate multiply,
    /// residual add, all f32 virtual) over its `inputs`; the last step's output is D, packed
    /// `[batch, m, n]`.
    fn epilogue_steps(
        &self,
        mut g: Graph,
        mut d: crate::graph::TensorId,
        [bias, gate, residual]: [Option<crate::graph::TensorId>; 3],
        out: DataType,
    ) -> Graph {
        if let Some(bias) = bias {
            d = g.binary(Binary::Add, d, bias);
        }
        if let Some(act) = self.epilogue.activation {
            d = g.unary(act.unary(), d);
        }
        if let Some(u) = gate {
            d = g.binary(Binary::Mul, d, u);
        }
        if let Some(r) = residual {
            d = g.binary(Binary::Add, d, r);
        }
        let spec = g.output(d);
        spec.name = "D".into();
        spec.dtype = out;
        spec.uid = uid::D;
        g
    }

    /// The same product with the batch folded into the rows, when B is shared by every batch and A's
    /// batches follow each other row by row: `[b, m, k] × [1, k, n]` is `[1, b·m, k] × [1, k, n]` over
    /// the same memory (D, U and R are packed, so they fold too). cuDNN 9.14 computed wrong results for
    /// the broadcast form without an epilogue (9.19 did not); the folded form avoids broadcasting.
    pub fn folded(&self) -> Option<MatmulArgs> {
        let [batch, m, k] = self.a.dims;
        let [_, sr, sc] = self.a.strides;
        let foldable =
            self.b.dims[0] == 1 && batch > 1 && sc == 1 && Some(self.a.strides[0]) == m.checked_mul(sr);
        if !foldable {
            return None;
        }
        // Sizes that overflow cannot fold (and `check` rejects them).
        let rows = batch.checked_mul(m)?;
        Some(MatmulArgs {
            a: MatrixLayout { dims: [1, rows, k], strides: [rows.checked_mul(sr)?, sr, 1] },
            ..*self
        })
    }

    /// The cached plan, built on first use with [`Cudnn::tuning`]'s engine configurations (timed
    /// on the first execution). [`Error::NotSupported`] names the shape, dtypes and epilogue when cuDNN
    /// has no engine for them.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType, out: DataType) -> Result<Rc<Plan>> {
        let epilogue = self.epilogue;
        if let Some(forms) = self.forms() {
            return Err(Error::NotSupported {
                op: format!("matmul {} {forms} {dtype}->{out} epilogue {epilogue}", self.describe()),
                reason: "the cuDNN graph has no prologue and no up product: they run in the decode GEMV, at \
                         one token (run rms_norm and separate matmuls for more)"
                    .into(),
            });
        }
        let broadcast_ok = ctx.features().batch_broadcast_matmul();
        if self.b.dims[0] == 1 && self.batch() > 1 && self.folded().is_none() && !broadcast_ok {
            return Err(Error::NotSupported {
                op: format!("matmul {} {dtype}->{out} epilogue {epilogue}", self.describe()),
                reason: format!(
                    "a B shared across batches with an A that cannot fold its batch into rows: cuDNN 9.14 \
                     returned wrong results for batch broadcasting in our tests (9.19 did not); this is {}",
                    ctx.info().cudnn_version_string()
                ),
            });
        }
        ctx.cache().get_or_build(&self.key(dtype, out), || {
            self.graph(dtype, out).build_tuned(ctx, ctx.tuning().for_rows(self.weight_rows()))
        })
    }
}

impl MatmulArgs {
    /// What the fused backend runs for these arguments (given x and W 16-byte aligned): the kernel
    /// asked for ([`MatmulArgs::with_form`]), else the decode GEMV where it takes the call
    /// ([`MatmulArgs::decode_gemv`]) over at most
    /// [`DECODE_GEMV_AUTO_TOKENS`](crate::DECODE_GEMV_AUTO_TOKENS) tokens, else the graph.
    pub fn fused_kernel(&self, dtype: DataType, out: DataType) -> MatmulKernel {
        match self.form {
            Some(kernel) => kernel,
            None if self.auto_gemv(dtype, dtype, out).is_some() => MatmulKernel::DecodeGemv,
            None => MatmulKernel::Graph,
        }
    }
}

impl<T: Element, O: Element, W: Element> Fused<(T, O, W)> for MatmulArgs {
    fn fused(self, ctx: &Cudnn, mut x: MatmulOperands<'_, T, O, W>) -> Result<()> {
        let (dtype, weight, out) = (T::DTYPE, W::DTYPE, O::DTYPE);
        match self.form {
            Some(MatmulKernel::Graph) => {}
            Some(MatmulKernel::DecodeGemv) => {
                if launch_gemv(ctx, &self.gemv(dtype, weight, out)?, &mut x)? {
                    return Ok(());
                }
                return Err(Error::NotSupported {
                    op: format!("decode gemv {} {dtype}->{out}", self.describe()),
                    reason: "A or B is not 16-byte aligned (the GEMV reads 16-byte chunks)".into(),
                });
            }
            None => {
                if let Some(g) = self.auto_gemv(dtype, weight, out) {
                    if launch_gemv(ctx, &g, &mut x)? {
                        return Ok(());
                    }
                }
            }
        }
        if weight != dtype {
            // A decode form the GEMV did not take: the graph refuses it by name, before anything runs.
            if self.forms().is_some() {
                return self.plan(ctx, dtype, out).map(drop);
            }
            // More tokens than the GEMV takes over FP8 codes (a prefill): A quantized per token and
            // the FP8 graph (Hopper's FP8 tensor cores, sm_89+), else B dequantized into A's dtype
            // and the 16-bit graph.
            let rows = self.folded().unwrap_or(self);
            if rows.fp8_prefill_applies(ctx, dtype) {
                match rows.run_fp8_graph(ctx, &mut x) {
                    Err(Error::NotSupported { .. }) => {}
                    done => return done,
                }
            }
            let b = super::naive::dequantized(ctx, &self, &x)?;
            return self.run_graph(ctx, x.with_b(&b));
        }
        self.run_graph(ctx, x)
    }
}

/// What identifies the FP8 graph's plan ([`MatmulArgs::fp8_graph`]): the 16-bit key, B's format, and
/// whether B's factors are per channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Fp8Key(super::Key, DataType, bool);

impl MatmulArgs {
    /// Whether a call over an FP8 weight past the GEMV runs the FP8 graph (`self` with any batch
    /// folded into rows): A bf16 or f16, one batch of packed row-major rows (`quantize_fp8` reads
    /// rows of k), no decode form, FP8 tensor cores (sm_89+).
    fn fp8_prefill_applies(&self, ctx: &Cudnn, dtype: DataType) -> bool {
        let (m, k) = (self.m(), self.k());
        matches!(dtype, DataType::BF16 | DataType::F16)
            && self.forms().is_none()
            && self.a.dims[0] == 1
            && self.a.strides == [m * k, k, 1]
            && ctx.info().compute_capability >= (8, 9)
    }

    /// Quantizes A into the scratch (`quantize_fp8`, the fused kernel: codes `[m, k]`, then a factor
    /// per row, or one for a weight with one factor) and executes the FP8 graph's cached plan on the
    /// codes, B's codes and both factors ([`MatmulArgs::fp8_graph`]). [`Error::NotSupported`], before
    /// anything ran, where cuDNN has no engine for it.
    fn run_fp8_graph<T: Element, O: Element, W: Element>(
        &self,
        ctx: &Cudnn,
        x: &mut MatmulOperands<'_, T, O, W>,
    ) -> Result<()> {
        use crate::kernels::{scratch, Kernels, View};
        use crate::ops::quantize::{quantize_fp8, QuantizeArgs, QuantizeOperands};
        let (m, k) = (self.m(), self.k());
        let b_scale = x.b_scale.ok_or_else(|| Error::invalid("matmul: an FP8 weight without its factors"))?;
        let (dtype, weight, out, per_channel) = (T::DTYPE, W::DTYPE, O::DTYPE, b_scale.len() > 1);
        let key = Fp8Key(self.key(dtype, out), weight, per_channel);
        let plan = ctx.cache().get_or_build(&key, || {
            self.fp8_graph(weight, b_scale.len(), out)
                .build_tuned(ctx, ctx.tuning().for_rows(self.weight_rows()))
        })?;
        // The scratch: m·k codes (16-byte aligned), then m f32 factors.
        let codes_len = (m * k).next_multiple_of(16);
        let kernels = Kernels::get(ctx)?;
        let base = scratch(ctx, kernels, codes_len / 4 + m)?;
        let stream = ctx.stream();
        let mut codes = View { addr: base, len: m * k, stream: stream.clone() };
        let (q, a_factors) =
            if per_channel { (QuantizeArgs::per_row(m, k), m) } else { (QuantizeArgs::per_tensor(m, k), 1) };
        let mut factors = View { addr: base + codes_len as u64, len: a_factors, stream: stream.clone() };
        quantize_fp8::<T, crate::F8E4M3>(
            ctx,
            q,
            QuantizeOperands::new(x.a, &mut codes, &mut factors),
            Backend::Fused,
        )?;
        let mut b = Bindings::new(stream);
        b.input::<crate::F8E4M3>(uid::A, &codes).input(uid::B, x.b);
        b.input::<f32>(uid::A_SCALE, &factors).input(uid::B_SCALE, b_scale);
        bind_epilogue(&mut b, x.bias, x.up, x.residual);
        b.output(uid::D, &mut *x.d);
        plan.execute(ctx, &b)
    }

    /// Executes the cached graph on `x` (B in A's dtype: W is T, or B a dequantized weight).
    fn run_graph<T: Element, O: Element, W: Element>(
        &self,
        ctx: &Cudnn,
        x: MatmulOperands<'_, T, O, W>,
    ) -> Result<()> {
        let plan = self.plan(ctx, T::DTYPE, O::DTYPE)?;
        let mut b = Bindings::new(ctx.stream());
        b.input(uid::A, x.a).input(uid::B, x.b);
        bind_epilogue(&mut b, x.bias, x.up, x.residual);
        b.output(uid::D, x.d);
        plan.execute(ctx, &b)
    }
}

/// Binds the epilogue's inputs a call gives (bias, U, R) to both graphs' uids.
fn bind_epilogue<'a, O: Element>(
    b: &mut Bindings<'a>,
    bias: Option<&'a dyn DevicePtr<O>>,
    up: Option<&'a dyn DevicePtr<O>>,
    residual: Option<&'a dyn DevicePtr<O>>,
) {
    for (uid, buf) in [(uid::BIAS, bias), (uid::GATE, up), (uid::RESIDUAL, residual)] {
        if let Some(buf) = buf {
            b.input(uid, buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul::{BufferLens, Epilogue};

    #[test]
    fn a_shared_b_folds_the_batch_into_rows() {
        let shared =
            MatmulArgs { b: MatrixLayout::row_major(1, 64, 128), ..MatmulArgs::packed(3, 32, 64, 128) };
        let f = shared.folded().unwrap();
        assert_eq!(f.a, MatrixLayout::row_major(1, 96, 64));
        assert_eq!((f.batch(), f.m(), f.k(), f.n()), (1, 96, 64, 128));
        let g = shared.with_epilogue(Epilogue::NONE).graph(DataType::BF16, DataType::BF16);
        let a = g.tensors().iter().find(|t| t.name == "A").unwrap();
        assert_eq!(a.dims, vec![1, 96, 64]);
        // Per-batch B, a column-major A or a single batch: nothing to fold.
        assert!(MatmulArgs::packed(3, 32, 64, 128).folded().is_none());
        let col = MatmulArgs { a: MatrixLayout::column_major(3, 32, 64), ..shared };
        assert!(col.folded().is_none());
        assert!(MatmulArgs::linear(30, 64, 128).folded().is_none());
    }

    #[test]
    fn extreme_shapes_do_not_fold_or_pass_the_check() {
        let b = MatrixLayout::row_major(1, 64, 128);
        // batch · m and batch · m · row stride overflow: no fold (it used to panic in debug and wrap in
        // release), and the check names the overflow.
        for a in [
            MatrixLayout { dims: [1 << 33, 1 << 32, 64], strides: [1 << 38, 64, 1] },
            MatrixLayout { dims: [1 << 20, 1 << 40, 64], strides: [1 << 46, 64, 1] },
            MatrixLayout { dims: [usize::MAX, usize::MAX, 64], strides: [usize::MAX, 64, 1] },
        ] {
            let args = MatmulArgs::new(a, b);
            assert!(args.folded().is_none(), "{a:?}");
            let lens = BufferLens { a: usize::MAX, b: usize::MAX, d: usize::MAX, ..Default::default() };
            let e =
                args.with_epilogue(Epilogue::NONE).check(DataType::BF16, DataType::BF16, &lens).unwrap_err();
            let m = e.to_string();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && (m.contains("overflows") || m.contains("64-bit")),
                "{m}"
            );
        }
        // A batch stride past i64::MAX would reach cuDNN as a negative stride.
        let a = MatrixLayout { dims: [1, 16, 64], strides: [1 << 63, 64, 1] };
        let lens = BufferLens { a: usize::MAX, b: usize::MAX, d: usize::MAX, ..Default::default() };
        let e = MatmulArgs::new(a, b)
            .with_epilogue(Epilogue::NONE)
            .check(DataType::BF16, DataType::BF16, &lens)
            .unwrap_err();
        assert!(e.to_string().contains("64-bit signed"), "{e}");
    }

    #[test]
    fn every_epilogue_fp8_graph_validates_and_binds_the_named_uids() {
        let args = MatmulArgs::linear(24, 64, 128);
        for weight in [DataType::F8E4M3, DataType::F8E5M2] {
            for factors in [1, 128] {
                for e in Epilogue::all() {
                    let g = args.with_epilogue(e).fp8_graph(weight, factors, DataType::BF16);
                    g.validate().unwrap_or_else(|err| panic!("{}: {err}", g.name()));
                    let bound: Vec<(&str, i64)> = g
                        .tensors()
                        .iter()
                        .filter(|t| !t.is_virtual)
                        .map(|t| (t.name.as_str(), t.uid))
                        .collect();
                    let mut expected = vec![
                        ("A", uid::A),
                        ("B", uid::B),
                        ("a_scale", uid::A_SCALE),
                        ("b_scale", uid::B_SCALE),
                    ];
                    for (on, name, id) in [
                        (e.bias, "bias", uid::BIAS),
                        (e.gate, "U", uid::GATE),
                        (e.residual, "R", uid::RESIDUAL),
                    ] {
                        if on {
                            expected.push((name, id));
                        }
                    }
                    expected.push(("D", uid::D));
                    assert_eq!(bound, expected, "{}", g.name());
                    // A per-channel weight takes A per token; a weight of one factor, A of one.
                    let dims = |name: &str| g.tensors().iter().find(|t| t.name == name).unwrap().dims.clone();
                    let (a, b) = if factors > 1 { ([1, 24, 1], [1, 1, 128]) } else { ([1, 1, 1], [1, 1, 1]) };
                    assert_eq!((dims("a_scale"), dims("b_scale")), (a.to_vec(), b.to_vec()), "{}", g.name());
                }
            }
        }
    }

    #[test]
    fn every_epilogue_graph_validates() {
        for args in [MatmulArgs::linear(7, 64, 4096), MatmulArgs::packed(3, 30, 64, 64)] {
            for (dtype, out) in [
                (DataType::BF16, DataType::BF16),
                (DataType::F16, DataType::F16),
                (DataType::F32, DataType::F32),
                (DataType::BF16, DataType::F32),
            ] {
                for e in Epilogue::all() {
                    let g = args.with_epilogue(e).graph(dtype, out);
                    g.validate().unwrap_or_else(|err| panic!("{}: {err}", g.name()));
                    assert!(g.name().contains(&format!("epilogue {}", e.name())), "{}", g.name());
                    let bound: Vec<(&str, i64, DataType)> = g
                        .tensors()
                        .iter()
                        .filter(|t| !t.is_virtual)
                        .map(|t| (t.name.as_str(), t.uid, t.dtype))
                        .collect();
                    let mut expected = vec![("A", uid::A, dtype), ("B", uid::B, dtype)];
                    if e.bias {
                        expected.push(("bias", uid::BIAS, out));
                    }
                    if e.gate {
                        expected.push(("U", uid::GATE, out));
                    }
                    if e.residual {
                        expected.push(("R", uid::RESIDUAL, out));
                    }
                    expected.push(("D", uid::D, out));
                    assert_eq!(bound, expected, "{}", g.name());
                    let d = g.tensors().iter().find(|t| t.name == "D").unwrap();
                    let (b, m, n) = (args.batch() as i64, args.m() as i64, args.n() as i64);
                    assert_eq!((d.dims.clone(), d.strides.clone()), (vec![b, m, n], vec![m * n, n, 1]));
                    // The graph is matmul plus one node per step: every virtual tensor is an intermediate.
                    let virtuals = g.tensors().iter().filter(|t| t.is_virtual).count();
                    assert_eq!(virtuals, e.steps(), "{}", g.name());
                }
            }
        }
        let g = MatmulArgs::linear(30, 4096, 6144)
            .with_epilogue(Epilogue::RESIDUAL)
            .graph(DataType::BF16, DataType::BF16);
        let b = g.tensors().iter().find(|t| t.name == "B").unwrap();
        assert_eq!((b.dims.clone(), b.strides.clone()), (vec![1, 4096, 6144], vec![4096 * 6144, 1, 4096]));
        assert_eq!(g.name(), "matmul [1, 30, 4096] x [1, 4096, 6144] col-major bf16->bf16 epilogue residual");
    }
}
