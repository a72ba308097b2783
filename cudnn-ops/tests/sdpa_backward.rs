//! Attention backward end to end: fused (cuDNN's composite backward graph) and naive (the math path's
//! autograd, one kernel per op) against the f64 reference `reference::backward::sdpa_backward`, with
//! the gradients poisoned (NaN) before each run. GPU tests are ignored by default; run them with
//! `--include-ignored` on a GPU machine.
//!
//! The forward's O and stats come from the f64 reference forward, rounded to what the GPU holds (O to
//! the I/O dtype, stats to f32), so each backend is judged on its own; `training_round_trip` feeds the
//! backward the stats and O a training forward wrote instead.

use cudarc::driver::CudaSlice;
use cudnn_llm_ops::reference::backward::{from_bhsd, sdpa_backward as reference_backward, to_bhsd};
use cudnn_llm_ops::reference::{self, AttentionShape, Tolerance};
use cudnn_llm_ops::testing::{download, gpu, poisoned, upload};
use cudnn_llm_ops::{
    sdpa, sdpa_backward, Backend, Cudnn, DataType, Element, Error, Layout, Mask, SdpaArgs, SdpaForm,
    SdpaGrads, SdpaOperands,
};
use half::{bf16, f16};

/// bf16 gradients: P and dS enter their GEMMs rounded to bf16 (8-bit mantissa) on both backends,
/// then the gradients are rounded once more; the forward's O tolerance plus that second rounding.
const GRAD_BF16: Tolerance = Tolerance::rel_l2(3e-2);
/// f16 gradients: the same path with 11-bit mantissas.
const GRAD_F16: Tolerance = Tolerance::rel_l2(1e-2);
/// Fused against naive at a size the f64 reference would take minutes for: two bf16 roundings apart.
const FUSED_VS_NAIVE_BF16: Tolerance = Tolerance::rel_l2(3e-2);
/// Log-sum-exp rows are f32 on both sides (as in cudnn-ops/tests/sdpa.rs).
const STATS_TOL: Tolerance = Tolerance::rel_l2(1e-4);

fn tol<T: Element>() -> Tolerance {
    if T::DTYPE == DataType::BF16 {
        GRAD_BF16
    } else {
        GRAD_F16
    }
}

fn shape(a: &SdpaArgs) -> AttentionShape {
    AttentionShape {
        batch: a.batch,
        heads_q: a.heads_q,
        heads_kv: a.heads_kv,
        seq_q: a.seq_q,
        seq_kv: a.seq_kv,
        dim: a.head_dim,
    }
}

/// Everything one backward reads, on the device and as the rounded f64 values the reference reads
/// (all packed in `layout`).
struct Inputs<T: Element> {
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    o: CudaSlice<T>,
    d_o: CudaSlice<T>,
    stats: CudaSlice<f32>,
    /// The reference gradients `(dq, dk, dv)` of these rounded inputs, in `layout`.
    expected: [Vec<f64>; 3],
}

fn inputs<T: Element>(ctx: &Cudnn, a: &SdpaArgs, layout: Layout, seed: u64) -> Inputs<T> {
    let sh = shape(a);
    let (nq, nkv) =
        (a.batch * a.heads_q * a.seq_q * a.head_dim, a.batch * a.heads_kv * a.seq_kv * a.head_dim);
    let up = |values: Vec<f64>| upload::<T>(ctx, &values).unwrap();
    let (q, qr) = up(reference::random_values(seed, nq));
    let (k, kr) = up(reference::random_values(seed + 1, nkv));
    let (v, vr) = up(reference::random_values(seed + 2, nkv));
    let (d_o, d_or) = up(reference::random_values(seed + 3, nq));
    let bq = |t: &[f64]| to_bhsd(t, layout, a.batch, a.heads_q, a.seq_q, a.head_dim);
    let bkv = |t: &[f64]| to_bhsd(t, layout, a.batch, a.heads_kv, a.seq_kv, a.head_dim);
    let scale = a.scale() as f64;
    let (o_bhsd, stats) = reference::attention(&bq(&qr), &bkv(&kr), &bkv(&vr), sh, scale, a.mask);
    let (o, or) = up(from_bhsd(&o_bhsd, layout, a.batch, a.heads_q, a.seq_q, a.head_dim));
    let stats32: Vec<f32> = stats.iter().map(|&s| s as f32).collect();
    let stats_r: Vec<f64> = stats32.iter().map(|&s| s as f64).collect();
    let stats = ctx.stream().clone_htod(&stats32).unwrap();
    let (dq, dk, dv) = reference_backward(&d_or, &qr, &kr, &vr, &or, &stats_r, sh, scale, a.mask, layout);
    Inputs { q, k, v, o, d_o, stats, expected: [dq, dk, dv] }
}

/// The three gradients of one backward, downloaded (storage order).
fn run<T: Element>(ctx: &Cudnn, backend: Backend, a: &SdpaArgs, x: &Inputs<T>) -> Result<[Vec<T>; 3], Error> {
    let (mut dq, mut dk, mut dv) =
        (poisoned::<T>(ctx, x.q.len())?, poisoned::<T>(ctx, x.k.len())?, poisoned::<T>(ctx, x.v.len())?);
    let grads = SdpaGrads::new(&x.q, &x.k, &x.v, &x.o, &x.d_o, &mut dq, &mut dk, &mut dv).stats(&x.stats);
    sdpa_backward(ctx, *a, grads, backend)?;
    Ok([download(ctx, &dq)?, download(ctx, &dk)?, download(ctx, &dv)?])
}

fn describe(a: &SdpaArgs, layout: Layout) -> String {
    format!(
        "b{} hq{} hkv{} sq{} skv{} d{} {} {}",
        a.batch,
        a.heads_q,
        a.heads_kv,
        a.seq_q,
        a.seq_kv,
        a.head_dim,
        layout.name(),
        a.mask.name()
    )
}

/// Both backends against the reference; failures are collected, not asserted one by one.
fn check_case<T: Element>(ctx: &Cudnn, a: SdpaArgs, layout: Layout, failures: &mut Vec<String>) {
    let x = inputs::<T>(ctx, &a, layout, 31);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("{} {} {}", backend.name(), T::DTYPE, describe(&a, layout));
        match run(ctx, backend, &a, &x) {
            Err(e) => failures.push(format!("{tag}: {e}")),
            Ok(grads) => {
                for (name, got, want) in
                    [("dQ", &grads[0], &x.expected[0]), ("dK", &grads[1], &x.expected[1])]
                        .into_iter()
                        .chain([("dV", &grads[2], &x.expected[2])])
                {
                    let c = reference::compare(got, want);
                    if !c.passes(tol::<T>()) {
                        failures.push(format!("{tag}: {name} {c}"));
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_naive_match_the_reference() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let mut cases = 0;
    // (heads_q, heads_kv): multi-head, grouped (4 query heads per K/V head) and multi-query.
    let heads = [(4, 4), (8, 2), (8, 1)];
    // (seq_q, seq_kv, mask): square prefill, a chunk against a longer K/V (bottom-right), odd lengths.
    let seqs = [
        (128, 128, Mask::None),
        (128, 128, Mask::CausalTopLeft),
        (64, 160, Mask::CausalBottomRight),
        (64, 96, Mask::CausalTopLeft),
        (40, 72, Mask::None),
        (72, 72, Mask::CausalBottomRight),
    ];
    for (i, &(hq, hkv)) in heads.iter().enumerate() {
        for (j, &(sq, skv, mask)) in seqs.iter().enumerate() {
            for layout in [Layout::Bshd, Layout::Bhsd] {
                // Alternate dtypes, head dims and batch sizes across the grid rather than multiplying.
                let d = if (i + j) % 2 == 0 { 64 } else { 128 };
                let batch = 1 + (i + j) % 2;
                let a = SdpaArgs::new(batch, hq, hkv, sq, skv, d, layout).with_mask(mask);
                if (i + j + usize::from(layout == Layout::Bhsd)) % 2 == 0 {
                    check_case::<bf16>(&ctx, a, layout, &mut failures);
                } else {
                    check_case::<f16>(&ctx, a, layout, &mut failures);
                }
                cases += 1;
            }
        }
    }
    // Every mask in both dtypes for a Llama head grouping (32/8), with an explicit scale.
    for mask in [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight] {
        let a = SdpaArgs::new(1, 32, 8, 64, 80, 64, Layout::Bshd).with_mask(mask).with_scale(0.2);
        check_case::<bf16>(&ctx, a, Layout::Bshd, &mut failures);
        check_case::<f16>(&ctx, a, Layout::Bshd, &mut failures);
        cases += 2;
    }
    println!("{cases} cases x 2 backends; cache {:?}", ctx.cache().stats());
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// The training loop's order: a fused training forward writes O and the stats, the backward reads
/// them; the reference backward reads the same O and stats.
#[test]
#[ignore = "needs a CUDA GPU"]
fn training_round_trip() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (mask, layout, (hq, hkv)) in [
        (Mask::CausalTopLeft, Layout::Bshd, (8, 2)),
        (Mask::None, Layout::Bhsd, (8, 8)),
        (Mask::CausalBottomRight, Layout::Bshd, (8, 1)),
    ] {
        let a = SdpaArgs::new(2, hq, hkv, 96, 128, 64, layout).with_mask(mask);
        let mut x = inputs::<bf16>(&ctx, &a, layout, 7);
        let (ref_stats, ref_o) = (download(&ctx, &x.stats).unwrap(), download(&ctx, &x.o).unwrap());
        x.o = poisoned::<bf16>(&ctx, x.o.len()).unwrap();
        x.stats = poisoned::<f32>(&ctx, x.stats.len()).unwrap();
        let fwd = SdpaOperands::new(&x.q, &x.k, &x.v, &mut x.o).stats(&mut x.stats);
        sdpa(&ctx, a, fwd, Backend::Fused).unwrap();
        let tag = describe(&a, layout);
        let stats = download(&ctx, &x.stats).unwrap();
        let c = reference::compare(&stats, &ref_stats.iter().map(|&s| s as f64).collect::<Vec<_>>());
        if !c.passes(STATS_TOL) {
            failures.push(format!("{tag}: forward stats {c}"));
        }
        let c = reference::compare(
            &download(&ctx, &x.o).unwrap(),
            &ref_o.iter().map(|v| v.to_f64()).collect::<Vec<_>>(),
        );
        if !c.passes(GRAD_BF16) {
            failures.push(format!("{tag}: forward O {c}"));
        }
        // The reference backward of what the forward wrote.
        let host =
            |b: &CudaSlice<bf16>| download(&ctx, b).unwrap().iter().map(|v| v.to_f64()).collect::<Vec<_>>();
        let stats64: Vec<f64> = stats.iter().map(|&s| s as f64).collect();
        let (dq, dk, dv) = reference_backward(
            &host(&x.d_o),
            &host(&x.q),
            &host(&x.k),
            &host(&x.v),
            &host(&x.o),
            &stats64,
            shape(&a),
            a.scale() as f64,
            mask,
            layout,
        );
        for backend in [Backend::Fused, Backend::Naive] {
            match run(&ctx, backend, &a, &x) {
                Err(e) => failures.push(format!("{} {tag}: {e}", backend.name())),
                Ok([gq, gk, gv]) => {
                    for (name, got, want) in [("dQ", &gq, &dq), ("dK", &gk, &dk), ("dV", &gv, &dv)] {
                        let c = reference::compare(got, want);
                        println!("{} {tag}: {name} {c}", backend.name());
                        if !c.passes(GRAD_BF16) {
                            failures.push(format!("{} {tag}: {name} {c}", backend.name()));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Fused against naive at a Llama head shape where the f64 reference would be too slow; a second
/// call hits the plan cache and gives the same gradients (the op zeroes or rewrites what it owns).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_matches_naive_at_llama_sizes() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (hq, hkv, s, d, mask) in [(32, 8, 1024, 128, Mask::CausalTopLeft), (32, 8, 512, 64, Mask::None)] {
        let a = SdpaArgs::new(1, hq, hkv, s, s, d, Layout::Bshd).with_mask(mask);
        let (nq, nkv) = (s * hq * d, s * hkv * d);
        let up = |seed: u64, n: usize| upload::<bf16>(&ctx, &reference::random_values(seed, n)).unwrap().0;
        let (q, k, v, d_o) = (up(1, nq), up(2, nkv), up(3, nkv), up(4, nq));
        let mut o = poisoned::<bf16>(&ctx, nq).unwrap();
        let mut stats = poisoned::<f32>(&ctx, hq * s).unwrap();
        sdpa(&ctx, a, SdpaOperands::new(&q, &k, &v, &mut o).stats(&mut stats), Backend::Fused).unwrap();
        let x = Inputs { q, k, v, o, d_o, stats, expected: Default::default() };
        let tag = describe(&a, Layout::Bshd);
        let (fused, again, naive) = match (
            run(&ctx, Backend::Fused, &a, &x),
            run(&ctx, Backend::Fused, &a, &x),
            run(&ctx, Backend::Naive, &a, &x),
        ) {
            (Ok(f), Ok(g), Ok(n)) => (f, g, n),
            (f, g, n) => {
                failures.push(format!("{tag}: fused {:?} again {:?} naive {:?}", f.err(), g.err(), n.err()));
                continue;
            }
        };
        for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
            let want: Vec<f64> = naive[i].iter().map(|v| v.to_f64()).collect();
            let c = reference::compare(&fused[i], &want);
            println!("{tag}: fused vs naive {name} {c}");
            if !c.passes(FUSED_VS_NAIVE_BF16) {
                failures.push(format!("{tag}: {name} {c}"));
            }
            let first: Vec<f64> = fused[i].iter().map(|v| v.to_f64()).collect();
            let c = reference::compare(&again[i], &first);
            if !c.passes(FUSED_VS_NAIVE_BF16) {
                failures.push(format!("{tag}: {name} second call {c}"));
            }
        }
    }
    println!("cache {:?}", ctx.cache().stats());
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Gradient buffers filled with 7.0: after a refused call, each must still hold 7.0 everywhere.
struct Sevens {
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    /// One element short of dK.
    short_dk: CudaSlice<bf16>,
}

impl Sevens {
    fn new(ctx: &Cudnn, nq: usize, nkv: usize) -> Self {
        let filled = |n: usize| ctx.stream().clone_htod(&vec![bf16::from_f32(7.0); n]).unwrap();
        Sevens { dq: filled(nq), dk: filled(nkv), dv: filled(nkv), short_dk: filled(nkv - 1) }
    }

    /// Runs `f`, expects an error containing `expected` (NotSupported or InvalidArgument as
    /// `not_supported` says), and checks that no gradient buffer was written.
    fn refused(
        &mut self,
        ctx: &Cudnn,
        expected: &str,
        not_supported: bool,
        f: impl FnOnce(&mut Sevens) -> Result<(), Error>,
    ) {
        let e = f(self).expect_err(expected);
        assert!(e.to_string().contains(expected), "{expected}: {e}");
        assert_eq!(e.is_not_supported(), not_supported, "{expected}: {e}");
        assert!(not_supported || matches!(e, Error::InvalidArgument(_)), "{expected}: {e}");
        ctx.synchronize().unwrap();
        for (name, buf) in
            [("dQ", &self.dq), ("dK", &self.dk), ("dV", &self.dv), ("short dK", &self.short_dk)]
        {
            let seven = bf16::from_f32(7.0);
            assert!(
                download(ctx, buf).unwrap().iter().all(|&v| v == seven),
                "{expected}: {name} was written"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_are_typed_errors_and_touch_nothing() {
    let ctx = gpu();
    let a = SdpaArgs::new(1, 8, 2, 64, 64, 64, Layout::Bshd).with_mask(Mask::CausalTopLeft);
    let x = inputs::<bf16>(&ctx, &a, Layout::Bshd, 3);
    let (nq, nkv) = (x.q.len(), x.k.len());
    let short_stats = ctx.stream().alloc_zeros::<f32>(8 * 64 - 1).unwrap();
    // Stats of another attention (a forward over 32 queries).
    let other_stats = ctx.stream().alloc_zeros::<f32>(8 * 32).unwrap();
    let f32_buf = |n: usize| ctx.stream().alloc_zeros::<f32>(n).unwrap();
    for backend in [Backend::Fused, Backend::Naive] {
        let mut g = Sevens::new(&ctx, nq, nkv);
        g.refused(&ctx, "training stats are missing", false, |g| {
            let grads = SdpaGrads::new(&x.q, &x.k, &x.v, &x.o, &x.d_o, &mut g.dq, &mut g.dk, &mut g.dv);
            sdpa_backward(&ctx, a, grads, backend)
        });
        for (stats, expected) in [(&short_stats, "stats has 511"), (&other_stats, "stats has 256")] {
            g.refused(&ctx, expected, false, |g| {
                let grads = SdpaGrads::new(&x.q, &x.k, &x.v, &x.o, &x.d_o, &mut g.dq, &mut g.dk, &mut g.dv);
                sdpa_backward(&ctx, a, grads.stats(stats), backend)
            });
        }
        g.refused(&ctx, "dK has", false, |g| {
            let grads = SdpaGrads::new(&x.q, &x.k, &x.v, &x.o, &x.d_o, &mut g.dq, &mut g.short_dk, &mut g.dv);
            sdpa_backward(&ctx, a, grads.stats(&x.stats), backend)
        });
        g.refused(&ctx, "not a multiple of heads_kv", false, |g| {
            let grads = SdpaGrads::new(&x.q, &x.k, &x.v, &x.o, &x.d_o, &mut g.dq, &mut g.dk, &mut g.dv);
            let mut bad = a;
            bad.heads_kv = 3;
            sdpa_backward(&ctx, bad, grads.stats(&x.stats), backend)
        });
        g.refused(&ctx, "unified SDPA backward", true, |g| {
            let grads = SdpaGrads::new(&x.q, &x.k, &x.v, &x.o, &x.d_o, &mut g.dq, &mut g.dk, &mut g.dv);
            sdpa_backward(&ctx, a.with_form(SdpaForm::Unified), grads.stats(&x.stats), backend)
        });
        // f32 I/O is refused before anything runs.
        let (q32, o32, kv32) = (f32_buf(nq), f32_buf(nq), f32_buf(nkv));
        let (mut dq32, mut dk32, mut dv32) = (f32_buf(nq), f32_buf(nkv), f32_buf(nkv));
        let grads = SdpaGrads::new(&q32, &kv32, &kv32, &o32, &o32, &mut dq32, &mut dk32, &mut dv32);
        let e = sdpa_backward(&ctx, a, grads.stats(&x.stats), backend).unwrap_err();
        assert!(e.is_not_supported() && e.to_string().contains("f16 or bf16"), "{e}");
    }
}
