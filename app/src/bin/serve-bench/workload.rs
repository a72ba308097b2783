//! The synthetic request stream and the latency statistics (no GPU): arrivals of a Poisson process
//! (exponential gaps at `rate` requests/s, or all at once), optionally in bursts (a burst of 1 to
//! `burst` requests at each arrival time, the bursts' times a Poisson process at `rate` / the mean
//! burst), prompt and output lengths uniform in their ranges, prompt ids uniform over the vocabulary,
//! and a `cancel` fraction of the requests cancelled after a uniform number of their ids (1 to one
//! fewer than asked); all drawn from SplitMix64 streams seeded by `--seed`
//! (`cudnn_llm::reference::random_iter`), so that a seed gives the same requests on every machine.

use cudnn_llm::reference::random_iter;

/// An inclusive range of lengths, written `MIN:MAX` (or one number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Smallest.
    pub min: usize,
    /// Largest.
    pub max: usize,
}

impl std::str::FromStr for Span {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |t: &str| t.trim().parse::<usize>().map_err(|e| format!("`{t}`: {e}"));
        let (min, max) = match s.split_once(':') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(s)?, num(s)?),
        };
        if min == 0 || max < min {
            return Err(format!("`{s}`: give MIN:MAX with 1 <= MIN <= MAX"));
        }
        Ok(Span { min, max })
    }
}

/// One request of the stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Seconds after the start.
    pub arrival: f64,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// New ids it asks for (at least 1).
    pub output: usize,
    /// Cancelled once it has this many new ids (fewer than `output`), if at all.
    pub cancel_after: Option<usize>,
}

impl Request {
    /// Whether it ends once it has `produced` new ids: its last, or the one it is cancelled after.
    pub fn ends_at(&self, produced: usize) -> bool {
        produced == self.output || Some(produced) == self.cancel_after
    }

    /// The new ids it ends with: all it asked for, or those it has when cancelled.
    pub fn wanted(&self) -> usize {
        self.cancel_after.unwrap_or(self.output)
    }
}

/// The requests of `reqs` that did not end with the ids they wanted (`ended[r]`: the new ids request
/// `r` ended with, `None` if it never ended).
pub fn lost(reqs: &[Request], ended: &[Option<Vec<u32>>]) -> Vec<usize> {
    (0..reqs.len())
        .filter(|&r| ended.get(r).and_then(Option::as_ref).is_none_or(|ids| ids.len() != reqs[r].wanted()))
        .collect()
}

/// How requests arrive and leave, besides their lengths.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    /// Arrivals per second (`f64::INFINITY`: all at 0).
    pub rate: f64,
    /// The largest burst (1: one request per arrival time).
    pub burst: usize,
    /// The fraction of requests (with 2 or more new ids) cancelled part way, in 0..=1.
    pub cancel: f64,
}

#[cfg(test)]
impl Mix {
    /// Poisson arrivals at `rate`, one at a time, none cancelled.
    pub fn poisson(rate: f64) -> Self {
        Mix { rate, burst: 1, cancel: 0.0 }
    }
}

/// `n` requests arriving and cancelled as `mix` says, prompts of `prompt` lengths, outputs of
/// `output` lengths, ids below `vocab`; deterministic for `seed`.
pub fn requests(n: usize, mix: Mix, prompt: Span, output: Span, vocab: usize, seed: u64) -> Vec<Request> {
    // Independent streams for gaps, lengths, ids, bursts and cancellations, so that one change leaves
    // the others as they were (a mix of single arrivals and no cancellations draws from neither of the
    // last two: its stream is the plain Poisson one).
    let mut gaps = random_iter(seed ^ 0xA11);
    let mut lens = random_iter(seed ^ 0x1E4);
    let mut ids = random_iter(seed ^ 0x1D5);
    let mut bursts = random_iter(seed ^ 0xB57);
    let mut cancels = random_iter(seed ^ 0xCA7);
    let burst = Span { min: 1, max: mix.burst.max(1) };
    // Bursts arrive at rate / their mean size, so that requests still arrive at `rate`.
    let burst_rate = mix.rate / ((1 + burst.max) as f64 / 2.0);
    let mut left_in_burst = 0;
    let unit = |r: &mut dyn Iterator<Item = f64>| r.next().map_or(0.5, |v| v * 0.5 + 0.5); // [0, 1)
    let pick = |r: &mut dyn Iterator<Item = f64>, s: Span| {
        s.min + ((unit(r) * (s.max - s.min + 1) as f64) as usize).min(s.max - s.min)
    };
    let mut t = 0.0;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        if left_in_burst == 0 {
            if mix.rate.is_finite() {
                // Exponential gap: -ln(1 - u) / rate, u in [0, 1).
                t += -(1.0 - unit(&mut gaps)).ln() / burst_rate;
            }
            left_in_burst = if burst.max > 1 { pick(&mut bursts, burst) } else { 1 };
        }
        left_in_burst -= 1;
        let p = pick(&mut lens, prompt);
        let o = pick(&mut lens, output);
        let prompt =
            (0..p).map(|_| ((unit(&mut ids) * vocab as f64) as usize).min(vocab - 1) as u32).collect();
        let cancel_after = (mix.cancel > 0.0 && o >= 2 && unit(&mut cancels) < mix.cancel)
            .then(|| pick(&mut cancels, Span { min: 1, max: o - 1 }));
        out.push(Request { arrival: t, prompt, output: o, cancel_after });
    }
    out
}

/// The `q`-quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Prefill batching: consecutive prompts of `lens` grouped into forwards of at most `max_tokens`
/// prompt tokens (a longer prompt alone), as index ranges; `max_tokens` 0: one prompt per forward.
pub fn prefill_groups(lens: &[usize], max_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut tokens = 0;
    for (i, &n) in lens.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if max_tokens > 0 && tokens + n <= max_tokens => {
                g.end = i + 1;
                tokens += n;
            }
            _ => {
                groups.push(i..i + 1);
                tokens = n;
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_groups_pack_consecutive_prompts_up_to_the_token_limit() {
        assert_eq!(prefill_groups(&[100, 200, 300, 50], 1000), vec![0..4]);
        assert_eq!(prefill_groups(&[600, 300, 200, 900, 2000, 10], 1000), vec![0..2, 2..3, 3..4, 4..5, 5..6]);
        assert_eq!(prefill_groups(&[5, 5, 5], 0), vec![0..1, 1..2, 2..3], "0: one prompt per forward");
        assert!(prefill_groups(&[], 100).is_empty());
    }

    #[test]
    fn spans_parse_and_refuse_what_is_empty() {
        assert_eq!("128:1024".parse::<Span>().unwrap(), Span { min: 128, max: 1024 });
        assert_eq!("7".parse::<Span>().unwrap(), Span { min: 7, max: 7 });
        for bad in ["0:4", "9:3", "a:3", "", "3:"] {
            assert!(bad.parse::<Span>().is_err(), "{bad}");
        }
    }

    #[test]
    fn streams_are_seeded_and_follow_their_distributions() {
        let (p, o) = (Span { min: 16, max: 64 }, Span { min: 1, max: 8 });
        let a = requests(2000, Mix::poisson(10.0), p, o, 500, 3);
        assert_eq!(a, requests(2000, Mix::poisson(10.0), p, o, 500, 3), "the same seed, the same stream");
        assert_ne!(a, requests(2000, Mix::poisson(10.0), p, o, 500, 4));
        assert!(a.iter().all(|r| r.cancel_after.is_none()));
        assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival), "arrivals in order");
        // Poisson at 10/s: the mean gap is 0.1 s (2000 gaps: within a few percent).
        let mean_gap = a.last().unwrap().arrival / 2000.0;
        assert!((mean_gap - 0.1).abs() < 0.01, "mean gap {mean_gap}");
        for r in &a {
            assert!((16..=64).contains(&r.prompt.len()) && (1..=8).contains(&r.output));
            assert!(r.prompt.iter().all(|&id| id < 500));
        }
        // Every length of the span comes up, the mean near the middle.
        let mean = a.iter().map(|r| r.prompt.len()).sum::<usize>() as f64 / 2000.0;
        assert!((mean - 40.0).abs() < 2.0, "mean prompt {mean}");
        assert!([16, 64].iter().all(|n| a.iter().any(|r| r.prompt.len() == *n)));
        assert!([1, 8].iter().all(|n| a.iter().any(|r| r.output == *n)));
        // An infinite rate: everything at once.
        assert!(requests(10, Mix::poisson(f64::INFINITY), p, o, 500, 3).iter().all(|r| r.arrival == 0.0));
    }

    #[test]
    fn bursts_keep_the_rate_and_cancellations_their_fraction() {
        let (p, o) = (Span { min: 16, max: 64 }, Span { min: 1, max: 8 });
        let mix = Mix { rate: 10.0, burst: 7, cancel: 0.25 };
        let a = requests(4000, mix, p, o, 500, 3);
        assert_eq!(a, requests(4000, mix, p, o, 500, 3));
        // The lengths and ids are those of the plain stream: bursts and cancellations draw apart.
        let plain = requests(4000, Mix::poisson(10.0), p, o, 500, 3);
        assert!(a.iter().zip(&plain).all(|(x, y)| x.prompt == y.prompt && x.output == y.output));
        // Bursts of 1 to 7 (mean 4) at 2.5/s: requests still at 10/s, within a few percent.
        let rate = 4000.0 / a.last().unwrap().arrival;
        assert!((rate - 10.0).abs() < 0.6, "rate {rate}");
        let mut sizes = vec![1usize];
        for w in a.windows(2) {
            if w[1].arrival == w[0].arrival {
                *sizes.last_mut().unwrap() += 1;
            } else {
                sizes.push(1);
            }
        }
        assert!(sizes.iter().all(|&s| (1..=7).contains(&s)) && sizes.contains(&7), "{sizes:?}");
        let mean = 4000.0 / sizes.len() as f64;
        assert!((mean - 4.0).abs() < 0.3, "mean burst {mean}");
        // A quarter of the requests that can be cancelled are, each before its last id.
        let can = a.iter().filter(|r| r.output >= 2).count() as f64;
        let cancelled: Vec<_> = a.iter().filter_map(|r| r.cancel_after.map(|k| (k, r.output))).collect();
        let share = cancelled.len() as f64 / can;
        assert!((share - 0.25).abs() < 0.03, "share {share}");
        assert!(cancelled.iter().all(|&(k, o)| (1..o).contains(&k)));
        assert!(a.iter().filter(|r| r.output == 1).all(|r| r.cancel_after.is_none()));
    }

    #[test]
    fn a_request_ends_at_its_last_id_or_its_cancellation_and_is_lost_otherwise() {
        let r = |output, cancel_after| Request { arrival: 0.0, prompt: vec![1], output, cancel_after };
        let reqs = [r(4, None), r(5, Some(2)), r(1, None), r(3, None)];
        assert!(!reqs[0].ends_at(3) && reqs[0].ends_at(4));
        assert!(reqs[1].ends_at(2) && !reqs[1].ends_at(1));
        assert_eq!(reqs.iter().map(Request::wanted).collect::<Vec<_>>(), [4, 2, 1, 3]);
        let ended = [Some(vec![7; 4]), Some(vec![7; 2]), Some(vec![7]), None];
        assert_eq!(lost(&reqs, &ended), [3], "never ended");
        let short = [Some(vec![7; 3]), Some(vec![7; 5]), Some(vec![7]), Some(vec![7; 3])];
        assert_eq!(lost(&reqs, &short), [0, 1], "ended with other counts than wanted");
        assert_eq!(lost(&reqs, &ended[..2]), [2, 3], "no record at all");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (percentile(&v, 0.5), percentile(&v, 0.9), percentile(&v, 0.99)),
            (Some(50.0), Some(90.0), Some(99.0))
        );
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(percentile(&[5.0], 0.99), Some(5.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
