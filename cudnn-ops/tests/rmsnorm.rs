//! RMSNorm end to end: fused (cuDNN) and naive (eager kernels) against the f64 CPU reference.
//! GPU tests are ignored by default; run them with `--include-ignored` on a GPU machine.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudnn_llm_ops::testing::{download, expect_invalid, gpu, poisoned, upload};
use cudnn_llm_ops::{
    reference, rms_norm, Backend, Cudnn, DataType, Element, Error, RmsNormArgs, RmsNormOperands,
};
use half::{bf16, f16};

const EPS: f32 = 1e-5;
/// The inverse RMS is f32 from f32 arithmetic on both paths.
const INV_RMS_TOL: reference::Tolerance = reference::Tolerance::rel_l2(1e-5);

#[test]
fn no_gpu_is_an_error_not_a_panic() {
    // On a machine without a driver this must be a typed error; with one it may succeed.
    if let Err(e) = Cudnn::new(0) {
        assert!(matches!(e, Error::NoGpu(_) | Error::Load(_) | Error::Driver(_)), "{e:?}");
        assert!(!e.to_string().is_empty());
    }
    assert!(matches!(Cudnn::new(1 << 20), Err(Error::NoGpu(_)) | Err(Error::Load(_))));
}

struct Case {
    tokens: usize,
    hidden: usize,
    x: Vec<f64>,
    w: Vec<f64>,
}

/// Runs both backends in each phase of `phases` (training = true) for dtype T on poisoned outputs and compares with the reference (inputs
/// uploaded and the reference computed once per dtype: the largest cases are 134M elements).
fn check<T: Element>(ctx: &Cudnn, case: &Case, phases: &[bool], failures: &mut Vec<String>) {
    let (n, args) = (case.tokens * case.hidden, RmsNormArgs::new(case.tokens, case.hidden, EPS));
    let (x, xr) = upload::<T>(ctx, &case.x).unwrap();
    let (w, wr) = upload::<T>(ctx, &case.w).unwrap();
    let (y_ref, inv_ref) = reference::rms_norm(&xr, &wr, case.tokens, case.hidden, EPS as f64);
    for backend in [Backend::Fused, Backend::Naive] {
        for &train in phases {
            let mut y = poisoned::<T>(ctx, n).unwrap();
            let mut inv = poisoned::<f32>(ctx, case.tokens).unwrap();
            let inv_arg: Option<&mut dyn DevicePtrMut<f32>> = if train { Some(&mut inv) } else { None };
            let tag = format!(
                "{} {} {}x{} {}",
                backend.name(),
                T::DTYPE,
                case.tokens,
                case.hidden,
                if train { "training" } else { "inference" }
            );
            let mut operands = RmsNormOperands::new(&x, &w, &mut y);
            operands.inv_rms = inv_arg;
            if let Err(e) = rms_norm(ctx, args, operands, backend) {
                failures.push(format!("{tag}: {e}"));
                continue;
            }
            let c = reference::compare(&download(ctx, &y).unwrap(), &y_ref);
            let tol = reference::tolerance(T::DTYPE);
            let mut line = format!("{tag}: y {c}");
            let mut ok = c.passes(tol);
            if train {
                let ci = reference::compare(&download(ctx, &inv).unwrap(), &inv_ref);
                ok &= ci.passes(INV_RMS_TOL);
                line += &format!("; inv_rms {ci}");
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
    for hidden in [768, 2048, 4096, 5120, 8192] {
        for tokens in [1, 7, 30, 2048, 16384] {
            seed += 2;
            let case = Case {
                tokens,
                hidden,
                x: reference::random_values(seed, tokens * hidden),
                w: reference::random_values(seed + 1, hidden),
            };
            check::<bf16>(&ctx, &case, &[false, true], &mut failures);
            check::<f16>(&ctx, &case, &[false, true], &mut failures);
            check::<f32>(&ctx, &case, &[false, true], &mut failures);
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_magnitudes_stay_finite() {
    let ctx = gpu();
    let case = Case {
        tokens: 64,
        hidden: 4096,
        x: reference::random_values(5, 64 * 4096).iter().map(|v| v * 3.0e4).collect(),
        w: reference::random_values(6, 4096),
    };
    let mut failures = Vec::new();
    check::<bf16>(&ctx, &case, &[true], &mut failures);
    check::<f16>(&ctx, &case, &[false], &mut failures);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn plan_cache_builds_once_per_shape() {
    let ctx = gpu();
    let args = RmsNormArgs::new(30, 2048, EPS);
    let (x, _) = upload::<bf16>(&ctx, &reference::random_values(1, 30 * 2048)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, 2048)).unwrap();
    let mut y = poisoned::<bf16>(&ctx, 30 * 2048).unwrap();
    ctx.cache().clear();
    for _ in 0..3 {
        rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut y), Backend::Fused).unwrap();
    }
    let s = ctx.cache().stats();
    assert_eq!((s.misses, s.hits, s.entries), (1, 2, 1));
    // Epsilon is a by-value scalar: a different epsilon reuses the plan.
    rms_norm(
        &ctx,
        RmsNormArgs::new(args.tokens, args.hidden, 1e-6),
        RmsNormOperands::new(&x, &w, &mut y),
        Backend::Fused,
    )
    .unwrap();
    assert_eq!(ctx.cache().stats().misses, 1);
    // Fewer tokens on a longer buffer is another shape, another plan; the training phase is another plan.
    rms_norm(
        &ctx,
        RmsNormArgs::new(29, args.hidden, args.epsilon),
        RmsNormOperands::new(&x, &w, &mut y),
        Backend::Fused,
    )
    .unwrap();
    let mut inv = poisoned::<f32>(&ctx, 30).unwrap();
    rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut y).inv_rms(&mut inv), Backend::Fused).unwrap();
    rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut y).inv_rms(&mut inv), Backend::Fused).unwrap();
    let s = ctx.cache().stats();
    assert_eq!((s.misses, s.hits, s.entries), (3, 4, 3));
    let plan = ctx.cache().get(&args.key(DataType::BF16, cudnn_llm_ops::NormPhase::Inference)).unwrap();
    println!(
        "{}: engine {}, workspace {} B, built in {:?}",
        plan.name(),
        plan.engine(),
        plan.workspace_size(),
        plan.build_time()
    );
    assert!(plan.build_time().as_nanos() > 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_are_errors_and_touch_nothing() {
    let ctx = gpu();
    let (t, h) = (30usize, 2048usize);
    let args = RmsNormArgs::new(t, h, EPS);
    let (x, _) = upload::<bf16>(&ctx, &reference::random_values(1, t * h + 8)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, h)).unwrap();
    let (w_short, _) = upload::<bf16>(&ctx, &reference::random_values(2, h - 1)).unwrap();
    let mut y = poisoned::<bf16>(&ctx, t * h + 8).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        let run = |a: RmsNormArgs,
                   x: &dyn DevicePtr<bf16>,
                   w: &dyn DevicePtr<bf16>,
                   y: &mut dyn DevicePtrMut<bf16>| {
            rms_norm(&ctx, a, RmsNormOperands::new(x, w, y), backend)
        };
        expect_invalid(&ctx, &mut y, "weight has 2047 elements", |y| run(args, &x, &w_short, y));
        expect_invalid(&ctx, &mut y, "tokens must be > 0", |y| {
            run(RmsNormArgs::new(0, args.hidden, args.epsilon), &x, &w, y)
        });
        expect_invalid(&ctx, &mut y, "output has 61439 elements", |y| {
            let mut short = y.slice_mut(0..t * h - 1);
            run(args, &x, &w, &mut short)
        });
        expect_invalid(&ctx, &mut y, "x has 61439 elements", |y| run(args, &x.slice(0..t * h - 1), &w, y));
        let mut inv_short = poisoned::<f32>(&ctx, t - 1).unwrap();
        expect_invalid(&ctx, &mut y, "inv_rms has 29 elements", |y| {
            rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, y).inv_rms(&mut inv_short), backend)
        });
    }
    // The fused plan declares 16-byte alignment; a view one element in is refused before cuDNN runs.
    expect_invalid(&ctx, &mut y, "is not 16-byte aligned", |y| {
        rms_norm(&ctx, args, RmsNormOperands::new(&x.slice(1..), &w, y), Backend::Fused)
    });
    expect_invalid(&ctx, &mut y, "is not 16-byte aligned", |y| {
        let mut off = y.slice_mut(1..);
        rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut off), Backend::Fused)
    });
    // The naive kernels need no alignment: the same view computes the right thing.
    let ok = rms_norm(&ctx, args, RmsNormOperands::new(&x.slice(1..), &w, &mut y), Backend::Naive);
    assert!(ok.is_ok(), "{ok:?}");
}
