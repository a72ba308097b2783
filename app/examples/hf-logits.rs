//! Logits of a Hugging Face checkpoint directory on this crate's decoder, for the parity check against
//! transformers (`python3 app/benches/hf_parity.py` drives it):
//!
//! ```text
//! cargo run --release --example hf-logits -- MODEL TOKENS_JSON OUT_DIR
//! ```
//!
//! `MODEL` is a checkpoint directory (config.json and safetensors) or a GGUF file (dequantized at load).
//! `TOKENS_JSON` is `{"prefill": [[ids...], ...], "decode": [[id per sequence], ...]}`: a prefill of
//! equal-length sequences, then decode steps of one token per sequence. For each backend (all naive,
//! all fused, then each `NAME:SELECTION` given, e.g. `naive-but-rope:naive=all;fused=rope`) it writes
//! `OUT_DIR/logits-NAME.f32`: little-endian f32 rows of `vocab` values, the prefill's rows
//! (sequence-major, every position) followed by each decode step's rows.
use cudnn_llm::half::bf16;
use cudnn_llm::llama::gguf::{is_gguf_path, Gguf};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver};
use cudnn_llm::Cudnn;
use std::path::PathBuf;

#[derive(serde::Deserialize)]
struct Tokens {
    prefill: Vec<Vec<u32>>,
    decode: Vec<Vec<u32>>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model_dir, tokens, out, extra @ ..] = args.as_slice() else {
        return Err("usage: hf-logits MODEL TOKENS_JSON OUT_DIR [NAME:SELECTION ...]".into());
    };
    // The two runs, then any named selection (e.g. `naive-but-rope:naive=all;fused=rope`).
    let mut runs = vec![("naive".to_string(), "naive=all".to_string()), ("fused".into(), "fused=all".into())];
    for e in extra {
        let (name, sel) = e.split_once(':').ok_or_else(|| format!("`{e}`: give NAME:SELECTION"))?;
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(format!("`{name}`: a run's name is letters, digits, - and _").into());
        }
        Backends::parse(sel)?;
        runs.push((name.to_string(), sel.to_string()));
    }
    let (model_dir, out) = (PathBuf::from(model_dir), PathBuf::from(out));
    let toks: Tokens = serde_json::from_str(&std::fs::read_to_string(tokens)?)?;
    let (cfg, weights) = if is_gguf_path(&model_dir) {
        let gguf = Gguf::open(&model_dir)?;
        let cfg = gguf.config()?;
        let weights = gguf.weights::<bf16>(&cfg)?;
        (cfg, weights)
    } else {
        let json = std::fs::read_to_string(model_dir.join("config.json"))?;
        let cfg = LlamaConfig::from_hf_json(&model_dir.display().to_string(), &json)?;
        let weights = Weights::<bf16>::load(&cfg, &model_dir)?;
        (cfg, weights)
    };
    let ctx = Cudnn::new(0)?;
    let (batch, seq) = (toks.prefill.len(), toks.prefill.first().map_or(0, Vec::len));
    let total = seq + toks.decode.len();
    let mut model = Llama::new(&ctx, &cfg, &weights, total)?;
    std::fs::create_dir_all(&out)?;
    for (name, sel) in &runs {
        let backends = Backends::parse(sel)?;
        let mut cache = model.cache(&ctx, batch, total)?;
        let mut rows: Vec<f32> = Vec::new();
        let mut keep = |logits: Vec<bf16>| rows.extend(logits.iter().map(|v| v.to_f32()));
        model.forward(&ctx, &toks.prefill, &mut cache, &backends, &mut NoObserver)?;
        keep(ctx.stream().clone_dtoh(&model.logits(&ctx, batch * seq, &backends, &mut NoObserver)?)?);
        for step in &toks.decode {
            let next: Vec<Vec<u32>> = step.iter().map(|&t| vec![t]).collect();
            model.forward(&ctx, &next, &mut cache, &backends, &mut NoObserver)?;
            keep(ctx.stream().clone_dtoh(&model.logits(&ctx, batch, &backends, &mut NoObserver)?)?);
        }
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out.join(format!("logits-{name}.f32")), bytes)?;
        println!("{name}: {} rows of {} logits", rows.len() / cfg.vocab, cfg.vocab);
    }
    if !model.fallbacks().is_empty() {
        println!("fallbacks: {:?}", model.fallbacks());
    }
    Ok(())
}
