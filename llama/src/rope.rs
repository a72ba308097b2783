//! Rotary position embedding as Llama-3 uses it: Hugging Face's `rotate_half` convention (the first
//! and second halves of each head are the pair), frequencies `theta^(-2i/d)` with Llama-3's scaling of
//! the low frequencies.

use crate::config::LlamaConfig;
use crate::{Error, Result};
use cudnn_llm_ops::{Llama3Scaling, RopeFrequencies};

/// The model's RoPE frequencies ([`RopeFrequencies`] in `cudnn-llm-ops`, where the math lives): base
/// `rope_theta`, Llama-3 scaled when the config says so. A theta or scaling that
/// [`LlamaConfig::check`] refuses is an [`Error::Config`].
pub fn frequencies(cfg: &LlamaConfig) -> Result<RopeFrequencies> {
    let config = |e: cudnn_llm_ops::Error| Error::Config(e.to_string());
    let f = RopeFrequencies::new(cfg.head_dim, cfg.rope_theta).map_err(config)?;
    match cfg.rope_scaling {
        None => Ok(f),
        Some(s) => {
            let s =
                Llama3Scaling::new(s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position);
            f.llama3(s).map_err(config)
        }
    }
}

/// The `head_dim / 2` inverse frequencies, Llama-3 scaled when the config says so (Hugging Face's
/// `_compute_llama3_parameters`; see [`RopeFrequencies::inv_freq`]).
pub fn inv_freq(cfg: &LlamaConfig) -> Result<Vec<f64>> {
    Ok(frequencies(cfg)?.inv_freq())
}

/// `cos` and `sin` of `position · inv_freq`, `[positions, head_dim / 2]` row-major, for positions
/// `start..start + count`.
pub fn tables(cfg: &LlamaConfig, start: usize, count: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    Ok(frequencies(cfg)?.tables(start, count))
}

/// Rotates one head vector `x` (`head_dim` values) by the angles whose cos/sin are `cos`, `sin`
/// (`head_dim / 2` each): `x · cos + rotate_half(x) · sin` with `rotate_half(x) = [-x₂, x₁]`.
pub use cudnn_llm_ops::ops::rope::rotate;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let cfg = LlamaConfig::llama_3_1_8b();
        let plain = inv_freq(&LlamaConfig { rope_scaling: None, ..cfg.clone() }).unwrap();
        let scaled = inv_freq(&cfg).unwrap();
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
            let (c, s) = tables(&cfg, 0, 4).unwrap();
            assert!(c.iter().chain(&s).all(|v| v.is_finite()));
        }
    }

    #[test]
    fn rotation_preserves_norms_and_position_zero_is_identity() {
        let cfg = LlamaConfig::tiny();
        let (cos, sin) = tables(&cfg, 0, 5).unwrap();
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
            let (c, s) = tables(&cfg, 0, 20).unwrap();
            let (mut a, mut b) = (q.clone(), x.clone());
            rotate(&mut a, &c[m * h..][..h], &s[m * h..][..h]);
            rotate(&mut b, &c[n * h..][..h], &s[n * h..][..h]);
            a.iter().zip(&b).map(|(u, v)| u * v).sum::<f64>()
        };
        assert!((dot_at(7, 3) - dot_at(14, 10)).abs() < 1e-9);
    }
}
