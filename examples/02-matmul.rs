//! A Llama MLP's projections as fused matmul graphs: `cargo run --release --example 02-matmul` on a GPU
//! machine. `h + down(silu(gate(x)) ⊙ up(x))` is two Linear matmuls with epilogues plus the plain `up`.
use cudnn_llm::half::bf16;
use cudnn_llm::{matmul, Backend, Cudnn, Epilogue, MatmulArgs, MatmulOperands};

fn main() -> cudnn_llm::Result<()> {
    let ctx = Cudnn::new(0)?; // an error (not a panic) without a GPU
    let (tokens, hidden, ffn) = (30, 4096, 14336);
    let stream = ctx.stream();
    let x = stream.clone_htod(&vec![bf16::from_f32(0.5); tokens * hidden])?;
    // The residual stream, and weights stored as PyTorch's Linear does: [out_features, in_features].
    let h = stream.clone_htod(&vec![bf16::ONE; tokens * hidden])?;
    let w_gate = stream.clone_htod(&vec![bf16::from_f32(1e-3); ffn * hidden])?;
    let w_up = stream.clone_htod(&vec![bf16::from_f32(1e-3); ffn * hidden])?;
    let w_down = stream.clone_htod(&vec![bf16::from_f32(1e-3); hidden * ffn])?;
    let (mut up, mut act, mut out) = (
        stream.alloc_zeros(tokens * ffn)?,
        stream.alloc_zeros(tokens * ffn)?,
        stream.alloc_zeros(tokens * hidden)?,
    );

    let wide = MatmulArgs::linear(tokens, hidden, ffn);
    let narrow = MatmulArgs::linear(tokens, ffn, hidden).with_epilogue(Epilogue::RESIDUAL);
    // up = x · W_upᵀ; act = silu(x · W_gateᵀ) ⊙ up; out = h + act · W_downᵀ. Each plan is built once.
    matmul(&ctx, &wide, MatmulOperands::new(&x, &w_up, &mut up), Backend::Fused)?;
    let gate = MatmulOperands::new(&x, &w_gate, &mut act).up(&up);
    matmul(&ctx, &wide.with_epilogue(Epilogue::SWIGLU), gate, Backend::Fused)?;
    matmul(&ctx, &narrow, MatmulOperands::new(&act, &w_down, &mut out).residual(&h), Backend::Fused)?;

    // Every element: up = gate = 4096 · 0.5 · 1e-3 ≈ 2.05, act = silu(2.05) · 2.05 ≈ 3.71,
    // out = 1 + 14336 · 3.71e-3 ≈ 54 (1e-3 is 0.99945e-3 in bf16; outputs are rounded to bf16).
    let y = stream.clone_dtoh(&out)?;
    println!("out[0] = {} (expected ~54), cache {:?}", y[0], ctx.cache().stats());
    Ok(())
}
