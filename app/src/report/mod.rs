//! The per-module speedup report: rows per module range and scenario, with the run's metadata, as a
//! terminal/markdown table, CSV (the same rows, one line each) and JSON (everything); [`chart`] draws it
//! as SVG, [`cli`] holds the `speedup-report` binary's options, [`train`] the training step's phase
//! totals and the `train_step` bench's rows, and [`memorize`] the memorization task with its loss
//! curves' SVG and summary.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

pub mod chart;
pub mod cli;
pub mod memorize;
pub mod train;

use train::PhaseRow;

/// What one module range did on each backend in one scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModuleRow {
    /// Range name, e.g. `fwd.layer.attn.gqa`.
    pub range: String,
    /// Calls per forward.
    pub calls: usize,
    /// Kernels the naive backend launched in the range.
    pub naive_kernels: usize,
    /// Their GPU time (ms).
    pub naive_kernel_ms: f64,
    /// CUDA-event time of the range on the naive backend (ms).
    pub naive_event_ms: f64,
    /// Kernels the fused backend launched in the range.
    pub fused_kernels: usize,
    /// Their GPU time (ms).
    pub fused_kernel_ms: f64,
    /// CUDA-event time of the range on the fused backend (ms).
    pub fused_event_ms: f64,
    /// `naive_kernel_ms / fused_kernel_ms`, when both ran.
    pub speedup: Option<f64>,
    /// Why a module did not run fused (fallback or error), or empty.
    pub note: String,
}

/// What one backend did in a range, per forward.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Side {
    /// Kernels launched.
    pub kernels: usize,
    /// Their GPU time (ms), or the event time when kernels were not recorded.
    pub kernel_ms: f64,
    /// CUDA-event time around the range (ms).
    pub event_ms: f64,
}

/// How far (as a fraction of the event time) kernel time may differ from event time for a range to
/// count as GPU-bound.
pub const GPU_BOUND: f64 = 0.10;

impl ModuleRow {
    /// A row with the speedup computed from the kernel times.
    pub fn new(range: &str, calls: usize, naive: Side, fused: Side, note: &str) -> Self {
        let speedup =
            (naive.kernel_ms > 0.0 && fused.kernel_ms > 0.0).then(|| naive.kernel_ms / fused.kernel_ms);
        ModuleRow {
            range: range.into(),
            calls,
            naive_kernels: naive.kernels,
            naive_kernel_ms: naive.kernel_ms,
            naive_event_ms: naive.event_ms,
            fused_kernels: fused.kernels,
            fused_kernel_ms: fused.kernel_ms,
            fused_event_ms: fused.event_ms,
            speedup,
            note: note.into(),
        }
    }

    /// Whether the kernels kept the GPU busy for the range: kernel time within [`GPU_BOUND`] of the
    /// event time (`None` when either is missing).
    pub fn gpu_bound(kernel_ms: f64, event_ms: f64) -> Option<bool> {
        (kernel_ms > 0.0 && event_ms > 0.0).then(|| (event_ms - kernel_ms).abs() <= GPU_BOUND * event_ms)
    }
}

/// Host time of a range's first call (plans built, kernels loaded) and of a warm call, per backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FirstCall {
    /// Range name.
    pub range: String,
    /// Naive backend, first call (host ms).
    pub naive_first_ms: f64,
    /// Naive backend, warm call (host ms).
    pub naive_warm_ms: f64,
    /// Fused backend, first call (host ms).
    pub fused_first_ms: f64,
    /// Fused backend, warm call (host ms).
    pub fused_warm_ms: f64,
}

/// One scenario (prefill or decode) of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scenario {
    /// e.g. `prefill 1x2048` or `decode 1 @ 2049`.
    pub name: String,
    /// Per-module rows in forward order.
    pub rows: Vec<ModuleRow>,
    /// Whole-forward times (ms) by what was measured, e.g. `naive`, `fused`, `fused (CUDA graph)`.
    pub forward_ms: Vec<(String, f64)>,
    /// First (cold) vs warm call host times per range.
    pub first_calls: Vec<FirstCall>,
    /// A training step's phases (forward, backward, optimizer, step): kernel totals against the
    /// phases' CUDA-event times; empty for inference.
    #[serde(default)]
    pub phases: Vec<PhaseRow>,
}

/// How and where the report was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Meta {
    /// GPU name.
    pub gpu: String,
    /// Driver version.
    pub driver: String,
    /// CUDA driver API version.
    pub cuda: String,
    /// cuDNN version.
    pub cudnn: String,
    /// Git revision of the build.
    pub git_revision: String,
    /// Model preset and layer count.
    pub model: String,
    /// I/O dtype.
    pub dtype: String,
    /// The fused selection compared against all-naive.
    pub fused: String,
    /// Anything else worth keeping (clocks, peak memory, plan builds), as name/value pairs.
    pub extra: Vec<(String, String)>,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Metadata.
    pub meta: Meta,
    /// Scenarios.
    pub scenarios: Vec<Scenario>,
}

/// One CSV line: a module row with its scenario and the metadata that identifies the run (the csv
/// crate cannot flatten a nested struct, so the row's fields are repeated here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CsvRow {
    /// Scenario name.
    pub scenario: String,
    /// GPU name.
    pub gpu: String,
    /// cuDNN version.
    pub cudnn: String,
    /// Model.
    pub model: String,
    /// See [`ModuleRow::range`].
    pub range: String,
    /// See [`ModuleRow::calls`].
    pub calls: usize,
    /// See [`ModuleRow::naive_kernels`].
    pub naive_kernels: usize,
    /// See [`ModuleRow::naive_kernel_ms`].
    pub naive_kernel_ms: f64,
    /// See [`ModuleRow::naive_event_ms`].
    pub naive_event_ms: f64,
    /// See [`ModuleRow::fused_kernels`].
    pub fused_kernels: usize,
    /// See [`ModuleRow::fused_kernel_ms`].
    pub fused_kernel_ms: f64,
    /// See [`ModuleRow::fused_event_ms`].
    pub fused_event_ms: f64,
    /// See [`ModuleRow::speedup`].
    pub speedup: Option<f64>,
    /// See [`ModuleRow::note`].
    pub note: String,
}

impl CsvRow {
    fn new(meta: &Meta, scenario: &str, r: &ModuleRow) -> Self {
        CsvRow {
            scenario: scenario.into(),
            gpu: meta.gpu.clone(),
            cudnn: meta.cudnn.clone(),
            model: meta.model.clone(),
            range: r.range.clone(),
            calls: r.calls,
            naive_kernels: r.naive_kernels,
            naive_kernel_ms: r.naive_kernel_ms,
            naive_event_ms: r.naive_event_ms,
            fused_kernels: r.fused_kernels,
            fused_kernel_ms: r.fused_kernel_ms,
            fused_event_ms: r.fused_event_ms,
            speedup: r.speedup,
            note: r.note.clone(),
        }
    }

    /// The module row this line holds.
    pub fn row(&self) -> ModuleRow {
        ModuleRow {
            range: self.range.clone(),
            calls: self.calls,
            naive_kernels: self.naive_kernels,
            naive_kernel_ms: self.naive_kernel_ms,
            naive_event_ms: self.naive_event_ms,
            fused_kernels: self.fused_kernels,
            fused_kernel_ms: self.fused_kernel_ms,
            fused_event_ms: self.fused_event_ms,
            speedup: self.speedup,
            note: self.note.clone(),
        }
    }
}

fn ms(v: f64) -> String {
    format!("{v:.3}")
}

fn times(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |s| format!("{s:.2}×"))
}

impl Report {
    /// The rows as CSV, one line per module and scenario.
    pub fn to_csv(&self) -> Result<String, csv::Error> {
        let mut w = csv::Writer::from_writer(Vec::new());
        for s in &self.scenarios {
            for r in &s.rows {
                w.serialize(CsvRow::new(&self.meta, &s.name, r))?;
            }
        }
        let bytes = w.into_inner().map_err(|e| e.into_error())?;
        Ok(String::from_utf8(bytes).expect("csv writes UTF-8"))
    }

    /// Reads [`Report::to_csv`] back.
    pub fn rows_from_csv(text: &str) -> Result<Vec<CsvRow>, csv::Error> {
        csv::Reader::from_reader(text.as_bytes()).deserialize().collect()
    }

    /// Everything as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serializes")
    }

    /// Reads [`Report::to_json`] back.
    pub fn from_json(text: &str) -> serde_json::Result<Self> {
        serde_json::from_str(text)
    }

    /// The markdown report: metadata, then per scenario the module table and the forward times.
    pub fn to_markdown(&self) -> String {
        let m = &self.meta;
        let mut md = format!(
            "## Per-module speedup: {} ({}), fused `{}` vs all naive\n\nGPU {}, driver {}, CUDA {}, cuDNN {}, build {}.\n",
            m.model, m.dtype, m.fused, m.gpu, m.driver, m.cuda, m.cudnn, m.git_revision
        );
        for (k, v) in &m.extra {
            let _ = writeln!(md, "- {k}: {v}");
        }
        for s in &self.scenarios {
            let _ = writeln!(md, "\n### {}\n", s.name);
            md += &self.table(s, true);
            let _ = writeln!(md, "\n{}", Self::gpu_bound_summary(s));
            if !s.phases.is_empty() {
                md += "\nPer step, the module rows summed by phase (`fwd.`, `bwd.`, `opt.`; `step`: every row) \
                       against the phase's CUDA-event time (`StepStats`, untraced steps):\n\n";
                md += &train::phase_table(&s.phases);
            }
            for (what, t) in &s.forward_ms {
                let _ = writeln!(md, "- forward, {what}: {} ms", ms(*t));
            }
            if !s.first_calls.is_empty() {
                md += "\nFirst call (plans built and tuned, kernels loaded) vs a warm call, host ms:\n\n";
                let head = ["range", "naive first", "naive warm", "fused first", "fused warm"];
                let mut lines: Vec<Vec<String>> = vec![head.iter().map(|h| h.to_string()).collect()];
                for f in &s.first_calls {
                    lines.push(vec![
                        f.range.clone(),
                        format!("{:.1}", f.naive_first_ms),
                        format!("{:.3}", f.naive_warm_ms),
                        format!("{:.1}", f.fused_first_ms),
                        format!("{:.3}", f.fused_warm_ms),
                    ]);
                }
                md += &render(&lines, true);
            }
        }
        md
    }

    /// One line: per backend, how many ranges were GPU-bound (kernel time within [`GPU_BOUND`] of
    /// event time) and which were not.
    pub fn gpu_bound_summary(s: &Scenario) -> String {
        let side = |label: &str, pick: fn(&ModuleRow) -> (f64, f64)| {
            let judged: Vec<(&str, bool)> = s
                .rows
                .iter()
                .filter_map(|r| {
                    let (k, e) = pick(r);
                    ModuleRow::gpu_bound(k, e).map(|b| (r.range.as_str(), b))
                })
                .collect();
            let bound = judged.iter().filter(|j| j.1).count();
            let others: Vec<&str> = judged.iter().filter(|j| !j.1).map(|j| j.0).collect();
            let mut text = format!("{label} {bound} of {}", judged.len());
            if !others.is_empty() {
                text += &format!(" (launch-bound: {})", others.join(", "));
            }
            text
        };
        format!(
            "Ranges whose kernel time is within {:.0}% of their CUDA-event time (GPU-bound): {}; {}.",
            GPU_BOUND * 100.0,
            side("naive", |r| (r.naive_kernel_ms, r.naive_event_ms)),
            side("fused", |r| (r.fused_kernel_ms, r.fused_event_ms)),
        )
    }

    /// The module table of one scenario, as markdown or as aligned terminal text.
    pub fn table(&self, s: &Scenario, markdown: bool) -> String {
        let head = [
            "range",
            "calls",
            "naive kernels",
            "naive kernel ms",
            "naive event ms",
            "fused kernels",
            "fused kernel ms",
            "fused event ms",
            "speedup",
        ];
        let mut lines: Vec<Vec<String>> = vec![head.iter().map(|h| h.to_string()).collect()];
        for r in &s.rows {
            let mut speed = times(r.speedup);
            if !r.note.is_empty() {
                speed += &format!(" ({})", r.note);
            }
            lines.push(vec![
                r.range.clone(),
                r.calls.to_string(),
                r.naive_kernels.to_string(),
                ms(r.naive_kernel_ms),
                ms(r.naive_event_ms),
                r.fused_kernels.to_string(),
                ms(r.fused_kernel_ms),
                ms(r.fused_event_ms),
                speed,
            ]);
        }
        render(&lines, markdown)
    }
}

/// Rows (the first is the header) as a markdown table, or as aligned terminal text (first column
/// left-aligned, the others right-aligned).
fn render(lines: &[Vec<String>], markdown: bool) -> String {
    let mut out = String::new();
    if markdown {
        for (i, l) in lines.iter().enumerate() {
            let _ = writeln!(out, "| {} |", l.join(" | "));
            if i == 0 {
                let _ = writeln!(out, "|---|{}", "---:|".repeat(l.len() - 1));
            }
        }
    } else {
        let widths: Vec<usize> = (0..lines[0].len())
            .map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0))
            .collect();
        for l in lines {
            let cells: Vec<String> = l
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(c, (v, w))| if c == 0 { format!("{v:<w$}") } else { format!("{v:>w$}") })
                .collect();
            let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(kernels: usize, kernel_ms: f64, event_ms: f64) -> Side {
        Side { kernels, kernel_ms, event_ms }
    }

    fn sample() -> Report {
        let rows = vec![
            ModuleRow::new("fwd.layer.attn.prenorm", 32, side(256, 0.965, 0.99), side(32, 0.083, 0.2), ""),
            ModuleRow::new("fwd.layer.attn.gqa", 32, side(320, 0.313, 0.33), side(32, 0.144, 0.15), ""),
            ModuleRow::new(
                "fwd.layer.attn.rope",
                32,
                side(320, 0.2, 0.21),
                Side::default(),
                "fallback: not supported, ran naive",
            ),
        ];
        Report {
            meta: Meta {
                gpu: "NVIDIA H200".into(),
                driver: "580.159.04".into(),
                cuda: "13.0".into(),
                cudnn: "9.19.0".into(),
                git_revision: "abc123".into(),
                model: "llama-3.1-8b x 32 layers".into(),
                dtype: "bf16".into(),
                fused: "fused=all".into(),
                extra: vec![("clocks".into(), "1980 MHz -> 1965 MHz".into())],
            },
            scenarios: vec![Scenario {
                name: "prefill 3x10".into(),
                rows,
                forward_ms: vec![("naive".into(), 6.97), ("fused".into(), 4.94)],
                first_calls: vec![FirstCall {
                    range: "fwd.layer.attn.gqa".into(),
                    naive_first_ms: 40.4,
                    naive_warm_ms: 0.137,
                    fused_first_ms: 619.6,
                    fused_warm_ms: 0.062,
                }],
                phases: vec![],
            }],
        }
    }

    #[test]
    fn json_round_trips() {
        let r = sample();
        assert_eq!(Report::from_json(&r.to_json()).unwrap(), r);
    }

    #[test]
    fn csv_round_trips_rows_with_their_scenario() {
        let r = sample();
        let csv = r.to_csv().unwrap();
        assert!(csv.starts_with("scenario,gpu,cudnn,model,range,calls,naive_kernels,"), "{csv}");
        let back = Report::rows_from_csv(&csv).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[0].scenario, "prefill 3x10");
        assert_eq!(back.iter().map(CsvRow::row).collect::<Vec<_>>(), r.scenarios[0].rows);
        assert_eq!(back[2].speedup, None);
    }

    #[test]
    fn markdown_and_terminal_tables() {
        let r = sample();
        let md = r.to_markdown();
        assert!(md.contains("| range | calls | naive kernels |"), "{md}");
        assert!(
            md.contains(
                "| fwd.layer.attn.prenorm | 32 | 256 | 0.965 | 0.990 | 32 | 0.083 | 0.200 | 11.63× |"
            ),
            "{md}"
        );
        assert!(md.contains("| fwd.layer.attn.gqa | 40.4 | 0.137 | 619.6 | 0.062 |"), "{md}");
        // 0.083 of 0.2 ms is launch-bound; the rope row has no fused side to judge.
        assert!(
            md.contains("(GPU-bound): naive 3 of 3; fused 1 of 2 (launch-bound: fwd.layer.attn.prenorm)."),
            "{md}"
        );
        assert!(md.contains("n/a (fallback: not supported, ran naive)"), "{md}");
        assert!(md.contains("- forward, fused: 4.940 ms") && md.contains("cuDNN 9.19.0"), "{md}");
        let term = r.table(&r.scenarios[0], false);
        let lines: Vec<&str> = term.lines().collect();
        assert_eq!(lines.len(), 4);
        // Columns line up: every line puts the calls column at the same place.
        let at = lines[0].find("calls").unwrap() + "calls".len();
        assert!(lines[1..].iter().all(|l| l[..at].ends_with("32")), "{term}");
    }

    #[test]
    fn a_training_scenario_shows_its_phases_and_older_json_reads_without_them() {
        let mut r = sample();
        let before = r.to_json();
        let phase = |name: &str, fused_event_ms| PhaseRow {
            phase: name.into(),
            naive_kernels: 576,
            naive_kernel_ms: 1.478,
            naive_event_ms: 1.53,
            fused_kernels: 64,
            fused_kernel_ms: 0.227,
            fused_event_ms,
        };
        r.scenarios[0].phases = vec![phase("forward", 0.35), phase("step", 0.24)];
        assert_eq!(Report::from_json(&r.to_json()).unwrap(), r);
        let md = r.to_markdown();
        assert!(md.contains("against the phase's CUDA-event time (`StepStats`, untraced steps)"), "{md}");
        assert!(
            md.contains("| forward | 576 | 1.478 | 1.530 | 96.6% | 64 | 0.227 | 0.350 | **64.9%** |"),
            "{md}"
        );
        assert!(md.contains("all but forward fused."), "{md}");
        // A report written before the phases existed reads back with none.
        let old = Report::from_json(&before.replace(",\n      \"phases\": []", "")).unwrap();
        assert!(!before.replace(",\n      \"phases\": []", "").contains("phases"));
        assert_eq!(old, sample());
        assert!(!sample().to_markdown().contains("CUDA-event time (`StepStats`"));
    }
}
