//! `generate --tp N`: the same generation on a model split over N GPUs ([`TpLlama`]: one thread,
//! `Cudnn` context and NCCL communicator per GPU, GPUs `0..N`). Each step's logits are all-gathered
//! on the GPUs and rank 0's copy is sampled on the host, as on one GPU. With `--decode graph` (and
//! RoPE and attention fused in every layer) the first decode step launches plainly and every rank
//! then captures its step, NCCL's collectives included, and replays it from then on.

use crate::cli::{Options, Plan, PlanDir};
use crate::{print_ids, report, report_plans, report_startup, Error, Input, Rates, COPY_BYTES};
use cudnn_llm_app::bench_util::copy_bandwidth_gbps;
use cudnn_llm_llama::generate::StopReason;
use cudnn_llm_llama::tp::{TpLlama, TpOptions, WeightSource};
use cudnn_llm_llama::{nccl, Backend, Backends, DecodeMode, ModuleKind, Sampler};
use cudnn_llm_ops::{default_plan_dir, Cudnn, Element, PLAN_DIR_ENV};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One sequence on the split model: its prefill, then decode steps launched plainly or, once
/// captured, replayed.
struct TpGen<T: Element> {
    tp: TpLlama<T>,
    backends: Backends,
    /// Capture the step after the first plain one (`--decode graph`, and the step can be captured).
    graph: bool,
    captured: bool,
    launched: usize,
    /// A prefill ran since the last step: a captured step may hold buffers it replaced.
    prefilled: bool,
}

impl<T: Element> TpGen<T> {
    /// Runs `ids` as a new sequence and returns the logits of the last of them.
    fn prefill(&mut self, ids: &[u32]) -> Result<Vec<f32>, Error> {
        self.tp.truncate(0)?;
        self.tp.forward(&[ids.to_vec()], &self.backends)?;
        self.prefilled = true;
        Ok(self.tp.logits(ids.len() - 1..ids.len(), &self.backends)?)
    }

    /// Runs one id after the cached ones and returns its logits.
    fn step(&mut self, id: u32) -> Result<Vec<f32>, Error> {
        if self.captured && std::mem::take(&mut self.prefilled) {
            // A longer prefill reallocates the activations a captured step holds: capture again.
            let stale = self.tp.each("a captured step's buffers", |r| {
                Ok(r.graph.as_ref().is_none_or(|g| !r.model.is_current(&r.ctx, g)))
            })?;
            self.captured = !stale.contains(&true);
        }
        if self.graph && self.launched > 0 && !self.captured {
            self.tp.capture_decode(&self.backends)?;
            self.captured = true;
        }
        if self.captured {
            return Ok(self.tp.decode(&[id])?);
        }
        self.tp.forward(&[vec![id]], &self.backends)?;
        self.launched += 1;
        Ok(self.tp.logits(0..1, &self.backends)?)
    }
}

/// Whether a decode step on `backends` can be captured: RoPE and attention fused in every layer.
fn graphable(backends: &Backends, layers: usize) -> bool {
    (0..layers).all(|l| {
        [ModuleKind::Rope, ModuleKind::Gqa].iter().all(|&k| backends.get(Some(l), k) == Backend::Fused)
    })
}

/// Generates on `ranks` GPUs and prints what the one-GPU path prints, with a line naming the ranks.
/// `ctx` (GPU 0, made before the ranks) measures the copy bandwidth of the roofline line.
pub(crate) fn run<T: Element>(
    ctx: &Cudnn,
    opts: &Options,
    plan: &Plan,
    input: &Input,
    ranks: usize,
) -> Result<(), Error> {
    let cfg = &input.config;
    // Measured before the model is resident, as on one GPU; the ranks' GPUs are of one host.
    let bandwidth = copy_bandwidth_gbps(ctx, COPY_BYTES, 10).map_err(|e| e.to_string());
    let source = WeightSource::checkpoint(cfg, &opts.model)?;
    let tp = TpLlama::<T>::new(cfg, ranks, &source, input.max_seq, tp_options())?;
    let mut tp = tp;
    let infos = tp.device_info()?;
    let gpus: Vec<String> =
        infos.iter().zip(tp.devices()).map(|(i, d)| format!("GPU {d} {}", i.name)).collect();
    let nccl_line = match nccl::library() {
        Ok((v, lib)) if ranks > 1 => format!(", NCCL {} ({lib})", nccl::version_string(v)),
        _ => String::new(),
    };
    eprintln!(
        "generate: {} ({} layers, {}) on {ranks} ranks, tensor parallel ({}{nccl_line}), backends `{}`, {} prompt \
         tokens",
        cfg.name,
        cfg.layers,
        plan.dtype,
        gpus.join(", "),
        plan.backends.to_selection(),
        input.prompt.len()
    );
    if input.eos.is_empty() {
        eprintln!("generate: no eos_token_id in config.json or generation_config.json: stopping at --max-new-tokens only");
    }
    // The plan directory of every rank's context, as the one-GPU path sets it.
    let dir: Option<Option<PathBuf>> = match &plan.plan_dir {
        PlanDir::EnvOrDefault if std::env::var_os(PLAN_DIR_ENV).is_some() => None, // applied by Cudnn::new
        PlanDir::EnvOrDefault | PlanDir::Default => Some(default_plan_dir()),
        PlanDir::Off => Some(None),
        PlanDir::Dir(d) => Some(Some(d.clone())),
    };
    if let Some(dir) = dir {
        tp.each("plan directory", move |r| {
            r.ctx.set_plan_dir(dir.as_deref());
            Ok(())
        })?;
    }
    tp.reset_cache(1, input.max_seq)?;
    let graph = plan.decode == DecodeMode::Graph && graphable(&plan.backends, cfg.layers);
    let mut g =
        TpGen { tp, backends: plan.backends.clone(), graph, captured: false, launched: 0, prefilled: false };
    let prompt = &input.prompt;
    if !opts.no_warmup {
        // A prefill and two decode steps (plans built and tuned, the step captured), then a fresh
        // sequence.
        let mut logits = g.prefill(prompt)?;
        for _ in 0..2.min(input.max_seq - prompt.len()) {
            let id = cudnn_llm_llama::sampling::argmax(&logits)?;
            logits = g.step(id)?;
        }
    }
    let mut sampler = Sampler::new(plan.sampling)?;
    let mut text = input.tokenizer.stream(true);
    let mut stdout = std::io::stdout().lock();
    let t = Instant::now();
    let mut logits = g.prefill(prompt)?;
    let mut id = sampler.sample(&logits)?;
    let prefill = t.elapsed();
    let first_token = cudnn_llm::cudnn_ops::startup::since_process_start();
    let (mut decode, mut tokens) = (Duration::ZERO, Vec::with_capacity(opts.max_new_tokens));
    let stop = loop {
        tokens.push(id);
        if let Some(chunk) = text.step(id)? {
            stdout
                .write_all(chunk.as_bytes())
                .and_then(|()| stdout.flush())
                .map_err(|e| format!("writing the text: {e}"))?;
        }
        if input.eos.contains(&id) {
            break StopReason::Eos(id);
        }
        if tokens.len() == opts.max_new_tokens {
            break StopReason::MaxTokens;
        }
        let t = Instant::now();
        logits = g.step(id)?;
        id = sampler.sample(&logits)?;
        decode += t.elapsed();
    };
    if let Some(rest) = text.finish()? {
        stdout.write_all(rest.as_bytes())?;
    }
    writeln!(stdout)?;
    eprintln!("generate: sampling: host: rank 0 chooses each id from the gathered logits (--tp)");
    match (g.captured, plan.decode) {
        (true, _) => eprintln!("generate: decode steps replayed one captured CUDA graph per rank"),
        (false, DecodeMode::Launch) => eprintln!("generate: decode steps launched plainly (--decode launch)"),
        (false, _) if !g.graph => {
            eprintln!(
                "generate: decode steps launched plainly: RoPE and attention are not fused in every layer"
            )
        }
        (false, _) => eprintln!("generate: decode steps launched plainly (one step: nothing to replay)"),
    }
    let fallbacks =
        g.tp.each("fallbacks", |r| Ok(if r.index == 0 { r.model.fallbacks().to_vec() } else { Vec::new() }))?;
    for f in fallbacks.iter().flatten() {
        eprintln!(
            "generate: {} (layer {:?}, {}) ran naive on rank 0: {}",
            f.range, f.layer, f.shape, f.reason
        );
    }
    if opts.ids {
        print_ids(&tokens);
    }
    let rates = Rates {
        tokens: tokens.len(),
        stop,
        prompt_tokens: prompt.len(),
        prefill,
        decode,
        decode_steps: tokens.len() - 1,
    };
    let (split, elem) = (*g.tp.plan(), std::mem::size_of::<T>());
    report(&rates, |i| split.decode_roofline(cfg, 1, prompt.len() + i, elem), bandwidth, " per rank", None);
    g.tp.each("plans", |r| {
        if r.index == 0 {
            report_plans(&r.ctx);
        }
        Ok(())
    })?;
    report_startup(first_token);
    Ok(())
}

/// Each call on the ranks waits up to 15 minutes (tp-bench's default: drawing or reading a rank's
/// share of Llama-3.1-70B takes minutes) before the ranks are torn down.
fn tp_options() -> TpOptions {
    TpOptions::default().with_timeout(std::time::Duration::from_secs(900))
}
