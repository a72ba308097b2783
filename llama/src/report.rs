//! The per-module speedup report: rows per module range and scenario, with the run's metadata, as a
//! terminal/markdown table, CSV (the same rows, one line each) and JSON (everything).

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

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
    /// Kernels the fused backend launched in the range.
    pub fused_kernels: usize,
    /// Their GPU time (ms).
    pub fused_kernel_ms: f64,
    /// `naive_kernel_ms / fused_kernel_ms`, when both ran.
    pub speedup: Option<f64>,
    /// Why a module did not run fused (fallback or error), or empty.
    pub note: String,
}

impl ModuleRow {
    /// A row with the speedup computed from the kernel times.
    pub fn new(range: &str, calls: usize, naive: (usize, f64), fused: (usize, f64), note: &str) -> Self {
        let speedup = (naive.1 > 0.0 && fused.1 > 0.0).then(|| naive.1 / fused.1);
        ModuleRow {
            range: range.into(),
            calls,
            naive_kernels: naive.0,
            naive_kernel_ms: naive.1,
            fused_kernels: fused.0,
            fused_kernel_ms: fused.1,
            speedup,
            note: note.into(),
        }
    }
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
    /// See [`ModuleRow::fused_kernels`].
    pub fused_kernels: usize,
    /// See [`ModuleRow::fused_kernel_ms`].
    pub fused_kernel_ms: f64,
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
            fused_kernels: r.fused_kernels,
            fused_kernel_ms: r.fused_kernel_ms,
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
            fused_kernels: self.fused_kernels,
            fused_kernel_ms: self.fused_kernel_ms,
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
            for (what, t) in &s.forward_ms {
                let _ = writeln!(md, "- forward, {what}: {} ms", ms(*t));
            }
        }
        md
    }

    /// The module table of one scenario, as markdown or as aligned terminal text.
    pub fn table(&self, s: &Scenario, markdown: bool) -> String {
        let head = [
            "range",
            "calls",
            "naive kernels",
            "naive kernel ms",
            "fused kernels",
            "fused kernel ms",
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
                r.fused_kernels.to_string(),
                ms(r.fused_kernel_ms),
                speed,
            ]);
        }
        let mut out = String::new();
        if markdown {
            for (i, l) in lines.iter().enumerate() {
                let _ = writeln!(out, "| {} |", l.join(" | "));
                if i == 0 {
                    let _ = writeln!(out, "|---|{}", "---:|".repeat(l.len() - 1));
                }
            }
        } else {
            let widths: Vec<usize> = (0..head.len())
                .map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0))
                .collect();
            for l in &lines {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let rows = vec![
            ModuleRow::new("fwd.layer.attn.prenorm", 32, (256, 0.965), (32, 0.083), ""),
            ModuleRow::new("fwd.layer.attn.gqa", 32, (320, 0.313), (32, 0.144), ""),
            ModuleRow::new(
                "fwd.layer.attn.rope",
                32,
                (320, 0.2),
                (0, 0.0),
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
        assert!(md.contains("| fwd.layer.attn.prenorm | 32 | 256 | 0.965 | 32 | 0.083 | 11.63× |"), "{md}");
        assert!(md.contains("n/a (fallback: not supported, ran naive)"), "{md}");
        assert!(md.contains("- forward, fused: 4.940 ms") && md.contains("cuDNN 9.19.0"), "{md}");
        let term = r.table(&r.scenarios[0], false);
        let lines: Vec<&str> = term.lines().collect();
        assert_eq!(lines.len(), 4);
        // Columns line up: every line puts the calls column at the same place.
        let at = lines[0].find("calls").unwrap() + "calls".len();
        assert!(lines[1..].iter().all(|l| l[..at].ends_with("32")), "{term}");
    }
}
