//! NCCL for tensor parallelism: the library opened at run time, the communicators of one process (one
//! per GPU, created together by `ncclCommInitAll`) and the two collectives the decoder needs, a sum
//! all-reduce in place and an in-place all-gather, enqueued on a rank's cudarc stream (so a forward
//! that calls them captures as a CUDA graph, NCCL's collectives included).
//!
//! 1. `let comms = Comm::init_all(&[0, 1], &NcclConfig::default())?;` opens NCCL (an error, not a panic, when it is missing or
//!    too old) and makes rank i's communicator on GPU `devices[i]`;
//! 2. move `comms[i]` to the thread that drives GPU i (a [`Comm`] is `Send`);
//! 3. `comm.all_reduce_sum(stream, &mut buf)?` on that GPU's stream; [`abort_all`] with the
//!    communicators' [`Comm::abort_handle`]s ends them from any thread when a rank failed, so the
//!    ranks waiting in a collective return.
//!
//! **Teardown and CUDA graphs.** NCCL frees the communicators of a process together, in the last
//! `ncclCommDestroy` or `ncclCommAbort` of them, and that call waits until every CUDA graph that
//! captured one of their collectives is destroyed. So destroy a rank's captured graphs before its
//! communicator (dropping a [`Comm`] destroys it), and [`abort_all`] aborts on a thread of its own,
//! never blocking its caller on graphs that other threads still hold.
//!
//! **Settings.** [`NcclConfig`] sets the communicators' `minCTAs`, `maxCTAs` and `cgaClusterSize`
//! (NCCL's `ncclConfig_t`, passed to `ncclCommInitRankConfig` in one group, as `ncclCommInitAll`
//! makes its own; `raw` replicates NCCL 2.28's struct and initializer, its layout pinned by
//! compile-time asserts); left at its default, `ncclCommInitAll` makes them. The protocol and
//! algorithm are NCCL environment variables, read once per process at the first communicator:
//! [`set_tuning_env`] sets them before that, and refuses afterwards.
//!
//! **Why not cudarc's `nccl` module.** cudarc 0.19 with `dynamic-loading` builds it, and its bindings
//! give the ABI types here, but its loader tries `libnccl.so` and `libnccl.so.<CUDA major>` (`.13`,
//! `.12`, ...) and never `libnccl.so.2`, the only name NCCL 2 installs (and the only file of the
//! `nvidia-nccl-cu13` wheel's `nvidia/nccl/lib`); it panics when none opens, and its `Comm` panics in
//! `Drop` and in `group()`. So this module opens the library as the cuDNN and CUPTI loaders do:
//! `$NCCL_LIBRARY` if set, else `libnccl.so.2` then `libnccl.so` through the system loader (put the
//! wheel's `site-packages/nvidia/nccl/lib` on `LD_LIBRARY_PATH`); every failure is an [`NcclError`].
//!
//! **NVLink multicast stays off.** [`Comm::init_all`] refuses to start with `NCCL_NVLS_ENABLE` set to
//! anything but `0` and sets it to `0` when it is unset: NVLS (NVLink SHARP multicast) all-reduces go
//! through multicast objects (`cuMulticastCreate`), which the machines this crate is measured on do
//! not allow (a program using them can put a host's shared GPUs out of service), and a two-GPU
//! all-reduce of a decoder's activations gains little from them. The variable is set before NCCL's
//! first communicator reads it; set it yourself before starting threads that read the environment.
//!
//! **Connections are made at init.** NCCL 2.22+ connects a communicator's peers at its first
//! collective by default (`NCCL_RUNTIME_CONNECT=1`), and that connect blocks the calling thread until
//! the peers call a collective too. A rank that fails before its first collective then leaves the
//! others blocked inside `ncclAllReduce` on the host, where no abort reaches them: seen here as a
//! tear-down test that hung in about one run in three. So [`Comm::init_all`] sets
//! `NCCL_RUNTIME_CONNECT=0` when it is unset (`ncclCommInitAll` connects every rank before it
//! returns; enqueueing a collective then never waits for a peer, only its kernel does, which an abort
//! ends) and refuses any other value ([`NcclError::LazyConnect`]).
//!
//! **Graph mixing support is off.** With `NCCL_GRAPH_MIXING_SUPPORT=1` (NCCL's default) every
//! collective captured in a CUDA graph carries extra synchronization so that graphs and collectives
//! outside graphs may run at the same time; on two H200s it cost about 0.11 ms of an 8B decode step's
//! 3.0 (64 all-reduces). [`Comm::init_all`] sets it to `0` when it is unset (a value set in the
//! environment is kept). NCCL then requires that a communicator never has two graph launches
//! running in parallel on different streams (a rank here replays its graphs on one stream), nor a
//! collective enqueued outside a graph while a graph launch may still run: whoever launches a graph
//! holding a communicator's collectives tells it ([`Comm::graph_launched`]; `Llama`'s replays do),
//! and the next collective enqueued outside a capture first waits on the host for that launch.
//!
//! **Symmetric windows for one-row all-reduces.** With NCCL 2.28.9 or later (and two ranks or
//! more), [`Comm::init_all`] also makes each rank a symmetric window ([`WINDOW_BYTES`] from
//! `ncclMemAlloc`, registered with `ncclCommWindowRegister` in one group, as NCCL asks). A
//! tensor-parallel rank keeps its one-token decode steps' residual stream there
//! ([`Comm::window_pair`]), so NCCL runs its symmetric kernels on their all-reduces: on two H200s a
//! TP2 Llama-3.1-8B decode step took 2.64 against 2.78-2.80 ms with plain buffers. Prefill's and
//! batches' all-reduces stay on plain buffers (the 16 MB all-reduce was slower in a window).
//!
//! One rule comes with them: NCCL 2.28's symmetric kernels are launched as programmatic dependents
//! of the kernel before them (`cudaLaunchAttributeProgrammaticStreamSerialization`) and never call
//! `griddepcontrol.wait`, so they start as soon as that kernel lets its dependents launch and may
//! read its output before it is written. The decode GEMVs let the next kernel launch early; before
//! an all-reduce they must not ([`cudnn_llm_ops::MatmulOperands::before_collective`], set on a rank's
//! o_proj and down), and a pass keeps x in the window only where those projections run that GEMV.
//! Without the rule the plain decode steps came out wrong (rel. L2 2e-2 against one GPU on 8B
//! shapes, while replayed graphs were right), as NCCL 2.28.3 had given wrong steps before
//! (NVIDIA/nccl#1924 reports graphs). `app/tests/tp.rs` compares windows against plain buffers bit for
//! bit. Older libraries make no window; [`WINDOWS_ENV`]`=0` or `TpOptions::with_windows(false)` turn
//! them off.

//!
//! **Copy-engine gathers for long passes.** With a gather window asked for
//! ([`Comm::init_all_with`]'s `gather_bytes`, NCCL 2.28.9 or later, two ranks or more), each rank
//! also gets a second communicator made with `NCCL_CTA_POLICY_ZERO` and a symmetric window of that
//! size on it. NCCL runs an in-place all-gather between such windows on the copy engines (a
//! flag handshake with the peers through stream memory operations, the copies, another handshake;
//! no kernel), so it can run beside a GEMM without taking its SMs. A tensor-parallel rank uses it
//! for long prefills: a row-parallel projection's partial rows are gathered from every rank while
//! the rank computes other rows (the other half of the pass, or the next chunk), then summed by the
//! rank with the residual ([`cudnn_llm_ops::sum_partials`]); see `TpOptions::gather_rows`. The probe `app/benches/tp_ce_allgather_probe.py` measured the copy
//! alone: 23.5 us for a 1024 x 4096 bf16 chunk to the other H200 (357 GB/s).
#![deny(missing_docs, rustdoc::broken_intra_doc_links)]

mod raw;
pub mod rendezvous;

use cudarc::driver::sys::{CUevent_flags, CUstreamCaptureStatus};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtrMut};
use cudarc::nccl::sys::ncclDataType_t;
use cudnn_llm_ops::{DataType, Element};
use once_cell::unsync::OnceCell;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The variable naming the NCCL library to open (and only it), e.g.
/// `.../site-packages/nvidia/nccl/lib/libnccl.so.2`.
pub const LIBRARY_ENV: &str = "NCCL_LIBRARY";

/// The oldest NCCL this module runs on (2.13.0, encoded as `ncclGetVersion` reports it): the first
/// with `ncclGetLastError`; bf16 reductions came in 2.10, collectives in CUDA graphs in 2.9.
pub const MIN_VERSION: u32 = 2_13_00;

/// The oldest NCCL that takes the [`NcclConfig`] attributes (2.17.0: `ncclConfig_t` gained
/// `cgaClusterSize`, `minCTAs` and `maxCTAs`).
pub const CONFIG_MIN_VERSION: u32 = 2_17_00;

/// The most CTAs (channels) NCCL 2.28 runs a collective on (`MAXCHANNELS`).
pub const MAX_CTAS: u32 = 64;

/// The largest CGA (thread-block cluster) size NCCL takes (`NCCL_MAX_CGA_CLUSTER_SIZE`).
pub const MAX_CGA_CLUSTER_SIZE: u32 = 8;

/// Settings of the communicators [`Comm::init_all`] makes, NCCL's `ncclConfig_t` attributes; each
/// `None` leaves NCCL's own choice (and its environment variables, e.g. `NCCL_MIN_CTAS`, which
/// override these when set). All `None` (the default) makes the communicators with
/// `ncclCommInitAll`; otherwise `ncclCommInitRankConfig` (NCCL 2.17 or later), blocking.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclConfig {
    /// `minCTAs`: the fewest CTAs (channels, one SM each) a collective runs on, 1 to [`MAX_CTAS`];
    /// needs `max_ctas` (NCCL 2.28 refuses a minimum against an unset maximum).
    pub min_ctas: Option<u32>,
    /// `maxCTAs`: the most CTAs a collective runs on, 1 to [`MAX_CTAS`], at least `min_ctas`.
    pub max_ctas: Option<u32>,
    /// `cgaClusterSize`: thread-block cluster size of NCCL's kernels (Hopper and later), 0 to
    /// [`MAX_CGA_CLUSTER_SIZE`] (0: no clusters).
    pub cga_cluster_size: Option<u32>,
}

impl NcclConfig {
    /// This configuration with `minCTAs` set.
    pub fn with_min_ctas(self, n: u32) -> Self {
        NcclConfig { min_ctas: Some(n), ..self }
    }

    /// This configuration with `maxCTAs` set.
    pub fn with_max_ctas(self, n: u32) -> Self {
        NcclConfig { max_ctas: Some(n), ..self }
    }

    /// This configuration with `cgaClusterSize` set.
    pub fn with_cga_cluster_size(self, n: u32) -> Self {
        NcclConfig { cga_cluster_size: Some(n), ..self }
    }

    /// Whether every attribute is NCCL's own.
    pub fn is_default(&self) -> bool {
        *self == NcclConfig::default()
    }

    /// The name of the first attribute set, for errors (`minCTAs` when none is).
    fn first_set(&self) -> &'static str {
        match (self.min_ctas, self.max_ctas, self.cga_cluster_size) {
            (Some(_), _, _) | (None, None, None) => "minCTAs",
            (None, Some(_), _) => "maxCTAs",
            (None, None, Some(_)) => "cgaClusterSize",
        }
    }

    /// Refuses values NCCL would refuse (or clamp), naming the attribute: CTAs outside 1 to
    /// [`MAX_CTAS`], a minimum above the maximum or without one, a cluster size above
    /// [`MAX_CGA_CLUSTER_SIZE`].
    pub fn validate(&self) -> Result<(), NcclError> {
        let bad = |option: &str, why: String| Err(NcclError::Config { option: option.into(), why });
        for (option, v) in [("minCTAs", self.min_ctas), ("maxCTAs", self.max_ctas)] {
            if let Some(v) = v.filter(|v| !(1..=MAX_CTAS).contains(v)) {
                return bad(option, format!("{v} is not between 1 and {MAX_CTAS}"));
            }
        }
        match (self.min_ctas, self.max_ctas) {
            (Some(min), Some(max)) if min > max => {
                return bad("minCTAs", format!("{min} is above maxCTAs {max}"));
            }
            (Some(min), None) => {
                return bad(
                    "minCTAs",
                    format!("{min} needs maxCTAs too (NCCL compares it with an unset maximum)"),
                );
            }
            _ => {}
        }
        if let Some(v) = self.cga_cluster_size.filter(|&v| v > MAX_CGA_CLUSTER_SIZE) {
            return bad("cgaClusterSize", format!("{v} is above {MAX_CGA_CLUSTER_SIZE}"));
        }
        Ok(())
    }
}

impl std::fmt::Display for NcclConfig {
    /// `minCTAs=16 maxCTAs=32`, or `NCCL defaults`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set: Vec<String> = [
            ("minCTAs", self.min_ctas),
            ("maxCTAs", self.max_ctas),
            ("cgaClusterSize", self.cga_cluster_size),
        ]
        .iter()
        .filter_map(|(name, v)| v.map(|v| format!("{name}={v}")))
        .collect();
        if set.is_empty() {
            f.write_str("NCCL defaults")
        } else {
            f.write_str(&set.join(" "))
        }
    }
}

/// NCCL's protocol choice, `NCCL_PROTO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `LL`: low latency, 8-byte stores with flags.
    Ll,
    /// `LL128`: low latency over 128-byte lines (NVLink).
    Ll128,
    /// `Simple`: bulk copies, highest bandwidth.
    Simple,
}

/// NCCL's algorithm choice for the collectives, `NCCL_ALGO` (NVLS and CollNet stay out: see the
/// module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// `Ring`.
    Ring,
    /// `Tree`.
    Tree,
}

impl Protocol {
    /// NCCL's name, as `NCCL_PROTO` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Ll => "LL",
            Protocol::Ll128 => "LL128",
            Protocol::Simple => "Simple",
        }
    }
}

impl Algorithm {
    /// NCCL's name, as `NCCL_ALGO` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "Ring",
            Algorithm::Tree => "Tree",
        }
    }
}

impl std::str::FromStr for Protocol {
    type Err = NcclError;
    fn from_str(s: &str) -> Result<Self, NcclError> {
        [Protocol::Ll, Protocol::Ll128, Protocol::Simple].into_iter().find(|p| p.name() == s).ok_or_else(
            || NcclError::Config {
                option: PROTO_ENV.into(),
                why: format!("`{s}` is not LL, LL128 or Simple"),
            },
        )
    }
}

impl std::str::FromStr for Algorithm {
    type Err = NcclError;
    fn from_str(s: &str) -> Result<Self, NcclError> {
        [Algorithm::Ring, Algorithm::Tree].into_iter().find(|a| a.name() == s).ok_or_else(|| {
            NcclError::Config { option: ALGO_ENV.into(), why: format!("`{s}` is not Ring or Tree") }
        })
    }
}

/// NCCL's protocol variable.
pub const PROTO_ENV: &str = "NCCL_PROTO";
/// NCCL's algorithm variable.
pub const ALGO_ENV: &str = "NCCL_ALGO";

/// Set once this process has started making a communicator: NCCL has read its environment since.
static COMMS_MADE: AtomicBool = AtomicBool::new(false);

/// Sets `NCCL_PROTO` and `NCCL_ALGO` for this process. NCCL reads them when it makes its first
/// communicator and keeps them for the process's life, so they are per process, not per
/// communicator: call this before the first [`Comm::init_all`] (an [`NcclError::Config`] after it),
/// and before starting threads that read the environment. A variable already set to another value
/// is refused too (the two would disagree about what ran); the same value is fine.
pub fn set_tuning_env(protocol: Option<Protocol>, algorithm: Option<Algorithm>) -> Result<(), NcclError> {
    let current = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    for (name, value) in tuning_env(COMMS_MADE.load(Ordering::SeqCst), current, protocol, algorithm)? {
        std::env::set_var(name, value);
    }
    Ok(())
}

/// The variables [`set_tuning_env`] sets, or why it cannot: `made` (a communicator exists) and
/// `current` (the environment) as arguments, so the policy is testable without NCCL.
fn tuning_env(
    made: bool,
    current: impl Fn(&str) -> Option<String>,
    protocol: Option<Protocol>,
    algorithm: Option<Algorithm>,
) -> Result<Vec<(&'static str, &'static str)>, NcclError> {
    let wanted: Vec<(&'static str, &'static str)> =
        [(PROTO_ENV, protocol.map(Protocol::name)), (ALGO_ENV, algorithm.map(Algorithm::name))]
            .into_iter()
            .filter_map(|(name, v)| v.map(|v| (name, v)))
            .collect();
    for &(name, value) in &wanted {
        if made {
            return Err(NcclError::Config {
                option: name.into(),
                why: format!(
                    "cannot become {value}: this process has made a communicator, and NCCL read its environment then"
                ),
            });
        }
        if let Some(old) = current(name).filter(|old| old != value) {
            return Err(NcclError::Config {
                option: name.into(),
                why: format!("is {old} in the environment; refusing to replace it with {value}"),
            });
        }
    }
    Ok(wanted)
}

/// Bytes of each rank's symmetric window ([`Comm::window_pair`]: two halves of 2 MiB, 256 rows of a
/// 4096-wide bf16 residual, 128 of an 8192-wide one).
pub const WINDOW_BYTES: usize = 4 << 20;
// Half a window holds 128 rows of the widest preset residual (70B: 8192 bf16).
const _: () = assert!(WINDOW_BYTES / 2 >= 128 * 8192 * 2);

/// The oldest NCCL whose symmetric windows [`Comm::init_all`] makes (see the module docs).
pub const WINDOW_MIN_VERSION: u32 = 2_28_09;

/// The variable that turns the symmetric windows off (`0`; `1` or unset: on where NCCL allows).
pub const WINDOWS_ENV: &str = "CUDNN_LLM_NCCL_WINDOWS";

/// [`WINDOWS_ENV`]: on unless `0`; another value than `0` or `1` is an error naming it.
fn windows_from_env(value: Option<&str>) -> Result<bool, NcclError> {
    match value {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(NcclError::Config { option: WINDOWS_ENV.into(), why: format!("`{v}` is not 0 or 1") }),
    }
}

/// NCCL's switch for NVLink SHARP multicast, which stays `0` (see the module docs).
pub const MULTICAST_ENV: &str = "NCCL_NVLS_ENABLE";

/// NCCL's switch for connecting peers at the first collective instead of at init, which stays `0`
/// (see the module docs).
pub const RUNTIME_CONNECT_ENV: &str = "NCCL_RUNTIME_CONNECT";

/// NCCL's support for graphs and collectives outside graphs running at once, `0` unless the
/// environment says otherwise (see the module docs).
pub const GRAPH_MIXING_ENV: &str = "NCCL_GRAPH_MIXING_SUPPORT";

pub use cudnn_llm_dylib::Candidate;

/// Why NCCL could not be used, or a collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// No candidate could be opened.
    #[error(
        "NCCL not found; tried {}. Install NCCL 2 (e.g. `pip install nvidia-nccl-cu13`) and put its lib \
         directory (site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH, or set \
         {LIBRARY_ENV}=/path/to/libnccl.so.2",
        cudnn_llm_dylib::tried(.tried)
    )]
    NotFound {
        /// Every candidate with its error.
        tried: Vec<Candidate>,
    },
    /// The library opened but lacks a function this module calls.
    #[error("{library} has no symbol `{symbol}` (is it NCCL 2.13 or later?)")]
    MissingSymbol {
        /// The library that was opened.
        library: String,
        /// The first missing symbol.
        symbol: String,
    },
    /// The library is older than [`MIN_VERSION`].
    #[error("{library} is NCCL {}, but {} or later is required", version_string(*.version), version_string(MIN_VERSION))]
    TooOld {
        /// The library that was opened.
        library: String,
        /// `ncclGetVersion()`.
        version: u32,
    },
    /// `NCCL_NVLS_ENABLE` asks for NVLink multicast, which this crate keeps off.
    #[error(
        "{MULTICAST_ENV}={value}: NVLink multicast stays off here (a program using it can put a host's \
         shared GPUs out of service); unset it or set it to 0"
    )]
    Multicast {
        /// The variable's value.
        value: String,
    },
    /// `NCCL_RUNTIME_CONNECT` asks for connections at the first collective, where a failed rank
    /// would leave the others blocked on the host.
    #[error(
        "{RUNTIME_CONNECT_ENV}={value}: connections are made at init here (with runtime connection a rank \
         that fails before its first collective leaves the others blocked in it, out of an abort's reach); \
         unset it or set it to 0"
    )]
    LazyConnect {
        /// The variable's value.
        value: String,
    },
    /// A communicator setting or tuning variable NCCL would refuse, or one set too late.
    #[error("NCCL {option}: {why}")]
    Config {
        /// The attribute (`minCTAs`, ...) or variable (`NCCL_PROTO`, ...).
        option: String,
        /// What is wrong with it.
        why: String,
    },
    /// An NCCL call failed.
    #[error("{call} failed with {name} ({code}){}", if .detail.is_empty() { String::new() } else { format!(": {}", .detail) })]
    Call {
        /// The NCCL function.
        call: String,
        /// The raw `ncclResult_t`.
        code: u32,
        /// `ncclGetErrorString` of the code.
        name: String,
        /// `ncclGetLastError`: NCCL's message for the failure.
        detail: String,
    },
    /// The communicator was aborted (another rank failed or timed out) or destroyed.
    #[error("rank {rank}'s NCCL communicator was aborted: {why}")]
    Aborted {
        /// The rank.
        rank: usize,
        /// Why it was aborted.
        why: String,
    },
    /// Arguments a collective cannot take (the message names them); nothing was enqueued.
    #[error("{0}")]
    Argument(String),
    /// A failure a test injected ([`cudnn_llm_ops::faults`]); nothing was enqueued.
    #[error("{0}")]
    Injected(String),
    /// A CUDA call around a collective failed (the message names it).
    #[error("{0}")]
    Cuda(String),
}

/// `major.minor.patch` of an `ncclGetVersion()` number (2.9 and later: `major·10000 + minor·100 +
/// patch`).
pub fn version_string(v: u32) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

/// Opens NCCL (once per process) and returns its version and the candidate that opened, for
/// reports; the same errors as [`Comm::init_all`]'s loading.
pub fn library() -> Result<(u32, String), NcclError> {
    let lib = raw::load()?;
    Ok((lib.version, lib.library.clone()))
}

/// Keeps NVLink multicast off, connections at init and (unless set) graph mixing support off before
/// NCCL reads its environment (see the module docs).
fn fixed_env() -> Result<(), NcclError> {
    let current = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    for name in fixed_env_to_set(current)? {
        std::env::set_var(name, "0");
    }
    Ok(())
}

/// The variables [`fixed_env`] sets to `0` (those unset), or the error for one set otherwise
/// (graph mixing keeps any value set); `current` reads the environment, so the policy is testable
/// without NCCL.
fn fixed_env_to_set(current: impl Fn(&str) -> Option<String>) -> Result<Vec<&'static str>, NcclError> {
    let mut unset = Vec::new();
    for name in [MULTICAST_ENV, RUNTIME_CONNECT_ENV, GRAPH_MIXING_ENV] {
        match current(name) {
            None => unset.push(name),
            Some(v) if v == "0" => {}
            Some(_) if name == GRAPH_MIXING_ENV => {}
            Some(value) if name == MULTICAST_ENV => return Err(NcclError::Multicast { value }),
            Some(value) => return Err(NcclError::LazyConnect { value }),
        }
    }
    Ok(unset)
}

/// A communicator's handle while it lives, or why it is gone.
enum State {
    Live(raw::RawComm),
    Gone(String),
}

/// What a [`Comm`] and its [`AbortHandle`]s share.
struct Shared {
    lib: &'static raw::Lib,
    rank: usize,
    state: Mutex<State>,
    /// The primary context a configured communicator was made in, held while it may live
    /// (`ncclCommInitAll`'s hold their own through the CUDA runtime).
    _context: Option<Arc<cudarc::driver::CudaContext>>,
}

impl Shared {
    /// Rank `rank`'s live communicator `raw`, holding `context` (a configured one's) while it lives.
    fn live(
        lib: &'static raw::Lib,
        rank: usize,
        raw: raw::RawComm,
        context: Option<Arc<cudarc::driver::CudaContext>>,
    ) -> Arc<Shared> {
        Arc::new(Shared { lib, rank, state: Mutex::new(State::Live(raw)), _context: context })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves a handle or a reason, both usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the handle (if the communicator still lives) from its owner: later calls return
    /// [`NcclError::Aborted`] with `why`.
    fn take(&self, why: &str) -> Option<raw::RawComm> {
        match std::mem::replace(&mut *self.lock(), State::Gone(why.to_string())) {
            State::Live(raw) => Some(raw),
            State::Gone(_) => None,
        }
    }
}

/// NCCL's unique id: the 128 bytes that make the processes given them one communicator
/// ([`Comm::init_rank`]). Opaque; it names rank 0's host and a port NCCL listens on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl UniqueId {
    /// A new id (`ncclGetUniqueId`), made once, by rank 0.
    pub fn new() -> Result<UniqueId, NcclError> {
        Ok(UniqueId(raw::load()?.unique_id()?))
    }

    /// Its bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The id in `bytes` (exactly 128, as [`UniqueId::as_bytes`] gave them).
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId, NcclError> {
        let b: [u8; 128] = bytes
            .try_into()
            .map_err(|_| NcclError::Argument(format!("a unique id is 128 bytes, not {}", bytes.len())))?;
        Ok(UniqueId(b))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

/// One rank's NCCL communicator, on one GPU. `Send`, not `Sync`: the thread driving the GPU owns
/// it; other threads reach it only through an [`AbortHandle`]. Dropping it destroys the
/// communicator, or aborts it when an operation left an error on it (the last of a process's
/// communicators to go waits for the graphs that captured their collectives).
pub struct Comm {
    shared: Arc<Shared>,
    ranks: usize,
    device: usize,
    /// Recorded again after each launch of a graph holding this communicator's collectives
    /// ([`Comm::graph_launched`]; made at the first), so it completes when the last launch has run.
    launched: OnceCell<CudaEvent>,
    /// A launch was recorded that no collective enqueued outside a capture has waited for yet. A
    /// `Cell`: `Comm` is not `Sync` (one thread enqueues on a communicator).
    pending: Cell<bool>,
    /// This rank's symmetric window, if NCCL made one (see the module docs); freed on drop, after the
    /// communicator's destroy or abort.
    window: Option<raw::RawWindow>,
    /// This rank's copy-engine all-gathers, if made (see the module docs).
    gather: Option<GatherComm>,
}

/// A rank's second communicator, made with `NCCL_CTA_POLICY_ZERO`, and its symmetric window: NCCL
/// runs all-gathers between such windows on the copy engines (see the module docs).
struct GatherComm {
    shared: Arc<Shared>,
    window: Option<raw::RawWindow>,
}

impl Drop for GatherComm {
    fn drop(&mut self) {
        release(&self.shared, self.window.take());
    }
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.shared.rank)
            .field("ranks", &self.ranks)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// A [`Comm`] (and its copy-engine communicator, if any) as another thread sees it: only
/// [`abort_all`] takes it.
#[derive(Clone)]
pub struct AbortHandle(Vec<Arc<Shared>>);

/// A collective's fault-injection check ([`cudnn_llm_ops::faults`], [`Site::Collective`]): nothing is
/// enqueued when it fails.
///
/// [`Site::Collective`]: cudnn_llm_ops::faults::Site::Collective
fn injected(what: &str) -> Result<(), NcclError> {
    cudnn_llm_ops::faults::hit(cudnn_llm_ops::faults::Site::Collective)
        .map_err(|e| NcclError::Injected(format!("{what}: {e}")))
}

/// Ends the communicators of `handles` that still live: their owners' later calls fail with
/// [`NcclError::Aborted`] (`why`) at once, and a helper thread calls `ncclCommAbort` on each, which
/// makes their ranks' pending collectives return (their kernels exit). Returns without waiting: the
/// last abort waits for the graphs that captured their collectives to be destroyed (see the module
/// docs). A thread that cannot start leaves the communicators unaborted (but taken).
pub fn abort_all(handles: &[AbortHandle], why: &str) {
    let taken: Vec<(&'static raw::Lib, raw::RawComm)> = handles
        .iter()
        .flat_map(|h| &h.0)
        .filter_map(|shared| shared.take(why).map(|raw| (shared.lib, raw)))
        .collect();
    if taken.is_empty() {
        return;
    }
    let _ = std::thread::Builder::new().name("nccl-abort".into()).spawn(move || {
        for (lib, raw) in taken {
            // Nothing is left to free when an abort itself fails.
            let _ = lib.abort(raw);
        }
    });
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortHandle").field("rank", &self.0.first().map_or(0, |s| s.rank)).finish()
    }
}

/// NCCL's type for `T`'s elements, and their size.
fn nccl_type<T: Element>() -> Result<(ncclDataType_t, usize), NcclError> {
    let t = match T::DTYPE {
        DataType::BF16 => ncclDataType_t::ncclBfloat16,
        DataType::F16 => ncclDataType_t::ncclFloat16,
        DataType::F32 => ncclDataType_t::ncclFloat32,
        other => {
            return Err(NcclError::Argument(format!(
                "NCCL collectives here take bf16, f16 or f32, not {other}"
            )))
        }
    };
    Ok((t, std::mem::size_of::<T>()))
}

/// A symmetric window of `bytes` on each of `comms` (rank i on GPU `devices[i]`, just made, so
/// live; [`raw::Lib::windows`]).
fn make_windows(
    comms: &[Arc<Shared>],
    devices: &[usize],
    bytes: usize,
) -> Result<Vec<raw::RawWindow>, NcclError> {
    let Some(lib) = comms.first().map(|c| c.lib) else { return Ok(Vec::new()) };
    let states: Vec<MutexGuard<'_, State>> = comms.iter().map(|c| c.lock()).collect();
    let raws: Vec<&raw::RawComm> = states
        .iter()
        .filter_map(|s| match &**s {
            State::Live(raw) => Some(raw),
            State::Gone(_) => None,
        })
        .collect();
    if raws.len() != comms.len() {
        return Err(NcclError::Argument("a communicator was aborted before its window was made".into()));
    }
    lib.windows(&raws, devices, bytes)
}

/// Buffers of `len` elements of `T` at the byte offsets `at` of window `w` (on GPU `device`), on
/// `stream`; `None` when `stream` is on another GPU or one would leave the window.
fn views<T: cudarc::driver::DeviceRepr>(
    w: &raw::RawWindow,
    device: usize,
    stream: &Arc<CudaStream>,
    len: usize,
    at: impl IntoIterator<Item = usize>,
) -> Option<Vec<WindowBuf<T>>> {
    let bytes = len.checked_mul(std::mem::size_of::<T>())?;
    if stream.context().ordinal() != device {
        return None;
    }
    at.into_iter()
        .map(|at| {
            (at.checked_add(bytes)? <= w.bytes).then_some(())?;
            // SAFETY: `bytes` bytes at `at` lie in the window (checked above), on `stream`'s GPU,
            // holding `len` elements of `T`; `WindowBuf` never frees them through cudarc, and the
            // window lives until its communicator drops.
            Some(WindowBuf(Some(unsafe { stream.upgrade_device_ptr::<T>(w.ptr + at as u64, len) })))
        })
        .collect()
}

/// Destroys the communicator `shared` holds (aborts it when an operation left an error on it),
/// outside its lock, so that [`abort_all`] never waits on it; `window` is deregistered before and
/// freed after. After an [`abort_all`], whose thread may still be inside `ncclCommAbort` tearing
/// down the window's registration, the window's memory is left to the process.
fn release(shared: &Shared, window: Option<raw::RawWindow>) {
    let lib = shared.lib;
    if let Some(raw) = shared.take("dropped") {
        if lib.async_error(&raw).is_ok() {
            if let Some(w) = window {
                let _ = lib.free_window(Some(&raw), w);
            }
            let _ = lib.destroy(raw);
        } else {
            let _ = lib.abort(raw);
            if let Some(w) = window {
                let _ = lib.free_window(None, w);
            }
        }
    } else if let Some(w) = window {
        std::mem::forget(w);
    }
}

impl Comm {
    /// One communicator per device of `devices`, rank i on GPU `devices[i]`, created together from
    /// this one thread: `ncclCommInitAll` for the default `config`, else one group of
    /// `ncclCommInitRankConfig` calls with its attributes. Checks `config`
    /// ([`NcclConfig::validate`]), keeps NVLink multicast off and connections at init
    /// ([`NcclError::Multicast`], [`NcclError::LazyConnect`] if the
    /// environment asks for it) and graph mixing support off unless the environment sets it, then
    /// opens NCCL. Devices must be distinct and present; NCCL reports
    /// otherwise.
    pub fn init_all(devices: &[usize], config: &NcclConfig) -> Result<Vec<Comm>, NcclError> {
        Self::init_all_with(devices, config, true, 0)
    }

    /// [`Comm::init_all`], making the decode windows only with `windows`, and with `gather_bytes`
    /// above 0 a copy-engine communicator per rank with a gather window of that many bytes
    /// ([`Comm::gather_in_place`]); both only where NCCL and [`WINDOWS_ENV`] allow (see the module
    /// docs).
    pub fn init_all_with(
        devices: &[usize],
        config: &NcclConfig,
        windows: bool,
        gather_bytes: usize,
    ) -> Result<Vec<Comm>, NcclError> {
        if devices.is_empty() {
            return Err(NcclError::Argument("no devices to make communicators for".into()));
        }
        let mut seen = devices.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != devices.len() {
            return Err(NcclError::Argument(format!("devices {devices:?} name a GPU twice")));
        }
        let ordinals = devices
            .iter()
            .map(|&d| std::ffi::c_int::try_from(d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| NcclError::Argument(format!("devices {devices:?} do not fit an int")))?;
        config.validate()?;
        fixed_env()?;
        let lib = raw::load()?;
        let symmetric = (windows || gather_bytes > 0)
            && devices.len() > 1
            && lib.has_windows(WINDOW_MIN_VERSION)
            && windows_from_env(std::env::var(WINDOWS_ENV).ok().as_deref())?;
        COMMS_MADE.store(true, Ordering::SeqCst);
        let raws: Vec<(raw::RawComm, Option<_>)> = if config.is_default() {
            lib.init_all(&ordinals)?.into_iter().map(|raw| (raw, None)).collect()
        } else {
            lib.init_all_config(&ordinals, config)?.into_iter().map(|(raw, ctx)| (raw, Some(ctx))).collect()
        };
        let ranks = devices.len();
        // Made before any window, so that an error below can abort them.
        let mut comms: Vec<Comm> = raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, ((raw, context), &device))| {
                Comm::plain(Shared::live(lib, rank, raw, context), ranks, device)
            })
            .collect();
        let gather_bytes = if symmetric { gather_bytes } else { 0 };
        if let Err(e) =
            Self::add_windows(lib, &mut comms, &ordinals, devices, symmetric && windows, gather_bytes)
        {
            // Aborted, not destroyed: a destroy may wait for the other ranks, which this one thread
            // would reach only after it (their drop then frees nothing more).
            let handles: Vec<AbortHandle> = comms.iter().map(Comm::abort_handle).collect();
            abort_all(&handles, &format!("a window could not be made: {e}"));
            return Err(e);
        }
        Ok(comms)
    }

    /// This process's communicator as rank `rank` of `ranks`, on GPU `device`, joining the others
    /// through `id` (rank 0 makes it with [`UniqueId::new`] and gives it to every rank, e.g. over
    /// [`rendezvous`]). Blocks until every rank has called it. The settings of [`Comm::init_all`]
    /// hold (`config` checked, NVLink multicast off, connections at init); symmetric windows and the
    /// copy-engine gather are not made (they are made collectively by one process's ranks).
    pub fn init_rank(
        device: usize,
        rank: usize,
        ranks: usize,
        id: &UniqueId,
        config: &NcclConfig,
    ) -> Result<Comm, NcclError> {
        if ranks == 0 || rank >= ranks {
            return Err(NcclError::Argument(format!(
                "rank {rank} of {ranks}: a rank is below the rank count"
            )));
        }
        config.validate()?;
        fixed_env()?;
        let lib = raw::load()?;
        COMMS_MADE.store(true, Ordering::SeqCst);
        let (raw, context) = lib.init_rank(device, rank, ranks, id.0, raw::ConfigV22800::from(config))?;
        Ok(Comm::plain(Shared::live(lib, rank, raw, Some(context)), ranks, device))
    }

    /// A communicator of `ranks` on `device` with no window or gather communicator (yet).
    fn plain(shared: Arc<Shared>, ranks: usize, device: usize) -> Comm {
        Comm {
            shared,
            ranks,
            device,
            launched: OnceCell::new(),
            pending: Cell::new(false),
            window: None,
            gather: None,
        }
    }

    /// The decode windows (with `windows`) and, with `gather_bytes` above 0, each rank's copy-engine
    /// communicator and its gather window, on the communicators `init_all_with` just made.
    fn add_windows(
        lib: &'static raw::Lib,
        comms: &mut [Comm],
        ordinals: &[std::ffi::c_int],
        devices: &[usize],
        windows: bool,
        gather_bytes: usize,
    ) -> Result<(), NcclError> {
        if windows {
            let shareds: Vec<Arc<Shared>> = comms.iter().map(|c| c.shared.clone()).collect();
            for (comm, window) in comms.iter_mut().zip(make_windows(&shareds, devices, WINDOW_BYTES)?) {
                comm.window = Some(window);
            }
        }
        if gather_bytes > 0 {
            let made = lib.init_all_raw(ordinals, raw::ConfigV22800::zero_cta(), "CTAPolicy")?;
            for (rank, (comm, (raw, context))) in comms.iter_mut().zip(made).enumerate() {
                comm.gather =
                    Some(GatherComm { shared: Shared::live(lib, rank, raw, Some(context)), window: None });
            }
            let shareds: Vec<Arc<Shared>> =
                comms.iter().filter_map(|c| c.gather.as_ref()).map(|g| g.shared.clone()).collect();
            let made = make_windows(&shareds, devices, gather_bytes)?;
            for (gather, window) in comms.iter_mut().filter_map(|c| c.gather.as_mut()).zip(made) {
                gather.window = Some(window);
            }
        }
        Ok(())
    }

    /// Whether this rank has a symmetric window (see the module docs).
    pub fn has_window(&self) -> bool {
        self.window.is_some()
    }

    /// This rank's symmetric window as two buffers of `len` elements of `T` on `stream` (its first
    /// and second half), or `None`: no window (see the module docs), `len` elements do not fit half
    /// of it, or `stream` is on another GPU. All-reduces of rows within either run NCCL's symmetric
    /// kernels. The buffers are views: dropping them frees nothing, and they must not outlive this
    /// communicator, which frees the window.
    pub fn window_pair<T: cudarc::driver::DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Option<[WindowBuf<T>; 2]> {
        let w = self.window.as_ref()?;
        let half = w.bytes / 2;
        if len.checked_mul(std::mem::size_of::<T>())? > half {
            return None;
        }
        let [a, b]: [WindowBuf<T>; 2] = views(w, self.device, stream, len, [0, half])?.try_into().ok()?;
        Some([a, b])
    }

    /// Bytes of this rank's gather window (0 without one: no copy-engine communicator, see the
    /// module docs).
    pub fn gather_bytes(&self) -> usize {
        self.gather.as_ref().and_then(|g| g.window.as_ref()).map_or(0, |w| w.bytes)
    }

    /// This rank's gather window as `n` consecutive buffers of `len` elements of `T` on `stream`, or
    /// `None`: no gather window ([`Comm::gather_bytes`] 0), they do not fit it, or `stream` is on another
    /// GPU. In-place gathers within one ([`Comm::gather_in_place`]) run on the copy engines. Views, as
    /// [`Comm::window_pair`]'s.
    pub fn gather_slots<T: cudarc::driver::DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
        n: usize,
    ) -> Option<Vec<WindowBuf<T>>> {
        let w = self.gather.as_ref()?.window.as_ref()?;
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        (bytes.checked_mul(n)? <= w.bytes).then_some(())?;
        views(w, self.device, stream, len, (0..n).map(|i| i * bytes))
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Ranks in the clique.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The GPU ordinal it runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// A handle through which [`abort_all`] ends this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(
            std::iter::once(&self.shared).chain(self.gather.as_ref().map(|g| &g.shared)).cloned().collect(),
        )
    }

    /// An error an earlier operation left on the communicator (`ncclCommGetAsyncError`), or
    /// [`NcclError::Aborted`].
    pub fn check(&self) -> Result<(), NcclError> {
        let state = self.shared.lock();
        self.shared.lib.async_error(self.live(&state)?)
    }

    /// The handle of a live communicator, or [`NcclError::Aborted`] with the reason it is gone.
    fn live<'s>(&self, state: &'s State) -> Result<&'s raw::RawComm, NcclError> {
        match state {
            State::Live(raw) => Ok(raw),
            State::Gone(why) => Err(NcclError::Aborted { rank: self.rank(), why: why.clone() }),
        }
    }

    /// Says that a CUDA graph holding this communicator's collectives was just launched on `stream`
    /// (see the module docs): the next collective enqueued outside a capture waits on the host until
    /// this launch has run, as NCCL requires with graph mixing support off.
    pub fn graph_launched(&self, stream: &CudaStream) -> Result<(), NcclError> {
        let done = self.launched.get_or_try_init(|| {
            stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(self.cuda_error("making the graph-launch event"))
        })?;
        done.record(stream).map_err(self.cuda_error("recording a graph launch"))?;
        self.pending.set(true);
        Ok(())
    }

    /// An [`NcclError::Cuda`] of this rank for a failed CUDA call, `what` naming it.
    fn cuda_error<'a>(&'a self, what: &'a str) -> impl Fn(cudarc::driver::DriverError) -> NcclError + 'a {
        move |e| NcclError::Cuda(format!("rank {}: {what}: {e}", self.rank()))
    }

    /// Before a collective on `stream`: outside a capture, waits for the last graph launch that
    /// [`Comm::graph_launched`] recorded, if the communicator still lives (not holding its lock, so
    /// an abort can end the graph's collectives meanwhile).
    fn after_graphs(&self, stream: &CudaStream) -> Result<(), NcclError> {
        // Most collectives follow no graph launch: they make no driver call here.
        let Some(done) = self.launched.get().filter(|_| self.pending.get()) else { return Ok(()) };
        let status =
            stream.capture_status().map_err(self.cuda_error("cuStreamIsCapturing before a collective"))?;
        if status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(()); // a capture launches nothing: the next plain collective waits
        }
        self.pending.set(false);
        // A communicator taken by an abort fails the collective at once (its abort may not have
        // reached the graph's collectives, which the wait would then never see end).
        self.live(&self.shared.lock())?;
        done.synchronize().map_err(self.cuda_error("waiting for the last graph launch before a collective"))
    }

    /// Checks that `stream` and `buf` are on this communicator's GPU.
    fn same_device<T>(
        &self,
        what: &str,
        stream: &CudaStream,
        buf: &impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        let (s, b) = (stream.context().ordinal(), buf.stream().context().ordinal());
        if s != self.device || b != self.device {
            return Err(NcclError::Argument(format!(
                "{what}: rank {} runs on GPU {}, but the stream is on GPU {s} and the buffer on GPU {b}",
                self.rank(),
                self.device
            )));
        }
        Ok(())
    }

    /// Sums `buf` over the ranks, in place, on `stream` (every rank calls it with the same length,
    /// in the same order as its other collectives). `bf16`, `f16` or `f32`.
    pub fn all_reduce_sum<T: Element>(
        &self,
        stream: &CudaStream,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        injected("all_reduce_sum")?;
        let (dtype, _) = nccl_type::<T>()?;
        self.same_device("all_reduce_sum", stream, buf)?;
        self.after_graphs(stream)?;
        let count = buf.len();
        let state = self.shared.lock();
        let raw = self.live(&state)?;
        let (ptr, _written) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses the buffer's `count` elements on this GPU (checked above), and the
        // `_written` guard records the write on `stream` after the enqueue, so cudarc keeps the buffer
        // alive and ordered until the collective has run.
        unsafe { self.shared.lib.all_reduce_sum(raw, ptr, count, dtype, stream.cu_stream()) }
    }

    /// Gathers every rank's `buf.len() / ranks` elements in place on `stream`: rank r's own part is
    /// `buf[r·n..(r+1)·n]` before, and every rank's part is in order in `buf` after. The length must
    /// be a multiple of the rank count.
    pub fn all_gather_in_place<T: Element>(
        &self,
        stream: &CudaStream,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        self.gather_on(&self.shared, "all_gather_in_place", stream, buf)
    }

    /// [`Comm::all_gather_in_place`] on this rank's copy-engine communicator: with `buf` inside a
    /// [`Comm::gather_slots`] buffer, at the same offset on every rank, NCCL copies the parts with
    /// the copy engines and launches no kernel (see the module docs). An [`NcclError::Argument`]
    /// without one.
    pub fn gather_in_place<T: Element>(
        &self,
        stream: &CudaStream,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        let Some(gather) = &self.gather else {
            return Err(NcclError::Argument(format!("rank {}: no copy-engine communicator", self.rank())));
        };
        self.gather_on(&gather.shared, "gather_in_place", stream, buf)
    }

    /// An in-place all-gather on `shared`'s communicator (this one or its copy-engine one).
    fn gather_on<T: Element>(
        &self,
        shared: &Shared,
        what: &str,
        stream: &CudaStream,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        injected(what)?;
        let element = nccl_type::<T>()?;
        self.same_device(what, stream, buf)?;
        let len = buf.len();
        if !len.is_multiple_of(self.ranks) {
            return Err(NcclError::Argument(format!(
                "{what}: {len} elements do not split into {} equal parts",
                self.ranks
            )));
        }
        self.after_graphs(stream)?;
        let state = shared.lock();
        let raw = self.live(&state)?;
        let (ptr, _written) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses `ranks · (len / ranks)` elements on this GPU (checked above), this
        // rank is `rank()` of both communicators, and the guard keeps the buffer ordered as in
        // `all_reduce_sum`.
        unsafe {
            shared.lib.all_gather_in_place(
                raw,
                ptr,
                len / self.ranks,
                self.rank(),
                element,
                stream.cu_stream(),
            )
        }
    }
}

/// A [`Comm::window_pair`] buffer: a cudarc buffer over a communicator's symmetric window, which
/// dropping it does not free.
pub struct WindowBuf<T>(Option<cudarc::driver::CudaSlice<T>>);

impl<T> std::ops::Deref for WindowBuf<T> {
    type Target = cudarc::driver::CudaSlice<T>;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("taken only by drop")
    }
}

impl<T> std::ops::DerefMut for WindowBuf<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut().expect("taken only by drop")
    }
}

impl<T> Drop for WindowBuf<T> {
    /// Lets go of the view (its events, its stream) without freeing the memory, NCCL's.
    fn drop(&mut self) {
        if let Some(view) = self.0.take() {
            view.leak();
        }
    }
}

impl Drop for Comm {
    /// Destroys the copy-engine communicator, then this one (`release`: aborted instead when an
    /// operation left an error on it; a window is deregistered before and freed after).
    fn drop(&mut self) {
        drop(self.gather.take());
        release(&self.shared, self.window.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_what_to_do() {
        let e = NcclError::Multicast { value: "1".into() };
        assert!(e.to_string().starts_with("NCCL_NVLS_ENABLE=1: NVLink multicast stays off"), "{e}");
        let e = NcclError::Call {
            call: "ncclAllReduce".into(),
            code: 5,
            name: "invalid usage".into(),
            detail: String::new(),
        };
        assert_eq!(e.to_string(), "ncclAllReduce failed with invalid usage (5)");
        let e = NcclError::Call {
            call: "ncclAllReduce".into(),
            code: 5,
            name: "invalid usage".into(),
            detail: "peer gone".into(),
        };
        assert_eq!(e.to_string(), "ncclAllReduce failed with invalid usage (5): peer gone");
        assert_eq!(version_string(22809), "2.28.9");
        assert_eq!(version_string(MIN_VERSION), "2.13.0");
    }

    #[test]
    fn collectives_take_16_and_32_bit_floats_only() {
        assert_eq!(nccl_type::<cudnn_llm_ops::half::bf16>().unwrap(), (ncclDataType_t::ncclBfloat16, 2));
        assert_eq!(nccl_type::<f32>().unwrap(), (ncclDataType_t::ncclFloat32, 4));
    }

    #[test]
    fn configs_nccl_would_refuse_are_typed_errors_naming_the_attribute() {
        let d = NcclConfig::default();
        assert!(d.is_default() && d.validate().is_ok());
        assert_eq!(d.to_string(), "NCCL defaults");
        let ok = d.with_min_ctas(16).with_max_ctas(32).with_cga_cluster_size(0);
        assert!(ok.validate().is_ok() && !ok.is_default());
        assert_eq!(ok.to_string(), "minCTAs=16 maxCTAs=32 cgaClusterSize=0");
        assert!(d.with_max_ctas(64).validate().is_ok());
        assert!(d.with_min_ctas(4).with_max_ctas(4).validate().is_ok());
        let cases = [
            (d.with_max_ctas(0), "maxCTAs", "0 is not between 1 and 64"),
            (d.with_max_ctas(65), "maxCTAs", "65 is not between 1 and 64"),
            (d.with_min_ctas(0).with_max_ctas(4), "minCTAs", "0 is not between 1 and 64"),
            (d.with_min_ctas(8).with_max_ctas(4), "minCTAs", "8 is above maxCTAs 4"),
            (d.with_min_ctas(8), "minCTAs", "8 needs maxCTAs too"),
            (d.with_cga_cluster_size(9), "cgaClusterSize", "9 is above 8"),
        ];
        for (config, attribute, why) in cases {
            let e = config.validate().unwrap_err();
            let NcclError::Config { option, why: said } = &e else { panic!("{e:?}") };
            assert_eq!(option, attribute, "{config:?}");
            assert!(said.starts_with(why), "{config:?}: {said}");
            assert!(e.to_string().starts_with(&format!("NCCL {attribute}: ")), "{e}");
            // Refused before any device or library is touched.
            let e = Comm::init_all(&[0, 1], &config).unwrap_err();
            assert!(matches!(e, NcclError::Config { .. }), "{e:?}");
        }
    }

    #[test]
    fn windows_are_on_unless_the_variable_says_0() {
        assert!(windows_from_env(None).unwrap());
        assert!(windows_from_env(Some("1")).unwrap());
        assert!(!windows_from_env(Some("0")).unwrap());
        let e = windows_from_env(Some("off")).unwrap_err();
        assert_eq!(e.to_string(), format!("NCCL {WINDOWS_ENV}: `off` is not 0 or 1"));
    }

    #[test]
    fn protocols_and_algorithms_parse_by_nccls_names_only() {
        assert_eq!("LL".parse::<Protocol>().unwrap(), Protocol::Ll);
        assert_eq!("LL128".parse::<Protocol>().unwrap(), Protocol::Ll128);
        assert_eq!("Simple".parse::<Protocol>().unwrap(), Protocol::Simple);
        assert_eq!("Ring".parse::<Algorithm>().unwrap(), Algorithm::Ring);
        assert_eq!("Tree".parse::<Algorithm>().unwrap(), Algorithm::Tree);
        let e = "NVLS".parse::<Algorithm>().unwrap_err();
        assert_eq!(e.to_string(), "NCCL NCCL_ALGO: `NVLS` is not Ring or Tree");
        let e = "ll".parse::<Protocol>().unwrap_err();
        assert_eq!(e.to_string(), "NCCL NCCL_PROTO: `ll` is not LL, LL128 or Simple");
    }

    #[test]
    fn tuning_variables_are_set_only_before_the_first_communicator() {
        let unset = |_: &str| None;
        let both = tuning_env(false, unset, Some(Protocol::Ll128), Some(Algorithm::Ring)).unwrap();
        assert_eq!(both, [(PROTO_ENV, "LL128"), (ALGO_ENV, "Ring")]);
        assert_eq!(tuning_env(false, unset, None, Some(Algorithm::Tree)).unwrap(), [(ALGO_ENV, "Tree")]);
        assert!(tuning_env(false, unset, None, None).unwrap().is_empty());
        // Nothing to set is fine even after a communicator; something to set is not.
        assert!(tuning_env(true, unset, None, None).unwrap().is_empty());
        let e = tuning_env(true, unset, Some(Protocol::Simple), None).unwrap_err();
        assert!(
            matches!(&e, NcclError::Config { option, why } if option == PROTO_ENV && why.contains("has made a communicator")),
            "{e:?}"
        );
        // The environment's own value: the same is fine, another is refused.
        let set = |name: &str| (name == PROTO_ENV).then(|| "LL".to_string());
        assert_eq!(tuning_env(false, set, Some(Protocol::Ll), None).unwrap(), [(PROTO_ENV, "LL")]);
        let e = tuning_env(false, set, Some(Protocol::Simple), None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "NCCL NCCL_PROTO: is LL in the environment; refusing to replace it with Simple"
        );
    }

    #[test]
    fn multicast_stays_off_connections_are_made_at_init_and_graph_mixing_is_off_unless_set() {
        let unset = |_: &str| None;
        assert_eq!(fixed_env_to_set(unset).unwrap(), [MULTICAST_ENV, RUNTIME_CONNECT_ENV, GRAPH_MIXING_ENV]);
        // Graph mixing support keeps what the environment says.
        let mixing = |name: &str| Some(if name == GRAPH_MIXING_ENV { "1" } else { "0" }.to_string());
        assert!(fixed_env_to_set(mixing).unwrap().is_empty());
        let zeros = |_: &str| Some("0".to_string());
        assert!(fixed_env_to_set(zeros).unwrap().is_empty());
        let one = |set: &'static str| move |name: &str| Some(if name == set { "1" } else { "0" }.to_string());
        let e = fixed_env_to_set(one(MULTICAST_ENV)).unwrap_err();
        assert_eq!(e, NcclError::Multicast { value: "1".into() });
        let e = fixed_env_to_set(one(RUNTIME_CONNECT_ENV)).unwrap_err();
        assert_eq!(e, NcclError::LazyConnect { value: "1".into() });
        assert!(
            e.to_string().starts_with("NCCL_RUNTIME_CONNECT=1: connections are made at init here"),
            "{e}"
        );
    }

    #[test]
    fn init_all_refuses_bad_device_lists_before_opening_nccl() {
        let d = NcclConfig::default();
        let e = Comm::init_all(&[], &d).unwrap_err();
        assert!(matches!(e, NcclError::Argument(ref m) if m.contains("no devices")), "{e}");
        let e = Comm::init_all(&[0, 1, 0], &d).unwrap_err();
        assert!(matches!(e, NcclError::Argument(ref m) if m.contains("[0, 1, 0] name a GPU twice")), "{e}");
    }
}
