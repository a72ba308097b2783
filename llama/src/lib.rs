//! A Llama-3 decoder whose modules run on fused cuDNN graphs or on naive eager-style kernels, chosen per
//! module kind and per layer, so that the same model measures what each fusion buys.
//!
//! | module | what it holds |
//! |---|---|
//! | [`config`] | the Llama-3.2-1B / Llama-3.1-8B / Llama-3.1-70B presets, a tiny test preset, Hugging Face `config.json` |
//! | [`chat`] | chat templates (Jinja, as transformers' `apply_chat_template`) from a checkpoint directory or a GGUF file |
//! | [`gguf`] | llama.cpp GGUF files (v2, v3): metadata as a config, tensors dequantized (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K, Q8_K), Q/K rows in Hugging Face's order |
//! | [`weights`] | host weights: seeded random init, Hugging Face safetensors checkpoints (single or sharded) |
//! | [`backends`] | which backend each module kind (and layer) runs on, and its string form |
//! | [`model`] | the decoder on the GPU: layers of modules (norm, attention, MLP in `src/modules/`), per-module backends, KV cache, fallbacks, an observer hook |
//! | [`generate`] | token generation: prefill, decode steps, last-position logits, stopping at EOS |
//! | [`batching`] | continuous batching over a paged KV cache: add a request (its prefill), step every live sequence at its own length, remove a finished one and reuse its pages; a CUDA graph per batch-size bucket |
//! | [`sampling`] | choosing the next token from host logits: greedy, temperature, top-k, top-p, seeded |
//! | [`tokenizer`] | Hugging Face `tokenizer.json`: encoding, decoding, streaming text as tokens arrive |
//! | [`profile`] | attributing kernels to module ranges (what an Nsight Systems NVTX projection shows) |
//! | [`rope`] | Llama-3 RoPE frequencies and the cos/sin tables |
//! | [`roofline`] | the bytes a decode step reads, its memory floor |
//! | [`trace`] | an observer recording NVTX ranges, CUDA events and host timestamps per module call |
//! | [`tp`] | tensor parallelism over the GPUs of one host: the sharding math, sharded loading, one thread per rank ([`tp::TpLlama`]) |
//! | [`nccl`] | the `cudnn-llm-nccl` crate, re-exported: NCCL opened at run time, communicators, in-place all-reduce and all-gather on a rank's stream, aborts |
//! | [`train`] | training: the forward that saves activations, the loss, the backward through every module, gradient accumulation, clipping, AdamW ([`Trainer`]) |
//! | [`reference`](mod@reference) | an f64 CPU forward of the whole model, and the training loss with its gradients, for tests |
#![deny(missing_docs, rustdoc::broken_intra_doc_links)]

pub mod backends;
pub mod batching;
pub mod chat;
pub mod config;
pub mod generate;
pub mod gguf;
mod json;
pub mod model;
mod modules;
pub use cudnn_llm_nccl as nccl;
pub mod profile;
pub mod reference;
pub mod roofline;
pub mod rope;
pub mod sampling;
pub mod tokenizer;
pub mod tp;
pub mod trace;
pub mod train;
pub mod weights;

pub use backends::{Backends, ModuleKind, Site};
pub use batching::{BatchConfig, BatchEngine, GraphCounts, StepTimes};
pub use config::{Fp8Checkpoint, Fp8Factors, LlamaConfig};
pub use cudnn_llm_ops::Backend;
pub use generate::{DecodeMode, Generation, Generator, SamplingPath, StopReason, PIPELINE_STEPS};
pub use model::{
    DecodeFusion, DecodeGraph, Fallback, KvCache, Llama, NoObserver, Observer, PagedCache, PagedDecodeGraph,
};
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;
pub use train::{Batch, StepStats, TrainConfig, Trainer};

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong building or running the model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bad configuration or preset name.
    #[error("config: {0}")]
    Config(String),
    /// A checkpoint cannot be read, or a tensor in it is missing or mis-shaped.
    #[error("weights: {0}")]
    Weights(String),
    /// A bad backend selection string.
    #[error("backends: {0}")]
    Backends(String),
    /// A sampling parameter out of its range (the message names it), or logits that cannot be sampled.
    #[error("sampling: {0}")]
    Sampling(String),
    /// A `tokenizer.json` that cannot be read, or text or ids it cannot encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A generation request that does not fit the generator (an empty prompt, a cache too small).
    #[error("generate: {0}")]
    Generate(String),
    /// A training batch or configuration the trainer does not take (the message names what).
    #[error("train: {0}")]
    Train(String),
    /// A cuDNN, CUDA or argument error from the ops layer.
    #[error(transparent)]
    Ops(#[from] cudnn_llm_ops::Error),
    /// NCCL missing, too old or refusing a call, or a communicator torn down.
    #[error("nccl: {0}")]
    Nccl(#[from] nccl::NcclError),
    /// A tensor-parallel setup this crate does not run (the message names what: more ranks than
    /// GPUs, heads or sizes that do not split over the ranks, a team torn down by a failed rank).
    #[error("tensor parallel: {0}")]
    Tp(String),
    /// One rank of a tensor-parallel model failed; the others were torn down.
    #[error("rank {rank}: {error}")]
    Rank {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        error: Box<Error>,
    },
}
