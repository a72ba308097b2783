//! Failures injected in the middle of a run (`cudnn_llm::cudnn_ops::faults`): a device allocation, a
//! plan build or a kernel compile failing inside a prefill, a captured decode step's launch failing,
//! an all-reduce failing on a rank. Each is a typed error naming the injection; the context, model
//! and cache stay usable, and the next call gives the logits of a run that never failed. GPU tests,
//! ignored by default; the faults are the process's, so these tests take a lock and the GPU runner
//! runs tests one at a time.

use cudnn_llm::cudnn_ops::faults::{self, Site};
use cudnn_llm::cudnn_ops::{Backend, Cudnn};
use cudnn_llm::llama::tp::{TpLlama, TpOptions, WeightSource};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver};
use cudnn_llm_app::bench_util::gpu;
use half::bf16;
use std::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn tokens(batch: usize, seq: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch).map(|b| (0..seq).map(|s| ((7 + 7919 * b + 104729 * s) % vocab) as u32).collect()).collect()
}

/// A context that neither reads nor writes plan or kernel caches: every plan is built and every
/// kernel room compiled in it. Plans take the heuristics' first engine (no autotuning by timing), so
/// every context computes the same bits.
fn fresh_context() -> Cudnn {
    let ctx = gpu();
    ctx.set_plan_dir(None);
    ctx.set_autotune(1);
    ctx
}

/// The logits of every row of a prefill of `toks` on a new cache.
fn prefill(
    ctx: &Cudnn,
    model: &mut Llama<bf16>,
    toks: &[Vec<u32>],
    backends: &Backends,
) -> cudnn_llm::llama::Result<Vec<bf16>> {
    let rows = toks.len() * toks[0].len();
    let mut cache = model.cache(ctx, toks.len(), toks[0].len())?;
    model.forward(ctx, toks, &mut cache, backends, &mut NoObserver)?;
    let logits = model.logits(ctx, rows, backends, &mut NoObserver)?;
    Ok(ctx.stream().clone_dtoh(&logits).map_err(cudnn_llm::cudnn_ops::Error::from)?)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failure_inside_a_prefill_is_an_error_and_the_next_prefill_is_right() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 3);
    let toks = tokens(2, 9, cfg.vocab);
    for (label, backends) in
        [("fused", Backends::all(Backend::Fused)), ("naive", Backends::all(Backend::Naive))]
    {
        let want = {
            let ctx = fresh_context();
            let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
            prefill(&ctx, &mut model, &toks, &backends).unwrap()
        };
        for site in [Site::Alloc, Site::PlanBuild, Site::Compile] {
            let mut hits = 0;
            for nth in [1, 3, 8] {
                let ctx = fresh_context();
                let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
                let before = faults::injected(site);
                faults::fail_nth(site, nth);
                let first = prefill(&ctx, &mut model, &toks, &backends);
                faults::disarm();
                let hit = faults::injected(site) > before;
                let what = format!("{label}, {} call {nth} failing", site.name());
                match &first {
                    Err(e) => {
                        assert!(hit, "{what}: failed, but not by the injection: {e}");
                        assert!(e.to_string().contains("injected failure:"), "{what}: {e}");
                        hits += 1;
                    }
                    Ok(got) => {
                        assert!(!hit, "{what}: an injected failure was swallowed");
                        assert_eq!(got, &want, "{what} (never reached): the logits");
                    }
                }
                // The same context, model and a new cache: the logits of a run that never failed,
                // with no module fallen back to naive over the injected failure.
                let again = prefill(&ctx, &mut model, &toks, &backends)
                    .unwrap_or_else(|e| panic!("{what}: the next prefill failed: {e}"));
                assert_eq!(again, want, "{what}: the next prefill's logits");
                assert!(model.fallbacks().is_empty(), "{what}: fell back: {:?}", model.fallbacks());
            }
            println!("{label}: {hits} {} failures injected inside the prefill, each recovered", site.name());
            // Allocations happen in every prefill on a fresh context; cuDNN plans only on the fused
            // backend; kernel rooms compile where a naive kernel runs (the fused backend may run none).
            let reached = match site {
                Site::Alloc => true,
                Site::PlanBuild => label == "fused",
                _ => label == "naive",
            };
            if reached {
                assert!(hits > 0, "{label}: no {} failure reached the prefill", site.name());
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failed_replay_of_a_captured_decode_step_leaves_the_next_one_right() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 4);
    let fused = Backends::all(Backend::Fused);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let (batch, prompt) = (2, 7);
    let all = tokens(batch, prompt + 4, cfg.vocab);
    let head: Vec<Vec<u32>> = all.iter().map(|t| t[..prompt].to_vec()).collect();
    let step = |s: usize| -> Vec<u32> { all.iter().map(|t| t[s]).collect() };
    let mut plain = model.cache(&ctx, batch, prompt + 4).unwrap();
    let mut replay = model.cache(&ctx, batch, prompt + 4).unwrap();
    for cache in [&mut plain, &mut replay] {
        model.forward(&ctx, &head, cache, &fused, &mut NoObserver).unwrap();
        let one: Vec<Vec<u32>> = step(prompt).iter().map(|&t| vec![t]).collect();
        model.forward(&ctx, &one, cache, &fused, &mut NoObserver).unwrap();
        model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap();
    }
    // SAFETY: this test uses one thread and no other stream.
    let mut graph = match unsafe { model.capture_decode(&ctx, &mut replay, &fused) } {
        Ok(g) => g,
        Err(e) if ctx.info().cudnn_version < 91500 => {
            println!("cuDNN < 9.15: no decode step captures: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let s = prompt + 1;
    let one: Vec<Vec<u32>> = step(s).iter().map(|&t| vec![t]).collect();
    model.forward(&ctx, &one, &mut plain, &fused, &mut NoObserver).unwrap();
    let want = ctx.stream().clone_dtoh(&model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap()).unwrap();
    faults::fail_nth(Site::Replay, 1);
    let failed = model.decode(&ctx, &mut graph, &step(s), &mut replay).map(drop);
    faults::disarm();
    let e = failed.expect_err("the armed replay fails").to_string();
    assert!(e.contains("injected failure"), "{e}");
    assert_eq!(replay.len(), prompt + 1, "a failed replay counts no token");
    let got =
        ctx.stream().clone_dtoh(model.decode(&ctx, &mut graph, &step(s), &mut replay).unwrap()).unwrap();
    assert_eq!(got, want, "the replay after the failed one: the plain step's logits");
    assert_eq!(replay.len(), prompt + 2);
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn a_failed_all_reduce_ends_the_ranks_call_with_an_error_in_bounded_time() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "a_failed_all_reduce_ends_the_ranks_call_with_an_error_in_bounded_time",
    ) {
        return;
    }
    let cfg = LlamaConfig::tiny();
    let options = TpOptions::default().with_timeout(std::time::Duration::from_secs(60));
    let mut tp = TpLlama::<bf16>::new(&cfg, 2, &WeightSource::Random { seed: 5 }, 32, options).unwrap();
    let fused = Backends::all(Backend::Fused);
    tp.reset_cache(1, 16).unwrap();
    let toks = tokens(1, 8, cfg.vocab);
    tp.forward(&toks, &fused).unwrap();
    tp.truncate(0).unwrap();
    // One rank's third all-reduce is not enqueued; the other rank's waits until the team aborts.
    let t = std::time::Instant::now();
    faults::fail_nth(Site::Collective, 3);
    let failed = tp.forward(&toks, &fused);
    faults::disarm();
    let e = failed.expect_err("an all-reduce failed").to_string();
    println!("after {:.2} s: {e}", t.elapsed().as_secs_f64());
    assert!(e.contains("injected failure") && e.contains("all_reduce_sum"), "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "{:?}", t.elapsed());
    // The team is torn down (its communicators aborted) and says so; a new team works.
    assert!(tp.forward(&toks, &fused).unwrap_err().to_string().contains("torn down"));
    drop(tp);
    let mut again =
        TpLlama::<bf16>::new(&cfg, 2, &WeightSource::Random { seed: 5 }, 32, TpOptions::default()).unwrap();
    again.reset_cache(1, 16).unwrap();
    again.forward(&toks, &fused).unwrap();
}
