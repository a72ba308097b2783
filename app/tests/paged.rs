//! Paged KV caches end to end: paged decode attention (cuDNN's page-table attributes, and the split-KV
//! kernel reading through the table) against the contiguous padded attention over the same keys and
//! the f64 reference, for page sizes 16 to 128, both page orders and shuffled pages; refusals that touch
//! nothing; the paged cache (`PagedKvCache`: RoPE append through the table, prefill, decode steps of
//! sequences at different lengths in a larger launch) against the contiguous cache (`KvCache`) step by
//! step, the naive backend's contiguous fallback included; and continuous batching (`BatchEngine`)
//! against each request run alone (`Generator`) on the tiny model, in launch and graph mode, with
//! add/remove cycles that leak no page and a typed out-of-pages error.
//!
//! GPU tests are ignored by default; run them with `--include-ignored` on a GPU machine. Each prints
//! what it compares; failures are collected and reported together.

use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::reference::{self, AttentionShape, Tolerance};
use cudnn_llm::cudnn_ops::{
    gather_pages, sdpa, Backend, Cudnn, Error, KvCache, KvCacheShape, Layout, Mask, PageGather,
    PageGatherOperands, PageOrder, PageShape, PageTable, PagedForm, PagedKvCache, PagedKvShape, QkvRows,
    RopeFrequencies, RopeTables, SdpaArgs, SdpaForm, SdpaKernel, SdpaOperands, TableShape,
};
use cudnn_llm::llama::generate::{DecodeMode, Generator};
use cudnn_llm::llama::sampling::{argmax, SamplingParams};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, BatchConfig, BatchEngine, Llama, LlamaConfig, NoObserver};
use cudnn_llm_app::bench_util::{
    download, end_finished, expect_untouched, gpu, greedy_alone, rms, same_greedy_ids, upload, NEAR_TIE,
};
use half::bf16;

/// Attention outputs against the f64 reference and against each other, as `cudnn-ops/tests/sdpa_decode.rs`.
const ATTN: Tolerance = Tolerance::rel_l2(2e-2);
/// Eager RoPE (bf16 after every elementary op) against the fused rotation (one rounding).
const ROPE_NAIVE: Tolerance = Tolerance::rel_l2(1e-2);

/// A decode over keys held twice: in a contiguous cache `[b, cap, h_kv · d]` and in a pool of
/// shuffled pages read through a table.
struct Twin {
    heads: (usize, usize, usize),
    lens: Vec<usize>,
    cap: usize,
    table: PageTable,
    qkv: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    kp: CudaSlice<bf16>,
    vp: CudaSlice<bf16>,
    /// Host copies of `qkv`, `k`, `v` (contiguous), rounded to bf16.
    host: [Vec<f64>; 3],
}

/// Sequences of `lens` keys (Q scaled by 3 so the softmax is not flat), a table of `lens.len() + 2`
/// rows (the call uses the first ones), pages of `page_size` in `order`, assigned in a seeded shuffle
/// with spare pages; positions past a length are `pad` in both caches.
fn twin(
    ctx: &Cudnn,
    (hq, hkv, d): (usize, usize, usize),
    lens: &[usize],
    page_size: usize,
    order: PageOrder,
    pad: f64,
    seed: u64,
) -> Twin {
    let b = lens.len();
    let max_pages = lens.iter().max().unwrap().div_ceil(page_size) + 1;
    let cap = max_pages * page_size;
    let rows = b + 2;
    let num_pages = rows * max_pages + 5;
    let pages = PageShape::new(num_pages, page_size, hkv, d, order).unwrap();
    let mut table = PageTable::new(ctx, TableShape::new(rows, max_pages, pages).unwrap()).unwrap();
    // A seeded shuffle of every page: row i's page j is perm[i · max_pages + j].
    let mut perm: Vec<u32> = (0..num_pages as u32).collect();
    reference::shuffle(&mut perm, seed + 100);
    let entries: Vec<u32> = perm[..rows * max_pages].to_vec();
    table.upload(ctx, &entries).unwrap();
    let w = (hq + 2 * hkv) * d;
    let qkv: Vec<f64> = reference::random_values(seed, b * w).iter().map(|v| 3.0 * v).collect();
    let row = hkv * d;
    let contiguous = |seed: u64| -> Vec<f64> {
        let mut values = reference::random_iter(seed);
        let mut out = vec![pad; b * cap * row];
        for (s, &n) in lens.iter().enumerate() {
            for x in &mut out[s * cap * row..][..n * row] {
                *x = values.next().unwrap();
            }
        }
        out
    };
    let (kc, vc) = (contiguous(seed + 1), contiguous(seed + 2));
    let [s0, s1, s2, _] = pages.strides();
    let scatter = |c: &[f64]| -> Vec<f64> {
        let mut pool = vec![pad; pages.pool_len()];
        for s in 0..b {
            for p in 0..cap {
                let page = entries[s * max_pages + p / page_size] as usize;
                for h in 0..hkv {
                    for e in 0..d {
                        pool[page * s0 + h * s1 + (p % page_size) * s2 + e] =
                            c[(s * cap + p) * row + h * d + e];
                    }
                }
            }
        }
        pool
    };
    let (kp, vp) = (scatter(&kc), scatter(&vc));
    let (qkv, qkv_h) = upload::<bf16>(ctx, &qkv).unwrap();
    let (k, k_h) = upload::<bf16>(ctx, &kc).unwrap();
    let (v, v_h) = upload::<bf16>(ctx, &vc).unwrap();
    let (kp, _) = upload::<bf16>(ctx, &kp).unwrap();
    let (vp, _) = upload::<bf16>(ctx, &vp).unwrap();
    Twin { heads: (hq, hkv, d), lens: lens.to_vec(), cap, table, qkv, k, v, kp, vp, host: [qkv_h, k_h, v_h] }
}

impl Twin {
    fn q_strides(&self) -> [usize; 4] {
        let (hq, hkv, d) = self.heads;
        let w = (hq + 2 * hkv) * d;
        [w, d, w, 1]
    }

    /// The contiguous padded decode (device lengths).
    fn contiguous(&self) -> SdpaArgs {
        let (hq, hkv, d) = self.heads;
        let mut a = SdpaArgs::new(self.lens.len(), hq, hkv, 1, self.cap, d, Layout::Bshd).with_seq_lens();
        a.q_strides = self.q_strides();
        let kv = [self.cap * hkv * d, d, hkv * d, 1];
        (a.k_strides, a.v_strides) = (kv, kv);
        a
    }

    /// The paged decode through the table.
    fn paged(&self) -> SdpaArgs {
        let (hq, hkv, d) = self.heads;
        let mut a =
            SdpaArgs::new(self.lens.len(), hq, hkv, 1, 1, d, Layout::Bshd).with_pages(self.table.shape());
        a.q_strides = self.q_strides();
        a
    }

    /// Runs `args` (contiguous or paged), O poisoned first; `[b, h_q, d]`.
    fn run(&self, ctx: &Cudnn, args: SdpaArgs) -> Result<Vec<bf16>, Error> {
        let (hq, _, d) = self.heads;
        let b = self.lens.len();
        let mut o = cudnn_llm_app::bench_util::poisoned::<bf16>(ctx, b * hq * d)?;
        let lq = ctx.stream().clone_htod(&vec![1i32; b])?;
        let lkv = ctx.stream().clone_htod(&self.lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
        let x = if args.pages.is_some() {
            SdpaOperands::new(&self.qkv, &self.kp, &self.vp, &mut o).pages(&self.table)
        } else {
            SdpaOperands::new(&self.qkv, &self.k, &self.v, &mut o)
        };
        sdpa(ctx, args, x.seq_lens(&lq, &lkv), Backend::Fused)?;
        download(ctx, &o)
    }

    /// The reference output `[h_q, d]` of sequence `s`.
    fn expected(&self, s: usize) -> Vec<f64> {
        let (hq, hkv, d) = self.heads;
        let (len, w, cap) = (self.lens[s], (hq + 2 * hkv) * d, self.cap);
        let q = self.host[0][s * w..][..hq * d].to_vec();
        let heads_major = |c: &[f64]| -> Vec<f64> {
            let mut out = Vec::with_capacity(hkv * len * d);
            for h in 0..hkv {
                for p in 0..len {
                    out.extend_from_slice(&c[((s * cap + p) * hkv + h) * d..][..d]);
                }
            }
            out
        };
        let shape = AttentionShape { batch: 1, heads_q: hq, heads_kv: hkv, seq_q: 1, seq_kv: len, dim: d };
        let scale = 1.0 / (d as f64).sqrt();
        reference::attention(
            &q,
            &heads_major(&self.host[1]),
            &heads_major(&self.host[2]),
            shape,
            scale,
            Mask::None,
        )
        .0
    }
}

/// Per sequence: `out` against the reference, and against `other` where given.
fn check_rows(tag: &str, t: &Twin, out: &[bf16], other: Option<(&str, &[bf16])>, failures: &mut Vec<String>) {
    let (hq, _, d) = t.heads;
    for s in 0..t.lens.len() {
        let rows = &out[s * hq * d..][..hq * d];
        let c = reference::compare(rows, &t.expected(s));
        let mut line = format!("{tag} sequence {s} ({} keys): vs reference {c}", t.lens[s]);
        if !c.passes(ATTN) {
            failures.push(line.clone());
        }
        if let Some((name, o)) = other {
            let theirs: Vec<f64> = o[s * hq * d..][..hq * d].iter().map(|v| v.to_f64()).collect();
            let c = reference::compare(rows, &theirs);
            line += &format!("; vs {name} {c}");
            if !c.passes(ATTN) {
                failures.push(format!("{tag} sequence {s}: vs {name} {c}"));
            }
        }
        println!("{line}");
    }
}

/// Paged decode attention equals the contiguous padded attention over the same keys, per sequence, and
/// the f64 reference: page sizes 16, 32, 64, 128, both page orders, Llama-3.1-8B's heads (32/8/128)
/// and a small GQA shape (8/2/64), lengths 1 to 700 across page boundaries; the fused choice (cuDNN's
/// paged plan on 9.15+), cuDNN's paged plan forced, and the split-KV kernel reading through the table.
#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_decode_attention_equals_the_contiguous_one_and_the_reference() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let lens = [1, 15, 16, 17, 200, 700];
    for (i, heads) in [(32, 8, 128), (8, 2, 64)].into_iter().enumerate() {
        for (j, page_size) in [16, 32, 64, 128].into_iter().enumerate() {
            for order in [PageOrder::HeadMajor, PageOrder::TokenMajor] {
                let t = twin(&ctx, heads, &lens, page_size, order, 0.0, (10 * i + j) as u64);
                let tag = format!("h{}/{} d{} page {page_size} {}", heads.0, heads.1, heads.2, order.name());
                let contiguous = match t.run(&ctx, t.contiguous()) {
                    Ok(o) => o,
                    Err(e) => {
                        failures.push(format!("{tag}: contiguous: {e}"));
                        continue;
                    }
                };
                check_rows(&format!("{tag} contiguous"), &t, &contiguous, None, &mut failures);
                let auto = t.paged();
                let name = auto.fused_kernel(ctx.features(), false).name();
                match t.run(&ctx, auto) {
                    Ok(o) => check_rows(
                        &format!("{tag} paged ({name})"),
                        &t,
                        &o,
                        Some(("contiguous", &contiguous)),
                        &mut failures,
                    ),
                    Err(e) => failures.push(format!("{tag}: paged ({name}): {e}")),
                }
                match t.run(&ctx, auto.with_form(SdpaKernel::SplitKv)) {
                    Ok(o) => check_rows(
                        &format!("{tag} paged split-kv"),
                        &t,
                        &o,
                        Some(("contiguous", &contiguous)),
                        &mut failures,
                    ),
                    Err(e) => failures.push(format!("{tag}: paged split-kv: {e}")),
                }
                match t.run(&ctx, auto.with_form(SdpaForm::Unified)) {
                    Ok(o) => check_rows(
                        &format!("{tag} paged cuDNN"),
                        &t,
                        &o,
                        Some(("contiguous", &contiguous)),
                        &mut failures,
                    ),
                    Err(e) if e.is_not_supported() && !ctx.features().sdpa_paged() => {
                        println!("{tag}: cuDNN {} has no paged plan: {e}", ctx.info().cudnn_version_string())
                    }
                    Err(e) => failures.push(format!("{tag}: cuDNN's paged plan: {e}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Positions past each length hold NaN in every page: the split-KV kernel reading through the table
/// reads no key past a length (cuDNN's paged plan is printed against the reference). Pages of 12
/// and 20 positions take the kernel's key-by-key table reads (a tile of 8 keys may span two pages),
/// 16 and 64 its one read per tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_split_kv_reads_no_key_past_the_length() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for page_size in [16, 64, 12, 20] {
        let t = twin(&ctx, (32, 8, 128), &[5, 100, 33], page_size, PageOrder::HeadMajor, f64::NAN, 5);
        let tag = format!("NaN past lengths, page {page_size}");
        match t.run(&ctx, t.paged().with_form(SdpaKernel::SplitKv)) {
            Ok(o) => check_rows(&format!("{tag} split-kv"), &t, &o, None, &mut failures),
            Err(e) => failures.push(format!("{tag}: split-kv: {e}")),
        }
        if ctx.features().sdpa_paged() {
            match t.run(&ctx, t.paged().with_form(SdpaForm::Unified)) {
                Ok(o) => check_rows(&format!("{tag} cuDNN (printed only)"), &t, &o, None, &mut Vec::new()),
                Err(e) => println!("{tag}: cuDNN's paged plan: {e}"),
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Bad paged calls are typed errors that write nothing: a table of another page shape, a table of
/// fewer rows than the batch, a pool shorter than its shape, paged arguments without a table and a
/// table without paged arguments.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_paged_calls_touch_nothing() {
    let ctx = gpu();
    let t = twin(&ctx, (8, 2, 64), &[3, 40], 16, PageOrder::HeadMajor, 0.0, 9);
    let b = t.lens.len();
    let lq = ctx.stream().clone_htod(&vec![1i32; b]).unwrap();
    let lkv = ctx.stream().clone_htod(&[3i32, 40]).unwrap();
    let mut o = ctx.stream().alloc_zeros::<bf16>(b * 8 * 64).unwrap();
    let other_pages =
        PageShape::new(t.table.shape().pages.num_pages, 32, 2, 64, PageOrder::HeadMajor).unwrap();
    let other = PageTable::new(&ctx, TableShape::new(4, 4, other_pages).unwrap()).unwrap();
    let few =
        PageTable::new(&ctx, TableShape::new(1, t.table.shape().max_pages, t.table.shape().pages).unwrap())
            .unwrap();
    let short = ctx.stream().alloc_zeros::<bf16>(t.table.shape().pages.pool_len() - 1).unwrap();
    let a = t.paged();
    let run = |args: SdpaArgs, table: Option<&PageTable>, k: &CudaSlice<bf16>, o: &mut CudaSlice<bf16>| {
        let mut x = SdpaOperands::new(&t.qkv, k, &t.vp, o).seq_lens(&lq, &lkv);
        if let Some(table) = table {
            x = x.pages(table);
        }
        sdpa(&ctx, args, x, Backend::Fused)
    };
    expect_untouched(&ctx, &mut o, "the arguments were made for", |o| run(a, Some(&other), &t.kp, o));
    expect_untouched(&ctx, &mut o, "a page table of 1 sequences, batch is 2", |o| {
        run(a, Some(&few), &t.kp, o)
    });
    expect_untouched(&ctx, &mut o, "K has", |o| run(a, Some(&t.table), &short, o));
    expect_untouched(&ctx, &mut o, "need the page table", |o| run(a, None, &t.kp, o));
    expect_untouched(&ctx, &mut o, "needs arguments made with SdpaArgs::with_pages", |o| {
        run(t.contiguous(), Some(&t.table), &t.k, o)
    });
    // A table entry outside the pool never reaches the device.
    let mut table = PageTable::new(&ctx, TableShape::new(1, 2, t.table.shape().pages).unwrap()).unwrap();
    let n = t.table.shape().pages.num_pages as u32;
    let e = table.upload(&ctx, &[0, n]).unwrap_err();
    assert!(e.to_string().contains("outside the pool"), "{e}");
}

/// The paged cache against the contiguous cache, step by step: 3 sequences prefilled one at a time
/// (the paged cache) or together (the contiguous one), then 20 decode steps together in a launch of 4
/// rows (the paged cache: the fourth row is no sequence and writes nothing); RoPE'd Q and K bitwise
/// equal, each sequence's cached K and V rows (gathered out of the pages) bitwise equal to the
/// contiguous cache's, attention outputs within the attention tolerance; pages of no sequence
/// untouched; on the fused backend (paged forms) and the naive one (the contiguous fallback).
#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_cache_steps_match_the_contiguous_cache() {
    let ctx = gpu();
    let (hq, hkv, d, b, prompt, steps, page_size) = (8, 2, 64, 3, 20, 20, 16);
    let cap = 48;
    let w = (hq + 2 * hkv) * d;
    let rope = RopeTables::<bf16>::from_frequencies(&ctx, &RopeFrequencies::new(d, 500_000.0).unwrap(), cap)
        .unwrap();
    let rows = QkvRows::new(hq, w);
    let mut failures = Vec::new();
    for backend in [Backend::Fused, Backend::Naive] {
        let mut contiguous =
            KvCache::<bf16>::new(&ctx, KvCacheShape::new(1, b, cap, hkv, d).unwrap()).unwrap();
        let pages = PageShape::new(12, page_size, hkv, d, PageOrder::HeadMajor).unwrap();
        let mut paged =
            PagedKvCache::<bf16>::new(&ctx, PagedKvShape::new(1, 4, cap, pages).unwrap()).unwrap();
        // A spare sequence first, removed: its freed pages are reused.
        let spare = paged.add();
        paged.begin(&ctx, &[spare], 17, 1).unwrap();
        paged.finish().unwrap();
        let ids: Vec<_> = (0..b).map(|_| paged.add()).collect();
        paged.remove(spare).unwrap();
        for step in 0..=steps {
            let seq = if step == 0 { prompt } else { 1 };
            let values = reference::random_values(1000 + step as u64, (b + 1) * seq * w);
            let (mut qc, _) = upload::<bf16>(&ctx, &values[..b * seq * w]).unwrap();
            let (mut qp, _) = upload::<bf16>(&ctx, &values).unwrap();
            let mut oc = ctx.stream().alloc_zeros::<bf16>(b * seq * hq * d).unwrap();
            let mut op = ctx.stream().alloc_zeros::<bf16>((b + 1) * seq * hq * d).unwrap();
            contiguous.begin(&ctx, seq).unwrap();
            contiguous.append_rotated(&ctx, 0, &rope, rows, qc.as_view_mut(), Backend::Fused).unwrap();
            contiguous.attend(&ctx, 0, rows, qc.as_view(), oc.as_view_mut(), Backend::Fused).unwrap();
            contiguous.finish().unwrap();
            let mut forms = Vec::new();
            if step == 0 {
                for (i, &id) in ids.iter().enumerate() {
                    let (q, o) = (i * seq * w..(i + 1) * seq * w, i * seq * hq * d..(i + 1) * seq * hq * d);
                    paged.begin(&ctx, &[id], seq, 1).unwrap();
                    paged.append_rotated(&ctx, 0, &rope, rows, qp.slice_mut(q.clone()), backend).unwrap();
                    forms.push(paged.attend(&ctx, 0, rows, qp.slice(q), op.slice_mut(o), backend).unwrap());
                    paged.finish().unwrap();
                }
            } else {
                let before = download(&ctx, paged.layer(0).unwrap().0).unwrap();
                paged.begin(&ctx, &ids, 1, b + 1).unwrap();
                paged.append_rotated(&ctx, 0, &rope, rows, qp.as_view_mut(), backend).unwrap();
                forms.push(paged.attend(&ctx, 0, rows, qp.as_view(), op.as_view_mut(), backend).unwrap());
                paged.finish().unwrap();
                // Pages of no sequence are as they were.
                let after = download(&ctx, paged.layer(0).unwrap().0).unwrap();
                let owned: Vec<u32> = ids.iter().flat_map(|&id| paged.pages(id).unwrap().to_vec()).collect();
                let page_len = pages.page_len();
                for p in (0..pages.num_pages as u32).filter(|p| !owned.contains(p)) {
                    let r = p as usize * page_len..(p as usize + 1) * page_len;
                    if before[r.clone()].iter().zip(&after[r]).any(|(x, y)| x.to_bits() != y.to_bits()) {
                        failures
                            .push(format!("{backend:?} step {step}: page {p} of no sequence was written"));
                    }
                }
            }
            let tag =
                format!("{backend:?} step {step} {:?}", forms.iter().map(|f| f.name()).collect::<Vec<_>>());
            // RoPE'd Q and K: fused, the same f32 math and one rounding; naive, the eager rounding.
            let (hc, hp) = (download(&ctx, &qc).unwrap(), download(&ctx, &qp).unwrap());
            if backend == Backend::Fused {
                if hc.iter().zip(&hp).any(|(x, y)| x.to_bits() != y.to_bits()) {
                    failures.push(format!("{tag}: rotated QKV rows differ"));
                }
            } else {
                let c =
                    reference::compare(&hp[..hc.len()], &hc.iter().map(|v| v.to_f64()).collect::<Vec<_>>());
                if !c.passes(ROPE_NAIVE) {
                    failures.push(format!("{tag}: eager-rotated QKV rows {c}"));
                }
            }
            let (oc, op) = (download(&ctx, &oc).unwrap(), download(&ctx, &op).unwrap());
            let theirs: Vec<f64> = oc.iter().map(|v| v.to_f64()).collect();
            let c = reference::compare(&op[..oc.len()], &theirs);
            println!("{tag}: paged vs contiguous attention {c}");
            if !c.passes(ATTN) {
                failures.push(format!("{tag}: attention {c}"));
            }
            // Prefills over their own rows; fused decode steps through the table (cuDNN's paged plan, or
            // the split-KV kernel); naive ones the contiguous fallback.
            let expected = match (step, backend) {
                (0, _) => forms == vec![PagedForm::Prefill; b],
                (_, Backend::Naive) => forms == vec![PagedForm::Gathered],
                _ => forms.len() == 1 && forms[0].reads_device_lengths(),
            };
            if !expected {
                failures.push(format!("{tag}: forms {forms:?} (refusal {:?})", paged.paged_refusal()));
            }
        }
        // Every sequence's K and V rows, gathered out of the pages, equal the contiguous cache's.
        let len = prompt + steps;
        let table = paged.table();
        for (l, (pool, cache)) in [
            (paged.layer(0).unwrap().0, contiguous.layer(0).unwrap().0),
            (paged.layer(0).unwrap().1, contiguous.layer(0).unwrap().1),
        ]
        .into_iter()
        .enumerate()
        {
            let mut dst = ctx.stream().alloc_zeros::<bf16>(b * cap * hkv * d).unwrap();
            // The table holds the last step's rows: the ids in order.
            gather_pages(&ctx, PageGather::new(b, len, cap), PageGatherOperands::new(pool, table, &mut dst))
                .unwrap();
            let (g, c) = (download(&ctx, &dst).unwrap(), download(&ctx, cache).unwrap());
            for s in 0..b {
                let r = s * cap * hkv * d..(s * cap + len) * hkv * d;
                let what = format!("{backend:?}: sequence {s}'s {} rows", ["K", "V"][l]);
                if backend == Backend::Fused {
                    if g[r.clone()].iter().zip(&c[r]).any(|(x, y)| x.to_bits() != y.to_bits()) {
                        failures.push(format!("{what} differ from the contiguous cache's"));
                    }
                } else {
                    let cmp = reference::compare(
                        &g[r.clone()],
                        &c[r].iter().map(|v| v.to_f64()).collect::<Vec<_>>(),
                    );
                    println!("{what} vs the contiguous cache's {cmp}");
                    if !cmp.passes(ROPE_NAIVE) {
                        failures.push(format!("{what} vs the contiguous cache's {cmp}"));
                    }
                }
            }
        }
        for id in ids {
            paged.remove(id).unwrap();
        }
        assert_eq!(paged.free_pages(), 12, "{backend:?}: every page back");
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Continuous batching on the tiny model gives each request the greedy ids it gets alone: 7 requests
/// of prompts 3 to 40 ids and 6 to 30 new ids, arriving while others decode, at most 4 at once (launch
/// buckets 1, 2, 4), pages of 16 reused as requests finish; in launch mode and in graph mode (a
/// captured step per bucket, replayed at every later length). Afterwards every page is free, and a
/// request the pool cannot hold is a typed error that changes nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn continuous_batching_equals_each_request_alone() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 3);
    let max_seq = 80;
    let prompts: Vec<Vec<u32>> = [5usize, 17, 33, 9, 40, 3, 12]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            reference::random_values(50 + i as u64, n)
                .iter()
                .map(|v| ((v * 0.5 + 0.5) * 511.0) as u32)
                .collect()
        })
        .collect();
    let outputs = [12usize, 20, 7, 25, 15, 30, 6];
    let mut generator = Generator::new(
        &ctx,
        Llama::new(&ctx, &cfg, &w, max_seq).unwrap(),
        Backends::parse("fused=all").unwrap(),
        max_seq,
    )
    .unwrap();
    let want: Vec<(Vec<u32>, Vec<Vec<f32>>)> =
        prompts.iter().zip(outputs).map(|(p, n)| greedy_alone(&ctx, &mut generator, p, n).unwrap()).collect();
    let mut failures = Vec::new();
    for mode in [DecodeMode::Launch, DecodeMode::Graph] {
        let model = Llama::new(&ctx, &cfg, &w, max_seq).unwrap();
        let bc = BatchConfig::new(4, max_seq, 16).with_reserve_rows(64);
        let engine = BatchEngine::new(&ctx, model, Backends::parse("fused=all").unwrap(), bc).unwrap();
        // SAFETY: this test uses one thread and no other stream.
        let mut engine = unsafe { engine.with_mode(mode) };
        let total = engine.free_pages();
        let (mut next, mut got) = (0, vec![Vec::new(); prompts.len()]);
        let mut handles = std::collections::HashMap::new();
        let mut step = 0;
        while next < prompts.len() || engine.live() > 0 {
            // A new request every third step while there is room.
            if next < prompts.len() && engine.live() < 4 && step % 3 == 0 {
                let (id, first) = engine.add(&ctx, &prompts[next], SamplingParams::greedy()).unwrap();
                got[next].push(first);
                handles.insert(id, next);
                next += 1;
            }
            end_finished(&mut engine, &mut handles, (&prompts, &got, &outputs), &format!("{mode:?}"));
            for (id, t) in engine.step(&ctx).unwrap() {
                got[handles[&id]].push(t);
            }
            step += 1;
        }
        for (r, ids) in got.iter().enumerate() {
            if let Some(f) = same_greedy_ids(&format!("{mode:?} request {r}"), ids, &want[r].0, &want[r].1) {
                failures.push(f);
            }
        }
        println!(
            "{mode:?}: {step} steps, last form {:?}, paged refusal {:?}, graph refusal {:?}, fallbacks {:?}",
            engine.last_form(),
            engine.paged_refusal(),
            engine.graph_refusal(),
            engine.model().fallbacks()
        );
        if engine.free_pages() != total {
            failures.push(format!(
                "{mode:?}: {} of {total} pages free after every request ended",
                engine.free_pages()
            ));
        }
        if mode == DecodeMode::Graph && (engine.graph_refusal().is_some() || !engine.replaying(4)) {
            failures.push(format!("graph mode did not replay: {:?}", engine.graph_refusal()));
        }
        // Each bucket that ran twice (of 1, 2, 4; 4 replays, checked above) captured first once; any
        // other capture replaced a stale graph.
        let g = engine.graph_counts();
        println!("{mode:?}: graph counts {g:?}");
        let first_captures = g.captures - g.stale;
        let counted = match mode {
            DecodeMode::Graph => (1..=3).contains(&first_captures) && g.refused == 0,
            _ => g.captures == 0,
        };
        if !counted {
            failures.push(format!(
                "{mode:?}: graph counts {g:?}, want 1 to 3 first captures in graph mode, none in launch mode"
            ));
        }
        if !engine.model().fallbacks().is_empty() {
            failures.push(format!("{mode:?}: fallbacks {:?}", engine.model().fallbacks()));
        }
    }
    // Out of pages: a pool of 3 pages of 16 holds one 40-id prompt; a second request is refused,
    // typed, and nothing changes.
    let model = Llama::new(&ctx, &cfg, &w, max_seq).unwrap();
    let bc = BatchConfig::new(2, max_seq, 16).with_pages(3);
    let mut engine = BatchEngine::new(&ctx, model, Backends::parse("fused=all").unwrap(), bc).unwrap();
    let (id, _) = engine.add(&ctx, &prompts[4], SamplingParams::greedy()).unwrap();
    match engine.add(&ctx, &prompts[1], SamplingParams::greedy()) {
        Err(cudnn_llm::llama::Error::Ops(Error::OutOfPages { needed: 2, free: 0, total: 3, .. })) => {}
        other => failures.push(format!("a request past the pool: {:?}", other.map(|(_, t)| t))),
    }
    assert_eq!((engine.live(), engine.free_pages()), (1, 0));
    engine.remove(id).unwrap();
    assert_eq!(engine.free_pages(), 3);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// The top-`k` cut of `row` with a near-tie margin: `id`'s logit is at least the `k`-th largest less
/// [`NEAR_TIE`] × the row's RMS.
fn in_top_k(row: &[f32], id: u32, k: usize) -> bool {
    let mut sorted = row.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    row[id as usize] >= sorted[k - 1] - NEAR_TIE * rms(row)
}

/// Continuous batching with greedy rows picked on the device and one sampled request in the batch
/// (its rows copied to the host and sampled there): 5 requests, at most 4 at once, in launch and in
/// graph mode. Every greedy request gets the ids it gets alone; the sampled request draws only from
/// the top-k of its own logits (a teacher-forced forward over its own sequence), not always the
/// argmax, and draws the same ids in both modes (the same kernels, the same seed).
#[test]
#[ignore = "needs a CUDA GPU"]
fn continuous_batching_picks_greedy_rows_on_the_device_beside_a_sampled_request() {
    const TOP_K: usize = 20;
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 4);
    let max_seq = 80;
    let prompts: Vec<Vec<u32>> = [7usize, 21, 4, 30, 11]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            reference::random_values(70 + i as u64, n)
                .iter()
                .map(|v| ((v * 0.5 + 0.5) * 511.0) as u32)
                .collect()
        })
        .collect();
    let outputs = [14usize, 9, 24, 18, 10];
    let sampled = 2;
    let params = |r: usize| match r == sampled {
        true => SamplingParams::new(0.8, 7).with_top_k(TOP_K),
        false => SamplingParams::greedy(),
    };
    let fused = Backends::parse("fused=all").unwrap();
    let mut generator =
        Generator::new(&ctx, Llama::new(&ctx, &cfg, &w, max_seq).unwrap(), fused.clone(), max_seq).unwrap();
    let want: Vec<(Vec<u32>, Vec<Vec<f32>>)> =
        prompts.iter().zip(outputs).map(|(p, n)| greedy_alone(&ctx, &mut generator, p, n).unwrap()).collect();
    let mut failures = Vec::new();
    let mut sampled_ids = Vec::new();
    for mode in [DecodeMode::Launch, DecodeMode::Graph] {
        let model = Llama::new(&ctx, &cfg, &w, max_seq).unwrap();
        let bc = BatchConfig::new(4, max_seq, 16).with_reserve_rows(64);
        // SAFETY: this test uses one thread and no other stream.
        let mut engine = unsafe { BatchEngine::new(&ctx, model, fused.clone(), bc).unwrap().with_mode(mode) };
        let (mut next, mut got) = (0, vec![Vec::new(); prompts.len()]);
        let mut handles = std::collections::HashMap::new();
        let mut step = 0;
        while next < prompts.len() || engine.live() > 0 {
            if next < prompts.len() && engine.live() < 4 && step % 2 == 0 {
                let (id, first) = engine.add(&ctx, &prompts[next], params(next)).unwrap();
                got[next].push(first);
                handles.insert(id, next);
                next += 1;
            }
            end_finished(&mut engine, &mut handles, (&prompts, &got, &outputs), &format!("{mode:?}"));
            for (id, t) in engine.step(&ctx).unwrap() {
                got[handles[&id]].push(t);
            }
            step += 1;
        }
        for (r, ids) in got.iter().enumerate().filter(|(r, _)| *r != sampled) {
            if let Some(f) = same_greedy_ids(&format!("{mode:?} request {r}"), ids, &want[r].0, &want[r].1) {
                failures.push(f);
            }
        }
        // The sampled request against the logits of its own sequence.
        let ids = &got[sampled];
        let all = [&prompts[sampled][..], &ids[..ids.len() - 1]].concat();
        let model = generator.model_mut();
        let mut cache = model.cache(&ctx, 1, all.len()).unwrap();
        model.forward(&ctx, std::slice::from_ref(&all), &mut cache, &fused, &mut NoObserver).unwrap();
        let dev = model.logits(&ctx, all.len(), &fused, &mut NoObserver).unwrap();
        let rows: Vec<Vec<f32>> = ctx
            .stream()
            .clone_dtoh(&dev)
            .unwrap()
            .chunks(cfg.vocab)
            .map(|r| r.iter().map(|v| v.to_f32()).collect())
            .collect();
        let start = prompts[sampled].len() - 1;
        let outside: Vec<usize> =
            (0..ids.len()).filter(|&i| !in_top_k(&rows[start + i], ids[i], TOP_K)).collect();
        let not_argmax = (0..ids.len()).filter(|&i| argmax(&rows[start + i]).unwrap() != ids[i]).count();
        println!("{mode:?}: sampled request {ids:?}: {not_argmax} ids not the argmax, outside the top {TOP_K}: {outside:?}");
        if !outside.is_empty() {
            failures.push(format!(
                "{mode:?}: sampled ids {outside:?} are outside the top {TOP_K} of their logits"
            ));
        }
        if not_argmax == 0 {
            failures.push(format!("{mode:?}: the sampled request drew the argmax every time: {ids:?}"));
        }
        if mode == DecodeMode::Graph && (engine.graph_refusal().is_some() || !engine.replaying(4)) {
            failures.push(format!("graph mode did not replay: {:?}", engine.graph_refusal()));
        }
        sampled_ids.push(ids.clone());
    }
    if sampled_ids[0] != sampled_ids[1] {
        failures.push(format!(
            "the sampled request drew other ids in launch and graph mode (same kernels and seed): {:?} vs {:?}",
            sampled_ids[0], sampled_ids[1]
        ));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// The serve-bench binary, where cargo built it or staged beside this test; `None` (said as SKIPPED)
/// when neither.
fn serve_bench() -> Option<std::path::PathBuf> {
    let found = cudnn_llm_app::bench_util::package_binary(env!("CARGO_BIN_EXE_serve-bench"), "serve-bench");
    if found.is_none() {
        eprintln!("SKIPPED: no serve-bench binary where cargo built it or staged beside this test");
    }
    found
}

#[test]
fn serve_bench_bad_options_exit_2_naming_them() {
    let Some(bin) = serve_bench() else { return };
    for (args, expected) in [
        (&["--order", "diagonal"][..], "--order diagonal"),
        (&["--rate=-2"], "--rate -2"),
        (&["--prompt-len", "8:4"], "MIN <= MAX"),
        (&["--pages", "1"], "--pages 1"),
    ] {
        let out = std::process::Command::new(&bin).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expected) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A short serving run on the tiny preset: every request served, the summary's rows (the per-step
/// timings among them) and the four files written, `serve-steps.csv` a GPU-timed row per engine call.
#[test]
#[ignore = "needs a CUDA GPU"]
fn serve_bench_serves_a_tiny_stream_and_writes_its_report() {
    let bin = serve_bench().expect("a GPU run needs the serve-bench binary");
    let dir = std::env::temp_dir().join(format!("serve-bench-{}", std::process::id()));
    let plans = dir.join("plans");
    let args = [
        "--preset",
        "tiny",
        "--requests",
        "24",
        "--rate",
        "200",
        "--prompt-len",
        "16:64",
        "--prompt-step",
        "16",
        "--output-len",
        "4:24",
        "--max-batch",
        "8",
        "--page-size",
        "16",
        "--out",
    ];
    let out = std::process::Command::new(&bin)
        .env(cudnn_llm::cudnn_ops::PLAN_DIR_ENV, &plans)
        .args(args)
        .arg(&dir)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}\n{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    for want in [
        "| requests | 24",
        "throughput (generated tokens/s)",
        "time to first token (ms)",
        "inter-token latency (ms)",
        "| decode step GPU (ms) |",
        "| decode step wall (ms) |",
        "| decode step: launch to ids back (ms) |",
        "| host after decode step (ms) |",
        "| prefill GPU (ms) |",
        "| prefills between decode steps (mean) |",
        "| graph captures during the run |",
    ] {
        assert!(stdout.contains(want), "{want}: {stdout}");
    }
    assert!(!stdout.contains("| decode step GPU (ms) | - |"), "decode steps were timed on the GPU: {stdout}");
    let requests = std::fs::read_to_string(dir.join("serve-requests.csv")).unwrap();
    assert_eq!(requests.lines().count(), 25, "a header and a row per request: {requests}");
    // One row per engine call: as many as prefill forwards and decode steps, each timed.
    let count = |metric: &str| -> usize {
        let line = stdout.lines().find(|l| l.starts_with(&format!("| {metric} |"))).unwrap();
        line.split('|').nth(2).unwrap().trim().parse().unwrap()
    };
    let steps = std::fs::read_to_string(dir.join("serve-steps.csv")).unwrap();
    let mut lines = steps.lines();
    assert_eq!(
        lines.next(),
        Some("kind,rows,bucket,gpu_ms,wall_ms,host_ms,prepare_ms,run_ms,sample_ms,captured"),
        "{steps}"
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), count("prefill forwards") + count("decode steps"), "{steps}");
    for r in &rows {
        let (gpu, wall): (f64, f64) = (r[3].parse().unwrap(), r[4].parse().unwrap());
        // The end event is recorded after the call returns: its GPU span is within the wall time,
        // give or take the event's own latency.
        assert!(gpu > 0.0 && gpu <= wall + 0.5, "gpu {gpu} ms, wall {wall} ms: {r:?}");
        assert!(r[0] == "decode" || r[0] == "prefill", "{r:?}");
        assert_eq!(r[0] == "decode", !r[7].is_empty(), "a decode step's split, none for a prefill: {r:?}");
    }
    assert!(dir.join("serve.md").exists() && dir.join("serve-summary.csv").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
