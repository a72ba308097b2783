//! Matmul with epilogues end to end: fused (cuDNN) and naive (cuBLAS + one kernel per step) against the
//! f64 CPU reference. The CPU tests run everywhere; the GPU tests are ignored by default:
//! `cargo test --release --test matmul -- --include-ignored` on a GPU machine (release keeps the f64
//! reference of the large shapes fast).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::testing::{self, download, expect_untouched, poisoned, upload};
use cudnn_llm_ops::{
    knob_name, matmul, reference, rms_norm, rope, Activation, Backend, Cudnn, DataType, Element, Epilogue,
    Error, GemvSplit, L2Flush, MatmulArgs, MatmulKernel, MatmulOperands, MatrixLayout, Prologue, RmsNormArgs,
    RmsNormOperands, RopeArgs, RopeOperands, RopeTables, DECODE_GEMV_MAX_TOKENS, F8E4M3, F8E5M2,
};
use half::{bf16, f16};

/// cuDNN may run f32 matmuls on tensor cores as TF32 (inputs rounded to 10 mantissa bits), which gives a
/// relative error near 1e-3; f32 outputs are held to this instead of the exact-f32 tolerance.
const F32_MATMUL_TOL: reference::Tolerance = reference::Tolerance::rel_l2(5e-3);

fn tolerance(dtype: DataType) -> reference::Tolerance {
    match dtype {
        DataType::F32 => F32_MATMUL_TOL,
        other => reference::tolerance(other),
    }
}

// ---------------------------------------------------------------------------------------------------
// CPU: the reference by hand.

#[test]
fn reference_by_hand() {
    // A [2, 3] · B [3, 2], B given as the transposed view of W [2, 3] (a Linear weight).
    let a = [1.0, 2.0, 3.0, -1.0, 0.5, 2.0];
    let w = [1.0, 0.0, -1.0, 2.0, 1.0, 0.5];
    let args = MatmulArgs::linear(2, 3, 2);
    // Row 0: [1 - 3, 2 + 2 + 1.5] = [-2, 5.5]; row 1: [-1 - 2, -2 + 0.5 + 1] = [-3, -0.5].
    let product = [-2.0, 5.5, -3.0, -0.5];
    assert_eq!(reference::matmul(&args, Epilogue::NONE, &a, &w, None, None, None), product);
    // The same B stored row-major [3, 2] gives the same product.
    let b_rows = [1.0, 2.0, 0.0, 1.0, -1.0, 0.5];
    let packed = MatmulArgs::packed(1, 2, 3, 2);
    assert_eq!(reference::matmul(&packed, Epilogue::NONE, &a, &b_rows, None, None, None), product);
    // Every step, in order: ((AB + bias) -> relu) * U + R.
    let (bias, u, r) = ([1.0, -6.0], [2.0, 3.0, 4.0, 5.0], [0.5, 0.5, 0.5, 0.5]);
    let e = Epilogue::BIAS.with_activation(Activation::Relu).with_gate().with_residual();
    let d = reference::matmul(&args, e, &a, &w, Some(&bias), Some(&u), Some(&r));
    assert_eq!(d, vec![0.5, 0.5, 0.5, 0.5]);
    let d = reference::matmul(&args, Epilogue::BIAS.with_residual(), &a, &w, Some(&bias), None, Some(&r));
    assert_eq!(d, vec![-0.5, 0.0, -1.5, -6.0]);
    // Sampled rows of a batched product: row 3 is batch 1, row 1.
    let batched = MatmulArgs::packed(2, 2, 3, 2);
    let a2: Vec<f64> =
        a.iter().chain(a.iter().map(|v| v * 2.0).collect::<Vec<_>>().iter()).copied().collect();
    let b2: Vec<f64> = b_rows.iter().chain(b_rows.iter()).copied().collect();
    assert_eq!(reference::matmul_rows(&batched, &a2, &b2, &[3, 0]), vec![-6.0, -1.0, -2.0, 5.5]);
}

#[test]
fn reference_activations_by_hand() {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-14 * b.abs().max(1.0);
    let cases = [
        (Activation::Silu, 1.0, 0.7310585786300049),
        (Activation::Silu, -2.0, -0.2384058440442351),
        (Activation::Gelu, 1.0, 0.8413447460685429),
        (Activation::Gelu, -1.0, -0.15865525393145707),
        (Activation::Gelu, 0.5, 0.34573123063700656),
        // Either side of the switch from series to continued fraction in erf (x/√2 = 2).
        (Activation::Gelu, 2.8, 2.792845635074802),
        (Activation::Gelu, 2.9, 2.8945891414288862),
        (Activation::Gelu, 4.3, 4.299963278406475),
        (Activation::Gelu, -6.0, -5.919525869479969e-09),
        (Activation::Gelu, 0.0, 0.0),
        (Activation::GeluTanh, 1.0, 0.8411919906082768),
        (Activation::GeluTanh, -3.0, -0.0036373920817729943),
        (Activation::Relu, -0.5, 0.0),
        (Activation::Relu, 2.5, 2.5),
    ];
    for (act, x, expected) in cases {
        let y = reference::activation(act, x);
        assert!(close(y, expected), "{}({x}) = {y:e}, expected {expected:e}", act.name());
    }
}

// ---------------------------------------------------------------------------------------------------
// GPU helpers.

/// A context taking the heuristics' first engine: correctness does not need autotuning, which costs
/// seconds per plan (`fused_and_naive_agree_on_llama_8b_at_2048_tokens` keeps it on).
fn gpu() -> Cudnn {
    let ctx = tuned_gpu();
    ctx.set_autotune(1);
    ctx
}

/// A context that autotunes the heuristics' configurations, without a knob search whatever the
/// environment says.
fn tuned_gpu() -> Cudnn {
    let ctx = testing::gpu();
    ctx.set_knob_search(0);
    // The tuning tests time small shapes (OProj30) too.
    ctx.set_autotune_min_rows(0);
    ctx
}

/// Host values of one case: A and B laid out as the args say, bias, U and R. B is scaled by 3/√k so that
/// `A·B` has unit variance and the activations see their interesting range.
struct Host {
    a: Vec<f64>,
    b: Vec<f64>,
    bias: Vec<f64>,
    u: Vec<f64>,
    r: Vec<f64>,
}

impl Host {
    fn new(seed: u64, args: &MatmulArgs) -> Self {
        let scale = 3.0 / (args.k() as f64).sqrt();
        let b_len = args.b.min_elements().unwrap();
        Host {
            a: reference::random_values(seed, args.a.min_elements().unwrap()),
            b: reference::random_values(seed + 1, b_len).iter().map(|v| v * scale).collect(),
            bias: reference::random_values(seed + 2, args.n()).iter().map(|v| v * 0.5).collect(),
            u: reference::random_values(seed + 3, args.d_len()),
            r: reference::random_values(seed + 4, args.d_len()),
        }
    }
}

/// Device copies in the input dtype `T` (A, B) and output dtype `O` (bias, U, R), with the rounded
/// values the GPU sees.
struct Device<T: Element, O: Element> {
    a: CudaSlice<T>,
    b: CudaSlice<T>,
    bias: CudaSlice<O>,
    u: CudaSlice<O>,
    r: CudaSlice<O>,
    rounded: Host,
}

impl<T: Element, O: Element> Device<T, O> {
    fn new(ctx: &Cudnn, h: &Host) -> Self {
        let (a, ar) = upload::<T>(ctx, &h.a).unwrap();
        let (b, br) = upload::<T>(ctx, &h.b).unwrap();
        let (bias, biasr) = upload::<O>(ctx, &h.bias).unwrap();
        let (u, ur) = upload::<O>(ctx, &h.u).unwrap();
        let (r, rr) = upload::<O>(ctx, &h.r).unwrap();
        Device { a, b, bias, u, r, rounded: Host { a: ar, b: br, bias: biasr, u: ur, r: rr } }
    }

    /// The operands an epilogue needs, writing `d`.
    fn operands<'a>(&'a self, e: Epilogue, d: &'a mut dyn DevicePtrMut<O>) -> MatmulOperands<'a, T, O> {
        let mut x = MatmulOperands::new(&self.a, &self.b, d);
        if e.bias {
            x = x.bias(&self.bias);
        }
        if e.gate {
            x = x.up(&self.u);
        }
        if e.residual {
            x = x.residual(&self.r);
        }
        x
    }

    /// The reference for `rows`, from the product of those rows.
    fn expected(&self, e: Epilogue, n: usize, rows: &[usize], product: &[f64]) -> Vec<f64> {
        let h = &self.rounded;
        reference::matmul_epilogue(
            e,
            product,
            n,
            rows,
            e.bias.then_some(&h.bias[..]),
            e.gate.then_some(&h.u[..]),
            e.residual.then_some(&h.r[..]),
        )
    }
}

/// Rows to compare: all of a small output, 16 (or 8 for the largest k·n) spread over a large one,
/// always including the first and last.
fn sample_rows(args: &MatmulArgs) -> Vec<usize> {
    let rows = args.batch() * args.m();
    let want = if args.k() * args.n() >= 4096 * 14336 { 8 } else { 16 };
    if rows <= want {
        return (0..rows).collect();
    }
    let mut v: Vec<usize> = (0..want).map(|i| i * (rows - 1) / (want - 1)).collect();
    v[want / 2] += 1; // an odd row in the middle
    v
}

fn download_rows<O: Element>(ctx: &Cudnn, d: &CudaSlice<O>, n: usize, rows: &[usize]) -> Vec<O> {
    let mut out = Vec::with_capacity(rows.len() * n);
    for &r in rows {
        out.extend(ctx.stream().clone_dtoh(&d.slice(r * n..(r + 1) * n)).unwrap());
    }
    out
}

/// Runs `e` on `backend` into a NaN-poisoned D and compares the sampled rows with the reference.
/// Returns the line to print and whether it passed.
#[allow(clippy::too_many_arguments)]
fn check<T: Element, O: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    e: Epilogue,
    backend: Backend,
    dev: &Device<T, O>,
    rows: &[usize],
    product: &[f64],
    d: &mut CudaSlice<O>,
) -> (String, bool) {
    let form = match (backend, args.form) {
        (Backend::Fused, Some(f)) => format!(" ({})", f.name()),
        _ => String::new(),
    };
    let tag = format!(
        "{}{form} {}->{} m={} k={} n={} batch={} {}",
        backend.name(),
        T::DTYPE,
        O::DTYPE,
        args.m(),
        args.k(),
        args.n(),
        args.batch(),
        e
    );
    ctx.stream().memcpy_htod(&vec![O::nan(); d.len()], d).unwrap();
    if let Err(err) = matmul(ctx, &args.with_epilogue(e), dev.operands(e, d), backend) {
        return (format!("{tag}: {err}"), false);
    }
    let out = download_rows(ctx, d, args.n(), rows);
    let c = reference::compare(&out, &dev.expected(e, args.n(), rows, product));
    let ok = c.passes(tolerance(O::DTYPE));
    (format!("{tag}: {c}"), ok)
}

/// Every epilogue and both backends on one shape and dtype pair; failing lines go to `failures`.
fn check_shape<T: Element, O: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    epilogues: &[Epilogue],
    seed: u64,
    failures: &mut Vec<String>,
) {
    let dev = Device::<T, O>::new(ctx, &Host::new(seed, args));
    let rows = sample_rows(args);
    let product = reference::matmul_rows(args, &dev.rounded.a, &dev.rounded.b, &rows);
    let mut d = poisoned::<O>(ctx, args.d_len()).unwrap();
    for &e in epilogues {
        for backend in [Backend::Fused, Backend::Naive] {
            let (line, ok) = check(ctx, args, e, backend, &dev, &rows, &product, &mut d);
            println!("{} {line}", if ok { "ok  " } else { "FAIL" });
            if !ok {
                failures.push(line);
            }
        }
    }
}

/// The epilogues every small shape runs: each step alone, the SwiGLU gate, and combinations.
fn epilogues() -> Vec<Epilogue> {
    let mut v = vec![Epilogue::NONE, Epilogue::BIAS];
    v.extend(Activation::ALL.map(|a| Epilogue::NONE.with_activation(a)));
    v.extend([
        Epilogue::NONE.with_gate(),
        Epilogue::SWIGLU,
        Epilogue::RESIDUAL,
        Epilogue::BIAS.with_activation(Activation::Silu).with_residual(),
        Epilogue::BIAS.with_activation(Activation::GeluTanh).with_gate().with_residual(),
    ]);
    v
}

// ---------------------------------------------------------------------------------------------------
// GPU tests.

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_epilogue_matches_the_reference() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mut failures = Vec::new();
    // Odd and even rows, k and n from {64, 4096, 14336}: every epilogue, bf16 and f16.
    let small = [(1, 64, 14336), (7, 4096, 64), (30, 14336, 4096), (2048, 64, 4096)];
    for (i, &(m, k, n)) in small.iter().enumerate() {
        let args = MatmulArgs::linear(m, k, n);
        check_shape::<bf16, bf16>(&ctx, &args, &epilogues(), 10 * i as u64, &mut failures);
        check_shape::<f16, f16>(&ctx, &args, &epilogues(), 10 * i as u64 + 5, &mut failures);
    }
    // Large shapes: the epilogues the Llama layers use, bf16.
    let large = [(2048, 4096, 14336), (2048, 14336, 4096), (1, 14336, 4096)];
    let used = [
        Epilogue::NONE,
        Epilogue::RESIDUAL,
        Epilogue::SWIGLU,
        Epilogue::BIAS.with_activation(Activation::Gelu),
    ];
    for (i, &(m, k, n)) in large.iter().enumerate() {
        check_shape::<bf16, bf16>(&ctx, &MatmulArgs::linear(m, k, n), &used, 100 + i as u64, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_and_strided_layouts_match_the_reference() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let es =
        [Epilogue::NONE, Epilogue::BIAS.with_activation(Activation::Silu).with_residual(), Epilogue::SWIGLU];
    let batched = MatmulArgs::packed(3, 32, 64, 128);
    let layouts = [
        // Row-major B per batch.
        batched,
        // One B shared by every batch (broadcast).
        MatmulArgs::new(batched.a, MatrixLayout::row_major(1, 64, 128)),
        // Column-major A (x stored transposed) and a transposed weight view.
        MatmulArgs::new(MatrixLayout::column_major(3, 32, 64), MatrixLayout::column_major(3, 64, 128)),
        // Padded rows: A rows 72 elements apart, k = 64.
        MatmulArgs::new(
            MatrixLayout::strided([1, 30, 64], [30 * 72, 72, 1]),
            MatmulArgs::linear(30, 64, 128).b,
        ),
    ];
    for (i, args) in layouts.iter().enumerate() {
        check_shape::<bf16, bf16>(&ctx, args, &es, 200 + i as u64, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f32_io_and_f32_output() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let es =
        [Epilogue::NONE, Epilogue::BIAS.with_activation(Activation::Gelu), Epilogue::SWIGLU.with_residual()];
    // bf16 weights and activations with f32 logits-style output: both backends must run it.
    check_shape::<bf16, f32>(&ctx, &MatmulArgs::linear(30, 4096, 4096), &es, 300, &mut failures);
    // f32 I/O, with k and n aligned to 16 bytes but not to 8 elements. cuDNN may not support f32 matmul
    // on every GPU: NotSupported from the fused path is reported, not failed.
    let args = MatmulArgs::linear(7, 68, 132);
    let dev = Device::<f32, f32>::new(&ctx, &Host::new(301, &args));
    let rows = sample_rows(&args);
    let product = reference::matmul_rows(&args, &dev.rounded.a, &dev.rounded.b, &rows);
    let mut d = poisoned::<f32>(&ctx, args.d_len()).unwrap();
    for e in es {
        for backend in [Backend::Fused, Backend::Naive] {
            let (line, ok) = check(&ctx, &args, e, backend, &dev, &rows, &product, &mut d);
            let unsupported = backend == Backend::Fused && line.contains("not supported");
            println!(
                "{} {line}",
                if ok {
                    "ok  "
                } else if unsupported {
                    "SKIP"
                } else {
                    "FAIL"
                }
            );
            if !ok && !unsupported {
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_naive_agree_on_llama_8b_at_2048_tokens() {
    // Autotuned plans: whichever engine wins must agree too.
    let ctx = tuned_gpu();
    let mut failures = Vec::new();
    for (proj, k, n, e) in [
        ("qkv", 4096, 6144, Epilogue::NONE),
        ("o", 4096, 4096, Epilogue::RESIDUAL),
        ("gate", 4096, 14336, Epilogue::SWIGLU),
        ("down", 14336, 4096, Epilogue::RESIDUAL),
    ] {
        let args = MatmulArgs::linear(2048, k, n);
        let dev = Device::<bf16, bf16>::new(&ctx, &Host::new(400 + k as u64, &args));
        let mut out = Vec::new();
        for backend in [Backend::Fused, Backend::Naive] {
            let mut y = poisoned::<bf16>(&ctx, args.d_len()).unwrap();
            matmul(&ctx, &args.with_epilogue(e), dev.operands(e, &mut y), backend).unwrap();
            out.push(download(&ctx, &y).unwrap());
        }
        let naive: Vec<f64> = out[1].iter().map(|v| v.to_f64()).collect();
        let c = reference::compare(&out[0], &naive);
        let ok = c.passes(reference::BF16_TOL);
        let line = format!("8B {proj} 2048x{k}->{n} {e}: fused vs naive {c}");
        println!("{} {line}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(line);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn plan_cache_builds_once_per_shape_and_epilogue() {
    let ctx = gpu();
    let args = MatmulArgs::linear(30, 2048, 2048);
    let dev = Device::<bf16, bf16>::new(&ctx, &Host::new(500, &args));
    let mut d = poisoned::<bf16>(&ctx, args.d_len()).unwrap();
    ctx.cache().clear();
    for _ in 0..3 {
        let residual = args.with_epilogue(Epilogue::RESIDUAL);
        matmul(&ctx, &residual, dev.operands(Epilogue::RESIDUAL, &mut d), Backend::Fused).unwrap();
    }
    assert_eq!(ctx.cache().stats().misses, 1);
    matmul(&ctx, &args, dev.operands(Epilogue::NONE, &mut d), Backend::Fused).unwrap();
    let fewer = MatmulArgs::linear(29, 2048, 2048);
    matmul(&ctx, &fewer, dev.operands(Epilogue::NONE, &mut d), Backend::Fused).unwrap();
    // The naive backend builds no plan.
    let swiglu = args.with_epilogue(Epilogue::SWIGLU);
    matmul(&ctx, &swiglu, dev.operands(Epilogue::SWIGLU, &mut d), Backend::Naive).unwrap();
    let s = ctx.cache().stats();
    assert_eq!((s.misses, s.hits, s.entries), (3, 2, 3));
    let residual = args.with_epilogue(Epilogue::RESIDUAL);
    let plan = ctx.cache().get(&residual.key(DataType::BF16, DataType::BF16)).unwrap();
    println!(
        "{}: engine {}, workspace {} B, built in {:?}",
        plan.name(),
        plan.engine(),
        plan.workspace_size(),
        plan.build_time()
    );
    assert!(plan.name().contains("epilogue residual"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_are_errors_and_touch_nothing() {
    let ctx = gpu();
    let args = MatmulArgs::linear(30, 64, 128);
    let dev = Device::<bf16, bf16>::new(&ctx, &Host::new(600, &args));
    let (wide, _) = upload::<bf16>(&ctx, &reference::random_values(601, 30 * 64 + 8)).unwrap();
    let mut d = poisoned::<bf16>(&ctx, args.d_len() + 8).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        let run = |args: MatmulArgs, e: Epilogue, x: MatmulOperands<'_, bf16>| {
            matmul(&ctx, &args.with_epilogue(e), x, backend)
        };
        let none = Epilogue::NONE;
        expect_untouched(&ctx, &mut d, "inner dimensions differ", |d| {
            run(MatmulArgs::new(args.a, MatrixLayout::column_major(1, 72, 128)), none, dev.operands(none, d))
        });
        expect_untouched(&ctx, &mut d, "batch mismatch", |d| {
            run(MatmulArgs::new(args.a, MatrixLayout::column_major(2, 64, 128)), none, dev.operands(none, d))
        });
        expect_untouched(&ctx, &mut d, "misaligned k for bf16", |d| {
            run(MatmulArgs::linear(30, 60, 128), none, dev.operands(none, d))
        });
        expect_untouched(&ctx, &mut d, "A has 1919 elements", |d| {
            let short = dev.a.slice(0..30 * 64 - 1);
            run(args, none, MatmulOperands::new(&short, &dev.b, d))
        });
        expect_untouched(&ctx, &mut d, "output has 3839 elements", |d| {
            let mut short = d.slice_mut(0..30 * 128 - 1);
            run(args, none, dev.operands(none, &mut short))
        });
        expect_untouched(&ctx, &mut d, "needs a residual R", |d| {
            run(args, Epilogue::RESIDUAL, dev.operands(none, d))
        });
        let r_short = dev.r.slice(0..100);
        expect_untouched(&ctx, &mut d, "residual R has 100 elements", |d| {
            run(args, Epilogue::RESIDUAL, dev.operands(none, d).residual(&r_short))
        });
    }
    // The fused plan declares 16-byte alignment: an A one element in is refused before cuDNN runs.
    let off: &dyn DevicePtr<bf16> = &wide.slice(1..);
    expect_untouched(&ctx, &mut d, "is not 16-byte aligned", |d| {
        matmul(&ctx, &args, MatmulOperands::new(off, &dev.b, d), Backend::Fused)
    });
    // cuBLAS takes the same view.
    let ok = matmul(&ctx, &args, MatmulOperands::new(off, &dev.b, &mut d), Backend::Naive);
    assert!(ok.is_ok(), "{ok:?}");
    // Unsupported dtype pair: f16 weights into a bf16 output.
    let (w16, _) = upload::<f16>(&ctx, &reference::random_values(602, 64 * 128)).unwrap();
    let (x16, _) = upload::<f16>(&ctx, &reference::random_values(603, 30 * 64)).unwrap();
    let err = matmul(&ctx, &args, MatmulOperands::<f16, bf16>::new(&x16, &w16, &mut d), Backend::Naive)
        .unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }) && err.to_string().contains("f16 -> bf16"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn autotuning_times_every_candidate_and_keeps_the_fastest() {
    let ctx = tuned_gpu();
    let args = MatmulArgs::linear(2048, 4096, 4096);
    let dev = Device::<bf16, bf16>::new(&ctx, &Host::new(600, &args));
    let mut d = poisoned::<bf16>(&ctx, args.d_len()).unwrap();
    let plan = args.with_epilogue(Epilogue::RESIDUAL).plan(&ctx, DataType::BF16, DataType::BF16).unwrap();
    assert!(plan.timings().is_empty(), "nothing is timed before the first execution");
    matmul(
        &ctx,
        &args.with_epilogue(Epilogue::RESIDUAL),
        dev.operands(Epilogue::RESIDUAL, &mut d),
        Backend::Fused,
    )
    .unwrap();
    let timings = plan.timings();
    println!("candidates {:?}, timings {timings:?}, chose {}", plan.candidates(), plan.engine());
    assert_eq!(timings.len(), plan.candidates().len());
    assert!(timings.len() <= ctx.autotune() && timings.iter().all(|(_, ms)| *ms > 0.0));
    let fastest = timings.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert_eq!(plan.engine(), fastest.0);
    // With autotuning off, the heuristics' first choice runs and nothing is timed.
    ctx.set_autotune(1);
    ctx.cache().clear();
    let first = args.with_epilogue(Epilogue::RESIDUAL).plan(&ctx, DataType::BF16, DataType::BF16).unwrap();
    assert_eq!(first.candidates().len(), 1);
    assert_eq!(first.engine(), plan.candidates()[0]);
}

/// Llama-3.1-8B's o_proj at 30 tokens (32 MiB of weights), with sampled rows of its f64 product and a
/// poisoned output: the shape the tuning tests time.
struct OProj30 {
    args: MatmulArgs,
    dev: Device<bf16, bf16>,
    rows: Vec<usize>,
    product: Vec<f64>,
    d: CudaSlice<bf16>,
}

impl OProj30 {
    fn new(ctx: &Cudnn, seed: u64) -> Self {
        let args = MatmulArgs::linear(30, 4096, 4096);
        let dev = Device::<bf16, bf16>::new(ctx, &Host::new(seed, &args));
        let rows = sample_rows(&args);
        let product = reference::matmul_rows(&args, &dev.rounded.a, &dev.rounded.b, &rows);
        let d = poisoned::<bf16>(ctx, args.d_len()).unwrap();
        OProj30 { args, dev, rows, product, d }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn knob_search_builds_configurations_around_the_fastest_and_stays_correct() {
    let ctx = tuned_gpu();
    ctx.set_autotune(3);
    ctx.set_knob_search(12);
    let o = OProj30::new(&ctx, 610);
    let (args, dev, rows, product, mut d) = (o.args, o.dev, o.rows, o.product, o.d);
    let plan = args.with_epilogue(Epilogue::RESIDUAL).plan(&ctx, DataType::BF16, DataType::BF16).unwrap();
    let heuristics = plan.candidates().len();
    assert!(plan.tune_time().is_zero());
    let (line, ok) = check(&ctx, &args, Epilogue::RESIDUAL, Backend::Fused, &dev, &rows, &product, &mut d);
    let timings = plan.timings();
    let knobs: Vec<String> = plan
        .knob_ranges()
        .unwrap()
        .iter()
        .map(|k| format!("{} {}..={} step {}", knob_name(k.kind), k.min, k.max, k.stride))
        .collect();
    println!("{line}\nchose {} of {timings:?}\nknobs of the chosen engine: {knobs:?}", plan.engine());
    assert!(ok, "{line}");
    assert_eq!(timings.len(), plan.candidates().len());
    assert!(
        timings.len() > heuristics && timings.len() <= heuristics + 12,
        "{heuristics} heuristics configurations, {} timed",
        timings.len()
    );
    let fastest = timings.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert_eq!(plan.engine(), fastest.0);
    assert!(!plan.tune_time().is_zero());
    // Each searched configuration is one knob away from a configuration timed before it.
    let parsed: Vec<(String, std::collections::BTreeMap<String, String>)> = timings
        .iter()
        .map(|(tag, _)| {
            let mut parts = tag.split("_k");
            let engine = parts.next().unwrap().to_string();
            let knobs =
                parts.map(|k| k.split_once('=').expect(tag)).map(|(k, v)| (k.into(), v.into())).collect();
            (engine, knobs)
        })
        .collect();
    for (i, (engine, knobs)) in parsed.iter().enumerate().skip(heuristics) {
        let one_away = parsed[..i].iter().any(|(e, earlier)| {
            let keys: std::collections::BTreeSet<&String> = knobs.keys().chain(earlier.keys()).collect();
            e == engine && keys.iter().filter(|k| knobs.get(**k) != earlier.get(**k)).count() == 1
        });
        assert!(one_away, "{} is not one knob away from an earlier candidate: {timings:?}", timings[i].0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tuning_times_every_candidate_and_stays_correct_under_each_l2_flush() {
    // Each flush mode empties L2 its own way before every timed candidate (what each costs is
    // `app/benches/matmul.rs`'s to measure): every candidate gets a finite time, the plan keeps the
    // fastest, and its output is right.
    let ctx = tuned_gpu();
    ctx.set_autotune(4);
    let o = OProj30::new(&ctx, 620);
    let (args, dev, rows, product, mut d) = (o.args, o.dev, o.rows, o.product, o.d);
    for flush in [L2Flush::Off, L2Flush::Write, L2Flush::Read] {
        ctx.set_tune_flush(flush);
        assert_eq!(ctx.tuning().flush, flush);
        ctx.cache().clear();
        let plan = args.with_epilogue(Epilogue::NONE).plan(&ctx, DataType::BF16, DataType::BF16).unwrap();
        assert!(plan.timings().is_empty(), "flush {}: timed before its first execution", flush.name());
        let (line, ok) = check(&ctx, &args, Epilogue::NONE, Backend::Fused, &dev, &rows, &product, &mut d);
        assert!(ok, "flush {}: {line}", flush.name());
        let timings = plan.timings();
        println!("flush {}: {timings:?}", flush.name());
        assert_eq!(timings.len(), plan.candidates().len(), "flush {}: {timings:?}", flush.name());
        assert!(timings.iter().all(|t| t.1.is_finite() && t.1 > 0.0), "flush {}: {timings:?}", flush.name());
        let fastest = timings.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        assert_eq!(plan.engine(), fastest.0, "flush {}", flush.name());
    }
}

// ---------------------------------------------------------------------------------------------------
// The decode GEMV: the fused backend's form for a Linear layer over at most 8 tokens.

/// Runs `e` in the GEMV form (forced, so that a silent fall back to the graph cannot pass) into a
/// NaN-poisoned D followed by 64 poisoned guard elements, and compares every row with the reference
/// and the guard with NaN. Returns the line to print and whether it passed.
fn check_gemv<T: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    e: Epilogue,
    dev: &Device<T, T>,
    product: &[f64],
) -> (String, bool) {
    let rows: Vec<usize> = (0..args.m()).collect();
    let mut d = poisoned::<T>(ctx, args.d_len() + 64).unwrap();
    let gemv = args.with_form(MatmulKernel::DecodeGemv);
    let (line, ok) = check(ctx, &gemv, e, Backend::Fused, dev, &rows, product, &mut d);
    let guard = download(ctx, &d).unwrap().split_off(args.d_len());
    let written = guard.iter().filter(|v| !v.to_f64().is_nan()).count();
    if written > 0 {
        return (format!("{line}; {written} of the 64 elements after D were written"), false);
    }
    (line, ok)
}

/// Every epilogue in `epilogues` on one shape in the GEMV form, against the f64 reference of all rows.
fn check_gemv_shape<T: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    epilogues: &[Epilogue],
    seed: u64,
    failures: &mut Vec<String>,
) {
    let dev = Device::<T, T>::new(ctx, &Host::new(seed, args));
    let rows: Vec<usize> = (0..args.m()).collect();
    let product = reference::matmul_rows(args, &dev.rounded.a, &dev.rounded.b, &rows);
    for &e in epilogues {
        let (line, ok) = check_gemv(ctx, args, e, &dev, &product);
        println!("{} {line}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(line);
        }
    }
}

/// Llama-3.1-8B's decode projections `(name, k, n, epilogue)`.
const LLAMA_8B_DECODE: [(&str, usize, usize, Epilogue); 5] = [
    ("qkv", 4096, 6144, Epilogue::NONE),
    ("o", 4096, 4096, Epilogue::RESIDUAL),
    ("up", 4096, 14336, Epilogue::NONE),
    ("gate", 4096, 14336, Epilogue::SWIGLU),
    ("down", 14336, 4096, Epilogue::RESIDUAL),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_gemv_matches_the_reference() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mut failures = Vec::new();
    let used = [Epilogue::NONE, Epilogue::RESIDUAL, Epilogue::SWIGLU];
    for m in [1, 3, DECODE_GEMV_MAX_TOKENS] {
        // Llama-3.1-8B's shapes, the epilogues a decoder uses, bf16 and f16.
        for (i, (_, k, n, _)) in LLAMA_8B_DECODE.iter().enumerate() {
            let args = MatmulArgs::linear(m, *k, *n);
            let seed = 700 + 10 * i as u64 + m as u64;
            check_gemv_shape::<bf16>(&ctx, &args, &used, seed, &mut failures);
            check_gemv_shape::<f16>(&ctx, &args, &used, seed + 100, &mut failures);
        }
        // Small and odd shapes, every epilogue (k and n are multiples of 8 on every backend, the shared
        // check's 16-byte rows): k = 8 (one chunk: one lane works), n = 8, n an odd number of 8s (the last
        // block has idle warps at 5 to 8 tokens), k = 4104 (513 chunks: the remainder loop), k = 7176
        // (the one-token long-row tile, 897 chunks: its remainder), a vocabulary-sized n.
        for (i, (k, n)) in
            [(8, 8), (8, 24), (64, 40), (4104, 56), (7176, 40), (64, 4104), (256, 50264)].iter().enumerate()
        {
            let args = MatmulArgs::linear(m, *k, *n);
            let seed = 900 + 10 * i as u64 + m as u64;
            check_gemv_shape::<bf16>(&ctx, &args, &epilogues(), seed, &mut failures);
            check_gemv_shape::<f16>(&ctx, &args, &epilogues(), seed + 100, &mut failures);
        }
    }
    // Every m up to the bound (each tile, and the tokens a tile repeats), one shape.
    for m in 1..=DECODE_GEMV_MAX_TOKENS {
        let args = MatmulArgs::linear(m, 1024, 520);
        check_gemv_shape::<bf16>(
            &ctx,
            &args,
            &[Epilogue::SWIGLU.with_residual()],
            1000 + m as u64,
            &mut failures,
        );
    }
    // A padded x (rows 4160 elements apart) and a padded weight (rows 4112 apart), as strided views.
    let padded = MatmulArgs::new(
        MatrixLayout::strided([1, 3, 4096], [3 * 4160, 4160, 1]),
        MatrixLayout::strided([1, 4096, 1000], [1000 * 4112, 1, 4112]),
    );
    check_gemv_shape::<bf16>(&ctx, &padded, &used, 1100, &mut failures);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_gemv_agrees_with_the_cudnn_graph_on_llama_8b() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for m in [1, 3, DECODE_GEMV_MAX_TOKENS] {
        for (proj, k, n, e) in LLAMA_8B_DECODE {
            let args = MatmulArgs::linear(m, k, n).with_epilogue(e);
            let dev = Device::<bf16, bf16>::new(&ctx, &Host::new(1200 + k as u64 + m as u64, &args));
            let mut out = Vec::new();
            for form in [MatmulKernel::Graph, MatmulKernel::DecodeGemv] {
                let mut y = poisoned::<bf16>(&ctx, args.d_len()).unwrap();
                matmul(&ctx, &args.with_form(form), dev.operands(e, &mut y), Backend::Fused).unwrap();
                out.push(download(&ctx, &y).unwrap());
            }
            let graph: Vec<f64> = out[0].iter().map(|v| v.to_f64()).collect();
            let c = reference::compare(&out[1], &graph);
            let same = out[0].iter().zip(&out[1]).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            let ok = c.passes(reference::BF16_TOL);
            let line = format!(
                "8B {proj} m={m} {k}->{n} {e}: gemv vs graph {c}; {same} of {} bit-identical",
                args.d_len()
            );
            println!("{} {line}", if ok { "ok  " } else { "FAIL" });
            if !ok {
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_fused_backend_takes_the_gemv_where_it_applies_and_says_so() {
    let ctx = gpu();
    let (k, n) = (1024, 2048);
    let args = MatmulArgs::linear(8, k, n);
    let dev = Device::<bf16, bf16>::new(&ctx, &Host::new(1300, &args));
    let mut d = poisoned::<bf16>(&ctx, args.d_len() + 8).unwrap();
    let calls = |ctx: &Cudnn| -> u64 {
        ctx.kernel_runs().iter().filter(|r| r.name.starts_with("decode gemv")).map(|r| r.calls).sum()
    };
    ctx.cache().clear();
    let (runs0, plans0) = (calls(&ctx), ctx.cache().stats().misses);
    // No form at 1 token: the GEMV, no plan.
    let a = MatmulArgs::linear(1, k, n).with_epilogue(Epilogue::RESIDUAL);
    matmul(&ctx, &a, dev.operands(Epilogue::RESIDUAL, &mut d), Backend::Fused).unwrap();
    assert_eq!((calls(&ctx) - runs0, ctx.cache().stats().misses - plans0), (1, 0), "{:?}", ctx.kernel_runs());
    let runs = ctx.kernel_runs();
    println!("kernel runs: {runs:?}");
    assert!(
        runs.iter()
            .any(|r| r.name == "decode gemv [1, 1024] x [1024, 2048] bf16 epilogue residual (gemv_bf16_m1)"),
        "{runs:?}"
    );
    // The graph form, 9 tokens, and no form at 8 tokens (the GEMV takes them only when asked for,
    // DECODE_GEMV_AUTO_TOKENS): a plan each, no GEMV.
    let graph = MatmulArgs::linear(1, k, n).with_form(MatmulKernel::Graph);
    matmul(&ctx, &graph, dev.operands(Epilogue::NONE, &mut d), Backend::Fused).unwrap();
    let nine = MatmulArgs::linear(8 + 1, k, n);
    let (a9, _) = upload::<bf16>(&ctx, &reference::random_values(1301, 9 * k)).unwrap();
    let mut d9 = poisoned::<bf16>(&ctx, 9 * n).unwrap();
    matmul(&ctx, &nine, MatmulOperands::new(&a9, &dev.b, &mut d9), Backend::Fused).unwrap();
    let eight = MatmulArgs::linear(8, k, n).with_epilogue(Epilogue::RESIDUAL);
    matmul(&ctx, &eight, dev.operands(Epilogue::RESIDUAL, &mut d), Backend::Fused).unwrap();
    assert_eq!((calls(&ctx) - runs0, ctx.cache().stats().misses - plans0), (1, 3));
    // The naive backend ignores the form.
    let forced = MatmulArgs::linear(1, k, n).with_form(MatmulKernel::DecodeGemv);
    matmul(&ctx, &forced, dev.operands(Epilogue::NONE, &mut d), Backend::Naive).unwrap();
    assert_eq!(calls(&ctx) - runs0, 1);
    // An x one element in: no GEMV (16-byte chunks); the graph refuses it too, the forced GEMV says why,
    // and neither writes anything.
    let (wide, _) = upload::<bf16>(&ctx, &reference::random_values(1302, k + 8)).unwrap();
    let off = wide.slice(1..);
    let one = MatmulArgs::linear(1, k, n);
    let err = expect_untouched(&ctx, &mut d, "is not 16-byte aligned", |d| {
        matmul(&ctx, &one, MatmulOperands::new(&off, &dev.b, d), Backend::Fused)
    });
    assert!(!err.to_string().contains("decode gemv"), "the graph's error, not the GEMV's: {err}");
    let err = expect_untouched(&ctx, &mut d, "A or B is not 16-byte aligned", |d| {
        matmul(&ctx, &forced, MatmulOperands::new(&off, &dev.b, d), Backend::Fused)
    });
    assert!(err.is_not_supported() && err.to_string().contains("decode gemv"), "{err}");
    // A forced GEMV that does not apply is NotSupported naming the reason, and touches nothing.
    let err = expect_untouched(&ctx, &mut d9, "9 rows of A (tokens)", |d| {
        matmul(
            &ctx,
            &nine.with_form(MatmulKernel::DecodeGemv),
            MatmulOperands::new(&a9, &dev.b, d),
            Backend::Fused,
        )
    });
    assert!(err.is_not_supported(), "{err}");
    assert_eq!(calls(&ctx) - runs0, 1);
}

// ---------------------------------------------------------------------------------------------------
// The decode GEMV's one-token fused forms: the RMSNorm prologue, the up product, both.

#[test]
fn fused_decode_reference_by_hand() {
    // x = [1, 1, 1, 1]: mean square 1, ε 0, so the normalized x is the norm weight [1, 2, 0.5, -1].
    let x = [1.0; 4];
    let norm = [1.0, 2.0, 0.5, -1.0];
    let w = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0];
    let w_up = [2.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    let plain = reference::decode_fused::<bf16>(Epilogue::NONE, &x, &w, None, None, None, None);
    assert_eq!(plain, vec![1.0, 3.0]);
    let normed =
        reference::decode_fused::<bf16>(Epilogue::NONE, &x, &w, Some((&norm, 0.0)), None, None, None);
    assert_eq!(normed, vec![1.0, 1.5]);
    // RMSNorm is scale invariant: 2·x gives the same rows.
    let x2 = [2.0; 4];
    assert_eq!(
        reference::decode_fused::<bf16>(Epilogue::NONE, &x2, &w, Some((&norm, 0.0)), None, None, None),
        normed
    );
    // Gate and up: silu(x·W) · (x·W_up), U = [2, 2.5]; then + R.
    let r = [0.25, -0.5];
    let e = Epilogue::SWIGLU.with_residual();
    let d = reference::decode_fused::<bf16>(e, &x, &w, Some((&norm, 0.0)), Some(&w_up), None, Some(&r));
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let expected = [silu(1.0) * 2.0 + 0.25, silu(1.5) * 2.5 - 0.5];
    assert!(d.iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-12), "{d:?} vs {expected:?}");
    // The rounding to the I/O dtype: x·W_up = 1 + 2^-9 is 1 in bf16 (8 mantissa bits), itself in f16.
    let up_row = [1.0 + 1.0 / 512.0];
    let bf =
        reference::decode_fused::<bf16>(Epilogue::SWIGLU, &[1.0], &[1.0], None, Some(&up_row), None, None);
    let hf =
        reference::decode_fused::<f16>(Epilogue::SWIGLU, &[1.0], &[1.0], None, Some(&up_row), None, None);
    assert_eq!((bf[0], hf[0]), (silu(1.0), silu(1.0) * up_row[0]));
}

/// One fused-form case at one token: x, W, W_up and the norm weight (`[k]` around 1, as trained norm
/// weights are), the residual.
struct FusedCase<T: Element> {
    x: CudaSlice<T>,
    w: CudaSlice<T>,
    w_up: CudaSlice<T>,
    norm: CudaSlice<T>,
    r: CudaSlice<T>,
    rounded: [Vec<f64>; 5],
}

const NORM_EPS: f32 = 1e-5;

impl<T: Element> FusedCase<T> {
    fn new(ctx: &Cudnn, k: usize, n: usize, seed: u64) -> Self {
        let scale = 3.0 / (k as f64).sqrt();
        let x: Vec<f64> = reference::random_values(seed, k).iter().map(|v| 4.0 * v).collect();
        let w: Vec<f64> = reference::random_values(seed + 1, n * k).iter().map(|v| v * scale).collect();
        let w_up: Vec<f64> = reference::random_values(seed + 2, n * k).iter().map(|v| v * scale).collect();
        let norm: Vec<f64> = reference::random_values(seed + 3, k).iter().map(|v| 1.0 + 0.5 * v).collect();
        let r = reference::random_values(seed + 4, n);
        let (x, xr) = upload::<T>(ctx, &x).unwrap();
        let (w, wr) = upload::<T>(ctx, &w).unwrap();
        let (w_up, ur) = upload::<T>(ctx, &w_up).unwrap();
        let (norm, nr) = upload::<T>(ctx, &norm).unwrap();
        let (r, rr) = upload::<T>(ctx, &r).unwrap();
        FusedCase { x, w, w_up, norm, r, rounded: [xr, wr, ur, nr, rr] }
    }

    /// `args`'s fused form (prologue and up product as it says) into a poisoned D with 64 guard
    /// elements: D, and how many guard elements were written.
    fn fused(&self, ctx: &Cudnn, args: &MatmulArgs) -> (Vec<T>, usize) {
        let n = args.n();
        let mut d = poisoned::<T>(ctx, n + 64).unwrap();
        let mut x = MatmulOperands::new(&self.x, &self.w, &mut d);
        if args.prologue.is_some() {
            x = x.norm_weight(&self.norm);
        }
        if args.up_product {
            x = x.up_weight(&self.w_up);
        }
        if args.epilogue.residual {
            x = x.residual(&self.r);
        }
        matmul(ctx, &args.with_form(MatmulKernel::DecodeGemv), x, Backend::Fused).unwrap();
        let mut out = download(ctx, &d).unwrap();
        let guard = out.split_off(n);
        (out, guard.iter().filter(|v| !v.to_f64().is_nan()).count())
    }

    /// The unfused fused-backend path a decoder runs without the forms: the RMSNorm graph into a
    /// poisoned buffer, the up projection's GEMV, the gate's GEMV with the epilogue.
    fn unfused(&self, ctx: &Cudnn, args: &MatmulArgs) -> Vec<T> {
        let (k, n) = (args.k(), args.n());
        let mut xn = poisoned::<T>(ctx, k).unwrap();
        let x: &CudaSlice<T> = if args.prologue.is_some() {
            let norm = RmsNormArgs::new(1, k, NORM_EPS);
            rms_norm(ctx, norm, RmsNormOperands::new(&self.x, &self.norm, &mut xn), Backend::Fused).unwrap();
            &xn
        } else {
            &self.x
        };
        let gemv = MatmulArgs::linear(1, k, n).with_form(MatmulKernel::DecodeGemv);
        let mut up = poisoned::<T>(ctx, n).unwrap();
        if args.up_product {
            matmul(ctx, &gemv, MatmulOperands::new(x, &self.w_up, &mut up), Backend::Fused).unwrap();
        }
        let mut d = poisoned::<T>(ctx, n).unwrap();
        let mut ops = MatmulOperands::new(x, &self.w, &mut d);
        if args.up_product {
            ops = ops.up(&up);
        }
        if args.epilogue.residual {
            ops = ops.residual(&self.r);
        }
        matmul(ctx, &gemv.with_epilogue(args.epilogue), ops, Backend::Fused).unwrap();
        download(ctx, &d).unwrap()
    }

    fn reference(&self, args: &MatmulArgs) -> Vec<f64> {
        let [x, w, w_up, norm, r] = &self.rounded;
        let e = args.epilogue;
        reference::decode_fused::<T>(
            e,
            x,
            w,
            args.prologue.map(|_| (&norm[..], NORM_EPS as f64)),
            args.up_product.then_some(&w_up[..]),
            None,
            e.residual.then_some(&r[..]),
        )
    }
}

/// The fused forms against the f64 reference (the dtype's tolerance) and against the unfused
/// fused-backend path (the same tolerance; the count of bit-identical outputs is printed: the up
/// product rounds as the up projection does, so without the prologue they should all be identical;
/// with it the unfused path rounds the normalized row, the prologue does not).
fn check_fused_forms<T: Element>(ctx: &Cudnn, k: usize, n: usize, seed: u64, failures: &mut Vec<String>) {
    let case = FusedCase::<T>::new(ctx, k, n, seed);
    let norm = Prologue::rms_norm(NORM_EPS);
    let base = MatmulArgs::linear(1, k, n);
    let swiglu = base.with_epilogue(Epilogue::SWIGLU).with_up_product();
    let forms = [
        ("norm", base.with_prologue(norm)),
        ("norm+residual", base.with_epilogue(Epilogue::RESIDUAL).with_prologue(norm)),
        ("dual", swiglu),
        ("norm+dual", swiglu.with_prologue(norm)),
        (
            "norm+dual+residual",
            base.with_epilogue(Epilogue::SWIGLU.with_residual()).with_up_product().with_prologue(norm),
        ),
    ];
    let tol = reference::tolerance(T::DTYPE);
    for (name, args) in forms {
        let (out, guard) = case.fused(ctx, &args);
        let vs_ref = reference::compare(&out, &case.reference(&args));
        let unfused = case.unfused(ctx, &args);
        let unfused_f64: Vec<f64> = unfused.iter().map(|v| v.to_f64()).collect();
        let vs_unfused = reference::compare(&out, &unfused_f64);
        let same =
            out.iter().zip(&unfused).filter(|(a, b)| a.to_f64().to_bits() == b.to_f64().to_bits()).count();
        let ok = vs_ref.passes(tol) && vs_unfused.passes(tol) && guard == 0;
        let line = format!(
            "{} {name} [1, {k}] x [{k}, {n}]: vs reference {vs_ref}; vs unfused {vs_unfused}, {same} of {n} \
             bit-identical; {guard} of 64 guard elements written",
            T::DTYPE
        );
        println!("{} {line}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(line);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_gemv_fused_forms_match_the_reference_and_the_unfused_path() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mut failures = Vec::new();
    // Llama-3.1-8B's qkv and gate/up shapes; small and odd ones: k = 8 (one chunk), k = 4104 (the
    // remainder loop), n not a multiple of a block's warps, a vocabulary-sized n, a long row (k = 16384).
    for (i, (k, n)) in [(4096, 6144), (4096, 14336), (8, 8), (64, 40), (4104, 56), (256, 50264), (16384, 136)]
        .iter()
        .enumerate()
    {
        check_fused_forms::<bf16>(&ctx, *k, *n, 1500 + 10 * i as u64, &mut failures);
        check_fused_forms::<f16>(&ctx, *k, *n, 1600 + 10 * i as u64, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// A long row through the RMSNorm prologue in both splits: it keeps nothing in shared memory, so
/// rows past what a block's shared memory would hold (k = 32768, 64 KiB in bf16; the forms once kept
/// the normalized row there and refused k above 24448) run and match the reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_long_row_runs_the_norm_prologue_in_both_splits() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let (k, bf) = (32768, DataType::BF16);
    MatmulArgs::linear(1, k, 136)
        .with_prologue(Prologue::rms_norm(NORM_EPS))
        .decode_gemv(bf, bf, bf)
        .unwrap();
    let mut failures = Vec::new();
    for split in [GemvSplit::Warp, GemvSplit::Block] {
        ctx.set_gemv_split(split);
        println!("split {}", split.name());
        check_fused_forms::<bf16>(&ctx, k, 136, 1700, &mut failures);
        check_fused_forms::<f16>(&ctx, k, 136, 1710, &mut failures);
    }
    ctx.set_gemv_split(GemvSplit::Auto);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_graph_and_the_naive_backend_refuse_the_fused_forms() {
    let ctx = gpu();
    let case = FusedCase::<bf16>::new(&ctx, 64, 64, 1700);
    let args = MatmulArgs::linear(1, 64, 64).with_prologue(Prologue::rms_norm(NORM_EPS));
    for (backend, form, expected) in [
        (Backend::Fused, Some(MatmulKernel::Graph), "the cuDNN graph has no prologue"),
        (Backend::Naive, None, "forms of the fused backend's decode GEMV"),
    ] {
        let a = match form {
            Some(f) => args.with_form(f),
            None => args,
        };
        let mut d = poisoned::<bf16>(&ctx, 64).unwrap();
        let err =
            matmul(&ctx, &a, MatmulOperands::new(&case.x, &case.w, &mut d).norm_weight(&case.norm), backend)
                .unwrap_err();
        assert!(err.is_not_supported() && err.to_string().contains(expected), "{err}");
        let untouched = download(&ctx, &d).unwrap().iter().all(|v| v.to_f64().is_nan());
        assert!(untouched, "{backend:?}: D was written by a refused call");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_decode_gemv_replays() {
    // The launch depends on the shape only: a CUDA graph of it replays on new inputs.
    let ctx = gpu();
    let args = MatmulArgs::linear(1, 4096, 6144).with_epilogue(Epilogue::RESIDUAL);
    let mut dev = Device::<bf16, bf16>::new(&ctx, &Host::new(1400, &args));
    let mut d = poisoned::<bf16>(&ctx, args.d_len()).unwrap();
    // The kernels load outside the capture, as plans are built outside one.
    matmul(&ctx, &args, dev.operands(Epilogue::RESIDUAL, &mut d), Backend::Fused).unwrap();
    // SAFETY: one thread, nothing else on this context's CUDA context meanwhile.
    let ((), graph) = unsafe {
        ctx.capture(|| matmul(&ctx, &args, dev.operands(Epilogue::RESIDUAL, &mut d), Backend::Fused))
    }
    .unwrap();
    let rows = [0];
    for seed in [1401, 1402] {
        // New x and residual in place, a poisoned D, then the replay.
        let h = Host::new(seed, &args);
        let (a, ar) = upload::<bf16>(&ctx, &h.a).unwrap();
        let (r, rr) = upload::<bf16>(&ctx, &h.r).unwrap();
        ctx.stream().memcpy_dtod(&a, &mut dev.a).unwrap();
        ctx.stream().memcpy_dtod(&r, &mut dev.r).unwrap();
        ctx.stream().memcpy_htod(&vec![bf16::NAN; d.len()], &mut d).unwrap();
        graph.launch().unwrap();
        let product = reference::matmul_rows(&args, &ar, &dev.rounded.b, &rows);
        let expected =
            reference::matmul_epilogue(Epilogue::RESIDUAL, &product, args.n(), &rows, None, None, Some(&rr));
        let c = reference::compare(&download(&ctx, &d).unwrap(), &expected);
        println!("replay with seed {seed}: {c}");
        assert!(c.passes(reference::BF16_TOL), "replay with seed {seed}: {c}");
    }
}

// ---------------------------------------------------------------------------------------------------
// The one-token GEMV's two splits (a warp or a block per row group) and programmatic dependent launch.

/// The splits and PDL settings the tests below run, with a name each.
const SPLITS: [(GemvSplit, bool, &str); 4] = [
    (GemvSplit::Warp, true, "warp, pdl on"),
    (GemvSplit::Block, true, "block, pdl on"),
    (GemvSplit::Block, false, "block, pdl off"),
    (GemvSplit::Auto, true, "auto, pdl on"),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn both_gemv_splits_match_the_reference_and_the_unfused_path_with_and_without_pdl() {
    let ctx = gpu();
    println!(
        "{} ({} SMs, sm_{}{}), cuDNN {}; PDL available: {}",
        ctx.info().name,
        ctx.info().sm_count,
        ctx.info().compute_capability.0,
        ctx.info().compute_capability.1,
        ctx.info().cudnn_version_string(),
        ctx.programmatic_launch()
    );
    let mut failures = Vec::new();
    for (split, pdl, name) in SPLITS {
        ctx.set_gemv_split(split);
        ctx.set_programmatic_launch(pdl);
        println!("-- {name}");
        // One token: Llama-3.1-8B's projections (every epilogue a decoder uses), and small and odd
        // shapes: k = 8 (one chunk), k = 64 (under one round of the block form), k = 4104 and 7176
        // (the remainder loops of the one-token tiles), n = 8 and 16 (fewer rows than one block
        // holds), 24, 40 and 56 (a last block that is not full), a vocabulary-sized n. (The matmul API takes n in multiples of 8, 16-byte rows of D: n = 1 or
        // 57 is refused before any launch, so those rows of the kernels are unreachable.)
        let used = [Epilogue::NONE, Epilogue::RESIDUAL, Epilogue::SWIGLU];
        for (i, (_, k, n, _)) in LLAMA_8B_DECODE.iter().enumerate() {
            let args = MatmulArgs::linear(1, *k, *n);
            check_gemv_shape::<bf16>(&ctx, &args, &used, 2000 + i as u64, &mut failures);
        }
        for (i, (k, n)) in
            [(8, 8), (8, 16), (64, 40), (4104, 56), (7176, 40), (1032, 24), (256, 50264)].iter().enumerate()
        {
            let args = MatmulArgs::linear(1, *k, *n);
            check_gemv_shape::<bf16>(&ctx, &args, &epilogues(), 2100 + i as u64, &mut failures);
            check_gemv_shape::<f16>(&ctx, &args, &epilogues(), 2200 + i as u64, &mut failures);
        }
        // The fused forms (reference, the unfused path, guard elements).
        for (i, (k, n)) in
            [(4096, 6144), (4096, 14336), (8, 8), (64, 40), (4104, 56), (16384, 136)].iter().enumerate()
        {
            check_fused_forms::<bf16>(&ctx, *k, *n, 2300 + 10 * i as u64, &mut failures);
            check_fused_forms::<f16>(&ctx, *k, *n, 2400 + 10 * i as u64, &mut failures);
        }
    }
    let runs = ctx.kernel_runs();
    for kernel in [
        "gemv_bf16_m1_block)",
        "gemv_bf16_m1_norm_dual_block)",
        "gemv_f16_m1_norm_block)",
        "gemv_bf16_m1)",
        "gemv_bf16_m1_u2)",
    ] {
        assert!(runs.iter().any(|r| r.name.ends_with(kernel)), "no run of {kernel}: {runs:?}");
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// A decode step's chain of dependent custom kernels at Llama-3.1-8B widths, each reading what the one
/// before wrote: the qkv GEMV with the prenorm folded in, RoPE with the K/V append (position from the
/// device), the o GEMV on the rotated Q plus the residual x, the gate-up GEMV with the prenorm, the
/// down GEMV plus the residual. Buffers it writes are poisoned before each run.
struct Chain {
    x: CudaSlice<bf16>,
    norm: CudaSlice<bf16>,
    w_qkv: CudaSlice<bf16>,
    w_o: CudaSlice<bf16>,
    w_gate: CudaSlice<bf16>,
    w_up: CudaSlice<bf16>,
    w_down: CudaSlice<bf16>,
    tables: RopeTables<bf16>,
    start: CudaSlice<i32>,
    qkv: CudaSlice<bf16>,
    kc: CudaSlice<bf16>,
    vc: CudaSlice<bf16>,
    h: CudaSlice<bf16>,
    mlp: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
}

const CHAIN_FFN: usize = 2048;
const CHAIN_CACHE: usize = 16;

impl Chain {
    fn new(ctx: &Cudnn) -> Self {
        let (hidden, qkv_n, ffn) = (4096, 6144, CHAIN_FFN);
        let w = |seed: u64, n: usize, k: usize| {
            let scale = 3.0 / (k as f64).sqrt();
            let v: Vec<f64> = reference::random_values(seed, n * k).iter().map(|v| v * scale).collect();
            upload::<bf16>(ctx, &v).unwrap().0
        };
        let norm: Vec<f64> = reference::random_values(2501, hidden).iter().map(|v| 1.0 + 0.5 * v).collect();
        let half = 64;
        let angle = |i: usize| (i / half) as f64 * 500000f64.powf(-((2 * (i % half)) as f64) / 128.0);
        let cos: Vec<f64> = (0..CHAIN_CACHE * half).map(|i| angle(i).cos()).collect();
        let sin: Vec<f64> = (0..CHAIN_CACHE * half).map(|i| angle(i).sin()).collect();
        let cache = CHAIN_CACHE * 8 * 128;
        Chain {
            x: upload::<bf16>(ctx, &reference::random_values(2500, hidden)).unwrap().0,
            norm: upload::<bf16>(ctx, &norm).unwrap().0,
            w_qkv: w(2502, qkv_n, hidden),
            w_o: w(2503, hidden, hidden),
            w_gate: w(2504, ffn, hidden),
            w_up: w(2505, ffn, hidden),
            w_down: w(2506, hidden, ffn),
            tables: RopeTables::new(ctx, &cos, &sin, 128).unwrap(),
            start: ctx.stream().clone_htod(&[5i32]).unwrap(),
            qkv: poisoned(ctx, qkv_n).unwrap(),
            kc: poisoned(ctx, cache).unwrap(),
            vc: poisoned(ctx, cache).unwrap(),
            h: poisoned(ctx, hidden).unwrap(),
            mlp: poisoned(ctx, ffn).unwrap(),
            out: poisoned(ctx, hidden).unwrap(),
        }
    }

    /// Enqueues the chain (nothing waits for it).
    fn run(&mut self, ctx: &Cudnn) -> cudnn_llm_ops::Result<()> {
        let (hidden, ffn) = (4096, CHAIN_FFN);
        let norm = Prologue::rms_norm(NORM_EPS);
        let qkv = MatmulArgs::linear(1, hidden, 6144).with_prologue(norm);
        matmul(
            ctx,
            &qkv,
            MatmulOperands::new(&self.x, &self.w_qkv, &mut self.qkv).norm_weight(&self.norm),
            Backend::Fused,
        )?;
        let r = RopeArgs::new(1, 1, 32, 8, 128).with_row_stride(6144);
        let ops = RopeOperands::new(&self.tables, &mut self.qkv)
            .append(&mut self.kc, &mut self.vc, CHAIN_CACHE)
            .starts(&self.start);
        rope(ctx, r, ops, Backend::Fused)?;
        let q = self.qkv.slice(0..hidden);
        let o = MatmulArgs::linear(1, hidden, hidden).with_epilogue(Epilogue::RESIDUAL);
        matmul(ctx, &o, MatmulOperands::new(&q, &self.w_o, &mut self.h).residual(&self.x), Backend::Fused)?;
        let gate = MatmulArgs::linear(1, hidden, ffn)
            .with_epilogue(Epilogue::SWIGLU)
            .with_up_product()
            .with_prologue(norm);
        let ops = MatmulOperands::new(&self.h, &self.w_gate, &mut self.mlp)
            .up_weight(&self.w_up)
            .norm_weight(&self.norm);
        matmul(ctx, &gate, ops, Backend::Fused)?;
        let down = MatmulArgs::linear(1, ffn, hidden).with_epilogue(Epilogue::RESIDUAL);
        matmul(
            ctx,
            &down,
            MatmulOperands::new(&self.mlp, &self.w_down, &mut self.out).residual(&self.h),
            Backend::Fused,
        )
    }

    /// Poisons every buffer the chain writes.
    fn poison(&mut self, ctx: &Cudnn) {
        for buf in [&mut self.qkv, &mut self.kc, &mut self.vc, &mut self.h, &mut self.mlp, &mut self.out] {
            let nan = vec![bf16::NAN; buf.len()];
            ctx.stream().memcpy_htod(&nan, buf).unwrap();
        }
    }

    /// What the chain wrote: the rotated qkv row, the K and V caches, the residual stream after
    /// attention, the MLP's activation, the output.
    fn outputs(&self, ctx: &Cudnn) -> Vec<Vec<u16>> {
        [&self.qkv, &self.kc, &self.vc, &self.h, &self.mlp, &self.out]
            .iter()
            .map(|b| download(ctx, b).unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_decode_chain_replays_with_pdl_as_it_runs_without() {
    // The chain launched plainly without PDL is the baseline (each kernel's correctness is tested
    // above and in cudnn-ops/tests/rope.rs); with PDL, plainly and replayed from a CUDA graph, every output must
    // be bit-identical to it (the kernels and their reduction orders are the same): a kernel that read
    // its input before the previous one finished would read poison (NaN) or a stale value.
    let ctx = gpu();
    println!(
        "{} sm_{}{}, PDL available: {}",
        ctx.info().name,
        ctx.info().compute_capability.0,
        ctx.info().compute_capability.1,
        ctx.programmatic_launch()
    );
    let names = ["qkv (rotated)", "K cache", "V cache", "h", "mlp", "out"];
    let mut chain = Chain::new(&ctx);
    for split in [GemvSplit::Warp, GemvSplit::Block, GemvSplit::Auto] {
        ctx.set_gemv_split(split);
        ctx.set_programmatic_launch(false);
        chain.poison(&ctx);
        chain.run(&ctx).unwrap();
        let base = chain.outputs(&ctx);
        let nan = base[5].iter().filter(|&&b| bf16::from_bits(b).is_nan()).count();
        assert_eq!(nan, 0, "{}: the baseline output has {nan} NaNs", split.name());
        // The K/V cache row at position 5 was written, the others kept their poison.
        let written =
            base[1].chunks(1024).filter(|row| row.iter().all(|&b| !bf16::from_bits(b).is_nan())).count();
        assert_eq!(written, 1, "{}: {written} K cache rows written", split.name());
        ctx.set_programmatic_launch(true);
        chain.poison(&ctx);
        chain.run(&ctx).unwrap();
        let plain = chain.outputs(&ctx);
        // SAFETY: one thread, nothing else on this context's CUDA context meanwhile.
        let ((), graph) = unsafe { ctx.capture(|| chain.run(&ctx)) }.unwrap();
        for replay in 0..3 {
            chain.poison(&ctx);
            graph.launch().unwrap();
            let got = chain.outputs(&ctx);
            for (what, (name, (g, p))) in [("replay", &got), ("plain", &plain)]
                .iter()
                .flat_map(|(what, out)| names.iter().zip(out.iter().zip(&base)).map(move |x| (*what, x)))
            {
                let diff = g.iter().zip(p).filter(|(a, b)| a != b).count();
                println!(
                    "{} {what} {replay} {name}: {diff} of {} differ from the run without PDL",
                    split.name(),
                    g.len()
                );
                assert_eq!(
                    diff,
                    0,
                    "{} {what} {replay} {name}: {diff} of {} elements differ",
                    split.name(),
                    g.len()
                );
            }
        }
    }
    ctx.set_programmatic_launch(true);
}

/// A norm weight `[k]` around 1, as trained ones are.
fn norm_weight<T: Element>(ctx: &Cudnn, k: usize, seed: u64) -> CudaSlice<T> {
    let g: Vec<f64> = reference::random_values(seed, k).iter().map(|v| 1.0 + 0.5 * v).collect();
    upload::<T>(ctx, &g).unwrap().0
}

/// RoPE tables of head dim `d` (base 10000) for `positions` positions.
fn rope_tables<T: Element>(ctx: &Cudnn, d: usize, positions: usize) -> RopeTables<T> {
    let half = d / 2;
    let angle = |i: usize| (i / half) as f64 * 10000f64.powf(-((2 * (i % half)) as f64) / d as f64);
    let cos: Vec<f64> = (0..positions * half).map(|i| angle(i).cos()).collect();
    let sin: Vec<f64> = (0..positions * half).map(|i| angle(i).sin()).collect();
    RopeTables::<T>::new(ctx, &cos, &sin, d).unwrap()
}

/// One rotary-epilogue case: `[1, k] x [k, (hq + 2 hkv) d]` (with the RMSNorm prologue or not), RoPE
/// tables of `positions` rows, caches of `max_seq` rows, the token at `pos`. The GEMV with the rotary
/// epilogue against the same GEMV followed by the RoPE op with its K/V append (device position): D and
/// both whole caches (poisoned alike before) bit for bit; where `pos` is inside the tables and the
/// cache, the cache rows at `pos` are written, elsewhere nothing is.
#[allow(clippy::too_many_arguments)]
fn check_rotary<T: Element>(
    ctx: &Cudnn,
    (hq, hkv, d): (usize, usize, usize),
    k: usize,
    positions: usize,
    max_seq: usize,
    pos: i32,
    norm: bool,
    seed: u64,
) -> Option<String> {
    use cudnn_llm_ops::{Rotary, RotaryOperands};
    let n = (hq + 2 * hkv) * d;
    let scale = 3.0 / (k as f64).sqrt();
    let x = upload::<T>(ctx, &reference::random_values(seed, k)).unwrap().0;
    let wv: Vec<f64> = reference::random_values(seed + 1, n * k).iter().map(|v| v * scale).collect();
    let w = upload::<T>(ctx, &wv).unwrap().0;
    let (g, tables) = (norm_weight::<T>(ctx, k, seed + 2), rope_tables::<T>(ctx, d, positions));
    let at = ctx.stream().clone_htod(&[pos]).unwrap();
    let cache = max_seq * hkv * d;
    let mut base = MatmulArgs::linear(1, k, n).with_form(MatmulKernel::DecodeGemv);
    if norm {
        base = base.with_prologue(Prologue::rms_norm(1e-5));
    }
    // The projection, then RoPE with the append.
    let (mut y1, mut k1, mut v1) = (
        poisoned::<T>(ctx, n).unwrap(),
        poisoned::<T>(ctx, cache).unwrap(),
        poisoned::<T>(ctx, cache).unwrap(),
    );
    let ops = MatmulOperands::new(&x, &w, &mut y1);
    let ops = if norm { ops.norm_weight(&g) } else { ops };
    matmul(ctx, &base, ops, Backend::Fused).unwrap();
    let r = RopeArgs::new(1, 1, hq, hkv, d).with_row_stride(n);
    let ops = RopeOperands::new(&tables, &mut y1).append(&mut k1, &mut v1, max_seq).starts(&at);
    rope(ctx, r, ops, Backend::Fused).unwrap();
    // One launch.
    let (mut y2, mut k2, mut v2) = (
        poisoned::<T>(ctx, n).unwrap(),
        poisoned::<T>(ctx, cache).unwrap(),
        poisoned::<T>(ctx, cache).unwrap(),
    );
    let args = base.with_rotary(Rotary::new(hq, hkv, d, max_seq));
    let ops =
        MatmulOperands::new(&x, &w, &mut y2).rotary(RotaryOperands::new(&tables, &at, &mut k2, &mut v2));
    let ops = if norm { ops.norm_weight(&g) } else { ops };
    matmul(ctx, &args, ops, Backend::Fused).unwrap();
    let bits = |b: &CudaSlice<T>| -> Vec<u64> {
        download(ctx, b).unwrap().iter().map(|v| v.to_f64().to_bits()).collect()
    };
    let (y1, y2, k1, k2, v1, v2) = (bits(&y1), bits(&y2), bits(&k1), bits(&k2), bits(&v1), bits(&v2));
    let differ = |a: &[u64], b: &[u64]| a.iter().zip(b).filter(|(a, b)| a != b).count();
    let nan = T::nan().to_f64().to_bits();
    let row = |c: &[u64]| -> usize {
        let p = pos.max(0) as usize;
        if p < max_seq {
            c[p * hkv * d..(p + 1) * hkv * d].iter().filter(|&&v| v != nan).count()
        } else {
            0
        }
    };
    let written = if pos >= 0 && (pos as usize) < positions.min(max_seq) { hkv * d } else { 0 };
    let line = format!(
        "{} rotary {hq}/{hkv}x{d} k {k}{} pos {pos} (tables {positions}, cache {max_seq}): D differs in {}, K in {}, \
         V in {}; cache row written {} / {} of K, V (want {written}); D unwritten {}",
        T::DTYPE,
        if norm { " norm" } else { "" },
        differ(&y1, &y2),
        differ(&k1, &k2),
        differ(&v1, &v2),
        row(&k2),
        row(&v2),
        y2.iter().filter(|&&v| v == nan).count()
    );
    let ok = differ(&y1, &y2) == 0
        && differ(&k1, &k2) == 0
        && differ(&v1, &v2) == 0
        && row(&k2) == written
        && row(&v2) == written
        && !y2.contains(&nan);
    println!("{} {line}", if ok { "ok  " } else { "FAIL" });
    (!ok).then_some(line)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_rotary_epilogue_equals_the_projection_then_rope_with_the_append() {
    let ctx = gpu();
    let mut failures = Vec::new();
    // Llama-3.1-8B's qkv_proj (3072 row pairs: 2 chunks in flight on a 132-SM H100 or H200) and a
    // rank's half of it (1536 pairs, as the smaller ones: the deep form, 4 chunks), small and odd head
    // counts, positions inside, at the edges of and outside the tables and the cache.
    let cases = [
        ((32, 8, 128), 4096, 600, 544, 517),
        ((16, 4, 128), 4096, 600, 544, 543),
        ((4, 2, 64), 256, 40, 48, 39),
        ((4, 2, 64), 256, 40, 48, 40),
        ((3, 1, 32), 64, 64, 16, 16),
        ((3, 1, 32), 64, 64, 16, -1),
        ((2, 2, 16), 24, 8, 8, 0),
    ];
    for (i, &(heads, k, positions, max_seq, pos)) in cases.iter().enumerate() {
        for norm in [false, true] {
            let seed = 2700 + 10 * i as u64;
            failures.extend(check_rotary::<bf16>(&ctx, heads, k, positions, max_seq, pos, norm, seed));
            failures.extend(check_rotary::<f16>(&ctx, heads, k, positions, max_seq, pos, norm, seed + 5));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------------
// The sum of a row-parallel matmul's partial products (what a tensor-parallel rank does with the
// parts it gathered): bit for bit the reference's f32 sum in part order, rounded once.

fn check_sum_partials<T: Element>(ctx: &Cudnn, count: usize, n: usize, offset: usize, based: bool) {
    // Values in ±4 over 1e-3 steps: the sums need f32, and rounding each step to T would differ.
    let value = |i: usize| T::from_f64(((i * 7919 + 13) % 8001) as f64 * 1e-3 - 4.0);
    let parts: Vec<T> = (0..count * n).map(value).collect();
    let base: Vec<T> = (0..n).map(|i| value(i * 31 + 5)).collect();
    let want = cudnn_llm_ops::sum_partials_reference(&parts, count, based.then_some(&base[..])).unwrap();
    // `offset` elements before the parts, the base and the output shift them off 16-byte alignment
    // (the kernel's element-wise path).
    let pad = |v: &[T]| ctx.stream().clone_htod(&[vec![T::default(); offset], v.to_vec()].concat()).unwrap();
    let (dev, dev_base) = (pad(&parts), pad(&base));
    let base_view = dev_base.slice(offset..);
    let mut out = poisoned::<T>(ctx, offset + n + 8).unwrap();
    cudnn_llm_ops::sum_partials(
        ctx,
        &dev.slice(offset..),
        count,
        based.then_some(&base_view as &dyn DevicePtr<T>),
        &mut out.slice_mut(offset..offset + n),
    )
    .unwrap();
    let got = download(ctx, &out).unwrap();
    let bits = |v: &T| v.to_f64().to_bits();
    let differ = got[offset..offset + n].iter().zip(&want).filter(|(a, b)| bits(a) != bits(b)).count();
    assert_eq!(
        differ,
        0,
        "{count} parts of {n} ({:?}, offset {offset}, base {based}): {differ} differ",
        T::DTYPE
    );
    // Nothing outside the output written.
    assert!(got[..offset].iter().chain(&got[offset + n..]).all(|v| v.to_f64().is_nan()));
    println!("sum_partials {:?}: {count} parts of {n} at offset {offset}, base {based}: exact", T::DTYPE);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sum_partials_matches_the_reference_bit_for_bit() {
    let ctx = testing::gpu();
    for (count, n, offset) in
        [(2, 4096 * 3, 0), (2, 4099, 0), (3, 1000, 0), (2, 4096, 3), (4, 1, 0), (1, 777, 1)]
    {
        for based in [false, true] {
            check_sum_partials::<bf16>(&ctx, count, n, offset, based);
            check_sum_partials::<f16>(&ctx, count, n, offset, based);
            check_sum_partials::<f32>(&ctx, count, n, offset, based);
        }
    }
    // A part count of 0 or a length that is not count parts of the output: refused, nothing written.
    let parts = ctx.stream().clone_htod(&[bf16::ONE; 10]).unwrap();
    let mut out = poisoned::<bf16>(&ctx, 4).unwrap();
    for count in [0, 3] {
        let e = cudnn_llm_ops::sum_partials(&ctx, &parts, count, None, &mut out).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    // A base of another length than the output: refused too.
    let short = ctx.stream().clone_htod(&[bf16::ONE; 3]).unwrap();
    let e = cudnn_llm_ops::sum_partials(&ctx, &parts.slice(..8), 2, Some(&short), &mut out).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(download(&ctx, &out).unwrap().iter().all(|v| v.is_nan()));
}

// ---------------------------------------------------------------------------------------------------
// A Linear's FP8 weight (`MatmulOperands::fp8_weight`): E4M3 (or E5M2, plain products) codes with one
// dequantization factor or one per output channel.

/// An FP8 weight `[n, k]`, its factors, and its dequantized values in `T` on the device. With
/// `pow2` the factors are powers of two, so that every dequantized value is exact in bf16 and f16
/// (an FP8 value has at most 4 significant bits) and a 16-bit weight holding them is the same
/// weight: the FP8 GEMV must then agree with the 16-bit one up to the order of its sums.
struct Fp8Weight<T: Element, W: Element> {
    codes: CudaSlice<W>,
    scales: CudaSlice<f32>,
    dequantized: CudaSlice<T>,
    host: (Vec<W>, Vec<f32>),
}

impl<T: Element, W: Element> Fp8Weight<T, W> {
    fn new(ctx: &Cudnn, (n, k): (usize, usize), per_channel: bool, pow2: bool, seed: u64) -> Self {
        use cudnn_llm_ops::ops::quantize::quantize;
        // Output channels of different magnitudes, as trained weights have.
        let w: Vec<f32> = reference::random_values(seed, n * k)
            .iter()
            .enumerate()
            .map(|(i, v)| *v as f32 * (0.02 + (i / k % 5) as f32 * 0.1) * 3.0 / (k as f32).sqrt())
            .collect();
        let (codes, mut scales) = quantize::<W>(&w, n, k, per_channel);
        if pow2 {
            // At least 2^-14: every E4M3 value is a multiple of 2^-9, so the dequantized values are
            // multiples of 2^-23, exact in f16 (whose subnormals are multiples of 2^-24) as in bf16.
            scales = scales.iter().map(|s| 2f32.powi((s.log2().round() as i32).max(-14))).collect();
        }
        let at = |i: usize| scales[if scales.len() == 1 { 0 } else { i / k }] as f64;
        let values: Vec<f64> = codes.iter().enumerate().map(|(i, c)| c.to_f64() * at(i)).collect();
        let (dequantized, exact) = upload::<T>(ctx, &values).unwrap();
        assert!(
            !pow2 || exact == values,
            "power-of-two factors keep the dequantized weight exact in {}",
            T::DTYPE
        );
        let s = ctx.stream();
        Fp8Weight {
            codes: s.clone_htod(&codes).unwrap(),
            scales: s.clone_htod(&scales).unwrap(),
            dequantized,
            host: (codes, scales),
        }
    }
}

/// `x · Wᵀ` and `e` over an FP8 weight on `backend` against the f64 reference over the codes' exact
/// values: fused, the decode GEMV up to 8 tokens, past it x quantized (per token, or per tensor for a
/// weight with one factor) and the FP8 graph (the reference quantizes x the same way); naive, the weight dequantized and cuBLAS. Failing lines go to
/// `failures`.
fn check_fp8_weight<T: Element, W: Element>(
    ctx: &Cudnn,
    (m, n, k): (usize, usize, usize),
    per_channel: bool,
    seed: u64,
    failures: &mut Vec<String>,
) {
    let weight = Fp8Weight::<T, W>::new(ctx, (n, k), per_channel, false, seed);
    let args = MatmulArgs::linear(m, k, n);
    let h = Host::new(seed + 1, &args);
    let dev = Device::<T, T>::new(ctx, &h);
    let rows: Vec<usize> = (0..m).collect();
    let (codes, factors) = (&weight.host.0, &weight.host.1);
    let exact = cudnn_llm_ops::fp8_weight_reference((m, n, k), &dev.rounded.a, codes, factors);
    // x as the FP8 graph sees it: E4M3 codes times a factor per token (per-channel weights), or one
    // factor for all of x (a weight with one factor).
    let x32: Vec<f32> = dev.rounded.a.iter().map(|&v| v as f32).collect();
    let (xq, xs) = cudnn_llm_ops::ops::quantize::quantize::<F8E4M3>(&x32, m, k, per_channel);
    let x_factor = |i: usize| xs[if per_channel { i / k } else { 0 }] as f64;
    let x8: Vec<f64> = xq.iter().enumerate().map(|(i, c)| c.to_f64() * x_factor(i)).collect();
    let quantized = cudnn_llm_ops::fp8_weight_reference((m, n, k), &x8, codes, factors);
    for e in [Epilogue::NONE, Epilogue::RESIDUAL, Epilogue::SWIGLU] {
        for backend in [Backend::Fused, Backend::Naive] {
            let fp8_graph = backend == Backend::Fused && m > DECODE_GEMV_MAX_TOKENS;
            let product = if fp8_graph { &quantized } else { &exact };
            let tag = format!(
                "{} {} x {} {m}x{n}x{k} {} {e}",
                backend.name(),
                T::DTYPE,
                W::DTYPE,
                if per_channel { "per-channel" } else { "per-tensor" }
            );
            let mut d = poisoned::<T>(ctx, m * n + 64).unwrap();
            let mut x = MatmulOperands::fp8_weight(&dev.a, &weight.codes, &weight.scales, &mut d);
            if e.gate {
                x = x.up(&dev.u);
            }
            if e.residual {
                x = x.residual(&dev.r);
            }
            if let Err(err) = matmul(ctx, &args.with_epilogue(e), x, backend) {
                failures.push(format!("{tag}: {err}"));
                continue;
            }
            let mut out = download(ctx, &d).unwrap();
            let guard = out.split_off(m * n).iter().filter(|v| !v.to_f64().is_nan()).count();
            let c = reference::compare(&out, &dev.expected(e, n, &rows, product));
            let ok = c.passes(reference::tolerance(T::DTYPE)) && guard == 0;
            println!("{} {tag}: {c}; {guard} of 64 guard elements written", if ok { "ok  " } else { "FAIL" });
            if !ok {
                failures.push(format!("{tag}: {c}; guard {guard}"));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_weights_match_the_reference_on_both_backends() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mut failures = Vec::new();
    // The GEMV's tiles (1, 3 and 8 tokens), then past it (the dequantized weight through the graph);
    // Llama-3.1-8B's down projection (at 1 and 9 tokens), a k with a remainder of chunks (4112: 257
    // chunks of 16), a weight with one factor.
    for (i, m) in [1, 3, 8, 9, 40].into_iter().enumerate() {
        let seed = 3000 + 10 * i as u64;
        if m == 1 || m == 9 {
            // (The host quantizes and multiplies 58.7 M weights: two token counts only.)
            check_fp8_weight::<bf16, F8E4M3>(&ctx, (m, 4096, 14336), true, seed, &mut failures);
        }
        check_fp8_weight::<bf16, F8E4M3>(&ctx, (m, 56, 4112), true, seed + 1, &mut failures);
        check_fp8_weight::<bf16, F8E4M3>(&ctx, (m, 1000, 1024), false, seed + 2, &mut failures);
        check_fp8_weight::<f16, F8E4M3>(&ctx, (m, 1000, 2048), true, seed + 3, &mut failures);
        check_fp8_weight::<f16, F8E5M2>(&ctx, (m, 1000, 2048), true, seed + 4, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_fp8_weight_under_a_batch_of_rows_equals_the_same_rows_as_one_linear() {
    // A `[2, 12, k]` x shared `[n, k]` FP8 weight (the FP8 graph folds the batch into 24 rows) and a
    // `[2, 3, k]` one (the decode GEMV over 6 rows): bit for bit the Linear over the rows.
    let ctx = gpu();
    let (n, k) = (320, 512);
    let w = Fp8Weight::<bf16, F8E4M3>::new(&ctx, (n, k), true, false, 4400);
    for (batch, m) in [(2, 12), (2, 3)] {
        let linear = MatmulArgs::linear(batch * m, k, n).with_epilogue(Epilogue::RESIDUAL);
        let batched =
            MatmulArgs::new(MatrixLayout::row_major(batch, m, k), linear.b).with_epilogue(Epilogue::RESIDUAL);
        let x = upload::<bf16>(&ctx, &reference::random_values(4401, batch * m * k)).unwrap().0;
        let r = upload::<bf16>(&ctx, &reference::random_values(4402, batch * m * n)).unwrap().0;
        let mut outs = Vec::new();
        for args in [linear, batched] {
            let mut y = poisoned::<bf16>(&ctx, batch * m * n).unwrap();
            let ops = MatmulOperands::fp8_weight(&x, &w.codes, &w.scales, &mut y).residual(&r);
            matmul(&ctx, &args, ops, Backend::Fused).unwrap();
            outs.push(download(&ctx, &y).unwrap());
        }
        let same = outs[0].iter().zip(&outs[1]).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
        println!("batch {batch} x {m} rows: {same} of {} outputs identical", outs[0].len());
        assert_eq!(same, outs[0].len(), "batch {batch} x {m}");
    }
    // A decode form the GEMV does not take over FP8 (the prologue at 2 tokens) is refused by name,
    // touching nothing.
    let x = upload::<bf16>(&ctx, &reference::random_values(4403, 2 * k)).unwrap().0;
    let g = upload::<bf16>(&ctx, &vec![1.0; k]).unwrap().0;
    let mut y = poisoned::<bf16>(&ctx, 2 * n).unwrap();
    let epoch = ctx.buffer_epoch();
    let args = MatmulArgs::linear(2, k, n).with_prologue(Prologue::rms_norm(1e-5));
    let e = matmul(
        &ctx,
        &args,
        MatmulOperands::fp8_weight(&x, &w.codes, &w.scales, &mut y).norm_weight(&g),
        Backend::Fused,
    )
    .unwrap_err();
    assert!(e.is_not_supported() && e.to_string().contains("prologue"), "{e}");
    assert_eq!(ctx.buffer_epoch(), epoch, "the refusal regrew no scratch");
    assert!(download(&ctx, &y).unwrap().iter().all(|v| v.is_nan()), "the refusal wrote nothing");
}

/// Every fused decode form over an FP8 weight with power-of-two factors against the same form over
/// the 16-bit weight holding its dequantized values (the dtype's tolerance; the bit-identical count
/// is printed: the sums group 16 elements per chunk instead of 8, so some outputs round the other way).
fn check_fp8_forms<T: Element>(ctx: &Cudnn, k: usize, n: usize, seed: u64, failures: &mut Vec<String>) {
    let w = Fp8Weight::<T, F8E4M3>::new(ctx, (n, k), true, true, seed);
    let w_up = Fp8Weight::<T, F8E4M3>::new(ctx, (n, k), true, true, seed + 1);
    let mut case = FusedCase::<T>::new(ctx, k, n, seed + 2);
    case.w = w.dequantized.clone();
    case.w_up = w_up.dequantized.clone();
    let norm = Prologue::rms_norm(NORM_EPS);
    let base = MatmulArgs::linear(1, k, n);
    let swiglu = base.with_epilogue(Epilogue::SWIGLU).with_up_product();
    let forms = [
        ("plain", base),
        ("residual", base.with_epilogue(Epilogue::RESIDUAL)),
        ("norm", base.with_prologue(norm)),
        ("norm+residual", base.with_epilogue(Epilogue::RESIDUAL).with_prologue(norm)),
        ("dual", swiglu),
        ("norm+dual", swiglu.with_prologue(norm)),
        (
            "norm+dual+residual",
            base.with_epilogue(Epilogue::SWIGLU.with_residual()).with_up_product().with_prologue(norm),
        ),
    ];
    for (name, args) in forms {
        let (want, _) = case.fused(ctx, &args);
        let mut d = poisoned::<T>(ctx, n + 64).unwrap();
        let mut x = MatmulOperands::fp8_weight(&case.x, &w.codes, &w.scales, &mut d);
        if args.prologue.is_some() {
            x = x.norm_weight(&case.norm);
        }
        if args.up_product {
            x = x.up_weight(&w_up.codes).up_scale(&w_up.scales);
        }
        if args.epilogue.residual {
            x = x.residual(&case.r);
        }
        let line = match matmul(ctx, &args.with_form(MatmulKernel::DecodeGemv), x, Backend::Fused) {
            Err(e) => Err(format!("{} fp8 {name} [1, {k}] x [{k}, {n}]: {e}", T::DTYPE)),
            Ok(()) => {
                let mut out = download(ctx, &d).unwrap();
                let guard = out.split_off(n).iter().filter(|v| !v.to_f64().is_nan()).count();
                let want64: Vec<f64> = want.iter().map(|v| v.to_f64()).collect();
                let c = reference::compare(&out, &want64);
                let same = out.iter().zip(&want).filter(|(a, b)| a.to_f64() == b.to_f64()).count();
                let line = format!(
                    "{} fp8 {name} [1, {k}] x [{k}, {n}]: vs the 16-bit weight {c}, {same} of {n} identical; \
                     {guard} of 64 guard elements written",
                    T::DTYPE
                );
                if c.passes(reference::tolerance(T::DTYPE)) && guard == 0 {
                    Ok(line)
                } else {
                    Err(line)
                }
            }
        };
        match line {
            Ok(l) => println!("ok   {l}"),
            Err(l) => {
                println!("FAIL {l}");
                failures.push(l);
            }
        }
    }
}

/// The rotary form (qkv_proj with RoPE and the K/V append) over an FP8 weight with power-of-two
/// factors against the same form over its dequantized 16-bit copy: D and both caches.
fn check_fp8_rotary<T: Element>(
    ctx: &Cudnn,
    (hq, hkv, d): (usize, usize, usize),
    k: usize,
    norm: bool,
    seed: u64,
) -> Option<String> {
    use cudnn_llm_ops::{Rotary, RotaryOperands};
    let (n, max_seq, positions, pos) = ((hq + 2 * hkv) * d, 64, 64, 37);
    let w = Fp8Weight::<T, F8E4M3>::new(ctx, (n, k), true, true, seed);
    let x = upload::<T>(ctx, &reference::random_values(seed + 1, k)).unwrap().0;
    let (g, tables) = (norm_weight::<T>(ctx, k, seed + 2), rope_tables::<T>(ctx, d, positions));
    let at = ctx.stream().clone_htod(&[pos]).unwrap();
    let mut args = MatmulArgs::linear(1, k, n)
        .with_form(MatmulKernel::DecodeGemv)
        .with_rotary(Rotary::new(hq, hkv, d, max_seq));
    if norm {
        args = args.with_prologue(Prologue::rms_norm(1e-5));
    }
    let cache = max_seq * hkv * d;
    let mut outs = Vec::new();
    for fp8 in [false, true] {
        let (mut y, mut kc, mut vc) = (
            poisoned::<T>(ctx, n).unwrap(),
            poisoned::<T>(ctx, cache).unwrap(),
            poisoned::<T>(ctx, cache).unwrap(),
        );
        let r = RotaryOperands::new(&tables, &at, &mut kc, &mut vc);
        let run = if fp8 {
            let ops = MatmulOperands::fp8_weight(&x, &w.codes, &w.scales, &mut y).rotary(r);
            matmul(ctx, &args, if norm { ops.norm_weight(&g) } else { ops }, Backend::Fused)
        } else {
            let ops = MatmulOperands::new(&x, &w.dequantized, &mut y).rotary(r);
            matmul(ctx, &args, if norm { ops.norm_weight(&g) } else { ops }, Backend::Fused)
        };
        if let Err(e) = run {
            return Some(format!("{} fp8 rotary {hq}/{hkv}x{d} k {k}: {e}", T::DTYPE));
        }
        let row = |c: &CudaSlice<T>| {
            download(ctx, c).unwrap()[pos as usize * hkv * d..(pos as usize + 1) * hkv * d].to_vec()
        };
        outs.push((download(ctx, &y).unwrap(), row(&kc), row(&vc)));
    }
    let tol = reference::tolerance(T::DTYPE);
    let cmp = |a: &[T], b: &[T]| reference::compare(a, &b.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
    let (cy, ck, cv) =
        (cmp(&outs[1].0, &outs[0].0), cmp(&outs[1].1, &outs[0].1), cmp(&outs[1].2, &outs[0].2));
    let ok = cy.passes(tol) && ck.passes(tol) && cv.passes(tol);
    let line = format!(
        "{} fp8 rotary {hq}/{hkv}x{d} k {k}{}: D {cy}; K row {ck}; V row {cv} (vs the 16-bit weight)",
        T::DTYPE,
        if norm { " norm" } else { "" }
    );
    println!("{} {line}", if ok { "ok  " } else { "FAIL" });
    (!ok).then_some(line)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_weights_take_every_decode_form_as_the_16_bit_weight_does() {
    let ctx = gpu();
    let mut failures = Vec::new();
    // Llama-3.1-8B's qkv shape and down's rows (k = 14336, the long-row tile, on fewer output rows:
    // the host quantizes every weight); one chunk (k = 16), a remainder of chunks (k = 4112), n not a
    // multiple of a block's warps.
    for (i, (k, n)) in [(4096, 6144), (14336, 512), (16, 8), (64, 40), (4112, 56)].iter().enumerate() {
        check_fp8_forms::<bf16>(&ctx, *k, *n, 4000 + 10 * i as u64, &mut failures);
        check_fp8_forms::<f16>(&ctx, *k, *n, 4100 + 10 * i as u64, &mut failures);
    }
    for (i, (heads, k)) in [((32, 8, 128), 4096), ((16, 4, 128), 4096), ((4, 2, 64), 256)].iter().enumerate()
    {
        for norm in [false, true] {
            failures.extend(check_fp8_rotary::<bf16>(&ctx, *heads, *k, norm, 4200 + 10 * i as u64));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn fp8_weight_arguments_are_checked_before_anything_runs() {
    let (bf, e4, e5) = (DataType::BF16, DataType::F8E4M3, DataType::F8E5M2);
    let a = MatmulArgs::linear(3, 64, 32);
    a.check_weight(bf, e4, (Some(32), None)).unwrap();
    a.check_weight(bf, e5, (Some(1), None)).unwrap();
    a.check_weight(bf, bf, (None, None)).unwrap();
    let dual = MatmulArgs::linear(1, 64, 32).with_epilogue(Epilogue::SWIGLU).with_up_product();
    dual.check_weight(bf, e4, (Some(32), Some(32))).unwrap();
    let cases = [
        (a.check_weight(bf, bf, (Some(32), None)), "weight factors were given for a bf16 weight"),
        (a.check_weight(bf, e4, (None, None)), "needs its dequantization factors"),
        (a.check_weight(bf, e4, (Some(31), None)), "31 given, needs 1 or one per output channel (32)"),
        (
            MatmulArgs::linear(3, 40, 32).check_weight(bf, e4, (Some(32), None)),
            "k = 40 must be a multiple of 16",
        ),
        (a.check_weight(bf, e4, (Some(32), Some(32))), "come with the up product, and only with it"),
        (dual.check_weight(bf, e4, (Some(32), None)), "come with the up product, and only with it"),
        (dual.check_weight(bf, e4, (Some(32), Some(1))), "B_up has 1 factors, B has 32"),
        (
            MatmulArgs::packed(2, 3, 64, 32).check_weight(bf, e4, (Some(32), None)),
            "an FP8 weight is a Linear's",
        ),
    ];
    for (r, expected) in cases {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected),
            "{e} (expected `{expected}`)"
        );
    }
    let e = a.check_weight(bf, DataType::F16, (None, None)).unwrap_err();
    assert!(e.is_not_supported() && e.to_string().contains("B in f16"), "{e}");
    // The GEMV: E5M2 takes the plain product only; the forms read E4M3.
    let norm = MatmulArgs::linear(1, 64, 32).with_prologue(Prologue::rms_norm(1e-5));
    norm.decode_gemv(bf, e4, bf).unwrap();
    let e = norm.decode_gemv(bf, e5, bf).unwrap_err();
    assert!(e.is_not_supported() && e.to_string().contains("E5M2 weights with a fused form"), "{e}");
    MatmulArgs::linear(8, 64, 32).decode_gemv(bf, e5, bf).unwrap();
}
