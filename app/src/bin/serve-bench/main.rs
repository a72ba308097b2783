//! `cargo run --release --bin serve-bench -- [options]`: a serving benchmark of
//! continuous batching ([`BatchEngine`]) over a paged KV cache, on a model preset with seeded random
//! weights (Llama-3.1-8B shapes by default, `--layers` to cut it) and a seeded synthetic request stream:
//! Poisson arrivals at `--rate` requests/s, prompt and output lengths uniform in `--prompt-len` and
//! `--output-len` (prompt lengths in steps of `--prompt-step`, so that the prefill shapes, each its own
//! plans, are few and warmed up before timing). Requests are admitted first come, first served while
//! fewer than `--max-batch` sequences are live and the pool has pages for the whole request (prompt and
//! output), each prefilled alone; all live sequences decode together, one token each per step (a
//! captured CUDA graph per batch-size bucket in `--mode graph`), and a sequence leaves when it has its
//! output, giving its pages to the next.
//!
//! Reports the decode throughput (generated tokens/s over the run), time to first token (arrival to
//! the first new id on the host, queueing and prefill included), inter-token latency (between a
//! sequence's consecutive ids) and end-to-end latency percentiles (p50, p90, p99), the mean batch, and
//! the attention form (paged, or the contiguous fallback and why): to stdout as markdown, and with
//! `--out DIR` as `serve.md`, `serve-summary.csv` and `serve-requests.csv` (one row per request).
//!
//! Each engine call of the timed run is timed too ([`steps`]): its GPU time (CUDA events around it on
//! the context's stream, read after the run; `--no-step-timing` leaves them out), its wall time
//! (launch to ids back) and the host time after it until the next call. The summary gains the decode
//! steps' GPU, wall and host-after percentiles, the prefills' GPU and wall percentiles, the mean
//! prefills between consecutive decode steps and the decode-graph captures during the timed run (a
//! capture there is a stall: a graph gone stale, [`BatchEngine::graph_counts`]); `--out` adds
//! `serve-steps.csv` (one row per call: kind, rows, bucket, gpu_ms, wall_ms, host_ms).
//!
//! A soak (`--duration`, `--burst`, `--cancel`, `--check-alone`): the requests arriving in the first
//! `--duration` seconds, in bursts, a fraction cancelled part way (ended with [`BatchEngine::remove`]
//! after a uniform number of their ids); the summary adds the requests cancelled and lost (every
//! request must end with the ids it asked for, or those it had when cancelled), the device memory
//! before and after the run (free, the context's pool in use, the workspace, the plans held), and
//! with `--check-alone S` how many ended greedy requests, rerun one at a time on a single-sequence
//! decoder for up to S seconds, gave the same ids (or parted only at a near-tie,
//! [`bench_util::NEAR_TIE`]). A stream of more than 64 prompt lengths has none of them warmed up:
//! their plans build during the run, as a server's would.
//!
//! Exit codes: 0 done; 2 bad options; 1 no usable GPU, a failure while serving, a lost request or a
//! request whose ids parted from its run alone.

use clap::Parser;
use cudnn_llm_app::bench_util::{
    self, csv_and_markdown, environment, greedy_alone, same_greedy_ids, tool_main,
};
use cudnn_llm_llama::generate::DecodeMode;
use cudnn_llm_llama::sampling::SamplingParams;
use cudnn_llm_llama::weights::Weights;
use cudnn_llm_llama::{Backends, BatchConfig, BatchEngine, Generator, GraphCounts, Llama, LlamaConfig};
use cudnn_llm_ops::{
    default_plan_dir, Cudnn, DataType, Element, PageOrder, PageShape, PagedKvShape, PLAN_DIR_ENV,
};
use half::{bf16, f16};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod steps;
mod workload;

use steps::{CallDetail, Dist, StepKind, StepLog, StepRow, StepSummary};
use workload::{lost, prefill_groups, requests, Mix, Request, Span};

type Error = Box<dyn std::error::Error>;

/// What to serve and how.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "serve-bench",
    about = "Continuous batching over a paged KV cache on a synthetic request stream"
)]
struct Options {
    /// Model preset, with seeded random weights: smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b or tiny.
    #[arg(long, default_value = "llama-3.1-8b")]
    preset: String,
    /// Decoder layers (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    /// I/O dtype: bf16 or f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Requests in the stream.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Arrivals per second (a Poisson process); `inf`: every request at the start.
    #[arg(long, default_value_t = 8.0)]
    rate: f64,
    /// Prompt lengths, MIN:MAX (uniform).
    #[arg(long, default_value = "128:1024")]
    prompt_len: Span,
    /// Prompt lengths are multiples of this (rounded into the range): few prefill shapes to warm up.
    #[arg(long, default_value_t = 64)]
    prompt_step: usize,
    /// Output lengths (new ids per request), MIN:MAX (uniform).
    #[arg(long, default_value = "64:512")]
    output_len: Span,
    /// The most sequences decoding together.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Positions per KV-cache page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Pages of each layer's K and V pools (default: --max-batch requests of the longest prompt and
    /// output).
    #[arg(long)]
    pages: Option<usize>,
    /// Storage order inside a page: head-major or token-major.
    #[arg(long, default_value = "head-major")]
    order: String,
    /// Decode steps: `graph` (a captured CUDA graph per batch-size bucket) or `launch`.
    #[arg(long, default_value = "graph")]
    mode: String,
    /// Prefill batching: the requests admitted in one step are prefilled together, packed in
    /// forwards of up to this many prompt tokens (a longer prompt alone); 0: one prompt per forward.
    #[arg(long, default_value_t = 8192)]
    prefill_tokens: usize,
    /// Sampling temperature (0: greedy); each request draws from its own stream seeded by --seed.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Arrivals come in bursts of 1 to this many requests at one time (the bursts' times a Poisson
    /// process, so that requests still arrive at --rate); 1: one at a time.
    #[arg(long, default_value_t = 1)]
    burst: usize,
    /// The fraction of requests (of 2 or more new ids) cancelled part way, each after a uniform number
    /// of its ids (1 to one fewer than it asked for).
    #[arg(long, default_value_t = 0.0)]
    cancel: f64,
    /// A soak of this many seconds: the requests arriving in that window are served (the stream of
    /// --requests must reach past it), and the run ends when they have all ended.
    #[arg(long)]
    duration: Option<f64>,
    /// After the run, reruns the ended greedy requests one at a time on a single-sequence decoder, in a
    /// seeded order, for up to this many seconds, and compares their ids (a cancelled one's: those it
    /// had); 0: no check.
    #[arg(long, default_value_t = 0.0)]
    check_alone: f64,
    /// Seed of the weights, the request stream and the sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Leave out the CUDA events around each decode step and prefill (their GPU times); wall and host
    /// times are still taken.
    #[arg(long)]
    no_step_timing: bool,
    /// Directory for serve.md, serve-summary.csv, serve-requests.csv and serve-steps.csv.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The most sequences decoding together (a CUDA graph per bucket up to it, activations for it).
const MAX_BATCH: usize = 1 << 16;

/// The most prompt tokens one packed prefill takes (its activations are reserved up front).
const MAX_PREFILL_TOKENS: usize = 1 << 20;

/// The most prompt ids a stream draws up front (all its requests' prompts).
const MAX_STREAM_TOKENS: usize = 1 << 28;

/// The most requests a stream holds (each is drawn up front, with its prompt ids, before the run).
const MAX_REQUESTS: usize = 1_000_000;

/// The largest burst of arrivals at one time.
const MAX_BURST: usize = MAX_REQUESTS;

/// A stream of more prompt lengths than this has none warmed up (their plans build in the run).
const MAX_WARM_PROMPT_LENGTHS: usize = 64;

/// The options, checked.
#[derive(Debug, Clone)]
struct Plan {
    config: LlamaConfig,
    dtype: DataType,
    batch: BatchConfig,
    mode: DecodeMode,
    requests: Vec<Request>,
    /// The distinct prompt lengths of the stream (warmed up before timing).
    prompt_lengths: Vec<usize>,
}

impl Options {
    /// Checks every option (no GPU) and draws the request stream.
    fn resolve(&self) -> Result<Plan, String> {
        let mut config = LlamaConfig::preset(&self.preset).map_err(|e| format!("--preset: {e}"))?;
        if let Some(l) = self.layers {
            if l == 0 {
                return Err("--layers must be at least 1".into());
            }
            config = config.with_layers(l);
        }
        config.check().map_err(|e| format!("--layers: {e}"))?;
        let dtype = match self.dtype.as_str() {
            "bf16" => DataType::BF16,
            "f16" => DataType::F16,
            other => return Err(format!("--dtype {other}: give bf16 or f16")),
        };
        let order = match self.order.as_str() {
            "head-major" => PageOrder::HeadMajor,
            "token-major" => PageOrder::TokenMajor,
            other => return Err(format!("--order {other}: give head-major or token-major")),
        };
        let mode = match self.mode.as_str() {
            "graph" => DecodeMode::Graph,
            "launch" => DecodeMode::Launch,
            other => return Err(format!("--mode {other}: give graph or launch")),
        };
        if !(1..=MAX_REQUESTS).contains(&self.requests) {
            return Err(format!("--requests {}: give 1 to {MAX_REQUESTS}", self.requests));
        }
        if self.rate.is_nan() || self.rate <= 0.0 {
            return Err(format!("--rate {}: give a rate > 0 (inf: all at once)", self.rate));
        }
        if self.prompt_step == 0 {
            return Err("--prompt-step must be at least 1".into());
        }
        if self.page_size == 0 || self.max_batch == 0 {
            return Err("--page-size and --max-batch must be at least 1".into());
        }
        if self.max_batch > MAX_BATCH {
            return Err(format!("--max-batch {}: give at most {MAX_BATCH}", self.max_batch));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("--temperature {}: give a finite value >= 0", self.temperature));
        }
        if !(1..=MAX_BURST).contains(&self.burst) {
            return Err(format!("--burst {}: give 1 to {MAX_BURST}", self.burst));
        }
        if !(0.0..=1.0).contains(&self.cancel) {
            return Err(format!("--cancel {}: give a fraction in 0..=1", self.cancel));
        }
        if let Some(d) = self.duration {
            if !(d.is_finite() && d > 0.0) {
                return Err(format!("--duration {d}: give a finite number of seconds > 0"));
            }
        }
        if !(self.check_alone.is_finite() && self.check_alone >= 0.0) {
            return Err(format!("--check-alone {}: give a finite number of seconds >= 0", self.check_alone));
        }
        if self.check_alone > 0.0 && self.temperature != 0.0 {
            return Err(format!(
                "--check-alone with --temperature {}: only greedy requests (temperature 0) are compared",
                self.temperature
            ));
        }
        // Prompt lengths in steps: the multiples of the step inside the range.
        let step = self.prompt_step;
        let p = self.prompt_len;
        let (lo, hi) = (p.min.checked_next_multiple_of(step).unwrap_or(usize::MAX), p.max / step * step);
        if lo > hi {
            return Err(format!(
                "--prompt-len {}:{} holds no multiple of --prompt-step {step}",
                p.min, p.max
            ));
        }
        let steps = Span { min: lo / step, max: hi / step };
        // Checked: a range's MAX is any usize the user typed.
        let max_seq = hi
            .checked_add(self.output_len.max)
            .filter(|&n| n <= config.max_positions)
            .ok_or_else(|| {
                format!(
                    "--prompt-len {}:{} with --output-len {}:{}: the longest request ({hi} prompt + {} output \
                     ids) is longer than the model's {} positions",
                    p.min, p.max, self.output_len.min, self.output_len.max, self.output_len.max, config.max_positions
                )
            })?;
        if self.page_size > config.max_positions {
            return Err(format!(
                "--page-size {}: longer than the model's {} positions",
                self.page_size, config.max_positions
            ));
        }
        // Every request's prompt ids are drawn up front.
        if self.requests.checked_mul(hi).is_none_or(|t| t > MAX_STREAM_TOKENS) {
            return Err(format!(
                "--requests {} x --prompt-len up to {hi}: more than {MAX_STREAM_TOKENS} prompt ids",
                self.requests
            ));
        }
        if self.prefill_tokens > MAX_PREFILL_TOKENS {
            return Err(format!(
                "--prefill-tokens {}: give at most {MAX_PREFILL_TOKENS}",
                self.prefill_tokens
            ));
        }
        let per_seq = max_seq.div_ceil(self.page_size);
        let pages = self.pages.unwrap_or(self.max_batch.saturating_mul(per_seq));
        if pages < per_seq {
            return Err(format!(
                "--pages {pages}: the longest request ({hi} prompt + {} output ids) needs {per_seq} pages of {}",
                self.output_len.max, self.page_size
            ));
        }
        // Activations for the largest forward of the run (the longest prompt, a packed prefill of up to
        // --prefill-tokens, a decode step of --max-batch): a larger one would reallocate them inside the
        // timed run and make every captured decode graph stale.
        let reserve = hi.max(self.max_batch).max(self.prefill_tokens);
        let batch = BatchConfig::new(self.max_batch, max_seq, self.page_size)
            .with_pages(pages)
            .with_order(order)
            .with_reserve_rows(reserve);
        batch.check().map_err(|e| e.to_string())?;
        // The page pool's and table's shapes, checked here as the cache will (page ids fit i32).
        let shape = PageShape::new(pages, self.page_size, config.kv_heads, config.head_dim, order)
            .map_err(|e| format!("--pages {pages}: {e}"))?;
        PagedKvShape::new(config.layers, self.max_batch, max_seq, shape)
            .map_err(|e| format!("--pages {pages}, --max-batch {}: {e}", self.max_batch))?;
        let mix = Mix { rate: self.rate, burst: self.burst, cancel: self.cancel };
        let mut reqs = requests(self.requests, mix, steps, self.output_len, config.vocab, self.seed);
        if let Some(d) = self.duration {
            let last = reqs.last().map_or(0.0, |r| r.arrival);
            if last < d {
                return Err(format!(
                    "--duration {d}: the stream of --requests {} at --rate {} ends at {last:.1} s; give more \
                     requests",
                    self.requests, self.rate
                ));
            }
            reqs.retain(|r| r.arrival < d);
            if reqs.is_empty() {
                return Err(format!("--duration {d}: no request arrives in the window"));
            }
        }
        for r in &mut reqs {
            // `steps` drew the number of steps: the prompt is that many steps long.
            let n = r.prompt.len() * step;
            r.prompt = r.prompt.iter().cycle().take(n).copied().collect();
        }
        let mut prompt_lengths: Vec<usize> = reqs.iter().map(|r| r.prompt.len()).collect();
        prompt_lengths.sort_unstable();
        prompt_lengths.dedup();
        Ok(Plan { config, dtype, batch, mode, requests: reqs, prompt_lengths })
    }
}

fn main() -> ExitCode {
    let opts = Options::parse();
    tool_main(
        "serve-bench",
        || opts.resolve(),
        |ctx, plan| {
            // Warm plans across runs, as the other tools: the plan directory from the environment or the
            // default.
            if std::env::var_os(PLAN_DIR_ENV).is_none() {
                ctx.set_plan_dir(default_plan_dir().as_deref());
            }
            match plan.dtype {
                DataType::F16 => run::<f16>(ctx, &opts, &plan),
                _ => run::<bf16>(ctx, &opts, &plan),
            }
        },
    )
}

/// One request's timings.
#[derive(Debug, Clone, Serialize)]
struct RequestRow {
    request: usize,
    arrival_s: f64,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Ended by a cancellation before its last id.
    cancelled: bool,
    /// Arrival to admission (waiting for a slot or pages).
    queue_ms: f64,
    /// Arrival to the first new id on the host.
    ttft_ms: f64,
    /// Mean gap between its consecutive ids (empty for one id).
    mean_itl_ms: Option<f64>,
    /// Arrival to its last id.
    e2e_ms: f64,
}

/// One line of the summary.
#[derive(Debug, Clone, Serialize)]
struct SummaryRow {
    metric: String,
    value: String,
    p50: String,
    p90: String,
    p99: String,
}

/// A live request.
struct State {
    request: usize,
    produced: usize,
    pages: usize,
    last_at: f64,
    itl: Vec<f64>,
    queue: f64,
    ttft: f64,
}

fn run<T: Element>(ctx: &Cudnn, opts: &Options, plan: &Plan) -> Result<(), Error> {
    let cfg = &plan.config;
    let b = &plan.batch;
    let capacity = b.max_seq.div_ceil(b.page_size) * b.page_size;
    eprintln!("serve-bench: {} random weights ({} layers, seed {}) ...", cfg.name, cfg.layers, opts.seed);
    let weights = Weights::<T>::random(cfg, opts.seed);
    let model = Llama::new(ctx, cfg, &weights, capacity)?;
    drop(weights);
    let backends = Backends::parse("fused=all")?;
    let engine = BatchEngine::new(ctx, model, backends.clone(), b.clone())?;
    // SAFETY: this binary runs one thread on the context's stream.
    let mut engine = unsafe { engine.with_mode(plan.mode) };
    let params = |r: usize| {
        if opts.temperature == 0.0 {
            SamplingParams::greedy()
        } else {
            SamplingParams::new(opts.temperature, opts.seed.wrapping_add(r as u64))
        }
    };
    warm_up(ctx, &mut engine, plan, opts.prefill_tokens)?;
    let captures_before = engine.graph_counts();
    let memory_before = Memory::read(ctx)?;
    let mut log = StepLog::new(ctx, !opts.no_step_timing);

    let reqs = &plan.requests;
    let n = reqs.len();
    let start = Instant::now();
    let now = || start.elapsed().as_secs_f64();
    let (mut arrived, mut waiting) = (0, VecDeque::new());
    let mut live: HashMap<_, State> = HashMap::new();
    let mut rows: Vec<Option<RequestRow>> = vec![None; n];
    // The new ids each request ended with (compared with its run alone by --check-alone).
    let mut ended: Vec<Option<Vec<u32>>> = vec![None; n];
    let (mut reserved, mut steps, mut batch_sum, mut generated) = (0usize, 0usize, 0usize, 0usize);
    let mut prefills = 0usize;
    let mut itl_all = Vec::new();
    // Ends request `s.request` (sequence `id`) at `t`: its pages back, its row and ids recorded.
    let mut finish =
        |engine: &mut BatchEngine<T>, id, s: State, t: f64, reserved: &mut usize| -> Result<(), Error> {
            let r = &reqs[s.request];
            let mut ids = engine.remove(id)?;
            *reserved -= s.pages;
            ended[s.request] = Some(ids.split_off(r.prompt.len().min(ids.len())));
            rows[s.request] = Some(RequestRow {
                request: s.request,
                arrival_s: r.arrival,
                prompt_tokens: r.prompt.len(),
                output_tokens: s.produced,
                cancelled: s.produced < r.output,
                queue_ms: s.queue * 1e3,
                ttft_ms: s.ttft * 1e3,
                mean_itl_ms: (!s.itl.is_empty())
                    .then(|| s.itl.iter().sum::<f64>() / s.itl.len() as f64 * 1e3),
                e2e_ms: (t - r.arrival) * 1e3,
            });
            Ok(())
        };
    loop {
        let t = now();
        while arrived < n && reqs[arrived].arrival <= t {
            waiting.push_back(arrived);
            arrived += 1;
        }
        // Admission, first come first served: a free row and pages for the whole request.
        let mut admitted = Vec::new();
        while let Some(&r) = waiting.front() {
            let need = engine.pages_for(reqs[r].prompt.len() + reqs[r].output);
            if engine.live() + admitted.len() >= b.max_batch || reserved + need > b.num_pages {
                break;
            }
            waiting.pop_front();
            reserved += need;
            admitted.push((r, need));
        }
        // Prefill batching: the admitted prompts packed into forwards of up to --prefill-tokens.
        let lens: Vec<usize> = admitted.iter().map(|&(r, _)| reqs[r].prompt.len()).collect();
        for group in prefill_groups(&lens, opts.prefill_tokens) {
            let at = now();
            let group = &admitted[group];
            let asked: Vec<(&[u32], SamplingParams)> =
                group.iter().map(|&(r, _)| (&reqs[r].prompt[..], params(r))).collect();
            log.begin()?;
            let added = engine.add_many(ctx, &asked)?;
            let tokens = asked.iter().map(|(p, _)| p.len()).sum();
            log.end(StepKind::Prefill, asked.len(), tokens, CallDetail::default())?;
            let t = now();
            prefills += 1;
            for (&(r, need), (id, _first)) in group.iter().zip(added) {
                generated += 1;
                let s = State {
                    request: r,
                    produced: 1,
                    pages: need,
                    last_at: t,
                    itl: Vec::new(),
                    queue: at - reqs[r].arrival,
                    ttft: t - reqs[r].arrival,
                };
                if reqs[r].ends_at(1) {
                    finish(&mut engine, id, s, t, &mut reserved)?;
                } else {
                    live.insert(id, s);
                }
            }
        }
        if engine.live() == 0 {
            if arrived == n && waiting.is_empty() {
                break;
            }
            if waiting.is_empty() {
                let wait = reqs[arrived].arrival - now();
                if wait > 0.0 {
                    std::thread::sleep(Duration::from_secs_f64(wait));
                    log.idle(wait);
                }
            }
            continue;
        }
        let captures = engine.graph_counts().captures;
        log.begin()?;
        let out = engine.step(ctx)?;
        let detail = CallDetail {
            split: Some(engine.last_step_times()),
            captured: engine.graph_counts().captures > captures,
        };
        log.end(StepKind::Decode, out.len(), b.bucket(out.len()).unwrap_or(out.len()), detail)?;
        let t = now();
        steps += 1;
        batch_sum += out.len();
        for (id, _token) in out {
            let s = live.get_mut(&id).expect("every live sequence is tracked");
            s.itl.push(t - s.last_at);
            itl_all.push(t - s.last_at);
            s.last_at = t;
            s.produced += 1;
            generated += 1;
            if reqs[s.request].ends_at(s.produced) {
                let s = live.remove(&id).expect("just seen");
                finish(&mut engine, id, s, t, &mut reserved)?;
            }
        }
    }
    let elapsed = now();
    let memory_after = Memory::read(ctx)?;
    let rows: Vec<RequestRow> = rows.into_iter().flatten().collect();
    // Every request ended, with the ids it asked for or those it had when cancelled.
    let lost = lost(reqs, &ended);
    let captures = (captures_before, engine.graph_counts());
    let step_rows = log.finish()?;
    let totals = Totals { elapsed, steps, batch_sum, generated, prefills, itl: itl_all, captures };
    let form = engine.decode_form().map_or("-", |f| f.name());
    let mut lines = vec![
        line("decode attention", form.to_string()),
        line("paged refusal", engine.paged_refusal().unwrap_or_else(|| "none".into())),
        line("graph refusal", engine.graph_refusal().unwrap_or("none").to_string()),
        line("fallbacks", engine.model().fallbacks().len().to_string()),
        line("requests cancelled", rows.iter().filter(|r| r.cancelled).count().to_string()),
        line("requests lost (not ended with their ids)", lost.len().to_string()),
    ];
    lines.extend(memory_before.lines(&memory_after));
    let mut failures: Vec<String> =
        lost.iter().take(8).map(|r| format!("request {r} did not end with its ids")).collect();
    if opts.check_alone > 0.0 {
        let mut generator = Generator::new(ctx, engine.into_model(), backends, capacity)?;
        // SAFETY: as the engine's, one thread.
        generator = unsafe { generator.with_mode(plan.mode) };
        let check = check_alone(ctx, &mut generator, reqs, &ended, opts.check_alone, opts.seed)?;
        lines.push(line(
            "alone check: requests rerun alone / ended",
            format!("{} / {}", check.checked, ended.iter().flatten().count()),
        ));
        lines.push(line("alone check: same ids", check.same.to_string()));
        lines.push(line("alone check: parted at a near-tie", check.near_tie.to_string()));
        lines.push(line("alone check: parted", check.failures.len().to_string()));
        failures.extend(check.failures);
    }
    report(ctx, opts, plan, lines, &rows, &step_rows, totals)?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; ").into())
    }
}

/// What device memory the run holds, read with the stream idle.
#[derive(Debug, Clone, Copy)]
struct Memory {
    /// Free device memory (the driver's count: every allocation of the process, cuDNN's and cuBLAS's
    /// included).
    free: usize,
    /// The context's stream-ordered pool in use (every buffer it and cudarc allocate).
    pool: u64,
    /// The shared workspace held.
    workspace: usize,
    /// Plans in the context's cache.
    plans: usize,
}

impl Memory {
    fn read(ctx: &Cudnn) -> Result<Memory, Error> {
        ctx.synchronize()?;
        Ok(Memory {
            free: ctx.memory_info()?.0,
            pool: ctx.pool_memory()?.0,
            workspace: ctx.workspace_bytes(),
            plans: ctx.cache().stats().entries,
        })
    }

    /// The summary's lines of the memory before the run (`self`) and after it.
    fn lines(&self, after: &Memory) -> Vec<SummaryRow> {
        let mib = |b: f64| b / (1u64 << 20) as f64;
        let pair = |a: f64, b: f64| format!("{:.1} -> {:.1} ({:+.1})", mib(a), mib(b), mib(b - a));
        vec![
            line(
                "device memory free (MiB), before -> after the run",
                pair(self.free as f64, after.free as f64),
            ),
            line("pool in use (MiB), before -> after", pair(self.pool as f64, after.pool as f64)),
            line("workspace (MiB), before -> after", pair(self.workspace as f64, after.workspace as f64)),
            line("plans held, before -> after", format!("{} -> {}", self.plans, after.plans)),
        ]
    }
}

/// What [`check_alone`] found.
struct AloneCheck {
    checked: usize,
    same: usize,
    near_tie: usize,
    failures: Vec<String>,
}

/// Reruns the requests that ended (`ended[r]`: the new ids request `r` had), one at a time on
/// `generator`, in an order seeded by `seed`, until `budget` seconds have passed, and compares each
/// one's ids with its run alone ([`same_greedy_ids`]: equal, or parting first at a near-tie).
fn check_alone<T: Element>(
    ctx: &Cudnn,
    generator: &mut Generator<T>,
    reqs: &[Request],
    ended: &[Option<Vec<u32>>],
    budget: f64,
    seed: u64,
) -> Result<AloneCheck, Error> {
    let mut order: Vec<usize> = (0..reqs.len()).filter(|&r| ended[r].is_some()).collect();
    // Seeded: any prefix of the order is a uniform sample.
    cudnn_llm::reference::shuffle(&mut order, seed ^ 0xA10E);
    let start = Instant::now();
    let mut check = AloneCheck { checked: 0, same: 0, near_tie: 0, failures: Vec::new() };
    for r in order {
        if start.elapsed().as_secs_f64() > budget {
            break;
        }
        let got = ended[r].as_deref().expect("only ended requests");
        let (want, logits) = greedy_alone(ctx, generator, &reqs[r].prompt, got.len())?;
        check.checked += 1;
        match same_greedy_ids(&format!("request {r}"), got, &want, &logits) {
            None if got == want => check.same += 1,
            None => check.near_tie += 1,
            Some(f) => check.failures.push(f),
        }
    }
    eprintln!(
        "serve-bench: {} requests rerun alone in {:.1} s: {} the same, {} parted at a near-tie (gap under {} x \
         the logits' RMS), {} parted",
        check.checked,
        start.elapsed().as_secs_f64(),
        check.same,
        check.near_tie,
        bench_util::NEAR_TIE,
        check.failures.len()
    );
    Ok(check)
}

/// Runs every prompt length of the stream once (its prefill plans), with prefill batching
/// (`prefill_tokens` > 0) one packed prefill of the longest prompts up to that many tokens (the
/// largest forward of the run, so that the context's shared buffers grow here rather than under a
/// captured graph), then decode steps at every batch-size bucket, largest first (their plans, and
/// their captured graphs in graph mode), before anything is timed.
fn warm_up<T: Element>(
    ctx: &Cudnn,
    engine: &mut BatchEngine<T>,
    plan: &Plan,
    prefill_tokens: usize,
) -> Result<(), Error> {
    let t = Instant::now();
    let warm_prompts =
        if plan.prompt_lengths.len() <= MAX_WARM_PROMPT_LENGTHS { &plan.prompt_lengths[..] } else { &[] };
    for &len in warm_prompts {
        let (id, _) = engine.add(ctx, &vec![0; len], SamplingParams::greedy())?;
        engine.remove(id)?;
    }
    let longest = *plan.prompt_lengths.last().expect("at least one request");
    let each = engine.pages_for(longest);
    let packed = (prefill_tokens / longest).min(plan.batch.max_batch).min(plan.batch.num_pages / each);
    if packed > 1 {
        let prompt = vec![0; longest];
        let asked = vec![(&prompt[..], SamplingParams::greedy()); packed];
        for (id, _) in engine.add_many(ctx, &asked)? {
            engine.remove(id)?;
        }
    }
    // Largest bucket first: the shared buffers grow to their largest before any smaller bucket's graph
    // is captured, so no capture goes stale later.
    let short = plan.prompt_lengths[0];
    // As many sequences as the pool holds at their longest here (3 steps per bucket).
    let each = engine.pages_for(short + 3 * plan.batch.buckets.len());
    let most = plan.batch.max_batch.min(plan.batch.num_pages / each);
    while engine.live() < most {
        engine.add(ctx, &vec![0; short], SamplingParams::greedy())?;
    }
    for &bucket in plan.batch.buckets.iter().rev().filter(|&&b| b <= most) {
        while engine.live() > bucket {
            engine.remove(engine.sequences()[0])?;
        }
        // Plain (plans), capture, replay; a sequence that would run out of room stops the warm-up.
        for _ in 0..3 {
            if engine
                .sequences()
                .iter()
                .any(|&id| engine.tokens(id).map_or(true, |t| t.len() >= engine.cache().capacity()))
            {
                break;
            }
            engine.step(ctx)?;
        }
    }
    for id in engine.sequences() {
        engine.remove(id)?;
    }
    let g = engine.graph_counts();
    eprintln!(
        "serve-bench: warmed up {} of {} prompt lengths and {} batch buckets in {:.1} s ({} graph captures, {} \
         of stale graphs, {} refused)",
        warm_prompts.len(),
        plan.prompt_lengths.len(),
        plan.batch.buckets.len(),
        t.elapsed().as_secs_f64(),
        g.captures,
        g.stale,
        g.refused
    );
    Ok(())
}

/// What the run counted.
struct Totals {
    elapsed: f64,
    steps: usize,
    batch_sum: usize,
    generated: usize,
    /// Prefill forwards (one per prompt without prefill batching).
    prefills: usize,
    itl: Vec<f64>,
    /// The engine's graph counts before and after the timed run.
    captures: (GraphCounts, GraphCounts),
}

fn report(
    ctx: &Cudnn,
    opts: &Options,
    plan: &Plan,
    engine_lines: Vec<SummaryRow>,
    rows: &[RequestRow],
    step_rows: &[StepRow],
    t: Totals,
) -> Result<(), Error> {
    let ttft: Vec<f64> = rows.iter().map(|r| r.ttft_ms).collect();
    let e2e: Vec<f64> = rows.iter().map(|r| r.e2e_ms).collect();
    let itl: Vec<f64> = t.itl.iter().map(|s| s * 1e3).collect();
    let prompt_tokens: usize = rows.iter().map(|r| r.prompt_tokens).sum();
    let dist = |metric: &str, v: &[f64]| dist_row(metric, Dist::of(v));
    let summary = vec![
        line("requests", rows.len().to_string()),
        line("wall time (s)", format!("{:.2}", t.elapsed)),
        line("throughput (generated tokens/s)", format!("{:.1}", t.generated as f64 / t.elapsed)),
        line("prompt tokens/s", format!("{:.1}", prompt_tokens as f64 / t.elapsed)),
        line("requests/s", format!("{:.2}", rows.len() as f64 / t.elapsed)),
        line("prefill forwards", t.prefills.to_string()),
        line("decode steps", t.steps.to_string()),
        line("mean batch", format!("{:.1}", t.batch_sum as f64 / t.steps.max(1) as f64)),
        dist("time to first token (ms)", &ttft),
        dist("inter-token latency (ms)", &itl),
        dist("end-to-end latency (ms)", &e2e),
    ];
    let steps = step_lines(&StepSummary::of(step_rows), t.captures.0, t.captures.1);
    let summary = [summary, engine_lines, steps].concat();
    let (summary_csv, summary_md) = csv_and_markdown(&summary)?;
    let (requests_csv, _) = csv_and_markdown(rows)?;
    let (steps_csv, _) = csv_and_markdown(step_rows)?;
    let b = &plan.batch;
    let settings = format!(
        "{} ({} layers, {}), {} requests at {} /s (seed {}{}), prompts {}:{} (step {}), outputs {}:{}, \
         max batch {}, buckets {:?}, pages {} of {} ({}), mode {:?}, temperature {}, prefill batching {}",
        plan.config.name,
        plan.config.layers,
        plan.dtype,
        plan.requests.len(),
        opts.rate,
        opts.seed,
        soak_settings(opts),
        opts.prompt_len.min,
        opts.prompt_len.max,
        opts.prompt_step,
        opts.output_len.min,
        opts.output_len.max,
        b.max_batch,
        b.buckets,
        b.num_pages,
        b.page_size,
        b.order.name(),
        plan.mode,
        opts.temperature,
        match opts.prefill_tokens {
            0 => "off (one prompt per forward)".to_string(),
            n => format!("up to {n} tokens per forward"),
        }
    );
    let md = format!("# serve-bench\n\n{}\n\n{settings}\n\n{summary_md}", environment(ctx.info()));
    println!("{md}");
    if let Some(dir) = &opts.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("serve.md"), &md)?;
        std::fs::write(dir.join("serve-summary.csv"), summary_csv)?;
        std::fs::write(dir.join("serve-requests.csv"), requests_csv)?;
        std::fs::write(dir.join("serve-steps.csv"), steps_csv)?;
        eprintln!(
            "serve-bench: wrote serve.md, serve-summary.csv, serve-requests.csv, serve-steps.csv to {}",
            dir.display()
        );
    }
    Ok(())
}

/// The settings of a soak, for the report's settings line (empty without one).
fn soak_settings(o: &Options) -> String {
    let mut s = String::new();
    if let Some(d) = o.duration {
        s += &format!(", arriving in the first {d} s of a stream of {}", o.requests);
    }
    if o.burst > 1 {
        s += &format!(", in bursts of 1 to {}", o.burst);
    }
    if o.cancel > 0.0 {
        s += &format!(", {}% cancelled part way", o.cancel * 100.0);
    }
    if o.check_alone > 0.0 {
        s += &format!(", rerun alone for up to {} s after", o.check_alone);
    }
    s
}

/// A summary line of one value.
fn line(metric: &str, value: String) -> SummaryRow {
    SummaryRow { metric: metric.into(), value, p50: String::new(), p90: String::new(), p99: String::new() }
}

/// A summary line of a distribution: its mean, p50, p90 and p99 (`-` where empty).
fn dist_row(metric: &str, d: Dist) -> SummaryRow {
    let f = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}"));
    let [p50, p90, p99] = d.p.map(f);
    SummaryRow { metric: metric.into(), value: f(d.mean), p50, p90, p99 }
}

/// The summary's lines of the per-step timings and of the graph captures between `before` and
/// `after` the timed run.
fn step_lines(s: &StepSummary, before: GraphCounts, after: GraphCounts) -> Vec<SummaryRow> {
    let captures = after.captures - before.captures;
    let (stale, refused) = (after.stale - before.stale, after.refused - before.refused);
    vec![
        dist_row("decode step GPU (ms)", s.decode_gpu),
        dist_row("decode step wall (ms)", s.decode_wall),
        dist_row("decode step: before the launch (ms)", s.decode_prepare),
        dist_row("decode step: launch to ids back (ms)", s.decode_run),
        dist_row("decode step: sampling after (ms)", s.decode_sample),
        dist_row("host after decode step (ms)", s.decode_host),
        dist_row("prefill GPU (ms)", s.prefill_gpu),
        dist_row("prefill wall (ms)", s.prefill_wall),
        line(
            "prefills between decode steps (mean)",
            s.prefills_between.map_or("-".into(), |x| format!("{x:.2}")),
        ),
        line(
            "graph captures during the run",
            format!("{captures} ({stale} of stale graphs, {refused} refused)"),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Plan, String> {
        let o = Options::try_parse_from([&["serve-bench"][..], args].concat()).map_err(|e| e.to_string())?;
        o.resolve()
    }

    #[test]
    fn defaults_serve_llama_3_1_8b_shapes() {
        let p = parse(&["--layers", "2", "--requests", "20"]).unwrap();
        assert_eq!((p.config.hidden, p.config.layers, p.config.heads, p.config.kv_heads), (4096, 2, 32, 8));
        assert_eq!((p.batch.max_batch, p.batch.page_size, p.batch.max_seq), (64, 16, 1024 + 512));
        assert_eq!(p.batch.num_pages, 64 * 96);
        // Packed prefills of up to --prefill-tokens fit the activations reserved.
        assert_eq!(p.batch.reserve_rows, 8192);
        let q = parse(&["--layers", "2", "--requests", "20", "--prefill-tokens", "0"]).unwrap();
        assert_eq!(q.batch.reserve_rows, 1024);
        let q = parse(&["--layers", "2", "--prefill-tokens", "16", "--max-batch", "100"]).unwrap();
        assert_eq!(q.batch.reserve_rows, 1024);
        assert_eq!(p.batch.buckets, vec![1, 2, 4, 8, 16, 32, 64]);
        assert_eq!((p.mode, p.dtype, p.requests.len()), (DecodeMode::Graph, DataType::BF16, 20));
        for r in &p.requests {
            assert!(r.prompt.len() % 64 == 0 && (128..=1024).contains(&r.prompt.len()), "{}", r.prompt.len());
            assert!((64..=512).contains(&r.output));
        }
        assert!(p.prompt_lengths.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_soak_serves_the_window_of_a_bursty_stream_with_cancellations() {
        let args =
            ["--preset", "tiny", "--requests", "400", "--rate", "20", "--burst", "5", "--cancel", "0.2"];
        let p =
            parse(&[&args[..], &["--duration", "6", "--prompt-len", "1:64", "--prompt-step", "1"]].concat())
                .unwrap();
        // Only the first 6 s of the stream (about 120 of its 400 requests), the rest as drawn.
        let all = parse(&[&args[..], &["--prompt-len", "1:64", "--prompt-step", "1"]].concat()).unwrap();
        assert!(p.requests.iter().all(|r| r.arrival < 6.0));
        assert!((80..=170).contains(&p.requests.len()), "{}", p.requests.len());
        assert_eq!(p.requests[..], all.requests[..p.requests.len()]);
        assert!(all.requests[p.requests.len()].arrival >= 6.0);
        assert!(p.requests.iter().any(|r| r.cancel_after.is_some()));
        assert!(p.requests.windows(2).any(|w| w[0].arrival == w[1].arrival), "bursts");
        assert!(p.requests.iter().all(|r| (1..=64).contains(&r.prompt.len())));
        assert!(p.prompt_lengths.len() > 32, "{} prompt lengths", p.prompt_lengths.len());
        // Without the soak options the stream is the plain Poisson one of before.
        let plain = parse(&["--preset", "tiny", "--requests", "50", "--rate", "20"]).unwrap();
        assert!(plain.requests.iter().all(|r| r.cancel_after.is_none()));
        assert!(plain.requests.windows(2).all(|w| w[0].arrival < w[1].arrival));
    }

    #[test]
    fn memory_lines_give_before_after_and_the_difference() {
        let before = Memory { free: 10 << 30, pool: 3 << 20, workspace: 1 << 20, plans: 40 };
        let after = Memory { free: (10 << 30) - (5 << 19), pool: 3 << 20, workspace: 2 << 20, plans: 52 };
        let l = before.lines(&after);
        assert_eq!(l[0].value, "10240.0 -> 10237.5 (-2.5)");
        assert_eq!(l[1].value, "3.0 -> 3.0 (+0.0)");
        assert_eq!(l[2].value, "1.0 -> 2.0 (+1.0)");
        assert_eq!(l[3].value, "40 -> 52");
    }

    #[test]
    fn step_timing_is_on_unless_asked_off() {
        let o = |args: &[&str]| Options::try_parse_from([&["serve-bench"][..], args].concat()).unwrap();
        assert!(!o(&[]).no_step_timing);
        assert!(o(&["--no-step-timing"]).no_step_timing);
        assert!(Options::try_parse_from(["serve-bench", "--no-step-timing=yes"]).is_err());
    }

    #[test]
    fn step_lines_give_the_step_percentiles_and_the_captures_of_the_run() {
        let row = |kind, gpu: Option<f64>, wall: f64, host: f64| StepRow {
            kind,
            rows: 4,
            bucket: 4,
            gpu_ms: gpu,
            wall_ms: wall,
            host_ms: host,
            prepare_ms: (kind == StepKind::Decode).then_some(0.125),
            run_ms: (kind == StepKind::Decode).then_some(wall - 0.25),
            sample_ms: (kind == StepKind::Decode).then_some(0.125),
            captured: false,
        };
        let (d, p) = (StepKind::Decode, StepKind::Prefill);
        let steps = [
            row(d, Some(7.0), 9.0, 0.25),
            row(p, Some(30.0), 32.0, 0.5),
            row(d, Some(9.0), 11.0, 0.75),
            row(d, None, 13.0, 0.0),
        ];
        let mut before = GraphCounts::default();
        before.captures = 7;
        let mut after = before;
        (after.captures, after.stale) = (9, 2);
        let lines = step_lines(&StepSummary::of(&steps), before, after);
        let cells = |m: &str| {
            let r = lines.iter().find(|r| r.metric == m).unwrap_or_else(|| panic!("no line {m}"));
            [r.value.clone(), r.p50.clone(), r.p90.clone(), r.p99.clone()]
        };
        assert_eq!(cells("decode step GPU (ms)"), ["8.00", "7.00", "9.00", "9.00"]);
        assert_eq!(cells("decode step wall (ms)"), ["11.00", "11.00", "13.00", "13.00"]);
        assert_eq!(cells("host after decode step (ms)")[1], "0.25");
        assert_eq!(cells("decode step: launch to ids back (ms)")[1..], ["10.75", "12.75", "12.75"]);
        assert_eq!(cells("decode step: before the launch (ms)")[0], "0.12");
        assert_eq!(cells("decode step: sampling after (ms)")[3], "0.12");
        assert_eq!(cells("prefill GPU (ms)"), ["30.00", "30.00", "30.00", "30.00"]);
        assert_eq!(cells("prefill wall (ms)")[0], "32.00");
        assert_eq!(cells("prefills between decode steps (mean)")[0], "0.50");
        assert_eq!(cells("graph captures during the run")[0], "2 (2 of stale graphs, 0 refused)");
        let (csv, _) = csv_and_markdown(&steps[..2]).unwrap();
        assert_eq!(
            csv,
            "kind,rows,bucket,gpu_ms,wall_ms,host_ms,prepare_ms,run_ms,sample_ms,captured\n\
             decode,4,4,7.0,9.0,0.25,0.125,8.75,0.125,false\n\
             prefill,4,4,30.0,32.0,0.5,,,,false\n"
        );
        let none = step_lines(&StepSummary::of(&[]), before, before);
        assert!(none.iter().take(9).all(|r| r.value == "-"), "{none:?}");
    }

    #[test]
    fn bad_options_name_themselves() {
        for (args, expected) in [
            (&["--dtype", "f32"][..], "--dtype f32"),
            (&["--order", "x"], "--order x"),
            (&["--mode", "x"], "--mode x"),
            (&["--rate", "0"], "--rate 0"),
            (&["--requests", "0"], "--requests"),
            (&["--layers", "0"], "--layers"),
            (&["--prompt-len", "10:20", "--prompt-step", "64"], "holds no multiple"),
            (&["--pages", "3"], "--pages 3"),
            (&["--max-batch", "0"], "--max-batch"),
            (&["--temperature=-1"], "--temperature"),
            (&["--preset", "nope"], "--preset"),
            (&["--prompt-len", "9:3"], "MIN <= MAX"),
            // Hostile numbers: overflowing sums, past the model's positions, huge counts, negatives.
            (&["--output-len", "1:18446744073709551615"], "longer than the model's"),
            (&["--prompt-len", "18446744073709551615"], "holds no multiple"),
            (&["--prompt-len", "64:18446744073709551615"], "longer than the model's"),
            (&["--prompt-len", "64:131072", "--output-len", "1"], "longer than the model's"),
            (&["--requests", "18446744073709551615"], "--requests 18446744073709551615"),
            (&["--output-len=-1:4"], "invalid digit"),
            (&["--prompt-len", "0:4"], "MIN <= MAX"),
            (&["--page-size", "18446744073709551616"], "too large"),
            (&["--rate", "nan"], "--rate NaN"),
            (&["--burst", "0"], "--burst 0"),
            (&["--burst", "18446744073709551615"], "--burst"),
            (&["--cancel", "1.5"], "--cancel 1.5"),
            (&["--cancel", "nan"], "--cancel NaN"),
            (&["--duration", "0"], "--duration 0"),
            (&["--duration", "inf"], "--duration inf"),
            (&["--duration", "1000", "--requests", "20"], "give more requests"),
            (&["--duration", "5", "--rate", "inf"], "give more requests"),
            (&["--check-alone=-1"], "--check-alone"),
            (&["--check-alone", "5", "--temperature", "0.7"], "only greedy requests"),
        ] {
            let e = parse(args).err().unwrap_or_else(|| panic!("{args:?} passed"));
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        let p = parse(&["--preset", "tiny", "--rate", "inf", "--max-batch", "6", "--pages", "500"]).unwrap();
        assert!(p.requests.iter().all(|r| r.arrival == 0.0));
        assert_eq!((p.batch.buckets.clone(), p.batch.num_pages), (vec![1, 2, 4, 6], 500));
    }
}
