//! Raw bindings of cuDNN 9's graph (backend) API, `cudnn_graph.h`, and the run-time loader.
//!
//! * [`bindings`] is bindgen's output for the cuDNN 9.19 headers (see `HEADER_VERSION`), committed and
//!   regenerated with `cudnn-sys/regen.sh` (`--check` diffs against the committed file). Every C enum is
//!   a newtype over `u32` with associated constants, so a value written back by a newer cuDNN is never
//!   undefined behaviour.
//! * [`load`] opens `libcudnn.so.9` at run time (nothing links against cuDNN at build time) and checks
//!   that the symbols the safe layer calls are present, the version is 9.x or later and the
//!   sub-libraries agree. Every failure is a [`LoadError`], never a panic.
//!
//! This crate holds no safe wrappers: those are in `cudnn-llm-ops`.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, clippy::all)]

#[rustfmt::skip]
pub mod bindings;
mod loader;

pub use bindings::*;
pub use loader::{
    check_version, load, load_from, version_string, Candidate, LoadError, Loaded, MIN_VERSION,
    REQUIRED_SYMBOLS,
};

/// The cuDNN version of the headers the bindings were generated from, as `cudnnGetVersion()` encodes
/// it (`major * 10000 + minor * 100 + patch`).
pub const HEADER_VERSION: usize = (CUDNN_MAJOR * 10000 + CUDNN_MINOR * 100 + CUDNN_PATCHLEVEL) as usize;
