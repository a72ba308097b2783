//! The facade of the workspace: everything of [`cudnn_ops`] at its root, and the Llama-3 decoder as
//! [`llama`].
//!
//! [`cudarc`] and [`half`] are re-exported as `cudnn_ops` re-exports them (cudarc 0.19 with
//! `cuda-13000` and `dynamic-loading`; see the [`cudnn_ops`] crate docs for why): use these rather
//! than depending on either crate yourself, or match that version and those features exactly.
//!
//! The binaries, benches and reports built on it are the workspace's `cudnn-llm-app` member; this
//! crate brings no CLI, plotting or serialization dependency.
#![deny(missing_docs)]

pub use cudnn_llm_llama as llama;
pub use cudnn_llm_ops as cudnn_ops;
pub use cudnn_llm_ops::*;
pub use cudnn_llm_ops::{cudarc, half};
