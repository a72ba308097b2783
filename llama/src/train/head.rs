//! The ends of the model in training: the embedding lookup and its scatter-add backward, and
//! `lm_head` with the loss (the fused cross-entropy writes the mean loss and the logits' gradient
//! over the logits in one call).

use super::linear::Linear;
use super::{Pass, IGNORE_INDEX};
use crate::backends::{ModuleKind, Site};
use crate::modules::linear::Then;
use crate::modules::EMBED_RANGE;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::{CudaSlice, DevicePtrMut};
use cudnn_llm_ops::{
    cross_entropy, embedding, embedding_backward, Backend, CrossEntropyArgs, CrossEntropyOperands, Element,
    EmbeddingArgs, EmbeddingBackwardOperands, EmbeddingGrad, EmbeddingOperands,
};

/// The range of the embedding's backward (one scatter-add; its backend is the trainer's
/// [`standalone`](super::TrainConfig::standalone) one).
pub const BWD_EMBED_RANGE: &str = "bwd.embed";
/// The range of the loss: the fused cross-entropy, which writes the logits' gradient as well (the
/// forward's last call; the backward starts from its gradient).
pub const LOSS_RANGE: &str = "fwd.loss";

fn embedding_args<T: Element>(p: &Pass<'_, T>) -> EmbeddingArgs {
    EmbeddingArgs::new(p.rows(), p.cfg.vocab, p.cfg.hidden)
}

/// `x = table[ids]`.
pub(crate) fn embed<T: Element>(
    p: &mut Pass<'_, T>,
    ids: &CudaSlice<u32>,
    table: &CudaSlice<T>,
    x: &mut CudaSlice<T>,
) -> Result<()> {
    let (ctx, args) = (p.ctx, embedding_args(p));
    let done =
        p.dispatch.observe(EMBED_RANGE, None, || embedding(ctx, args, EmbeddingOperands::new(ids, table, x)));
    Ok(done?)
}

/// The table's f32 gradient from `g`, the gradient of the embedding's output: a deterministic
/// scatter-add over the ids, added to what `grad` holds when `accumulate` (a later micro-batch, or
/// the tied `lm_head`'s share written before it).
pub(crate) fn embed_backward<T: Element>(
    p: &mut Pass<'_, T>,
    ids: &CudaSlice<u32>,
    g: &CudaSlice<T>,
    grad: &mut CudaSlice<f32>,
    accumulate: bool,
    backend: Backend,
) -> Result<()> {
    let (ctx, args) = (p.ctx, embedding_args(p));
    let done = p.dispatch.observe(BWD_EMBED_RANGE, None, || {
        let x = EmbeddingBackwardOperands::new(ids, g, grad).how(EmbeddingGrad::Deterministic);
        embedding_backward(ctx, args, if accumulate { x.accumulate() } else { x }, backend)
    });
    Ok(done?)
}

/// `logits = y · W_headᵀ` (`[rows, vocab]`).
pub(crate) fn lm_head<T: Element>(
    p: &mut Pass<'_, T>,
    w: &CudaSlice<T>,
    y: &CudaSlice<T>,
    logits: &mut CudaSlice<T>,
) -> Result<()> {
    let (ctx, head) = (p.ctx, Linear::new(p.rows(), p.cfg.hidden, p.cfg.vocab));
    p.dispatch.run(Site::LM_HEAD, None, &p.shape, |b| head.forward(ctx, b, y, w, Then::Nothing, &mut *logits))
}

/// The mean cross-entropy of `logits` against `targets` (rows whose target is [`IGNORE_INDEX`] not
/// counted) into `loss[0]`, and the logits' gradient over the logits, scaled by `grad_scale` (this
/// micro-batch's share of the step's counted targets). On `lm_head`'s backend: the fused kernel, or
/// eager's `.float()`, `log_softmax`, `nll_loss` and their backward.
pub(crate) fn loss<T: Element>(
    p: &mut Pass<'_, T>,
    logits: &mut CudaSlice<T>,
    targets: &CudaSlice<i32>,
    loss: &mut dyn DevicePtrMut<f32>,
    grad_scale: f32,
) -> Result<()> {
    let args = CrossEntropyArgs::new(p.rows(), p.cfg.vocab)
        .with_ignore_index(IGNORE_INDEX)
        .with_grad_scale(grad_scale);
    let (ctx, backend) = (p.ctx, p.backends.get(None, ModuleKind::LmHead));
    let done = p.dispatch.observe(LOSS_RANGE, None, || {
        cross_entropy(ctx, args, CrossEntropyOperands::in_place(logits, targets, loss), backend)
    });
    Ok(done?)
}

/// From the logits' gradient (`dlogits`, over the logits' buffer): `dy`, the gradient of the output
/// norm's output, and `lm_head`'s weight gradient into its f32 sum (the embedding's, when tied).
pub(crate) fn lm_head_backward<T: Element>(
    p: &mut Pass<'_, T>,
    w: &CudaSlice<T>,
    y: &CudaSlice<T>,
    dlogits: &CudaSlice<T>,
    dy: &mut CudaSlice<T>,
    grad: &mut CudaSlice<f32>,
) -> Result<()> {
    let (ctx, acc) = (p.ctx, p.accumulate);
    let head = Linear::new(p.rows(), p.cfg.hidden, p.cfg.vocab);
    p.dispatch.run_each(Site::LM_HEAD.backward(), None, &p.shape, |ops| {
        ops.run(|b| head.data_grad(ctx, b, dlogits, w, &mut *dy, false))?;
        ops.run(|b| head.weight_grad(ctx, b, dlogits, y, &mut *grad, acc))
    })
}
