//! Rotary position embedding as Llama-3 uses it: Hugging Face's `rotate_half` convention (the first
//! and second halves of each head are the pair), frequencies `theta^(-2i/d)` with Llama-3's scaling of
//! the low frequencies.

use crate::config::LlamaConfig;

/// The `head_dim / 2` inverse frequencies, Llama-3 scaled when the config says so (Hugging Face's
/// `_compute_llama3_parameters`): wavelengths longer than `original_max_position / low_freq_factor`
/// are divided by `factor`, shorter than `original_max_position / high_freq_factor` kept, and the band
/// between interpolated.
pub fn inv_freq(cfg: &LlamaConfig) -> Vec<f64> {
    let d = cfg.head_dim as f64;
    let base: Vec<f64> =
        (0..cfg.head_dim / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d)).collect();
    let Some(s) = cfg.rope_scaling else { return base };
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
                let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// `cos` and `sin` of `position · inv_freq`, `[positions, head_dim / 2]` row-major, for positions
/// `start..start + count`.
pub fn tables(cfg: &LlamaConfig, start: usize, count: usize) -> (Vec<f64>, Vec<f64>) {
    let f = inv_freq(cfg);
    let angles: Vec<f64> = (start..start + count).flat_map(|p| f.iter().map(move |w| p as f64 * w)).collect();
    (angles.iter().map(|a| a.cos()).collect(), angles.iter().map(|a| a.sin()).collect())
}

/// Rotates one head vector `x` (`head_dim` values) by the angles whose cos/sin are `cos`, `sin`
/// (`head_dim / 2` each): `x · cos + rotate_half(x) · sin` with `rotate_half(x) = [-x₂, x₁]`.
pub fn rotate(x: &mut [f64], cos: &[f64], sin: &[f64]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let cfg = LlamaConfig::llama_3_1_8b();
        let plain = inv_freq(&LlamaConfig { rope_scaling: None, ..cfg.clone() });
        let scaled = inv_freq(&cfg);
        assert_eq!(plain.len(), 64);
        assert_eq!(plain[0], 1.0);
        assert!((plain[1] - 500000f64.powf(-2.0 / 128.0)).abs() < 1e-15);
        // Short wavelengths (< 8192 / 4 = 2048 positions) are untouched, long ones (> 8192) divided by 8.
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[63], plain[63] / 8.0);
        let mut banded = 0;
        for (s, p) in scaled.iter().zip(&plain) {
            let wavelen = 2.0 * std::f64::consts::PI / p;
            if wavelen < 2048.0 {
                assert_eq!(s, p);
            } else if wavelen > 8192.0 {
                assert_eq!(*s, p / 8.0);
            } else {
                banded += 1;
                assert!(*s < *p && *s > p / 8.0);
            }
        }
        assert!(banded > 0, "some frequencies fall in the interpolated band");
    }

    /// The edge values `LlamaConfig::check` accepts (its tests hold the ones it refuses) give finite
    /// tables.
    #[test]
    fn values_the_config_check_accepts_give_finite_tables() {
        let base = LlamaConfig::tiny();
        let unscaled = LlamaConfig {
            rope_scaling: Some(crate::config::RopeScaling { factor: 1.0, ..base.rope_scaling.unwrap() }),
            ..base.clone()
        };
        for cfg in [base.clone(), unscaled, LlamaConfig { rms_eps: 0.1, ..base.clone() }] {
            cfg.check().unwrap();
            let (c, s) = tables(&cfg, 0, 4);
            assert!(c.iter().chain(&s).all(|v| v.is_finite()));
        }
    }

    #[test]
    fn rotation_preserves_norms_and_position_zero_is_identity() {
        let cfg = LlamaConfig::tiny();
        let (cos, sin) = tables(&cfg, 0, 5);
        let h = cfg.head_dim / 2;
        let x: Vec<f64> = (0..cfg.head_dim).map(|i| (i as f64 * 0.37).sin() + 0.1).collect();
        let mut y = x.clone();
        rotate(&mut y, &cos[..h], &sin[..h]);
        assert_eq!(x, y);
        for p in 1..5 {
            let mut y = x.clone();
            rotate(&mut y, &cos[p * h..][..h], &sin[p * h..][..h]);
            let n = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>();
            assert!((n(&x) - n(&y)).abs() < 1e-12);
            assert_ne!(x, y);
        }
        // Relative positions: <R(m)q, R(n)k> depends on m − n only.
        let q: Vec<f64> = (0..cfg.head_dim).map(|i| (i as f64).cos()).collect();
        let dot_at = |m: usize, n: usize| {
            let (c, s) = tables(&cfg, 0, 20);
            let (mut a, mut b) = (q.clone(), x.clone());
            rotate(&mut a, &c[m * h..][..h], &s[m * h..][..h]);
            rotate(&mut b, &c[n * h..][..h], &s[n * h..][..h]);
            a.iter().zip(&b).map(|(u, v)| u * v).sum::<f64>()
        };
        assert!((dot_at(7, 3) - dot_at(14, 10)).abs() < 1e-9);
    }
}
