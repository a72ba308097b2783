//! Command-line options of `train` (parsed with clap; checked without a GPU).

use clap::Parser;
use cudnn_llm_llama::config::PRESETS;
use cudnn_llm_llama::{Backend, Backends, LlamaConfig, TrainConfig};
use std::path::PathBuf;

/// What to train, on what, with which hyperparameters and backends.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(
    name = "train",
    about = "Train a Llama-3 model on fused cuDNN graphs or naive kernels, module by module"
)]
pub struct Options {
    /// Checkpoint directory to start from (config.json, model.safetensors or an index and shards);
    /// without it, a preset with seeded random weights.
    #[arg(long, conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// Preset of a randomly initialized model: tiny, llama-3.2-1b or llama-3.1-8b.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Keep only the first N decoder layers (of the preset or the checkpoint).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Seed of the random weights and of the synthetic sequences.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Train on this text file (tokenized with --tokenizer, cut into --seq-token sequences) instead of
    /// synthetic sequences.
    #[arg(long, requires = "tokenizer")]
    pub text: Option<PathBuf>,
    /// tokenizer.json for --text.
    #[arg(long, requires = "text")]
    pub tokenizer: Option<PathBuf>,
    /// Train on these token ids: a JSON array of sequences of equal length (`[[1, 2, ...], ...]`),
    /// all of them one batch each step (labels: the inputs), e.g. a batch a parity check shares with
    /// PyTorch; instead of --text or synthetic sequences, and of --batch and --seq.
    #[arg(long, value_name = "FILE.json", conflicts_with_all = ["text", "sequences", "symbols", "batch", "seq"])]
    pub tokens: Option<PathBuf>,
    /// Synthetic data: this many fixed random sequences (seeded), cycled through batch by batch, to
    /// memorize; default: one batch.
    #[arg(long, conflicts_with = "text")]
    pub sequences: Option<usize>,
    /// Synthetic data: tokens drawn from the first N ids (fewer symbols need more context to
    /// memorize); default: the whole vocabulary.
    #[arg(long, conflicts_with = "text")]
    pub symbols: Option<usize>,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 32)]
    pub seq: usize,
    /// Micro-batches each step's sequences are split into (gradients accumulate over them).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3, allow_negative_numbers = true)]
    pub lr: f64,
    /// AdamW beta1.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    /// AdamW beta2.
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f64,
    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (no clipping without it).
    #[arg(long, allow_negative_numbers = true)]
    pub clip: Option<f32>,
    /// Keep f32 master weights for AdamW (the model runs their bf16 rounding).
    #[arg(long)]
    pub master_weights: bool,
    /// Activation checkpointing: recompute each layer's activations in the backward (one layer's in
    /// memory instead of all).
    #[arg(long)]
    pub checkpoint: bool,
    /// Modules to fuse, forward and backward, e.g. `fused=all`, `fused=all;naive=rope@0-3`, or `` for
    /// all naive.
    #[arg(long, default_value = "fused=all")]
    pub fuse: String,
    /// Backend of the embedding's backward, the gradient norm and AdamW: fused or naive.
    #[arg(long, default_value = "fused")]
    pub standalone: String,
    /// CSV of each step: loss, gradient norm, phase times, tokens/s.
    #[arg(long, default_value = "train.csv")]
    pub csv: PathBuf,
    /// Write the trained model here as a checkpoint (config.json, model.safetensors).
    #[arg(long)]
    pub save: Option<PathBuf>,
}

/// Where the starting weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// A Hugging Face checkpoint directory.
    Checkpoint(PathBuf),
    /// A preset with seeded random weights.
    Random(Box<LlamaConfig>),
}

/// The options, checked and resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The starting weights.
    pub start: Start,
    /// The trainer's hyperparameters and backends.
    pub train: TrainConfig,
}

impl Options {
    /// Checks the options that need no file and no GPU; errors name the option.
    pub fn resolve(&self) -> Result<Plan, String> {
        if self.steps == 0 {
            return Err("--steps must be at least 1".into());
        }
        // With --tokens the batch is the file's, checked when it is read.
        if self.tokens.is_none() {
            check_step_shape(self.batch, self.seq, self.micro_batches, ("--batch", "--seq"))?;
        }
        if self.sequences == Some(0) || self.symbols == Some(0) {
            return Err("--sequences and --symbols must be at least 1".into());
        }
        if self.tokens.is_none() {
            // The sequences made up front, and a step's batch of them, stay countable on the host.
            let held = self.sequences.unwrap_or(self.batch).max(self.batch);
            if held.checked_mul(self.seq).is_none_or(|t| t > MAX_SYNTHETIC_TOKENS) {
                return Err(format!(
                    "--batch {} / --sequences {} x --seq {}: more than {MAX_SYNTHETIC_TOKENS} tokens held",
                    self.batch,
                    self.sequences.map_or("-".into(), |n| n.to_string()),
                    self.seq
                ));
            }
        }
        let start = match &self.model {
            Some(dir) => Start::Checkpoint(dir.clone()),
            None => {
                let cfg = LlamaConfig::preset(&self.preset).map_err(|_| {
                    format!("--preset {}: expected one of {}", self.preset, PRESETS.join(", "))
                })?;
                Start::Random(Box::new(cfg))
            }
        };
        let backends = Backends::parse(&self.fuse).map_err(|e| format!("--fuse: {e}"))?;
        let standalone = match self.standalone.as_str() {
            "fused" => Backend::Fused,
            "naive" => Backend::Naive,
            other => return Err(format!("--standalone {other}: expected fused or naive")),
        };
        let mut train = TrainConfig::new(self.lr)
            .with_betas(self.beta1, self.beta2)
            .with_eps(self.eps)
            .with_weight_decay(self.weight_decay)
            .with_micro_batches(self.micro_batches)
            .with_master_weights(self.master_weights)
            .with_checkpointing(self.checkpoint)
            .with_backends(backends)
            .with_standalone(standalone);
        if let Some(c) = self.clip {
            train = train.with_clip(c);
        }
        // The hyperparameters now; --fuse's layer ranges once the model's layer count is known.
        let no_ranges = Backends::parse("").map_err(|e| e.to_string())?;
        train.clone().with_backends(no_ranges).check(1).map_err(|e| flag_error(&e.to_string()))?;
        Ok(Plan { start, train })
    }
}

/// A [`TrainConfig::check`] error, which names the config's field first (`train: weight_decay -1
/// is ...`), as this binary's flag says it (`--weight-decay -1 is ...`).
fn flag_error(e: &str) -> String {
    let e = e.strip_prefix("train: ").unwrap_or(e);
    let (field, rest) = e.split_once(' ').unwrap_or((e, ""));
    let flag = match field {
        "betas" => "--beta1/--beta2".to_string(),
        f => format!("--{}", f.replace('_', "-")),
    };
    format!("{flag} {rest}")
}

/// The most tokens one micro-batch holds (its activations index with 32-bit counts).
pub const MAX_STEP_TOKENS: usize = 1 << 24;

/// The most tokens of sequences held on the host (`--sequences` or `--batch`, × `--seq`).
pub const MAX_SYNTHETIC_TOKENS: usize = 1 << 28;

/// Checks one step's shape: `batch` sequences of `seq` tokens split into `micro` micro-batches, each
/// of a multiple of 8 tokens; `names` are what the errors call the batch and the sequence length.
pub fn check_step_shape(batch: usize, seq: usize, micro: usize, names: (&str, &str)) -> Result<(), String> {
    let (b, s) = names;
    if batch == 0 {
        return Err(format!("{b} must be at least 1"));
    }
    if seq < 2 {
        return Err(format!("{s} must be at least 2 (each token predicts the next)"));
    }
    if micro == 0 || !batch.is_multiple_of(micro) {
        return Err(format!("--micro-batches {micro} must divide {b} {batch} into equal micro-batches"));
    }
    let per = (batch / micro).checked_mul(seq).filter(|&t| t <= MAX_STEP_TOKENS).ok_or_else(|| {
        format!("{b} {batch} x {s} {seq}: more than {MAX_STEP_TOKENS} tokens a micro-batch")
    })?;
    if !per.is_multiple_of(8) {
        return Err(format!(
            "a micro-batch of {} sequences × {s} {seq} = {per} tokens: the weight gradients need a multiple of 8",
            batch / micro
        ));
    }
    Ok(())
}

/// Reads `--tokens`: a JSON array of equal-length sequences of token ids below `vocab`, whose shape
/// [`check_step_shape`] takes with `micro` micro-batches.
pub fn read_tokens(path: &std::path::Path, vocab: usize, micro: usize) -> Result<Vec<Vec<u32>>, String> {
    let at = format!("--tokens {}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| format!("{at}: {e}"))?;
    let seqs: Vec<Vec<i64>> =
        serde_json::from_str(&text).map_err(|e| format!("{at}: not a JSON array of token id arrays: {e}"))?;
    let seq = seqs.first().map_or(0, Vec::len);
    if seqs.iter().any(|s| s.len() != seq) {
        return Err(format!("{at}: sequences of different lengths (the first has {seq})"));
    }
    check_step_shape(
        seqs.len(),
        seq,
        micro,
        (&format!("{at}'s sequence count"), &format!("{at}'s sequence length")),
    )?;
    seqs.into_iter()
        .map(|s| {
            s.into_iter()
                .map(|id| {
                    u32::try_from(id)
                        .ok()
                        .filter(|&v| (v as usize) < vocab)
                        .ok_or_else(|| format!("{at}: token id {id} is outside the vocabulary of {vocab}"))
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from([&["train"], args].concat())
    }

    #[test]
    fn defaults_train_the_tiny_preset_all_fused() {
        let o = parse(&[]).unwrap();
        assert_eq!((o.batch, o.seq, o.steps, o.micro_batches), (8, 32, 100, 1));
        let p = o.resolve().unwrap();
        assert_eq!(p.start, Start::Random(Box::new(LlamaConfig::tiny())));
        assert_eq!(p.train.backends, Backends::all(Backend::Fused));
        assert_eq!((p.train.lr, p.train.clip, p.train.standalone), (3e-3, None, Backend::Fused));
        let args =
            ["--fuse", "", "--standalone", "naive", "--clip", "1", "--micro-batches", "2", "--checkpoint"];
        let p = parse(&args).unwrap().resolve().unwrap();
        assert_eq!((p.train.clip, p.train.micro_batches, p.train.checkpoint), (Some(1.0), 2, true));
        assert_eq!(p.train.backends, Backends::all(Backend::Naive));
        let p = parse(&["--model", "dir"]).unwrap().resolve().unwrap();
        assert_eq!(p.start, Start::Checkpoint("dir".into()));
    }

    #[test]
    fn bad_options_are_errors_naming_the_option() {
        for (args, expected) in [
            (&["--batch", "0"][..], "--batch must be at least 1"),
            (&["--seq", "1"], "--seq must be at least 2"),
            (&["--batch", "6", "--micro-batches", "4"], "--micro-batches 4 must divide --batch 6"),
            (&["--batch", "3", "--seq", "5"], "15 tokens"),
            (&["--preset", "gpt2"], "--preset gpt2: expected one of"),
            (&["--fuse", "fused=attention"], "--fuse"),
            (&["--standalone", "cudnn"], "--standalone cudnn"),
            (&["--lr", "-1"], "--lr -1"),
            (&["--clip", "0"], "--clip 0"),
            (&["--weight-decay=-1"], "--weight-decay -1 is"),
            (&["--beta1", "1"], "--beta1/--beta2 (1, "),
            (&["--eps", "0"], "--eps 0 is"),
            (&["--sequences", "0"], "--sequences"),
            (&["--steps", "0"], "--steps must be at least 1"),
        ] {
            let e = parse(args).unwrap().resolve().unwrap_err();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        // clap refuses what does not go together.
        assert!(parse(&["--tokens", "t.json", "--batch", "2"]).is_err(), "--tokens gives the batch");
        assert!(parse(&["--tokens", "t.json", "--text", "a", "--tokenizer", "t"]).is_err());
        assert!(parse(&["--text", "a.txt"]).is_err(), "--text needs --tokenizer");
        assert!(parse(&["--model", "m", "--preset", "tiny"]).is_err());
        assert!(parse(&["--text", "a", "--tokenizer", "t", "--sequences", "3"]).is_err());
    }

    #[test]
    fn tokens_files_give_the_batch_and_are_checked() {
        // The default --batch 8 would not split into 3 micro-batches; a --tokens file of 6 does.
        let o = parse(&["--tokens", "t.json", "--micro-batches", "3"]).unwrap();
        assert_eq!(o.tokens, Some(PathBuf::from("t.json")));
        o.resolve().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let good = file("good.json", "[[1, 2, 3, 4], [5, 6, 7, 8]]");
        assert_eq!(read_tokens(&good, 16, 1).unwrap(), vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
        assert_eq!(
            read_tokens(&good, 16, 2).unwrap_err(),
            format!(
            "a micro-batch of 1 sequences × --tokens {}'s sequence length 4 = 4 tokens: the weight gradients \
             need a multiple of 8",
            good.display()
        )
        );
        for (name, text, vocab, expected) in [
            ("ragged.json", "[[1, 2, 3, 4], [5, 6]]", 16, "sequences of different lengths (the first has 4)"),
            ("empty.json", "[]", 16, "sequence count must be at least 1"),
            (
                "short.json",
                "[[1], [2], [3], [4], [5], [6], [7], [8]]",
                16,
                "sequence length must be at least 2",
            ),
            (
                "vocab.json",
                "[[1, 2, 3, 4], [5, 6, 7, 16]]",
                16,
                "token id 16 is outside the vocabulary of 16",
            ),
            ("negative.json", "[[1, 2, 3, 4], [5, 6, 7, -1]]", 16, "token id -1 is outside"),
            ("object.json", "{\"ids\": [1]}", 16, "not a JSON array of token id arrays"),
        ] {
            let p = file(name, text);
            let e = read_tokens(&p, vocab, 1).unwrap_err();
            assert!(
                e.starts_with(&format!("--tokens {}", p.display())) && e.contains(expected),
                "{name}: {e}"
            );
        }
        let e = read_tokens(&dir.path().join("missing.json"), 16, 1).unwrap_err();
        assert!(e.contains("missing.json"), "{e}");
    }
}
