//! The only module that calls into C libraries: cuDNN here, the CUDA driver in [`driver`], cuBLAS in
//! [`cublas`], NVRTC's probe in [`nvrtc`]. Each cuDNN wrapper turns a `cudnnStatus_t` into a [`Result`] carrying the step, the
//! status name and `cudnnGetLastErrorString`. Status codes in the 3000s
//! (`CUDNN_STATUS_NOT_SUPPORTED*`) become [`Error::NotSupported`] so callers can fall back.
//!
//! Backend docs: <https://docs.nvidia.com/deeplearning/cudnn/latest/api/cudnn-graph-library.html>.

pub(crate) mod cublas;
pub(crate) mod driver;
pub(crate) mod nvrtc;

/// Whether one of the names cudarc's dynamic loading tries for the CUDA library `name` (`"cuda"`,
/// `"nvrtc"`, `"cublas"`) opens: cudarc panics on its first call into a library it cannot open.
///
/// The workspace leaves cudarc's linking mode to the final build (`fallback-dynamic-loading`): alone it
/// loads the libraries at run time, and a dependent that links them (candle turns on cudarc's
/// `dynamic-linking`) started with them loaded, where the probe finds them too. cudarc's own probe
/// (`is_culib_present`) exists in the first mode only, hence this one.
pub(crate) fn library_present(name: &str) -> bool {
    cudarc_names(name).iter().any(|n| {
        // SAFETY: opening a CUDA library runs no initializer with preconditions (the CUDA libraries
        // initialize on their first call); the handle is closed when dropped here, and the library
        // stays loaded while cudarc or the system loader holds it too.
        unsafe { libloading::Library::new(n) }.is_ok()
    })
}

/// The names cudarc 0.19's dynamic loading tries for `name` on Linux, for the CUDA 13.0 it is built
/// for (`get_lib_name_candidates`, whose list exists in that mode only).
fn cudarc_names(name: &str) -> Vec<String> {
    let (major, minor) = (13, 0);
    let w = 64;
    let mut names = vec![
        format!("lib{name}.so"),
        format!("lib{name}{w}.so"),
        format!("lib{name}{w}_{major}.so"),
        format!("lib{name}{w}_{major}{minor}.so"),
        format!("lib{name}{w}_{major}{minor}_0.so"),
        format!("lib{name}{w}_{major}0_{minor}.so"),
    ];
    names.extend([10, 11, 12].map(|v| format!("lib{name}{w}_{v}.so")));
    names.push(format!("lib{name}{w}_{major}0_0.so"));
    names.push(format!("lib{name}{w}_9.so"));
    names.extend([major, 12, 11, 10, 9, 1].map(|v| format!("lib{name}.so.{v}")));
    names
}

use crate::{Error, Result};
use cudnn_llm_sys as sys;
use std::ffi::{c_void, CStr};

pub(crate) use sys::{
    cudnnBackendAttributeName_t as AttrName, cudnnBackendAttributeType_t as AttrType,
    cudnnBackendDescriptorType_t as DescType, cudnnBackendDescriptor_t as RawDesc,
    cudnnHandle_t as RawHandle,
};

/// The loaded, version-checked library.
pub(crate) fn lib() -> Result<&'static sys::CudnnLib> {
    Ok(&sys::load()?.lib)
}

/// `cudnnGetVersion()` of the loaded library, and its path.
pub(crate) fn version() -> Result<(usize, String)> {
    let loaded = sys::load()?;
    Ok((loaded.version, loaded.library.clone()))
}

/// Maps a status to a result; `step` names the call for the error message.
fn check(lib: &sys::CudnnLib, status: sys::cudnnStatus_t, step: impl FnOnce() -> String) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cudnnGetErrorString accepts any value and returns a static C string (or null).
    let name = unsafe { lib.cudnnGetErrorString(status) };
    let name = if name.is_null() {
        format!("CUDNN_STATUS_{}", status.0)
    } else {
        // SAFETY: non-null pointers from cudnnGetErrorString are NUL-terminated static strings.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    let mut buf = [0 as std::ffi::c_char; 1024];
    // SAFETY: the buffer is writable for its full length, which we pass; cuDNN NUL-terminates.
    unsafe { lib.cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by cuDNN (or all zeros).
    let message = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().trim().to_string();
    Err(status_error(status.0, name, message, step()))
}

/// Builds the error for a failed status (pure, so it can be tested without cuDNN).
pub(crate) fn status_error(status: u32, name: String, message: String, step: String) -> Error {
    if status / 1000 * 1000 == sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED.0 {
        let reason = if message.is_empty() { name } else { format!("{name}: {message}") };
        Error::NotSupported { op: step, reason }
    } else {
        Error::Cudnn { step, status, name, message }
    }
}

/// Creates an empty backend descriptor of `kind`.
pub(crate) fn create_descriptor(kind: DescType) -> Result<RawDesc> {
    let lib = lib()?;
    let mut d: RawDesc = std::ptr::null_mut();
    // SAFETY: `d` is a valid out-pointer; cuDNN writes a new descriptor there on success.
    let status = unsafe { lib.cudnnBackendCreateDescriptor(kind, &mut d) };
    check(lib, status, || format!("create descriptor {}", kind.0))?;
    Ok(d)
}

/// # Safety
/// `d` must come from [`create_descriptor`] and not have been destroyed.
pub(crate) unsafe fn destroy_descriptor(d: RawDesc) {
    if let Ok(lib) = lib() {
        // SAFETY: guaranteed by the caller. A failure here has nothing left to free; ignore it.
        let _ = unsafe { lib.cudnnBackendDestroyDescriptor(d) };
    }
}

/// # Safety
/// `d` must be a live descriptor; `ptr` must point to `count` readable values of the C type that
/// `ty` names.
pub(crate) unsafe fn set_attribute(
    d: RawDesc,
    name: AttrName,
    ty: AttrType,
    count: i64,
    ptr: *const c_void,
) -> Result<()> {
    let lib = lib()?;
    // SAFETY: guaranteed by the caller.
    let status = unsafe { lib.cudnnBackendSetAttribute(d, name, ty, count, ptr as *mut c_void) };
    check(lib, status, || format!("set attribute {}", name.0))
}

/// Reads up to `requested` values into `ptr`; returns how many the attribute holds.
///
/// # Safety
/// `d` must be a live descriptor; `ptr` must be writable for `requested` values of the C type that
/// `ty` names (or null with `requested == 0`).
pub(crate) unsafe fn get_attribute(
    d: RawDesc,
    name: AttrName,
    ty: AttrType,
    requested: i64,
    ptr: *mut c_void,
) -> Result<i64> {
    let lib = lib()?;
    let mut count = 0i64;
    // SAFETY: guaranteed by the caller; `count` is a valid out-pointer.
    let status = unsafe { lib.cudnnBackendGetAttribute(d, name, ty, requested, &mut count, ptr) };
    check(lib, status, || format!("get attribute {}", name.0))?;
    Ok(count)
}

/// # Safety
/// `d` must be a live descriptor.
pub(crate) unsafe fn finalize(d: RawDesc, what: &str) -> Result<()> {
    let lib = lib()?;
    // SAFETY: guaranteed by the caller.
    let status = unsafe { lib.cudnnBackendFinalize(d) };
    check(lib, status, || format!("finalize {what}"))
}

/// # Safety
/// `handle` must be live, `plan` a finalized execution plan built for it and `pack` a finalized variant
/// pack whose pointers are valid for what the plan reads and writes until the work completes.
pub(crate) unsafe fn execute(handle: RawHandle, plan: RawDesc, pack: RawDesc) -> Result<()> {
    let lib = lib()?;
    // SAFETY: guaranteed by the caller.
    let status = unsafe { lib.cudnnBackendExecute(handle, plan, pack) };
    check(lib, status, || "execute".to_string())
}

/// Which handle a plan was finalized for: unique over the process, unlike a handle's address, which
/// cuDNN may hand out again after the handle is destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HandleId(u64);

impl HandleId {
    /// A fresh id, never handed out before.
    fn next() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        HandleId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The id `n`, for tests that compare ids without a GPU.
    #[cfg(test)]
    pub(crate) fn for_test(n: u64) -> Self {
        HandleId(n)
    }
}

impl std::fmt::Display for HandleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// An owned cuDNN handle, destroyed on drop.
pub(crate) struct Handle {
    raw: RawHandle,
    id: HandleId,
}

impl Handle {
    /// Creates a handle and binds it to `stream` (a `CUstream` from cudarc).
    pub(crate) fn new(stream: *mut c_void) -> Result<Self> {
        let lib = lib()?;
        let mut h: RawHandle = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer.
        check(lib, unsafe { lib.cudnnCreate(&mut h) }, || "cudnnCreate".into())?;
        let handle = Handle { raw: h, id: HandleId::next() };
        // SAFETY: `h` is live; the stream belongs to the current context and outlives the handle (the
        // owning context keeps both, handle dropped first).
        check(lib, unsafe { lib.cudnnSetStream(h, stream as sys::cudaStream_t) }, || {
            "cudnnSetStream".into()
        })?;
        Ok(handle)
    }

    pub(crate) fn raw(&self) -> RawHandle {
        self.raw
    }

    /// This handle's process-wide identity.
    pub(crate) fn id(&self) -> HandleId {
        self.id
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Ok(lib) = lib() {
            // SAFETY: the handle is live and owned; nothing uses it after drop.
            let _ = unsafe { lib.cudnnDestroy(self.raw) };
        }
    }
}

/// `cudnnGetCudartVersion()`: the CUDA runtime cuDNN was built against.
pub(crate) fn cudart_version() -> Result<usize> {
    let lib = lib()?;
    // SAFETY: no arguments, symbol checked at load.
    Ok(unsafe { lib.cudnnGetCudartVersion() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_supported_category_maps_to_not_supported() {
        for code in [3000, 3001, 3007, 3999] {
            let e = status_error(
                code,
                "CUDNN_STATUS_NOT_SUPPORTED_X".into(),
                "no engine".into(),
                "finalize".into(),
            );
            assert!(e.is_not_supported(), "{code}: {e:?}");
            assert_eq!(e.to_string(), "not supported: finalize: CUDNN_STATUS_NOT_SUPPORTED_X: no engine");
        }
        for code in [2000, 2002, 4000, 5000] {
            let e = status_error(code, "CUDNN_STATUS_BAD_PARAM".into(), "".into(), "set attribute 7".into());
            assert!(!e.is_not_supported(), "{code}");
            assert_eq!(
                e.to_string(),
                format!("cuDNN set attribute 7 failed: CUDNN_STATUS_BAD_PARAM ({code})")
            );
        }
    }

    #[test]
    fn handle_ids_are_never_reused() {
        let (a, b) = (HandleId::next(), HandleId::next());
        assert_ne!(a, b);
        assert!(b.0 > a.0, "{a} then {b}");
    }

    #[test]
    fn status_categories_match_the_header() {
        assert_eq!(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED.0, 3000);
        assert_eq!(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN.0 / 1000, 3);
        assert_eq!(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM.0, 2000);
    }
}

#[cfg(test)]
mod probe_tests {
    #[test]
    fn the_probe_tries_the_sonames_cudarc_tries() {
        let names = super::cudarc_names("nvrtc");
        assert_eq!(names.len(), 17);
        for soname in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.1"] {
            assert!(names.iter().any(|n| n == soname), "{soname} missing from {names:?}");
        }
        assert!(!super::library_present("no-such-cuda-library"));
    }
}
