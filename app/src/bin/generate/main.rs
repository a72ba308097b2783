//! `cargo run --release --bin generate -- --model DIR --prompt TEXT [options]`: generates text with a
//! Hugging Face Llama-3 checkpoint, streaming it to stdout as it decodes, then reports on stderr the
//! prefill and decode rates and how close a decode step comes to the memory roofline (the bytes a step
//! must read, at the device-to-device copy bandwidth measured in the same run).
//!
//! Exit codes: 0 done; 2 bad options or an unreadable checkpoint directory (config.json,
//! tokenizer.json, generation_config.json, the prompt); 1 no usable GPU, or a failure while loading or
//! generating.

use clap::Parser;
use cudnn_llm::cudnn_ops::startup;
use cudnn_llm_app::bench_util::{copy_bandwidth_gbps, tool_main};
use cudnn_llm_llama::chat::{ChatTemplate, Message};
use cudnn_llm_llama::generate::{eos_token_ids, Generation, StopReason};
use cudnn_llm_llama::gguf::Gguf;
use cudnn_llm_llama::roofline::{self, DecodeRoofline};
use cudnn_llm_llama::tp::{RankEnv, ShardPlan};
use cudnn_llm_llama::{DecodeMode, Generator, Llama, LlamaConfig, Sampler, SamplingPath, Tokenizer};
use cudnn_llm_ops::{default_plan_dir, Cudnn, DataType, Element, WeightScales, PLAN_DIR_ENV};
use half::{bf16, f16};
use std::io::Write;
use std::ops::ControlFlow;
use std::process::ExitCode;
use std::time::Duration;

mod cli;
mod tp;

use cli::{Options, Plan, PlanDir};

type Error = Box<dyn std::error::Error>;

/// Bytes of each device-to-device copy measuring the bandwidth.
const COPY_BYTES: usize = 1 << 30;

/// What the checkpoint gives before any GPU work.
struct Input {
    /// The GGUF file, when --model names one (its weights are read later, after the GPU checks).
    gguf: Option<Gguf>,
    config: LlamaConfig,
    tokenizer: Tokenizer,
    eos: Vec<u32>,
    prompt: Vec<u32>,
    /// Prompt and new tokens: the cache and RoPE tables (checked against the model's positions).
    max_seq: usize,
}

fn main() -> ExitCode {
    let opts = Options::parse();
    let setup = || {
        let plan = opts.resolve()?;
        let input = read_input(&opts)?;
        plan.backends.check_layers(input.config.layers).map_err(|e| format!("--fuse: {e}"))?;
        let env = RankEnv::of_several().map_err(|e| e.to_string())?;
        let ranks = match (&env, plan.tp) {
            (Some(env), Some(n)) if n != env.world => {
                return Err(format!(
                    "--tp {n}, but launched as rank {} of {} (WORLD_SIZE is set): give --tp {} or none",
                    env.rank, env.world, env.world
                ))
            }
            (Some(env), _) => Some(tp::Ranks::Processes(env.clone())),
            (None, n) => n.map(tp::Ranks::Threads),
        };
        if let Some(n) = ranks.as_ref().map(tp::Ranks::count) {
            if input.gguf.is_some() {
                return Err(format!(
                    "--tp {n}: a GGUF file runs on one GPU; give a checkpoint directory to split it"
                ));
            }
            if let Some(q) = &input.config.fp8 {
                return Err(format!("--tp {n}: an FP8 checkpoint ({}) runs on one GPU", q.describe()));
            }
            ShardPlan::new(&input.config, n).map_err(|e| format!("--tp {n}: {e}"))?;
        }
        Ok::<_, String>((plan, input, ranks))
    };
    tool_main("generate", setup, |ctx, (plan, input, ranks)| {
        // A command-line tool wants warm plans: on by default here, unlike the library.
        match &plan.plan_dir {
            PlanDir::EnvOrDefault if std::env::var_os(PLAN_DIR_ENV).is_some() => {} // applied by Cudnn::new
            PlanDir::EnvOrDefault | PlanDir::Default => ctx.set_plan_dir(default_plan_dir().as_deref()),
            PlanDir::Off => ctx.set_plan_dir(None),
            PlanDir::Dir(dir) => ctx.set_plan_dir(Some(dir)),
        }
        match (plan.dtype, ranks) {
            (DataType::F16, Some(n)) => tp::run::<f16>(ctx, &opts, &plan, &input, n),
            (_, Some(n)) => tp::run::<bf16>(ctx, &opts, &plan, &input, n),
            (DataType::F16, None) => run::<f16>(ctx, &opts, &plan, &input),
            _ => run::<bf16>(ctx, &opts, &plan, &input),
        }
    })
}

/// Reads the checkpoint's config, tokenizer and end-of-sequence ids (config.json, tokenizer.json and
/// generation_config.json of a directory, or a GGUF file's metadata), and encodes the prompt.
fn read_input(opts: &Options) -> Result<Input, String> {
    let dir = &opts.model;
    let is_gguf = cudnn_llm_llama::gguf::is_gguf_path(dir);
    if !dir.is_dir() && !is_gguf {
        return Err(format!("--model {}: not a directory or a .gguf file", dir.display()));
    }
    let gguf = if is_gguf { Some(Gguf::open(dir).map_err(|e| e.to_string())?) } else { None };
    let (config, tokenizer, eos) = match &gguf {
        Some(g) => {
            let config = g.config().map_err(|e| e.to_string())?;
            let tokenizer = Tokenizer::from_gguf(g).map_err(|e| e.to_string())?;
            let eos = config.eos_token_ids.clone();
            (config, tokenizer, eos)
        }
        None => {
            let config = LlamaConfig::from_dir(dir).map_err(|e| e.to_string())?;
            let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json")).map_err(|e| e.to_string())?;
            let eos = eos_token_ids(dir, &config).map_err(|e| e.to_string())?;
            (config, tokenizer, eos)
        }
    };
    if opts.system.is_some() && opts.chat.is_none() {
        return Err("--system goes with --chat (a system message before the user's)".into());
    }
    let prompt = match (&opts.prompt, &opts.chat) {
        (Some(text), _) => tokenizer.encode(text, true).map_err(|e| e.to_string())?,
        (None, Some(user)) => {
            let template = match &gguf {
                Some(g) => ChatTemplate::from_gguf(g),
                None => ChatTemplate::from_dir(dir).map_err(|e| format!("--chat: {e}"))?,
            };
            let template = template.ok_or_else(|| {
                format!(
                    "--chat: {} has no chat template (tokenizer_config.json's chat_template, chat_template.jinja \
                     or a GGUF file's tokenizer.chat_template)",
                    dir.display()
                )
            })?;
            let mut messages: Vec<Message> =
                opts.system.iter().map(|s| Message::new("system", s.as_str())).collect();
            messages.push(Message::new("user", user.as_str()));
            tokenizer.encode_chat(&template, &messages, true).map_err(|e| format!("--chat: {e}"))?
        }
        (None, None) => return Err("give --prompt or --chat".into()),
    };
    if prompt.is_empty() {
        return Err("the prompt encodes to no tokens".into());
    }
    if let Some(id) = prompt.iter().find(|&&id| id as usize >= config.vocab) {
        return Err(format!("the tokenizer gives id {id}, past the model's vocabulary of {}", config.vocab));
    }
    let max_seq =
        prompt.len().checked_add(opts.max_new_tokens).filter(|&n| n <= config.max_positions).ok_or_else(
            || {
                format!(
                    "--max-new-tokens {} after {} prompt tokens exceeds the model's {} positions",
                    opts.max_new_tokens,
                    prompt.len(),
                    config.max_positions
                )
            },
        )?;
    Ok(Input { gguf, config, tokenizer, eos, prompt, max_seq })
}

fn run<T: Element>(ctx: &Cudnn, opts: &Options, plan: &Plan, input: &Input) -> Result<(), Error> {
    let cfg = &input.config;
    // An FP8 checkpoint loads dequantized and runs its projections in FP8 again, whatever --dtype.
    let fp8 = plan.fp8.or(cfg.fp8.is_some().then_some(WeightScales::PerChannel));
    let info = ctx.info();
    eprintln!(
        "generate: {} ({} layers, {}{}) on {}, backends `{}`, {} prompt tokens",
        cfg.name,
        cfg.layers,
        plan.dtype,
        match (&cfg.fp8, fp8) {
            (Some(q), _) => format!(", an FP8 checkpoint ({}): projections in FP8 E4M3", q.describe()),
            (None, Some(WeightScales::PerTensor)) => ", projections in FP8 E4M3, factors per tensor".into(),
            (None, Some(_)) => ", projections in FP8 E4M3".into(),
            (None, None) => String::new(),
        },
        info.name,
        plan.backends.to_selection(),
        input.prompt.len()
    );
    if input.eos.is_empty() {
        eprintln!("generate: no eos_token_id in config.json or generation_config.json: stopping at --max-new-tokens only");
    }
    let max_seq = input.max_seq;
    let model = {
        // Before any weight is read: a model that cannot fit fails here.
        Llama::<T>::ensure_fits(ctx, cfg, max_seq)?;
        let mut model = match &input.gguf {
            Some(g) => Llama::new(ctx, cfg, &g.weights::<T>(cfg)?, max_seq)?,
            // Straight from the mapped files into the device, no host copy of the weights.
            None => Llama::load(ctx, cfg, &opts.model, max_seq)?,
        };
        if let Some(scales) = fp8 {
            startup::timed("fp8 quantization", || model.quantize_to_fp8(ctx, scales), |_| String::new())?;
        }
        model
    };
    // SAFETY: this binary runs on one thread and makes no other stream of the context.
    let mut generator =
        unsafe { Generator::new(ctx, model, plan.backends.clone(), max_seq)?.with_mode(plan.decode) };
    generator.set_sampling_path(plan.sampling_path);
    if !opts.no_warmup {
        startup::timed("warm-up", || warm_up(ctx, &mut generator, &input.prompt), |_| String::new())?;
    }
    let mut first_token: Option<Option<Duration>> = None;
    let mut sampler = Sampler::new(plan.sampling)?;
    let mut text = input.tokenizer.stream(true);
    let mut stdout = std::io::stdout().lock();
    let mut failed: Option<Error> = None;
    let generation =
        generator.generate(ctx, &input.prompt, opts.max_new_tokens, &mut sampler, &input.eos, |id| {
            first_token.get_or_insert_with(startup::since_process_start);
            let printed = text.step(id).map_err(Error::from).and_then(|chunk| {
                Ok(chunk.map(|c| stdout.write_all(c.as_bytes()).and_then(|()| stdout.flush())).transpose()?)
            });
            match printed {
                Ok(_) => ControlFlow::Continue(()),
                Err(e) => {
                    failed = Some(e);
                    ControlFlow::Break(())
                }
            }
        })?;
    if let Some(e) = failed {
        return Err(format!("writing the text: {e}").into());
    }
    if let Some(rest) = text.finish()? {
        stdout.write_all(rest.as_bytes())?;
    }
    writeln!(stdout)?;
    match (generator.replaying(), generator.graph_refusal()) {
        (true, _) => eprintln!("generate: decode steps replayed one captured CUDA graph"),
        (false, Some(why)) => eprintln!("generate: decode steps launched plainly: {why}"),
        (false, None) => eprintln!("generate: decode steps launched plainly (--decode launch)"),
    }
    eprintln!("generate: sampling: {}", sampling_line(&generation, &generator, &sampler));
    for f in generator.model().fallbacks() {
        eprintln!("generate: {} (layer {:?}, {}) ran naive: {}", f.range, f.layer, f.shape, f.reason);
    }
    let rates = Rates::from(&generation);
    if opts.ids {
        print_ids(&generation.tokens);
    }
    let elem = std::mem::size_of::<T>();
    // After the text, off the path to the first token; 2 x 1 GiB next to the model and its cache (an
    // error, e.g. out of memory, leaves the roofline line without a bandwidth, saying why).
    let bandwidth = copy_bandwidth_gbps(ctx, COPY_BYTES, 10).map_err(|e| e.to_string());
    let kernels = Some(match generator.step_kernels() {
        Some(counted) => counted.map_err(|e| e.to_string()),
        None => Err("the step launches its kernels one by one (no captured graph)".into()),
    });
    let roof = |i| match fp8.is_some() {
        true => DecodeRoofline::fp8(cfg, 1, rates.prompt_tokens + i, elem),
        false => DecodeRoofline::new(cfg, 1, rates.prompt_tokens + i, elem),
    };
    report(&rates, roof, bandwidth, "", kernels);
    report_plans(ctx);
    report_startup(first_token.flatten());
    Ok(())
}

/// Where the time before the first token went (the library's start-up record), on stderr.
pub(crate) fn report_startup(first_token: Option<Duration>) {
    let at = first_token.map_or("unknown".into(), startup::millis);
    eprintln!("generate: startup: first token handed to the output {at} after exec; {}", startup::summary());
}

/// Which sampling path chose the decode steps' ids (the line `generate: sampling: ...`).
fn sampling_line<T: Element>(g: &Generation, generator: &Generator<T>, sampler: &Sampler) -> String {
    if g.device_steps > 0 {
        return format!(
            "device greedy, pipelined: {} of {} decode steps picked on the device, read back every {} steps ({} steps past the stop rolled back)",
            g.device_steps,
            g.decode_steps,
            cudnn_llm_llama::PIPELINE_STEPS,
            g.overrun_steps
        );
    }
    let why = if !sampler.params().is_greedy() {
        "sampling with --temperature > 0"
    } else if generator.mode() != DecodeMode::Graph {
        "--decode launch"
    } else if generator.sampling_path() == SamplingPath::Host {
        "--sampling-path host"
    } else if generator.graph_refusal().is_some() {
        "the step is not captured"
    } else {
        "no decode step replayed"
    };
    format!("host: each step's logits copied back and chosen on the host ({why})")
}

/// How many plans were built here and how many came from the plan directory, on stderr.
fn report_plans(ctx: &Cudnn) {
    let s = ctx.cache().stats();
    let Some(dir) = ctx.plan_dir() else {
        eprintln!("generate: plans: {} built (no plan directory)", s.misses);
        return;
    };
    eprintln!(
        "generate: plans: {} built, {} loaded from {} ({} rejected), {} saved",
        s.misses - s.disk_hits,
        s.disk_hits,
        dir.display(),
        s.disk_rejects,
        s.disk_writes
    );
    for e in ctx.cache().disk_events() {
        eprintln!("generate: plan file {}: {:?}: {}", e.path.display(), e.kind, e.reason);
    }
}

/// An untimed prefill and two decode steps (fused plans are built, autotuned and cached by the first
/// call of each shape), then a fresh sequence.
fn warm_up<T: Element>(ctx: &Cudnn, g: &mut Generator<T>, prompt: &[u32]) -> Result<(), Error> {
    let mut logits = g.prefill(ctx, prompt)?;
    for _ in 0..2 {
        if g.len() == g.capacity() {
            break;
        }
        let id = cudnn_llm_llama::sampling::argmax(&logits)?;
        logits = g.step(ctx, id)?;
    }
    g.reset();
    Ok(())
}

/// What a generation produced and how long it took: the library's [`Generation`], or the
/// tensor-parallel loop's ([`tp`]).
struct Rates {
    /// New ids.
    tokens: usize,
    stop: StopReason,
    prompt_tokens: usize,
    /// The prefill to the first new id.
    prefill: Duration,
    /// The decode steps.
    decode: Duration,
    decode_steps: usize,
}

impl From<&Generation> for Rates {
    fn from(g: &Generation) -> Self {
        Rates {
            tokens: g.tokens.len(),
            stop: g.stop,
            prompt_tokens: g.prompt_tokens,
            prefill: g.prefill,
            decode: g.decode,
            decode_steps: g.decode_steps,
        }
    }
}

/// The generated ids on stderr (`--ids`).
fn print_ids(ids: &[u32]) {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    eprintln!("generate: ids {}", ids.join(" "));
}

/// The rates and the roofline line, on stderr: `roof(i)` is decode step i's bytes (per rank with
/// `--tp`, `per` then says so), against the measured copy bandwidth.
///
/// `kernels`: the kernels and nodes of the replayed decode step's graph (or why they are not known),
/// which say what bounds a step far from its memory floor; `None` says nothing of them.
fn report(
    g: &Rates,
    roof: impl Fn(usize) -> DecodeRoofline,
    bandwidth_gbps: Result<f64, String>,
    per: &str,
    kernels: Option<Result<(usize, usize), String>>,
) {
    eprintln!("generate: {} new tokens, stopped by {:?}", g.tokens, g.stop);
    let prefill_rate = g.prompt_tokens as f64 / g.prefill.as_secs_f64();
    eprintln!(
        "prefill: {} tokens in {:.2} ms (to the first token): {prefill_rate:.1} tokens/s",
        g.prompt_tokens,
        g.prefill.as_secs_f64() * 1e3,
    );
    if g.decode_steps == 0 {
        eprintln!("decode: no decode step ran (one new token)");
        return;
    }
    let rate = g.decode_steps as f64 / g.decode.as_secs_f64();
    let step_ms = g.decode.as_secs_f64() * 1e3 / g.decode_steps as f64;
    eprintln!(
        "decode: {} steps in {:.2} ms: {rate:.1} tokens/s ({step_ms:.3} ms/step)",
        g.decode_steps,
        g.decode.as_secs_f64() * 1e3
    );
    let bandwidth_gbps = match bandwidth_gbps {
        Ok(b) => b,
        Err(e) => {
            eprintln!("roofline: not measured: {e}");
            return;
        }
    };
    // Step i after a prompt of p tokens reads every weight and the p + i + 1 cached K/V rows.
    let steps: Vec<DecodeRoofline> = (0..g.decode_steps).map(roof).collect();
    let n = steps.len() as f64;
    let floor_ms: f64 = steps.iter().map(|r| r.floor_ms(bandwidth_gbps)).sum::<f64>() / n;
    let kv_mb = steps.iter().map(|r| r.kv_bytes as f64).sum::<f64>() / n / 1e6;
    eprintln!(
        "roofline: a decode step reads {:.1} MB of weights + {kv_mb:.2} MB of KV cache{per} on average; at the {:.0} GB/s \
         measured device copy bandwidth that is {floor_ms:.3} ms/step: this run's steps reach {:.1}% of the memory roofline",
        steps[0].weight_bytes as f64 / 1e6,
        bandwidth_gbps,
        100.0 * floor_ms / step_ms
    );
    if let Some(kernels) = kernels {
        if let Some(why) = roofline::bound(floor_ms, step_ms, kernels.map(|(k, _)| k)) {
            eprintln!("roofline: {why}");
        }
    }
}
