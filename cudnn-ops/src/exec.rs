//! The execution state plans and kernels run on: the cuDNN handle bound to a cudarc stream, the
//! device it opened, the growable workspace, the cuBLAS handle and the buffer epoch. A [`Cudnn`]
//! owns one and builds its plan cache and kernel registry on top; `plan/`, `kernels/` and `cache`
//! depend on this module, never on the context.
//!
//! [`Cudnn`]: crate::Cudnn

use crate::faults::Zeros;
use crate::features::Features;
use crate::raw::{self, Handle, HandleId, RawHandle};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use once_cell::unsync::OnceCell;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

/// Device memory [`Exec::ensure_free`] keeps free beyond what a caller asks for: cuDNN's and
/// cuBLAS's workspaces and handles, and the driver's own allocations, come out of it.
pub const MEMORY_HEADROOM: usize = 256 << 20;

/// What the context runs on, for reports.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// GPU name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors (what custom kernels size their grids by, e.g. the split-KV decode
    /// attention's splits).
    pub sm_count: usize,
    /// CUDA driver API version (e.g. 13000).
    pub driver_version: i32,
    /// `cudnnGetVersion()`, e.g. 91900.
    pub cudnn_version: usize,
    /// The CUDA runtime cuDNN was built for.
    pub cudnn_cudart_version: usize,
    /// Which library file was opened.
    pub cudnn_library: String,
}

impl DeviceInfo {
    /// cuDNN version as `9.19.0`.
    pub fn cudnn_version_string(&self) -> String {
        cudnn_llm_sys::version_string(self.cudnn_version)
    }
}

/// The execution state of a context ([`Cudnn`](crate::Cudnn) derefs to it): the cuDNN handle bound
/// to one stream, the device it runs on, the workspace plans share, the cuBLAS handle and the buffer
/// epoch. It is what executing a [`Plan`](crate::Plan) or launching a kernel needs, so `&ctx` is
/// accepted wherever an `&Exec` is asked for. Not `Send`, as its context.
pub struct Exec {
    // Field order is drop order: the workspace goes before the handle and the stream.
    workspace: RefCell<Option<Rc<CudaSlice<u8>>>>,
    /// Counts reallocations of the buffers ops share through the context (see
    /// [`Cudnn::buffer_epoch`](crate::Cudnn::buffer_epoch)).
    epoch: std::cell::Cell<u64>,
    blas: OnceCell<cudarc::cublas::CudaBlas>,
    handle: Handle,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    features: Features,
    /// Programmatic dependent launch asked for ([`Exec::set_programmatic_launch`]).
    programmatic: std::cell::Cell<bool>,
    /// How the one-token decode GEMV splits its rows ([`Exec::set_gemv_split`]).
    gemv_split: std::cell::Cell<GemvSplit>,
    /// What a KV cache's fused decode attention runs ([`Exec::set_decode_attention`]).
    decode_attention: std::cell::Cell<DecodeAttention>,
}

/// What the KV caches' fused decode attention (one query per sequence over the cache, lengths on the
/// device: `KvCache::attend`, `PagedKvCache::attend`) runs ([`Exec::set_decode_attention`]); the
/// results agree within the attention tolerances (f32 softmax either way, summation orders differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecodeAttention {
    /// The library's choice (the default): what [`crate::SdpaArgs::fused_kernel`] picks.
    Auto,
    /// cuDNN's padded (or paged) plan where the running cuDNN has it (9.15+), else the split-KV kernel.
    Cudnn,
    /// The split-KV kernel wherever it takes the shape (else cuDNN's plan).
    SplitKv,
}

impl DecodeAttention {
    /// Every choice.
    pub const ALL: [DecodeAttention; 3] =
        [DecodeAttention::Auto, DecodeAttention::Cudnn, DecodeAttention::SplitKv];

    /// `auto`, `cudnn` or `split-kv`, for tables and [`DECODE_ATTENTION_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            DecodeAttention::Auto => "auto",
            DecodeAttention::Cudnn => "cudnn",
            DecodeAttention::SplitKv => "split-kv",
        }
    }

    /// The choice named `auto`, `cudnn` or `split-kv`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name.trim())
    }
}

/// Environment variable that sets a new context's [`DecodeAttention`]: `auto` (default), `cudnn` or
/// `split-kv`; any other value makes opening a context an error that names it.
pub const DECODE_ATTENTION_ENV: &str = "CUDNN_LLM_DECODE_ATTENTION";

/// How the one-token decode GEMV of the fused matmul shares the work of a weight row
/// ([`Exec::set_gemv_split`]); the results are the same up to f32 summation order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GemvSplit {
    /// The library's choice (the default): [`GemvSplit::Warp`] for every shape, the block form
    /// having lost on the shapes it was written for (qkv and o_proj of an 8B model on an H200).
    Auto,
    /// A warp streams whole rows (several round trips per row; the long rows of down_proj, the
    /// many of up/gate and lm_head).
    Warp,
    /// A block of four warps shares each row (one round of loads per row of a few thousand
    /// elements, a finer grid). One token only: more tokens keep the warp form.
    Block,
}

impl GemvSplit {
    /// Every split.
    pub const ALL: [GemvSplit; 3] = [GemvSplit::Auto, GemvSplit::Warp, GemvSplit::Block];

    /// `auto`, `warp` or `block`, for tables and [`GEMV_SPLIT_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            GemvSplit::Auto => "auto",
            GemvSplit::Warp => "warp",
            GemvSplit::Block => "block",
        }
    }

    /// The split named `auto`, `warp` or `block`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name.trim())
    }
}

/// Environment variable that sets a new context's [`GemvSplit`]: `auto` (default), `warp` or `block`;
/// any other value makes opening a context an error that names it.
pub const GEMV_SPLIT_ENV: &str = "CUDNN_LLM_GEMV_SPLIT";

/// Environment variable that turns a new context's programmatic dependent launch off (`0`, `off`,
/// `false` or `no`); anything else, or unset, leaves it on where the GPU has it
/// ([`Exec::set_programmatic_launch`]).
pub const PDL_ENV: &str = "CUDNN_LLM_PDL";

/// The choice `value` of environment variable `var` names (unset: `default`); a value that names none
/// of `all` is an error naming the variable, the value and the names it takes.
fn env_choice<T: Copy>(
    var: &str,
    value: Option<&str>,
    all: &[T],
    name: fn(T) -> &'static str,
    default: T,
) -> Result<T> {
    let Some(value) = value else { return Ok(default) };
    all.iter().copied().find(|&c| name(c) == value.trim()).ok_or_else(|| {
        let names: Vec<&str> = all.iter().map(|&c| name(c)).collect();
        Error::invalid(format!("{var}={value:?}: it takes {}", names.join(", ")))
    })
}

/// The value of environment variable `var`, `None` where it is unset; an error where it is not UTF-8.
fn env_value(var: &str) -> Result<Option<String>> {
    match std::env::var(var) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::invalid(format!("{var}={v:?}: not UTF-8"))),
    }
}

/// Whether `value` of [`PDL_ENV`] leaves programmatic dependent launch on.
fn pdl_from(value: Option<&str>) -> bool {
    !matches!(value.map(|v| v.trim().to_ascii_lowercase()).as_deref(), Some("0" | "off" | "false" | "no"))
}

/// The first compute capability with programmatic dependent launch (Hopper).
const PDL_COMPUTE_CAPABILITY: i32 = 9;

/// The next buffer epoch ([`Cudnn::buffer_epoch`](crate::Cudnn::buffer_epoch)): increasing over the
/// whole process.
static NEXT_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn next_epoch() -> u64 {
    NEXT_EPOCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Exec {
    /// Binds the stream's CUDA context to this thread, creates a cuDNN handle on `stream` and reads
    /// the device's and cuDNN's versions.
    pub(crate) fn open(stream: Arc<CudaStream>) -> Result<Self> {
        // The settings' variables first: a value they do not take opens nothing.
        let gemv_split = env_choice(
            GEMV_SPLIT_ENV,
            env_value(GEMV_SPLIT_ENV)?.as_deref(),
            &GemvSplit::ALL,
            GemvSplit::name,
            GemvSplit::Auto,
        )?;
        let decode_attention = env_choice(
            DECODE_ATTENTION_ENV,
            env_value(DECODE_ATTENTION_ENV)?.as_deref(),
            &DecodeAttention::ALL,
            DecodeAttention::name,
            DecodeAttention::Auto,
        )?;
        let ctx = stream.context().clone();
        ctx.bind_to_thread()?;
        let (cudnn_version, cudnn_library) = raw::version()?;
        let handle = Handle::new(stream.cu_stream() as *mut std::ffi::c_void)?;
        let info = DeviceInfo {
            ordinal: ctx.ordinal(),
            name: ctx.name()?,
            compute_capability: ctx.compute_capability()?,
            sm_count: sm_count(&ctx)?,
            driver_version: raw::driver::driver_version(),
            cudnn_version,
            cudnn_cudart_version: raw::cudart_version()?,
            cudnn_library,
        };
        let features = Features::for_version(info.cudnn_version, info.compute_capability);
        Ok(Exec {
            workspace: RefCell::new(None),
            epoch: std::cell::Cell::new(next_epoch()),
            blas: OnceCell::new(),
            handle,
            stream,
            info,
            features,
            programmatic: std::cell::Cell::new(pdl_from(std::env::var(PDL_ENV).ok().as_deref())),
            gemv_split: std::cell::Cell::new(gemv_split),
            decode_attention: std::cell::Cell::new(decode_attention),
        })
    }

    /// The identity of this context's cuDNN handle (what a [`crate::Plan`] records).
    pub(crate) fn handle_id(&self) -> HandleId {
        self.handle.id()
    }

    /// The stream all work of this context is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Device and library versions.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// What the running cuDNN can do on this GPU (graph forms, limits, workarounds), computed once
    /// from its version when the context opened.
    pub fn features(&self) -> Features {
        self.features
    }

    /// Launches the custom kernels that allow it (the decode GEMV; every fused RoPE kernel, with or
    /// without the K/V append, forward and backward) as
    /// programmatic dependent launches (PDL), so each may start, and stream its weights into L2,
    /// while the kernel before it on the stream drains; they wait for that kernel's completion
    /// before reading its output, so results are the same either way. On by default where the GPU
    /// has it (compute capability 9.0+) unless [`PDL_ENV`] turns it off; asking for it elsewhere
    /// leaves it off. A CUDA graph captured meanwhile records programmatic edges; it keeps them
    /// whatever is set afterwards.
    pub fn set_programmatic_launch(&self, on: bool) {
        self.programmatic.set(on);
    }

    /// Whether custom kernels that allow it launch as programmatic dependent launches now
    /// ([`Exec::set_programmatic_launch`] and compute capability 9.0+).
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic.get() && self.info.compute_capability.0 >= PDL_COMPUTE_CAPABILITY
    }

    /// How the fused matmul's one-token decode GEMV splits a weight row's work from now on
    /// ([`GemvSplit::Auto`] unless [`GEMV_SPLIT_ENV`] or this says otherwise): to compare the forms
    /// (`examples/05-decode`). A CUDA graph captured before keeps what it captured.
    pub fn set_gemv_split(&self, split: GemvSplit) {
        self.gemv_split.set(split);
    }

    /// See [`Exec::set_gemv_split`].
    pub fn gemv_split(&self) -> GemvSplit {
        self.gemv_split.get()
    }

    /// What the KV caches' fused decode attention runs from now on ([`DecodeAttention::Auto`] unless
    /// [`DECODE_ATTENTION_ENV`] or this says otherwise): to compare the kernels in a decode step
    /// (`examples/05-decode`, `examples/07-paged-decode`). A CUDA graph captured before keeps what it
    /// captured.
    pub fn set_decode_attention(&self, choice: DecodeAttention) {
        self.decode_attention.set(choice);
    }

    /// See [`Exec::set_decode_attention`].
    pub fn decode_attention(&self) -> DecodeAttention {
        self.decode_attention.get()
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    pub(crate) fn raw_handle(&self) -> RawHandle {
        self.handle.raw()
    }

    /// A workspace of at least `bytes`, grown (never shrunk) as plans need. The `Rc` keeps an old
    /// buffer alive while a prepared execution still points at it.
    pub(crate) fn workspace(&self, bytes: usize) -> Result<Option<Rc<CudaSlice<u8>>>> {
        if bytes == 0 {
            return Ok(None);
        }
        let mut ws = self.workspace.borrow_mut();
        if ws.as_ref().is_none_or(|w| w.len() < bytes) {
            let size = bytes.next_power_of_two().max(1 << 20);
            *ws = Some(Rc::new(self.stream.zeros::<u8>(size)?));
            self.bump_epoch();
        }
        Ok(ws.clone())
    }

    /// This state's part of [`Cudnn::buffer_epoch`](crate::Cudnn::buffer_epoch): moved by every
    /// reallocation of the workspace or of a buffer the kernels keep ([`Exec::bump_epoch`]).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.get()
    }

    /// Records that a buffer ops share through the context was reallocated.
    pub(crate) fn bump_epoch(&self) {
        self.epoch.set(next_epoch());
    }

    /// Makes the context's CUDA context current on this thread (cuDNN uses the current context).
    pub(crate) fn bind(&self) -> Result<()> {
        Ok(self.stream.context().bind_to_thread()?)
    }

    /// The cuBLAS handle on this context's stream, created on first use (the naive backend's GEMMs).
    pub(crate) fn blas(&self) -> Result<&cudarc::cublas::CudaBlas> {
        self.blas.get_or_try_init(|| {
            if !raw::cublas::library_present() {
                return Err(Error::Blas(
                    "libcublas.so was not found: install the CUDA 13 cuBLAS library".into(),
                ));
            }
            self.bind()?;
            cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|e| Error::Blas(e.to_string()))
        })
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        Ok(cudarc::driver::result::mem_get_info()?)
    }

    /// Checks, before something large is allocated, that `needed` bytes are free with
    /// [`MEMORY_HEADROOM`] to spare for what cuDNN, cuBLAS and the driver allocate on their own:
    /// [`Error::OutOfMemory`] naming `what` (with both sizes) otherwise. A model, cache or pool that
    /// cannot fit then fails before it has allocated most of itself, and the context stays usable.
    pub fn ensure_free(&self, needed: usize, what: impl FnOnce() -> String) -> Result<()> {
        // Buffers dropped on the stream return to the driver only once the stream has run their
        // frees: until then the driver counts them as used.
        self.synchronize()?;
        let (free, _) = self.memory_info()?;
        if needed > free.saturating_sub(MEMORY_HEADROOM) {
            return Err(Error::OutOfMemory { what: what(), needed, free });
        }
        Ok(())
    }

    /// Bytes of stream-ordered device memory (every buffer this context and cudarc allocate; not
    /// cuDNN's or cuBLAS's own allocations) in use now, and the most in use since the last
    /// [`Exec::reset_peak_memory`].
    pub fn pool_memory(&self) -> Result<(u64, u64)> {
        self.bind()?;
        raw::driver::pool_usage(self.stream.context().cu_device())
    }

    /// Starts a new high-water mark for [`Exec::pool_memory`] (at the memory in use now).
    pub fn reset_peak_memory(&self) -> Result<()> {
        self.bind()?;
        raw::driver::reset_pool_peak(self.stream.context().cu_device())
    }

    /// Bytes of workspace currently held.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.borrow().as_ref().map_or(0, |w| w.len())
    }
}

/// The device's multiprocessor count.
fn sm_count(ctx: &CudaContext) -> Result<usize> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    let n = ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    usize::try_from(n).map_err(|_| Error::NoGpu(format!("the driver reports {n} multiprocessors")))
}

/// CUDA devices the driver sees (honouring `CUDA_VISIBLE_DEVICES`); [`Error::NoGpu`] without a
/// driver library or when the driver does not start (never a panic), `Ok(0)` for none.
pub fn device_count() -> Result<usize> {
    if !raw::driver::library_present() {
        return Err(Error::NoGpu(
            "the CUDA driver library (libcuda.so.1) was not found: install an NVIDIA driver".into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| Error::NoGpu(format!("the CUDA driver did not start: {e}")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Checks for the driver library before cudarc could panic on it, then opens the device.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    let count = device_count()?;
    if count == 0 {
        return Err(Error::NoGpu("the driver reports no CUDA device".into()));
    }
    if ordinal >= count {
        return Err(Error::NoGpu(format!("device {ordinal} requested, but only {count} present")));
    }
    Ok(CudaContext::new(ordinal)?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_pdl_variable_turns_it_off_only_when_it_says_so() {
        for (value, on) in [
            (None, true),
            (Some("1"), true),
            (Some("on"), true),
            (Some(""), true),
            (Some("0"), false),
            (Some(" off "), false),
            (Some("FALSE"), false),
            (Some("no"), false),
        ] {
            assert_eq!(super::pdl_from(value), on, "{value:?}");
        }
    }

    #[test]
    fn gemv_splits_parse_their_names() {
        use super::GemvSplit;
        for s in [GemvSplit::Auto, GemvSplit::Warp, GemvSplit::Block] {
            assert_eq!(GemvSplit::parse(s.name()), Some(s));
        }
        assert_eq!(GemvSplit::parse(" block\n"), Some(GemvSplit::Block));
        assert_eq!(GemvSplit::parse("rows"), None);
    }

    #[test]
    fn setting_variables_take_their_names_and_refuse_the_rest() {
        use super::{env_choice, DecodeAttention, GemvSplit};
        let split =
            |v| env_choice("CUDNN_LLM_GEMV_SPLIT", v, &GemvSplit::ALL, GemvSplit::name, GemvSplit::Auto);
        assert_eq!(split(None).unwrap(), GemvSplit::Auto);
        assert_eq!(split(Some(" block\n")).unwrap(), GemvSplit::Block);
        let e = split(Some("rows")).unwrap_err().to_string();
        assert!(e.contains("CUDNN_LLM_GEMV_SPLIT=\"rows\": it takes auto, warp, block"), "{e}");
        let attention = |v| {
            env_choice(
                "CUDNN_LLM_DECODE_ATTENTION",
                v,
                &DecodeAttention::ALL,
                DecodeAttention::name,
                DecodeAttention::Auto,
            )
        };
        assert_eq!(attention(Some("split-kv")).unwrap(), DecodeAttention::SplitKv);
        assert_eq!(attention(None).unwrap(), DecodeAttention::Auto);
        let e = attention(Some("flash")).unwrap_err().to_string();
        assert!(e.contains("CUDNN_LLM_DECODE_ATTENTION=\"flash\": it takes auto, cudnn, split-kv"), "{e}");
        assert!(attention(Some("")).is_err(), "an empty value names nothing");
    }

    #[test]
    fn decode_attention_choices_parse_their_names() {
        use super::DecodeAttention;
        for s in [DecodeAttention::Auto, DecodeAttention::Cudnn, DecodeAttention::SplitKv] {
            assert_eq!(DecodeAttention::parse(s.name()), Some(s));
        }
        assert_eq!(DecodeAttention::parse("split-kv\n"), Some(DecodeAttention::SplitKv));
        assert_eq!(DecodeAttention::parse("flash"), None);
    }
}
