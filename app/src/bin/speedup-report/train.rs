//! `speedup-report --train`: the per-module report of a training step. Two trainers start from the
//! same weights, one all naive and one on the fused selection; each takes a cold and a warm step
//! traced on the host clock (first-call costs per range), then the warm-up steps; then, alternating
//! between them, `--repeat` steps with every module call in an NVTX range between CUDA events and
//! its kernels recorded by CUPTI, and `--repeat` untraced steps for the phases' CUDA-event times
//! (`StepStats`) and the wall time. Rows: `fwd.` (the loss included), `bwd.`, `opt.` ranges; the
//! phase table sums them against the event times. No activation checkpointing, so every `fwd.` range
//! belongs to the forward.

use crate::kernels::Kernels;
use crate::{gpu_clocks, meta, run_lines, write, Error};
use cudnn_llm_app::bench_util::{median, wall_ms};
use cudnn_llm_app::report::cli::{Options, Resolved};
use cudnn_llm_app::report::train::{phase_rows, PhaseTimes};
use cudnn_llm_app::report::{FirstCall, Meta, ModuleRow, Report, Scenario, Side};
use cudnn_llm_llama::model::EMBED_RANGE;
use cudnn_llm_llama::profile::{attribute, KernelRecord, RangeRecord, UNATTRIBUTED};
use cudnn_llm_llama::trace::Tracer;
use cudnn_llm_llama::train::{ADAMW_RANGE, BWD_EMBED_RANGE, GRAD_NORM_RANGE, LOSS_RANGE};
use cudnn_llm_llama::weights::Weights;
use cudnn_llm_llama::{Backend, Backends, Batch, LlamaConfig, Site, StepStats, TrainConfig, Trainer};
use cudnn_llm_ops::Cudnn;
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;

/// AdamW's learning rate: small, so that the measured steps run on weights close to the first's.
const LR: f64 = 1e-4;
/// The standard deviation of a random model's embedding (transformers' `initializer_range`, as the
/// `train` binary draws it), so that the tied logits do not saturate.
const EMBED_STD: f64 = 0.02;
/// How far apart the first step's fused and naive losses may be (relative): two bf16 paths, each
/// within 1e-2 of the f64 loss in `tests/train.rs`.
const LOSS_AGREEMENT: f64 = 2e-2;

/// Per range name: calls, kernels, kernel ms (CUPTI) and event ms, summed over the traced steps.
#[derive(Default, Clone, Copy)]
struct Sums {
    calls: f64,
    kernels: f64,
    kernel_ms: f64,
    event_ms: f64,
}

/// What one backend's trainer measured.
#[derive(Default)]
struct Measured {
    sums: BTreeMap<String, Sums>,
    ranges: Vec<RangeRecord>,
    records: Vec<KernelRecord>,
    /// Host ms of each range's first (cold) and second (warm) step, the longest call of each.
    cold: BTreeMap<String, (f64, f64)>,
    /// The first step's loss.
    first_loss: f64,
    /// Untraced steps' statistics and wall ms.
    stats: Vec<StepStats>,
    wall: Vec<f64>,
    /// High-water mark of device memory over this backend's steps.
    peak: u64,
}

impl Measured {
    fn phases(&self) -> PhaseTimes {
        let med = |f: fn(&StepStats) -> f64| median(self.stats.iter().map(f).collect());
        PhaseTimes {
            forward_ms: med(|s| s.forward_ms),
            backward_ms: med(|s| s.backward_ms),
            optimizer_ms: med(|s| s.optimizer_ms),
            step_ms: med(|s| s.step_ms),
        }
    }
}

/// Random weights as the `train` binary draws them (the embedding at std [`EMBED_STD`]).
fn random_weights(cfg: &LlamaConfig) -> Weights<bf16> {
    let mut w = Weights::<bf16>::random(cfg, 0);
    let scale = EMBED_STD * 3f64.sqrt();
    w.embed.data.iter_mut().for_each(|v| *v = bf16::from_f64(v.to_f64() * scale));
    w
}

/// Runs the training report and writes `report-train.{md,csv,json,svg}`; fused and naive first-step
/// losses that disagree fail the run after the report is written.
pub(crate) fn run(ctx: &Cudnn, opts: &Options, plan: &Resolved) -> Result<(), Error> {
    let clocks_start = gpu_clocks();
    let cfg = &plan.config;
    eprintln!(
        "speedup-report --train: {} x {} layers, bf16, batch {} x seq {}, on {}",
        cfg.name,
        cfg.layers,
        opts.batch,
        opts.seq,
        ctx.info().name
    );
    let weights = match &plan.model_dir {
        Some(dir) => Weights::<bf16>::load(cfg, dir)?,
        None => random_weights(cfg),
    };
    let batch = Batch::new(
        (0..opts.batch)
            .map(|b| (0..opts.seq).map(|t| ((b * 7919 + t * 104729) % cfg.vocab) as u32).collect())
            .collect(),
    );
    let selections = [
        ("naive", Backends::all(Backend::Naive), Backend::Naive),
        ("fused", plan.fused.clone(), Backend::Fused),
    ];
    let mut trainers = selections
        .iter()
        .map(|(_, b, standalone)| {
            let tcfg = TrainConfig::new(LR).with_backends(b.clone()).with_standalone(*standalone);
            Trainer::new(ctx, cfg, &weights, tcfg)
        })
        .collect::<Result<Vec<_>, _>>()?;
    drop(weights);
    ctx.synchronize()?;
    let base = ctx.pool_memory()?.0;
    let kernels = Kernels::probe();
    let bar = ProgressBar::new(plan.forwards as u64).with_style(
        ProgressStyle::with_template("{msg:>20} [{bar:30}] {pos}/{len} steps").expect("a valid template"),
    );
    let mut m: Vec<Measured> = selections.iter().map(|_| Measured::default()).collect();
    let note_peak = |m: &mut Measured| -> Result<(), Error> {
        m.peak = m.peak.max(ctx.pool_memory()?.1);
        Ok(())
    };
    // Cold and warm step of each backend, host time per range; then the warm-up steps.
    for ((label, ..), (t, mine)) in selections.iter().zip(trainers.iter_mut().zip(m.iter_mut())) {
        bar.set_message(format!("{label} cold, warm-up"));
        ctx.reset_peak_memory()?;
        for k in 0..2 {
            let mut tracer = Tracer::new(ctx.stream().clone(), Tracer::host_clock());
            let stats = t.step_observed(ctx, &batch, &mut tracer)?;
            if k == 0 {
                mine.first_loss = stats.loss;
            }
            for call in tracer.finish()? {
                let ms = (call.range.end_ns - call.range.start_ns) as f64 * 1e-6;
                let e = mine.cold.entry(call.range.name.clone()).or_insert((0.0, 0.0));
                let slot = if k == 0 { &mut e.0 } else { &mut e.1 };
                *slot = slot.max(ms);
            }
            bar.inc(1);
        }
        for _ in 0..opts.warmup {
            t.step(ctx, &batch)?;
            bar.inc(1);
        }
        note_peak(mine)?;
    }
    // Traced steps, alternating between the backends so that clock changes weigh on both alike.
    bar.set_message("traced");
    for _ in 0..opts.repeat {
        for (t, mine) in trainers.iter_mut().zip(m.iter_mut()) {
            ctx.synchronize()?;
            ctx.reset_peak_memory()?;
            kernels.start();
            let mut tracer = Tracer::new(ctx.stream().clone(), kernels.clock());
            t.step_observed(ctx, &batch, &mut tracer)?;
            ctx.synchronize()?;
            mine.records.extend(kernels.stop());
            note_peak(mine)?;
            for call in tracer.finish()? {
                let s = mine.sums.entry(call.range.name.clone()).or_default();
                s.calls += 1.0;
                s.event_ms += call.gpu_ms()?;
                mine.ranges.push(call.range);
            }
            bar.inc(1);
        }
    }
    // Untraced steps: the phases' event times and the wall time.
    bar.set_message("untraced");
    for _ in 0..opts.repeat {
        for (t, mine) in trainers.iter_mut().zip(m.iter_mut()) {
            let mut stats = None;
            let wall = wall_ms(ctx, || -> Result<(), Error> {
                stats = Some(t.step(ctx, &batch)?);
                Ok(())
            })?;
            mine.stats.extend(stats);
            mine.wall.push(wall);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let with_kernels = kernels.active();
    for mine in m.iter_mut() {
        for (name, t) in attribute(&mine.ranges, &mine.records) {
            let s = mine.sums.entry(name).or_default();
            s.kernels += t.kernels as f64;
            s.kernel_ms += t.kernel_ns as f64 * 1e-6;
        }
    }
    let rows = module_rows(&m, &trainers[1], opts.repeat, with_kernels);
    let phases = phase_rows(&rows, m[0].phases(), m[1].phases());
    let first_calls = rows
        .iter()
        .filter_map(|r| {
            let (n, f) = (m[0].cold.get(&r.range), m[1].cold.get(&r.range));
            (n.is_some() || f.is_some()).then(|| {
                let ((nf, nw), (ff, fw)) = (n.copied().unwrap_or_default(), f.copied().unwrap_or_default());
                FirstCall {
                    range: r.range.clone(),
                    naive_first_ms: nf,
                    naive_warm_ms: nw,
                    fused_first_ms: ff,
                    fused_warm_ms: fw,
                }
            })
        })
        .collect();
    let scenario = Scenario {
        name: format!("train step {}x{} (forward, loss, backward, AdamW)", opts.batch, opts.seq),
        rows,
        forward_ms: Vec::new(),
        first_calls,
        phases,
    };
    let (naive_loss, fused_loss) = (m[0].first_loss, m[1].first_loss);
    let rel = ((fused_loss - naive_loss) / naive_loss).abs();
    let agreement = format!("naive {naive_loss:.5}, fused {fused_loss:.5} (relative {rel:.1e})");
    eprintln!("speedup-report: first-step loss {agreement}");
    let meta = metadata(ctx, opts, plan, &trainers, &m, base, &kernels, agreement, clocks_start);
    let report = Report { meta, scenarios: vec![scenario] };
    write(&report, opts, "report-train")?;
    if rel.is_nan() || rel > LOSS_AGREEMENT {
        return Err(format!(
            "fused and naive first-step losses disagree: {naive_loss} vs {fused_loss} (relative {rel:.2e} > \
             {LOSS_AGREEMENT}; the report is written anyway)"
        )
        .into());
    }
    Ok(())
}

/// The rows in step order (the forward, the loss, the backward, the optimizer, then kernels outside
/// ranges and any other range), per step.
fn module_rows(m: &[Measured], fused: &Trainer<bf16>, steps: usize, with_kernels: bool) -> Vec<ModuleRow> {
    let mut names: Vec<&str> = std::iter::once(EMBED_RANGE)
        .chain(Site::ALL.iter().map(|s| s.range))
        .chain([LOSS_RANGE])
        .chain(Site::BACKWARD.iter().rev().map(|s| s.range))
        .chain([BWD_EMBED_RANGE, GRAD_NORM_RANGE, ADAMW_RANGE, UNATTRIBUTED])
        .collect();
    for name in m.iter().flat_map(|m| m.sums.keys()) {
        if !names.contains(&name.as_str()) {
            names.push(name);
        }
    }
    let empty = Sums::default();
    let per = |s: &Sums| {
        let k = steps as f64;
        Side {
            kernels: (s.kernels / k).round() as usize,
            kernel_ms: if with_kernels { s.kernel_ms } else { s.event_ms } / k,
            event_ms: s.event_ms / k,
        }
    };
    names
        .into_iter()
        .filter_map(|name| {
            let (n, f) = (m[0].sums.get(name), m[1].sums.get(name));
            if n.is_none() && f.is_none() {
                return None;
            }
            let (n, f) = (n.unwrap_or(&empty), f.unwrap_or(&empty));
            let fallbacks: Vec<&str> =
                fused.fallbacks().iter().filter(|f| f.range == name).map(|f| f.reason.as_str()).collect();
            let note = fallbacks.first().map_or(String::new(), |r| format!("fell back: {r}"));
            let calls = (n.calls.max(f.calls) / steps as f64).round() as usize;
            Some(ModuleRow::new(name, calls, per(n), per(f), &note))
        })
        .collect()
}

/// The run's metadata: GPU, driver, cuDNN, build, model and selection, then the first-step losses,
/// the wall times, the optimizer, memory, weights, clocks, kernel attribution, plans, fallbacks.
#[allow(clippy::too_many_arguments)]
fn metadata(
    ctx: &Cudnn,
    opts: &Options,
    plan: &Resolved,
    trainers: &[Trainer<bf16>],
    m: &[Measured],
    base: u64,
    kernels: &Kernels,
    agreement: String,
    clocks_start: String,
) -> Meta {
    let cfg = &plan.config;
    let gib = |b: u64| format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64);
    let (naive_wall, fused_wall) = (median(m[0].wall.clone()), median(m[1].wall.clone()));
    let mut extra = vec![
        ("first-step loss, fused vs naive".to_string(), agreement),
        (
            format!("step wall time (host, the loss read back), median of {}", opts.repeat),
            format!("naive {naive_wall:.3} ms, fused {fused_wall:.3} ms ({:.2}×)", naive_wall / fused_wall),
        ),
        (
            "optimizer".into(),
            format!(
                "AdamW lr {LR:e}, betas (0.9, 0.95), eps 1e-8, no weight decay, no clipping; bf16 weights, f32 \
                 gradients and moments; no activation checkpointing; {} tokens per step",
                opts.batch * opts.seq
            ),
        ),
        ("device memory of both trainers (weights, gradients, AdamW moments) before any step".into(), gib(base)),
    ];
    for (label, mm) in ["naive", "fused"].iter().zip(m) {
        extra.push((
            format!("peak device memory, {label} steps (stream-ordered allocations)"),
            format!("{} (+{} over the trainers)", gib(mm.peak), gib(mm.peak.saturating_sub(base))),
        ));
    }
    extra.push((
        "weights".into(),
        match &plan.model_dir {
            Some(dir) => format!("checkpoint {}", dir.display()),
            None => format!("random (seed 0, embedding std {EMBED_STD})"),
        },
    ));
    extra.extend(run_lines(ctx, kernels, clocks_start));
    let shape = format!("{} layers, batch {}, seq {}, training step", cfg.layers, opts.batch, opts.seq);
    meta(ctx, plan, &shape, "bf16".into(), extra, trainers.iter().flat_map(|t| t.fallbacks()))
}
