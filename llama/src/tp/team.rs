//! The ranks of a tensor-parallel model: one thread per GPU, each owning its `Cudnn` context, its
//! shard, its KV cache and its captured decode step, driven from the caller's thread by jobs that
//! every rank runs (the collectives in them meet on the GPUs).

use super::load::{RankSource, WeightSource};
use super::shard::ShardPlan;
use crate::backends::Backends;
use crate::config::LlamaConfig;
use crate::model::{DecodeGraph, KvCache, Llama, NoObserver};
use crate::nccl::rendezvous::{RankEnv, RendezvousError, Session};
use crate::nccl::{AbortHandle, Comm, NcclConfig, UniqueId};
use crate::{Error, Result};
use cudnn_llm_ops::cudarc::driver::sys::CUevent_flags;
use cudnn_llm_ops::{Cudnn, DeviceInfo, Element};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Stack of a rank's thread: a main thread's (8 MiB), not a spawned thread's 2 MiB default.
const RANK_STACK: usize = 8 << 20;

/// How long the other ranks get to finish once one failed or timed out (their collectives were
/// aborted, so they return promptly unless a rank hangs outside NCCL).
const GRACE: Duration = Duration::from_secs(30);

/// Bounds of how long a rank of a job of processes hears nothing from another before it takes it
/// for gone (the call timeout, within these; heartbeats come every half second).
const SILENCE_MIN: Duration = Duration::from_secs(5);
const SILENCE_MAX: Duration = Duration::from_secs(60);

/// How long a rank of a job of processes waits, after a collective failed here, for the rendezvous
/// link to name another rank that failed.
const PEER_REPORT: Duration = Duration::from_secs(1);

/// The longest wait a team call takes, whatever its timeout says.
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Settings of a [`TpLlama`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TpOptions {
    /// GPU ordinals of the ranks, rank i on `devices[i]`; `None`: GPUs `0..ranks`.
    pub devices: Option<Vec<usize>>,
    /// How long a call waits for every rank (loading included) before it aborts the communicators
    /// and fails.
    pub timeout: Duration,
    /// The NCCL communicators' settings (default: NCCL's own).
    pub nccl: NcclConfig,
    /// How long a rank's thread polls for its next job after one before it blocks (default
    /// [`TpOptions::DEFAULT_SPIN`]; zero: it blocks at once; `Duration::MAX`: it never blocks). A
    /// blocked thread wakes late, and the ranks wake unevenly, and the first to start a step waits for
    /// the last in the step's first collective; a polling rank takes the call as it is sent. On two
    /// H100s polling took 0.15 ms off a TP2 Llama-3.1-8B decode step as the caller sees it. The cost
    /// is a busy core per rank for at most this long after each call.
    pub spin: Duration,
    /// Each rank keeps its decode steps' residual stream in an NCCL symmetric window, so that their
    /// all-reduces run NCCL's symmetric kernels (default: on; NCCL 2.28.9 or later only, and
    /// `CUDNN_LLM_NCCL_WINDOWS=0` turns it off; see [`crate::nccl`]).
    pub windows: bool,
    /// Rows a copy-engine gather slot holds (default 0: off). With it, a rank sums the row-parallel
    /// projections of passes of 512 rows or more by gathering every rank's partial rows with the
    /// copy engines while it computes other rows, instead of all-reducing them: one sequence of
    /// 1024 rows or more and at most twice this many runs as two interleaved halves (so never with
    /// fewer than 512 rows a slot), other passes and batches in chunks of at most this many rows
    /// (`modules/reduce.rs`; NCCL 2.28.9 or later, two ranks or more; `CUDNN_LLM_NCCL_WINDOWS=0`
    /// turns it off with the windows). Each rank's gather window takes
    /// `2 · ranks · gather_rows · hidden` elements, and a halved pass keeps a second set of
    /// activations for its second half. [`TpOptions::GATHER_ROWS`] measured best. Off by default:
    /// with the second communicator made, the same runs' decode steps came out 0-4% slower (cause
    /// not found).
    pub gather_rows: usize,
}

impl Default for TpOptions {
    /// GPUs `0..ranks`, ten minutes per call, NCCL's own communicator settings, ranks polling
    /// [`TpOptions::DEFAULT_SPIN`] for calls.
    fn default() -> Self {
        TpOptions {
            devices: None,
            timeout: Duration::from_secs(600),
            nccl: NcclConfig::default(),
            spin: Self::DEFAULT_SPIN,
            windows: true,
            gather_rows: 0,
        }
    }
}

impl TpOptions {
    /// [`TpOptions::spin`]'s default: long enough to span what a generation loop does on the host
    /// between two decode steps.
    pub const DEFAULT_SPIN: Duration = Duration::from_millis(2);

    /// The [`TpOptions::gather_rows`] that measured best: a 2048-token Llama-3.1-8B prefill in two
    /// halves of 1024 rows (TP2 on two H200s 27.68 ms against 29.30 all-reduced and 47.64 on one
    /// GPU in one call; as two chunks, before the halves: 28.62-29.06 against 29.52-29.96; chunks of
    /// 512 rows: 29.99; of 256: 34.43).
    pub const GATHER_ROWS: usize = 1024;

    /// These options with long passes' sums gathered by the copy engines through slots of `rows`
    /// rows (0: all-reduced; [`TpOptions::gather_rows`]).
    pub fn with_gather_rows(self, rows: usize) -> Self {
        TpOptions { gather_rows: rows, ..self }
    }

    /// These options with the ranks' threads polling `spin` for their next job ([`TpOptions::spin`]).
    pub fn with_spin(self, spin: Duration) -> Self {
        TpOptions { spin, ..self }
    }

    /// These options with the symmetric windows on or off ([`TpOptions::windows`]).
    pub fn with_windows(self, windows: bool) -> Self {
        TpOptions { windows, ..self }
    }

    /// These options with each call waiting at most `timeout`.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        TpOptions { timeout, ..self }
    }

    /// These options with the communicators made with `nccl`.
    pub fn with_nccl(self, nccl: NcclConfig) -> Self {
        TpOptions { nccl, ..self }
    }

    /// These options with the ranks on `devices`.
    pub fn with_devices(self, devices: Vec<usize>) -> Self {
        TpOptions { devices: Some(devices), ..self }
    }
}

/// One rank, as a job sees it on the rank's thread: its shard, its cache and captured decode step,
/// its context (its GPU and stream). Fields drop in order, the context last.
#[non_exhaustive]
pub struct Rank<T: Element> {
    /// The decode step [`TpLlama::capture_decode`] captured.
    pub graph: Option<DecodeGraph<T>>,
    /// The cache [`TpLlama::reset_cache`] made.
    pub cache: Option<KvCache<T>>,
    /// This rank's shard: the decoder at the rank's shapes ([`ShardPlan::local`]).
    pub model: Llama<T>,
    /// This rank's context.
    pub ctx: Cudnn,
    /// This rank's index.
    pub index: usize,
}

impl<T: Element> Rank<T> {
    /// The context, model and cache, or an error before [`TpLlama::reset_cache`].
    pub fn parts(&mut self) -> Result<(&Cudnn, &mut Llama<T>, &mut KvCache<T>)> {
        let cache =
            self.cache.as_mut().ok_or_else(|| Error::Tp("no cache: call reset_cache first".into()))?;
        Ok((&self.ctx, &mut self.model, cache))
    }

    /// Runs `f` between two CUDA events on the rank's stream and waits for it: `f`'s value and the
    /// GPU milliseconds between the events.
    pub fn timed<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<(R, f64)> {
        let cuda = self.ctx.stream().context().clone();
        let event =
            || cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cudnn_llm_ops::Error::from);
        let (start, end) = (event()?, event()?);
        start.record(self.ctx.stream()).map_err(cudnn_llm_ops::Error::from)?;
        let value = f(self)?;
        end.record(self.ctx.stream()).map_err(cudnn_llm_ops::Error::from)?;
        end.synchronize().map_err(cudnn_llm_ops::Error::from)?;
        Ok((value, start.elapsed_ms(&end).map_err(cudnn_llm_ops::Error::from)? as f64))
    }
}

/// A job for every rank, run on its thread.
type Job<T> = Box<dyn FnOnce(&mut Rank<T>) + Send>;

/// A rank's next job: polled for up to `spin`, then waited for; `None` once the team has gone.
fn next_job<J>(queue: &mpsc::Receiver<J>, spin: Duration) -> Option<J> {
    // No end (a window past what an `Instant` holds): it polls until a job or the team's end.
    let until = Instant::now().checked_add(spin);
    loop {
        match queue.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) if until.is_none_or(|u| Instant::now() < u) => {
                std::hint::spin_loop()
            }
            Err(mpsc::TryRecvError::Empty) => return queue.recv().ok(),
        }
    }
}

struct Worker<T: Element> {
    jobs: Option<mpsc::Sender<Job<T>>>,
    thread: Option<JoinHandle<()>>,
    /// Set when the thread has ended (its rank state dropped).
    ended: Arc<AtomicBool>,
}

/// Sets its flag when dropped (a rank thread's end, however it ends).
struct SetOnDrop(Arc<AtomicBool>);
impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// A Llama-3 decoder split over GPUs, Megatron style ([`crate::tp`]): one thread per rank this
/// process holds (every rank with [`TpLlama::new`], its own with [`TpLlama::join`]), NCCL between
/// them. Calls run on every rank and wait for all of them; a rank that fails
/// or does not answer within the timeout aborts every communicator (so no rank stays blocked in a
/// collective), the call returns the first error, and the team refuses further calls.
pub struct TpLlama<T: Element> {
    cfg: LlamaConfig,
    plan: ShardPlan,
    /// The GPUs of the ranks this process holds.
    devices: Vec<usize>,
    /// The first rank this process holds (0 unless it is a rank of a job of processes).
    first: usize,
    workers: Vec<Worker<T>>,
    aborts: Vec<AbortHandle>,
    timeout: Duration,
    torn_down: Option<String>,
    /// The other processes' ranks ([`TpLlama::join`]).
    link: Option<Link>,
}

/// A rank's ties to the other processes of its job.
struct Link {
    session: Session,
    /// The first failure the session's watchers heard of (naming the rank).
    failure: Arc<Mutex<Option<String>>>,
}

impl Link {
    fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl<T: Element> TpLlama<T> {
    /// Splits `cfg` over `ranks` GPUs and loads each rank's slices from `source`, with RoPE tables
    /// for `max_positions` positions. Before any allocation, in this order: [`ShardPlan::new`]'s
    /// errors; [`NcclConfig::validate`]'s ([`Error::Nccl`]); an [`Error::Tp`] for a device list of another length or naming a GPU twice; for more
    /// than one rank, NCCL missing or too old ([`Error::Nccl`]); the driver's errors, and an
    /// [`Error::Tp`] for more ranks than GPUs. Then NCCL's communicators, and each rank opens its GPU
    /// and uploads its shard layer by layer on its thread.
    pub fn new(
        cfg: &LlamaConfig,
        ranks: usize,
        source: &WeightSource,
        max_positions: usize,
        options: TpOptions,
    ) -> Result<Self> {
        let plan = ShardPlan::new(cfg, ranks)?;
        options.nccl.validate()?;
        let devices = options.devices.clone().unwrap_or_else(|| (0..ranks).collect());
        let mut distinct = devices.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if devices.len() != ranks || distinct.len() != ranks {
            return Err(Error::Tp(format!("{ranks} ranks need {ranks} distinct GPUs, given {devices:?}")));
        }
        if ranks > 1 {
            crate::nccl::library()?;
        }
        let present = cudnn_llm_ops::device_count()?;
        if let Some(d) = devices.iter().find(|&&d| d >= present) {
            return Err(Error::Tp(format!(
                "{ranks} ranks on GPUs {devices:?}, but GPU {d} is not there ({present} present)"
            )));
        }
        let comms: Vec<Option<Comm>> = if ranks > 1 {
            let gather_bytes =
                crate::modules::reduce::Gather::<T>::window_bytes(ranks, options.gather_rows, cfg.hidden)
                    .ok_or_else(|| {
                        Error::Tp(format!("gather rows {} overflow a window size", options.gather_rows))
                    })?;
            Comm::init_all_with(&devices, &options.nccl, options.windows, gather_bytes)?
                .into_iter()
                .map(Some)
                .collect()
        } else {
            vec![None]
        };
        let here = devices.into_iter().zip(comms).enumerate().map(|(r, (d, c))| (r, d, c)).collect();
        Self::start(cfg, plan, here, source, max_positions, &options, None)
    }

    /// This process's rank of a job of processes, one per GPU, started by `cudnn-llm-launch`,
    /// torchrun or any launcher that sets their environment (`env`, [`RankEnv::from_env`]): the
    /// ranks meet through [`Session::join`] (rank 0 hands out NCCL's unique id), each makes its
    /// communicator ([`Comm::init_rank`]) and loads its own slices from `source` on GPU
    /// `LOCAL_RANK`. Every process then makes the same calls in the same order, as the ranks of one
    /// process do (`each` runs its job on this process's rank only and returns its one value;
    /// [`TpLlama::logits`] and [`TpLlama::decode`] return the all-gathered logits on every rank);
    /// [`TpLlama::broadcast`] and [`TpLlama::receive`] carry what rank 0 alone knows (the next
    /// tokens) to the others. A rank whose process dies, fails or falls silent ends every other
    /// rank's calls with an error naming it: its link closes or goes quiet, and each rank aborts its
    /// communicator. Errors before anything is made, in this order: [`ShardPlan::new`]'s, the NCCL
    /// settings', an [`Error::Tp`] for given devices or copy-engine gather rows (a process's rank is
    /// on GPU `LOCAL_RANK`, and the gather needs every rank in one process), NCCL missing, and a
    /// `LOCAL_RANK` past the GPUs present. The decode all-reduces run NCCL's regular kernels (the
    /// symmetric windows are made by one process for all its ranks).
    pub fn join(
        cfg: &LlamaConfig,
        env: &RankEnv,
        source: &WeightSource,
        max_positions: usize,
        options: TpOptions,
    ) -> Result<Self> {
        let plan = ShardPlan::new(cfg, env.world)?;
        options.nccl.validate()?;
        if options.devices.is_some() {
            return Err(Error::Tp(format!(
                "rank {} of a job of processes takes GPU LOCAL_RANK={}: give no devices",
                env.rank, env.local_rank
            )));
        }
        if options.gather_rows > 0 {
            return Err(Error::Tp(
                "copy-engine gather rows need every rank in one process (TpLlama::new)".into(),
            ));
        }
        if env.world > 1 {
            crate::nccl::library()?;
        }
        let (device, present) = (env.local_rank, cudnn_llm_ops::device_count()?);
        if device >= present {
            return Err(Error::Tp(format!(
                "rank {} takes GPU LOCAL_RANK={device}, but {present} are present",
                env.rank
            )));
        }
        let world = env.world;
        let tp = |e: RendezvousError| Error::Tp(e.to_string());
        let mut session = Session::join(env, options.timeout, || {
            if world == 1 {
                return Ok(Vec::new());
            }
            UniqueId::new().map(|id| id.as_bytes().to_vec()).map_err(|e| e.to_string())
        })
        .map_err(tp)?;
        // Watched from here on: a rank that fails or dies while the others make their communicators
        // (which block until every rank has joined) ends their wait too.
        let failure = Arc::new(Mutex::new(None::<String>));
        let aborts = Arc::new(Mutex::new(Vec::<AbortHandle>::new()));
        let (heard, to_abort) = (failure.clone(), aborts.clone());
        session.watch(options.timeout.clamp(SILENCE_MIN, SILENCE_MAX), move |why| {
            heard.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(why.clone());
            crate::nccl::abort_all(&to_abort.lock().unwrap_or_else(|p| p.into_inner()), &why);
        });
        let link = Link { session, failure };
        let comm = if world > 1 {
            let made = UniqueId::from_bytes(link.session.payload())
                .map_err(Error::from)
                .and_then(|id| init_watched(device, env.rank, world, id, &options, &link));
            let comm = made.inspect_err(|e| link.session.abort(&format!("its communicator: {e}")))?;
            aborts.lock().unwrap_or_else(|p| p.into_inner()).push(comm.abort_handle());
            Some(comm)
        } else {
            None
        };
        if let Some(why) = link.failure() {
            // A rank failed after this one's communicator was made, before its abort was registered.
            return Err(Error::Tp(why));
        }
        let here = vec![(env.rank, device, comm)];
        Self::start(cfg, plan, here, source, max_positions, &options, Some(link))
    }

    /// Starts a thread for each of `here`'s ranks (index, GPU, communicator), which loads its shard,
    /// and waits for them.
    fn start(
        cfg: &LlamaConfig,
        plan: ShardPlan,
        here: Vec<(usize, usize, Option<Comm>)>,
        source: &WeightSource,
        max_positions: usize,
        options: &TpOptions,
        link: Option<Link>,
    ) -> Result<Self> {
        let mut team = TpLlama {
            cfg: cfg.clone(),
            plan,
            devices: here.iter().map(|(_, d, _)| *d).collect(),
            first: here.first().map_or(0, |(r, _, _)| *r),
            workers: Vec::with_capacity(here.len()),
            aborts: here.iter().filter_map(|(_, _, c)| c.as_ref().map(Comm::abort_handle)).collect(),
            timeout: options.timeout,
            torn_down: None,
            link,
        };
        // One share of the cores per rank of this host (a job of processes: per rank of the job).
        let threads =
            std::thread::available_parallelism().map_or(1, |n| n.get()).div_ceil(plan.ranks.min(64));
        let spin = options.spin;
        let (ready, answers) = mpsc::channel();
        for (at, (rank, device, comm)) in here.into_iter().enumerate() {
            let (jobs, queue) = mpsc::channel::<Job<T>>();
            let (cfg, source, ready) = (cfg.clone(), source.clone(), ready.clone());
            let ended = Arc::new(AtomicBool::new(false));
            let flag = SetOnDrop(ended.clone());
            let body = move || {
                let _ended = flag;
                let built = catch(|| {
                    let rs = RankSource::new(&cfg, &plan, rank, &source, threads);
                    build_rank(&cfg, &plan, &rs, device, max_positions, comm)
                });
                let mut state = match built {
                    Ok(state) => state,
                    Err(e) => {
                        let _ = ready.send((at, Err(e)));
                        return;
                    }
                };
                let _ = ready.send((at, Ok(())));
                drop(ready);
                while let Some(job) = next_job(&queue, spin) {
                    job(&mut state);
                }
            };
            // The caller's thread runs the model on one GPU with a main thread's stack; so do these
            // (NVRTC compiles the naive kernels on first use, cuDNN builds plans).
            let spawned = std::thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .stack_size(RANK_STACK)
                .spawn(body);
            let thread = spawned.map_err(|e| {
                team.tear_down(&format!("rank {rank}'s thread did not start"));
                Error::Tp(format!("cannot start rank {rank}'s thread: {e}"))
            })?;
            team.workers.push(Worker { jobs: Some(jobs), thread: Some(thread), ended });
        }
        drop(ready);
        team.collect(answers, "loading")?;
        Ok(team)
    }

    /// The whole model's config.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// How the model is split.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// Ends the team cleanly: as a rank of a job of processes, tells the others this rank is done (a
    /// follower waiting in [`TpLlama::receive`] gets `None`) before its communicator goes; dropping
    /// the team without this tells them it failed. With every rank in this process, the same as a
    /// drop.
    pub fn finish(mut self) {
        if let Some(link) = self.link.take() {
            if self.torn_down.is_none() {
                link.session.finish();
            } else {
                self.link = Some(link); // Drop reports why
            }
        }
    }

    /// The GPU ordinals of the ranks this process holds, in rank order (all of them, or with
    /// [`TpLlama::join`] its own).
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// The ranks this process holds: `0..ranks`, or its own rank of a job of processes.
    pub fn ranks_here(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.workers.len()
    }

    /// Whether this process holds rank 0, the one that owns the tokens (always, unless it is another
    /// rank of a job of processes).
    pub fn leads(&self) -> bool {
        self.first == 0
    }

    /// Rank 0 of a job of processes: hands `bytes` to every other rank's [`TpLlama::receive`], in
    /// order (nothing to do when this process holds every rank). Errors on another rank, and for a
    /// rank that cannot be reached.
    pub fn broadcast(&mut self, bytes: &[u8]) -> Result<()> {
        self.check("broadcast")?;
        let Some(link) = &self.link else { return Ok(()) };
        link.session.broadcast(bytes).map_err(|e| {
            let e = self.peer_error(e.to_string());
            self.tear_down(&e.to_string());
            e
        })
    }

    /// Another rank of a job of processes: rank 0's next [`TpLlama::broadcast`], `None` once rank 0
    /// has finished (dropped its team cleanly). Waits up to the call timeout; a rank that failed or
    /// died is an error naming it, and tears this team down. Errors on rank 0.
    pub fn receive(&mut self) -> Result<Option<Vec<u8>>> {
        self.check("receive")?;
        let got = match &self.link {
            Some(link) if self.first != 0 => link.session.receive(self.timeout),
            _ => return Err(Error::Tp("receive: this process holds rank 0, which sends".into())),
        };
        got.map_err(|e| {
            let why = e.to_string();
            self.tear_down(&why);
            Error::Tp(why)
        })
    }

    /// Per-rank bytes to the process holding rank 0: there, every rank's `mine` in rank order
    /// (`Some`; with every rank in this process, `mine` alone, which the caller made from every
    /// rank's values); on another rank of a job of processes, `mine` sent to rank 0 and `None`. Rank 0
    /// waits up to the call timeout for the others; a rank that failed or sent nothing is an error
    /// naming it, and tears this team down.
    pub fn gather(&mut self, mine: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
        self.check("gather")?;
        let Some(link) = &self.link else { return Ok(Some(vec![mine])) };
        let got = if self.first == 0 {
            link.session.gather(self.timeout).map(|others| Some([vec![mine], others].concat()))
        } else {
            link.session.send(&mine).map(|()| None)
        };
        got.map_err(|e| {
            let why = e.to_string();
            self.tear_down(&why);
            Error::Tp(why)
        })
    }

    /// A collective that failed here may have failed for another process's rank (NCCL saw its peer
    /// go before the rendezvous link did): waits up to [`PEER_REPORT`] for the link to say which rank,
    /// so that the error names the cause (tearing down first would silence the link).
    fn await_peer_report(&self, e: &Error) {
        let Some(link) = &self.link else { return };
        if !matches!(e, Error::Nccl(_)) {
            return;
        }
        let until = Instant::now() + PEER_REPORT;
        while link.failure().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// An error if the team was torn down.
    fn check(&self, what: &str) -> Result<()> {
        match &self.torn_down {
            Some(why) => Err(Error::Tp(format!("{what}: the ranks were torn down ({why})"))),
            None => Ok(()),
        }
    }

    /// `here`, with the failure another process's rank reported first, when there was one (the cause,
    /// where `here` is its consequence: an aborted collective).
    fn peer_error(&self, here: String) -> Error {
        match self.link.as_ref().and_then(Link::failure) {
            Some(why) => Error::Tp(format!("{why} (here: {here})")),
            None => Error::Tp(here),
        }
    }

    /// Why the team was torn down, if it was (then every call fails).
    pub fn torn_down(&self) -> Option<&str> {
        self.torn_down.as_deref()
    }

    /// Runs `f` on every rank, on the ranks' threads, and returns the ranks' values in rank order.
    /// The ranks must call the same collectives in the same order (every model call does). A rank
    /// that returns an error (or panics), or a call that exceeds the timeout, aborts every rank's
    /// communicator, waits a grace period for the others, tears the team down and returns the first
    /// error ([`Error::Rank`], or [`Error::Tp`] for a timeout). `what` names the call in errors.
    pub fn each<R, F>(&mut self, what: &str, f: F) -> Result<Vec<R>>
    where
        R: Send + 'static,
        F: Fn(&mut Rank<T>) -> Result<R> + Send + Sync + 'static,
    {
        self.check(what)?;
        let f = Arc::new(f);
        let (reply, answers) = mpsc::channel();
        for (rank, worker) in self.workers.iter().enumerate() {
            let (f, to_main) = (f.clone(), reply.clone());
            let job: Job<T> = Box::new(move |state| {
                let _ = to_main.send((rank, catch(|| f(state))));
            });
            let sent = worker.jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok());
            if !sent {
                let _ = reply.send((rank, Err(Error::Tp("its thread has ended".into()))));
            }
        }
        drop(reply);
        self.collect(answers, what)
    }

    /// Waits for every rank's answer (see [`TpLlama::each`]).
    fn collect<R>(&mut self, answers: mpsc::Receiver<(usize, Result<R>)>, what: &str) -> Result<Vec<R>> {
        let n = self.workers.len();
        let mut values: Vec<Option<R>> = (0..n).map(|_| None).collect();
        let mut answered = vec![false; n];
        let mut failure: Option<Error> = None;
        // A timeout past what an `Instant` holds (`Duration::MAX`) waits a century, not a panic.
        let mut deadline = Instant::now() + self.timeout.min(CENTURY);
        while answered.iter().any(|a| !a) {
            match answers.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((rank, answer)) => {
                    answered[rank] = true;
                    match answer {
                        Ok(v) => values[rank] = Some(v),
                        Err(e) if failure.is_none() => {
                            let rank = self.first + rank;
                            self.await_peer_report(&e);
                            self.tear_down(&format!("rank {rank} failed in {what}: {e}"));
                            failure = Some(Error::Rank { rank, error: Box::new(e) });
                            deadline = Instant::now() + GRACE;
                        }
                        Err(_) => {} // torn down already: the first error is the cause
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) if failure.is_none() => {
                    let silent: Vec<usize> =
                        (0..n).filter(|&r| !answered[r]).map(|r| self.first + r).collect();
                    let why = format!("ranks {silent:?} did not finish {what} within {:?}", self.timeout);
                    self.tear_down(&why);
                    failure = Some(Error::Tp(why));
                    deadline = Instant::now() + GRACE;
                }
                // Grace over, or every rank's reply gone: leave the silent ranks.
                Err(_) => break,
            }
        }
        if let Some(e) = failure {
            // A rank of another process that failed first is the cause.
            return Err(match self.link.as_ref().and_then(Link::failure) {
                Some(_) => self.peer_error(e.to_string()),
                None => e,
            });
        }
        let values: Vec<R> = values.into_iter().flatten().collect();
        if values.len() != n {
            let why = format!("a rank's thread ended without answering {what}");
            self.tear_down(&why);
            return Err(Error::Tp(why));
        }
        Ok(values)
    }

    /// Refuses later calls, has every rank drop its captured decode step (after the job it runs, if
    /// any) and aborts every communicator on a helper thread (NCCL's last abort waits for those
    /// graphs to go, see [`crate::nccl`]).
    fn tear_down(&mut self, why: &str) {
        if self.torn_down.is_some() {
            return;
        }
        self.torn_down = Some(why.to_string());
        for w in &self.workers {
            if let Some(jobs) = &w.jobs {
                let _ = jobs.send(Box::new(|state: &mut Rank<T>| state.graph = None));
            }
        }
        crate::nccl::abort_all(&self.aborts, why);
        if let Some(link) = &self.link {
            // The other processes' ranks learn of it now rather than at their next collective.
            link.session.abort(why);
        }
    }

    /// Each rank's GPU, cuDNN and driver, in rank order.
    pub fn device_info(&mut self) -> Result<Vec<DeviceInfo>> {
        self.each("device_info", |r| Ok(r.ctx.info().clone()))
    }

    /// A new, empty KV cache on every rank (its K/V heads) for `batch` sequences of up to `max_seq`
    /// tokens; a captured decode step is dropped.
    pub fn reset_cache(&mut self, batch: usize, max_seq: usize) -> Result<()> {
        self.each("reset_cache", move |r| {
            r.graph = None;
            r.cache = None;
            r.cache = Some(r.model.cache(&r.ctx, batch, max_seq)?);
            Ok(())
        })
        .map(drop)
    }

    /// Tokens cached per sequence (the same on every rank).
    pub fn cache_len(&mut self) -> Result<usize> {
        let lens = self.each("cache_len", |r| crate::model::cache_len(r.parts()?.2))?;
        match lens.windows(2).find(|w| w[0] != w[1]) {
            Some(w) => Err(Error::Tp(format!("the ranks' caches disagree: {} and {} tokens", w[0], w[1]))),
            None => Ok(lens[0]),
        }
    }

    /// Keeps the first `len` cached tokens of each sequence on every rank.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.each("truncate", move |r| {
            r.parts()?.2.truncate_to(len);
            Ok(())
        })
        .map(drop)
    }

    /// Runs the next `tokens` of every sequence through every rank ([`Llama::forward`]) and waits for
    /// the work to finish.
    pub fn forward(&mut self, tokens: &[Vec<u32>], backends: &Backends) -> Result<()> {
        let (tokens, backends) = (Arc::new(tokens.to_vec()), Arc::new(backends.clone()));
        self.each("forward", move |r| {
            let (ctx, model, cache) = r.parts()?;
            model.forward(ctx, &tokens, cache, &backends, &mut NoObserver)?;
            Ok(ctx.synchronize()?)
        })
        .map(drop)
    }

    /// Logits `[rows.len(), vocab]` of the last forward's output rows `rows`, on the host: every rank
    /// its vocabulary slice, all-gathered on the GPUs, rank 0's copy downloaded.
    pub fn logits(&mut self, rows: std::ops::Range<usize>, backends: &Backends) -> Result<Vec<f32>> {
        let (n, backends, first) = (rows.len(), Arc::new(backends.clone()), self.first);
        let per_rank = self.each("logits", move |r| {
            let dev = r.model.logits_rows(&r.ctx, rows.clone(), &backends, &mut NoObserver)?;
            first_rank_host(r, first, &dev)
        })?;
        Ok(gathered_to_rows(&per_rank[0], self.plan.ranks, n, self.cfg.vocab))
    }

    /// Captures one decode step and its logits on every rank as a CUDA graph, NCCL's collectives
    /// included ([`Llama::capture_decode`]'s conditions: run a plain decode step and its logits with
    /// the same `backends` first). Replay it with [`TpLlama::decode`].
    pub fn capture_decode(&mut self, backends: &Backends) -> Result<()> {
        let backends = Arc::new(backends.clone());
        self.each("capture_decode", move |r| {
            r.graph = None;
            let (ctx, model, cache) = r.parts()?;
            // SAFETY: `ctx`'s CUDA context object was made on this rank's thread and never leaves it
            // (jobs run here), so no other thread can use its buffers or streams meanwhile; the other
            // ranks' threads work on their own GPUs' contexts.
            let graph = unsafe { model.capture_decode(ctx, cache, &backends) }?;
            r.graph = Some(graph);
            Ok(())
        })
        .map(drop)
    }

    /// Replays the captured decode step for `tokens` (one per sequence) on every rank and returns
    /// their logits `[batch, vocab]` on the host.
    pub fn decode(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (batch, step, first) = (tokens.len(), Arc::new(tokens.to_vec()), self.first);
        let per_rank = self.each("decode", move |r| {
            let Rank { graph, cache, model, ctx, index } = r;
            let graph = graph.as_mut().ok_or_else(|| Error::Tp("decode: capture_decode first".into()))?;
            let cache = cache.as_mut().ok_or_else(|| Error::Tp("decode: call reset_cache first".into()))?;
            let dev = model.decode(ctx, graph, &step, cache)?;
            if *index == first {
                Ok(ctx.stream().clone_dtoh(dev).map_err(cudnn_llm_ops::Error::from)?)
            } else {
                ctx.synchronize()?;
                Ok(Vec::new())
            }
        })?;
        let host: Vec<f32> = per_rank[0].iter().map(|v| v.to_f64() as f32).collect();
        Ok(gathered_to_rows(&host, self.plan.ranks, batch, self.cfg.vocab))
    }
}

impl<T: Element> Drop for TpLlama<T> {
    /// Ends the rank threads (each drops its shard and destroys its communicator); threads of a
    /// torn-down team that do not end within the grace period are left behind rather than waited for.
    fn drop(&mut self) {
        // The other processes' ranks first: a follower waiting for rank 0's next message ends its
        // own ranks now, and NCCL's teardown of a communicator waits for every rank's (so ending ours
        // before telling them would wait forever). Dropped without [`TpLlama::finish`], this rank
        // ends on an error or a panic: the others are told so.
        if let Some(link) = self.link.take() {
            let why = match &self.torn_down {
                Some(why) => why.clone(),
                None if std::thread::panicking() => "it panicked".to_string(),
                None => "it ended without finishing (an error on this rank)".to_string(),
            };
            link.session.abort(&why); // then dropped: its links close
        }
        for w in &mut self.workers {
            w.jobs = None;
        }
        let deadline = Instant::now() + GRACE;
        for w in &mut self.workers {
            let Some(thread) = w.thread.take() else { continue };
            if self.torn_down.is_some() {
                while !w.ended.load(Ordering::Acquire) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if !w.ended.load(Ordering::Acquire) {
                    continue; // detached: it is stuck outside anything an abort reaches
                }
            }
            let _ = thread.join();
        }
    }
}

/// This process's communicator, made on a helper thread while the rendezvous link is watched:
/// `ncclCommInitRank` blocks until every rank has called it, so a rank that failed or died before
/// (the link says which) or a wait past the timeout ends the wait here with an error. The helper
/// thread is then left blocked in NCCL; the process's end takes it.
fn init_watched(
    device: usize,
    rank: usize,
    world: usize,
    id: UniqueId,
    options: &TpOptions,
    link: &Link,
) -> Result<Comm> {
    let (made, wait) = mpsc::channel();
    let nccl = options.nccl;
    std::thread::Builder::new()
        .name(format!("tp-rank-{rank}-init"))
        .spawn(move || {
            let _ = made.send(Comm::init_rank(device, rank, world, &id, &nccl));
        })
        .map_err(|e| Error::Tp(format!("cannot start rank {rank}'s communicator thread: {e}")))?;
    let until = Instant::now() + options.timeout.min(CENTURY);
    loop {
        match wait.recv_timeout(Duration::from_millis(20)) {
            Ok(comm) => return Ok(comm?),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Error::Tp(format!("rank {rank}'s communicator thread ended without a result")))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(why) = link.failure() {
            return Err(Error::Tp(format!("{why} (while rank {rank} made its NCCL communicator)")));
        }
        if Instant::now() >= until {
            return Err(Error::Tp(format!(
                "rank {rank}'s NCCL communicator was not made within {:?} (a rank did not join NCCL)",
                options.timeout
            )));
        }
    }
}

/// Builds rank `rs.rank`'s shard on GPU `device`.
fn build_rank<T: Element>(
    cfg: &LlamaConfig,
    plan: &ShardPlan,
    rs: &RankSource<'_>,
    device: usize,
    max_positions: usize,
    comm: Option<Comm>,
) -> Result<Rank<T>> {
    let ctx = Cudnn::new(device)?;
    let (embed, norm) = (rs.embed::<T>()?, rs.norm::<T>()?);
    // One rank of a tied model reads the embedding as lm_head (no second copy).
    let head = if plan.ranks == 1 && cfg.tie_embeddings { None } else { Some(rs.lm_head::<T>()?) };
    let local = plan.local(cfg);
    let model = Llama::shard(
        &ctx,
        &local,
        &mut |l| rs.layer::<T>(l),
        [&embed, &norm],
        head.as_ref(),
        max_positions,
        comm,
    )?;
    Ok(Rank { graph: None, cache: None, model, ctx, index: rs.rank })
}

/// The first rank's (`first`, this process's first) copy of a gathered device buffer as f32 (empty
/// on the other ranks, which wait for their work instead).
fn first_rank_host<T: Element>(
    r: &mut Rank<T>,
    first: usize,
    dev: &cudnn_llm_ops::cudarc::driver::CudaSlice<T>,
) -> Result<Vec<f32>> {
    if r.index != first {
        r.ctx.synchronize()?;
        return Ok(Vec::new());
    }
    let host = r.ctx.stream().clone_dtoh(dev).map_err(cudnn_llm_ops::Error::from)?;
    Ok(host.iter().map(|v| v.to_f64() as f32).collect())
}

/// `f`'s result, a panic turned into an [`Error::Tp`].
fn catch<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let text = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        Err(Error::Tp(format!("panicked: {text}")))
    })
}

/// Logits gathered over `ranks` ranks, every rank's `[rows, vocab / ranks]` slice in rank order
/// (`[ranks, rows, vocab / ranks]`), as `[rows, vocab]`.
pub fn gathered_to_rows<V: Copy>(gathered: &[V], ranks: usize, rows: usize, vocab: usize) -> Vec<V> {
    let part = vocab / ranks.max(1);
    let mut out = Vec::with_capacity(rows * vocab);
    for row in 0..rows {
        for r in 0..ranks {
            let at = (r * rows + row) * part;
            out.extend_from_slice(&gathered[at..at + part]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_logits_come_back_in_vocabulary_order() {
        // 3 ranks, 2 rows, vocabulary 6: each rank holds 2 entries of each row.
        let (ranks, rows, vocab) = (3, 2, 6);
        let rows_major: Vec<usize> = (0..rows * vocab).collect();
        let mut gathered = Vec::new();
        for r in 0..ranks {
            for row in 0..rows {
                gathered.extend_from_slice(&rows_major[row * vocab + r * 2..row * vocab + r * 2 + 2]);
            }
        }
        assert_eq!(gathered, [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
        assert_eq!(gathered_to_rows(&gathered, ranks, rows, vocab), rows_major);
        // One row, or one rank: the layout is already row-major.
        assert_eq!(gathered_to_rows(&[1, 2, 3, 4], 2, 1, 4), [1, 2, 3, 4]);
        assert_eq!(gathered_to_rows(&[1, 2, 3, 4], 1, 2, 2), [1, 2, 3, 4]);
    }

    #[test]
    fn a_rank_takes_its_jobs_in_order_polling_or_blocked_and_stops_when_the_team_goes() {
        for spin in [Duration::ZERO, Duration::from_millis(1), Duration::from_secs(60), Duration::MAX] {
            let (send, queue) = mpsc::channel();
            send.send(1).unwrap();
            send.send(2).unwrap();
            assert_eq!(next_job(&queue, spin), Some(1));
            assert_eq!(next_job(&queue, spin), Some(2));
            // A job sent after the poll window (or, for the long window, within it) still arrives.
            let late = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                send.send(3).unwrap();
                send
            });
            assert_eq!(next_job(&queue, spin), Some(3));
            drop(late.join().unwrap());
            // The sender gone: no job, polling or blocked, without waiting out the window.
            let t = Instant::now();
            assert_eq!(next_job(&queue, spin), None);
            assert!(t.elapsed() < Duration::from_secs(30), "{spin:?}: {:?}", t.elapsed());
        }
    }

    #[test]
    fn setups_that_cannot_run_fail_before_touching_a_gpu() {
        let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
        let random = WeightSource::Random { seed: 0 };
        let new = |ranks, options| TpLlama::<f32>::new(&cfg, ranks, &random, 64, options).map(drop);
        let e = new(3, TpOptions::default()).unwrap_err().to_string();
        assert!(e.contains("32 query heads do not split over 3 ranks"), "{e}");
        let e = new(2, TpOptions::default().with_devices(vec![0])).unwrap_err().to_string();
        assert!(e.contains("2 ranks need 2 distinct GPUs, given [0]"), "{e}");
        let e = new(2, TpOptions::default().with_devices(vec![1, 1])).unwrap_err().to_string();
        assert!(e.contains("given [1, 1]"), "{e}");
        // NCCL missing is a typed error before the GPUs are counted; with NCCL, more ranks than GPUs
        // names the missing GPU (or the driver's absence). Either way nothing was opened.
        let e = new(8, TpOptions::default().with_devices((100..108).collect())).unwrap_err();
        match (&e, crate::nccl::library()) {
            (Error::Nccl(crate::nccl::NcclError::NotFound { tried }), Err(_)) => {
                assert!(!tried.is_empty());
                assert!(e.to_string().contains("NCCL_LIBRARY"), "{e}");
            }
            (Error::Tp(m), Ok(_)) => assert!(m.contains("GPU 100 is not there"), "{m}"),
            (Error::Ops(cudnn_llm_ops::Error::NoGpu(_)), Ok(_)) => {}
            (other, nccl) => panic!("{other:?} (NCCL: {nccl:?})"),
        }
        // A communicator setting NCCL would refuse, whatever the rank count.
        let bad = crate::nccl::NcclConfig::default().with_min_ctas(8).with_max_ctas(4);
        let e = new(2, TpOptions::default().with_nccl(bad)).unwrap_err();
        assert!(
            matches!(&e, Error::Nccl(crate::nccl::NcclError::Config { option, .. }) if option == "minCTAs"),
            "{e:?}"
        );
        // One rank needs no NCCL: the driver's error or the missing GPU.
        let e = new(1, TpOptions::default().with_devices(vec![100])).unwrap_err();
        assert!(matches!(e, Error::Tp(_) | Error::Ops(cudnn_llm_ops::Error::NoGpu(_))), "{e:?}");
    }
}
