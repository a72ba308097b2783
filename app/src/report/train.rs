//! Training steps: the rows of `cargo bench --bench train_step` (one per batch × sequence setting
//! and backend) joined with `app/benches/train_torch.py`'s, and the per-phase totals of
//! `speedup-report --train` (the module rows' kernel time against each phase's CUDA-event time).

use super::{ModuleRow, GPU_BOUND};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// A step's shape: `batch` sequences of `seq` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

/// The six settings, 12288 to 18432 tokens per step (Llama-3.2-1B shapes).
pub const SETTINGS: [Setting; 6] = [
    Setting { batch: 1, seq: 16384 },
    Setting { batch: 2, seq: 8192 },
    Setting { batch: 3, seq: 4096 },
    Setting { batch: 6, seq: 2048 },
    Setting { batch: 12, seq: 1024 },
    Setting { batch: 24, seq: 768 },
];

impl Setting {
    /// Token rows per step.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// `BxS`, e.g. `2x8192` (the join key with PyTorch's rows).
    pub fn name(&self) -> String {
        format!("{}x{}", self.batch, self.seq)
    }

    /// One setting, `BxS` (both at least 1, a step of a multiple of 8 tokens).
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("setting `{text}`: expected BATCHxSEQ, e.g. 2x8192");
        let (b, s) = text.trim().split_once('x').ok_or_else(bad)?;
        let (batch, seq) = (b.parse::<usize>().map_err(|_| bad())?, s.parse::<usize>().map_err(|_| bad())?);
        if batch == 0 || seq < 2 {
            return Err(format!("setting `{text}`: at least 1 sequence of at least 2 tokens"));
        }
        let tokens = batch.checked_mul(seq).ok_or_else(bad)?;
        if !tokens.is_multiple_of(8) {
            return Err(format!(
                "setting `{text}`: {tokens} tokens; the weight gradients need a multiple of 8"
            ));
        }
        Ok(Setting { batch, seq })
    }

    /// A comma-separated list of settings, or `all` for [`SETTINGS`].
    pub fn parse_list(text: &str) -> Result<Vec<Self>, String> {
        if text.trim() == "all" {
            return Ok(SETTINGS.to_vec());
        }
        let list = text
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(Setting::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if list.is_empty() {
            return Err("no setting given: expected e.g. `2x8192,12x1024` or `all`".into());
        }
        Ok(list)
    }
}

/// Whether an error message says the device ran out of memory (a CUDA allocation, cuDNN's, or an op's
/// own check before it allocates).
pub fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    ["out of memory", "out of device memory", "out_of_memory", "alloc_failed"].iter().any(|s| m.contains(s))
}

/// The PyTorch runs `app/benches/train_torch.py` makes, in the order the tables show them: SDPA
/// restricted to one backend each (eager), then `torch.compile` with the default dispatch.
pub const TORCH_BACKENDS: [&str; 4] = ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "compile"];

/// One line of `train_step.csv`: a setting on one backend, the warm times medians over the warm
/// steps; empty times and a note when the setting did not run (out of memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    /// The setting, `BxS`.
    pub setting: String,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Token rows per step.
    pub tokens: usize,
    /// `fused` (every module and the standalone ops) or `naive`.
    pub backend: String,
    /// Activation checkpointing: `no`, or why it is on.
    pub checkpoint: String,
    /// Wall seconds of the first step (plans built and tuned, kernels compiled, buffers allocated).
    pub cold_s: Option<f64>,
    /// Wall seconds of a warm step (launch to the loss read back), median.
    pub iter_s: Option<f64>,
    /// GPU seconds of a warm step between CUDA events (first forward to the end of AdamW), median.
    pub gpu_s: Option<f64>,
    /// GPU seconds of the forward (loss and its gradient included), median.
    pub forward_s: Option<f64>,
    /// GPU seconds of the backward, median.
    pub backward_s: Option<f64>,
    /// GPU seconds of the gradient norm and AdamW, median.
    pub optimizer_s: Option<f64>,
    /// `tokens / iter_s`.
    pub tokens_per_s: Option<f64>,
    /// Peak device memory of the run in GiB (stream-ordered allocations: weights, gradients,
    /// optimizer state, activations, scratch).
    pub peak_gib: Option<f64>,
    /// The first step's loss.
    pub loss: Option<f64>,
    /// The naive `iter_s` over this row's.
    pub speedup_vs_naive: Option<f64>,
    /// PyTorch's `iter_s` with SDPA on cuDNN.
    pub torch_cudnn_s: Option<f64>,
    /// PyTorch's `iter_s` with SDPA on flash attention.
    pub torch_flash_s: Option<f64>,
    /// PyTorch's `iter_s` with SDPA on memory-efficient attention.
    pub torch_efficient_s: Option<f64>,
    /// PyTorch's `iter_s` under `torch.compile`.
    pub torch_compile_s: Option<f64>,
    /// The fastest PyTorch `iter_s` of the setting over this row's (>1: ours faster).
    pub speedup_vs_torch: Option<f64>,
    /// Fallbacks, the checkpointing retry, or why the setting did not run.
    pub note: String,
}

/// A row of `app/benches/train_torch.py`'s CSV.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TorchStepRow {
    /// The setting, `BxS`.
    pub setting: String,
    /// One of [`TORCH_BACKENDS`].
    pub backend: String,
    /// Gradient checkpointing: `no`, or why it is on.
    pub checkpoint: String,
    /// Wall seconds of the first iteration.
    pub cold_s: Option<f64>,
    /// Wall seconds of a warm iteration, median.
    pub iter_s: Option<f64>,
    /// GPU seconds of a warm iteration (CUDA events), median.
    pub gpu_s: Option<f64>,
    /// GPU seconds of the forward (the loss included), median.
    pub forward_s: Option<f64>,
    /// GPU seconds of `loss.backward()`, median.
    pub backward_s: Option<f64>,
    /// GPU seconds of `opt.step()` and `opt.zero_grad()`, median.
    pub optimizer_s: Option<f64>,
    /// Tokens per warm second.
    pub tokens_per_s: Option<f64>,
    /// `torch.cuda.max_memory_allocated()` in GiB.
    pub peak_gib: Option<f64>,
    /// The first iteration's loss.
    pub loss: Option<f64>,
    /// Why it did not run (out of memory, a refused backend), or empty.
    pub note: String,
    /// torch (and transformers) version.
    pub torch: String,
}

/// Reads `app/benches/train_torch.py`'s CSV.
pub fn read_torch_csv(text: &str) -> Result<Vec<TorchStepRow>, csv::Error> {
    csv::Reader::from_reader(text.as_bytes()).deserialize().collect()
}

/// PyTorch's warm iteration time of `setting` on `backend`, if it ran.
fn torch_s(torch: &[TorchStepRow], setting: &str, backend: &str) -> Option<f64> {
    torch.iter().find(|t| t.setting == setting && t.backend == backend).and_then(|t| t.iter_s)
}

fn ratio(num: Option<f64>, den: Option<f64>) -> Option<f64> {
    match (num, den) {
        (Some(n), Some(d)) if n > 0.0 && d > 0.0 => Some((n / d * 100.0).round() / 100.0),
        _ => None,
    }
}

/// Fills each row's speedups: over the naive row of its setting, and over the fastest PyTorch run of
/// it; and PyTorch's times per backend.
pub fn join(rows: &mut [StepRow], torch: &[TorchStepRow]) {
    let naive: Vec<(String, Option<f64>)> =
        rows.iter().filter(|r| r.backend == "naive").map(|r| (r.setting.clone(), r.iter_s)).collect();
    for r in rows.iter_mut() {
        if r.backend != "naive" {
            let n = naive.iter().find(|(s, _)| *s == r.setting).and_then(|(_, t)| *t);
            r.speedup_vs_naive = ratio(n, r.iter_s);
        }
        let [cudnn, flash, efficient, compile] = TORCH_BACKENDS.map(|b| torch_s(torch, &r.setting, b));
        (r.torch_cudnn_s, r.torch_flash_s, r.torch_efficient_s, r.torch_compile_s) =
            (cudnn, flash, efficient, compile);
        let best = [cudnn, flash, efficient, compile].into_iter().flatten().reduce(f64::min);
        r.speedup_vs_torch = ratio(best, r.iter_s);
    }
}

fn secs(v: Option<f64>) -> String {
    v.map_or("—".into(), |s| format!("{s:.3}"))
}

/// The comparison with PyTorch as markdown: per setting, our fused and naive warm step and each
/// PyTorch run's (seconds), the fused speedup over each, and the PyTorch runs that did not run.
pub fn torch_table(rows: &[StepRow], torch: &[TorchStepRow]) -> String {
    let mut settings: Vec<&str> = Vec::new();
    for s in rows.iter().map(|r| r.setting.as_str()).chain(torch.iter().map(|t| t.setting.as_str())) {
        if !settings.contains(&s) {
            settings.push(s);
        }
    }
    let ours = |setting: &str, backend: &str| {
        rows.iter().find(|r| r.setting == setting && r.backend == backend).and_then(|r| r.iter_s)
    };
    let mut md = String::from("| setting | fused s | naive s |");
    for b in TORCH_BACKENDS {
        let _ = write!(md, " torch {b} s | fused vs {b} |");
    }
    md += "\n|---|---:|---:|";
    md += &"---:|---:|".repeat(TORCH_BACKENDS.len());
    md += "\n";
    let mut notes = Vec::new();
    for s in settings {
        let fused = ours(s, "fused");
        let _ = write!(md, "| {s} | {} | {} |", secs(fused), secs(ours(s, "naive")));
        for b in TORCH_BACKENDS {
            let t = torch_s(torch, s, b);
            let speedup = ratio(t, fused).map_or("—".into(), |x| format!("{x:.2}×"));
            let _ = write!(md, " {} | {speedup} |", secs(t));
        }
        md += "\n";
        for t in torch.iter().filter(|t| t.setting == s && (!t.note.is_empty() || t.checkpoint != "no")) {
            let what = [t.note.as_str(), if t.checkpoint == "no" { "" } else { t.checkpoint.as_str() }];
            let what: Vec<&str> = what.into_iter().filter(|w| !w.is_empty()).collect();
            notes.push(format!("- {s}, torch {}: {}", t.backend, what.join("; ")));
        }
    }
    if !notes.is_empty() {
        md += "\n";
        md += &notes.join("\n");
        md += "\n";
    }
    md
}

/// The phase a range belongs to: `forward` (`fwd.`), `backward` (`bwd.`), `optimizer` (`opt.`).
/// Without activation checkpointing, which reruns `fwd.` ranges inside the backward.
pub fn phase_of(range: &str) -> Option<&'static str> {
    match range.split('.').next() {
        Some("fwd") => Some("forward"),
        Some("bwd") => Some("backward"),
        Some("opt") => Some("optimizer"),
        _ => None,
    }
}

/// CUDA-event milliseconds of a step's phases (`StepStats`), per step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PhaseTimes {
    /// The forward, the loss and its gradient included.
    pub forward_ms: f64,
    /// The backward.
    pub backward_ms: f64,
    /// The gradient norm and AdamW.
    pub optimizer_ms: f64,
    /// The whole step.
    pub step_ms: f64,
}

/// One phase of a training step on both backends: its module rows' kernels against its CUDA-event
/// time, per step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseRow {
    /// `forward`, `backward`, `optimizer`, or `step` (every row, kernels outside ranges included).
    pub phase: String,
    /// Naive kernels launched in the phase's ranges.
    pub naive_kernels: usize,
    /// Their GPU time (ms).
    pub naive_kernel_ms: f64,
    /// The phase's CUDA-event time on the naive backend (ms).
    pub naive_event_ms: f64,
    /// Fused kernels launched in the phase's ranges.
    pub fused_kernels: usize,
    /// Their GPU time (ms).
    pub fused_kernel_ms: f64,
    /// The phase's CUDA-event time on the fused backend (ms).
    pub fused_event_ms: f64,
}

impl PhaseRow {
    /// Kernel time over event time, naive.
    pub fn naive_ratio(&self) -> Option<f64> {
        (self.naive_event_ms > 0.0).then(|| self.naive_kernel_ms / self.naive_event_ms)
    }

    /// Kernel time over event time, fused.
    pub fn fused_ratio(&self) -> Option<f64> {
        (self.fused_event_ms > 0.0).then(|| self.fused_kernel_ms / self.fused_event_ms)
    }
}

/// Sums the module rows (per step) by phase, against the phases' event times: `forward`,
/// `backward`, `optimizer`, then `step` over every row.
pub fn phase_rows(rows: &[ModuleRow], naive: PhaseTimes, fused: PhaseTimes) -> Vec<PhaseRow> {
    let phases = [
        ("forward", naive.forward_ms, fused.forward_ms),
        ("backward", naive.backward_ms, fused.backward_ms),
        ("optimizer", naive.optimizer_ms, fused.optimizer_ms),
        ("step", naive.step_ms, fused.step_ms),
    ];
    phases
        .into_iter()
        .map(|(phase, naive_event_ms, fused_event_ms)| {
            let mine: Vec<&ModuleRow> =
                rows.iter().filter(|r| phase == "step" || phase_of(&r.range) == Some(phase)).collect();
            PhaseRow {
                phase: phase.into(),
                naive_kernels: mine.iter().map(|r| r.naive_kernels).sum(),
                naive_kernel_ms: mine.iter().map(|r| r.naive_kernel_ms).sum(),
                naive_event_ms,
                fused_kernels: mine.iter().map(|r| r.fused_kernels).sum(),
                fused_kernel_ms: mine.iter().map(|r| r.fused_kernel_ms).sum(),
                fused_event_ms,
            }
        })
        .collect()
}

/// The phase table as markdown: per phase and backend, kernels, kernel ms, event ms and their
/// ratio, marked where the kernel total is more than [`GPU_BOUND`] off the event time.
pub fn phase_table(phases: &[PhaseRow]) -> String {
    let pct = |r: Option<f64>| match r {
        Some(r) if (r - 1.0).abs() <= GPU_BOUND => format!("{:.1}%", 100.0 * r),
        Some(r) => format!("**{:.1}%**", 100.0 * r),
        None => "n/a".into(),
    };
    let mut md = String::from(
        "| phase | naive kernels | naive kernel ms | naive event ms | kernel / event | fused kernels | \
         fused kernel ms | fused event ms | kernel / event |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in phases {
        let _ = writeln!(
            md,
            "| {} | {} | {:.3} | {:.3} | {} | {} | {:.3} | {:.3} | {} |",
            p.phase,
            p.naive_kernels,
            p.naive_kernel_ms,
            p.naive_event_ms,
            pct(p.naive_ratio()),
            p.fused_kernels,
            p.fused_kernel_ms,
            p.fused_event_ms,
            pct(p.fused_ratio())
        );
    }
    let off: Vec<String> = phases
        .iter()
        .flat_map(|p| {
            [("naive", p.naive_ratio()), ("fused", p.fused_ratio())]
                .into_iter()
                .filter(|(_, r)| r.is_some_and(|r| (r - 1.0).abs() > GPU_BOUND))
                .map(move |(b, _)| format!("{} {b}", p.phase))
        })
        .collect();
    let _ = write!(
        md,
        "\nKernel totals within {:.0}% of the phase's CUDA-event time: {}.\n",
        GPU_BOUND * 100.0,
        if off.is_empty() {
            "every phase, both backends".to_string()
        } else {
            format!("all but {}", off.join(", "))
        }
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Side;

    #[test]
    fn settings_parse_and_name() {
        assert_eq!(Setting::parse("2x8192").unwrap(), Setting { batch: 2, seq: 8192 });
        assert_eq!(Setting::parse(" 24x768").unwrap().tokens(), 18432);
        assert_eq!(Setting::parse_list("all").unwrap(), SETTINGS.to_vec());
        let names: Vec<String> = SETTINGS.iter().map(Setting::name).collect();
        assert_eq!(names, ["1x16384", "2x8192", "3x4096", "6x2048", "12x1024", "24x768"]);
        let two = Setting::parse_list("2x8192,12x1024,").unwrap();
        assert_eq!(two.iter().map(Setting::name).collect::<Vec<_>>(), ["2x8192", "12x1024"]);
        for (bad, expected) in [
            ("2*8192", "expected BATCHxSEQ"),
            ("0x16", "at least 1 sequence"),
            ("8x1", "at least 1 sequence of at least 2 tokens"),
            ("1x15", "15 tokens; the weight gradients need a multiple of 8"),
            ("x16", "expected BATCHxSEQ"),
        ] {
            let e = Setting::parse(bad).unwrap_err();
            assert!(e.contains(expected), "{bad}: {e}");
        }
        assert!(Setting::parse_list(",").unwrap_err().contains("no setting"));
        assert!(Setting::parse_list("2x8192,oops").unwrap_err().contains("`oops`"));
    }

    #[test]
    fn out_of_memory_messages_are_recognized() {
        assert!(is_out_of_memory("CUDA driver: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"));
        assert!(is_out_of_memory(
            "out of device memory: naive sdpa: scratch needs 8 bytes, 0 bytes are free"
        ));
        assert!(is_out_of_memory("cuDNN execute failed: CUDNN_STATUS_ALLOC_FAILED (4)"));
        assert!(!is_out_of_memory("not supported: sdpa: head dim 96"));
    }

    fn ours(setting: &str, backend: &str, iter_s: Option<f64>) -> StepRow {
        StepRow {
            setting: setting.into(),
            batch: 2,
            seq: 8192,
            tokens: 16384,
            backend: backend.into(),
            checkpoint: "no".into(),
            cold_s: iter_s.map(|s| s * 20.0),
            iter_s,
            gpu_s: iter_s,
            forward_s: None,
            backward_s: None,
            optimizer_s: None,
            tokens_per_s: None,
            peak_gib: None,
            loss: None,
            speedup_vs_naive: None,
            torch_cudnn_s: None,
            torch_flash_s: None,
            torch_efficient_s: None,
            torch_compile_s: None,
            speedup_vs_torch: None,
            note: if iter_s.is_none() { "out of memory".into() } else { String::new() },
        }
    }

    /// What `app/benches/train_torch.py` writes (its header and empty fields for a failed run).
    const TORCH_CSV: &str = "\
setting,batch,seq,tokens,backend,checkpoint,cold_s,iter_s,gpu_s,forward_s,backward_s,optimizer_s,tokens_per_s,peak_gib,loss,note,torch,gpu
2x8192,2,8192,16384,sdpa-cudnn,no,9.5,0.60,0.59,0.2,0.35,0.04,27306.7,61.2,12.1,,torch 2.11.0 transformers 5.17.0,H100
2x8192,2,8192,16384,sdpa-flash,no,3.1,0.55,0.54,0.19,0.32,0.04,29789.1,61.0,12.1,,torch 2.11.0 transformers 5.17.0,H100
2x8192,2,8192,16384,sdpa-efficient,no,,,,,,,,,,No available kernel. Aborting execution.,torch 2.11.0 transformers 5.17.0,H100
2x8192,2,8192,16384,compile,gradient checkpointing (out of memory without),95.0,0.50,0.49,0.17,0.29,0.04,32768.0,40.5,12.1,,torch 2.11.0 transformers 5.17.0,H100
12x1024,12,1024,12288,sdpa-cudnn,no,5.0,0.40,0.39,0.13,0.23,0.04,30720.0,50.0,12.0,,torch 2.11.0 transformers 5.17.0,H100
";

    #[test]
    fn torch_rows_join_ours_by_setting() {
        let torch = read_torch_csv(TORCH_CSV).unwrap();
        assert_eq!(torch.len(), 5);
        assert_eq!(
            (torch[2].iter_s, torch[2].note.as_str()),
            (None, "No available kernel. Aborting execution.")
        );
        let mut rows = vec![
            ours("2x8192", "fused", Some(0.4)),
            ours("2x8192", "naive", None),
            ours("12x1024", "fused", Some(0.32)),
            ours("12x1024", "naive", Some(0.8)),
        ];
        join(&mut rows, &torch);
        let r = &rows[0];
        assert_eq!(
            (r.torch_cudnn_s, r.torch_flash_s, r.torch_efficient_s, r.torch_compile_s),
            (Some(0.6), Some(0.55), None, Some(0.5))
        );
        // The fastest PyTorch run (compile, 0.50 s) over ours (0.40 s); no naive time to compare.
        assert_eq!((r.speedup_vs_torch, r.speedup_vs_naive), (Some(1.25), None));
        assert_eq!((rows[2].speedup_vs_naive, rows[2].speedup_vs_torch), (Some(2.5), Some(1.25)));
        assert_eq!((rows[3].speedup_vs_naive, rows[3].speedup_vs_torch), (None, Some(0.5)));
        assert_eq!(rows[1].speedup_vs_torch, None, "a row that did not run has no speedup");
        // The CSV round-trips, empty fields as None.
        let (csv, md) = crate::bench_util::csv_and_markdown(&rows).unwrap();
        let back: Vec<StepRow> =
            csv::Reader::from_reader(csv.as_bytes()).deserialize().collect::<Result<_, _>>().unwrap();
        assert_eq!(back, rows);
        assert!(md.contains("| 2x8192 | 2 | 8192 | 16384 | naive | no | "), "{md}");
        let table = torch_table(&rows, &torch);
        assert!(
            table.starts_with("| setting | fused s | naive s | torch sdpa-cudnn s | fused vs sdpa-cudnn |"),
            "{table}"
        );
        assert!(
            table.contains("| 2x8192 | 0.400 | — | 0.600 | 1.50× | 0.550 | 1.38× | — | — | 0.500 | 1.25× |"),
            "{table}"
        );
        assert!(table.contains("| 12x1024 | 0.320 | 0.800 | 0.400 | 1.25× | — | — |"), "{table}");
        assert!(table.contains("- 2x8192, torch sdpa-efficient: No available kernel."), "{table}");
        assert!(
            table.contains("- 2x8192, torch compile: gradient checkpointing (out of memory without)"),
            "{table}"
        );
        assert_eq!(table.matches("\n- ").count(), 2, "{table}");
    }

    #[test]
    fn phases_sum_module_rows_against_event_times() {
        let side = |kernels, kernel_ms| Side { kernels, kernel_ms, event_ms: kernel_ms };
        let rows = vec![
            ModuleRow::new("fwd.embed", 1, side(1, 0.1), side(1, 0.1), ""),
            ModuleRow::new("fwd.layer.mlp.mlp", 2, side(10, 4.0), side(2, 2.0), ""),
            ModuleRow::new("fwd.loss", 1, side(6, 1.0), side(3, 0.2), ""),
            ModuleRow::new("bwd.layer.mlp.mlp", 2, side(20, 8.0), side(4, 4.5), ""),
            ModuleRow::new("bwd.embed", 1, side(3, 0.5), side(1, 0.3), ""),
            ModuleRow::new("opt.grad_norm", 1, side(16, 0.4), side(2, 0.1), ""),
            ModuleRow::new("opt.adamw", 1, side(800, 2.0), side(1, 0.9), ""),
            ModuleRow::new(cudnn_llm::llama::profile::UNATTRIBUTED, 0, side(1, 0.01), Side::default(), ""),
        ];
        assert_eq!(phase_of("fwd.layer.attn.gqa"), Some("forward"));
        assert_eq!(phase_of("opt.adamw"), Some("optimizer"));
        assert_eq!(phase_of(cudnn_llm::llama::profile::UNATTRIBUTED), None);
        let naive = PhaseTimes { forward_ms: 5.2, backward_ms: 8.6, optimizer_ms: 2.5, step_ms: 16.4 };
        let fused = PhaseTimes { forward_ms: 3.0, backward_ms: 4.9, optimizer_ms: 1.0, step_ms: 9.5 };
        let p = phase_rows(&rows, naive, fused);
        let names: Vec<&str> = p.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(names, ["forward", "backward", "optimizer", "step"]);
        assert_eq!((p[0].naive_kernels, p[0].fused_kernels), (17, 6));
        assert!((p[0].naive_kernel_ms - 5.1).abs() < 1e-12 && (p[0].fused_kernel_ms - 2.3).abs() < 1e-12);
        assert_eq!((p[1].naive_kernels, p[2].naive_kernels, p[3].naive_kernels), (23, 816, 857));
        assert!((p[3].naive_kernel_ms - 16.01).abs() < 1e-12);
        let md = phase_table(&p);
        assert!(
            md.contains("| forward | 17 | 5.100 | 5.200 | 98.1% | 6 | 2.300 | 3.000 | **76.7%** |"),
            "{md}"
        );
        assert!(
            md.contains("| optimizer | 816 | 2.400 | 2.500 | 96.0% | 3 | 1.000 | 1.000 | 100.0% |"),
            "{md}"
        );
        assert!(
            md.contains("within 10% of the phase's CUDA-event time: all but forward fused, step fused."),
            "{md}"
        );
        let all_in = phase_rows(
            &rows,
            naive,
            PhaseTimes { forward_ms: 2.3, backward_ms: 4.8, optimizer_ms: 1.0, step_ms: 8.1 },
        );
        assert!(phase_table(&all_in).contains("every phase, both backends"), "{}", phase_table(&all_in));
        assert_eq!(PhaseRow { naive_event_ms: 0.0, ..p[0].clone() }.naive_ratio(), None);
    }
}
