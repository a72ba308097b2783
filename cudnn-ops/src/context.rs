//! The context: one object that owns the execution state ([`Exec`]: cuDNN handle bound to a cudarc
//! stream, workspace, cuBLAS handle), the plan cache, the naive kernels and the tuning settings.
//!
//! It sits on top of what it owns: plans (`plan/`) and the kernels (`kernels/`) run on an [`Exec`]
//! and the cache draws its epochs from `exec`; none of them names the context. A `Cudnn` derefs to
//! its `Exec`, so `plan.execute(&ctx, ..)` and the kernels' `launch(ctx, ..)` take it as one.

use crate::cache::PlanCache;
use crate::exec::{open_device, Exec};
use crate::kernels::{KernelRun, Kernels};
use crate::plan::store::{default_dir_from, dir_from_setting, Environment, PlanStore};
use crate::plan::{L2Flush, Tuning};
use crate::{Error, Result};
use cudarc::driver::CudaStream;
use once_cell::unsync::OnceCell;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Engine configurations matmul plans time on first use unless [`Cudnn::set_autotune`] or
/// [`AUTOTUNE_ENV`] says otherwise.
pub const DEFAULT_AUTOTUNE: usize = 8;

/// Environment variable that sets a new context's autotuning candidates (a positive integer).
pub const AUTOTUNE_ENV: &str = "CUDNN_LLM_AUTOTUNE";

/// Matmuls of fewer rows than this take the heuristics' first choice unless
/// [`Cudnn::set_autotune_min_rows`] or [`AUTOTUNE_MIN_ROWS_ENV`] says otherwise ([`Tuning::for_rows`]).
pub const DEFAULT_AUTOTUNE_MIN_ROWS: usize = 128;

/// Environment variable that sets a new context's [`Cudnn::set_autotune_min_rows`] (a count; 0 tunes
/// every size).
pub const AUTOTUNE_MIN_ROWS_ENV: &str = "CUDNN_LLM_AUTOTUNE_MIN_ROWS";

/// The row threshold `value` of [`AUTOTUNE_MIN_ROWS_ENV`] asks for, else [`DEFAULT_AUTOTUNE_MIN_ROWS`].
fn autotune_min_rows_from(value: Option<&str>) -> usize {
    value.and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(DEFAULT_AUTOTUNE_MIN_ROWS)
}

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

/// Environment variable that sets a new context's plan directory ([`Cudnn::set_plan_dir`]): a path;
/// `on` (or `1`, `default`) for [`default_plan_dir`]; `off` (or empty, `0`, `none`) for none. Unset,
/// a context keeps no plans on disk.
pub const PLAN_DIR_ENV: &str = "CUDNN_LLM_PLAN_DIR";

/// Where plans persist when asked for without a path: `$XDG_CACHE_HOME/cudnn-llm/plans`, else
/// `$HOME/.cache/cudnn-llm/plans`; `None` when neither variable is set.
pub fn default_plan_dir() -> Option<PathBuf> {
    default_dir_from(std::env::var_os("XDG_CACHE_HOME").as_deref(), std::env::var_os("HOME").as_deref())
}

/// The knob-search budget `value` of [`KNOB_SEARCH_ENV`] asks for, else 0.
fn knob_search_from(value: Option<&str>) -> usize {
    value.and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0)
}

/// A cuDNN context: its execution state ([`Exec`]: handle, stream, workspace), plan cache, naive
/// kernels and tuning settings. It derefs to its [`Exec`], whose methods (`stream`, `info`,
/// `features`, `synchronize`, the memory queries) are the context's. Not `Send`: a cuDNN handle must
/// not be used from two threads at once, so create one context per thread (and per device).
pub struct Cudnn {
    // Field order is drop order: plans and kernels go before the execution state (workspace,
    // handle, stream).
    cache: PlanCache,
    kernels: OnceCell<Kernels>,
    autotune: Cell<usize>,
    autotune_min_rows: Cell<usize>,
    knob_search: Cell<usize>,
    tune_flush: Cell<L2Flush>,
    exec: Exec,
}

impl Cudnn {
    /// Opens GPU `ordinal` on a new stream. Fails with [`Error::NoGpu`](crate::Error::NoGpu) when
    /// there is no driver or no device, and [`Error::Load`](crate::Error::Load) when cuDNN is missing
    /// or too old; never panics.
    ///
    /// cudarc's cross-stream event tracking stays on (cudarc's default). [`Exec::stream`] hands out
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
        let stream = crate::startup::timed(
            "context",
            || open_device(ordinal).and_then(|ctx| Ok(ctx.new_stream()?)),
            |_| format!("driver and device {ordinal}"),
        )?;
        Self::with_stream(stream)
    }

    /// A context whose cuDNN work goes to `stream`.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Self> {
        crate::faults::from_env()?;
        let exec = crate::startup::timed("handles", || Exec::open(stream), |_| "cuDNN and cuBLAS".into())?;
        let ctx = Cudnn {
            cache: PlanCache::default(),
            kernels: OnceCell::new(),
            autotune: Cell::new(autotune_from(std::env::var(AUTOTUNE_ENV).ok().as_deref())),
            autotune_min_rows: Cell::new(autotune_min_rows_from(
                std::env::var(AUTOTUNE_MIN_ROWS_ENV).ok().as_deref(),
            )),
            knob_search: Cell::new(knob_search_from(std::env::var(KNOB_SEARCH_ENV).ok().as_deref())),
            tune_flush: Cell::new(
                std::env::var(TUNE_FLUSH_ENV).ok().and_then(|v| L2Flush::parse(&v)).unwrap_or(L2Flush::Read),
            ),
            exec,
        };
        let dir = dir_from_setting(std::env::var_os(PLAN_DIR_ENV).as_deref(), default_plan_dir);
        ctx.set_plan_dir(dir.as_deref());
        Ok(ctx)
    }

    /// How many kernels one replay of `graph` launches (its kernel nodes; NCCL's and cuDNN's count
    /// like ours), and how many nodes it has in all: what bounds a small model's decode step when its
    /// bytes do not.
    pub fn graph_kernels(graph: &cudarc::driver::CudaGraph) -> Result<(usize, usize)> {
        crate::raw::driver::graph_kernels(graph)
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
        let stream = self.stream();
        let tracking = stream.context().is_event_tracking();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::from)?;
        let mut paused = Paused { stream, tracking, capturing: true };
        if tracking {
            // SAFETY: the caller promises no other thread uses this CUDA context meanwhile; on this
            // thread only `f`'s captured (not executed) work runs before `paused` turns it back on.
            unsafe { stream.context().disable_event_tracking() };
        }
        let ran = f();
        paused.capturing = false;
        let graph =
            stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
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

    /// Keeps finalized plans and autotuning choices in `dir` (`None`: nowhere), so that a later
    /// process, or a later context, loads them instead of running heuristics and autotuning again.
    /// Affects plans built afterwards; [`default_plan_dir`] is the conventional place. Off unless
    /// [`PLAN_DIR_ENV`] or this says otherwise: a library does not write to the home directory
    /// unasked, and a process that measures cold plan builds (the speedup report, the tests) must
    /// not find them warm; a server or a command-line tool turns it on (`generate` does).
    ///
    /// One file per plan key, named by a stable hash of the key, holding the plan's JSON
    /// (`CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION`) where cuDNN serializes the engine, and the
    /// engine and knobs always (where it does not, a later process finalizes that one configuration,
    /// skipping heuristics and autotuning but not the engine's compilation). A file is used only for
    /// the very graph it was built from (the graph's whole description and tuning are stored and
    /// compared) on the same GPU model and SM count, driver, cuDNN and crate version; anything else,
    /// a damaged file, or one cuDNN refuses, is rebuilt and replaced, recorded in
    /// [`PlanCache::disk_events`] and said once on stderr, never an error. Files are written to a
    /// temporary name and renamed, so processes sharing the directory never read a partial one. The
    /// directory is created on the first write; [`PlanCache::stats`] counts disk hits, misses,
    /// rejections and writes.
    ///
    /// The custom kernels (the naive baselines' and the decode room's) keep their compiled CUBINs in
    /// its `kernels/` folder, one per op room, keyed by the room's source, the GPU architecture, NVRTC
    /// and the driver, under the same trust rules: the directory the context has when it first uses
    /// its kernels or op-owned buffers is the one used. [`startup::phases`](crate::startup::phases) says what was compiled and
    /// what was loaded.
    pub fn set_plan_dir(&self, dir: Option<&Path>) {
        let store = dir.map(|d| PlanStore::new(d.to_path_buf(), self.environment()));
        self.cache.set_store(store);
    }

    /// The plan directory ([`Cudnn::set_plan_dir`]), if plans persist.
    pub fn plan_dir(&self) -> Option<PathBuf> {
        self.cache.store_dir()
    }

    /// What a stored plan must have been built on: this GPU (model and SM count), driver, cuDNN and
    /// crate version.
    fn environment(&self) -> Environment {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS;
        let info = self.info();
        let (major, minor) = info.compute_capability;
        Environment {
            gpu: info.name.clone(),
            // 0 if the driver will not say: then it never matches a file that says otherwise.
            sm_count: self.stream().context().attribute(SMS).map_or(0, |n| n.max(0) as u32),
            compute_capability: (major.max(0) as u32, minor.max(0) as u32),
            driver: info.driver_version as i64,
            cudnn: info.cudnn_version as u64,
            crate_version: crate::plan::store::build_fingerprint(),
        }
    }

    /// The custom kernels fused ops ran in place of a cuDNN plan (the decode GEMV of
    /// [`matmul`](crate::matmul)), one entry per configuration with its call count, sorted by name;
    /// [`Cudnn::cache`] lists the plans.
    pub fn kernel_runs(&self) -> Vec<KernelRun> {
        self.kernels.get().map(Kernels::runs).unwrap_or_default()
    }

    /// Changes whenever a buffer ops share through this context is reallocated to grow (the
    /// workspace, the naive kernels' scratch, padded attention's clamped lengths) or the plan cache is
    /// cleared (plans own the kernels a graph launches). Values come from one process-wide counter,
    /// so two contexts never show the same one. A captured CUDA graph holds those addresses: it is
    /// stale once this value differs from the one at its capture, or on another context.
    pub fn buffer_epoch(&self) -> u64 {
        self.exec.epoch().max(self.cache.epoch())
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

    /// Matmuls of fewer rows than `rows` (per batch) take the heuristics' first choice instead of
    /// autotuning ([`Tuning::for_rows`]: they are bound by their weights' bytes); 0 tunes every size.
    /// [`DEFAULT_AUTOTUNE_MIN_ROWS`] unless [`AUTOTUNE_MIN_ROWS_ENV`] is set. Affects plans built
    /// afterwards.
    pub fn set_autotune_min_rows(&self, rows: usize) {
        self.autotune_min_rows.set(rows);
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
    /// [`Cudnn::set_autotune_min_rows`], [`Cudnn::set_knob_search`] and [`Cudnn::set_tune_flush`].
    pub fn tuning(&self) -> Tuning {
        Tuning {
            candidates: self.autotune.get(),
            knob_search: self.knob_search.get(),
            flush: self.tune_flush.get(),
            min_rows: self.autotune_min_rows.get(),
        }
    }
}

/// A context is its execution state plus what it caches on it: `&ctx` goes wherever an `&Exec` is
/// asked for (plan execution, kernel launches).
impl std::ops::Deref for Cudnn {
    type Target = Exec;

    fn deref(&self) -> &Exec {
        &self.exec
    }
}

impl Kernels {
    /// The context's kernel registry (its program compiles for the device on the first launch). Here,
    /// not in `kernels/`: the context owns the registry, and the kernels know only the [`Exec`] they
    /// launch on.
    pub(crate) fn get(ctx: &Cudnn) -> Result<&Kernels> {
        Ok(ctx.kernels.get_or_init(|| Kernels::new(ctx.plan_dir())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Op-owned buffers: one per slot, grown (zeroed, moving the buffer epoch) and never shrunk, back
    /// in the slot when the guard drops, refused while held or under another element type.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn op_owned_buffers_grow_return_and_refuse_a_second_holder() {
        use crate::kernels::{Kernels, Owned};
        use cudarc::driver::DevicePtr;
        const A: Owned<f32> = Owned::new("test slot a");
        const A_AS_I32: Owned<i32> = Owned::new("test slot a");
        let ctx = Cudnn::new(0).expect("this test needs a CUDA GPU with cuDNN");
        let k = Kernels::get(&ctx).unwrap();
        let e0 = ctx.buffer_epoch();
        let buf = k.owned(&ctx, A, 100).unwrap();
        assert!(buf.len() >= 100);
        assert_eq!(ctx.stream().clone_dtoh(&*buf).unwrap(), vec![0.0; buf.len()], "zeroed when allocated");
        let e1 = ctx.buffer_epoch();
        assert!(e1 > e0, "an allocation moves the epoch");
        let e = k.owned(&ctx, A, 10).err().unwrap().to_string();
        assert!(e.contains("already in use"), "{e}");
        let e = k.owned(&ctx, A_AS_I32, 10).err().unwrap().to_string();
        assert!(e.contains("another element type"), "{e}");
        let addr = buf.device_ptr(ctx.stream()).0;
        drop(buf);
        let again = k.owned(&ctx, A, 50).unwrap();
        assert_eq!(again.device_ptr(ctx.stream()).0, addr, "the same buffer, not shrunk");
        assert_eq!(ctx.buffer_epoch(), e1, "no allocation, no new epoch");
        drop(again);
        let bigger = k.owned(&ctx, A, 1000).unwrap();
        assert!(bigger.len() >= 1000 && ctx.buffer_epoch() > e1);
    }

    #[test]
    fn small_matmuls_take_the_first_choice_unless_asked() {
        assert_eq!(autotune_min_rows_from(None), DEFAULT_AUTOTUNE_MIN_ROWS);
        assert_eq!(autotune_min_rows_from(Some(" 0 ")), 0);
        assert_eq!(autotune_min_rows_from(Some("x")), DEFAULT_AUTOTUNE_MIN_ROWS);
        let t = Tuning::FIRST.with_candidates(8).with_knob_search(12).with_min_rows(128);
        assert_eq!(t.for_rows(128), t, "at the threshold: tuned");
        let small = t.for_rows(127);
        assert_eq!((small.candidates, small.knob_search, small.min_rows), (1, 0, 128));
        assert_eq!(small.flush, t.flush);
        assert_eq!(t.with_min_rows(0).for_rows(1), t.with_min_rows(0), "0 tunes every size");
    }

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
