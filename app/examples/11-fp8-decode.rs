//! A Llama decoder with FP8 projections against bf16 on one GPU: the same random checkpoint (Llama-3.1-8B
//! shapes unless a preset is given: `8b`, `1b`, `smollm2`), all layers unless `LAYERS` is given.
//!
//! - Decode: batch 1 after a 512-token prompt, one step replayed as a CUDA graph (with logits), the
//!   median over 64 steps, beside the memory floor (weights and K/V over the measured copy bandwidth;
//!   projections a byte an element and a factor per output row in FP8, `DecodeRoofline::fp8`).
//! - Prefill of 2048 tokens (with the last row's logits), wall time, median of 3 after a warm-up.
//! - Accuracy: the FP8 model's logits against the bf16 model's over the prompt's last row and the 64
//!   steps (rel L2, top-1 agreement), both fed the same tokens.
//!
//! `cargo run --release --example 11-fp8-decode [-- PRESET [LAYERS]]`; writes `fp8-decode.{csv,md}` to
//! `$BENCH_RESULTS_DIR` (default `benches/results`).
use cudnn_llm::cudnn_ops::WeightScales;
use cudnn_llm::half::bf16;
use cudnn_llm::llama::roofline::DecodeRoofline;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, KvCache, Llama, LlamaConfig, NoObserver};
use cudnn_llm::{reference, Backend, Cudnn};
use cudnn_llm_app::bench_util::{
    copy_bandwidth_gbps, csv_and_markdown, environment, median, round, wall_ms, write_results,
};
use std::fmt::Write as _;

type Error = Box<dyn std::error::Error>;

const PROMPT: usize = 512;
const STEPS: usize = 64;
const PREFILL: usize = 2048;

/// What one dtype's model did: decode step and prefill times, and its logits in order.
struct Run {
    step_ms: f64,
    prefill_ms: f64,
    logits: Vec<Vec<f32>>,
}

fn main() -> Result<(), Error> {
    let ctx = Cudnn::new(0)?;
    let mut args = std::env::args().skip(1);
    let preset = args.next().unwrap_or_else(|| "8b".into());
    let cfg = match preset.as_str() {
        "8b" => LlamaConfig::llama_3_1_8b(),
        "1b" => LlamaConfig::llama_3_2_1b(),
        other => return Err(format!("unknown preset `{other}`: 8b or 1b").into()),
    };
    let cfg = match args.next() {
        Some(l) => cfg.with_layers(l.parse()?),
        None => cfg,
    };
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let max_seq = PREFILL.max(PROMPT + STEPS + 2);
    let weights = Weights::<bf16>::random(&cfg, 0);
    let mut model = Llama::new(&ctx, &cfg, &weights, max_seq)?;
    drop(weights);
    let bf16_bytes = model.linear_weight_bytes();
    let bf = run(&ctx, &cfg, &mut model, max_seq)?;
    model.quantize_to_fp8(&ctx, WeightScales::PerChannel)?;
    let fp8_bytes = model.linear_weight_bytes();
    let f8 = run(&ctx, &cfg, &mut model, max_seq)?;
    // Accuracy: every logits row of FP8 against bf16.
    let (mut top1, mut rel) = (0, Vec::new());
    for (a, b) in f8.logits.iter().zip(&bf.logits) {
        let c = reference::compare(a, &b.iter().map(|&v| v as f64).collect::<Vec<_>>());
        rel.push(c.rel_l2);
        top1 += usize::from(argmax(a) == argmax(b));
    }
    let copy = copy_bandwidth_gbps(&ctx, 1 << 30, 20)?;
    let cached = PROMPT + STEPS / 2;
    let floors = [DecodeRoofline::new(&cfg, 1, cached, 2), DecodeRoofline::fp8(&cfg, 1, cached, 2)];
    let mut rows = Vec::new();
    for ((dtype, r, bytes), roof) in
        [("bf16", &bf, bf16_bytes), ("fp8", &f8, fp8_bytes)].into_iter().zip(floors)
    {
        rows.push(Row {
            gpu: info.name.clone(),
            driver: info.driver_version,
            cudnn: info.cudnn_version_string(),
            model: cfg.name.clone(),
            layers: cfg.layers,
            dtype: dtype.into(),
            linear_gb: round(bytes as f64 / 1e9, 3),
            decode_ms: round(r.step_ms, 4),
            floor_ms: round(roof.floor_ms(copy), 4),
            pct_of_floor: round(100.0 * roof.fraction(r.step_ms, copy), 1),
            prefill_ms: round(r.prefill_ms, 2),
        });
    }
    let mut md = String::new();
    writeln!(md, "## {} ({} layers, random weights): FP8 projections against bf16\n", cfg.name, cfg.layers)?;
    writeln!(
        md,
        "GPU {}, driver {}, cuDNN {}, build {}. Device copy (1 GiB): {copy:.0} GB/s. Decode: batch 1, {PROMPT}-token \
         prompt, one step with logits replayed as a CUDA graph, median of {STEPS}; the floor is the step's bytes \
         over the copy bandwidth. Prefill: {PREFILL} tokens with the last row's logits, wall, median of 3. FP8: \
         E4M3 projections with a factor per output row (`Llama::quantize_to_fp8`); embedding, lm_head, norms and the \
         K/V cache in bf16.\n",
        info.name,
        info.driver_version,
        info.cudnn_version_string(),
        cudnn_llm_app::BUILD.git_revision
    )?;
    writeln!(md, "| dtype | projection GB | decode ms | floor ms | % of floor | prefill ms |")?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|")?;
    for r in &rows {
        writeln!(
            md,
            "| {} | {:.3} | {:.4} | {:.4} | {:.1}% | {:.2} |",
            r.dtype, r.linear_gb, r.decode_ms, r.floor_ms, r.pct_of_floor, r.prefill_ms
        )?;
    }
    let mid = {
        let mut r = rel.clone();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    writeln!(
        md,
        "\nFP8 against bf16 logits over {} rows (the prompt's last, then each step, same tokens): rel L2 median \
         {mid:.4}, max {:.4}; top-1 agrees on {top1} of {}.\nDecode FP8 / bf16: {:.2}x faster; prefill FP8 / bf16: \
         {:.2}x.",
        rel.len(),
        rel.iter().cloned().fold(0.0, f64::max),
        rel.len(),
        bf.step_ms / f8.step_ms,
        bf.prefill_ms / f8.prefill_ms
    )?;
    println!("\n{md}");
    let (csv, _) = csv_and_markdown(&rows)?;
    write_results(&format!("fp8-decode-{preset}"), &csv, &md);
    Ok(())
}

/// Times `model`'s decode step (replayed) and prefill, and keeps its logits over the prompt's last row
/// and each step (fed the same tokens whatever the model picks).
fn run(ctx: &Cudnn, cfg: &LlamaConfig, model: &mut Llama<bf16>, max_seq: usize) -> Result<Run, Error> {
    let fused = Backends::all(Backend::Fused);
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|t| (t * 7919) % cfg.vocab as u32).collect();
    let token = |s: usize| (100 + 31 * s as u32) % cfg.vocab as u32;
    let mut cache: KvCache<bf16> = model.cache(ctx, 1, max_seq)?;
    model.forward(ctx, std::slice::from_ref(&prompt), &mut cache, &fused, &mut NoObserver)?;
    let mut logits = vec![ctx.stream().clone_dtoh(&model.logits(ctx, 1, &fused, &mut NoObserver)?)?];
    // A plain step builds what the step needs outside the capture.
    model.forward(ctx, &[vec![token(0)]], &mut cache, &fused, &mut NoObserver)?;
    model.logits(ctx, 1, &fused, &mut NoObserver)?;
    cache.truncate_to(PROMPT);
    // SAFETY: one thread, no other stream of this context.
    let mut graph = unsafe { model.capture_decode(ctx, &mut cache, &fused) }?;
    // The logits of each step first, then the same steps timed alone.
    for s in 0..STEPS {
        let out = model.decode(ctx, &mut graph, &[token(s)], &mut cache)?;
        logits.push(ctx.stream().clone_dtoh(out)?);
    }
    cache.truncate_to(PROMPT);
    let mut times = Vec::new();
    for s in 0..STEPS {
        times.push(wall_ms(ctx, || model.decode(ctx, &mut graph, &[token(s)], &mut cache).map(drop))?);
    }
    let step_ms = median(times);
    let long: Vec<u32> = (0..PREFILL as u32).map(|t| (t * 104729 + 17) % cfg.vocab as u32).collect();
    let mut prefill = Vec::new();
    for i in 0..4 {
        cache.truncate_to(0);
        let ms = wall_ms(ctx, || -> Result<(), cudnn_llm::llama::Error> {
            model.forward(ctx, std::slice::from_ref(&long), &mut cache, &fused, &mut NoObserver)?;
            model.logits(ctx, 1, &fused, &mut NoObserver)?;
            Ok(())
        })?;
        if i > 0 {
            prefill.push(ms);
        }
    }
    let logits = logits.iter().map(|row| row.iter().map(|v| v.to_f32()).collect()).collect();
    Ok(Run { step_ms, prefill_ms: median(prefill), logits })
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i)
}

/// One line of `fp8-decode-<preset>.csv`.
#[derive(serde::Serialize)]
struct Row {
    gpu: String,
    driver: i32,
    cudnn: String,
    model: String,
    layers: usize,
    dtype: String,
    linear_gb: f64,
    decode_ms: f64,
    floor_ms: f64,
    pct_of_floor: f64,
    prefill_ms: f64,
}
