//! Choosing the next token from one position's logits on the host (`f32`, one per vocabulary id).
//!
//! * Greedy: the argmax; ties go to the lowest id. Temperature 0 is greedy.
//! * Otherwise, in the order Hugging Face's `generate` applies them: the logits are divided by the
//!   temperature, softmaxed, cut to the `top_k` most probable ids, then to the smallest prefix of those
//!   (most probable first) whose probability reaches `top_p`, renormalised, and one id is drawn.
//!   Ties in probability are ordered by id, lowest first, so the kept set is deterministic.
//! * Draws come from ChaCha8 seeded with [`SamplingParams::seed`]: the same seed and logits give the
//!   same ids on every platform.
//!
//! Logits holding NaN or +∞ are an error (a broken forward, not a distribution); −∞ is a masked id.

use crate::{Error, Result};
use cudnn_llm_ops::Pick;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Ordering;

/// How to choose tokens. `Default` is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// Softmax temperature, ≥ 0 and finite; 0 means greedy.
    pub temperature: f32,
    /// Keep only the `k` most probable ids (k ≥ 1); `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most probable ids whose probability reaches `p`, in (0, 1]; `None`
    /// (or 1) keeps all.
    pub top_p: Option<f32>,
    /// Seed of the random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Sampling at `temperature` (0 is greedy) from the stream seeded by `seed`, over every id (no
    /// top-k or top-p cut).
    pub fn new(temperature: f32, seed: u64) -> Self {
        SamplingParams { temperature, top_k: None, top_p: None, seed }
    }

    /// The same keeping only the `k` most probable ids.
    pub fn with_top_k(self, k: usize) -> Self {
        SamplingParams { top_k: Some(k), ..self }
    }

    /// The same keeping the smallest set of most probable ids whose probability reaches `p`.
    pub fn with_top_p(self, p: f32) -> Self {
        SamplingParams { top_p: Some(p), ..self }
    }

    /// Argmax decoding.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, top_k: None, top_p: None, seed: 0 }
    }

    /// Whether these parameters choose the argmax (temperature 0, or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }

    /// Checks every parameter; the error names the first one out of range.
    pub fn check(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::Sampling(format!("temperature {t} must be finite and >= 0 (0 is greedy)")));
        }
        if self.top_k == Some(0) {
            return Err(Error::Sampling("top_k 0 keeps no token: give k >= 1, or no top-k".into()));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::Sampling(format!("top_p {p} must be in (0, 1]")));
            }
        }
        Ok(())
    }
}

/// A token chooser: checked parameters and the random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler for `params`, after [`SamplingParams::check`].
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.check()?;
        Ok(Sampler { params, rng: ChaCha8Rng::seed_from_u64(params.seed) })
    }

    /// Argmax decoding.
    pub fn greedy() -> Self {
        Sampler { params: SamplingParams::greedy(), rng: ChaCha8Rng::seed_from_u64(0) }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token for `logits` (one per vocabulary id). Greedy parameters draw nothing from the
    /// random stream.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let kept = distribution(logits, &self.params)?;
        let u: f64 = self.rng.random();
        let mut acc = 0.0;
        for &(id, p) in &kept {
            acc += p;
            if u < acc {
                return Ok(id);
            }
        }
        // Rounding left the sum a hair under 1 and u above it: the last kept id.
        Ok(kept.last().expect("distribution keeps at least one id").0)
    }
}

/// Checks that `logits` can be sampled: non-empty, ids fit `u32`, no NaN or +∞.
fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::Sampling("no logits".into()));
    }
    if u32::try_from(logits.len()).is_err() {
        return Err(Error::Sampling(format!("{} logits: ids past u32", logits.len())));
    }
    if let Some(i) = logits.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
        return Err(broken(i, logits[i]));
    }
    if logits.iter().all(|v| *v == f32::NEG_INFINITY) {
        return Err(masked());
    }
    Ok(())
}

/// The error of logits holding `value` (NaN or +∞) first at id `id`.
fn broken(id: usize, value: f32) -> Error {
    Error::Sampling(format!("logit {value} at id {id}: the forward is broken"))
}

/// The error of logits that are all −∞.
fn masked() -> Error {
    Error::Sampling("every logit is -inf: no token can be chosen".into())
}

/// The id of a greedy pick made on the device ([`cudnn_llm_ops::argmax`]), or the error [`argmax`]
/// gives for the same logits on the host (the same message).
pub fn pick_result(pick: Pick) -> Result<u32> {
    match pick {
        Pick::Id(id) => Ok(id),
        Pick::Broken { id, value } => Err(broken(id as usize, value)),
        Pick::Masked => Err(masked()),
    }
}

/// The id of the largest logit, the lowest such id on ties.
pub fn argmax(logits: &[f32]) -> Result<u32> {
    check_logits(logits)?;
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    Ok(best as u32)
}

/// Most probable first, then lowest id: a total order on `(id, probability)` pairs.
fn by_probability(a: &(u32, f64), b: &(u32, f64)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The ids sampling can draw for `params` with their renormalised probabilities, most probable first
/// (ties by lowest id): temperature, softmax, top-k, then top-p. Greedy parameters give the argmax
/// alone, with probability 1.
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Result<Vec<(u32, f64)>> {
    params.check()?;
    if params.is_greedy() {
        return Ok(vec![(argmax(logits)?, 1.0)]);
    }
    check_logits(logits)?;
    let t = f64::from(params.temperature);
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let mut probs: Vec<(u32, f64)> =
        logits.iter().enumerate().map(|(i, v)| (i as u32, ((*v as f64 - max) / t).exp())).collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    if let Some(k) = params.top_k.filter(|k| *k < probs.len()) {
        probs.select_nth_unstable_by(k, by_probability);
        probs.truncate(k);
        let kept: f64 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= kept);
    }
    let top_p = params.top_p.map_or(1.0, f64::from);
    // Sort only as many of the most probable ids as the cut needs: a head that grows until its
    // probability reaches top_p (a vocabulary of 128k sorted per token would cost more than a step).
    let mut head = 64.min(probs.len());
    loop {
        if head < probs.len() {
            probs.select_nth_unstable_by(head, by_probability);
        }
        probs[..head].sort_unstable_by(by_probability);
        let mut acc = 0.0;
        let cut = probs[..head].iter().position(|p| {
            acc += p.1;
            acc >= top_p
        });
        match cut {
            Some(i) => {
                probs.truncate(i + 1);
                break;
            }
            // Rounding kept the sum of everything under top_p (1): keep everything.
            None if head == probs.len() => break,
            None => head = (head * 4).min(probs.len()),
        }
    }
    let kept: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= kept);
    probs.retain(|p| p.1 > 0.0);
    Ok(probs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, seed }
    }

    /// Logits whose softmax (temperature 1) is `probs`.
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    fn ids(kept: &[(u32, f64)]) -> Vec<u32> {
        kept.iter().map(|p| p.0).collect()
    }

    #[test]
    fn greedy_is_the_argmax_with_ties_to_the_lowest_id() {
        assert_eq!(argmax(&[0.1, 3.0, -1.0, 3.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0]).unwrap(), 1);
        let logits = [0.5, 2.0, 2.0, 1.9, -3.0];
        for p in [SamplingParams::greedy(), params(0.0, Some(3), Some(0.5), 9), params(1.5, Some(1), None, 4)]
        {
            let mut s = Sampler::new(p).unwrap();
            for _ in 0..5 {
                assert_eq!(s.sample(&logits).unwrap(), 1, "{p:?}");
            }
            assert_eq!(distribution(&logits, &p).unwrap(), vec![(1, 1.0)]);
        }
        assert_eq!(Sampler::greedy().sample(&logits).unwrap(), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_seeds_differ() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 101) as f32 / 25.0).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, Some(200), Some(0.95), seed)).unwrap();
            (0..64).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        // Many distinct ids: it samples, not argmaxes.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 10, "{distinct:?}");
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 0.05, 0.5, 0.15, 0.3 (ids 0..4): sorted 1, 3, 2, 0 with sums 0.5, 0.8, 0.95, 1.
        let logits = logits_of(&[0.05, 0.5, 0.15, 0.3]);
        let kept = |p| ids(&distribution(&logits, &params(1.0, None, Some(p), 0)).unwrap());
        assert_eq!(kept(0.9), vec![1, 3, 2]);
        assert_eq!(kept(0.7), vec![1, 3]);
        assert_eq!(kept(0.4), vec![1]);
        assert_eq!(kept(0.99), vec![1, 3, 2, 0]);
        assert_eq!(kept(1.0), vec![1, 3, 2, 0]);
        // Renormalised over the kept set.
        let d = distribution(&logits, &params(1.0, None, Some(0.9), 0)).unwrap();
        let want = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95];
        for ((_, p), w) in d.iter().zip(want) {
            assert!((p - w).abs() < 1e-6, "{d:?}");
        }
        // Draws come from the kept set only.
        let mut s = Sampler::new(params(1.0, None, Some(0.7), 3)).unwrap();
        let seen: std::collections::HashSet<u32> = (0..500).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(seen, [1, 3].into_iter().collect());
    }

    #[test]
    fn top_p_over_a_large_vocabulary_grows_past_the_first_head() {
        // 1000 equal logits: top-p 0.4995 needs 500 ids (499 hold 0.499), past the first sorted head of 64.
        let d = distribution(&vec![0.0; 1000], &params(1.0, None, Some(0.4995), 0)).unwrap();
        assert_eq!(ids(&d), (0..500).collect::<Vec<_>>());
    }

    #[test]
    fn top_k_keeps_the_k_most_probable_ties_to_lower_ids() {
        let logits = [1.0, 4.0, 2.0, 4.0, 3.0, 2.0];
        let kept = |k| ids(&distribution(&logits, &params(1.0, Some(k), None, 0)).unwrap());
        assert_eq!(kept(2), vec![1, 3]);
        assert_eq!(kept(3), vec![1, 3, 4]);
        assert_eq!(kept(4), vec![1, 3, 4, 2]);
        assert_eq!(kept(100), vec![1, 3, 4, 2, 5, 0]);
        // Top-k then top-p over the top-k renormalised: the top 3 have 0.42, 0.42, 0.16, so p 0.8
        // keeps two (over the whole softmax, 0.37 + 0.37 < 0.8 would keep three).
        let both = distribution(&logits, &params(1.0, Some(3), Some(0.8), 0)).unwrap();
        assert_eq!(ids(&both), vec![1, 3]);
        let mut s = Sampler::new(params(1.0, Some(2), None, 5)).unwrap();
        let seen: std::collections::HashSet<u32> = (0..200).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(seen, [1, 3].into_iter().collect());
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let logits = logits_of(&[0.6, 0.3, 0.1]);
        let p = |t| distribution(&logits, &params(t, None, None, 0)).unwrap();
        let one = p(1.0);
        assert!((one[0].1 - 0.6).abs() < 1e-6 && (one[2].1 - 0.1).abs() < 1e-6, "{one:?}");
        // T = 0.5 squares the probabilities before renormalising: 0.36, 0.09, 0.01 over 0.46.
        let half = p(0.5);
        assert!((half[0].1 - 0.36 / 0.46).abs() < 1e-6, "{half:?}");
        // A high temperature is nearly uniform.
        let hot = p(1000.0);
        assert!(hot.iter().all(|x| (x.1 - 1.0 / 3.0).abs() < 1e-3), "{hot:?}");
    }

    #[test]
    fn invalid_parameters_are_errors_naming_the_parameter() {
        for (p, name) in [
            (params(-0.5, None, None, 0), "temperature"),
            (params(f32::NAN, None, None, 0), "temperature"),
            (params(f32::INFINITY, None, None, 0), "temperature"),
            (params(1.0, Some(0), None, 0), "top_k"),
            (params(1.0, None, Some(0.0), 0), "top_p"),
            (params(1.0, None, Some(1.5), 0), "top_p"),
            (params(1.0, None, Some(-0.1), 0), "top_p"),
            (params(1.0, None, Some(f32::NAN), 0), "top_p"),
        ] {
            let e = Sampler::new(p).unwrap_err().to_string();
            assert!(e.contains(name), "{p:?}: {e}");
            let e = distribution(&[1.0, 2.0], &p).unwrap_err().to_string();
            assert!(e.contains(name), "{p:?}: {e}");
        }
    }

    #[test]
    fn unsampleable_logits_are_errors() {
        for (logits, what) in [
            (vec![], "no logits"),
            (vec![1.0, f32::NAN], "id 1"),
            (vec![f32::INFINITY, 0.0], "id 0"),
            (vec![f32::NEG_INFINITY; 3], "-inf"),
        ] {
            let e = argmax(&logits).unwrap_err().to_string();
            assert!(e.contains(what), "{logits:?}: {e}");
            let mut s = Sampler::new(params(1.0, None, Some(0.9), 0)).unwrap();
            let e = s.sample(&logits).unwrap_err().to_string();
            assert!(e.contains(what), "{logits:?}: {e}");
        }
        // A device pick of the same logits gives the same message.
        let picks = [
            Pick::Masked,
            Pick::Broken { id: 1, value: f32::NAN },
            Pick::Broken { id: 0, value: f32::INFINITY },
        ];
        for (logits, pick) in [
            (vec![f32::NEG_INFINITY; 3], picks[0]),
            (vec![1.0, f32::NAN], picks[1]),
            (vec![f32::INFINITY, 0.0], picks[2]),
        ] {
            assert_eq!(pick_result(pick).unwrap_err().to_string(), argmax(&logits).unwrap_err().to_string());
        }
        assert_eq!(pick_result(Pick::Id(5)).unwrap(), 5);
        // -inf is a masked id, never drawn.
        let mut s = Sampler::new(params(1.0, None, None, 1)).unwrap();
        for _ in 0..100 {
            assert_ne!(s.sample(&[0.0, f32::NEG_INFINITY, 0.0]).unwrap(), 1);
        }
    }
}
