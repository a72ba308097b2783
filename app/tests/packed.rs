//! Packed prefill through the whole decoder: several prompts of different lengths (1, non-multiples
//! of 64) back to back in one forward over a paged cache (embedding, norms and projections over the
//! packed rows, RoPE at each token's own position, K/V into each sequence's pages, ragged causal
//! attention over the fused QKV rows in place) against each prompt prefilled alone: the same
//! last-token logits (within bf16 tolerance) and first token, then decode steps that read the packed
//! prefill's pages giving the same logits; and `BatchEngine::add_many` with greedy decoding giving each
//! request the ids it gets alone (as `continuous_batching_equals_each_request_alone` checks `add`).
//! On the tiny preset and on 2 layers of Llama-3.1-8B shapes; fused and naive backends.
//!
//! GPU tests are ignored by default; run them with `--include-ignored` on a GPU machine. Each prints
//! what it compares; failures are collected and reported together.

use cudnn_llm::cudnn_ops::reference::{self, Tolerance};
use cudnn_llm::cudnn_ops::{Cudnn, Element, PageOrder, PagedForm};
use cudnn_llm::llama::generate::{DecodeMode, Generator};
use cudnn_llm::llama::sampling::{argmax, SamplingParams};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, BatchConfig, BatchEngine, Llama, LlamaConfig, NoObserver};
use cudnn_llm_app::bench_util::{download, end_finished, gpu, greedy_alone, rms, same_greedy_ids, NEAR_TIE};
use half::bf16;

/// Logits of one sequence prefilled packed against alone: bf16 activations through every layer,
/// where the two attentions (ragged composite graph against the plain causal one) round differently;
/// each attention alone is within 2e-2 of the f64 reference (cudnn-ops/tests/ragged.rs, cudnn-ops/tests/sdpa.rs).
const LOGITS: Tolerance = Tolerance::rel_l2(2e-2);
/// Positions per page.
const PAGE: usize = 16;

/// `n` seeded ids below `vocab`.
fn prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    reference::random_values(seed, n).iter().map(|v| ((v * 0.5 + 0.5) * (vocab - 1) as f64) as u32).collect()
}

/// The first `rows · vocab` values of `dev`, as f32 rows.
fn rows_of<T: Element>(
    ctx: &Cudnn,
    dev: &cudarc::driver::CudaSlice<T>,
    rows: usize,
    vocab: usize,
) -> Vec<Vec<f32>> {
    let host = download(ctx, dev).unwrap();
    host[..rows * vocab].chunks(vocab).map(|r| r.iter().map(|v| v.to_f64() as f32).collect()).collect()
}

/// `got` against `want` logits of one sequence: within [`LOGITS`], and the same argmax or a
/// near-tie there. Returns a failure, if any.
fn same_logits(tag: &str, got: &[f32], want: &[f32]) -> Option<String> {
    let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    let got_e: Vec<bf16> = got.iter().map(|&v| bf16::from_f32(v)).collect();
    let c = reference::compare(&got_e, &want64);
    let (a, b) = (argmax(got).unwrap(), argmax(want).unwrap());
    let gap = want[b as usize] - want[a as usize];
    println!("{tag}: {c}; argmax {a} vs {b} alone (gap {gap}, rms {})", rms(want));
    if !c.passes(LOGITS) {
        return Some(format!("{tag}: {c}"));
    }
    (a != b && gap > NEAR_TIE * rms(want)).then(|| format!("{tag}: argmax {a}, alone {b} (gap {gap})"))
}

/// Model level: the prompts prefilled one by one (each a plain step) and packed (one step), on one
/// paged cache; each one's last-token logits, then one decode step of each group (reading the pages
/// the prefills wrote) with the alone run's greedy ids, compared logits against logits.
fn packed_logits(
    ctx: &Cudnn,
    model: &mut Llama<bf16>,
    backends: &Backends,
    prompts: &[Vec<u32>],
    max_seq: usize,
    tag: &str,
    failures: &mut Vec<String>,
) {
    let vocab = model.config().vocab;
    let n = prompts.len();
    let pages = 2 * n * max_seq.div_ceil(PAGE);
    let mut cache = model.paged_cache(ctx, n, max_seq, PAGE, pages, PageOrder::HeadMajor).unwrap();
    let none = &mut NoObserver;
    // Alone: one plain prefill step per prompt.
    let mut alone_ids = Vec::new();
    let mut alone = Vec::new();
    for p in prompts {
        let id = cache.add();
        cache.begin_packed(ctx, &[id], &[p.len()]).unwrap();
        model.forward_paged(ctx, &mut cache, p, backends, none).unwrap();
        let dev = model.logits_rows(ctx, p.len() - 1..p.len(), backends, none).unwrap();
        alone.push(rows_of(ctx, &dev, 1, vocab).remove(0));
        cache.finish().unwrap();
        alone_ids.push(id);
    }
    // Packed: one step of every prompt.
    let ids: Vec<_> = prompts.iter().map(|_| cache.add()).collect();
    let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    cache.begin_packed(ctx, &ids, &lens).unwrap();
    assert_eq!(cache.step(), Some((1, lens.iter().sum())), "{tag}: a packed step is one row");
    model.forward_paged(ctx, &mut cache, &prompts.concat(), backends, none).unwrap();
    if cache.last_form() != Some(PagedForm::Ragged) {
        failures.push(format!("{tag}: the packed step attended as {:?}", cache.last_form()));
    }
    let last: Vec<usize> = lens
        .iter()
        .scan(0, |end, &l| {
            *end += l;
            Some(*end - 1)
        })
        .collect();
    let dev = model.logits_of(ctx, &last, backends, none).unwrap();
    let packed = rows_of(ctx, &dev, n, vocab);
    cache.finish().unwrap();
    for (i, (got, want)) in packed.iter().zip(&alone).enumerate() {
        let t = format!("{tag} prompt {i} ({} ids) prefill", lens[i]);
        failures.extend(same_logits(&t, got, want));
    }
    // One decode step of each group, every sequence fed the alone run's greedy id.
    let next: Vec<u32> = alone.iter().map(|l| argmax(l).unwrap()).collect();
    let mut step = |group: &[cudnn_llm::cudnn_ops::SeqId]| {
        cache.begin(ctx, group, 1, n).unwrap();
        model.forward_paged(ctx, &mut cache, &next, backends, none).unwrap();
        let dev = model.logits_rows(ctx, 0..n, backends, none).unwrap();
        cache.finish().unwrap();
        rows_of(ctx, &dev, n, vocab)
    };
    let (after_alone, after_packed) = (step(&alone_ids), step(&ids));
    for (i, (got, want)) in after_packed.iter().zip(&after_alone).enumerate() {
        failures.extend(same_logits(&format!("{tag} prompt {i} first decode step"), got, want));
    }
}

/// Engine level: `add_many` of the first three prompts, two steps, `add_many` of the rest while the
/// first decode, then greedy steps until each request has its `outputs` ids; against each request run
/// alone on a contiguous cache. Every page is free afterwards.
#[allow(clippy::too_many_arguments)]
fn packed_engine(
    ctx: &Cudnn,
    cfg: &LlamaConfig,
    w: &Weights<bf16>,
    backends: &str,
    mode: DecodeMode,
    prompts: &[Vec<u32>],
    outputs: &[usize],
    max_seq: usize,
    want: &[(Vec<u32>, Vec<Vec<f32>>)],
    failures: &mut Vec<String>,
) {
    let tag = format!("{} {backends} {mode:?}", cfg.name);
    let model = Llama::new(ctx, cfg, w, max_seq).unwrap();
    let bc = BatchConfig::new(8, max_seq, PAGE);
    let engine = BatchEngine::new(ctx, model, Backends::parse(backends).unwrap(), bc).unwrap();
    // SAFETY: this test uses one thread and no other stream.
    let mut engine = unsafe { engine.with_mode(mode) };
    let total = engine.free_pages();
    let mut got = vec![Vec::new(); prompts.len()];
    let mut handles = std::collections::HashMap::new();
    let split = 3.min(prompts.len());
    let mut step = 0;
    loop {
        let wave = match step {
            0 => 0..split,
            2 => split..prompts.len(),
            _ => 0..0,
        };
        if !wave.is_empty() {
            let reqs: Vec<(&[u32], SamplingParams)> =
                wave.clone().map(|r| (&prompts[r][..], SamplingParams::greedy())).collect();
            for (r, (id, first)) in wave.zip(engine.add_many(ctx, &reqs).unwrap()) {
                got[r].push(first);
                handles.insert(id, r);
            }
        }
        end_finished(&mut engine, &mut handles, (prompts, &got, outputs), &tag);
        if handles.is_empty() && step >= 2 {
            break;
        }
        for (id, t) in engine.step(ctx).unwrap() {
            got[handles[&id]].push(t);
        }
        step += 1;
    }
    for (r, ids) in got.iter().enumerate() {
        failures.extend(same_greedy_ids(&format!("{tag} request {r}"), ids, &want[r].0, &want[r].1));
    }
    println!(
        "{tag}: {step} steps, last form {:?}, graph refusal {:?}, fallbacks {:?}",
        engine.last_form(),
        engine.graph_refusal(),
        engine.model().fallbacks()
    );
    if engine.free_pages() != total {
        failures
            .push(format!("{tag}: {} of {total} pages free after every request ended", engine.free_pages()));
    }
    if backends.starts_with("fused") && !engine.model().fallbacks().is_empty() {
        failures.push(format!("{tag}: fallbacks {:?}", engine.model().fallbacks()));
    }
}

/// Every check of this file for `cfg` and prompts of `lens`, on the fused and the naive backend.
fn check_preset(cfg: LlamaConfig, lens: &[usize], max_seq: usize) {
    let ctx = gpu();
    let w = Weights::<bf16>::random(&cfg, 5);
    let prompts: Vec<Vec<u32>> =
        lens.iter().enumerate().map(|(i, &n)| prompt(70 + i as u64, n, cfg.vocab)).collect();
    let outputs: Vec<usize> = (0..lens.len()).map(|i| 4 + 3 * i).collect();
    let mut failures = Vec::new();
    for backends in ["fused=all", "naive=all"] {
        let tag = format!("{} {backends}", cfg.name);
        let b = Backends::parse(backends).unwrap();
        let mut model = Llama::new(&ctx, &cfg, &w, max_seq).unwrap();
        packed_logits(&ctx, &mut model, &b, &prompts, max_seq, &tag, &mut failures);
        let mut generator =
            Generator::new(&ctx, Llama::new(&ctx, &cfg, &w, max_seq).unwrap(), b, max_seq).unwrap();
        let want: Vec<_> = prompts
            .iter()
            .zip(&outputs)
            .map(|(p, &n)| greedy_alone(&ctx, &mut generator, p, n).unwrap())
            .collect();
        let modes: &[DecodeMode] = if backends.starts_with("fused") {
            &[DecodeMode::Launch, DecodeMode::Graph]
        } else {
            &[DecodeMode::Launch]
        };
        for &mode in modes {
            packed_engine(&ctx, &cfg, &w, backends, mode, &prompts, &outputs, max_seq, &want, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_prefill_equals_each_prompt_alone_tiny() {
    check_preset(LlamaConfig::tiny(), &[1, 37, 100, 5, 130], 256);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_prefill_equals_each_prompt_alone_llama_3_1_8b_2_layers() {
    check_preset(LlamaConfig::llama_3_1_8b().with_layers(2), &[1, 100, 257, 64, 513], 640);
}
