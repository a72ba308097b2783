//! Command-line options of `speedup-report` (parsed with clap; checked without a GPU).

use clap::Parser;
use cudnn_llm_llama::tp::ShardPlan;
use cudnn_llm_llama::{Backends, LlamaConfig};
use cudnn_llm_ops::{DataType, WeightScales};
use std::path::PathBuf;

/// What to run and where to write the report.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(name = "speedup-report", about = "Per-module speedup of fused cuDNN graphs over naive kernels")]
pub struct Options {
    /// Model preset, with random weights: smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b or tiny.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub config: String,
    /// A Hugging Face checkpoint directory to run instead of a preset: its config.json, and
    /// model.safetensors or model.safetensors.index.json with the shards it names. Or a llama.cpp
    /// `.gguf` file (its config and dequantized weights; the one-GPU report only).
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    pub model: Option<PathBuf>,
    /// Decoder layers (default: the model's). With --model, the first LAYERS layers of the checkpoint
    /// (at most as many as it has).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Prompt tokens per sequence (the prefill scenario); --seq + --decode-steps is at most the
    /// model's max_position_embeddings.
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    /// Decode steps after the prefill (0: no decode scenario).
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Modules to fuse, e.g. `fused=all` or `fused=prenorm,gqa` (compared with all naive).
    #[arg(long, default_value = "fused=all")]
    pub fuse: String,
    /// I/O dtype: bf16 or f16; or fp8: bf16 with every layer's projections in FP8 E4M3, a factor
    /// per output channel (`Llama::quantize_to_fp8`: fused, the decode GEMV over the codes and FP8
    /// GEMMs over activations quantized per token; naive, the weights dequantized and cuBLAS); or
    /// fp8-tensor: the same with one factor per weight and per activation tensor.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Untimed forwards before measuring.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed forwards (medians are reported).
    #[arg(long, default_value_t = 10)]
    pub repeat: usize,
    /// Directory for report.md, report.csv, report.json and report.svg (report-train.* with
    /// --train).
    #[arg(long, default_value = "benches/results")]
    pub out: PathBuf,
    /// Report a training step instead of inference: --batch sequences of --seq tokens through the
    /// forward, the loss, the backward (`bwd.` rows) and AdamW (`opt.` rows), each phase's kernel
    /// total against its CUDA-event time; bf16; --decode-steps does not apply. --warmup and
    /// --repeat count steps.
    #[arg(long)]
    pub train: bool,
    /// Tensor parallelism: run the model split over N GPUs of this host (GPUs 0..N, one thread,
    /// `Cudnn` context and NCCL communicator each; `cudnn_llm_llama::tp`), fused vs naive per module
    /// with rows per rank (each rank's kernels, told apart by CUPTI's device id), the all-reduce
    /// ranges included, and the scaling against a one-GPU run of the same model in the same process.
    /// Writes report-tpN.{md,csv,json,svg}. NCCL is loaded at run time (NCCL_LIBRARY names it).
    #[arg(long, value_name = "N")]
    pub tp: Option<usize>,
    /// With --tp: leave out the one-GPU run (a model one GPU cannot hold, e.g. llama-3.1-70b); the
    /// report then has no scaling line.
    #[arg(long)]
    pub no_baseline: bool,
}

/// The options, checked and resolved.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The model shape.
    pub config: LlamaConfig,
    /// The checkpoint directory or GGUF file to load weights from (`--model`); `None`: random weights.
    pub model_dir: Option<PathBuf>,
    /// `--seq + --decode-steps`: the positions the KV cache and RoPE tables hold (`--seq` with
    /// `--train`).
    pub max_seq: usize,
    /// Forwards the progress bar counts: per scenario and selection, two checks plus warm-up and
    /// measured forwards. With `--train`, steps: per selection a cold and a warm one, the warm-up,
    /// and the measured steps twice (traced, then untraced).
    pub forwards: usize,
    /// The fused selection.
    pub fused: Backends,
    /// The I/O dtype.
    pub dtype: DataType,
    /// `--dtype fp8` or `fp8-tensor`: the projections in FP8 with these factors (the I/O dtype bf16).
    pub fp8: Option<WeightScales>,
    /// `--tp`: the ranks the model is split over (`None`: one GPU, no tensor parallelism).
    pub tp: Option<usize>,
}

impl Options {
    /// Resolves the model (a preset, or `--model`'s config.json), layer count, sizes, backend
    /// selection and dtype; errors say what is wrong and name the option. Reads no weights.
    pub fn resolve(&self) -> Result<Resolved, String> {
        let mut config = match &self.model {
            Some(file) if cudnn_llm_llama::gguf::is_gguf_path(file) => {
                if self.tp.is_some() || self.train {
                    return Err(format!(
                        "--model {}: a GGUF file runs the one-GPU report only",
                        file.display()
                    ));
                }
                let g = cudnn_llm_llama::gguf::Gguf::open(file).map_err(|e| format!("--model: {e}"))?;
                g.config().map_err(|e| format!("--model: {e}"))?
            }
            Some(dir) => LlamaConfig::from_dir(dir).map_err(|e| format!("--model {}: {e}", dir.display()))?,
            None => LlamaConfig::preset(&self.config).map_err(|e| e.to_string())?,
        };
        if let Some(l) = self.layers {
            if l == 0 {
                return Err("--layers must be at least 1".into());
            }
            if let Some(dir) = self.model.as_ref().filter(|_| l > config.layers) {
                return Err(format!(
                    "--layers {l} is more than the {} layers of --model {}",
                    config.layers,
                    dir.display()
                ));
            }
            config = config.with_layers(l);
            config.check().map_err(|e| format!("--layers {l}: {e}"))?;
        }
        if self.batch == 0 || self.seq == 0 {
            return Err("--batch and --seq must be at least 1".into());
        }
        if self.repeat == 0 {
            return Err("--repeat must be at least 1".into());
        }
        if let Some(n) = self.tp {
            self.check_tp(&config, n)?;
        } else if self.no_baseline {
            return Err("--no-baseline applies to --tp only".into());
        }
        if self.train {
            return self.resolve_train(config);
        }
        let max_seq =
            self.seq.checked_add(self.decode_steps).filter(|&n| n <= config.max_positions).ok_or_else(
                || {
                    format!(
                        "--seq {} + --decode-steps {} is more than the model's {} positions",
                        self.seq, self.decode_steps, config.max_positions
                    )
                },
            )?;
        // The widest activation (and the logits) must be addressable: batch · positions · width
        // elements within i64 (what cuDNN's tensor sizes take) and usize.
        let widest =
            [config.hidden, config.ffn, config.qkv_width(), config.vocab].into_iter().max().unwrap_or(0);
        if self
            .batch
            .checked_mul(max_seq)
            .and_then(|t| t.checked_mul(widest))
            .is_none_or(|n| i64::try_from(n).is_err())
        {
            return Err(format!(
                "--batch {} x (--seq {} + --decode-steps {}) tokens x width {widest} overflows",
                self.batch, self.seq, self.decode_steps
            ));
        }
        let scenarios = if self.decode_steps > 0 { 2 } else { 1 };
        let forwards = self
            .warmup
            .checked_add(self.repeat)
            .and_then(|n| n.checked_add(2))
            .and_then(|n| n.checked_mul(2 * scenarios))
            .filter(|_| self.repeat.checked_mul(self.decode_steps.max(1)).is_some())
            .ok_or_else(|| {
                format!(
                    "--warmup {} and --repeat {} (x --decode-steps {}) overflow the forward count",
                    self.warmup, self.repeat, self.decode_steps
                )
            })?;
        let fused = Backends::parse_for(&self.fuse, config.layers).map_err(|e| format!("--fuse: {e}"))?;
        let (dtype, fp8) = parse_dtype(&self.dtype)?;
        if fp8.is_some() && self.tp.is_some() {
            return Err("--dtype fp8 runs the one-GPU report: leave out --tp".into());
        }
        Ok(Resolved {
            config,
            model_dir: self.model.clone(),
            max_seq,
            forwards,
            fused,
            dtype,
            fp8,
            tp: self.tp,
        })
    }

    /// `--tp n`'s conditions that hold without a GPU: at least one rank, an inference report, and a
    /// model that splits over `n` ranks ([`ShardPlan::new`]). More ranks than GPUs, or NCCL missing,
    /// is an error of the run.
    fn check_tp(&self, config: &LlamaConfig, n: usize) -> Result<(), String> {
        if n == 0 {
            return Err("--tp 0: give the number of GPUs to split the model over (1 or more)".into());
        }
        if self.train {
            return Err(format!(
                "--tp {n} cannot be combined with --train: the training report runs on one GPU"
            ));
        }
        ShardPlan::new(config, n).map(drop).map_err(|e| format!("--tp {n}: {e}"))
    }

    /// The rest of [`Options::resolve`] for `--train`: bf16, a step of a multiple of 8 tokens (the
    /// weight gradients' GEMMs) within the model's positions.
    fn resolve_train(&self, config: LlamaConfig) -> Result<Resolved, String> {
        if DataType::parse(&self.dtype) != Some(DataType::BF16) {
            return Err(format!("--train takes --dtype bf16 (the trainer's weights), not {}", self.dtype));
        }
        if self.seq < 2 {
            return Err("--train: --seq must be at least 2 (each token predicts the next)".into());
        }
        if self.seq > config.max_positions {
            return Err(format!(
                "--train: --seq {} is more than the model's {} positions",
                self.seq, config.max_positions
            ));
        }
        let widest =
            [config.hidden, config.ffn, config.qkv_width(), config.vocab].into_iter().max().unwrap_or(0);
        let tokens = self.batch.checked_mul(self.seq);
        if tokens.and_then(|t| t.checked_mul(widest)).is_none_or(|n| i64::try_from(n).is_err()) {
            return Err(format!(
                "--batch {} x --seq {} tokens x width {widest} overflows",
                self.batch, self.seq
            ));
        }
        let tokens = tokens.unwrap_or(0);
        if !tokens.is_multiple_of(8) {
            return Err(format!(
                "--train: --batch {} x --seq {} = {tokens} tokens: the weight gradients need a multiple of 8",
                self.batch, self.seq
            ));
        }
        let forwards = self
            .repeat
            .checked_mul(2)
            .and_then(|n| n.checked_add(self.warmup))
            .and_then(|n| n.checked_add(2))
            .and_then(|n| n.checked_mul(2))
            .ok_or_else(|| {
                format!("--warmup {} and --repeat {} overflow the step count", self.warmup, self.repeat)
            })?;
        let fused = Backends::parse_for(&self.fuse, config.layers).map_err(|e| format!("--fuse: {e}"))?;
        Ok(Resolved {
            config,
            model_dir: self.model.clone(),
            max_seq: self.seq,
            forwards,
            fused,
            dtype: DataType::BF16,
            fp8: None,
            tp: None,
        })
    }
}

/// A `--dtype` of the report and `generate`: `bf16` or `f16`; `fp8` (bf16 activations, every layer's
/// projections in E4M3 with a factor per output channel, prefill activations per token) or
/// `fp8-tensor` (one factor per weight and per activation tensor: cuDNN's fastest FP8 engine, less
/// accurate). The I/O dtype and, for the FP8 forms, the weights' factors.
pub fn parse_dtype(s: &str) -> Result<(DataType, Option<WeightScales>), String> {
    match s.trim() {
        "fp8" => Ok((DataType::BF16, Some(WeightScales::PerChannel))),
        "fp8-tensor" => Ok((DataType::BF16, Some(WeightScales::PerTensor))),
        other => match DataType::parse(other) {
            Some(d @ (DataType::BF16 | DataType::F16)) => Ok((d, None)),
            _ => Err(format!("--dtype {s} is not supported: use bf16, f16, fp8 or fp8-tensor")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from(std::iter::once("speedup-report").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_are_the_8b_prefill_all_fused() {
        let o = parse(&[]).unwrap();
        assert_eq!(
            (o.config.as_str(), o.batch, o.seq, o.decode_steps, o.fuse.as_str()),
            ("llama-3.1-8b", 1, 2048, 16, "fused=all")
        );
        let p = o.resolve().unwrap();
        assert_eq!(p.config.layers, 32);
        assert_eq!(p.dtype, DataType::BF16);
        assert_eq!(p.fused, Backends::all(cudnn_llm_llama::Backend::Fused));
    }

    #[test]
    fn options_parse_and_resolve() {
        let o = parse(&[
            "--config",
            "llama-3.2-1b",
            "--layers",
            "4",
            "--batch",
            "3",
            "--seq",
            "10",
            "--fuse",
            "fused=prenorm,gqa",
            "--dtype",
            "f16",
            "--out",
            "/tmp/r",
        ])
        .unwrap();
        let p = o.resolve().unwrap();
        assert_eq!((p.config.hidden, p.config.layers), (2048, 4));
        assert_eq!(p.dtype, DataType::F16);
        assert_eq!(p.fused.to_selection(), "fused=prenorm,gqa");
        assert_eq!(o.out, PathBuf::from("/tmp/r"));
    }

    #[test]
    fn sizes_that_overflow_are_errors_naming_the_option() {
        let max = usize::MAX.to_string();
        for (args, expected) in [
            (vec!["--seq", &max, "--decode-steps", "1"], "--seq 18446744073709551615 + --decode-steps 1"),
            (vec!["--seq", "2048", "--decode-steps", &max], "--decode-steps 18446744073709551615"),
            (vec!["--seq", "131072", "--decode-steps", "1"], "more than the model's 131072 positions"),
            (vec!["--batch", &max], "--batch 18446744073709551615 x (--seq 2048 + --decode-steps 16)"),
            (vec!["--batch", "100000000000"], "--batch 100000000000 x"),
            (vec!["--warmup", &max], "--warmup 18446744073709551615"),
            (vec!["--repeat", &max, "--warmup", "0"], "--repeat 18446744073709551615"),
            (vec!["--repeat", "4611686018427387904", "--decode-steps", "4"], "x --decode-steps 4"),
            (vec!["--layers", "100000"], "--layers 100000"),
        ] {
            let e = parse(&args).unwrap().resolve().unwrap_err();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        let p = parse(&["--seq", "131056", "--warmup", "1", "--repeat", "2"]).unwrap().resolve().unwrap();
        assert_eq!((p.max_seq, p.forwards), (131072, 2 * 2 * 5));
        let p = parse(&["--decode-steps", "0", "--warmup", "1", "--repeat", "2"]).unwrap().resolve().unwrap();
        assert_eq!(p.forwards, 2 * 5);
    }

    #[test]
    fn fuse_ranges_are_checked_against_the_layers() {
        let e = parse(&["--fuse", "fused=gqa@0-18446744073709551615"]).unwrap().resolve().unwrap_err();
        assert!(e.starts_with("--fuse: ") && e.contains("reaches past layer 31"), "{e}");
        let e = parse(&["--layers", "4", "--fuse", "fused=all;naive=rope@4"]).unwrap().resolve().unwrap_err();
        assert!(e.contains("`naive=rope@4` reaches past layer 3, the last of a 4-layer model"), "{e}");
        let p = parse(&["--layers", "4", "--fuse", "fused=all;naive=rope@0-3"]).unwrap().resolve().unwrap();
        assert_eq!(p.fused.to_selection(), "fused=all;naive=rope@0-3");
    }

    #[test]
    fn model_reads_a_checkpoint_directory_config() {
        let dir = std::env::temp_dir().join(format!("report-cli-{}", std::process::id())).join("My-Llama");
        std::fs::create_dir_all(&dir).unwrap();
        let cleanup = || {
            let _ = std::fs::remove_dir_all(dir.parent().unwrap());
        };
        let d = dir.to_str().unwrap();
        let e = parse(&["--model", d]).unwrap().resolve().unwrap_err();
        assert!(e.starts_with(&format!("--model {d}: ")) && e.contains("config.json"), "{e}");
        let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "vocab_size": 512, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}"#;
        std::fs::write(dir.join("config.json"), json).unwrap();
        let p = parse(&["--model", d, "--seq", "64"]).unwrap().resolve().unwrap();
        assert_eq!((p.config.name.as_str(), p.config.layers, p.config.head_dim), ("My-Llama", 2, 32));
        assert_eq!(p.model_dir.as_deref(), Some(dir.as_path()));
        assert_eq!(
            parse(&["--model", d, "--seq", "64", "--layers", "1"]).unwrap().resolve().unwrap().config.layers,
            1
        );
        let e = parse(&["--model", d, "--seq", "64", "--layers", "3"]).unwrap().resolve().unwrap_err();
        assert!(e.contains("--layers 3 is more than the 2 layers of --model"), "{e}");
        // This model has 4096 positions, not the presets' 131072.
        let e = parse(&["--model", d, "--seq", "8192"]).unwrap().resolve().unwrap_err();
        assert!(e.contains("more than the model's 4096 positions"), "{e}");
        std::fs::write(dir.join("config.json"), json.replace("\"default\"", "\"yarn\"")).unwrap();
        let e = parse(&["--model", d]).unwrap().resolve().unwrap_err();
        assert!(e.contains("`rope_parameters.rope_type` `yarn`"), "{e}");
        cleanup();
        // --model replaces --config.
        assert!(parse(&["--model", d, "--config", "tiny"]).is_err());
        assert_eq!(parse(&[]).unwrap().model, None);
    }

    #[test]
    fn bad_options_say_what_is_wrong() {
        assert!(parse(&["--seq", "many"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        for (args, expected) in [
            (vec!["--config", "gpt2"], "unknown preset `gpt2`"),
            (vec!["--layers", "0"], "--layers"),
            (vec!["--fuse", "fused=attention"], "valid modules are"),
            (vec!["--dtype", "f32"], "use bf16, f16, fp8 or fp8-tensor"),
            (vec!["--dtype", "fp8", "--tp", "2"], "--dtype fp8 runs the one-GPU report"),
            (vec!["--repeat", "0"], "--repeat"),
        ] {
            let e = parse(&args).unwrap().resolve().unwrap_err();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
    }

    #[test]
    fn train_mode_takes_the_step_shape_and_bf16() {
        let o =
            parse(&["--train", "--config", "llama-3.2-1b", "--layers", "2", "--batch", "2", "--seq", "1024"])
                .unwrap();
        assert!(o.train && !parse(&[]).unwrap().train);
        let p = o.resolve().unwrap();
        // --decode-steps (default 16) does not apply; steps: 2 x (2 + 3 warm-up + 2 x 10).
        assert_eq!((p.config.layers, p.max_seq, p.forwards, p.dtype), (2, 1024, 50, DataType::BF16));
        for (args, expected) in [
            (vec!["--train", "--dtype", "f16"], "--train takes --dtype bf16"),
            (vec!["--train", "--seq", "1"], "--seq must be at least 2"),
            (vec!["--train", "--batch", "3", "--seq", "5"], "3 x --seq 5 = 15 tokens"),
            (vec!["--train", "--seq", "131073"], "more than the model's 131072 positions"),
            (vec!["--train", "--batch", "100000000000", "--seq", "100000"], "overflows"),
            (vec!["--train", "--repeat", "18446744073709551615"], "overflow the step count"),
            (vec!["--train", "--config", "tiny", "--fuse", "fused=all;naive=mlp@2"], "reaches past layer 1"),
        ] {
            let e = parse(&args).unwrap().resolve().unwrap_err();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        assert_eq!(o.resolve().unwrap().tp, None);
        // The inference checks of --decode-steps do not hold a training report back.
        let max = usize::MAX.to_string();
        assert!(parse(&["--train", "--decode-steps", &max]).unwrap().resolve().is_ok());
    }

    #[test]
    fn tp_takes_ranks_the_model_splits_over_and_refuses_what_cannot_run() {
        assert_eq!(parse(&[]).unwrap().resolve().unwrap().tp, None);
        let p = parse(&["--tp", "2", "--layers", "2"]).unwrap().resolve().unwrap();
        assert_eq!((p.tp, p.config.layers, p.dtype), (Some(2), 2, DataType::BF16));
        // One rank is the tensor-parallel code on one GPU; 8 split the 8B preset's 8 KV heads.
        assert_eq!(parse(&["--tp", "1"]).unwrap().resolve().unwrap().tp, Some(1));
        assert_eq!(parse(&["--tp", "8", "--dtype", "f16"]).unwrap().resolve().unwrap().tp, Some(8));
        let o = parse(&["--tp", "2", "--no-baseline", "--config", "llama-3.1-70b", "--layers", "4"]).unwrap();
        assert!(o.no_baseline && o.resolve().is_ok());
        for (args, expected) in [
            (vec!["--tp", "0"], "--tp 0: give the number of GPUs"),
            (vec!["--tp", "2", "--train"], "--tp 2 cannot be combined with --train"),
            (vec!["--train", "--tp", "1"], "--tp 1 cannot be combined with --train"),
            (vec!["--tp", "3"], "32 query heads do not split over 3 ranks"),
            (vec!["--tp", "5", "--config", "tiny"], "--tp 5: "),
            (vec!["--no-baseline"], "--no-baseline applies to --tp only"),
            // The options' own checks still apply.
            (vec!["--tp", "2", "--dtype", "f32"], "use bf16, f16, fp8 or fp8-tensor"),
            (vec!["--tp", "2", "--fuse", "fused=attention"], "valid modules are"),
        ] {
            let e = parse(&args).unwrap().resolve().unwrap_err();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        assert!(parse(&["--tp", "3"]).unwrap().resolve().unwrap_err().starts_with("--tp 3: "));
        assert!(parse(&["--tp", "-1"]).is_err() && parse(&["--tp", "two"]).is_err());
    }
}
