//! `cargo bench --bench train_step`: one training step of Llama-3.2-1B (16 layers,
//! hidden 2048, 32/8 heads of 64, MLP 8192, a 128256-token vocabulary tied to `lm_head`), random
//! weights (the embedding at transformers' std 0.02), bf16 weights and activations, f32 gradients
//! and AdamW moments: forward, next-token loss, backward, global gradient norm and AdamW
//! ([`Trainer::step`]), all fused or all naive (every module, the embedding's backward, the norm and
//! AdamW), at the batch × sequence settings (1x16384, 2x8192, 3x4096, 6x2048, 12x1024,
//! 24x768; 12288 to 18432 tokens per step).
//!
//! Each setting and backend runs in a fresh context and trainer: the first (cold) step, which builds
//! and tunes the fused plans and compiles the naive kernels, then `TRAIN_BENCH_WARM` warm steps
//! (default 3). A row holds the cold step's wall seconds, the warm steps' median wall seconds (launch
//! to the loss read back) and GPU seconds (CUDA events from the first forward to the end of AdamW),
//! the forward (loss included), backward and optimizer GPU seconds (`StepStats`), tokens/s, and the
//! peak of stream-ordered device memory (weights, gradients, moments, activations, scratch). A
//! setting that runs out of device memory is run again with activation checkpointing, and the row
//! says so (`checkpoint`); one that still does not fit is a row with the error in `note`.
//!
//! The summary is written as `train_step.csv` / `train_step.md` to `$BENCH_RESULTS_DIR` (default
//! `benches/results`). If `$TORCH_TRAIN_CSV` names the output of `app/benches/train_torch.py` (run on the
//! same GPU just before), PyTorch's iteration times join the rows by setting (`torch_*_s`,
//! `speedup_vs_torch` against the fastest of them) and a second table compares the fused step with
//! each PyTorch run.
//!
//! Environment: `TRAIN_BENCH_SETTINGS` (default `2x8192,12x1024`; `all` for the six, or a list such
//! as `1x16384,24x768`), `TRAIN_BENCH_BACKENDS` (default `fused,naive`), `TRAIN_BENCH_WARM` (warm
//! steps, default 3), `TRAIN_BENCH_LAYERS` (fewer layers, for a quick look), `TRAIN_BENCH_CHECKPOINT`
//! (`auto`, the default: only after running out of memory; `on`; `off`), `TRAIN_BENCH_CRITERION=1`
//! (criterion also samples each warm step; off by default: a step takes a good part of a second).
//! Without a GPU it says so and exits 0.

use criterion::Criterion;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backend, Backends, Batch, LlamaConfig, StepStats, TrainConfig, Trainer};
use cudnn_llm::Cudnn;
use cudnn_llm_app::bench_util::{bench_main, csv_and_markdown, environment, median, round, write_results};
use cudnn_llm_app::report::train::{
    is_out_of_memory, join, read_torch_csv, torch_table, Setting, StepRow, TorchStepRow,
};
use half::bf16;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// AdamW's learning rate (the times do not depend on it).
const LR: f64 = 1e-4;
/// The standard deviation of the embedding (transformers' `initializer_range`), so that the tied
/// logits do not saturate.
const EMBED_STD: f64 = 0.02;
/// The default settings: one long-sequence and one short-sequence step (`all` runs the six).
const DEFAULT_SETTINGS: &str = "2x8192,12x1024";

/// When to turn activation checkpointing on.
#[derive(Clone, Copy, PartialEq)]
enum Checkpoint {
    /// After a step ran out of device memory without it.
    Auto,
    On,
    Off,
}

/// The bench's environment variables, read and checked.
struct Env {
    settings: Vec<Setting>,
    backends: Vec<Backend>,
    warm: usize,
    layers: Option<usize>,
    checkpoint: Checkpoint,
    criterion: bool,
}

impl Env {
    fn read() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let settings = Setting::parse_list(&var("TRAIN_BENCH_SETTINGS").unwrap_or(DEFAULT_SETTINGS.into()))
            .map_err(|e| format!("TRAIN_BENCH_SETTINGS: {e}"))?;
        let backends = var("TRAIN_BENCH_BACKENDS")
            .unwrap_or("fused,naive".into())
            .split(',')
            .map(|b| match b.trim() {
                "fused" => Ok(Backend::Fused),
                "naive" => Ok(Backend::Naive),
                other => Err(format!("TRAIN_BENCH_BACKENDS: `{other}` is not fused or naive")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let count = |name: &str, default: usize| match var(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(format!("{name}: `{v}` is not a count >= 1")),
        };
        let warm = count("TRAIN_BENCH_WARM", 3)?;
        let layers = var("TRAIN_BENCH_LAYERS").map(|_| count("TRAIN_BENCH_LAYERS", 16)).transpose()?;
        let checkpoint = match var("TRAIN_BENCH_CHECKPOINT").as_deref().map(str::trim) {
            None | Some("auto") => Checkpoint::Auto,
            Some("on") => Checkpoint::On,
            Some("off") => Checkpoint::Off,
            Some(other) => return Err(format!("TRAIN_BENCH_CHECKPOINT: `{other}` is not auto, on or off")),
        };
        let criterion = var("TRAIN_BENCH_CRITERION").is_some_and(|v| v.trim() == "1");
        Ok(Env { settings, backends, warm, layers, checkpoint, criterion })
    }
}

/// What one run of a setting on a backend measured.
struct Measured {
    cold_s: f64,
    /// Warm steps: wall seconds and statistics.
    walls: Vec<f64>,
    stats: Vec<StepStats>,
    loss: f64,
    peak_bytes: u64,
    fallbacks: Vec<String>,
}

/// The step's sequences: ids spread over the vocabulary (a fixed pattern).
fn batch(s: Setting, vocab: usize) -> Batch {
    Batch::new(
        (0..s.batch)
            .map(|b| (0..s.seq).map(|t| ((b * 7919 + t * 104729 + 1) % vocab) as u32).collect())
            .collect(),
    )
}

/// One step from an idle stream: wall seconds (the step reads its loss back) and its statistics.
fn timed_step(ctx: &Cudnn, t: &mut Trainer<bf16>, b: &Batch) -> Result<(f64, StepStats), Error> {
    ctx.synchronize()?;
    let start = Instant::now();
    let stats = t.step(ctx, b)?;
    Ok((start.elapsed().as_secs_f64(), stats))
}

/// Runs `setting` on `backend` in a fresh context: a cold step, then the warm ones (and criterion's,
/// if asked).
fn measure(
    cfg: &LlamaConfig,
    weights: &Weights<bf16>,
    (setting, backend, checkpoint): (Setting, Backend, bool),
    env: &Env,
    criterion: &mut Criterion,
) -> Result<Measured, Error> {
    let ctx = Cudnn::new(0)?;
    ctx.reset_peak_memory()?;
    let tcfg = TrainConfig::new(LR)
        .with_backends(Backends::all(backend))
        .with_standalone(backend)
        .with_checkpointing(checkpoint);
    let mut t = Trainer::new(&ctx, cfg, weights, tcfg)?;
    let b = batch(setting, cfg.vocab);
    let (cold_s, first) = timed_step(&ctx, &mut t, &b)?;
    let (mut walls, mut stats) = (Vec::new(), Vec::new());
    for _ in 0..env.warm {
        let (w, s) = timed_step(&ctx, &mut t, &b)?;
        walls.push(w);
        stats.push(s);
    }
    if env.criterion {
        let name = format!("train_step/{}/{}/{}", cfg.name, setting.name(), backend.name());
        criterion.bench_function(&name, |bench| {
            bench.iter_custom(|iters| {
                let ms: f64 = (0..iters).map(|_| t.step(&ctx, &b).expect("a warm step").step_ms).sum();
                Duration::from_secs_f64(ms * 1e-3)
            })
        });
    }
    ctx.synchronize()?;
    let peak_bytes = ctx.pool_memory()?.1;
    let fallbacks = t
        .fallbacks()
        .iter()
        .map(|f| format!("{} layer {:?} ran naive: {}", f.range, f.layer, f.reason))
        .collect();
    Ok(Measured { cold_s, walls, stats, loss: first.loss, peak_bytes, fallbacks })
}

/// The row of a run (`m`), or of a setting that did not run (`m` is `None`, `note` says why).
fn row(setting: Setting, backend: Backend, checkpoint: &str, m: Option<&Measured>, note: String) -> StepRow {
    let med = |f: fn(&StepStats) -> f64| m.map(|m| round(median(m.stats.iter().map(f).collect()) * 1e-3, 5));
    let iter_s = m.map(|m| median(m.walls.clone()));
    let mut note = note;
    if let Some(f) = m.and_then(|m| m.fallbacks.first()) {
        let more = m.map_or(0, |m| m.fallbacks.len() - 1);
        note =
            format!("fallback: {f}{}", if more > 0 { format!(" (and {more} more)") } else { String::new() });
    }
    StepRow {
        setting: setting.name(),
        batch: setting.batch,
        seq: setting.seq,
        tokens: setting.tokens(),
        backend: backend.name().into(),
        checkpoint: checkpoint.into(),
        cold_s: m.map(|m| round(m.cold_s, 3)),
        iter_s: iter_s.map(|s| round(s, 5)),
        gpu_s: med(|s| s.step_ms),
        forward_s: med(|s| s.forward_ms),
        backward_s: med(|s| s.backward_ms),
        optimizer_s: med(|s| s.optimizer_ms),
        tokens_per_s: iter_s.map(|s| round(setting.tokens() as f64 / s, 0)),
        peak_gib: m.map(|m| round(m.peak_bytes as f64 / (1u64 << 30) as f64, 2)),
        loss: m.map(|m| round(m.loss, 4)),
        speedup_vs_naive: None,
        torch_cudnn_s: None,
        torch_flash_s: None,
        torch_efficient_s: None,
        torch_compile_s: None,
        speedup_vs_torch: None,
        note,
    }
}

/// One setting on one backend, with activation checkpointing as `env` says: a row either way.
fn case(
    cfg: &LlamaConfig,
    weights: &Weights<bf16>,
    setting: Setting,
    backend: Backend,
    env: &Env,
    criterion: &mut Criterion,
) -> StepRow {
    let first = env.checkpoint == Checkpoint::On;
    let tag = format!("{} {}", setting.name(), backend.name());
    let said = |r: StepRow| {
        match r.iter_s {
            Some(s) => println!(
                "{tag}: cold {:.2} s, warm {s:.4} s/step (fwd {:.4}, bwd {:.4}, opt {:.4} GPU s), {:.0} tokens/s, \
                 peak {:.2} GiB, checkpoint {}",
                r.cold_s.unwrap_or(f64::NAN),
                r.forward_s.unwrap_or(f64::NAN),
                r.backward_s.unwrap_or(f64::NAN),
                r.optimizer_s.unwrap_or(f64::NAN),
                r.tokens_per_s.unwrap_or(f64::NAN),
                r.peak_gib.unwrap_or(f64::NAN),
                r.checkpoint
            ),
            None => println!("{tag}: did not run: {}", r.note),
        }
        r
    };
    let asked = if first { "yes (asked)" } else { "no" };
    match measure(cfg, weights, (setting, backend, first), env, criterion) {
        Ok(m) => said(row(setting, backend, asked, Some(&m), String::new())),
        Err(e) if env.checkpoint == Checkpoint::Auto && is_out_of_memory(&e.to_string()) => {
            println!("{tag}: out of memory without activation checkpointing ({e}); again with it");
            let again = "yes (out of memory without)";
            match measure(cfg, weights, (setting, backend, true), env, criterion) {
                Ok(m) => said(row(setting, backend, again, Some(&m), String::new())),
                Err(e) => {
                    said(row(setting, backend, again, None, format!("failed with checkpointing too: {e}")))
                }
            }
        }
        Err(e) => said(row(setting, backend, asked, None, e.to_string())),
    }
}

fn torch_rows() -> Vec<TorchStepRow> {
    let Ok(path) = std::env::var("TORCH_TRAIN_CSV") else { return Vec::new() };
    match std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|t| read_torch_csv(&t).map_err(|e| e.to_string()))
    {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("cannot read $TORCH_TRAIN_CSV {path}: {e}");
            Vec::new()
        }
    }
}

fn main() {
    bench_main("train_step bench", run);
}

fn run(info_ctx: &Cudnn) -> Result<(), Error> {
    let info = info_ctx.info().clone();
    let env = Env::read()?;
    let mut cfg = LlamaConfig::llama_3_2_1b();
    if let Some(n) = env.layers {
        if n > cfg.layers {
            return Err(format!("TRAIN_BENCH_LAYERS {n}: {} has {} layers", cfg.name, cfg.layers).into());
        }
        cfg = cfg.with_layers(n);
    }
    println!("# {}", environment(&info));
    println!(
        "# {} x {} layers ({:.3} B parameters), settings {}, backends {}, {} warm steps",
        cfg.name,
        cfg.layers,
        cfg.parameters() as f64 / 1e9,
        env.settings.iter().map(Setting::name).collect::<Vec<_>>().join(","),
        env.backends.iter().map(|b| b.name()).collect::<Vec<_>>().join(","),
        env.warm
    );
    let mut weights = Weights::<bf16>::random(&cfg, 0);
    let scale = EMBED_STD * 3f64.sqrt();
    weights.embed.data.iter_mut().for_each(|v| *v = bf16::from_f64(v.to_f64() * scale));
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    let total_gib = info_ctx.memory_info()?.1 as f64 / (1u64 << 30) as f64;
    let mut rows = Vec::new();
    for &setting in &env.settings {
        for &backend in &env.backends {
            rows.push(case(&cfg, &weights, setting, backend, &env, &mut criterion));
        }
    }
    if env.criterion {
        criterion.final_summary();
    }
    let torch = torch_rows();
    join(&mut rows, &torch);
    let (csv, table) = csv_and_markdown(&rows).map_err(|e| format!("cannot render train_step.csv: {e}"))?;
    let torch_version = torch.iter().map(|t| t.torch.clone()).find(|v| !v.is_empty());
    let mut md = format!(
        "## Training step: {} ({} layers, {:.3} B parameters, tied embedding), bf16, fused vs naive{}\n\n{}\n\n\
         Random weights (embedding std {EMBED_STD}); AdamW lr {LR:e}, betas (0.9, 0.95), eps 1e-8, no weight decay, \
         no clipping; bf16 weights, f32 gradients and AdamW moments, no master weights. Each setting and backend \
         runs in a fresh context: `cold_s` is the first step's wall time (plans built and tuned, kernels \
         compiled), `iter_s` the median wall time of {} warm steps (launch to the loss read back), `gpu_s` their \
         CUDA-event time from the first forward to the end of AdamW, `forward_s` (the loss and its gradient \
         included), `backward_s`, `optimizer_s` (gradient norm and AdamW) the phases' event times. `peak_gib`: \
         the high-water mark of stream-ordered device memory (weights, gradients, moments, activations, scratch; \
         not cuDNN's or cuBLAS's own allocations) of {total_gib:.1} GiB. `checkpoint`: activation checkpointing \
         (only where a step ran out of memory without it, unless asked). `speedup_vs_naive`: naive `iter_s` over \
         the row's; `torch_*_s`: PyTorch's warm iteration (`app/benches/train_torch.py`); `speedup_vs_torch`: the \
         fastest of them over the row's (>1: ours faster).\n\n{table}",
        cfg.name,
        cfg.layers,
        cfg.parameters() as f64 / 1e9,
        match &torch_version {
            Some(_) => " vs PyTorch",
            None => "",
        },
        environment(&info),
        env.warm,
    );
    md += &match torch_version {
        Some(v) => format!(
            "\n\n### Against PyTorch ({v}, same GPU)\n\nWarm seconds per iteration: transformers' \
             `LlamaForCausalLM` of the same shapes in bf16 with `AdamW(fused=True)`, SDPA restricted to one \
             backend each, and under `torch.compile`.\n\n{}",
            torch_table(&rows, &torch)
        ),
        None => {
            "\n\nPyTorch: not given (run `app/benches/train_torch.py` first and set `$TORCH_TRAIN_CSV`).\n"
                .into()
        }
    };
    println!("\n{md}");
    write_results("train_step", &csv, &md);
    Ok(())
}
