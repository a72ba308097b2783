//! The cuDNN version the bindings were generated from, and how versions are written.

/// The cuDNN version of the headers `cudnn-llm-sys` was generated from (e.g. 91900).
pub const HEADER_VERSION: usize = cudnn_llm_sys::HEADER_VERSION;

/// `major.minor.patch` of a `cudnnGetVersion()` number.
pub fn version_string(v: usize) -> String {
    cudnn_llm_sys::version_string(v)
}
