//! `cargo bench --bench rmsnorm`: fused (cuDNN) vs naive (8 eager kernels) RMSNorm, bf16, at the
//! Llama-3.2-1B (hidden 2048) and Llama-3.1-8B (hidden 4096) widths.
//!
//! Criterion times each case with CUDA events (`iter_custom`). After it, a summary measures the same
//! cases again (median of event-timed samples), a large device-to-device copy as the bandwidth
//! ceiling, the cold plan build, and the host cost of a cached fused call against cuDNN's own execute
//! on the same plan with a prebuilt variant pack. The summary is printed and written as CSV and
//! markdown to `$BENCH_RESULTS_DIR` (default `benches/results`). Without a GPU it says so and exits 0.

use criterion::Criterion;
use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::{
    reference, rms_norm, Backend, Bindings, Cudnn, DataType, NormPhase, Result, RmsNormArgs, RmsNormOperands,
};
use cudnn_llm_app::bench_util::{
    bench_main, copy_bandwidth_gbps, csv_and_markdown, environment, gpu_time_ms, median_call_ms,
    median_host_us, round, upload, write_results,
};
use half::bf16;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

const HIDDEN: [usize; 2] = [2048, 4096];
const TOKENS: [usize; 3] = [30, 2048, 16384];
const EPS: f32 = 1e-5;

struct Buffers {
    args: RmsNormArgs,
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
}

impl Buffers {
    fn new(ctx: &Cudnn, tokens: usize, hidden: usize) -> Result<Self> {
        let (x, _) = upload(ctx, &reference::random_values(tokens as u64, tokens * hidden))?;
        let (w, _) = upload(ctx, &reference::random_values(hidden as u64, hidden))?;
        let y = ctx.stream().alloc_zeros(tokens * hidden)?;
        Ok(Buffers { args: RmsNormArgs::new(tokens, hidden, EPS), x, w, y })
    }

    fn run(&mut self, ctx: &Cudnn, backend: Backend) -> Result<()> {
        rms_norm(ctx, self.args, RmsNormOperands::new(&self.x, &self.w, &mut self.y), backend)
    }

    /// Bytes a perfect kernel moves: x read, weight read, y written.
    fn bytes(&self) -> f64 {
        ((2 * self.args.tokens * self.args.hidden + self.args.hidden) * 2) as f64
    }
}

fn main() {
    bench_main("rmsnorm bench", run);
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));

    // Cold plan build for every shape (cleared cache), before anything else touches cuDNN's engines.
    let mut cases = Vec::new();
    let mut cold = Vec::new();
    for hidden in HIDDEN {
        for tokens in TOKENS {
            let mut b = Buffers::new(ctx, tokens, hidden)?;
            let t = Instant::now();
            b.run(ctx, Backend::Fused)?;
            ctx.synchronize()?;
            cold.push(t.elapsed());
            b.run(ctx, Backend::Naive)?;
            check(ctx, &b)?;
            cases.push(b);
        }
    }

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    for b in cases.iter_mut() {
        for backend in [Backend::Fused, Backend::Naive] {
            let name = format!("rmsnorm/{}/bf16/{}x{}", backend.name(), b.args.tokens, b.args.hidden);
            c.bench_function(&name, |bench| {
                bench.iter_custom(|iters| {
                    let ms = gpu_time_ms(ctx, iters as usize, || b.run(ctx, backend)).expect("timed run");
                    Duration::from_secs_f64(ms * 1e-3)
                })
            });
        }
    }
    c.final_summary();

    // Summary with our own medians.
    let copy_gbps = copy_bandwidth_gbps(ctx, 1 << 30, 20)?;
    let mut rows = Vec::new();
    for (b, cold) in cases.iter_mut().zip(&cold) {
        let batch = if b.args.tokens * b.args.hidden < 1 << 22 { 50 } else { 5 };
        let fused = median_call_ms(ctx, 20, 30, batch, || b.run(ctx, Backend::Fused))?;
        let naive = median_call_ms(ctx, 20, 30, batch, || b.run(ctx, Backend::Naive))?;
        let plan = b.args.plan(ctx, DataType::BF16, NormPhase::Inference)?;
        rows.push(Row {
            tokens: b.args.tokens,
            hidden: b.args.hidden,
            fused_ms: fused,
            naive_ms: naive,
            fused_gbps: b.bytes() / (fused * 1e-3) / 1e9,
            naive_gbps: b.bytes() / (naive * 1e-3) / 1e9,
            copy_gbps,
            cold_ms: cold.as_secs_f64() * 1e3,
            engine: plan.engine().to_string(),
        });
    }
    let host = host_overhead(ctx, &mut cases[0])?;
    let (csv, md) = render(&info, &rows, copy_gbps, &host);
    println!("\n{md}");
    write_results("rmsnorm", &csv, &md);
    Ok(())
}

/// Fused and naive agree with the reference before anything is timed.
fn check(ctx: &Cudnn, b: &Buffers) -> Result<()> {
    let (x, w): (Vec<bf16>, Vec<bf16>) = (ctx.stream().clone_dtoh(&b.x)?, ctx.stream().clone_dtoh(&b.w)?);
    let xr: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let wr: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
    let (y_ref, _) = reference::rms_norm(&xr, &wr, b.args.tokens, b.args.hidden, EPS as f64);
    // `y` holds the naive result now; the fused one was checked by the tests, compare both here.
    let naive_out = ctx.stream().clone_dtoh(&b.y)?;
    let cmp = reference::compare(&naive_out, &y_ref);
    if !cmp.passes(reference::BF16_TOL) {
        return Err(cudnn_llm::cudnn_ops::Error::InvalidArgument(format!("naive result off: {cmp}")));
    }
    let mut y = ctx.stream().alloc_zeros::<bf16>(b.y.len())?;
    rms_norm(ctx, b.args, RmsNormOperands::new(&b.x, &b.w, &mut y), Backend::Fused)?;
    let cmp = reference::compare(&ctx.stream().clone_dtoh(&y)?, &y_ref);
    if !cmp.passes(reference::BF16_TOL) {
        return Err(cudnn_llm::cudnn_ops::Error::InvalidArgument(format!("fused result off: {cmp}")));
    }
    Ok(())
}

struct Row {
    tokens: usize,
    hidden: usize,
    fused_ms: f64,
    naive_ms: f64,
    fused_gbps: f64,
    naive_gbps: f64,
    copy_gbps: f64,
    cold_ms: f64,
    engine: String,
}

/// One line of `rmsnorm.csv`.
#[derive(serde::Serialize)]
struct CsvRow<'a> {
    gpu: &'a str,
    driver: i32,
    cudnn: String,
    dtype: &'static str,
    tokens: usize,
    hidden: usize,
    fused_ms: f64,
    naive_ms: f64,
    speedup: f64,
    fused_gbps: f64,
    naive_gbps: f64,
    copy_gbps: f64,
    fused_pct_of_copy: f64,
    cold_plan_ms: f64,
    engine: &'a str,
}

struct HostCost {
    shape: String,
    ours_us: f64,
    cudnn_execute_us: f64,
    variant_pack_us: f64,
}

/// Host time per cached fused call vs `cudnnBackendExecute` alone on the same plan with a prebuilt
/// variant pack (the smallest shape, so the GPU keeps up and the launch queue never blocks).
fn host_overhead(ctx: &Cudnn, b: &mut Buffers) -> Result<HostCost> {
    let plan = b.args.plan(ctx, DataType::BF16, NormPhase::Inference)?;
    let ours = median_host_us(ctx, 30, 200, || b.run(ctx, Backend::Fused))?;
    let mut bind = Bindings::new(ctx.stream());
    let uid = |name: &str| plan.uid(name);
    bind.input(uid("X")?, &b.x).input(uid("scale")?, &b.w).scalar_f32(uid("epsilon")?, EPS);
    bind.output(uid("Y")?, &mut b.y);
    let prepared = plan.prepare(ctx, &bind)?;
    let raw = median_host_us(ctx, 30, 200, || prepared.execute())?;
    drop(prepared);
    let pack = median_host_us(ctx, 30, 200, || plan.prepare(ctx, &bind).map(drop))?;
    Ok(HostCost {
        shape: format!("{}x{}", b.args.tokens, b.args.hidden),
        ours_us: ours,
        cudnn_execute_us: raw,
        variant_pack_us: pack,
    })
}

fn render(
    info: &cudnn_llm::cudnn_ops::DeviceInfo,
    rows: &[Row],
    copy_gbps: f64,
    host: &HostCost,
) -> (String, String) {
    let mut csv_rows = Vec::with_capacity(rows.len());
    let mut md = String::new();
    let _ = writeln!(md, "## RMSNorm, bf16: fused (cuDNN) vs naive (8 eager kernels)\n");
    let _ = writeln!(
        md,
        "GPU {}, driver {}, cuDNN {} ({}), build {} ({}), bindings from cuDNN {} headers.\n",
        info.name,
        info.driver_version,
        info.cudnn_version_string(),
        info.cudnn_library,
        cudnn_llm_app::BUILD.git_revision,
        cudnn_llm_app::BUILD.rustc,
        cudnn_llm_app::BUILD.cudnn_headers
    );
    let _ = writeln!(md, "Device-to-device copy (1 GiB, read + write): **{copy_gbps:.0} GB/s**. Times are medians of CUDA-event samples after warm-up; GB/s counts x read, weight read, y written.\n");
    let _ = writeln!(md, "| tokens × hidden | fused ms | naive ms | speedup | fused GB/s | % of copy | naive GB/s | cold plan build ms | engine |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in rows {
        let pct = 100.0 * r.fused_gbps / r.copy_gbps;
        let speedup = r.naive_ms / r.fused_ms;
        csv_rows.push(CsvRow {
            gpu: &info.name,
            driver: info.driver_version,
            cudnn: info.cudnn_version_string(),
            dtype: "bf16",
            tokens: r.tokens,
            hidden: r.hidden,
            fused_ms: round(r.fused_ms, 5),
            naive_ms: round(r.naive_ms, 5),
            speedup: round(speedup, 2),
            fused_gbps: round(r.fused_gbps, 1),
            naive_gbps: round(r.naive_gbps, 1),
            copy_gbps: round(r.copy_gbps, 1),
            fused_pct_of_copy: round(pct, 1),
            cold_plan_ms: round(r.cold_ms, 1),
            engine: &r.engine,
        });
        let _ = writeln!(
            md,
            "| {} × {} | {:.4} | {:.4} | {:.1}× | {:.0} | {:.0}% | {:.0} | {:.1} | {} |",
            r.tokens,
            r.hidden,
            r.fused_ms,
            r.naive_ms,
            speedup,
            r.fused_gbps,
            pct,
            r.naive_gbps,
            r.cold_ms,
            r.engine
        );
    }
    let _ = writeln!(md, "\nHost time of a cached fused call ({}): **{:.2} µs** per call; cuDNN's own `cudnnBackendExecute` on the same plan with a prebuilt variant pack: {:.2} µs; so ours is **{:.2} µs** (of which building the variant pack, cuDNN calls too, is {:.2} µs).",
        host.shape, host.ours_us, host.cudnn_execute_us, host.ours_us - host.cudnn_execute_us, host.variant_pack_us);
    // The CSV through the writer the other benches use (its markdown table is not this one's).
    let csv = csv_and_markdown(&csv_rows).map(|(csv, _)| csv).unwrap_or_else(|e| {
        eprintln!("cannot render rmsnorm.csv: {e}");
        String::new()
    });
    (csv, md)
}
