//! `cargo bench --bench fp8`: Llama-3.1-8B's Linear layers in FP8 against bf16 on one GPU.
//!
//! - Decode (one token): the bf16 matmul's decode GEMV (`matmul`, fused) against the same matmul over
//!   an E4M3 weight with per-channel factors (fused: the decode GEMV streaming the codes, naive:
//!   dequantize + cuBLAS),
//!   as GB/s of weight read and the fraction of the device copy bandwidth.
//! - Prefill (2048 tokens): the bf16 matmul graph against `quantize_fp8` (per token) followed by
//!   `scaled_matmul` (per token, per channel), both fused, as TFLOP/s.
//!
//! Each case is checked against the f64 reference before it is timed (prefill: its first rows).
//! Criterion times each case with CUDA events; a summary measures them again (median of event-timed
//! samples) and writes `fp8.{csv,md}` to `$BENCH_RESULTS_DIR` (default: the workspace's
//! `benches/results`). Without a GPU it says so and exits 0.

use criterion::Criterion;
use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::ops::scaled_matmul::reference as scaled_reference;
use cudnn_llm::cudnn_ops::{
    fp8_weight_reference, matmul, quantize_fp8, reference, scaled_matmul, Backend, Cudnn, Error, MatmulArgs,
    MatmulOperands, QuantizeArgs, QuantizeOperands, Result, ScaledMatmulArgs, ScaledMatmulOperands, F8E4M3,
};
use cudnn_llm_app::bench_util::{
    bench_main, copy_bandwidth_gbps, csv_and_markdown, environment, gpu_time_ms, median_call_ms, round,
    write_results,
};
use half::bf16;
use std::fmt::Write as _;
use std::time::Duration;

/// Llama-3.1-8B's projections: name, output features, input features.
const LINEARS: [(&str, usize, usize); 4] =
    [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)];
/// Rows of a prefill.
const PREFILL: usize = 2048;
/// Prefill rows checked against the f64 reference.
const CHECKED_ROWS: usize = 4;
/// FP8 products against the f64 product of the codes (bf16 output rounding).
const FP8_TOL: reference::Tolerance = reference::Tolerance::rel_l2(1e-2);

/// One projection at `m` tokens, every operand on the device.
struct Case {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    wq: CudaSlice<F8E4M3>,
    ws: CudaSlice<f32>,
    xq: CudaSlice<F8E4M3>,
    xs: CudaSlice<f32>,
}

impl Case {
    fn new(ctx: &Cudnn, name: &'static str, m: usize, n: usize, k: usize) -> Result<Self> {
        let seed = (m * 31 + n * 7 + k) as u64;
        let xs: Vec<bf16> =
            reference::random_values(seed, m * k).iter().map(|&v| bf16::from_f64(v)).collect();
        let wf: Vec<bf16> =
            reference::random_values(seed + 1, n * k).iter().map(|&v| bf16::from_f64(v * 0.05)).collect();
        let s = ctx.stream();
        let w = s.clone_htod(&wf)?;
        // The weight's codes and per-channel factors on the device, as `Llama::quantize_to_fp8` makes them.
        let (mut wq, mut ws) = (s.alloc_zeros::<F8E4M3>(n * k)?, s.alloc_zeros::<f32>(n)?);
        let q = QuantizeArgs::per_row(n, k);
        quantize_fp8(ctx, q, QuantizeOperands::new(&w, &mut wq, &mut ws), Backend::Fused)?;
        Ok(Case {
            name,
            m,
            n,
            k,
            x: s.clone_htod(&xs)?,
            w,
            y: s.alloc_zeros(m * n)?,
            wq,
            ws,
            xq: s.alloc_zeros(m * k)?,
            xs: s.alloc_zeros(m)?,
        })
    }

    fn bf16(&mut self, ctx: &Cudnn) -> Result<()> {
        let args = MatmulArgs::linear(self.m, self.k, self.n);
        matmul(ctx, &args, MatmulOperands::new(&self.x, &self.w, &mut self.y), Backend::Fused)
    }

    /// The Linear over the E4M3 weight.
    fn fp8_weight(&mut self, ctx: &Cudnn, backend: Backend) -> Result<()> {
        let args = MatmulArgs::linear(self.m, self.k, self.n);
        matmul(ctx, &args, MatmulOperands::fp8_weight(&self.x, &self.wq, &self.ws, &mut self.y), backend)
    }

    /// `quantize_fp8` per token, then `scaled_matmul` per token and per channel.
    fn fp8_prefill(&mut self, ctx: &Cudnn) -> Result<()> {
        let q = QuantizeArgs::per_row(self.m, self.k);
        quantize_fp8(ctx, q, QuantizeOperands::new(&self.x, &mut self.xq, &mut self.xs), Backend::Fused)?;
        let args = ScaledMatmulArgs::new(self.m, self.n, self.k).per_channel().per_token();
        scaled_matmul(
            ctx,
            args,
            ScaledMatmulOperands::new(&self.xq, &self.xs, &self.wq, &self.ws, &mut self.y),
            Backend::Fused,
        )
    }

    /// The first `rows` rows of y against `want`.
    fn expect(&self, ctx: &Cudnn, rows: usize, want: &[f64], what: &str) -> Result<()> {
        let got = ctx.stream().clone_dtoh(&self.y)?;
        let c = reference::compare(&got[..rows * self.n], want);
        println!("{} {}x{}x{} {what}: {c}", self.name, self.m, self.n, self.k);
        if !c.passes(FP8_TOL) {
            return Err(Error::InvalidArgument(format!("{} {what} off: {c}", self.name)));
        }
        Ok(())
    }

    /// Every path against its f64 reference (prefill: the first rows).
    fn check(&mut self, ctx: &Cudnn) -> Result<()> {
        let rows = self.m.min(CHECKED_ROWS);
        let x: Vec<f64> = ctx.stream().clone_dtoh(&self.x)?.iter().map(|v| v.to_f64()).collect();
        let (wq, ws) = (ctx.stream().clone_dtoh(&self.wq)?, ctx.stream().clone_dtoh(&self.ws)?);
        if self.m == 1 {
            let want = fp8_weight_reference((1, self.n, self.k), &x[..self.k], &wq, &ws);
            for backend in [Backend::Fused, Backend::Naive] {
                self.fp8_weight(ctx, backend)?;
                self.expect(ctx, 1, &want, &format!("fp8 weight {}", backend.name()))?;
            }
        } else {
            self.fp8_prefill(ctx)?;
            let (xq, xs) = (ctx.stream().clone_dtoh(&self.xq)?, ctx.stream().clone_dtoh(&self.xs)?);
            let args = ScaledMatmulArgs::new(rows, self.n, self.k).per_channel().per_token();
            let want = scaled_reference(args, &xq[..rows * self.k], &xs[..rows], &wq, &ws);
            self.expect(ctx, rows, &want, "quantize + scaled_matmul")?;
            // The matmul over the FP8 weight quantizes x the same way (the same kernel) into the FP8 graph.
            self.fp8_weight(ctx, Backend::Fused)?;
            self.expect(ctx, rows, &want, "fp8 weight fused")?;
        }
        Ok(())
    }
}

fn main() {
    bench_main("fp8 bench", run);
}

/// The paths a case times: name and call.
type Path = (&'static str, fn(&mut Case, &Cudnn) -> Result<()>);

fn paths(m: usize) -> Vec<Path> {
    if m == 1 {
        vec![
            ("bf16 GEMV", |c, ctx| c.bf16(ctx)),
            ("fp8 weight fused", |c, ctx| c.fp8_weight(ctx, Backend::Fused)),
            ("fp8 weight naive", |c, ctx| c.fp8_weight(ctx, Backend::Naive)),
        ]
    } else {
        vec![
            ("bf16 matmul", |c, ctx| c.bf16(ctx)),
            ("fp8 quantize + scaled_matmul", |c, ctx| c.fp8_prefill(ctx)),
            ("fp8 weight fused", |c, ctx| c.fp8_weight(ctx, Backend::Fused)),
        ]
    }
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let mut cases = Vec::new();
    for (name, n, k) in LINEARS {
        for m in [1, PREFILL] {
            let mut c = Case::new(ctx, name, m, n, k)?;
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
        for (path, call) in paths(c.m) {
            let name = format!("fp8/{}/{}x{}x{}/{path}", c.name, c.m, c.n, c.k);
            crit.bench_function(&name, |bench| {
                bench.iter_custom(|iters| {
                    let ms = gpu_time_ms(ctx, iters as usize, || call(c, ctx)).expect("timed run");
                    Duration::from_secs_f64(ms * 1e-3)
                })
            });
        }
    }
    crit.final_summary();
    let copy_gbps = copy_bandwidth_gbps(ctx, 1 << 30, 20)?;
    let mut rows = Vec::new();
    for c in cases.iter_mut() {
        for (path, call) in paths(c.m) {
            let ms = median_call_ms(ctx, 20, 30, if c.m == 1 { 50 } else { 5 }, || call(c, ctx))?;
            let weight_bytes = (c.n * c.k * if path.starts_with("bf16") { 2 } else { 1 }) as f64;
            let gbps = weight_bytes / (ms * 1e-3) / 1e9;
            rows.push(Row {
                gpu: info.name.clone(),
                driver: info.driver_version,
                cudnn: info.cudnn_version_string(),
                linear: c.name.into(),
                m: c.m,
                n: c.n,
                k: c.k,
                path: path.into(),
                ms: round(ms, 5),
                weight_gbps: round(gbps, 1),
                pct_of_copy: round(100.0 * gbps / copy_gbps, 1),
                tflops: round(2.0 * (c.m * c.n * c.k) as f64 / (ms * 1e-3) / 1e12, 1),
            });
        }
    }
    let mut md = String::new();
    let _ =
        writeln!(md, "## Llama-3.1-8B Linear layers: FP8 (E4M3 weights, per-channel factors) against bf16\n");
    let _ = writeln!(
        md,
        "GPU {}, driver {}, cuDNN {}, build {}. Device copy (1 GiB): {copy_gbps:.0} GB/s. Medians of CUDA-event \
         samples after warm-up. Decode (m = 1): GB/s of weight read (2 bytes an element in bf16, 1 in FP8). \
         Prefill (m = 2048): the FP8 row includes quantizing the activations per token.\n",
        info.name,
        info.driver_version,
        info.cudnn_version_string(),
        cudnn_llm_app::BUILD.git_revision
    );
    let _ = writeln!(md, "| linear | m x n x k | path | ms | weight GB/s | % of copy | TFLOP/s |");
    let _ = writeln!(md, "|---|---|---|---:|---:|---:|---:|");
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {} x {} x {} | {} | {:.4} | {:.0} | {:.0}% | {:.1} |",
            r.linear, r.m, r.n, r.k, r.path, r.ms, r.weight_gbps, r.pct_of_copy, r.tflops
        );
    }
    println!("\n{md}");
    let csv =
        csv_and_markdown(&rows).map(|(csv, _)| csv).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    write_results("fp8", &csv, &md);
    Ok(())
}

/// One line of `fp8.csv`.
#[derive(serde::Serialize)]
struct Row {
    gpu: String,
    driver: i32,
    cudnn: String,
    linear: String,
    m: usize,
    n: usize,
    k: usize,
    path: String,
    ms: f64,
    weight_gbps: f64,
    pct_of_copy: f64,
    tflops: f64,
}
