//! Model shapes: the Llama-3.2-1B and Llama-3.1-8B presets, a tiny one for tests, and Hugging Face's
//! `config.json`.

use crate::{Error, Result};
use serde::Deserialize;

/// Llama-3's RoPE frequency scaling (`rope_scaling` with `rope_type: llama3` in Hugging Face configs).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
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

/// The shape of a Llama-3 decoder.
#[derive(Debug, Clone, PartialEq)]
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
}

/// Names [`LlamaConfig::preset`] accepts.
pub const PRESETS: [&str; 3] = ["llama-3.2-1b", "llama-3.1-8b", "tiny"];

impl LlamaConfig {
    /// Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, head dim 64, FFN 8192, tied embeddings.
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
        }
    }

    /// Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, head dim 128, FFN 14336.
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
        }
    }

    /// A model small enough for an f64 CPU reference: hidden 128, 2 layers, 4 heads, 2 KV heads, head
    /// dim 32, FFN 256, vocabulary 512, Llama-3 RoPE scaling.
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
            ..LlamaConfig::llama_3_1_8b()
        }
    }

    /// A preset by name (one of [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "llama-3.2-1b" => Ok(Self::llama_3_2_1b()),
            "llama-3.1-8b" => Ok(Self::llama_3_1_8b()),
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

    /// Reads a Hugging Face `config.json` (`LlamaForCausalLM`).
    pub fn from_hf_json(name: &str, json: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Hf {
            hidden_size: usize,
            num_hidden_layers: usize,
            num_attention_heads: usize,
            num_key_value_heads: Option<usize>,
            head_dim: Option<usize>,
            intermediate_size: usize,
            vocab_size: usize,
            rms_norm_eps: f64,
            rope_theta: Option<f64>,
            rope_scaling: Option<serde_json::Value>,
            tie_word_embeddings: Option<bool>,
        }
        let hf: Hf =
            serde_json::from_str(json).map_err(|e| Error::Config(format!("{name}: config.json: {e}")))?;
        let rope_scaling = match hf.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let kind =
                    v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                if kind != "llama3" {
                    return Err(Error::Config(format!(
                        "{name}: rope_scaling type `{kind}` is not supported (llama3 only)"
                    )));
                }
                Some(
                    serde_json::from_value(v)
                        .map_err(|e| Error::Config(format!("{name}: rope_scaling: {e}")))?,
                )
            }
        };
        let cfg = LlamaConfig {
            name: name.to_string(),
            hidden: hf.hidden_size,
            layers: hf.num_hidden_layers,
            heads: hf.num_attention_heads,
            kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            ffn: hf.intermediate_size,
            vocab: hf.vocab_size,
            rms_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta.unwrap_or(10000.0),
            rope_scaling,
            tie_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// Checks that the shape is one this crate runs: heads divisible by KV heads, head dim a multiple
    /// of 8 (fused attention) and even (RoPE), everything non-zero.
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
        ] {
            if v == 0 {
                return fail(format!("{what} is 0"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return fail(format!("heads {} is not a multiple of kv_heads {}", self.heads, self.kv_heads));
        }
        if !self.head_dim.is_multiple_of(8) {
            return fail(format!("head_dim {} is not a multiple of 8", self.head_dim));
        }
        Ok(())
    }

    /// Width of the fused QKV projection: `(heads + 2 · kv_heads) · head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Width of the attention output: `heads · head_dim`.
    pub fn attn_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Parameters, lm_head included (once when tied).
    pub fn parameters(&self) -> usize {
        let per_layer = 2 * self.hidden
            + self.hidden * self.qkv_width()
            + self.attn_width() * self.hidden
            + 3 * self.hidden * self.ffn;
        let head = if self.tie_embeddings { 0 } else { self.vocab * self.hidden };
        self.vocab * self.hidden + self.layers * per_layer + self.hidden + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for name in PRESETS {
            LlamaConfig::preset(name).unwrap().check().unwrap();
        }
        assert_eq!(LlamaConfig::llama_3_1_8b().with_layers(4).layers, 4);
        let e = LlamaConfig::preset("llama-2-7b").unwrap_err().to_string();
        assert!(e.contains("llama-2-7b") && e.contains("llama-3.2-1b, llama-3.1-8b, tiny"), "{e}");
    }

    #[test]
    fn reads_a_hugging_face_config() {
        let json = r#"{
            "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
            "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256, "tie_word_embeddings": true,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "torch_dtype": "bfloat16"
        }"#;
        let cfg = LlamaConfig::from_hf_json("llama-3.2-1b", json).unwrap();
        assert_eq!(cfg, LlamaConfig::llama_3_2_1b());
        let bad = json.replace("\"llama3\"", "\"yarn\"");
        assert!(LlamaConfig::from_hf_json("m", &bad).unwrap_err().to_string().contains("yarn"));
        let bad = json.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5");
        assert!(LlamaConfig::from_hf_json("m", &bad)
            .unwrap_err()
            .to_string()
            .contains("multiple of kv_heads"));
        assert!(LlamaConfig::from_hf_json("m", "{").is_err());
    }
}
