//! `cargo bench --bench llama_layer`: Llama-3.1-8B shapes, bf16, batch 1, random weights.
//!
//! Criterion times the one-layer prefill all-naive and all-fused; a summary then measures:
//! - One decoder layer, prefill of 2048 tokens and one decode step at s_kv 4096: all-naive, all-fused,
//!   and each module kind fused alone (the rest naive).
//! - The whole forward of a 4-layer model at 2048 tokens, all-naive vs all-fused, GPU time (CUDA events)
//!   and wall time (host clock around forward + synchronize).
//!
//! Writes `llama_layer.csv` / `llama_layer.md` to `$BENCH_RESULTS_DIR`. If `$TORCH_LLAMA_CSV` names the
//! output of `app/benches/llama_torch.py` (the same model in PyTorch eager, run on the same GPU just
//! before), its times join the 4-layer rows. `LLAMA_BENCH_LAYERS` overrides the 4.

use cudnn_llm::cudnn_ops::{Backend, Cudnn, Error, Result};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, KvCache, Llama, LlamaConfig, ModuleKind, NoObserver};
use cudnn_llm_app::bench_util::{
    bench_main, csv_and_markdown, environment, gpu_and_wall_ms, median, median_call_ms, round, wall_ms,
    write_results,
};
use half::bf16;
use serde::{Deserialize, Serialize};

const PREFILL: usize = 2048;
const DECODE_KV: usize = 4096;

#[derive(Serialize)]
struct Row {
    scenario: String,
    layers: usize,
    backends: String,
    gpu_ms: f64,
    wall_ms: f64,
    speedup_vs_naive: f64,
    torch_eager_wall_ms: Option<f64>,
    speedup_vs_torch_wall: Option<f64>,
}

impl Row {
    /// A row from GPU and wall ms, the all-naive GPU ms of its group and PyTorch's wall ms if run.
    fn new(
        scenario: &str,
        layers: usize,
        backends: &str,
        (gpu, wall): (f64, f64),
        naive_ms: f64,
        torch: Option<f64>,
    ) -> Self {
        Row {
            scenario: scenario.into(),
            layers,
            backends: backends.into(),
            gpu_ms: round(gpu, 4),
            wall_ms: round(wall, 4),
            speedup_vs_naive: round(naive_ms / gpu, 2),
            torch_eager_wall_ms: torch,
            speedup_vs_torch_wall: torch.map(|t| round(t / wall, 2)),
        }
    }
}

#[derive(Deserialize)]
struct TorchRow {
    scenario: String,
    layers: usize,
    wall_ms: f64,
}

fn ops(e: cudnn_llm::llama::Error) -> Error {
    match e {
        cudnn_llm::llama::Error::Ops(e) => e,
        other => Error::InvalidArgument(other.to_string()),
    }
}

/// Median GPU ms (CUDA events) and wall ms (host clock, synchronized) of `step`.
fn time(ctx: &Cudnn, mut step: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let gpu = median_call_ms(ctx, 3, 11, 1, &mut step)?;
    let wall = (0..11).map(|_| wall_ms(ctx, &mut step)).collect::<Result<Vec<f64>>>()?;
    Ok((gpu, median(wall)))
}

/// Samples per backend of the many-layer forward.
const MANY_SAMPLES: usize = 21;

struct Bench {
    model: Llama<bf16>,
    prefill: Vec<Vec<u32>>,
    cache: KvCache<bf16>,
}

impl Bench {
    fn new(ctx: &Cudnn, layers: usize) -> Result<Self> {
        let cfg = LlamaConfig::llama_3_1_8b().with_layers(layers);
        let w = Weights::<bf16>::random(&cfg, 1);
        let model = Llama::new(ctx, &cfg, &w, DECODE_KV).map_err(ops)?;
        let cache = model.cache(ctx, 1, DECODE_KV).map_err(ops)?;
        let prefill = vec![(0..PREFILL as u32).map(|t| (t * 7919) % cfg.vocab as u32).collect()];
        Ok(Bench { model, prefill, cache })
    }

    fn prefill(&mut self, ctx: &Cudnn, b: &Backends) -> Result<()> {
        self.cache.clear();
        self.model.forward(ctx, &self.prefill, &mut self.cache, b, &mut NoObserver).map(drop).map_err(ops)
    }

    /// One token against a cache holding `DECODE_KV - 1` (contents are whatever was written).
    fn decode(&mut self, ctx: &Cudnn, b: &Backends) -> Result<()> {
        if self.cache.lens()[0] < DECODE_KV - 1 {
            self.cache.clear();
            let filler = vec![vec![1u32; DECODE_KV - 1]];
            self.model.forward(ctx, &filler, &mut self.cache, b, &mut NoObserver).map_err(ops)?;
        }
        self.cache.truncate_to(DECODE_KV - 1);
        self.model.forward(ctx, &[vec![42]], &mut self.cache, b, &mut NoObserver).map(drop).map_err(ops)
    }
}

fn main() {
    bench_main("llama_layer bench", run);
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let mut selections = vec![("all naive".to_string(), Backends::all(Backend::Naive))];
    selections.push(("all fused".into(), Backends::all(Backend::Fused)));
    // Each per-layer module kind fused alone.
    for kind in ModuleKind::ALL.into_iter().filter(|k| k.per_layer()) {
        selections.push((
            format!("only {} fused", kind.name()),
            Backends::all(Backend::Naive).with(kind, Backend::Fused),
        ));
    }
    let mut rows = Vec::new();
    let mut one = Bench::new(ctx, 1)?;
    // Criterion on the two ends (one layer, prefill); the summary below measures every selection.
    let mut crit = criterion::Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2))
        .sample_size(10)
        .configure_from_args();
    for (name, b) in &selections[..2] {
        crit.bench_function(
            &format!("llama_layer/8b/prefill{PREFILL}/{}", name.replace(' ', "_")),
            |bench| {
                bench.iter_custom(|iters| {
                    let ms =
                        cudnn_llm_app::bench_util::gpu_time_ms(ctx, iters as usize, || one.prefill(ctx, b))
                            .expect("timed run");
                    std::time::Duration::from_secs_f64(ms * 1e-3)
                })
            },
        );
    }
    crit.final_summary();
    for scenario in ["prefill 2048", "decode 1 @ 4096"] {
        let mut naive_ms = 0.0;
        for (name, b) in &selections {
            let (gpu, wall) = if scenario.starts_with("prefill") {
                time(ctx, || one.prefill(ctx, b))?
            } else {
                time(ctx, || one.decode(ctx, b))?
            };
            if name == "all naive" {
                naive_ms = gpu;
            }
            println!("{scenario} {name}: {gpu:.3} ms GPU, {wall:.3} ms wall");
            rows.push(Row::new(scenario, 1, name, (gpu, wall), naive_ms, None));
        }
    }
    println!("fallbacks: {:?}", one.model.fallbacks());
    drop(one);

    let layers = std::env::var("LLAMA_BENCH_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let torch: Vec<TorchRow> = std::env::var("TORCH_LLAMA_CSV")
        .ok()
        .and_then(|p| csv::Reader::from_path(p).ok())
        .map(|mut r| r.deserialize().filter_map(|x| x.ok()).collect())
        .unwrap_or_default();
    let torch_wall =
        torch.iter().find(|t| t.scenario == "prefill 2048" && t.layers == layers).map(|t| t.wall_ms);
    let mut many = Bench::new(ctx, layers)?;
    // All-naive and all-fused samples alternate, so that clock drift over the run affects both alike.
    let ends = &selections[..2];
    for _ in 0..3 {
        for (_, b) in ends {
            many.prefill(ctx, b)?;
        }
    }
    let mut samples = vec![(Vec::new(), Vec::new()); ends.len()];
    for _ in 0..MANY_SAMPLES {
        for ((_, b), (gpu, wall)) in ends.iter().zip(&mut samples) {
            let (g, w) = gpu_and_wall_ms(ctx, || many.prefill(ctx, b))?;
            gpu.push(g);
            wall.push(w);
        }
    }
    let medians: Vec<(f64, f64)> = samples.into_iter().map(|(g, w)| (median(g), median(w))).collect();
    for ((name, _), m) in ends.iter().zip(&medians) {
        rows.push(Row::new("prefill 2048", layers, name, *m, medians[0].0, torch_wall));
    }
    println!("fallbacks: {:?}", many.model.fallbacks());
    let (csv, table) = csv_and_markdown(&rows).map_err(|e| Error::InvalidArgument(format!("csv: {e}")))?;
    let md = format!(
        "## Llama-3.1-8B shapes, bf16, batch 1: per-module backend swaps\n\n{}\n\nGPU ms: median of CUDA-event \
         samples; wall ms: median host time of forward + synchronize. `only X fused`: that module kind fused, \
         every other naive. {}\n\n{table}",
        environment(&info),
        if torch_wall.is_some() {
            "PyTorch eager: `app/benches/llama_torch.py`, same GPU, same device call."
        } else {
            "PyTorch eager not run this time."
        }
    );
    println!("\n{md}");
    write_results("llama_layer", &csv, &md);
    Ok(())
}
