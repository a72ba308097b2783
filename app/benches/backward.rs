//! `cargo bench --bench backward`: the training side, forward and backward per op, fused vs naive
//! (PyTorch eager's decomposition), bf16 activations, at Llama-3.1-8B and Llama-3.2-1B shapes:
//!
//! | op | cases | phases | backends |
//! |---|---|---|---|
//! | AdamW | Llama-3.2-1B's 1.24 B parameters (147 tensors, tied embedding), f32 and bf16 params (f32 moments) | `step` | fused (one multi-tensor launch), naive (8 kernels per tensor) |
//! | grad norm | the same gradients | `norm`, `norm+clip` | fused, naive (`clip_grad_norm_(foreach=False)`) |
//! | RoPE | 16384 tokens (4 × 4096), Q and K of a QKV buffer | `fwd`, `bwd` | fused (one kernel), naive (10 kernels) |
//! | embedding | 16384 tokens into 128256 × hidden | `fwd`, `bwd` | fused (atomic), fused-det (deterministic), naive (zeros, sort, segment sums) |
//! | cross-entropy | 16384 and 4096 tokens × 128256 | `fwd`, `fwd+bwd` | fused (3 launches, no f32 logits), naive (`.float()`, `log_softmax`, `nll_loss` and back) |
//! | RMSNorm | 16384 × 4096 and 16384 × 2048 ([`RMSNORM_CASES`]) | `fwd` (training: the inverse RMS saved), `bwd`, `fwd+bwd` | fused (cuDNN norm forward / backward graphs), naive (8 forward, 19 backward kernels) |
//! | matmul | Llama-3.1-8B's qkv, o, gate_up (each of gate and up) and down projections at 2048 and 16384 tokens ([`MATMUL_CASES`]) | `dx`, `dw`, `dw+=f32`; `dx+swiglu` on the down projection | fused (cuDNN matmul graphs), naive (cuBLAS GEMM, an add kernel when accumulating, 4 eager kernels after the SwiGLU's GEMM) |
//! | SDPA backward | see [`sdpa`] | | rows added with the op |
//!
//! Inputs are random and non-zero (a host-generated block tiled over the device buffer). Criterion
//! times each case with CUDA events (`iter_custom`); the summary then takes the median of 15
//! CUDA-event samples after warm-up, each over enough calls to cover about 2 ms. GB/s count what a
//! perfect kernel must move (each row's `note` says what) against a 1 GiB device-to-device copy;
//! TFLOP/s count the GEMMs' 2·m·n·k.
//! The summary is written as `backward.csv` / `backward.md` to `$BENCH_RESULTS_DIR` (default
//! `benches/results`). If `$TORCH_BACKWARD_CSV` names the output of `app/benches/backward_torch.py` (run
//! on the same GPU just before), PyTorch's times join the rows (`torch_backend`, `torch_ms`).
//! `BACKWARD_BENCH_FILTER=rope` keeps only the ops whose name contains the text;
//! `BACKWARD_BENCH_CRITERION=0` skips criterion's own sampling (the CUDA-event medians the tables
//! report remain), for a short device call. Without a GPU it says so and exits 0.

use criterion::Criterion;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm::cudnn_ops::ops::{matmul::backward::naive as linear_naive, rmsnorm::naive as rms_naive};
use cudnn_llm::cudnn_ops::{
    adamw, cross_entropy, embedding, embedding_backward, grad_norm, linear_backward_data,
    linear_backward_weight, reference, rms_norm, rms_norm_backward, rope, rope_backward, sdpa, sdpa_backward,
    swiglu_down_backward, AdamWArgs, AdamWOperands, AdamWTensor, Backend, CrossEntropyArgs,
    CrossEntropyOperands, Cudnn, DataGrad, DataType, Element, EmbeddingArgs, EmbeddingBackwardOperands,
    EmbeddingGrad, EmbeddingOperands, GradNormArgs, GradNormOperands, Layout, LinearGradArgs, Mask,
    MultiTensor, Result, RmsNormArgs, RmsNormGrads, RmsNormOperands, RopeArgs, RopeBackwardOperands,
    RopeOperands, RopeTables, SdpaArgs, SdpaGrads, SdpaOperands, SwigluForm, SwigluGrads, WeightGrad,
};
use cudnn_llm_app::bench_util::{
    bench_main, copy_bandwidth_gbps, csv_and_markdown, environment, gpu_time_ms, median_call_ms, round,
    write_results,
};
use half::bf16;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The vocabulary of Llama 3 (both models).
const VOCAB: usize = 128_256;
/// Training tokens per step of the large cases.
const TOKENS: usize = 16_384;

/// What one timed row is.
struct Case {
    op: &'static str,
    model: &'static str,
    /// The shape, spelled as `backward_torch.py` spells it (the join key with PyTorch's rows).
    shape: String,
    dtype: &'static str,
    phase: &'static str,
    backend: &'static str,
    /// Bytes a perfect kernel moves (memory-bound ops).
    bytes: Option<f64>,
    /// Floating-point operations (GEMMs, attention).
    flops: Option<f64>,
    /// What `bytes` or `flops` count.
    note: &'static str,
}

/// One line of `backward.csv`.
#[derive(Serialize)]
struct Row {
    op: &'static str,
    model: &'static str,
    shape: String,
    dtype: &'static str,
    phase: &'static str,
    backend: &'static str,
    ms: f64,
    gbps: Option<f64>,
    pct_of_copy: Option<f64>,
    tflops: Option<f64>,
    speedup_vs_naive: Option<f64>,
    torch_backend: Option<String>,
    torch_ms: Option<f64>,
    speedup_vs_torch: Option<f64>,
    note: &'static str,
}

/// A row of `app/benches/backward_torch.py`'s CSV.
#[derive(Deserialize)]
struct TorchRow {
    op: String,
    model: String,
    shape: String,
    dtype: String,
    backend: String,
    phase: String,
    ms: Option<f64>,
    torch: Option<String>,
}

fn torch_times() -> Vec<TorchRow> {
    let Ok(path) = std::env::var("TORCH_BACKWARD_CSV") else { return Vec::new() };
    match csv::Reader::from_path(&path) {
        Ok(mut r) => r.deserialize().filter_map(|row| row.ok()).collect(),
        Err(e) => {
            eprintln!("cannot read {path}: {e}");
            Vec::new()
        }
    }
}

/// The PyTorch backend each op is compared with: HF's loss upcasts the logits, the default AdamW on
/// CUDA is `fused=True` as timed, `clip_grad_norm_` defaults to foreach on CUDA, the rest is eager.
fn torch_backend(op: &str) -> &'static str {
    match op {
        "cross_entropy" => "eager_float",
        "adamw" => "fused",
        "grad_norm" => "foreach",
        "sdpa" => "cudnn",
        _ => "eager",
    }
}

/// A function that times one op's cases and adds their rows.
type OpRows = fn(&mut Bench) -> Result<()>;

/// The timer and the rows it collects.
struct Bench<'a> {
    ctx: &'a Cudnn,
    criterion: Criterion,
    copy_gbps: f64,
    rows: Vec<Row>,
}

impl Bench<'_> {
    /// Runs `f` once (kernel compilation, scratch growth), lets criterion time it, then records the
    /// median of 15 CUDA-event samples after warm-up.
    fn time(&mut self, case: Case, mut f: impl FnMut() -> Result<()>) -> Result<()> {
        let ctx = self.ctx;
        f()?;
        ctx.synchronize()?;
        let once = gpu_time_ms(ctx, 1, &mut f)?;
        let criterion = std::env::var("BACKWARD_BENCH_CRITERION").map_or(true, |v| v != "0");
        let batch = (2.0 / once.max(1e-3)).ceil().clamp(1.0, 100.0) as usize;
        let name = format!(
            "{}/{}/{}/{}/{}/{}",
            case.op, case.model, case.shape, case.dtype, case.phase, case.backend
        );
        if criterion {
            self.criterion.bench_function(&name, |b| {
                b.iter_custom(|iters| {
                    let ms = gpu_time_ms(ctx, iters as usize, &mut f).expect("timed run");
                    Duration::from_secs_f64(ms * 1e-3)
                })
            });
        }
        let ms = median_call_ms(ctx, 3, 15, batch, &mut f)?;
        let gbps = case.bytes.map(|b| b / (ms * 1e-3) / 1e9);
        let tflops = case.flops.map(|f| f / (ms * 1e-3) / 1e12);
        println!(
            "{name}: {ms:.4} ms{}{}",
            gbps.map(|g| format!(", {g:.0} GB/s")).unwrap_or_default(),
            tflops.map(|t| format!(", {t:.0} TFLOP/s")).unwrap_or_default()
        );
        self.rows.push(Row {
            op: case.op,
            model: case.model,
            shape: case.shape,
            dtype: case.dtype,
            phase: case.phase,
            backend: case.backend,
            ms: round(ms, 5),
            gbps: gbps.map(|g| round(g, 1)),
            pct_of_copy: gbps.map(|g| round(100.0 * g / self.copy_gbps, 1)),
            tflops: tflops.map(|t| round(t, 1)),
            speedup_vs_naive: None,
            torch_backend: None,
            torch_ms: None,
            speedup_vs_torch: None,
            note: case.note,
        });
        Ok(())
    }
}

/// A device buffer of `n` random non-zero values times `scale`: a block of up to 4 M host values,
/// tiled over the buffer with device copies (the large cases hold billions of elements).
fn random<T: Element>(ctx: &Cudnn, n: usize, seed: u64, scale: f64) -> Result<CudaSlice<T>> {
    let block: Vec<f64> = reference::random_values(seed, n.clamp(1, 1 << 22))
        .iter()
        .map(|v| scale * if *v == 0.0 { 0.5 } else { *v })
        .collect();
    let block = ctx.stream().clone_htod(&reference::to_elements::<T>(&block))?;
    let mut out = ctx.stream().alloc_zeros::<T>(n.max(1))?;
    let mut at = 0;
    while at < n {
        let len = block.len().min(n - at);
        ctx.stream().memcpy_dtod(&block.slice(0..len), &mut out.slice_mut(at..at + len))?;
        at += len;
    }
    Ok(out)
}

/// `n` token ids spread over the vocabulary (a fixed LCG).
fn token_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn main() {
    bench_main("backward bench", run);
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10)
        .configure_from_args();
    let copy_gbps = copy_bandwidth_gbps(ctx, 1 << 30, 20)?;
    let mut bench = Bench { ctx, criterion, copy_gbps, rows: Vec::new() };
    let filter = std::env::var("BACKWARD_BENCH_FILTER").unwrap_or_default();
    // Largest op-owned buffers last: the eager cross-entropy grows the shared scratch to three f32
    // copies of the logits, and scratch is never shrunk.
    let ops: [(&str, OpRows); 8] = [
        ("adamw", optim::<f32, f32>),
        ("adamw", optim::<bf16, bf16>),
        ("rope", rope_cases),
        ("embedding", embedding_cases),
        ("rmsnorm", rmsnorm),
        ("sdpa", sdpa_cases),
        ("matmul", matmul),
        ("cross_entropy", cross_entropy_cases),
    ];
    for (name, op) in ops {
        if name.contains(&filter) || (filter == "grad_norm" && name == "adamw") {
            op(&mut bench)?;
        }
    }
    bench.criterion.final_summary();

    let torch = torch_times();
    let mut rows = std::mem::take(&mut bench.rows);
    let key = |r: &Row| (r.op, r.model, r.shape.clone(), r.dtype, r.phase);
    let naive: Vec<_> = rows.iter().filter(|r| r.backend == "naive").map(|r| (key(r), r.ms)).collect();
    for r in rows.iter_mut() {
        if r.backend != "naive" {
            r.speedup_vs_naive = naive.iter().find(|(k, _)| *k == key(r)).map(|(_, ms)| round(ms / r.ms, 2));
        }
        let want = torch_backend(r.op);
        if let Some(t) = torch.iter().find(|t| {
            t.op == r.op
                && t.model == r.model
                && t.shape == r.shape
                && t.dtype == r.dtype
                && t.phase == r.phase
                && t.backend == want
        }) {
            r.torch_backend = Some(want.to_string());
            r.torch_ms = t.ms;
            r.speedup_vs_torch = t.ms.map(|t| round(t / r.ms, 2));
        }
    }
    let (csv, table) = csv_and_markdown(&rows).map_err(|e| {
        cudnn_llm::cudnn_ops::Error::InvalidArgument(format!("cannot render backward.csv: {e}"))
    })?;
    let torch_version = torch.iter().find_map(|t| t.torch.clone());
    let md = format!(
        "## Backward: fused vs naive (PyTorch eager's decomposition), forward and backward per op\n\n{}\n\n\
         Device-to-device copy (1 GiB, read + write): **{copy_gbps:.0} GB/s**; `pct_of_copy` is a row's GB/s \
         against it; `tflops` counts a GEMM's 2·m·n·k (the matmul rows: 2·T·in·out). Times are medians of \
         CUDA-event samples after warm-up. `speedup_vs_naive` is the naive time over the row's; \
         `speedup_vs_torch` is PyTorch's time over the row's (>1: ours faster), from \
         `app/benches/backward_torch.py`{}. Naive launches per call (bf16): RMSNorm {} forward, {} backward; \
         matmul `dx` and `dw` {} (the cuBLAS GEMM), `dw+=f32` {}, `dx+swiglu` {}.\n\n{table}",
        environment(&info),
        match torch_version {
            Some(v) => format!(" ({v}, same GPU, same device call)"),
            None => " (not given: set `$TORCH_BACKWARD_CSV`)".into(),
        },
        rms_naive::kernel_count(DataType::BF16),
        rms_naive::backward_kernel_count(DataType::BF16, false),
        linear_naive::data_kernel_count(false),
        linear_naive::weight_kernel_count(true, false),
        linear_naive::SWIGLU_KERNELS,
    );
    // Attention has two PyTorch backends to compare with: the join above takes CUDNN_ATTENTION; the
    // FLASH_ATTENTION rows are listed here.
    let mut flash = String::new();
    for r in rows.iter().filter(|r| r.op == "sdpa" && r.backend == "fused") {
        let t = torch.iter().find(|t| {
            t.op == "sdpa"
                && t.shape == r.shape
                && t.model == r.model
                && t.phase == r.phase
                && t.backend == "flash"
        });
        if let Some(ms) = t.and_then(|t| t.ms) {
            flash += &format!(
                "| {} | {} | {} | {:.4} | {:.4} | {:.2}x |\n",
                r.model,
                r.shape,
                r.phase,
                r.ms,
                ms,
                ms / r.ms
            );
        }
    }
    let md = if flash.is_empty() {
        md
    } else {
        format!("{md}\n\nAttention against PyTorch's FLASH_ATTENTION backend (same device call):\n\n| model | shape | phase | fused ms | flash ms | flash / fused |\n|---|---|---|---|---|---|\n{flash}")
    };
    println!("\n{md}");
    write_results("backward", &csv, &md);
    Ok(())
}

/// Llama-3.2-1B's parameter shapes (tied embedding), as `backward_torch.py::llama_1b_shapes`.
fn llama_1b_shapes() -> Vec<usize> {
    let (h, i, kv, layers) = (2048, 8192, 8 * 64, 16);
    let mut shapes = vec![VOCAB * h, h];
    for _ in 0..layers {
        shapes.extend([h * h, kv * h, kv * h, h * h, i * h, i * h, h * i, h, h]);
    }
    shapes
}

/// The parameters, gradients and moments of one optimizer case.
struct OptimSet<P, G> {
    p: Vec<CudaSlice<P>>,
    g: Vec<CudaSlice<G>>,
    m: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
    tables: MultiTensor,
    norm: CudaSlice<f32>,
}

/// AdamW (`step`), then the gradient norm (`norm`) and `clip_grad_norm_` (`norm+clip`) on the same
/// gradients, over Llama-3.2-1B's parameters in `P`, gradients in `G`.
fn optim<P: Element, G: Element>(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    let shapes = llama_1b_shapes();
    let count: usize = shapes.iter().sum();
    let mut set = OptimSet::<P, G> {
        p: Vec::new(),
        g: Vec::new(),
        m: Vec::new(),
        v: Vec::new(),
        tables: MultiTensor::new(),
        norm: ctx.stream().alloc_zeros(2)?,
    };
    for (k, &n) in shapes.iter().enumerate() {
        set.p.push(random(ctx, n, 13 + k as u64, 0.02)?);
        set.g.push(random(ctx, n, 1000 + k as u64, 1e-3)?);
        set.m.push(ctx.stream().alloc_zeros(n)?);
        set.v.push(ctx.stream().alloc_zeros(n)?);
    }
    let dtype = P::DTYPE.name();
    let (p_size, g_size) = (P::DTYPE.size() as f64, G::DTYPE.size() as f64);
    let shape = format!("{count} params");
    let args = AdamWArgs::new(1e-4).with_betas(0.9, 0.95).with_eps(1e-8).with_weight_decay(0.1).with_step(1);
    // One step from zero moments first, so that m and v hold a step's state (v = (1 − β₂)·g² ≥ 0).
    step(ctx, &mut set, args, Backend::Fused)?;
    for backend in [Backend::Fused, Backend::Naive] {
        let case = Case {
            op: "adamw",
            model: "Llama-3.2-1B",
            shape: shape.clone(),
            dtype,
            phase: "step",
            backend: backend.name(),
            bytes: Some(count as f64 * (2.0 * p_size + g_size + 16.0)),
            flops: None,
            note: "p read + written, g read, f32 m and v read + written",
        };
        let args = args.with_step(2);
        b.time(case, || step(ctx, &mut set, args, backend))?;
    }
    let norm_args = GradNormArgs::clip(1.0);
    for (phase, clip, note) in
        [("norm", false, "g read"), ("norm+clip", true, "g read, then read + written by the clip")]
    {
        for backend in [Backend::Fused, Backend::Naive] {
            let case = Case {
                op: "grad_norm",
                model: "Llama-3.2-1B",
                shape: shape.clone(),
                dtype: G::DTYPE.name(),
                phase,
                backend: backend.name(),
                bytes: Some(count as f64 * g_size * if clip { 3.0 } else { 1.0 }),
                flops: None,
                note,
            };
            b.time(case, || {
                let OptimSet { g, tables, norm, .. } = &mut set;
                let x = if clip {
                    GradNormOperands::clip(
                        tables,
                        g.iter_mut().map(|g| g as &mut dyn DevicePtrMut<G>).collect(),
                        norm,
                    )
                } else {
                    GradNormOperands::new(tables, g.iter().map(|g| g as &dyn DevicePtr<G>).collect(), norm)
                };
                grad_norm(ctx, norm_args, x, backend)
            })?;
        }
    }
    Ok(())
}

/// One AdamW step over every tensor of `set`.
fn step<P: Element, G: Element>(
    ctx: &Cudnn,
    set: &mut OptimSet<P, G>,
    args: AdamWArgs,
    backend: Backend,
) -> Result<()> {
    let OptimSet { p, g, m, v, tables, .. } = set;
    let tensors = p
        .iter_mut()
        .zip(g.iter())
        .zip(m.iter_mut().zip(v.iter_mut()))
        .map(|((p, g), (m, v))| AdamWTensor::new(p, g, m, v))
        .collect();
    adamw(ctx, args, AdamWOperands::new(tables, tensors), backend)
}

/// RoPE forward and backward on the Q and K heads of a bf16 QKV buffer, 4 sequences of 4096.
fn rope_cases(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    for (model, hq, hkv, d) in [("Llama-3.1-8B", 32, 8, 128), ("Llama-3.2-1B", 32, 8, 64)] {
        let (batch, seq) = (4, TOKENS / 4);
        let half = d / 2;
        let angle = |i: usize| (i / half) as f64 * 500000f64.powf(-((2 * (i % half)) as f64) / d as f64);
        let cos: Vec<f64> = (0..seq * half).map(|i| angle(i).cos()).collect();
        let sin: Vec<f64> = (0..seq * half).map(|i| angle(i).sin()).collect();
        let tables = RopeTables::<bf16>::new(ctx, &cos, &sin, d)?;
        let row_stride = (hq + 2 * hkv) * d;
        let args = RopeArgs::new(batch, seq, hq, hkv, d).with_row_stride(row_stride);
        let mut qkv = random::<bf16>(ctx, batch * seq * row_stride, 21, 1.0)?;
        let shape = format!("b{batch} s{seq} h{hq}/{hkv} d{d}");
        let bytes = (2 * batch * seq * (hq + hkv) * d * 2) as f64;
        for phase in ["fwd", "bwd"] {
            for backend in [Backend::Fused, Backend::Naive] {
                let case = Case {
                    op: "rope",
                    model,
                    shape: shape.clone(),
                    dtype: "bf16",
                    phase,
                    backend: backend.name(),
                    bytes: Some(bytes),
                    flops: None,
                    note: "Q and K read + written",
                };
                b.time(case, || match phase {
                    "fwd" => rope(ctx, args, RopeOperands::new(&tables, &mut qkv), backend),
                    _ => rope_backward(ctx, args, RopeBackwardOperands::new(&tables, &mut qkv), backend),
                })?;
            }
        }
    }
    Ok(())
}

/// The embedding lookup and its backward into an f32 table gradient, 16384 tokens.
fn embedding_cases(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    for (model, hidden) in [("Llama-3.1-8B", 4096), ("Llama-3.2-1B", 2048)] {
        let args = EmbeddingArgs::new(TOKENS, VOCAB, hidden);
        let ids = ctx.stream().clone_htod(&token_ids(TOKENS, VOCAB, 7))?;
        let table = random::<bf16>(ctx, VOCAB * hidden, 22, 1.0)?;
        let mut y = ctx.stream().alloc_zeros::<bf16>(TOKENS * hidden)?;
        let dy = random::<bf16>(ctx, TOKENS * hidden, 23, 1.0)?;
        let mut dtable = ctx.stream().alloc_zeros::<f32>(VOCAB * hidden)?;
        let shape = format!("{TOKENS}x{hidden} vocab {VOCAB}");
        let fwd = Case {
            op: "embedding",
            model,
            shape: shape.clone(),
            dtype: "bf16",
            phase: "fwd",
            backend: "fused",
            bytes: Some((2 * TOKENS * hidden * 2) as f64),
            flops: None,
            note: "rows read, y written (one kernel on both backends)",
        };
        b.time(fwd, || embedding(ctx, args, EmbeddingOperands::new(&ids, &table, &mut y)))?;
        let runs = [
            (Backend::Fused, EmbeddingGrad::Atomic, "fused"),
            (Backend::Fused, EmbeddingGrad::Deterministic, "fused-det"),
            (Backend::Naive, EmbeddingGrad::Atomic, "naive"),
        ];
        for (backend, how, name) in runs {
            let case = Case {
                op: "embedding",
                model,
                shape: shape.clone(),
                dtype: "bf16",
                phase: "bwd",
                backend: name,
                bytes: Some((TOKENS * hidden * 2 + VOCAB * hidden * 4) as f64),
                flops: None,
                note: "dy read, f32 table gradient written",
            };
            b.time(case, || {
                let x = EmbeddingBackwardOperands::new(&ids, &dy, &mut dtable).how(how);
                embedding_backward(ctx, args, x, backend)
            })?;
        }
    }
    Ok(())
}

/// Cross-entropy over the Llama 3 vocabulary, bf16 logits: the loss alone and the loss with dlogits.
fn cross_entropy_cases(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    for tokens in [TOKENS, 4096] {
        let args = CrossEntropyArgs::new(tokens, VOCAB).with_ignore_index(-100);
        let logits = random::<bf16>(ctx, tokens * VOCAB, 11, 2.0)?;
        let targets: Vec<i32> = token_ids(tokens, VOCAB, 12)
            .iter()
            .enumerate()
            .map(|(k, &t)| if k % 7 == 0 { -100 } else { t as i32 })
            .collect();
        let targets = ctx.stream().clone_htod(&targets)?;
        let mut loss = ctx.stream().alloc_zeros::<f32>(1)?;
        let mut d = ctx.stream().alloc_zeros::<bf16>(tokens * VOCAB)?;
        let shape = format!("{tokens}x{VOCAB}");
        let n = (tokens * VOCAB * 2) as f64;
        for (phase, bytes, note) in [
            ("fwd", n, "bf16 logits read once"),
            ("fwd+bwd", 2.0 * n, "bf16 logits read once, dlogits written once"),
        ] {
            for backend in [Backend::Fused, Backend::Naive] {
                let case = Case {
                    op: "cross_entropy",
                    model: "Llama-3",
                    shape: shape.clone(),
                    dtype: "bf16",
                    phase,
                    backend: backend.name(),
                    bytes: Some(bytes),
                    flops: None,
                    note,
                };
                b.time(case, || {
                    let x = match phase {
                        "fwd" => CrossEntropyOperands::new(&logits, &targets, &mut loss),
                        _ => CrossEntropyOperands::with_grad(&logits, &mut d, &targets, &mut loss),
                    };
                    cross_entropy(ctx, args, x, backend)
                })?;
            }
        }
    }
    Ok(())
}

/// RMSNorm's training forward and backward, bf16, fused vs naive, shapes spelled as
/// `backward_torch.py::rmsnorm_cases` spells them (`"{tokens}x{hidden}"`): `fwd` (x and the weight
/// in; y and the f32 inverse RMS out), `bwd` (dy, x, the weight and the saved inverse RMS in; dx and
/// dweight out) and `fwd+bwd` (both, as a training step runs them). GB/s count those buffers once.
const RMSNORM_CASES: [(&str, usize, usize); 2] =
    [("Llama-3.1-8B", TOKENS, 4096), ("Llama-3.2-1B", TOKENS, 2048)];

fn rmsnorm(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    for (model, tokens, hidden) in RMSNORM_CASES {
        let args = RmsNormArgs::new(tokens, hidden, 1e-5);
        let n = tokens * hidden;
        let x = random::<bf16>(ctx, n, 31, 1.0)?;
        let w = random::<bf16>(ctx, hidden, 32, 1.0)?;
        let dy = random::<bf16>(ctx, n, 33, 1.0)?;
        let mut y = ctx.stream().alloc_zeros::<bf16>(n)?;
        let mut inv_rms = ctx.stream().alloc_zeros::<f32>(tokens)?;
        let mut dx = ctx.stream().alloc_zeros::<bf16>(n)?;
        let mut dw = ctx.stream().alloc_zeros::<bf16>(hidden)?;
        // The `bwd` rows read the statistic a training forward saved.
        rms_norm(ctx, args, RmsNormOperands::new(&x, &w, &mut y).inv_rms(&mut inv_rms), Backend::Fused)?;
        let (rows, row, stat) = ((n * 2) as f64, (hidden * 2) as f64, (tokens * 4) as f64);
        let (fwd, bwd) = (2.0 * rows + row + stat, 3.0 * rows + 2.0 * row + stat);
        let phases = [
            ("fwd", fwd, "x, weight read; y, f32 inverse RMS written"),
            ("bwd", bwd, "dy, x, weight, f32 inverse RMS read; dx, dweight written"),
            ("fwd+bwd", fwd + bwd, "the fwd and bwd rows' bytes"),
        ];
        for (phase, bytes, note) in phases {
            for backend in [Backend::Fused, Backend::Naive] {
                let case = Case {
                    op: "rmsnorm",
                    model,
                    shape: format!("{tokens}x{hidden}"),
                    dtype: "bf16",
                    phase,
                    backend: backend.name(),
                    bytes: Some(bytes),
                    flops: None,
                    note,
                };
                b.time(case, || {
                    if phase != "bwd" {
                        let fwd = RmsNormOperands::new(&x, &w, &mut y).inv_rms(&mut inv_rms);
                        rms_norm(ctx, args, fwd, backend)?;
                    }
                    if phase == "fwd" {
                        return Ok(());
                    }
                    let grads = RmsNormGrads::new(&dy, &x, &w, &inv_rms, &mut dx, &mut dw);
                    rms_norm_backward(ctx, args, grads, backend)
                })?;
            }
        }
    }
    Ok(())
}

/// SDPA backward rows go here with the op: causal top-left GQA, BSHD, batch 1, fused vs naive and
/// PyTorch's CUDNN_ATTENTION / FLASH_ATTENTION backends (`torch_backend` "cudnn" and "flash"),
/// `fwd+bwd` and `bwd`, TFLOP/s counting the causal half of 4·s²·d·h forward and 2.5 times that
/// backward; shapes as `backward_torch.py::sdpa_cases` (`"b1 s{s} h{hq}/{hkv} d{d} causal"`).
const SDPA_CASES: [(&str, usize, usize, usize, usize); 4] = [
    ("Llama-3.1-8B", 4096, 32, 8, 128),
    ("Llama-3.1-8B", 8192, 32, 8, 128),
    ("Llama-3.2-1B", 4096, 32, 8, 64),
    ("Llama-3.2-1B", 8192, 32, 8, 64),
];

fn sdpa_cases(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    for (model, s, hq, hkv, d) in SDPA_CASES {
        let args = SdpaArgs::new(1, hq, hkv, s, s, d, Layout::Bshd).with_mask(Mask::CausalTopLeft);
        let (nq, nkv) = (s * hq * d, s * hkv * d);
        let q = random::<bf16>(ctx, nq, 41, 1.0)?;
        let k = random::<bf16>(ctx, nkv, 42, 1.0)?;
        let v = random::<bf16>(ctx, nkv, 43, 1.0)?;
        let d_o = random::<bf16>(ctx, nq, 44, 1.0)?;
        let mut o = ctx.stream().alloc_zeros::<bf16>(nq)?;
        let mut stats = ctx.stream().alloc_zeros::<f32>(hq * s)?;
        let (mut dq, mut dk, mut dv) = (
            ctx.stream().alloc_zeros::<bf16>(nq)?,
            ctx.stream().alloc_zeros::<bf16>(nkv)?,
            ctx.stream().alloc_zeros::<bf16>(nkv)?,
        );
        // The `bwd` rows read the O and stats of one fused training forward.
        sdpa(ctx, args, SdpaOperands::new(&q, &k, &v, &mut o).stats(&mut stats), Backend::Fused)?;
        let fwd_flops = args.flops();
        let phases = [("fwd+bwd", 3.5 * fwd_flops), ("bwd", 2.5 * fwd_flops)];
        // The math path materializes f32 [h, s, s] scores (8.6 GB each at s 8192): naive at 4096 only.
        let backends: &[Backend] =
            if s <= 4096 { &[Backend::Fused, Backend::Naive] } else { &[Backend::Fused] };
        for (phase, flops) in phases {
            for &backend in backends {
                let case = Case {
                    op: "sdpa",
                    model,
                    shape: format!("b1 s{s} h{hq}/{hkv} d{d} causal"),
                    dtype: "bf16",
                    phase,
                    backend: backend.name(),
                    bytes: None,
                    flops: Some(flops),
                    note: "causal top-left, GQA, BSHD; the forward keeps its log-sum-exp stats",
                };
                b.time(case, || {
                    if phase == "fwd+bwd" {
                        sdpa(ctx, args, SdpaOperands::new(&q, &k, &v, &mut o).stats(&mut stats), backend)?;
                    }
                    let grads = SdpaGrads::new(&q, &k, &v, &o, &d_o, &mut dq, &mut dk, &mut dv).stats(&stats);
                    sdpa_backward(ctx, args, grads, backend)
                })?;
            }
        }
    }
    Ok(())
}

/// Linear gradients of Llama-3.1-8B's projections (gate and up share one shape, `gate_up`, as in
/// `app/benches/matmul.rs`), bf16, at [`MATMUL_TOKENS`], fused vs naive (one cuBLAS GEMM, and an add
/// kernel when accumulating): `dx` (dX = dY·W), `dw` (dW = dYᵀ·X into a bf16 gradient) and `dw+=f32`
/// (dW added to an f32 gradient accumulator); then, on the down projection's shape, `dx+swiglu`
/// ([`swiglu_rows`]). TFLOP/s count the GEMM's 2·T·in·out. Shapes as
/// `backward_torch.py::matmul_cases` (`"{name} {T}x{in}->{out}"`).
const MATMUL_CASES: [(&str, usize, usize); 4] =
    [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 14336), ("down", 14336, 4096)];
/// Tokens per step of the matmul rows: one sequence of 2048, and [`TOKENS`].
const MATMUL_TOKENS: [usize; 2] = [2048, TOKENS];

fn matmul(b: &mut Bench) -> Result<()> {
    let ctx = b.ctx;
    for tokens in MATMUL_TOKENS {
        for (name, inp, out) in MATMUL_CASES {
            let args = LinearGradArgs::new(tokens, inp, out);
            let dy = random::<bf16>(ctx, tokens * out, 41, 1.0)?;
            let w = random::<bf16>(ctx, out * inp, 42, 0.02)?;
            let x = random::<bf16>(ctx, tokens * inp, 43, 1.0)?;
            let mut dx = ctx.stream().alloc_zeros::<bf16>(tokens * inp)?;
            let mut dw = ctx.stream().alloc_zeros::<bf16>(out * inp)?;
            let mut dw32 = ctx.stream().alloc_zeros::<f32>(out * inp)?;
            let shape = format!("{name} {tokens}x{inp}->{out}");
            let phases = [
                ("dx", "dX = dY·W"),
                ("dw", "dW = dYᵀ·X, bf16"),
                ("dw+=f32", "dW = dYᵀ·X added to an f32 gradient (naive: GEMM, then an add kernel)"),
            ];
            for (phase, note) in phases {
                for backend in [Backend::Fused, Backend::Naive] {
                    let case = Case {
                        op: "matmul",
                        model: "Llama-3.1-8B",
                        shape: shape.clone(),
                        dtype: "bf16",
                        phase,
                        backend: backend.name(),
                        bytes: None,
                        flops: Some(args.flops()),
                        note,
                    };
                    b.time(case, || match phase {
                        "dx" => linear_backward_data(ctx, &args, DataGrad::new(&dy, &w, &mut dx), backend),
                        "dw" => {
                            linear_backward_weight(ctx, &args, WeightGrad::new(&dy, &x, &mut dw), backend)
                        }
                        _ => {
                            let grads = WeightGrad::new(&dy, &x, &mut dw32);
                            linear_backward_weight(ctx, &args.accumulating(), grads, backend)
                        }
                    })?;
                }
            }
            if name == "down" {
                swiglu_rows(b, &args, &shape, &dy, &w)?;
            }
        }
    }
    Ok(())
}

/// The SwiGLU backward through the down projection (`args`, its `dy` and weight `w`), phase
/// `dx+swiglu`: d_gate and d_up from d_act = dY·W_down and the forward's gate and up. Fused: the data
/// gradient's graph with the SwiGLU steps after the matmul (or, where cuDNN refuses that graph, the
/// split form: the matmul into f32, then a pointwise graph; the note says which); naive: the cuBLAS
/// GEMM and four elementwise kernels.
fn swiglu_rows(
    b: &mut Bench,
    args: &LinearGradArgs,
    shape: &str,
    dy: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
) -> Result<()> {
    let ctx = b.ctx;
    let n = args.tokens * args.in_features;
    let gate = random::<bf16>(ctx, n, 44, 2.0)?;
    let up = random::<bf16>(ctx, n, 45, 1.0)?;
    let mut d_gate = ctx.stream().alloc_zeros::<bf16>(n)?;
    let mut d_up = ctx.stream().alloc_zeros::<bf16>(n)?;
    for backend in [Backend::Fused, Backend::Naive] {
        let note = match backend {
            Backend::Naive => "cuBLAS GEMM, then silu, 2 muls, silu backward (eager's kernels)",
            Backend::Fused => match args.swiglu_form(ctx, <bf16 as Element>::DTYPE)? {
                SwigluForm::Fused => "one graph: the matmul, then the SwiGLU backward on its f32 result",
                SwigluForm::Split => "split: the matmul into f32, then a pointwise graph (one graph refused)",
                other => other.name(),
            },
        };
        let case = Case {
            op: "matmul",
            model: "Llama-3.1-8B",
            shape: shape.to_string(),
            dtype: "bf16",
            phase: "dx+swiglu",
            backend: backend.name(),
            bytes: None,
            flops: Some(args.flops()),
            note,
        };
        b.time(case, || {
            let grads = SwigluGrads::new(dy, w, &gate, &up, &mut d_gate, &mut d_up);
            swiglu_down_backward(ctx, args, grads, backend)
        })?;
    }
    Ok(())
}
