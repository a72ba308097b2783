//! `generate --tp N`: the same generation on a model split over N GPUs ([`TpLlama`]: one thread,
//! `Cudnn` context and NCCL communicator per GPU, GPUs `0..N`). Each step's logits are all-gathered
//! on the GPUs and rank 0's copy is sampled on the host, as on one GPU. With `--decode graph` (and
//! RoPE and attention fused in every layer) the first decode step launches plainly and every rank
//! then captures its step, NCCL's collectives included, and replays it from then on. Started as
//! the ranks of a job of processes, each process holds one rank ([`TpLlama::join`]); rank 0 runs this
//! same loop and broadcasts each prefill's ids and each step's id (with its capture and replay
//! decisions), which the other ranks follow ([`TpGen::follow`]) until rank 0 finishes.

use crate::cli::{Options, Plan, PlanDir};
use crate::{print_ids, report, report_plans, report_startup, Error, Input, Rates, COPY_BYTES};
use cudnn_llm_app::bench_util::copy_bandwidth_gbps;
use cudnn_llm_llama::generate::StopReason;
use cudnn_llm_llama::tp::{RankEnv, TpLlama, TpOptions, WeightSource};
use cudnn_llm_llama::{nccl, Backend, Backends, DecodeMode, ModuleKind, Sampler};
use cudnn_llm_ops::{default_plan_dir, Cudnn, Element, PLAN_DIR_ENV};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How the ranks are held: every rank in this process (`--tp N`), or this process's rank of a job
/// of processes (launched with `WORLD_SIZE` and the rest set).
#[derive(Debug, Clone)]
pub(crate) enum Ranks {
    Threads(usize),
    Processes(RankEnv),
}

impl Ranks {
    /// How many ranks the model is split over.
    pub(crate) fn count(&self) -> usize {
        match self {
            Ranks::Threads(n) => *n,
            Ranks::Processes(env) => env.world,
        }
    }
}

/// What rank 0 tells the other processes' ranks to run next: the token stream they follow.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Command {
    /// A new sequence of these ids.
    Prefill(Vec<u32>),
    /// One id after the cached ones; capture the step first (`capture`), and replay the captured
    /// step (`replay`) rather than launch it.
    Step { id: u32, capture: bool, replay: bool },
}

impl Command {
    fn encode(&self) -> Vec<u8> {
        match self {
            Command::Prefill(ids) => {
                let mut m = vec![b'P'];
                m.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
                m
            }
            Command::Step { id, capture, replay } => {
                let mut m = vec![b'S'];
                m.extend(id.to_le_bytes());
                m.extend([*capture as u8, *replay as u8]);
                m
            }
        }
    }

    fn decode(m: &[u8]) -> Result<Command, Error> {
        let ids =
            |b: &[u8]| b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        match m.split_first() {
            Some((b'P', rest)) if rest.len() % 4 == 0 && !rest.is_empty() => Ok(Command::Prefill(ids(rest))),
            Some((b'S', rest)) if rest.len() == 6 && rest[4] < 2 && rest[5] < 2 => Ok(Command::Step {
                id: u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]),
                capture: rest[4] == 1,
                replay: rest[5] == 1,
            }),
            _ => Err(format!("rank 0 sent a message this build does not read ({} bytes)", m.len()).into()),
        }
    }
}

/// One sequence on the split model: its prefill, then decode steps launched plainly or, once
/// captured, replayed. Rank 0 decides; as processes, the other ranks run what it sends.
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
        self.tp.broadcast(&Command::Prefill(ids.to_vec()).encode())?;
        self.run_prefill(ids)
    }

    /// A prefill, on every rank.
    fn run_prefill(&mut self, ids: &[u32]) -> Result<Vec<f32>, Error> {
        self.tp.truncate(0)?;
        self.tp.forward(&[ids.to_vec()], &self.backends)?;
        self.prefilled = true;
        Ok(self.tp.logits(ids.len() - 1..ids.len(), &self.backends)?)
    }

    /// Runs one id after the cached ones and returns its logits.
    fn step(&mut self, id: u32) -> Result<Vec<f32>, Error> {
        if self.captured && std::mem::take(&mut self.prefilled) {
            // A longer prefill reallocates the activations a captured step holds: capture again.
            self.captured = !self.stale()?;
        }
        let capture = self.graph && self.launched > 0 && !self.captured;
        let replay = self.captured || capture;
        self.tp.broadcast(&Command::Step { id, capture, replay }.encode())?;
        self.run_step(id, capture, replay)
    }

    /// Whether a rank here has no captured step, or one that holds buffers a longer prefill replaced.
    fn stale(&mut self) -> Result<bool, Error> {
        let stale = self.tp.each("a captured step's buffers", |r| {
            Ok(r.graph.as_ref().is_none_or(|g| !r.model.is_current(&r.ctx, g)))
        })?;
        Ok(stale.contains(&true))
    }

    /// A step as rank 0 decided it.
    fn run_step(&mut self, id: u32, capture: bool, replay: bool) -> Result<Vec<f32>, Error> {
        if capture {
            self.tp.capture_decode(&self.backends)?;
            self.captured = true;
        }
        if replay {
            return Ok(self.tp.decode(&[id])?);
        }
        self.tp.forward(&[vec![id]], &self.backends)?;
        self.launched += 1;
        Ok(self.tp.logits(0..1, &self.backends)?)
    }

    /// Another process's rank: runs what rank 0 sends until it finishes.
    fn follow(&mut self) -> Result<(), Error> {
        while let Some(m) = self.tp.receive()? {
            match Command::decode(&m)? {
                Command::Prefill(ids) => {
                    self.run_prefill(&ids)?;
                }
                Command::Step { id, capture, replay } => {
                    if replay && !capture && std::mem::take(&mut self.prefilled) {
                        // Rank 0 found its captured step current after the prefill: so must this rank.
                        if self.stale()? {
                            return Err("rank 0 replays its captured step, but this rank's is stale (its \
                                        buffers were reallocated): the ranks' states differ"
                                .into());
                        }
                    }
                    self.run_step(id, capture, replay)?;
                }
            }
        }
        Ok(())
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
    ranks: Ranks,
) -> Result<(), Error> {
    let cfg = &input.config;
    // Measured before the model is resident, as on one GPU; the ranks' GPUs are of one host.
    let bandwidth = copy_bandwidth_gbps(ctx, COPY_BYTES, 10).map_err(|e| e.to_string());
    let source = WeightSource::checkpoint(cfg, &opts.model)?;
    let mut tp = match &ranks {
        Ranks::Threads(n) => TpLlama::<T>::new(cfg, *n, &source, input.max_seq, tp_options())?,
        Ranks::Processes(env) => TpLlama::<T>::join(cfg, env, &source, input.max_seq, tp_options())?,
    };
    let (leads, count) = (tp.leads(), ranks.count());
    let infos = tp.device_info()?;
    let gpus: Vec<String> =
        infos.iter().zip(tp.devices()).map(|(i, d)| format!("GPU {d} {}", i.name)).collect();
    let nccl_line = match nccl::library() {
        Ok((v, lib)) if count > 1 => format!(", NCCL {} ({lib})", nccl::version_string(v)),
        _ => String::new(),
    };
    let how = match &ranks {
        Ranks::Threads(_) => format!("tensor parallel ({}{nccl_line})", gpus.join(", ")),
        Ranks::Processes(env) => format!(
            "tensor parallel, a process per rank (rank 0 on {}{nccl_line}; rendezvous at {}:{})",
            gpus.join(", "),
            env.master_addr,
            env.master_port
        ),
    };
    if leads {
        eprintln!(
            "generate: {} ({} layers, {}) on {count} ranks, {how}, backends `{}`, {} prompt tokens",
            cfg.name,
            cfg.layers,
            plan.dtype,
            plan.backends.to_selection(),
            input.prompt.len()
        );
    }
    if leads && input.eos.is_empty() {
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
    if !leads {
        // Rank 0 tokenizes, samples and prints; this rank runs what it sends until it finishes.
        g.follow()?;
        g.tp.finish();
        return Ok(());
    }
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
    g.tp.finish();
    Ok(())
}

/// Each call on the ranks waits up to 15 minutes (tp-bench's default: drawing or reading a rank's
/// share of Llama-3.1-70B takes minutes) before the ranks are torn down.
fn tp_options() -> TpOptions {
    TpOptions::default().with_timeout(std::time::Duration::from_secs(900))
}

#[cfg(test)]
mod tests {
    use super::Command;

    #[test]
    fn rank_0s_commands_read_back_as_sent_and_anything_else_is_refused() {
        for c in [
            Command::Prefill(vec![128000, 9906, 0, u32::MAX]),
            Command::Step { id: 42, capture: true, replay: true },
            Command::Step { id: 0, capture: false, replay: false },
        ] {
            assert_eq!(Command::decode(&c.encode()).unwrap(), c);
        }
        for bad in
            [&b""[..], b"P", b"P\x01\x02\x03", b"S\x01\x00\x00\x00\x01", b"S\x01\x00\x00\x00\x02\x00", b"X"]
        {
            let e = Command::decode(bad).unwrap_err().to_string();
            assert!(e.contains("does not read"), "{bad:?}: {e}");
        }
    }
}
