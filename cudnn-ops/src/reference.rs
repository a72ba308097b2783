//! CPU references in f64, and the comparison used by tests and the report.

use crate::dtype::{DataType, Element};

/// RMSNorm of row-major `[tokens, hidden]` in f64: returns `(y, inv_rms)`.
pub fn rms_norm(
    x: &[f64],
    weight: &[f64],
    tokens: usize,
    hidden: usize,
    epsilon: f64,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(x.len(), tokens * hidden, "reference rms_norm: x length");
    assert_eq!(weight.len(), hidden, "reference rms_norm: weight length");
    let mut y = Vec::with_capacity(x.len());
    let mut inv = Vec::with_capacity(tokens);
    for row in x.chunks_exact(hidden) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let r = 1.0 / (mean_sq + epsilon).sqrt();
        inv.push(r);
        y.extend(row.iter().zip(weight).map(|(v, w)| v * r * w));
    }
    (y, inv)
}

/// Named tolerances per dtype: relative L2 error `‖out − ref‖ / ‖ref‖`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Maximum relative L2 error.
    pub rel_l2: f64,
}

/// bf16 outputs: 8 bits of mantissa, a rounding of ~2e-3 per element; the bound.
pub const BF16_TOL: Tolerance = Tolerance { rel_l2: 1e-2 };
/// f16 outputs: 11 bits of mantissa.
pub const F16_TOL: Tolerance = Tolerance { rel_l2: 2e-3 };
/// f32 outputs with f32 compute.
pub const F32_TOL: Tolerance = Tolerance { rel_l2: 1e-5 };

/// The tolerance for outputs of `dtype`.
pub fn tolerance(dtype: DataType) -> Tolerance {
    match dtype {
        DataType::BF16 => BF16_TOL,
        DataType::F16 => F16_TOL,
        _ => F32_TOL,
    }
}

/// How an output compares with its reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// `‖out − ref‖ / ‖ref‖`.
    pub rel_l2: f64,
    /// Largest `|out − ref|`.
    pub max_abs: f64,
    /// Index of the largest difference.
    pub worst_index: usize,
    /// Elements that are NaN or infinite (unwritten poisoned elements show here).
    pub non_finite: usize,
    /// Elements compared.
    pub len: usize,
}

impl Comparison {
    /// True when every element is finite and the relative error is within `tol`.
    pub fn passes(&self, tol: Tolerance) -> bool {
        self.non_finite == 0 && self.rel_l2 <= tol.rel_l2 && self.rel_l2.is_finite()
    }
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rel_l2 {:.3e}, max |diff| {:.3e} at {}, {} non-finite of {}",
            self.rel_l2, self.max_abs, self.worst_index, self.non_finite, self.len
        )
    }
}

/// Compares `out` with `reference` (lengths must match).
pub fn compare<T: Element>(out: &[T], reference: &[f64]) -> Comparison {
    assert_eq!(out.len(), reference.len(), "compare: lengths differ");
    let (mut diff2, mut ref2, mut max_abs, mut worst, mut non_finite) = (0.0, 0.0, 0.0, 0, 0);
    for (i, (o, r)) in out.iter().zip(reference).enumerate() {
        let o = o.to_f64();
        if !o.is_finite() {
            non_finite += 1;
            continue;
        }
        let d = (o - r).abs();
        diff2 += d * d;
        ref2 += r * r;
        if d > max_abs {
            max_abs = d;
            worst = i;
        }
    }
    let rel_l2 = if ref2 > 0.0 { (diff2 / ref2).sqrt() } else { diff2.sqrt() };
    Comparison { rel_l2, max_abs, worst_index: worst, non_finite, len: out.len() }
}

/// Deterministic pseudo-random values in `[-1, 1)` (SplitMix64), never exactly zero.
pub fn random_values(seed: u64, n: usize) -> Vec<f64> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let v = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            if v == 0.0 {
                0.5
            } else {
                v
            }
        })
        .collect()
}

/// Rounds f64 values to `T` (what the GPU will actually see).
pub fn to_elements<T: Element>(values: &[f64]) -> Vec<T> {
    values.iter().map(|&v| T::from_f64(v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn rms_norm_by_hand() {
        // Row [3, 4]: mean square 12.5, inverse RMS 1/sqrt(12.5).
        let (y, inv) = rms_norm(&[3.0, 4.0, 0.0, 2.0], &[1.0, 2.0], 2, 2, 0.0);
        let r = 1.0 / 12.5f64.sqrt();
        assert!((inv[0] - r).abs() < 1e-15 && (inv[1] - 1.0 / 2.0f64.sqrt()).abs() < 1e-15);
        assert!((y[0] - 3.0 * r).abs() < 1e-15 && (y[1] - 8.0 * r).abs() < 1e-15);
        assert_eq!(y[2], 0.0);
        // Epsilon matters for a zero row.
        let (y, inv) = rms_norm(&[0.0, 0.0], &[1.0, 1.0], 1, 2, 1e-4);
        assert_eq!(y, vec![0.0, 0.0]);
        assert!((inv[0] - 100.0).abs() < 1e-9);
    }

    #[test]
    fn rms_norm_is_scale_invariant() {
        let x = random_values(1, 64);
        let w = random_values(2, 16);
        let (y1, _) = rms_norm(&x, &w, 4, 16, 0.0);
        let x1000: Vec<f64> = x.iter().map(|v| v * 1000.0).collect();
        let (y2, _) = rms_norm(&x1000, &w, 4, 16, 0.0);
        for (a, b) in y1.iter().zip(&y2) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn compare_detects_errors_and_nan() {
        let r = vec![1.0, -2.0, 3.0];
        let exact: Vec<bf16> = to_elements(&r);
        let c = compare(&exact, &r);
        assert!(c.passes(BF16_TOL) && c.rel_l2 == 0.0, "{c}");
        let off: Vec<bf16> = to_elements(&[1.0, -2.0, 3.5]);
        let c = compare(&off, &r);
        assert!(!c.passes(BF16_TOL) && c.worst_index == 2 && (c.max_abs - 0.5).abs() < 1e-12, "{c}");
        let nan = vec![bf16::NAN, bf16::from_f64(-2.0), bf16::from_f64(3.0)];
        let c = compare(&nan, &r);
        assert_eq!(c.non_finite, 1);
        assert!(!c.passes(BF16_TOL));
    }

    #[test]
    fn random_values_are_reproducible_nonzero_and_spread() {
        let a = random_values(7, 10_000);
        assert_eq!(a, random_values(7, 10_000));
        assert_ne!(a, random_values(8, 10_000));
        assert!(a.iter().all(|v| *v != 0.0 && (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
    }
}
