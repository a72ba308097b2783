//! Element types: the [`DataType`] tag used in graphs and the [`Element`] trait that ties it to Rust
//! types, so buffers are checked against the graph's dtypes at execute time.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

/// A tensor element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Boolean (graph intermediates only, e.g. attention masks).
    Bool,
    /// FP8 E4M3 ([`crate::F8E4M3`], `float8_e4m3fn`).
    F8E4M3,
    /// FP8 E5M2 ([`crate::F8E5M2`], `float8_e5m2`).
    F8E5M2,
}

impl DataType {
    /// Every data type.
    pub const ALL: [DataType; 8] = [
        DataType::F32,
        DataType::F16,
        DataType::BF16,
        DataType::I32,
        DataType::I64,
        DataType::Bool,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    /// Whether this is one of the 8-bit floats.
    pub fn is_fp8(self) -> bool {
        matches!(self, DataType::F8E4M3 | DataType::F8E5M2)
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DataType::Bool | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::F32 | DataType::I32 => 4,
            DataType::I64 => 8,
        }
    }

    /// Short name used in reports and keys (`bf16`, `f16`, `f32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F16 => "f16",
            DataType::BF16 => "bf16",
            DataType::I32 => "i32",
            DataType::I64 => "i64",
            DataType::Bool => "bool",
            DataType::F8E4M3 => "fp8e4m3",
            DataType::F8E5M2 => "fp8e5m2",
        }
    }

    /// Parses [`DataType::name`].
    pub fn parse(s: &str) -> Option<Self> {
        DataType::ALL.into_iter().find(|d| d.name() == s)
    }

    pub(crate) fn to_raw(self) -> cudnn_llm_sys::cudnnDataType_t {
        use cudnn_llm_sys::cudnnDataType_t as T;
        match self {
            DataType::F32 => T::CUDNN_DATA_FLOAT,
            DataType::F16 => T::CUDNN_DATA_HALF,
            DataType::BF16 => T::CUDNN_DATA_BFLOAT16,
            DataType::I32 => T::CUDNN_DATA_INT32,
            DataType::I64 => T::CUDNN_DATA_INT64,
            DataType::Bool => T::CUDNN_DATA_BOOLEAN,
            DataType::F8E4M3 => T::CUDNN_DATA_FP8_E4M3,
            DataType::F8E5M2 => T::CUDNN_DATA_FP8_E5M2,
        }
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can live in a device buffer bound to a graph tensor.
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    /// The matching graph dtype.
    const DTYPE: DataType;
    /// Converts from f64, rounding to nearest.
    fn from_f64(v: f64) -> Self;
    /// Converts to f64 exactly.
    fn to_f64(self) -> f64;
    /// A NaN of this type, used to poison outputs before a run.
    fn nan() -> Self;
    /// Converts from bf16, rounding to nearest: [`Element::from_f64`] of its exact value, without the
    /// f64 where the conversion is a copy or a widening (a checkpoint's tensors convert through this).
    fn from_bf16(v: bf16) -> Self {
        Self::from_f64(v.to_f64())
    }
    /// Converts from f16, as [`Element::from_bf16`].
    fn from_f16(v: f16) -> Self {
        Self::from_f64(v.to_f64())
    }
    /// Converts from f32, as [`Element::from_bf16`].
    fn from_f32(v: f32) -> Self {
        Self::from_f64(v as f64)
    }
}

impl Element for f32 {
    const DTYPE: DataType = DataType::F32;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn nan() -> Self {
        f32::NAN
    }
    fn from_bf16(v: bf16) -> Self {
        v.to_f32()
    }
    fn from_f16(v: f16) -> Self {
        v.to_f32()
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DataType = DataType::F16;
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn nan() -> Self {
        f16::NAN
    }
    fn from_f16(v: f16) -> Self {
        v
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DataType = DataType::BF16;
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn nan() -> Self {
        bf16::NAN
    }
    fn from_bf16(v: bf16) -> Self {
        v
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct conversions give what `from_f64` of the exact value gives: every bf16 and f16 bit
    /// pattern, and f32 patterns spread over every exponent (NaN compared as NaN). The f32 patterns keep
    /// their three lowest bits zero: `half`'s f64 -> bf16 (2.7) drops an f64's low 32 bits before it
    /// rounds, so an f32 whose only bits past a tie lie there rounds as a tie; the direct f32 route
    /// rounds it right (checked below).
    #[test]
    fn direct_conversions_equal_the_f64_route() {
        fn same<T: Element>(a: T, b: T, what: &str) {
            let (x, y) = (a.to_f64(), b.to_f64());
            assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{what}: {x} vs {y}");
        }
        fn check<T: Element>() {
            for bits in 0..=u16::MAX {
                let (b, h) = (bf16::from_bits(bits), f16::from_bits(bits));
                same(T::from_bf16(b), T::from_f64(b.to_f64()), &format!("bf16 {bits:#06x}"));
                same(T::from_f16(h), T::from_f64(h.to_f64()), &format!("f16 {bits:#06x}"));
            }
            let mut x = 0x9e37_79b9u32;
            for i in 0..(1u32 << 20) {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // every fourth a pattern near a bf16 or f16 rounding boundary
                let bits = match i % 4 {
                    0 => (x & 0xffff_0000) | 0x8000 | (x & 0x7ff8),
                    1 => (x & 0xffff_e000) | 0x1000 | (x & 0x0ff8),
                    _ => x & !7,
                };
                let v = f32::from_bits(bits);
                same(T::from_f32(v), T::from_f64(v as f64), &format!("f32 {bits:#010x}"));
            }
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
        // Past a tie by bit 1 only: rounds up (half's f64 route rounds it down, as a tie to even).
        let v = f32::from_bits(0x3f80_8002);
        assert_eq!(<bf16 as Element>::from_f32(v).to_bits(), 0x3f81);
    }

    #[test]
    fn names_round_trip_and_sizes() {
        for d in DataType::ALL {
            assert_eq!(DataType::parse(d.name()), Some(d));
        }
        assert_eq!(DataType::parse("fp8"), None);
        assert_eq!(
            (DataType::F8E4M3.size(), DataType::F8E4M3.is_fp8(), DataType::BF16.is_fp8()),
            (1, true, false)
        );
        assert_eq!((DataType::BF16.size(), DataType::F32.size(), DataType::I64.size()), (2, 4, 8));
        assert_eq!(<bf16 as Element>::DTYPE, DataType::BF16);
    }

    #[test]
    fn raw_codes_match_the_header() {
        // cudnnDataType_t values written in cudnn_graph.h.
        assert_eq!(DataType::F32.to_raw().0, 0);
        assert_eq!(DataType::F16.to_raw().0, 2);
        assert_eq!(DataType::BF16.to_raw().0, 9);
        assert_eq!(DataType::I32.to_raw().0, 4);
        assert_eq!(DataType::I64.to_raw().0, 10);
        assert_eq!(DataType::Bool.to_raw().0, 11);
        assert_eq!(DataType::F8E4M3.to_raw().0, 12);
        assert_eq!(DataType::F8E5M2.to_raw().0, 13);
    }
}
