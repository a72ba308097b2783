//! The facade of the workspace: everything of [`cudnn_ops`] at its root, and the Llama-3 decoder as
//! [`llama`].
//!
//! [`cudarc`] and [`half`] are re-exported as `cudnn_ops` re-exports them (cudarc 0.19 with
//! `cuda-13000` and `dynamic-loading`; see the [`cudnn_ops`] crate docs for why): use these rather
//! than depending on either crate yourself, or match that version and those features exactly.
//!
//! With the `app` feature (off by default) it also holds what the workspace's binaries, benches and
//! tests share: the per-module report, the bench and test helpers and this build's metadata. They are
//! not part of the library's API and bring CLI, plotting and serialization dependencies.
#![deny(missing_docs)]

pub use cudnn_llm_llama as llama;
pub use cudnn_llm_ops as cudnn_ops;
pub use cudnn_llm_ops::*;
pub use cudnn_llm_ops::{cudarc, half};

#[cfg(feature = "app")]
pub mod bench_util;
#[cfg(feature = "app")]
pub mod report;

/// How this binary was built.
#[cfg(feature = "app")]
#[derive(Debug, Clone, Copy)]
pub struct BuildInfo {
    /// `git rev-parse --short HEAD`, with `-dirty` for uncommitted tracked changes.
    pub git_revision: &'static str,
    /// `rustc --version`.
    pub rustc: &'static str,
    /// The cuDNN headers the bindings came from (`cudnn-sys/HEADER_VERSION`).
    pub cudnn_headers: &'static str,
}

/// Build metadata recorded by `build.rs`.
#[cfg(feature = "app")]
pub const BUILD: BuildInfo = BuildInfo {
    git_revision: env!("BUILD_GIT_REVISION"),
    rustc: env!("BUILD_RUSTC_VERSION"),
    cudnn_headers: env!("BUILD_CUDNN_HEADERS"),
};
