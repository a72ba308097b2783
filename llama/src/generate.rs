//! Token generation on one sequence: a [`Generator`] owns a [`Llama`], its [`KvCache`] and a backend
//! selection, and gives a serving engine the two calls it drives a sequence with:
//!
//! * [`Generator::prefill`] runs prompt ids (appending to what is cached) and returns the logits of
//!   the last position only (one row of `lm_head`, not one per prompt token), as host `f32`;
//! * [`Generator::step`] runs one token and returns its logits.
//!
//! The caller chooses each next token itself, or with a [`Sampler`]; [`Generator::generate`] is the
//! loop for the simple case (prefill, sample, step until an end-of-sequence id or a token budget),
//! with a callback per token for streaming and wall-clock timings of both phases.
//!
//! Decode steps launch every kernel from the host ([`DecodeMode::Launch`], the default), or replay
//! one captured CUDA graph ([`DecodeMode::Graph`], opted into with the `unsafe`
//! [`Generator::with_mode`]) where the step allows it: RoPE and attention fused in every layer, on a
//! cuDNN with run-time sequence lengths (9.15+), so that the position and lengths are device values.
//! In graph mode the first step launches plainly (plans are built then), the second captures the
//! step and replays it, later ones replay it; a step that cannot be captured launches plainly, and
//! [`Generator::graph_refusal`] says why.
//!
//! Greedy generation in graph mode can pick ids on the device ([`SamplingPath::Device`], opt-in here,
//! the `generate` binary's default; [`SamplingPath::Host`] is the library's default):
//! the captured step ends with the argmax of its logits ([`Llama::capture_greedy_decode`]), which
//! writes the next id where the next replay reads it, so [`Generator::generate`] enqueues up to
//! [`PIPELINE_STEPS`] steps without waiting for any, copying each step's 4-byte pick into a device
//! list, and reads the list back once per window. Where a window ran past a stop (an end-of-sequence
//! id, the callback's break, an unsampleable row) the cache and the ids are rolled back to what a
//! synchronous run leaves: the extra K/V rows are past the cache's length, unread and overwritten by
//! the next step. The ids are those of the host path: the same logits, the same argmax (ties to the
//! lowest id) and the same errors. Sampled (non-greedy) generation, plain launches and
//! [`SamplingPath::Host`] copy each step's logits and choose on the host.
//!
//! End-of-sequence ids come from the checkpoint directory ([`eos_token_ids`]: the config's
//! `eos_token_id` and `generation_config.json`'s, each an id or a list).

use crate::backends::Backends;
use crate::config::LlamaConfig;
use crate::model::{DecodeGraph, KvCache, Llama, NoObserver, Observer};
use crate::sampling::{pick_result, Sampler};
use crate::{Error, Result};
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::faults::Zeros;
use cudnn_llm_ops::{Cudnn, Element, Pick};
use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

/// How decode steps run.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeMode {
    /// Every kernel launched from the host, each step.
    #[default]
    Launch,
    /// One captured CUDA graph replayed per step where the step allows it (see the module docs),
    /// plain launches otherwise. An observer given to [`Generator::step_observed`] sees no module
    /// ranges of a replayed step.
    Graph,
}

/// Where greedy ids are chosen in [`DecodeMode::Graph`].
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SamplingPath {
    /// On the device, inside the captured step, pipelined: the host enqueues [`PIPELINE_STEPS`]
    /// steps, then reads their ids back at once (see the module docs). Opt-in; its GPU tests
    /// (`app/tests/argmax.rs`, `device_greedy_equals_host_greedy_*` in `app/tests/generate.rs`) pass on H100
    /// and H200, and on an H200 it took an 8B step from 4.76 to 4.16 ms in `generate`.
    Device,
    /// On the host: each step's logits are copied back and the host takes their argmax (the step
    /// is captured without the argmax). The default.
    #[default]
    Host,
}

/// Decode steps [`Generator::generate`] enqueues before it reads their ids back, on the device path.
pub const PIPELINE_STEPS: usize = 16;

/// Why [`Generator::generate`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// It produced this end-of-sequence id (the last of [`Generation::tokens`]).
    Eos(u32),
    /// It produced the `max_new` tokens asked for.
    MaxTokens,
    /// The callback returned [`ControlFlow::Break`].
    Callback,
}

/// What [`Generator::generate`] produced, and how long it took.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Generation {
    /// The new ids, in order (an end-of-sequence id that stopped it included).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Prompt ids prefilled.
    pub prompt_tokens: usize,
    /// Wall time from the start of the prefill to the first new id (the prefill forward, its logits
    /// copied to the host, and the first sampling): time to first token.
    pub prefill: Duration,
    /// Wall time of the decode steps: each step's forward, its logits copied to the host, and the
    /// sampling of the next id; on the device path, each window's steps enqueued and its ids read
    /// back, steps later rolled back included (the callback is not timed).
    pub decode: Duration,
    /// Decode steps run (`tokens.len() - 1`: the last id needs no forward).
    pub decode_steps: usize,
    /// Of those, the steps whose ids the device picked, pipelined ([`SamplingPath::Device`]); the
    /// others copied their logits to the host.
    pub device_steps: usize,
    /// Steps that ran past a stop inside a pipelined window and were rolled back (their time is in
    /// [`Generation::decode`], their tokens nowhere).
    pub overrun_steps: usize,
}

impl Generation {
    /// Prompt ids per second of [`Generation::prefill`].
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64()
    }

    /// Decode steps per second (`None` without steps).
    pub fn decode_tokens_per_s(&self) -> Option<f64> {
        (self.decode_steps > 0).then(|| self.decode_steps as f64 / self.decode.as_secs_f64())
    }
}

/// One sequence's generation state: the model, its KV cache, the backends, and the ids cached.
pub struct Generator<T: Element> {
    model: Llama<T>,
    cache: KvCache<T>,
    backends: Backends,
    mode: DecodeMode,
    tokens: Vec<u32>,
    max_seq: usize,
    /// Decode steps launched plainly with the current backends (the first builds the plans).
    launched: usize,
    graph: Option<DecodeGraph<T>>,
    /// Why the step cannot be replayed with the current backends, once a capture said so.
    refusal: Option<String>,
    /// Where greedy ids are chosen in graph mode.
    path: SamplingPath,
    /// The pick words of a pipelined window, one per step (device; grown to [`PIPELINE_STEPS`]).
    window: Option<CudaSlice<u32>>,
}

impl<T: Element> Generator<T> {
    /// A generator for one sequence of up to `max_seq` ids (prompt and generated), running each module
    /// on the backend `backends` gives it. `model` must have RoPE tables for `max_seq` positions.
    pub fn new(ctx: &Cudnn, model: Llama<T>, backends: Backends, max_seq: usize) -> Result<Self> {
        if max_seq == 0 {
            return Err(Error::Generate("a cache of 0 tokens holds no sequence".into()));
        }
        let cache = model.cache(ctx, 1, max_seq)?;
        Ok(Generator {
            model,
            cache,
            backends,
            mode: DecodeMode::default(),
            tokens: Vec::new(),
            max_seq,
            launched: 0,
            graph: None,
            refusal: None,
            path: SamplingPath::default(),
            window: None,
        })
    }

    /// The same generator running decode steps in `mode`.
    ///
    /// # Safety
    ///
    /// With [`DecodeMode::Graph`], a decode step may capture a CUDA graph ([`Llama::capture_decode`]):
    /// no other thread may use buffers or streams of the context's CUDA context during a call of
    /// [`Generator::step`], [`Generator::step_observed`] or [`Generator::generate`] (the contract of
    /// [`Cudnn::capture`]). [`DecodeMode::Launch`] asks nothing.
    pub unsafe fn with_mode(mut self, mode: DecodeMode) -> Self {
        self.mode = mode;
        self
    }

    /// How decode steps run.
    pub fn mode(&self) -> DecodeMode {
        self.mode
    }

    /// Chooses greedy ids on `path` from now on (a captured step is captured again, with or without
    /// the argmax). Sampled generation and plain launches choose on the host whatever the path.
    pub fn set_sampling_path(&mut self, path: SamplingPath) {
        if path != self.path {
            (self.path, self.graph) = (path, None);
        }
    }

    /// Where greedy ids are chosen in graph mode.
    pub fn sampling_path(&self) -> SamplingPath {
        self.path
    }

    /// Whether [`Generator::generate`] with `sampler` picks ids on the device, pipelined (once the
    /// step is captured): greedy, graph mode, [`SamplingPath::Device`], no capture refused.
    pub fn pipelines(&self, sampler: &Sampler) -> bool {
        sampler.params().is_greedy()
            && self.mode == DecodeMode::Graph
            && self.path == SamplingPath::Device
            && self.refusal.is_none()
    }

    /// The model (its config and fallbacks).
    pub fn model(&self) -> &Llama<T> {
        &self.model
    }

    /// The model, e.g. to run another cache through it between generations (the generator's cache is
    /// untouched; the logits of its last position are not kept, so call [`Generator::step`] or
    /// [`Generator::prefill`] again before reading any).
    pub fn model_mut(&mut self) -> &mut Llama<T> {
        &mut self.model
    }

    /// Gives the model back.
    pub fn into_model(self) -> Llama<T> {
        self.model
    }

    /// The backend selection.
    pub fn backends(&self) -> &Backends {
        &self.backends
    }

    /// Runs later calls on `backends` (the cached K/V stay valid: every backend computes the same
    /// model).
    pub fn set_backends(&mut self, backends: Backends) {
        self.backends = backends;
        (self.launched, self.graph, self.refusal) = (0, None, None);
    }

    /// Whether decode steps replay a captured graph now (graph mode, captured, not refused).
    pub fn replaying(&self) -> bool {
        self.mode == DecodeMode::Graph && self.graph.is_some()
    }

    /// Kernels one replay of the captured decode step launches, and its nodes in all; `None` before a
    /// step was captured (or in [`DecodeMode::Launch`]).
    pub fn step_kernels(&self) -> Option<Result<(usize, usize)>> {
        self.graph.as_ref().map(|g| g.kernels())
    }

    /// Why decode steps launch plainly in [`DecodeMode::Graph`] (the capture's refusal), if they do.
    pub fn graph_refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// The ids in the cache, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Ids in the cache.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The most ids the cache holds.
    pub fn capacity(&self) -> usize {
        self.max_seq
    }

    /// Forgets the sequence (the cache memory is kept).
    pub fn reset(&mut self) {
        self.cache.clear();
        self.tokens.clear();
    }

    /// Builds the plans of prompts of each length in `prompt_lengths` and of a decode step after each
    /// (autotuning those that tune), by running dummy prompts (id 0) through the model, so that the
    /// first requests of those lengths find them in the context's plan cache; with a plan directory
    /// ([`Cudnn::set_plan_dir`]) a later process loads them from disk instead of building them. The
    /// sequence is reset afterwards (the cache memory is kept). A length must leave room for the
    /// decode step (at most [`Generator::capacity`] − 1); lengths are checked before anything runs.
    ///
    /// Each length is a distinct set of plans (matmul rows, attention sequence lengths), so a server
    /// prebuilds the lengths it pads prompts to. They are built one after another on the context's
    /// stream: a context's cuDNN handle serves one thread at a time, a plan is finalized for the
    /// handle that runs it, and autotuning times candidates on the GPU, where concurrent builds would
    /// skew the timings and so the choices. To spread the building over threads or processes, give
    /// each its own context on one shared plan directory (plans are saved when final, files are
    /// replaced atomically), then let the serving context load them.
    pub fn prebuild(&mut self, ctx: &Cudnn, prompt_lengths: &[usize]) -> Result<()> {
        if let Some(&n) = prompt_lengths.iter().find(|&&n| n == 0 || n >= self.max_seq) {
            return Err(Error::Generate(format!(
                "prebuild: a prompt of {n} ids and a decode step do not fit a cache of {} (lengths 1 to {})",
                self.max_seq,
                self.max_seq.saturating_sub(1)
            )));
        }
        for &n in prompt_lengths {
            self.reset();
            self.prefill(ctx, &vec![0; n])?;
            self.step(ctx, 0)?;
        }
        self.reset();
        Ok(())
    }

    /// Runs `ids` after the cached ones (the prompt, or more of it) and returns the logits of the last
    /// of them, `vocab` values.
    pub fn prefill(&mut self, ctx: &Cudnn, ids: &[u32]) -> Result<Vec<f32>> {
        self.prefill_observed(ctx, ids, &mut NoObserver)
    }

    /// [`Generator::prefill`] with an observer around every module call.
    pub fn prefill_observed(&mut self, ctx: &Cudnn, ids: &[u32], obs: &mut dyn Observer) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::Generate("prefill: no ids".into()));
        }
        self.fits(ids.len())?;
        self.model.forward(ctx, &[ids.to_vec()], &mut self.cache, &self.backends, obs)?;
        self.tokens.extend_from_slice(ids);
        self.last_logits(ctx, ids.len() - 1, obs)
    }

    /// Runs one id after the cached ones (a decode step) and returns its logits, `vocab` values.
    pub fn step(&mut self, ctx: &Cudnn, id: u32) -> Result<Vec<f32>> {
        self.step_observed(ctx, id, &mut NoObserver)
    }

    /// [`Generator::step`] with an observer around every module call.
    pub fn step_observed(&mut self, ctx: &Cudnn, id: u32, obs: &mut dyn Observer) -> Result<Vec<f32>> {
        if self.tokens.is_empty() {
            return Err(Error::Generate("step: prefill a prompt first".into()));
        }
        self.fits(1)?;
        if self.graph_ready(ctx) {
            let graph = self.graph.as_mut().expect("graph_ready");
            let dev = self.model.decode(ctx, graph, &[id], &mut self.cache)?;
            self.tokens.push(id); // in the cache now, whether or not the copy below succeeds
            let host = ctx.stream().clone_dtoh(dev).map_err(cudnn_llm_ops::Error::from)?;
            return Ok(host.iter().map(|v| v.to_f64() as f32).collect());
        }
        self.model.forward(ctx, &[vec![id]], &mut self.cache, &self.backends, obs)?;
        self.tokens.push(id);
        let logits = self.last_logits(ctx, 0, obs)?;
        self.launched += 1;
        Ok(logits)
    }

    /// Whether the next decode step replays a captured graph: graph mode, a plain step ran (its plans
    /// are built), and the graph is current or captured now (with the argmax on
    /// [`SamplingPath::Device`]). A step that cannot be captured (or replayed at another position)
    /// launches plainly: the refusal is kept, and said by [`Generator::graph_refusal`].
    fn graph_ready(&mut self, ctx: &Cudnn) -> bool {
        if self.mode != DecodeMode::Graph || self.refusal.is_some() || self.launched == 0 {
            return false;
        }
        if self.graph.as_ref().is_some_and(|g| !self.model.is_current(ctx, g)) {
            self.graph = None; // a longer prefill reallocated what it holds
        }
        if self.graph.is_none() {
            let (model, cache, backends) = (&mut self.model, &mut self.cache, &self.backends);
            // SAFETY: graph mode was chosen through `with_mode`, whose caller took on this contract.
            let captured = unsafe {
                match self.path {
                    SamplingPath::Device => model.capture_greedy_decode(ctx, cache, backends),
                    SamplingPath::Host => model.capture_decode(ctx, cache, backends),
                }
            };
            match captured {
                Ok(g) => self.graph = Some(g),
                Err(e) => self.refusal = Some(e.to_string()),
            }
        }
        self.graph.is_some()
    }

    /// Runs `steps` greedy decode steps on the device, the first on `id`, each later one on the id
    /// the one before picked, without waiting for any; then reads their pick words back (one wait).
    /// The cache and [`Generator::tokens`] hold every step's id afterwards (a step whose input
    /// followed a pick that is not an id holds some valid id: roll it back). Needs a greedy graph
    /// ([`Generator::graph_ready`] on [`SamplingPath::Device`]) and room for `steps` ids.
    fn pipelined(&mut self, ctx: &Cudnn, id: u32, steps: usize) -> Result<Vec<u32>> {
        self.fits(steps)?;
        if self.window.as_ref().is_none_or(|w| w.len() < steps) {
            let n = steps.max(PIPELINE_STEPS);
            self.window = Some(ctx.stream().zeros::<u32>(n)?);
        }
        let window = self.window.as_mut().expect("allocated above");
        let graph = self.graph.as_mut().expect("graph_ready");
        let len = self.tokens.len();
        let mut enqueue = || -> Result<()> {
            for j in 0..steps {
                let picks = match j {
                    0 => {
                        self.model.decode(ctx, graph, &[id], &mut self.cache)?;
                        graph
                            .picks()
                            .ok_or_else(|| Error::Generate("a decode graph without the argmax".into()))?
                    }
                    _ => self.model.decode_next(ctx, graph, &mut self.cache)?,
                };
                let s = ctx.stream();
                s.memcpy_dtod(&picks.slice(..1), &mut window.slice_mut(j..j + 1))
                    .map_err(cudnn_llm_ops::Error::from)?;
            }
            Ok(())
        };
        // The one wait: the copy of the words returns once every step has run.
        let words = enqueue().and_then(|()| {
            Ok(ctx.stream().clone_dtoh(&window.slice(..steps)).map_err(cudnn_llm_ops::Error::from)?)
        });
        let words = match words {
            Ok(w) => w,
            Err(e) => {
                self.cache.truncate_to(len); // steps that were enqueued are forgotten with the error
                return Err(e);
            }
        };
        self.tokens.push(id);
        for w in &words[..steps - 1] {
            self.tokens.push(match Pick::from_word(*w) {
                Pick::Id(next) => next,
                _ => 0, // not an id: the caller rolls this step back before it returns the error
            });
        }
        Ok(words)
    }

    /// Forgets the last `n` decode steps (steps a pipelined window ran past a stop): the ids and the
    /// cache's length go back to what they were before those steps.
    fn roll_back(&mut self, n: usize) {
        let len = self.tokens.len() - n;
        self.tokens.truncate(len);
        self.cache.truncate_to(len);
    }

    /// Errors unless `n` more ids fit the cache.
    fn fits(&self, n: usize) -> Result<()> {
        let (len, cap) = (self.tokens.len(), self.max_seq);
        if len + n > cap {
            return Err(Error::Generate(format!(
                "{n} more ids do not fit: the cache holds {len} of at most {cap}"
            )));
        }
        Ok(())
    }

    /// Logits of output row `row` of the last forward, on the host.
    fn last_logits(&mut self, ctx: &Cudnn, row: usize, obs: &mut dyn Observer) -> Result<Vec<f32>> {
        let dev = self.model.logits_rows(ctx, row..row + 1, &self.backends, obs)?;
        let host = ctx.stream().clone_dtoh(&dev).map_err(cudnn_llm_ops::Error::from)?;
        Ok(host.iter().map(|v| v.to_f64() as f32).collect())
    }

    /// Generates up to `max_new` ids after `prompt`, starting a new sequence (the cache is reset):
    /// prefill, then choose an id with `sampler`, hand it to `on_token`, and run it, until an id in
    /// `stop` comes out, `max_new` ids are out, or `on_token` breaks. The cache must hold
    /// `prompt.len() + max_new - 1` ids (the last id is not run).
    pub fn generate(
        &mut self,
        ctx: &Cudnn,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        stop: &[u32],
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(Error::Generate("an empty prompt: give at least one id (e.g. BOS)".into()));
        }
        if max_new == 0 {
            return Err(Error::Generate("max_new 0: ask for at least one id".into()));
        }
        let need = prompt.len() + max_new - 1;
        if need > self.max_seq {
            return Err(Error::Generate(format!(
                "{} prompt ids and {max_new} new ones need a cache of {need}; this generator's holds {}",
                prompt.len(),
                self.max_seq
            )));
        }
        self.reset();
        let t = Instant::now();
        let logits = self.prefill(ctx, prompt)?;
        let mut id = sampler.sample(&logits)?;
        let prefill = t.elapsed();
        let (mut decode, mut tokens) = (Duration::ZERO, Vec::with_capacity(max_new));
        // Pick words of steps a pipelined window ran ahead, not yet handed out, oldest first.
        let mut ahead: VecDeque<u32> = VecDeque::new();
        let (mut device_steps, mut overrun_steps) = (0, 0);
        let stop = loop {
            tokens.push(id);
            let flow = on_token(id);
            let stop = if stop.contains(&id) {
                Some(StopReason::Eos(id))
            } else if tokens.len() == max_new {
                Some(StopReason::MaxTokens)
            } else if flow.is_break() {
                Some(StopReason::Callback)
            } else {
                None
            };
            if let Some(stop) = stop {
                // Steps enqueued past this id did not happen in a synchronous run.
                overrun_steps += ahead.len();
                self.roll_back(ahead.len());
                break stop;
            }
            if ahead.is_empty() {
                let t = Instant::now();
                if self.pipelines(sampler) && self.graph_ready(ctx) {
                    let steps = PIPELINE_STEPS.min(max_new - tokens.len());
                    ahead.extend(self.pipelined(ctx, id, steps)?);
                    device_steps += steps;
                } else {
                    let logits = self.step(ctx, id)?;
                    id = sampler.sample(&logits)?;
                    decode += t.elapsed();
                    continue;
                }
                decode += t.elapsed();
            }
            let word = ahead.pop_front().expect("a window of at least one step");
            id = match pick_result(Pick::from_word(word)) {
                Ok(next) => next,
                Err(e) => {
                    // The step that made these logits ran in a synchronous run; those after it did not.
                    self.roll_back(ahead.len());
                    return Err(e);
                }
            };
        };
        let decode_steps = tokens.len() - 1;
        let device_steps = device_steps - overrun_steps;
        Ok(Generation {
            tokens,
            stop,
            prompt_tokens: prompt.len(),
            prefill,
            decode,
            decode_steps,
            device_steps,
            overrun_steps,
        })
    }
}

/// End-of-sequence ids of a Hugging Face checkpoint directory whose `config.json` gave `cfg`:
/// `cfg.eos_token_ids`, then those of `generation_config.json` when that file exists (an id, a list of
/// ids, or absent/null), without repeats. Empty when neither names one.
pub fn eos_token_ids(dir: &Path, cfg: &LlamaConfig) -> Result<Vec<u32>> {
    let mut ids = cfg.eos_token_ids.clone();
    let path = dir.join("generation_config.json");
    if path.exists() {
        let json =
            std::fs::read_to_string(&path).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        for id in parse_eos(&json).map_err(|e| Error::Config(format!("{}: {e}", path.display())))? {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// The `eos_token_id` of one JSON object: an id, a list of ids, or absent/null (no ids).
pub fn parse_eos(json: &str) -> std::result::Result<Vec<u32>, String> {
    let v = crate::json::parse_unique(json).map_err(|e| e.to_string())?;
    let id = |v: &serde_json::Value| {
        v.as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| format!("eos_token_id: {v} is not a token id"))
    };
    match v.get("eos_token_id") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(a)) => a.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eos_ids_are_an_id_a_list_or_nothing() {
        assert_eq!(parse_eos(r#"{"eos_token_id": 128001}"#).unwrap(), vec![128001]);
        assert_eq!(
            parse_eos(r#"{"eos_token_id": [128001, 128008, 128009]}"#).unwrap(),
            vec![128001, 128008, 128009]
        );
        assert_eq!(parse_eos(r#"{"bos_token_id": 1}"#).unwrap(), Vec::<u32>::new());
        assert_eq!(parse_eos(r#"{"eos_token_id": null}"#).unwrap(), Vec::<u32>::new());
        for bad in
            [r#"{"eos_token_id": "</s>"}"#, r#"{"eos_token_id": [1, -2]}"#, r#"{"eos_token_id": 1e20}"#]
        {
            let e = parse_eos(bad).unwrap_err();
            assert!(e.contains("eos_token_id"), "{bad}: {e}");
        }
        assert!(parse_eos("{").is_err());
    }

    #[test]
    fn eos_ids_of_a_directory_merge_both_files() {
        let dir = std::env::temp_dir().join(format!("llama-eos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = LlamaConfig { eos_token_ids: vec![128001], ..LlamaConfig::llama_3_1_8b() };
        assert_eq!(eos_token_ids(&dir, &cfg).unwrap(), vec![128001], "no generation_config.json");
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [128001, 128009]}"#).unwrap();
        assert_eq!(eos_token_ids(&dir, &cfg).unwrap(), vec![128001, 128009]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
        let e = eos_token_ids(&dir, &cfg).unwrap_err().to_string();
        assert!(e.contains("generation_config.json") && e.contains("eos_token_id"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rates_come_from_counts_and_times() {
        let g = Generation {
            tokens: vec![1, 2, 3],
            stop: StopReason::MaxTokens,
            prompt_tokens: 10,
            prefill: Duration::from_millis(20),
            decode: Duration::from_millis(4),
            decode_steps: 2,
            device_steps: 0,
            overrun_steps: 0,
        };
        assert!((g.prefill_tokens_per_s() - 500.0).abs() < 1e-9);
        assert!((g.decode_tokens_per_s().unwrap() - 500.0).abs() < 1e-9);
        let one = Generation { decode_steps: 0, decode: Duration::ZERO, ..g };
        assert_eq!(one.decode_tokens_per_s(), None);
    }
}
