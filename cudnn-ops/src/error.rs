//! The one error type of the crate. Every failure is a value; nothing here panics on bad input.

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, from a missing driver to a graph cuDNN cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A cuDNN call failed. `status` is the numeric code, `name` its `cudnnGetErrorString` name,
    /// `message` the text of `cudnnGetLastErrorString` right after the failure.
    #[error("cuDNN {step} failed: {name} ({status}){}", detail(.message))]
    Cudnn {
        /// The step that failed, e.g. `finalize OPERATIONGRAPH` or `execute`.
        step: String,
        /// The raw `cudnnStatus_t`.
        status: u32,
        /// Its name.
        name: String,
        /// cuDNN's last error message (may be empty).
        message: String,
    },
    /// cuDNN (or this library) cannot run what was asked on this GPU and version. Callers can fall back
    /// to another implementation.
    #[error("not supported: {op}: {reason}")]
    NotSupported {
        /// The op or graph, with its shape.
        op: String,
        /// Why: the cuDNN status and message, or the library's own rule.
        reason: String,
    },
    /// A graph failed validation; names the offending tensor.
    #[error("invalid graph `{graph}`: tensor `{tensor}`: {reason}")]
    InvalidGraph {
        /// The graph's name.
        graph: String,
        /// The offending tensor's name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An argument (shape, buffer length, alignment, binding) is wrong. Nothing was written.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A plan, bindings or buffer was used with a context other than its own: a plan finalized for
    /// another context's handle, bindings made for another stream, or a buffer on another device.
    /// Nothing was enqueued.
    #[error("wrong context: {0}")]
    WrongContext(String),
    /// cuDNN could not be loaded or is too old.
    #[error(transparent)]
    Load(#[from] cudnn_llm_sys::LoadError),
    /// No usable GPU: no driver library, no device, or the driver refused to start.
    #[error("no CUDA GPU: {0}")]
    NoGpu(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC is missing or a kernel failed to compile.
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// cuBLAS is missing or a cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// Device memory does not fit what was asked (checked before allocating).
    #[error("out of device memory: {what} needs {needed} bytes, {free} bytes are free")]
    OutOfMemory {
        /// What needed the memory, with its shape.
        what: String,
        /// Bytes needed.
        needed: usize,
        /// Bytes free on the device when checked.
        free: usize,
    },
    /// A failure injected by a test ([`crate::faults`]): the `count`th injected at `site`.
    #[error("injected failure: the {} injected `{site}` failure (CUDNN_LLM_FAULTS or faults::fail_nth)", ordinal(*.count))]
    Injected {
        /// The site's name (`alloc`, `plan`, `compile`, `collective`, `replay`).
        site: &'static str,
        /// How many failures this site has injected, this one included.
        count: u64,
    },
    /// A paged KV cache has fewer free pages than a step needs (its sequences grow into new pages).
    /// Nothing was allocated; free pages (remove a finished sequence) or make a larger pool.
    #[error("out of KV cache pages: {what} needs {needed} more pages, {free} of {total} are free")]
    OutOfPages {
        /// What needed the pages (the step and its sequences).
        what: String,
        /// Pages needed.
        needed: usize,
        /// Pages free.
        free: usize,
        /// Pages of the pool.
        total: usize,
    },
}

fn detail(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

impl Error {
    /// Whether this is, or wraps the text of, a failure a test injected ([`crate::faults`]).
    pub fn is_injected(&self) -> bool {
        matches!(self, Error::Injected { .. }) || self.to_string().contains("injected failure:")
    }

    /// True for [`Error::NotSupported`]: the request is valid but has no implementation here.
    pub fn is_not_supported(&self) -> bool {
        matches!(self, Error::NotSupported { .. })
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

/// `ensure!`-style early return with an [`Error::InvalidArgument`].
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Error::InvalidArgument(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;

/// `1st`, `2nd`, `3rd`, `4th`, ...
fn ordinal(n: u64) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}
