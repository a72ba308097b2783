//! Command-line options of `speedup-report` (parsed with clap; checked without a GPU).

use clap::Parser;
use cudnn_ops::DataType;
use llama::{Backends, LlamaConfig};
use std::path::PathBuf;

/// What to run and where to write the report.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(name = "speedup-report", about = "Per-module speedup of fused cuDNN graphs over naive kernels")]
pub struct Options {
    /// Model preset: llama-3.2-1b, llama-3.1-8b or tiny.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub config: String,
    /// Decoder layers (default: the preset's).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Prompt tokens per sequence (the prefill scenario).
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    /// Decode steps after the prefill (0: no decode scenario).
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Modules to fuse, e.g. `fused=all` or `fused=prenorm,gqa` (compared with all naive).
    #[arg(long, default_value = "fused=all")]
    pub fuse: String,
    /// I/O dtype: bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Untimed forwards before measuring.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed forwards (medians are reported).
    #[arg(long, default_value_t = 10)]
    pub repeat: usize,
    /// Directory for report.md, report.csv, report.json and report.svg.
    #[arg(long, default_value = "benches/results")]
    pub out: PathBuf,
}

/// The options, checked and resolved.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The model shape.
    pub config: LlamaConfig,
    /// The fused selection.
    pub fused: Backends,
    /// The I/O dtype.
    pub dtype: DataType,
}

impl Options {
    /// Resolves the preset, layer count, backend selection and dtype; errors say what is wrong.
    pub fn resolve(&self) -> Result<Plan, String> {
        let mut config = LlamaConfig::preset(&self.config).map_err(|e| e.to_string())?;
        if let Some(l) = self.layers {
            if l == 0 {
                return Err("--layers must be at least 1".into());
            }
            config = config.with_layers(l);
        }
        if self.batch == 0 || self.seq == 0 {
            return Err("--batch and --seq must be at least 1".into());
        }
        if self.repeat == 0 {
            return Err("--repeat must be at least 1".into());
        }
        let fused = Backends::parse(&self.fuse).map_err(|e| e.to_string())?;
        let dtype = match DataType::parse(&self.dtype) {
            Some(d @ (DataType::BF16 | DataType::F16)) => d,
            _ => return Err(format!("--dtype {} is not supported: use bf16 or f16", self.dtype)),
        };
        Ok(Plan { config, fused, dtype })
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
        assert_eq!(p.fused, Backends::all(llama::Backend::Fused));
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
    fn bad_options_say_what_is_wrong() {
        assert!(parse(&["--seq", "many"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        for (args, expected) in [
            (vec!["--config", "gpt2"], "unknown preset `gpt2`"),
            (vec!["--layers", "0"], "--layers"),
            (vec!["--fuse", "fused=attention"], "valid modules are"),
            (vec!["--dtype", "f32"], "use bf16 or f16"),
            (vec!["--repeat", "0"], "--repeat"),
        ] {
            let e = parse(&args).unwrap().resolve().unwrap_err();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
    }
}
