//! The fused half: three launches (count the targets, one block per row for the loss and, in the
//! backward, the gradient, a deterministic mean), no f32 copy of the logits (`loss.cu`).

use super::{ignore_args, row_blocks, suffix, CrossEntropyArgs, CrossEntropyOperands, Ptrs, ONE_BLOCK};
use crate::dtype::Element;
use crate::kernels::{launch, scratch, Arg, Kernels};
use crate::ops::Fused;
use crate::{Cudnn, Result};

/// Threads per row block of the fused kernel.
const ROW_THREADS: u32 = 512;

impl<T: Element> Fused<T> for CrossEntropyArgs {
    fn fused(self, ctx: &Cudnn, x: CrossEntropyOperands<'_, T>) -> Result<()> {
        let sfx = suffix(T::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let CrossEntropyArgs { tokens, vocab, ignore_index, grad_scale } = self;
        let p = Ptrs::new(ctx, x);
        // Every size below was checked by `CrossEntropyArgs::check`.
        let i = |v: usize| Arg::I64(v as i64);
        let (ignore, has_ignore) = ignore_args(ignore_index);
        // Op-owned scratch: count, then row losses, then row log-sum-exps.
        let base = scratch(ctx, kernels, 2 * tokens + 1)?;
        let (count, row_loss, lse) = (base, base + 4, base + 4 * (tokens as u64 + 1));
        launch(
            ctx,
            kernels,
            "ce_count",
            ONE_BLOCK,
            &[Arg::Ptr(p.targets), i(tokens), ignore, has_ignore, Arg::Ptr(count)],
        )?;
        launch(
            ctx,
            kernels,
            &format!("ce_fused_{sfx}"),
            row_blocks(tokens, ROW_THREADS)?,
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
            ONE_BLOCK,
            &[Arg::Ptr(row_loss), i(tokens), Arg::Ptr(count), Arg::Ptr(p.loss)],
        )
    }
}
