//! LayerNorm over row-major `[tokens, hidden]`: `y = (x − mean) / sqrt(var + ε) · weight + bias` with
//! each row's mean and biased variance (PyTorch's `layer_norm`), f32 compute, I/O in bf16, f16 or
//! f32; the norm of GPT-2, BERT, Falcon, Phi and most models that are not Llama. Fused: one cuDNN
//! `NORM_FORWARD` (LAYER_NORM) graph per shape, dtype and phase ([`LayerNormArgs::graph`]). Naive:
//! PyTorch eager's `layer_norm` CUDA path, row moments then the affine transform ([`naive`]). The
//! training phase (statistics buffers in the operands) also writes each row's f32 mean and inverse
//! standard deviation, as eager's `native_layer_norm` returns them. [`reference()`] is the f64 CPU
//! reference both are checked against.
//!
//! This room was added by following `docs/adding-an-op.md`.

mod fused;
pub mod naive;

use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::NormPhase;
use crate::ops::Op;
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Shape and epsilon of a LayerNorm call.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LayerNormArgs {
    /// Rows (tokens).
    pub tokens: usize,
    /// Row length (hidden size).
    pub hidden: usize,
    /// Added to the variance before the square root.
    pub epsilon: f32,
}

impl LayerNormArgs {
    /// `tokens` rows of `hidden` elements, `epsilon` added to each row's variance.
    pub fn new(tokens: usize, hidden: usize, epsilon: f32) -> Self {
        LayerNormArgs { tokens, hidden, epsilon }
    }

    /// Checks the arguments and the buffer lengths shared by every backend; nothing is touched on
    /// error. `stats` are the mean and inverse-std lengths of a training call.
    pub fn check(
        &self,
        x: usize,
        weight: usize,
        bias: usize,
        y: usize,
        stats: Option<(usize, usize)>,
    ) -> Result<()> {
        let LayerNormArgs { tokens, hidden, epsilon } = *self;
        ensure!(tokens > 0, "layer_norm: tokens must be > 0");
        ensure!(hidden > 0, "layer_norm: hidden must be > 0");
        ensure!(
            epsilon.is_finite() && epsilon >= 0.0,
            "layer_norm: epsilon {epsilon} must be finite and >= 0"
        );
        let n = crate::checked::product("layer_norm: tokens * hidden", &[tokens, hidden])?;
        ensure!(weight == hidden, "layer_norm: weight has {weight} elements, hidden is {hidden}");
        ensure!(bias == hidden, "layer_norm: bias has {bias} elements, hidden is {hidden}");
        ensure!(x >= n, "layer_norm: x has {x} elements, needs tokens*hidden = {n}");
        ensure!(y >= n, "layer_norm: output has {y} elements, needs tokens*hidden = {n}");
        if let Some((mean, inv_std)) = stats {
            ensure!(mean >= tokens, "layer_norm: mean has {mean} elements, needs tokens = {tokens}");
            ensure!(inv_std >= tokens, "layer_norm: inv_std has {inv_std} elements, needs tokens = {tokens}");
        }
        Ok(())
    }

    /// The plan-cache key for this shape (epsilon is bound by value, not part of it).
    pub fn key(&self, dtype: DataType, phase: NormPhase) -> Key {
        Key { tokens: self.tokens, hidden: self.hidden, dtype, phase }
    }
}

/// What identifies a LayerNorm plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Key {
    /// Rows.
    pub tokens: usize,
    /// Row length.
    pub hidden: usize,
    /// I/O dtype (x, weight, bias, y).
    pub dtype: DataType,
    /// Inference or training.
    pub phase: NormPhase,
}

/// The buffers of a LayerNorm call: x, weight and bias `[hidden]` in, y out, and in the training
/// phase each row's f32 mean and inverse standard deviation `[tokens]`.
#[non_exhaustive]
pub struct LayerNormOperands<'a, T: Element> {
    /// `[tokens, hidden]` row-major.
    pub x: &'a dyn DevicePtr<T>,
    /// `[hidden]`.
    pub weight: &'a dyn DevicePtr<T>,
    /// `[hidden]`.
    pub bias: &'a dyn DevicePtr<T>,
    /// `[tokens, hidden]`, like x.
    pub y: &'a mut dyn DevicePtrMut<T>,
    /// The f32 mean and inverse standard deviation of each row; given, they select the training phase.
    pub stats: Option<(&'a mut dyn DevicePtrMut<f32>, &'a mut dyn DevicePtrMut<f32>)>,
}

impl<'a, T: Element> LayerNormOperands<'a, T> {
    /// Inference: x, weight and bias in, y out.
    pub fn new(
        x: &'a dyn DevicePtr<T>,
        weight: &'a dyn DevicePtr<T>,
        bias: &'a dyn DevicePtr<T>,
        y: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        LayerNormOperands { x, weight, bias, y, stats: None }
    }

    /// Training: also writes each row's f32 mean and inverse standard deviation.
    pub fn stats(
        mut self,
        mean: &'a mut dyn DevicePtrMut<f32>,
        inv_std: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        self.stats = Some((mean, inv_std));
        self
    }

    /// The phase the operands select.
    pub fn phase(&self) -> NormPhase {
        if self.stats.is_some() {
            NormPhase::Training
        } else {
            NormPhase::Inference
        }
    }
}

impl<T: Element> Op<T> for LayerNormArgs {
    type Operands<'a> = LayerNormOperands<'a, T>;

    fn checked(self, x: &LayerNormOperands<'_, T>) -> Result<Self> {
        let stats = x.stats.as_ref().map(|(m, s)| (m.len(), s.len()));
        self.check(x.x.len(), x.weight.len(), x.bias.len(), x.y.len(), stats)?;
        Ok(self)
    }
}

/// LayerNorm on `backend`; the phase follows the operands ([`LayerNormOperands::stats`] for training).
pub fn layer_norm<T: Element>(
    ctx: &Cudnn,
    args: LayerNormArgs,
    x: LayerNormOperands<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, args, x, backend)
}

/// LayerNorm of row-major `[tokens, hidden]` in f64: `(y, mean, inv_std)`, the variance biased (divided
/// by `hidden`) as PyTorch's.
pub fn reference(
    x: &[f64],
    weight: &[f64],
    bias: &[f64],
    args: LayerNormArgs,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (tokens, hidden) = (args.tokens, args.hidden);
    assert_eq!(x.len(), tokens * hidden, "reference layer_norm: x length");
    assert_eq!((weight.len(), bias.len()), (hidden, hidden), "reference layer_norm: weight and bias lengths");
    let (mut y, mut means, mut inv) = (Vec::with_capacity(x.len()), Vec::new(), Vec::new());
    for row in x.chunks_exact(hidden) {
        let mean = row.iter().sum::<f64>() / hidden as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / hidden as f64;
        let r = 1.0 / (var + args.epsilon as f64).sqrt();
        y.extend(row.iter().zip(weight.iter().zip(bias)).map(|(v, (w, b))| (v - mean) * r * w + b));
        means.push(mean);
        inv.push(r);
    }
    (y, means, inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_errors_name_the_argument() {
        let a = LayerNormArgs::new(4, 8, 1e-5);
        assert!(a.check(32, 8, 8, 32, Some((4, 4))).is_ok());
        let cases = [
            (LayerNormArgs { tokens: 0, ..a }.check(32, 8, 8, 32, None), "tokens must be > 0"),
            (LayerNormArgs { hidden: 0, ..a }.check(32, 8, 8, 32, None), "hidden must be > 0"),
            (LayerNormArgs { epsilon: f32::NAN, ..a }.check(32, 8, 8, 32, None), "epsilon"),
            (LayerNormArgs { epsilon: -1.0, ..a }.check(32, 8, 8, 32, None), "epsilon"),
            (a.check(32, 7, 8, 32, None), "weight has 7 elements, hidden is 8"),
            (a.check(32, 8, 9, 32, None), "bias has 9 elements, hidden is 8"),
            (a.check(31, 8, 8, 32, None), "x has 31 elements"),
            (a.check(32, 8, 8, 31, None), "output has 31 elements"),
            (a.check(32, 8, 8, 32, Some((3, 4))), "mean has 3 elements"),
            (a.check(32, 8, 8, 32, Some((4, 3))), "inv_std has 3 elements"),
            (LayerNormArgs { tokens: usize::MAX, ..a }.check(32, 8, 8, 32, None), "overflows"),
        ];
        for (r, expected) in cases {
            let e = r.unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)) && e.to_string().contains(expected), "{e}");
        }
    }

    #[test]
    fn keys_differ_by_shape_dtype_and_phase_not_epsilon() {
        let a = LayerNormArgs::new(30, 4096, 1e-5);
        let base = a.key(DataType::BF16, NormPhase::Inference);
        assert_eq!(base, LayerNormArgs { epsilon: 1e-6, ..a }.key(DataType::BF16, NormPhase::Inference));
        for k in [
            LayerNormArgs { tokens: 31, ..a }.key(DataType::BF16, NormPhase::Inference),
            LayerNormArgs { hidden: 2048, ..a }.key(DataType::BF16, NormPhase::Inference),
            a.key(DataType::F16, NormPhase::Inference),
            a.key(DataType::BF16, NormPhase::Training),
        ] {
            assert_ne!(base, k);
        }
    }

    #[test]
    fn the_reference_by_hand() {
        // Row [1, 3]: mean 2, variance 1, so (x - 2) / 1 = [-1, 1]; times [2, 3] plus [0.5, -0.5].
        let a = LayerNormArgs::new(1, 2, 0.0);
        let (y, mean, inv) = reference(&[1.0, 3.0], &[2.0, 3.0], &[0.5, -0.5], a);
        assert_eq!((y, mean, inv), (vec![-1.5, 2.5], vec![2.0], vec![1.0]));
        // A constant row has variance 0: epsilon alone keeps it finite.
        let (y, _, inv) = reference(&[5.0; 4], &[1.0; 4], &[0.0; 4], LayerNormArgs::new(1, 4, 1e-4));
        assert_eq!(y, vec![0.0; 4]);
        assert!((inv[0] - 100.0).abs() < 1e-4, "{inv:?}");
    }
}
