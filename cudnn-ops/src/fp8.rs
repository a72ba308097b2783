//! The two 8-bit float formats of Hopper's tensor cores (OCP FP8): [`F8E4M3`] (4 exponent bits, 3
//! mantissa bits, bias 7, no infinities, NaN `S.1111.111`, largest finite 448; PyTorch's
//! `float8_e4m3fn`) and [`F8E5M2`] (5 and 2, bias 15, IEEE-like with infinities, largest finite
//! 57344; `float8_e5m2`).
//!
//! Conversions from wider floats round to nearest, ties to even, and **saturate**: a finite value
//! past the largest finite one becomes that one (with its sign), as CUDA's
//! `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)` and cuDNN's FP8 outputs do, so a scaled tensor
//! never turns into NaN or infinity; NaN stays NaN; an infinity saturates to the largest finite
//! value (E4M3 has none; for E5M2 the same rule keeps scaled data finite). PyTorch's `.to()` does not
//! saturate (it gives NaN past the range): quantizers choose their scales so nothing is past it.

use crate::dtype::{DataType, Element};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// The layout of an 8-bit float: exponent and mantissa bits, and whether the all-ones exponent
/// holds infinities and NaNs (E5M2) or ordinary values with only `S.1111.111` a NaN (E4M3).
struct Format {
    exp_bits: u32,
    man_bits: u32,
    ieee: bool,
}

impl Format {
    const fn bias(&self) -> i32 {
        (1 << (self.exp_bits - 1)) - 1
    }

    /// The code of the largest finite magnitude.
    const fn max_code(&self) -> u8 {
        if self.ieee {
            // Exponent all ones but one, mantissa all ones.
            ((((1u32 << self.exp_bits) - 2) << self.man_bits) | ((1 << self.man_bits) - 1)) as u8
        } else {
            // Exponent all ones, mantissa all ones but the last (all ones is NaN).
            ((((1u32 << self.exp_bits) - 1) << self.man_bits) | ((1 << self.man_bits) - 2)) as u8
        }
    }

    fn nan(&self) -> u8 {
        0x7f
    }

    /// The value of `code`, exactly.
    fn decode(&self, code: u8) -> f64 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = ((code & 0x7f) >> self.man_bits) as i32;
        let man = (code & ((1 << self.man_bits) - 1)) as f64;
        let all_ones = (1 << self.exp_bits) - 1;
        if self.ieee && exp == all_ones {
            return if man == 0.0 { sign * f64::INFINITY } else { f64::NAN };
        }
        if !self.ieee && code & 0x7f == 0x7f {
            return f64::NAN;
        }
        let scale = (1u64 << self.man_bits) as f64;
        if exp == 0 {
            sign * man / scale * 2f64.powi(1 - self.bias())
        } else {
            sign * (1.0 + man / scale) * 2f64.powi(exp - self.bias())
        }
    }

    /// `v` rounded to nearest (ties to even), saturating to the largest finite magnitude.
    fn encode(&self, v: f64) -> u8 {
        if v.is_nan() {
            return self.nan();
        }
        let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
        let a = v.abs();
        let max = self.max_code();
        if a >= self.decode(max) {
            return sign | max;
        }
        // The codes are ordered like their magnitudes: the largest code whose value is at most `a`,
        // then the nearer of it and the next (ties to the even code).
        let (mut lo, mut hi) = (0u8, max);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.decode(mid) <= a {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let below = lo;
        if below == max {
            return sign | max;
        }
        let above = below + 1;
        let (d_lo, d_hi) = (a - self.decode(below), self.decode(above) - a);
        let code = if d_lo < d_hi || (d_lo == d_hi && below % 2 == 0) { below } else { above };
        sign | code
    }
}

const E4M3: Format = Format { exp_bits: 4, man_bits: 3, ieee: false };
const E5M2: Format = Format { exp_bits: 5, man_bits: 2, ieee: true };

macro_rules! fp8_type {
    ($name:ident, $format:ident, $dtype:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name(pub u8);

        impl $name {
            /// The largest finite value.
            pub const MAX: $name = $name($format.max_code());

            /// `v` rounded to nearest (ties to even), saturating: past the largest finite value (or infinite) it
            /// becomes that value with its sign, NaN stays NaN (CUDA's `__NV_SATFINITE`).
            pub fn from_f32(v: f32) -> Self {
                $name($format.encode(v as f64))
            }

            /// The value, exactly.
            pub fn to_f32(self) -> f32 {
                $format.decode(self.0) as f32
            }

            /// The bits.
            pub fn to_bits(self) -> u8 {
                self.0
            }

            /// The number with these bits.
            pub fn from_bits(bits: u8) -> Self {
                $name(bits)
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({:#04x} = {})", stringify!($name), self.0, $format.decode(self.0))
            }
        }

        // SAFETY: a `repr(transparent)` byte: every bit pattern is a valid value (a number or a NaN),
        // all zeros is +0, and the device sees the same single byte.
        unsafe impl DeviceRepr for $name {}
        // SAFETY: all zero bits is the value +0.
        unsafe impl ValidAsZeroBits for $name {}

        impl Element for $name {
            const DTYPE: DataType = $dtype;
            fn from_f64(v: f64) -> Self {
                $name($format.encode(v))
            }
            fn to_f64(self) -> f64 {
                $format.decode(self.0)
            }
            fn nan() -> Self {
                $name($format.nan())
            }
        }
    };
}

fp8_type!(
    F8E4M3,
    E4M3,
    DataType::F8E4M3,
    "An FP8 E4M3 number (`float8_e4m3fn`): 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest finite 448."
);
fp8_type!(
    F8E5M2,
    E5M2,
    DataType::F8E5M2,
    "An FP8 E5M2 number (`float8_e5m2`): 5 exponent bits (bias 15), 2 mantissa bits, infinities, largest finite 57344."
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_e4m3_code_decodes_as_ocp_writes_it() {
        assert_eq!(F8E4M3::MAX, F8E4M3(0x7e));
        assert_eq!(F8E4M3(0x7e).to_f64(), 448.0);
        assert_eq!(F8E4M3(0x01).to_f64(), 2f64.powi(-9), "smallest subnormal");
        assert_eq!(F8E4M3(0x08).to_f64(), 2f64.powi(-6), "smallest normal");
        assert_eq!(F8E4M3(0x38).to_f64(), 1.0);
        assert_eq!(F8E4M3(0x3c).to_f64(), 1.5);
        assert_eq!(F8E4M3(0xc0).to_f64(), -2.0);
        assert!(F8E4M3(0x7f).to_f64().is_nan() && F8E4M3(0xff).to_f64().is_nan());
        assert!(F8E4M3(0x78).to_f64().is_finite(), "exponent all ones is finite (256)");
        assert_eq!(F8E4M3(0x78).to_f64(), 256.0);
        let finite = (0..=255u8).filter(|&c| F8E4M3(c).to_f64().is_finite()).count();
        assert_eq!(finite, 254, "two NaNs, no infinities");
    }

    #[test]
    fn every_e5m2_code_decodes_as_ieee_would() {
        assert_eq!(F8E5M2::MAX, F8E5M2(0x7b));
        assert_eq!(F8E5M2(0x7b).to_f64(), 57344.0);
        assert_eq!(F8E5M2(0x01).to_f64(), 2f64.powi(-16), "smallest subnormal");
        assert_eq!(F8E5M2(0x3c).to_f64(), 1.0);
        assert_eq!(F8E5M2(0x7c).to_f64(), f64::INFINITY);
        assert_eq!(F8E5M2(0xfc).to_f64(), f64::NEG_INFINITY);
        assert!((0x7d..=0x7f).all(|c| F8E5M2(c).to_f64().is_nan()));
        // E5M2 is the top byte of an f16: every finite code decodes as that f16.
        for c in 0..=255u8 {
            let v = F8E5M2(c).to_f64();
            let h = half::f16::from_bits((c as u16) << 8).to_f64();
            assert!(v == h || (v.is_nan() && h.is_nan()), "{c:#04x}: {v} vs f16 {h}");
        }
    }

    fn check_rounding<T: Element + std::fmt::Debug + PartialEq>(
        code: impl Fn(T) -> u8,
        of: impl Fn(u8) -> T,
    ) {
        // Every finite code survives a round trip; the midpoint between neighbours goes to the even
        // one; just past it, to the upper one.
        for c in 0..0x7fu8 {
            let v = of(c).to_f64();
            if !v.is_finite() {
                continue;
            }
            assert_eq!(code(T::from_f64(v)), c, "round trip of {c:#04x} ({v})");
            assert_eq!(code(T::from_f64(-v)), if v == 0.0 { 0x80 } else { c | 0x80 }, "negative {v}");
            let next = of(c + 1).to_f64();
            if next.is_finite() && c + 1 != 0x7f {
                let mid = (v + next) / 2.0;
                let even = if c % 2 == 0 { c } else { c + 1 };
                assert_eq!(code(T::from_f64(mid)), even, "tie between {c:#04x} and {:#04x}", c + 1);
                assert_eq!(
                    code(T::from_f64(mid + (next - v) * 1e-3)),
                    c + 1,
                    "past the midpoint of {c:#04x}"
                );
                assert_eq!(code(T::from_f64(mid - (next - v) * 1e-3)), c, "before the midpoint of {c:#04x}");
            }
        }
    }

    #[test]
    fn conversions_round_to_nearest_even_and_saturate() {
        check_rounding::<F8E4M3>(|x| x.0, F8E4M3);
        check_rounding::<F8E5M2>(|x| x.0, F8E5M2);
        for big in [449.0, 480.0, 1e6, f64::INFINITY] {
            assert_eq!(F8E4M3::from_f64(big), F8E4M3::MAX, "{big}");
            assert_eq!(F8E4M3::from_f64(-big).0, 0xfe, "-{big}");
        }
        assert_eq!(F8E5M2::from_f64(1e9), F8E5M2::MAX);
        assert_eq!(F8E5M2::from_f64(f64::NEG_INFINITY).0, 0xfb);
        assert!(F8E4M3::from_f64(f64::NAN).to_f64().is_nan() && F8E5M2::nan().to_f64().is_nan());
        assert_eq!(F8E4M3::from_f64(2f64.powi(-11)).0, 0x00, "below half the smallest subnormal: zero");
        assert_eq!(F8E4M3::from_f64(2f64.powi(-10) * 1.01).0, 0x01, "past half of it: the subnormal");
        assert_eq!(F8E4M3::from_f32(0.3).to_f32(), 0.3125);
        assert_eq!(F8E5M2::from_f32(0.3).to_f32(), 0.3125);
        assert_eq!(F8E4M3::from_f32(-0.0).to_bits(), 0x80);
    }
}
