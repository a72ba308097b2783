//! The report's measurements: per-range sums over traced forwards, whole-forward times, first-call
//! costs, and plain launches against a CUDA-graph replay.

use crate::kernels::Kernels;
use crate::Error;
use cudnn_llm_app::bench_util::{gpu_and_wall_ms, median, wall_ms};
use cudnn_llm_app::report::cli::Options;
use cudnn_llm_llama::profile::{attribute, KernelRecord, RangeRecord};
use cudnn_llm_llama::trace::Tracer;
use cudnn_llm_llama::{Backends, KvCache, Llama, NoObserver, Observer};
use cudnn_llm_ops::{Cudnn, Element};
use indicatif::ProgressBar;
use std::collections::BTreeMap;

/// Per range name: calls, kernels, kernel ms (CUPTI) and event ms, summed over the measured forwards.
#[derive(Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub(crate) struct Sums {
    pub(crate) calls: f64,
    pub(crate) kernels: f64,
    pub(crate) kernel_ms: f64,
    pub(crate) event_ms: f64,
}

#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Measured {
    /// Kernel records were collected (CUPTI worked throughout).
    pub(crate) with_kernels: bool,
    pub(crate) sums: BTreeMap<String, Sums>,
    pub(crate) forwards: usize,
    /// Whole-forward GPU ms (events around untraced forwards), median per forward.
    pub(crate) forward_gpu_ms: f64,
    /// Whole-forward host ms (untraced forwards + synchronize), median per forward.
    pub(crate) forward_wall_ms: f64,
    /// Host ms of each range's first (cold) and second (warm) call.
    pub(crate) cold: BTreeMap<String, (f64, f64)>,
}

/// One scenario: the forwards it runs on a model whose cache holds `start` tokens.
pub(crate) struct Work {
    pub(crate) name: String,
    pub(crate) tokens: Vec<Vec<Vec<u32>>>,
    pub(crate) start: usize,
}

/// Measures `work` on each backend of `selections`: first (cold) and warm call host times, warm-up,
/// then traced passes (NVTX, events, CUPTI per range) and untraced ones (whole-forward time). Samples
/// alternate between backends, so that clock changes over the run (GPUs slow down as they heat) weigh
/// on both alike. `peak` gets each backend's high-water mark of device memory.
#[allow(clippy::too_many_arguments)]
pub(crate) fn measure<T: Element>(
    ctx: &Cudnn,
    model: &mut Llama<T>,
    cache: &mut KvCache<T>,
    work: &Work,
    prompt: &[Vec<u32>],
    selections: &[(&str, Backends)],
    opts: &Options,
    kernels: &Kernels,
    bar: &ProgressBar,
    peak: &mut BTreeMap<String, u64>,
) -> Result<Vec<Measured>, Error> {
    // Puts the cache where the scenario starts (a prefill fills it for decode).
    let reset = |model: &mut Llama<T>, cache: &mut KvCache<T>, b: &Backends| -> Result<(), Error> {
        cache.clear();
        if work.start > 0 {
            model.forward(ctx, prompt, cache, b, &mut NoObserver)?;
        }
        Ok(())
    };
    let pass = |model: &mut Llama<T>, cache: &mut KvCache<T>, b: &Backends, obs: &mut dyn Observer| {
        work.tokens.iter().try_for_each(|tokens| model.forward(ctx, tokens, cache, b, obs).map(drop))
    };
    let mut note_peak = |label: &str| -> Result<(), Error> {
        let high = ctx.pool_memory()?.1;
        let p = peak.entry(label.to_string()).or_insert(0);
        *p = (*p).max(high);
        Ok(())
    };
    let mut colds = Vec::new();
    for (label, b) in selections {
        bar.set_message(format!("{} {label}", work.name));
        ctx.reset_peak_memory()?;
        // Cold then warm call of every module, host time per range.
        let mut cold = BTreeMap::new();
        for i in 0..2 {
            reset(model, cache, b)?;
            let mut t = Tracer::new(ctx.stream().clone(), Tracer::host_clock());
            pass(model, cache, b, &mut t)?;
            ctx.synchronize()?;
            for call in t.finish()? {
                let ms = (call.range.end_ns - call.range.start_ns) as f64 * 1e-6;
                let e: &mut (f64, f64) = cold.entry(call.range.name.clone()).or_insert((0.0, 0.0));
                if i == 0 {
                    e.0 = e.0.max(ms)
                } else {
                    e.1 = e.1.max(ms)
                }
            }
            bar.inc(1);
        }
        for _ in 0..opts.warmup {
            reset(model, cache, b)?;
            pass(model, cache, b, &mut Tracer::new(ctx.stream().clone(), Tracer::host_clock()))?;
            bar.inc(1);
        }
        ctx.synchronize()?;
        note_peak(label)?;
        colds.push(cold);
    }
    bar.set_message(format!("{} measured", work.name));
    let n = selections.len();
    let mut sums: Vec<BTreeMap<String, Sums>> = vec![BTreeMap::new(); n];
    let mut ranges: Vec<Vec<RangeRecord>> = vec![Vec::new(); n];
    let mut records: Vec<Vec<KernelRecord>> = vec![Vec::new(); n];
    for _ in 0..opts.repeat {
        for (i, (label, b)) in selections.iter().enumerate() {
            reset(model, cache, b)?;
            ctx.synchronize()?;
            ctx.reset_peak_memory()?;
            // Kernels are collected around the measured pass only (not the decode scenario's prefill).
            kernels.start();
            let mut t = Tracer::new(ctx.stream().clone(), kernels.clock());
            pass(model, cache, b, &mut t)?;
            ctx.synchronize()?;
            records[i].extend(kernels.stop());
            note_peak(label)?;
            for call in t.finish()? {
                let s = sums[i].entry(call.range.name.clone()).or_default();
                s.calls += 1.0;
                s.event_ms += call.gpu_ms()?;
                ranges[i].push(call.range);
            }
            bar.inc(1);
        }
    }
    let with_kernels = kernels.active();
    // Whole-forward times from untraced passes (no events, NVTX or CUPTI per module), per forward.
    let per_pass = work.tokens.len() as f64;
    let (mut gpu, mut wall) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for _ in 0..opts.repeat {
        for (i, (_, b)) in selections.iter().enumerate() {
            reset(model, cache, b)?;
            let (g, w) = gpu_and_wall_ms(ctx, || pass(model, cache, b, &mut NoObserver))?;
            gpu[i].push(g / per_pass);
            wall[i].push(w / per_pass);
        }
    }
    let mut out = Vec::new();
    for (i, ((mut sums, cold), (gpu, wall))) in
        sums.into_iter().zip(colds).zip(gpu.into_iter().zip(wall)).enumerate()
    {
        for (name, t) in attribute(&ranges[i], &records[i]) {
            let s = sums.entry(name).or_default();
            s.kernels += t.kernels as f64;
            s.kernel_ms += t.kernel_ns as f64 * 1e-6;
        }
        out.push(Measured {
            with_kernels,
            sums,
            forwards: opts.repeat * work.tokens.len(),
            forward_gpu_ms: median(gpu),
            forward_wall_ms: median(wall),
            cold,
        });
    }
    Ok(out)
}

/// Median wall ms of the fused prefill launched plainly and of its captured CUDA graph replayed, timed
/// the same way (launch + synchronize) in alternation, after the other measurements, so that the ratio
/// is launch overhead alone (and clock changes weigh on both alike).
pub(crate) fn graph_replay<T: Element>(
    ctx: &Cudnn,
    model: &mut Llama<T>,
    cache: &mut KvCache<T>,
    prompt: &[Vec<u32>],
    backends: &Backends,
    repeat: usize,
) -> Result<(f64, f64), Error> {
    cache.clear();
    // SAFETY: the report runs on one thread and makes no other stream of this context.
    let graph = unsafe { model.capture(ctx, prompt, cache, backends) }?;
    graph.upload()?;
    let (mut plain, mut replay) = (Vec::new(), Vec::new());
    // The first round warms the host's caches after the other work and is not kept.
    for round in 0..repeat.max(3) + 1 {
        cache.clear();
        let p = wall_ms(ctx, || model.forward(ctx, prompt, cache, backends, &mut NoObserver).map(drop))?;
        let r = wall_ms(ctx, || graph.launch().map_err(cudnn_llm_ops::Error::from))?;
        if round > 0 {
            plain.push(p);
            replay.push(r);
        }
    }
    Ok((median(plain), median(replay)))
}

/// Kernels one replay of a captured decode step launches and its graph's nodes, or why not counted.
pub(crate) type StepKernels = Result<(usize, usize), String>;

/// Median wall ms of one fused decode step with its logits, launched plainly and replayed as a
/// captured graph ([`Llama::capture_decode`]), alternating, at the cache lengths of the decode
/// scenario (after `prompt` and one warm step; `steps` steps, each timed alone with a synchronize),
/// and the captured step's kernels.
pub(crate) fn decode_graph<T: Element>(
    ctx: &Cudnn,
    model: &mut Llama<T>,
    cache: &mut KvCache<T>,
    prompt: &[Vec<u32>],
    backends: &Backends,
    steps: usize,
    repeat: usize,
) -> Result<(f64, f64, StepKernels), Error> {
    let batch = prompt.len();
    let step_tokens = |s: usize| vec![(s % 1000) as u32 + 7; batch];
    cache.clear();
    model.forward(ctx, prompt, cache, backends, &mut NoObserver)?;
    // A plain step and its logits first: the capture builds no plan.
    let first: Vec<Vec<u32>> = step_tokens(0).iter().map(|&t| vec![t]).collect();
    model.forward(ctx, &first, cache, backends, &mut NoObserver)?;
    model.logits(ctx, batch, backends, &mut NoObserver)?;
    // SAFETY: the report runs on one thread and makes no other stream of this context.
    let mut graph = unsafe { model.capture_decode(ctx, cache, backends) }?;
    let at = cache.lens()[0];
    let (mut plain, mut replay) = (Vec::new(), Vec::new());
    for _ in 0..repeat.max(3) {
        let (mut p, mut r) = (0.0, 0.0);
        for s in 0..steps {
            let tokens = step_tokens(s + 1);
            let rows: Vec<Vec<u32>> = tokens.iter().map(|&t| vec![t]).collect();
            cache.truncate_to(at + s);
            p += wall_ms(ctx, || -> Result<(), Error> {
                model.forward(ctx, &rows, cache, backends, &mut NoObserver)?;
                model.logits(ctx, batch, backends, &mut NoObserver)?;
                Ok(())
            })?;
            cache.truncate_to(at + s);
            r += wall_ms(ctx, || -> Result<(), Error> {
                model.decode(ctx, &mut graph, &tokens, cache)?;
                Ok(())
            })?;
        }
        plain.push(p / steps as f64);
        replay.push(r / steps as f64);
    }
    let kernels = graph.kernels().map_err(|e| e.to_string());
    Ok((median(plain), median(replay), kernels))
}
