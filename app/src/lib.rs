//! What the workspace's binaries, benches and whole-stack tests share: the per-module report
//! ([`report`]), the bench and test helpers ([`bench_util`]) and this build's metadata ([`BUILD`]).
//! Not a library to depend on (it is not published); the library is `cudnn-llm`.
#![deny(missing_docs)]

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
