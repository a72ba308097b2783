//! `cargo bench --bench sdpa`: fused (cuDNN) vs naive (PyTorch math path: repeat K/V, cuBLAS, f32
//! scores, separate scale/mask/softmax kernels) attention, bf16, batch 1, BSHD storage, with the
//! Llama-3.2-1B (32 query heads, 8 K/V heads, d 64) and Llama-3.1-8B (32, 8, d 128) heads: causal
//! prefill at s in {512, 2048, 4096, 8192} and a decode step (s_q 1 against s_kv 4096, bottom-right
//! causal), plus the unmasked 8B shape at s 2048 in both graph forms.
//!
//! Criterion times each case with CUDA events; a summary then measures medians, TFLOP/s (causal
//! square attention counts half of 4·b·h·s_q·s_kv·d), the plan build, and writes `sdpa.csv` / `sdpa.md`
//! to `$BENCH_RESULTS_DIR`. If `$TORCH_SDPA_CSV` names the output of `app/benches/sdpa_torch.py` (run on the
//! same GPU just before), PyTorch's CUDNN_ATTENTION and FLASH_ATTENTION times join the table.
//! `SDPA_BENCH_FILTER=8B` keeps only cases whose label contains the text.

use criterion::Criterion;
use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::{
    reference, sdpa, Backend, Cudnn, DataType, Error, Layout, Mask, Result, SdpaArgs, SdpaForm, SdpaKernel,
    SdpaOperands,
};
use cudnn_llm_app::bench_util::{
    bench_main, csv_and_markdown, environment, gpu_time_ms, median_call_ms, round, upload, write_results,
};
use half::bf16;
use serde::{Deserialize, Serialize};
use std::time::Duration;

struct Case {
    label: String,
    model: &'static str,
    args: SdpaArgs,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    /// Naive attention fits in device memory.
    naive_ok: bool,
}

impl Case {
    fn new(ctx: &Cudnn, model: &'static str, args: SdpaArgs, form: &str) -> Result<Self> {
        let q_len = args.batch * args.heads_q * args.seq_q * args.head_dim;
        let kv_len = args.batch * args.heads_kv * args.seq_kv * args.head_dim;
        let (q, _) = upload(ctx, &reference::random_values(1, q_len))?;
        let (k, _) = upload(ctx, &reference::random_values(2, kv_len))?;
        let (v, _) = upload(ctx, &reference::random_values(3, kv_len))?;
        let o = ctx.stream().alloc_zeros(q_len)?;
        let label = format!(
            "{model}/{}/sq{}/skv{}{}",
            args.mask.name(),
            args.seq_q,
            args.seq_kv,
            if form.is_empty() { String::new() } else { format!("/{form}") }
        );
        Ok(Case { label, model, args, q, k, v, o, naive_ok: true })
    }

    fn run(&mut self, ctx: &Cudnn, backend: Backend) -> Result<()> {
        sdpa(ctx, self.args, SdpaOperands::new(&self.q, &self.k, &self.v, &mut self.o), backend)
    }
}

fn cases(ctx: &Cudnn) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for (model, d) in [("Llama-3.2-1B", 64), ("Llama-3.1-8B", 128)] {
        for s in [512, 2048, 4096, 8192] {
            let a = SdpaArgs::new(1, 32, 8, s, s, d, Layout::Bshd).with_mask(Mask::CausalTopLeft);
            out.push(Case::new(ctx, model, a, "")?);
        }
        let decode = SdpaArgs::new(1, 32, 8, 1, 4096, d, Layout::Bshd).with_mask(Mask::CausalBottomRight);
        out.push(Case::new(ctx, model, decode, "")?);
        // The fused decode runs the split-KV kernel; cuDNN's graph beside it.
        out.push(Case::new(ctx, model, decode.with_form(SdpaForm::Unified), "unified")?);
    }
    for form in [SdpaForm::Unified, SdpaForm::Composite] {
        let a = SdpaArgs::new(1, 32, 8, 2048, 2048, 128, Layout::Bshd).with_form(form);
        out.push(Case::new(ctx, "Llama-3.1-8B", a, form.name())?);
    }
    let filter = std::env::var("SDPA_BENCH_FILTER").unwrap_or_default();
    out.retain(|c| c.label.contains(&filter));
    Ok(out)
}

/// A row of `app/benches/sdpa_torch.py`'s CSV.
#[derive(Deserialize)]
struct TorchRow {
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    seq_q: usize,
    seq_kv: usize,
    mask: String,
    backend: String,
    ms: Option<f64>,
    torch: Option<String>,
}

fn torch_times() -> Vec<TorchRow> {
    let Ok(path) = std::env::var("TORCH_SDPA_CSV") else { return Vec::new() };
    match csv::Reader::from_path(&path) {
        Ok(mut r) => r.deserialize().filter_map(|row| row.ok()).collect(),
        Err(e) => {
            eprintln!("cannot read {path}: {e}");
            Vec::new()
        }
    }
}

#[derive(Serialize)]
struct Row {
    model: &'static str,
    mask: &'static str,
    seq_q: usize,
    seq_kv: usize,
    form: String,
    engine: String,
    fused_ms: f64,
    fused_tflops: f64,
    naive_ms: Option<f64>,
    naive_tflops: Option<f64>,
    speedup_vs_naive: Option<f64>,
    torch_cudnn_ms: Option<f64>,
    torch_flash_ms: Option<f64>,
    fused_vs_torch_cudnn: Option<f64>,
    fused_vs_torch_flash: Option<f64>,
    plan_build_ms: f64,
}

fn main() {
    bench_main("sdpa bench", run);
}

fn run(ctx: &Cudnn) -> Result<()> {
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let mut cases = cases(ctx)?;
    // First calls: plan builds, and a fused-vs-naive agreement check wherever naive fits.
    for c in cases.iter_mut() {
        c.run(ctx, Backend::Fused)?;
        let fused: Vec<bf16> = ctx.stream().clone_dtoh(&c.o)?;
        match c.run(ctx, Backend::Naive) {
            Ok(()) => {
                let naive: Vec<f64> = ctx.stream().clone_dtoh(&c.o)?.iter().map(|v| v.to_f64()).collect();
                let cmp = reference::compare(&fused, &naive);
                println!("{}: fused vs naive {cmp}", c.label);
                if !cmp.passes(reference::Tolerance::rel_l2(2e-2)) {
                    return Err(Error::InvalidArgument(format!(
                        "{}: fused and naive disagree: {cmp}",
                        c.label
                    )));
                }
            }
            Err(e @ Error::OutOfMemory { .. }) => {
                println!("{}: naive skipped: {e}", c.label);
                c.naive_ok = false;
            }
            Err(e) => return Err(e),
        }
    }

    let mut crit = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10)
        .configure_from_args();
    for c in cases.iter_mut() {
        for backend in [Backend::Fused, Backend::Naive] {
            if backend == Backend::Naive && !c.naive_ok {
                continue;
            }
            let name = format!("sdpa/{}/{}", backend.name(), c.label);
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
    let torch_ms = |a: &SdpaArgs, backend: &str| {
        torch
            .iter()
            .find(|t| {
                (t.heads_q, t.heads_kv, t.head_dim, t.seq_q, t.seq_kv)
                    == (a.heads_q, a.heads_kv, a.head_dim, a.seq_q, a.seq_kv)
                    && t.mask == a.mask.name()
                    && t.backend == backend
            })
            .and_then(|t| t.ms)
    };
    let mut rows = Vec::new();
    for c in cases.iter_mut() {
        let flops = c.args.flops();
        // Batch enough calls per CUDA-event sample to cover about a millisecond.
        let probe = median_call_ms(ctx, 3, 3, 1, || c.run(ctx, Backend::Fused))?;
        let batch = (1.0 / probe).ceil().clamp(1.0, 200.0) as usize;
        let fused = median_call_ms(ctx, 10, 21, batch, || c.run(ctx, Backend::Fused))?;
        let naive = if c.naive_ok {
            Some(median_call_ms(ctx, 3, 11, 1, || c.run(ctx, Backend::Naive))?)
        } else {
            None
        };
        let plan = c.args.plan(ctx, DataType::BF16, false)?;
        let tflops = |ms: f64| round(flops / (ms * 1e-3) / 1e12, 1);
        let (tc, tf) = (torch_ms(&c.args, "cudnn"), torch_ms(&c.args, "flash"));
        rows.push(Row {
            model: c.model,
            mask: c.args.mask.name(),
            seq_q: c.args.seq_q,
            seq_kv: c.args.seq_kv,
            form: match c.args.fused_kernel(ctx.features(), false) {
                SdpaKernel::SplitKv => SdpaKernel::SplitKv.name().to_string(),
                _ => plan.form().to_string(),
            },
            engine: match c.args.fused_kernel(ctx.features(), false) {
                SdpaKernel::SplitKv => "custom kernel".to_string(),
                _ => plan.engine().to_string(),
            },
            fused_ms: round(fused, 4),
            fused_tflops: tflops(fused),
            naive_ms: naive.map(|n| round(n, 3)),
            naive_tflops: naive.map(tflops),
            speedup_vs_naive: naive.map(|n| round(n / fused, 1)),
            torch_cudnn_ms: tc.map(|t| round(t, 4)),
            torch_flash_ms: tf.map(|t| round(t, 4)),
            fused_vs_torch_cudnn: tc.map(|t| round(t / fused, 3)),
            fused_vs_torch_flash: tf.map(|t| round(t / fused, 2)),
            plan_build_ms: round(plan.build_time().as_secs_f64() * 1e3, 1),
        });
    }
    let (csv, table) = csv_and_markdown(&rows).map_err(|e| Error::InvalidArgument(format!("csv: {e}")))?;
    let md = format!(
        "## Attention forward, bf16, batch 1, 32 query heads, 8 K/V heads, BSHD\n\n{}\n\n\
         Medians of CUDA-event samples after warm-up. TFLOP/s count 4·b·h_q·s_q·s_kv·d, halved for causal \
         prefill. `fused_vs_torch_*` is PyTorch's time over ours (>1: ours faster), measured in the same device \
         call by `app/benches/sdpa_torch.py`{}. `plan_build_ms` is the cold build of the fused plan.\n\n{table}",
        environment(&info),
        match torch.first().and_then(|t| t.torch.clone()) {
            Some(v) => format!(", {v}"),
            None => " (not run this time)".into(),
        }
    );
    println!("\n{md}");
    write_results("sdpa", &csv, &md);
    Ok(())
}
