//! The backward's custom kernels (cross-entropy, AdamW, grad norm and clipping, RoPE backward,
//! embedding backward), fused and eager, against the f64 references of `reference::backward`, with
//! outputs poisoned (NaN) before each run. GPU tests are ignored by default; run them with
//! `--include-ignored` on a GPU machine.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::reference::{self, backward as rb, Tolerance};
use cudnn_llm_ops::testing::gpu;
use cudnn_llm_ops::testing::{download, poisoned, upload};
use cudnn_llm_ops::{
    adamw, cross_entropy, embedding_backward, grad_norm, rope, rope_backward, AdamWArgs, AdamWOperands,
    AdamWTensor, Backend, CrossEntropyArgs, CrossEntropyOperands, Cudnn, Element, EmbeddingArgs,
    EmbeddingBackwardOperands, EmbeddingGrad, GradNormArgs, GradNormOperands, MultiTensor, RopeArgs,
    RopeBackwardOperands, RopeOperands, RopeTables,
};
use half::{bf16, f16};

/// The loss is one f32 sum over rows of f32 log-sum-exps computed with `__expf`/`__logf` (a few
/// ulp each); relative to the f64 loss of the same rounded logits.
const LOSS_TOL: f64 = 1e-5;
/// f32 dlogits through `__expf` (relative error up to ~2e-6 at the arguments softmax sees).
const CE_F32_TOL: Tolerance = Tolerance::rel_l2(1e-4);
/// f32 optimizer state and norms: a handful of f32 operations per element.
const OPTIM_F32_TOL: Tolerance = Tolerance::rel_l2(1e-5);

fn ce_tol<T: Element>() -> Tolerance {
    if T::DTYPE == cudnn_llm_ops::DataType::F32 {
        CE_F32_TOL
    } else {
        reference::tolerance(T::DTYPE)
    }
}

fn scalar(ctx: &Cudnn, buf: &CudaSlice<f32>) -> f64 {
    download(ctx, buf).unwrap()[0] as f64
}

fn check_cross_entropy<T: Element>(ctx: &Cudnn, tokens: usize, vocab: usize) {
    // Logits spread over ±8 so that softmax is far from uniform; every 4th target ignored.
    let values: Vec<f64> = reference::random_values(3, tokens * vocab).iter().map(|v| 8.0 * v).collect();
    let (logits, rounded) = upload::<T>(ctx, &values).unwrap();
    let targets: Vec<i32> =
        (0..tokens).map(|t| if t % 4 == 1 { -100 } else { ((t * 7919) % vocab) as i32 }).collect();
    let wide: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
    let t_dev = ctx.stream().clone_htod(&targets).unwrap();
    let grad = 0.5;
    let (want_loss, lse) = rb::cross_entropy(&rounded, &wide, vocab, Some(-100));
    let want_d = rb::cross_entropy_backward(&rounded, &wide, &lse, vocab, Some(-100), grad);
    let args = CrossEntropyArgs::new(tokens, vocab).with_ignore_index(-100).with_grad_scale(grad as f32);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("{} {backend:?} {tokens}x{vocab}", T::DTYPE);
        let mut loss = poisoned::<f32>(ctx, 1).unwrap();
        cross_entropy(ctx, args, CrossEntropyOperands::new(&logits, &t_dev, &mut loss), backend).unwrap();
        let l = scalar(ctx, &loss);
        assert!(((l - want_loss) / want_loss).abs() < LOSS_TOL, "{tag}: loss {l} vs {want_loss}");

        let mut loss = poisoned::<f32>(ctx, 1).unwrap();
        let mut d = poisoned::<T>(ctx, tokens * vocab).unwrap();
        let x = CrossEntropyOperands::with_grad(&logits, &mut d, &t_dev, &mut loss);
        cross_entropy(ctx, args, x, backend).unwrap();
        let l = scalar(ctx, &loss);
        assert!(((l - want_loss) / want_loss).abs() < LOSS_TOL, "{tag}: loss {l} vs {want_loss}");
        let c = reference::compare(&download(ctx, &d).unwrap(), &want_d);
        println!("{tag}: dlogits {c}");
        assert!(c.passes(ce_tol::<T>()), "{tag}: dlogits {c}");

        let mut inplace = logits.clone();
        let mut loss = poisoned::<f32>(ctx, 1).unwrap();
        cross_entropy(ctx, args, CrossEntropyOperands::in_place(&mut inplace, &t_dev, &mut loss), backend)
            .unwrap();
        let c = reference::compare(&download(ctx, &inplace).unwrap(), &want_d);
        assert!(c.passes(ce_tol::<T>()), "{tag}: in place {c}");
        assert!(((scalar(ctx, &loss) - want_loss) / want_loss).abs() < LOSS_TOL, "{tag}: in-place loss");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_matches_the_reference_per_dtype() {
    let ctx = gpu();
    // A vocabulary that is no multiple of the block (nor of its 4-way unroll), and one row of 128256.
    check_cross_entropy::<bf16>(&ctx, 9, 1000);
    check_cross_entropy::<f16>(&ctx, 5, 3001);
    check_cross_entropy::<f32>(&ctx, 6, 2049);
    check_cross_entropy::<bf16>(&ctx, 2, 128_256);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_rejects_bad_arguments_with_outputs_untouched() {
    let ctx = gpu();
    let (tokens, vocab) = (4, 100);
    let (logits, _) = upload::<bf16>(&ctx, &reference::random_values(1, tokens * vocab)).unwrap();
    let targets = ctx.stream().clone_htod(&[1i32, 2, 3, 4]).unwrap();
    let args = CrossEntropyArgs::new(tokens, vocab);
    let mut loss = ctx.stream().clone_htod(&[7.0f32]).unwrap();
    let mut d = ctx.stream().clone_htod(&vec![bf16::from_f32(7.0); tokens * vocab - 1]).unwrap();
    let x = CrossEntropyOperands::with_grad(&logits, &mut d, &targets, &mut loss);
    let e = cross_entropy(&ctx, args, x, Backend::Fused).unwrap_err();
    assert!(e.to_string().contains("dlogits have"), "{e}");
    let x = CrossEntropyOperands::with_grad(&logits, &mut d, &targets, &mut loss);
    let e = cross_entropy(&ctx, CrossEntropyArgs::new(5, vocab), x, Backend::Naive).unwrap_err();
    assert!(e.to_string().contains("logits have"), "{e}");
    assert_eq!(download(&ctx, &loss).unwrap(), vec![7.0]);
    assert!(download(&ctx, &d).unwrap().iter().all(|v| v.to_f32() == 7.0));
    // A device target outside the vocabulary cannot be refused before the launch: its loss is NaN.
    let bad = ctx.stream().clone_htod(&[1i32, 2, 300, 4]).unwrap();
    let mut d = poisoned::<bf16>(&ctx, tokens * vocab).unwrap();
    cross_entropy(
        &ctx,
        args,
        CrossEntropyOperands::with_grad(&logits, &mut d, &bad, &mut loss),
        Backend::Fused,
    )
    .unwrap();
    assert!(scalar(&ctx, &loss).is_nan());
}

/// One tensor's host state for the AdamW test.
struct Host {
    p: Vec<f64>,
    g: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
}

fn check_adamw<P: Element, G: Element>(ctx: &Cudnn, master: bool, clip: bool) {
    let hp = AdamWArgs::new(0.05).with_betas(0.9, 0.95).with_eps(1e-8).with_weight_decay(0.1).with_step(1);
    let rhp = rb::AdamWParams {
        lr: hp.lr,
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        weight_decay: hp.weight_decay,
    };
    // Sizes across chunk boundaries (65536 elements per block), a tiny one and an empty one.
    let sizes = [70_000, 3, 0, 65_536];
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("{}/{} {backend:?} master {master} clip {clip}", P::DTYPE, G::DTYPE);
        let mut host = Vec::new();
        let mut dev = Vec::new();
        for (k, &n) in sizes.iter().enumerate() {
            let (p, pr) = upload::<P>(ctx, &reference::random_values(10 + k as u64, n)).unwrap();
            let (g, gr) = upload::<G>(ctx, &reference::random_values(20 + k as u64, n)).unwrap();
            let w = ctx.stream().clone_htod(&reference::to_elements::<f32>(&pr)).unwrap();
            let zeros = ctx.stream().alloc_zeros::<f32>(n).unwrap();
            host.push(Host { p: pr, g: gr, m: vec![0.0; n], v: vec![0.0; n] });
            dev.push((p, g, zeros.clone(), zeros, w));
        }
        let mut opt = MultiTensor::new();
        let mut norm = poisoned::<f32>(ctx, 2).unwrap();
        let grads: Vec<&[f64]> = host.iter().map(|h| h.g.as_slice()).collect();
        let want_norm = rb::global_grad_norm(&grads);
        let coef = if clip { rb::clip_coefficient(want_norm, 1.0) } else { 1.0 };
        {
            let g: Vec<&dyn DevicePtr<G>> = dev.iter().map(|d| &d.1 as &dyn DevicePtr<G>).collect();
            let args = if clip { GradNormArgs::clip(1.0) } else { GradNormArgs::norm() };
            grad_norm(ctx, args, GradNormOperands::new(&mut opt, g, &mut norm), backend).unwrap();
        }
        let got = download(ctx, &norm).unwrap();
        assert!(
            ((got[0] as f64 - want_norm) / want_norm).abs() < 1e-5,
            "{tag}: norm {} vs {want_norm}",
            got[0]
        );
        assert!(((got[1] as f64 - coef) / coef).abs() < 1e-5, "{tag}: coefficient {} vs {coef}", got[1]);
        for step in 1..=2 {
            for h in host.iter_mut() {
                let g: Vec<f64> = h.g.iter().map(|x| x * coef).collect();
                rb::adamw_step(&mut h.p, &g, &mut h.m, &mut h.v, step, rhp);
            }
            let tensors: Vec<AdamWTensor<'_, P, G>> = dev
                .iter_mut()
                .map(|(p, g, m, v, w)| {
                    let t = AdamWTensor::new(p, g, m, v);
                    if master {
                        t.master(w)
                    } else {
                        t
                    }
                })
                .collect();
            let mut x = AdamWOperands::new(&mut opt, tensors);
            if clip {
                x = x.clip(&norm);
            }
            adamw(ctx, hp.with_step(step), x, backend).unwrap();
        }
        for (k, (h, d)) in host.iter().zip(&dev).enumerate() {
            if h.p.is_empty() {
                continue;
            }
            let c = reference::compare(&download(ctx, &d.2).unwrap(), &h.m);
            assert!(c.passes(OPTIM_F32_TOL), "{tag}: tensor {k} m {c}");
            let c = reference::compare(&download(ctx, &d.3).unwrap(), &h.v);
            assert!(c.passes(OPTIM_F32_TOL), "{tag}: tensor {k} v {c}");
            let c = reference::compare(&download(ctx, &d.0).unwrap(), &h.p);
            println!("{tag}: tensor {k} params {c}");
            assert!(c.passes(reference::tolerance(P::DTYPE)), "{tag}: tensor {k} params {c}");
            if master {
                let c = reference::compare(&download(ctx, &d.4).unwrap(), &h.p);
                assert!(c.passes(OPTIM_F32_TOL), "{tag}: tensor {k} master {c}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_matches_torch_formula_per_dtype() {
    let ctx = gpu();
    check_adamw::<f32, f32>(&ctx, false, false);
    check_adamw::<bf16, bf16>(&ctx, false, true);
    check_adamw::<bf16, f32>(&ctx, true, false);
    check_adamw::<bf16, bf16>(&ctx, true, true);
    check_adamw::<f32, bf16>(&ctx, false, true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grad_norm_is_deterministic_and_clipping_scales_in_place() {
    let ctx = gpu();
    let sizes = [200_000, 17, 0, 65_537];
    let host: Vec<Vec<f64>> =
        sizes.iter().enumerate().map(|(k, &n)| reference::random_values(k as u64, n)).collect();
    let grads: Vec<CudaSlice<bf16>> = host.iter().map(|h| upload::<bf16>(&ctx, h).unwrap().0).collect();
    let rounded: Vec<Vec<f64>> =
        grads.iter().map(|g| download(&ctx, g).unwrap().iter().map(|v| v.to_f64()).collect()).collect();
    let refs: Vec<&[f64]> = rounded.iter().map(|r| r.as_slice()).collect();
    let want = rb::global_grad_norm(&refs);
    let coef = rb::clip_coefficient(want, 1.0);
    let args = GradNormArgs::clip(1.0);
    for backend in [Backend::Fused, Backend::Naive] {
        let mut opt = MultiTensor::new();
        fn read(g: &[CudaSlice<bf16>]) -> Vec<&dyn DevicePtr<bf16>> {
            g.iter().map(|g| g as &dyn DevicePtr<bf16>).collect()
        }
        let mut a = poisoned::<f32>(&ctx, 2).unwrap();
        let mut b = poisoned::<f32>(&ctx, 2).unwrap();
        grad_norm(&ctx, args, GradNormOperands::new(&mut opt, read(&grads), &mut a), backend).unwrap();
        grad_norm(&ctx, args, GradNormOperands::new(&mut opt, read(&grads), &mut b), backend).unwrap();
        let (a, b) = (download(&ctx, &a).unwrap(), download(&ctx, &b).unwrap());
        assert_eq!(a[0].to_bits(), b[0].to_bits(), "{backend:?}: two runs differ");
        assert!(((a[0] as f64 - want) / want).abs() < 1e-5, "{backend:?}: norm {} vs {want}", a[0]);
        assert!(((a[1] as f64 - coef) / coef).abs() < 1e-5, "{backend:?}: coefficient {} vs {coef}", a[1]);
        // The norm alone: coefficient 1.
        let mut c = poisoned::<f32>(&ctx, 2).unwrap();
        let none = GradNormArgs::norm();
        grad_norm(&ctx, none, GradNormOperands::new(&mut opt, read(&grads), &mut c), backend).unwrap();
        assert_eq!(download(&ctx, &c).unwrap()[1], 1.0, "{backend:?}: coefficient without max_norm");
        // clip_grad_norm_: the same norm, then the gradients scaled in place.
        let mut clipped: Vec<CudaSlice<bf16>> = grads.clone();
        let mut norm = poisoned::<f32>(&ctx, 2).unwrap();
        let gm: Vec<&mut dyn DevicePtrMut<bf16>> =
            clipped.iter_mut().map(|g| g as &mut dyn DevicePtrMut<bf16>).collect();
        grad_norm(&ctx, args, GradNormOperands::clip(&mut opt, gm, &mut norm), backend).unwrap();
        assert_eq!(download(&ctx, &norm).unwrap()[0].to_bits(), a[0].to_bits(), "{backend:?}: clip's norm");
        for (g, r) in clipped.iter().zip(&rounded).filter(|(g, _)| !g.is_empty()) {
            let want: Vec<f64> = r.iter().map(|v| v * coef).collect();
            let c = reference::compare(&download(&ctx, g).unwrap(), &want);
            assert!(c.passes(reference::BF16_TOL), "{backend:?}: clipped {c}");
        }
        // Clipping without a threshold is refused, the gradients untouched.
        let mut norm = poisoned::<f32>(&ctx, 2).unwrap();
        let before = download(&ctx, &clipped[0]).unwrap();
        let gm: Vec<&mut dyn DevicePtrMut<bf16>> =
            clipped.iter_mut().map(|g| g as &mut dyn DevicePtrMut<bf16>).collect();
        let e = grad_norm(&ctx, none, GradNormOperands::clip(&mut opt, gm, &mut norm), backend).unwrap_err();
        assert!(e.to_string().contains("needs a max_norm"), "{e}");
        assert_eq!(download(&ctx, &clipped[0]).unwrap(), before);
    }
}

fn check_rope_backward<T: Element>(ctx: &Cudnn, a: RopeArgs, positions: usize) {
    let half = a.head_dim / 2;
    let angle = |i: usize| (i / half) as f64 * 500000f64.powf(-((2 * (i % half)) as f64) / a.head_dim as f64);
    let cos: Vec<f64> = (0..positions * half).map(|i| angle(i).cos()).collect();
    let sin: Vec<f64> = (0..positions * half).map(|i| angle(i).sin()).collect();
    let tables = RopeTables::<T>::new(ctx, &cos, &sin, a.head_dim).unwrap();
    let n = a.batch * a.seq * a.row_stride;
    let (dy, rounded) = upload::<T>(ctx, &reference::random_values(5, n)).unwrap();
    // The reference on the Q and K heads of each row, V and padding unchanged.
    let rows = a.batch * a.seq;
    let heads = a.heads_q + a.heads_kv;
    let pos: Vec<usize> = (0..rows).map(|r| a.start + r % a.seq).collect();
    let qk: Vec<f64> =
        (0..rows).flat_map(|r| rounded[r * a.row_stride..][..heads * a.head_dim].to_vec()).collect();
    let shape = rb::RopeShape { heads, dim: a.head_dim, positions: &pos, cos: &cos, sin: &sin };
    let back = rb::rope_backward(&qk, shape);
    let mut want = rounded.clone();
    for r in 0..rows {
        want[r * a.row_stride..][..heads * a.head_dim]
            .copy_from_slice(&back[r * heads * a.head_dim..][..heads * a.head_dim]);
    }
    for backend in [Backend::Fused, Backend::Naive] {
        let mut buf = dy.clone();
        rope_backward(ctx, a, RopeBackwardOperands::new(&tables, &mut buf), backend).unwrap();
        let c = reference::compare(&download(ctx, &buf).unwrap(), &want);
        println!("{} {backend:?} {a:?}: {c}", T::DTYPE);
        assert!(c.passes(reference::tolerance(T::DTYPE)), "{backend:?} {a:?}: {c}");
        // Forward after backward gives back the gradient (rotation by θ after −θ).
        rope(ctx, a, RopeOperands::new(&tables, &mut buf), backend).unwrap();
        let c = reference::compare(&download(ctx, &buf).unwrap(), &rounded);
        assert!(c.passes(reference::tolerance(T::DTYPE)), "{backend:?} round trip {c}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_backward_rotates_by_minus_theta() {
    let ctx = gpu();
    let a = RopeArgs::new(2, 33, 32, 8, 128).with_row_stride(6144);
    check_rope_backward::<bf16>(&ctx, a, 64);
    check_rope_backward::<f16>(&ctx, RopeArgs::new(3, 7, 3, 1, 8).with_row_stride(48).with_start(2), 16);
}

fn check_embedding_backward<T: Element>(ctx: &Cudnn, vocab: usize, hidden: usize, ids: &[u32]) {
    let rows = ids.len();
    let (dy, rounded) = upload::<T>(ctx, &reference::random_values(8, rows * hidden)).unwrap();
    let ids_dev = ctx.stream().clone_htod(ids).unwrap();
    let acc = reference::random_values(9, vocab * hidden);
    let acc32 = reference::to_elements::<f32>(&acc);
    let acc_rounded: Vec<f64> = acc32.iter().map(|&v| v as f64).collect();
    let args = EmbeddingArgs::new(rows, vocab, hidden);
    let runs = [
        (Backend::Fused, EmbeddingGrad::Atomic),
        (Backend::Fused, EmbeddingGrad::Deterministic),
        (Backend::Naive, EmbeddingGrad::Atomic),
    ];
    for (backend, how) in runs {
        let tag = format!("{} {backend:?} {how:?} {rows} ids into {vocab}x{hidden}", T::DTYPE);
        let mut dt = poisoned::<f32>(ctx, vocab * hidden).unwrap();
        embedding_backward(
            ctx,
            args,
            EmbeddingBackwardOperands::new(&ids_dev, &dy, &mut dt).how(how),
            backend,
        )
        .unwrap();
        let want = rb::embedding_backward(ids, &rounded, vocab, hidden, None);
        let first = download(ctx, &dt).unwrap();
        let c = reference::compare(&first, &want);
        assert!(c.passes(OPTIM_F32_TOL), "{tag}: {c}");
        // The deterministic kernel and the eager sort give the same bits on every run.
        if how == EmbeddingGrad::Deterministic || backend == Backend::Naive {
            embedding_backward(
                ctx,
                args,
                EmbeddingBackwardOperands::new(&ids_dev, &dy, &mut dt).how(how),
                backend,
            )
            .unwrap();
            let again = download(ctx, &dt).unwrap();
            assert!(first.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()), "{tag}: runs differ");
        }
        // Accumulation adds to what is there.
        let mut dt = ctx.stream().clone_htod(&acc32).unwrap();
        let x = EmbeddingBackwardOperands::new(&ids_dev, &dy, &mut dt).how(how).accumulate();
        embedding_backward(ctx, args, x, backend).unwrap();
        let want = rb::embedding_backward(ids, &rounded, vocab, hidden, Some(&acc_rounded));
        let c = reference::compare(&download(ctx, &dt).unwrap(), &want);
        assert!(c.passes(OPTIM_F32_TOL), "{tag} accumulate: {c}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_backward_scatter_adds_atomic_and_deterministic() {
    let ctx = gpu();
    // Many repeats of a few ids (more than one 4096-token segment), ids at both ends of the
    // vocabulary, and a vocabulary that is no multiple of the 32-row tile.
    let ids: Vec<u32> = (0..5000u32).map(|r| if r % 3 == 0 { 7 } else { (r * 131) % 1001 }).collect();
    check_embedding_backward::<bf16>(&ctx, 1001, 96, &ids);
    check_embedding_backward::<f32>(&ctx, 1001, 300, &[0, 1000, 0, 5]);
    check_embedding_backward::<f16>(&ctx, 40, 8, &[39, 39, 39, 0]);
}
