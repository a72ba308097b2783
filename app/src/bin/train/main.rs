//! `cargo run --release --bin train -- [options]`: trains a Llama-3 model (a preset
//! with seeded random weights, or a Hugging Face checkpoint) on synthetic sequences to memorize, on
//! a tokenized text file or on a batch of token ids given as JSON (`--tokens`), with every module
//! fused or naive as `--fuse` says, showing the loss and tokens/s as it goes; writes each step to a
//! CSV (`--csv`) and, with `--save DIR`, the trained model as a checkpoint.
//!
//! A preset starts from `Weights::random` with the embedding scaled to transformers' initializer range
//! (std 0.02).
//!
//! Exit codes: 0 done; 2 bad options or unreadable inputs (checkpoint, text, tokenizer, tokens); 1
//! no usable GPU, or a failure while training.

use clap::Parser;
use cudnn_llm_app::bench_util::tool_main;
use cudnn_llm_llama::weights::Weights;
use cudnn_llm_llama::{Batch, LlamaConfig, StepStats, Tokenizer, Trainer};
use cudnn_llm_ops::Cudnn;
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use std::process::ExitCode;
use std::time::Instant;

mod cli;

use cli::{Options, Plan, Start};

type Error = Box<dyn std::error::Error>;

/// The standard deviation of a random model's embedding (transformers' `initializer_range`).
const EMBED_STD: f64 = 0.02;

/// The model to train and the sequences to train it on.
struct Input {
    config: LlamaConfig,
    weights: Weights<bf16>,
    /// Sequences of `--seq` tokens, taken `--batch` at a time, cyclically (or `--tokens`' sequences,
    /// all of them each step).
    sequences: Vec<Vec<u32>>,
    /// Sequences per step.
    batch: usize,
}

fn main() -> ExitCode {
    let opts = Options::parse();
    let setup = || opts.resolve().and_then(|plan| Ok((plan.clone(), read_input(&opts, &plan)?)));
    tool_main("train", setup, |ctx, (plan, input)| run(ctx, &opts, plan, input))
}

/// A splitmix64 stream: the synthetic sequences of a seed are the same everywhere.
fn splitmix(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Reads the checkpoint or builds the preset, and makes the sequences.
fn read_input(opts: &Options, plan: &Plan) -> Result<Input, String> {
    let (mut config, checkpoint) = match &plan.start {
        Start::Checkpoint(dir) => (LlamaConfig::from_dir(dir).map_err(|e| e.to_string())?, Some(dir)),
        Start::Random(cfg) => ((**cfg).clone(), None),
    };
    if let Some(n) = opts.layers {
        if n == 0 || n > config.layers {
            return Err(format!("--layers {n}: the model has {} layers", config.layers));
        }
        config = config.with_layers(n);
    }
    plan.train.backends.check_layers(config.layers).map_err(|e| format!("--fuse: {e}"))?;
    if opts.tokens.is_none() && opts.seq > config.max_positions {
        return Err(format!("--seq {}: the model has {} positions", opts.seq, config.max_positions));
    }
    // A given batch is checked before the weights are read.
    let given = match &opts.tokens {
        Some(path) => Some(cli::read_tokens(path, config.vocab, opts.micro_batches)?),
        None => None,
    };
    if let Some(len) = given.as_ref().and_then(|s| s.first()).map(Vec::len) {
        if len > config.max_positions {
            return Err(format!(
                "--tokens: sequences of {len} ids; the model has {} positions",
                config.max_positions
            ));
        }
    }
    let weights = match checkpoint {
        // The config's layers: a checkpoint's later layers are not read.
        Some(dir) => Weights::<bf16>::load(&config, dir).map_err(|e| e.to_string())?,
        None => {
            // The random weights' embedding is uniform in ±1; transformers initializes it with std
            // `initializer_range` 0.02, which keeps a tied lm_head's first logits from saturating.
            let mut w = Weights::<bf16>::random(&config, opts.seed);
            let scale = EMBED_STD * 3f64.sqrt();
            w.embed.data.iter_mut().for_each(|v| *v = bf16::from_f64(v.to_f64() * scale));
            w
        }
    };
    if let Some(sequences) = given {
        let batch = sequences.len();
        return Ok(Input { config, weights, sequences, batch });
    }
    let sequences = match (&opts.text, &opts.tokenizer) {
        (Some(text), Some(tok)) => {
            let tokenizer = Tokenizer::from_file(tok).map_err(|e| e.to_string())?;
            let text =
                std::fs::read_to_string(text).map_err(|e| format!("--text {}: {e}", text.display()))?;
            let ids = tokenizer.encode(&text, false).map_err(|e| e.to_string())?;
            if let Some(id) = ids.iter().find(|&&id| id as usize >= config.vocab) {
                return Err(format!(
                    "the tokenizer gives id {id}, past the model's vocabulary of {}",
                    config.vocab
                ));
            }
            let chunks: Vec<Vec<u32>> = ids.chunks_exact(opts.seq).map(<[u32]>::to_vec).collect();
            if chunks.len() < opts.batch {
                return Err(format!(
                    "--text gives {} tokens, fewer than one batch of {} × {}",
                    ids.len(),
                    opts.batch,
                    opts.seq
                ));
            }
            chunks
        }
        _ => {
            let symbols = opts.symbols.unwrap_or(config.vocab);
            if symbols > config.vocab {
                return Err(format!("--symbols {symbols} exceeds the vocabulary of {}", config.vocab));
            }
            let mut next = splitmix(opts.seed ^ 0x5EED);
            let count = opts.sequences.unwrap_or(opts.batch);
            (0..count).map(|_| (0..opts.seq).map(|_| (next() % symbols as u64) as u32).collect()).collect()
        }
    };
    Ok(Input { config, weights, sequences, batch: opts.batch })
}

/// The `step`-th batch: the next `batch` sequences, cyclically.
fn batch(sequences: &[Vec<u32>], batch: usize, step: usize) -> Batch {
    let n = sequences.len();
    Batch::new((0..batch).map(|i| sequences[(step * batch + i) % n].clone()).collect())
}

/// One CSV row.
#[derive(serde::Serialize)]
struct Row {
    step: usize,
    loss: f64,
    grad_norm: f64,
    clip_coefficient: f64,
    tokens: usize,
    forward_ms: f64,
    backward_ms: f64,
    optimizer_ms: f64,
    /// GPU ms of the whole step (events), against `step_ms`, the host's.
    gpu_step_ms: f64,
    step_ms: f64,
    tokens_per_s: f64,
}

fn run(ctx: &Cudnn, opts: &Options, plan: Plan, input: Input) -> Result<(), Error> {
    let Input { config: cfg, weights, sequences, batch: per_step } = input;
    let info = ctx.info();
    eprintln!(
        "train: {} ({} layers, {:.1}M parameters, bf16) on {}, cuDNN {}, backends `{}`, {} sequences of {} \
         tokens, batch {} in {} micro-batches",
        cfg.name,
        cfg.layers,
        cfg.parameters() as f64 / 1e6,
        info.name,
        info.cudnn_version_string(),
        plan.train.backends.to_selection(),
        sequences.len(),
        sequences.first().map_or(0, Vec::len),
        per_step,
        opts.micro_batches
    );
    let mut trainer = Trainer::new(ctx, &cfg, &weights, plan.train)?;
    drop(weights);
    let mut csv =
        csv::Writer::from_path(&opts.csv).map_err(|e| format!("--csv {}: {e}", opts.csv.display()))?;
    let bar = ProgressBar::new(opts.steps as u64).with_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} steps {msg}").expect("a valid template"),
    );
    let (mut first, mut last) = (None, None);
    let started = Instant::now();
    let mut timed = (0usize, 0.0f64);
    for step in 0..opts.steps {
        let t0 = Instant::now();
        let s: StepStats = trainer.step(ctx, &batch(&sequences, per_step, step))?;
        let wall = t0.elapsed().as_secs_f64();
        let rate = s.tokens as f64 / wall;
        // The first step builds the fused plans: the rate leaves it out.
        if step > 0 {
            timed = (timed.0 + s.tokens, timed.1 + wall);
        }
        first.get_or_insert(s.loss);
        last = Some(s.loss);
        csv.serialize(Row {
            step: step + 1,
            loss: s.loss,
            grad_norm: s.grad_norm,
            clip_coefficient: s.clip_coefficient,
            tokens: s.tokens,
            forward_ms: s.forward_ms,
            backward_ms: s.backward_ms,
            optimizer_ms: s.optimizer_ms,
            gpu_step_ms: s.step_ms,
            step_ms: wall * 1e3,
            tokens_per_s: rate,
        })?;
        bar.set_message(format!("loss {:.4} | grad norm {:.3} | {:.0} tokens/s", s.loss, s.grad_norm, rate));
        bar.inc(1);
        if !s.loss.is_finite() {
            bar.abandon();
            return Err(format!("step {}: the loss is {}", step + 1, s.loss).into());
        }
    }
    bar.finish();
    csv.flush()?;
    let rate = if timed.1 > 0.0 {
        format!("{:.0} tokens/s after the first step", timed.0 as f64 / timed.1)
    } else {
        "one step: no warm rate".to_string()
    };
    eprintln!(
        "train: loss {:.4} -> {:.4} in {} steps ({:.1} s, {rate}); steps in {}",
        first.unwrap_or(f64::NAN),
        last.unwrap_or(f64::NAN),
        opts.steps,
        started.elapsed().as_secs_f64(),
        opts.csv.display()
    );
    for f in trainer.fallbacks() {
        eprintln!("train: fallback: {} layer {:?} ({}) ran naive: {}", f.range, f.layer, f.shape, f.reason);
    }
    if let Some(dir) = &opts.save {
        trainer.save(ctx, dir)?;
        eprintln!("train: saved {}", dir.display());
    }
    Ok(())
}
