//! NCCL for tensor parallelism: the library opened at run time, the communicators of one process (one
//! per GPU, created together by `ncclCommInitAll`) and the two collectives the decoder needs, a sum
//! all-reduce in place and an in-place all-gather, enqueued on a rank's cudarc stream (so a forward
//! that calls them captures as a CUDA graph, NCCL's collectives included).
//!
//! 1. `let comms = Comm::init_all(&[0, 1])?;` opens NCCL (an error, not a panic, when it is missing or
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

mod raw;

use cudarc::driver::{CudaStream, DevicePtrMut};
use cudarc::nccl::sys::ncclDataType_t;
use cudnn_llm_ops::{DataType, Element};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The variable naming the NCCL library to open (and only it), e.g.
/// `.../site-packages/nvidia/nccl/lib/libnccl.so.2`.
pub const LIBRARY_ENV: &str = "NCCL_LIBRARY";

/// The oldest NCCL this module runs on (2.13.0, encoded as `ncclGetVersion` reports it): the first
/// with `ncclGetLastError`; bf16 reductions came in 2.10, collectives in CUDA graphs in 2.9.
pub const MIN_VERSION: u32 = 2_13_00;

/// NCCL's switch for NVLink SHARP multicast, which stays `0` (see the module docs).
pub const MULTICAST_ENV: &str = "NCCL_NVLS_ENABLE";

/// A place the loader tried, and why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// A path or a bare soname handed to the system loader.
    pub name: String,
    /// The loader's error text.
    pub error: String,
}

/// Why NCCL could not be used, or a collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// No candidate could be opened.
    #[error(
        "NCCL not found; tried {}. Install NCCL 2 (e.g. `pip install nvidia-nccl-cu13`) and put its lib \
         directory (site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH, or set \
         {LIBRARY_ENV}=/path/to/libnccl.so.2",
        list(.tried)
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
}

fn list(tried: &[Candidate]) -> String {
    tried.iter().map(|c| format!("`{}` ({})", c.name, c.error)).collect::<Vec<_>>().join(", ")
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

/// Keeps NVLink multicast off before NCCL reads its environment (see the module docs).
fn multicast_off() -> Result<(), NcclError> {
    match std::env::var_os(MULTICAST_ENV) {
        Some(v) if v == "0" => Ok(()),
        Some(v) => Err(NcclError::Multicast { value: v.to_string_lossy().into_owned() }),
        None => {
            std::env::set_var(MULTICAST_ENV, "0");
            Ok(())
        }
    }
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
}

impl Shared {
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

/// One rank's NCCL communicator, on one GPU. `Send`, not `Sync`: the thread driving the GPU owns
/// it; other threads reach it only through an [`AbortHandle`]. Dropping it destroys the
/// communicator, or aborts it when an operation left an error on it (the last of a process's
/// communicators to go waits for the graphs that captured their collectives).
pub struct Comm {
    shared: Arc<Shared>,
    ranks: usize,
    device: usize,
    /// Not `Sync` (one thread enqueues on a communicator).
    _not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
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

/// A [`Comm`] as another thread sees it: only [`abort_all`] takes it.
#[derive(Clone)]
pub struct AbortHandle(Arc<Shared>);

/// Ends the communicators of `handles` that still live: their owners' later calls fail with
/// [`NcclError::Aborted`] (`why`) at once, and a helper thread calls `ncclCommAbort` on each, which
/// makes their ranks' pending collectives return (their kernels exit). Returns without waiting: the
/// last abort waits for the graphs that captured their collectives to be destroyed (see the module
/// docs). A thread that cannot start leaves the communicators unaborted (but taken).
pub fn abort_all(handles: &[AbortHandle], why: &str) {
    let taken: Vec<(&'static raw::Lib, raw::RawComm)> =
        handles.iter().filter_map(|h| h.0.take(why).map(|raw| (h.0.lib, raw))).collect();
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
        f.debug_struct("AbortHandle").field("rank", &self.0.rank).finish()
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

impl Comm {
    /// One communicator per device of `devices`, rank i on GPU `devices[i]`, created together
    /// (`ncclCommInitAll`, from this one thread). Keeps NVLink multicast off first
    /// ([`NcclError::Multicast`] if the environment asks for it), then opens NCCL. Devices must be
    /// distinct and present; NCCL reports otherwise.
    pub fn init_all(devices: &[usize]) -> Result<Vec<Comm>, NcclError> {
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
        multicast_off()?;
        let lib = raw::load()?;
        let raws = lib.init_all(&ordinals)?;
        let ranks = devices.len();
        Ok(raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (raw, &device))| Comm {
                shared: Arc::new(Shared { lib, rank, state: Mutex::new(State::Live(raw)) }),
                ranks,
                device,
                _not_sync: std::marker::PhantomData,
            })
            .collect())
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
        AbortHandle(self.shared.clone())
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
        let (dtype, _) = nccl_type::<T>()?;
        self.same_device("all_reduce_sum", stream, buf)?;
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
        let element = nccl_type::<T>()?;
        self.same_device("all_gather_in_place", stream, buf)?;
        let len = buf.len();
        if !len.is_multiple_of(self.ranks) {
            return Err(NcclError::Argument(format!(
                "all_gather_in_place: {len} elements do not split into {} equal parts",
                self.ranks
            )));
        }
        let state = self.shared.lock();
        let raw = self.live(&state)?;
        let (ptr, _written) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses `ranks · (len / ranks)` elements on this GPU (checked above), this
        // rank is `rank()`, and the guard keeps the buffer ordered as in `all_reduce_sum`.
        unsafe {
            self.shared.lib.all_gather_in_place(
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

impl Drop for Comm {
    /// Destroys the communicator (aborts it when an operation left an error on it), outside the
    /// lock, so that [`abort_all`] never waits on it.
    fn drop(&mut self) {
        if let Some(raw) = self.shared.take("dropped") {
            let lib = self.shared.lib;
            let _ = if lib.async_error(&raw).is_ok() { lib.destroy(raw) } else { lib.abort(raw) };
        }
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
    fn init_all_refuses_bad_device_lists_before_opening_nccl() {
        let e = Comm::init_all(&[]).unwrap_err();
        assert!(matches!(e, NcclError::Argument(ref m) if m.contains("no devices")), "{e}");
        let e = Comm::init_all(&[0, 1, 0]).unwrap_err();
        assert!(matches!(e, NcclError::Argument(ref m) if m.contains("[0, 1, 0] name a GPU twice")), "{e}");
    }
}
