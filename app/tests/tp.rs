//! Tensor parallelism on two GPUs (the `nvidia-h200-x2` kind, with NCCL: the `nvidia-nccl-cu13`
//! wheel's `nvidia/nccl/lib` on LD_LIBRARY_PATH, or NCCL_LIBRARY naming its `libnccl.so.2`): two-rank
//! logits against one-GPU logits of the same weights (tiny, 1B and 8B shapes; prefill, plain decode
//! steps and replayed decode graphs), the collectives alone, and a failing or silent rank ending the
//! call with an error instead of a hang, communicators with CTA limits summing as the default ones,
//! long passes' sums gathered by the copy engines as all-reduced; two rank processes against two
//! rank threads (bit for bit, and a dying rank named); `speedup-report --tp 2` (per-rank rows with the all-reduce
//! ranges, kernel totals against CUDA-event times, the scaling against one GPU). GPU tests are ignored by default; run them with
//! `--include-ignored` on a machine with two GPUs. A test that needs more GPUs than the machine has
//! (`four_ranks_...` needs four) says so (`SKIPPED ...: needs 4 CUDA GPUs, this machine has 2`) and
//! passes without running.

use cudnn_llm::cudnn_ops::reference::{compare, Tolerance};
use cudnn_llm::cudnn_ops::Backend;
use cudnn_llm::llama::nccl::NcclConfig;
use cudnn_llm::llama::sampling::argmax;
use cudnn_llm::llama::tp::{Rank, TpLlama, TpOptions, WeightSource};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{reference, Backends, Error, LlamaConfig, ModuleKind, NoObserver};
use half::bf16;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Logits of the same bf16 weights on two ranks against one GPU: the ranks round their partial sums
/// to bf16 before the all-reduce adds them, so the two differ by bf16 roundings per layer.
const TP_TOL: Tolerance = Tolerance::rel_l2(2e-2);
/// Logits of a bf16 model against the f64 reference (as tests/llama.rs).
const MODEL_TOL: Tolerance = Tolerance::rel_l2(3e-2);

/// `ranks` ranks on GPUs `0..ranks`, or a failure saying what the test needs.
fn team(cfg: &LlamaConfig, ranks: usize, seed: u64, max_seq: usize, options: TpOptions) -> TpLlama<bf16> {
    TpLlama::new(cfg, ranks, &WeightSource::Random { seed }, max_seq, options).unwrap_or_else(|e| {
        panic!(
            "this test needs {ranks} CUDA GPUs with cuDNN and, for 2, NCCL (the nvidia-h200-x2 kind; NCCL from \
             the nvidia-nccl-cu13 wheel's nvidia/nccl/lib on LD_LIBRARY_PATH, or NCCL_LIBRARY): {e}"
        )
    })
}

fn tokens(batch: usize, seq: usize, vocab: usize, seed: u32) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| (0..seq).map(|s| (seed + 7919 * b as u32 + 104729 * s as u32) % vocab as u32).collect())
        .collect()
}

/// Logits of one run: the prompt's last row per sequence, then each decode step's rows.
struct Run {
    /// `[calls][batch · vocab]`: the prefill's last rows, then one entry per step.
    logits: Vec<Vec<f32>>,
}

/// Whether decode steps on `backends` can be captured: RoPE and attention fused in every layer.
fn graphable(backends: &Backends, layers: usize) -> bool {
    (0..layers).all(|l| {
        [ModuleKind::Rope, ModuleKind::Gqa].iter().all(|&k| backends.get(Some(l), k) == Backend::Fused)
    })
}

/// Prefills `prompt` (batch × len), then runs `steps` decode steps feeding `feed[step]` (one id per
/// sequence): the first `plain` steps as plain forwards, the rest replaying a captured graph (all of
/// them plain when the backends cannot be captured).
fn run(
    tp: &mut TpLlama<bf16>,
    prompt: &[Vec<u32>],
    feed: &[Vec<u32>],
    plain: usize,
    backends: &Backends,
) -> Run {
    let (batch, len) = (prompt.len(), prompt[0].len());
    tp.reset_cache(batch, len + feed.len() + 1).unwrap();
    tp.forward(prompt, backends).unwrap();
    // Each sequence's last row: rows len-1, 2·len-1, ...
    let all = tp.logits(0..batch * len, backends).unwrap();
    let vocab = tp.config().vocab;
    let last: Vec<f32> =
        (0..batch).flat_map(|b| all[((b + 1) * len - 1) * vocab..][..vocab].iter().copied()).collect();
    let mut logits = vec![last];
    let plain = if graphable(backends, tp.config().layers) { plain } else { feed.len() };
    for (s, ids) in feed.iter().enumerate() {
        if s < plain {
            let step: Vec<Vec<u32>> = ids.iter().map(|&t| vec![t]).collect();
            tp.forward(&step, backends).unwrap();
            logits.push(tp.logits(0..batch, backends).unwrap());
            if s + 1 == plain && plain < feed.len() {
                tp.capture_decode(backends).unwrap();
            }
        } else {
            logits.push(tp.decode(ids).unwrap());
        }
    }
    assert_eq!(tp.cache_len().unwrap(), len + feed.len());
    Run { logits }
}

/// Ids a one-GPU greedy decode would feed: the argmax of each sequence's logits, step after step
/// (from a one-rank run, so both runs see the same ids).
fn greedy_feed(
    tp: &mut TpLlama<bf16>,
    prompt: &[Vec<u32>],
    steps: usize,
    backends: &Backends,
) -> Vec<Vec<u32>> {
    let (batch, len) = (prompt.len(), prompt[0].len());
    let vocab = tp.config().vocab;
    tp.reset_cache(batch, len + steps + 1).unwrap();
    tp.forward(prompt, backends).unwrap();
    let all = tp.logits(0..batch * len, backends).unwrap();
    let mut ids: Vec<u32> =
        (0..batch).map(|b| argmax(&all[((b + 1) * len - 1) * vocab..][..vocab]).unwrap()).collect();
    let mut feed = Vec::new();
    for _ in 0..steps {
        feed.push(ids.clone());
        let step: Vec<Vec<u32>> = ids.iter().map(|&t| vec![t]).collect();
        tp.forward(&step, backends).unwrap();
        let l = tp.logits(0..batch, backends).unwrap();
        ids = (0..batch).map(|b| argmax(&l[b * vocab..][..vocab]).unwrap()).collect();
    }
    feed
}

/// Compares two runs call by call (logits within [`TP_TOL`]) and their greedy choices: the same id
/// wherever the one-GPU logits' top two are further apart than the two runs differ there.
fn assert_runs_agree(what: &str, ranks: usize, one: &Run, two: &Run, vocab: usize) {
    let mut failures = Vec::new();
    for (call, (a, b)) in one.logits.iter().zip(&two.logits).enumerate() {
        let reference: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let c = compare(b, &reference);
        println!("{what}: call {call} (0 = prefill), {ranks} ranks vs 1 GPU: {c}");
        if !c.passes(TP_TOL) {
            failures.push(format!("call {call}: {c}"));
        }
        for (seq, (ra, rb)) in a.chunks(vocab).zip(b.chunks(vocab)).enumerate() {
            let (ia, ib) = (argmax(ra).unwrap() as usize, argmax(rb).unwrap() as usize);
            let mut sorted = ra.to_vec();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let margin = (sorted[0] - sorted[1]) as f64;
            let diff = ra.iter().zip(rb).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
            if ia != ib && margin > 2.0 * diff {
                failures.push(format!(
                    "call {call} sequence {seq}: greedy id {ib} on {ranks} ranks, {ia} on 1 GPU (margin {margin:.4}, max |diff| {diff:.4})"
                ));
            } else if ia != ib {
                println!("{what}: call {call} sequence {seq}: near tie ({ia} vs {ib}, margin {margin:.4} within {diff:.4})");
            }
        }
    }
    assert_eq!(one.logits.len(), two.logits.len());
    assert!(failures.is_empty(), "{what}: {failures:#?}");
}

/// One rank and `ranks` ranks of `cfg` on the same random weights: prefill, `plain` plain decode
/// steps, then replayed graphs, on each backend selection.
fn one_vs_split(
    cfg: &LlamaConfig,
    ranks: usize,
    (batch, len): (usize, usize),
    steps: usize,
    plain: usize,
    selections: &[&str],
) {
    let prompt = tokens(batch, len, cfg.vocab, 5);
    let max_seq = len + steps + 1;
    let mut runs = Vec::new();
    let mut one = team(cfg, 1, 7, max_seq, TpOptions::default());
    let feed = greedy_feed(&mut one, &prompt, steps, &Backends::all(Backend::Fused));
    for sel in selections {
        runs.push(run(&mut one, &prompt, &feed, plain, &Backends::parse(sel).unwrap()));
    }
    drop(one);
    let mut split = team(cfg, ranks, 7, max_seq, TpOptions::default());
    for (sel, single) in selections.iter().zip(&runs) {
        let parts = run(&mut split, &prompt, &feed, plain, &Backends::parse(sel).unwrap());
        assert_runs_agree(&format!("{} `{sel}`", cfg.name), ranks, single, &parts, cfg.vocab);
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_ranks_match_one_gpu_on_the_tiny_config() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(2, "two_ranks_match_one_gpu_on_the_tiny_config") {
        return;
    }
    let cfg = LlamaConfig::tiny();
    // One GPU against the f64 reference first, so that agreement below means both are right.
    let (batch, len) = (2, 9);
    let prompt = tokens(batch, len, cfg.vocab, 5);
    let w = Weights::<bf16>::random(&cfg, 7);
    let hidden = reference::forward(&cfg, &w, &prompt, 0);
    let expected = reference::logits(&cfg, &w, &hidden);
    for ranks in [1, 2] {
        let mut tp = team(&cfg, ranks, 7, 32, TpOptions::default());
        for sel in ["", "fused=all"] {
            let b = Backends::parse(sel).unwrap();
            tp.reset_cache(batch, 32).unwrap();
            tp.forward(&prompt, &b).unwrap();
            let c = compare(&tp.logits(0..batch * len, &b).unwrap(), &expected);
            println!("tiny, {ranks} rank(s), `{sel}`: prefill logits vs f64 reference: {c}");
            assert!(c.passes(MODEL_TOL), "{ranks} rank(s) `{sel}`: {c}");
        }
    }
    // Naive, fused and a mix; 3 plain decode steps, then 5 replayed graphs (fused RoPE and attention,
    // which captured steps need).
    one_vs_split(
        &cfg,
        2,
        (batch, len),
        8,
        3,
        &["fused=all", "fused=all;naive=mlp@1,o_proj", "fused=rope,gqa"],
    );
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_ranks_match_one_gpu_on_the_1b_config_with_tied_embeddings() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "two_ranks_match_one_gpu_on_the_1b_config_with_tied_embeddings",
    ) {
        return;
    }
    // Tied: each rank's lm_head is its rows of the embedding.
    let cfg = LlamaConfig::llama_3_2_1b().with_layers(2);
    one_vs_split(&cfg, 2, (1, 40), 6, 2, &["fused=all"]);
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_ranks_match_one_gpu_on_8b_shapes_with_2_layers() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(2, "two_ranks_match_one_gpu_on_8b_shapes_with_2_layers") {
        return;
    }
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
    one_vs_split(&cfg, 2, (1, 64), 6, 2, &["fused=all", ""]);
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn symmetric_windows_give_the_logits_of_plain_buffers_bit_for_bit() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "symmetric_windows_give_the_logits_of_plain_buffers_bit_for_bit",
    ) {
        return;
    }
    // Two ranks with the decode residual in NCCL symmetric windows against the same ranks on plain
    // buffers: NCCL sums two ranks' rows alike either way, so every call must agree exactly. The
    // plain steps came out wrong (rel. L2 2e-2) while the GEMV before each all-reduce let NCCL's
    // symmetric kernel, which does not wait for it, start early.
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
    let prompt = tokens(1, 64, cfg.vocab, 5);
    let mut runs = Vec::new();
    for windows in [true, false] {
        let mut tp = team(&cfg, 2, 7, 72, TpOptions::default().with_windows(windows));
        let has = tp.each("window", |r| Ok(r.model.comm().is_some_and(|c| c.has_window()))).unwrap();
        println!("windows asked {windows}: ranks with a window {has:?}");
        if windows && !has.iter().all(|&h| h) {
            eprintln!("SKIPPED symmetric windows: this NCCL makes none (2.28.9 or later needed)");
            return;
        }
        assert!(windows || has.iter().all(|&h| !h));
        let fused = Backends::all(Backend::Fused);
        let feed = greedy_feed(&mut tp, &prompt, 6, &fused);
        runs.push((feed.clone(), run(&mut tp, &prompt, &feed, 3, &fused)));
    }
    let ((feed_on, on), (feed_off, off)) = (&runs[0], &runs[1]);
    assert_eq!(feed_on, feed_off, "greedy ids differ with windows");
    for (call, (a, b)) in on.logits.iter().zip(&off.logits).enumerate() {
        let differ = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        println!("call {call} (0 = prefill; 1-3 plain steps, then replays): {differ} logits differ");
        assert_eq!(differ, 0, "call {call}: {differ} of {} logits differ with windows", a.len());
    }
}

/// Every row of `got` (`[rows, vocab]` logits) within [`TP_TOL`] of the same row of `want`; prints
/// how many rows are bit-identical and the worst row.
fn assert_rows_agree(what: &str, got: &[f32], want: &[f32], vocab: usize) {
    let (mut same, mut worst, mut failures) = (0, 0.0f64, Vec::new());
    for (row, (a, b)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        same += usize::from(a == b);
        let c = compare(a, &b.iter().map(|&v| v as f64).collect::<Vec<_>>());
        worst = worst.max(c.rel_l2);
        if !c.passes(TP_TOL) {
            failures.push(format!("row {row}: {c}"));
        }
    }
    assert_eq!(got.len(), want.len(), "{what}");
    println!("{what}: {same} of {} rows bit-identical, worst row rel. L2 {worst:.3e}", want.len() / vocab);
    assert!(failures.is_empty(), "{what}: {failures:#?}");
}

/// Long passes' sums of `cfg` on two ranks gathered by the copy engines (`gather_rows` 1024 and
/// `small`) against the same weights all-reducing them: every prefill row's logits of `prompt`
/// within the two-rank tolerance, row by row (the gathered sum adds the residual and both parts in
/// one rounding where the all-reduced one rounds the first rank's `x + part` first, so bits may
/// differ; a chunk summed before its gather landed, a slot written again before its sum read it, or
/// rows attending to the wrong K/V rows give rows far off). Also with o_proj naive (cuBLAS writing
/// the slots). Then the decode steps after such a prefill (all-reduced) against the all-reduced
/// team's. `chunks` and `halved` give the chunks each rank gathers and the passes it runs halved
/// over the two prefills of each gathering team.
fn gathered_vs_all_reduced(
    cfg: &LlamaConfig,
    prompt: &[Vec<u32>],
    small: usize,
    chunks: [u64; 2],
    halved: [u64; 2],
) {
    let (batch, len) = (prompt.len(), prompt[0].len());
    let selections = ["fused=all", "fused=all;naive=o_proj"];
    let fused = Backends::all(Backend::Fused);
    let mut reduced: Vec<Vec<f32>> = Vec::new();
    let mut reduced_run = None;
    for (i, rows) in [0, 1024, small].into_iter().enumerate() {
        let mut tp = team(cfg, 2, 7, len + 10, TpOptions::default().with_gather_rows(rows));
        let bytes = tp.each("gather", |r| Ok(r.model.comm().map_or(0, |c| c.gather_bytes()))).unwrap();
        println!("gather rows {rows}: window bytes per rank {bytes:?}");
        if rows > 0 && bytes.contains(&0) {
            eprintln!("SKIPPED copy-engine gathers: this NCCL makes no window (2.28.9 or later needed)");
            return;
        }
        assert!(rows > 0 || bytes.iter().all(|&b| b == 0));
        for (s, sel) in selections.iter().enumerate() {
            let backends = Backends::parse(sel).unwrap();
            tp.reset_cache(batch, len + 10).unwrap();
            tp.forward(prompt, &backends).unwrap();
            let all = tp.logits(0..batch * len, &backends).unwrap();
            if rows == 0 {
                reduced.push(all);
                continue;
            }
            assert_rows_agree(
                &format!("{batch} x {len}, gather rows {rows} `{sel}`"),
                &all,
                &reduced[s],
                cfg.vocab,
            );
        }
        let counts =
            tp.each("gathered", |r| Ok([r.model.chunks_gathered(), r.model.passes_halved()])).unwrap();
        println!("gather rows {rows}: chunks gathered and passes halved per rank {counts:?}");
        let want = if i == 0 { [0, 0] } else { [chunks[i - 1], halved[i - 1]] };
        assert_eq!(counts, vec![want; 2], "gather rows {rows}: [chunks, halved passes]");
        // Decode steps after a gathered prefill (plain, then replayed).
        let feed: Vec<Vec<u32>> = (0..4).map(|s| vec![(100 + 31 * s) as u32; batch]).collect();
        let decoded = run(&mut tp, prompt, &feed, 2, &fused);
        match &reduced_run {
            None => reduced_run = Some(decoded),
            Some(want) => assert_runs_agree(&format!("gather rows {rows}"), 2, want, &decoded, cfg.vocab),
        }
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn copy_engine_gathered_sums_give_every_prefill_row_of_all_reduces() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "copy_engine_gathered_sums_give_every_prefill_row_of_all_reduces",
    ) {
        return;
    }
    // Two sequences of 520 rows: a batch does not run halved, so each projection's sums go in
    // chunks of 520 rows (two a projection) or of 208 (five, so the two window slots are reused).
    // Two layers, two projections, two prefills: 16 and 40 chunks.
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
    gathered_vs_all_reduced(&cfg, &tokens(2, 520, cfg.vocab, 5), 208, [16, 40], [0, 0]);
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn halved_prefill_gives_every_row_of_the_all_reduced_prefill() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "halved_prefill_gives_every_row_of_the_all_reduced_prefill",
    ) {
        return;
    }
    // One sequence of 1041 tokens with 1024-row slots runs halved (rows 0..521 and 521..1041
    // interleaved module by module, each half's sums gathered whole while the other computes, the
    // second half a chunked prefill over the first's K/V rows): one chunk per half and projection,
    // 16 over two prefills. With 512-row slots the halves do not fit, and the pass gathers in
    // chunks (three of at most 512 rows a projection: 24).
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
    gathered_vs_all_reduced(&cfg, &tokens(1, 1041, cfg.vocab, 11), 512, [16, 24], [2, 0]);
}

#[test]
#[ignore = "needs 4 CUDA GPUs and NCCL"]
fn four_ranks_match_one_gpu_with_kv_heads_replicated_and_split() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        4,
        "four_ranks_match_one_gpu_with_kv_heads_replicated_and_split",
    ) {
        return;
    }
    // tiny (4 query heads, 2 K/V heads): a query head per rank, each K/V head held by two ranks.
    let tiny = LlamaConfig::tiny();
    assert!(tiny.kv_heads < 4);
    one_vs_split(&tiny, 4, (2, 9), 8, 3, &["fused=all", "", "fused=all;naive=mlp@1,o_proj"]);
    // 1B shapes, tied (32 query heads, 8 K/V heads): 8 query and 2 K/V heads per rank, a quarter of
    // the vocabulary each.
    one_vs_split(&LlamaConfig::llama_3_2_1b().with_layers(2), 4, (1, 40), 6, 2, &["fused=all"]);
    // 8B shapes: a quarter of the MLP rows (3584) per rank.
    one_vs_split(&LlamaConfig::llama_3_1_8b().with_layers(2), 4, (1, 64), 6, 2, &["fused=all", ""]);
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn all_reduce_and_all_gather_across_two_gpus() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(2, "all_reduce_and_all_gather_across_two_gpus") {
        return;
    }
    let mut tp = team(&LlamaConfig::tiny(), 2, 1, 16, TpOptions::default());
    let out = tp
        .each("collectives", |r| {
            let comm = r.model.comm().ok_or_else(|| Error::Tp("no communicator".into()))?;
            let stream = r.ctx.stream();
            // Rank r holds r + 1 + i: the sum over two ranks is 2i + 3.
            let values: Vec<bf16> =
                (0..1000).map(|i| bf16::from_f32((r.index + 1 + i % 50) as f32)).collect();
            let mut buf = stream.clone_htod(&values).map_err(cudnn_llm::Error::from)?;
            comm.all_reduce_sum(stream, &mut buf)?;
            let summed = stream.clone_dtoh(&buf).map_err(cudnn_llm::Error::from)?;
            // All-gather: rank r writes 10·(r+1) in its half.
            let mut g = stream.clone_htod(&vec![bf16::ZERO; 8]).map_err(cudnn_llm::Error::from)?;
            let own = vec![bf16::from_f32(10.0 * (r.index + 1) as f32); 4];
            stream
                .memcpy_htod(&own, &mut g.slice_mut(r.index * 4..r.index * 4 + 4))
                .map_err(cudnn_llm::Error::from)?;
            comm.all_gather_in_place(stream, &mut g)?;
            let gathered = stream.clone_dtoh(&g).map_err(cudnn_llm::Error::from)?;
            Ok((summed, gathered))
        })
        .unwrap();
    for (rank, (summed, gathered)) in out.iter().enumerate() {
        let want: Vec<f32> = (0..1000).map(|i| (2 * (i % 50) + 3) as f32).collect();
        assert_eq!(summed.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), want, "rank {rank} all-reduce");
        assert_eq!(
            gathered.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            [10.0, 10.0, 10.0, 10.0, 20.0, 20.0, 20.0, 20.0]
        );
        println!("rank {rank}: all-reduce and all-gather exact");
    }
}

/// Replayed decode graphs followed at once by a plain step, all enqueued by one job per rank without
/// a host wait: the plain step's collectives must wait for the replays (NCCL's condition with graph
/// mixing support off, `Comm::graph_launched`), and its logits equal those of the same calls with the
/// host waiting for each replay's logits. Also: a rank refuses a paged cache (paged steps do not sum
/// over the ranks).
#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn plain_collectives_right_after_graph_replays_wait_for_them() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "plain_collectives_right_after_graph_replays_wait_for_them",
    ) {
        return;
    }
    let cfg = LlamaConfig::tiny();
    // Enough replays that the host reaches the plain step's first collective long before they end.
    let (batch, len, replays) = (2, 9, 24);
    let prompt = tokens(batch, len, cfg.vocab, 5);
    let step =
        |s: usize| -> Vec<u32> { (0..batch).map(|b| ((31 * s + 7 * b + 1) % cfg.vocab) as u32).collect() };
    let fused = Backends::all(Backend::Fused);
    let mut tp = team(&cfg, 2, 7, len + replays + 4, TpOptions::default());
    // Prefill, one plain step (plans), the capture: the same start for both orders.
    let start = |tp: &mut TpLlama<bf16>| {
        tp.reset_cache(batch, len + replays + 4).unwrap();
        tp.forward(&prompt, &fused).unwrap();
        tp.forward(&step(0).iter().map(|&t| vec![t]).collect::<Vec<_>>(), &fused).unwrap();
        tp.logits(0..batch, &fused).unwrap();
        tp.capture_decode(&fused).unwrap();
    };
    // Each rank's gathered logits of the plain step after the replays, as laid out on the rank, and
    // whether the replays had run when the plain step's enqueue returned to the host.
    let after = |tp: &mut TpLlama<bf16>, wait: bool| -> Vec<(Vec<f32>, bool)> {
        if wait {
            for s in 1..=replays {
                tp.decode(&step(s)).unwrap(); // host logits: the host waits for each replay
            }
        }
        let (steps, last) = (Arc::new((1..=replays).map(step).collect::<Vec<_>>()), step(replays + 1));
        let fused = fused.clone();
        tp.each("replays, then a plain step", move |r| {
            let Rank { graph, cache, model, ctx, .. } = r;
            let (graph, cache) =
                graph.as_mut().zip(cache.as_mut()).ok_or_else(|| Error::Tp("no graph".into()))?;
            if !wait {
                for ids in steps.iter() {
                    model.decode(ctx, graph, ids, cache)?; // device logits: nothing waits
                }
            }
            let replayed = ctx.stream().record_event(None).map_err(cudnn_llm::Error::from)?;
            let one: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
            model.forward(ctx, &one, cache, &fused, &mut NoObserver)?;
            let ran = replayed.is_complete();
            let logits = model.logits_rows(ctx, 0..one.len(), &fused, &mut NoObserver)?;
            let host = ctx.stream().clone_dtoh(&logits).map_err(cudnn_llm::Error::from)?;
            Ok((host.iter().map(|v| v.to_f32()).collect(), ran))
        })
        .unwrap()
    };
    // The library turns NCCL's graph mixing support off unless the environment says otherwise.
    let mixing = std::env::var("NCCL_GRAPH_MIXING_SUPPORT");
    assert_eq!(mixing.as_deref(), Ok("0"), "this test needs NCCL_GRAPH_MIXING_SUPPORT unset or 0");
    start(&mut tp);
    let waited = after(&mut tp, true);
    start(&mut tp);
    let queued = after(&mut tp, false);
    for (rank, ((w, _), (q, ran))) in waited.iter().zip(&queued).enumerate() {
        assert!(
            ran,
            "rank {rank}: the plain step's collectives were enqueued before the queued replays had run"
        );
        assert!(w.iter().all(|v| v.is_finite()), "rank {rank}: non-finite logits");
        assert_eq!(
            w, q,
            "rank {rank}: the plain step after queued replays differs from the one after waited replays"
        );
        println!(
            "rank {rank}: the plain step after {replays} queued replays equals the one after waited replays"
        );
    }
    let refused = tp
        .each("paged cache", |r| {
            let order = cudnn_llm::cudnn_ops::PageOrder::TokenMajor;
            Ok(r.model.paged_cache(&r.ctx, 1, 16, 16, 4, order).err().map(|e| e.to_string()))
        })
        .unwrap();
    for (rank, e) in refused.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {rank} made a paged cache"));
        assert!(e.contains("paged caches run on one GPU"), "rank {rank}: {e}");
    }
}

/// Communicators made through `ncclCommInitRankConfig` with CTA limits (and a cluster size) sum
/// exactly as `ncclCommInitAll`'s: integers in -100..=100 on each rank, whose sums bf16 holds
/// exactly, at 1000 elements, a decode step's 4096 and a prefill's 2048 × 4096 (many channels).
#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn communicators_with_cta_limits_all_reduce_exactly_as_the_default_ones() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "communicators_with_cta_limits_all_reduce_exactly_as_the_default_ones",
    ) {
        return;
    }
    const SIZES: [usize; 3] = [1000, 4096, 2048 * 4096];
    let value = |rank: usize, i: usize| ((i * 37 + rank * 11) % 201) as f32 - 100.0;
    let reduce = |nccl: NcclConfig| -> Vec<Vec<Vec<f32>>> {
        let mut tp = team(&LlamaConfig::tiny(), 2, 1, 16, TpOptions::default().with_nccl(nccl));
        tp.each("all-reduces", move |r| {
            let comm = r.model.comm().ok_or_else(|| Error::Tp("no communicator".into()))?;
            let stream = r.ctx.stream();
            let mut out = Vec::new();
            for n in SIZES {
                let values: Vec<bf16> = (0..n).map(|i| bf16::from_f32(value(r.index, i))).collect();
                let mut buf = stream.clone_htod(&values).map_err(cudnn_llm::Error::from)?;
                comm.all_reduce_sum(stream, &mut buf)?;
                let summed = stream.clone_dtoh(&buf).map_err(cudnn_llm::Error::from)?;
                out.push(summed.iter().map(|v| v.to_f32()).collect());
            }
            Ok(out)
        })
        .unwrap_or_else(|e| panic!("all-reduces with {nccl}: {e}"))
    };
    let want: Vec<Vec<f32>> =
        SIZES.iter().map(|&n| (0..n).map(|i| value(0, i) + value(1, i)).collect()).collect();
    let default = reduce(NcclConfig::default());
    for (rank, got) in default.iter().enumerate() {
        assert!(got == &want, "rank {rank}: the default communicators' sums are not exact");
    }
    let d = NcclConfig::default();
    for nccl in [
        d.with_min_ctas(1).with_max_ctas(1),
        d.with_min_ctas(2).with_max_ctas(2),
        d.with_min_ctas(16).with_max_ctas(32),
        d.with_max_ctas(4).with_cga_cluster_size(0),
    ] {
        let got = reduce(nccl);
        for rank in 0..2 {
            for (k, n) in SIZES.iter().enumerate() {
                let diff = got[rank][k]
                    .iter()
                    .zip(&default[rank][k])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    diff, 0,
                    "{nccl}: rank {rank}, {n} elements: {diff} sums differ from the default communicators'"
                );
            }
        }
        println!("{nccl}: both ranks' sums of {SIZES:?} elements equal the default communicators' bit for bit (and exact)");
    }
}

/// One all-reduce of 1 Mi bf16 zeros on a rank's stream, waited for.
fn all_reduce_once(r: &mut Rank<bf16>) -> cudnn_llm::llama::Result<()> {
    let comm = r.model.comm().ok_or_else(|| Error::Tp("no communicator".into()))?;
    let mut buf = r.ctx.stream().alloc_zeros::<bf16>(1 << 20).map_err(cudnn_llm::Error::from)?;
    comm.all_reduce_sum(r.ctx.stream(), &mut buf)?;
    Ok(r.ctx.synchronize()?)
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn a_failing_or_silent_rank_ends_the_call_with_an_error_not_a_hang() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "a_failing_or_silent_rank_ends_the_call_with_an_error_not_a_hang",
    ) {
        return;
    }
    let cfg = LlamaConfig::tiny();
    // Rank 1 fails before its all-reduce, at once (the abort may come before rank 0 enqueues) and
    // after a second (rank 0 is then in its all-reduce; with NCCL's runtime connection it would
    // be blocked on the host there, which is what connecting at init prevents).
    for delay in [Duration::ZERO, Duration::from_secs(1)] {
        let mut tp = team(&cfg, 2, 1, 16, TpOptions::default().with_timeout(Duration::from_secs(120)));
        let t = Instant::now();
        let e = tp
            .each("injected failure", move |r| {
                if r.index == 1 {
                    std::thread::sleep(delay);
                    return Err(Error::Tp("injected failure".into()));
                }
                all_reduce_once(r)
            })
            .unwrap_err();
        println!("failure after {delay:?}: {e} after {:?}", t.elapsed());
        assert!(matches!(&e, Error::Rank { rank: 1, .. }), "{e:?}");
        assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
        let later = tp.forward(&tokens(1, 4, cfg.vocab, 1), &Backends::all(Backend::Fused)).unwrap_err();
        assert!(
            later.to_string().contains("torn down") && later.to_string().contains("injected failure"),
            "{later}"
        );
        let t = Instant::now();
        drop(tp);
        println!("teardown after a failure: {:?}", t.elapsed());
    }

    // Rank 1 stays silent past the timeout while rank 0 waits in an all-reduce.
    let mut tp = team(&cfg, 2, 1, 16, TpOptions::default().with_timeout(Duration::from_secs(5)));
    let t = Instant::now();
    let e = tp
        .each("silent rank", |r| {
            if r.index == 1 {
                std::thread::sleep(Duration::from_secs(8));
            }
            all_reduce_once(r)
        })
        .unwrap_err();
    println!("timeout: {e} after {:?}", t.elapsed());
    assert!(matches!(&e, Error::Tp(m) if m.contains("did not finish silent rank")), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(45), "took {:?}", t.elapsed());
}

/// A rank's kernels run on its one stream, so together they can run no longer than the events
/// around its forward; 10% over allows for clock reads and rounding (as the training report's test).
/// The all-reduce kernels are left out of that sum: under CUPTI each one also waits for the other
/// rank, whose profiled launches run late, so their times include skew the events' run does not have
/// (seen on two H200s at the tiny config: 0.87 ms of kernels with them against 0.70 ms of events).
const KERNELS_WITHIN_EVENTS: f64 = 1.1;

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn the_report_tp2_mode_writes_rows_per_rank_with_the_all_reduces_and_the_scaling() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "the_report_tp2_mode_writes_rows_per_rank_with_the_all_reduces_and_the_scaling",
    ) {
        return;
    }
    let bin =
        cudnn_llm_app::bench_util::package_binary(env!("CARGO_BIN_EXE_speedup-report"), "speedup-report")
            .expect("the speedup-report binary was not built");
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--tp",
        "2",
        "--config",
        "tiny",
        "--seq",
        "64",
        "--decode-steps",
        "4",
        "--warmup",
        "1",
        "--repeat",
        "3",
    ];
    let out = std::process::Command::new(&bin)
        .args(args)
        .args(["--out", &dir.path().to_string_lossy()])
        .output()
        .unwrap();
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}\n{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
    for ext in ["md", "csv", "svg"] {
        assert!(dir.path().join(format!("report-tp2.{ext}")).exists(), "report-tp2.{ext}");
    }
    let json = std::fs::read_to_string(dir.path().join("report-tp2.json")).unwrap();
    let report = cudnn_llm_app::report::Report::from_json(&json).unwrap();
    let names: Vec<&str> = report.scenarios.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "prefill 1x64, TP2 rank 0 (GPU 0)",
            "prefill 1x64, TP2 rank 1 (GPU 1)",
            "decode 4 steps after 64, TP2 rank 0 (GPU 0)",
            "decode 4 steps after 64, TP2 rank 1 (GPU 1)"
        ]
    );
    let layers = LlamaConfig::tiny().layers;
    for pair in report.scenarios.chunks(2) {
        let mut reduce_kernels = Vec::new();
        for s in pair {
            let ranges: Vec<&str> = s.rows.iter().map(|r| r.range.as_str()).collect();
            for want in
                ["fwd.embed", "fwd.layer.attn.o_proj", "fwd.layer.attn.allreduce", "fwd.layer.mlp.allreduce"]
            {
                assert!(ranges.contains(&want), "{}: no {want} row: {ranges:?}", s.name);
            }
            let forward = |what: &str| {
                s.forward_ms
                    .iter()
                    .find(|(w, _)| w == what)
                    .map(|(_, ms)| *ms)
                    .unwrap_or_else(|| panic!("{}: no `{what}` forward time: {:?}", s.name, s.forward_ms))
            };
            for (label, pick) in [
                (
                    "naive",
                    (|r: &cudnn_llm_app::report::ModuleRow| {
                        (r.naive_kernels, r.naive_kernel_ms, r.naive_event_ms)
                    }) as fn(&_) -> _,
                ),
                ("fused", |r| (r.fused_kernels, r.fused_kernel_ms, r.fused_event_ms)),
            ] {
                let mut total = 0.0;
                for r in &s.rows {
                    let (kernels, kernel_ms, _) = pick(r);
                    if r.range.ends_with(".allreduce") {
                        // One NCCL kernel per all-reduce, on each rank's own GPU.
                        assert!(r.calls == layers && kernels >= r.calls, "{} {label}: {r:?}", s.name);
                        assert!(kernel_ms > 0.0, "{} {label}: {r:?}", s.name);
                        reduce_kernels.push(kernels);
                    } else {
                        total += kernel_ms;
                    }
                }
                let gpu = forward(&format!("{label}, GPU (this rank)"));
                println!(
                    "{} {label}: kernels but all-reduces {total:.4} ms, forward events {gpu:.4} ms",
                    s.name
                );
                assert!(
                    total > 0.0 && total <= KERNELS_WITHIN_EVENTS * gpu,
                    "{} {label}: {total} vs {gpu}",
                    s.name
                );
                assert!(forward(&format!("{label}, GPU (slowest rank)")) >= gpu);
                assert!(forward(&format!("{label}, GPU (one GPU)")) > 0.0);
            }
        }
        // Both ranks launch the same collectives: the same NCCL kernel counts, each on its own GPU.
        let (r0, r1) = reduce_kernels.split_at(reduce_kernels.len() / 2);
        assert_eq!(r0, r1, "{}: all-reduce kernels per rank", pair[0].name);
    }
    let extra = |key: &str| {
        report
            .meta
            .extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no `{key}` line: {:?}", report.meta.extra))
    };
    for key in ["scaling, prefill 1x64, fused", "scaling, decode 4 steps after 64, naive"] {
        assert!(extra(key).contains("× ("), "{key}: {}", extra(key));
    }
    let agreement = extra("TP2 vs one GPU hidden states (prefill, fused)");
    assert!(agreement.contains("(within"), "{agreement}");
    assert!(
        extra("fused vs naive hidden states (prefill), TP2 rank 0").contains("rel_l2"),
        "{:?}",
        report.meta.extra
    );
    assert!(
        extra("kernel attribution").starts_with("CUPTI activity records, per rank by device id (0 kernels")
    );
    assert!(extra("tensor parallelism").starts_with("2 ranks on GPU 0 "));

    // The same report with the ranks as processes: rank 0 writes it with every rank's rows.
    let processes = tempfile::tempdir().unwrap();
    let codes = as_ranks(2, &format!("report-test-{}", std::process::id()), |_| {
        let mut c = std::process::Command::new(&bin);
        c.args(args).args(["--no-baseline", "--out", &processes.path().to_string_lossy()]);
        c
    });
    assert_eq!(codes, [Some(0), Some(0)]);
    let json = std::fs::read_to_string(processes.path().join("report-tp2.json")).unwrap();
    let report = cudnn_llm_app::report::Report::from_json(&json).unwrap();
    let got: Vec<&str> = report.scenarios.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(got, names);
    for s in &report.scenarios {
        let ranges: Vec<&str> = s.rows.iter().map(|r| r.range.as_str()).collect();
        for want in ["fwd.embed", "fwd.layer.attn.allreduce", "fwd.layer.mlp.allreduce"] {
            assert!(ranges.contains(&want), "{}: no {want} row: {ranges:?}", s.name);
        }
    }
    let how = report.meta.extra.iter().find(|(k, _)| k == "tensor parallelism").map(|(_, v)| v.as_str());
    assert!(
        how.is_some_and(|v| v.starts_with("2 ranks on GPU 0 ")
            && v.contains("GPU 1")
            && v.contains("(one process,")),
        "{how:?}"
    );
}

/// Where the rank processes of [`two_processes_give_the_logits_of_two_threads_on_8b_shapes`] find the
/// ids to feed and rank 0 writes its logits (set by that test only).
const RANK_FILES_ENV: &str = "CUDNN_LLM_TP_TEST_FILES";

/// Set by the processes test for its second job, in which rank 1 dies.
const DIE_ENV: &str = "CUDNN_LLM_TP_TEST_DIE";

/// 8B shapes, 2 layers: the model of the processes test.
fn processes_case() -> (LlamaConfig, Vec<Vec<u32>>, usize) {
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
    let prompt = tokens(1, 64, cfg.vocab, 5);
    (cfg, prompt, 3)
}

/// A rank of the job of processes [`two_processes_give_the_logits_of_two_threads_on_8b_shapes`]
/// starts (this test binary again, with `WORLD_SIZE` and the rest set); started any other way it has
/// nothing to do.
#[test]
#[ignore = "a rank process of two_processes_give_the_logits_of_two_threads_on_8b_shapes"]
fn rank_process_of_the_processes_test() {
    let Some(files) = std::env::var_os(RANK_FILES_ENV) else { return };
    let files = std::path::PathBuf::from(files);
    let env = cudnn_llm::llama::tp::RankEnv::from_env().unwrap().expect("WORLD_SIZE set by the test");
    let (cfg, prompt, plain) = processes_case();
    let feed: Vec<Vec<u32>> = std::fs::read_to_string(files.join("feed"))
        .unwrap()
        .lines()
        .map(|l| l.split(' ').map(|t| t.parse().unwrap()).collect())
        .collect();
    let max_seq = prompt[0].len() + feed.len() + 1;
    let options = TpOptions::default().with_timeout(Duration::from_secs(120));
    let mut tp =
        TpLlama::<bf16>::join(&cfg, &env, &WeightSource::Random { seed: 7 }, max_seq, options).unwrap();
    assert_eq!((tp.ranks_here(), tp.leads()), (env.rank..env.rank + 1, env.rank == 0));
    if std::env::var_os(DIE_ENV).is_some() {
        // Rank 1 dies after loading; rank 0's next calls must fail naming it, not hang.
        if env.rank == 1 {
            std::process::exit(3);
        }
        let t = Instant::now();
        let fused = Backends::all(Backend::Fused);
        let failed = (|| -> Result<(), Error> {
            tp.reset_cache(1, max_seq)?;
            for _ in 0..20 {
                tp.forward(&prompt, &fused)?;
                tp.truncate(0)?;
            }
            Ok(())
        })();
        let why = failed.expect_err("rank 1 is gone").to_string();
        let line = format!("{why}\nafter {:.2} s", t.elapsed().as_secs_f64());
        std::fs::write(files.join("rank0-error"), line).unwrap();
        return;
    }
    let got = run(&mut tp, &prompt, &feed, plain, &Backends::all(Backend::Fused));
    // Every rank holds the all-gathered logits; each writes its own, and the test compares them.
    let bytes: Vec<u8> = got.logits.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(files.join(format!("rank{}", env.rank)), bytes).unwrap();
    // Then as `generate` runs: rank 0 sends each next id and runs it, rank 1 runs what it receives,
    // until rank 0 ends its team (first, while rank 1 waits for a message).
    let fused = Backends::all(Backend::Fused);
    tp.truncate(prompt[0].len()).unwrap();
    if tp.leads() {
        for id in [11u32, 12, 13] {
            tp.broadcast(&id.to_le_bytes()).unwrap();
            tp.forward(&[vec![id]], &fused).unwrap();
        }
        tp.finish();
    } else {
        let mut followed = 0;
        while let Some(m) = tp.receive().unwrap() {
            let id = u32::from_le_bytes(m[..4].try_into().unwrap());
            tp.forward(&[vec![id]], &fused).unwrap();
            followed += 1;
        }
        assert_eq!((followed, tp.cache_len().unwrap()), (3, prompt[0].len() + 3));
        tp.finish();
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn two_processes_give_the_logits_of_two_threads_on_8b_shapes() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(
        2,
        "two_processes_give_the_logits_of_two_threads_on_8b_shapes",
    ) {
        return;
    }
    let (cfg, prompt, plain) = processes_case();
    let fused = Backends::all(Backend::Fused);
    // Greedy ids of one GPU, the threads' run, then the processes' (one after the other: GPU memory).
    let mut one = team(&cfg, 1, 7, prompt[0].len() + 8, TpOptions::default());
    let feed = greedy_feed(&mut one, &prompt, 6, &fused);
    let single = run(&mut one, &prompt, &feed, plain, &fused);
    drop(one);
    let mut threads = team(&cfg, 2, 7, prompt[0].len() + 8, TpOptions::default());
    let two = run(&mut threads, &prompt, &feed, plain, &fused);
    drop(threads);
    let files = std::env::temp_dir().join(format!("cudnn-llm-tp-processes-{}", std::process::id()));
    std::fs::create_dir_all(&files).unwrap();
    let text: Vec<String> =
        feed.iter().map(|ids| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")).collect();
    std::fs::write(files.join("feed"), text.join("\n")).unwrap();
    let codes = rank_processes(&files, false);
    assert_eq!(codes, [Some(0), Some(0)], "the rank processes' exit codes (None: killed after 300 s)");
    let vocab = cfg.vocab;
    for rank in 0..2 {
        let bytes = std::fs::read(files.join(format!("rank{rank}"))).unwrap();
        let flat: Vec<f32> =
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let processes = Run { logits: flat.chunks(vocab).map(<[f32]>::to_vec).collect() };
        let same = processes
            .logits
            .iter()
            .flatten()
            .zip(two.logits.iter().flatten())
            .filter(|(a, b)| a == b)
            .count();
        println!(
            "rank {rank} of 2 processes: {same} of {} logits bit for bit those of 2 threads",
            two.logits.iter().map(Vec::len).sum::<usize>()
        );
        assert_runs_agree(&format!("{} as processes (rank {rank})", cfg.name), 2, &two, &processes, vocab);
        assert_runs_agree(&format!("{} as processes vs 1 GPU", cfg.name), 2, &single, &processes, vocab);
    }
    // Again, with rank 1 dying once loaded: rank 0's call fails naming it, in bounded time.
    let codes = rank_processes(&files, true);
    assert_eq!(codes, [Some(0), Some(3)], "rank 0 reports (exit 0), rank 1 died (exit 3)");
    let why = std::fs::read_to_string(files.join("rank0-error")).unwrap();
    println!("rank 0, once rank 1 died: {why}");
    assert!(why.contains("rank 1"), "{why}");
    let _ = std::fs::remove_dir_all(&files);
}

/// Runs the two rank processes of the processes test (rank 1 dying with `die`) and returns their exit
/// codes, `None` for one killed after 300 s.
fn rank_processes(files: &std::path::Path, die: bool) -> Vec<Option<i32>> {
    as_ranks(2, &format!("tp-test-{}-{die}", std::process::id()), |_| {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(["--exact", "rank_process_of_the_processes_test", "--include-ignored", "--nocapture"])
            .env(RANK_FILES_ENV, files);
        if die {
            c.env(DIE_ENV, "1");
        }
        c
    })
}

/// Runs `world` processes, `command(rank)` each, as the ranks of job `job` on this host (the
/// environment torchrun sets, rank 0 listening on a free loopback port), and returns their exit codes,
/// `None` for one killed after 300 s.
fn as_ranks(world: usize, job: &str, command: impl Fn(usize) -> std::process::Command) -> Vec<Option<i32>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let started = Instant::now();
    let mut ranks: Vec<std::process::Child> = (0..world)
        .map(|rank| {
            command(rank)
                .envs([
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.to_string()),
                    ("CUDNN_LLM_JOB", job.to_string()),
                ])
                .spawn()
                .unwrap()
        })
        .collect();
    // Every rank ends on its own (a failing one ends the others through the rendezvous link).
    let mut codes = vec![None; world];
    while codes.iter().any(Option::is_none) && started.elapsed() < Duration::from_secs(300) {
        for (c, r) in codes.iter_mut().zip(&mut ranks) {
            if c.is_none() {
                *c = r.try_wait().unwrap().map(|s| s.code().unwrap_or(-1));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for r in &mut ranks {
        let _ = r.kill();
    }
    println!("{job}: exit codes {codes:?} after {:.1} s", started.elapsed().as_secs_f64());
    codes
}
