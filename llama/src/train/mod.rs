//! Training: the forward that saves what the backward needs, the next-token loss, the backward through
//! every module, gradient accumulation over micro-batches, global-norm clipping and AdamW, each module
//! fused or naive as a [`Backends`] selection says (the strings inference takes).
//!
//! ```text
//! Trainer::step(batch)                                        # trainer.rs
//!   zero nothing: the first micro-batch writes the gradients, later ones add to them
//!   for each micro-batch:
//!     x0 = embed(ids)                                         # fwd.embed
//!     for each layer:                                         # the forward saves, per layer:
//!       h1 = attn_norm(x)                                     #   fwd.layer.attn.prenorm    h1, inverse RMS
//!       qkv = rope(qkv_proj(h1)); o = gqa(qkv)                #   fwd.layer.attn.{qkv_proj, rope, gqa}  qkv (rotated), o, stats
//!       x_mid = x + o_proj(o)                                 #   fwd.layer.attn.o_proj     x_mid
//!       h2 = mlp_norm(x_mid)                                  #   fwd.layer.mlp.prenorm     h2, inverse RMS
//!       x' = x_mid + down(silu(gate(h2)) ⊙ up(h2))            #   fwd.layer.mlp.mlp         up, silu(gate) ⊙ up
//!     y = output_norm(x); logits = lm_head(y)                 # fwd.output_norm, fwd.lm_head
//!     loss, dlogits = cross_entropy(logits, shifted labels)   # fwd.loss (one fused call, dlogits over the logits)
//!     dy = lm_head'(dlogits); g = output_norm'(dy)            # bwd.lm_head, bwd.output_norm
//!     for each layer, last first:
//!       dh = mlp'(g);        g += mlp_norm'(dh)               #   bwd.layer.mlp.{mlp, prenorm}
//!       do = o_proj'(g); dqkv = rope'(gqa'(do)); dh = qkv_proj'(dqkv); g += attn_norm'(dh)
//!                                                             #   bwd.layer.attn.{o_proj, gqa, rope, qkv_proj, prenorm}
//!     embed'(g)                                               # bwd.embed
//!   norm, coefficient = grad_norm(grads, clip)                # opt.grad_norm
//!   adamw(params, grads · coefficient)                        # opt.adamw
//! ```
//!
//! Activations are in the model's dtype (bf16); gradients of the weights are f32 sums over the
//! step's micro-batches (each weight-gradient GEMM adds to its buffer in its epilogue, an embedding
//! tied to `lm_head` receives both shares), AdamW keeps f32 moments and, if asked, f32 master
//! weights. The loss is the mean over every counted target of the step, whatever the micro-batch
//! split: each micro-batch's cross-entropy gradient is scaled by its share of the counted targets.
//!
//! Each backward module runs inside a `bwd.` range named like its forward
//! ([`Site::backward`](crate::Site::backward)) on the
//! backend its kind has in the selection; a fused op that cuDNN refuses runs naive on its own and is
//! recorded ([`Trainer::fallbacks`]). The loss follows `lm_head`'s backend; the embedding's backward,
//! the gradient norm and AdamW, which belong to no module kind, run on
//! [`TrainConfig::standalone`].
//!
//! With activation checkpointing ([`TrainConfig::checkpoint`]) the forward keeps only the stream at
//! each layer's input; before a layer's backward its forward runs again from there (its `fwd.`
//! ranges appear inside the backward), into one layer's worth of saved activations.

mod attention;
mod head;
mod linear;
mod mlp;
mod norm;
mod params;
mod trainer;
mod views;

pub use head::{BWD_EMBED_RANGE, LOSS_RANGE};
pub use trainer::{Trainer, ADAMW_RANGE, GRAD_NORM_RANGE};

use crate::backends::Backends;
use crate::config::LlamaConfig;
use crate::modules::dispatch::Dispatch;
use crate::{Backend, Error, Result};
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{Cudnn, Element, RopeTables};

/// Labels equal to this count for nothing (PyTorch's and Hugging Face's `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// Next-token targets of a batch, one per token row (`batch · seq`, batch-major), from labels as
/// Hugging Face takes them (the same shape as the inputs): the token at position `t` predicts the
/// label at `t + 1`; the last position of each sequence, and positions whose next label is
/// [`IGNORE_INDEX`], predict nothing ([`IGNORE_INDEX`]).
pub fn shift_labels(labels: &[Vec<i32>]) -> Vec<i32> {
    labels
        .iter()
        .flat_map(|seq| seq.iter().skip(1).copied().chain((!seq.is_empty()).then_some(IGNORE_INDEX)))
        .collect()
}

/// One step's sequences: inputs of equal length, and labels (the inputs themselves unless given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    inputs: Vec<Vec<u32>>,
    labels: Option<Vec<Vec<i32>>>,
}

impl Batch {
    /// Sequences that are their own labels: each token predicts the next.
    pub fn new(inputs: Vec<Vec<u32>>) -> Self {
        Batch { inputs, labels: None }
    }

    /// With labels of the inputs' shape (see [`shift_labels`]); [`IGNORE_INDEX`] masks a position.
    pub fn with_labels(self, labels: Vec<Vec<i32>>) -> Self {
        Batch { labels: Some(labels), ..self }
    }

    /// The sequences.
    pub fn inputs(&self) -> &[Vec<u32>] {
        &self.inputs
    }

    /// The labels, the inputs where none were given.
    pub fn labels(&self) -> Vec<Vec<i32>> {
        match &self.labels {
            Some(l) => l.clone(),
            None => self.inputs.iter().map(|s| s.iter().map(|&t| t as i32).collect()).collect(),
        }
    }

    /// The next-token targets, one per token row ([`shift_labels`] of [`Batch::labels`]).
    pub fn targets(&self) -> Vec<i32> {
        shift_labels(&self.labels())
    }
}

/// Hyperparameters of a [`Trainer`], and the backends it runs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TrainConfig {
    /// AdamW's learning rate.
    pub lr: f64,
    /// AdamW's moment decays `(beta1, beta2)`.
    pub betas: (f64, f64),
    /// AdamW's epsilon.
    pub eps: f64,
    /// Decoupled weight decay (applied to every tensor, as `torch.optim.AdamW` over all parameters).
    pub weight_decay: f64,
    /// Clips the global gradient norm to this (`clip_grad_norm_`); `None` leaves gradients as they are.
    pub clip: Option<f32>,
    /// Micro-batches a step's sequences are split into; gradients add up over them.
    pub micro_batches: usize,
    /// f32 master weights that AdamW updates (the model's bf16 weights are their rounding).
    pub master_weights: bool,
    /// Activation checkpointing: keep only each layer's input and recompute the layer's other
    /// activations before its backward (one layer's activations in memory instead of all, for one
    /// more forward of the layers).
    pub checkpoint: bool,
    /// The backend of each module, forward and backward.
    pub backends: Backends,
    /// The backend of the ops outside the module kinds: the embedding's backward, the gradient norm
    /// and AdamW.
    pub standalone: Backend,
}

impl TrainConfig {
    /// AdamW with learning rate `lr`, betas (0.9, 0.95), eps 1e-8, no weight decay, no clipping, one
    /// micro-batch, no master weights, no activation checkpointing, everything fused.
    pub fn new(lr: f64) -> Self {
        TrainConfig {
            lr,
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.0,
            clip: None,
            micro_batches: 1,
            master_weights: false,
            checkpoint: false,
            backends: Backends::all(Backend::Fused),
            standalone: Backend::Fused,
        }
    }

    /// With AdamW's betas.
    pub fn with_betas(self, beta1: f64, beta2: f64) -> Self {
        TrainConfig { betas: (beta1, beta2), ..self }
    }

    /// With AdamW's epsilon.
    pub fn with_eps(self, eps: f64) -> Self {
        TrainConfig { eps, ..self }
    }

    /// With decoupled weight decay.
    pub fn with_weight_decay(self, weight_decay: f64) -> Self {
        TrainConfig { weight_decay, ..self }
    }

    /// Clipping the global gradient norm to `max_norm`.
    pub fn with_clip(self, max_norm: f32) -> Self {
        TrainConfig { clip: Some(max_norm), ..self }
    }

    /// Splitting each step into `micro_batches` micro-batches.
    pub fn with_micro_batches(self, micro_batches: usize) -> Self {
        TrainConfig { micro_batches, ..self }
    }

    /// With (or without) f32 master weights.
    pub fn with_master_weights(self, master_weights: bool) -> Self {
        TrainConfig { master_weights, ..self }
    }

    /// With (or without) activation checkpointing.
    pub fn with_checkpointing(self, checkpoint: bool) -> Self {
        TrainConfig { checkpoint, ..self }
    }

    /// With the modules' backends.
    pub fn with_backends(self, backends: Backends) -> Self {
        TrainConfig { backends, ..self }
    }

    /// With the backend of the embedding's backward, the gradient norm and AdamW.
    pub fn with_standalone(self, standalone: Backend) -> Self {
        TrainConfig { standalone, ..self }
    }

    /// Checks the hyperparameters (errors name the field) and the selection against a model of
    /// `layers` layers.
    pub fn check(&self, layers: usize) -> Result<()> {
        let fail = |m: String| Err(Error::Train(m));
        let (b1, b2) = self.betas;
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return fail(format!("lr {} is not a finite number >= 0", self.lr));
        }
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return fail(format!("betas ({b1}, {b2}) are not both in [0, 1)"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return fail(format!("eps {} is not a finite number > 0", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return fail(format!("weight_decay {} is not a finite number >= 0", self.weight_decay));
        }
        if let Some(c) = self.clip {
            if !(c.is_finite() && c > 0.0) {
                return fail(format!("clip {c} is not a finite number > 0"));
            }
        }
        if self.micro_batches == 0 {
            return fail("micro_batches is 0".into());
        }
        self.backends.check_layers(layers)
    }
}

/// What one [`Trainer::step`] did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StepStats {
    /// The mean next-token loss over the step's counted targets (before the update).
    pub loss: f64,
    /// The global L2 norm of the gradients, before clipping.
    pub grad_norm: f64,
    /// The factor the gradients were scaled by (1 unless clipped).
    pub clip_coefficient: f64,
    /// Targets counted in the loss.
    pub targets: usize,
    /// Token rows run through the model (`sequences · seq`).
    pub tokens: usize,
    /// GPU milliseconds of the forwards (loss and its gradient included), of the backwards, and of
    /// the gradient norm and optimizer, from CUDA events.
    pub forward_ms: f64,
    /// See [`StepStats::forward_ms`].
    pub backward_ms: f64,
    /// See [`StepStats::forward_ms`].
    pub optimizer_ms: f64,
    /// GPU milliseconds of the whole step, from the first micro-batch's forward to the end of the
    /// optimizer: the three phases and what runs between them (later micro-batches' token uploads).
    pub step_ms: f64,
}

/// One micro-batch's shared state, handed to every training module: the context, the dispatch, the
/// selection, the shape, the RoPE tables, the identities [`linear::add_into`] multiplies by, and
/// whether weight gradients add to their buffers (every micro-batch after the first).
pub(crate) struct Pass<'a, T: Element> {
    pub(crate) ctx: &'a Cudnn,
    pub(crate) cfg: &'a LlamaConfig,
    pub(crate) dispatch: Dispatch<'a>,
    pub(crate) backends: &'a Backends,
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    /// `"{rows} tokens"`: the shape fallbacks are recorded for.
    pub(crate) shape: String,
    pub(crate) rope: &'a RopeTables<T>,
    pub(crate) eye: &'a CudaSlice<T>,
    pub(crate) accumulate: bool,
}

impl<T: Element> Pass<'_, T> {
    /// Token rows: `batch · seq`.
    pub(crate) fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_shift_by_one_and_the_last_position_predicts_nothing() {
        assert_eq!(shift_labels(&[vec![5, 6, 7], vec![1, IGNORE_INDEX, 3]]), vec![6, 7, -100, -100, 3, -100]);
        assert_eq!(shift_labels(&[vec![9]]), vec![IGNORE_INDEX]);
        assert!(shift_labels(&[]).is_empty());
        let b = Batch::new(vec![vec![1, 2], vec![3, 4]]);
        assert_eq!(b.labels(), vec![vec![1, 2], vec![3, 4]]);
        assert_eq!(b.targets(), vec![2, IGNORE_INDEX, 4, IGNORE_INDEX]);
        let masked = b.clone().with_labels(vec![vec![1, IGNORE_INDEX], vec![3, 4]]);
        assert_eq!(masked.targets(), vec![IGNORE_INDEX, IGNORE_INDEX, 4, IGNORE_INDEX]);
        assert_eq!(masked.inputs(), b.inputs());
    }

    #[test]
    fn hyperparameters_are_checked_by_name() {
        let ok = TrainConfig::new(1e-3).with_clip(1.0).with_micro_batches(2).with_weight_decay(0.1);
        ok.check(2).unwrap();
        for (bad, expected) in [
            (TrainConfig::new(f64::NAN), "lr NaN"),
            (TrainConfig::new(-1.0), "lr -1"),
            (ok.clone().with_betas(1.0, 0.9), "betas (1, 0.9)"),
            (ok.clone().with_eps(0.0), "eps 0"),
            (ok.clone().with_weight_decay(-0.1), "weight_decay -0.1"),
            (ok.clone().with_clip(0.0), "clip 0"),
            (ok.clone().with_micro_batches(0), "micro_batches is 0"),
        ] {
            let e = bad.check(2).unwrap_err().to_string();
            assert!(e.starts_with("train: ") && e.contains(expected), "{expected}: {e}");
        }
        let e = ok.with_backends(Backends::parse("fused=all;naive=mlp@2").unwrap()).check(2).unwrap_err();
        assert!(e.to_string().contains("reaches past layer 1"), "{e}");
    }
}
