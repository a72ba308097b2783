//! Command-line options of `generate` (parsed with clap; checked without a GPU).

use clap::Parser;
use cudnn_llm_llama::{Backends, DecodeMode, SamplingParams, SamplingPath};
use cudnn_llm_ops::DataType;
use std::path::PathBuf;

/// What to generate, from which checkpoint, on which backends.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(
    name = "generate",
    about = "Generate text with a Llama-3 checkpoint on fused cuDNN graphs or naive kernels"
)]
pub struct Options {
    /// Checkpoint directory: config.json, model.safetensors (or an index and shards), tokenizer.json;
    /// generation_config.json is read too when present (end-of-sequence ids). Or a llama.cpp `.gguf`
    /// file: config, tokenizer, chat template and weights (dequantized) from the file.
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt (encoded with the tokenizer's special tokens, e.g. <|begin_of_text|>).
    #[arg(long, required_unless_present = "chat", conflicts_with = "chat")]
    pub prompt: Option<String>,
    /// A user message for an Instruct checkpoint: rendered with the checkpoint's chat template
    /// (tokenizer_config.json's `chat_template`, or chat_template.jinja) and its generation prompt,
    /// then encoded without adding special tokens (the template writes them), as transformers'
    /// `apply_chat_template` does.
    #[arg(long)]
    pub chat: Option<String>,
    /// A system message before --chat's user message.
    #[arg(long)]
    pub system: Option<String>,
    /// Most new tokens; generation stops earlier at an end-of-sequence id.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample from the K most probable tokens only (needs --temperature > 0).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of most probable tokens reaching probability P, in (0, 1] (needs
    /// --temperature > 0).
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Seed of the sampling stream (needs --temperature > 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Modules to fuse, e.g. `fused=all`, `fused=prenorm,gqa`, or `` for all naive.
    #[arg(long, default_value = "fused=all")]
    pub fuse: String,
    /// I/O dtype: bf16 or f16; or fp8: bf16 with every layer's projections quantized to FP8 E4M3 at
    /// load, one factor per output channel (`Llama::quantize_to_fp8`); or fp8-tensor: one factor per
    /// weight and per prefill activation tensor (cuDNN's fastest FP8 engine, less accurate).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Skip the untimed warm-up (a prefill and two decode steps that build and tune the fused plans).
    #[arg(long)]
    pub no_warmup: bool,
    /// Decode steps: `graph` replays one captured CUDA graph per step where the step allows it (RoPE
    /// and attention fused, cuDNN 9.15+), `launch` launches every kernel from the host.
    #[arg(long, value_enum, default_value_t = Decode::Graph)]
    pub decode: Decode,
    /// Where greedy ids are chosen when decode steps replay a graph: `device` (the argmax inside
    /// the captured step, steps enqueued ahead and their ids read back in windows) or `host` (each
    /// step's logits copied back and their argmax taken on the host), to compare the two on one
    /// checkpoint. Sampling (--temperature > 0), --decode launch and --tp choose on the host. The
    /// default is `device` (it gives the host path's ids, `tests/generate.rs`; on an H200 an 8B step
    /// took 4.16 ms with it and 4.76 ms on the host path).
    #[arg(long, value_enum, default_value_t = Path::Device)]
    pub sampling_path: Path,
    /// Where finalized plans and autotuning choices persist between runs: a directory, `on` for the
    /// default ($XDG_CACHE_HOME/cudnn-llm/plans, else ~/.cache/cudnn-llm/plans), `off` for nowhere.
    /// Unset: CUDNN_LLM_PLAN_DIR if set (same values), else the default.
    #[arg(long, value_name = "DIR|on|off")]
    pub plan_dir: Option<String>,
    /// Tensor parallelism: split the model over N GPUs of this host (GPUs 0..N, one thread, context
    /// and NCCL communicator each; NCCL is loaded at run time, NCCL_LIBRARY names it). The logits
    /// are gathered on rank 0 and sampled there; the output is the same, with a line naming the
    /// ranks. Started as the ranks of a job (`cudnn-llm-launch --nproc N -- generate ...`, or
    /// torchrun: WORLD_SIZE set), each process holds one rank on GPU LOCAL_RANK, N is the world size,
    /// and rank 0 tokenizes, samples and prints while the others follow its token stream.
    #[arg(long, value_name = "N")]
    pub tp: Option<usize>,
    /// Also print the generated ids on stderr (`generate: ids 5 17 ...`), e.g. to compare runs.
    #[arg(long)]
    pub ids: bool,
}

/// How decode steps run (`--decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Decode {
    /// Replay a captured CUDA graph per step where possible.
    Graph,
    /// Launch every kernel from the host.
    Launch,
}

/// Where greedy ids are chosen (`--sampling-path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Path {
    /// On the device, pipelined.
    Device,
    /// On the host, each step.
    Host,
}

/// The options, checked and resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The backend selection.
    pub backends: Backends,
    /// The I/O dtype.
    pub dtype: DataType,
    /// `--dtype fp8` or `fp8-tensor`: the projections in FP8 with these factors (the I/O dtype bf16).
    pub fp8: Option<cudnn_llm_ops::WeightScales>,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// How decode steps run.
    pub decode: DecodeMode,
    /// Where greedy ids are chosen.
    pub sampling_path: SamplingPath,
    /// Where plans persist.
    pub plan_dir: PlanDir,
    /// `--tp`: the ranks the model is split over (`None`: one GPU).
    pub tp: Option<usize>,
}

/// Where plans persist (`--plan-dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanDir {
    /// `CUDNN_LLM_PLAN_DIR` if set (the library reads it), else the default directory.
    EnvOrDefault,
    /// The default directory (`on`).
    Default,
    /// Nowhere (`off`).
    Off,
    /// This directory.
    Dir(PathBuf),
}

impl Options {
    /// Checks the selection, dtype and sampling options; errors name the option.
    pub fn resolve(&self) -> Result<Plan, String> {
        if self.max_new_tokens == 0 {
            return Err("--max-new-tokens must be at least 1".into());
        }
        if self.tp == Some(0) {
            return Err("--tp 0: give the number of GPUs to split the model over (1 or more)".into());
        }
        let backends = Backends::parse(&self.fuse).map_err(|e| format!("--fuse: {e}"))?;
        let (dtype, fp8) = cudnn_llm_app::report::cli::parse_dtype(&self.dtype)?;
        if fp8.is_some() && self.tp.is_some_and(|n| n > 1) {
            return Err("--dtype fp8 runs on one GPU: leave out --tp".into());
        }
        if self.temperature == 0.0 {
            for (set, name) in [
                (self.top_k.is_some(), "--top-k"),
                (self.top_p.is_some(), "--top-p"),
                (self.seed.is_some(), "--seed"),
            ] {
                if set {
                    return Err(format!("{name} samples: give --temperature > 0 with it (0 is greedy)"));
                }
            }
        }
        let mut sampling = SamplingParams::new(self.temperature, self.seed.unwrap_or(0));
        (sampling.top_k, sampling.top_p) = (self.top_k, self.top_p);
        sampling.check().map_err(|e| e.to_string())?;
        let decode = match self.decode {
            Decode::Graph => DecodeMode::Graph,
            Decode::Launch => DecodeMode::Launch,
        };
        let plan_dir = match self.plan_dir.as_deref().map(str::trim) {
            None => PlanDir::EnvOrDefault,
            Some("on" | "default") => PlanDir::Default,
            Some("off" | "none") => PlanDir::Off,
            Some("") => return Err("--plan-dir: give a directory, `on` or `off`".into()),
            Some(dir) => PlanDir::Dir(PathBuf::from(dir)),
        };
        let sampling_path = match self.sampling_path {
            Path::Device => SamplingPath::Device,
            Path::Host => SamplingPath::Host,
        };
        Ok(Plan { backends, dtype, fp8, sampling, decode, sampling_path, plan_dir, tp: self.tp })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from([&["generate", "--model", "m", "--prompt", "hi"], args].concat())
    }

    #[test]
    fn defaults_are_greedy_all_fused_bf16() {
        let o = parse(&[]).unwrap();
        assert_eq!((o.max_new_tokens, o.fuse.as_str(), o.no_warmup), (128, "fused=all", false));
        let p = o.resolve().unwrap();
        assert_eq!(p.backends, Backends::all(cudnn_llm_llama::Backend::Fused));
        assert_eq!(p.dtype, DataType::BF16);
        assert!(p.sampling.is_greedy());
        assert_eq!(p.sampling, SamplingParams::greedy());
        assert_eq!(p.decode, DecodeMode::Graph);
        assert_eq!(p.plan_dir, PlanDir::EnvOrDefault);
        assert_eq!((p.tp, o.ids), (None, false));
        assert_eq!(parse(&["--decode", "launch"]).unwrap().resolve().unwrap().decode, DecodeMode::Launch);
        assert!(parse(&["--decode", "replay"]).is_err());
        assert_eq!(p.sampling_path, SamplingPath::Device);
        let host = parse(&["--sampling-path", "host"]).unwrap().resolve().unwrap();
        assert_eq!(host.sampling_path, SamplingPath::Host);
        assert!(parse(&["--sampling-path", "gpu"]).is_err());
    }

    #[test]
    fn plan_dir_takes_a_directory_on_or_off() {
        let dir = |arg: &str| parse(&["--plan-dir", arg]).unwrap().resolve().map(|p| p.plan_dir);
        assert_eq!(dir("on"), Ok(PlanDir::Default));
        assert_eq!(dir("off"), Ok(PlanDir::Off));
        assert_eq!(dir("/srv/plans"), Ok(PlanDir::Dir(PathBuf::from("/srv/plans"))));
        assert!(dir("").unwrap_err().contains("--plan-dir"));
    }

    #[test]
    fn sampling_options_resolve() {
        let o = parse(&[
            "--temperature",
            "0.7",
            "--top-k",
            "40",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            "--fuse",
            "fused=gqa",
            "--dtype",
            "f16",
        ])
        .unwrap();
        let p = o.resolve().unwrap();
        assert_eq!(p.sampling, SamplingParams::new(0.7, 3).with_top_k(40).with_top_p(0.9));
        assert_eq!(p.dtype, DataType::F16);
        assert_eq!(p.backends.to_selection(), "fused=gqa");
    }

    #[test]
    fn bad_options_name_the_option() {
        for (args, want) in [
            (vec!["--max-new-tokens", "0"], "--max-new-tokens"),
            (vec!["--fuse", "fused=attention"], "valid modules are"),
            (vec!["--dtype", "f32"], "use bf16, f16, fp8 or fp8-tensor"),
            (vec!["--dtype", "fp8", "--tp", "2"], "--dtype fp8 runs on one GPU"),
            (vec!["--top-p", "0.9"], "--top-p samples"),
            (vec!["--top-k", "5"], "--top-k samples"),
            (vec!["--seed", "5"], "--seed samples"),
            (vec!["--temperature", "-1"], "temperature"),
            (vec!["--temperature", "1", "--top-p", "1.5"], "top_p"),
            (vec!["--temperature", "1", "--top-k", "0"], "top_k"),
            (vec!["--tp", "0"], "--tp 0: give the number of GPUs"),
        ] {
            let e = parse(&args).unwrap().resolve().unwrap_err();
            assert!(e.contains(want), "{args:?}: {e}");
        }
        assert!(parse(&["--max-new-tokens", "-3"]).is_err());
        assert!(Options::try_parse_from(["generate", "--prompt", "hi"]).is_err(), "--model is required");
    }

    #[test]
    fn tp_takes_a_rank_count_with_any_sampling() {
        let o = parse(&["--tp", "2", "--ids", "--temperature", "0.5", "--seed", "1"]).unwrap();
        let p = o.resolve().unwrap();
        assert_eq!((p.tp, o.ids), (Some(2), true));
        assert_eq!(parse(&["--tp", "1", "--decode", "launch"]).unwrap().resolve().unwrap().tp, Some(1));
        assert!(parse(&["--tp", "-2"]).is_err() && parse(&["--tp", "x"]).is_err());
    }
}
