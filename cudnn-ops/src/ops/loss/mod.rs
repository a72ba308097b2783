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

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Shape and options of a cross-entropy call over `logits [tokens, vocab]` (packed rows) and one i32
/// target per token.
#[derive(Debug, Clone, Copy, PartialEq)]
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

/// Threads per row block of the fused kernel.
const ROW_THREADS: u32 = 512;

impl CrossEntropyArgs {
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

fn suffix(dtype: DataType) -> Result<&'static str> {
    match dtype {
        DataType::BF16 => Ok("bf16"),
        DataType::F16 => Ok("f16"),
        DataType::F32 => Ok("f32"),
        other => Err(Error::NotSupported {
            op: "cross_entropy".into(),
            reason: format!("takes bf16, f16 or f32 logits, not {other}"),
        }),
    }
}

/// The mean cross-entropy loss into `loss[0]` (f32), forward only.
pub fn cross_entropy_loss<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: CrossEntropyArgs,
    logits: &(impl DevicePtr<T> + ?Sized),
    targets: &(impl DevicePtr<i32> + ?Sized),
    loss: &mut (impl DevicePtrMut<f32> + ?Sized),
) -> Result<()> {
    args.check(logits.len(), targets.len(), loss.len(), None)?;
    let sfx = suffix(T::DTYPE)?;
    let (x, _gx) = logits.device_ptr(ctx.stream());
    let (t, _gt) = targets.device_ptr(ctx.stream());
    let (l, _gl) = loss.device_ptr_mut(ctx.stream());
    run::<T>(backend, ctx, args, sfx, Ptrs { logits: x, targets: t, loss: l, dlogits: None })
}

/// The mean loss into `loss[0]` and its gradient with respect to the logits into `dlogits` (the
/// logits' dtype), in one call.
pub fn cross_entropy<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: CrossEntropyArgs,
    logits: &(impl DevicePtr<T> + ?Sized),
    targets: &(impl DevicePtr<i32> + ?Sized),
    loss: &mut (impl DevicePtrMut<f32> + ?Sized),
    dlogits: &mut (impl DevicePtrMut<T> + ?Sized),
) -> Result<()> {
    args.check(logits.len(), targets.len(), loss.len(), Some(dlogits.len()))?;
    let sfx = suffix(T::DTYPE)?;
    let (x, _gx) = logits.device_ptr(ctx.stream());
    let (t, _gt) = targets.device_ptr(ctx.stream());
    let (l, _gl) = loss.device_ptr_mut(ctx.stream());
    let (d, _gd) = dlogits.device_ptr_mut(ctx.stream());
    run::<T>(backend, ctx, args, sfx, Ptrs { logits: x, targets: t, loss: l, dlogits: Some(d) })
}

/// [`cross_entropy`] with the gradient written over the logits (no second `[tokens, vocab]` buffer).
pub fn cross_entropy_in_place<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: CrossEntropyArgs,
    logits: &mut (impl DevicePtrMut<T> + ?Sized),
    targets: &(impl DevicePtr<i32> + ?Sized),
    loss: &mut (impl DevicePtrMut<f32> + ?Sized),
) -> Result<()> {
    args.check(logits.len(), targets.len(), loss.len(), Some(logits.len()))?;
    let sfx = suffix(T::DTYPE)?;
    let (t, _gt) = targets.device_ptr(ctx.stream());
    let (l, _gl) = loss.device_ptr_mut(ctx.stream());
    let (x, _gx) = logits.device_ptr_mut(ctx.stream());
    run::<T>(backend, ctx, args, sfx, Ptrs { logits: x, targets: t, loss: l, dlogits: Some(x) })
}

/// Device addresses of one call (their guards live in the caller).
struct Ptrs {
    logits: u64,
    targets: u64,
    loss: u64,
    dlogits: Option<u64>,
}

fn run<T: Element>(backend: Backend, ctx: &Cudnn, args: CrossEntropyArgs, sfx: &str, p: Ptrs) -> Result<()> {
    let kernels = Kernels::get(ctx)?;
    let CrossEntropyArgs { tokens, vocab, ignore_index, grad_scale } = args;
    // Every size below was checked by `CrossEntropyArgs::check` (n and 3n fit i64).
    let i = |v: usize| Arg::I64(v as i64);
    let (ignore, has_ignore) =
        (Arg::I64(ignore_index.unwrap_or(0) as i64), i(ignore_index.is_some() as usize));
    let rows = |threads: u32| -> Result<LaunchConfig> {
        Ok(LaunchConfig {
            grid_dim: (checked::launch_dim("cross_entropy: tokens", tokens)?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    };
    let one_block = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    match backend {
        Backend::Fused => {
            // Op-owned scratch: count, then row losses, then row log-sum-exps.
            let base = scratch(ctx, kernels, 2 * tokens + 1)?;
            let (count, row_loss, lse) = (base, base + 4, base + 4 * (tokens as u64 + 1));
            launch(
                ctx,
                kernels,
                "ce_count",
                one_block,
                &[Arg::Ptr(p.targets), i(tokens), ignore, has_ignore, Arg::Ptr(count)],
            )?;
            launch(
                ctx,
                kernels,
                &format!("ce_fused_{sfx}"),
                rows(ROW_THREADS)?,
                &[
                    Arg::Ptr(p.logits),
                    Arg::Ptr(p.dlogits.unwrap_or(0)),
                    Arg::Ptr(p.targets),
                    i(vocab),
                    ignore,
                    has_ignore,
                    Arg::Ptr(count),
                    Arg::F32(grad_scale),
                    Arg::Ptr(row_loss),
                    Arg::Ptr(lse),
                    i(p.dlogits.is_some() as usize),
                ],
            )?;
            launch(
                ctx,
                kernels,
                "ce_mean",
                one_block,
                &[Arg::Ptr(row_loss), i(tokens), Arg::Ptr(count), Arg::Ptr(p.loss)],
            )
        }
        Backend::Naive => {
            let n = tokens * vocab;
            let wide = T::DTYPE != DataType::F32;
            // f32 scratch: [x32 (16-bit logits only)] [logp] [g] [total weight].
            let base = scratch(ctx, kernels, 3 * n + 1)?;
            let at = |k: usize| base + 4 * (k * n) as u64;
            let (logp, g, out) = (at(1), at(2), at(3));
            let x32 = if wide {
                elementwise(
                    ctx,
                    kernels,
                    &format!("cast_{sfx}_f32"),
                    n,
                    &[Arg::Ptr(p.logits), Arg::Ptr(at(0))],
                )?;
                at(0)
            } else {
                p.logits
            };
            launch(
                ctx,
                kernels,
                "ce_log_softmax_f32",
                rows(1024)?,
                &[Arg::Ptr(x32), i(vocab), Arg::Ptr(logp)],
            )?;
            let nll = [
                Arg::Ptr(logp),
                Arg::Ptr(p.targets),
                i(tokens),
                i(vocab),
                ignore,
                has_ignore,
                Arg::Ptr(p.loss),
                Arg::Ptr(out),
            ];
            launch(ctx, kernels, "ce_nll_forward", one_block, &nll)?;
            let Some(d) = p.dlogits else { return Ok(()) };
            elementwise(ctx, kernels, "bwd_fill_f32", n, &[Arg::Ptr(g), Arg::F32(0.0)])?;
            let scatter = [
                Arg::Ptr(p.targets),
                i(vocab),
                ignore,
                has_ignore,
                Arg::Ptr(out),
                Arg::F32(grad_scale),
                Arg::Ptr(g),
            ];
            elementwise(ctx, kernels, "ce_nll_backward", tokens, &scatter)?;
            let gi = if wide { g } else { d };
            launch(
                ctx,
                kernels,
                "ce_log_softmax_backward_f32",
                rows(1024)?,
                &[Arg::Ptr(g), Arg::Ptr(logp), i(vocab), Arg::Ptr(gi)],
            )?;
            if wide {
                elementwise(ctx, kernels, &format!("cast_f32_{sfx}"), n, &[Arg::Ptr(g), Arg::Ptr(d)])?;
            }
            Ok(())
        }
    }
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
