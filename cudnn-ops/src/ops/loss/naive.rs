//! The naive half: `F.cross_entropy(logits.float(), targets)` and its backward as eager runs them
//! (`loss.cu`): `.float()`, `log_softmax`, `nll_loss`; then `nll_loss_backward` (zeros and a
//! scatter), `log_softmax_backward` and the cast back, three f32 `[tokens, vocab]` intermediates.

use super::{ignore_args, row_blocks, suffix, CrossEntropyArgs, CrossEntropyOperands, Ptrs, ONE_BLOCK};
use crate::dtype::{DataType, Element};
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Result};

impl<T: Element> Naive<T> for CrossEntropyArgs {
    fn naive(self, ctx: &Cudnn, x: CrossEntropyOperands<'_, T>) -> Result<()> {
        let sfx = suffix(T::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let CrossEntropyArgs { tokens, vocab, ignore_index, grad_scale } = self;
        let p = Ptrs::new(ctx, x);
        // Every size below was checked by `CrossEntropyArgs::check` (n and 3n fit i64).
        let i = |v: usize| Arg::I64(v as i64);
        let (ignore, has_ignore) = ignore_args(ignore_index);
        let n = tokens * vocab;
        let wide = T::DTYPE != DataType::F32;
        // f32 scratch: [x32 (16-bit logits only)] [logp] [g] [total weight].
        let base = scratch(ctx, kernels, 3 * n + 1)?;
        let at = |k: usize| base + 4 * (k * n) as u64;
        let (logp, g, out) = (at(1), at(2), at(3));
        let x32 = if wide {
            elementwise(ctx, kernels, &format!("cast_{sfx}_f32"), n, &[Arg::Ptr(p.logits), Arg::Ptr(at(0))])?;
            at(0)
        } else {
            p.logits
        };
        launch(
            ctx,
            kernels,
            "ce_log_softmax_f32",
            row_blocks(tokens, 1024)?,
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
        launch(ctx, kernels, "ce_nll_forward", ONE_BLOCK, &nll)?;
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
            row_blocks(tokens, 1024)?,
            &[Arg::Ptr(g), Arg::Ptr(logp), i(vocab), Arg::Ptr(gi)],
        )?;
        if wide {
            elementwise(ctx, kernels, &format!("cast_f32_{sfx}"), n, &[Arg::Ptr(g), Arg::Ptr(d)])?;
        }
        Ok(())
    }
}
