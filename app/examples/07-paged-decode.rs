//! Paged against contiguous decode attention at Llama-3.1-8B heads (32 query heads over 8 K/V heads of
//! 128, bf16): a batch of 64 sequences of seeded lengths from 128 to 4096 (mixed), one query each, the
//! lengths on the device. The contiguous cache is `[64, 4096, 8 · 128]` (what `KvCache` keeps); the paged
//! one a pool of just the pages the lengths need, in a seeded shuffle, read through a page table, for
//! page sizes 16 to 512 and both page orders. The contiguous keys are gathered out of the pages,
//! so both read the same values: outputs (cuDNN's plans and the split-KV kernel, contiguous and paged)
//! are compared with cuDNN's contiguous ones before anything is timed. Each form is timed
//! replaying a CUDA graph of 32 calls (as a captured decode step runs them), CUDA-event medians after
//! warm-up, with the ratio contiguous / paged (the target: the paged form at 95% of the
//! contiguous one or better, a ratio >= 0.95):
//! `cargo run --release --example 07-paged-decode [batch] [min_len] [max_len]`.
//! With `CUDNN_LLM_KNOB_SEARCH` above 0 it also times every engine configuration cuDNN offers for the
//! contiguous and the paged plan and prints them (to see whether the heuristics' choice is the fastest).
use cudnn_llm::cudarc::driver::CudaSlice;
use cudnn_llm::half::bf16;
use cudnn_llm::{
    gather_pages, reference, sdpa, Backend, Cudnn, DataType, Error, Layout, PageGather, PageGatherOperands,
    PageOrder, PageShape, PageTable, SdpaArgs, SdpaKernel, SdpaOperands, SeqLens, TableShape,
};
use cudnn_llm_app::bench_util::{environment, median_call_ms};

/// Calls per captured graph.
const CALLS: usize = 32;
/// Llama-3.1-8B's attention heads.
const HEADS: (usize, usize, usize) = (32, 8, 128);
/// Page sizes swept (the contiguous capacity is a multiple of the largest).
const PAGE_SIZES: [usize; 6] = [16, 32, 64, 128, 256, 512];

fn arg(i: usize, default: usize) -> Result<usize, Box<dyn std::error::Error>> {
    match std::env::args().nth(i) {
        Some(a) => Ok(a.parse().map_err(|e| format!("argument {i} ({a}): {e}"))?),
        None => Ok(default),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (batch, min, max) = (arg(1, 64)?, arg(2, 128)?, arg(3, 4096)?);
    if batch == 0 || min == 0 || max < min {
        return Err("give batch >= 1 and 1 <= min_len <= max_len".into());
    }
    let ctx = Cudnn::new(0)?;
    let (hq, hkv, d) = HEADS;
    let w = (hq + 2 * hkv) * d;
    let cap = max.next_multiple_of(*PAGE_SIZES.iter().max().unwrap_or(&1));
    let mut r = reference::random_iter(7);
    let lens: Vec<usize> = (0..batch)
        .map(|_| min + ((r.next().unwrap() * 0.5 + 0.5) * (max - min + 1) as f64) as usize)
        .collect();
    let lens: Vec<usize> = lens.into_iter().map(|l| l.min(max)).collect();
    println!("{}", environment(ctx.info()));
    println!(
        "decode attention b{batch} h{hq}/{hkv} d{d} bf16, lengths {min}..={max} (mean {:.0}), contiguous capacity {cap}",
        lens.iter().sum::<usize>() as f64 / batch as f64
    );
    let s = ctx.stream();
    let qkv = s.clone_htod(&reference::to_elements::<bf16>(&reference::random_values(1, batch * w)))?;
    let mut o_c = s.alloc_zeros::<bf16>(batch * hq * d)?;
    let mut o_p = s.alloc_zeros::<bf16>(batch * hq * d)?;
    let lq = s.clone_htod(&vec![1i32; batch])?;
    let lkv = s.clone_htod(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
    let mut clamped = SeqLens::new(&ctx, batch, 1, cap)?;
    clamped.clamp(&ctx, &lq, &lkv)?;
    let mut kc = s.alloc_zeros::<bf16>(batch * cap * hkv * d)?;
    let mut vc = s.alloc_zeros::<bf16>(batch * cap * hkv * d)?;
    let mut contiguous = SdpaArgs::new(batch, hq, hkv, 1, cap, d, Layout::Bshd).with_seq_lens();
    contiguous.q_strides = [w, d, w, 1];
    let kv = [cap * hkv * d, d, hkv * d, 1];
    (contiguous.k_strides, contiguous.v_strides) = (kv, kv);
    // One random pool's worth of values, reused by every configuration.
    let rows = |ps: usize| (lens.iter().map(|l| l.div_ceil(ps)).sum::<usize>() + 8) * ps;
    let most_rows = PAGE_SIZES.into_iter().map(rows).max().unwrap_or(0);
    let values: Vec<bf16> = reference::random_iter(2).take(most_rows * hkv * d).map(bf16::from_f64).collect();
    println!(
        "{:>5} {:>11} {:>9} {:>14} {:>18} {:>8} {:>14} {:>14} {:>8} {:>8}",
        "page",
        "order",
        "pages",
        "contiguous us",
        "paged us (form)",
        "ratio",
        "split-kv c us",
        "split-kv p us",
        "ratio",
        "best"
    );
    for page_size in PAGE_SIZES {
        for order in [PageOrder::HeadMajor, PageOrder::TokenMajor] {
            let need: usize = lens.iter().map(|l| l.div_ceil(page_size)).sum();
            let pages = PageShape::new(need + 8, page_size, hkv, d, order)?;
            let max_pages = cap / page_size;
            let mut table = PageTable::new(&ctx, TableShape::new(batch, max_pages, pages)?)?;
            // Pages handed out in a seeded shuffle, as a pool looks after sequences came and went.
            let mut free: Vec<u32> = (0..pages.num_pages as u32).collect();
            reference::shuffle(&mut free, page_size as u64);
            let mut entries = vec![0u32; batch * max_pages];
            let mut next = free.into_iter();
            for (b, &len) in lens.iter().enumerate() {
                for slot in &mut entries[b * max_pages..][..len.div_ceil(page_size)] {
                    *slot = next.next().expect("the pool holds every sequence's pages");
                }
            }
            table.upload(&ctx, &entries)?;
            let kp = s.clone_htod(&values[..pages.pool_len()])?;
            let vp = s.clone_htod(&values[values.len() - pages.pool_len()..])?;
            // The contiguous cache holds the same keys: gathered out of the pages.
            gather_pages(
                &ctx,
                PageGather::new(batch, cap, cap),
                PageGatherOperands::new(&kp, &table, &mut kc),
            )?;
            gather_pages(
                &ctx,
                PageGather::new(batch, cap, cap),
                PageGatherOperands::new(&vp, &table, &mut vc),
            )?;
            let mut paged = SdpaArgs::new(batch, hq, hkv, 1, 1, d, Layout::Bshd).with_pages(table.shape());
            paged.q_strides = [w, d, w, 1];
            // Both kernels read the clamped lengths (the split-KV kernel also takes raw ones).
            let run_c = |a: SdpaArgs, o: &mut CudaSlice<bf16>| {
                let x = SdpaOperands::new(&qkv, &kc, &vc, o).clamped_seq_lens(&clamped);
                sdpa(&ctx, a, x, Backend::Fused)
            };
            let run_p = |a: SdpaArgs, o: &mut CudaSlice<bf16>| {
                let x = SdpaOperands::new(&qkv, &kp, &vp, o).pages(&table).clamped_seq_lens(&clamped);
                sdpa(&ctx, a, x, Backend::Fused)
            };
            let form = paged.fused_kernel(ctx.features(), false).name();
            // The SDPA op builds its plans on the heuristics' first engine. With a knob-search budget
            // (CUDNN_LLM_KNOB_SEARCH) this example puts tuned ones in the plan cache first, where the op
            // finds them: their first run times the heuristics' candidates and the knobs around the
            // fastest (printed after the validating runs).
            let tuning = ctx.tuning();
            let mut tuned = Vec::new();
            if tuning.knob_search > 0 {
                for (what, a) in [("contiguous", contiguous), ("paged", paged)] {
                    let a = a.normalized();
                    let Some(form) = a.fused_kernel(ctx.features(), false).graph_form() else { continue };
                    let plan = ctx.cache().get_or_build(&a.key(DataType::BF16, false), || {
                        a.graph(DataType::BF16, false, form, ctx.features()).build_tuned(&ctx, tuning)
                    })?;
                    println!("{what} page {page_size}: cuDNN candidates {:?}", plan.candidates());
                    tuned.push((what, plan));
                }
            }
            let tag = format!("{page_size:>5} {:>11} {:>9}", order.name(), pages.num_pages);
            // Validate before timing: the same keys give the same outputs, on cuDNN's plans and on
            // the split-KV kernel, each against cuDNN's contiguous plan.
            let split_c = contiguous.with_form(SdpaKernel::SplitKv);
            let split_p = paged.with_form(SdpaKernel::SplitKv);
            if let Err(e) = run_c(contiguous, &mut o_c) {
                println!("{tag}: contiguous: {e}");
                continue;
            }
            let c = s.clone_dtoh(&o_c)?.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
            let mut bad = Vec::new();
            type Run<'r> = &'r dyn Fn(SdpaArgs, &mut CudaSlice<bf16>) -> cudnn_llm::Result<()>;
            let runs: [(&str, Run, SdpaArgs); 3] = [
                ("paged", &run_p, paged),
                ("contiguous split-kv", &run_c, split_c),
                ("paged split-kv", &run_p, split_p),
            ];
            for (what, run, a) in runs {
                if let Err(e) = run(a, &mut o_p) {
                    bad.push(format!("{what}: {e}"));
                    continue;
                }
                let cmp = reference::compare(&s.clone_dtoh(&o_p)?, &c);
                if !cmp.passes(reference::Tolerance::rel_l2(2e-2)) {
                    bad.push(format!("{what} differs from contiguous ({cmp})"));
                }
            }
            if !bad.is_empty() {
                println!("{tag}: {}; not timed", bad.join("; "));
                continue;
            }
            let time = |f: &mut dyn FnMut() -> cudnn_llm::Result<()>| -> Result<f64, Error> {
                // SAFETY: one thread, no other stream of this context.
                let ((), graph) = unsafe {
                    ctx.capture(|| {
                        for _ in 0..CALLS {
                            f()?;
                        }
                        Ok::<_, Error>(())
                    })
                }?;
                Ok(median_call_ms(&ctx, 3, 21, 1, || Ok(graph.launch()?))? / CALLS as f64 * 1e3)
            };
            for (what, plan) in &tuned {
                println!("{what} page {page_size}: tuned {} ({:?})", plan.engine(), plan.timings());
            }
            let contiguous_us = time(&mut || run_c(contiguous, &mut o_c))?;
            let paged_us = time(&mut || run_p(paged, &mut o_p))?;
            let split_c_us = time(&mut || run_c(split_c, &mut o_c))?;
            let split_p_us = time(&mut || run_p(split_p, &mut o_p))?;
            println!(
                "{tag} {contiguous_us:>14.2} {:>18} {:>8.3} {split_c_us:>14.2} {split_p_us:>14.2} {:>8.3} {:>8.3}",
                format!("{paged_us:.2} ({form})"),
                contiguous_us / paged_us,
                split_c_us / split_p_us,
                contiguous_us.min(split_c_us) / paged_us.min(split_p_us)
            );
        }
    }
    println!(
        "ratio = contiguous us / paged us, for cuDNN's plans (paged on 9.15+) and for the split-KV kernel (c: \
         contiguous, p: paged); best = the faster contiguous / the faster paged; the target is >= 0.95"
    );
    Ok(())
}
