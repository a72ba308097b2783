//! `cargo bench --bench layernorm`: fused (cuDNN `NORM_FORWARD` in LAYER_NORM mode) against naive
//! (eager's one `layer_norm` kernel) LayerNorm, bf16, inference, at the widths of BERT-base / GPT-2
//! (768), BERT-large (1024), Phi-2 (2560) and 4096, over 30, 2048 and 16384 rows.
//!
//! Each case is checked against the f64 reference before it is timed. Criterion times each case with
//! CUDA events; a summary then measures them again (median of event-timed samples) with a 1 GiB
//! device copy as the bandwidth ceiling and the cold plan build, printed and written as CSV and
//! markdown to `$BENCH_RESULTS_DIR` (default: the workspace's `benches/results`). If `$TORCH_LN_CSV`
//! names the output of `app/benches/layernorm_torch.py` (PyTorch's `F.layer_norm` on the same GPU, run
//! just before in the same device call), the table gets its column. Without a GPU it says so and
//! exits 0.

use criterion::Criterion;
use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::ops::layernorm;
use cudnn_llm::cudnn_ops::{
    layer_norm, reference, Backend, Cudnn, DataType, Error, LayerNormArgs, LayerNormOperands, NormPhase,
    Result,
};
use cudnn_llm_app::bench_util::{
    bench_main, copy_bandwidth_gbps, csv_and_markdown, environment, gpu_time_ms, median_call_ms, round,
    upload, write_results,
};
use half::bf16;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

const HIDDEN: [usize; 4] = [768, 1024, 2560, 4096];
const TOKENS: [usize; 3] = [30, 2048, 16384];
const EPS: f32 = 1e-5;

struct Case {
    args: LayerNormArgs,
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    /// The inputs as rounded, for the reference.
    rounded: [Vec<f64>; 3],
}

impl Case {
    fn new(ctx: &Cudnn, tokens: usize, hidden: usize) -> Result<Self> {
        let seed = (tokens * 7 + hidden) as u64;
        let (x, xr) = upload(ctx, &reference::random_values(seed, tokens * hidden))?;
        let (w, wr) = upload(ctx, &reference::random_values(seed + 1, hidden))?;
        let (b, br) = upload(ctx, &reference::random_values(seed + 2, hidden))?;
        let y = ctx.stream().alloc_zeros(tokens * hidden)?;
        Ok(Case { args: LayerNormArgs::new(tokens, hidden, EPS), x, w, b, y, rounded: [xr, wr, br] })
    }

    fn run(&mut self, ctx: &Cudnn, backend: Backend) -> Result<()> {
        layer_norm(ctx, self.args, LayerNormOperands::new(&self.x, &self.w, &self.b, &mut self.y), backend)
    }

    /// Both backends against the f64 reference.
    fn check(&mut self, ctx: &Cudnn) -> Result<()> {
        let [xr, wr, br] = &self.rounded;
        let (want, _, _) = layernorm::reference(xr, wr, br, self.args);
        for backend in [Backend::Fused, Backend::Naive] {
            self.run(ctx, backend)?;
            let cmp = reference::compare(&ctx.stream().clone_dtoh(&self.y)?, &want);
            if !cmp.passes(reference::BF16_TOL) {
                return Err(Error::InvalidArgument(format!("{} layer_norm off: {cmp}", backend.name())));
            }
        }
        Ok(())
    }

    /// Bytes a perfect kernel moves: x read, weight and bias read, y written.
    fn bytes(&self) -> f64 {
        ((2 * self.args.tokens * self.args.hidden + 2 * self.args.hidden) * 2) as f64
    }
}

fn main() {
    bench_main("layernorm bench", run);
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let mut cases = Vec::new();
    let mut cold = Vec::new();
    for hidden in HIDDEN {
        for tokens in TOKENS {
            let mut c = Case::new(ctx, tokens, hidden)?;
            let t = Instant::now();
            c.run(ctx, Backend::Fused)?;
            ctx.synchronize()?;
            cold.push(t.elapsed().as_secs_f64() * 1e3);
            c.check(ctx)?;
            cases.push(c);
        }
    }
    let mut crit = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10)
        .configure_from_args();
    for c in cases.iter_mut() {
        for backend in [Backend::Fused, Backend::Naive] {
            let name = format!("layernorm/{}/bf16/{}x{}", backend.name(), c.args.tokens, c.args.hidden);
            crit.bench_function(&name, |bench| {
                bench.iter_custom(|iters| {
                    let ms = gpu_time_ms(ctx, iters as usize, || c.run(ctx, backend)).expect("timed run");
                    Duration::from_secs_f64(ms * 1e-3)
                })
            });
        }
    }
    crit.final_summary();

    let torch = torch_times();
    let copy_gbps = copy_bandwidth_gbps(ctx, 1 << 30, 20)?;
    let mut rows = Vec::new();
    for (c, cold_ms) in cases.iter_mut().zip(cold) {
        let batch = if c.args.tokens * c.args.hidden < 1 << 22 { 50 } else { 5 };
        let fused_ms = median_call_ms(ctx, 20, 30, batch, || c.run(ctx, Backend::Fused))?;
        let naive_ms = median_call_ms(ctx, 20, 30, batch, || c.run(ctx, Backend::Naive))?;
        let plan = c.args.plan(ctx, DataType::BF16, NormPhase::Inference)?;
        let fused_gbps = c.bytes() / (fused_ms * 1e-3) / 1e9;
        rows.push(Row {
            gpu: info.name.clone(),
            driver: info.driver_version,
            cudnn: info.cudnn_version_string(),
            tokens: c.args.tokens,
            hidden: c.args.hidden,
            fused_ms: round(fused_ms, 5),
            naive_ms: round(naive_ms, 5),
            torch_ms: torch.get(&(c.args.tokens, c.args.hidden)).map(|&t| round(t, 5)),
            speedup_vs_naive: round(naive_ms / fused_ms, 2),
            fused_gbps: round(fused_gbps, 1),
            fused_pct_of_copy: round(100.0 * fused_gbps / copy_gbps, 1),
            cold_plan_ms: round(cold_ms, 1),
            engine: plan.engine().to_string(),
        });
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## LayerNorm, bf16 inference: fused (cuDNN LAYER_NORM graph) vs naive (eager's one kernel)\n"
    );
    let _ = writeln!(
        md,
        "GPU {}, driver {}, cuDNN {}, build {}. Device copy (1 GiB, read + write): {copy_gbps:.0} GB/s. \
         Medians of CUDA-event samples after warm-up; GB/s counts x, weight and bias read and y written. \
         `torch ms`: PyTorch's `F.layer_norm` (`app/benches/layernorm_torch.py`, same call), where given.\n",
        info.name,
        info.driver_version,
        info.cudnn_version_string(),
        cudnn_llm_app::BUILD.git_revision
    );
    let _ = writeln!(md, "| tokens × hidden | fused ms | naive ms | torch ms | fused vs naive | fused GB/s | % of copy | cold plan ms | engine |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let torch = r.torch_ms.map_or("-".into(), |t| format!("{t:.4}"));
        let _ = writeln!(
            md,
            "| {} × {} | {:.4} | {:.4} | {torch} | {:.2}x | {:.0} | {:.0}% | {:.1} | {} |",
            r.tokens,
            r.hidden,
            r.fused_ms,
            r.naive_ms,
            r.speedup_vs_naive,
            r.fused_gbps,
            r.fused_pct_of_copy,
            r.cold_plan_ms,
            r.engine
        );
    }
    println!("\n{md}");
    let csv =
        csv_and_markdown(&rows).map(|(csv, _)| csv).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    write_results("layernorm", &csv, &md);
    Ok(())
}

/// One line of `layernorm.csv`.
#[derive(serde::Serialize)]
struct Row {
    gpu: String,
    driver: i32,
    cudnn: String,
    tokens: usize,
    hidden: usize,
    fused_ms: f64,
    naive_ms: f64,
    torch_ms: Option<f64>,
    speedup_vs_naive: f64,
    fused_gbps: f64,
    fused_pct_of_copy: f64,
    cold_plan_ms: f64,
    engine: String,
}

/// PyTorch's times by (tokens, hidden) from `$TORCH_LN_CSV` (`tokens,hidden,ms` lines), if given.
fn torch_times() -> HashMap<(usize, usize), f64> {
    let Ok(path) = std::env::var("TORCH_LN_CSV") else { return HashMap::new() };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        eprintln!("TORCH_LN_CSV {path}: {e}");
        String::new()
    });
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Some(((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?), f.get(2)?.parse().ok()?))
        })
        .collect()
}
