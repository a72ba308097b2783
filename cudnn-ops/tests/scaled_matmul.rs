//! FP8 scaled matmul end to end (the FP8-weight Linear is a matmul: `tests/matmul.rs`): fused (cuDNN's FP8 matmul with the scales fused) and naive
//! (dequantize to bf16, then the bf16 cuBLAS GEMM) against the f64 reference over the codes'
//! exact values (`cudnn_llm_ops::ops::scaled_matmul::reference`), on poisoned outputs: E4M3 and
//! E5M2 x E4M3 operands, per-tensor and per-channel weight scales, bf16 and f32 outputs, a decode
//! row and a prefill block; bad input touching nothing. GPU tests are ignored by default; run them
//! with `--include-ignored` on a GPU machine (FP8 tensor cores: sm_89 or later).

use cudnn_llm_ops::ops::quantize::quantize;
use cudnn_llm_ops::ops::scaled_matmul;
use cudnn_llm_ops::testing::{download, expect_invalid, gpu, poisoned};
use cudnn_llm_ops::{
    reference, scaled_matmul, Backend, Cudnn, Element, ScaledMatmulArgs, ScaledMatmulOperands, F8E4M3, F8E5M2,
};
use half::bf16;

/// Both backends against the f64 product of the codes: f32 accumulation, the output rounded once
/// (bf16: ~2e-3 an element); the naive backend also rounds the dequantized operands to bf16.
const SCALED_TOL: reference::Tolerance = reference::Tolerance::rel_l2(1e-2);

fn check<A: Element, O: Element>(ctx: &Cudnn, args: ScaledMatmulArgs, seed: u64, failures: &mut Vec<String>) {
    let ScaledMatmulArgs { m, n, k, .. } = args;
    let x: Vec<f32> = reference::random_values(seed, m * k).iter().map(|v| *v as f32 * 3.0).collect();
    // Output channels of different magnitudes, as trained weights have.
    let w: Vec<f32> = reference::random_values(seed + 1, n * k)
        .iter()
        .enumerate()
        .map(|(i, v)| *v as f32 * (0.01 + (i / k % 7) as f32))
        .collect();
    let (per_channel, per_token) = (args.b_scales() > 1, args.a_scales() > 1);
    let (qa, sa) = quantize::<A>(&x, m, k, per_token);
    let (qb, sb) = quantize::<F8E4M3>(&w, n, k, per_channel);
    let want = scaled_matmul::reference(args, &qa, &sa, &qb, &sb);
    let s = ctx.stream();
    let (da, db) = (s.clone_htod(&qa).unwrap(), s.clone_htod(&qb).unwrap());
    let (dsa, dsb) = (s.clone_htod(&sa).unwrap(), s.clone_htod(&sb).unwrap());
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!(
            "{} {}x{}x{} {} x fp8e4m3 -> {} {}",
            backend.name(),
            m,
            n,
            k,
            A::DTYPE,
            O::DTYPE,
            if per_channel { "per-channel" } else { "per-tensor" }
        ) + if per_token { " per-token" } else { "" };
        let mut d = poisoned::<O>(ctx, m * n).unwrap();
        let run = scaled_matmul(ctx, args, ScaledMatmulOperands::new(&da, &dsa, &db, &dsb, &mut d), backend);
        if let Err(e) = run {
            failures.push(format!("{tag}: {e}"));
            continue;
        }
        let c = reference::compare(&download(ctx, &d).unwrap(), &want);
        println!("{tag}: {c}");
        if !c.passes(SCALED_TOL) {
            failures.push(format!("{tag}: {c}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn both_backends_match_the_reference_on_fp8_operands() {
    let ctx = gpu();
    if ctx.info().compute_capability < (8, 9) {
        println!("SKIPPED: FP8 tensor cores need sm_89 or later");
        return;
    }
    let mut failures = Vec::new();
    for (i, args) in [
        ScaledMatmulArgs::new(1, 1024, 2048),
        ScaledMatmulArgs::new(1, 1024, 2048).per_channel(),
        ScaledMatmulArgs::new(128, 512, 1024),
        ScaledMatmulArgs::new(128, 512, 1024).per_channel(),
        ScaledMatmulArgs::new(128, 512, 1024).per_channel().per_token(),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 10 * i as u64;
        check::<F8E4M3, bf16>(&ctx, args, seed, &mut failures);
        check::<F8E4M3, f32>(&ctx, args, seed + 1, &mut failures);
        check::<F8E5M2, bf16>(&ctx, args, seed + 2, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_touches_nothing() {
    let ctx = gpu();
    let s = ctx.stream();
    let args = ScaledMatmulArgs::new(4, 64, 64);
    let (a, b) = (
        s.clone_htod(&vec![F8E4M3(0x38); 4 * 64]).unwrap(),
        s.clone_htod(&vec![F8E4M3(0x38); 64 * 64]).unwrap(),
    );
    let (one, many) = (s.clone_htod(&[1f32]).unwrap(), s.clone_htod(&[1f32; 64]).unwrap());
    let mut d = s.clone_htod(&vec![bf16::ZERO; 4 * 64]).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        expect_invalid(&ctx, &mut d, "b_scale has 64 elements, needs 1", |d| {
            scaled_matmul(&ctx, args, ScaledMatmulOperands::new(&a, &one, &b, &many, d), backend)
        });
        expect_invalid(&ctx, &mut d, "k = 40 must be a multiple of 16", |d| {
            scaled_matmul(
                &ctx,
                ScaledMatmulArgs::new(4, 64, 40),
                ScaledMatmulOperands::new(&a, &one, &b, &one, d),
                backend,
            )
        });
        expect_invalid(&ctx, &mut d, "B has 4096 elements, needs n*k = 8192", |d| {
            scaled_matmul(
                &ctx,
                ScaledMatmulArgs::new(4, 128, 64),
                ScaledMatmulOperands::new(&a, &one, &b, &one, d),
                backend,
            )
        });
    }
}
