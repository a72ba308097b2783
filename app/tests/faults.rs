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
    assert_eq!(replay.uniform_len(), Some(prompt + 1), "a failed replay counts no token");
    let got =
        ctx.stream().clone_dtoh(model.decode(&ctx, &mut graph, &step(s), &mut replay).unwrap()).unwrap();
    assert_eq!(got, want, "the replay after the failed one: the plain step's logits");
    assert_eq!(replay.uniform_len(), Some(prompt + 2));
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

/// In the batching engine, a request whose prefill fails (an allocation failing inside it) is ended with
/// its error: it holds no page and no row, and the sequences already live finish with the ids each gets
/// alone. A decode step that fails (a plan build in launch mode, a replay in graph mode) is an error
/// for that step alone: no sequence gains an id, no page is lost, and the next step carries on as if it
/// had not happened.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failing_request_in_the_batching_engine_ends_alone_and_the_others_finish_right() {
    use cudnn_llm::llama::generate::{DecodeMode, Generator};
    use cudnn_llm::llama::sampling::SamplingParams;
    use cudnn_llm::llama::{BatchConfig, BatchEngine};
    use cudnn_llm_app::bench_util::{end_finished, greedy_alone, same_greedy_ids};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = fresh_context();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 6);
    let fused = Backends::all(Backend::Fused);
    let max_seq = 96;
    // Two requests decoding, a third (longer than the activations are sized for, so its prefill
    // allocates) that fails once and is retried later.
    let prompts: Vec<Vec<u32>> =
        tokens(3, 48, cfg.vocab).into_iter().zip([7usize, 11, 48]).map(|(t, n)| t[..n].to_vec()).collect();
    let outputs = [24usize, 20, 10];
    let mut generator =
        Generator::new(&ctx, Llama::new(&ctx, &cfg, &w, max_seq).unwrap(), fused.clone(), max_seq).unwrap();
    let want: Vec<(Vec<u32>, Vec<Vec<f32>>)> =
        prompts.iter().zip(outputs).map(|(p, n)| greedy_alone(&ctx, &mut generator, p, n).unwrap()).collect();
    drop(generator);
    let mut failures = Vec::new();
    for mode in [DecodeMode::Launch, DecodeMode::Graph] {
        let model = Llama::new(&ctx, &cfg, &w, max_seq).unwrap();
        let bc = BatchConfig::new(4, max_seq, 16);
        // SAFETY: this test uses one thread and no other stream.
        let mut engine = unsafe { BatchEngine::new(&ctx, model, fused.clone(), bc).unwrap().with_mode(mode) };
        let total = engine.free_pages();
        let mut got = vec![Vec::new(); prompts.len()];
        let mut handles = std::collections::HashMap::new();
        for r in 0..2 {
            let (id, first) = engine.add(&ctx, &prompts[r], SamplingParams::greedy()).unwrap();
            got[r].push(first);
            handles.insert(id, r);
        }
        let (mut step, mut step_failed, mut added) = (0, false, false);
        let fail_at = if mode == DecodeMode::Graph { 9 } else { 6 };
        while !handles.is_empty() || !added {
            // Step 3: the third request arrives and its prefill's first allocation fails.
            if step == 3 {
                let (free, live) = (engine.free_pages(), engine.live());
                let before = faults::injected(Site::Alloc);
                faults::fail_nth(Site::Alloc, 1);
                let failed = engine.add(&ctx, &prompts[2], SamplingParams::greedy());
                faults::disarm();
                match failed {
                    Err(e) if e.to_string().contains("injected failure") => {}
                    Err(e) => failures.push(format!("{mode:?}: the third request failed otherwise: {e}")),
                    Ok(_) => {
                        failures.push(format!("{mode:?}: the armed allocation did not fail the prefill"))
                    }
                }
                assert!(faults::injected(Site::Alloc) > before, "{mode:?}: no allocation failed");
                if (engine.free_pages(), engine.live()) != (free, live) {
                    failures.push(format!(
                        "{mode:?}: after the failed request {} pages free and {} live, before {free} and {live}",
                        engine.free_pages(),
                        engine.live()
                    ));
                }
            }
            // Step 6: the third request again, now served.
            if step == 6 {
                let (id, first) = engine.add(&ctx, &prompts[2], SamplingParams::greedy()).unwrap();
                got[2].push(first);
                handles.insert(id, 2);
                added = true;
            }
            end_finished(&mut engine, &mut handles, (&prompts, &got, &outputs), &format!("{mode:?}"));
            // One failing step: in launch mode the first step of three sequences (a bucket of 4 not run
            // before, so its plans are built), in graph mode a replay of that bucket's captured step.
            let stepped = if step == fail_at && !handles.is_empty() {
                let site = if mode == DecodeMode::Graph { Site::Replay } else { Site::PlanBuild };
                let lengths = |e: &BatchEngine<bf16>| -> Vec<usize> {
                    e.sequences().iter().map(|&id| e.tokens(id).unwrap().len()).collect()
                };
                let (free, lens) = (engine.free_pages(), lengths(&engine));
                faults::fail_nth(site, 1);
                let failed = engine.step(&ctx);
                faults::disarm();
                match &failed {
                    Err(e) if e.to_string().contains("injected failure") => step_failed = true,
                    Err(e) => failures.push(format!("{mode:?}: the step failed otherwise: {e}")),
                    Ok(_) => println!("{mode:?}: step {step} reached no {} call", site.name()),
                }
                let after = lengths(&engine);
                if step_failed && (after != lens || engine.free_pages() != free) {
                    failures.push(format!(
                        "{mode:?}: the failed step changed lengths {lens:?} -> {after:?}, free pages {free} -> {}",
                        engine.free_pages()
                    ));
                }
                failed.ok()
            } else {
                Some(engine.step(&ctx).unwrap())
            };
            for (id, t) in stepped.into_iter().flatten() {
                got[handles[&id]].push(t);
            }
            step += 1;
        }
        for (r, ids) in got.iter().enumerate() {
            if let Some(f) = same_greedy_ids(&format!("{mode:?} request {r}"), ids, &want[r].0, &want[r].1) {
                failures.push(f);
            }
        }
        if !step_failed {
            failures.push(format!("{mode:?}: no decode step failed by injection"));
        }
        if engine.free_pages() != total {
            failures.push(format!("{mode:?}: {} of {total} pages free at the end", engine.free_pages()));
        }
        if !engine.model().fallbacks().is_empty() {
            failures.push(format!("{mode:?}: fallbacks {:?}", engine.model().fallbacks()));
        }
        println!("{mode:?}: {step} steps, graph counts {:?}", engine.graph_counts());
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
