//! `cargo run --release --bin tp-bench -- [options]`: tensor parallelism against one
//! GPU, in one invocation (one device call). For each rank count of `--ranks` (default `1,2`; each in
//! a process of its own, below) it loads the model (random weights, or `--checkpoint DIR`), then
//! times on every rank with CUDA events (the slowest rank's time counts):
//!
//! - the prefill forward of `--batch` × `--prompt` tokens (median of `--reps`, after the first
//!   forward, which builds and tunes the plans, and `--warmup` more);
//! - a decode step (one token per sequence, its logits all-gathered): `--steps` plain launches and
//!   `--steps` replays of the captured CUDA graph, each timed alone, the graph replay's wall time
//!   from the caller (host logits included), and `--steps` replays enqueued back to back and timed
//!   together (`chain`: a generation loop that does not wait for each step; the ranks' launch skew,
//!   which a step timed alone includes, counts once; each replay uploads its ids and positions from
//!   pageable host memory, which the driver may do only once the stream is idle, so the chain is
//!   back to back at best);
//! - one all-reduce of a decode step's `[batch, hidden]` and of the prefill's `[batch·prompt, hidden]`;
//! - with `--timeline`, last and for the last rank count of `--ranks` only, each rank's replayed
//!   decode step as a CUPTI timeline (kernel kinds, their GPU time and the idle time before them;
//!   the all-reduce kernels' time includes waiting for the other ranks). Only then: once CUPTI has
//!   traced a GPU's context, that GPU runs a process's later graphs slower (on two H200s, a TP2
//!   step timed after a one-GPU row's trace had about 70 us more idle time on GPU 0 than on GPU 1,
//!   and took 0.06 ms longer than without it);
//! - with `--decode-variants`, the decode step again under other context settings (decode attention,
//!   GEMV split, programmatic launch), each set on every rank and re-captured, in turn for
//!   `--variant-rounds` rounds on the loaded model (`variant ...` lines: graph replay and back to back);
//! - the device copy bandwidth, for the per-rank memory floor of a decode step (the bytes one rank
//!   reads, [`ShardPlan::decode_roofline`]) and that floor plus the step's 2 all-reduces per layer.
//!
//! **Ranks as processes.** Started as the ranks of a job (`cudnn-llm-launch --nproc N -- tp-bench
//! --ranks N ...`, or torchrun: `WORLD_SIZE` and the rest set), each process holds one rank
//! ([`TpLlama::join`]) and runs the same measurements; every time is rank 0's (not the slowest
//! rank's), rank 0 alone prints and writes `tp-<preset>-<layers>l[-<setting>]-processes.{csv,md}`.
//! `--ranks` must be the world size; `--timeline` and `--gather-rows` need the ranks in one process.
//! With `--allreduce-only`, the all-reduces alone (below).
//!
//! Each rank count runs in a process of its own (this executable again, with `--ranks N` and the
//! other options; it hands its row back in a file), one after the other: on two H200s a one-GPU row
//! measured first in the same process left GPU 0 about 70 us idler per TP2 decode step than a TP2
//! row in a process of its own (2.848 against 2.804 ms back to back; cause not found).
//! `--same-process` measures every rank count in this process instead.
//!
//! Then speedup and scaling efficiency (speedup / ranks) against the one-rank row, printed and written
//! as `tp-<preset>-<layers>l[-<setting>].{csv,md}` under `$BENCH_RESULTS_DIR` (default
//! `benches/results`).
//!
//! **NCCL settings**, for sweeps (one invocation per setting; each is printed, written as CSV columns
//! and names the files): `--nccl-min-ctas N`, `--nccl-max-ctas N` and `--nccl-cga-cluster-size N`
//! make the communicators with those `ncclConfig_t` attributes (NCCL's own when not given; a minimum
//! needs a maximum); `--nccl-proto LL|LL128|Simple` and `--nccl-algo Ring|Tree` set `NCCL_PROTO` and
//! `NCCL_ALGO` for this process before its first communicator (NCCL reads them once per process, so
//! they hold for every row of the invocation; a different value already in the environment is
//! refused). `--rank-spin-us N` sets how long the ranks' threads poll for their next call before
//! they block (`TpOptions::spin`; 0 blocks at once), and names the files too. `--allreduce-only`
//! skips the model (the ranks hold the 1-layer tiny model) and times all-reduces alone: a decode
//! step's and the prefill's `[tokens, hidden]` of `--preset`, and 8 KB to 64 MB in powers of two,
//! written as `tp-allreduce[-<setting>].{csv,md}`; seconds per setting.
//! Llama-3.1-70B shapes: `--preset llama-3.1-70b --layers 8 --ranks 1,2` (a one-GPU row of all 80
//! layers does not leave room for much else on a 141 GB H200). Exit codes: 0 done (rows that failed
//! say why), 2 bad options, 1 no row ran.

use clap::Parser;
use cudnn_llm::{DecodeAttention, GemvSplit};
use cudnn_llm_app::bench_util::{
    copy_bandwidth_gbps, csv_and_markdown, environment, median, say, write_results,
};
use cudnn_llm_llama::nccl::rendezvous::{RankEnv, Session};
use cudnn_llm_llama::nccl::{self, Algorithm, Comm, NcclConfig, NcclError, Protocol, UniqueId};
use cudnn_llm_llama::profile::StepTimeline;
use cudnn_llm_llama::tp::{Rank, ShardPlan, TpLlama, TpOptions, WeightSource};
use cudnn_llm_llama::{Backends, LlamaConfig, NoObserver};
use half::bf16;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// Set on the ranks above 0 of a job of processes: rank 0 speaks for the job.
static QUIET: AtomicBool = AtomicBool::new(false);

/// `std::println!`, silent on the ranks above 0 of a job of processes ([`QUIET`]).
macro_rules! println {
    ($($t:tt)*) => {
        if !QUIET.load(Ordering::Relaxed) {
            std::println!($($t)*)
        }
    };
}

/// What to measure.
#[derive(Debug, Clone, Parser)]
#[command(name = "tp-bench", about = "Tensor-parallel prefill and decode against one GPU")]
struct Options {
    /// Model preset: smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b or tiny.
    #[arg(long, default_value = "llama-3.1-8b")]
    preset: String,
    /// Decoder layers (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    /// Rank counts to measure, in order; speedups are against the 1-rank row.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    ranks: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    prompt: usize,
    /// Sequences.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Decode steps timed (plain, then replayed).
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Untimed prefills after the first (which builds and tunes the plans), before the timed ones.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed prefills.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Modules to fuse, e.g. `fused=all`, or `` for all naive.
    #[arg(long, default_value = "fused=all")]
    fuse: String,
    /// A Hugging Face checkpoint directory (its config.json is the model) instead of random weights.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Seconds a call waits for every rank.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// NCCL communicators' `minCTAs` (1 to 64; needs --nccl-max-ctas). Default: NCCL's.
    #[arg(long)]
    nccl_min_ctas: Option<u32>,
    /// NCCL communicators' `maxCTAs` (1 to 64). Default: NCCL's.
    #[arg(long)]
    nccl_max_ctas: Option<u32>,
    /// NCCL communicators' `cgaClusterSize` (0 to 8). Default: NCCL's.
    #[arg(long)]
    nccl_cga_cluster_size: Option<u32>,
    /// `NCCL_PROTO` for this process (LL, LL128 or Simple), set before its first communicator.
    #[arg(long, value_parser = parse_proto)]
    nccl_proto: Option<Protocol>,
    /// `NCCL_ALGO` for this process (Ring or Tree), set before its first communicator.
    #[arg(long, value_parser = parse_algo)]
    nccl_algo: Option<Algorithm>,
    /// Microseconds a rank's thread polls for its next call before it blocks (`TpOptions::spin`;
    /// 0: it blocks at once). Default: the library's.
    #[arg(long)]
    rank_spin_us: Option<u64>,
    /// Rows of each copy-engine gather slot for a long pass's sums, gathered in two interleaved
    /// halves of the prompt or in chunks (`TpOptions::gather_rows`; 0: all-reduced). Default: the
    /// library's.
    #[arg(long)]
    gather_rows: Option<usize>,
    /// Time all-reduces only (decode and prefill sizes, and 8 KB to 64 MB), no model.
    #[arg(long)]
    allreduce_only: bool,
    /// Also print each rank's replayed decode step timeline (CUPTI, 8 replays back to back), for the
    /// last rank count only and after everything it times (tracing slows a GPU's later graphs).
    #[arg(long)]
    timeline: bool,
    /// Decode settings to compare in this process, `;`-separated: `default`, or `,`-separated
    /// `attention=auto|cudnn|split-kv`, `split=auto|warp|block`, `pdl=on|off` (set on every rank,
    /// the step re-captured and timed, graph and back to back, in turn for `--variant-rounds`).
    #[arg(long, value_delimiter = ';', value_parser = parse_variant)]
    decode_variants: Vec<Variant>,
    /// Rounds over `--decode-variants`.
    #[arg(long, default_value_t = 3)]
    variant_rounds: usize,
    /// Measure every rank count in this process (by default each runs in a process of its own).
    #[arg(long)]
    same_process: bool,
    /// Write this invocation's one row as JSON to FILE instead of the results files (what the
    /// parent process asks of each rank count's process).
    #[arg(long, hide = true)]
    row_out: Option<PathBuf>,
}

/// A decode setting of `--decode-variants`: the context knobs every rank takes.
#[derive(Debug, Clone)]
struct Variant {
    name: String,
    attention: DecodeAttention,
    split: GemvSplit,
    pdl: bool,
}

fn parse_variant(s: &str) -> Result<Variant, String> {
    let mut v = Variant {
        name: s.trim().to_string(),
        attention: DecodeAttention::Auto,
        split: GemvSplit::Auto,
        pdl: true,
    };
    if v.name == "default" {
        return Ok(v);
    }
    for entry in s.trim().split(',') {
        let bad = || {
            format!("`{entry}`: a decode variant takes attention=auto|cudnn|split-kv, split=auto|warp|block, pdl=on|off or `default`")
        };
        let (key, value) = entry.split_once('=').ok_or_else(bad)?;
        match key.trim() {
            "attention" => v.attention = DecodeAttention::parse(value).ok_or_else(bad)?,
            "split" => v.split = GemvSplit::parse(value).ok_or_else(bad)?,
            "pdl" => {
                v.pdl = match value.trim() {
                    "on" => true,
                    "off" => false,
                    _ => return Err(bad()),
                }
            }
            _ => return Err(bad()),
        }
    }
    Ok(v)
}

fn parse_proto(s: &str) -> Result<Protocol, String> {
    s.parse().map_err(|e: NcclError| e.to_string())
}

fn parse_algo(s: &str) -> Result<Algorithm, String> {
    s.parse().map_err(|e: NcclError| e.to_string())
}

/// The NCCL settings of an invocation, and how long its ranks poll for calls: its columns in every
/// row and the suffix of its files.
#[derive(Debug, Clone, Default)]
struct Setting {
    nccl_min_ctas: Option<u32>,
    nccl_max_ctas: Option<u32>,
    nccl_cga_cluster_size: Option<u32>,
    /// Empty: NCCL's choice.
    nccl_proto: String,
    /// Empty: NCCL's choice.
    nccl_algo: String,
    /// `None`: the library's.
    rank_spin_us: Option<u64>,
    /// `None`: the library's.
    gather_rows: Option<usize>,
}

impl Setting {
    fn of(opts: &Options) -> Self {
        Setting {
            nccl_min_ctas: opts.nccl_min_ctas,
            nccl_max_ctas: opts.nccl_max_ctas,
            nccl_cga_cluster_size: opts.nccl_cga_cluster_size,
            nccl_proto: opts.nccl_proto.map_or(String::new(), |p| p.name().into()),
            nccl_algo: opts.nccl_algo.map_or(String::new(), |a| a.name().into()),
            rank_spin_us: opts.rank_spin_us,
            gather_rows: opts.gather_rows,
        }
    }

    /// The team's options: these settings, calls waiting at most `timeout` seconds.
    fn options(&self, timeout: u64) -> TpOptions {
        let options =
            TpOptions::default().with_timeout(Duration::from_secs(timeout)).with_nccl(self.config());
        let options = match self.rank_spin_us {
            Some(us) => options.with_spin(Duration::from_micros(us)),
            None => options,
        };
        match self.gather_rows {
            Some(rows) => options.with_gather_rows(rows),
            None => options,
        }
    }

    fn config(&self) -> NcclConfig {
        let mut c = NcclConfig::default();
        c.min_ctas = self.nccl_min_ctas;
        c.max_ctas = self.nccl_max_ctas;
        c.cga_cluster_size = self.nccl_cga_cluster_size;
        c
    }

    /// `min16-max32-cga0-LL128-Ring-spin0`, the parts given; `default` for none.
    fn label(&self) -> String {
        let numbers = [
            ("min", self.nccl_min_ctas.map(u64::from)),
            ("max", self.nccl_max_ctas.map(u64::from)),
            ("cga", self.nccl_cga_cluster_size.map(u64::from)),
        ];
        let parts: Vec<String> = numbers
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}{v}")))
            .chain([&self.nccl_proto, &self.nccl_algo].into_iter().filter(|s| !s.is_empty()).cloned())
            .chain(self.rank_spin_us.map(|us| format!("spin{us}")))
            .chain(self.gather_rows.map(|rows| format!("gather{rows}")))
            .collect();
        if parts.is_empty() {
            "default".into()
        } else {
            parts.join("-")
        }
    }

    /// `-<label>` for a non-default setting, so a sweep's invocations keep their files.
    fn file_suffix(&self) -> String {
        match self.label().as_str() {
            "default" => String::new(),
            l => format!("-{l}"),
        }
    }
}

/// The option that sets an NCCL attribute or variable, for errors.
fn cli_option(attribute: &str) -> &'static str {
    match attribute {
        "minCTAs" => "--nccl-min-ctas",
        "maxCTAs" => "--nccl-max-ctas",
        "cgaClusterSize" => "--nccl-cga-cluster-size",
        nccl::PROTO_ENV => "--nccl-proto",
        nccl::ALGO_ENV => "--nccl-algo",
        _ => "an --nccl option",
    }
}

/// An NCCL settings error as the option that caused it: `--nccl-min-ctas: NCCL minCTAs: ...`.
fn option_error(e: NcclError) -> Error {
    match &e {
        NcclError::Config { option, .. } => format!("{}: {e}", cli_option(option)).into(),
        _ => e.into(),
    }
}

/// One rank count's measurements.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct Row {
    model: String,
    layers: usize,
    ranks: usize,
    batch: usize,
    prompt: usize,
    fuse: String,
    prefill_ms: f64,
    prefill_tokens_per_s: f64,
    prefill_speedup: Option<f64>,
    prefill_efficiency: Option<f64>,
    decode_graph_ms: f64,
    decode_wall_ms: f64,
    /// Per step of `--steps` replays enqueued back to back and timed together (the slowest rank).
    decode_chain_ms: f64,
    decode_plain_ms: f64,
    decode_tokens_per_s: f64,
    decode_speedup: Option<f64>,
    decode_efficiency: Option<f64>,
    decode_chain_speedup: Option<f64>,
    allreduce_decode_us: f64,
    allreduce_prefill_us: f64,
    copy_gbps: f64,
    floor_ms: f64,
    roofline_pct: f64,
    roofline_with_allreduce_pct: f64,
    /// The NCCL setting's columns ([`Setting`]; the csv writer takes no flattened structs).
    nccl_min_ctas: Option<u32>,
    nccl_max_ctas: Option<u32>,
    nccl_cga_cluster_size: Option<u32>,
    nccl_proto: String,
    nccl_algo: String,
    rank_spin_us: Option<u64>,
    gather_rows: Option<usize>,
    error: String,
}

impl Row {
    /// The row of `ranks` ranks before anything is measured: what the options say.
    fn of(opts: &Options, cfg: &LlamaConfig, setting: &Setting, ranks: usize) -> Row {
        Row {
            model: cfg.name.clone(),
            layers: cfg.layers,
            ranks,
            batch: opts.batch,
            prompt: opts.prompt,
            fuse: opts.fuse.clone(),
            nccl_min_ctas: setting.nccl_min_ctas,
            nccl_max_ctas: setting.nccl_max_ctas,
            nccl_cga_cluster_size: setting.nccl_cga_cluster_size,
            nccl_proto: setting.nccl_proto.clone(),
            nccl_algo: setting.nccl_algo.clone(),
            rank_spin_us: setting.rank_spin_us,
            gather_rows: setting.gather_rows,
            ..Row::default()
        }
    }
}

/// The positions the bench's cache holds: the prompt, a warm-up step, `steps` plain steps, `steps`
/// replays, up to 8 timed from the caller and `steps` back to back (a decode variant's plain step and
/// replays start again at the prompt's end, the timeline's 8 replays after its first step: they fit).
fn bench_max_seq(prompt: usize, steps: usize) -> Option<usize> {
    steps.checked_mul(3)?.checked_add(prompt)?.checked_add(10)
}

/// The most rows one prefill forward of the bench runs (`--batch` × `--prompt`).
const MAX_PREFILL_ROWS: usize = 1 << 24;

/// The most repetitions a loop-count option takes.
const MAX_COUNT: usize = 1_000_000;

fn main() -> ExitCode {
    let opts = Options::parse();
    let plan = (|| -> Result<(LlamaConfig, WeightSource, Backends, Option<RankEnv>), Error> {
        let cfg = match &opts.checkpoint {
            Some(dir) => LlamaConfig::from_dir(dir)?,
            None => LlamaConfig::preset(&opts.preset)?,
        };
        let cfg = match opts.layers {
            Some(l) => cfg.with_layers(l),
            None => cfg,
        };
        let source = match &opts.checkpoint {
            Some(dir) => WeightSource::checkpoint(&cfg, dir)?,
            None => WeightSource::Random { seed: 0 },
        };
        if opts.ranks.is_empty() || opts.prompt == 0 || opts.batch == 0 || opts.steps == 0 || opts.reps == 0 {
            return Err(
                "--ranks, --prompt, --batch, --steps and --reps must be non-empty and non-zero".into()
            );
        }
        // Checked against the model before anything is made: the cache `measure` makes fits the
        // model's positions, a prefill's rows stay within 32-bit counts, loop counts stay countable.
        if bench_max_seq(opts.prompt, opts.steps).is_none_or(|n| n > cfg.max_positions) {
            return Err(format!(
                "--prompt {} and --steps {}: a cache of the prompt and 3 x the steps (+10) exceeds the model's \
                 {} positions",
                opts.prompt, opts.steps, cfg.max_positions
            )
            .into());
        }
        if opts.batch.checked_mul(opts.prompt).is_none_or(|n| n > MAX_PREFILL_ROWS) {
            return Err(format!(
                "--batch {} x --prompt {}: more than {MAX_PREFILL_ROWS} rows",
                opts.batch, opts.prompt
            )
            .into());
        }
        for (name, n) in
            [("--warmup", opts.warmup), ("--reps", opts.reps), ("--variant-rounds", opts.variant_rounds)]
        {
            if n > MAX_COUNT {
                return Err(format!("{name} {n}: give at most {MAX_COUNT}").into());
            }
        }
        if !opts.decode_variants.is_empty() && opts.variant_rounds == 0 {
            return Err("--variant-rounds must be at least 1 with --decode-variants".into());
        }
        if opts.row_out.is_some() && opts.ranks.len() != 1 {
            return Err("--row-out takes one rank count in --ranks".into());
        }
        let rank_env = RankEnv::of_several()?;
        if let Some(env) = &rank_env {
            let whose = format!("launched as rank {} of {} (WORLD_SIZE is set)", env.rank, env.world);
            if !opts.allreduce_only && opts.ranks != [env.world] {
                return Err(format!("{whose}: give --ranks {} (the world size)", env.world).into());
            }
            if opts.timeline || opts.gather_rows.is_some() || opts.row_out.is_some() {
                return Err(
                    format!("{whose}: --timeline and --gather-rows need every rank in one process").into()
                );
            }
        } else if opts.allreduce_only && opts.ranks.iter().all(|&r| r < 2) {
            return Err("--allreduce-only needs a rank count above 1 in --ranks".into());
        }
        if !opts.allreduce_only {
            for &r in &opts.ranks {
                ShardPlan::new(&cfg, r)?;
            }
        }
        Setting::of(&opts).config().validate().map_err(option_error)?;
        let backends = Backends::parse(&opts.fuse)?;
        // Last, once every option is known good: NCCL reads these at its first communicator.
        nccl::set_tuning_env(opts.nccl_proto, opts.nccl_algo).map_err(option_error)?;
        Ok((cfg, source, backends, rank_env))
    })();
    let (cfg, source, backends, rank_env) = match plan {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tp-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let setting = Setting::of(&opts);
    QUIET.store(rank_env.as_ref().is_some_and(|e| e.rank != 0), Ordering::Relaxed);
    // A rank count's process leaves the header to its parent.
    if opts.row_out.is_none() && opts.ranks.iter().any(|&r| r > 1) {
        match nccl::library() {
            Ok((v, lib)) => println!("# NCCL {} ({lib})", nccl::version_string(v)),
            Err(e) => println!("# NCCL: {e}"),
        }
        let env = |name: &str| std::env::var(name).unwrap_or_else(|_| "unset".into());
        let spin = setting.options(opts.timeout).spin;
        println!(
            "# settings `{}`: {}, {}={}, {}={}, ranks poll {} us for a call",
            setting.label(),
            setting.config(),
            nccl::PROTO_ENV,
            env(nccl::PROTO_ENV),
            nccl::ALGO_ENV,
            env(nccl::ALGO_ENV),
            spin.as_micros()
        );
    }
    if opts.allreduce_only {
        return match rank_env {
            Some(env) => allreduce_as_processes(&env, &opts, &cfg, &setting),
            None => allreduce_only(&opts, &cfg, &setting),
        };
    }
    let children = rank_env.is_none() && !opts.same_process && opts.row_out.is_none() && opts.ranks.len() > 1;
    let mut rows = Vec::new();
    for (i, &ranks) in opts.ranks.iter().enumerate() {
        let last = i + 1 == opts.ranks.len();
        let mut row = Row::of(&opts, &cfg, &setting, ranks);
        if children {
            rows.push(in_child(row, last));
            continue;
        }
        let trace = opts.timeline && last;
        if let Err(e) = measure(&opts, &cfg, &source, &backends, &mut row, trace, rank_env.as_ref()) {
            match &rank_env {
                Some(env) => say(&format!("tp-bench: rank {} of {ranks}: {e}", env.rank)),
                None => eprintln!("tp-bench: {ranks} rank(s): {e}"),
            }
            row.error = e.to_string();
        }
        rows.push(row);
    }
    if QUIET.load(Ordering::Relaxed) {
        return if rows[0].error.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) };
    }
    if let Some(path) = &opts.row_out {
        // A rank count's process: its row goes back to the parent, which writes the files.
        let written = serde_json::to_string(&rows[0]).map_err(Error::from).and_then(|json| {
            std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()).into())
        });
        if let Err(e) = written {
            eprintln!("tp-bench: cannot hand the row back: {e}");
            return ExitCode::from(1);
        }
        return if rows[0].error.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) };
    }
    if rows.iter().all(|r| !r.error.is_empty()) {
        return ExitCode::from(1);
    }
    scale(&mut rows);
    println!(
        "\n{:>5} {:>11} {:>9} {:>11} {:>11} {:>9} {:>11} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9}",
        "ranks",
        "prefill ms",
        "speedup",
        "efficiency",
        "decode ms",
        "speedup",
        "efficiency",
        "chain ms",
        "speedup",
        "wall ms",
        "allred us",
        "roof %",
        "+comm %"
    );
    for r in &rows {
        println!(
            "{:>5} {:>11.3} {:>9} {:>11} {:>11.4} {:>9} {:>11} {:>9.4} {:>9} {:>9.4} {:>10.1} {:>8.1}% {:>8.1}%{}",
            r.ranks,
            r.prefill_ms,
            times(r.prefill_speedup),
            percent(r.prefill_efficiency),
            r.decode_graph_ms,
            times(r.decode_speedup),
            percent(r.decode_efficiency),
            r.decode_chain_ms,
            times(r.decode_chain_speedup),
            r.decode_wall_ms,
            r.allreduce_decode_us,
            r.roofline_pct,
            r.roofline_with_allreduce_pct,
            if r.error.is_empty() { String::new() } else { format!("  failed: {}", r.error) }
        );
    }
    match csv_and_markdown(&rows) {
        Ok((csv, md)) => {
            let processes = if rank_env.is_some() { "-processes" } else { "" };
            let name = format!("tp-{}-{}l{}{processes}", cfg.name, cfg.layers, setting.file_suffix());
            write_results(&name, &csv, &md)
        }
        Err(e) => eprintln!("tp-bench: cannot write the results: {e}"),
    }
    ExitCode::SUCCESS
}

/// The arguments of rank count `ranks`'s process: this invocation's, with `--ranks` replaced and
/// `--timeline` only for the `last`, and `--row-out` appended by the caller.
fn child_args(args: &[String], ranks: usize, last: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--ranks" {
            it.next(); // its value
            continue;
        }
        if !a.starts_with("--ranks=") && (a != "--timeline" || last) {
            out.push(a.clone());
        }
    }
    out.extend(["--ranks".to_string(), ranks.to_string()]);
    out
}

/// `row`'s rank count measured by this executable in a process of its own; its output goes to ours.
/// A process that fails, or hands no row back, gives `row` with what went wrong.
fn in_child(mut row: Row, last: bool) -> Row {
    let ranks = row.ranks;
    let ran = (|| -> Result<Row, Error> {
        let exe = std::env::current_exe()?;
        let file = std::env::temp_dir().join(format!("tp-bench-{}-ranks{ranks}.json", std::process::id()));
        std::fs::remove_file(&file).ok();
        let args: Vec<String> = std::env::args().skip(1).collect();
        println!("\n# {ranks} rank(s): a process of its own");
        let status = std::process::Command::new(exe)
            .args(child_args(&args, ranks, last))
            .arg("--row-out")
            .arg(&file)
            .status();
        let text = std::fs::read_to_string(&file);
        std::fs::remove_file(&file).ok();
        match text {
            Ok(text) => Ok(serde_json::from_str(&text)?),
            Err(_) => Err(format!("its process ended ({}) without a row", status?).into()),
        }
    })();
    match ran {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tp-bench: {ranks} rank(s): {e}");
            row.error = e.to_string();
            row
        }
    }
}

/// Speedup and efficiency against the one-rank row (none without one: the columns stay empty).
fn scale(rows: &mut [Row]) {
    let Some(one) = rows.iter().find(|r| r.ranks == 1 && r.error.is_empty()).cloned() else { return };
    for r in rows.iter_mut().filter(|r| r.error.is_empty()) {
        let (prefill, decode) = (one.prefill_ms / r.prefill_ms, one.decode_graph_ms / r.decode_graph_ms);
        r.prefill_speedup = Some(prefill);
        r.prefill_efficiency = Some(prefill / r.ranks as f64);
        r.decode_speedup = Some(decode);
        r.decode_efficiency = Some(decode / r.ranks as f64);
        r.decode_chain_speedup = Some(one.decode_chain_ms / r.decode_chain_ms);
    }
}

/// `1.69x`, or `-` without a one-rank row.
fn times(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}x"))
}

/// `84.5%` of a fraction, or `-` without a one-rank row.
fn percent(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v))
}

/// The slowest rank's value of each rank's.
fn slowest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(0.0, f64::max)
}

fn measure(
    opts: &Options,
    cfg: &LlamaConfig,
    source: &WeightSource,
    backends: &Backends,
    row: &mut Row,
    trace: bool,
    env: Option<&RankEnv>,
) -> Result<(), Error> {
    let (ranks, batch, prompt, steps) = (row.ranks, opts.batch, opts.prompt, opts.steps);
    let max_seq = bench_max_seq(prompt, steps).ok_or("--prompt and --steps overflow")?;
    let t = Instant::now();
    let options = Setting::of(opts).options(opts.timeout);
    let mut tp = match env {
        Some(env) => TpLlama::<bf16>::join(cfg, env, source, max_seq, options)?,
        None => TpLlama::<bf16>::new(cfg, ranks, source, max_seq, options)?,
    };
    let how = if env.is_some() { " as processes (rank 0's times)" } else { "" };
    println!("\n## {ranks} ranks{how}: loaded in {:.1} s", t.elapsed().as_secs_f64());
    for (r, info) in tp.device_info()?.iter().enumerate() {
        println!("# rank {r}: {}", environment(info));
    }
    if ranks > 1 {
        let windows = tp.each("windows", |r| Ok(r.model.comm().is_some_and(|c| c.has_window())))?;
        let on = if windows.iter().all(|&w| w) { "on" } else { "off" };
        println!("# decode residual in NCCL symmetric windows: {on}");
        let gather = tp.each("gather", |r| Ok(r.model.comm().map_or(0, |c| c.gather_bytes())))?;
        println!("# long passes' sums gathered by the copy engines: {} bytes of window a rank", gather[0]);
    }
    let b = Arc::new(backends.clone());
    let ids: Arc<Vec<Vec<u32>>> = Arc::new(
        (0..batch)
            .map(|s| (0..prompt).map(|t| ((t * 7919 + s * 104729) % cfg.vocab) as u32).collect())
            .collect(),
    );

    // Prefill: one untimed (plans built and tuned) and `warmup` more, then `reps` timed from an
    // empty cache.
    tp.reset_cache(batch, max_seq)?;
    tp.forward(&ids, backends)?;
    let mut prefill = Vec::new();
    for rep in 0..opts.warmup + opts.reps {
        let (ids, b) = (ids.clone(), b.clone());
        let ms = slowest(tp.each("prefill", move |r| {
            r.parts()?.2.clear();
            let ((), ms) = r.timed(|r| {
                let (ctx, model, cache) = r.parts()?;
                model.forward(ctx, &ids, cache, &b, &mut NoObserver).map(drop)
            })?;
            Ok(ms)
        })?);
        if rep >= opts.warmup {
            prefill.push(ms);
        }
    }
    row.prefill_ms = median(prefill);
    let chunks = tp.each("gathered", |r| Ok([r.model.chunks_gathered(), r.model.passes_halved()]))?;
    let (gathered, halved): (Vec<u64>, Vec<u64>) = chunks.iter().map(|[c, h]| (c, h)).unzip();
    println!("# row chunks gathered by the copy engines per rank: {gathered:?}, passes halved: {halved:?}");
    row.prefill_tokens_per_s = (batch * prompt) as f64 / (row.prefill_ms * 1e-3);
    println!(
        "prefill {batch} x {prompt}: {:.3} ms ({:.0} tokens/s)",
        row.prefill_ms, row.prefill_tokens_per_s
    );

    // Decode: one plain step and its logits untimed (plans), `steps` plain steps, then the capture and
    // `steps` replays.
    let step_ids =
        |s: usize| -> Vec<u32> { (0..batch).map(|q| ((100 + s * 31 + q) % cfg.vocab) as u32).collect() };
    let plain_step = |tp: &mut TpLlama<bf16>, s: usize| -> Result<f64, Error> {
        let (ids, b) = (Arc::new(step_ids(s)), b.clone());
        Ok(slowest(tp.each("decode step", move |r| {
            let ((), ms) = r.timed(|r| {
                let (ctx, model, cache) = r.parts()?;
                let step: Vec<Vec<u32>> = ids.iter().map(|&t| vec![t]).collect();
                model.forward(ctx, &step, cache, &b, &mut NoObserver)?;
                model.logits_rows(ctx, 0..ids.len(), &b, &mut NoObserver).map(drop)
            })?;
            Ok(ms)
        })?))
    };
    // The median of `steps` replays of the captured step, each timed alone.
    let graph_ms = |tp: &mut TpLlama<bf16>| -> Result<f64, Error> {
        let each: Vec<f64> = (0..steps)
            .map(|s| replays_ms(tp, "decode replay", vec![step_ids(s)]))
            .collect::<Result<_, _>>()?;
        Ok(median(each))
    };
    plain_step(&mut tp, 0)?;
    let plain: Vec<f64> = (1..=steps).map(|s| plain_step(&mut tp, s)).collect::<Result<_, _>>()?;
    row.decode_plain_ms = median(plain);
    tp.capture_decode(backends)?;
    row.decode_graph_ms = graph_ms(&mut tp)?;
    let mut wall = Vec::new();
    for s in 0..steps.min(8) {
        let t = Instant::now();
        tp.decode(&step_ids(s))?;
        wall.push(t.elapsed().as_secs_f64() * 1e3);
    }
    row.decode_wall_ms = median(wall);
    // `steps` replays enqueued back to back in one job per rank and timed together, as a generation
    // loop that does not wait for each step runs them: the ranks' launch skew counts once, not per
    // step.
    row.decode_chain_ms = replays_ms(&mut tp, "decode chain", (0..steps).map(step_ids).collect())?;
    // The decode variants, each set on every rank and re-captured after a plain step from the prompt's
    // cache (the last one's settings stay for what follows, which does not decode).
    let mut by_variant: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); opts.decode_variants.len()];
    for round in 0..if opts.decode_variants.is_empty() { 0 } else { opts.variant_rounds } {
        for (v, times) in opts.decode_variants.iter().zip(&mut by_variant) {
            let set = v.clone();
            tp.each("decode variant", move |r| {
                r.ctx.set_decode_attention(set.attention);
                r.ctx.set_gemv_split(set.split);
                r.ctx.set_programmatic_launch(set.pdl);
                Ok(())
            })?;
            tp.truncate(prompt)?;
            plain_step(&mut tp, 0)?;
            tp.capture_decode(backends)?;
            let graph = graph_ms(&mut tp)?;
            tp.truncate(prompt + 1)?;
            let chain = replays_ms(&mut tp, "decode chain", (0..steps).map(step_ids).collect())?;
            println!(
                "variant ranks={ranks} round={round} {}: graph {graph:.4} ms, chain {chain:.4} ms",
                v.name
            );
            times.0.push(graph);
            times.1.push(chain);
        }
    }
    for (v, (graph, chain)) in opts.decode_variants.iter().zip(by_variant).filter(|(_, t)| !t.0.is_empty()) {
        println!(
            "variant ranks={ranks} {}: median graph {:.4} ms, chain {:.4} ms",
            v.name,
            median(graph),
            median(chain)
        );
    }
    row.decode_tokens_per_s = batch as f64 / (row.decode_graph_ms * 1e-3);
    println!(
        "decode step (batch {batch}): graph {:.4} ms, {steps} back to back {:.4} ms, plain {:.4} ms, wall {:.4} ms \
         ({:.1} tokens/s)",
        row.decode_graph_ms,
        row.decode_chain_ms,
        row.decode_plain_ms,
        row.decode_wall_ms,
        row.decode_tokens_per_s
    );

    // The all-reduces alone, at a decode step's and a prefill's size.
    let hidden = cfg.hidden;
    let sizes = [batch * hidden, batch * prompt * hidden];
    let allreduce = allreduce_us(&mut tp, &sizes, 20)?;
    (row.allreduce_decode_us, row.allreduce_prefill_us) = (allreduce[0], allreduce[1]);
    println!(
        "all-reduce: {:.1} us of {batch} x {hidden}, {:.1} us of {} x {hidden} (bf16)",
        row.allreduce_decode_us,
        row.allreduce_prefill_us,
        batch * prompt
    );

    // The memory floor of a rank's decode step, at the slowest rank's copy bandwidth.
    let copies = tp.each("copy bandwidth", |r| Ok(copy_bandwidth_gbps(&r.ctx, 1 << 30, 10)?))?;
    row.copy_gbps = copies.into_iter().fold(f64::INFINITY, f64::min);
    let cached = prompt + steps + steps / 2;
    let roof = tp.plan().decode_roofline(cfg, batch, cached, 2);
    row.floor_ms = roof.floor_ms(row.copy_gbps);
    let comm_ms = 2.0 * cfg.layers as f64 * row.allreduce_decode_us * 1e-3;
    row.roofline_pct = 100.0 * row.floor_ms / row.decode_graph_ms;
    row.roofline_with_allreduce_pct = 100.0 * (row.floor_ms + comm_ms) / row.decode_graph_ms;
    println!(
        "roofline: a rank reads {:.2} GB per step; at {:.0} GB/s that is {:.4} ms ({:.1}% of the step), {:.4} ms with \
         its {} all-reduces ({:.1}%)",
        roof.bytes() as f64 / 1e9,
        row.copy_gbps,
        row.floor_ms,
        row.roofline_pct,
        row.floor_ms + comm_ms,
        2 * cfg.layers,
        row.roofline_with_allreduce_pct
    );
    if trace {
        // Last: no timing follows in this process (the step as the last decode variant, if any, left
        // it). The replays restart after the prompt's first step.
        tp.truncate(prompt + 1)?;
        timeline(&mut tp, (0..8).map(step_ids).collect())?;
    }
    tp.finish();
    Ok(())
}

/// Milliseconds per step of replaying the captured decode step once per entry of `steps` (one id per
/// sequence each), enqueued back to back in one job per rank and timed together; the slowest rank's.
fn replays_ms(tp: &mut TpLlama<bf16>, what: &'static str, steps: Vec<Vec<u32>>) -> Result<f64, Error> {
    let n = steps.len() as f64;
    Ok(slowest(tp.each(what, move |r| {
        let ((), ms) = r.timed(|r| {
            let Rank { graph, cache, model, ctx, .. } = r;
            let (graph, cache) = graph
                .as_mut()
                .zip(cache.as_mut())
                .ok_or_else(|| cudnn_llm_llama::Error::Tp("no captured step".into()))?;
            steps.iter().try_for_each(|ids| model.decode(ctx, graph, ids, cache).map(drop))
        })?;
        Ok(ms / n)
    })?))
}

/// Each rank's [`StepTimeline`] of replays of the captured decode step, one per entry of `steps`,
/// enqueued back to back (CUPTI records every device's kernels). Skipped, saying why, where CUPTI
/// does not load.
fn timeline(tp: &mut TpLlama<bf16>, steps: Vec<Vec<u32>>) -> Result<(), Error> {
    let cupti = match cudnn_llm_cupti::Cupti::load() {
        Ok(c) => c,
        Err(e) => {
            println!("no replayed-step timeline: {e}");
            return Ok(());
        }
    };
    let n = steps.len();
    let devices: Vec<u32> = tp.device_info()?.iter().map(|i| i.ordinal as u32).collect();
    cupti.start()?;
    let replayed = replays_ms(tp, "timeline", steps);
    let collected = cupti.stop_and_collect()?;
    replayed?;
    for (r, d) in devices.into_iter().enumerate() {
        match StepTimeline::of(&collected.kernels, d, n) {
            Some(t) => {
                println!("rank {r} (GPU {d}), replayed decode step timeline (CUPTI, {n} replays): {t}")
            }
            None => println!(
                "rank {r} (GPU {d}): no replayed-step timeline ({} kernels recorded)",
                collected.kernels.len()
            ),
        }
    }
    Ok(())
}

/// Microseconds per in-place bf16 sum all-reduce of each size of `sizes` (elements), the slowest
/// rank's: 3 untimed, then `timed` back to back on the rank's stream between CUDA events. 0 for one
/// rank (no communicator).
fn allreduce_us(tp: &mut TpLlama<bf16>, sizes: &[usize], timed: usize) -> Result<Vec<f64>, Error> {
    let sizes = sizes.to_vec();
    let n = sizes.len();
    let per_rank = tp.each("all-reduce", move |r| {
        if r.model.comm().is_none() {
            return Ok(vec![0.0; sizes.len()]);
        }
        let stream = r.ctx.stream().clone();
        let mut out = Vec::new();
        for &n in &sizes {
            let mut buf = stream.alloc_zeros::<bf16>(n).map_err(cudnn_llm::Error::from)?;
            let mut reduce = |r: &mut Rank<bf16>, times: usize| -> cudnn_llm_llama::Result<()> {
                let comm =
                    r.model.comm().ok_or_else(|| cudnn_llm_llama::Error::Tp("no communicator".into()))?;
                for _ in 0..times {
                    comm.all_reduce_sum(&stream, &mut buf)?;
                }
                Ok(())
            };
            reduce(r, 3)?;
            let ((), ms) = r.timed(|r| reduce(r, timed))?;
            out.push(ms * 1e3 / timed as f64);
        }
        Ok(out)
    })?;
    Ok((0..n).map(|i| slowest(per_rank.iter().map(|v| v[i]).collect())).collect())
}

/// One all-reduce size of `--allreduce-only`.
#[derive(Debug, Clone, Default, serde::Serialize)]
struct AllreduceRow {
    ranks: usize,
    /// `decode` (batch × hidden), `prefill` (batch·prompt × hidden) or `sweep`.
    what: String,
    elements: usize,
    bytes: usize,
    us: f64,
    /// Bytes / time.
    algbw_gbps: f64,
    /// NCCL's bus bandwidth of an all-reduce: algbw · 2(n−1)/n.
    busbw_gbps: f64,
    /// As [`Row`]'s.
    nccl_min_ctas: Option<u32>,
    nccl_max_ctas: Option<u32>,
    nccl_cga_cluster_size: Option<u32>,
    nccl_proto: String,
    nccl_algo: String,
    rank_spin_us: Option<u64>,
    gather_rows: Option<usize>,
    error: String,
}

/// The sizes `--allreduce-only` times: a decode step's and the prefill's activations of `cfg`,
/// then 8 KB to 64 MB of bf16 in powers of two.
fn allreduce_sizes(cfg: &LlamaConfig, batch: usize, prompt: usize) -> Vec<(&'static str, usize)> {
    let sweep = (13..=26).map(|p| ("sweep", (1usize << p) / 2));
    [("decode", batch * cfg.hidden), ("prefill", batch * prompt * cfg.hidden)]
        .into_iter()
        .chain(sweep)
        .collect()
}

/// `--allreduce-only`: for each rank count above 1, the ranks (holding a 1-layer tiny model, loaded
/// in moments) time all-reduces of [`allreduce_sizes`]; printed and written.
fn allreduce_only(opts: &Options, cfg: &LlamaConfig, setting: &Setting) -> ExitCode {
    let sizes = allreduce_sizes(cfg, opts.batch, opts.prompt);
    let stand_in = LlamaConfig::tiny().with_layers(1);
    let mut rows = Vec::new();
    for &ranks in opts.ranks.iter().filter(|&&r| r > 1) {
        let row = |what: &str, elements: usize| AllreduceRow {
            ranks,
            what: what.into(),
            elements,
            bytes: 2 * elements,
            nccl_min_ctas: setting.nccl_min_ctas,
            nccl_max_ctas: setting.nccl_max_ctas,
            nccl_cga_cluster_size: setting.nccl_cga_cluster_size,
            nccl_proto: setting.nccl_proto.clone(),
            nccl_algo: setting.nccl_algo.clone(),
            rank_spin_us: setting.rank_spin_us,
            gather_rows: setting.gather_rows,
            ..AllreduceRow::default()
        };
        let t = Instant::now();
        let measured = (|| -> Result<Vec<f64>, Error> {
            let options = setting.options(opts.timeout);
            let mut tp =
                TpLlama::<bf16>::new(&stand_in, ranks, &WeightSource::Random { seed: 0 }, 16, options)?;
            let elements: Vec<usize> = sizes.iter().map(|s| s.1).collect();
            allreduce_us(&mut tp, &elements, 50)
        })();
        match measured {
            Ok(us) => {
                println!(
                    "\n## {ranks} ranks: {:.1} s\n{:>8} {:>12} {:>11} {:>10} {:>10}",
                    t.elapsed().as_secs_f64(),
                    "what",
                    "bytes",
                    "us",
                    "algbw",
                    "busbw"
                );
                for (&(what, elements), us) in sizes.iter().zip(us) {
                    let mut r = row(what, elements);
                    r.us = us;
                    r.algbw_gbps = r.bytes as f64 / (us * 1e-6) / 1e9;
                    r.busbw_gbps = r.algbw_gbps * 2.0 * (ranks - 1) as f64 / ranks as f64;
                    println!(
                        "{:>8} {:>12} {:>11.2} {:>6.1} GB/s {:>6.1} GB/s",
                        r.what, r.bytes, r.us, r.algbw_gbps, r.busbw_gbps
                    );
                    rows.push(r);
                }
            }
            Err(e) => {
                eprintln!("tp-bench: {ranks} ranks: {e}");
                rows.push(AllreduceRow { error: e.to_string(), ..row("all", 0) });
            }
        }
    }
    let failed = rows.iter().all(|r| !r.error.is_empty());
    match csv_and_markdown(&rows) {
        Ok((csv, md)) => write_results(&format!("tp-allreduce{}", setting.file_suffix()), &csv, &md),
        Err(e) => eprintln!("tp-bench: cannot write the results: {e}"),
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// `--allreduce-only` with one rank per process, started by `cudnn-llm-launch` or torchrun (`WORLD_SIZE`
/// and the rest set): the ranks join through the TCP rendezvous, make their communicator from rank 0's
/// unique id ([`Comm::init_rank`]) and time the sizes of [`allreduce_sizes`] (3 untimed, then the median
/// of 5 samples of 10 back to back between CUDA events); rank 0 prints its times and writes
/// `tp-allreduce-processes`. A rank that fails or dies ends the others, naming it.
fn allreduce_as_processes(env: &RankEnv, opts: &Options, cfg: &LlamaConfig, setting: &Setting) -> ExitCode {
    let sizes = allreduce_sizes(cfg, opts.batch, opts.prompt);
    let rank = env.rank;
    let measured = (|| -> Result<Vec<f64>, Error> {
        let timeout = Duration::from_secs(opts.timeout);
        let new_id = || UniqueId::new().map(|id| id.as_bytes().to_vec()).map_err(|e| e.to_string());
        let mut session = Session::join(env, timeout, new_id)?;
        session.watch(Duration::from_secs(opts.timeout.clamp(5, 600)), move |why| {
            say(&format!("tp-bench: rank {rank}: {why}; ending this rank"));
            std::process::exit(1);
        });
        let id = UniqueId::from_bytes(session.payload())?;
        let ctx = cudnn_llm::Cudnn::new(env.local_rank)?;
        let comm = Comm::init_rank(env.local_rank, env.rank, env.world, &id, &setting.config())?;
        let stream = ctx.stream();
        let cuda = stream.context();
        let timing = Some(cudnn_llm::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (cuda.new_event(timing)?, cuda.new_event(timing)?);
        let mut us = Vec::new();
        for &(_, n) in &sizes {
            let mut buf = stream.alloc_zeros::<bf16>(n)?;
            for _ in 0..3 {
                comm.all_reduce_sum(stream, &mut buf)?;
            }
            let mut samples = Vec::new();
            for _ in 0..5 {
                start.record(stream)?;
                for _ in 0..10 {
                    comm.all_reduce_sum(stream, &mut buf)?;
                }
                end.record(stream)?;
                samples.push(start.elapsed_ms(&end)? as f64 * 1e3 / 10.0);
            }
            us.push(median(samples));
        }
        drop(comm);
        session.finish();
        Ok(us)
    })();
    let us = match measured {
        Ok(us) => us,
        Err(e) => {
            say(&format!("tp-bench: rank {rank} of {}: {e}", env.world));
            return ExitCode::from(1);
        }
    };
    if rank != 0 {
        return ExitCode::SUCCESS;
    }
    let ranks = env.world;
    println!(
        "\n## {ranks} ranks as processes (rank 0's times)\n{:>8} {:>12} {:>11} {:>10} {:>10}",
        "what", "bytes", "us", "algbw", "busbw"
    );
    let mut rows = Vec::new();
    for (&(what, elements), us) in sizes.iter().zip(us) {
        let bytes = 2 * elements;
        let algbw_gbps = bytes as f64 / (us * 1e-6) / 1e9;
        let row = AllreduceRow {
            ranks,
            what: what.into(),
            elements,
            bytes,
            us,
            algbw_gbps,
            busbw_gbps: algbw_gbps * 2.0 * (ranks - 1) as f64 / ranks as f64,
            nccl_min_ctas: setting.nccl_min_ctas,
            nccl_max_ctas: setting.nccl_max_ctas,
            nccl_cga_cluster_size: setting.nccl_cga_cluster_size,
            nccl_proto: setting.nccl_proto.clone(),
            nccl_algo: setting.nccl_algo.clone(),
            ..AllreduceRow::default()
        };
        println!(
            "{:>8} {:>12} {:>11.2} {:>6.1} GB/s {:>6.1} GB/s",
            row.what, row.bytes, row.us, row.algbw_gbps, row.busbw_gbps
        );
        rows.push(row);
    }
    match csv_and_markdown(&rows) {
        Ok((csv, md)) => {
            write_results(&format!("tp-allreduce-processes{}", setting.file_suffix()), &csv, &md)
        }
        Err(e) => eprintln!("tp-bench: cannot write the results: {e}"),
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::child_args;

    #[test]
    fn a_rank_counts_process_takes_the_options_with_its_rank_count() {
        let args: Vec<String> =
            ["--preset", "tiny", "--ranks", "1,2", "--timeline", "--steps=4", "--ranks=2,1"]
                .map(String::from)
                .to_vec();
        assert_eq!(
            child_args(&args, 2, true),
            ["--preset", "tiny", "--timeline", "--steps=4", "--ranks", "2"]
        );
        assert_eq!(child_args(&args, 1, false), ["--preset", "tiny", "--steps=4", "--ranks", "1"]);
    }
}
