//! FP8 quantization of activations on the device: `x` `[rows, cols]` (bf16, f16 or f32) into FP8
//! codes ([`F8E4M3`](crate::F8E4M3) or [`F8E5M2`](crate::F8E5M2)) and their dequantization factors,
//! one per row (per token, [`Scaling::PerRow`]) or one for the tensor: `factor = amax / FP8_MAX` (1
//! where the amax is 0) and `code = x / factor` rounded to nearest even and saturated, the rule of
//! [`quantize`] (the CPU side, and the reference: the codes agree bit for bit). What feeds
//! [`scaled_matmul`](crate::scaled_matmul) in an FP8 prefill.
//!
//! Fused: per row one kernel (a block per row: amax, factor, codes); per tensor three (blocks' partial
//! maxima, the factor, the codes). Naive: the eager decomposition (`x.float()`, `abs`, `amax`, the
//! factor, the division, the cast), a launch each ([`naive`]).

mod fused;
pub mod naive;

use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::ops::Op;
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// One factor per row, or one for the whole tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scaling {
    /// One factor for all of it.
    PerTensor,
    /// One factor per row (per token).
    PerRow,
}

/// Shape and scaling of a quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct QuantizeArgs {
    /// Rows (tokens).
    pub rows: usize,
    /// Row length.
    pub cols: usize,
    /// Per row or per tensor.
    pub scaling: Scaling,
}

impl QuantizeArgs {
    /// `rows` rows of `cols`, one factor per row.
    pub fn per_row(rows: usize, cols: usize) -> Self {
        QuantizeArgs { rows, cols, scaling: Scaling::PerRow }
    }

    /// `rows` rows of `cols`, one factor for all.
    pub fn per_tensor(rows: usize, cols: usize) -> Self {
        QuantizeArgs { rows, cols, scaling: Scaling::PerTensor }
    }

    /// The factor count: `rows` or 1.
    pub fn factors(&self) -> usize {
        match self.scaling {
            Scaling::PerRow => self.rows,
            Scaling::PerTensor => 1,
        }
    }

    /// Checks the shape, dtypes and buffer lengths (x, codes, factors, in elements); nothing is
    /// touched on error.
    pub fn check(&self, x: DataType, q: DataType, lens: [usize; 3]) -> Result<()> {
        let QuantizeArgs { rows, cols, .. } = *self;
        ensure!(rows > 0 && cols > 0, "quantize_fp8: rows and cols must be > 0 (got {rows}, {cols})");
        ensure!(
            matches!(x, DataType::BF16 | DataType::F16 | DataType::F32),
            "quantize_fp8: the input dtype {x} is not bf16, f16 or f32"
        );
        ensure!(q.is_fp8(), "quantize_fp8: the codes' dtype {q} is not FP8");
        let n = crate::checked::product("quantize_fp8: rows * cols", &[rows, cols])?;
        let [lx, lq, lf] = lens;
        ensure!(lx >= n, "quantize_fp8: x has {lx} elements, needs rows*cols = {n}");
        ensure!(lq >= n, "quantize_fp8: the codes have {lq} elements, need rows*cols = {n}");
        let want = self.factors();
        ensure!(lf == want, "quantize_fp8: factors has {lf} elements, needs {want} ({:?})", self.scaling);
        Ok(())
    }
}

/// The buffers of a quantization: x in, codes and factors out.
#[non_exhaustive]
pub struct QuantizeOperands<'a, T: Element, F: Element> {
    /// `[rows, cols]` row-major.
    pub x: &'a dyn DevicePtr<T>,
    /// `[rows, cols]` row-major FP8 codes.
    pub q: &'a mut dyn DevicePtrMut<F>,
    /// `rows` or 1 f32 factors.
    pub factors: &'a mut dyn DevicePtrMut<f32>,
}

impl<'a, T: Element, F: Element> QuantizeOperands<'a, T, F> {
    /// x in; codes and factors out.
    pub fn new(
        x: &'a dyn DevicePtr<T>,
        q: &'a mut dyn DevicePtrMut<F>,
        factors: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        QuantizeOperands { x, q, factors }
    }
}

impl<T: Element, F: Element> Op<(T, F)> for QuantizeArgs {
    type Operands<'a> = QuantizeOperands<'a, T, F>;

    fn checked(self, x: &QuantizeOperands<'_, T, F>) -> Result<Self> {
        self.check(T::DTYPE, F::DTYPE, [x.x.len(), x.q.len(), x.factors.len()])?;
        Ok(self)
    }
}

/// Quantizes `x` to FP8 on `backend`.
pub fn quantize_fp8<T: Element, F: Element>(
    ctx: &Cudnn,
    args: QuantizeArgs,
    x: QuantizeOperands<'_, T, F>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<(T, F), _>(ctx, args, x, backend)
}

/// `values` (row-major `[rows, cols]`) quantized to FP8 `T` on the CPU with one factor per row
/// (`per_row`) or for all: each factor is the rows' largest magnitude over `T`'s largest finite value
/// (1 for rows of zeros), each code the value over its factor rounded to `T` (to nearest even,
/// saturating). Returns the codes and the factors (`value ≈ code · factor`). The reference of
/// [`quantize_fp8`]; panics for a `T` that is not FP8.
pub fn quantize<T: Element>(values: &[f32], rows: usize, cols: usize, per_row: bool) -> (Vec<T>, Vec<f32>) {
    assert!(T::DTYPE.is_fp8(), "quantize: {} is not an FP8 type", T::DTYPE);
    assert_eq!(values.len(), rows * cols, "quantize: values length");
    let max = T::from_f64(f64::MAX).to_f64() as f32;
    // In f32, as the kernels compute them: the factor, then the quotient, rounded once to FP8.
    let factor = |amax: f32| if amax > 0.0 { amax / max } else { 1.0 };
    let amax = |v: &[f32]| v.iter().fold(0f32, |m, x| if x.is_nan() { m } else { m.max(x.abs()) });
    let factors: Vec<f32> = if per_row {
        values.chunks(cols.max(1)).map(|r| factor(amax(r))).collect()
    } else {
        vec![factor(amax(values))]
    };
    let codes = values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let f = if per_row { factors[i / cols.max(1)] } else { factors[0] };
            T::from_f64((v / f) as f64)
        })
        .collect();
    (codes, factors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{F8E4M3, F8E5M2};

    #[test]
    fn argument_errors_name_the_argument() {
        let (bf, e4) = (DataType::BF16, DataType::F8E4M3);
        let a = QuantizeArgs::per_row(4, 32);
        assert!(a.check(bf, e4, [128, 128, 4]).is_ok());
        assert!(QuantizeArgs::per_tensor(4, 32)
            .check(DataType::F32, DataType::F8E5M2, [128, 128, 1])
            .is_ok());
        let cases = [
            (QuantizeArgs::per_row(0, 32).check(bf, e4, [128, 128, 4]), "must be > 0"),
            (a.check(DataType::I32, e4, [128, 128, 4]), "input dtype i32"),
            (a.check(bf, bf, [128, 128, 4]), "codes' dtype bf16 is not FP8"),
            (a.check(bf, e4, [127, 128, 4]), "x has 127 elements"),
            (a.check(bf, e4, [128, 127, 4]), "codes have 127 elements"),
            (a.check(bf, e4, [128, 128, 1]), "factors has 1 elements, needs 4 (PerRow)"),
            (QuantizeArgs::per_row(usize::MAX, 32).check(bf, e4, [128, 128, 4]), "overflows"),
        ];
        for (r, expected) in cases {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(expected), "{e} (expected `{expected}`)");
        }
    }

    /// `quant_encode` of quantize.cu, step for step in f32 (`frexpf`, `ldexpf`, `rintf`).
    fn device_rule(v: f32, man: i32, bias: i32, max_code: u8, max_value: f32) -> u8 {
        if v.is_nan() {
            return 0x7f;
        }
        let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
        let a = v.abs();
        if a >= max_value {
            return sign | max_code;
        }
        let steps = (1 << man) as f32;
        // frexpf: a = f * 2^e with f in [0.5, 1) (a normal f32 here).
        let e = if a == 0.0 { 0 } else { ((a.to_bits() >> 23) & 0xff) as i32 - 126 };
        let mut big_e = e - 1 + bias;
        let ldexp = |x: f32, p: i32| x * 2f32.powi(p);
        if a == 0.0 || big_e < 1 {
            let k = ldexp(a, bias - 1 + man).round_ties_even();
            return sign | k as u8;
        }
        let mut f = ((ldexp(a, 1 - e) - 1.0) * steps).round_ties_even();
        if f == steps {
            f = 0.0;
            big_e += 1;
        }
        let code = (big_e << man) | f as i32;
        sign | (if code > max_code as i32 { max_code } else { code as u8 })
    }

    #[test]
    fn the_kernels_rounding_rule_is_the_hosts_bit_for_bit() {
        // Every f32 between the codes' midpoints and far beyond: a sweep over 2^-12 .. 2^17 in steps
        // of 1/64 of an octave, both signs, zero and NaN.
        let mut values = vec![0.0f32, -0.0, f32::NAN, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e30];
        for octave in -12..17 {
            for s in 0..64 {
                values.push(2f32.powi(octave) * (1.0 + s as f32 / 64.0));
            }
        }
        for &v in values.iter().chain(values.clone().iter().map(|v| -v).collect::<Vec<_>>().iter()) {
            let (h4, h5) = (F8E4M3::from_f64(v as f64).0, F8E5M2::from_f64(v as f64).0);
            assert_eq!(device_rule(v, 3, 7, 0x7e, 448.0), h4, "e4m3 of {v}");
            assert_eq!(device_rule(v, 2, 15, 0x7b, 57344.0), h5, "e5m2 of {v}");
        }
        // The midpoints between neighbouring codes, where rounding decides.
        for c in 0..0x7eu8 {
            let (lo, hi) = (F8E4M3(c).to_f64(), F8E4M3(c + 1).to_f64());
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(
                device_rule(mid, 3, 7, 0x7e, 448.0),
                F8E4M3::from_f64(mid as f64).0,
                "e4m3 tie at {mid}"
            );
        }
        for c in 0..0x7bu8 {
            let (lo, hi) = (F8E5M2(c).to_f64(), F8E5M2(c + 1).to_f64());
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(
                device_rule(mid, 2, 15, 0x7b, 57344.0),
                F8E5M2::from_f64(mid as f64).0,
                "e5m2 tie at {mid}"
            );
        }
    }

    #[test]
    fn each_rows_largest_value_lands_on_the_largest_code() {
        let (rows, cols) = (3, 16);
        let v: Vec<f32> =
            (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * (1 + i / cols) as f32).collect();
        let (q, f) = quantize::<F8E4M3>(&v, rows, cols, true);
        for r in 0..rows {
            let row = &v[r * cols..(r + 1) * cols];
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert_eq!(f[r], amax / 448.0);
            let at = row.iter().position(|x| x.abs() == amax).unwrap();
            assert_eq!(q[r * cols + at].0 & 0x7f, 0x7e, "row {r}");
        }
        let (z, f) = quantize::<F8E5M2>(&[0.0; 8], 1, 8, false);
        assert_eq!((z.iter().all(|c| c.0 == 0), f), (true, vec![1.0]));
        // A NaN does not set its row's factor and stays NaN.
        let (q, f) = quantize::<F8E4M3>(&[f32::NAN, 2.0, -1.0, 0.5], 1, 4, true);
        assert_eq!(f, vec![2.0 / 448.0]);
        assert!(q[0].to_f64().is_nan() && q[1].0 == 0x7e);
    }
}
