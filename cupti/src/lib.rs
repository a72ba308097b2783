//! Kernel timelines from CUPTI's activity API, with `libcupti` loaded at run time.
//!
//! For every GPU kernel the process launches (its own, cuDNN's and cuBLAS's alike) a collection yields
//! the kernel's name, its GPU start and end, and the host time of the API call that launched it
//! (`cuLaunchKernel*` / `cudaLaunchKernel*` / graph launches: the driver or runtime API record with the
//! kernel's correlation id), all on CUPTI's clock. [`timestamp`] reads that clock, so host ranges can be
//! stamped on it and kernels attributed to the range open at their launch.
//!
//! ```no_run
//! let cupti = cudnn_llm_cupti::Cupti::load()?; // an error (not a panic) where there is no libcupti
//! cupti.start()?;
//! let t0 = cudnn_llm_cupti::timestamp(&cupti)?;
//! // ... launch work, then synchronise the device ...
//! let t1 = cudnn_llm_cupti::timestamp(&cupti)?;
//! let collected = cupti.stop_and_collect()?;
//! for k in collected.kernels.iter().filter(|k| (t0..t1).contains(&k.launch_ns)) {
//!     println!("{} {} ns", k.name, k.end_ns - k.start_ns);
//! }
//! # Ok::<(), cudnn_llm_cupti::Error>(())
//! ```
//!
//! * [`bindings`] is bindgen's output for the CUPTI 13.0 headers (see `HEADER_VERSION`), restricted to
//!   what this crate uses, committed and regenerated with `cupti/regen.sh` (`--check` diffs). Its layout
//!   assertions (compile-time) check every bound struct's size, alignment and field offsets.
//! * CUPTI's activity state is process-wide, so collections are too: one at a time, whichever
//!   [`Cupti`] handle started it. The library, once opened, is never unloaded (CUPTI hooks itself into
//!   the driver and keeps threads and callbacks that point into it).
#![deny(unsafe_op_in_unsafe_fn)]

#[rustfmt::skip]
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code, unsafe_op_in_unsafe_fn, clippy::all)]
pub mod bindings;
mod records;

use bindings::{CUcontext, CUptiResult, CUpti_Activity, CUpti_ActivityFlag, CUpti_ActivityKind, CuptiLib};
use std::alloc::Layout;
use std::ffi::{c_char, CStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The environment variable naming the libcupti to open (and only it).
pub const LIBRARY_ENV: &str = "CUPTI_LIBRARY";

/// Size of each activity buffer handed to CUPTI.
pub const BUFFER_SIZE: usize = 8 << 20;
/// Alignment of the buffers (CUPTI's `ACTIVITY_RECORD_ALIGNMENT` is 8).
const BUFFER_ALIGN: usize = 8;

/// Activity kinds enabled by [`Cupti::start`]: kernels, and the API calls that launch them.
pub const KINDS: [CUpti_ActivityKind; 3] = [
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME,
    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER,
];

/// One kernel execution: when its launch was called on the host, and when it ran on the GPU, all in
/// nanoseconds on CUPTI's clock ([`timestamp`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRecord {
    /// Kernel (function) name as CUPTI reports it (mangled, not demangled).
    pub name: String,
    /// Host time the launching API call was entered; 0 if no API record matched (see
    /// [`Collected::unmatched`]).
    pub launch_ns: u64,
    /// GPU start; 0 if CUPTI could not time the kernel (see [`Collected::untimed`]).
    pub start_ns: u64,
    /// GPU end; 0 if CUPTI could not time the kernel.
    pub end_ns: u64,
    /// The GPU it ran on: CUPTI's `deviceId`, the CUDA device ordinal of this process (as
    /// `cuDeviceGet` numbers the visible devices), so kernels of several GPUs can be told apart.
    pub device: u32,
}

/// What a collection produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    /// Every kernel recorded between [`Cupti::start`] and [`Cupti::stop_and_collect`], sorted by GPU start.
    pub kernels: Vec<KernelRecord>,
    /// Records CUPTI dropped for lack of buffer space (`cuptiActivityGetNumDroppedRecords`).
    pub dropped: usize,
    /// Kernels with no driver or runtime API record of the same correlation id (`launch_ns` is 0).
    pub unmatched: usize,
    /// Kernels whose GPU start or end is 0 (CUPTI could not time them, e.g. still running at the flush).
    pub untimed: usize,
    /// Driver and runtime API records seen (all calls, not only launches).
    pub api_records: usize,
    /// Records that could not be read: shorter than their kind needs, or a buffer whose record walk
    /// ended in an error (counted once per buffer).
    pub unreadable: usize,
}

pub use cudnn_llm_dylib::Candidate;

/// Why CUPTI could not be used. Every variant says what was tried or which call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No candidate could be opened.
    #[error(
        "CUPTI not found; tried {}. Install CUPTI for CUDA 13 (the CUDA toolkit's extras/CUPTI/lib64, or \
         `pip install nvidia-cuda-cupti` for nvidia/cu13/lib) and put it on LD_LIBRARY_PATH, or set \
         {LIBRARY_ENV}=/path/to/libcupti.so.13",
        cudnn_llm_dylib::tried(.tried)
    )]
    NotFound {
        /// Every candidate with its error.
        tried: Vec<Candidate>,
    },
    /// The library opened but lacks a function this crate calls.
    #[error("{library} has no symbol `{symbol}` (is it libcupti?)")]
    MissingSymbol {
        /// The library that was opened.
        library: String,
        /// The first missing symbol.
        symbol: String,
    },
    /// A CUPTI call returned an error.
    #[error("{function} failed with {name} ({code}) in {library}")]
    Call {
        /// The CUPTI function.
        function: &'static str,
        /// The raw `CUptiResult`.
        code: u32,
        /// `cuptiGetResultString` of the code.
        name: String,
        /// The library that was called.
        library: String,
    },
    /// [`Cupti::start`] while a collection is running (or starting or stopping).
    #[error("a CUPTI collection is already running in this process")]
    AlreadyStarted,
    /// [`Cupti::stop_and_collect`] without a running collection.
    #[error("no CUPTI collection is running")]
    NotStarted,
    /// The activity callbacks were registered through another libcupti than this handle's.
    #[error(
        "CUPTI activity callbacks were registered through another libcupti than {library}; use one library \
         per process"
    )]
    OtherLibrary {
        /// This handle's library.
        library: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

cudnn_llm_dylib::required_symbols!(CuptiLib:
    cuptiGetVersion,
    cuptiGetResultString,
    cuptiGetTimestamp,
    cuptiActivityEnable,
    cuptiActivityDisable,
    cuptiActivityRegisterCallbacks,
    cuptiActivityFlushAll,
    cuptiActivityGetNextRecord,
    cuptiActivityGetNumDroppedRecords,
);

/// Where [`Cupti::load`] looks, in order: `$CUPTI_LIBRARY` alone if set and non-empty; otherwise
/// `libcupti.so.13` and `libcupti.so` through the system loader (LD_LIBRARY_PATH, ld.so.cache), then
/// `extras/CUPTI/lib64/libcupti.so.13` under `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda` and every
/// `/usr/local/cuda-13*` (newest first), where a CUDA toolkit installs it off the loader's path.
pub fn default_candidates() -> Vec<PathBuf> {
    let local: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    candidates_from(
        std::env::var_os(LIBRARY_ENV),
        [std::env::var_os("CUDA_HOME"), std::env::var_os("CUDA_PATH")],
        &local,
    )
}

/// [`default_candidates`] from given environment values and `/usr/local` entries.
fn candidates_from(
    library: Option<OsString>,
    cuda_roots: [Option<OsString>; 2],
    usr_local: &[PathBuf],
) -> Vec<PathBuf> {
    if library.as_ref().is_some_and(|p| !p.is_empty()) {
        return cudnn_llm_dylib::candidates(library, []);
    }
    let mut out = vec![PathBuf::from("libcupti.so.13"), PathBuf::from("libcupti.so")];
    let mut roots: Vec<PathBuf> =
        cuda_roots.into_iter().flatten().filter(|r| !r.is_empty()).map(PathBuf::from).collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut versioned: Vec<&PathBuf> = usr_local
        .iter()
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("cuda-13")))
        .collect();
    versioned.sort_by(|a, b| b.cmp(a));
    roots.extend(versioned.into_iter().cloned());
    for root in roots {
        let lib = root.join("extras/CUPTI/lib64/libcupti.so.13");
        if !out.contains(&lib) {
            out.push(lib);
        }
    }
    out
}

/// Libraries opened so far, never closed (see the crate docs), by the candidate that opened them.
static OPENED: Mutex<Vec<(PathBuf, &'static CuptiLib)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data inconsistent in a way that matters
    // more than losing the whole profile, so a poisoned lock is used as is.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An opened, checked libcupti. Cheap to clone; the library stays loaded for the life of the process.
#[derive(Clone)]
pub struct Cupti {
    lib: &'static CuptiLib,
    library: String,
    version: u32,
}

impl std::fmt::Debug for Cupti {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cupti").field("library", &self.library).field("version", &self.version).finish()
    }
}

impl Cupti {
    /// Opens the first of [`default_candidates`] that loads and has every [`REQUIRED_SYMBOLS`].
    pub fn load() -> Result<Self> {
        Self::load_from(&default_candidates())
    }

    /// Opens the first candidate that loads (a path, or a soname for the system loader) and checks it.
    pub fn load_from(candidates: &[PathBuf]) -> Result<Self> {
        match cudnn_llm_dylib::open_first(candidates, open) {
            Ok((lib, name)) => Self::check(lib, name),
            Err(tried) => Err(Error::NotFound { tried }),
        }
    }

    fn check(lib: &'static CuptiLib, library: String) -> Result<Self> {
        if let Some(symbol) = first_missing(lib) {
            return Err(Error::MissingSymbol { library, symbol: symbol.to_string() });
        }
        let mut this = Self { lib, library, version: 0 };
        let mut version = 0u32;
        // SAFETY: the symbol was checked above; it writes one u32 through a valid pointer.
        let r = unsafe { lib.cuptiGetVersion(&mut version) };
        this.ok("cuptiGetVersion", r)?;
        this.version = version;
        Ok(this)
    }

    /// The candidate that opened.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// `cuptiGetVersion()`: the CUPTI API version, `130001` for CUDA 13.0 Update 1 (`xxyyzz` from 13.0
    /// on; small integers, e.g. 28, before).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `cuptiGetTimestamp()`: now, in ns on the clock of the kernel and API records.
    pub fn timestamp(&self) -> Result<u64> {
        let mut t = 0u64;
        // SAFETY: the symbol was checked at load; it writes one u64 through a valid pointer.
        let r = unsafe { self.lib.cuptiGetTimestamp(&mut t) };
        self.ok("cuptiGetTimestamp", r)?;
        Ok(t)
    }

    /// Starts a collection: registers the buffer callbacks (once per process), resets CUPTI's dropped
    /// count and enables [`KINDS`]. Kernels launched from now on are recorded. Fails with
    /// [`Error::AlreadyStarted`] while another collection runs; on any failure nothing stays enabled.
    pub fn start(&self) -> Result<()> {
        let hooks = Hooks::of(self.lib);
        {
            let mut s = lock(&STATE);
            if s.phase != Phase::Idle {
                return Err(Error::AlreadyStarted);
            }
            if s.hooks.is_some_and(|h| !h.same_library(&hooks)) {
                return Err(Error::OtherLibrary { library: self.library.clone() });
            }
            s.clear();
            s.phase = Phase::Starting;
        }
        let result = self.start_inner(hooks);
        let mut s = lock(&STATE);
        s.phase = if result.is_ok() { Phase::Collecting } else { Phase::Idle };
        result
    }

    fn start_inner(&self, hooks: Hooks) -> Result<()> {
        let registered = {
            let mut s = lock(&STATE);
            let registered = s.hooks.is_some();
            // Set before registering, so that a callback arriving at once finds them.
            s.hooks = Some(hooks);
            registered
        };
        if !registered {
            // SAFETY: the symbol was checked at load; both callbacks are `extern "C"` functions with
            // exactly the signatures CUPTI declares (the bindgen types), valid for the whole process.
            let r = unsafe {
                self.lib.cuptiActivityRegisterCallbacks(Some(buffer_requested), Some(buffer_completed))
            };
            if let Err(e) = self.ok("cuptiActivityRegisterCallbacks", r) {
                lock(&STATE).hooks = None;
                return Err(e);
            }
        }
        let mut dropped = 0usize;
        // SAFETY: the symbol was checked at load; a null context asks for the global queue's count, which
        // is written through a valid pointer. Reading it resets it; the value (records dropped before
        // this collection) is discarded on purpose, and so is an error (nothing to reset).
        let _ = unsafe { self.lib.cuptiActivityGetNumDroppedRecords(std::ptr::null_mut(), 0, &mut dropped) };
        for (i, kind) in KINDS.iter().enumerate() {
            // SAFETY: the symbol was checked at load; the kind is a value from CUPTI's enum.
            let r = unsafe { self.lib.cuptiActivityEnable(*kind) };
            if let Err(e) = self.ok("cuptiActivityEnable", r) {
                for k in &KINDS[..i] {
                    // SAFETY: as above; undoes an enable that succeeded.
                    let _ = unsafe { self.lib.cuptiActivityDisable(*k) };
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Ends the collection and returns its kernels: forces a flush of every buffer
    /// (`cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED)`), disables [`KINDS`], flushes again
    /// (records of the calls in between) and matches every kernel to the API call with its correlation
    /// id. Synchronise the device first: a kernel still running at the flush is [`Collected::untimed`].
    /// On an error the collection still ends (a later [`Cupti::start`] may begin a new one).
    pub fn stop_and_collect(&self) -> Result<Collected> {
        {
            let mut s = lock(&STATE);
            if s.phase != Phase::Collecting {
                return Err(Error::NotStarted);
            }
            if s.hooks.is_some_and(|h| !h.same_library(&Hooks::of(self.lib))) {
                return Err(Error::OtherLibrary { library: self.library.clone() });
            }
            s.phase = Phase::Stopping;
        }
        let mut first_error: Option<Error> = None;
        let mut note = |e: Result<()>| {
            if let Err(e) = e {
                first_error.get_or_insert(e);
            }
        };
        let forced = CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED.0;
        // SAFETY: the symbol was checked at load and the callbacks are registered (start succeeded). No
        // lock of this crate is held: the flush calls `buffer_completed`, which takes them.
        note(self.ok("cuptiActivityFlushAll", unsafe { self.lib.cuptiActivityFlushAll(forced) }));
        for kind in KINDS {
            // SAFETY: the symbol was checked at load; the kind is a value from CUPTI's enum.
            note(self.ok("cuptiActivityDisable", unsafe { self.lib.cuptiActivityDisable(kind) }));
        }
        // SAFETY: as for the first flush.
        note(self.ok("cuptiActivityFlushAll", unsafe { self.lib.cuptiActivityFlushAll(forced) }));
        let mut dropped = 0usize;
        // SAFETY: the symbol was checked at load; null context = the global queue; valid out pointer.
        let r = unsafe { self.lib.cuptiActivityGetNumDroppedRecords(std::ptr::null_mut(), 0, &mut dropped) };
        note(self.ok("cuptiActivityGetNumDroppedRecords", r));
        let mut s = lock(&STATE);
        s.dropped += dropped;
        let collected = s.take();
        s.phase = Phase::Idle;
        drop(s);
        match first_error {
            Some(e) => Err(e),
            None => Ok(collected),
        }
    }

    fn ok(&self, function: &'static str, r: CUptiResult) -> Result<()> {
        if r == CUptiResult::CUPTI_SUCCESS {
            return Ok(());
        }
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: the symbol was checked at load; it writes a pointer to a static string (or leaves it).
        let status = unsafe { self.lib.cuptiGetResultString(r, &mut s) };
        let name = if status == CUptiResult::CUPTI_SUCCESS && !s.is_null() {
            // SAFETY: on success the pointer is to a NUL-terminated static string inside libcupti.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        } else {
            "unknown CUptiResult".to_string()
        };
        Err(Error::Call { function, code: r.0, name, library: self.library.clone() })
    }
}

/// `cuptiGetTimestamp()` through `cupti`: now, in ns on the clock of [`KernelRecord`]'s fields.
pub fn timestamp(cupti: &Cupti) -> Result<u64> {
    cupti.timestamp()
}

/// Opens `path` once per process and keeps it loaded for good.
fn open(path: &Path) -> Result<&'static CuptiLib, String> {
    let mut opened = lock(&OPENED);
    if let Some((_, lib)) = opened.iter().find(|(p, _)| p == path) {
        return Ok(lib);
    }
    // SAFETY: opening a shared library runs its initialisers; libcupti's only set up its own state
    // (it attaches to the driver later, when activity is enabled).
    let lib = unsafe { CuptiLib::new(path) }.map_err(|e| e.to_string())?;
    let lib: &'static CuptiLib = Box::leak(Box::new(lib));
    opened.push((path.to_path_buf(), lib));
    Ok(lib)
}

// ---------------------------------------------------------------------------------------------------
// The process-wide collection and CUPTI's buffer callbacks.

type NextRecordFn = unsafe extern "C" fn(*mut u8, usize, *mut *mut CUpti_Activity) -> CUptiResult;
type DroppedFn = unsafe extern "C" fn(CUcontext, u32, *mut usize) -> CUptiResult;

/// The CUPTI functions the completion callback calls (it gets no library handle).
#[derive(Clone, Copy)]
struct Hooks {
    next_record: NextRecordFn,
    dropped: DroppedFn,
}

impl Hooks {
    fn of(lib: &CuptiLib) -> Self {
        // Both symbols are in REQUIRED_SYMBOLS, checked before any `Cupti` exists; the fallbacks are
        // unreachable but keep this free of panics.
        Self {
            next_record: lib
                .cuptiActivityGetNextRecord
                .as_ref()
                .map_or(no_next_record as NextRecordFn, |f| *f),
            dropped: lib.cuptiActivityGetNumDroppedRecords.as_ref().map_or(no_dropped as DroppedFn, |f| *f),
        }
    }

    fn same_library(&self, other: &Hooks) -> bool {
        self.next_record as usize == other.next_record as usize
    }
}

unsafe extern "C" fn no_next_record(_: *mut u8, _: usize, _: *mut *mut CUpti_Activity) -> CUptiResult {
    CUptiResult::CUPTI_ERROR_NOT_INITIALIZED
}

unsafe extern "C" fn no_dropped(_: CUcontext, _: u32, _: *mut usize) -> CUptiResult {
    CUptiResult::CUPTI_ERROR_NOT_INITIALIZED
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Starting,
    Collecting,
    Stopping,
}

struct State {
    phase: Phase,
    /// Set when the callbacks are registered with CUPTI; never unset after a successful registration.
    hooks: Option<Hooks>,
    kernels: Vec<records::RawKernel>,
    api: Vec<records::ApiCall>,
    dropped: usize,
    unreadable: usize,
}

impl State {
    /// Records are kept while collecting and while the stop flushes.
    fn accepting(&self) -> bool {
        matches!(self.phase, Phase::Collecting | Phase::Stopping)
    }

    fn clear(&mut self) {
        self.kernels = Vec::new();
        self.api = Vec::new();
        self.dropped = 0;
        self.unreadable = 0;
    }

    fn take(&mut self) -> Collected {
        let api = std::mem::take(&mut self.api);
        let (kernels, unmatched) = records::match_launches(std::mem::take(&mut self.kernels), &api);
        let untimed = kernels.iter().filter(|k| k.start_ns == 0 || k.end_ns == 0).count();
        let collected = Collected {
            kernels,
            dropped: self.dropped,
            unmatched,
            untimed,
            api_records: api.len(),
            unreadable: self.unreadable,
        };
        self.clear();
        collected
    }
}

static STATE: Mutex<State> = Mutex::new(State {
    phase: Phase::Idle,
    hooks: None,
    kernels: Vec::new(),
    api: Vec::new(),
    dropped: 0,
    unreadable: 0,
});

fn buffer_layout() -> Option<Layout> {
    Layout::from_size_align(BUFFER_SIZE, BUFFER_ALIGN).ok()
}

/// CUPTI asks for an empty buffer: an 8 MB, 8-byte-aligned allocation, or none (CUPTI then drops
/// records and counts them) if allocation fails.
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_num_records: *mut usize) {
    let allocated = match buffer_layout() {
        // SAFETY: the layout has a non-zero size.
        Some(layout) => unsafe { std::alloc::alloc(layout) },
        None => std::ptr::null_mut(),
    };
    // SAFETY: CUPTI passes valid, writable pointers for the three outputs (checked for null anyway).
    unsafe {
        if !buffer.is_null() {
            *buffer = allocated;
        } else if !allocated.is_null() {
            // Nowhere to hand it: give it back.
            if let Some(layout) = buffer_layout() {
                std::alloc::dealloc(allocated, layout);
            }
        }
        if !size.is_null() {
            *size = if allocated.is_null() { 0 } else { BUFFER_SIZE };
        }
        if !max_num_records.is_null() {
            *max_num_records = 0; // fill the buffer
        }
    }
}

/// CUPTI returns a buffer of records: read them into [`STATE`], then free the buffer.
unsafe extern "C" fn buffer_completed(
    _: CUcontext,
    _: u32,
    buffer: *mut u8,
    _size: usize,
    valid_size: usize,
) {
    if buffer.is_null() {
        return;
    }
    // A panic must not unwind into CUPTI (it would abort the process); nothing below is expected to
    // panic, and if something did, the buffer's records are lost and the buffer is still freed.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: CUPTI hands over `buffer`, allocated by `buffer_requested` with BUFFER_SIZE bytes, of
        // which the first `valid_size` hold records; it is not used by CUPTI any more.
        unsafe { consume_buffer(buffer, valid_size.min(BUFFER_SIZE)) }
    });
    if let Some(layout) = buffer_layout() {
        // SAFETY: `buffer` came from `buffer_requested` (std::alloc::alloc with this same layout), and
        // CUPTI relinquished it with this callback; it is freed exactly once, here.
        unsafe { std::alloc::dealloc(buffer, layout) };
    }
}

/// Walks and parses one completed buffer into [`STATE`] if a collection is accepting records.
///
/// # Safety
/// `buffer` must be valid for reads of `valid` bytes holding CUPTI activity records, and stay so for
/// the call.
unsafe fn consume_buffer(buffer: *mut u8, valid: usize) {
    let hooks = {
        let s = lock(&STATE);
        if !s.accepting() {
            return; // late records of an earlier collection, or none running
        }
        s.hooks
    };
    let Some(hooks) = hooks else { return };
    let mut offsets = Vec::new();
    let mut walk_failed = false;
    let mut record: *mut CUpti_Activity = std::ptr::null_mut();
    loop {
        // SAFETY: `buffer` holds `valid` bytes of records (the caller's contract); `record` is null or
        // the previous record CUPTI returned, as the function requires.
        let r = unsafe { (hooks.next_record)(buffer, valid, &mut record) };
        if r == CUptiResult::CUPTI_ERROR_MAX_LIMIT_REACHED {
            break;
        }
        let off = (record as usize).wrapping_sub(buffer as usize);
        if r != CUptiResult::CUPTI_SUCCESS || record.is_null() || off >= valid {
            walk_failed = true;
            break;
        }
        offsets.push(off);
    }
    // SAFETY: the caller guarantees `valid` readable bytes at `buffer`; nothing writes them meanwhile.
    let bytes = unsafe { std::slice::from_raw_parts(buffer, valid) };
    // SAFETY: the offsets are of records CUPTI wrote; a kernel record's name is null or points to a
    // string CUPTI keeps for the life of the process.
    let parsed = unsafe { records::parse_records(bytes, offsets) };
    let mut dropped = 0usize;
    // SAFETY: a CUPTI function called from its own callback, as CUPTI's samples do; null context = the
    // global queue; valid out pointer. The count is reset by the read, so counts add up.
    let r = unsafe { (hooks.dropped)(std::ptr::null_mut(), 0, &mut dropped) };
    let mut s = lock(&STATE);
    if s.accepting() {
        s.kernels.extend(parsed.kernels);
        s.api.extend(parsed.api);
        s.unreadable += parsed.unreadable + usize::from(walk_failed);
        if r == CUptiResult::CUPTI_SUCCESS {
            s.dropped += dropped;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::tests::BufferBuilder;
    use std::ffi::CString;

    #[test]
    fn candidates_follow_the_environment() {
        let only = candidates_from(Some("/opt/x/libcupti.so.13".into()), [None, None], &[]);
        assert_eq!(only, [PathBuf::from("/opt/x/libcupti.so.13")]);
        let local = [
            PathBuf::from("/usr/local/cuda-13.0"),
            PathBuf::from("/usr/local/cuda-13.1"),
            PathBuf::from("/usr/local/cuda-12.8"),
            PathBuf::from("/usr/local/bin"),
        ];
        let all = candidates_from(Some("".into()), [Some("/opt/cuda".into()), None], &local);
        let names: Vec<String> = all.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            names,
            [
                "libcupti.so.13",
                "libcupti.so",
                "/opt/cuda/extras/CUPTI/lib64/libcupti.so.13",
                "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13",
                "/usr/local/cuda-13.1/extras/CUPTI/lib64/libcupti.so.13",
                "/usr/local/cuda-13.0/extras/CUPTI/lib64/libcupti.so.13",
            ]
        );
    }

    #[test]
    fn missing_libraries_are_listed() {
        let err = Cupti::load_from(&[
            PathBuf::from("/nonexistent/libcupti.so.13"),
            PathBuf::from("libcupti_nope.so"),
        ])
        .unwrap_err();
        let Error::NotFound { tried } = &err else { panic!("{err:?}") };
        assert_eq!(tried.len(), 2);
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/libcupti.so.13") && msg.contains("libcupti_nope.so"), "{msg}");
        assert!(msg.contains(LIBRARY_ENV), "{msg}");
    }

    #[test]
    fn a_library_without_cupti_symbols_is_refused() {
        let err = Cupti::load_from(&[PathBuf::from("libc.so.6")]).unwrap_err();
        assert_eq!(
            err,
            Error::MissingSymbol { library: "libc.so.6".into(), symbol: "cuptiGetVersion".into() }
        );
    }

    /// A stand-in for cuptiActivityGetNextRecord over buffers made by `BufferBuilder`: steps by the
    /// size of each record's kind, as CUPTI does with the sizes it knows.
    unsafe extern "C" fn fake_next_record(
        buffer: *mut u8,
        valid: usize,
        record: *mut *mut CUpti_Activity,
    ) -> CUptiResult {
        use crate::bindings::{CUpti_ActivityAPI, CUpti_ActivityKernel10};
        // SAFETY: test-only; the test passes its own buffer and a valid `record` pointer.
        unsafe {
            let next = if (*record).is_null() {
                0
            } else {
                let cur = (*record).cast::<u8>().offset_from(buffer) as usize;
                let kind = (*record).cast::<u32>().read();
                cur + match CUpti_ActivityKind(kind) {
                    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => {
                        size_of::<CUpti_ActivityKernel10>()
                    }
                    CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER
                    | CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME => size_of::<CUpti_ActivityAPI>(),
                    _ => 48,
                }
            };
            if next >= valid {
                return CUptiResult::CUPTI_ERROR_MAX_LIMIT_REACHED;
            }
            *record = buffer.add(next).cast();
            CUptiResult::CUPTI_SUCCESS
        }
    }

    unsafe extern "C" fn fake_dropped(_: CUcontext, _: u32, dropped: *mut usize) -> CUptiResult {
        // SAFETY: test-only; called with a valid pointer.
        unsafe { *dropped = 3 };
        CUptiResult::CUPTI_SUCCESS
    }

    /// The callbacks end to end, without CUPTI: a buffer from `buffer_requested`, filled with records,
    /// handed to `buffer_completed`, collected by the same code `stop_and_collect` uses.
    #[test]
    fn callbacks_fill_the_store() {
        let name = CString::new("void gemm<128>(float*)").unwrap();
        let mut b = BufferBuilder::new();
        b.api(CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME, 10, 20, 1)
            .kernel(Some(&name), 30, 40, 1)
            .other()
            .kernel(None, 50, 0, 2);
        let records = b.bytes().to_vec();

        let mut buffer: *mut u8 = std::ptr::null_mut();
        let (mut size, mut max) = (0usize, 1usize);
        // SAFETY: valid out pointers, as CUPTI passes.
        unsafe { buffer_requested(&mut buffer, &mut size, &mut max) };
        assert!(!buffer.is_null());
        assert_eq!((size, max, buffer as usize % BUFFER_ALIGN), (BUFFER_SIZE, 0, 0));
        // SAFETY: `buffer` has BUFFER_SIZE writable bytes, more than `records`.
        unsafe { std::ptr::copy_nonoverlapping(records.as_ptr(), buffer, records.len()) };

        {
            let mut s = lock(&STATE);
            assert_eq!(s.phase, Phase::Idle);
            s.hooks = Some(Hooks { next_record: fake_next_record, dropped: fake_dropped });
            s.phase = Phase::Collecting;
        }
        // SAFETY: a buffer from `buffer_requested` with `records.len()` valid bytes; freed by the call.
        unsafe { buffer_completed(std::ptr::null_mut(), 0, buffer, size, records.len()) };
        let collected = {
            let mut s = lock(&STATE);
            let c = s.take();
            s.phase = Phase::Idle;
            s.hooks = None;
            c
        };
        assert_eq!(
            collected,
            Collected {
                kernels: vec![
                    KernelRecord {
                        name: "void gemm<128>(float*)".into(),
                        launch_ns: 10,
                        start_ns: 30,
                        end_ns: 40,
                        device: 0
                    },
                    KernelRecord {
                        name: records::UNNAMED.into(),
                        launch_ns: 0,
                        start_ns: 50,
                        end_ns: 0,
                        device: 0
                    },
                ],
                dropped: 3,
                unmatched: 1,
                untimed: 1,
                api_records: 1,
                unreadable: 0,
            }
        );

        // Not collecting: a buffer is freed and its records ignored.
        let mut buffer: *mut u8 = std::ptr::null_mut();
        // SAFETY: as above.
        unsafe {
            buffer_requested(&mut buffer, &mut size, &mut max);
            std::ptr::copy_nonoverlapping(records.as_ptr(), buffer, records.len());
            buffer_completed(std::ptr::null_mut(), 0, buffer, size, records.len());
        }
        assert!(lock(&STATE).kernels.is_empty());
    }
}
