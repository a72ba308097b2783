//! The only NCCL FFI of the crate: finding and opening `libnccl.so.2`, checking its symbols and
//! version, and thin wrappers of the calls [`super::Comm`] makes. Types come from cudarc's `nccl`
//! bindings (`ncclComm_t`, `ncclDataType_t`, `ncclRedOp_t`); statuses are kept as integers, so a status
//! this build does not know is a value, not undefined behaviour.
//!
//! NCCL docs: <https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api.html>.

use super::{NcclConfig, NcclError, CONFIG_MIN_VERSION, LIBRARY_ENV, MIN_VERSION};
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::CudaContext;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// An `ncclResult_t` as the library returns it.
type Status = c_uint;
const SUCCESS: Status = 0;

/// Symbols [`Lib`] calls; a library missing any of them is refused when it is opened.
pub(crate) const REQUIRED_SYMBOLS: [&str; 9] = [
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclAllReduce",
    "ncclAllGather",
];

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): an attribute NCCL picks itself.
const UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`.
const API_MAGIC: c_uint = 0xcafe_beef;
/// The `NCCL_VERSION_CODE` of the header whose `ncclConfig_t` [`ConfigV22800`] replicates (2.28.9;
/// 2.28.3 to 2.28.9 share the layout).
const CONFIG_VERSION: c_uint = 2_28_09;

/// `ncclConfig_t` as NCCL 2.28's `nccl.h` lays it out (`struct ncclConfig_v22800`), field for field.
/// NCCL copies `size` bytes of it (at most its own struct's) and, for a `version` older than a field,
/// ignores the field; so a newer library reads this layout as 2.28 wrote it, and an older one (2.17
/// to 2.27, which have every field this module sets) reads its own prefix of it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConfigV22800 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
    shrink_share: c_int,
    nvls_ctas: c_int,
    n_channels_per_net_peer: c_int,
    nvlink_centric_sched: c_int,
}

// The layout of `ncclConfig_v22800` on LP64 (x86_64, aarch64): pointers 8-aligned after 4 ints.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ConfigV22800>() == 80);
    assert!(offset_of!(ConfigV22800, size) == 0);
    assert!(offset_of!(ConfigV22800, magic) == 8);
    assert!(offset_of!(ConfigV22800, version) == 12);
    assert!(offset_of!(ConfigV22800, blocking) == 16);
    assert!(offset_of!(ConfigV22800, cga_cluster_size) == 20);
    assert!(offset_of!(ConfigV22800, min_ctas) == 24);
    assert!(offset_of!(ConfigV22800, max_ctas) == 28);
    assert!(offset_of!(ConfigV22800, net_name) == 32);
    assert!(offset_of!(ConfigV22800, split_share) == 40);
    assert!(offset_of!(ConfigV22800, traffic_class) == 44);
    assert!(offset_of!(ConfigV22800, comm_name) == 48);
    assert!(offset_of!(ConfigV22800, collnet_enable) == 56);
    assert!(offset_of!(ConfigV22800, cta_policy) == 60);
    assert!(offset_of!(ConfigV22800, shrink_share) == 64);
    assert!(offset_of!(ConfigV22800, nvls_ctas) == 68);
    assert!(offset_of!(ConfigV22800, n_channels_per_net_peer) == 72);
    assert!(offset_of!(ConfigV22800, nvlink_centric_sched) == 76);
    assert!(size_of::<UniqueId>() == 128);
};

impl ConfigV22800 {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.28.9, value for value: the struct's size, the magic, the
    /// header's version, every attribute unset.
    pub(crate) const INITIALIZER: ConfigV22800 = ConfigV22800 {
        size: std::mem::size_of::<ConfigV22800>(),
        magic: API_MAGIC,
        version: CONFIG_VERSION,
        blocking: UNDEF_INT,
        cga_cluster_size: UNDEF_INT,
        min_ctas: UNDEF_INT,
        max_ctas: UNDEF_INT,
        net_name: std::ptr::null(),
        split_share: UNDEF_INT,
        traffic_class: UNDEF_INT,
        comm_name: std::ptr::null(),
        collnet_enable: UNDEF_INT,
        cta_policy: UNDEF_INT,
        shrink_share: UNDEF_INT,
        nvls_ctas: UNDEF_INT,
        n_channels_per_net_peer: UNDEF_INT,
        nvlink_centric_sched: UNDEF_INT,
    };

    /// The initializer with `blocking = 1` (as `ncclCommInitAll`'s communicators) and the attributes
    /// `config` sets; the rest stay NCCL's. `config` was validated, so every value fits an int.
    pub(crate) fn from(config: &NcclConfig) -> ConfigV22800 {
        let int = |v: Option<u32>| v.map_or(UNDEF_INT, |v| c_int::try_from(v).unwrap_or(UNDEF_INT));
        ConfigV22800 {
            blocking: 1,
            cga_cluster_size: int(config.cga_cluster_size),
            min_ctas: int(config.min_ctas),
            max_ctas: int(config.max_ctas),
            ..ConfigV22800::INITIALIZER
        }
    }

    /// The initializer with `blocking = 1` and `CTAPolicy = NCCL_CTA_POLICY_ZERO` (NCCL 2.28+): NCCL
    /// runs a collective on the copy engines where it can (an all-gather between symmetric windows
    /// of one node), launching no kernel.
    pub(crate) fn zero_cta() -> ConfigV22800 {
        ConfigV22800 { blocking: 1, cta_policy: CTA_POLICY_ZERO, ..ConfigV22800::INITIALIZER }
    }
}

/// `NCCL_CTA_POLICY_ZERO`.
const CTA_POLICY_ZERO: c_int = 2;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// The calls that make communicators with a configuration (NCCL 2.14 and later; the attributes set
/// here came in 2.17), looked up when the library opens and used only when a configuration is given.
struct ConfigCalls {
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    group_start: unsafe extern "C" fn() -> Status,
    group_end: unsafe extern "C" fn() -> Status,
    comm_init_rank_config:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, UniqueId, c_int, *mut ConfigV22800) -> Status,
}

/// The symmetric-memory calls (NCCL 2.27+): `ncclMemAlloc`, `ncclMemFree`, `ncclCommWindowRegister`,
/// `ncclCommWindowDeregister`.
#[derive(Clone, Copy)]
struct WindowCalls {
    mem_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Status,
    mem_free: unsafe extern "C" fn(*mut c_void) -> Status,
    window_register: unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void, c_int) -> Status,
    window_deregister: unsafe extern "C" fn(ncclComm_t, *mut c_void) -> Status,
}

/// `NCCL_WIN_COLL_SYMMETRIC`: a window every rank registers at the same offset and size, which
/// NCCL's symmetric collective kernels run on.
const WIN_COLL_SYMMETRIC: c_int = 1;

/// One rank's symmetric window: memory from `ncclMemAlloc` on the rank's GPU, registered with its
/// communicator. Freed by [`Lib::free_window`] only.
pub(crate) struct RawWindow {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: usize,
    handle: *mut c_void,
    /// The GPU's primary context, current for the free.
    context: Arc<CudaContext>,
}

// SAFETY: the window is memory and a registration handle NCCL owns; any thread may free it, and its
// owner (`super::Comm`, which is not `Sync`) frees it once, in its drop.
unsafe impl Send for RawWindow {}

/// An opened, checked NCCL: its function table, where it was found and its version.
pub(crate) struct Lib {
    get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> Status,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Status,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> Status,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut Status) -> Status,
    #[allow(clippy::type_complexity)]
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        CUstream,
    ) -> Status,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        CUstream,
    ) -> Status,
    /// `None` when the library lacks one of them.
    config_calls: Option<ConfigCalls>,
    /// `None` when the library lacks one of them.
    window_calls: Option<WindowCalls>,
    /// The candidate that opened.
    pub(crate) library: String,
    /// `ncclGetVersion()`, e.g. 22809 for 2.28.9.
    pub(crate) version: u32,
    // Last: the function pointers above point into it.
    _lib: libloading::Library,
}

/// A communicator handle. Not `Copy`: [`Lib::destroy`] and [`Lib::abort`] take it by value, so a
/// handle cannot be used after either.
pub(crate) struct RawComm(ncclComm_t);

// SAFETY: an NCCL communicator is a library-owned object that any thread may call with its handle;
// what NCCL forbids is concurrent calls on one communicator, which the owner prevents (`super::Comm`
// keeps the handle behind a mutex and calls NCCL only while holding it).
unsafe impl Send for RawComm {}

/// Where [`load`] looks, in order: `$NCCL_LIBRARY` alone if set and non-empty; otherwise
/// `libnccl.so.2` (the soname NCCL 2 ships, the only name in the `nvidia-nccl-cu13` wheel's
/// `nvidia/nccl/lib`) and `libnccl.so`, through the system loader (LD_LIBRARY_PATH, ld.so.cache).
pub(crate) fn default_candidates() -> Vec<PathBuf> {
    candidates_from(std::env::var_os(LIBRARY_ENV))
}

/// [`default_candidates`] for a given value of `$NCCL_LIBRARY`.
fn candidates_from(library: Option<std::ffi::OsString>) -> Vec<PathBuf> {
    cudnn_llm_dylib::candidates(library, ["libnccl.so.2", "libnccl.so"].map(PathBuf::from))
}

static LOADED: OnceLock<Result<Lib, NcclError>> = OnceLock::new();

/// The process-wide NCCL, opened on first use from [`default_candidates`]; the outcome, success or
/// error, is kept (NCCL keeps process-wide state, so one library serves the process).
pub(crate) fn load() -> Result<&'static Lib, NcclError> {
    LOADED.get_or_init(|| load_from(&default_candidates())).as_ref().map_err(Clone::clone)
}

/// Opens the first candidate that loads, then checks its symbols and version (uncached).
pub(crate) fn load_from(candidates: &[PathBuf]) -> Result<Lib, NcclError> {
    let open = |path: &std::path::Path| {
        // SAFETY: opening a shared library runs its initialisers; NCCL's only set up process state.
        unsafe { libloading::Library::new(path) }
    };
    match cudnn_llm_dylib::open_first(candidates, open) {
        Ok((lib, name)) => Lib::check(lib, name),
        Err(tried) => Err(NcclError::NotFound { tried }),
    }
}

/// A symbol of `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the symbol's C signature, and the pointer must not outlive `lib`.
unsafe fn symbol<F: Copy>(lib: &libloading::Library, name: &str, library: &str) -> Result<F, NcclError> {
    // SAFETY: the caller's promise on `F`.
    let sym = unsafe { lib.get::<F>(name.as_bytes()) };
    sym.map(|s| *s)
        .map_err(|_| NcclError::MissingSymbol { library: library.to_string(), symbol: name.into() })
}

impl Lib {
    fn check(lib: libloading::Library, library: String) -> Result<Self, NcclError> {
        for name in REQUIRED_SYMBOLS {
            // SAFETY: only the address is looked up; nothing is called through this type.
            unsafe { symbol::<*const c_void>(&lib, name, &library) }?;
        }
        let l = &library;
        // SAFETY: each type is the C signature in nccl.h (2.13 and later); the pointers live in
        // the returned `Lib`, which owns the library they point into.
        let mut table = unsafe {
            Lib {
                get_version: symbol(&lib, "ncclGetVersion", l)?,
                get_error_string: symbol(&lib, "ncclGetErrorString", l)?,
                get_last_error: symbol(&lib, "ncclGetLastError", l)?,
                comm_init_all: symbol(&lib, "ncclCommInitAll", l)?,
                comm_destroy: symbol(&lib, "ncclCommDestroy", l)?,
                comm_abort: symbol(&lib, "ncclCommAbort", l)?,
                comm_get_async_error: symbol(&lib, "ncclCommGetAsyncError", l)?,
                all_reduce: symbol(&lib, "ncclAllReduce", l)?,
                all_gather: symbol(&lib, "ncclAllGather", l)?,
                config_calls: (|| {
                    Ok::<_, NcclError>(ConfigCalls {
                        get_unique_id: symbol(&lib, "ncclGetUniqueId", l)?,
                        group_start: symbol(&lib, "ncclGroupStart", l)?,
                        group_end: symbol(&lib, "ncclGroupEnd", l)?,
                        comm_init_rank_config: symbol(&lib, "ncclCommInitRankConfig", l)?,
                    })
                })()
                .ok(),
                window_calls: (|| {
                    Ok::<_, NcclError>(WindowCalls {
                        mem_alloc: symbol(&lib, "ncclMemAlloc", l)?,
                        mem_free: symbol(&lib, "ncclMemFree", l)?,
                        window_register: symbol(&lib, "ncclCommWindowRegister", l)?,
                        window_deregister: symbol(&lib, "ncclCommWindowDeregister", l)?,
                    })
                })()
                .ok(),
                library: library.clone(),
                version: 0,
                _lib: lib,
            }
        };
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer for an int.
        let status = unsafe { (table.get_version)(&mut v) };
        table.status(status, "ncclGetVersion", None)?;
        table.version = u32::try_from(v).unwrap_or(0);
        check_version(&table.library, table.version)?;
        Ok(table)
    }

    /// `ncclCommInitAll` over `devices` (rank i on `devices[i]`), all communicators of one clique.
    pub(crate) fn init_all(&self, devices: &[c_int]) -> Result<Vec<RawComm>, NcclError> {
        let n = c_int::try_from(devices.len())
            .map_err(|_| NcclError::Argument(format!("{} devices do not fit an int", devices.len())))?;
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for `n` handles and `devices` holds `n` ordinals (both live for
        // the call); NCCL writes one handle per device.
        let status = unsafe { (self.comm_init_all)(comms.as_mut_ptr(), n, devices.as_ptr()) };
        self.status(status, "ncclCommInitAll", None)?;
        Ok(comms.into_iter().map(RawComm).collect())
    }

    /// The communicators of [`Lib::init_all`], made with `config` as `ncclCommInitAll` makes its
    /// own: a unique id, then in one group `ncclCommInitRankConfig` for rank i with GPU `devices[i]`
    /// current. Leaves the calling thread's current context as it found it. Returns each rank's
    /// communicator with the primary context it was made in, for the caller to hold while the
    /// communicator lives (so that context outlives NCCL's resources in it).
    pub(crate) fn init_all_config(
        &self,
        devices: &[c_int],
        config: &NcclConfig,
    ) -> Result<Vec<(RawComm, Arc<CudaContext>)>, NcclError> {
        self.init_all_raw(devices, ConfigV22800::from(config), config.first_set())
    }

    /// [`Lib::init_all_config`] with the struct itself; `option` names the attribute an error
    /// about a library too old for it names.
    pub(crate) fn init_all_raw(
        &self,
        devices: &[c_int],
        config: ConfigV22800,
        option: &str,
    ) -> Result<Vec<(RawComm, Arc<CudaContext>)>, NcclError> {
        let calls = match &self.config_calls {
            Some(calls) if self.version >= CONFIG_MIN_VERSION => calls,
            _ => {
                return Err(NcclError::Config {
                    option: option.to_string(),
                    why: format!(
                        "{} is NCCL {}; communicator settings need {} or later (ncclCommInitRankConfig)",
                        self.library,
                        super::version_string(self.version),
                        super::version_string(CONFIG_MIN_VERSION)
                    ),
                })
            }
        };
        let n = c_int::try_from(devices.len())
            .map_err(|_| NcclError::Argument(format!("{} devices do not fit an int", devices.len())))?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer for a unique id.
        let status = unsafe { (calls.get_unique_id)(&mut id) };
        self.status(status, "ncclGetUniqueId", None)?;
        // Restored at the end (nothing to restore when nothing was current).
        let previous = cudarc::driver::result::ctx::get_current().ok().flatten();
        // NCCL takes a rank's GPU from the current device (`cudaGetDevice`), the device of the
        // thread's current context: GPU `devices[i]`'s primary context, opened before the group so
        // that every rank of it gets its call.
        let contexts = devices
            .iter()
            .map(|&d| {
                let d =
                    usize::try_from(d).map_err(|_| NcclError::Argument(format!("GPU {d} is no ordinal")))?;
                CudaContext::new(d).map_err(cuda_error)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: no arguments; the group end below follows whatever happens in between.
        let status = unsafe { (calls.group_start)() };
        self.status(status, "ncclGroupStart", None)?;
        let mut first_error = Ok(());
        for (rank, (ctx, comm)) in contexts.iter().zip(comms.iter_mut()).enumerate() {
            // As `ncclCommInitAll`, every rank gets its call, and the group end reports.
            let bound = ctx.bind_to_thread().map_err(cuda_error);
            let made = bound.and_then(|()| {
                let mut cfg = config;
                // SAFETY: `comm` is a valid out-pointer, `rank < n`, and `cfg` a live `ncclConfig_t`
                // laid out as NCCL 2.28 declares it (asserted where it is defined), copied by NCCL in the call.
                let status = unsafe { (calls.comm_init_rank_config)(comm, n, id, rank as c_int, &mut cfg) };
                self.status(status, "ncclCommInitRankConfig", None)
            });
            if first_error.is_ok() {
                first_error = made;
            }
        }
        // SAFETY: ends the group started above (NCCL creates the communicators here).
        let status = unsafe { (calls.group_end)() };
        let ended = self.status(status, "ncclGroupEnd", None);
        restore(previous);
        first_error?;
        ended?;
        Ok(comms.into_iter().map(RawComm).zip(contexts).collect())
    }

    /// The calls that take a configuration, or an error naming `what` on a library too old for them.
    fn config_calls(&self, what: &str) -> Result<&ConfigCalls, NcclError> {
        match &self.config_calls {
            Some(calls) if self.version >= CONFIG_MIN_VERSION => Ok(calls),
            _ => Err(NcclError::Config {
                option: what.to_string(),
                why: format!(
                    "{} is NCCL {}; ranks as processes need {} or later (ncclCommInitRankConfig)",
                    self.library,
                    super::version_string(self.version),
                    super::version_string(CONFIG_MIN_VERSION)
                ),
            }),
        }
    }

    /// A new unique id (`ncclGetUniqueId`): the 128 bytes every rank of one communicator is given.
    pub(crate) fn unique_id(&self) -> Result<[u8; 128], NcclError> {
        let calls = self.config_calls("unique id")?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer for a unique id.
        let status = unsafe { (calls.get_unique_id)(&mut id) };
        self.status(status, "ncclGetUniqueId", None)?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// This process's rank `rank` of `ranks` in the communicator of unique id `id`, on GPU `device`
    /// (made current for the call, the previous context restored), with `config`. Blocks until every
    /// rank called it (or NCCL fails). Returns the communicator with the primary context it was made
    /// in, for the caller to hold while the communicator lives.
    pub(crate) fn init_rank(
        &self,
        device: usize,
        rank: usize,
        ranks: usize,
        id: [u8; 128],
        config: ConfigV22800,
    ) -> Result<(RawComm, Arc<CudaContext>), NcclError> {
        let calls = self.config_calls("ranks as processes")?;
        let int = |v: usize, what: &str| {
            c_int::try_from(v).map_err(|_| NcclError::Argument(format!("{what} {v} does not fit an int")))
        };
        let (rank, ranks) = (int(rank, "rank")?, int(ranks, "rank count")?);
        let previous = cudarc::driver::result::ctx::get_current().ok().flatten();
        let ctx = CudaContext::new(device).map_err(cuda_error)?;
        let made = ctx.bind_to_thread().map_err(cuda_error).and_then(|()| {
            let mut comm: ncclComm_t = std::ptr::null_mut();
            let mut cfg = config;
            let id = UniqueId { internal: id.map(|b| b as c_char) };
            // SAFETY: `comm` is a valid out-pointer, `rank < ranks` (checked by the caller), and `cfg` a
            // live `ncclConfig_t` laid out as NCCL 2.28 declares it, copied by NCCL in the call.
            let status = unsafe { (calls.comm_init_rank_config)(&mut comm, ranks, id, rank, &mut cfg) };
            self.status(status, "ncclCommInitRankConfig", None).map(|()| RawComm(comm))
        });
        restore(previous);
        Ok((made?, ctx))
    }

    /// Whether this library makes symmetric windows ([`Lib::windows`]): it has the calls and is
    /// `min_version` or later.
    pub(crate) fn has_windows(&self, min_version: u32) -> bool {
        self.window_calls.is_some() && self.config_calls.is_some() && self.version >= min_version
    }

    /// A symmetric window of `bytes` per rank: `ncclMemAlloc` on each rank's GPU, then, in one group,
    /// `ncclCommWindowRegister` of each on its communicator (`comms[i]` on GPU `devices[i]`, the
    /// communicators of one clique). Leaves the calling thread's current context as it found it.
    /// On an error, what was allocated is freed.
    pub(crate) fn windows(
        &self,
        comms: &[&RawComm],
        devices: &[usize],
        bytes: usize,
    ) -> Result<Vec<RawWindow>, NcclError> {
        let (Some(w), Some(calls)) = (self.window_calls, self.config_calls.as_ref()) else {
            return Err(NcclError::Argument(format!("{} has no symmetric windows", self.library)));
        };
        let previous = cudarc::driver::result::ctx::get_current().ok().flatten();
        let mut made: Vec<RawWindow> = Vec::new();
        let result = (|| {
            for &d in devices {
                let context = CudaContext::new(d).map_err(cuda_error)?;
                context.bind_to_thread().map_err(cuda_error)?;
                let mut ptr: *mut c_void = std::ptr::null_mut();
                // SAFETY: a valid out-pointer; NCCL allocates `bytes` on the current device.
                let status = unsafe { (w.mem_alloc)(&mut ptr, bytes) };
                self.status(status, "ncclMemAlloc", None)?;
                made.push(RawWindow {
                    ptr: ptr as CUdeviceptr,
                    bytes,
                    handle: std::ptr::null_mut(),
                    context,
                });
            }
            // SAFETY: no arguments; the group end below follows whatever happens in between.
            let status = unsafe { (calls.group_start)() };
            self.status(status, "ncclGroupStart", None)?;
            let mut first_error = Ok(());
            for (win, comm) in made.iter_mut().zip(comms) {
                let registered = win.context.bind_to_thread().map_err(cuda_error).and_then(|()| {
                    // SAFETY: a live communicator, memory from ncclMemAlloc of `bytes` on its GPU
                    // (current), and a valid out-pointer for the handle.
                    let status = unsafe {
                        (w.window_register)(
                            comm.0,
                            win.ptr as *mut c_void,
                            win.bytes,
                            &mut win.handle,
                            WIN_COLL_SYMMETRIC,
                        )
                    };
                    self.status(status, "ncclCommWindowRegister", Some(comm))
                });
                if first_error.is_ok() {
                    first_error = registered;
                }
            }
            // SAFETY: ends the group started above (NCCL registers the windows here).
            let status = unsafe { (calls.group_end)() };
            first_error?;
            self.status(status, "ncclGroupEnd", None)
        })();
        if let Err(e) = result {
            for (win, comm) in made.into_iter().zip(comms) {
                let _ = self.free_window(Some(comm), win);
            }
            restore(previous);
            return Err(e);
        }
        restore(previous);
        Ok(made)
    }

    /// Deregisters `win` from `comm` (unless the communicator is gone: `None`) and frees its memory.
    pub(crate) fn free_window(&self, comm: Option<&RawComm>, win: RawWindow) -> Result<(), NcclError> {
        let Some(w) = self.window_calls else { return Ok(()) };
        let previous = cudarc::driver::result::ctx::get_current().ok().flatten();
        let result = win.context.bind_to_thread().map_err(cuda_error).and_then(|()| {
            if let (Some(comm), false) = (comm, win.handle.is_null()) {
                // SAFETY: the handle this communicator's registration returned, deregistered once.
                let status = unsafe { (w.window_deregister)(comm.0, win.handle) };
                self.status(status, "ncclCommWindowDeregister", Some(comm))?;
            }
            // SAFETY: memory from ncclMemAlloc on the current GPU, freed once (`win` is consumed).
            let status = unsafe { (w.mem_free)(win.ptr as *mut c_void) };
            self.status(status, "ncclMemFree", None)
        });
        restore(previous);
        result
    }

    /// `ncclCommDestroy`: waits for the communicator's work, then frees it.
    pub(crate) fn destroy(&self, comm: RawComm) -> Result<(), NcclError> {
        // SAFETY: the handle came from `init_all` and is consumed here, so it is not used again.
        let status = unsafe { (self.comm_destroy)(comm.0) };
        self.status(status, "ncclCommDestroy", None)
    }

    /// `ncclCommAbort`: ends the communicator's unfinished operations (their kernels return) and
    /// frees it, without waiting for the other ranks.
    pub(crate) fn abort(&self, comm: RawComm) -> Result<(), NcclError> {
        // SAFETY: as in `destroy`.
        let status = unsafe { (self.comm_abort)(comm.0) };
        self.status(status, "ncclCommAbort", None)
    }

    /// `ncclCommGetAsyncError`: an error an earlier operation left on the communicator.
    pub(crate) fn async_error(&self, comm: &RawComm) -> Result<(), NcclError> {
        let mut pending: Status = SUCCESS;
        // SAFETY: a live handle (borrowed, so not destroyed meanwhile) and a valid out-pointer.
        let status = unsafe { (self.comm_get_async_error)(comm.0, &mut pending) };
        self.status(status, "ncclCommGetAsyncError", Some(comm))?;
        self.status(pending, "an earlier operation (ncclCommGetAsyncError)", Some(comm))
    }

    /// `ncclAllReduce` with `ncclSum`, in place over `count` elements at `buf`, enqueued on `stream`.
    ///
    /// # Safety
    /// `buf` must address at least `count` elements of `dtype` on the communicator's device, which
    /// stay allocated until the operation completes on `stream`, a stream of that device.
    pub(crate) unsafe fn all_reduce_sum(
        &self,
        comm: &RawComm,
        buf: CUdeviceptr,
        count: usize,
        dtype: ncclDataType_t,
        stream: CUstream,
    ) -> Result<(), NcclError> {
        let p = buf as *mut c_void;
        // SAFETY: the caller's promise on `buf` and `stream`; a live handle.
        let status = unsafe { (self.all_reduce)(p, p, count, dtype, ncclRedOp_t::ncclSum, comm.0, stream) };
        self.status(status, "ncclAllReduce", Some(comm))
    }

    /// `ncclAllGather` in place: rank `rank`'s `count` elements sit at `buf + rank·count` and every
    /// rank's land in order at `buf`, enqueued on `stream`.
    ///
    /// # Safety
    /// `buf` must address at least `ranks · count` elements of `dtype` (`elem` bytes each) on the
    /// communicator's device, allocated until the operation completes on `stream`, a stream of that
    /// device; `rank` must be this communicator's rank.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_gather_in_place(
        &self,
        comm: &RawComm,
        buf: CUdeviceptr,
        count: usize,
        rank: usize,
        (dtype, elem): (ncclDataType_t, usize),
        stream: CUstream,
    ) -> Result<(), NcclError> {
        let send = (buf + (rank * count * elem) as CUdeviceptr) as *const c_void;
        // SAFETY: the caller's promise on `buf`, `rank` and `stream`; in place is NCCL's documented
        // `sendbuff == recvbuff + rank · sendcount`.
        let status = unsafe { (self.all_gather)(send, buf as *mut c_void, count, dtype, comm.0, stream) };
        self.status(status, "ncclAllGather", Some(comm))
    }

    /// Maps a status to a result naming `call`, with NCCL's name for the status and its last error
    /// message (of `comm`, or of the process).
    fn status(&self, status: Status, call: &str, comm: Option<&RawComm>) -> Result<(), NcclError> {
        if status == SUCCESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString takes any value and returns a static string (or null).
        let name = unsafe { text((self.get_error_string)(status)) };
        let raw = comm.map_or(std::ptr::null_mut(), |c| c.0);
        // SAFETY: ncclGetLastError takes a live handle or null and returns a string it owns.
        let detail = unsafe { text((self.get_last_error)(raw)) };
        Err(NcclError::Call { call: call.to_string(), code: status, name, detail })
    }
}

/// Makes `previous` (the context current on entry, if any) current again.
fn restore(previous: Option<cudarc::driver::sys::CUcontext>) {
    if let Some(ctx) = previous {
        // SAFETY: the context that was current on entry, still retained by its owner.
        let _ = unsafe { cudarc::driver::result::ctx::set_current(ctx) };
    }
}

/// A driver error on the way to a communicator.
fn cuda_error(e: cudarc::driver::DriverError) -> NcclError {
    NcclError::Argument(format!("CUDA driver: {e}"))
}

/// A C string NCCL returns, copied (empty for null).
///
/// # Safety
/// `p` is null or a NUL-terminated string valid for the call.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's promise.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
}

/// The version policy, apart from the loading so it can be tested without a library: refuses
/// versions older than [`MIN_VERSION`].
pub(crate) fn check_version(library: &str, version: u32) -> Result<(), NcclError> {
    if version < MIN_VERSION {
        return Err(NcclError::TooOld { library: library.to_string(), version });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_typed_error_listing_every_candidate() {
        let err =
            load_from(&[PathBuf::from("/nonexistent/libnccl.so.2"), PathBuf::from("libnccl_nope.so.2")])
                .err()
                .expect("no such library");
        let NcclError::NotFound { tried } = &err else { panic!("{err:?}") };
        assert_eq!(
            tried.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["/nonexistent/libnccl.so.2", "libnccl_nope.so.2"]
        );
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/libnccl.so.2") && msg.contains("libnccl_nope.so.2"), "{msg}");
        assert!(msg.contains(LIBRARY_ENV) && msg.contains("nvidia/nccl/lib"), "{msg}");
    }

    #[test]
    fn a_library_without_nccl_symbols_is_refused() {
        // libc loads everywhere and has none of NCCL's symbols.
        let err = load_from(&[PathBuf::from("libc.so.6")]).err().expect("libc is no NCCL");
        assert_eq!(
            err,
            NcclError::MissingSymbol { library: "libc.so.6".into(), symbol: "ncclGetVersion".into() }
        );
        assert!(err.to_string().contains("`ncclGetVersion`"), "{err}");
    }

    /// `NCCL_CONFIG_INITIALIZER` of 2.28.9 (the layout itself is pinned by the compile-time asserts).
    #[test]
    fn the_config_starts_as_nccls_initializer_and_sets_only_what_is_given() {
        let init = ConfigV22800::INITIALIZER;
        assert_eq!((init.size, init.magic, init.version), (80, 0xcafebeef, 22809));
        let ints = |c: &ConfigV22800| {
            [
                c.blocking,
                c.cga_cluster_size,
                c.min_ctas,
                c.max_ctas,
                c.split_share,
                c.traffic_class,
                c.collnet_enable,
                c.cta_policy,
                c.shrink_share,
                c.nvls_ctas,
                c.n_channels_per_net_peer,
                c.nvlink_centric_sched,
            ]
        };
        assert_eq!(ints(&init), [c_int::MIN; 12]);
        assert!(init.net_name.is_null() && init.comm_name.is_null());
        let zero = ConfigV22800::zero_cta();
        let mut want = [c_int::MIN; 12];
        (want[0], want[7]) = (1, 2);
        assert_eq!(ints(&zero), want);
        let set = ConfigV22800::from(&NcclConfig::default().with_min_ctas(2).with_max_ctas(16));
        let mut want = [c_int::MIN; 12];
        (want[0], want[2], want[3]) = (1, 2, 16);
        assert_eq!(ints(&set), want);
        assert_eq!((set.size, set.magic, set.version), (80, 0xcafebeef, 22809));
        let cga = ConfigV22800::from(&NcclConfig::default().with_cga_cluster_size(0));
        assert_eq!((cga.blocking, cga.cga_cluster_size, cga.min_ctas), (1, 0, c_int::MIN));
    }

    #[test]
    fn version_policy() {
        assert!(check_version("x", 22809).is_ok());
        assert!(check_version("x", MIN_VERSION).is_ok());
        let old = check_version("libnccl.so.2", 21204).unwrap_err();
        assert_eq!(old, NcclError::TooOld { library: "libnccl.so.2".into(), version: 21204 });
        assert!(old.to_string().contains("2.12.4") && old.to_string().contains("2.13.0"), "{old}");
    }

    /// Why this module opens NCCL itself: cudarc's dynamic loading tries `libnccl.so` and
    /// `libnccl.so.<CUDA major>` and the like, never `libnccl.so.2`, the one name NCCL's wheel ships.
    /// When a cudarc release adds it, this fails: then cudarc's loader could serve instead.
    #[test]
    fn cudarc_does_not_try_the_wheels_soname() {
        let names = cudarc::get_lib_name_candidates("nccl");
        assert!(names.contains(&"libnccl.so".to_string()), "{names:?}");
        assert!(!names.contains(&"libnccl.so.2".to_string()), "{names:?}");
        let wheel = [PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")];
        assert_eq!(candidates_from(None), wheel);
        assert_eq!(candidates_from(Some("".into())), wheel);
        assert_eq!(
            candidates_from(Some("/opt/x/libnccl.so.2".into())),
            [PathBuf::from("/opt/x/libnccl.so.2")]
        );
    }
}
