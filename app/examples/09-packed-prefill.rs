//! Packed prefill through the whole decoder on a paged cache, on Llama-3.1-8B shapes (4 layers by
//! default, random bf16 weights, fused backends): 8 prompts with seeded lengths in 100..2000,
//!
//! - packed: one forward of all their tokens back to back (`begin_packed`: per-token RoPE positions
//!   and page targets, ragged causal attention over the fused QKV rows in place), then the logits of
//!   each prompt's last token (`logits_of`), as `BatchEngine::add_many` runs it;
//! - one by one: 8 forwards, one prompt each, and its last token's logits (`BatchEngine::add`);
//! - padded to the longest: one forward of 8 sequences of the longest length (a uniform step, plain
//!   causal attention), then the 8 last-token logits;
//! - the same total tokens as one prompt (`b = 1`, `s` = the sum): the reference cost.
//!
//! Each prefill writes fresh sequences (added, prefilled, removed per call). CUDA-event medians of 7
//! timed calls after 2 untimed ones (which build the plans); tokens/s count the prompt tokens (the
//! padding not counted). `cargo run --release --example 09-packed-prefill [seed]
//! [layers]` on a GPU machine.
use cudnn_llm::cudarc::driver::sys::CUevent_flags;
use cudnn_llm::half::bf16;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver, PagedCache};
use cudnn_llm::{reference, Cudnn, PageOrder, SeqId};
use cudnn_llm_app::bench_util::{environment, median};

type Error = Box<dyn std::error::Error>;

const PAGE: usize = 16;

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let seed = args.next().map_or(Ok(16), |s| s.parse::<u64>())?;
    let layers = args.next().map_or(Ok(4), |s| s.parse::<usize>())?;
    let ctx = Cudnn::new(0)?;
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(layers);
    let lens: Vec<usize> =
        reference::random_iter(seed).take(8).map(|x| 100 + (((x + 1.0) / 2.0) * 1900.0) as usize).collect();
    let total: usize = lens.iter().sum();
    let longest = *lens.iter().max().unwrap_or(&1);
    println!("{}", environment(ctx.info()));
    println!(
        "packed prefill, {} ({layers} layers, bf16, fused), seed {seed}: lengths {lens:?}, {total} tokens, longest {longest}",
        cfg.name
    );
    eprintln!("09-packed-prefill: random weights ...");
    let w = Weights::<bf16>::random(&cfg, seed);
    let max_seq = total.next_multiple_of(PAGE);
    let mut model = Llama::new(&ctx, &cfg, &w, max_seq)?;
    drop(w);
    model.reserve(&ctx, total.max(lens.len() * longest))?;
    let backends = Backends::parse("fused=all")?;
    let pages = 2 * lens.len() * max_seq.div_ceil(PAGE);
    let mut cache = model.paged_cache(&ctx, lens.len(), max_seq, PAGE, pages, PageOrder::HeadMajor)?;
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            reference::random_values(seed + 1 + i as u64, n)
                .iter()
                .map(|v| ((v * 0.5 + 0.5) * (cfg.vocab - 1) as f64) as u32)
                .collect()
        })
        .collect();

    // One prefill of `prompts` (`packed`: in one step; else one step each), on fresh sequences
    // removed afterwards.
    let prefill = |model: &mut Llama<bf16>, cache: &mut PagedCache<bf16>, how: How| -> Result<(), Error> {
        let obs = &mut NoObserver;
        match how {
            How::Packed => {
                let ids: Vec<SeqId> = prompts.iter().map(|_| cache.add()).collect();
                cache.begin_packed(&ctx, &ids, &lens)?;
                model.forward_paged(&ctx, cache, &prompts.concat(), &backends, obs)?;
                let last: Vec<usize> = lens
                    .iter()
                    .scan(0, |end, &n| {
                        *end += n;
                        Some(*end - 1)
                    })
                    .collect();
                model.logits_of(&ctx, &last, &backends, obs)?;
                cache.finish()?;
                for id in ids {
                    cache.remove(id)?;
                }
            }
            How::OneByOne => {
                for p in &prompts {
                    let id = cache.add();
                    cache.begin_packed(&ctx, &[id], &[p.len()])?;
                    model.forward_paged(&ctx, cache, p, &backends, obs)?;
                    model.logits_rows(&ctx, p.len() - 1..p.len(), &backends, obs)?;
                    cache.finish()?;
                    cache.remove(id)?;
                }
            }
            How::Padded => {
                let ids: Vec<SeqId> = prompts.iter().map(|_| cache.add()).collect();
                cache.begin(&ctx, &ids, longest, ids.len())?;
                let padded: Vec<u32> =
                    prompts.iter().flat_map(|p| p.iter().copied().cycle().take(longest)).collect();
                model.forward_paged(&ctx, cache, &padded, &backends, obs)?;
                let last: Vec<usize> = (0..ids.len()).map(|i| i * longest + lens[i] - 1).collect();
                model.logits_of(&ctx, &last, &backends, obs)?;
                cache.finish()?;
                for id in ids {
                    cache.remove(id)?;
                }
            }
            How::OnePrompt => {
                let id = cache.add();
                let all = prompts.concat();
                cache.begin_packed(&ctx, &[id], &[total])?;
                model.forward_paged(&ctx, cache, &all, &backends, obs)?;
                model.logits_rows(&ctx, total - 1..total, &backends, obs)?;
                cache.finish()?;
                cache.remove(id)?;
            }
        }
        Ok(())
    };
    let cuda = ctx.stream().context();
    let (start, end) = (
        cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
    );
    let mut rows = Vec::new();
    for how in [How::Packed, How::OneByOne, How::Padded, How::OnePrompt] {
        let mut time = || -> Result<f64, Error> {
            for _ in 0..2 {
                prefill(&mut model, &mut cache, how)?;
            }
            let mut samples = Vec::with_capacity(7);
            for _ in 0..7 {
                start.record(ctx.stream())?;
                prefill(&mut model, &mut cache, how)?;
                end.record(ctx.stream())?;
                samples.push(start.elapsed_ms(&end)? as f64);
            }
            Ok(median(samples))
        };
        let r = time().map_err(|e| e.to_string());
        rows.push((how, r));
    }
    let packed = rows[0].1.as_ref().ok().copied();
    println!("\n| prefill | forwards | rows | ms | prompt tokens/s | vs packed |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (how, r) in &rows {
        let (forwards, n) = match how {
            How::Packed | How::OnePrompt => (1, total),
            How::OneByOne => (lens.len(), total),
            How::Padded => (1, lens.len() * longest),
        };
        match r {
            Ok(ms) => println!(
                "| {} | {forwards} | {n} | {ms:.2} | {:.0} | {} |",
                how.name(),
                total as f64 / ms * 1e3,
                packed.map_or("-".into(), |p| format!("{:.2}x", ms / p))
            ),
            Err(e) => println!("| {} | {forwards} | {n} | failed: {e} | - | - |", how.name()),
        }
    }
    println!("\nattention of the packed step: ragged (fallbacks: {:?})", model.fallbacks());
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum How {
    Packed,
    OneByOne,
    Padded,
    OnePrompt,
}

impl How {
    fn name(self) -> &'static str {
        match self {
            How::Packed => "packed (add_many)",
            How::OneByOne => "one by one (add)",
            How::Padded => "padded to the longest",
            How::OnePrompt => "one prompt of the same tokens",
        }
    }
}
