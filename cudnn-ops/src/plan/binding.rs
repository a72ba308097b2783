//! Binding buffers to a plan's tensors: [`Bindings`], their checks against the plan (context, stream,
//! device, dtype, length, alignment), the variant pack, and the execution it enqueues.

use super::candidate::Candidate;
use super::Plan;
use crate::descriptor::{Attr, Descriptor};
use crate::dtype::{DataType, Element};
use crate::exec::Exec;
use crate::raw::driver::DeviceBytes;
use crate::{Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudnn_llm_sys as sys;
use std::ffi::c_void;
use std::rc::Rc;
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// A by-value scalar: a host value cuDNN reads at execute time.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
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
    pub(super) fn boxed(self) -> Box<[u8; 4]> {
        Box::new(match self {
            Scalar::F32(v) => v.to_ne_bytes(),
            Scalar::I32(v) => v.to_ne_bytes(),
        })
    }
}

impl Plan {
    /// Refuses a context other than the one the plan was finalized for (its handle, stream and device
    /// are the ones the plan's engines were built for, and the plan cache is per context), and
    /// bindings made for a stream other than the context's (cudarc's event tracking would then order
    /// the buffers against the wrong stream). [`Error::WrongContext`]; nothing is enqueued.
    pub fn check_context(&self, ctx: &Exec, b: &Bindings<'_>) -> Result<()> {
        self.check_handle(ctx)?;
        if b.stream.cu_stream() != ctx.stream().cu_stream() {
            return Err(Error::WrongContext(format!(
                "plan `{}`: the bindings were made for another stream than the context's",
                self.name
            )));
        }
        Ok(())
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
    pub fn prepare<'p>(&'p self, ctx: &'p Exec, b: &'p Bindings<'_>) -> Result<Prepared<'p>> {
        self.prepare_candidate(ctx, b, self.chosen.get())
    }

    /// [`Plan::prepare`] for candidate `index` (autotuning times each this way).
    pub(super) fn prepare_candidate<'p>(
        &'p self,
        ctx: &'p Exec,
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
        let workspace = match ctx.workspace(need)? {
            Some(ws) if need > 0 => Some(DeviceBytes::new(ws, need)?),
            _ => None,
        };
        let ws_ptr = workspace.as_ref().map_or(std::ptr::null_mut(), |ws| ws.addr() as *mut c_void);
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
        // Zeroed before each execution where the cuDNN version needs it (`Features::zeroes_workspace`).
        let zero = ctx.features().zeroes_workspace();
        Ok(Prepared { candidate, _plan: self, ctx, pack, zero, workspace })
    }
}

/// A plan with its variant pack built: executing it is a single `cudnnBackendExecute`.
pub struct Prepared<'p> {
    candidate: Rc<Candidate>,
    /// Keeps the plan (and the graph descriptors its candidates were finalized from) borrowed.
    _plan: &'p Plan,
    ctx: &'p Exec,
    pack: Descriptor,
    /// Whether the workspace is zeroed before each execution (the cuDNN version needs it).
    zero: bool,
    /// The workspace the variant pack points at, kept alive; `None` when the engine needs none.
    workspace: Option<DeviceBytes>,
}

impl Prepared<'_> {
    /// Enqueues the plan on the context's stream.
    pub fn execute(&self) -> Result<()> {
        if let (true, Some(ws)) = (self.zero, &self.workspace) {
            ws.zero()?;
        }
        // SAFETY: the plan was finalized for this context's handle (`check_context` compared the
        // handle the plan recorded); the variant pack's pointers were checked against the plan's
        // tensors and are borrowed (bindings) or held (workspace) for `'p`.
        unsafe { crate::raw::execute(self.ctx.raw_handle(), self.candidate.plan.raw(), self.pack.raw()) }
    }
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
    fn a_plan_refuses_buffers_of_another_device() {
        same_device("rmsnorm", 0x1000, 0, 0).unwrap();
        let e = same_device("rmsnorm", 0x1000, 1, 0).unwrap_err();
        assert!(matches!(e, Error::WrongContext(_)) && e.to_string().contains("on device 1"), "{e}");
    }
}
