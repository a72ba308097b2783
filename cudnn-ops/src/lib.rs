//! Safe cuDNN graph API for LLM inference: fused RMSNorm, SDPA and matmul (with epilogues) graphs with
//! plan caching, next to naive PyTorch-eager-style baselines.
//!
//! | layer | what it is |
//! |---|---|
//! | [`Cudnn`] | the context: cuDNN handle bound to a cudarc stream, plan cache, workspace, naive kernels |
//! | [`TensorSpec`], [`Graph`] | graph builder in the cuDNN frontend's shape: typed attributes in, named outputs out, `validate()` without a GPU |
//! | [`Plan`], [`Bindings`] | heuristics (mode A, B when autotuning, then FALLBACK) and a plan finalized for one context's handle, optionally autotuned over engine configurations and knobs ([`Tuning`], [`KnobRange`]); execution checks the handle and every bound buffer |
//! | [`Features`] | what the running cuDNN can do on this GPU, from its version ([`Cudnn::features`]) |
//! | [`PlanCache`], [`PlanKey`] | plans by shape/stride/dtype/flags, with hit and miss counters |
//! | [`ops`] | fused ops: [`ops::rmsnorm::rms_norm`] ... |
//! | [`naive`] | the eager baselines: one kernel per elementary op, f32 intermediates |
//! | [`reference`](mod@reference) | f64 CPU references and the comparison used by tests and reports |
//!
//! Recipe for a fused call:
//! 1. `let ctx = Cudnn::new(0)?;` (an error, not a panic, without a driver, GPU or cuDNN);
//! 2. allocate buffers on `ctx.stream()` with cudarc;
//! 3. `ops::rmsnorm::rms_norm(&ctx, args, &x, &w, &mut y)?` builds the plan once per shape, then executes.
#![deny(missing_docs, rustdoc::broken_intra_doc_links)]

mod cache;
mod checked;
mod context;
mod descriptor;
mod dtype;
mod error;
mod features;
mod graph;
pub mod naive;
pub mod ops;
mod plan;
#[cfg(test)]
mod proptests;
mod raw;
pub mod reference;
mod tensor;

pub use cache::{CacheStats, PlanCache, PlanKey};
pub use context::{
    open_device, Cudnn, DeviceInfo, Tuning, AUTOTUNE_ENV, DEFAULT_AUTOTUNE, KNOB_SEARCH_ENV, TUNE_FLUSH_ENV,
};
pub use dtype::{DataType, Element};
pub use error::{Error, Result};
pub use features::Features;
pub use graph::{
    Binary, Graph, Mask, NormPhase, Reduce, RmsNormOutputs, SdpaForm, SdpaOptions, SdpaOutputs, TensorId,
    Unary,
};
pub use ops::matmul::{
    linear, matmul, matmul_with, Activation, BufferLens, Epilogue, Linear, MatmulArgs, MatrixLayout, Operands,
};
pub use ops::rmsnorm::{rms_norm, rms_norm_train, rms_norm_with, RmsNormArgs};
pub use ops::rope::{rope_at, rope_with, RopeArgs, RopeTables};
pub use ops::rows::{check_ids, embedding, write_cache, write_cache_at, CacheWrite};
pub use ops::sdpa::{sdpa, sdpa_padded, sdpa_train, sdpa_with, Layout, SdpaArgs, SdpaLens};
pub use plan::{knob_name, Bindings, KnobRange, L2Flush, Plan, Prepared, Scalar};
pub use tensor::{packed_strides, TensorSpec, DEFAULT_ALIGNMENT, MAX_RANK};

/// Which implementation a module runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// cuDNN graphs.
    Fused,
    /// One kernel per elementary op, as PyTorch eager.
    Naive,
}

impl Backend {
    /// `fused` or `naive`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Fused => "fused",
            Backend::Naive => "naive",
        }
    }
}

/// The cuDNN version of the headers `cudnn-sys` was generated from (e.g. 91900).
pub const HEADER_VERSION: usize = cudnn_sys::HEADER_VERSION;

/// `major.minor.patch` of a `cudnnGetVersion()` number.
pub fn version_string(v: usize) -> String {
    cudnn_sys::version_string(v)
}
