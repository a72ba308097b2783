//! Training on the GPU (tiny preset): the gradient of every weight tensor against the f64 reference
//! `llama::reference::train::gradients` for all-naive, all-fused and a mixed selection, with
//! micro-batches and tied embeddings; two AdamW steps against the f64 AdamW formula applied to the
//! GPU's own gradients; a short memorization run on both backends; a trained model written as a
//! checkpoint and read back. GPU tests are ignored by default; run them with `--include-ignored` on
//! a GPU machine. Each prints what it compares before it asserts.

use cudnn_llm::bench_util::gpu;
use cudnn_llm::cudnn_ops::reference::backward::{self as rb, AdamWParams};
use cudnn_llm::cudnn_ops::reference::{compare, Tolerance};
use cudnn_llm::cudnn_ops::{Backend, Cudnn};
use cudnn_llm::llama::reference::train as rt;
use cudnn_llm::llama::train::IGNORE_INDEX;
use cudnn_llm::llama::weights::{Tensor, Weights};
use cudnn_llm::llama::{Backends, Batch, LlamaConfig, NoObserver, TrainConfig, Trainer};
use half::bf16;

/// Gradients of a bf16 model against f64. Activations and activation gradients are rounded to bf16
/// at every op: the f64 reference with every stored tensor rounded so (a CPU emulation, without the
/// kernels' internal roundings) moves this test's gradients by 4e-3 to 8e-3 per tensor; the attention
/// backward alone is allowed 3e-2 against f64 (tests/sdpa_backward.rs, `GRAD_BF16`), and its dQ, dK
/// and dV feed every gradient below it. A missing term, a transposed product, a wrong loss scale or
/// a tied share left out errs by 0.3 or more.
const GRAD_TOL: Tolerance = Tolerance::rel_l2(8e-2);
/// The mean loss from bf16 logits against f64: relative.
const LOSS_TOL: f64 = 1e-2;
/// AdamW on f32 master weights against f64: a handful of f32 operations per element, relative to
/// the update (not to the weight).
const MASTER_UPDATE_TOL: Tolerance = Tolerance::rel_l2(1e-4);

/// Every tensor of `w` in Hugging Face order (`Weights::names`).
fn tensors<E>(w: &Weights<E>) -> Vec<&Tensor<E>> {
    let mut out = vec![&w.embed];
    for l in &w.layers {
        out.extend([
            &l.attn_norm,
            &l.q_proj,
            &l.k_proj,
            &l.v_proj,
            &l.o_proj,
            &l.mlp_norm,
            &l.gate_proj,
            &l.up_proj,
            &l.down_proj,
        ]);
    }
    out.push(&w.norm);
    out.extend(w.lm_head.as_ref());
    out
}

fn f64s<E: cudnn_llm::cudnn_ops::Element>(w: &Weights<E>) -> Vec<Vec<f64>> {
    tensors(w).iter().map(|t| t.to_f64()).collect()
}

/// `n` sequences of `seq` tokens spread over the vocabulary, two labels masked.
fn batch(cfg: &LlamaConfig, n: usize, seq: usize, seed: usize) -> Batch {
    let inputs: Vec<Vec<u32>> = (0..n)
        .map(|b| (0..seq).map(|s| ((seed + 7919 * b + 104729 * s) % cfg.vocab) as u32).collect())
        .collect();
    let mut labels: Vec<Vec<i32>> = inputs.iter().map(|s| s.iter().map(|&t| t as i32).collect()).collect();
    labels[0][3] = IGNORE_INDEX;
    labels[n - 1][seq / 2] = IGNORE_INDEX;
    Batch::new(inputs).with_labels(labels)
}

/// AdamW at `lr`, the modules on `sel` and the rest naive when `sel` is (all naive), else fused.
fn train_config(sel: &str, lr: f64) -> TrainConfig {
    let standalone = if sel.is_empty() { Backend::Naive } else { Backend::Fused };
    TrainConfig::new(lr).with_backends(Backends::parse(sel).unwrap()).with_standalone(standalone)
}

/// One selection's gradients (the second of two backward calls, so that the first micro-batch is
/// seen to overwrite what the last step left) against the reference's.
fn check_gradients(
    ctx: &Cudnn,
    cfg: &LlamaConfig,
    w: &Weights<bf16>,
    (b, want_loss, want): (&Batch, f64, &Weights<f64>),
    sel: &str,
    micro: usize,
    failures: &mut Vec<String>,
) {
    let tag = format!("{} tied {} `{sel}` micro {micro}", cfg.name, cfg.tie_embeddings);
    let mut t = Trainer::new(ctx, cfg, w, train_config(sel, 1e-3).with_micro_batches(micro)).unwrap();
    t.backward(ctx, b, &mut NoObserver).unwrap();
    let loss = t.backward(ctx, b, &mut NoObserver).unwrap();
    let rel = ((loss - want_loss) / want_loss).abs();
    println!("{tag}: loss {loss:.6} vs {want_loss:.6} (relative {rel:.1e})");
    if rel.is_nan() || rel > LOSS_TOL {
        failures.push(format!("{tag}: loss {loss} vs {want_loss}"));
    }
    let got = t.gradients(ctx).unwrap();
    let names = Weights::<bf16>::names(cfg);
    assert_eq!(tensors(&got).len(), names.len(), "{tag}: gradient tensors");
    for ((name, shape), (g, r)) in names.iter().zip(tensors(&got).into_iter().zip(tensors(want))) {
        assert_eq!(&g.shape, shape, "{tag}: {name}");
        let c = compare(&g.data, &r.data);
        let ok = c.passes(GRAD_TOL);
        println!("  {} {name}: {c}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(format!("{tag}: {name}: {c}"));
        }
    }
    for f in t.fallbacks() {
        println!("  fallback: {f:?}");
        failures.push(format!("{tag}: fallback {} layer {:?}: {}", f.range, f.layer, f.reason));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn train_gradients_match_the_f64_reference_on_every_backend_mix() {
    let ctx = gpu();
    println!("{} cuDNN {}", ctx.info().name, ctx.info().cudnn_version_string());
    let mixed = "fused=all;naive=rope@0,gqa@1,mlp@0,prenorm@1,lm_head";
    let mut failures = Vec::new();
    for tied in [false, true] {
        let mut cfg = LlamaConfig::tiny();
        cfg.tie_embeddings = tied;
        let w = Weights::<bf16>::random(&cfg, 1);
        let w64 = rt::widen(&w);
        // 64 token rows per micro-batch either way: 4 sequences of 16 in one, 8 in two.
        let (b4, b8) = (batch(&cfg, 4, 16, 5), batch(&cfg, 8, 16, 11));
        let (l4, g4) = rt::gradients(&cfg, &w64, b4.inputs(), &b4.targets());
        let (l8, g8) = rt::gradients(&cfg, &w64, b8.inputs(), &b8.targets());
        let runs: &[(&str, usize)] =
            if tied { &[("fused=all", 1), ("", 2)] } else { &[("", 1), ("fused=all", 2), (mixed, 1)] };
        for &(sel, micro) in runs {
            let want = if micro == 1 { (&b4, l4, &g4) } else { (&b8, l8, &g8) };
            check_gradients(&ctx, &cfg, &w, want, sel, micro, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Elements of `got` (bf16 weights after an update) further than one bf16 ulp (at the bottom of
/// the binade, `2^-7` relative) from the f64 `want`: rounding the f32 update, not another update.
fn off_by_more_than_an_ulp(got: &[f64], want: &[f64]) -> usize {
    got.iter().zip(want).filter(|(g, w)| (*g - *w).abs() > w.abs() * 2f64.powi(-7) + 1e-30).count()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_steps_move_weights_as_the_f64_formula_says() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 3);
    // eps near the clipped gradients' size, so that the clipping coefficient shows in the update;
    // a clip far below the gradient norm, so that it clips.
    let (lr, eps, wd, clip) = (1e-2, 1e-4, 0.1, 0.05f32);
    let hp = AdamWParams { lr, beta1: 0.9, beta2: 0.95, eps, weight_decay: wd };
    let b = batch(&cfg, 8, 16, 7);
    let mut failures = Vec::new();
    for master in [true, false] {
        let tcfg = TrainConfig::new(lr)
            .with_betas(hp.beta1, hp.beta2)
            .with_eps(eps)
            .with_weight_decay(wd)
            .with_clip(clip)
            .with_micro_batches(2)
            .with_master_weights(master);
        let mut t = Trainer::new(&ctx, &cfg, &w, tcfg).unwrap();
        assert_eq!(t.weights(&ctx).unwrap(), w, "the trainer starts from the given weights");
        let mut p = f64s(&w);
        let mut m: Vec<Vec<f64>> = p.iter().map(|t| vec![0.0; t.len()]).collect();
        let mut v = m.clone();
        for step in 1..=2u64 {
            let before = p.clone();
            let stats = t.step(&ctx, &b).unwrap();
            assert_eq!(t.steps(), step);
            // The reference applies the f64 formula to the gradients the GPU computed (unclipped, as
            // the trainer keeps them), so this checks the optimizer's wiring, not the gradients.
            let g = f64s(&t.gradients(&ctx).unwrap());
            let refs: Vec<&[f64]> = g.iter().map(Vec::as_slice).collect();
            let norm = rb::global_grad_norm(&refs);
            let coef = rb::clip_coefficient(norm, clip as f64);
            let tag = format!("master {master} step {step}");
            println!(
                "{tag}: loss {:.4}, norm {:.5} vs {norm:.5}, coefficient {:.5} vs {coef:.5}",
                stats.loss, stats.grad_norm, stats.clip_coefficient
            );
            if ((stats.grad_norm - norm) / norm).abs() > 1e-4
                || ((stats.clip_coefficient - coef) / coef).abs() > 1e-4
            {
                failures
                    .push(format!("{tag}: norm {} coefficient {}", stats.grad_norm, stats.clip_coefficient));
            }
            assert!(coef < 0.5, "{tag}: the test means to clip (coefficient {coef})");
            for (k, gk) in g.iter().enumerate() {
                let clipped: Vec<f64> = gk.iter().map(|x| x * coef).collect();
                rb::adamw_step(&mut p[k], &clipped, &mut m[k], &mut v[k], step, hp);
            }
            let names = Weights::<bf16>::names(&cfg);
            let weights = f64s(&t.weights(&ctx).unwrap());
            let masters = t.master_weights(&ctx).unwrap().map(|w| f64s(&w));
            assert_eq!(masters.is_some(), master);
            for (k, (name, _)) in names.iter().enumerate() {
                let off = off_by_more_than_an_ulp(&weights[k], &p[k]);
                if off > 0 {
                    failures.push(format!("{tag}: {name}: {off} weights off by more than a bf16 ulp"));
                }
                if let Some(masters) = &masters {
                    let moved: Vec<f32> =
                        masters[k].iter().zip(&before[k]).map(|(a, b)| (a - b) as f32).collect();
                    let want: Vec<f64> = p[k].iter().zip(&before[k]).map(|(a, b)| a - b).collect();
                    let c = compare(&moved, &want);
                    if !c.passes(MASTER_UPDATE_TOL) {
                        failures.push(format!("{tag}: {name} master update: {c}"));
                    }
                }
            }
            if let Some(masters) = masters {
                // Carry the GPU's f32 masters, so that step 2 starts where the GPU is.
                p = masters;
            } else {
                p = weights;
            }
            let moved = p.iter().zip(&before).filter(|(a, b)| a != b).count();
            assert!(moved == p.len(), "{tag}: {moved} of {} tensors moved", p.len());
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// `count` fixed sequences of `seq` tokens drawn from the first `symbols` ids (xorshift from
/// `seed`): with so few symbols the next token depends on the sequence and position, not on the
/// current token alone, so memorizing them needs attention.
fn fixed_sequences(count: usize, seq: usize, symbols: u64, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % symbols) as u32
    };
    (0..count).map(|_| (0..seq).map(|_| next()).collect()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memorization_loss_falls_on_both_backends() {
    // The f64 reference trained the same way (AdamW lr 3e-3, betas (0.9, 0.95), clip 1, weights
    // rounded to bf16 after each step or not) reaches 0.41 at step 20 and 0.012 at step 60; a model
    // that only learns which symbol follows which stays near ln 16 = 2.8.
    const STEPS: usize = 60;
    const FINAL_LOSS: f64 = 0.5;
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 1);
    let b = Batch::new(fixed_sequences(8, 32, 16, 12345));
    let mut failures = Vec::new();
    for sel in ["fused=all", ""] {
        let tcfg = train_config(sel, 3e-3).with_clip(1.0);
        let mut t = Trainer::new(&ctx, &cfg, &w, tcfg).unwrap();
        let start = std::time::Instant::now();
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            losses.push(t.step(&ctx, &b).unwrap().loss);
        }
        let shown: Vec<String> = losses.iter().step_by(5).map(|l| format!("{l:.3}")).collect();
        let last = *losses.last().unwrap();
        println!(
            "`{sel}`: losses every 5 steps {} -> {last:.4} ({:.1} s)",
            shown.join(" "),
            start.elapsed().as_secs_f64()
        );
        if !(losses[0] > 5.0 && last < FINAL_LOSS) {
            failures.push(format!("`{sel}`: loss {} -> {last} (want below {FINAL_LOSS})", losses[0]));
        }
        if !t.fallbacks().is_empty() {
            failures.push(format!("`{sel}`: fallbacks {:?}", t.fallbacks()));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn trained_weights_save_as_a_checkpoint_that_loads_back() {
    let ctx = gpu();
    let mut cfg = LlamaConfig::tiny();
    cfg.tie_embeddings = true;
    let w = Weights::<bf16>::random(&cfg, 4);
    let mut t = Trainer::new(&ctx, &cfg, &w, TrainConfig::new(1e-2)).unwrap();
    t.step(&ctx, &batch(&cfg, 4, 16, 3)).unwrap();
    let trained = t.weights(&ctx).unwrap();
    assert_ne!(trained, w, "a step changes the weights");
    let dir = std::env::temp_dir().join(format!("cudnn-llm-train-save-{}", std::process::id()));
    t.save(&ctx, &dir).unwrap();
    let back_cfg = LlamaConfig::from_dir(&dir).unwrap();
    let mut named = cfg.clone();
    named.name = back_cfg.name.clone();
    assert_eq!(back_cfg, named);
    let back = Weights::<bf16>::load(&back_cfg, &dir).unwrap();
    assert_eq!(back, trained);
    std::fs::remove_dir_all(&dir).unwrap();
}
