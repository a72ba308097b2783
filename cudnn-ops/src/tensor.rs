//! Tensor specifications: what a graph knows about a tensor before any memory exists.

use crate::descriptor::{Attr, Descriptor};
use crate::dtype::DataType;
use crate::Result;
use cudnn_llm_sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// The most dimensions a cuDNN tensor may have (`CUDNN_DIM_MAX`).
pub const MAX_RANK: usize = cudnn_llm_sys::CUDNN_DIM_MAX as usize;

/// Default byte alignment declared for device tensors, checked against pointers at execute time.
pub const DEFAULT_ALIGNMENT: i64 = 16;

/// A tensor of a graph: logical dims over strided storage, dtype, unique id and flags.
///
/// Layout is only ever expressed through strides: a transposed or head-split view is a different
/// stride vector over the same memory, never a copy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TensorSpec {
    /// Name used in errors and for binding lookups.
    pub name: String,
    /// Logical dimensions.
    pub dims: Vec<i64>,
    /// Element strides, one per dimension.
    pub strides: Vec<i64>,
    /// Element type.
    pub dtype: DataType,
    /// Unique id within the graph (the variant-pack key). 0 means "assign one".
    pub uid: i64,
    /// An intermediate that never exists in memory.
    pub is_virtual: bool,
    /// A host scalar passed by value at execute time (epsilon, scale).
    pub by_value: bool,
    /// Byte alignment the bound pointer is guaranteed to have.
    pub alignment: i64,
    /// The uid of this tensor's ragged-offset tensor (`CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC`): an i32
    /// `[b + 1, 1, 1, 1]` device tensor whose entry `i` is the element offset of sequence `i` in a
    /// packed (THD) buffer, so the batch stride is not used. Only the Q, K, V and O of an SDPA with
    /// sequence lengths take one (the unified operation, or the composite graph with its padding mask,
    /// where an output stats tensor may take one too; [`Graph::validate`](crate::Graph::validate)).
    pub ragged_offset: Option<i64>,
}

impl TensorSpec {
    /// A device tensor with packed row-major strides and [`DEFAULT_ALIGNMENT`].
    pub fn new(name: impl Into<String>, dims: &[i64], dtype: DataType) -> Self {
        TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            strides: packed_strides(dims),
            dtype,
            uid: 0,
            is_virtual: false,
            by_value: false,
            alignment: DEFAULT_ALIGNMENT,
            ragged_offset: None,
        }
    }

    /// A host scalar passed by value, shaped all-ones with `rank` dimensions.
    pub fn scalar(name: impl Into<String>, dtype: DataType, rank: usize) -> Self {
        let ones = vec![1; rank];
        TensorSpec { by_value: true, ..TensorSpec::new(name, &ones, dtype) }
    }

    /// Replaces the strides.
    pub fn with_strides(mut self, strides: &[i64]) -> Self {
        self.strides = strides.to_vec();
        self
    }

    /// Sets the unique id.
    pub fn with_uid(mut self, uid: i64) -> Self {
        self.uid = uid;
        self
    }

    /// Packed without padding: the sequences' offsets come from the tensor of uid `offsets` (see
    /// [`TensorSpec::ragged_offset`](#structfield.ragged_offset)).
    pub fn with_ragged_offset(mut self, offsets: i64) -> Self {
        self.ragged_offset = Some(offsets);
        self
    }

    /// Sets the declared byte alignment.
    pub fn with_alignment(mut self, alignment: i64) -> Self {
        self.alignment = alignment;
        self
    }

    /// Number of elements a buffer must hold: one past the furthest element the strides reach (0 for
    /// an empty tensor). `None` when that does not fit `i64` (cuDNN's size type) or a stride is
    /// negative: no buffer is long enough for such a spec.
    pub fn min_elements(&self) -> Option<usize> {
        if self.dims.iter().any(|&d| d <= 0) {
            return Some(0);
        }
        // A ragged tensor's sequences start at device offsets and end at device lengths: the host's
        // bound is one token (the batch dim and the token dim, the widest stride of the others,
        // count once; ops check the real bound, which they know).
        let token_dim = match self.ragged_offset {
            Some(_) => (1..self.dims.len()).max_by_key(|&i| (self.strides[i], self.dims[i])),
            None => None,
        };
        let mut last = 0i64;
        for (i, (&d, &s)) in self.dims.iter().zip(&self.strides).enumerate() {
            let d = if token_dim.is_some() && (i == 0 || Some(i) == token_dim) { 1 } else { d };
            if s < 0 {
                return None;
            }
            last = last.checked_add((d - 1).checked_mul(s)?)?;
        }
        usize::try_from(last.checked_add(1)?).ok()
    }

    /// Checks the spec on its own; the message does not repeat the name (callers add it).
    pub fn check(&self) -> std::result::Result<(), String> {
        let rank = self.dims.len();
        if rank == 0 || rank > MAX_RANK {
            return Err(format!("rank {rank} is outside 1..={MAX_RANK}"));
        }
        if self.strides.len() != rank {
            return Err(format!("{} strides for {rank} dims", self.strides.len()));
        }
        if let Some(d) = self.dims.iter().find(|&&d| d <= 0) {
            return Err(format!("dimension {d} in {:?} is not positive", self.dims));
        }
        if let Some(s) = self.strides.iter().find(|&&s| s <= 0) {
            return Err(format!("stride {s} in {:?} is not positive", self.strides));
        }
        if self.dims.len() == self.strides.len() {
            let bytes = self.min_elements().and_then(|n| n.checked_mul(self.dtype.size()));
            if bytes.is_none_or(|b| i64::try_from(b).is_err()) {
                return Err(format!(
                    "dims {:?} over strides {:?} reach past 2^63 bytes",
                    self.dims, self.strides
                ));
            }
        }
        if self.is_virtual && self.by_value {
            return Err("a tensor cannot be both virtual and by-value".into());
        }
        let a = self.alignment;
        if a <= 0 || a & (a - 1) != 0 || (a as usize) < self.dtype.size() {
            return Err(format!(
                "alignment {a} is not a power of two >= the element size {}",
                self.dtype.size()
            ));
        }
        Ok(())
    }

    /// Creates and finalizes the backend tensor descriptor; `ragged` is the finalized descriptor of the
    /// tensor [`TensorSpec::ragged_offset`](#structfield.ragged_offset) names (the graph passes it).
    pub(crate) fn descriptor(&self, ragged: Option<&Descriptor>) -> Result<Descriptor> {
        let mut d = Descriptor::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, Attr::DataType(self.dtype))?;
        d.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, Attr::I64(&self.dims))?;
        d.set(A::CUDNN_ATTR_TENSOR_STRIDES, Attr::I64(&self.strides))?;
        d.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, Attr::I64(&[self.uid]))?;
        d.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, Attr::I64(&[self.alignment]))?;
        if self.is_virtual {
            d.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, Attr::Bool(true))?;
        }
        if self.by_value {
            d.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, Attr::Bool(true))?;
        }
        if let Some(offsets) = ragged {
            d.set(A::CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, Attr::Descriptors(&[offsets]))?;
        }
        d.finalize(&format!("tensor `{}`", self.name))?;
        Ok(d)
    }
}

/// Row-major (last dimension fastest) strides for `dims`. A stride past `i64::MAX` saturates there, and
/// [`TensorSpec::check`] rejects the spec (its extent overflows).
pub fn packed_strides(dims: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(dims[i + 1].max(1));
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_strides_are_row_major() {
        assert_eq!(packed_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(packed_strides(&[5]), vec![1]);
        let t = TensorSpec::new("x", &[2, 3, 4], DataType::BF16);
        assert_eq!(t.min_elements(), Some(24));
        // A transposed view of a [3, 4] matrix stored row-major: dims [4, 3], strides [1, 4].
        let v = TensorSpec::new("wT", &[4, 3], DataType::BF16).with_strides(&[1, 4]);
        assert_eq!(v.min_elements(), Some(12));
    }

    #[test]
    fn extreme_dims_saturate_and_are_rejected() {
        // Packed strides of dims whose product passes i64::MAX saturate instead of wrapping or panicking.
        let dims = [1 << 32, 1 << 32, 1 << 32];
        assert_eq!(packed_strides(&dims), vec![i64::MAX, 1 << 32, 1]);
        assert_eq!(packed_strides(&[i64::MAX, i64::MAX, i64::MAX]), vec![i64::MAX, i64::MAX, 1]);
        let t = TensorSpec::new("x", &dims, DataType::BF16);
        assert_eq!(t.min_elements(), None);
        assert!(t.check().unwrap_err().contains("past 2^63 bytes"));
        // 5 rows 2^62 apart: the extent wraps to a small number without checks.
        let wrapped = TensorSpec::new("q", &[5, 8], DataType::BF16).with_strides(&[1 << 62, 1]);
        assert_eq!(wrapped.min_elements(), None);
        let negative = TensorSpec::new("q", &[2, 8], DataType::BF16).with_strides(&[-8, 1]);
        assert_eq!(negative.min_elements(), None);
        assert_eq!(TensorSpec::new("e", &[0, 8], DataType::BF16).min_elements(), Some(0));
    }

    #[test]
    fn check_rejects_bad_specs() {
        let ok = TensorSpec::new("x", &[2, 3], DataType::F32);
        assert!(ok.check().is_ok());
        let cases = [
            (TensorSpec::new("x", &[], DataType::F32), "rank 0"),
            (TensorSpec::new("x", &[1; 9], DataType::F32), "rank 9"),
            (TensorSpec::new("x", &[2, 0], DataType::F32), "dimension 0"),
            (ok.clone().with_strides(&[3]), "1 strides for 2 dims"),
            (ok.clone().with_strides(&[3, -1]), "stride -1"),
            (ok.clone().with_alignment(3), "alignment 3"),
            (ok.clone().with_alignment(2), "alignment 2"),
            (TensorSpec { is_virtual: true, ..TensorSpec::scalar("e", DataType::F32, 4) }, "both virtual"),
            (TensorSpec::new("x", &[5, 8], DataType::F32).with_strides(&[1 << 62, 1]), "past 2^63 bytes"),
            (TensorSpec::new("x", &[3, 8], DataType::BF16).with_strides(&[1 << 61, 1]), "past 2^63 bytes"),
            (TensorSpec::new("x", &[1 << 40, 1 << 40], DataType::F32), "past 2^63 bytes"),
        ];
        for (spec, expected) in cases {
            let err = spec.check().unwrap_err();
            assert!(err.contains(expected), "{spec:?}: {err}");
        }
    }
}
