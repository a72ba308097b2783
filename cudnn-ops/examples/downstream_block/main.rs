//! A Llama-3.2-1B-shaped decoder block on `cudnn-llm-ops`' public API (`block.rs`), with random weights:
//! a prefill of two prompts of different lengths into one KV cache, then decode steps with each
//! sequence at its own position. `cargo run -p cudnn-llm-ops --release --example downstream_block` on a
//! GPU machine; `tests/downstream_block.rs` checks the same block against an f64 reference.

mod block;

use block::{random_bf16, Block, HostWeights, Shape};
use cudnn_llm_ops::half::bf16;
use cudnn_llm_ops::{Backend, Cudnn, KvCache, Llama3Scaling, RopeFrequencies, RopeTables};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Cudnn::new(0)?;
    let shape = Shape::llama_3_2_1b();
    let (batch, prompt, max_seq) = (2, 16, 64);
    let freqs =
        RopeFrequencies::new(shape.head_dim, 500_000.0)?.llama3(Llama3Scaling::new(32.0, 1.0, 4.0, 8192))?;
    let rope = RopeTables::<bf16>::from_frequencies(&ctx, &freqs, max_seq)?;
    let block = Block::new(&ctx, shape, 0, &HostWeights::random(&shape, 1))?;
    let mut cache = KvCache::<bf16>::new(&ctx, shape.cache(batch, max_seq)?)?;
    let upload = |seq: usize, seed: u64| -> Result<_, cudnn_llm_ops::Error> {
        let x: Vec<bf16> =
            random_bf16(seed, batch * seq * shape.hidden, 1.0, 0.0).into_iter().map(bf16::from_f64).collect();
        Ok(ctx.stream().clone_htod(&x)?)
    };

    // Prefill both prompts padded to 16 tokens, then keep the second one's own 11.
    let (x, mut out) = (upload(prompt, 7)?, upload(prompt, 0)?);
    let t = Instant::now();
    cache.begin(&ctx, prompt)?;
    let form = block.forward(&ctx, &mut cache, &rope, &x, &mut out, Backend::Fused)?;
    cache.finish()?;
    ctx.stream().synchronize()?;
    println!("prefill {batch} x {prompt}: {:.1} ms ({}, cold)", t.elapsed().as_secs_f64() * 1e3, form.name());
    cache.truncate(&[prompt, 11])?;

    for step in 0..4 {
        let (x, mut out) = (upload(1, 100 + step)?, upload(1, 0)?);
        let t = Instant::now();
        cache.begin(&ctx, 1)?;
        let form = block.forward(&ctx, &mut cache, &rope, &x, &mut out, Backend::Fused)?;
        cache.finish()?;
        ctx.stream().synchronize()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        println!("decode step {step}, cached {:?}: {ms:.2} ms ({})", cache.lens(), form.name());
    }
    if let Some(why) = cache.padded_refusal() {
        println!("decode attention ran a plan per length: {why}");
    }
    Ok(())
}
