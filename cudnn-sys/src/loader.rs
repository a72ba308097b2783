//! Finds and opens `libcudnn.so.9`, then checks symbols and versions before anything calls it.

use crate::bindings::{cudnnStatus_t, CudnnLib};
use once_cell::sync::OnceCell;
use std::path::PathBuf;

/// The oldest cuDNN the graph code supports (9.0.0).
pub const MIN_VERSION: usize = 9_00_00;

cudnn_llm_dylib::required_symbols!(CudnnLib:
    cudnnGetVersion,
    cudnnGetCudartVersion,
    cudnnGetErrorString,
    cudnnGetLastErrorString,
    cudnnGraphVersionCheck,
    cudnnCreate,
    cudnnDestroy,
    cudnnSetStream,
    cudnnBackendCreateDescriptor,
    cudnnBackendDestroyDescriptor,
    cudnnBackendFinalize,
    cudnnBackendSetAttribute,
    cudnnBackendGetAttribute,
    cudnnBackendExecute,
);

pub use cudnn_llm_dylib::Candidate;

/// Why cuDNN could not be used. Each variant says what was tried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// No candidate could be opened.
    #[error("cuDNN not found; tried {}. Install cuDNN 9 (e.g. `pip install nvidia-cudnn-cu13`) and put its lib directory on LD_LIBRARY_PATH, or set CUDNN_LIBRARY=/path/to/libcudnn.so.9", cudnn_llm_dylib::tried(.tried))]
    NotFound {
        /// Every candidate with its error.
        tried: Vec<Candidate>,
    },
    /// The library opened but lacks a function the graph API needs.
    #[error("{library} has no symbol `{symbol}` (is it cuDNN 9 or later?)")]
    MissingSymbol {
        /// The library that was opened.
        library: String,
        /// The first missing symbol.
        symbol: String,
    },
    /// The library is older than [`MIN_VERSION`].
    #[error("{library} is cuDNN {}, but 9.0.0 or later is required", version_string(*.version))]
    TooOld {
        /// The library that was opened.
        library: String,
        /// `cudnnGetVersion()`.
        version: usize,
    },
    /// `cudnnGraphVersionCheck()` failed: the sub-libraries (`libcudnn_graph`, `libcudnn_engines_*`, ...)
    /// come from different cuDNN releases, usually two installs mixed on the library path.
    #[error("{library} (cuDNN {}) has mismatched sub-libraries: cudnnGraphVersionCheck returned status {status}; put one cuDNN's lib directory first on LD_LIBRARY_PATH", version_string(*.version))]
    SubLibraryMismatch {
        /// The library that was opened.
        library: String,
        /// `cudnnGetVersion()`.
        version: usize,
        /// The raw status code.
        status: u32,
    },
}

/// Formats `cudnnGetVersion()`'s encoding as `major.minor.patch`.
pub fn version_string(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

/// An opened, checked cuDNN.
pub struct Loaded {
    /// The function table.
    pub lib: CudnnLib,
    /// The candidate that opened.
    pub library: String,
    /// `cudnnGetVersion()`.
    pub version: usize,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("library", &self.library).field("version", &self.version).finish()
    }
}

static LOADED: OnceCell<Result<Loaded, LoadError>> = OnceCell::new();

/// The process-wide cuDNN, opened on first use: `$CUDNN_LIBRARY` if set (and only it), else
/// `libcudnn.so.9` then `libcudnn.so` through the system loader. The outcome, success or error, is
/// cached.
pub fn load() -> Result<&'static Loaded, LoadError> {
    LOADED
        .get_or_init(|| {
            let candidates = cudnn_llm_dylib::candidates(
                std::env::var_os("CUDNN_LIBRARY"),
                ["libcudnn.so.9", "libcudnn.so"].map(PathBuf::from),
            );
            load_from(&candidates)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens the first candidate that loads and checks it (uncached; [`load`] is the usual entry).
pub fn load_from(candidates: &[PathBuf]) -> Result<Loaded, LoadError> {
    let open = |path: &std::path::Path| {
        // SAFETY: opening a shared library runs its initialisers; cuDNN's are sound to run at any time.
        unsafe { CudnnLib::new(path) }
    };
    match cudnn_llm_dylib::open_first(candidates, open) {
        Ok((lib, name)) => check(lib, name),
        Err(tried) => Err(LoadError::NotFound { tried }),
    }
}

fn check(lib: CudnnLib, library: String) -> Result<Loaded, LoadError> {
    if let Some(symbol) = first_missing(&lib) {
        return Err(LoadError::MissingSymbol { library, symbol: symbol.to_string() });
    }
    // SAFETY: both symbols were checked above; they take no arguments and only read library state.
    let (version, graph) = unsafe { (lib.cudnnGetVersion(), lib.cudnnGraphVersionCheck()) };
    check_version(&library, version, graph)?;
    Ok(Loaded { lib, library, version })
}

/// The version policy, separate from the loading so it can be tested without a library:
/// refuses versions older than [`MIN_VERSION`] and failed sub-library checks.
pub fn check_version(library: &str, version: usize, graph_check: cudnnStatus_t) -> Result<(), LoadError> {
    if version < MIN_VERSION {
        return Err(LoadError::TooOld { library: library.to_string(), version });
    }
    if graph_check != cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Err(LoadError::SubLibraryMismatch {
            library: library.to_string(),
            version,
            status: graph_check.0,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_lists_every_candidate() {
        let err =
            load_from(&[PathBuf::from("/nonexistent/libcudnn.so.9"), PathBuf::from("libcudnn_nope.so.9")])
                .unwrap_err();
        let LoadError::NotFound { tried } = &err else { panic!("{err:?}") };
        assert_eq!(tried.len(), 2);
        assert_eq!(tried[0].name, "/nonexistent/libcudnn.so.9");
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/libcudnn.so.9") && msg.contains("libcudnn_nope.so.9"), "{msg}");
        assert!(msg.contains("CUDNN_LIBRARY"), "{msg}");
    }

    #[test]
    fn a_library_without_cudnn_symbols_is_refused() {
        // libc loads everywhere and has none of cuDNN's symbols.
        let err = load_from(&[PathBuf::from("libc.so.6")]).unwrap_err();
        assert_eq!(
            err,
            LoadError::MissingSymbol { library: "libc.so.6".into(), symbol: "cudnnGetVersion".into() }
        );
        assert!(err.to_string().contains("`cudnnGetVersion`"));
    }

    #[test]
    fn version_policy() {
        let ok = cudnnStatus_t::CUDNN_STATUS_SUCCESS;
        assert!(check_version("x", 9_19_00, ok).is_ok());
        assert!(check_version("x", 9_00_00, ok).is_ok());
        let old = check_version("libcudnn.so.8", 8_09_07, ok).unwrap_err();
        assert_eq!(old, LoadError::TooOld { library: "libcudnn.so.8".into(), version: 8_09_07 });
        assert!(old.to_string().contains("8.9.7"), "{old}");
        let mixed = check_version("x", 9_19_00, cudnnStatus_t::CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH);
        let Err(LoadError::SubLibraryMismatch { status, .. }) = mixed else { panic!("{mixed:?}") };
        assert_eq!(status, cudnnStatus_t::CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH.0);
    }
}
