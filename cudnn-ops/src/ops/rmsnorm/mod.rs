//! RMSNorm over row-major `[tokens, hidden]`: `y = x / sqrt(mean(x²) + ε) * weight`, f32 compute,
//! I/O in bf16, f16 or f32. Fused: one cuDNN `NORM_FORWARD` (RMS_NORM) graph per shape, dtype and
//! phase ([`RmsNormArgs::graph`]). Naive: Hugging Face's `LlamaRMSNorm.forward` as eager runs it
//! ([`naive`]). The training phase (an inverse-RMS buffer in the operands) also writes the f32
//! inverse RMS of each row.

mod fused;
pub mod naive;

use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::NormPhase;
use crate::ops::Op;
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
    pub fn key(&self, dtype: DataType, phase: NormPhase) -> Key {
        Key { tokens: self.tokens, hidden: self.hidden, row_stride: self.hidden, dtype, phase }
    }
}

/// What identifies an RMSNorm plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
