//! RMSNorm over row-major `[tokens, hidden]`: `y = x / sqrt(mean(x²) + ε) * weight`, f32 compute,
//! I/O in bf16, f16 or f32. Fused: one cuDNN `NORM_FORWARD` (RMS_NORM) graph per shape, dtype and
//! phase ([`RmsNormArgs::graph`]). Naive: Hugging Face's `LlamaRMSNorm.forward` as eager runs it
//! ([`naive`]). The training phase (an inverse-RMS buffer in the operands) also writes the f32
//! inverse RMS of each row.
//!
//! The backward phase is [`rms_norm_backward`]: dy, x, the weight and the training forward's saved
//! inverse RMS in, dx and dweight out ([`RmsNormGrads`]), optionally with the gradient of a pre-norm
//! residual stream added to dx. Fused: one cuDNN `NORM_BACKWARD` (RMS_NORM) graph per shape and dtype
//! ([`RmsNormArgs::backward_graph`]); naive: eager autograd of `LlamaRMSNorm` ([`naive`]).

mod fused;
pub mod naive;

use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::NormPhase;
use crate::ops::Op;
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::marker::PhantomData;

/// Shape and epsilon of an RMSNorm call.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RmsNormArgs {
    /// Rows (tokens).
    pub tokens: usize,
    /// Row length (hidden size).
    pub hidden: usize,
    /// Added to the mean square before the square root.
    pub epsilon: f32,
}

impl RmsNormArgs {
    /// `tokens` rows of `hidden` elements, `epsilon` added to each row's mean square.
    pub fn new(tokens: usize, hidden: usize, epsilon: f32) -> Self {
        RmsNormArgs { tokens, hidden, epsilon }
    }

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
    pub fn key(&self, dtype: DataType, phase: NormPhase) -> Key {
        Key { tokens: self.tokens, hidden: self.hidden, row_stride: self.hidden, dtype, phase }
    }
}

impl RmsNormArgs {
    /// Checks the backward's arguments and buffer lengths shared by every backend; nothing is touched
    /// on error. Epsilon is not read (it is inside the saved inverse RMS). An empty inverse-RMS buffer is
    /// the statistic an inference forward never wrote: an error naming the training forward.
    pub fn check_backward(&self, lens: &GradLens) -> Result<()> {
        let RmsNormArgs { tokens, hidden, .. } = *self;
        ensure!(tokens > 0, "rms_norm_backward: tokens must be > 0");
        ensure!(hidden > 0, "rms_norm_backward: hidden must be > 0");
        let n = crate::checked::product("rms_norm_backward: tokens * hidden", &[tokens, hidden])?;
        ensure!(
            lens.inv_rms > 0,
            "rms_norm_backward: the inverse-RMS buffer is empty; the backward needs the f32 inverse RMS the \
             training forward saves (RmsNormOperands::inv_rms), an inference forward saves none"
        );
        ensure!(
            lens.inv_rms >= tokens,
            "rms_norm_backward: inv_rms has {} elements, needs tokens = {tokens} (one per row, from the \
             training forward of this shape)",
            lens.inv_rms
        );
        ensure!(
            lens.weight == hidden,
            "rms_norm_backward: weight has {} elements, hidden is {hidden}",
            lens.weight
        );
        ensure!(
            lens.dweight == hidden,
            "rms_norm_backward: dweight has {} elements, hidden is {hidden}",
            lens.dweight
        );
        for (what, len) in [("dy", lens.dy), ("x", lens.x), ("dx", lens.dx)] {
            ensure!(len >= n, "rms_norm_backward: {what} has {len} elements, needs tokens*hidden = {n}");
        }
        if let Some(len) = lens.d_residual {
            ensure!(len >= n, "rms_norm_backward: d_residual has {len} elements, needs tokens*hidden = {n}");
        }
        Ok(())
    }

    /// The plan-cache key of the backward for this shape.
    pub fn backward_key(&self, dtype: DataType, d_residual: bool) -> BackwardKey {
        BackwardKey { tokens: self.tokens, hidden: self.hidden, row_stride: self.hidden, dtype, d_residual }
    }
}

/// Element counts of the backward's buffers, checked by [`RmsNormArgs::check_backward`] (no GPU
/// needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GradLens {
    /// dy.
    pub dy: usize,
    /// x.
    pub x: usize,
    /// The weight.
    pub weight: usize,
    /// The saved inverse RMS.
    pub inv_rms: usize,
    /// dx.
    pub dx: usize,
    /// dweight.
    pub dweight: usize,
    /// The residual stream's gradient, when given.
    pub d_residual: Option<usize>,
}

/// What identifies an RMSNorm backward plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct BackwardKey {
    /// Rows.
    pub tokens: usize,
    /// Row length.
    pub hidden: usize,
    /// Element stride between rows (`hidden` when packed).
    pub row_stride: usize,
    /// I/O dtype (dy, x, weight, dx, dweight).
    pub dtype: DataType,
    /// Whether the residual stream's gradient is added to dx in the graph.
    pub d_residual: bool,
}

/// The buffers of an RMSNorm backward: dy, x, weight and the training forward's f32 inverse RMS in;
/// dx and dweight out (overwritten); optionally the gradient of a pre-norm residual stream, added to
/// dx (`dx = norm'ᵀ dy + d_residual`, the gradient reaching the stream along both paths).
#[non_exhaustive]
pub struct RmsNormGrads<'a, T: Element> {
    /// The gradient of y, `[tokens, hidden]`.
    pub dy: &'a dyn DevicePtr<T>,
    /// The forward's input, `[tokens, hidden]`.
    pub x: &'a dyn DevicePtr<T>,
    /// `[hidden]`.
    pub weight: &'a dyn DevicePtr<T>,
    /// The f32 inverse RMS of each row, as the training forward wrote it ([`RmsNormOperands::inv_rms`]).
    pub inv_rms: &'a dyn DevicePtr<f32>,
    /// The residual stream's gradient `[tokens, hidden]`, added to dx.
    pub d_residual: Option<&'a dyn DevicePtr<T>>,
    /// The gradient of x, `[tokens, hidden]`.
    pub dx: &'a mut dyn DevicePtrMut<T>,
    /// The gradient of the weight, `[hidden]` (overwritten, not accumulated).
    pub dweight: &'a mut dyn DevicePtrMut<T>,
}

impl<'a, T: Element> RmsNormGrads<'a, T> {
    /// dy, x, weight and the saved inverse RMS in; dx and dweight out.
    pub fn new(
        dy: &'a dyn DevicePtr<T>,
        x: &'a dyn DevicePtr<T>,
        weight: &'a dyn DevicePtr<T>,
        inv_rms: &'a dyn DevicePtr<f32>,
        dx: &'a mut dyn DevicePtrMut<T>,
        dweight: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        RmsNormGrads { dy, x, weight, inv_rms, d_residual: None, dx, dweight }
    }

    /// Adds the residual stream's gradient to dx.
    pub fn d_residual(mut self, d_residual: &'a dyn DevicePtr<T>) -> Self {
        self.d_residual = Some(d_residual);
        self
    }

    /// The buffer lengths.
    pub fn lens(&self) -> GradLens {
        GradLens {
            dy: self.dy.len(),
            x: self.x.len(),
            weight: self.weight.len(),
            inv_rms: self.inv_rms.len(),
            dx: self.dx.len(),
            dweight: self.dweight.len(),
            d_residual: self.d_residual.map(|r| r.len()),
        }
    }
}

/// The element type of the backward phase: `Op<Grad<T>>` is RMSNorm's backward on `T` tensors.
pub(crate) struct Grad<T>(PhantomData<T>);

impl<T: Element> Op<Grad<T>> for RmsNormArgs {
    type Operands<'a> = RmsNormGrads<'a, T>;

    fn checked(self, x: &RmsNormGrads<'_, T>) -> Result<Self> {
        self.check_backward(&x.lens())?;
        Ok(self)
    }
}

/// RMSNorm's backward on `backend`: dx and dweight from dy, x, the weight and the training forward's
/// inverse RMS ([`RmsNormGrads`]; `.d_residual(&g)` adds a residual stream's gradient to dx). The
/// fused graph adds the residual gradient only where cuDNN fuses norm backward with an add (9.21 and
/// later, [`crate::Features::rmsnorm_backward_add`]); before, that call is [`crate::Error::NotSupported`]
/// and nothing is written.
pub fn rms_norm_backward<T: Element>(
    ctx: &Cudnn,
    args: RmsNormArgs,
    x: RmsNormGrads<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<Grad<T>, _>(ctx, args, x, backend)
}

/// What identifies an RMSNorm plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Key {
    /// Rows.
    pub tokens: usize,
    /// Row length.
    pub hidden: usize,
    /// Element stride between rows (`hidden` when packed).
    pub row_stride: usize,
    /// I/O dtype (x, weight, y).
    pub dtype: DataType,
    /// Inference or training.
    pub phase: NormPhase,
}

/// The buffers of an RMSNorm call: x and weight `[hidden]` in, y out, and in the training phase the
/// f32 inverse RMS `[tokens]`.
#[non_exhaustive]
pub struct RmsNormOperands<'a, T: Element> {
    /// `[tokens, hidden]` row-major.
    pub x: &'a dyn DevicePtr<T>,
    /// `[hidden]`.
    pub weight: &'a dyn DevicePtr<T>,
    /// `[tokens, hidden]`, like x.
    pub y: &'a mut dyn DevicePtrMut<T>,
    /// The f32 inverse RMS of each row; given, it selects the training phase.
    pub inv_rms: Option<&'a mut dyn DevicePtrMut<f32>>,
}

impl<'a, T: Element> RmsNormOperands<'a, T> {
    /// Inference: x and weight in, y out.
    pub fn new(
        x: &'a dyn DevicePtr<T>,
        weight: &'a dyn DevicePtr<T>,
        y: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        RmsNormOperands { x, weight, y, inv_rms: None }
    }

    /// Training: also writes the f32 inverse RMS of each row.
    pub fn inv_rms(mut self, inv_rms: &'a mut dyn DevicePtrMut<f32>) -> Self {
        self.inv_rms = Some(inv_rms);
        self
    }

    /// The phase the operands select.
    pub fn phase(&self) -> NormPhase {
        if self.inv_rms.is_some() {
            NormPhase::Training
        } else {
            NormPhase::Inference
        }
    }
}

impl<T: Element> Op<T> for RmsNormArgs {
    type Operands<'a> = RmsNormOperands<'a, T>;

    fn checked(self, x: &RmsNormOperands<'_, T>) -> Result<Self> {
        self.check(x.x.len(), x.weight.len(), x.y.len(), x.inv_rms.as_ref().map(|i| i.len()))?;
        Ok(self)
    }
}

/// RMSNorm on `backend`; the phase follows the operands ([`RmsNormOperands::inv_rms`] for training).
pub fn rms_norm<T: Element>(
    ctx: &Cudnn,
    args: RmsNormArgs,
    x: RmsNormOperands<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, args, x, backend)
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
    fn backward_argument_errors() {
        let a = RmsNormArgs { tokens: 4, hidden: 8, epsilon: 1e-5 };
        let ok = GradLens { dy: 32, x: 32, weight: 8, inv_rms: 4, dx: 32, dweight: 8, d_residual: Some(32) };
        a.check_backward(&ok).unwrap();
        // Epsilon is inside the saved statistic: the backward does not read it.
        RmsNormArgs { epsilon: f32::NAN, ..a }.check_backward(&ok).unwrap();
        let cases = [
            (RmsNormArgs { tokens: 0, ..a }.check_backward(&ok), "tokens must be > 0"),
            (RmsNormArgs { hidden: 0, ..a }.check_backward(&ok), "hidden must be > 0"),
            (a.check_backward(&GradLens { inv_rms: 0, ..ok }), "training forward saves"),
            (a.check_backward(&GradLens { inv_rms: 3, ..ok }), "inv_rms has 3 elements, needs tokens = 4"),
            (a.check_backward(&GradLens { weight: 7, ..ok }), "weight has 7 elements, hidden is 8"),
            (a.check_backward(&GradLens { dweight: 9, ..ok }), "dweight has 9 elements, hidden is 8"),
            (a.check_backward(&GradLens { dy: 31, ..ok }), "dy has 31 elements"),
            (a.check_backward(&GradLens { x: 31, ..ok }), "x has 31 elements"),
            (a.check_backward(&GradLens { dx: 31, ..ok }), "dx has 31 elements"),
            (a.check_backward(&GradLens { d_residual: Some(31), ..ok }), "d_residual has 31 elements"),
            (RmsNormArgs { tokens: usize::MAX, ..a }.check_backward(&ok), "overflows"),
        ];
        for (r, expected) in cases {
            let e = r.unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)) && e.to_string().contains(expected), "{e}");
        }
    }

    #[test]
    fn backward_keys_differ_from_each_other_by_shape_dtype_and_residual() {
        let a = RmsNormArgs { tokens: 30, hidden: 4096, epsilon: 1e-5 };
        let base = a.backward_key(DataType::BF16, false);
        assert_eq!(base, RmsNormArgs { epsilon: 1e-6, ..a }.backward_key(DataType::BF16, false));
        for k in [
            RmsNormArgs { tokens: 31, ..a }.backward_key(DataType::BF16, false),
            RmsNormArgs { hidden: 2048, ..a }.backward_key(DataType::BF16, false),
            a.backward_key(DataType::F32, false),
            a.backward_key(DataType::BF16, true),
        ] {
            assert_ne!(base, k);
        }
    }

    #[test]
    fn same_shape_same_key_any_change_different_key() {
        use std::collections::hash_map::DefaultHasher;
        use std::hash::{Hash, Hasher};
        let key =
            |tokens, hidden, dtype, phase| RmsNormArgs { tokens, hidden, epsilon: 1e-5 }.key(dtype, phase);
        let hash = |k: &Key| {
            let mut h = DefaultHasher::new();
            k.hash(&mut h);
            h.finish()
        };
        let base = key(30, 4096, DataType::BF16, NormPhase::Inference);
        assert_eq!(base, key(30, 4096, DataType::BF16, NormPhase::Inference));
        assert_eq!(hash(&base), hash(&key(30, 4096, DataType::BF16, NormPhase::Inference)));
        // Epsilon is bound by value and never part of the key.
        let eps =
            RmsNormArgs { tokens: 30, hidden: 4096, epsilon: 1e-6 }.key(DataType::BF16, NormPhase::Inference);
        assert_eq!(base, eps);
        let changed = [
            key(31, 4096, DataType::BF16, NormPhase::Inference),
            key(30, 2048, DataType::BF16, NormPhase::Inference),
            key(30, 4096, DataType::F16, NormPhase::Inference),
            key(30, 4096, DataType::BF16, NormPhase::Training),
            Key { row_stride: 4104, ..base },
        ];
        for k in changed {
            assert_ne!(base, k);
            assert_ne!(hash(&base), hash(&k), "{k:?}");
        }
    }
}
