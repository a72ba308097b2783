//! RoPE frequencies and their cos/sin tables on the host, in f64: plain RoPE (`theta^(-2i/d)`) and
//! Llama-3's scaling of the low frequencies (Hugging Face's `_compute_llama3_parameters`). The tables
//! go to the device with [`RopeTables::from_frequencies`]; tests and references read the f64 values.

use super::RopeTables;
use crate::dtype::Element;
use crate::error::ensure;
use crate::{Cudnn, Result};

/// Llama-3's RoPE frequency scaling (`rope_type: llama3` in Hugging Face configs): wavelengths longer
/// than `original_max_position / low_freq_factor` are divided by `factor`, shorter than
/// `original_max_position / high_freq_factor` kept, and the band between interpolated.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Llama3Scaling {
    /// Divides the low frequencies (≥ 1).
    pub factor: f64,
    /// Wavelengths above `original_max_position / low_freq_factor` are scaled fully (> 0).
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position / high_freq_factor` are kept (> `low_freq_factor`).
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with (`original_max_position_embeddings`, > 0).
    pub original_max_position: usize,
}

impl Llama3Scaling {
    /// The scaling of `rope_scaling` in a Llama-3 config; checked by [`RopeFrequencies::llama3`].
    pub fn new(
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: usize,
    ) -> Self {
        Llama3Scaling { factor, low_freq_factor, high_freq_factor, original_max_position }
    }

    /// Llama-3.1 and 3.2's values: factor 8 (3.2: 32), low 1, high 4, 8192 original positions.
    pub fn llama_3_1() -> Self {
        Llama3Scaling::new(8.0, 1.0, 4.0, 8192)
    }

    /// The errors [`RopeFrequencies::llama3`] returns, with nothing built.
    fn check(&self) -> Result<()> {
        let Llama3Scaling { factor, low_freq_factor: low, high_freq_factor: high, original_max_position } =
            *self;
        ensure!(
            factor.is_finite() && factor >= 1.0,
            "rope: llama3 factor {factor} is not a finite number ≥ 1"
        );
        ensure!(
            low.is_finite() && low > 0.0,
            "rope: llama3 low_freq_factor {low} is not a finite positive number"
        );
        ensure!(
            high.is_finite() && high > low,
            "rope: llama3 high_freq_factor {high} is not finite and above low_freq_factor {low}"
        );
        ensure!(original_max_position > 0, "rope: llama3 original_max_position is 0");
        Ok(())
    }
}

/// The `head_dim / 2` rotation frequencies of RoPE in the `rotate_half` convention (the first and
/// second halves of each head are the pairs): `theta^(-2i/d)`, optionally with [`Llama3Scaling`].
///
/// ```
/// use cudnn_llm_ops::{Llama3Scaling, RopeFrequencies};
/// // Llama-3.2-1B: head dim 64, theta 500000, factor 32.
/// let f = RopeFrequencies::new(64, 500_000.0)?.llama3(Llama3Scaling::new(32.0, 1.0, 4.0, 8192))?;
/// let (cos, sin) = f.tables(0, 16); // [16 positions, 32] each, f64
/// assert_eq!((cos.len(), sin.len()), (16 * 32, 16 * 32));
/// assert_eq!((cos[0], sin[0]), (1.0, 0.0)); // position 0 is the identity
/// # Ok::<(), cudnn_llm_ops::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeFrequencies {
    head_dim: usize,
    theta: f64,
    scaling: Option<Llama3Scaling>,
}

impl RopeFrequencies {
    /// Plain RoPE for heads of `head_dim` (even, > 0) with base `theta` (finite, > 0).
    pub fn new(head_dim: usize, theta: f64) -> Result<Self> {
        ensure!(head_dim > 0 && head_dim.is_multiple_of(2), "rope: head dim {head_dim} must be even and > 0");
        ensure!(theta.is_finite() && theta > 0.0, "rope: theta {theta} is not a finite positive number");
        Ok(RopeFrequencies { head_dim, theta, scaling: None })
    }

    /// With Llama-3's frequency scaling (checked: see [`Llama3Scaling`]'s fields).
    pub fn llama3(self, scaling: Llama3Scaling) -> Result<Self> {
        scaling.check()?;
        Ok(RopeFrequencies { scaling: Some(scaling), ..self })
    }

    /// The head dim.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The base.
    pub fn theta(&self) -> f64 {
        self.theta
    }

    /// The Llama-3 scaling, if any.
    pub fn scaling(&self) -> Option<Llama3Scaling> {
        self.scaling
    }

    /// The `head_dim / 2` inverse frequencies (radians per position).
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let base = (0..self.head_dim / 2).map(|i| 1.0 / self.theta.powf(2.0 * i as f64 / d));
        let Some(s) = self.scaling else { return base.collect() };
        let old = s.original_max_position as f64;
        let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
        base.map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
    }

    /// `cos` and `sin` of `position · inv_freq`, `[count, head_dim / 2]` row-major, for positions
    /// `start..start + count` (what [`RopeTables::new`] takes, from `start = 0`).
    pub fn tables(&self, start: usize, count: usize) -> (Vec<f64>, Vec<f64>) {
        let f = self.inv_freq();
        let angles: Vec<f64> =
            (start..start + count).flat_map(|p| f.iter().map(move |w| p as f64 * w)).collect();
        (angles.iter().map(|a| a.cos()).collect(), angles.iter().map(|a| a.sin()).collect())
    }
}

/// Rotates one head vector `x` (`head_dim` values) by the angles whose cos/sin are `cos`, `sin`
/// (`head_dim / 2` each, a row of [`RopeFrequencies::tables`]): `x · cos + rotate_half(x) · sin` with
/// `rotate_half(x) = [-x₂, x₁]`, in f64 (the reference of the kernels).
pub fn rotate(x: &mut [f64], cos: &[f64], sin: &[f64]) {
    let half = x.len() / 2;
    for i in 0..half.min(cos.len()).min(sin.len()) {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

impl<T: Element> RopeTables<T> {
    /// Builds and uploads the tables of `freqs` for positions `0..positions`.
    pub fn from_frequencies(ctx: &Cudnn, freqs: &RopeFrequencies, positions: usize) -> Result<Self> {
        // Host f64 tables of [positions, dim / 2] twice, f32 halves and I/O-dtype full rows on the device.
        crate::checked::product("rope: positions * head_dim", &[positions, freqs.head_dim, 8])?;
        let (cos, sin) = freqs.tables(0, positions);
        RopeTables::new(ctx, &cos, &sin, freqs.head_dim)
    }

    /// The head dim the tables rotate.
    pub fn head_dim(&self) -> usize {
        self.dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `llama/src/rope.rs`'s `inv_freq` before the math moved here, verbatim but for its arguments.
    fn llama_inv_freq_before(head_dim: usize, theta: f64, s: Option<Llama3Scaling>) -> Vec<f64> {
        let d = head_dim as f64;
        let base: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / d)).collect();
        let Some(s) = s else { return base };
        let old = s.original_max_position as f64;
        let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    let smooth =
                        (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect()
    }

    #[test]
    fn frequencies_match_llamas_former_values_bit_for_bit() {
        for (d, theta, s) in [
            (64, 500_000.0, Some(Llama3Scaling::new(32.0, 1.0, 4.0, 8192))), // Llama-3.2-1B
            (128, 500_000.0, Some(Llama3Scaling::llama_3_1())),              // Llama-3.1-8B
            (128, 10_000.0, None),                                           // Llama-2
            (16, 500_000.0, Some(Llama3Scaling::new(1.0, 1.0, 4.0, 64))),    // unscaled band
        ] {
            let mut f = RopeFrequencies::new(d, theta).unwrap();
            if let Some(s) = s {
                f = f.llama3(s).unwrap();
            }
            assert_eq!(f.inv_freq(), llama_inv_freq_before(d, theta, s), "{d} {theta} {s:?}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = RopeFrequencies::new(128, 500_000.0).unwrap();
        let scaled = plain.llama3(Llama3Scaling::llama_3_1()).unwrap().inv_freq();
        let plain = plain.inv_freq();
        assert_eq!(plain[0], 1.0);
        assert!((plain[1] - 500000f64.powf(-2.0 / 128.0)).abs() < 1e-15);
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[63], plain[63] / 8.0);
        let banded = scaled.iter().zip(&plain).filter(|(s, p)| s < p && **s > *p / 8.0).count();
        assert!(banded > 0, "some frequencies fall in the interpolated band");
    }

    #[test]
    fn tables_start_at_the_identity_and_rotate_by_relative_position() {
        let f = RopeFrequencies::new(16, 10_000.0).unwrap();
        let (cos, sin) = f.tables(0, 20);
        assert!(cos[..8].iter().all(|&c| c == 1.0) && sin[..8].iter().all(|&s| s == 0.0));
        // An offset start gives the same rows.
        let (c5, s5) = f.tables(5, 3);
        assert_eq!((&c5[..], &s5[..]), (&cos[5 * 8..8 * 8], &sin[5 * 8..8 * 8]));
        // <R(m)q, R(n)k> depends on m − n only.
        let q: Vec<f64> = (0..16).map(|i| (i as f64).cos()).collect();
        let k: Vec<f64> = (0..16).map(|i| (i as f64 * 0.37).sin()).collect();
        let dot_at = |m: usize, n: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            rotate(&mut a, &cos[m * 8..][..8], &sin[m * 8..][..8]);
            rotate(&mut b, &cos[n * 8..][..8], &sin[n * 8..][..8]);
            a.iter().zip(&b).map(|(u, v)| u * v).sum::<f64>()
        };
        assert!((dot_at(7, 3) - dot_at(14, 10)).abs() < 1e-9);
        assert!((dot_at(7, 3) - dot_at(7, 4)).abs() > 1e-6);
    }

    #[test]
    fn bad_frequencies_are_refused() {
        for (d, theta, expected) in
            [(0, 1e4, "even and > 0"), (7, 1e4, "even"), (8, 0.0, "theta 0"), (8, f64::NAN, "theta NaN")]
        {
            let e = RopeFrequencies::new(d, theta).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        let f = RopeFrequencies::new(8, 1e4).unwrap();
        for (s, expected) in [
            (Llama3Scaling::new(0.5, 1.0, 4.0, 8192), "factor 0.5"),
            (Llama3Scaling::new(8.0, 0.0, 4.0, 8192), "low_freq_factor 0"),
            (Llama3Scaling::new(8.0, 4.0, 4.0, 8192), "high_freq_factor 4"),
            (Llama3Scaling::new(8.0, 1.0, f64::INFINITY, 8192), "high_freq_factor inf"),
            (Llama3Scaling::new(8.0, 1.0, 4.0, 0), "original_max_position is 0"),
        ] {
            let e = f.llama3(s).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
    }
}
