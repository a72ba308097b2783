//! The backward graphs of RMSNorm and matmul (Linear data and weight gradients, bias gradient, the
//! SwiGLU backward through the down projection), fused and naive, against the f64 references of
//! `reference::backward`, per dtype, with outputs poisoned (NaN) before each run; accumulation adds to
//! what the gradient buffers hold; bad inputs are typed errors that leave the outputs untouched. GPU
//! tests are ignored by default; run them with `--include-ignored` on a GPU machine.

use cudarc::driver::{CudaSlice, DevicePtr};
use cudnn_llm_ops::reference::{self, backward as rb, Tolerance};
use cudnn_llm_ops::testing::{download, gpu, poisoned, upload};
use cudnn_llm_ops::{
    linear_backward_data, linear_backward_weight, rms_norm_backward, swiglu_down_backward, Backend, Cudnn,
    DataGrad, DataType, Element, Error, LinearGradArgs, RmsNormArgs, RmsNormGrads, SwigluGrads, WeightGrad,
};
use half::{bf16, f16};

/// cuDNN may run f32 matmuls on tensor cores as TF32 (inputs rounded to 10 mantissa bits): a relative
/// error near 1e-3, as in cudnn-ops/tests/matmul.rs.
const F32_MATMUL_TOL: Tolerance = Tolerance::rel_l2(5e-3);
/// f32 RMSNorm gradients: f32 arithmetic with row and column sums of a few thousand terms.
const F32_NORM_TOL: Tolerance = Tolerance::rel_l2(1e-5);

fn matmul_tol(dtype: DataType) -> Tolerance {
    if dtype == DataType::F32 {
        F32_MATMUL_TOL
    } else {
        reference::tolerance(dtype)
    }
}

fn norm_tol(dtype: DataType) -> Tolerance {
    if dtype == DataType::F32 {
        F32_NORM_TOL
    } else {
        reference::tolerance(dtype)
    }
}

/// Compares one output with its reference, printing the line and recording a failure.
fn check<T: Element>(
    ctx: &Cudnn,
    tag: &str,
    out: &CudaSlice<T>,
    want: &[f64],
    tol: Tolerance,
    failures: &mut Vec<String>,
) {
    let got = download(ctx, out).unwrap();
    let c = reference::compare(&got[..want.len()], want);
    let ok = c.passes(tol);
    println!("{} {tag}: {c}", if ok { "ok  " } else { "FAIL" });
    if !ok {
        failures.push(format!("{tag}: {c}"));
    }
}

fn all_nan<T: Element>(ctx: &Cudnn, buf: &CudaSlice<T>) -> bool {
    download(ctx, buf).unwrap().iter().all(|v| v.to_f64().is_nan())
}

fn is_not_supported(e: &Error) -> bool {
    matches!(e, Error::NotSupported { .. })
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm

fn rms_case<T: Element>(ctx: &Cudnn, tokens: usize, hidden: usize, seed: u64, failures: &mut Vec<String>) {
    let n = tokens * hidden;
    let args = RmsNormArgs::new(tokens, hidden, 1e-5);
    let (x, xr) = upload::<T>(ctx, &reference::random_values(seed, n)).unwrap();
    let (w, wr) = upload::<T>(ctx, &reference::random_values(seed + 1, hidden)).unwrap();
    let (dy, dyr) = upload::<T>(ctx, &reference::random_values(seed + 2, n)).unwrap();
    let (res, resr) = upload::<T>(ctx, &reference::random_values(seed + 3, n)).unwrap();
    // The saved statistic as the training forward writes it: f32 inverse RMS per row.
    let (_, inv_ref) = reference::rms_norm(&xr, &wr, tokens, hidden, 1e-5);
    let (inv, invr) = upload::<f32>(ctx, &inv_ref).unwrap();
    let (dx_plain, dw_want) = rb::rms_norm_backward(&dyr, &xr, &wr, &invr, tokens, hidden, None);
    let (dx_res, _) = rb::rms_norm_backward(&dyr, &xr, &wr, &invr, tokens, hidden, Some(&resr));
    for backend in [Backend::Fused, Backend::Naive] {
        for residual in [false, true] {
            let tag = format!(
                "rmsnorm backward {} {} {tokens}x{hidden}{}",
                backend.name(),
                T::DTYPE,
                if residual { " + d_residual" } else { "" }
            );
            let mut dx = poisoned::<T>(ctx, n).unwrap();
            let mut dw = poisoned::<T>(ctx, hidden).unwrap();
            let mut grads = RmsNormGrads::new(&dy, &x, &w, &inv, &mut dx, &mut dw);
            if residual {
                grads = grads.d_residual(&res);
            }
            match rms_norm_backward(ctx, args, grads, backend) {
                Ok(()) => {}
                Err(e) if residual && backend == Backend::Fused && is_not_supported(&e) => {
                    // Before cuDNN 9.21 the residual add is refused before anything is written.
                    assert!(all_nan(ctx, &dx) && all_nan(ctx, &dw), "{tag}: refused, yet outputs written");
                    println!("skip {tag}: {e}");
                    continue;
                }
                Err(e) => {
                    failures.push(format!("{tag}: {e}"));
                    continue;
                }
            }
            let want = if residual { &dx_res } else { &dx_plain };
            check(ctx, &format!("{tag} dx"), &dx, want, norm_tol(T::DTYPE), failures);
            check(ctx, &format!("{tag} dweight"), &dw, &dw_want, norm_tol(T::DTYPE), failures);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_norm_backward_matches_the_reference_per_dtype() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mut failures = Vec::new();
    for (i, &(tokens, hidden)) in [(1, 768), (7, 768), (30, 2048), (64, 4096)].iter().enumerate() {
        let seed = 11 + 10 * i as u64;
        rms_case::<bf16>(&ctx, tokens, hidden, seed, &mut failures);
        rms_case::<f16>(&ctx, tokens, hidden, seed, &mut failures);
        rms_case::<f32>(&ctx, tokens, hidden, seed, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// A bad RMSNorm backward call: what is wrong, dy, the statistic, dweight's length, the message.
type BadNorm<'a> = (&'a str, &'a CudaSlice<bf16>, &'a dyn DevicePtr<f32>, usize, &'a str);

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_norm_backward_bad_inputs_are_typed_errors_outputs_untouched() {
    let ctx = gpu();
    let (tokens, hidden) = (8, 256);
    let n = tokens * hidden;
    let args = RmsNormArgs::new(tokens, hidden, 1e-5);
    let (x, _) = upload::<bf16>(&ctx, &reference::random_values(1, n)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, hidden)).unwrap();
    let (dy, _) = upload::<bf16>(&ctx, &reference::random_values(3, n)).unwrap();
    let (short_dy, _) = upload::<bf16>(&ctx, &reference::random_values(3, n - 1)).unwrap();
    let (inv, _) = upload::<f32>(&ctx, &vec![1.0; tokens]).unwrap();
    // No statistic (an inference forward writes none) and one of another shape's rows.
    let empty = inv.slice(0..0);
    let short_inv = inv.slice(0..tokens - 1);
    for backend in [Backend::Fused, Backend::Naive] {
        let cases: [BadNorm<'_>; 4] = [
            ("missing stats", &dy, &empty, hidden, "training forward saves"),
            ("short stats", &dy, &short_inv, hidden, "inv_rms has 7 elements"),
            ("short dy", &short_dy, &inv, hidden, "dy has 2047 elements"),
            ("dweight of another width", &dy, &inv, hidden + 8, "dweight has 264 elements"),
        ];
        for (what, dy, inv, dw_len, msg) in cases {
            let mut dx = poisoned::<bf16>(&ctx, n).unwrap();
            let mut dw = poisoned::<bf16>(&ctx, dw_len).unwrap();
            let e =
                rms_norm_backward(&ctx, args, RmsNormGrads::new(dy, &x, &w, inv, &mut dx, &mut dw), backend)
                    .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(msg), "{what}: {e}");
            assert!(all_nan(&ctx, &dx) && all_nan(&ctx, &dw), "{what} ({backend:?}): outputs were written");
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Linear gradients

struct Linear {
    tokens: usize,
    inp: usize,
    out: usize,
}

fn linear_case<T: Element, O: Element>(ctx: &Cudnn, s: &Linear, seed: u64, failures: &mut Vec<String>) {
    let Linear { tokens, inp, out } = *s;
    let args = LinearGradArgs::new(tokens, inp, out);
    let (x, xr) = upload::<T>(ctx, &reference::random_values(seed, tokens * inp)).unwrap();
    let (w, wr) = upload::<T>(ctx, &reference::random_values(seed + 1, out * inp)).unwrap();
    let (dy, dyr) = upload::<T>(ctx, &reference::random_values(seed + 2, tokens * out)).unwrap();
    let dx_want = rb::linear_backward_data(&dyr, &wr, tokens, inp, out);
    let dw_want = rb::linear_backward_weight(&dyr, &xr, tokens, inp, out, None);
    let db_want = rb::bias_grad(&dyr, tokens, out);
    let tol = matmul_tol(O::DTYPE);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("linear {} {}->{} {tokens}x{inp}->{out}", backend.name(), T::DTYPE, O::DTYPE);
        let mut dx = poisoned::<O>(ctx, tokens * inp).unwrap();
        match linear_backward_data(ctx, &args, DataGrad::new(&dy, &w, &mut dx), backend) {
            Ok(()) => check(ctx, &format!("{tag} dx"), &dx, &dx_want, tol, failures),
            Err(e) => failures.push(format!("{tag} dx: {e}")),
        }
        for bias in [false, true] {
            let mut dw = poisoned::<O>(ctx, out * inp).unwrap();
            let mut db = poisoned::<O>(ctx, out).unwrap();
            let mut grads = WeightGrad::new(&dy, &x, &mut dw);
            if bias {
                grads = grads.bias(&mut db);
            }
            match linear_backward_weight(ctx, &args, grads, backend) {
                Ok(()) => {
                    check(ctx, &format!("{tag} dW"), &dw, &dw_want, tol, failures);
                    if bias {
                        check(ctx, &format!("{tag} dbias"), &db, &db_want, tol, failures);
                    }
                }
                Err(e) => failures.push(format!("{tag} dW (bias {bias}): {e}")),
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_gradients_match_the_reference_per_dtype() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (i, s) in [Linear { tokens: 32, inp: 64, out: 128 }, Linear { tokens: 48, inp: 256, out: 96 }]
        .iter()
        .enumerate()
    {
        let seed = 100 + 10 * i as u64;
        linear_case::<bf16, bf16>(&ctx, s, seed, &mut failures);
        linear_case::<f16, f16>(&ctx, s, seed, &mut failures);
        linear_case::<f32, f32>(&ctx, s, seed, &mut failures);
        // An f32 gradient of bf16 activations (an f32 accumulator for bf16 weights).
        linear_case::<bf16, f32>(&ctx, s, seed, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Accumulating adds to the buffer's contents: old + new, checked against the reference with the old
/// gradient as its starting point; for f32 and bf16 accumulators.
fn accumulate_case<T: Element, O: Element>(ctx: &Cudnn, failures: &mut Vec<String>) {
    let (tokens, inp, out) = (32, 64, 128);
    let args = LinearGradArgs::new(tokens, inp, out).accumulating();
    let (x, xr) = upload::<T>(ctx, &reference::random_values(7, tokens * inp)).unwrap();
    let (w, wr) = upload::<T>(ctx, &reference::random_values(8, out * inp)).unwrap();
    let (dy, dyr) = upload::<T>(ctx, &reference::random_values(9, tokens * out)).unwrap();
    // Old gradients far from zero, so an overwrite could not pass.
    let old =
        |seed, n| -> Vec<f64> { reference::random_values(seed, n).iter().map(|v| 20.0 + 4.0 * v).collect() };
    let tol = matmul_tol(O::DTYPE);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("accumulate {} {}->{}", backend.name(), T::DTYPE, O::DTYPE);
        let (mut dw, dw_old) = upload::<O>(ctx, &old(20, out * inp)).unwrap();
        let (mut db, db_old) = upload::<O>(ctx, &old(21, out)).unwrap();
        let (mut dx, dx_old) = upload::<O>(ctx, &old(22, tokens * inp)).unwrap();
        let r = linear_backward_weight(ctx, &args, WeightGrad::new(&dy, &x, &mut dw).bias(&mut db), backend)
            .and_then(|()| linear_backward_data(ctx, &args, DataGrad::new(&dy, &w, &mut dx), backend));
        if let Err(e) = r {
            failures.push(format!("{tag}: {e}"));
            continue;
        }
        let dw_want = rb::linear_backward_weight(&dyr, &xr, tokens, inp, out, Some(&dw_old));
        let db_want: Vec<f64> =
            rb::bias_grad(&dyr, tokens, out).iter().zip(&db_old).map(|(g, o)| g + o).collect();
        let dx_want: Vec<f64> = rb::linear_backward_data(&dyr, &wr, tokens, inp, out)
            .iter()
            .zip(&dx_old)
            .map(|(g, o)| g + o)
            .collect();
        check(ctx, &format!("{tag} dW"), &dw, &dw_want, tol, failures);
        check(ctx, &format!("{tag} dbias"), &db, &db_want, tol, failures);
        check(ctx, &format!("{tag} dx"), &dx, &dx_want, tol, failures);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulation_adds_rather_than_overwrites() {
    let ctx = gpu();
    let mut failures = Vec::new();
    accumulate_case::<bf16, f32>(&ctx, &mut failures);
    accumulate_case::<bf16, bf16>(&ctx, &mut failures);
    accumulate_case::<f32, f32>(&ctx, &mut failures);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// In-place accumulation binds one buffer as the matmul's residual input and its output. At the 8B
/// projection shapes the heuristics pick split-K and stream-K engines the small shapes above never
/// see, so the fused accumulating gradients are checked there too: `acc - old` against a fresh naive
/// (cuBLAS) gradient of the same inputs, in f32 accumulators of bf16 activations.
#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulation_in_place_is_right_at_llama_8b_shapes() {
    let ctx = gpu();
    let mut failures = Vec::new();
    // (tokens, in, out): gate_up at 16384 tokens, down at 2048, q at 16384 (wide in, narrow out).
    for (tokens, inp, out) in [(16384, 4096, 28672), (2048, 14336, 4096), (16384, 4096, 4096)] {
        let (x, _) = upload::<bf16>(&ctx, &reference::random_values(31, tokens * inp)).unwrap();
        let (w, _) = upload::<bf16>(&ctx, &reference::random_values(32, out * inp)).unwrap();
        let (dy, _) = upload::<bf16>(&ctx, &reference::random_values(33, tokens * out)).unwrap();
        let old =
            |seed, n| -> Vec<f64> { reference::random_values(seed, n).iter().map(|v| 3.0 + v).collect() };
        let args = LinearGradArgs::new(tokens, inp, out);
        let tag = format!("in-place {tokens}x{inp}->{out}");
        let mut fresh_w = poisoned::<f32>(&ctx, out * inp).unwrap();
        let mut fresh_x = poisoned::<f32>(&ctx, tokens * inp).unwrap();
        let (mut acc_w, old_w) = upload::<f32>(&ctx, &old(34, out * inp)).unwrap();
        let (mut acc_x, old_x) = upload::<f32>(&ctx, &old(35, tokens * inp)).unwrap();
        let r = linear_backward_weight(&ctx, &args, WeightGrad::new(&dy, &x, &mut fresh_w), Backend::Naive)
            .and_then(|()| {
                linear_backward_data(&ctx, &args, DataGrad::new(&dy, &w, &mut fresh_x), Backend::Naive)
            })
            .and_then(|()| {
                let acc = args.accumulating();
                linear_backward_weight(&ctx, &acc, WeightGrad::new(&dy, &x, &mut acc_w), Backend::Fused)?;
                linear_backward_data(&ctx, &acc, DataGrad::new(&dy, &w, &mut acc_x), Backend::Fused)
            });
        if let Err(e) = r {
            failures.push(format!("{tag}: {e}"));
            continue;
        }
        for (what, acc, fresh, old) in [("dW", &acc_w, &fresh_w, &old_w), ("dX", &acc_x, &fresh_x, &old_x)] {
            let got: Vec<f32> = download(&ctx, acc)
                .unwrap()
                .iter()
                .zip(old)
                .map(|(a, o)| (f64::from(*a) - o) as f32)
                .collect();
            let want: Vec<f64> = download(&ctx, fresh).unwrap().iter().map(|v| f64::from(*v)).collect();
            let c = reference::compare(&got, &want);
            // Both sides are f32 sums of the same bf16 products in different orders; subtracting an
            // old value near 3 from the accumulated one costs f32 rounding of ~3 * 2^-24 per element.
            let ok = c.passes(Tolerance::rel_l2(1e-3));
            println!("{} {tag} {what}: {c}", if ok { "ok  " } else { "FAIL" });
            if !ok {
                failures.push(format!("{tag} {what}: {c}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_backward_bad_inputs_are_typed_errors_outputs_untouched() {
    let ctx = gpu();
    let (tokens, inp, out) = (32, 64, 128);
    let args = LinearGradArgs::new(tokens, inp, out);
    let (x, _) = upload::<bf16>(&ctx, &reference::random_values(1, tokens * inp)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, out * inp)).unwrap();
    let (dy, _) = upload::<bf16>(&ctx, &reference::random_values(3, tokens * out)).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        // dX of another layer's shape.
        let mut dx = poisoned::<bf16>(&ctx, tokens * inp - 8).unwrap();
        let e = linear_backward_data(&ctx, &args, DataGrad::new(&dy, &w, &mut dx), backend).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("linear_backward_data"),
            "{e}"
        );
        assert!(all_nan(&ctx, &dx));
        // A bias gradient of the wrong length: neither dW nor the bias is written.
        let mut dw = poisoned::<bf16>(&ctx, out * inp).unwrap();
        let mut db = poisoned::<bf16>(&ctx, out - 8).unwrap();
        let e = linear_backward_weight(&ctx, &args, WeightGrad::new(&dy, &x, &mut dw).bias(&mut db), backend)
            .unwrap_err();
        assert!(e.to_string().contains("bias gradient has 120 elements"), "{e}");
        assert!(all_nan(&ctx, &dw) && all_nan(&ctx, &db));
        // Tokens that misalign dYᵀ's rows: the weight gradient's inner dimension.
        let odd = LinearGradArgs::new(tokens - 1, inp, out);
        let mut dw = poisoned::<bf16>(&ctx, out * inp).unwrap();
        let e = linear_backward_weight(&ctx, &odd, WeightGrad::new(&dy, &x, &mut dw), backend).unwrap_err();
        assert!(e.to_string().contains("misaligned k"), "{e}");
        assert!(all_nan(&ctx, &dw));
    }
}

// ---------------------------------------------------------------------------------------------------
// SwiGLU

fn swiglu_case<T: Element>(
    ctx: &Cudnn,
    tokens: usize,
    hidden: usize,
    inter: usize,
    failures: &mut Vec<String>,
) {
    // The down projection: in = intermediate, out = hidden.
    let args = LinearGradArgs::new(tokens, inter, hidden);
    let (dy, dyr) = upload::<T>(ctx, &reference::random_values(31, tokens * hidden)).unwrap();
    let (w, wr) = upload::<T>(ctx, &reference::random_values(32, hidden * inter)).unwrap();
    let gate_v: Vec<f64> = reference::random_values(33, tokens * inter).iter().map(|v| 4.0 * v).collect();
    let (gate, gr) = upload::<T>(ctx, &gate_v).unwrap();
    let (up, ur) = upload::<T>(ctx, &reference::random_values(34, tokens * inter)).unwrap();
    let d_act = rb::linear_backward_data(&dyr, &wr, tokens, inter, hidden);
    let (dg_want, du_want) = rb::swiglu_backward(&d_act, &gr, &ur);
    if let Ok(form) = args.swiglu_form(ctx, T::DTYPE) {
        println!("swiglu backward {} {tokens}x{hidden}->{inter}: {} form", T::DTYPE, form.name());
    }
    let tol = matmul_tol(T::DTYPE);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("swiglu backward {} {} {tokens}x{hidden}->{inter}", backend.name(), T::DTYPE);
        let n = tokens * inter;
        let (mut dg, mut du) = (poisoned::<T>(ctx, n).unwrap(), poisoned::<T>(ctx, n).unwrap());
        match swiglu_down_backward(
            ctx,
            &args,
            SwigluGrads::new(&dy, &w, &gate, &up, &mut dg, &mut du),
            backend,
        ) {
            Ok(()) => {
                check(ctx, &format!("{tag} d_gate"), &dg, &dg_want, tol, failures);
                check(ctx, &format!("{tag} d_up"), &du, &du_want, tol, failures);
            }
            Err(e) => failures.push(format!("{tag}: {e}")),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_down_backward_matches_the_reference_per_dtype() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (tokens, hidden, inter) in [(16, 64, 128), (40, 128, 352)] {
        swiglu_case::<bf16>(&ctx, tokens, hidden, inter, &mut failures);
        swiglu_case::<f16>(&ctx, tokens, hidden, inter, &mut failures);
        swiglu_case::<f32>(&ctx, tokens, hidden, inter, &mut failures);
    }
    // Bad inputs: accumulating into fresh gradients, an `up` of another shape; nothing written.
    let args = LinearGradArgs::new(16, 128, 64);
    let (dy, _) = upload::<bf16>(&ctx, &reference::random_values(1, 16 * 64)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &reference::random_values(2, 64 * 128)).unwrap();
    let (g, _) = upload::<bf16>(&ctx, &reference::random_values(3, 16 * 128)).unwrap();
    let (short, _) = upload::<bf16>(&ctx, &reference::random_values(4, 16 * 128 - 1)).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        for (a, up, msg) in [(args.accumulating(), &g, "not an option"), (args, &short, "up has 2047")] {
            let (mut dg, mut du) =
                (poisoned::<bf16>(&ctx, 16 * 128).unwrap(), poisoned::<bf16>(&ctx, 16 * 128).unwrap());
            let e =
                swiglu_down_backward(&ctx, &a, SwigluGrads::new(&dy, &w, &g, up, &mut dg, &mut du), backend)
                    .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(msg), "{e}");
            assert!(all_nan(&ctx, &dg) && all_nan(&ctx, &du));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
