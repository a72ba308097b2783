//! `cargo bench --bench matmul`: fused matmul graphs with epilogues (cuDNN) vs cuBLAS plus one kernel per
//! epilogue step (PyTorch eager), bf16, on the Llama-3.1-8B and Llama-3.2-1B projections at 30, 2048 and
//! 8192 tokens.
//!
//! Every shape runs the plain matmul (fused vs cuBLAS alone), the residual add and the SwiGLU gate; the
//! 8B shapes at 2048 tokens also run the bias add and each activation. Before timing, both paths are
//! checked against the f64 reference on a few rows. Criterion then times each case with CUDA events;
//! after it a summary measures every case again (medians of alternating fused/naive event-timed
//! samples), reads the engine and cold plan-build time of each plan, checks the targets and
//! writes `matmul.csv` and `matmul.md` to `$BENCH_RESULTS_DIR` (default `benches/results`).
//!
//! Environment:
//! - `MATMUL_BENCH_FILTER=8B/o/,t2048`: only cases whose name (`8B/o/t2048/residual`) contains one of
//!   the comma-separated parts;
//! - `MATMUL_BENCH_TOKENS=30,2048`: token counts (default 30, 2048, 8192);
//! - `MATMUL_BENCH_EPILOGUES=none,residual,silu+gate`: one epilogue list for every shape;
//! - `MATMUL_BENCH_CRITERION=0`: skip the criterion pass (the summary is what gets written);
//! - `MATMUL_BENCH_LIST=1`: print the selected case names and exit (no GPU needed);
//! - `MATMUL_BENCH_FLUSH=0`: skip the comparison of autotuning's L2 flush modes (by default the summary
//!   ends with it: the median candidate time of the 8B `o` projection at 30 tokens under each mode);
//! - `CUDNN_LLM_AUTOTUNE=N`, `CUDNN_LLM_KNOB_SEARCH=N`, `CUDNN_LLM_TUNE_FLUSH=read|write|off` (read by
//!   the context): heuristics' configurations timed per plan (default 8), configurations the knob
//!   search may add around the fastest (default 0; `tune_ms` says what the search cost), and how L2
//!   is emptied before each timed candidate (default `read`).
//!
//! Without a GPU it says so and exits 0.

use criterion::{Criterion, Throughput};
use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::ops::matmul::naive::kernel_count;
use cudnn_llm::cudnn_ops::{
    matmul, reference, Activation, Backend, Cudnn, DataType, Epilogue, L2Flush, MatmulArgs, MatmulOperands,
    Result, Tuning,
};
use cudnn_llm_app::bench_util::{
    bench_main, csv_and_markdown, environment, gpu_time_ms, median, write_results,
};
use half::bf16;
use std::collections::hash_map::{Entry, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

/// (projection, in_features, out_features).
type Projection = (&'static str, usize, usize);
/// Sampled rows of one shape (`m, k, n`) and the f64 product `A·B` at those rows.
type Products = HashMap<(usize, usize, usize), (Vec<usize>, Vec<f64>)>;

const MODELS: [(&str, [Projection; 4]); 2] = [
    ("8B", [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 14336), ("down", 14336, 4096)]),
    ("1B", [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 8192), ("down", 8192, 2048)]),
];
const TOKENS: [usize; 3] = [30, 2048, 8192];
/// Alternating fused/naive samples per case in the summary, each at least `SAMPLE_MS` long.
const REPS: usize = 25;
const SAMPLE_MS: f64 = 0.5;
/// Rows of each output checked against the f64 reference.
const CHECK_ROWS: usize = 4;

struct Case {
    model: &'static str,
    proj: &'static str,
    tokens: usize,
    epilogue: Epilogue,
    args: MatmulArgs,
    name: String,
}

impl Case {
    fn new(model: &'static str, proj: &'static str, tokens: usize, k: usize, n: usize, e: Epilogue) -> Self {
        let name = format!("{model}/{proj}/t{tokens}/{e}");
        Case { model, proj, tokens, epilogue: e, args: MatmulArgs::linear(tokens, k, n), name }
    }
}

/// The default epilogues of a shape: plain, residual and the SwiGLU gate everywhere; bias and each
/// activation on the 8B shapes at 2048 tokens.
fn default_epilogues(model: &str, tokens: usize) -> Vec<Epilogue> {
    let mut v = vec![Epilogue::NONE, Epilogue::RESIDUAL, Epilogue::SWIGLU];
    if model == "8B" && tokens == 2048 {
        v.push(Epilogue::BIAS);
        v.extend(Activation::ALL.map(|a| Epilogue::NONE.with_activation(a)));
        v.push(Epilogue::BIAS.with_activation(Activation::Gelu));
    }
    v
}

fn env_list(name: &str) -> Option<Vec<String>> {
    let v = std::env::var(name).ok()?;
    Some(v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
}

fn cases() -> Result<Vec<Case>> {
    let tokens: Vec<usize> = match env_list("MATMUL_BENCH_TOKENS") {
        Some(t) => t
            .iter()
            .map(|s| s.parse().map_err(|_| cudnn_llm::Error::InvalidArgument(format!("token count `{s}`"))))
            .collect::<Result<_>>()?,
        None => TOKENS.to_vec(),
    };
    let epilogues = match env_list("MATMUL_BENCH_EPILOGUES") {
        Some(list) => Some(list.iter().map(|s| Epilogue::parse(s)).collect::<Result<Vec<_>>>()?),
        None => None,
    };
    let filter = env_list("MATMUL_BENCH_FILTER");
    let mut out = Vec::new();
    for (model, projs) in MODELS {
        for (proj, k, n) in projs {
            for &t in &tokens {
                let es = epilogues.clone().unwrap_or_else(|| default_epilogues(model, t));
                for e in es {
                    let case = Case::new(model, proj, t, k, n, e);
                    if filter.as_ref().is_none_or(|f| f.iter().any(|p| case.name.contains(p.as_str()))) {
                        out.push(case);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Device memory shared by all cases: each case reads a prefix of every pool, so the largest shape sets
/// the sizes. Activations, gate and residual pools are separate allocations (no aliasing).
struct Pools {
    a: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    bias: CudaSlice<bf16>,
    u: CudaSlice<bf16>,
    r: CudaSlice<bf16>,
    d_fused: CudaSlice<bf16>,
    d_naive: CudaSlice<bf16>,
}

/// A device buffer of `len` pseudo-random bf16 values in `[-scale, scale)`, uploaded in chunks.
fn random_pool(ctx: &Cudnn, seed: u64, len: usize, scale: f64) -> Result<CudaSlice<bf16>> {
    const CHUNK: usize = 1 << 24;
    let mut buf = ctx.stream().alloc_zeros::<bf16>(len.max(1))?;
    for (i, start) in (0..len).step_by(CHUNK).enumerate() {
        let end = (start + CHUNK).min(len);
        let host: Vec<bf16> = reference::random_values(seed + i as u64, end - start)
            .iter()
            .map(|v| bf16::from_f64(v * scale))
            .collect();
        ctx.stream().memcpy_htod(&host, &mut buf.slice_mut(start..end))?;
    }
    Ok(buf)
}

impl Pools {
    fn new(ctx: &Cudnn, cases: &[Case]) -> Result<Self> {
        let max = |f: &dyn Fn(&Case) -> usize| cases.iter().map(f).max().unwrap_or(0);
        let d = max(&|c| c.args.d_len());
        let with = |e: fn(&Epilogue) -> bool| max(&|c| if e(&c.epilogue) { c.args.d_len() } else { 0 });
        Ok(Pools {
            a: random_pool(ctx, 1, max(&|c| c.args.m() * c.args.k()), 1.0)?,
            // Weights ~ U(-1, 1)/32: outputs of unit order for k in the thousands.
            w: random_pool(ctx, 1000, max(&|c| c.args.k() * c.args.n()), 1.0 / 32.0)?,
            bias: random_pool(ctx, 2000, max(&|c| c.args.n()), 0.5)?,
            u: random_pool(ctx, 3000, with(|e| e.gate), 1.0)?,
            r: random_pool(ctx, 4000, with(|e| e.residual), 1.0)?,
            d_fused: ctx.stream().alloc_zeros(d.max(1))?,
            d_naive: ctx.stream().alloc_zeros(d.max(1))?,
        })
    }

    fn run(&mut self, ctx: &Cudnn, case: &Case, backend: Backend) -> Result<()> {
        let (args, e) = (&case.args, case.epilogue);
        let len = args.d_len();
        let a = self.a.slice(0..args.m() * args.k());
        let w = self.w.slice(0..args.k() * args.n());
        let bias = self.bias.slice(0..args.n());
        let u = self.u.slice(0..if e.gate { len } else { 0 });
        let r = self.r.slice(0..if e.residual { len } else { 0 });
        let d = match backend {
            Backend::Fused => &mut self.d_fused,
            Backend::Naive => &mut self.d_naive,
        };
        let mut d = d.slice_mut(0..len);
        let mut x = MatmulOperands::new(&a, &w, &mut d);
        if e.bias {
            x = x.bias(&bias);
        }
        if e.gate {
            x = x.up(&u);
        }
        if e.residual {
            x = x.residual(&r);
        }
        matmul(ctx, &args.with_epilogue(e), x, backend)
    }
}

fn main() {
    if std::env::var("MATMUL_BENCH_LIST").is_ok_and(|v| v == "1") {
        match cases() {
            Ok(cases) => cases.iter().for_each(|c| println!("{}", c.name)),
            Err(e) => eprintln!("matmul bench: {e}"),
        }
        return;
    }
    bench_main("matmul bench", run);
}

#[derive(Default)]
struct Row {
    fused_ms: Option<f64>,
    naive_ms: Option<f64>,
    engine: String,
    /// Autotuning: every finalized engine with its median ms, in heuristics order.
    tuning: String,
    plan_ms: Option<f64>,
    tune_ms: Option<f64>,
    check: String,
    error: String,
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let cases = cases()?;
    println!("{} cases", cases.len());
    let mut pools = Pools::new(ctx, &cases)?;

    // Cold plan builds (first fused call of each case) and the check against the reference.
    let mut rows: Vec<Row> = Vec::with_capacity(cases.len());
    let mut products = Products::new();
    for case in &cases {
        let mut row = Row::default();
        for backend in [Backend::Fused, Backend::Naive] {
            if let Err(e) = pools.run(ctx, case, backend) {
                row.error += &format!("{}: {e}; ", backend.name());
            }
        }
        ctx.synchronize()?;
        if let Ok(plan) = case.args.with_epilogue(case.epilogue).plan(ctx, DataType::BF16, DataType::BF16) {
            row.engine = plan.engine().to_string();
            row.tuning =
                plan.timings().iter().map(|(e, ms)| format!("{e} {ms:.4}")).collect::<Vec<_>>().join(" ");
            row.plan_ms = Some(plan.build_time().as_secs_f64() * 1e3);
            row.tune_ms = Some(plan.tune_time().as_secs_f64() * 1e3);
        }
        row.check = check(ctx, &pools, case, &mut products, &row.error)?;
        println!(
            "{}: check {}, {}; engine {} ({} timed in {:.0} ms: {})",
            case.name,
            row.check,
            if row.error.is_empty() { "ok" } else { &row.error },
            row.engine,
            row.tuning.split(' ').count() / 2,
            row.tune_ms.unwrap_or(0.0),
            row.tuning
        );
        rows.push(row);
    }
    drop(products);

    if std::env::var("MATMUL_BENCH_CRITERION").map_or(true, |v| v != "0") {
        let mut c = Criterion::default()
            .warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_millis(300))
            .sample_size(10)
            .configure_from_args();
        for (case, row) in cases.iter().zip(&rows) {
            let mut group = c.benchmark_group(format!("matmul/{}", case.name));
            group.throughput(Throughput::Elements(case.args.flops() as u64));
            for backend in [Backend::Fused, Backend::Naive] {
                if row.error.contains(&format!("{}:", backend.name())) {
                    continue;
                }
                group.bench_function(backend.name(), |bench| {
                    bench.iter_custom(|iters| {
                        let ms = gpu_time_ms(ctx, iters as usize, || pools.run(ctx, case, backend))
                            .expect("timed run");
                        Duration::from_secs_f64(ms * 1e-3)
                    })
                });
            }
            group.finish();
        }
        c.final_summary();
    }

    // Summary: medians of alternating samples.
    for (case, row) in cases.iter().zip(rows.iter_mut()) {
        let fused_ok = !row.error.contains("fused:");
        let naive_ok = !row.error.contains("naive:");
        let (fused, naive) = time_case(ctx, &mut pools, case, fused_ok, naive_ok)?;
        row.fused_ms = fused;
        row.naive_ms = naive;
    }
    let (csv, mut md) = render(&info, ctx.tuning(), &cases, &rows);
    if std::env::var("MATMUL_BENCH_FLUSH").map_or(true, |v| v != "0") {
        md += &tune_flush(ctx)?;
    }
    println!("\n{md}");
    write_results("matmul", &csv, &md);
    Ok(())
}

/// Autotuning's L2 flush modes compared on the 8B `o` projection at 30 tokens, which reads 32 MiB of
/// weights: per mode, a fresh plan autotunes 4 candidates and the median of their times is kept. A
/// memset flush (`write`) leaves L2 full of dirty lines and the timed execution pays for writing them
/// back; a reading flush (`read`) leaves clean lines, as the kernels before a layer do; without a flush
/// (`off`) the GPU idles while the timed launch is enqueued. Target: `read` below 0.85 × `write`.
/// Clears the plan cache; the context's tuning settings are restored after.
fn tune_flush(ctx: &Cudnn) -> Result<String> {
    let saved = ctx.tuning();
    let case = Case::new("8B", "o", 30, 4096, 4096, Epilogue::NONE);
    let mut pools = Pools::new(ctx, std::slice::from_ref(&case))?;
    ctx.set_autotune(4);
    ctx.set_knob_search(0);
    let mut medians = Vec::new();
    let mut measure = |flush: L2Flush| -> Result<f64> {
        ctx.set_tune_flush(flush);
        ctx.cache().clear();
        pools.run(ctx, &case, Backend::Fused)?;
        ctx.synchronize()?;
        let plan = case.args.with_epilogue(case.epilogue).plan(ctx, DataType::BF16, DataType::BF16)?;
        let ms: Vec<f64> = plan.timings().iter().map(|t| t.1).filter(|v| v.is_finite()).collect();
        println!("tune flush {}: {:?}", flush.name(), plan.timings());
        Ok(median(ms))
    };
    let mut failure = None;
    for flush in [L2Flush::Off, L2Flush::Write, L2Flush::Read] {
        match measure(flush) {
            Ok(ms) => medians.push((flush, ms)),
            Err(e) => {
                failure = Some(format!("{}: {e}", flush.name()));
                break;
            }
        }
    }
    ctx.set_autotune(saved.candidates);
    ctx.set_knob_search(saved.knob_search);
    ctx.set_tune_flush(saved.flush);
    ctx.cache().clear();
    let mut md = String::from("\n### Autotuning's L2 flush\n\n");
    let _ = writeln!(
        md,
        "Median candidate time of `{}` (4 candidates autotuned per mode). A `write` flush leaves dirty lines \
         that the timed execution writes back; `read` leaves clean ones, as a layer's earlier kernels do.\n",
        case.name
    );
    if let Some(e) = failure {
        let _ = writeln!(md, "Not measured: {e}");
        return Ok(md);
    }
    for (flush, ms) in &medians {
        let _ = writeln!(md, "- `{}`: {ms:.4} ms", flush.name());
    }
    if let [_, (_, write), (_, read)] = medians[..] {
        let verdict = if read < 0.85 * write { "**met**" } else { "**not met**" };
        let _ = writeln!(md, "\nTarget `read` < 0.85 × `write`: {verdict} ({:.2}×).", read / write);
    }
    Ok(md)
}

/// Per-call GPU time of each backend: warm-up, a batch size that makes samples ≥ `SAMPLE_MS`, then
/// `REPS` alternating fused and naive samples.
fn time_case(
    ctx: &Cudnn,
    pools: &mut Pools,
    case: &Case,
    fused_ok: bool,
    naive_ok: bool,
) -> Result<(Option<f64>, Option<f64>)> {
    let backends: Vec<Backend> = [(Backend::Fused, fused_ok), (Backend::Naive, naive_ok)]
        .iter()
        .filter(|b| b.1)
        .map(|b| b.0)
        .collect();
    let mut batch = Vec::new();
    for &backend in &backends {
        for _ in 0..3 {
            pools.run(ctx, case, backend)?;
        }
        let one = gpu_time_ms(ctx, 3, || pools.run(ctx, case, backend))? / 3.0;
        batch.push(((SAMPLE_MS / one.max(1e-4)).ceil() as usize).clamp(1, 200));
    }
    let mut samples = vec![Vec::with_capacity(REPS); backends.len()];
    for _ in 0..REPS {
        for (i, &backend) in backends.iter().enumerate() {
            let ms = gpu_time_ms(ctx, batch[i], || pools.run(ctx, case, backend))?;
            samples[i].push(ms / batch[i] as f64);
        }
    }
    let (mut fused, mut naive) = (None, None);
    for (backend, s) in backends.into_iter().zip(samples) {
        match backend {
            Backend::Fused => fused = Some(median(s)),
            Backend::Naive => naive = Some(median(s)),
        }
    }
    Ok((fused, naive))
}

/// Compares `CHECK_ROWS` rows of both outputs with the f64 reference; the product of those rows is
/// computed once per shape.
fn check(ctx: &Cudnn, pools: &Pools, case: &Case, products: &mut Products, errors: &str) -> Result<String> {
    let (m, k, n) = (case.args.m(), case.args.k(), case.args.n());
    let dtoh = |buf: &CudaSlice<bf16>, start: usize, len: usize| -> Result<Vec<f64>> {
        let host = ctx.stream().clone_dtoh(&buf.slice(start..start + len))?;
        Ok(host.iter().map(|v| v.to_f64()).collect())
    };
    if let Entry::Vacant(slot) = products.entry((m, k, n)) {
        let rows: Vec<usize> = if m <= CHECK_ROWS {
            (0..m).collect()
        } else {
            (0..CHECK_ROWS).map(|i| i * (m - 1) / (CHECK_ROWS - 1)).collect()
        };
        // The rows of A the sampled outputs need, packed, and the whole weight.
        let mut a = Vec::with_capacity(rows.len() * k);
        for &r in &rows {
            a.extend(dtoh(&pools.a, r * k, k)?);
        }
        let w = dtoh(&pools.w, 0, k * n)?;
        let packed_rows: Vec<usize> = (0..rows.len()).collect();
        let product = reference::matmul_rows(&MatmulArgs::linear(rows.len(), k, n), &a, &w, &packed_rows);
        slot.insert((rows, product));
    }
    let (rows, product) = &products[&(m, k, n)];
    let e = case.epilogue;
    // U and R rows gathered in the order of `rows`, so the epilogue reads them at packed indices.
    let gather = |buf: &CudaSlice<bf16>| -> Result<Vec<f64>> {
        let mut v = Vec::with_capacity(rows.len() * n);
        for &r in rows {
            v.extend(dtoh(buf, r * n, n)?);
        }
        Ok(v)
    };
    let bias = if e.bias { Some(dtoh(&pools.bias, 0, n)?) } else { None };
    let u = if e.gate { Some(gather(&pools.u)?) } else { None };
    let r = if e.residual { Some(gather(&pools.r)?) } else { None };
    let packed: Vec<usize> = (0..rows.len()).collect();
    let expected =
        reference::matmul_epilogue(e, product, n, &packed, bias.as_deref(), u.as_deref(), r.as_deref());
    let mut verdict = Vec::new();
    for (backend, d) in [(Backend::Fused, &pools.d_fused), (Backend::Naive, &pools.d_naive)] {
        if errors.contains(&format!("{}:", backend.name())) {
            continue;
        }
        let mut out: Vec<bf16> = Vec::with_capacity(rows.len() * n);
        for &row in rows {
            out.extend(ctx.stream().clone_dtoh(&d.slice(row * n..(row + 1) * n))?);
        }
        let c = reference::compare(&out, &expected);
        let ok = c.passes(reference::BF16_TOL);
        verdict.push(format!("{} {} {:.1e}", backend.name(), if ok { "ok" } else { "FAIL" }, c.rel_l2));
    }
    Ok(verdict.join(", "))
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.4}"))
}

fn tflops(case: &Case, ms: Option<f64>) -> String {
    ms.map_or("n/a".into(), |ms| format!("{:.0}", case.args.flops() / (ms * 1e-3) / 1e12))
}

fn speedup(row: &Row) -> Option<f64> {
    Some(row.naive_ms? / row.fused_ms?)
}

/// One line of `matmul.csv` and of the markdown table (the same records).
#[derive(serde::Serialize)]
struct Out {
    model: &'static str,
    proj: &'static str,
    tokens: usize,
    k: usize,
    n: usize,
    epilogue: String,
    fused_ms: String,
    naive_ms: String,
    speedup: String,
    fused_tflops: String,
    naive_tflops: String,
    engine: String,
    autotuned_ms: String,
    plan_build_ms: String,
    tune_ms: String,
    naive_kernels: usize,
    check: String,
    error: String,
}

fn render(
    info: &cudnn_llm::cudnn_ops::DeviceInfo,
    tuning: Tuning,
    cases: &[Case],
    rows: &[Row],
) -> (String, String) {
    let out: Vec<Out> = cases
        .iter()
        .zip(rows)
        .map(|(c, r)| Out {
            model: c.model,
            proj: c.proj,
            tokens: c.tokens,
            k: c.args.k(),
            n: c.args.n(),
            epilogue: c.epilogue.to_string(),
            fused_ms: fmt_ms(r.fused_ms),
            naive_ms: fmt_ms(r.naive_ms),
            speedup: speedup(r).map_or("n/a".into(), |s| format!("{s:.2}")),
            fused_tflops: tflops(c, r.fused_ms),
            naive_tflops: tflops(c, r.naive_ms),
            engine: r.engine.clone(),
            autotuned_ms: r.tuning.clone(),
            plan_build_ms: r.plan_ms.map_or("n/a".into(), |v| format!("{v:.1}")),
            tune_ms: r.tune_ms.map_or("n/a".into(), |v| format!("{v:.1}")),
            naive_kernels: kernel_count(c.epilogue),
            check: r.check.clone(),
            error: r.error.clone(),
        })
        .collect();
    let (csv, table) =
        csv_and_markdown(&out).unwrap_or_else(|e| (String::new(), format!("(cannot render: {e})")));
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## Matmul + epilogues, bf16: fused (cuDNN graph) vs naive (cuBLAS GEMM + one kernel per step)\n"
    );
    let _ = writeln!(md, "{}\n", environment(info));
    let _ = writeln!(
        md,
        "Linear layers `y[tokens, n] = x[tokens, k] · W[n, k]ᵀ` (weights read through their transposed view). \
         Naive = `cublasGemmStridedBatchedEx` (f32 compute, bf16 out), then one eager-style kernel per epilogue \
         step (bias, activation, gate multiply, residual add; each reads and writes bf16). For `none` the \
         comparison is fused vs cuBLAS alone. Times are medians of {REPS} alternating CUDA-event samples \
         (≥ {SAMPLE_MS} ms each) on hot buffers (at 30 tokens the weights of the smaller projections fit in L2). \
         TFLOP/s counts 2·m·n·k. Speedup = naive / fused. Plan build = cold `Graph::build_tuned` (validate → \
         finalize up to {} engine configurations); the first execution times them (single executions, L2 \
         flush `{}` before each){}, keeps the fastest (`autotuned_ms`, in the order timed) and takes `tune_ms`. \
         Check: {CHECK_ROWS} rows of each output vs the f64 reference, relative L2 (bf16 bound 1e-2).\n",
        tuning.candidates,
        tuning.flush.name(),
        if tuning.knob_search > 0 {
            format!(
                ", then builds and times up to {} more, one knob changed at a time around the fastest so far \
                 (knob search, `CUDNN_LLM_KNOB_SEARCH`)",
                tuning.knob_search
            )
        } else {
            String::new()
        }
    );
    md += &table;
    let errors: Vec<String> = cases
        .iter()
        .zip(rows)
        .filter(|(_, r)| !r.error.is_empty())
        .map(|(c, r)| format!("- {}: {}", c.name, r.error))
        .collect();
    if !errors.is_empty() {
        let _ = writeln!(md, "\nErrors:\n{}", errors.join("\n"));
    }
    md += &targets(cases, rows);
    (csv, md)
}

/// The targets, each with its verdict and the cases that miss it, and every case where cuDNN's
/// chosen engine is slower than cuBLAS (+ kernels).
fn targets(cases: &[Case], rows: &[Row]) -> String {
    let mut md = String::from("\n### Targets\n\n");
    let pick = |pred: &dyn Fn(&Case) -> bool| -> Vec<(&Case, Option<f64>)> {
        cases.iter().zip(rows).filter(|(c, _)| pred(c)).map(|(c, r)| (c, speedup(r))).collect()
    };
    let mut verdict = |title: &str, sel: Vec<(&Case, Option<f64>)>, min: &dyn Fn(&Case) -> f64| {
        if sel.is_empty() {
            let _ = writeln!(md, "- {title}: not measured in this run");
            return;
        }
        let misses: Vec<String> = sel
            .iter()
            .filter(|(c, s)| s.is_none_or(|s| s < min(c)))
            .map(|(c, s)| format!("{} ({})", c.name, s.map_or("n/a".into(), |s| format!("{s:.2}×"))))
            .collect();
        let worst = sel.iter().filter_map(|(_, s)| *s).fold(f64::INFINITY, f64::min);
        if misses.is_empty() {
            let _ = writeln!(md, "- {title}: **met** on {} cases (lowest speedup {worst:.2}×)", sel.len());
        } else {
            let _ = writeln!(
                md,
                "- {title}: **missed** on {} of {}: {}",
                misses.len(),
                sel.len(),
                misses.join(", ")
            );
        }
    };
    verdict(
        "plain fused matmul within 5% of cuBLAS at 2048 tokens, every 8B shape (speedup ≥ 0.95)",
        pick(&|c| c.model == "8B" && c.tokens == 2048 && c.epilogue == Epilogue::NONE),
        &|_| 0.95,
    );
    let key = |c: &Case| c.epilogue == Epilogue::RESIDUAL || c.epilogue == Epilogue::SWIGLU;
    verdict(
        "fused residual add and SwiGLU gate faster than cuBLAS + kernels at 2048 tokens, every shape (> 1.0)",
        pick(&|c| c.tokens == 2048 && key(c)),
        &|_| 1.0 + 1e-9,
    );
    verdict(
        "at 30 tokens: residual and SwiGLU ≥ 1.2× on o_proj, never slower elsewhere",
        pick(&|c| c.tokens == 30 && key(c)),
        &|c| if c.proj == "o" { 1.2 } else { 1.0 },
    );
    let _ = writeln!(md, "\n### Where the fused graph is slower than cuBLAS (+ kernels)\n");
    let slower: Vec<String> = cases
        .iter()
        .zip(rows)
        .filter_map(|(c, r)| {
            let s = speedup(r)?;
            (s < 1.0).then(|| {
                format!(
                    "- {}: cuDNN `{}` {:.4} ms vs {} {:.4} ms: {:.1}% slower (engines timed: {})",
                    c.name,
                    r.engine,
                    r.fused_ms.unwrap_or(0.0),
                    if c.epilogue == Epilogue::NONE {
                        "cuBLAS".to_string()
                    } else {
                        format!("cuBLAS + {} kernel(s)", c.epilogue.steps())
                    },
                    r.naive_ms.unwrap_or(0.0),
                    (1.0 / s - 1.0) * 100.0,
                    if r.tuning.is_empty() { "one" } else { &r.tuning }
                )
            })
        })
        .collect();
    if slower.is_empty() {
        md += "None.\n";
    } else {
        md += &slower.join("\n");
        md += "\n";
    }
    md
}
