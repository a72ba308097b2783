//! Execution plans: heuristics, finalization, buffer checks and execution through a variant pack.

use crate::descriptor::{Attr, Descriptor};
use crate::dtype::{DataType, Element};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudnn_sys as sys;
use std::ffi::c_void;
use std::rc::Rc;
use std::time::{Duration, Instant};
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

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

/// A finalized execution plan and what it needs bound at execute time.
pub struct Plan {
    // Field order is drop order: the plan goes before the graph descriptors it was built from.
    plan: Descriptor,
    _graph: Descriptor,
    _parts: Vec<Descriptor>,
    tensors: Vec<TensorSpec>,
    constants: Vec<(i64, Box<[u8; 4]>)>,
    workspace: usize,
    engine: String,
    name: String,
    form: String,
    build_time: Duration,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("name", &self.name)
            .field("form", &self.form)
            .field("engine", &self.engine)
            .field("workspace", &self.workspace)
            .field("build_time", &self.build_time)
            .finish()
    }
}

impl Plan {
    pub(crate) fn from_graph(ctx: &Cudnn, parts: PlanParts, started: Instant) -> Result<Plan> {
        let PlanParts { name, form, graph, descriptors, tensors, constants } = parts;
        let mut last_error = None;
        for mode in [
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let configs = match engine_configs(&graph, mode) {
                Ok(c) => c,
                Err(e) => {
                    last_error = Some(e);
                    continue;
                }
            };
            for config in configs {
                match finalize_plan(ctx, &config) {
                    Ok(plan) => {
                        let workspace =
                            plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
                        let engine = engine_name(&config).unwrap_or_else(|_| "unknown".into());
                        return Ok(Plan {
                            plan,
                            _graph: graph,
                            _parts: descriptors,
                            tensors,
                            constants: constants.into_iter().map(|(uid, v)| (uid, v.boxed())).collect(),
                            workspace,
                            engine,
                            name,
                            form,
                            build_time: started.elapsed(),
                        });
                    }
                    Err(e) => last_error = Some(e),
                }
            }
        }
        let reason = match last_error {
            Some(e) => format!("no engine configuration finalized (last error: {e})"),
            None => "heuristics returned no engine configuration".into(),
        };
        Err(Error::NotSupported { op: name, reason })
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The graph's form label (e.g. `composite` or `unified` for attention); empty when unlabeled.
    pub fn form(&self) -> &str {
        &self.form
    }

    /// The engine that was chosen, as `eng<global index>`.
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// Workspace bytes the plan needs per execution.
    pub fn workspace_size(&self) -> usize {
        self.workspace
    }

    /// Wall time from validation to the finalized plan (the cold cost a cache hit avoids).
    pub fn build_time(&self) -> Duration {
        self.build_time
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
                (Place::Device { addr, len }, false) => {
                    let need = t.min_elements();
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
        self.check(b)?;
        ctx.bind()?;
        let workspace = ctx.workspace(self.workspace)?;
        let ws_ptr = match &workspace {
            Some(ws) if self.workspace > 0 => {
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
        Ok(Prepared { plan: self, ctx, pack, _workspace: workspace })
    }

    /// Checks the bindings and enqueues the plan on the context's stream.
    pub fn execute(&self, ctx: &Cudnn, b: &Bindings<'_>) -> Result<()> {
        self.prepare(ctx, b)?.execute()
    }
}

/// A plan with its variant pack built: executing it is a single `cudnnBackendExecute`.
pub struct Prepared<'p> {
    plan: &'p Plan,
    ctx: &'p Cudnn,
    pack: Descriptor,
    _workspace: Option<Rc<CudaSlice<u8>>>,
}

impl Prepared<'_> {
    /// Enqueues the plan on the context's stream.
    pub fn execute(&self) -> Result<()> {
        // SAFETY: the plan was finalized for this context's handle; the variant pack's pointers were
        // checked against the plan's tensors and are borrowed (bindings, workspace) for `'p`.
        unsafe { crate::raw::execute(self.ctx.raw_handle(), self.plan.plan.raw(), self.pack.raw()) }
    }
}

fn engine_configs(graph: &Descriptor, mode: sys::cudnnBackendHeurMode_t) -> Result<Vec<Descriptor>> {
    let mut heur = Descriptor::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, Attr::Descriptors(&[graph]))?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, Attr::HeurMode(mode))?;
    heur.finalize("engine heuristics")?;
    heur.get_descriptors(A::CUDNN_ATTR_ENGINEHEUR_RESULTS, D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, None)
}

fn finalize_plan(ctx: &Cudnn, config: &Descriptor) -> Result<Descriptor> {
    let mut plan = Descriptor::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Attr::Handle(ctx.raw_handle()))?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, Attr::Descriptors(&[config]))?;
    plan.finalize("execution plan")?;
    Ok(plan)
}

fn engine_name(config: &Descriptor) -> Result<String> {
    let engine = config.get_descriptors(
        A::CUDNN_ATTR_ENGINECFG_ENGINE,
        D::CUDNN_BACKEND_ENGINE_DESCRIPTOR,
        Some(1),
    )?;
    let engine = engine.first().ok_or_else(|| Error::invalid("engine config without engine"))?;
    Ok(format!("eng{}", engine.get_i64(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?))
}

enum Place {
    Device { addr: u64, len: usize },
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
        let len = buf.len();
        let (addr, guard) = buf.device_ptr(self.stream);
        self.push(uid, T::DTYPE, Place::Device { addr, len }, guard)
    }

    /// Binds a buffer the plan writes.
    pub fn output<T: Element>(
        &mut self,
        uid: i64,
        buf: &'a mut (impl DevicePtrMut<T> + ?Sized),
    ) -> &mut Self {
        let len = buf.len();
        let (addr, guard) = buf.device_ptr_mut(self.stream);
        self.push(uid, T::DTYPE, Place::Device { addr, len }, guard)
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
