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
