//! Safe cuDNN graph API for LLM inference: fused RMSNorm, attention and matmul graphs with plan
//! caching, fused RoPE and row kernels, each next to its naive PyTorch-eager-style baseline.
//!
//! | layer | what it is |
//! |---|---|
//! | [`Cudnn`], [`Exec`] | the context: plan cache, naive kernels and tuning settings on top of its execution state (cuDNN handle bound to a cudarc stream, workspace), which plans and kernels run on |
//! | [`TensorSpec`], [`Graph`] | graph builder in the cuDNN frontend's shape: typed attributes in, named outputs out, `validate()` without a GPU |
//! | [`Plan`], [`Bindings`] | heuristics (mode A, B when autotuning, then FALLBACK) and a plan finalized for one context's handle, optionally autotuned over engine configurations and knobs ([`Tuning`], [`KnobRange`]); execution checks the handle and every bound buffer |
//! | [`Features`] | what the running cuDNN can do on this GPU, from its version ([`Exec::features`]) |
//! | [`PlanCache`], [`PlanKey`] | plans by op-declared keys (shape/stride/dtype/flags), with hit and miss counters; optionally persistent in a plan directory ([`Cudnn::set_plan_dir`], [`PLAN_DIR_ENV`]), so a new process loads plans and autotuning choices instead of rebuilding them |
//! | [`ops`] | one room per op: [`rms_norm`], [`sdpa`], [`matmul`], [`rope`], [`embedding`] and [`write_cache`], each with its arguments, operands, fused half and eager baseline; backward phases [`rms_norm_backward`], [`sdpa_backward`], [`linear_backward_data`], [`linear_backward_weight`], [`swiglu_down_backward`], [`rope_backward`], [`embedding_backward`]; the training side's custom kernels [`cross_entropy`], [`adamw`], [`grad_norm`] |
//! | [`KvCache`], [`PagedKvCache`], [`RopeFrequencies`] | what a decoder keeps between steps: per-layer K/V caches with per-sequence positions, appends (RoPE fused) and decode attention that picks the one-launch padded form (cuDNN's padded plan, or the split-KV kernel where cuDNN has none) and falls back by itself ([`kv_cache`]); a paged cache of page pools and a page table for sequences that come and go (continuous batching), its decode attention reading K/V through the table; RoPE tables for plain and Llama-3-scaled frequencies |
//! | [`Uploader`] | host-to-device uploads through two pinned staging buffers that host threads fill while the copy engine moves the other (a model's weights at load) |
//! | [`reference`](mod@reference) | f64 CPU references and the comparison used by tests and reports |
//!
//! Recipe for an op call:
//! 1. `let ctx = Cudnn::new(0)?;` (an error, not a panic, without a driver, GPU or cuDNN);
//! 2. allocate buffers on `ctx.stream()` with cudarc;
//! 3. `rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut y), Backend::Fused)?` builds the plan
//!    once per shape, then executes; `Backend::Naive` runs the eager kernels instead.
//!
//! # cudarc and half
//!
//! [`cudarc`] and [`half`] are part of this crate's public API (device buffers are cudarc
//! `DevicePtr`s, the context hands out an `Arc<CudaStream>`, [`Error::Driver`] wraps a cudarc error,
//! 16-bit elements are `half`'s `f16`/`bf16`), so both are re-exported: use `cudnn_llm_ops::cudarc` and
//! `cudnn_llm_ops::half` rather than depending on them yourself. This crate is built against cudarc 0.19
//! with `default-features = false` and the features `std`, `driver`, `nvrtc`, `cublas`, `f16`,
//! `cuda-13000` and `dynamic-loading`: `cuda-13000` because the driver bindings target CUDA 13
//! drivers, `dynamic-loading` because nothing is linked at build time (the CUDA libraries are opened
//! at run time, so the crate builds on a machine without CUDA). A crate that depends on cudarc
//! directly must match this exactly: another `cuda-*` feature or `dynamic-linking` makes cudarc
//! fail to build, and another cudarc version gives two incompatible copies of its types.
#![deny(missing_docs, rustdoc::broken_intra_doc_links)]

pub use cudarc;
pub use half;

mod backend;
mod cache;
mod checked;
mod context;
mod descriptor;
mod disk;
mod dtype;
mod error;
mod exec;
pub mod faults;
mod features;
mod fp8;
mod graph;
mod kernels;
pub mod kv_cache;
pub mod ops;
mod plan;
#[cfg(test)]
mod proptests;
mod raw;
pub mod reference;
mod sources;
pub mod staging;
pub mod startup;
mod tensor;
pub mod testing;
mod version;

pub use backend::Backend;
pub use cache::{CacheStats, PlanCache, PlanKey};
pub use context::{
    default_plan_dir, Cudnn, AUTOTUNE_ENV, AUTOTUNE_MIN_ROWS_ENV, DEFAULT_AUTOTUNE,
    DEFAULT_AUTOTUNE_MIN_ROWS, KNOB_SEARCH_ENV, PLAN_DIR_ENV, TUNE_FLUSH_ENV,
};
pub use dtype::{DataType, Element};
pub use error::{Error, Result};
pub use exec::{
    device_count, open_device, DecodeAttention, DeviceInfo, Exec, GemvSplit, DECODE_ATTENTION_ENV,
    GEMV_SPLIT_ENV, MEMORY_HEADROOM, PDL_ENV,
};
pub use features::Features;
pub use fp8::{F8E4M3, F8E5M2};
pub use graph::{
    Binary, Graph, LayerNormOutputs, Mask, NormPhase, Reduce, RmsNormGradOutputs, RmsNormOutputs,
    SdpaBackwardOptions, SdpaForm, SdpaGradients, SdpaOptions, SdpaOutputs, TensorId, Unary,
};
pub use kernels::KernelRun;
pub use kv_cache::{
    AttendForm, KvCache, KvCacheShape, KvLayer, PageAllocator, PagedForm, PagedKvCache, PagedKvShape,
    QkvRows, SeqId,
};
pub use ops::argmax::{argmax, ArgmaxArgs, ArgmaxOperands, Pick};
pub use ops::decode_layer::{decode_layer, DecodeLayerArgs, DecodeLayerOperands, DecodeLayerWeights};
pub use ops::layernorm::{layer_norm, LayerNormArgs, LayerNormOperands};
pub use ops::loss::{cross_entropy, CrossEntropyArgs, CrossEntropyOperands, Logits};
pub use ops::matmul::{
    fp8_weight_reference, linear_backward_data, linear_backward_weight, matmul, sum_partials,
    sum_partials_reference, swiglu_down_backward, Activation, BufferLens, DataGrad, Epilogue, LinearGradArgs,
    MatmulArgs, MatmulKernel, MatmulOperands, MatrixLayout, Prologue, Rotary, RotaryLens, RotaryOperands,
    SwigluForm, SwigluGrads, WeightGrad, DECODE_GEMV_AUTO_TOKENS, DECODE_GEMV_MAX_TOKENS,
};
pub use ops::optim::{
    adamw, grad_norm, AdamWArgs, AdamWOperands, AdamWTensor, GradNormArgs, GradNormOperands, Grads,
    MultiTensor,
};
pub use ops::quantize::{quantize_fp8, QuantizeArgs, QuantizeOperands, Scaling};
pub use ops::rmsnorm::{rms_norm, rms_norm_backward, RmsNormArgs, RmsNormGrads, RmsNormOperands};
pub use ops::rope::backward::{rope_backward, RopeBackwardOperands};
pub use ops::rope::{
    rope, KvAppend, Llama3Scaling, RopeArgs, RopeFrequencies, RopeOperands, RopeTables, TokenPositions,
};
pub use ops::rows::backward::{embedding_backward, EmbeddingBackwardOperands, EmbeddingGrad};
pub use ops::rows::{
    check_ids, embedding, gather_pages, write_cache, CacheRows, CacheWrite, CacheWriteOperands,
    EmbeddingArgs, EmbeddingOperands, PageGather, PageGatherOperands, PageOrder, PageShape, PageTable,
    TableShape,
};
pub use ops::scaled_matmul::{scaled_matmul, ScaledMatmulArgs, ScaledMatmulOperands, WeightScales};
pub use ops::sdpa::{
    sdpa, sdpa_backward, sdpa_ragged, DeviceRagged, DeviceSeqLens, Layout, RaggedArgs, RaggedBatch,
    RaggedKey, RaggedOperands, RowStrides, SdpaArgs, SdpaGrads, SdpaKernel, SdpaLens, SdpaOperands, SeqLens,
};
pub use plan::{
    knob_name, Bindings, DiskEvent, DiskEventKind, KnobRange, L2Flush, Plan, PlanOrigin, Prepared, Scalar,
    Tuning,
};
pub use staging::Uploader;
pub use tensor::{packed_strides, TensorSpec, DEFAULT_ALIGNMENT, MAX_RANK};
pub use version::{version_string, HEADER_VERSION};
