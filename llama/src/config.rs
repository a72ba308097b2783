//! Model shapes: the Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B presets, a tiny one for tests, and Hugging Face's
//! `config.json` as transformers 4.x and 5.x write it.

use crate::{Error, Result};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::path::Path;

/// Llama-3's RoPE frequency scaling (`rope_type: llama3` in Hugging Face configs).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[non_exhaustive]
pub struct RopeScaling {
    /// Divides the low frequencies.
    pub factor: f64,
    /// Wavelengths above `original_max_position / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    #[serde(rename = "original_max_position_embeddings")]
    pub original_max_position: usize,
}

impl RopeScaling {
    /// Llama-3 scaling: low frequencies divided by `factor`, wavelengths between
    /// `original_max_position / high_freq_factor` and `original_max_position / low_freq_factor`
    /// interpolated.
    pub fn llama3(
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: usize,
    ) -> Self {
        RopeScaling { factor, low_freq_factor, high_freq_factor, original_max_position }
    }
}

/// The shape of a Llama-3 decoder.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LlamaConfig {
    /// Preset or model name, for reports.
    pub name: String,
    /// Hidden size.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Head dim.
    pub head_dim: usize,
    /// MLP inner size.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama-3 frequency scaling; `None` for plain RoPE.
    pub rope_scaling: Option<RopeScaling>,
    /// `lm_head` shares the embedding matrix.
    pub tie_embeddings: bool,
    /// The longest context the model was trained for (`max_position_embeddings`). Informational: the
    /// model's RoPE tables are sized by [`crate::Llama::new`]'s `max_positions`, not by this.
    pub max_positions: usize,
    /// The beginning-of-sequence token (`bos_token_id`), if the model names one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation (`eos_token_id`, one id or a list); empty if the model names none.
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint stores its Linear weights in FP8 (`quantization_config`): they load dequantized
    /// into the model's dtype, and [`Llama::quantize_to_fp8`](crate::Llama::quantize_to_fp8) puts them
    /// back in FP8. `None` for a 16-bit checkpoint.
    pub fp8: Option<Fp8Checkpoint>,
}

/// How an FP8 checkpoint's weights carry their dequantization factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fp8Factors {
    /// One per weight (compressed-tensors `strategy: tensor`): `weight_scale` `[]` or `[1]`.
    PerTensor,
    /// One per output channel (compressed-tensors `strategy: channel`): `weight_scale` `[n, 1]` or `[n]`.
    PerChannel,
    /// One per `rows x cols` block (`quant_method: fp8` with `weight_block_size`): `weight_scale_inv`
    /// `[ceil(n / rows), ceil(k / cols)]`.
    Blocks {
        /// Weight rows (output channels) per block.
        rows: usize,
        /// Weight columns (input channels) per block.
        cols: usize,
    },
}

/// An FP8 checkpoint's scheme, read from `quantization_config`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fp8Checkpoint {
    /// `compressed-tensors` or `fp8`.
    pub method: &'static str,
    /// How the weights' factors are given.
    pub factors: Fp8Factors,
    /// The checkpoint gives static activation scales (`input_scale`): not read; activations are
    /// quantized per token at run time instead.
    pub static_activations: bool,
}

impl Fp8Checkpoint {
    /// The name of a weight's factor tensor: `<weight>_scale` (compressed-tensors) or
    /// `<weight>_scale_inv` (`fp8`).
    pub fn factor_name(&self, weight: &str) -> String {
        match self.factors {
            Fp8Factors::Blocks { .. } => format!("{weight}_scale_inv"),
            _ => format!("{weight}_scale"),
        }
    }

    /// The factor count and shape expected beside a `[n, k]` weight.
    pub fn factor_shapes(&self, n: usize, k: usize) -> Vec<Vec<usize>> {
        match self.factors {
            Fp8Factors::PerTensor => vec![vec![], vec![1]],
            Fp8Factors::PerChannel => vec![vec![n, 1], vec![n]],
            Fp8Factors::Blocks { rows, cols } => vec![vec![n.div_ceil(rows), k.div_ceil(cols)]],
        }
    }

    /// For reports: `compressed-tensors, per channel`.
    pub fn describe(&self) -> String {
        let f = match self.factors {
            Fp8Factors::PerTensor => "per tensor".to_string(),
            Fp8Factors::PerChannel => "per channel".to_string(),
            Fp8Factors::Blocks { rows, cols } => format!("{rows}x{cols} blocks"),
        };
        let inputs = if self.static_activations { "; its static input scales are not read" } else { "" };
        format!("{}, {f}{inputs}", self.method)
    }
}

/// Names [`LlamaConfig::preset`] accepts.
pub const PRESETS: [&str; 5] = ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "tiny"];

/// Most decoder layers [`LlamaConfig::check`] accepts (Llama-3.1-405B has 126).
pub const MAX_LAYERS: usize = 1 << 12;
/// Largest single dimension [`LlamaConfig::check`] accepts: hidden, MLP size, head dim, the Q, KV and
/// fused QKV widths (Llama-3.1-405B's largest is its MLP, 53248). Well inside cuBLAS's `int` dims.
pub const MAX_DIM: usize = 1 << 20;
/// Largest vocabulary [`LlamaConfig::check`] accepts (token ids are `u32`; Llama-3 has 128256).
pub const MAX_VOCAB: usize = 1 << 24;
/// Most elements [`LlamaConfig::check`] accepts in one weight tensor, the fused `[qkv_width, hidden]`
/// projection included: `i32::MAX`, what 32-bit element indexing reaches (Llama-3.1-405B's embedding,
/// 128256 × 16384, is the largest Llama-3 tensor at 2.1e9).
pub const MAX_TENSOR_ELEMENTS: usize = i32::MAX as usize;
/// Largest `max_positions` [`LlamaConfig::check`] accepts.
pub const MAX_POSITIONS: usize = 1 << 24;
/// Largest RMSNorm epsilon [`LlamaConfig::check`] accepts (models use 1e-5 or 1e-6; a larger epsilon
/// is a typo, not a model).
pub const MAX_RMS_EPS: f64 = 0.1;
/// RoPE base transformers' `LlamaConfig` uses when `config.json` names none (its documented default).
pub const DEFAULT_ROPE_THETA: f64 = 10000.0;
/// Context length transformers' `LlamaConfig` uses when `config.json` has no
/// `max_position_embeddings` (its documented default).
pub const DEFAULT_MAX_POSITIONS: usize = 2048;

/// Llama-3's special tokens: `<|begin_of_text|>`.
const LLAMA3_BOS: u32 = 128000;
/// Llama-3.1's end tokens: `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`.
const LLAMA3_EOS: [u32; 3] = [128001, 128008, 128009];

impl LlamaConfig {
    /// Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, head dim 64, FFN 8192, tied
    /// embeddings, 131072 positions, bos 128000, eos 128001, 128008 and 128009 (the instruct model's;
    /// the base model stops at 128001 only, which is among them).
    pub fn llama_3_2_1b() -> Self {
        LlamaConfig {
            name: "llama-3.2-1b".into(),
            hidden: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 128256,
            rms_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: Some(RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }),
            tie_embeddings: true,
            max_positions: 131072,
            bos_token_id: Some(LLAMA3_BOS),
            eos_token_ids: LLAMA3_EOS.to_vec(),
            fp8: None,
        }
    }

    /// Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, head dim 128, FFN 14336, 131072
    /// positions, the same special tokens as [`LlamaConfig::llama_3_2_1b`].
    pub fn llama_3_1_8b() -> Self {
        LlamaConfig {
            name: "llama-3.1-8b".into(),
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            vocab: 128256,
            rms_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }),
            tie_embeddings: false,
            max_positions: 131072,
            bos_token_id: Some(LLAMA3_BOS),
            eos_token_ids: LLAMA3_EOS.to_vec(),
            fp8: None,
        }
    }

    /// Llama-3.1-70B: hidden 8192, 80 layers, 64 heads, 8 KV heads, head dim 128, FFN 28672, the
    /// vocabulary, RoPE scaling and special tokens of [`LlamaConfig::llama_3_1_8b`]. Its bf16 weights
    /// (141 GB) need two or more GPUs ([`crate::tp`]), or a few layers of it (`with_layers`) on one.
    pub fn llama_3_1_70b() -> Self {
        LlamaConfig {
            name: "llama-3.1-70b".into(),
            hidden: 8192,
            layers: 80,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            ffn: 28672,
            ..LlamaConfig::llama_3_1_8b()
        }
    }

    /// SmolLM2-135M's shapes (a Llama-architecture model): hidden 576, 30 layers, 9 heads, 3 KV heads,
    /// head dim 64, FFN 1536, vocabulary 49152, tied embeddings, RoPE base 100000 without scaling,
    /// 8192 positions, bos and eos 0 (`<|endoftext|>`). The real checkpoint loads from its GGUF or
    /// `config.json`; this preset gives its shapes with random weights, for decode benches of a
    /// model whose step is bound by launches rather than bytes.
    pub fn smollm2_135m() -> Self {
        LlamaConfig {
            name: "smollm2-135m".into(),
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
            rms_eps: 1e-5,
            rope_theta: 100000.0,
            rope_scaling: None,
            tie_embeddings: true,
            max_positions: 8192,
            bos_token_id: Some(0),
            eos_token_ids: vec![0],
            fp8: None,
        }
    }

    /// A model small enough for an f64 CPU reference: hidden 128, 2 layers, 4 heads, 2 KV heads, head
    /// dim 32, FFN 256, vocabulary 512, Llama-3 RoPE scaling. Its vocabulary has no special tokens:
    /// no bos, no eos (generation runs to its length limit).
    pub fn tiny() -> Self {
        LlamaConfig {
            name: "tiny".into(),
            hidden: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 256,
            vocab: 512,
            tie_embeddings: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            fp8: None,
            ..LlamaConfig::llama_3_1_8b()
        }
    }

    /// A preset by name (one of [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "smollm2-135m" => Ok(Self::smollm2_135m()),
            "llama-3.2-1b" => Ok(Self::llama_3_2_1b()),
            "llama-3.1-8b" => Ok(Self::llama_3_1_8b()),
            "llama-3.1-70b" => Ok(Self::llama_3_1_70b()),
            "tiny" => Ok(Self::tiny()),
            other => Err(Error::Config(format!(
                "unknown preset `{other}`: expected one of {}",
                PRESETS.join(", ")
            ))),
        }
    }

    /// The same model with `layers` decoder layers (benches run a few layers of a large model).
    pub fn with_layers(self, layers: usize) -> Self {
        LlamaConfig { layers, ..self }
    }

    /// Reads and checks `dir/config.json`, the config of a Hugging Face checkpoint directory (whose
    /// weights [`crate::weights::Weights::load`] reads from the same directory). The config is named
    /// after the directory's last component.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let file = dir.join("config.json");
        let json =
            std::fs::read_to_string(&file).map_err(|e| Error::Config(format!("{}: {e}", file.display())))?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        Self::from_hf_json(&name, &json)
    }

    /// Reads a Hugging Face `config.json` of a `LlamaForCausalLM`, as transformers 4.x or 5.x writes it.
    ///
    /// RoPE comes from the top-level `rope_theta` and `rope_scaling` (4.x; `rope_scaling` null, or
    /// with `rope_type` or the legacy `type`), or from `rope_parameters` (5.x), or both if they agree
    /// (a disagreement is an error). The rope types are `default` and `llama3`. When no form names a
    /// theta, it is [`DEFAULT_ROPE_THETA`], transformers' `LlamaConfig` default; likewise a missing
    /// `max_position_embeddings` is [`DEFAULT_MAX_POSITIONS`], a missing `num_key_value_heads` the
    /// number of heads, a missing `head_dim` `hidden_size / num_attention_heads` (an explicit
    /// `head_dim` need not divide the hidden size) and a missing `tie_word_embeddings` false.
    ///
    /// What the decoder does not implement is an error naming the key: a `model_type` other than
    /// `llama`, `architectures` without `LlamaForCausalLM`, `attention_bias` or `mlp_bias` true, a
    /// `hidden_act` other than `silu`, another rope type (yarn, dynamic, linear, longrope, ...), a key
    /// of the rope parameters this decoder does not read, a `partial_rotary_factor` other than 1, a
    /// `sliding_window`, a `quantization_config` other than the FP8 ones [`Fp8Checkpoint`] reads,
    /// `pretraining_tp` above 1. Keys that do not change the
    /// forward (dtype, `initializer_range`, `use_cache`, `attention_dropout`, `pad_token_id`, ...) are
    /// ignored. The result passes [`LlamaConfig::check`].
    pub fn from_hf_json(name: &str, json: &str) -> Result<Self> {
        let fail = |m: String| Error::Config(format!("{name}: config.json: {m}"));
        let root = crate::json::parse_unique(json).map_err(|e| fail(e.to_string()))?;
        let Value::Object(map) = root else {
            return Err(fail("expected a JSON object".into()));
        };
        let hf = Hf { map: &map, prefix: "" };
        let err = |e: String| fail(e);

        if let Some(t) = hf.str("model_type").map_err(err)? {
            if t != "llama" {
                return Err(fail(format!("`model_type` `{t}` is not supported (llama only)")));
            }
        }
        if let Some(a) = hf.get("architectures") {
            let names: Vec<&str> = a.as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            if !names.contains(&"LlamaForCausalLM") {
                return Err(fail(format!("`architectures` {a} does not include LlamaForCausalLM")));
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if hf.bool(key).map_err(err)? == Some(true) {
                return Err(fail(format!("`{key}` true is not supported (Llama-3 has no biases)")));
            }
        }
        if let Some(act) = hf.str("hidden_act").map_err(err)? {
            if act != "silu" {
                return Err(fail(format!("`hidden_act` `{act}` is not supported (silu only)")));
            }
        }
        if let Some(w) = hf.get("sliding_window") {
            return Err(fail(format!("`sliding_window` {w} is not supported (full attention only)")));
        }
        let fp8 = hf.get("quantization_config").map(fp8_checkpoint).transpose().map_err(err)?;
        if let Some(tp) = hf.usize("pretraining_tp").map_err(err)? {
            if tp > 1 {
                return Err(fail(format!("`pretraining_tp` {tp} is not supported (1 only)")));
            }
        }
        hf.partial_rotary_factor().map_err(err)?;
        let (rope_theta, rope_scaling) = rope(&hf).map_err(err)?;

        let heads = hf.req_usize("num_attention_heads").map_err(err)?;
        let hidden = hf.req_usize("hidden_size").map_err(err)?;
        let head_dim = match hf.usize("head_dim").map_err(err)? {
            Some(d) => d,
            None if heads == 0 => return Err(fail("`num_attention_heads` is 0".into())),
            None => hidden / heads,
        };
        let eos_token_ids = match hf.get("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| token_id("eos_token_id", v))
                .collect::<std::result::Result<_, _>>()
                .map_err(err)?,
            Some(v) => vec![token_id("eos_token_id", v).map_err(err)?],
        };
        let bos_token_id =
            hf.get("bos_token_id").map(|v| token_id("bos_token_id", v)).transpose().map_err(err)?;
        let cfg = LlamaConfig {
            name: name.to_string(),
            hidden,
            layers: hf.req_usize("num_hidden_layers").map_err(err)?,
            heads,
            kv_heads: hf.usize("num_key_value_heads").map_err(err)?.unwrap_or(heads),
            head_dim,
            ffn: hf.req_usize("intermediate_size").map_err(err)?,
            vocab: hf.req_usize("vocab_size").map_err(err)?,
            rms_eps: hf.req_f64("rms_norm_eps").map_err(err)?,
            rope_theta,
            rope_scaling,
            tie_embeddings: hf.bool("tie_word_embeddings").map_err(err)?.unwrap_or(false),
            max_positions: hf.usize("max_position_embeddings").map_err(err)?.unwrap_or(DEFAULT_MAX_POSITIONS),
            bos_token_id,
            eos_token_ids,
            fp8,
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// A Hugging Face `config.json` of this model (transformers 4.x keys, as `save_pretrained` writes
    /// them for a `LlamaForCausalLM`), which [`LlamaConfig::from_hf_json`] reads back as this config
    /// (all but the name, which comes from the directory) and transformers loads beside a checkpoint
    /// written by [`crate::weights::Weights::save`]. `dtype` is the checkpoint's (`torch_dtype`).
    pub fn to_hf_json(&self, dtype: cudnn_llm_ops::DataType) -> String {
        let rope_scaling = match self.rope_scaling {
            None => Value::Null,
            Some(s) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position,
            }),
        };
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => Value::from(*one),
            many => Value::from(many.to_vec()),
        };
        let torch_dtype = match dtype {
            cudnn_llm_ops::DataType::BF16 => "bfloat16",
            cudnn_llm_ops::DataType::F16 => "float16",
            _ => "float32",
        };
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_positions,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": torch_dtype,
        });
        serde_json::to_string_pretty(&json).expect("a JSON value serializes")
    }

    /// Checks that the shape is one this crate runs: everything non-zero, heads divisible by KV heads,
    /// head dim a multiple of 8 (fused attention) and even (RoPE); sizes within [`MAX_LAYERS`],
    /// [`MAX_DIM`], [`MAX_VOCAB`], [`MAX_POSITIONS`] and [`MAX_TENSOR_ELEMENTS`], so that every derived
    /// size ([`LlamaConfig::qkv_width`], [`LlamaConfig::parameters`], tensor shapes) fits; RoPE theta
    /// finite and positive; Llama-3 scaling with a finite `factor` ≥ 1, finite
    /// `0 < low_freq_factor < high_freq_factor` (the interpolation divides by their difference) and a
    /// non-zero `original_max_position`; `rms_eps` finite in `[f32::MIN_POSITIVE, MAX_RMS_EPS]` (the
    /// kernels take it as a normal f32); bos and eos ids inside the vocabulary. Errors name the field.
    pub fn check(&self) -> Result<()> {
        let fail = |m: String| Err(Error::Config(format!("{}: {m}", self.name)));
        for (what, v) in [
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("max_positions", self.max_positions),
        ] {
            if v == 0 {
                return fail(format!("{what} is 0"));
            }
        }
        for (what, v, cap) in [
            ("layers", self.layers, MAX_LAYERS),
            ("hidden", self.hidden, MAX_DIM),
            ("heads", self.heads, MAX_DIM),
            ("head_dim", self.head_dim, MAX_DIM),
            ("ffn", self.ffn, MAX_DIM),
            ("vocab", self.vocab, MAX_VOCAB),
            ("max_positions", self.max_positions, MAX_POSITIONS),
        ] {
            if v > cap {
                return fail(format!("{what} {v} is above this crate's limit {cap}"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return fail(format!("heads {} is not a multiple of kv_heads {}", self.heads, self.kv_heads));
        }
        if !self.head_dim.is_multiple_of(8) {
            return fail(format!("head_dim {} is not a multiple of 8", self.head_dim));
        }
        // heads and head_dim are at most 2^20 each, so this product cannot overflow a 64-bit usize, but
        // checked arithmetic keeps it honest on any target.
        let qkv = (self.kv_heads.checked_mul(2))
            .and_then(|kv| kv.checked_add(self.heads))
            .and_then(|h| h.checked_mul(self.head_dim));
        match qkv {
            Some(w) if w <= MAX_DIM => {}
            _ => {
                return fail(format!(
                    "the QKV width (heads {} + 2 × kv_heads {}) × head_dim {} is above this crate's limit \
                     {MAX_DIM}",
                    self.heads, self.kv_heads, self.head_dim
                ))
            }
        }
        for (what, rows, cols) in [
            ("embedding (vocab × hidden)", self.vocab, self.hidden),
            ("fused QKV projection (qkv_width × hidden)", self.qkv_width(), self.hidden),
            ("MLP projection (ffn × hidden)", self.ffn, self.hidden),
            ("attention output (hidden × heads · head_dim)", self.hidden, self.attn_width()),
        ] {
            if rows.checked_mul(cols).is_none_or(|n| n > MAX_TENSOR_ELEMENTS) {
                return fail(format!(
                    "the {what} tensor, {rows} × {cols}, has more than {MAX_TENSOR_ELEMENTS} elements"
                ));
            }
        }
        if self.checked_parameters().is_none() {
            return fail("the parameter count overflows usize".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return fail(format!("rope_theta {} is not a finite positive number", self.rope_theta));
        }
        if let Some(s) = &self.rope_scaling {
            if !(s.factor.is_finite() && s.factor >= 1.0) {
                return fail(format!("rope_scaling.factor {} is not a finite number ≥ 1", s.factor));
            }
            if !(s.low_freq_factor.is_finite() && s.low_freq_factor > 0.0) {
                return fail(format!(
                    "rope_scaling.low_freq_factor {} is not a finite positive number",
                    s.low_freq_factor
                ));
            }
            if !(s.high_freq_factor.is_finite() && s.high_freq_factor > s.low_freq_factor) {
                return fail(format!(
                    "rope_scaling.high_freq_factor {} is not finite and above low_freq_factor {}",
                    s.high_freq_factor, s.low_freq_factor
                ));
            }
            if s.original_max_position == 0 {
                return fail("rope_scaling.original_max_position_embeddings is 0".into());
            }
        }
        if !(self.rms_eps.is_finite() && (f32::MIN_POSITIVE as f64..=MAX_RMS_EPS).contains(&self.rms_eps)) {
            return fail(format!(
                "rms_eps {:e} is outside [{:e}, {MAX_RMS_EPS}] (a normal f32, at most {MAX_RMS_EPS})",
                self.rms_eps,
                f32::MIN_POSITIVE
            ));
        }
        for (what, id) in self
            .bos_token_id
            .iter()
            .map(|&b| ("bos_token_id", b))
            .chain(self.eos_token_ids.iter().map(|&e| ("eos_token_id", e)))
        {
            if id as usize >= self.vocab {
                return fail(format!("{what} {id} is outside the vocabulary of {}", self.vocab));
            }
        }
        Ok(())
    }

    /// Width of the fused QKV projection: `(heads + 2 · kv_heads) · head_dim` (saturating for configs
    /// [`LlamaConfig::check`] refuses).
    pub fn qkv_width(&self) -> usize {
        self.heads.saturating_add(self.kv_heads.saturating_mul(2)).saturating_mul(self.head_dim)
    }

    /// Width of the attention output: `heads · head_dim` (saturating for configs
    /// [`LlamaConfig::check`] refuses).
    pub fn attn_width(&self) -> usize {
        self.heads.saturating_mul(self.head_dim)
    }

    /// Parameters, lm_head included (once when tied); `usize::MAX` for configs whose count overflows
    /// (which [`LlamaConfig::check`] refuses).
    pub fn parameters(&self) -> usize {
        self.checked_parameters().unwrap_or(usize::MAX)
    }

    fn checked_parameters(&self) -> Option<usize> {
        let hid = self.hidden;
        let per_layer = [
            hid.checked_mul(2)?,
            hid.checked_mul(
                self.heads.checked_add(self.kv_heads.checked_mul(2)?)?.checked_mul(self.head_dim)?,
            )?,
            self.heads.checked_mul(self.head_dim)?.checked_mul(hid)?,
            hid.checked_mul(self.ffn)?.checked_mul(3)?,
        ]
        .into_iter()
        .try_fold(0usize, usize::checked_add)?;
        let embed = self.vocab.checked_mul(hid)?;
        let head = if self.tie_embeddings { 0 } else { embed };
        [embed, self.layers.checked_mul(per_layer)?, hid, head]
            .into_iter()
            .try_fold(0usize, usize::checked_add)
    }
}

/// What one rope dictionary says: its theta, if it names one, and its scaling.
type RopeForm = (Option<f64>, Option<RopeScaling>);

/// A token id in `config.json`: a non-negative integer that fits `u32`.
fn token_id(key: &str, v: &Value) -> std::result::Result<u32, String> {
    v.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| format!("`{key}` {v} is not a token id"))
}

/// A JSON object of `config.json` (the root, or a rope dictionary whose keys are named with `prefix`),
/// read key by key so that errors name the key. A key whose value is null counts as absent.
struct Hf<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Hf<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn typed<T>(
        &self,
        key: &str,
        what: &str,
        f: impl Fn(&Value) -> Option<T>,
    ) -> std::result::Result<Option<T>, String> {
        self.get(key)
            .map(|v| f(v).ok_or_else(|| format!("`{}{key}` {v} is not {what}", self.prefix)))
            .transpose()
    }

    fn usize(&self, key: &str) -> std::result::Result<Option<usize>, String> {
        self.typed(key, "a non-negative integer", |v| v.as_u64().and_then(|u| usize::try_from(u).ok()))
    }

    fn req_usize(&self, key: &str) -> std::result::Result<usize, String> {
        self.usize(key)?.ok_or_else(|| format!("`{}{key}` is missing", self.prefix))
    }

    fn f64(&self, key: &str) -> std::result::Result<Option<f64>, String> {
        self.typed(key, "a number", Value::as_f64)
    }

    fn req_f64(&self, key: &str) -> std::result::Result<f64, String> {
        self.f64(key)?.ok_or_else(|| format!("`{}{key}` is missing", self.prefix))
    }

    fn bool(&self, key: &str) -> std::result::Result<Option<bool>, String> {
        self.typed(key, "true or false", Value::as_bool)
    }

    fn str(&self, key: &str) -> std::result::Result<Option<&str>, String> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| format!("`{}{key}` {v} is not a string", self.prefix)))
            .transpose()
    }

    /// transformers rotates only this fraction of each head when it is below 1; the decoder rotates
    /// all of it.
    fn partial_rotary_factor(&self) -> std::result::Result<(), String> {
        match self.f64("partial_rotary_factor")? {
            Some(f) if f != 1.0 => Err(format!(
                "`{}partial_rotary_factor` {f} is not supported (the whole head is rotated)",
                self.prefix
            )),
            _ => Ok(()),
        }
    }

    /// One rope dictionary (`rope_scaling` or `rope_parameters`): its theta, if it names one, and its
    /// scaling.
    fn rope_dict(&self, legacy_type: bool) -> std::result::Result<RopeForm, String> {
        let p = self.prefix;
        let kind = match (self.str("rope_type")?, if legacy_type { self.str("type")? } else { None }) {
            (Some(a), Some(b)) if a != b => {
                return Err(format!("`{p}rope_type` `{a}` disagrees with `{p}type` `{b}`"));
            }
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => return Err(format!("`{p}rope_type` is missing")),
        };
        let mut known = vec!["rope_type", "rope_theta", "partial_rotary_factor"];
        if legacy_type {
            known.push("type");
        }
        let scaling = match kind {
            "default" => None,
            "llama3" => {
                known.extend([
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                ]);
                Some(RopeScaling {
                    factor: self.req_f64("factor")?,
                    low_freq_factor: self.req_f64("low_freq_factor")?,
                    high_freq_factor: self.req_f64("high_freq_factor")?,
                    original_max_position: self.req_usize("original_max_position_embeddings")?,
                })
            }
            other => {
                return Err(format!("`{p}rope_type` `{other}` is not supported (default or llama3 only)"));
            }
        };
        if let Some(key) = self.map.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(format!("`{p}{key}` is not supported for rope type {kind}"));
        }
        self.partial_rotary_factor()?;
        Ok((self.f64("rope_theta")?, scaling))
    }
}

/// RoPE theta and scaling from the transformers 4.x keys (`rope_theta`, `rope_scaling`), the 5.x key
/// (`rope_parameters`), or both where they agree.
fn rope(hf: &Hf) -> std::result::Result<(f64, Option<RopeScaling>), String> {
    let dict = |key: &'static str, legacy: bool| -> std::result::Result<Option<RopeForm>, String> {
        match hf.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => {
                let prefix = if legacy { "rope_scaling." } else { "rope_parameters." };
                Hf { map: m, prefix }.rope_dict(legacy).map(Some)
            }
            Some(v) => Err(format!("`{key}` {v} is not an object")),
        }
    };
    // 4.x: the top-level theta, and a scaling dictionary (null or absent: none) that may repeat it.
    let top_theta = hf.f64("rope_theta")?;
    let legacy = dict("rope_scaling", true)?;
    let legacy_theta = match (top_theta, legacy.and_then(|l| l.0)) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!("`rope_theta` {a} disagrees with `rope_scaling.rope_theta` {b}"));
        }
        (a, b) => a.or(b),
    };
    // `"rope_scaling": null` states "no scaling" (transformers 4's way of saying so): beside a
    // `rope_parameters` with scaling, the two forms disagree and neither is chosen silently.
    let legacy_scaling_stated = hf.map.contains_key("rope_scaling");
    let legacy_scaling = legacy.and_then(|l| l.1);
    // 5.x: one dictionary holding both.
    let Some((theta, scaling)) = dict("rope_parameters", false)? else {
        return Ok((legacy_theta.unwrap_or(DEFAULT_ROPE_THETA), legacy_scaling));
    };
    if let (Some(a), Some(b)) = (legacy_theta, theta) {
        if a != b {
            return Err(format!("`rope_theta` {a} disagrees with `rope_parameters.rope_theta` {b}"));
        }
    }
    if legacy_scaling_stated && legacy_scaling != scaling {
        return Err(format!(
            "`rope_scaling` ({}) disagrees with `rope_parameters` ({})",
            describe(legacy_scaling),
            describe(scaling)
        ));
    }
    Ok((theta.or(legacy_theta).unwrap_or(DEFAULT_ROPE_THETA), scaling))
}

fn describe(s: Option<RopeScaling>) -> String {
    match s {
        None => "no scaling".into(),
        Some(s) => format!(
            "llama3, factor {}, low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {}",
            s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
        ),
    }
}

/// The FP8 scheme of a `quantization_config`, or why it is refused, naming what: compressed-tensors
/// `float-quantized` (8-bit float weights per tensor or per channel, symmetric, static; activations
/// none, dynamic, or static per tensor) and `fp8` (blocks of `weight_block_size`, dynamic
/// activations) load; every other scheme or option is an error.
fn fp8_checkpoint(q: &serde_json::Value) -> std::result::Result<Fp8Checkpoint, String> {
    let method = q.get("quant_method").and_then(|m| m.as_str());
    let refuse =
        |what: String| format!("`quantization_config` quant_method `{}`: {what}", method.unwrap_or(""));
    match method {
        Some("compressed-tensors") => {
            if let Some(f) = q.get("format").and_then(|f| f.as_str()) {
                if f != "float-quantized" {
                    return Err(refuse(format!("format `{f}` is not supported (float-quantized only)")));
                }
            }
            for key in ["kv_cache_scheme", "sparsity_config", "transform_config"] {
                if q.get(key).is_some_and(|v| !v.is_null()) {
                    return Err(refuse(format!("`{key}` is not supported")));
                }
            }
            let groups = q.get("config_groups").and_then(|g| g.as_object()).filter(|g| !g.is_empty());
            let groups = groups.ok_or_else(|| refuse("no `config_groups`".into()))?;
            let mut factors = None;
            let mut static_activations = false;
            for (name, g) in groups {
                let at = |k: &str| format!("config_groups.{name}.{k}");
                let targets = g.get("targets").and_then(|t| t.as_array());
                if targets.is_none_or(|t| t.iter().any(|v| v.as_str() != Some("Linear"))) {
                    return Err(refuse(format!(
                        "{} {}: only `Linear` targets are supported",
                        at("targets"),
                        g.get("targets").unwrap_or(&serde_json::Value::Null)
                    )));
                }
                let w = g.get("weights").ok_or_else(|| refuse(format!("{} is missing", at("weights"))))?;
                let field = |k: &str| w.get(k).cloned().unwrap_or(serde_json::Value::Null);
                if field("type").as_str() != Some("float") || field("num_bits").as_u64() != Some(8) {
                    return Err(refuse(format!(
                        "{}: {} bits of type {}: only 8-bit float (FP8) weights are supported",
                        at("weights"),
                        field("num_bits"),
                        field("type")
                    )));
                }
                if field("symmetric").as_bool() == Some(false) || field("dynamic").as_bool() == Some(true) {
                    return Err(refuse(format!(
                        "{}: asymmetric or dynamic weights are not supported",
                        at("weights")
                    )));
                }
                let f = match field("strategy").as_str() {
                    Some("tensor") => Fp8Factors::PerTensor,
                    Some("channel") => Fp8Factors::PerChannel,
                    other => {
                        return Err(refuse(format!(
                            "{}.strategy {}: only `tensor` and `channel` are supported",
                            at("weights"),
                            other.unwrap_or("(none)")
                        )))
                    }
                };
                if factors.is_some_and(|x| x != f) {
                    return Err(refuse(
                        "config groups with different weight strategies are not supported".into(),
                    ));
                }
                factors = Some(f);
                if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
                    let field = |k: &str| a.get(k).cloned().unwrap_or(serde_json::Value::Null);
                    if field("type").as_str() != Some("float") || field("num_bits").as_u64() != Some(8) {
                        return Err(refuse(format!(
                            "{}: only 8-bit float activations are supported",
                            at("input_activations")
                        )));
                    }
                    match (field("dynamic").as_bool(), field("strategy").as_str()) {
                        (Some(true), Some("token" | "tensor")) => {}
                        (Some(false) | None, Some("tensor")) => static_activations = true,
                        (d, s) => {
                            return Err(refuse(format!(
                                "{}: dynamic {d:?} strategy {s:?} is not supported",
                                at("input_activations")
                            )))
                        }
                    }
                }
                if g.get("output_activations").is_some_and(|v| !v.is_null()) {
                    return Err(refuse(format!("{} is not supported", at("output_activations"))));
                }
            }
            let factors = factors.expect("at least one group");
            Ok(Fp8Checkpoint { method: "compressed-tensors", factors, static_activations })
        }
        Some("fp8") => {
            if let Some(a) = q.get("activation_scheme").and_then(|a| a.as_str()) {
                if a != "dynamic" {
                    return Err(refuse(format!("activation_scheme `{a}` is not supported (dynamic only)")));
                }
            }
            let block = q.get("weight_block_size").and_then(|b| b.as_array());
            let dims: Option<Vec<usize>> = block.map(|b| {
                b.iter().filter_map(|v| v.as_u64().map(|v| v as usize)).filter(|&v| v > 0).collect()
            });
            match dims.as_deref() {
                Some(&[rows, cols]) => Ok(Fp8Checkpoint {
                    method: "fp8",
                    factors: Fp8Factors::Blocks { rows, cols },
                    static_activations: false,
                }),
                _ => Err(refuse(format!(
                    "`weight_block_size` {}: two positive block dims are needed (per-tensor fp8 checkpoints are \
                     not supported)",
                    q.get("weight_block_size").unwrap_or(&serde_json::Value::Null)
                ))),
            }
        }
        Some(m) => Err(format!(
            "`quantization_config` quant_method `{m}`: this quantization scheme is not supported"
        )),
        None => {
            Err("`quantization_config` without a quant_method: quantized checkpoints are not supported"
                .into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_written_as_hf_json_read_back_equal() {
        let untied = LlamaConfig { rope_scaling: None, eos_token_ids: vec![7], ..LlamaConfig::tiny() };
        for cfg in [LlamaConfig::llama_3_2_1b(), LlamaConfig::llama_3_1_8b(), LlamaConfig::tiny(), untied] {
            let json = cfg.to_hf_json(cudnn_llm_ops::DataType::BF16);
            let back = LlamaConfig::from_hf_json(&cfg.name, &json).unwrap();
            assert_eq!(back, cfg, "{json}");
            let v: Value = serde_json::from_str(&json).unwrap();
            assert_eq!(v["architectures"][0], "LlamaForCausalLM");
            assert_eq!(v["torch_dtype"], "bfloat16");
        }
    }

    #[test]
    fn presets_have_the_published_shapes() {
        let b1 = LlamaConfig::preset("llama-3.2-1b").unwrap();
        assert_eq!(
            (b1.hidden, b1.layers, b1.heads, b1.kv_heads, b1.head_dim, b1.ffn),
            (2048, 16, 32, 8, 64, 8192)
        );
        assert!(b1.tie_embeddings);
        // 1.24 billion parameters (Hugging Face's count for Llama-3.2-1B).
        assert_eq!(b1.parameters(), 1_235_814_400);
        let b8 = LlamaConfig::preset("llama-3.1-8b").unwrap();
        assert_eq!(
            (b8.hidden, b8.layers, b8.heads, b8.kv_heads, b8.head_dim, b8.ffn),
            (4096, 32, 32, 8, 128, 14336)
        );
        assert_eq!(b8.parameters(), 8_030_261_248);
        assert_eq!((b8.vocab, b8.rms_eps, b8.rope_theta), (128256, 1e-5, 500000.0));
        assert_eq!(b8.rope_scaling.unwrap().factor, 8.0);
        assert_eq!(b8.qkv_width(), 6144);
        let b70 = LlamaConfig::preset("llama-3.1-70b").unwrap();
        assert_eq!(
            (b70.hidden, b70.layers, b70.heads, b70.kv_heads, b70.head_dim, b70.ffn, b70.vocab),
            (8192, 80, 64, 8, 128, 28672, 128256)
        );
        // 70.55 billion parameters (Hugging Face's count for Llama-3.1-70B): 141.1 GB in bf16.
        assert_eq!(b70.parameters(), 70_553_706_496);
        assert_eq!(
            (b70.rope_scaling, b70.tie_embeddings, b70.rope_theta),
            (b8.rope_scaling, false, 500000.0)
        );
        // SmolLM2-135M: 134,515,008 parameters (Hugging Face's count), the shapes of its GGUF
        // (`tests/fixtures/smollm2_gguf.json`).
        let smol = LlamaConfig::smollm2_135m();
        assert_eq!(smol.parameters(), 134_515_008);
        assert_eq!(
            (smol.layers, smol.hidden, smol.ffn, smol.heads, smol.kv_heads, smol.vocab, smol.max_positions),
            (30, 576, 1536, 9, 3, 49152, 8192)
        );
        assert_eq!((smol.rope_theta, smol.rope_scaling, smol.tie_embeddings), (100000.0, None, true));
        for name in PRESETS {
            LlamaConfig::preset(name).unwrap().check().unwrap();
        }
        assert_eq!(LlamaConfig::llama_3_1_8b().with_layers(4).layers, 4);
        let e = LlamaConfig::preset("llama-2-7b").unwrap_err().to_string();
        assert!(
            e.contains("llama-2-7b")
                && e.contains("smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, tiny"),
            "{e}"
        );
    }

    /// Llama-3.2-1B's `config.json` as transformers 4.x writes it.
    const HF4: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "vocab_size": 128256, "tie_word_embeddings": true, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
        "attention_bias": false, "attention_dropout": 0.0, "mlp_bias": false, "pretraining_tp": 1,
        "initializer_range": 0.02, "use_cache": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0"
    }"#;

    /// The same model as transformers 5.x writes it: `rope_parameters`, no `rope_theta`/`rope_scaling`.
    const HF5: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05, "vocab_size": 128256,
        "tie_word_embeddings": true, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
        "dtype": "bfloat16", "transformers_version": "5.0.0"
    }"#;

    fn edit(json: &str, f: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut v: Value = serde_json::from_str(json).unwrap();
        f(v.as_object_mut().unwrap());
        v.to_string()
    }

    fn hf_err(json: &str) -> String {
        LlamaConfig::from_hf_json("m", json).unwrap_err().to_string()
    }

    #[test]
    fn reads_a_transformers_4_config() {
        let cfg = LlamaConfig::from_hf_json("llama-3.2-1b", HF4).unwrap();
        assert_eq!(cfg, LlamaConfig::llama_3_2_1b());
        // rope_scaling with the legacy `type`, or null; a single eos id.
        let legacy = edit(HF4, |m| {
            let s = m["rope_scaling"].as_object_mut().unwrap();
            let t = s.remove("rope_type").unwrap();
            s.insert("type".into(), t);
        });
        assert_eq!(LlamaConfig::from_hf_json("llama-3.2-1b", &legacy).unwrap(), cfg);
        let plain = edit(HF4, |m| {
            m.insert("rope_scaling".into(), Value::Null);
            m.insert("rope_theta".into(), 10000.0.into());
            m.insert("eos_token_id".into(), 128001.into());
        });
        let p = LlamaConfig::from_hf_json("m", &plain).unwrap();
        assert_eq!((p.rope_theta, p.rope_scaling, p.eos_token_ids), (10000.0, None, vec![128001]));
        // No theta anywhere, no max_position_embeddings, no head_dim or num_key_value_heads:
        // transformers' defaults.
        let bare = edit(HF4, |m| {
            for k in
                ["rope_theta", "rope_scaling", "max_position_embeddings", "head_dim", "num_key_value_heads"]
            {
                m.remove(k);
            }
        });
        let b = LlamaConfig::from_hf_json("m", &bare).unwrap();
        assert_eq!((b.rope_theta, b.rope_scaling, b.max_positions), (10000.0, None, 2048));
        assert_eq!((b.head_dim, b.kv_heads), (64, 32));
        // An explicit head_dim need not divide the hidden size.
        let wide = edit(HF4, |m| {
            m.insert("head_dim".into(), 128.into());
        });
        let w = LlamaConfig::from_hf_json("m", &wide).unwrap();
        assert_eq!((w.head_dim, w.attn_width(), w.hidden), (128, 4096, 2048));
    }

    #[test]
    fn reads_a_transformers_5_config() {
        let cfg = LlamaConfig::from_hf_json("llama-3.2-1b", HF5).unwrap();
        assert_eq!(cfg, LlamaConfig::llama_3_2_1b());
        let default = edit(HF5, |m| {
            m.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_type": "default", "rope_theta": 20000.0}),
            );
        });
        let d = LlamaConfig::from_hf_json("m", &default).unwrap();
        assert_eq!((d.rope_theta, d.rope_scaling), (20000.0, None));
        // Both forms, agreeing.
        let both = edit(HF5, |m| {
            m.insert("rope_theta".into(), 500000.0.into());
            m.insert("rope_scaling".into(), m["rope_parameters"].clone());
        });
        assert_eq!(LlamaConfig::from_hf_json("llama-3.2-1b", &both).unwrap(), cfg);
        let theta_only = edit(HF5, |m| {
            m.insert("rope_theta".into(), 500000.0.into());
        });
        assert_eq!(LlamaConfig::from_hf_json("llama-3.2-1b", &theta_only).unwrap(), cfg);
    }

    #[test]
    fn disagreeing_rope_forms_are_errors() {
        let theta = edit(HF5, |m| {
            m.insert("rope_theta".into(), 10000.0.into());
        });
        let e = hf_err(&theta);
        assert!(e.contains("`rope_theta` 10000 disagrees with `rope_parameters.rope_theta` 500000"), "{e}");
        let scaling = edit(HF5, |m| {
            let mut s = m["rope_parameters"].clone();
            s["factor"] = 8.0.into();
            m.insert("rope_scaling".into(), s);
        });
        let e = hf_err(&scaling);
        assert!(
            e.contains("`rope_scaling` (llama3, factor 8") && e.contains("disagrees with `rope_parameters`"),
            "{e}"
        );
        let null = edit(HF5, |m| {
            m.insert("rope_scaling".into(), Value::Null);
        });
        assert!(hf_err(&null).contains("`rope_scaling` (no scaling) disagrees"), "{}", hf_err(&null));
        let inner = edit(HF4, |m| {
            m["rope_scaling"]["rope_theta"] = 10000.0.into();
        });
        assert!(hf_err(&inner).contains("`rope_theta` 500000 disagrees with `rope_scaling.rope_theta` 10000"));
        let types = edit(HF4, |m| {
            m["rope_scaling"]["type"] = "yarn".into();
        });
        assert!(hf_err(&types)
            .contains("`rope_scaling.rope_type` `llama3` disagrees with `rope_scaling.type` `yarn`"));
    }

    /// serde keeps the last of a key given twice: an ambiguous config.json is an error naming the key,
    /// at the top level and inside `rope_scaling`.
    #[test]
    fn a_key_given_twice_is_an_error_naming_it() {
        let twice = HF4.replacen("{", "{\n  \"hidden_size\": 128,", 1);
        assert!(hf_err(&twice).contains("`hidden_size` is given twice"), "{}", hf_err(&twice));
        let nested = HF4.replacen("\"rope_scaling\": {", "\"rope_scaling\": {\"factor\": 1.0, ", 1);
        assert_ne!(nested, HF4);
        assert!(hf_err(&nested).contains("`factor` is given twice"), "{}", hf_err(&nested));
    }

    #[test]
    fn fp8_quantization_configs_load_and_what_else_they_ask_is_refused_by_name() {
        let with = |q: Value| {
            edit(HF4, |m| {
                m.insert("quantization_config".into(), q);
            })
        };
        let ct = |weights: Value, inputs: Value| {
            serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                    "output_activations": null}}})
        };
        let channel = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false});
        let per_token =
            serde_json::json!({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true});
        let cfg = LlamaConfig::from_hf_json("m", &with(ct(channel.clone(), per_token.clone()))).unwrap();
        let q = cfg.fp8.expect("an FP8 checkpoint");
        assert_eq!(
            (q.method, q.factors, q.static_activations),
            ("compressed-tensors", Fp8Factors::PerChannel, false)
        );
        assert_eq!(q.factor_name("a.weight"), "a.weight_scale");
        assert_eq!(q.factor_shapes(6, 4), vec![vec![6, 1], vec![6]]);
        let tensor = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "tensor"});
        let static_in =
            serde_json::json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false});
        let q = LlamaConfig::from_hf_json("m", &with(ct(tensor, static_in))).unwrap().fp8.unwrap();
        assert_eq!((q.factors, q.static_activations), (Fp8Factors::PerTensor, true));
        assert!(q.describe().contains("static input scales are not read"), "{}", q.describe());
        let blocks = serde_json::json!({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 64]});
        let q = LlamaConfig::from_hf_json("m", &with(blocks)).unwrap().fp8.unwrap();
        assert_eq!(q.factors, Fp8Factors::Blocks { rows: 128, cols: 64 });
        assert_eq!(
            (q.factor_name("w"), q.factor_shapes(300, 64)),
            ("w_scale_inv".to_string(), vec![vec![3, 1]])
        );
        // A 16-bit checkpoint has none.
        assert_eq!(LlamaConfig::from_hf_json("m", HF4).unwrap().fp8, None);
        let int8 = serde_json::json!({"num_bits": 8, "type": "int", "strategy": "channel"});
        let group =
            serde_json::json!({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128});
        let asym =
            serde_json::json!({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": false});
        for (q, expected) in [
            (ct(int8, Value::Null), "only 8-bit float (FP8) weights"),
            (ct(group, Value::Null), "strategy group: only `tensor` and `channel`"),
            (ct(asym, Value::Null), "asymmetric or dynamic weights"),
            (
                ct(
                    channel.clone(),
                    serde_json::json!({"num_bits": 8, "type": "float", "strategy": "group", "dynamic": true}),
                ),
                "input_activations: dynamic Some(true) strategy Some(\"group\")",
            ),
            (
                {
                    let mut q = ct(channel.clone(), per_token.clone());
                    q["kv_cache_scheme"] = serde_json::json!({"num_bits": 8, "type": "float"});
                    q
                },
                "`kv_cache_scheme` is not supported",
            ),
            (
                {
                    let mut q = ct(channel.clone(), per_token.clone());
                    q["format"] = "pack-quantized".into();
                    q
                },
                "format `pack-quantized`",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}),
                "activation_scheme `static`",
            ),
            (serde_json::json!({"quant_method": "fp8"}), "`weight_block_size` null"),
        ] {
            let e = hf_err(&with(q));
            assert!(e.contains(expected), "{e} (expected `{expected}`)");
        }
    }

    #[test]
    fn unsupported_keys_are_errors_naming_the_key() {
        let set = |json: &str, key: &str, v: Value| {
            edit(json, |m| {
                m.insert(key.into(), v);
            })
        };
        for (json, expected) in [
            (set(HF4, "model_type", "mistral".into()), "`model_type` `mistral`"),
            (
                set(HF4, "architectures", serde_json::json!(["LlamaForSequenceClassification"])),
                "`architectures`",
            ),
            (set(HF4, "attention_bias", true.into()), "`attention_bias` true"),
            (set(HF4, "mlp_bias", true.into()), "`mlp_bias` true"),
            (set(HF4, "hidden_act", "gelu".into()), "`hidden_act` `gelu`"),
            (set(HF4, "sliding_window", 4096.into()), "`sliding_window` 4096"),
            (
                set(HF4, "quantization_config", serde_json::json!({"quant_method": "awq"})),
                "`quantization_config` quant_method `awq`: this quantization scheme is not supported",
            ),
            (
                set(
                    HF4,
                    "quantization_config",
                    serde_json::json!({"quant_method": "fp8", "weight_block_size": [128]}),
                ),
                "`weight_block_size` [128]: two positive block dims are needed",
            ),
            (
                set(
                    HF4,
                    "quantization_config",
                    serde_json::json!({"quant_method": "compressed-tensors",
                        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}),
                ),
                "only `Linear` targets are supported",
            ),
            (
                set(HF4, "quantization_config", serde_json::json!({"bits": 4})),
                "`quantization_config` without a quant_method",
            ),
            (set(HF4, "pretraining_tp", 2.into()), "`pretraining_tp` 2"),
            (set(HF4, "partial_rotary_factor", 0.5.into()), "`partial_rotary_factor` 0.5"),
            (
                set(HF4, "num_hidden_layers", "16".into()),
                "`num_hidden_layers` \"16\" is not a non-negative integer",
            ),
            (set(HF4, "eos_token_id", (-1).into()), "`eos_token_id` -1 is not a token id"),
            (set(HF4, "rope_scaling", 1.0.into()), "`rope_scaling` 1.0 is not an object"),
            (
                edit(HF4, |m| {
                    m.remove("vocab_size");
                }),
                "`vocab_size` is missing",
            ),
            (
                edit(HF4, |m| {
                    m["rope_scaling"]["rope_type"] = "yarn".into();
                }),
                "`rope_scaling.rope_type` `yarn` is not supported",
            ),
            (
                edit(HF4, |m| {
                    m["rope_scaling"]["rope_type"] = "dynamic".into();
                }),
                "`dynamic`",
            ),
            (
                edit(HF4, |m| {
                    m["rope_scaling"].as_object_mut().unwrap().remove("rope_type");
                }),
                "`rope_scaling.rope_type` is missing",
            ),
            (
                edit(HF4, |m| {
                    m["rope_scaling"].as_object_mut().unwrap().remove("factor");
                }),
                "`rope_scaling.factor` is missing",
            ),
            (
                edit(HF4, |m| {
                    m["rope_scaling"]["mscale"] = 1.0.into();
                }),
                "`rope_scaling.mscale` is not supported",
            ),
            (
                edit(HF5, |m| {
                    m["rope_parameters"]["rope_type"] = "linear".into();
                }),
                "`rope_parameters.rope_type` `linear`",
            ),
            (
                edit(HF5, |m| {
                    m["rope_parameters"]["rope_type"] = "longrope".into();
                }),
                "`longrope`",
            ),
            (
                edit(HF5, |m| {
                    m["rope_parameters"]["partial_rotary_factor"] = 0.5.into();
                }),
                "`rope_parameters.partial_rotary_factor` 0.5",
            ),
            (
                edit(HF5, |m| {
                    m["rope_parameters"].as_object_mut().unwrap().remove("rope_type");
                }),
                "`rope_parameters.rope_type` is missing",
            ),
            // transformers 5 has no legacy `type`.
            (
                edit(HF5, |m| {
                    m["rope_parameters"]["type"] = "llama3".into();
                }),
                "`rope_parameters.type` is not supported",
            ),
            (
                edit(HF5, |m| {
                    m["rope_parameters"]["rope_theta"] = 0.0.into();
                }),
                "rope_theta 0 is not a finite positive number",
            ),
        ] {
            let e = hf_err(&json);
            assert!(e.starts_with("config: m: ") && e.contains(expected), "{expected}: {e}");
        }
        // Harmless keys and nulls are fine.
        let ok = edit(HF4, |m| {
            m.insert("sliding_window".into(), Value::Null);
            m.insert("attention_dropout".into(), 0.1.into());
            m.insert("pad_token_id".into(), Value::Null);
            m.insert("partial_rotary_factor".into(), 1.0.into());
            m.remove("model_type");
            m.remove("architectures");
        });
        LlamaConfig::from_hf_json("m", &ok).unwrap();
        assert!(LlamaConfig::from_hf_json("m", "{").is_err());
        assert!(hf_err("[1]").contains("expected a JSON object"));
        let bad = HF4.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5");
        assert!(hf_err(&bad).contains("multiple of kv_heads"));
    }

    #[test]
    fn from_dir_reads_config_json() {
        let dir =
            std::env::temp_dir().join(format!("llama-config-{}", std::process::id())).join("Llama-3.2-1B");
        std::fs::create_dir_all(&dir).unwrap();
        let e = LlamaConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        std::fs::write(dir.join("config.json"), HF5).unwrap();
        let cfg = LlamaConfig::from_dir(&dir).unwrap();
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
        assert_eq!(cfg, LlamaConfig { name: "Llama-3.2-1B".into(), ..LlamaConfig::llama_3_2_1b() });
    }

    #[test]
    fn check_bounds_sizes_so_derived_sizes_cannot_overflow() {
        let base = LlamaConfig::tiny();
        let with = |f: &dyn Fn(&mut LlamaConfig)| {
            let mut c = base.clone();
            f(&mut c);
            c.check().map(|_| c).map_err(|e| e.to_string())
        };
        for (f, expected) in [
            (
                &(|c: &mut LlamaConfig| c.heads = 1 << 61) as &dyn Fn(&mut LlamaConfig),
                "heads 2305843009213693952 is above",
            ),
            (
                &|c| {
                    c.heads = 1 << 20;
                    c.kv_heads = 1 << 20
                },
                "QKV width",
            ),
            (&|c| c.layers = usize::MAX, "layers 18446744073709551615 is above"),
            (&|c| c.vocab = usize::MAX, "vocab"),
            (
                &|c| {
                    c.vocab = 1 << 24;
                    c.hidden = 1 << 10
                },
                "embedding (vocab × hidden) tensor",
            ),
            (
                &|c| {
                    c.ffn = 1 << 20;
                    c.hidden = 1 << 12
                },
                "MLP projection",
            ),
            (&|c| c.head_dim = usize::MAX - 7, "head_dim"),
            (&|c| c.max_positions = 0, "max_positions is 0"),
            (&|c| c.max_positions = usize::MAX, "max_positions"),
        ] {
            let e = with(f).unwrap_err();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        // The largest accepted shape's derived sizes are computable.
        let big = with(&|c| {
            c.vocab = MAX_TENSOR_ELEMENTS / (1 << 14);
            c.hidden = 1 << 14;
            c.layers = MAX_LAYERS;
            c.ffn = MAX_TENSOR_ELEMENTS / (1 << 14);
        })
        .unwrap();
        assert!(big.parameters() > big.layers * big.hidden * big.ffn * 3);
        // (Its tensor names: `weights`' tests.)
        // Unchecked configs saturate instead of overflowing.
        let huge = LlamaConfig { heads: 1 << 61, ..base };
        assert_eq!((huge.qkv_width(), huge.parameters()), (usize::MAX, usize::MAX));
    }

    #[test]
    fn check_refuses_rope_and_eps_values_that_make_nan_tables() {
        let base = LlamaConfig::tiny();
        let s = base.rope_scaling.unwrap();
        let scaled = |f: &dyn Fn(&mut RopeScaling)| {
            let mut r = s;
            f(&mut r);
            LlamaConfig { rope_scaling: Some(r), ..base.clone() }
        };
        for (cfg, expected) in [
            (LlamaConfig { rope_theta: 0.0, ..base.clone() }, "rope_theta 0"),
            (LlamaConfig { rope_theta: -1.0, ..base.clone() }, "rope_theta -1"),
            (LlamaConfig { rope_theta: f64::NAN, ..base.clone() }, "rope_theta NaN"),
            (LlamaConfig { rope_theta: f64::INFINITY, ..base.clone() }, "rope_theta inf"),
            (scaled(&|r| r.factor = 0.0), "rope_scaling.factor 0"),
            (scaled(&|r| r.factor = 0.5), "rope_scaling.factor 0.5"),
            (scaled(&|r| r.factor = f64::NAN), "rope_scaling.factor NaN"),
            (scaled(&|r| r.low_freq_factor = 0.0), "rope_scaling.low_freq_factor 0"),
            (scaled(&|r| r.low_freq_factor = -1.0), "rope_scaling.low_freq_factor -1"),
            (scaled(&|r| r.high_freq_factor = 1.0), "rope_scaling.high_freq_factor 1"),
            (scaled(&|r| r.high_freq_factor = 0.5), "rope_scaling.high_freq_factor 0.5"),
            (scaled(&|r| r.high_freq_factor = f64::INFINITY), "rope_scaling.high_freq_factor inf"),
            (scaled(&|r| r.original_max_position = 0), "original_max_position_embeddings is 0"),
            (LlamaConfig { rms_eps: 0.0, ..base.clone() }, "rms_eps 0e0"),
            (LlamaConfig { rms_eps: -1e-5, ..base.clone() }, "rms_eps -1e-5"),
            (LlamaConfig { rms_eps: 1e-40, ..base.clone() }, "rms_eps 1e-40"),
            (LlamaConfig { rms_eps: 0.5, ..base.clone() }, "rms_eps 5e-1"),
            (LlamaConfig { rms_eps: f64::NAN, ..base.clone() }, "rms_eps NaN"),
            (LlamaConfig { eos_token_ids: vec![1, 512], ..base.clone() }, "eos_token_id 512 is outside"),
            (LlamaConfig { bos_token_id: Some(600), ..base.clone() }, "bos_token_id 600 is outside"),
        ] {
            let e = cfg.check().unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        // (That the values it accepts give finite tables: `rope`'s tests.)
    }
}
