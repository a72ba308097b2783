//! `speedup-report --tp N`: the per-module report of a model split over N GPUs of this host
//! ([`TpLlama`]: one thread, `Cudnn` context and NCCL communicator per GPU, GPUs `0..N`). Started as
//! the ranks of a job of processes (`cudnn-llm-launch --nproc N -- speedup-report ...`), each process
//! measures its own rank ([`TpLlama::join`]) and sends its rows to rank 0, which writes the report
//! (the one-GPU baseline runs on GPU 0 once the ranks are done).
//!
//! For each scenario (prefill, then decode steps) and each selection (all naive, then the fused
//! one), every rank runs what the one-GPU report runs: a cold and a warm call of every module (host
//! time per range), the warm-up, then `--repeat` traced forwards, each module call in an NVTX range
//! between CUDA events on the rank's stream, the two all-reduces of each layer
//! (`fwd.layer.attn.allreduce`, `fwd.layer.mlp.allreduce`) included, while CUPTI records the
//! process's kernels. A kernel belongs to the rank whose GPU ran it (CUPTI's device id) and, within
//! the rank, to the range open on the rank's thread when it was launched. Then `--repeat` untraced
//! forwards timed with CUDA events on every rank.
//!
//! **Rows are per rank**: a scenario per rank (`prefill 1x2048, TP2 rank 0 (GPU 0)`). The ranks run
//! the same shapes, so their module rows differ little, except the all-reduces: an all-reduce's time
//! includes waiting for the slower rank to arrive. **The scaling** compares the slowest rank's
//! untraced forward (what a caller waits for) with the same forward of a one-rank model of the same
//! weights loaded afterwards in the same process on GPU 0 (skipped with `--no-baseline`).

use crate::kernels::{clock, Kernels};
use crate::measure::{Measured, Sums, Work};
use crate::{agreement, check, fell_back, gpu_clocks, meta, plan_lines, scenario, works, write, Error};
use cudnn_llm::reference;
use cudnn_llm_app::bench_util::median;
use cudnn_llm_app::report::cli::{Options, Resolved};
use cudnn_llm_app::report::{Report, Scenario};
use cudnn_llm_llama::model::{ATTN_ALLREDUCE_RANGE, EMBED_RANGE, MLP_ALLREDUCE_RANGE};
use cudnn_llm_llama::profile::{attribute, KernelRecord, RangeRecord, UNATTRIBUTED};
use cudnn_llm_llama::tp::{Rank, RankEnv, TpLlama, TpOptions, WeightSource};
use cudnn_llm_llama::trace::Tracer;
use cudnn_llm_llama::{nccl, Backend, Backends, NoObserver, Observer, Site};
use cudnn_llm_ops::{Cudnn, Element};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

type LResult<R> = cudnn_llm_llama::Result<R>;

/// One scenario as the ranks run it: its forwards, after the prompt when it starts past 0.
struct Pass {
    tokens: Vec<Vec<Vec<u32>>>,
    prompt: Vec<Vec<u32>>,
    start: usize,
}

impl Pass {
    /// Puts the rank's cache where the scenario starts (a prefill fills it for decode) and waits.
    fn reset<T: Element>(&self, r: &mut Rank<T>, b: &Backends) -> LResult<()> {
        let (ctx, model, cache) = r.parts()?;
        cache.clear();
        if self.start > 0 {
            model.forward(ctx, &self.prompt, cache, b, &mut NoObserver)?;
        }
        Ok(ctx.synchronize()?)
    }

    /// The scenario's forwards on the rank (launched, not waited for).
    fn run<T: Element>(&self, r: &mut Rank<T>, b: &Backends, obs: &mut dyn Observer) -> LResult<()> {
        let (ctx, model, cache) = r.parts()?;
        for tokens in &self.tokens {
            model.forward(ctx, tokens, cache, b, obs)?;
        }
        Ok(())
    }

    /// The scenario's forwards on the rank with `obs` a [`Tracer`] on `clock`; waits for them and
    /// returns every call's range and CUDA-event milliseconds.
    fn traced<T: Element>(
        &self,
        r: &mut Rank<T>,
        b: &Backends,
        clock: Box<dyn FnMut() -> u64>,
    ) -> LResult<Vec<(RangeRecord, f64)>> {
        let mut tracer = Tracer::new(r.ctx.stream().clone(), clock);
        self.run(r, b, &mut tracer)?;
        r.ctx.synchronize()?;
        let calls = tracer.finish().map_err(cudnn_llm_ops::Error::from)?;
        calls
            .into_iter()
            .map(|c| Ok((c.gpu_ms().map_err(cudnn_llm_ops::Error::from)?, c.range)))
            .map(|t: LResult<(f64, RangeRecord)>| t.map(|(ms, range)| (range, ms)))
            .collect()
    }
}

/// The ranges of a tensor-parallel forward in forward order: the one-GPU report's, each all-reduce
/// after the projection it sums.
fn tp_ranges() -> Vec<&'static str> {
    let mut names = vec![EMBED_RANGE];
    for site in Site::ALL {
        names.push(site.range);
        if site == Site::O_PROJ {
            names.push(ATTN_ALLREDUCE_RANGE);
        }
        if site == Site::MLP {
            names.push(MLP_ALLREDUCE_RANGE);
        }
    }
    names.push(UNATTRIBUTED);
    names
}

/// The selections compared: all naive, then the fused one.
fn selections(plan: &Resolved) -> [(&'static str, Backends); 2] {
    [("naive", Backends::all(Backend::Naive)), ("fused", plan.fused.clone())]
}

/// Runs the tensor-parallel report and writes `report-tpN.{md,csv,json,svg}`; fused and naive
/// prefill outputs that disagree fail the run after the report is written.
pub(crate) fn run<T: Element>(
    ctx: &Cudnn,
    opts: &Options,
    plan: &Resolved,
    env: Option<&RankEnv>,
) -> Result<(), Error> {
    let ranks = plan.tp.ok_or("speedup-report: the tensor-parallel report without --tp")?;
    let clocks_start = gpu_clocks();
    let cfg = &plan.config;
    let leads = env.is_none_or(|e| e.rank == 0);
    if leads {
        let how = if env.is_some() { ", a process per rank" } else { "" };
        eprintln!(
            "speedup-report --tp {ranks}{how}: {} x {} layers, {}, batch {} x seq {}",
            cfg.name, cfg.layers, plan.dtype, opts.batch, opts.seq
        );
    }
    let source = match &plan.model_dir {
        Some(dir) => WeightSource::checkpoint(cfg, dir)?,
        None => WeightSource::Random { seed: 0 },
    };
    let loading = Instant::now();
    let mut tp = match env {
        Some(env) => TpLlama::<T>::join(cfg, env, &source, plan.max_seq, tp_options())?,
        None => TpLlama::<T>::new(cfg, ranks, &source, plan.max_seq, tp_options())?,
    };
    let load_s = loading.elapsed().as_secs_f64();
    let infos = tp.device_info()?;
    let gpus: Vec<String> =
        infos.iter().zip(tp.devices()).map(|(i, d)| format!("GPU {d} {}", i.name)).collect();
    tp.reset_cache(opts.batch, plan.max_seq)?;
    let base = tp.each("device memory", |r| Ok(r.ctx.pool_memory()?.0))?;
    let kernels = Kernels::probe();
    let (prompt, works) = works(opts, cfg.vocab);
    let selections = selections(plan);
    let bar = if leads { ProgressBar::new(plan.forwards as u64) } else { ProgressBar::hidden() };
    let bar = bar.with_style(
        ProgressStyle::with_template("{msg:>32} [{bar:30}] {pos}/{len} forwards").expect("a valid template"),
    );
    let mut stray = 0;
    let mut measured = Vec::new();
    for work in &works {
        let pass = Arc::new(Pass { tokens: work.tokens.clone(), prompt: prompt.clone(), start: work.start });
        measured.push(measure(&mut tp, &pass, work, &selections, opts, &kernels, &bar, &mut stray)?);
    }
    bar.finish_and_clear();
    // Fused and naive prefill outputs of the split model (rank 0's copy; every rank holds them).
    let mut hidden = Vec::new();
    for (_, b) in &selections {
        hidden.push(hidden_states(&mut tp, &prompt, b, cfg.hidden)?);
    }
    // Each rank here's fallbacks; the first is rank 0's on the process that reports.
    let local = tp.each("fallbacks", |r| Ok(r.model.fallbacks().to_vec()))?;
    let fallbacks: Vec<Vec<(String, String)>> = local.iter().map(|f| fell_back(f)).collect();
    let rank0_fallbacks = local.into_iter().next().unwrap_or_default();
    let plans = tp.each("plans", |r| Ok(plan_lines(&r.ctx)))?;
    let runs = tp.each("kernel runs", |r| {
        Ok(r.ctx
            .kernel_runs()
            .into_iter()
            .map(|k| format!("{}, {} calls", k.name, k.calls))
            .collect::<Vec<_>>())
    })?;
    let peak = tp.each("peak memory", |r| Ok(r.ctx.pool_memory()?.1))?;
    // Every rank's rows, on the process holding rank 0 (as processes, each sends its own there).
    let here = PerRank { gpus, devices: tp.devices().to_vec(), base, peak, fallbacks, measured, stray };
    let everyone = match tp.gather(serde_json::to_vec(&here)?)? {
        None => {
            tp.finish(); // another rank's process: rank 0 reports
            return Ok(());
        }
        Some(parts) if parts.len() == 1 => here,
        Some(parts) => PerRank::merge(parts)?,
    };
    tp.finish();
    let PerRank { gpus, devices, base, peak, fallbacks, measured, stray } = everyone;

    let names = tp_ranges();
    let mut scenarios: Vec<Scenario> = Vec::new();
    let mut extra: Vec<(String, String)> = Vec::new();
    let (agreement_line, disagree) = check(&hidden, plan);
    extra.extend(agreement_line.map(|(k, v)| (format!("{k}, TP{ranks} rank 0"), v)));
    let baseline = if opts.no_baseline || ranks == 1 {
        None
    } else {
        eprintln!("speedup-report --tp {ranks}: the same model on one GPU, for the scaling");
        Some(one_gpu::<T>(cfg, &source, plan, opts, &works, &prompt))
    };
    for (work, per_selection) in works.iter().zip(&measured) {
        let slowest = |s: usize| per_selection[s].iter().map(|m| m.forward_gpu_ms).fold(0.0, f64::max);
        for (rank, &device) in devices.iter().enumerate() {
            let m = [per_selection[0][rank].clone(), per_selection[1][rank].clone()];
            let name = format!("{}, TP{ranks} rank {rank} (GPU {device})", work.name);
            let mut s = scenario(name, &m, &names, &fallbacks[rank]);
            for (what, _) in &mut s.forward_ms {
                // GPU: this rank's events; wall: the call on every rank, from the caller.
                let whose = if what.ends_with("GPU") { "this rank" } else { "all ranks, from the caller" };
                *what = format!("{what} ({whose})");
            }
            s.forward_ms.push(("naive, GPU (slowest rank)".into(), slowest(0)));
            s.forward_ms.push(("fused, GPU (slowest rank)".into(), slowest(1)));
            if let Some(Ok(one)) = &baseline {
                s.forward_ms.push(("naive, GPU (one GPU)".into(), one.forward_ms[&work.name][0]));
                s.forward_ms.push(("fused, GPU (one GPU)".into(), one.forward_ms[&work.name][1]));
            }
            scenarios.push(s);
        }
        if let Some(Ok(one)) = &baseline {
            for (s, (label, _)) in selections.iter().enumerate() {
                let (single, split) = (one.forward_ms[&work.name][s], slowest(s));
                extra.push((
                    format!("scaling, {}, {label}", work.name),
                    format!(
                        "one GPU {single:.3} ms, TP{ranks} {split:.3} ms (slowest rank): {:.2}× ({:.1}% \
                         efficiency)",
                        single / split,
                        100.0 * single / split / ranks as f64
                    ),
                ));
            }
        }
    }
    match &baseline {
        Some(Ok(one)) => {
            let c = reference::compare(&hidden[1], &one.fused_hidden);
            let verdict = if c.passes(agreement(plan)) { "within" } else { "beyond" };
            extra.push((
                format!("TP{ranks} vs one GPU hidden states (prefill, fused)"),
                format!("{c} ({verdict} the fused vs naive tolerance)"),
            ));
            extra.push((
                "one-GPU run".into(),
                format!("a one-rank model of the same weights on GPU {}", devices[0]),
            ));
        }
        Some(Err(e)) => extra.push(("one-GPU run".into(), format!("failed: {e} (no scaling)"))),
        None if ranks == 1 => extra.push(("one-GPU run".into(), "--tp 1 is the one-GPU run".into())),
        None => extra.push(("one-GPU run".into(), "left out (--no-baseline): no scaling".into())),
    }
    let nccl_line = match nccl::library() {
        Ok((v, lib)) if ranks > 1 => format!("NCCL {} ({lib})", nccl::version_string(v)),
        Ok(_) => "one rank: no NCCL".into(),
        Err(e) => format!("NCCL: {e}"),
    };
    extra.push((
        "tensor parallelism".into(),
        format!(
            "{ranks} ranks on {} ({}, Cudnn context and NCCL communicator each), {nccl_line}; Megatron \
             split: heads and FFN rows per rank, an all-reduce after o_proj and after the MLP's down, \
             vocabulary-parallel lm_head; loaded in {load_s:.1} s",
            gpus.join(", "),
            if env.is_some() { "one process" } else { "one thread" }
        ),
    ));
    extra.push((
        "rows".into(),
        "per rank: a rank's kernels are those CUPTI recorded on its GPU (device id), in the range open on the \
         rank's thread at launch; an all-reduce's time includes waiting for the slower rank"
            .into(),
    ));
    let gib = |b: u64| format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64);
    for (rank, (b, p)) in base.iter().zip(&peak).enumerate() {
        extra.push((
            format!("device memory, rank {rank}"),
            format!("{} before any forward (weights, KV cache), peak {}", gib(*b), gib(*p)),
        ));
    }
    extra.push((
        "weights".into(),
        match &plan.model_dir {
            Some(dir) => format!("checkpoint {} (each rank reads its slices)", dir.display()),
            None => "random (seed 0), each rank drawing its slices".into(),
        },
    ));
    extra.push(("GPU clocks at start (GPU 0)".into(), clocks_start));
    extra.push(("GPU clocks at end (GPU 0)".into(), gpu_clocks()));
    let attribution = if kernels.active() {
        format!("CUPTI activity records, per rank by device id ({stray} kernels on GPUs of no rank)")
    } else {
        "unavailable: CUDA-event times only".into()
    };
    extra.push(("kernel attribution".into(), attribution));
    for (i, p) in plans.first().into_iter().flatten().enumerate() {
        extra.push((format!("plan {} (rank 0)", i + 1), p.clone()));
    }
    for (i, k) in runs.first().into_iter().flatten().enumerate() {
        extra.push((format!("kernel {} (rank 0)", i + 1), k.clone()));
    }
    let shape = format!("{} layers, batch {}, seq {}, TP{ranks}", cfg.layers, opts.batch, opts.seq);
    let meta = meta(ctx, plan, &shape, plan.dtype.to_string(), extra, &rank0_fallbacks);
    let report = Report { meta, scenarios };
    write(&report, opts, &format!("report-tp{ranks}"))?;
    match disagree {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// What each rank measured, in rank order: what a process sends to rank 0's (as JSON) when the ranks
/// are processes.
#[derive(serde::Serialize, serde::Deserialize)]
struct PerRank {
    /// `GPU d name` of each rank.
    gpus: Vec<String>,
    devices: Vec<usize>,
    /// Device memory before any forward, and at its peak.
    base: Vec<u64>,
    peak: Vec<u64>,
    /// Each rank's fallbacks (range, reason).
    fallbacks: Vec<Vec<(String, String)>>,
    /// `[work][selection][rank]`.
    measured: Vec<Vec<Vec<Measured>>>,
    /// Kernels on GPUs of no rank.
    stray: usize,
}

impl PerRank {
    /// The processes' parts (JSON, in rank order) as one.
    fn merge(parts: Vec<Vec<u8>>) -> Result<PerRank, Error> {
        let mut all: Option<PerRank> = None;
        for bytes in parts {
            let p: PerRank = serde_json::from_slice(&bytes)?;
            let Some(a) = all.as_mut() else {
                all = Some(p);
                continue;
            };
            a.gpus.extend(p.gpus);
            a.devices.extend(p.devices);
            a.base.extend(p.base);
            a.peak.extend(p.peak);
            a.fallbacks.extend(p.fallbacks);
            a.stray += p.stray;
            if a.measured.len() != p.measured.len() {
                return Err("the ranks measured different scenarios".into());
            }
            for (work, theirs) in a.measured.iter_mut().zip(p.measured) {
                for (selection, ranks) in work.iter_mut().zip(theirs) {
                    selection.extend(ranks);
                }
            }
        }
        all.ok_or_else(|| "no rank's measurements".into())
    }
}

/// Measures one scenario on every rank and selection: `[selection][rank]`. `stray` counts kernels
/// that ran on a GPU of no rank.
#[allow(clippy::too_many_arguments)]
fn measure<T: Element>(
    tp: &mut TpLlama<T>,
    pass: &Arc<Pass>,
    work: &Work,
    selections: &[(&str, Backends)],
    opts: &Options,
    kernels: &Kernels,
    bar: &ProgressBar,
    stray: &mut usize,
) -> Result<Vec<Vec<Measured>>, Error> {
    let ranks = tp.devices().len();
    let devices: Vec<u32> = tp.devices().iter().map(|&d| d as u32).collect();
    // Cold then warm call of every module (host time per range, the longest call), then the warm-up.
    let mut colds = Vec::new();
    for (label, b) in selections {
        bar.set_message(format!("{} {label}", work.name));
        let b = Arc::new(b.clone());
        let mut cold: Vec<BTreeMap<String, (f64, f64)>> = vec![BTreeMap::new(); ranks];
        for i in 0..2 {
            let (p, b) = (pass.clone(), b.clone());
            let calls = tp.each("a cold call", move |r| {
                p.reset(r, &b)?;
                p.traced(r, &b, Tracer::host_clock())
            })?;
            for (rank, calls) in calls.into_iter().enumerate() {
                for (range, _) in calls {
                    let ms = (range.end_ns - range.start_ns) as f64 * 1e-6;
                    let e = cold[rank].entry(range.name).or_insert((0.0, 0.0));
                    let slot = if i == 0 { &mut e.0 } else { &mut e.1 };
                    *slot = slot.max(ms);
                }
            }
            bar.inc(1);
        }
        for _ in 0..opts.warmup {
            let (p, b) = (pass.clone(), b.clone());
            tp.each("a warm-up forward", move |r| {
                p.reset(r, &b)?;
                p.run(r, &b, &mut NoObserver)?;
                Ok(r.ctx.synchronize()?)
            })?;
            bar.inc(1);
        }
        colds.push(cold);
    }
    // Traced forwards, alternating between the selections; CUPTI around the measured pass only.
    bar.set_message(format!("{} measured", work.name));
    let n = selections.len();
    let mut sums: Vec<Vec<BTreeMap<String, Sums>>> = vec![vec![BTreeMap::new(); ranks]; n];
    let mut ranges: Vec<Vec<Vec<RangeRecord>>> = vec![vec![Vec::new(); ranks]; n];
    let mut records: Vec<Vec<Vec<KernelRecord>>> = vec![vec![Vec::new(); ranks]; n];
    for _ in 0..opts.repeat {
        for (i, (_, b)) in selections.iter().enumerate() {
            let b = Arc::new(b.clone());
            let (p, bb) = (pass.clone(), b.clone());
            tp.each("a reset", move |r| p.reset(r, &bb))?;
            kernels.start();
            let (p, cupti) = (pass.clone(), kernels.handle());
            let traced = tp.each("a traced forward", move |r| p.traced(r, &b, clock(cupti.clone())));
            let got = kernels.stop();
            for (rank, calls) in traced?.into_iter().enumerate() {
                for (range, ms) in calls {
                    let s = sums[i][rank].entry(range.name.clone()).or_default();
                    s.calls += 1.0;
                    s.event_ms += ms;
                    ranges[i][rank].push(range);
                }
            }
            for k in got {
                match devices.iter().position(|&d| d == k.device) {
                    Some(rank) => records[i][rank].push(k),
                    None => *stray += 1,
                }
            }
            bar.inc(1);
        }
    }
    let with_kernels = kernels.active();
    // Untraced forwards: CUDA events around each rank's pass, and the call on all ranks from here.
    let per_pass = pass.tokens.len() as f64;
    let mut gpu: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); ranks]; n];
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); n];
    for _ in 0..opts.repeat {
        for (i, (_, b)) in selections.iter().enumerate() {
            let b = Arc::new(b.clone());
            let (p, bb) = (pass.clone(), b.clone());
            tp.each("a reset", move |r| p.reset(r, &bb))?;
            let p = pass.clone();
            let t = Instant::now();
            let ms =
                tp.each("an untraced forward", move |r| Ok(r.timed(|r| p.run(r, &b, &mut NoObserver))?.1))?;
            wall[i].push(t.elapsed().as_secs_f64() * 1e3 / per_pass);
            for (rank, ms) in ms.into_iter().enumerate() {
                gpu[i][rank].push(ms / per_pass);
            }
        }
    }
    let mut out = Vec::new();
    for i in 0..n {
        let mut per_rank = Vec::new();
        for rank in 0..ranks {
            let mut sums = std::mem::take(&mut sums[i][rank]);
            for (name, t) in attribute(&ranges[i][rank], &records[i][rank]) {
                let s = sums.entry(name).or_default();
                s.kernels += t.kernels as f64;
                s.kernel_ms += t.kernel_ns as f64 * 1e-6;
            }
            per_rank.push(Measured {
                with_kernels,
                sums,
                forwards: opts.repeat * pass.tokens.len(),
                forward_gpu_ms: median(std::mem::take(&mut gpu[i][rank])),
                forward_wall_ms: median(wall[i].clone()),
                cold: colds[i][rank].clone(),
            });
        }
        out.push(per_rank);
    }
    Ok(out)
}

/// The prefill's output rows (`[batch · seq, hidden]`, after the output norm) on `b`, rank 0's copy.
fn hidden_states<T: Element>(
    tp: &mut TpLlama<T>,
    prompt: &[Vec<u32>],
    b: &Backends,
    hidden: usize,
) -> Result<Vec<T>, Error> {
    let (prompt, b) = (Arc::new(prompt.to_vec()), Arc::new(b.clone()));
    let rows = prompt.iter().map(Vec::len).sum::<usize>() * hidden;
    let mut per_rank = tp.each("hidden states", move |r| {
        let index = r.index;
        let (ctx, model, cache) = r.parts()?;
        cache.clear();
        let out = model.forward(ctx, &prompt, cache, &b, &mut NoObserver)?;
        if index == 0 {
            Ok(ctx.stream().clone_dtoh(&out.slice(..rows)).map_err(cudnn_llm_ops::Error::from)?)
        } else {
            ctx.synchronize()?;
            Ok(Vec::new())
        }
    })?;
    Ok(per_rank.swap_remove(0))
}

/// What the one-GPU run measured.
struct OneGpu {
    /// Per scenario, the median untraced forward's GPU ms, naive then fused.
    forward_ms: BTreeMap<String, Vec<f64>>,
    /// The fused prefill's output rows.
    fused_hidden: Vec<f64>,
}

/// The same model as one rank (GPU 0): per scenario and selection, the cold and warm calls and the
/// warm-up untimed, then `--repeat` forwards timed with CUDA events (median), and the fused prefill
/// output. Its failure (one GPU too small) is reported, not fatal.
fn one_gpu<T: Element>(
    cfg: &cudnn_llm_llama::LlamaConfig,
    source: &WeightSource,
    plan: &Resolved,
    opts: &Options,
    works: &[Work],
    prompt: &[Vec<u32>],
) -> Result<OneGpu, Error> {
    let mut one = TpLlama::<T>::new(cfg, 1, source, plan.max_seq, tp_options())?;
    one.reset_cache(opts.batch, plan.max_seq)?;
    let mut forward_ms = BTreeMap::new();
    for work in works {
        let pass = Arc::new(Pass { tokens: work.tokens.clone(), prompt: prompt.to_vec(), start: work.start });
        let mut times = Vec::new();
        for (_, b) in selections(plan) {
            let b = Arc::new(b);
            let mut samples = Vec::new();
            for k in 0..2 + opts.warmup + opts.repeat {
                let (p, b) = (pass.clone(), b.clone());
                let ms = one.each("a one-GPU forward", move |r| {
                    p.reset(r, &b)?;
                    Ok(r.timed(|r| p.run(r, &b, &mut NoObserver))?.1)
                })?;
                if k >= 2 + opts.warmup {
                    samples.push(ms[0] / pass.tokens.len() as f64);
                }
            }
            times.push(median(samples));
        }
        forward_ms.insert(work.name.clone(), times);
    }
    let fused = hidden_states(&mut one, prompt, &plan.fused, cfg.hidden)?;
    let fused_hidden = fused.iter().map(|v| v.to_f64()).collect();
    Ok(OneGpu { forward_ms, fused_hidden })
}

/// Each call on the ranks waits up to 15 minutes (tp-bench's default: drawing or reading a rank's
/// share of Llama-3.1-70B takes minutes) before the ranks are torn down.
fn tp_options() -> TpOptions {
    TpOptions::default().with_timeout(std::time::Duration::from_secs(900))
}
