//! Batch-1 decode against the memory roofline: Llama-3.1-8B shapes with random weights (all 32 layers
//! unless `LAYERS` is given), a 512-token prompt, then fused decode steps launched plainly and replayed
//! as one CUDA graph per step, beside the floor (weight + KV bytes over the measured copy bandwidth),
//! and which attention the fused decode runs (`examples/06-decode-attention.rs` times it alone):
//! `cargo run --release --features app --example 05-decode [-- LAYERS]` on a GPU machine.
use cudnn_llm::bench_util::{copy_bandwidth_gbps, median, wall_ms};
use cudnn_llm::half::bf16;
use cudnn_llm::llama::roofline::DecodeRoofline;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver};
use cudnn_llm::{Backend, Cudnn, Layout, SdpaArgs};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Cudnn::new(0)?;
    let layers = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(layers);
    let (prompt_len, steps) = (512, 64);
    let max_seq = prompt_len + 2 * steps + 2;
    let mut model = Llama::new(&ctx, &cfg, &Weights::<bf16>::random(&cfg, 0), max_seq)?;
    let fused = Backends::all(Backend::Fused);
    let prompt = vec![(0..prompt_len as u32).map(|t| (t * 7919) % cfg.vocab as u32).collect::<Vec<_>>()];
    let mut cache = model.cache(&ctx, 1, max_seq)?;
    model.forward(&ctx, &prompt, &mut cache, &fused, &mut NoObserver)?;
    // A plain step first: plans are built and kernels loaded outside the capture.
    model.forward(&ctx, &[vec![1]], &mut cache, &fused, &mut NoObserver)?;
    model.logits(&ctx, 1, &fused, &mut NoObserver)?;
    // SAFETY: one thread, no other stream of this context.
    let mut graph = unsafe { model.capture_decode(&ctx, &mut cache, &fused) }?;
    let at = cache.len();
    let (mut plain, mut replay) = (Vec::new(), Vec::new());
    for step in 0..steps {
        // Both at the same cache lengths, alternating.
        let token = 100 + step as u32;
        cache.truncate(at + step);
        plain.push(wall_ms(&ctx, || -> Result<(), cudnn_llm::llama::Error> {
            model.forward(&ctx, &[vec![token]], &mut cache, &fused, &mut NoObserver)?;
            model.logits(&ctx, 1, &fused, &mut NoObserver)?;
            Ok(())
        })?);
        cache.truncate(at + step);
        replay.push(wall_ms(&ctx, || model.decode(&ctx, &mut graph, &[token], &mut cache).map(drop))?);
    }
    let copy = copy_bandwidth_gbps(&ctx, 1 << 30, 20)?;
    let roof = DecodeRoofline::new(&cfg, 1, at + steps / 2, 2);
    let (plain, replay) = (median(plain), median(replay));
    println!("{}: {} layers, batch 1, {} cached tokens, bf16, fused", cfg.name, layers, at + steps / 2);
    // What the fused backend runs for a decode step's attention (one query over the whole cache, the
    // lengths on the device, as the model calls it).
    let attention = SdpaArgs::new(1, cfg.heads, cfg.kv_heads, 1, max_seq, cfg.head_dim, Layout::Bshd)
        .with_seq_lens()
        .fused_kernel(ctx.features(), false);
    println!("decode attention: {} (one query over the {max_seq}-position cache)", attention.name());
    println!(
        "copy bandwidth {copy:.0} GB/s; floor {:.3} ms ({:.2} GB)",
        roof.floor_ms(copy),
        roof.bytes() as f64 / 1e9
    );
    for (what, ms) in [("plain launches", plain), ("graph replay", replay)] {
        println!(
            "{what:>15}: {ms:.3} ms per step (with logits), {:.1}% of the roofline",
            100.0 * roof.fraction(ms, copy)
        );
    }
    Ok(())
}
