//! The facade of the workspace: re-exports [`cudnn_ops`] and records how this build was made, for
//! bench summaries and reports.
#![deny(missing_docs)]

pub use cudnn_ops;
pub use cudnn_ops::*;
pub use llama;

pub mod bench_util;
pub mod report;

/// How this binary was built.
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
pub const BUILD: BuildInfo = BuildInfo {
    git_revision: env!("BUILD_GIT_REVISION"),
    rustc: env!("BUILD_RUSTC_VERSION"),
    cudnn_headers: env!("BUILD_CUDNN_HEADERS"),
};
