//! Perplexity of a real text under a checkpoint in bf16 and with its projections in FP8
//! (`Llama::quantize_to_fp8`), the fused backend, in one run:
//!
//! ```text
//! cargo run --release --example 12-perplexity -- MODEL TEXT [CHUNK]
//! ```
//!
//! `MODEL` is a checkpoint directory (config.json, tokenizer.json, safetensors) or a GGUF file; `TEXT`
//! a text file (e.g. the repository's `LICENSE-APACHE`), tokenized with the model's tokenizer (BOS
//! first) and cut into windows of `CHUNK` tokens (default 512), each a fresh prefill; every token of a
//! window but the first is predicted from those before it. Prints the perplexity in bf16, FP8 with per-channel factors and FP8 with per-tensor ones, and their
//! ratio, and writes `perplexity-<model>.{csv,md}` to `$BENCH_RESULTS_DIR` (default
//! `benches/results`).
use cudnn_llm::cudnn_ops::WeightScales;
use cudnn_llm::half::bf16;
use cudnn_llm::llama::gguf::{is_gguf_path, Gguf};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver, Tokenizer};
use cudnn_llm::{Backend, Cudnn};
use cudnn_llm_app::bench_util::{csv_and_markdown, environment, next_token_nll, write_results};
use std::fmt::Write as _;
use std::path::PathBuf;

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model_path, text, rest @ ..] = args.as_slice() else {
        return Err("usage: 12-perplexity MODEL TEXT [CHUNK]".into());
    };
    let chunk: usize = rest.first().map(|c| c.parse()).transpose()?.unwrap_or(512);
    if chunk < 2 {
        return Err("CHUNK: at least 2 tokens (one predicted)".into());
    }
    let path = PathBuf::from(model_path);
    let (cfg, weights, tokenizer) = if is_gguf_path(&path) {
        let gguf = Gguf::open(&path)?;
        let cfg = gguf.config()?;
        (cfg.clone(), gguf.weights::<bf16>(&cfg)?, Tokenizer::from_gguf(&gguf)?)
    } else {
        let cfg = LlamaConfig::from_dir(&path)?;
        (
            cfg.clone(),
            Weights::<bf16>::load(&cfg, &path)?,
            Tokenizer::from_file(&path.join("tokenizer.json"))?,
        )
    };
    let ids = tokenizer.encode(&std::fs::read_to_string(text)?, true)?;
    let windows: Vec<&[u32]> = ids.chunks(chunk).filter(|w| w.len() >= 2).collect();
    if windows.is_empty() {
        return Err(format!("{text}: {} tokens, too few to predict any", ids.len()).into());
    }
    let ctx = Cudnn::new(0)?;
    let info = ctx.info().clone();
    println!("# {}", environment(&info));
    let fused = Backends::all(Backend::Fused);
    let mut rows = Vec::new();
    for (dtype, scales) in [
        ("bf16", None),
        ("fp8", Some(WeightScales::PerChannel)),
        ("fp8-tensor", Some(WeightScales::PerTensor)),
    ] {
        // A fresh model per row: quantizing frees the bf16 weights.
        let mut model = Llama::new(&ctx, &cfg, &weights, chunk)?;
        if let Some(scales) = scales {
            model.quantize_to_fp8(&ctx, scales)?;
        }
        let (mut nll, mut predicted) = (0.0, 0usize);
        for w in &windows {
            let mut cache = model.cache(&ctx, 1, chunk)?;
            model.forward(&ctx, &[w.to_vec()], &mut cache, &fused, &mut NoObserver)?;
            // Rows 0..len-1 predict tokens 1..len.
            let logits =
                ctx.stream().clone_dtoh(&model.logits(&ctx, w.len() - 1, &fused, &mut NoObserver)?)?;
            let logits: Vec<f32> = logits.iter().map(|v| v.to_f32()).collect();
            nll += next_token_nll(&logits, cfg.vocab, &w[1..])?;
            predicted += w.len() - 1;
        }
        let ppl = (nll / predicted as f64).exp();
        println!(
            "{dtype}: perplexity {ppl:.4} over {predicted} predicted tokens in {} windows",
            windows.len()
        );
        rows.push(Row {
            gpu: info.name.clone(),
            cudnn: info.cudnn_version_string(),
            model: cfg.name.clone(),
            text: text.clone(),
            dtype: dtype.into(),
            tokens: predicted,
            perplexity: ppl,
        });
    }
    let mut md = String::new();
    writeln!(md, "## Perplexity of `{text}` under {} in bf16 and with FP8 projections\n", cfg.name)?;
    writeln!(
        md,
        "{} Windows of {chunk} tokens, each a fresh prefill, fused backend. FP8: `Llama::quantize_to_fp8` \
         (E4M3 projections; fp8: a factor per output row, the prefill quantizes activations per token; \
         fp8-tensor: one factor per weight and per activation tensor).\n",
        environment(&info)
    )?;
    writeln!(md, "| dtype | predicted tokens | perplexity |\n|---|---:|---:|")?;
    for r in &rows {
        writeln!(md, "| {} | {} | {:.4} |", r.dtype, r.tokens, r.perplexity)?;
    }
    for r in &rows[1..] {
        let ratio = r.perplexity / rows[0].perplexity;
        writeln!(md, "\n{} / bf16 perplexity: {ratio:.4} ({:+.2}%).", r.dtype, 100.0 * (ratio - 1.0))?;
    }
    println!("\n{md}");
    let (csv, _) = csv_and_markdown(&rows)?;
    let stem: String = cfg.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    write_results(&format!("perplexity-{stem}"), &csv, &md);
    Ok(())
}

/// One line of `perplexity-<model>.csv`.
#[derive(serde::Serialize)]
struct Row {
    gpu: String,
    cudnn: String,
    model: String,
    text: String,
    dtype: String,
    tokens: usize,
    perplexity: f64,
}
