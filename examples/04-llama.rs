//! Llama-3.2-1B with random weights: a prefill and 16 decode steps, all-naive then all-fused, with
//! times: `cargo run --release --example 04-llama [-- SELECTION]` on a GPU machine (SELECTION is a
//! backend string such as `fused=prenorm,gqa`; the default compares `naive=all` with `fused=all`).
use cudnn_llm::half::bf16;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver};
use cudnn_llm::Cudnn;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Cudnn::new(0)?; // an error (not a panic) without a GPU
    let cfg = LlamaConfig::llama_3_2_1b();
    let t = Instant::now();
    let weights = Weights::<bf16>::random(&cfg, 0);
    let mut model = Llama::new(&ctx, &cfg, &weights, 512)?;
    println!("{}: {} parameters, ready in {:.1} s", cfg.name, cfg.parameters(), t.elapsed().as_secs_f64());
    let selections: Vec<String> = match std::env::args().nth(1) {
        Some(s) => vec![s],
        None => vec!["".into(), "fused=all".into()],
    };
    let prompt: Vec<Vec<u32>> = (0..3).map(|b| (0..10).map(|t| 1000 + 37 * b + t).collect()).collect();
    for sel in &selections {
        let backends = Backends::parse(sel)?;
        let mut cache = model.cache(&ctx, prompt.len(), 64)?;
        // The first pass builds plans and compiles kernels; the second is timed.
        let mut times = (0.0, 0.0);
        for _ in 0..2 {
            cache.clear();
            let t = Instant::now();
            model.forward(&ctx, &prompt, &mut cache, &backends, &mut NoObserver)?;
            ctx.synchronize()?;
            let prefill = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            for step in 0..16u32 {
                let next: Vec<Vec<u32>> =
                    (0..prompt.len() as u32).map(|b| vec![2000 + 10 * b + step]).collect();
                model.forward(&ctx, &next, &mut cache, &backends, &mut NoObserver)?;
            }
            ctx.synchronize()?;
            times = (prefill, t.elapsed().as_secs_f64() * 1e3 / 16.0);
        }
        let name = if sel.is_empty() { "naive=all" } else { sel };
        println!("{name:>12}: prefill 3 x 10 tokens {:.2} ms, decode {:.2} ms per step", times.0, times.1);
    }
    for f in model.fallbacks() {
        println!("fallback: {} layer {:?} ({}): {}", f.range, f.layer, f.shape, f.reason);
    }
    Ok(())
}
