//! Cross-entropy over a vocabulary, forward and backward (custom kernels: cuDNN has no graph for it).
//!
//! Fused: one block per token row computes the row's log-sum-exp in one streaming pass over the
//! logits (an online max and sum of exponentials in registers, the row read in chunks of
//! `blockDim × 4` elements) and, for the backward, a second pass writes
//! `dlogits = grad · (softmax − onehot) / count` in the logits' dtype, optionally over the logits
//! themselves. No f32 copy of the logits exists at any point; three launches in all (count the
//! targets, the rows, a deterministic mean).
//!
//! Naive: what `F.cross_entropy(logits.float(), targets)` and its backward run in eager mode:
//! `.float()`, `log_softmax`, `nll_loss`, then `nll_loss_backward` (zeros and a scatter),
//! `log_softmax_backward` and the cast back, with three f32 `[tokens, vocab]` intermediates.

mod fused;
mod naive;

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::kernels::Arg;
use crate::ops::Op;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Shape and options of a cross-entropy call over `logits [tokens, vocab]` (packed rows) and one i32
/// target per token.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct CrossEntropyArgs {
    /// Token rows.
    pub tokens: usize,
    /// Logits per row.
    pub vocab: usize,
    /// Targets equal to this are not counted (PyTorch's `ignore_index`, usually -100).
    pub ignore_index: Option<i32>,
    /// The gradient of whatever consumes the mean loss (1 for the loss itself; `1 / steps` under
    /// gradient accumulation). Only the backward reads it.
    pub grad_scale: f32,
}

/// The most tokens one call takes: the counted tokens are summed in f32, exact up to 2^24.
pub const MAX_TOKENS: usize = 1 << 24;

/// Kernels the eager path launches for the forward alone and for forward + backward (16-bit logits;
/// f32 logits skip both casts).
pub const NAIVE_KERNELS: (usize, usize) = (3, 7);

impl CrossEntropyArgs {
    /// `tokens` rows of `vocab` logits; every target counted, gradient scale 1 (the mean loss itself).
    pub fn new(tokens: usize, vocab: usize) -> Self {
        CrossEntropyArgs { tokens, vocab, ignore_index: None, grad_scale: 1.0 }
    }

    /// The same, not counting targets equal to `ignore_index` (PyTorch's `ignore_index`, usually -100).
    pub fn with_ignore_index(self, ignore_index: i32) -> Self {
        CrossEntropyArgs { ignore_index: Some(ignore_index), ..self }
    }

    /// The same with the backward scaled by `grad_scale` (see [`CrossEntropyArgs::grad_scale`](#structfield.grad_scale)).
    pub fn with_grad_scale(self, grad_scale: f32) -> Self {
        CrossEntropyArgs { grad_scale, ..self }
    }

    /// Checks the shape against the buffer lengths with checked arithmetic (no GPU needed);
    /// `dlogits` is the length of the gradient buffer when there is one.
    pub fn check(&self, logits: usize, targets: usize, loss: usize, dlogits: Option<usize>) -> Result<()> {
        let CrossEntropyArgs { tokens, vocab, grad_scale, .. } = *self;
        ensure!(tokens > 0 && vocab > 0, "cross_entropy: empty shape {self:?}");
        ensure!(tokens <= MAX_TOKENS, "cross_entropy: {tokens} tokens exceed {MAX_TOKENS} (f32 token count)");
        ensure!(
            vocab <= i32::MAX as usize,
            "cross_entropy: vocabulary of {vocab} exceeds what i32 targets can index"
        );
        ensure!(grad_scale.is_finite(), "cross_entropy: grad_scale {grad_scale} is not finite");
        let n = checked::product("cross_entropy: tokens * vocab", &[tokens, vocab])?;
        // The eager path's three f32 intermediates of n elements.
        checked::product("cross_entropy: eager scratch", &[n, 3, 4])?;
        ensure!(logits >= n, "cross_entropy: logits have {logits} elements, need {n}");
        ensure!(targets >= tokens, "cross_entropy: {targets} targets for {tokens} tokens");
        ensure!(loss >= 1, "cross_entropy: the loss buffer is empty");
        if let Some(d) = dlogits {
            ensure!(d >= n, "cross_entropy: dlogits have {d} elements, need {n}");
        }
        Ok(())
    }
}

/// Checks host targets before upload: each is in `0..vocab` or the ignore index. (The kernels cannot
/// report a bad device target; they give a NaN loss for it.)
pub fn check_targets(targets: &[i32], vocab: usize, ignore_index: Option<i32>) -> Result<()> {
    if let Some((i, t)) =
        targets.iter().enumerate().find(|&(_, &t)| Some(t) != ignore_index && (t < 0 || t as usize >= vocab))
    {
        return Err(Error::invalid(format!(
            "cross_entropy: target {t} of token {i} is outside the vocabulary of {vocab} and not the ignore index"
        )));
    }
    Ok(())
}

pub(crate) fn suffix(dtype: DataType) -> Result<&'static str> {
    crate::kernels::float_suffix("cross_entropy", "logits", dtype)
}

/// Where the gradient of a cross-entropy call goes, which also selects its phase.
#[non_exhaustive]
pub enum Logits<'a, T: Element> {
    /// Forward only: the mean loss.
    Loss(&'a dyn DevicePtr<T>),
    /// Forward and backward: the loss and `dlogits` (the logits' dtype, `[tokens, vocab]`).
    Grad {
        /// `[tokens, vocab]` logits, read.
        logits: &'a dyn DevicePtr<T>,
        /// Their gradient, written.
        dlogits: &'a mut dyn DevicePtrMut<T>,
    },
    /// Forward and backward with the gradient written over the logits (no second `[tokens, vocab]`
    /// buffer).
    InPlace(&'a mut dyn DevicePtrMut<T>),
}

/// The buffers of a cross-entropy call: the logits (and where their gradient goes), one i32 target
/// per token, and the f32 mean loss `[1]`.
#[non_exhaustive]
pub struct CrossEntropyOperands<'a, T: Element> {
    /// The logits and the phase: [`Logits::Loss`], [`Logits::Grad`] or [`Logits::InPlace`].
    pub logits: Logits<'a, T>,
    /// Device i32 targets, one per token.
    pub targets: &'a dyn DevicePtr<i32>,
    /// f32 `[1]`: the mean loss.
    pub loss: &'a mut dyn DevicePtrMut<f32>,
}

impl<'a, T: Element> CrossEntropyOperands<'a, T> {
    /// Forward only: the mean loss of `logits` against `targets` into `loss[0]`.
    pub fn new(
        logits: &'a dyn DevicePtr<T>,
        targets: &'a dyn DevicePtr<i32>,
        loss: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        CrossEntropyOperands { logits: Logits::Loss(logits), targets, loss }
    }

    /// Forward and backward: also the gradient with respect to the logits into `dlogits`.
    pub fn with_grad(
        logits: &'a dyn DevicePtr<T>,
        dlogits: &'a mut dyn DevicePtrMut<T>,
        targets: &'a dyn DevicePtr<i32>,
        loss: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        CrossEntropyOperands { logits: Logits::Grad { logits, dlogits }, targets, loss }
    }

    /// Forward and backward, the gradient written over the logits.
    pub fn in_place(
        logits: &'a mut dyn DevicePtrMut<T>,
        targets: &'a dyn DevicePtr<i32>,
        loss: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        CrossEntropyOperands { logits: Logits::InPlace(logits), targets, loss }
    }

    /// Whether the call writes the gradient (forward and backward) or only the loss.
    pub fn backward(&self) -> bool {
        !matches!(self.logits, Logits::Loss(_))
    }

    /// Element counts of the logits and of the gradient buffer, if any.
    fn lens(&self) -> (usize, Option<usize>) {
        match &self.logits {
            Logits::Loss(l) => (l.len(), None),
            Logits::Grad { logits, dlogits } => (logits.len(), Some(dlogits.len())),
            Logits::InPlace(l) => (l.len(), Some(l.len())),
        }
    }
}

impl<T: Element> Op<T> for CrossEntropyArgs {
    type Operands<'a> = CrossEntropyOperands<'a, T>;

    fn checked(self, x: &CrossEntropyOperands<'_, T>) -> Result<Self> {
        let (logits, dlogits) = x.lens();
        self.check(logits, x.targets.len(), x.loss.len(), dlogits)?;
        suffix(T::DTYPE)?;
        Ok(self)
    }
}

/// Cross-entropy on `backend`: the mean loss into `loss[0]` and, when the operands ask for it
/// ([`CrossEntropyOperands::with_grad`], [`CrossEntropyOperands::in_place`]), its gradient with respect
/// to the logits, in one call.
pub fn cross_entropy<T: Element>(
    ctx: &Cudnn,
    args: CrossEntropyArgs,
    x: CrossEntropyOperands<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, args, x, backend)
}

/// Device addresses of one call, and the guards that record its reads and writes when they drop.
pub(crate) struct Ptrs<'a> {
    pub(crate) logits: u64,
    pub(crate) targets: u64,
    pub(crate) loss: u64,
    pub(crate) dlogits: Option<u64>,
    _guards: Vec<cudarc::driver::SyncOnDrop<'a>>,
}

impl<'a> Ptrs<'a> {
    /// The addresses of `x` on `ctx`'s stream.
    pub(crate) fn new<'b: 'a, T: Element>(ctx: &'a Cudnn, x: CrossEntropyOperands<'b, T>) -> Ptrs<'a> {
        let s = ctx.stream();
        let CrossEntropyOperands { logits, targets, loss } = x;
        let (t, gt) = targets.device_ptr(s);
        let (l, gl) = loss.device_ptr_mut(s);
        let mut guards = vec![gt, gl];
        let (logits, dlogits) = match logits {
            Logits::Loss(x) => {
                let (p, g) = x.device_ptr(s);
                guards.push(g);
                (p, None)
            }
            Logits::Grad { logits, dlogits } => {
                let (p, g) = logits.device_ptr(s);
                let (d, gd) = dlogits.device_ptr_mut(s);
                guards.extend([g, gd]);
                (p, Some(d))
            }
            Logits::InPlace(x) => {
                let (p, g) = x.device_ptr_mut(s);
                guards.push(g);
                (p, Some(p))
            }
        };
        Ptrs { logits, targets: t, loss: l, dlogits, _guards: guards }
    }
}

/// The rows of one launch, one block each.
pub(crate) fn row_blocks(tokens: usize, threads: u32) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (checked::launch_dim("cross_entropy: tokens", tokens)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One block of 1024 threads (the count and the mean).
pub(crate) const ONE_BLOCK: LaunchConfig =
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };

/// `(ignore, has_ignore)` as the kernels take them.
pub(crate) fn ignore_args(ignore_index: Option<i32>) -> (Arg, Arg) {
    (Arg::I64(ignore_index.unwrap_or(0) as i64), Arg::I64(ignore_index.is_some() as i64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_lengths_are_checked() {
        let a = CrossEntropyArgs { tokens: 4, vocab: 10, ignore_index: Some(-100), grad_scale: 1.0 };
        a.check(40, 4, 1, Some(40)).unwrap();
        a.check(40, 4, 1, None).unwrap();
        for (bad, lens, expected) in [
            (a, (39, 4, 1, Some(40)), "logits have 39"),
            (a, (40, 3, 1, Some(40)), "3 targets for 4"),
            (a, (40, 4, 0, Some(40)), "loss buffer is empty"),
            (a, (40, 4, 1, Some(39)), "dlogits have 39"),
            (CrossEntropyArgs { tokens: 0, ..a }, (40, 4, 1, None), "empty shape"),
            (
                CrossEntropyArgs { tokens: MAX_TOKENS + 1, ..a },
                (usize::MAX, usize::MAX, 1, None),
                "f32 token count",
            ),
            (CrossEntropyArgs { vocab: 1 << 31, ..a }, (usize::MAX, 4, 1, None), "i32 targets"),
            (CrossEntropyArgs { grad_scale: f32::NAN, ..a }, (40, 4, 1, None), "not finite"),
        ] {
            let (l, t, o, d) = lens;
            let e = bad.check(l, t, o, d).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected),
                "{expected}: {e}"
            );
        }
        assert!(suffix(DataType::I32).unwrap_err().is_not_supported());
    }

    #[test]
    fn host_targets_are_checked() {
        check_targets(&[0, 9, -100], 10, Some(-100)).unwrap();
        let e = check_targets(&[0, 10], 10, Some(-100)).unwrap_err().to_string();
        assert!(e.contains("target 10 of token 1"), "{e}");
        assert!(check_targets(&[-100], 10, None).is_err(), "-100 is only ignored when asked");
        assert!(check_targets(&[-1], 10, Some(-100)).is_err());
    }
}
