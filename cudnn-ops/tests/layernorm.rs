//! LayerNorm end to end: fused (cuDNN) and naive (eager's one kernel) against the f64 CPU reference
//! (`cudnn_llm_ops::ops::layernorm::reference`), on poisoned outputs, in both phases and the three
//! float dtypes; the plan cache; bad input touching nothing. GPU tests are ignored by default; run
//! them with `--include-ignored` on a GPU machine.

use cudarc::driver::DevicePtrMut;
use cudnn_llm_ops::ops::layernorm;
use cudnn_llm_ops::testing::{download, expect_invalid, gpu, poisoned, upload};
use cudnn_llm_ops::{layer_norm, reference, Backend, Cudnn, Element, LayerNormArgs, LayerNormOperands};
use half::{bf16, f16};

const EPS: f32 = 1e-5;
/// The statistics are f32 from f32 arithmetic on both paths (cuDNN's and ours differ in summation order).
const STATS_TOL: reference::Tolerance = reference::Tolerance::rel_l2(1e-5);

/// Both backends, in each phase of `phases` (training = true), for dtype T against the reference;
/// failures are collected, each line printed.
fn check<T: Element>(
    ctx: &Cudnn,
    args: LayerNormArgs,
    seed: u64,
    (shift, scale): (f64, f64),
    phases: &[bool],
    failures: &mut Vec<String>,
) {
    let n = args.tokens * args.hidden;
    // Rows with a common offset, as hidden states have: the mean must really be subtracted.
    let xs: Vec<f64> = reference::random_values(seed, n).iter().map(|v| v * scale + shift).collect();
    let (x, xr) = upload::<T>(ctx, &xs).unwrap();
    let (w, wr) = upload::<T>(ctx, &reference::random_values(seed + 1, args.hidden)).unwrap();
    let (b, br) = upload::<T>(ctx, &reference::random_values(seed + 2, args.hidden)).unwrap();
    let (y_ref, mean_ref, inv_ref) = layernorm::reference(&xr, &wr, &br, args);
    for backend in [Backend::Fused, Backend::Naive] {
        for &train in phases {
            let mut y = poisoned::<T>(ctx, n).unwrap();
            let mut mean = poisoned::<f32>(ctx, args.tokens).unwrap();
            let mut inv = poisoned::<f32>(ctx, args.tokens).unwrap();
            let tag = format!(
                "{} {} {}x{} x·{scale}+{shift} {}",
                backend.name(),
                T::DTYPE,
                args.tokens,
                args.hidden,
                if train { "training" } else { "inference" }
            );
            let mut operands = LayerNormOperands::new(&x, &w, &b, &mut y);
            if train {
                operands = operands.stats(&mut mean, &mut inv);
            }
            if let Err(e) = layer_norm(ctx, args, operands, backend) {
                failures.push(format!("{tag}: {e}"));
                continue;
            }
            let c = reference::compare(&download(ctx, &y).unwrap(), &y_ref);
            let mut ok = c.passes(reference::tolerance(T::DTYPE));
            let mut line = format!("{tag}: y {c}");
            if train {
                let cm = reference::compare(&download(ctx, &mean).unwrap(), &mean_ref);
                let ci = reference::compare(&download(ctx, &inv).unwrap(), &inv_ref);
                ok &= cm.passes(STATS_TOL) && ci.passes(STATS_TOL);
                line += &format!("; mean {cm}; inv_std {ci}");
            } else {
                // Inference writes no statistics: the poison is still there.
                ok &= download(ctx, &mean).unwrap().iter().all(|v| v.is_nan());
                ok &= download(ctx, &inv).unwrap().iter().all(|v| v.is_nan());
            }
            println!("{} {line}", if ok { "ok  " } else { "FAIL" });
            if !ok {
                failures.push(line);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_naive_match_the_reference() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mut failures = Vec::new();
    let mut seed = 1;
    for hidden in [64, 768, 1024, 2560, 4096, 8192] {
        for tokens in [1, 7, 30, 2048] {
            seed += 3;
            let args = LayerNormArgs::new(tokens, hidden, EPS);
            check::<bf16>(&ctx, args, seed, (0.0, 1.0), &[false, true], &mut failures);
            check::<f16>(&ctx, args, seed, (0.0, 1.0), &[false, true], &mut failures);
            check::<f32>(&ctx, args, seed, (0.0, 1.0), &[false, true], &mut failures);
        }
    }
    // A common offset (rows of mean 40 in bf16: the mean must really be subtracted) and large
    // magnitudes (3e4 times the spread) stay accurate and finite.
    check::<bf16>(&ctx, LayerNormArgs::new(64, 4096, EPS), 99, (40.0, 1.0), &[false, true], &mut failures);
    check::<f16>(&ctx, LayerNormArgs::new(64, 4096, EPS), 101, (0.0, 3.0e4), &[false, true], &mut failures);
    check::<f32>(&ctx, LayerNormArgs::new(64, 4096, EPS), 103, (0.0, 3.0e4), &[true], &mut failures);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn plan_cache_builds_once_per_shape_and_phase() {
    let ctx = gpu();
    let args = LayerNormArgs::new(30, 1024, EPS);
    let (x, _) = upload::<bf16>(&ctx, &reference::random_values(1, 30 * 1024)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, 1024)).unwrap();
    let (b, _) = upload::<bf16>(&ctx, &reference::random_values(3, 1024)).unwrap();
    let mut y = poisoned::<bf16>(&ctx, 30 * 1024).unwrap();
    ctx.cache().clear();
    for eps in [EPS, 1e-6, EPS] {
        // Epsilon is bound by value: one plan.
        let a = LayerNormArgs::new(args.tokens, args.hidden, eps);
        layer_norm(&ctx, a, LayerNormOperands::new(&x, &w, &b, &mut y), Backend::Fused).unwrap();
    }
    let s = ctx.cache().stats();
    assert_eq!((s.misses, s.hits, s.entries), (1, 2, 1));
    let (mut mean, mut inv) = (poisoned::<f32>(&ctx, 30).unwrap(), poisoned::<f32>(&ctx, 30).unwrap());
    let ops = LayerNormOperands::new(&x, &w, &b, &mut y).stats(&mut mean, &mut inv);
    layer_norm(&ctx, args, ops, Backend::Fused).unwrap();
    assert_eq!(ctx.cache().stats().entries, 2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_are_errors_and_touch_nothing() {
    let ctx = gpu();
    let (t, h) = (30usize, 1024usize);
    let args = LayerNormArgs::new(t, h, EPS);
    let (x, _) = upload::<bf16>(&ctx, &reference::random_values(1, t * h)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, h)).unwrap();
    let (b_short, _) = upload::<bf16>(&ctx, &reference::random_values(3, h - 1)).unwrap();
    let mut y = poisoned::<bf16>(&ctx, t * h).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        expect_invalid(&ctx, &mut y, "bias has 1023 elements", |y| {
            layer_norm(&ctx, args, LayerNormOperands::new(&x, &w, &b_short, y), backend)
        });
        expect_invalid(&ctx, &mut y, "epsilon", |y| {
            layer_norm(
                &ctx,
                LayerNormArgs::new(t, h, f32::NAN),
                LayerNormOperands::new(&x, &w, &w, y),
                backend,
            )
        });
        let mut mean_short = poisoned::<f32>(&ctx, t - 1).unwrap();
        let mut inv = poisoned::<f32>(&ctx, t).unwrap();
        expect_invalid(&ctx, &mut y, "mean has 29 elements", |y| {
            let ops = LayerNormOperands::new(&x, &w, &w, y).stats(&mut mean_short, &mut inv);
            layer_norm(&ctx, args, ops, backend)
        });
        expect_invalid(&ctx, &mut y, "output has", |y| {
            let mut short = y.slice_mut(0..t * h - 1);
            let short: &mut dyn DevicePtrMut<bf16> = &mut short;
            layer_norm(&ctx, args, LayerNormOperands::new(&x, &w, &w, short), backend)
        });
    }
}
