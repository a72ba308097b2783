//! Attributing GPU kernels to named ranges, the way an Nsight Systems NVTX projection does: a kernel
//! belongs to the innermost range that was open on the host when the kernel was *launched*, whenever
//! it then ran on the GPU (launches are asynchronous: a kernel often runs after its range has closed,
//! and overlaps the GPU work of the next range).

use std::collections::BTreeMap;

/// One instance of a named host range (a module call), on the host clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangeRecord {
    /// Range name, e.g. `fwd.layer.attn.gqa`.
    pub name: String,
    /// Layer of the call, if per layer.
    pub layer: Option<usize>,
    /// Host time the range opened (ns).
    pub start_ns: u64,
    /// Host time it closed (ns).
    pub end_ns: u64,
}

pub use cudnn_llm_cupti::KernelRecord;

/// GPU duration of a kernel in ns.
pub fn duration_ns(k: &KernelRecord) -> u64 {
    k.end_ns.saturating_sub(k.start_ns)
}

/// What the kernels of one range name add up to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RangeTotals {
    /// Range instances (calls).
    pub calls: usize,
    /// Kernels launched inside them (innermost range only).
    pub kernels: usize,
    /// Sum of those kernels' GPU durations (ns).
    pub kernel_ns: u64,
}

/// The name kernels launched outside every range are filed under.
pub const UNATTRIBUTED: &str = "(outside ranges)";

/// Files every kernel under the innermost range (latest start among those containing its launch
/// time; ranges are properly nested) and sums per range name. Every range name appears, with zero
/// kernels if none launched inside it; kernels outside every range go to [`UNATTRIBUTED`].
pub fn attribute(ranges: &[RangeRecord], kernels: &[KernelRecord]) -> BTreeMap<String, RangeTotals> {
    let mut totals: BTreeMap<String, RangeTotals> = BTreeMap::new();
    for r in ranges {
        totals.entry(r.name.clone()).or_default().calls += 1;
    }
    // Ranges by start time; a kernel's candidates are those starting at or before its launch.
    let mut order: Vec<&RangeRecord> = ranges.iter().collect();
    order.sort_by_key(|r| (r.start_ns, std::cmp::Reverse(r.end_ns)));
    for k in kernels {
        let upto = order.partition_point(|r| r.start_ns <= k.launch_ns);
        let owner = order[..upto].iter().rev().find(|r| k.launch_ns < r.end_ns);
        let name = owner.map_or(UNATTRIBUTED, |r| r.name.as_str());
        let t = totals.entry(name.to_string()).or_default();
        t.kernels += 1;
        t.kernel_ns += duration_ns(k);
    }
    totals
}

/// Like [`attribute`], but counting each kernel in every range that contains its launch (a parent
/// such as a whole forward then includes its children).
pub fn attribute_inclusive(
    ranges: &[RangeRecord],
    kernels: &[KernelRecord],
) -> BTreeMap<String, RangeTotals> {
    let mut totals: BTreeMap<String, RangeTotals> = BTreeMap::new();
    for r in ranges {
        totals.entry(r.name.clone()).or_default().calls += 1;
    }
    for k in kernels {
        let mut names: Vec<&str> = ranges
            .iter()
            .filter(|r| r.start_ns <= k.launch_ns && k.launch_ns < r.end_ns)
            .map(|r| r.name.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            names.push(UNATTRIBUTED);
        }
        for n in names {
            let t = totals.entry(n.to_string()).or_default();
            t.kernels += 1;
            t.kernel_ns += duration_ns(k);
        }
    }
    totals
}

/// Where the GPU time of a replayed step goes, from CUPTI's kernel records of `steps` replays of
/// one captured step on one device: the records cut in order into steps of equal kernel counts; per
/// step, the span from its first kernel's start to its last one's end, the time some kernel runs
/// (the union of the kernels' intervals) and the idle rest; per kernel kind ([`kernel_kind`]), its
/// launches, GPU time and the idle time just before it (the gap it waits out after the kernel before
/// it ends; a programmatic launch that overlaps the kernel before it waits none). Medians over the
/// steps for span and busy time, means for the rows. A kind is told apart by the kind of the kernel
/// before it in the step (the same GEMV kernel after attention and after the MLP's first GEMV are
/// two projections, `o_proj` and `down`).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StepTimeline {
    /// Kernels per step.
    pub kernels_per_step: usize,
    /// Median span of a step (us).
    pub span_us: f64,
    /// Median time some kernel runs in a step (us).
    pub busy_us: f64,
    /// Per kernel kind, most time (GPU plus idle before) first.
    pub rows: Vec<TimelineRow>,
}

/// One kernel kind of a [`StepTimeline`], per step.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TimelineRow {
    /// What the kernel is ([`kernel_kind`]).
    pub kind: String,
    /// What the kernel before it in the step is (`-` for a step's first).
    pub after: String,
    /// Launches per step.
    pub launches: f64,
    /// GPU time per step (us).
    pub gpu_us: f64,
    /// Idle time just before its launches, per step (us).
    pub idle_before_us: f64,
}

/// A kernel's kind for a timeline: ours by name; cuDNN's, NCCL's and other mangled names by a word
/// of theirs (attention, RMSNorm, all-reduce, all-gather), or their first 48 characters.
pub fn kernel_kind(name: &str) -> String {
    let n = name.to_ascii_lowercase();
    let words = [
        ("allreduce", "all-reduce (NCCL)"),
        ("allgather", "all-gather (NCCL)"),
        ("sdpa", "attention (cuDNN)"),
        ("fmha", "attention (cuDNN)"),
        ("norm", "rmsnorm (cuDNN)"),
    ];
    if !name.starts_with("_Z") && !n.starts_with("cudnn") && !n.starts_with("sm") && !n.starts_with("nccl") {
        return name.to_string();
    }
    words
        .iter()
        .find(|(w, _)| n.contains(w))
        .map_or_else(|| name.chars().take(48).collect(), |w| w.1.to_string())
}

impl StepTimeline {
    /// The timeline of `device`'s kernels among `kernels`, recorded over `steps` replays; `None`
    /// where there are none or their count is not a multiple of `steps` (a replay's kernels missing).
    pub fn of(kernels: &[KernelRecord], device: u32, steps: usize) -> Option<Self> {
        let mut mine: Vec<&KernelRecord> =
            kernels.iter().filter(|k| k.device == device && k.end_ns > k.start_ns).collect();
        if steps == 0 || mine.is_empty() || !mine.len().is_multiple_of(steps) {
            return None;
        }
        mine.sort_by_key(|k| k.start_ns);
        let per_step = mine.len() / steps;
        let (mut spans, mut busy) = (Vec::new(), Vec::new());
        let mut kinds: BTreeMap<(String, String), (usize, f64, f64)> = BTreeMap::new();
        for step in mine.chunks(per_step) {
            let (first, mut end, mut running) = (step[0].start_ns, step[0].start_ns, 0u64);
            let mut before = "-".to_string();
            for k in step {
                let gap = k.start_ns.saturating_sub(end);
                running += k.end_ns.saturating_sub(k.start_ns.max(end));
                end = end.max(k.end_ns);
                let kind = kernel_kind(&k.name);
                let e = kinds.entry((kind.clone(), std::mem::replace(&mut before, kind))).or_default();
                e.0 += 1;
                e.1 += duration_ns(k) as f64 * 1e-3;
                e.2 += gap as f64 * 1e-3;
            }
            spans.push((end - first) as f64 * 1e-3);
            busy.push(running as f64 * 1e-3);
        }
        let s = steps as f64;
        let mut rows: Vec<TimelineRow> = kinds
            .into_iter()
            .map(|((kind, after), (n, gpu, idle))| TimelineRow {
                kind,
                after,
                launches: n as f64 / s,
                gpu_us: gpu / s,
                idle_before_us: idle / s,
            })
            .collect();
        rows.sort_by(|a, b| (b.gpu_us + b.idle_before_us).total_cmp(&(a.gpu_us + a.idle_before_us)));
        Some(StepTimeline { kernels_per_step: per_step, span_us: median(spans), busy_us: median(busy), rows })
    }
}

impl std::fmt::Display for StepTimeline {
    /// The per-kind table (after a line of totals).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} kernels per step, span {:.1} us, some kernel running {:.1} us, idle {:.1} us",
            self.kernels_per_step,
            self.span_us,
            self.busy_us,
            self.span_us - self.busy_us
        )?;
        writeln!(
            f,
            "{:<40} {:<32} {:>9} {:>12} {:>10} {:>14}",
            "kernel", "after", "per step", "GPU us/step", "mean us", "idle before us"
        )?;
        for r in &self.rows {
            let after: String = r.after.chars().take(32).collect();
            writeln!(
                f,
                "{:<40} {after:<32} {:>9.1} {:>12.1} {:>10.2} {:>14.1}",
                r.kind,
                r.launches,
                r.gpu_us,
                r.gpu_us / r.launches,
                r.idle_before_us
            )?;
        }
        Ok(())
    }
}

/// Median of a sample (NaN-free; the mean of the two middle values of an even count); 0 for an
/// empty one.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(name: &str, start: u64, end: u64) -> RangeRecord {
        RangeRecord { name: name.into(), layer: None, start_ns: start, end_ns: end }
    }

    fn kernel(name: &str, launch: u64, start: u64, end: u64) -> KernelRecord {
        KernelRecord { name: name.into(), launch_ns: launch, start_ns: start, end_ns: end, device: 0 }
    }

    #[test]
    fn a_step_timeline_cuts_replays_and_sums_kinds_per_step() {
        // Two replays of a step of 3 kernels on device 0 (one of device 1 and one of zero length
        // ignored): a GEMV, an NCCL all-reduce 2 ns after it, and a second GEMV overlapping the
        // all-reduce by 1 ns.
        let mut k = vec![
            kernel("gemv_bf16_m1", 0, 0, 10),
            kernel("_Z29ncclDevKernel_AllReduce_Sum_bf16_RING_LLv", 0, 12, 20),
            kernel("gemv_bf16_m1", 0, 19, 30),
            kernel("gemv_bf16_m1", 0, 100, 110),
            kernel("_Z29ncclDevKernel_AllReduce_Sum_bf16_RING_LLv", 0, 115, 125),
            kernel("gemv_bf16_m1", 0, 125, 140),
            kernel("gemv_bf16_m1", 0, 150, 150),
        ];
        k.push(KernelRecord { device: 1, ..kernel("elsewhere", 0, 0, 1000) });
        k.reverse(); // records come in any order
        let t = StepTimeline::of(&k, 0, 2).expect("two whole steps");
        assert_eq!(t.kernels_per_step, 3);
        // Spans 30 and 40; busy 28 (gap of 2) and 35 (gap of 5); medians of two are their means.
        assert!((t.span_us - 35e-3).abs() < 1e-12 && (t.busy_us - 31.5e-3).abs() < 1e-12, "{t:?}");
        // The GEMV first in the step and the one after the all-reduce are two rows.
        let gemv =
            |after: &str| t.rows.iter().find(|r| r.kind == "gemv_bf16_m1" && r.after == after).unwrap();
        assert_eq!((gemv("-").launches, gemv("all-reduce (NCCL)").launches), (1.0, 1.0));
        assert!((gemv("-").gpu_us - 10e-3).abs() < 1e-12);
        assert!((gemv("all-reduce (NCCL)").gpu_us - 13e-3).abs() < 1e-12);
        assert_eq!(gemv("all-reduce (NCCL)").idle_before_us, 0.0);
        assert_eq!(t.rows.len(), 3);
        let ar = t.rows.iter().find(|r| r.kind == "all-reduce (NCCL)").unwrap();
        assert_eq!(ar.launches, 1.0);
        assert!((ar.gpu_us - 9e-3).abs() < 1e-12 && (ar.idle_before_us - 3.5e-3).abs() < 1e-12, "{ar:?}");
        assert!(StepTimeline::of(&k, 0, 4).is_none(), "6 kernels are not 4 whole steps");
        assert!(StepTimeline::of(&k, 2, 1).is_none(), "no kernels on device 2");
        assert_eq!(kernel_kind("_Z10sdpa_fprop_kernel"), "attention (cuDNN)");
        assert_eq!(kernel_kind("gemv_bf16_m1_norm_rope_u4"), "gemv_bf16_m1_norm_rope_u4");
    }

    #[test]
    fn innermost_range_at_launch_owns_the_kernel() {
        // fwd [0, 100) holds prenorm [10, 20) and gqa [30, 60); gqa holds an inner cudnn range [40, 50).
        let ranges =
            [range("fwd", 0, 100), range("prenorm", 10, 20), range("gqa", 30, 60), range("cudnn", 40, 50)];
        let kernels = [
            kernel("a", 12, 100, 110),  // prenorm, runs long after its range closed
            kernel("b", 19, 110, 130),  // prenorm, last ns of the range
            kernel("c", 20, 130, 140),  // at prenorm's end: fwd (end is exclusive)
            kernel("d", 45, 140, 200),  // inner cudnn range
            kernel("e", 55, 200, 205),  // gqa after the inner range closed
            kernel("f", 150, 300, 301), // after everything
        ];
        let t = attribute(&ranges, &kernels);
        assert_eq!(t["prenorm"], RangeTotals { calls: 1, kernels: 2, kernel_ns: 30 });
        assert_eq!(t["fwd"], RangeTotals { calls: 1, kernels: 1, kernel_ns: 10 });
        assert_eq!(t["cudnn"], RangeTotals { calls: 1, kernels: 1, kernel_ns: 60 });
        assert_eq!(t["gqa"], RangeTotals { calls: 1, kernels: 1, kernel_ns: 5 });
        assert_eq!(t[UNATTRIBUTED], RangeTotals { calls: 0, kernels: 1, kernel_ns: 1 });
        let total: u64 = t.values().map(|x| x.kernel_ns).sum();
        assert_eq!(total, kernels.iter().map(duration_ns).sum::<u64>());
        // Inclusive: fwd contains everything launched in [0, 100).
        let inc = attribute_inclusive(&ranges, &kernels);
        assert_eq!(inc["fwd"], RangeTotals { calls: 1, kernels: 5, kernel_ns: 105 });
        assert_eq!(inc["gqa"], RangeTotals { calls: 1, kernels: 2, kernel_ns: 65 });
        assert_eq!(inc["prenorm"], t["prenorm"]);
    }

    #[test]
    fn repeated_calls_and_kernels_spanning_ranges() {
        // Two layers' prenorm calls; the first call's kernel runs on the GPU during the second call's
        // window (launch queue ahead of the GPU): still the first call's.
        let ranges = [range("prenorm", 0, 10), range("mlp", 10, 20), range("prenorm", 20, 30)];
        let kernels = [kernel("k0", 5, 25, 50), kernel("k1", 15, 50, 60), kernel("k2", 25, 60, 62)];
        let t = attribute(&ranges, &kernels);
        assert_eq!(t["prenorm"], RangeTotals { calls: 2, kernels: 2, kernel_ns: 27 });
        assert_eq!(t["mlp"], RangeTotals { calls: 1, kernels: 1, kernel_ns: 10 });
        assert!(!t.contains_key(UNATTRIBUTED));
        // A range with no kernels is still a row.
        let t = attribute(&[range("rope", 0, 5)], &[]);
        assert_eq!(t["rope"], RangeTotals { calls: 1, kernels: 0, kernel_ns: 0 });
    }
}
