//! NVRTC: only the library probe (compilation goes through cudarc's safe `compile_ptx_with_opts`).

/// Whether libnvrtc can be opened; cudarc panics on its first call otherwise.
pub(crate) fn library_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened; nothing is called in it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
