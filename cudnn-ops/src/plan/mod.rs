//! Execution plans: heuristics, finalization, buffer checks and execution through a variant pack.

use crate::descriptor::{Attr, Descriptor};
use crate::dtype::{DataType, Element};
use engine::{knob_ranges, EngineChoice};
use crate::tensor::TensorSpec;
use autotune::Flusher;
use crate::{Cudnn, Error, Result, Tuning};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudnn_sys as sys;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::rc::Rc;
use std::time::{Duration, Instant};
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

mod autotune;
mod engine;

pub use autotune::L2Flush;
pub use engine::{knob_name, KnobRange};

/// A by-value scalar: a host value cuDNN reads at execute time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    /// 32-bit float.
    F32(f32),
    /// 32-bit integer.
    I32(i32),
}

impl Scalar {
    /// The scalar's dtype.
    pub fn dtype(self) -> DataType {
        match self {
            Scalar::F32(_) => DataType::F32,
            Scalar::I32(_) => DataType::I32,
        }
    }

    /// The value's bytes, in a box whose address stays put while the variant pack points at it.
    fn boxed(self) -> Box<[u8; 4]> {
        Box::new(match self {
            Scalar::F32(v) => v.to_ne_bytes(),
            Scalar::I32(v) => v.to_ne_bytes(),
        })
    }
}

/// What a graph hands over to become a plan.
pub(crate) struct PlanParts {
    pub(crate) name: String,
    pub(crate) form: String,
    pub(crate) graph: Descriptor,
    pub(crate) descriptors: Vec<Descriptor>,
    /// Tensors the caller binds.
    pub(crate) tensors: Vec<TensorSpec>,
    /// By-value tensors the plan binds itself (uid, value).
    pub(crate) constants: Vec<(i64, Scalar)>,
}

/// One finalized engine configuration of a graph.
struct Candidate {
    // Field order is drop order: the plan goes before the configuration it was finalized from.
    plan: Descriptor,
    workspace: usize,
    choice: EngineChoice,
    /// The engine configuration and, for configurations built here, its engine and knob choices.
    _config: Vec<Descriptor>,
}

impl Candidate {
    fn new(ctx: &Cudnn, config: Descriptor, choice: EngineChoice, parts: Vec<Descriptor>) -> Result<Self> {
        let plan = finalize_plan(ctx, &config)?;
        let workspace = plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
        let mut keep = vec![config];
        keep.extend(parts);
        Ok(Candidate { plan, workspace, choice, _config: keep })
    }
}

/// A finalized execution plan and what it needs bound at execute time.
///
/// A plan may hold several finalized engine configurations (see [`crate::Graph::build_tuned`]): the
/// first execution then times each on the caller's buffers, may build more by changing one knob at a
/// time around the fastest ([`Tuning::knob_search`]), and keeps the fastest (the frontend's
/// autotuning); until then, and with one candidate and no knob search, the heuristics' first choice
/// runs.
pub struct Plan {
    // Field order is drop order: the plans go before the graph descriptors they were built from.
    candidates: RefCell<Vec<Rc<Candidate>>>,
    chosen: Cell<usize>,
    tuned: Cell<bool>,
    knob_search: usize,
    flush: crate::L2Flush,
    timings: RefCell<Vec<(String, f64)>>,
    _graph: Descriptor,
    _parts: Vec<Descriptor>,
    tensors: Vec<TensorSpec>,
    constants: Vec<(i64, Box<[u8; 4]>)>,
    name: String,
    form: String,
    build_time: Duration,
    tune_time: Cell<Duration>,
    /// The id of the context whose handle the plan was finalized for ([`Plan::check_context`]).
    context: u64,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("name", &self.name)
            .field("form", &self.form)
            .field("engine", &self.engine())
            .field("candidates", &self.candidates.borrow().len())
            .field("workspace", &self.workspace_size())
            .field("build_time", &self.build_time)
            .finish()
    }
}

impl Plan {
    /// Finalizes engine configurations in heuristics order (mode A, then FALLBACK) until
    /// `tuning.candidates` succeed. [`Error::NotSupported`] if none does.
    pub(crate) fn from_graph(
        ctx: &Cudnn,
        parts: PlanParts,
        started: Instant,
        tuning: Tuning,
    ) -> Result<Plan> {
        let max_candidates = tuning.candidates;
        let PlanParts { name, form, graph, descriptors, tensors, constants } = parts;
        let mut last_error = None;
        let mut candidates: Vec<Rc<Candidate>> = Vec::new();
        // Mode B (a costlier heuristic, with more configurations) only when several candidates are
        // wanted; the frontend serializes its finalize process-wide, and so do we.
        let modes: &[sys::cudnnBackendHeurMode_t] = if max_candidates > 1 {
            &[
                sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
                sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B,
                sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
            ]
        } else {
            &[
                sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
                sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
            ]
        };
        'modes: for &mode in modes {
            let configs = match engine_configs(&graph, mode) {
                Ok(c) => c,
                Err(e) => {
                    last_error = Some(e);
                    continue;
                }
            };
            for config in configs {
                // An unreadable configuration still runs; it is only left out of the knob search.
                let choice =
                    EngineChoice::read(&config).unwrap_or(EngineChoice { index: -1, knobs: Vec::new() });
                if choice.index >= 0 && candidates.iter().any(|c| c.choice.same(&choice)) {
                    continue; // later modes repeat configurations earlier ones listed
                }
                match Candidate::new(ctx, config, choice, Vec::new()) {
                    Ok(c) => {
                        candidates.push(Rc::new(c));
                        if candidates.len() >= max_candidates.max(1) {
                            break 'modes;
                        }
                    }
                    Err(e) => last_error = Some(e),
                }
            }
        }
        if candidates.is_empty() {
            let reason = match last_error {
                Some(e) => format!("no engine configuration finalized (last error: {e})"),
                None => "heuristics returned no engine configuration".into(),
            };
            return Err(Error::NotSupported { op: name, reason });
        }
        Ok(Plan {
            tuned: Cell::new(candidates.len() == 1 && tuning.knob_search == 0),
            knob_search: tuning.knob_search,
            flush: tuning.flush,
            candidates: RefCell::new(candidates),
            chosen: Cell::new(0),
            timings: RefCell::new(Vec::new()),
            _graph: graph,
            _parts: descriptors,
            tensors,
            constants: constants.into_iter().map(|(uid, v)| (uid, v.boxed())).collect(),
            name,
            form,
            build_time: started.elapsed(),
            tune_time: Cell::new(Duration::ZERO),
            context: ctx.id(),
        })
    }

    /// Refuses a context other than the one the plan was finalized for (its handle, stream and device
    /// are the ones the plan's engines were built for, and the plan cache is per context), and
    /// bindings made for a stream other than the context's (cudarc's event tracking would then order
    /// the buffers against the wrong stream). [`Error::WrongContext`]; nothing is enqueued.
    pub fn check_context(&self, ctx: &Cudnn, b: &Bindings<'_>) -> Result<()> {
        same_context(&self.name, self.context, ctx.id())?;
        if b.stream.cu_stream() != ctx.stream().cu_stream() {
            return Err(Error::WrongContext(format!(
                "plan `{}`: the bindings were made for another stream than the context's",
                self.name
            )));
        }
        Ok(())
    }

    fn chosen(&self) -> Rc<Candidate> {
        self.candidates.borrow()[self.chosen.get()].clone()
    }

    /// Engines that finalized, in heuristics order (the first is the heuristics' choice), then those
    /// the knob search built.
    pub fn candidates(&self) -> Vec<String> {
        self.candidates.borrow().iter().map(|c| c.choice.tag()).collect()
    }

    /// The knobs the running engine exposes (what a knob search varies).
    pub fn knob_ranges(&self) -> Result<Vec<KnobRange>> {
        let index = self.chosen().choice.index;
        if index < 0 {
            return Err(Error::invalid(format!(
                "plan `{}`: the running engine could not be read",
                self.name
            )));
        }
        knob_ranges(&self._graph, index)
    }

    /// Median milliseconds per candidate from autotuning, in the order timed (empty until the first
    /// execution of a plan that autotunes: several candidates or a knob search).
    pub fn timings(&self) -> Vec<(String, f64)> {
        self.timings.borrow().clone()
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The graph's form label (e.g. `composite` or `unified` for attention); empty when unlabeled.
    pub fn form(&self) -> &str {
        &self.form
    }

    /// The engine that runs, as the frontend tags it: `eng<global index>` then `_k<knob type>=<value>`
    /// per knob ([`crate::knob_name`] names the types).
    pub fn engine(&self) -> String {
        self.chosen().choice.tag()
    }

    /// Workspace bytes the running engine needs per execution.
    pub fn workspace_size(&self) -> usize {
        self.chosen().workspace
    }

    /// Wall time from validation to the finalized plan (the cold cost a cache hit avoids).
    pub fn build_time(&self) -> Duration {
        self.build_time
    }

    /// Wall time the first execution spent autotuning (timing candidates, building and timing those
    /// of the knob search); zero until then and for untuned plans.
    pub fn tune_time(&self) -> Duration {
        self.tune_time.get()
    }

    /// The tensors that must be bound at execute time.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The uid of the bound tensor called `name`.
    pub fn uid(&self, name: &str) -> Result<i64> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.uid)
            .ok_or_else(|| Error::invalid(format!("plan `{}` has no tensor `{name}`", self.name)))
    }

    /// Checks every binding against the plan: each bound tensor present once, dtype, length, alignment,
    /// host vs device; no unknown uid.
    pub fn check(&self, b: &Bindings<'_>) -> Result<()> {
        for e in &b.entries {
            if !self.tensors.iter().any(|t| t.uid == e.uid) {
                return Err(Error::invalid(format!("plan `{}` has no tensor with uid {}", self.name, e.uid)));
            }
        }
        for t in &self.tensors {
            let mut found = b.entries.iter().filter(|e| e.uid == t.uid);
            let (Some(e), None) = (found.next(), found.next()) else {
                return Err(Error::invalid(format!(
                    "tensor `{}` (uid {}) must be bound exactly once",
                    t.name, t.uid
                )));
            };
            if e.dtype != t.dtype {
                return Err(Error::invalid(format!(
                    "tensor `{}` is {}, bound buffer is {}",
                    t.name, t.dtype, e.dtype
                )));
            }
            match (&e.place, t.by_value) {
                (Place::Host(_), true) => {}
                (Place::Device { addr, len, .. }, false) => {
                    let Some(need) = t.min_elements() else {
                        return Err(Error::invalid(format!(
                            "tensor `{}` {:?} over strides {:?} overflows",
                            t.name, t.dims, t.strides
                        )));
                    };
                    if *len < need {
                        return Err(Error::invalid(format!(
                            "tensor `{}` {:?} needs {need} elements, bound buffer has {len}",
                            t.name, t.dims
                        )));
                    }
                    if addr % t.alignment as u64 != 0 {
                        return Err(Error::invalid(format!(
                            "tensor `{}`: pointer {addr:#x} is not {}-byte aligned",
                            t.name, t.alignment
                        )));
                    }
                }
                (_, by_value) => {
                    let want = if by_value { "a host scalar" } else { "a device buffer" };
                    return Err(Error::invalid(format!("tensor `{}` must be bound to {want}", t.name)));
                }
            }
        }
        Ok(())
    }

    /// Checks the bindings and builds the variant pack once; [`Prepared::execute`] then only enqueues.
    pub fn prepare<'p>(&'p self, ctx: &'p Cudnn, b: &'p Bindings<'_>) -> Result<Prepared<'p>> {
        self.prepare_candidate(ctx, b, self.chosen.get())
    }

    fn prepare_candidate<'p>(
        &'p self,
        ctx: &'p Cudnn,
        b: &'p Bindings<'_>,
        index: usize,
    ) -> Result<Prepared<'p>> {
        self.check_context(ctx, b)?;
        self.check(b)?;
        ctx.bind()?;
        for e in &b.entries {
            if let Place::Device { addr, device, .. } = e.place {
                same_device(&self.name, addr, device, ctx.info().ordinal)?;
            }
        }
        let candidate = self.candidates.borrow()[index].clone();
        let need = candidate.workspace;
        let workspace = ctx.workspace(need)?;
        let ws_ptr = match &workspace {
            Some(ws) if need > 0 => {
                let (addr, _sync) = ws.device_ptr(ctx.stream());
                addr as *mut c_void
            }
            _ => std::ptr::null_mut(),
        };
        let mut uids: Vec<i64> = b.entries.iter().map(|e| e.uid).collect();
        let mut ptrs: Vec<*mut c_void> = b.entries.iter().map(Entry::ptr).collect();
        for (uid, value) in &self.constants {
            uids.push(*uid);
            // cuDNN reads by-value tensors through host pointers; the boxes live as long as the plan.
            ptrs.push(value.as_ptr() as *mut c_void);
        }
        let mut pack = Descriptor::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, Attr::I64(&uids))?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, Attr::VoidPtrs(&ptrs))?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, Attr::VoidPtrs(&[ws_ptr]))?;
        pack.finalize("variant pack")?;
        // Zeroed before each execution where the cuDNN version needs it (see `Cudnn::zeroes_workspace`).
        let zero = (need > 0 && ctx.zeroes_workspace()).then_some((ws_ptr as u64, need));
        Ok(Prepared { candidate, _plan: self, ctx, pack, zero, _workspace: workspace })
    }

    /// Checks the bindings and enqueues the plan on the context's stream. The first execution of a
    /// plan with several candidates times them first (synchronizing the stream), so run it once before
    /// capturing a CUDA graph.
    pub fn execute(&self, ctx: &Cudnn, b: &Bindings<'_>) -> Result<()> {
        self.check_context(ctx, b)?;
        if !self.tuned.get() {
            self.autotune(ctx, b)?;
        }
        self.prepare(ctx, b)?.execute()
    }

    /// Median ms of candidate `i`: one warm-up, then [`TUNE_SAMPLES`] single executions, each after an
    /// L2 flush (the plan's [`crate::L2Flush`]). The flush evicts the plan's inputs, as a forward evicts
    /// a layer's weights before the next layer reads its own, and keeps the GPU busy while the timed
    /// launch is enqueued, so that a kernel shorter than its launch is timed as the kernel, not as the
    /// host.
    fn time_candidate(
        &self,
        ctx: &Cudnn,
        b: &Bindings<'_>,
        i: usize,
        (start, end): (&cudarc::driver::CudaEvent, &cudarc::driver::CudaEvent),
        flush: &mut Flusher,
    ) -> Result<f64> {
        let prepared = self.prepare_candidate(ctx, b, i)?;
        prepared.execute()?;
        let mut samples = Vec::with_capacity(TUNE_SAMPLES);
        for _ in 0..TUNE_SAMPLES {
            if flush.run(ctx).is_err() {
                // The flush only serves the timing: without it the timing goes on, hot.
                *flush = Flusher::Off;
            }
            start.record(ctx.stream())?;
            prepared.execute()?;
            end.record(ctx.stream())?;
            samples.push(start.elapsed_ms(end)? as f64);
        }
        samples.sort_by(f64::total_cmp);
        Ok(samples[TUNE_SAMPLES / 2])
    }

    /// Times every candidate on these bindings (see `time_candidate`), runs the knob search if the
    /// plan has a budget for one (`knob_search`), and keeps the fastest. Outputs are overwritten;
    /// inputs are only read.
    pub fn autotune(&self, ctx: &Cudnn, b: &Bindings<'_>) -> Result<()> {
        self.check_context(ctx, b)?;
        let started = Instant::now();
        let cuda = ctx.stream().context();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (cuda.new_event(flags)?, cuda.new_event(flags)?);
        let mut flush = Flusher::new(ctx, self.flush);
        let mut timings = Vec::new();
        let mut last_error = None;
        let mut time = |i: usize, timings: &mut Vec<(String, f64)>| {
            let engine = self.candidates.borrow()[i].choice.tag();
            // A configuration can finalize and still fail to run: it is timed as never finishing.
            match self.time_candidate(ctx, b, i, (&start, &end), &mut flush) {
                Ok(ms) => timings.push((engine, ms)),
                Err(e) => {
                    timings.push((engine, f64::INFINITY));
                    last_error = Some(e);
                }
            }
        };
        let heuristics = self.candidates.borrow().len();
        for i in 0..heuristics {
            time(i, &mut timings);
        }
        let fastest =
            |t: &[(String, f64)]| (0..t.len()).min_by(|&x, &y| t[x].1.total_cmp(&t[y].1)).unwrap_or(0);
        // Knob search: every configuration one knob away from the fastest so far, again around a new
        // fastest, until none is faster or the budget is spent. Finalize failures (combinations an
        // engine rejects) cost an attempt, not the budget; attempts are capped at four times it. A
        // configuration needing more workspace than every heuristics' one is not kept (the context's
        // workspace only grows).
        let (mut built, mut attempts) = (0, 0);
        let max_attempts = self.knob_search.saturating_mul(4);
        let max_workspace = self.candidates.borrow().iter().map(|c| c.workspace).max().unwrap_or(0);
        let mut tried: Vec<EngineChoice> =
            self.candidates.borrow().iter().map(|c| c.choice.clone()).collect();
        let mut ranges: HashMap<i64, Vec<KnobRange>> = HashMap::new();
        let mut searched: Vec<usize> = Vec::new();
        while built < self.knob_search && attempts < max_attempts {
            let best = fastest(&timings);
            let base = self.candidates.borrow()[best].choice.clone();
            if searched.contains(&best) || base.index < 0 || timings[best].1.is_infinite() {
                break;
            }
            searched.push(best);
            let knobs = ranges
                .entry(base.index)
                .or_insert_with(|| knob_ranges(&self._graph, base.index).unwrap_or_default());
            for next in base.neighbours(knobs) {
                if built >= self.knob_search || attempts >= max_attempts {
                    break;
                }
                if tried.iter().any(|t| t.same(&next)) {
                    continue;
                }
                tried.push(next.clone());
                attempts += 1;
                let Ok((config, parts)) = next.build(&self._graph) else { continue };
                let Ok(candidate) = Candidate::new(ctx, config, next, parts) else { continue };
                if candidate.workspace > max_workspace {
                    continue;
                }
                built += 1;
                let index = {
                    let mut candidates = self.candidates.borrow_mut();
                    candidates.push(Rc::new(candidate));
                    candidates.len() - 1
                };
                time(index, &mut timings);
            }
        }
        if timings.iter().all(|(_, ms)| ms.is_infinite()) {
            return Err(last_error.unwrap_or_else(|| Error::invalid("autotune: no candidate ran")));
        }
        self.chosen.set(fastest(&timings));
        self.tuned.set(true);
        self.tune_time.set(started.elapsed());
        *self.timings.borrow_mut() = timings;
        Ok(())
    }
}

/// A plan with its variant pack built: executing it is a single `cudnnBackendExecute`.
pub struct Prepared<'p> {
    candidate: Rc<Candidate>,
    /// Keeps the plan (and the graph descriptors its candidates were finalized from) borrowed.
    _plan: &'p Plan,
    ctx: &'p Cudnn,
    pack: Descriptor,
    /// Workspace address and bytes to zero before each execution, if the cuDNN version needs it.
    zero: Option<(u64, usize)>,
    _workspace: Option<Rc<CudaSlice<u8>>>,
}

impl Prepared<'_> {
    /// Enqueues the plan on the context's stream.
    pub fn execute(&self) -> Result<()> {
        if let Some((ptr, bytes)) = self.zero {
            // SAFETY: `ptr` is the workspace held by `_workspace`, at least `bytes` long, on this stream.
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.ctx.stream().cu_stream())? };
        }
        // SAFETY: the plan was finalized for this context's handle; the variant pack's pointers were
        // checked against the plan's tensors and are borrowed (bindings, workspace) for `'p`.
        unsafe { crate::raw::execute(self.ctx.raw_handle(), self.candidate.plan.raw(), self.pack.raw()) }
    }
}

/// [`Error::WrongContext`] unless a plan finalized for context `plan_ctx` runs on context `ctx`.
fn same_context(plan: &str, plan_ctx: u64, ctx: u64) -> Result<()> {
    if plan_ctx == ctx {
        return Ok(());
    }
    Err(Error::WrongContext(format!(
        "plan `{plan}` was finalized for context #{plan_ctx} and cannot run on context #{ctx}"
    )))
}

/// [`Error::WrongContext`] when a buffer bound at `addr`, allocated on device `device` (its stream's,
/// read when it was bound: no driver call per execution), is not on the context's device `ordinal`.
fn same_device(plan: &str, addr: u64, device: usize, ordinal: usize) -> Result<()> {
    if device == ordinal {
        return Ok(());
    }
    Err(Error::WrongContext(format!(
        "plan `{plan}`: a bound buffer ({addr:#x}) is on device {device}, the context on device {ordinal}"
    )))
}

/// Timed executions per autotuning candidate (the median is kept).
const TUNE_SAMPLES: usize = 9;

/// Heuristics mode B's finalize is not thread-safe (the frontend holds a process-wide mutex around it).
static HEUR_B: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn engine_configs(graph: &Descriptor, mode: sys::cudnnBackendHeurMode_t) -> Result<Vec<Descriptor>> {
    let mut heur = Descriptor::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, Attr::Descriptors(&[graph]))?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, Attr::HeurMode(mode))?;
    if mode == sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B {
        let _serialized = HEUR_B.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        heur.finalize("engine heuristics (mode B)")?;
    } else {
        heur.finalize("engine heuristics")?;
    }
    heur.get_descriptors(A::CUDNN_ATTR_ENGINEHEUR_RESULTS, D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, None)
}

fn finalize_plan(ctx: &Cudnn, config: &Descriptor) -> Result<Descriptor> {
    let mut plan = Descriptor::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Attr::Handle(ctx.raw_handle()))?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, Attr::Descriptors(&[config]))?;
    plan.finalize("execution plan")?;
    Ok(plan)
}

enum Place {
    /// `device`: the ordinal of the buffer's stream's CUDA context, where cudarc allocated it.
    Device {
        addr: u64,
        len: usize,
        device: usize,
    },
    Host(Box<[u8; 4]>),
}

struct Entry {
    uid: i64,
    dtype: DataType,
    place: Place,
}

impl Entry {
    fn ptr(&self) -> *mut c_void {
        match &self.place {
            Place::Device { addr, .. } => *addr as *mut c_void,
            // cuDNN reads by-value scalars through a host pointer; the box keeps it stable.
            Place::Host(v) => v.as_ptr() as *mut c_void,
        }
    }
}

/// Buffers bound to a plan's tensor uids for one execution. Holds cudarc's stream-ordering guards
/// until dropped, so the buffers are not reused by another stream before the plan's work is enqueued.
pub struct Bindings<'a> {
    stream: &'a CudaStream,
    entries: Vec<Entry>,
    _guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Bindings<'a> {
    /// Empty bindings for work on `stream`.
    pub fn new(stream: &'a CudaStream) -> Self {
        Bindings { stream, entries: Vec::with_capacity(6), _guards: Vec::with_capacity(6) }
    }

    /// Binds a buffer the plan reads.
    pub fn input<T: Element>(&mut self, uid: i64, buf: &'a (impl DevicePtr<T> + ?Sized)) -> &mut Self {
        let (len, device) = (buf.len(), buf.stream().context().ordinal());
        let (addr, guard) = buf.device_ptr(self.stream);
        self.push(uid, T::DTYPE, Place::Device { addr, len, device }, guard)
    }

    /// Binds an i32 buffer the plan reads (sequence lengths).
    pub fn input_i32(&mut self, uid: i64, buf: &'a (impl DevicePtr<i32> + ?Sized)) -> &mut Self {
        let (len, device) = (buf.len(), buf.stream().context().ordinal());
        let (addr, guard) = buf.device_ptr(self.stream);
        self.push(uid, DataType::I32, Place::Device { addr, len, device }, guard)
    }

    /// Binds a buffer the plan writes.
    pub fn output<T: Element>(
        &mut self,
        uid: i64,
        buf: &'a mut (impl DevicePtrMut<T> + ?Sized),
    ) -> &mut Self {
        let (len, device) = (buf.len(), buf.stream().context().ordinal());
        let (addr, guard) = buf.device_ptr_mut(self.stream);
        self.push(uid, T::DTYPE, Place::Device { addr, len, device }, guard)
    }

    /// Binds an f32 host scalar to a by-value tensor.
    pub fn scalar_f32(&mut self, uid: i64, value: f32) -> &mut Self {
        self.scalar(uid, Scalar::F32(value))
    }

    /// Binds a host scalar to a by-value tensor.
    pub fn scalar(&mut self, uid: i64, value: Scalar) -> &mut Self {
        self.entries.push(Entry { uid, dtype: value.dtype(), place: Place::Host(value.boxed()) });
        self
    }

    fn push(&mut self, uid: i64, dtype: DataType, place: Place, guard: SyncOnDrop<'a>) -> &mut Self {
        self.entries.push(Entry { uid, dtype, place });
        self._guards.push(guard);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_refuses_another_context() {
        same_context("rmsnorm", 3, 3).unwrap();
        let e = same_context("rmsnorm", 3, 4).unwrap_err();
        assert!(matches!(e, Error::WrongContext(_)) && e.to_string().contains("context #3"), "{e}");
    }

    #[test]
    fn a_plan_refuses_buffers_of_another_device() {
        same_device("rmsnorm", 0x1000, 0, 0).unwrap();
        let e = same_device("rmsnorm", 0x1000, 1, 0).unwrap_err();
        assert!(matches!(e, Error::WrongContext(_)) && e.to_string().contains("on device 1"), "{e}");
    }
}
