//! Fused RMSNorm in a few lines: `cargo run --release --example 01-rmsnorm` on a GPU machine.
use cudnn_llm::half::bf16;
use cudnn_llm::{rms_norm, Backend, Cudnn, RmsNormArgs, RmsNormOperands};

fn main() -> cudnn_llm::Result<()> {
    let ctx = Cudnn::new(0)?; // handle + stream + plan cache + workspace; an error (not a panic) without a GPU
    let (tokens, hidden) = (30, 4096);
    let x = ctx.stream().clone_htod(&vec![bf16::from_f32(0.5); tokens * hidden])?;
    let w = ctx.stream().clone_htod(&vec![bf16::ONE; hidden])?;
    let mut y = ctx.stream().alloc_zeros::<bf16>(tokens * hidden)?;
    for _ in 0..3 {
        // The plan is built on the first call and taken from the cache afterwards.
        let args = RmsNormArgs::new(tokens, hidden, 1e-5);
        rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut y), Backend::Fused)?;
    }
    let out = ctx.stream().clone_dtoh(&y)?;
    println!("y[0] = {} (expected ~1), cache {:?}", out[0], ctx.cache().stats());
    Ok(())
}
