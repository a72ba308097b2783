//! The only NCCL FFI of the crate: finding and opening `libnccl.so.2`, checking its symbols and
//! version, and thin wrappers of the calls [`super::Comm`] makes. Types come from cudarc's `nccl`
//! bindings (`ncclComm_t`, `ncclDataType_t`, `ncclRedOp_t`); statuses are kept as integers, so a status
//! this build does not know is a value, not undefined behaviour.
//!
//! NCCL docs: <https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api.html>.

use super::{Candidate, NcclError, LIBRARY_ENV, MIN_VERSION};
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

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
    match library {
        Some(path) if !path.is_empty() => vec![PathBuf::from(path)],
        _ => vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")],
    }
}

static LOADED: OnceLock<Result<Lib, NcclError>> = OnceLock::new();

/// The process-wide NCCL, opened on first use from [`default_candidates`]; the outcome, success or
/// error, is kept (NCCL keeps process-wide state, so one library serves the process).
pub(crate) fn load() -> Result<&'static Lib, NcclError> {
    LOADED.get_or_init(|| load_from(&default_candidates())).as_ref().map_err(Clone::clone)
}

/// Opens the first candidate that loads, then checks its symbols and version (uncached).
pub(crate) fn load_from(candidates: &[PathBuf]) -> Result<Lib, NcclError> {
    let mut tried = Vec::new();
    for candidate in candidates {
        let name = candidate.display().to_string();
        // SAFETY: opening a shared library runs its initialisers; NCCL's only set up process state.
        match unsafe { libloading::Library::new(candidate) } {
            Ok(lib) => return Lib::check(lib, name),
            Err(e) => tried.push(Candidate { name, error: e.to_string() }),
        }
    }
    Err(NcclError::NotFound { tried })
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
