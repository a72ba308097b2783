//! The report's SVG: per scenario, the fused speedup of each module range (bars, log scale not needed:
//! speedups are 0-20×), and the time breakdown of each backend stacked by module.

use super::Report;
use plotters::prelude::*;

pub(crate) const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

static BACKENDS: [&str; 2] = ["naive", "fused"];

/// Axis and legend names: `fwd.layer.attn.qkv_proj` is `qkv_proj`, the two prenorms `attn.norm` and
/// `mlp.norm`; a backward range (`bwd.`) gets a `'` (`qkv_proj'`), the optimizer's keep their name.
fn short(range: &str) -> String {
    let (phase, rest) = range.split_once('.').unwrap_or(("", range));
    let name = match rest {
        "layer.attn.prenorm" => "attn.norm",
        "layer.mlp.prenorm" => "mlp.norm",
        "layer.mlp.mlp" => "mlp",
        other => other.rsplit('.').next().unwrap_or(other),
    };
    match phase {
        "bwd" => format!("{name}'"),
        "fwd" | "opt" => name.to_string(),
        _ => range.to_string(),
    }
}

/// Renders the chart as an SVG document.
pub fn svg(report: &Report) -> Result<String, String> {
    let rows = report.scenarios.len().max(1);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (1200, 420 * rows as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        for (s, area) in report.scenarios.iter().zip(root.split_evenly((rows, 2)).chunks(2)) {
            let names: Vec<String> = s.rows.iter().map(|r| short(&r.range)).collect();
            let speedups: Vec<f64> = s.rows.iter().map(|r| r.speedup.unwrap_or(0.0)).collect();
            let top = speedups.iter().copied().fold(1.0, f64::max) * 1.15;
            let mut chart = ChartBuilder::on(&area[0])
                .caption(format!("{}: fused speedup per module", s.name), ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(50)
                .build_cartesian_2d((0..names.len().saturating_sub(1)).into_segmented(), 0.0..top)
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .y_desc("naive / fused kernel time")
                .x_labels(names.len())
                .x_label_style(("sans-serif", 11))
                .x_label_formatter(&|x| match x {
                    SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
                    _ => String::new(),
                })
                .draw()
                .map_err(|e| e.to_string())?;
            chart
                .draw_series(speedups.iter().enumerate().map(|(i, &v)| {
                    let mut bar = Rectangle::new(
                        [(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), v)],
                        COLORS[i % COLORS.len()].filled(),
                    );
                    bar.set_margin(0, 0, 6, 6);
                    bar
                }))
                .map_err(|e| e.to_string())?;
            // Stacked time per backend.
            let naive: Vec<f64> = s.rows.iter().map(|r| r.naive_kernel_ms).collect();
            let fused: Vec<f64> = s.rows.iter().map(|r| r.fused_kernel_ms).collect();
            let total = naive.iter().sum::<f64>().max(fused.iter().sum::<f64>()).max(1e-9) * 1.1;
            let mut stack = ChartBuilder::on(&area[1])
                .caption(format!("{}: kernel time by module (ms)", s.name), ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(60)
                // A third, empty segment leaves room for the legend.
                .build_cartesian_2d((0..BACKENDS.len()).into_segmented(), 0.0..total)
                .map_err(|e| e.to_string())?;
            stack
                .configure_mesh()
                .disable_x_mesh()
                .y_desc("ms")
                .x_label_formatter(&|x| match x {
                    SegmentValue::CenterOf(i) => BACKENDS.get(*i).unwrap_or(&"").to_string(),
                    _ => String::new(),
                })
                .draw()
                .map_err(|e| e.to_string())?;
            for (col, times) in [&naive, &fused].into_iter().enumerate() {
                let mut base = 0.0;
                for (i, &t) in times.iter().enumerate() {
                    let mut bar = Rectangle::new(
                        [(SegmentValue::Exact(col), base), (SegmentValue::Exact(col + 1), base + t)],
                        COLORS[i % COLORS.len()].filled(),
                    );
                    bar.set_margin(0, 0, 30, 30);
                    let series = stack.draw_series(std::iter::once(bar)).map_err(|e| e.to_string())?;
                    if col == 0 {
                        series.label(names[i].as_str()).legend(move |(x, y)| {
                            Rectangle::new([(x, y - 5), (x + 10, y + 5)], COLORS[i % COLORS.len()].filled())
                        });
                    }
                    base += t;
                }
            }
            stack
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Meta, ModuleRow, Scenario, Side};

    fn side(kernels: usize, kernel_ms: f64) -> Side {
        Side { kernels, kernel_ms, event_ms: kernel_ms }
    }

    #[test]
    fn chart_has_a_bar_per_module_and_both_stacks() {
        let rows = vec![
            ModuleRow::new("fwd.layer.attn.prenorm", 32, side(256, 0.965), side(32, 0.083), ""),
            ModuleRow::new("fwd.layer.attn.gqa", 32, side(320, 0.313), side(32, 0.144), ""),
            ModuleRow::new("fwd.output_norm", 1, side(8, 0.03), side(1, 0.003), ""),
        ];
        let report = Report {
            meta: Meta::default(),
            scenarios: vec![Scenario {
                name: "prefill 3x10".into(),
                rows,
                forward_ms: vec![],
                first_calls: vec![],
                phases: vec![],
            }],
        };
        let svg = svg(&report).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", &svg[..100]);
        // Every drawn rectangle has a positive size (a zero-width segment with margins goes negative).
        assert!(!svg.contains("width=\"-") && !svg.contains("height=\"-"), "negative rectangles");
        let filled = svg.matches("<rect").count();
        assert!(filled >= 3 + 2 * 3, "3 speedup bars and 2 stacks of 3, got {filled} rects");
        for label in ["attn.norm", "gqa", "output_norm", "fused speedup per module", "naive", "fused"] {
            assert!(svg.contains(label), "missing {label}");
        }
    }

    #[test]
    fn short_names_mark_the_backward() {
        assert_eq!(short("fwd.layer.attn.prenorm"), "attn.norm");
        assert_eq!(short("bwd.layer.attn.prenorm"), "attn.norm'");
        assert_eq!(short("bwd.lm_head"), "lm_head'");
        assert_eq!(short("opt.adamw"), "adamw");
        assert_eq!(short("fwd.embed"), "embed");
        assert_eq!(short(cudnn_llm::llama::profile::UNATTRIBUTED), cudnn_llm::llama::profile::UNATTRIBUTED);
    }
}
