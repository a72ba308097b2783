//! The context: one object that owns the cuDNN handle (bound to a cudarc stream), the plan cache,
//! the growable workspace and the naive kernels.

use crate::cache::PlanCache;
use crate::features::Features;
use crate::plan::L2Flush;
use crate::raw::{self, Handle, HandleId, RawHandle};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use once_cell::unsync::OnceCell;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

/// Engine configurations matmul plans time on first use unless [`Cudnn::set_autotune`] or
/// [`AUTOTUNE_ENV`] says otherwise.
pub const DEFAULT_AUTOTUNE: usize = 8;

/// Environment variable that sets a new context's autotuning candidates (a positive integer).
pub const AUTOTUNE_ENV: &str = "CUDNN_LLM_AUTOTUNE";

/// Environment variable that sets a new context's knob search: how many engine configurations
/// autotuning may build beyond the heuristics' (a count; 0 turns the search off).
pub const KNOB_SEARCH_ENV: &str = "CUDNN_LLM_KNOB_SEARCH";

/// The candidate count `value` of [`AUTOTUNE_ENV`] asks for, else [`DEFAULT_AUTOTUNE`].
fn autotune_from(value: Option<&str>) -> usize {
    value.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(DEFAULT_AUTOTUNE)
}

/// Environment variable that sets a new context's autotuning L2 flush: `read` (default), `write`
/// or `off` ([`L2Flush`]).
pub const TUNE_FLUSH_ENV: &str = "CUDNN_LLM_TUNE_FLUSH";

/// The knob-search budget `value` of [`KNOB_SEARCH_ENV`] asks for, else 0.
fn knob_search_from(value: Option<&str>) -> usize {
    value.and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0)
}

/// How a plan that autotunes picks its engine configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Heuristics' configurations to finalize and time on the first execution (1 without a knob
    /// search: take the first, untimed).
    pub candidates: usize,
    /// Further configurations the first execution may build and time: knob by knob around the
    /// fastest one so far, while that improves (0: none).
    pub knob_search: usize,
    /// How L2 is emptied before each timed execution.
    pub flush: L2Flush,
}

impl Tuning {
    /// The heuristics' first choice, untimed.
    pub const FIRST: Tuning = Tuning { candidates: 1, knob_search: 0, flush: L2Flush::Read };
}

/// What the context runs on, for reports.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// GPU name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
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
        cudnn_sys::version_string(self.cudnn_version)
    }
}

/// A cuDNN context: handle, stream, plan cache, workspace. Not `Send`: a cuDNN handle must not be used
/// from two threads at once, so create one context per thread (and per device).
pub struct Cudnn {
    // Field order is drop order: plans and workspace go before the handle and the stream.
    cache: PlanCache,
    workspace: RefCell<Option<Rc<CudaSlice<u8>>>>,
    /// Counts reallocations of the buffers ops share through the context (see [`Cudnn::buffer_epoch`]).
    epoch: std::cell::Cell<u64>,
    pub(crate) naive: OnceCell<crate::kernels::Kernels>,
    blas: OnceCell<cudarc::cublas::CudaBlas>,
    autotune: std::cell::Cell<usize>,
    knob_search: std::cell::Cell<usize>,
    tune_flush: std::cell::Cell<L2Flush>,
    handle: Handle,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    features: Features,
}

/// The next buffer epoch ([`Cudnn::buffer_epoch`]): increasing over the whole process.
static NEXT_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn next_epoch() -> u64 {
    NEXT_EPOCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Cudnn {
    /// Opens GPU `ordinal` on a new stream. Fails with [`Error::NoGpu`] when there is no driver or no
    /// device, and [`Error::Load`] when cuDNN is missing or too old; never panics.
    ///
    /// cudarc's cross-stream event tracking stays on (cudarc's default). [`Cudnn::stream`] hands out
    /// the `Arc<CudaStream>`, from which safe code can `fork()` or `context().new_stream()`; with
    /// tracking on, every buffer records an event when a stream writes it (`device_ptr_mut`) and
    /// another when a stream reads it (`device_ptr`), each use first waits on the events it conflicts
    /// with, and a buffer is freed on its stream only after waiting on both. So a buffer written on a
    /// forked stream and read by a fused op here is ordered after the write, and cannot be freed
    /// while the op reads it. Every op takes its callers' pointers through `device_ptr(ctx.stream())`
    /// and holds the guards until its work is enqueued ([`Bindings`](crate::Bindings) keeps them); the
    /// context's own scratch buffers (the naive kernels', padded attention's clamped lengths) are used
    /// on its stream only.
    ///
    /// The cost is an event wait and record per bound buffer on every call (about 1.5 µs of host time
    /// for an RMSNorm, measured before tracking was kept on). A caller who keeps all work on this one
    /// stream may take it back with `unsafe { ctx.stream().context().disable_event_tracking() }` before
    /// allocating: that is an `unsafe` promise to order every other stream by hand, and buffers
    /// allocated afterwards are no longer tracked.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = open_device(ordinal)?;
        let stream = ctx.new_stream()?;
        Self::with_stream(stream)
    }

    /// A context whose cuDNN work goes to `stream`.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        ctx.bind_to_thread()?;
        let (cudnn_version, cudnn_library) = raw::version()?;
        let handle = Handle::new(stream.cu_stream() as *mut std::ffi::c_void)?;
        let info = DeviceInfo {
            ordinal: ctx.ordinal(),
            name: ctx.name()?,
            compute_capability: ctx.compute_capability()?,
            driver_version: raw::driver::driver_version(),
            cudnn_version,
            cudnn_cudart_version: raw::cudart_version()?,
            cudnn_library,
        };
        let features = Features::for_version(info.cudnn_version, info.compute_capability);
        Ok(Cudnn {
            cache: PlanCache::default(),
            workspace: RefCell::new(None),
            epoch: std::cell::Cell::new(next_epoch()),
            naive: OnceCell::new(),
            blas: OnceCell::new(),
            autotune: std::cell::Cell::new(autotune_from(std::env::var(AUTOTUNE_ENV).ok().as_deref())),
            knob_search: std::cell::Cell::new(knob_search_from(
                std::env::var(KNOB_SEARCH_ENV).ok().as_deref(),
            )),
            tune_flush: std::cell::Cell::new(
                std::env::var(TUNE_FLUSH_ENV).ok().and_then(|v| L2Flush::parse(&v)).unwrap_or(L2Flush::Read),
            ),
            handle,
            stream,
            info,
            features,
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

    /// Captures what `f` enqueues on this context's stream as a CUDA graph (thread-local capture
    /// mode), and returns `f`'s value with the instantiated graph. The capture is ended whatever `f`
    /// returns (or if it panics); `f`'s error comes first, then the capture's, and a capture that
    /// recorded no work is [`Error::InvalidArgument`]. Build plans before capturing: no plan is built
    /// inside a capture.
    ///
    /// cudarc's cross-stream event tracking is paused while `f` runs: each buffer use would otherwise
    /// wait on events recorded before the capture began, which a capture may not depend on
    /// (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`). Nothing executes during a capture and everything `f`
    /// enqueues goes to this one stream, so the waits it skips order nothing that runs; a replay of
    /// the graph is ordered by this stream like any other work on it. Buffers allocated inside `f`
    /// carry no events afterwards.
    ///
    /// # Safety
    ///
    /// The pause is a flag of the CUDA context object this context's stream belongs to, which its
    /// forks share: while `capture` runs, no other thread may use buffers or streams of that CUDA
    /// context (their cross-stream waits, and the waits before a free, would be skipped).
    pub unsafe fn capture<R, E: From<Error>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(R, cudarc::driver::CudaGraph), E> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        /// Turns tracking back on and ends an unfinished capture, also when `f` panics.
        struct Paused<'a> {
            stream: &'a Arc<CudaStream>,
            tracking: bool,
            capturing: bool,
        }
        impl Drop for Paused<'_> {
            fn drop(&mut self) {
                if self.tracking {
                    // SAFETY: turns back on what was on; slices allocated meanwhile stay untracked.
                    unsafe { self.stream.context().enable_event_tracking() };
                }
                if self.capturing {
                    let flags = CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
                    let _ = self.stream.end_capture(flags);
                }
            }
        }
        let tracking = self.stream.context().is_event_tracking();
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::from)?;
        let mut paused = Paused { stream: &self.stream, tracking, capturing: true };
        if tracking {
            // SAFETY: the caller promises no other thread uses this CUDA context meanwhile; on this
            // thread only `f`'s captured (not executed) work runs before `paused` turns it back on.
            unsafe { self.stream.context().disable_event_tracking() };
        }
        let ran = f();
        paused.capturing = false;
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        drop(paused);
        let value = ran?;
        let graph = graph.map_err(Error::from)?;
        let graph = graph.ok_or_else(|| Error::invalid("capture: nothing was enqueued".to_string()))?;
        Ok((value, graph))
    }

    /// The plan cache.
    pub fn cache(&self) -> &PlanCache {
        &self.cache
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
            *ws = Some(Rc::new(self.stream.alloc_zeros::<u8>(size)?));
            self.bump_epoch();
        }
        Ok(ws.clone())
    }

    /// Changes whenever a buffer ops share through this context is reallocated to grow (the
    /// workspace, the naive kernels' scratch, padded attention's clamped lengths) or the plan cache is
    /// cleared (plans own the kernels a graph launches). Values come from one process-wide counter,
    /// so two contexts never show the same one. A captured CUDA graph holds those addresses: it is
    /// stale once this value differs from the one at its capture, or on another context.
    pub fn buffer_epoch(&self) -> u64 {
        self.epoch.get().max(self.cache.epoch())
    }

    pub(crate) fn bump_epoch(&self) {
        self.epoch.set(next_epoch());
    }

    /// Makes the context's CUDA context current on this thread (cuDNN uses the current context).
    pub(crate) fn bind(&self) -> Result<()> {
        Ok(self.stream.context().bind_to_thread()?)
    }

    /// How many engine configurations ops that autotune (matmul) finalize and time on first use; 1
    /// takes the heuristics' first choice. Affects plans built afterwards.
    pub fn set_autotune(&self, candidates: usize) {
        self.autotune.set(candidates.max(1));
    }

    /// See [`Cudnn::set_autotune`].
    pub fn autotune(&self) -> usize {
        self.autotune.get()
    }

    /// How many configurations beyond the heuristics' autotuning may build and time, one knob at a
    /// time around the fastest so far ([`Tuning::knob_search`]); 0 (the default unless
    /// [`KNOB_SEARCH_ENV`] is set) turns the search off. Affects plans built afterwards.
    pub fn set_knob_search(&self, budget: usize) {
        self.knob_search.set(budget);
    }

    /// How autotuning empties L2 before each timed execution ([`L2Flush::Read`] unless
    /// [`TUNE_FLUSH_ENV`] says otherwise). Affects plans built afterwards.
    pub fn set_tune_flush(&self, flush: L2Flush) {
        self.tune_flush.set(flush);
    }

    /// What plans that autotune (matmul) are built with: [`Cudnn::set_autotune`],
    /// [`Cudnn::set_knob_search`] and [`Cudnn::set_tune_flush`].
    pub fn tuning(&self) -> Tuning {
        Tuning {
            candidates: self.autotune.get(),
            knob_search: self.knob_search.get(),
            flush: self.tune_flush.get(),
        }
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

    /// Bytes of stream-ordered device memory (every buffer this context and cudarc allocate; not
    /// cuDNN's or cuBLAS's own allocations) in use now, and the most in use since the last
    /// [`Cudnn::reset_peak_memory`].
    pub fn pool_memory(&self) -> Result<(u64, u64)> {
        self.bind()?;
        raw::driver::pool_usage(self.stream.context().cu_device())
    }

    /// Starts a new high-water mark for [`Cudnn::pool_memory`] (at the memory in use now).
    pub fn reset_peak_memory(&self) -> Result<()> {
        self.bind()?;
        raw::driver::reset_pool_peak(self.stream.context().cu_device())
    }

    /// Bytes of workspace currently held.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.borrow().as_ref().map_or(0, |w| w.len())
    }
}

/// Checks for the driver library before cudarc could panic on it, then opens the device.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !raw::driver::library_present() {
        return Err(Error::NoGpu(
            "the CUDA driver library (libcuda.so.1) was not found: install an NVIDIA driver".into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| Error::NoGpu(format!("the CUDA driver did not start: {e}")))?;
    if count == 0 {
        return Err(Error::NoGpu("the driver reports no CUDA device".into()));
    }
    if ordinal >= count as usize {
        return Err(Error::NoGpu(format!("device {ordinal} requested, but only {count} present")));
    }
    Ok(CudaContext::new(ordinal)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knob_search_env_takes_counts() {
        assert_eq!(knob_search_from(None), 0);
        assert_eq!(knob_search_from(Some("64")), 64);
        assert_eq!(knob_search_from(Some("0")), 0);
        assert_eq!(knob_search_from(Some("-3")), 0);
        assert_eq!(knob_search_from(Some("many")), 0);
    }

    #[test]
    fn autotune_env_takes_positive_counts_only() {
        assert_eq!(autotune_from(None), DEFAULT_AUTOTUNE);
        assert_eq!(autotune_from(Some("24")), 24);
        assert_eq!(autotune_from(Some(" 1 ")), 1);
        for bad in ["0", "-3", "many", ""] {
            assert_eq!(autotune_from(Some(bad)), DEFAULT_AUTOTUNE, "{bad:?}");
        }
    }
}
