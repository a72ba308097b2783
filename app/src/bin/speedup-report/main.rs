//! `cargo run --release --bin speedup-report -- [options]`: what the fused cuDNN modules buy over naive
//! kernels, module by module, on this GPU. See `--help` and the README.
//!
//! For each scenario (prefill, then decode steps) and each backend selection (all naive, then the
//! fused one) it runs warm-up forwards, then `--repeat` measured forwards with every module call in an
//! NVTX range, between CUDA events, and (when CUPTI loads) with every kernel recorded and attributed to
//! the range that launched it. It also times the whole forward with plain launches and replayed as a
//! CUDA graph, the first (cold) call of each module against a warm one, peak device memory and GPU
//! clocks, checks that fused and naive hidden states agree, and writes report.{md,csv,json,svg}.
//!
//! The model is a preset with random weights (`--config`), or a Hugging Face checkpoint directory
//! (`--model DIR`: its config.json and safetensors), which the report's metadata names.
//!
//! `--train` reports a training step instead (forward, loss, backward, AdamW; see [`train`]) and
//! writes report-train.{md,csv,json,svg}. `--tp N` runs the model split over N GPUs, with rows per
//! rank, the all-reduces' ranges and the scaling against one GPU (see [`tp`]), and writes
//! report-tpN.{md,csv,json,svg}.

use clap::Parser;
use cudnn_llm::reference;
use cudnn_llm_app::bench_util::{copy_bandwidth_gbps, tool_main};
use cudnn_llm_app::report::cli::{Options, Resolved};
use cudnn_llm_app::report::{chart, FirstCall, Meta, ModuleRow, Report, Scenario, Side};
use cudnn_llm_app::BUILD;
use cudnn_llm_llama::roofline::{self, DecodeRoofline};
use cudnn_llm_llama::tp::RankEnv;
use cudnn_llm_llama::weights::Weights;
use cudnn_llm_llama::{Backend, Backends, Fallback, Llama, NoObserver, Site};
use cudnn_llm_ops::{Cudnn, DataType, Element, WeightScales};
use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::process::ExitCode;

mod kernels;
mod measure;
mod tp;
mod train;

use kernels::Kernels;
use measure::{decode_graph, graph_replay, measure, Measured, Sums, Work};

type Error = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let opts = Options::parse();
    tool_main(
        "speedup-report",
        || {
            let mut plan = opts.resolve()?;
            // Started as the ranks of a job of processes: one rank here, the world size the --tp.
            let env = RankEnv::of_several().map_err(|e| e.to_string())?;
            if let Some(env) = &env {
                match plan.tp {
                    Some(n) if n != env.world => {
                        return Err(format!(
                        "--tp {n}, but launched as rank {} of {} (WORLD_SIZE is set): give --tp {} or none",
                        env.rank, env.world, env.world
                    ))
                    }
                    _ if opts.train => {
                        return Err("launched as ranks (WORLD_SIZE is set): --train runs on one GPU".into())
                    }
                    _ => plan.tp = Some(env.world),
                }
            }
            Ok((plan, env))
        },
        |ctx, (plan, env)| match plan.dtype {
            _ if opts.train => train::run(ctx, &opts, &plan),
            DataType::F16 if plan.tp.is_some() => tp::run::<f16>(ctx, &opts, &plan, env.as_ref()),
            _ if plan.tp.is_some() => tp::run::<bf16>(ctx, &opts, &plan, env.as_ref()),
            DataType::F16 => run::<f16>(ctx, &opts, &plan),
            _ => run::<bf16>(ctx, &opts, &plan),
        },
    )
}

/// The report's steps: load the model, measure every scenario, check that fused and naive agree,
/// gather the run's metadata, write the files. Disagreement fails the run after the report is written.
fn run<T: Element>(ctx: &Cudnn, opts: &Options, plan: &Resolved) -> Result<(), Error> {
    let clocks_start = gpu_clocks();
    eprintln!(
        "speedup-report: {} x {} layers, {}, on {}",
        plan.config.name,
        plan.config.layers,
        dtype_name(plan),
        ctx.info().name
    );
    // Before any weight is read or made on the host: a model that cannot fit fails here.
    Llama::<T>::ensure_fits(ctx, &plan.config, plan.max_seq)?;
    // Checked by resolve: within the model's positions, and every activation size fits.
    let (cfg, max_seq) = (&plan.config, plan.max_seq);
    let mut model = match &plan.model_dir {
        Some(file) if cudnn_llm_llama::gguf::is_gguf_path(file) => {
            Llama::new(ctx, cfg, &cudnn_llm_llama::gguf::Gguf::open(file)?.weights::<T>(cfg)?, max_seq)?
        }
        Some(dir) => Llama::load(ctx, cfg, dir, max_seq)?,
        None => Llama::new(ctx, cfg, &Weights::<T>::random(cfg, 0), max_seq)?,
    };
    if let Some(scales) = plan.fp8 {
        model.quantize_to_fp8(ctx, scales)?;
    }
    let kernels = Kernels::probe();
    let measured = measure_all(ctx, &mut model, opts, plan, &kernels)?;
    let (agreement, disagree) = check(&measured.hidden, plan);
    let meta = metadata(ctx, opts, plan, &model, &kernels, &measured, agreement, clocks_start);
    let report = Report { meta, scenarios: measured.scenarios };
    write(&report, opts, "report")?;
    match disagree {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// What [`measure_all`] measured.
struct Measurements<T> {
    scenarios: Vec<Scenario>,
    /// Lines for the metadata: CUDA-graph replays that failed, the decode roofline.
    extra: Vec<(String, String)>,
    /// Device memory of the model (weights, KV cache) before any forward.
    base: u64,
    /// Per backend, the high-water mark of device memory.
    peak: BTreeMap<String, u64>,
    /// Prefill hidden states, naive then fused.
    hidden: Vec<Vec<T>>,
}

/// Measures each scenario (prefill, then decode steps) on all-naive and on the fused selection, keeps
/// both prefill outputs for [`check`], then times the fused prefill and decode step replayed as CUDA
/// graphs against plain launches.
fn measure_all<T: Element>(
    ctx: &Cudnn,
    model: &mut Llama<T>,
    opts: &Options,
    plan: &Resolved,
    kernels: &Kernels,
) -> Result<Measurements<T>, Error> {
    let cfg = &plan.config;
    let (prompt, works) = works(opts, cfg.vocab);
    let selections = [("naive", Backends::all(Backend::Naive)), ("fused", plan.fused.clone())];
    let total = plan.forwards;
    debug_assert_eq!(total, works.len() * selections.len() * (2 + opts.warmup + opts.repeat));
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} forwards").expect("a valid template"),
    );
    let mut cache = model.cache(ctx, opts.batch, plan.max_seq)?;
    ctx.synchronize()?;
    let base = ctx.pool_memory()?.0;
    let mut m = Measurements {
        scenarios: Vec::new(),
        extra: Vec::new(),
        base,
        peak: BTreeMap::new(),
        hidden: Vec::new(),
    };
    for work in &works {
        let measured =
            measure(ctx, model, &mut cache, work, &prompt, &selections, opts, kernels, &bar, &mut m.peak)?;
        for (_, backends) in selections.iter().filter(|_| work.start == 0) {
            cache.clear();
            let out = model.forward(ctx, &work.tokens[0], &mut cache, backends, &mut NoObserver)?;
            let rows = opts.batch * opts.seq * cfg.hidden;
            m.hidden.push(ctx.stream().clone_dtoh(&out.slice(..rows))?);
        }
        m.scenarios.push(scenario(
            work.name.clone(),
            &measured,
            &forward_ranges(),
            &fell_back(model.fallbacks()),
        ));
    }
    bar.finish_and_clear();
    // The whole prefill forward replayed as a CUDA graph (plans are built and tuned by now).
    match graph_replay(ctx, model, &mut cache, &prompt, &plan.fused, opts.repeat) {
        Ok((plain, replay)) => {
            let f = &mut m.scenarios[0].forward_ms;
            f.push(("fused, plain launches (wall, alternating with replays)".into(), plain));
            f.push(("fused, CUDA graph replay (wall)".into(), replay));
        }
        Err(e) => m.extra.push(("CUDA graph replay".into(), format!("failed: {e}"))),
    }
    // A fused decode step with its logits, launched plainly and replayed, against the memory floor.
    if opts.decode_steps >= 2 {
        let steps = opts.decode_steps - 1; // after the warm step that builds the plans
        match decode_graph(ctx, model, &mut cache, &prompt, &plan.fused, steps, opts.repeat) {
            Ok((plain, replay, kernels)) => {
                let f = &mut m.scenarios[1].forward_ms;
                f.push(("fused step + logits, plain launches (wall)".into(), plain));
                f.push(("fused step + logits, CUDA graph replay (wall)".into(), replay));
                // Step s (of 0..steps) runs after seq + 1 + s cached tokens: the mean is half-way.
                let cached = opts.seq + 1 + (steps - 1) / 2;
                let elem = std::mem::size_of::<T>();
                let roof = match plan.fp8 {
                    Some(_) => DecodeRoofline::fp8(cfg, opts.batch, cached, elem),
                    None => DecodeRoofline::new(cfg, opts.batch, cached, elem),
                };
                let line = match copy_bandwidth_gbps(ctx, 1 << 30, 10) {
                    Ok(copy) => {
                        let mut line = format!(
                            "{:.2} GB read per step, floor {:.3} ms at the {copy:.0} GB/s copy bandwidth: graph \
                             replay {:.1}%, plain launches {:.1}% of it",
                            roof.bytes() as f64 / 1e9,
                            roof.floor_ms(copy),
                            100.0 * roof.fraction(replay, copy),
                            100.0 * roof.fraction(plain, copy)
                        );
                        // Far from the floor, bytes do not bound the step: say what does.
                        let counted = kernels.clone().map(|(k, _)| k);
                        if let Some(why) = roofline::bound(roof.floor_ms(copy), replay, counted) {
                            line += &format!("; {why}");
                        }
                        line
                    }
                    Err(e) => format!("copy bandwidth not measured: {e}"),
                };
                m.extra.push(("decode roofline (step + logits)".into(), line));
            }
            Err(e) => m.extra.push(("decode CUDA graph".into(), format!("not measured: {e}"))),
        }
    }
    Ok(m)
}

/// The report's prompt (`--batch` sequences of `--seq` ids) and scenarios: its prefill, then
/// `--decode-steps` one-token steps after it (none for 0).
fn works(opts: &Options, vocab: usize) -> (Vec<Vec<u32>>, Vec<Work>) {
    let prompt: Vec<Vec<u32>> = (0..opts.batch)
        .map(|b: usize| {
            let id = |t: usize| b.wrapping_mul(7919).wrapping_add(t.wrapping_mul(104729)) % vocab;
            (0..opts.seq).map(|t| id(t) as u32).collect()
        })
        .collect();
    let mut works = vec![Work {
        name: format!("prefill {}x{}", opts.batch, opts.seq),
        tokens: vec![prompt.clone()],
        start: 0,
    }];
    if opts.decode_steps > 0 {
        let steps = (0..opts.decode_steps)
            .map(|s| vec![vec![(s.wrapping_mul(31) % vocab) as u32]; opts.batch])
            .collect();
        works.push(Work {
            name: format!("decode {} steps after {}", opts.decode_steps, opts.seq),
            tokens: steps,
            start: opts.seq,
        });
    }
    (prompt, works)
}

/// Compares the fused prefill hidden states with the naive ones: the metadata line, and the error to
/// fail the run with (after the report is written) when they disagree beyond [`agreement`].
fn check<T: Element>(hidden: &[Vec<T>], plan: &Resolved) -> (Option<(String, String)>, Option<String>) {
    let [naive, fused] = hidden else {
        return (None, None);
    };
    let naive: Vec<f64> = naive.iter().map(|v| v.to_f64()).collect();
    let c = reference::compare(fused, &naive);
    eprintln!("speedup-report: fused vs naive hidden states: {c}");
    let disagree = (!c.passes(agreement(plan)))
        .then(|| format!("fused and naive outputs disagree: {c} (the report is written anyway)"));
    (Some(("fused vs naive hidden states (prefill)".into(), c.to_string())), disagree)
}

/// The run's metadata: GPU, driver, cuDNN, build, model and selection, then the extra lines (the
/// agreement check, measurements' notes, memory, weights, clocks, kernel attribution, each fused
/// plan's engine, each fallback).
#[allow(clippy::too_many_arguments)]
fn metadata<T: Element>(
    ctx: &Cudnn,
    opts: &Options,
    plan: &Resolved,
    model: &Llama<T>,
    kernels: &Kernels,
    measured: &Measurements<T>,
    agreement: Option<(String, String)>,
    clocks_start: String,
) -> Meta {
    let cfg = &plan.config;
    let mut extra: Vec<(String, String)> = agreement.into_iter().collect();
    extra.extend(measured.extra.iter().cloned());
    let gib = |b: u64| format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64);
    let base = measured.base;
    extra.push(("device memory of the model (weights, KV cache) before any forward".into(), gib(base)));
    for (label, bytes) in &measured.peak {
        extra.push((
            format!("peak device memory, {label} runs (stream-ordered allocations)"),
            format!("{} (+{} over the model)", gib(*bytes), gib(bytes.saturating_sub(base))),
        ));
    }
    extra.push((
        "weights".into(),
        match &plan.model_dir {
            Some(dir) => format!("checkpoint {}", dir.display()),
            None => "random (seed 0)".into(),
        },
    ));
    extra.extend(run_lines(ctx, kernels, clocks_start));
    // Custom kernels that ran where a plan could have (the decode GEMV), e.g. `decode gemv [1, 4096] x
    // [4096, 6144] bf16 epilogue none (gemv_bf16_m1), 96 calls`.
    for (i, r) in ctx.kernel_runs().into_iter().enumerate() {
        extra.push((format!("kernel {}", i + 1), format!("{}, {} calls", r.name, r.calls)));
    }
    let shape = format!("{} layers, batch {}, seq {}", cfg.layers, opts.batch, opts.seq);
    meta(ctx, plan, &shape, dtype_name(plan), extra, model.fallbacks())
}

/// The report's dtype: the I/O dtype, or `fp8 (E4M3 projections, factors per channel, bf16 activations)`.
fn dtype_name(plan: &Resolved) -> String {
    match plan.fp8 {
        Some(WeightScales::PerTensor) => {
            format!("fp8 (E4M3 projections, factors per tensor, {} activations)", plan.dtype)
        }
        Some(_) => format!("fp8 (E4M3 projections, factors per channel, {} activations)", plan.dtype),
        None => plan.dtype.to_string(),
    }
}

/// Both reports' metadata: the GPU, driver, cuDNN, build, the model (`shape` after its name) and
/// selection, then `extra` and a line per fallback.
fn meta<'a>(
    ctx: &Cudnn,
    plan: &Resolved,
    shape: &str,
    dtype: String,
    mut extra: Vec<(String, String)>,
    fallbacks: impl IntoIterator<Item = &'a Fallback>,
) -> Meta {
    for f in fallbacks {
        extra.push((format!("fallback {} layer {:?} ({})", f.range, f.layer, f.shape), f.reason.clone()));
    }
    let (cfg, info) = (&plan.config, ctx.info());
    Meta {
        gpu: info.name.clone(),
        driver: gpu_query("driver_version"),
        cuda: info.driver_version.to_string(),
        cudnn: info.cudnn_version_string(),
        git_revision: BUILD.git_revision.into(),
        model: match &plan.model_dir {
            Some(dir) => format!("{} ({}) x {shape}", cfg.name, dir.display()),
            None => format!("{} x {shape}", cfg.name),
        },
        dtype,
        fused: plan.fused.to_selection(),
        extra,
    }
}

/// The lines both reports end their metadata with: the GPU clocks at start and now, how kernel times
/// were attributed, and which engine each fused plan ran ([`plan_lines`]).
fn run_lines(ctx: &Cudnn, kernels: &Kernels, clocks_start: String) -> Vec<(String, String)> {
    let attribution =
        if kernels.active() { "CUPTI activity records" } else { "unavailable: CUDA-event times only" };
    let mut lines = vec![
        ("GPU clocks at start".into(), clocks_start),
        ("GPU clocks at end".into(), gpu_clocks()),
        ("kernel attribution".into(), attribution.into()),
    ];
    for (i, p) in plan_lines(ctx).into_iter().enumerate() {
        lines.push((format!("plan {}", i + 1), p));
    }
    lines
}

/// Which engine each fused plan runs (and, for autotuned plans, the best and worst candidate), sorted.
fn plan_lines(ctx: &Cudnn) -> Vec<String> {
    let mut plans: Vec<String> = ctx
        .cache()
        .plans()
        .iter()
        .map(|p| {
            let t = p.timings();
            let tuned = match (
                t.iter().map(|x| x.1).filter(|v| v.is_finite()).reduce(f64::min),
                t.iter().map(|x| x.1).filter(|v| v.is_finite()).reduce(f64::max),
            ) {
                (Some(lo), Some(hi)) if t.len() > 1 => {
                    format!(", fastest of {} tuned ({lo:.4} ms; slowest {hi:.4} ms)", t.len())
                }
                _ => String::new(),
            };
            let ws = match p.workspace_size() {
                0 => String::new(),
                b => format!(", workspace {:.1} MiB", b as f64 / (1u64 << 20) as f64),
            };
            format!("{}: {} {}{tuned}{ws}", p.name(), p.form(), p.engine())
        })
        .collect();
    plans.sort();
    plans
}

/// Prints each scenario's table, forward times and phase totals, and writes
/// `{stem}.{md,csv,json,svg}` to `--out`.
fn write(report: &Report, opts: &Options, stem: &str) -> Result<(), Error> {
    for s in &report.scenarios {
        println!("\n{}\n{}", s.name, report.table(s, false));
        for (what, ms) in &s.forward_ms {
            println!("forward, {what}: {ms:.3} ms");
        }
        if !s.phases.is_empty() {
            println!("\n{}", cudnn_llm_app::report::train::phase_table(&s.phases));
        }
    }
    std::fs::create_dir_all(&opts.out)?;
    std::fs::write(opts.out.join(format!("{stem}.md")), report.to_markdown())?;
    std::fs::write(opts.out.join(format!("{stem}.csv")), report.to_csv()?)?;
    std::fs::write(opts.out.join(format!("{stem}.json")), report.to_json())?;
    std::fs::write(opts.out.join(format!("{stem}.svg")), chart::svg(report)?)?;
    println!("\nwrote {stem}.{{md,csv,json,svg}} to {}", opts.out.display());
    Ok(())
}

/// The ranges of a forward in forward order: the embedding, the attention half, the MLP half, the
/// once-per-forward modules, then kernels outside every range.
fn forward_ranges() -> Vec<&'static str> {
    std::iter::once(cudnn_llm_llama::model::EMBED_RANGE)
        .chain(Site::ALL.iter().map(|s| s.range))
        .chain([cudnn_llm_llama::profile::UNATTRIBUTED])
        .collect()
}

/// Each fallback's range and reason (what a scenario's rows note; the rank processes of `--tp` send
/// them to rank 0 so).
fn fell_back(fallbacks: &[Fallback]) -> Vec<(String, String)> {
    fallbacks.iter().map(|f| (f.range.to_string(), f.reason.clone())).collect()
}

/// The scenario `name`: a row per range of `names` that ran (naive `m[0]`, fused `m[1]`), per forward
/// (averaged over the measured forwards), noting the fused model's fallbacks (`fell_back`: range and
/// reason, [`fell_back`]).
fn scenario(name: String, m: &[Measured], names: &[&str], fell_back: &[(String, String)]) -> Scenario {
    let (naive, fused) = (&m[0], &m[1]);
    let mut rows = Vec::new();
    let empty = Sums::default();
    for &name in names {
        let (n, f) = (naive.sums.get(name), fused.sums.get(name));
        if n.is_none() && f.is_none() {
            continue;
        }
        let (n, f) = (n.unwrap_or(&empty), f.unwrap_or(&empty));
        let per = |s: &Sums, m: &Measured| {
            let k = m.forwards as f64;
            Side {
                kernels: (s.kernels / k).round() as usize,
                kernel_ms: if m.with_kernels { s.kernel_ms } else { s.event_ms } / k,
                event_ms: s.event_ms / k,
            }
        };
        let fell: Vec<&str> =
            fell_back.iter().filter(|(range, _)| range == name).map(|(_, reason)| reason.as_str()).collect();
        let note = if fell.is_empty() { String::new() } else { format!("fell back: {}", fell[0]) };
        rows.push(ModuleRow::new(
            name,
            (n.calls / naive.forwards as f64).round() as usize,
            per(n, naive),
            per(f, fused),
            &note,
        ));
    }
    let forward_ms = vec![
        ("naive, GPU".into(), naive.forward_gpu_ms),
        ("fused, GPU".into(), fused.forward_gpu_ms),
        ("naive, wall".into(), naive.forward_wall_ms),
        ("fused, wall".into(), fused.forward_wall_ms),
    ];
    let first_calls = names
        .iter()
        .filter_map(|name| {
            let (n, f) = (naive.cold.get(*name), fused.cold.get(*name));
            (n.is_some() || f.is_some()).then(|| {
                let ((nf, nw), (ff, fw)) = (n.copied().unwrap_or_default(), f.copied().unwrap_or_default());
                FirstCall {
                    range: name.to_string(),
                    naive_first_ms: nf,
                    naive_warm_ms: nw,
                    fused_first_ms: ff,
                    fused_warm_ms: fw,
                }
            })
        })
        .collect();
    Scenario { name, rows, forward_ms, first_calls, phases: Vec::new() }
}

fn gpu_query(field: &str) -> String {
    std::process::Command::new("nvidia-smi")
        .args([&format!("--query-gpu={field}"), "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
        .unwrap_or_else(|| "n/a".into())
}

fn gpu_clocks() -> String {
    gpu_query("clocks.sm,clocks.mem,temperature.gpu,power.draw")
}

/// How far apart the fused and naive prefill hidden states may be. Seeded random weights (this crate's
/// init): 3e-2, the bound of the GPU tests. A checkpoint: 1e-1, because bf16 error grows with depth
/// and with transformers' initialization: on an 8B-shaped, 32-layer random checkpoint written by
/// transformers, transformers' own bf16 forward is 5.3e-2 from its fp32 forward, naive and fused are
/// 1.01x and 0.87x that, and 6.7e-2 from each other (benches/results/h100/hf_parity-8b-32layers.md).
/// FP8 projections on seeded random weights: 8e-2, the bound of `app/tests/llama.rs`'s FP8 test.
fn agreement(plan: &Resolved) -> reference::Tolerance {
    // FP8: the fused prefill quantizes the activations per token (3 mantissa bits), the naive one
    // does not.
    let rel_l2 = match (plan.model_dir.is_some(), plan.fp8) {
        (true, _) => 1e-1,
        (false, Some(_)) => 8e-2,
        (false, None) => 3e-2,
    };
    reference::Tolerance::rel_l2(rel_l2)
}
