//! FP8 scaled matmul, a Linear layer over FP8 operands: `D[m, n] = (A · a_scale) × (B · b_scale)ᵀ`
//! with A `[m, k]` (activations) and B `[n, k]` (the weight as a Linear holds it, a row per output
//! channel) row-major in [`F8E4M3`](crate::F8E4M3) or [`F8E5M2`](crate::F8E5M2) (not both E5M2),
//! `a_scale` one f32 for all of A or one per row (token, [`Scaling`]), `b_scale` one f32 for all of
//! B or one per output channel ([`WeightScales`]), f32 accumulation, D in bf16, f16 or f32. The scales are the dequantization
//! factors (`value = code · scale`, e.g. `amax / 448` for E4M3), device tensors so that a captured
//! step can take new ones.
//!
//! Fused: one cuDNN graph per shape, dtypes and scale form, the FP8 matmul with both scale
//! multiplies fused after it ([`ScaledMatmulArgs::graph`]; Hopper's FP8 tensor cores, cuDNN 9 on
//! sm_89 and later). Naive: dequantize A and B into bf16 (a kernel each), then the bf16 cuBLAS GEMM
//! (`naive.rs`): what a framework without FP8 kernels runs. [`reference()`] is the f64 product of
//! the dequantized codes, which both are checked against. Activations come to FP8 through
//! [`quantize_fp8`](crate::ops::quantize::quantize_fp8).

mod fused;
pub mod naive;

use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::ops::quantize::Scaling;
use crate::ops::Op;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// How B's dequantization factors are given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WeightScales {
    /// One f32 for the whole weight.
    PerTensor,
    /// One f32 per output channel (row of B), `n` of them.
    PerChannel,
}

/// Shape and scale form of a scaled matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ScaledMatmulArgs {
    /// Rows of A and D (tokens).
    pub m: usize,
    /// Rows of B, columns of D (output channels).
    pub n: usize,
    /// The inner dimension (input channels).
    pub k: usize,
    /// B's scales.
    pub weight_scales: WeightScales,
    /// A's scales: one, or one per row (per token, as [`quantize_fp8`](crate::quantize_fp8) makes them
    /// with [`Scaling::PerRow`]).
    pub activation_scales: Scaling,
}

impl ScaledMatmulArgs {
    /// `[m, k] × [n, k]ᵀ` with A's and B's scales per tensor.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        ScaledMatmulArgs {
            m,
            n,
            k,
            weight_scales: WeightScales::PerTensor,
            activation_scales: Scaling::PerTensor,
        }
    }

    /// These arguments with one scale per output channel of B.
    pub fn per_channel(self) -> Self {
        ScaledMatmulArgs { weight_scales: WeightScales::PerChannel, ..self }
    }

    /// These arguments with one scale per row (token) of A.
    pub fn per_token(self) -> Self {
        ScaledMatmulArgs { activation_scales: Scaling::PerRow, ..self }
    }

    /// A's scale count: 1 or `m`.
    pub fn a_scales(&self) -> usize {
        match self.activation_scales {
            Scaling::PerTensor => 1,
            Scaling::PerRow => self.m,
        }
    }

    /// B's scale count: 1 or `n`.
    pub fn b_scales(&self) -> usize {
        match self.weight_scales {
            WeightScales::PerTensor => 1,
            WeightScales::PerChannel => self.n,
        }
    }

    /// Checks the shape, the dtypes and the buffer lengths; nothing is touched on error. `lens`:
    /// A, B, a_scale, b_scale and D, in elements.
    pub fn check(&self, a: DataType, b: DataType, out: DataType, lens: [usize; 5]) -> Result<()> {
        let ScaledMatmulArgs { m, n, k, .. } = *self;
        ensure!(m > 0 && n > 0 && k > 0, "scaled_matmul: m, n and k must be > 0 (got {m}, {n}, {k})");
        ensure!(a.is_fp8() && b.is_fp8(), "scaled_matmul: A and B must be FP8 (got {a} and {b})");
        if a == DataType::F8E5M2 && b == DataType::F8E5M2 {
            return Err(Error::NotSupported {
                op: format!("scaled_matmul {m}x{n}x{k} {a} x {b}"),
                reason: "two E5M2 operands have no FP8 tensor-core form: quantize the weight to E4M3".into(),
            });
        }
        ensure!(
            matches!(out, DataType::BF16 | DataType::F16 | DataType::F32),
            "scaled_matmul: the output dtype {out} is not bf16, f16 or f32"
        );
        // FP8 tensor cores read 16-byte rows: k a multiple of 16 elements; D's rows 16-byte aligned.
        ensure!(k % 16 == 0, "scaled_matmul: k = {k} must be a multiple of 16 (16-byte FP8 rows)");
        let align = 16 / out.size();
        ensure!(n % align == 0, "scaled_matmul: n = {n} must be a multiple of {align} for a {out} output");
        let [la, lb, lsa, lsb, ld] = lens;
        let need_a = crate::checked::product("scaled_matmul: m * k", &[m, k])?;
        let need_b = crate::checked::product("scaled_matmul: n * k", &[n, k])?;
        let need_d = crate::checked::product("scaled_matmul: m * n", &[m, n])?;
        ensure!(la >= need_a, "scaled_matmul: A has {la} elements, needs m*k = {need_a}");
        ensure!(lb >= need_b, "scaled_matmul: B has {lb} elements, needs n*k = {need_b}");
        let want_a = self.a_scales();
        ensure!(
            lsa == want_a,
            "scaled_matmul: a_scale has {lsa} elements, needs {want_a} ({:?})",
            self.activation_scales
        );
        let want = self.b_scales();
        ensure!(
            lsb == want,
            "scaled_matmul: b_scale has {lsb} elements, needs {want} ({:?})",
            self.weight_scales
        );
        ensure!(ld >= need_d, "scaled_matmul: D has {ld} elements, needs m*n = {need_d}");
        Ok(())
    }

    /// The plan-cache key.
    pub fn key(&self, a: DataType, b: DataType, out: DataType) -> Key {
        Key { args: *self, a, b, out }
    }
}

/// What identifies a scaled-matmul plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Key {
    /// Shape and scale form.
    pub args: ScaledMatmulArgs,
    /// A's dtype.
    pub a: DataType,
    /// B's dtype.
    pub b: DataType,
    /// D's dtype.
    pub out: DataType,
}

/// The buffers of one call: A and B (FP8 codes), their f32 dequantization factors, D.
#[non_exhaustive]
pub struct ScaledMatmulOperands<'a, A: Element, B: Element, O: Element> {
    /// `[m, k]` row-major.
    pub a: &'a dyn DevicePtr<A>,
    /// `[n, k]` row-major.
    pub b: &'a dyn DevicePtr<B>,
    /// One f32.
    pub a_scale: &'a dyn DevicePtr<f32>,
    /// One f32, or `n` ([`WeightScales`]).
    pub b_scale: &'a dyn DevicePtr<f32>,
    /// `[m, n]` row-major.
    pub d: &'a mut dyn DevicePtrMut<O>,
}

impl<'a, A: Element, B: Element, O: Element> ScaledMatmulOperands<'a, A, B, O> {
    /// A and B with their scales in, D out.
    pub fn new(
        a: &'a dyn DevicePtr<A>,
        a_scale: &'a dyn DevicePtr<f32>,
        b: &'a dyn DevicePtr<B>,
        b_scale: &'a dyn DevicePtr<f32>,
        d: &'a mut dyn DevicePtrMut<O>,
    ) -> Self {
        ScaledMatmulOperands { a, b, a_scale, b_scale, d }
    }
}

impl<A: Element, B: Element, O: Element> Op<(A, B, O)> for ScaledMatmulArgs {
    type Operands<'a> = ScaledMatmulOperands<'a, A, B, O>;

    fn checked(self, x: &ScaledMatmulOperands<'_, A, B, O>) -> Result<Self> {
        let lens = [x.a.len(), x.b.len(), x.a_scale.len(), x.b_scale.len(), x.d.len()];
        self.check(A::DTYPE, B::DTYPE, O::DTYPE, lens)?;
        Ok(self)
    }
}

/// The scaled matmul on `backend`.
pub fn scaled_matmul<A: Element, B: Element, O: Element>(
    ctx: &Cudnn,
    args: ScaledMatmulArgs,
    x: ScaledMatmulOperands<'_, A, B, O>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<(A, B, O), _>(ctx, args, x, backend)
}

/// The f64 reference: `D[m, n] = Σ_k (a[m, k] · a_scale[m or 0]) (b[n, k] · b_scale[n or 0])` over
/// the codes' exact values.
pub fn reference<A: Element, B: Element>(
    args: ScaledMatmulArgs,
    a: &[A],
    a_scale: &[f32],
    b: &[B],
    b_scale: &[f32],
) -> Vec<f64> {
    let ScaledMatmulArgs { m, n, k, .. } = args;
    assert_eq!(
        (a.len(), b.len(), a_scale.len(), b_scale.len()),
        (m * k, n * k, args.a_scales(), args.b_scales()),
        "reference scaled_matmul"
    );
    let mut d = Vec::with_capacity(m * n);
    for (i, row) in a.chunks(k).enumerate() {
        let sa = a_scale[if a_scale.len() == 1 { 0 } else { i }];
        for (j, col) in b.chunks(k).enumerate() {
            let s = row.iter().zip(col).map(|(x, y)| x.to_f64() * y.to_f64()).sum::<f64>();
            let sb = if b_scale.len() == 1 { b_scale[0] } else { b_scale[j] };
            d.push(s * sa as f64 * sb as f64);
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::quantize::quantize;
    use crate::{F8E4M3, F8E5M2};

    #[test]
    fn argument_errors_name_the_argument() {
        let (e4, e5, bf) = (DataType::F8E4M3, DataType::F8E5M2, DataType::BF16);
        let a = ScaledMatmulArgs::new(4, 32, 64);
        let ok = [4 * 64, 32 * 64, 1, 1, 4 * 32];
        assert!(
            a.check(e4, e4, bf, ok).is_ok()
                && a.check(e5, e4, bf, ok).is_ok()
                && a.check(e4, e5, bf, ok).is_ok()
        );
        assert!(a.per_channel().check(e4, e4, DataType::F32, [256, 2048, 1, 32, 128]).is_ok());
        let cases = [
            (ScaledMatmulArgs::new(0, 32, 64).check(e4, e4, bf, ok), "must be > 0"),
            (a.check(bf, e4, bf, ok), "A and B must be FP8"),
            (a.check(e4, e4, e4, ok), "output dtype fp8e4m3 is not"),
            (ScaledMatmulArgs::new(4, 32, 40).check(e4, e4, bf, ok), "k = 40 must be a multiple of 16"),
            (ScaledMatmulArgs::new(4, 30, 64).check(e4, e4, bf, ok), "n = 30 must be a multiple of 8"),
            (a.check(e4, e4, bf, [255, 2048, 1, 1, 128]), "A has 255 elements"),
            (a.check(e4, e4, bf, [256, 2047, 1, 1, 128]), "B has 2047 elements"),
            (a.check(e4, e4, bf, [256, 2048, 2, 1, 128]), "a_scale has 2 elements, needs 1"),
            (
                a.per_token().check(e4, e4, bf, [256, 2048, 1, 1, 128]),
                "a_scale has 1 elements, needs 4 (PerRow)",
            ),
            (a.check(e4, e4, bf, [256, 2048, 1, 32, 128]), "b_scale has 32 elements, needs 1"),
            (a.per_channel().check(e4, e4, bf, [256, 2048, 1, 1, 128]), "needs 32 (PerChannel)"),
            (a.check(e4, e4, bf, [256, 2048, 1, 1, 127]), "D has 127 elements"),
            (ScaledMatmulArgs::new(usize::MAX, 32, 64).check(e4, e4, bf, ok), "overflows"),
        ];
        for (r, expected) in cases {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(expected), "{e} (expected `{expected}`)");
        }
        match a.check(e5, e5, bf, ok) {
            Err(Error::NotSupported { reason, .. }) => assert!(reason.contains("E5M2"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn quantized_weights_and_the_reference_come_back_within_fp8_rounding() {
        let (m, n, k) = (3, 8, 32);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let w: Vec<f32> =
            (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) * (1.0 + (i / k) as f32)).collect();
        let (qa, sa) = quantize::<F8E4M3>(&x, m, k, false);
        let (qb, sb) = quantize::<F8E4M3>(&w, n, k, true);
        assert_eq!((sa.len(), sb.len()), (1, n));
        // Each row's largest magnitude lands on the largest code.
        for (r, s) in sb.iter().enumerate() {
            let amax = w[r * k..(r + 1) * k].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!((s * 448.0 - amax).abs() <= amax * 1e-6, "row {r}");
            assert!(qb[r * k..(r + 1) * k].iter().any(|c| c.0 & 0x7f == 0x7e), "row {r} reaches 448");
        }
        let exact: Vec<f64> = (0..m)
            .flat_map(|i| {
                let (x, w) = (&x, &w);
                (0..n).map(move |j| (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>())
            })
            .collect();
        let got = reference(ScaledMatmulArgs::new(m, n, k).per_channel(), &qa, &sa, &qb, &sb);
        // Per token: each row of A quantized with its own factor, the same product.
        let (qt, st) = quantize::<F8E4M3>(&x, m, k, true);
        let per_token =
            reference(ScaledMatmulArgs::new(m, n, k).per_channel().per_token(), &qt, &st, &qb, &sb);
        let c = crate::reference::compare(&per_token.iter().map(|v| *v as f32).collect::<Vec<_>>(), &exact);
        assert!(c.passes(crate::reference::Tolerance::rel_l2(5e-2)), "per token: {c}");
        let c = crate::reference::compare(&got.iter().map(|v| *v as f32).collect::<Vec<_>>(), &exact);
        assert!(c.passes(crate::reference::Tolerance::rel_l2(5e-2)), "{c}");
        // Zeros quantize to zeros with a unit factor; E5M2 codes work the same way.
        let (z, f) = quantize::<F8E5M2>(&[0.0; 16], 1, 16, true);
        assert_eq!((z.iter().all(|c| c.to_f64() == 0.0), f), (true, vec![1.0]));
    }
}
