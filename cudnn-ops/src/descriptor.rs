//! Owning backend descriptors with typed attributes.
//!
//! A [`Descriptor`] is created empty, filled with [`Descriptor::set`], finalized, and destroyed on drop.
//! Attribute values are the [`Attr`] enum, so the C type tag, element count and pointer always agree.

use crate::dtype::DataType;
use crate::raw::{self, AttrName, AttrType, DescType, RawDesc};
use crate::Result;
use cudnn_llm_sys as sys;
use std::ffi::c_void;

/// A typed attribute value (borrowed for the duration of the `set` call).
pub(crate) enum Attr<'a> {
    I64(&'a [i64]),
    F64(f64),
    Bool(bool),
    DataType(DataType),
    Descriptors(&'a [&'a Descriptor]),
    Handle(raw::RawHandle),
    VoidPtrs(&'a [*mut c_void]),
    /// A `CUDNN_TYPE_CHAR` array (e.g. a plan's JSON), passed with its length.
    Chars(&'a [u8]),
    NormMode(sys::cudnnBackendNormMode_t),
    NormPhase(sys::cudnnBackendNormFwdPhase_t),
    HeurMode(sys::cudnnBackendHeurMode_t),
    PointwiseMode(sys::cudnnPointwiseMode_t),
    ReduceOp(sys::cudnnReduceTensorOp_t),
    KnobType(sys::cudnnBackendKnobType_t),
}

/// An owned `cudnnBackendDescriptor_t`.
pub(crate) struct Descriptor {
    raw: RawDesc,
}

impl Descriptor {
    /// Creates an empty descriptor.
    pub(crate) fn new(kind: DescType) -> Result<Self> {
        Ok(Descriptor { raw: raw::create_descriptor(kind)? })
    }

    pub(crate) fn raw(&self) -> RawDesc {
        self.raw
    }

    /// Sets one attribute.
    pub(crate) fn set(&mut self, name: AttrName, value: Attr<'_>) -> Result<()> {
        use sys::cudnnBackendAttributeType_t as T;
        let dt;
        let descs: Vec<RawDesc>;
        let (ty, count, ptr): (AttrType, usize, *const c_void) = match &value {
            Attr::I64(v) => (T::CUDNN_TYPE_INT64, v.len(), v.as_ptr().cast()),
            Attr::F64(v) => (T::CUDNN_TYPE_DOUBLE, 1, (v as *const f64).cast()),
            Attr::Bool(v) => (T::CUDNN_TYPE_BOOLEAN, 1, (v as *const bool).cast()),
            Attr::DataType(d) => {
                dt = d.to_raw();
                (T::CUDNN_TYPE_DATA_TYPE, 1, (&dt as *const sys::cudnnDataType_t).cast())
            }
            Attr::Descriptors(ds) => {
                descs = ds.iter().map(|d| d.raw).collect();
                (T::CUDNN_TYPE_BACKEND_DESCRIPTOR, descs.len(), descs.as_ptr().cast())
            }
            Attr::Handle(h) => (T::CUDNN_TYPE_HANDLE, 1, (h as *const raw::RawHandle).cast()),
            Attr::VoidPtrs(p) => (T::CUDNN_TYPE_VOID_PTR, p.len(), p.as_ptr().cast()),
            Attr::Chars(c) => (T::CUDNN_TYPE_CHAR, c.len(), c.as_ptr().cast()),
            Attr::NormMode(m) => {
                (T::CUDNN_TYPE_NORM_MODE, 1, (m as *const sys::cudnnBackendNormMode_t).cast())
            }
            Attr::NormPhase(p) => {
                (T::CUDNN_TYPE_NORM_FWD_PHASE, 1, (p as *const sys::cudnnBackendNormFwdPhase_t).cast())
            }
            Attr::HeurMode(m) => {
                (T::CUDNN_TYPE_HEUR_MODE, 1, (m as *const sys::cudnnBackendHeurMode_t).cast())
            }
            Attr::PointwiseMode(m) => {
                (T::CUDNN_TYPE_POINTWISE_MODE, 1, (m as *const sys::cudnnPointwiseMode_t).cast())
            }
            Attr::ReduceOp(op) => {
                (T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, (op as *const sys::cudnnReduceTensorOp_t).cast())
            }
            Attr::KnobType(k) => {
                (T::CUDNN_TYPE_KNOB_TYPE, 1, (k as *const sys::cudnnBackendKnobType_t).cast())
            }
        };
        // SAFETY: `ptr` points to `count` values of the C type `ty` names, all alive until this returns
        // (borrowed from `value` or the locals above); `self.raw` is live.
        unsafe { raw::set_attribute(self.raw, name, ty, count as i64, ptr) }
    }

    /// Finalizes the descriptor; `what` names it in errors.
    pub(crate) fn finalize(&mut self, what: &str) -> Result<()> {
        // SAFETY: `self.raw` is live.
        unsafe { raw::finalize(self.raw, what) }
    }

    /// Reads a single INT64 attribute.
    pub(crate) fn get_i64(&self, name: AttrName) -> Result<i64> {
        let mut v = 0i64;
        // SAFETY: one writable i64; `self.raw` is live.
        unsafe {
            raw::get_attribute(
                self.raw,
                name,
                sys::cudnnBackendAttributeType_t::CUDNN_TYPE_INT64,
                1,
                (&mut v as *mut i64).cast(),
            )?
        };
        Ok(v)
    }

    /// Reads a `CUDNN_TYPE_CHAR` array attribute (e.g. a plan's JSON): the count first, then the
    /// values, exactly as cuDNN hands them (a trailing NUL included, if it gives one).
    pub(crate) fn get_chars(&self, name: AttrName) -> Result<Vec<u8>> {
        let ty = sys::cudnnBackendAttributeType_t::CUDNN_TYPE_CHAR;
        // SAFETY: a count query: zero requested, null array; `self.raw` is live.
        let n = unsafe { raw::get_attribute(self.raw, name, ty, 0, std::ptr::null_mut())? }.max(0) as usize;
        let mut out = vec![0u8; n];
        // SAFETY: `out` is writable for `n` one-byte chars; `self.raw` is live.
        let got = unsafe { raw::get_attribute(self.raw, name, ty, n as i64, out.as_mut_ptr().cast())? };
        out.truncate((got.max(0) as usize).min(n));
        Ok(out)
    }

    /// Reads a single 32-bit enum attribute of C type `ty` (e.g. a knob type) as its raw value.
    pub(crate) fn get_enum(&self, name: AttrName, ty: AttrType) -> Result<u32> {
        let mut v = 0u32;
        // SAFETY: one writable 32-bit value, the size of every cuDNN enum; `self.raw` is live.
        unsafe { raw::get_attribute(self.raw, name, ty, 1, (&mut v as *mut u32).cast())? };
        Ok(v)
    }

    /// Reads a descriptor-array attribute into freshly created descriptors of `kind` (cuDNN fills
    /// pre-created descriptors). With `max = None` the count is queried first.
    pub(crate) fn get_descriptors(
        &self,
        name: AttrName,
        kind: DescType,
        max: Option<usize>,
    ) -> Result<Vec<Descriptor>> {
        use sys::cudnnBackendAttributeType_t as T;
        let n = match max {
            Some(n) => n,
            None => {
                // SAFETY: a count query: zero requested, null array; `self.raw` is live.
                let n = unsafe {
                    raw::get_attribute(
                        self.raw,
                        name,
                        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                        0,
                        std::ptr::null_mut(),
                    )?
                };
                n.max(0) as usize
            }
        };
        let out = (0..n).map(|_| Descriptor::new(kind)).collect::<Result<Vec<_>>>()?;
        let mut raws: Vec<RawDesc> = out.iter().map(|d| d.raw).collect();
        // SAFETY: `raws` holds `n` live descriptors of the requested kind for cuDNN to fill.
        let got = unsafe {
            raw::get_attribute(
                self.raw,
                name,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                n as i64,
                raws.as_mut_ptr().cast(),
            )?
        };
        let mut out = out;
        out.truncate((got.max(0) as usize).min(n));
        Ok(out)
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by `raw::create_descriptor`, destroyed exactly once here.
        unsafe { raw::destroy_descriptor(self.raw) }
    }
}
