//! `cargo run --release --features app --bin tp-bench -- [options]`: tensor parallelism against one
//! GPU, in one process and one device call. For each rank count of `--ranks` (default `1,2`) it
//! loads the model (random weights, or `--checkpoint DIR`), then times on every rank with CUDA events
//! (the slowest rank's time counts):
//!
//! - the prefill forward of `--batch` × `--prompt` tokens (median of `--reps`);
//! - a decode step (one token per sequence, its logits all-gathered): `--steps` plain launches and
//!   `--steps` replays of the captured CUDA graph, and the graph replay's wall time from the caller
//!   (host logits included);
//! - one all-reduce of a decode step's `[batch, hidden]` and of the prefill's `[batch·prompt, hidden]`;
//! - the device copy bandwidth, for the per-rank memory floor of a decode step (the bytes one rank
//!   reads, [`ShardPlan::decode_roofline`]) and that floor plus the step's 2 all-reduces per layer.
//!
//! Then speedup and scaling efficiency (speedup / ranks) against the one-rank row, printed and written
//! as `tp-<preset>-<layers>l.{csv,md}` under `$BENCH_RESULTS_DIR` (default `benches/results`).
//! Llama-3.1-70B shapes: `--preset llama-3.1-70b --layers 8 --ranks 1,2` (a one-GPU row of all 80
//! layers does not leave room for much else on a 141 GB H200). Exit codes: 0 done (rows that failed
//! say why), 2 bad options, 1 no row ran.

use clap::Parser;
use cudnn_llm::bench_util::{copy_bandwidth_gbps, csv_and_markdown, environment, median, write_results};
use cudnn_llm_llama::tp::{Rank, ShardPlan, TpLlama, TpOptions, WeightSource};
use cudnn_llm_llama::{nccl, Backends, LlamaConfig, NoObserver};
use half::bf16;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// What to measure.
#[derive(Debug, Clone, Parser)]
#[command(name = "tp-bench", about = "Tensor-parallel prefill and decode against one GPU")]
struct Options {
    /// Model preset: llama-3.2-1b, llama-3.1-8b, llama-3.1-70b or tiny.
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
    /// Timed prefills.
    #[arg(long, default_value_t = 5)]
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
}

/// One rank count's measurements.
#[derive(Debug, Clone, Default, serde::Serialize)]
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
    decode_plain_ms: f64,
    decode_tokens_per_s: f64,
    decode_speedup: Option<f64>,
    decode_efficiency: Option<f64>,
    allreduce_decode_us: f64,
    allreduce_prefill_us: f64,
    copy_gbps: f64,
    floor_ms: f64,
    roofline_pct: f64,
    roofline_with_allreduce_pct: f64,
    error: String,
}

fn main() -> ExitCode {
    let opts = Options::parse();
    let plan = (|| -> Result<(LlamaConfig, WeightSource, Backends), Error> {
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
        for &r in &opts.ranks {
            ShardPlan::new(&cfg, r)?;
        }
        Ok((cfg, source, Backends::parse(&opts.fuse)?))
    })();
    let (cfg, source, backends) = match plan {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tp-bench: {e}");
            return ExitCode::from(2);
        }
    };
    if opts.ranks.iter().any(|&r| r > 1) {
        match nccl::library() {
            Ok((v, lib)) => println!("# NCCL {} ({lib})", nccl::version_string(v)),
            Err(e) => println!("# NCCL: {e}"),
        }
    }
    let mut rows = Vec::new();
    for &ranks in &opts.ranks {
        let mut row = Row {
            model: cfg.name.clone(),
            layers: cfg.layers,
            ranks,
            batch: opts.batch,
            prompt: opts.prompt,
            fuse: opts.fuse.clone(),
            ..Row::default()
        };
        if let Err(e) = measure(&opts, &cfg, &source, &backends, &mut row) {
            eprintln!("tp-bench: {ranks} rank(s): {e}");
            row.error = e.to_string();
        }
        rows.push(row);
    }
    if rows.iter().all(|r| !r.error.is_empty()) {
        return ExitCode::from(1);
    }
    scale(&mut rows);
    println!(
        "\n{:>5} {:>11} {:>9} {:>11} {:>11} {:>9} {:>11} {:>9} {:>10} {:>9} {:>9}",
        "ranks",
        "prefill ms",
        "speedup",
        "efficiency",
        "decode ms",
        "speedup",
        "efficiency",
        "wall ms",
        "allred us",
        "roof %",
        "+comm %"
    );
    for r in &rows {
        println!(
            "{:>5} {:>11.3} {:>9} {:>11} {:>11.4} {:>9} {:>11} {:>9.4} {:>10.1} {:>8.1}% {:>8.1}%{}",
            r.ranks,
            r.prefill_ms,
            times(r.prefill_speedup),
            percent(r.prefill_efficiency),
            r.decode_graph_ms,
            times(r.decode_speedup),
            percent(r.decode_efficiency),
            r.decode_wall_ms,
            r.allreduce_decode_us,
            r.roofline_pct,
            r.roofline_with_allreduce_pct,
            if r.error.is_empty() { String::new() } else { format!("  failed: {}", r.error) }
        );
    }
    match csv_and_markdown(&rows) {
        Ok((csv, md)) => write_results(&format!("tp-{}-{}l", cfg.name, cfg.layers), &csv, &md),
        Err(e) => eprintln!("tp-bench: cannot write the results: {e}"),
    }
    ExitCode::SUCCESS
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
) -> Result<(), Error> {
    let (ranks, batch, prompt, steps) = (row.ranks, opts.batch, opts.prompt, opts.steps);
    // The prompt, a warm-up step, `steps` plain steps, `steps` replays and up to 8 timed from the caller.
    let max_seq = prompt + 2 * steps + 10;
    let t = Instant::now();
    let options = TpOptions::default().with_timeout(Duration::from_secs(opts.timeout));
    let mut tp = TpLlama::<bf16>::new(cfg, ranks, source, max_seq, options)?;
    println!("\n## {} ranks: loaded in {:.1} s", ranks, t.elapsed().as_secs_f64());
    for (r, info) in tp.device_info()?.iter().enumerate() {
        println!("# rank {r}: {}", environment(info));
    }
    let b = Arc::new(backends.clone());
    let ids: Arc<Vec<Vec<u32>>> = Arc::new(
        (0..batch)
            .map(|s| (0..prompt).map(|t| ((t * 7919 + s * 104729) % cfg.vocab) as u32).collect())
            .collect(),
    );

    // Prefill: one untimed (plans built and tuned), then `reps` timed from an empty cache.
    tp.reset_cache(batch, max_seq)?;
    tp.forward(&ids, backends)?;
    let mut prefill = Vec::new();
    for _ in 0..opts.reps {
        let (ids, b) = (ids.clone(), b.clone());
        prefill.push(slowest(tp.each("prefill", move |r| {
            r.parts()?.2.truncate(0);
            let ((), ms) = r.timed(|r| {
                let (ctx, model, cache) = r.parts()?;
                model.forward(ctx, &ids, cache, &b, &mut NoObserver).map(drop)
            })?;
            Ok(ms)
        })?));
    }
    row.prefill_ms = median(prefill);
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
    plain_step(&mut tp, 0)?;
    let plain: Vec<f64> = (1..=steps).map(|s| plain_step(&mut tp, s)).collect::<Result<_, _>>()?;
    row.decode_plain_ms = median(plain);
    tp.capture_decode(backends)?;
    let mut graph = Vec::new();
    for s in 0..steps {
        let ids = Arc::new(step_ids(s));
        graph.push(slowest(tp.each("decode replay", move |r| {
            let ((), ms) = r.timed(|r| {
                let Rank { graph, cache, model, ctx, .. } = r;
                let (graph, cache) = graph
                    .as_mut()
                    .zip(cache.as_mut())
                    .ok_or_else(|| cudnn_llm_llama::Error::Tp("no captured step".into()))?;
                model.decode(ctx, graph, &ids, cache).map(drop)
            })?;
            Ok(ms)
        })?));
    }
    row.decode_graph_ms = median(graph);
    let mut wall = Vec::new();
    for s in 0..steps.min(8) {
        let t = Instant::now();
        tp.decode(&step_ids(s))?;
        wall.push(t.elapsed().as_secs_f64() * 1e3);
    }
    row.decode_wall_ms = median(wall);
    row.decode_tokens_per_s = batch as f64 / (row.decode_graph_ms * 1e-3);
    println!(
        "decode step (batch {batch}): graph {:.4} ms, plain {:.4} ms, wall {:.4} ms ({:.1} tokens/s)",
        row.decode_graph_ms, row.decode_plain_ms, row.decode_wall_ms, row.decode_tokens_per_s
    );

    // The all-reduces alone, at a decode step's and a prefill's size.
    let hidden = cfg.hidden;
    let sizes = [batch * hidden, batch * prompt * hidden];
    let allreduce = tp.each("all-reduce", move |r| {
        if r.model.comm().is_none() {
            return Ok(vec![0.0; 2]);
        }
        let stream = r.ctx.stream().clone();
        let mut out = Vec::new();
        for n in sizes {
            let mut buf = stream.alloc_zeros::<bf16>(n).map_err(cudnn_llm::Error::from)?;
            // 3 untimed, then 20 timed.
            let mut reduce = |r: &mut Rank<bf16>, times: usize| -> cudnn_llm_llama::Result<()> {
                let comm =
                    r.model.comm().ok_or_else(|| cudnn_llm_llama::Error::Tp("no communicator".into()))?;
                for _ in 0..times {
                    comm.all_reduce_sum(&stream, &mut buf)?;
                }
                Ok(())
            };
            reduce(r, 3)?;
            let ((), ms) = r.timed(|r| reduce(r, 20))?;
            out.push(ms * 1e3 / 20.0);
        }
        Ok(out)
    })?;
    row.allreduce_decode_us = slowest(allreduce.iter().map(|v| v[0]).collect());
    row.allreduce_prefill_us = slowest(allreduce.iter().map(|v| v[1]).collect());
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
    Ok(())
}
