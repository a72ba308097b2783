//! NVRTC: the library probe, its version, and compiling one program to a CUBIN for one GPU
//! architecture (cudarc's safe API gives PTX only, which the driver would compile again at load).

use cudarc::nvrtc::{result, sys};
use std::ffi::{CStr, CString};

/// Whether libnvrtc can be opened; cudarc panics on its first call otherwise.
pub(crate) fn library_present() -> bool {
    super::library_present("nvrtc")
}

/// NVRTC's `(major, minor)` version. Call only after [`library_present`].
pub(crate) fn version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are to live locals NVRTC writes one int each to.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// Destroys the program when dropped, also on an early return.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once, here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// The options every program compiles with, for `sm_{major}{minor}` (part of a cached CUBIN's key).
pub(crate) fn options((major, minor): (i32, i32)) -> Vec<String> {
    vec![format!("--gpu-architecture=sm_{major}{minor}")]
}

/// Compiles `source` (named `name` in diagnostics) with [`options`] for `arch` and returns the CUBIN,
/// or the compiler's log. Call only after [`library_present`]. Programs are independent: several
/// threads may compile at once.
pub(crate) fn compile_cubin(source: &str, name: &str, arch: (i32, i32)) -> Result<Vec<u8>, String> {
    crate::faults::hit(crate::faults::Site::Compile).map_err(|e| format!("{name}: {e}"))?;
    let src = CString::new(source).map_err(|_| format!("{name}: a NUL byte in the source"))?;
    let cname = CString::new(name).map_err(|_| format!("{name}: a NUL byte in the name"))?;
    let prog = Program(result::create_program(&src, Some(&cname)).map_err(|e| format!("{name}: {e:?}"))?);
    let options = options(arch);
    // SAFETY: the program is live; the options are NUL-free strings cudarc turns into C strings that
    // outlive the call.
    if let Err(e) = unsafe { result::compile_program(prog.0, &options) } {
        // SAFETY: the program is live and was compiled (unsuccessfully), so it has a log.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|raw| {
                let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
                CStr::from_bytes_until_nul(&bytes).map_or_else(
                    |_| String::from_utf8_lossy(&bytes).into_owned(),
                    |c| c.to_string_lossy().into_owned(),
                )
            })
            .unwrap_or_default();
        return Err(format!("{name}: {e:?}\n{log}"));
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; `size` is a live local NVRTC writes to.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result().map_err(|e| format!("{name}: {e:?}"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC said the CUBIN takes.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("{name}: {e:?}"))?;
    Ok(cubin)
}
