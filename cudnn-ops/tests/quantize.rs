//! FP8 quantization of activations end to end: fused (a kernel per row, or three per tensor) and
//! naive (the eager decomposition) against the CPU rule (`cudnn_llm_ops::ops::quantize::quantize`),
//! codes and factors bit for bit, on poisoned outputs: bf16, f16 and f32 inputs, E4M3 and E5M2, per
//! row and per tensor, a row of zeros; bad input touching nothing. GPU tests are ignored by default;
//! run them with `--include-ignored` on a GPU machine.

use cudnn_llm_ops::ops::quantize::quantize;
use cudnn_llm_ops::testing::{download, gpu, poisoned, upload};
use cudnn_llm_ops::{
    quantize_fp8, reference, Backend, Cudnn, Element, QuantizeArgs, QuantizeOperands, Scaling, F8E4M3, F8E5M2,
};
use half::{bf16, f16};

fn check<T: Element, F: Element + PartialEq + std::fmt::Debug>(
    ctx: &Cudnn,
    args: QuantizeArgs,
    seed: u64,
    failures: &mut Vec<String>,
) {
    let (rows, cols) = (args.rows, args.cols);
    // Rows of different magnitudes, the last one all zeros.
    let values: Vec<f64> = reference::random_values(seed, rows * cols)
        .iter()
        .enumerate()
        .map(|(i, v)| if i / cols == rows - 1 { 0.0 } else { v * 10f64.powi((i / cols) as i32 % 5 - 2) })
        .collect();
    let (x, rounded) = upload::<T>(ctx, &values).unwrap();
    let host: Vec<f32> = rounded.iter().map(|&v| v as f32).collect();
    let (want_q, want_f) = quantize::<F>(&host, rows, cols, args.scaling == Scaling::PerRow);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("{} {rows}x{cols} {} -> {} {:?}", backend.name(), T::DTYPE, F::DTYPE, args.scaling);
        let mut q = poisoned::<F>(ctx, rows * cols).unwrap();
        let mut f = poisoned::<f32>(ctx, args.factors()).unwrap();
        if let Err(e) = quantize_fp8(ctx, args, QuantizeOperands::new(&x, &mut q, &mut f), backend) {
            failures.push(format!("{tag}: {e}"));
            continue;
        }
        let (got_q, got_f) = (download(ctx, &q).unwrap(), download(ctx, &f).unwrap());
        let differ = got_q.iter().zip(&want_q).filter(|(a, b)| a != b).count();
        println!(
            "{tag}: {differ} codes differ, factors {}",
            if got_f == want_f { "equal" } else { "differ" }
        );
        if differ > 0 || got_f != want_f {
            failures.push(format!(
                "{tag}: {differ} codes differ; factors {:?} vs {:?}",
                &got_f[..got_f.len().min(4)],
                &want_f[..want_f.len().min(4)]
            ));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn both_backends_give_the_cpu_rules_codes_and_factors() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (i, args) in [
        QuantizeArgs::per_row(7, 4096),
        QuantizeArgs::per_tensor(7, 4096),
        QuantizeArgs::per_row(300, 96),
        QuantizeArgs::per_tensor(2048, 1024),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 10 * i as u64;
        check::<bf16, F8E4M3>(&ctx, args, seed, &mut failures);
        check::<f16, F8E5M2>(&ctx, args, seed + 1, &mut failures);
        check::<f32, F8E4M3>(&ctx, args, seed + 2, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_touches_nothing() {
    let ctx = gpu();
    let (x, _) = upload::<bf16>(&ctx, &[1.0; 64]).unwrap();
    let s = ctx.stream();
    for backend in [Backend::Fused, Backend::Naive] {
        let mut q = s.clone_htod(&[F8E4M3(0x11); 64]).unwrap();
        let mut f = s.clone_htod(&[7.0f32; 4]).unwrap();
        let e = quantize_fp8(
            &ctx,
            QuantizeArgs::per_row(8, 8),
            QuantizeOperands::new(&x, &mut q, &mut f),
            backend,
        )
        .unwrap_err();
        assert!(matches!(e, cudnn_llm_ops::Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("factors has 4 elements, needs 8 (PerRow)"), "{e}");
        ctx.synchronize().unwrap();
        assert_eq!(download(&ctx, &f).unwrap(), [7.0; 4], "factors written");
        assert!(download(&ctx, &q).unwrap().iter().all(|c| c.0 == 0x11), "codes written");
    }
}
