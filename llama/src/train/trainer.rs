//! [`Trainer`]: the parameters and optimizer state on the GPU, one step's activations, and the step
//! itself (see the [module docs](super) for its order of calls).

use super::attention::{self, Attention};
use super::linear::identities;
use super::mlp::{self, Mlp};
use super::norm::{Norm, NormGrad};
use super::params::{split, Ids, Layer, Params};
use super::{head, Batch, Pass, StepStats, TrainConfig, IGNORE_INDEX};
use crate::backends::Site;
use crate::config::LlamaConfig;
use crate::modules::dispatch::{Dispatch, Fallbacks};
use crate::modules::residual::Residual;
use crate::modules::{Fallback, NoObserver, Observer};
use crate::weights::Weights;
use crate::{Error, Result};
use cudnn_llm_ops::cudarc::driver::sys::CUevent_flags;
use cudnn_llm_ops::cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::faults::Zeros;
use cudnn_llm_ops::{
    adamw, check_ids, grad_norm, AdamWArgs, AdamWOperands, AdamWTensor, Cudnn, DataType, Element,
    GradNormArgs, GradNormOperands, MultiTensor, RopeTables,
};
use std::path::Path;

/// The range of the global gradient norm (and clipping coefficient).
pub const GRAD_NORM_RANGE: &str = "opt.grad_norm";
/// The range of the AdamW update.
pub const ADAMW_RANGE: &str = "opt.adamw";

fn ops_err(e: cudnn_llm_ops::cudarc::driver::DriverError) -> Error {
    Error::Ops(cudnn_llm_ops::Error::from(e))
}

/// What one layer's forward keeps for its backward (its input is the stream's buffer before it).
struct LayerActs<T> {
    attn: attention::Saved<T>,
    /// The residual stream between attention and the MLP.
    x_mid: CudaSlice<T>,
    mlp: mlp::Saved<T>,
}

/// One micro-batch's buffers: what the forward saves and the backward's scratch.
struct Acts<T> {
    batch: usize,
    seq: usize,
    /// Activation checkpointing: one layer's saved activations, recomputed in the backward.
    checkpoint: bool,
    ids: CudaSlice<u32>,
    targets: CudaSlice<i32>,
    /// The residual stream at each layer's input, then after the last layer.
    xs: Vec<CudaSlice<T>>,
    /// Each layer's saved activations, or one layer's with checkpointing.
    layers: Vec<LayerActs<T>>,
    /// The output norm's output and inverse RMS.
    y: CudaSlice<T>,
    inv: CudaSlice<f32>,
    /// The logits, then (the loss writes it over them) their gradient.
    logits: CudaSlice<T>,
    /// The residual stream's gradient.
    g: Residual<T>,
    /// The gradient of a norm's output.
    dh: CudaSlice<T>,
    /// A norm weight's gradient of this micro-batch.
    dweight: CudaSlice<T>,
    attn: attention::Scratch<T>,
    mlp: mlp::Scratch<T>,
}

impl<T: Element> Acts<T> {
    fn new(ctx: &Cudnn, cfg: &LlamaConfig, batch: usize, seq: usize, checkpoint: bool) -> Result<Self> {
        let rows = batch * seq;
        let s = ctx.stream();
        let t = |n: usize| s.zeros::<T>(n).map_err(Error::Ops);
        let f = |n: usize| s.zeros::<f32>(n).map_err(Error::Ops);
        let (h, w, a, ffn) = (cfg.hidden, cfg.qkv_width(), cfg.attn_width(), cfg.ffn);
        let layer = || -> Result<LayerActs<T>> {
            Ok(LayerActs {
                attn: attention::Saved {
                    h: t(rows * h)?,
                    inv: f(rows)?,
                    qkv: t(rows * w)?,
                    o: t(rows * a)?,
                    stats: f(batch * cfg.heads * seq)?,
                },
                x_mid: t(rows * h)?,
                mlp: mlp::Saved { h: t(rows * h)?, inv: f(rows)?, up: t(rows * ffn)?, act: t(rows * ffn)? },
            })
        };
        Ok(Acts {
            batch,
            seq,
            checkpoint,
            ids: s.zeros::<u32>(rows)?,
            targets: s.zeros::<i32>(rows)?,
            xs: (0..=cfg.layers).map(|_| t(rows * h)).collect::<Result<_>>()?,
            layers: (0..if checkpoint { 1 } else { cfg.layers }).map(|_| layer()).collect::<Result<_>>()?,
            y: t(rows * h)?,
            inv: f(rows)?,
            logits: t(rows * cfg.vocab)?,
            g: Residual::new(t(rows * h)?, t(rows * h)?),
            dh: t(rows * h)?,
            dweight: t(h)?,
            attn: attention::Scratch { d_o: t(rows * a)?, dqkv: t(rows * w)? },
            mlp: mlp::Scratch { gate: t(rows * ffn)?, d_gate: t(rows * ffn)?, d_up: t(rows * ffn)? },
        })
    }
}

/// One micro-batch's host data.
struct Micro {
    ids: Vec<u32>,
    targets: Vec<i32>,
    /// Targets that count (not [`IGNORE_INDEX`]).
    counted: usize,
}

/// The events around one micro-batch: start, end of the forward (and loss), end of the backward.
struct Marks {
    start: CudaEvent,
    forward: CudaEvent,
    backward: CudaEvent,
}

fn mark(ctx: &Cudnn) -> Result<CudaEvent> {
    let e = ctx.stream().context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(ops_err)?;
    e.record(ctx.stream()).map_err(ops_err)?;
    Ok(e)
}

fn elapsed(a: &CudaEvent, b: &CudaEvent) -> Result<f64> {
    Ok(a.elapsed_ms(b).map_err(ops_err)? as f64)
}

/// The forward and backward of one step, before the update.
struct Accumulated {
    micro: Vec<Micro>,
    marks: Vec<Marks>,
}

impl Accumulated {
    fn counted(&self) -> usize {
        self.micro.iter().map(|m| m.counted).sum()
    }

    fn tokens(&self) -> usize {
        self.micro.iter().map(|m| m.ids.len()).sum()
    }
}

/// A Llama-3 model being trained on one GPU: its parameters with their f32 gradients and AdamW state,
/// a step's activations, and the step ([`Trainer::step`]). Weights are bf16 (the model's dtype;
/// attention and RoPE take 16-bit data, AdamW bf16 or f32 parameters).
pub struct Trainer<T: Element> {
    cfg: LlamaConfig,
    tcfg: TrainConfig,
    params: Params<T>,
    rope: Option<RopeTables<T>>,
    acts: Option<Acts<T>>,
    /// The identities of the gradient adds.
    eye: CudaSlice<T>,
    opt: MultiTensor,
    /// `[norm, clipping coefficient]` of the last step.
    norm: CudaSlice<f32>,
    /// The mean loss of each micro-batch of the last step.
    losses: CudaSlice<f32>,
    fallbacks: Fallbacks,
    steps: u64,
}

impl<T: Element> Trainer<T> {
    /// Uploads `weights` (each layer's Q, K and V projections as one matrix) with zero gradients and
    /// moments, and f32 master copies if `tcfg` asks for them.
    ///
    /// Errors: a config [`LlamaConfig::check`] refuses, or whose hidden size, MLP size or vocabulary
    /// is not a multiple of 8 (the gradients' GEMMs take 16-byte rows); weights of other shapes than
    /// the config's; hyperparameters [`TrainConfig::check`] refuses; `T` other than bf16.
    pub fn new(ctx: &Cudnn, cfg: &LlamaConfig, weights: &Weights<T>, tcfg: TrainConfig) -> Result<Self> {
        cfg.check()?;
        tcfg.check(cfg.layers)?;
        if T::DTYPE != DataType::BF16 {
            return Err(Error::Train(format!(
                "weights of {}: training takes bf16 (attention, RoPE and the embedding take 16-bit data, \
                 AdamW bf16 or f32 parameters)",
                T::DTYPE
            )));
        }
        for (what, n) in [("hidden", cfg.hidden), ("ffn", cfg.ffn), ("vocab", cfg.vocab)] {
            if !n.is_multiple_of(8) {
                return Err(Error::Train(format!(
                    "{}: {what} {n} is not a multiple of 8 (the gradients' GEMMs take 16-byte rows)",
                    cfg.name
                )));
            }
        }
        check_shapes(cfg, weights)?;
        let s = ctx.stream();
        Ok(Trainer {
            params: Params::new(ctx, cfg, weights, tcfg.master_weights)?,
            eye: s.clone_htod(&identities::<T>()).map_err(ops_err)?,
            norm: s.zeros::<f32>(2)?,
            losses: s.zeros::<f32>(tcfg.micro_batches)?,
            cfg: cfg.clone(),
            tcfg,
            rope: None,
            acts: None,
            opt: MultiTensor::new(),
            fallbacks: Fallbacks::default(),
            steps: 0,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The hyperparameters and backends.
    pub fn train_config(&self) -> &TrainConfig {
        &self.tcfg
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Fused modules that ran naive, with the reason (each module, layer and shape once).
    pub fn fallbacks(&self) -> &[Fallback] {
        &self.fallbacks.list
    }

    /// One training step over `batch`: forward and backward of each micro-batch (the sequences split
    /// into [`TrainConfig::micro_batches`] equal parts, gradients summed), the global gradient norm,
    /// clipping and AdamW. Waits for the GPU to read back the loss and norm.
    ///
    /// Errors, before any GPU work: no sequences, sequences of different or zero lengths, a count
    /// the micro-batches do not divide, a micro-batch whose tokens are not a multiple of 8, token ids
    /// or labels outside the vocabulary (labels may be [`IGNORE_INDEX`]), labels of another shape
    /// than the inputs, a micro-batch without a target to predict.
    pub fn step(&mut self, ctx: &Cudnn, batch: &Batch) -> Result<StepStats> {
        self.step_observed(ctx, batch, &mut NoObserver)
    }

    /// [`Trainer::step`] with an observer around every module call (and the loss, the embedding's
    /// backward, the gradient norm and AdamW).
    pub fn step_observed(&mut self, ctx: &Cudnn, batch: &Batch, obs: &mut dyn Observer) -> Result<StepStats> {
        let acc = self.accumulate(ctx, batch, obs)?;
        let before = mark(ctx)?;
        self.optimize(ctx, obs)?;
        let after = mark(ctx)?;
        let loss = self.loss(ctx, &acc)?;
        let norm = ctx.stream().clone_dtoh(&self.norm).map_err(ops_err)?;
        let mut stats = StepStats {
            loss,
            grad_norm: norm[0] as f64,
            clip_coefficient: norm[1] as f64,
            targets: acc.counted(),
            tokens: acc.tokens(),
            forward_ms: 0.0,
            backward_ms: 0.0,
            optimizer_ms: elapsed(&before, &after)?,
            step_ms: match acc.marks.first() {
                Some(m) => elapsed(&m.start, &after)?,
                None => 0.0,
            },
        };
        for m in &acc.marks {
            stats.forward_ms += elapsed(&m.start, &m.forward)?;
            stats.backward_ms += elapsed(&m.forward, &m.backward)?;
        }
        Ok(stats)
    }

    /// Forward and backward of `batch` as [`Trainer::step`] runs them, without the update: the
    /// gradients stay in the trainer ([`Trainer::gradients`] reads them). Returns the loss.
    pub fn backward(&mut self, ctx: &Cudnn, batch: &Batch, obs: &mut dyn Observer) -> Result<f64> {
        let acc = self.accumulate(ctx, batch, obs)?;
        self.loss(ctx, &acc)
    }

    /// The mean loss of the step: each micro-batch's mean weighted by its counted targets.
    fn loss(&self, ctx: &Cudnn, acc: &Accumulated) -> Result<f64> {
        let losses = ctx.stream().clone_dtoh(&self.losses).map_err(ops_err)?;
        let sum: f64 = acc.micro.iter().zip(&losses).map(|(m, &l)| l as f64 * m.counted as f64).sum();
        Ok(sum / acc.counted() as f64)
    }

    /// Checks `batch` and splits it into micro-batches: `(sequences per micro-batch, seq, micro)`.
    fn split_batch(&self, batch: &Batch) -> Result<(usize, usize, Vec<Micro>)> {
        let fail = |m: String| Err(Error::Train(m));
        let inputs = batch.inputs();
        let (n, seq) = (inputs.len(), inputs.first().map_or(0, Vec::len));
        if n == 0 || seq == 0 || inputs.iter().any(|s| s.len() != seq) {
            return fail("give one or more sequences of equal, non-zero length".into());
        }
        let m = self.tcfg.micro_batches;
        if !n.is_multiple_of(m) {
            return fail(format!("{n} sequences do not split into {m} equal micro-batches"));
        }
        let per = n / m;
        if !(per * seq).is_multiple_of(8) {
            return fail(format!(
                "micro-batches of {per} × {seq} = {} tokens: the weight gradients need a multiple of 8",
                per * seq
            ));
        }
        if seq > crate::config::MAX_POSITIONS {
            return fail(format!("sequences of {seq} exceed {} positions", crate::config::MAX_POSITIONS));
        }
        let vocab = self.cfg.vocab;
        check_ids(&inputs.iter().flatten().copied().collect::<Vec<_>>(), vocab)?;
        let labels = batch.labels();
        if labels.len() != n || labels.iter().any(|l| l.len() != seq) {
            return fail(format!("labels must have the inputs' shape, {n} sequences of {seq}"));
        }
        for (i, l) in labels.iter().enumerate() {
            if let Some((t, &bad)) = l
                .iter()
                .enumerate()
                .find(|&(_, &v)| v != IGNORE_INDEX && !(0..vocab as i64).contains(&(v as i64)))
            {
                return fail(format!(
                    "label {bad} at position {t} of sequence {i} is outside the vocabulary of {vocab} and not \
                     the ignore index {IGNORE_INDEX}"
                ));
            }
        }
        let micro = (0..m)
            .map(|k| {
                let range = k * per..(k + 1) * per;
                let targets = super::shift_labels(&labels[range.clone()]);
                let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
                let ids = inputs[range].iter().flatten().copied().collect();
                Micro { ids, targets, counted }
            })
            .collect::<Vec<_>>();
        if let Some(k) = micro.iter().position(|m| m.counted == 0) {
            return fail(format!("micro-batch {k} has no target to predict (all ignored)"));
        }
        Ok((per, seq, micro))
    }

    /// Forward and backward of every micro-batch of `batch`, gradients summed.
    fn accumulate(&mut self, ctx: &Cudnn, batch: &Batch, obs: &mut dyn Observer) -> Result<Accumulated> {
        let (per, seq, micro) = self.split_batch(batch)?;
        if self.rope.as_ref().is_none_or(|r| r.positions() < seq) {
            self.rope = None;
            self.rope = Some(RopeTables::from_frequencies(ctx, &crate::rope::frequencies(&self.cfg)?, seq)?);
        }
        if self.acts.as_ref().is_none_or(|a| (a.batch, a.seq) != (per, seq)) {
            self.acts = None;
            self.acts = Some(Acts::new(ctx, &self.cfg, per, seq, self.tcfg.checkpoint)?);
        }
        let counted: usize = micro.iter().map(|m| m.counted).sum();
        let Trainer { cfg, tcfg, params, rope, acts, eye, losses, fallbacks, .. } = self;
        let (rope, acts) = (rope.as_ref().expect("built above"), acts.as_mut().expect("allocated above"));
        let mut marks = Vec::with_capacity(micro.len());
        for (k, m) in micro.iter().enumerate() {
            let s = ctx.stream();
            s.memcpy_htod(&m.ids, &mut acts.ids).map_err(ops_err)?;
            s.memcpy_htod(&m.targets, &mut acts.targets).map_err(ops_err)?;
            let start = mark(ctx)?;
            let mut p = Pass {
                ctx,
                cfg: &*cfg,
                dispatch: Dispatch::new(&mut *fallbacks, &tcfg.backends, &mut *obs),
                backends: &tcfg.backends,
                batch: per,
                seq,
                shape: format!("{} tokens", per * seq),
                rope,
                eye: &*eye,
                accumulate: k > 0,
            };
            let scale = m.counted as f32 / counted as f32;
            forward(&mut p, &params.ids, &params.values, acts, &mut losses.slice_mut(k..k + 1), scale)?;
            let forward_done = mark(ctx)?;
            backward(&mut p, &params.ids, &params.values, &mut params.grads, acts, tcfg.standalone)?;
            marks.push(Marks { start, forward: forward_done, backward: mark(ctx)? });
        }
        Ok(Accumulated { micro, marks })
    }

    /// The global gradient norm (and clipping coefficient), then AdamW over every parameter.
    fn optimize(&mut self, ctx: &Cudnn, obs: &mut dyn Observer) -> Result<()> {
        let Trainer { tcfg, params, opt, norm, steps, .. } = self;
        let args = match tcfg.clip {
            Some(c) => GradNormArgs::clip(c),
            None => GradNormArgs::norm(),
        };
        obs.begin(GRAD_NORM_RANGE, None);
        let grads: Vec<&dyn DevicePtr<f32>> = params.grads.iter().map(|g| g as &dyn DevicePtr<f32>).collect();
        let done = grad_norm(ctx, args, GradNormOperands::new(&mut *opt, grads, &mut *norm), tcfg.standalone);
        obs.end(GRAD_NORM_RANGE, None);
        done?;
        // The step AdamW runs as (bias correction); counted only once it ran.
        let step = *steps + 1;
        let (b1, b2) = tcfg.betas;
        let hp = AdamWArgs::new(tcfg.lr)
            .with_betas(b1, b2)
            .with_eps(tcfg.eps)
            .with_weight_decay(tcfg.weight_decay)
            .with_step(step);
        let Params { values, grads, m, v, master, .. } = params;
        let mut masters: Vec<Option<&mut CudaSlice<f32>>> = match master {
            Some(w) => w.iter_mut().map(Some).collect(),
            None => values.iter().map(|_| None).collect(),
        };
        let tensors = values
            .iter_mut()
            .zip(grads.iter())
            .zip(m.iter_mut().zip(v.iter_mut()))
            .zip(masters.iter_mut())
            .map(|(((p, g), (m, v)), w)| {
                let t = AdamWTensor::new(p as &mut dyn DevicePtrMut<T>, g as &dyn DevicePtr<f32>, m, v);
                match w.take() {
                    Some(w) => t.master(w),
                    None => t,
                }
            })
            .collect();
        let mut x = AdamWOperands::new(opt, tensors);
        if tcfg.clip.is_some() {
            x = x.clip(&*norm);
        }
        obs.begin(ADAMW_RANGE, None);
        let done = adamw(ctx, hp, x, tcfg.standalone);
        obs.end(ADAMW_RANGE, None);
        done?;
        *steps = step;
        Ok(())
    }

    /// The weights the model runs, as Hugging Face tensors (Q, K and V split again).
    pub fn weights(&self, ctx: &Cudnn) -> Result<Weights<T>> {
        Ok(split(&self.cfg, download(ctx, &self.params.values)?))
    }

    /// The f32 master weights, if the trainer keeps them.
    pub fn master_weights(&self, ctx: &Cudnn) -> Result<Option<Weights<f32>>> {
        match &self.params.master {
            Some(w) => Ok(Some(split(&self.cfg, download(ctx, w)?))),
            None => Ok(None),
        }
    }

    /// The f32 gradients of the last step (or [`Trainer::backward`]), as Hugging Face tensors: the sum
    /// over the micro-batches of the gradient of the step's mean loss, unclipped. A tied embedding's
    /// holds its lookup's and `lm_head`'s shares.
    pub fn gradients(&self, ctx: &Cudnn) -> Result<Weights<f32>> {
        Ok(split(&self.cfg, download(ctx, &self.params.grads)?))
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (the weights the model runs, in its
    /// dtype), a checkpoint that [`Weights::load`] and transformers' `from_pretrained` read.
    pub fn save(&self, ctx: &Cudnn, dir: &Path) -> Result<()> {
        let io = |e: std::io::Error| Error::Weights(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::write(dir.join("config.json"), self.cfg.to_hf_json(T::DTYPE)).map_err(io)?;
        self.weights(ctx)?.save(&self.cfg, &dir.join("model.safetensors"), T::DTYPE)
    }
}

fn download<E: Element>(ctx: &Cudnn, list: &[CudaSlice<E>]) -> Result<Vec<Vec<E>>> {
    list.iter().map(|t| ctx.stream().clone_dtoh(t).map_err(ops_err)).collect()
}

/// Refuses weights whose tensors are not the config's (names, shapes, a tied or untied `lm_head`).
fn check_shapes<T: Element>(cfg: &LlamaConfig, w: &Weights<T>) -> Result<()> {
    if w.layers.len() != cfg.layers || w.lm_head.is_some() == cfg.tie_embeddings {
        return Err(Error::Weights(format!(
            "{} layers of weights with{} lm_head for a {}-layer config with{} tied embeddings",
            w.layers.len(),
            if w.lm_head.is_some() { "" } else { "out" },
            cfg.layers,
            if cfg.tie_embeddings { "" } else { "out" },
        )));
    }
    for ((name, shape), t) in Weights::<T>::names(cfg).iter().zip(w.tensors()) {
        if &t.shape != shape || t.len() != shape.iter().product::<usize>() {
            return Err(Error::Weights(format!(
                "`{name}` has shape {:?} ({} values), expected {shape:?}",
                t.shape,
                t.len()
            )));
        }
    }
    Ok(())
}

/// Layer `l`'s forward from `x`, saving into `s`, writing the next layer's input into `x_next`.
fn layer_forward<T: Element>(
    p: &mut Pass<'_, T>,
    l: usize,
    w: &Layer<&CudaSlice<T>>,
    x: &CudaSlice<T>,
    s: &mut LayerActs<T>,
    x_next: &mut CudaSlice<T>,
) -> Result<()> {
    let attn_norm = Norm { site: Site::ATTN_PRENORM, layer: Some(l) };
    attn_norm.forward(p, w.attn_norm, x, &mut s.attn.h, &mut s.attn.inv)?;
    Attention { layer: l }.forward(p, w, x, &mut s.attn, &mut s.x_mid)?;
    let mlp_norm = Norm { site: Site::MLP_PRENORM, layer: Some(l) };
    mlp_norm.forward(p, w.mlp_norm, &s.x_mid, &mut s.mlp.h, &mut s.mlp.inv)?;
    Mlp { layer: l }.forward(p, w, &s.x_mid, &mut s.mlp, x_next)
}

/// One micro-batch's forward, the loss and its gradient (into `loss[0]`, the gradient scaled by
/// `grad_scale`). With activation checkpointing every layer saves into the one slot, which the
/// backward refills layer by layer.
fn forward<T: Element>(
    p: &mut Pass<'_, T>,
    ids: &Ids,
    values: &[CudaSlice<T>],
    a: &mut Acts<T>,
    loss: &mut dyn DevicePtrMut<f32>,
    grad_scale: f32,
) -> Result<()> {
    let layers = a.xs.len() - 1;
    head::embed(p, &a.ids, &values[ids.embed()], &mut a.xs[0])?;
    for l in 0..layers {
        let slot = if a.checkpoint { 0 } else { l };
        let (before, after) = a.xs.split_at_mut(l + 1);
        layer_forward(p, l, &ids.layer(values, l), &before[l], &mut a.layers[slot], &mut after[0])?;
    }
    let output_norm = Norm { site: Site::OUTPUT_NORM, layer: None };
    output_norm.forward(p, &values[ids.norm()], &a.xs[layers], &mut a.y, &mut a.inv)?;
    head::lm_head(p, &values[ids.head()], &a.y, &mut a.logits)?;
    head::loss(p, &mut a.logits, &a.targets, loss, grad_scale)
}

/// One micro-batch's backward from the logits' gradient, into the weights' f32 gradients.
fn backward<T: Element>(
    p: &mut Pass<'_, T>,
    ids: &Ids,
    values: &[CudaSlice<T>],
    grads: &mut [CudaSlice<f32>],
    a: &mut Acts<T>,
    standalone: cudnn_llm_ops::Backend,
) -> Result<()> {
    let Acts {
        ids: tokens,
        checkpoint,
        xs,
        layers,
        y,
        inv,
        logits,
        g,
        dh,
        dweight,
        attn: attn_scratch,
        mlp: mlp_scratch,
        ..
    } = a;
    let (head_id, norm_id) = (ids.head(), ids.norm());
    head::lm_head_backward(p, &values[head_id], y, logits, dh, &mut grads[head_id])?;
    let output_norm = Norm { site: Site::OUTPUT_NORM, layer: None };
    let count = xs.len() - 1;
    let (w, grad, dx) = (&values[norm_id], &mut grads[norm_id], g.first_mut());
    let (x, inv, dy) = (&xs[count], &*inv, &*dh);
    output_norm.backward(p, NormGrad { w, x, inv, dy, residual: None, dx, dweight: &mut *dweight, grad })?;
    for l in (0..count).rev() {
        let w = ids.layer(values, l);
        let slot = if *checkpoint {
            // Recompute the layer's activations from its input (rewriting the next layer's input,
            // which the backward has read already).
            let (before, after) = xs.split_at_mut(l + 1);
            layer_forward(p, l, &w, &before[l], &mut layers[0], &mut after[0])?;
            0
        } else {
            l
        };
        let s = &layers[slot];
        let mut gr = ids.layer_mut(grads, l);
        Mlp { layer: l }.backward(p, &w, &mut gr, &s.mlp, g.get(), mlp_scratch, dh)?;
        let mlp_norm = Norm { site: Site::MLP_PRENORM, layer: Some(l) };
        g.add(|r, dx| {
            let (x, inv, grad) = (&s.x_mid, &s.mlp.inv, &mut *gr.mlp_norm);
            let (dy, dweight) = (&*dh, &mut *dweight);
            mlp_norm.backward(p, NormGrad { w: w.mlp_norm, x, inv, dy, residual: Some(r), dx, dweight, grad })
        })?;
        Attention { layer: l }.backward(p, &w, &mut gr, &s.attn, g.get(), attn_scratch, dh)?;
        let attn_norm = Norm { site: Site::ATTN_PRENORM, layer: Some(l) };
        g.add(|r, dx| {
            let (x, inv, grad) = (&xs[l], &s.attn.inv, &mut *gr.attn_norm);
            let (dy, dweight) = (&*dh, &mut *dweight);
            attn_norm
                .backward(p, NormGrad { w: w.attn_norm, x, inv, dy, residual: Some(r), dx, dweight, grad })
        })?;
    }
    // A tied embedding already holds lm_head's share of this micro-batch.
    let accumulate = head_id == ids.embed() || p.accumulate;
    head::embed_backward(p, tokens, g.get(), &mut grads[ids.embed()], accumulate, standalone)
}
