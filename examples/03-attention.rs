//! Causal grouped-query attention read straight out of a fused QKV projection buffer:
//! `cargo run --release --example 03-attention` on a GPU machine.
use cudnn_llm::half::bf16;
use cudnn_llm::{sdpa, Backend, Cudnn, DataType, Layout, Mask, SdpaArgs, SdpaOperands};

fn main() -> cudnn_llm::Result<()> {
    let ctx = Cudnn::new(0)?; // an error (not a panic) without a GPU
                              // Llama-3.1-8B heads: 32 query heads, 8 K/V heads, head dim 128; one sequence of 2048 tokens.
    let (seq, hq, hkv, d) = (2048, 32, 8, 128);
    let width = (hq + 2 * hkv) * d; // a QKV projection writes [tokens, (32 + 8 + 8) · 128]
    let qkv = ctx.stream().clone_htod(&vec![bf16::from_f32(0.25); seq * width])?;
    let mut o = ctx.stream().alloc_zeros::<bf16>(seq * hq * d)?;

    // Q, K and V are strided views into the same rows: logical [b, h, s, d], strides [s·w, d, w, 1].
    let mut args = SdpaArgs::new(1, hq, hkv, seq, seq, d, Layout::Bshd).with_mask(Mask::CausalTopLeft);
    let rows = [seq * width, d, width, 1];
    (args.q_strides, args.k_strides, args.v_strides) = (rows, rows, rows);
    let (q, k, v) = (qkv.slice(..), qkv.slice(hq * d..), qkv.slice((hq + hkv) * d..));
    sdpa(&ctx, args, SdpaOperands::new(&q, &k, &v, &mut o), Backend::Fused)?;

    let plan = args.plan(&ctx, DataType::BF16, false)?;
    let out = ctx.stream().clone_dtoh(&o)?;
    println!(
        "o[0] = {} (expected 0.25: V is constant), {} graph on {}, built in {:.0} ms",
        out[0],
        plan.form(),
        plan.engine(),
        plan.build_time().as_secs_f64() * 1e3
    );
    Ok(())
}
