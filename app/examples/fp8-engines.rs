//! Which cuDNN engines run an FP8 prefill GEMM on this GPU, and how fast: for two of Llama-3.1-8B's
//! projections (qkv_proj, gate_up) at 2048 tokens, the scaled-matmul graph in each scale form (A per tensor or per token, B
//! per tensor or per channel), the FP8 product with no scale at all, and the bf16 matmul, each built with every
//! engine configuration the heuristics offer (up to `CANDIDATES`) plus a knob search, each
//! candidate timed (`Plan::timings`), then the chosen plan timed again with CUDA events.
//!
//! ```text
//! cargo run --release --example fp8-engines            # prints a table per projection
//! ```
//!
//! An investigation, not a bench: it shows whether a faster cuDNN engine exists than the one the
//! default autotuning (8 candidates, no knob search) finds for `--dtype fp8`'s GEMMs.

use cudnn_llm::cudnn_ops::{Bindings, Cudnn, DataType, Graph, ScaledMatmulArgs, TensorSpec, Tuning, F8E4M3};
use cudnn_llm::half::bf16;
use cudnn_llm_app::bench_util::median_call_ms;

type Error = Box<dyn std::error::Error>;

/// A graph to time: its label, the graph, and whether A's factors are per token and B's per channel
/// (`None`: no factor inputs).
type Form = (&'static str, Graph, Option<(bool, bool)>);

const CANDIDATES: usize = 32;
const KNOB_SEARCH: usize = 16;
const M: usize = 2048;
const LINEARS: [(&str, usize, usize); 2] = [("qkv_proj", 6144, 4096), ("gate_up", 28672, 4096)];

/// The FP8 product `[1, m, k] x [1, k, n]` (B K-major over an `[n, k]` weight) into bf16, no scale.
fn plain(m: usize, n: usize, k: usize, dtype: DataType) -> Graph {
    let (m, n, k) = (m as i64, n as i64, k as i64);
    let mut g = Graph::new(format!("plain {m}x{n}x{k} {dtype}"));
    let a = g.tensor(TensorSpec::new("A", &[1, m, k], dtype).with_strides(&[m * k, k, 1]).with_uid(1));
    let b = g.tensor(TensorSpec::new("B", &[1, k, n], dtype).with_strides(&[n * k, 1, k]).with_uid(2));
    let d = g.matmul(a, b);
    let spec = g.output(d);
    (spec.name, spec.dtype, spec.uid) = ("D".into(), DataType::BF16, 100);
    g
}

fn main() -> Result<(), Error> {
    let ctx = Cudnn::new(0)?;
    ctx.set_plan_dir(None);
    let info = ctx.info();
    println!(
        "# {} (sm_{}{}), cuDNN {}",
        info.name, info.compute_capability.0, info.compute_capability.1, info.cudnn_version
    );
    let tuning = Tuning::FIRST.with_candidates(CANDIDATES).with_knob_search(KNOB_SEARCH);
    let s = ctx.stream();
    for (name, n, k) in LINEARS {
        let flops = 2.0 * (M * n * k) as f64;
        let a8 = s.alloc_zeros::<F8E4M3>(M * k)?;
        let b8 = s.alloc_zeros::<F8E4M3>(n * k)?;
        let a16 = s.alloc_zeros::<bf16>(M * k)?;
        let b16 = s.alloc_zeros::<bf16>(n * k)?;
        let (sa_row, sa_one) = (s.clone_htod(&vec![1f32; M])?, s.clone_htod(&[1f32])?);
        let (sb_col, sb_one) = (s.clone_htod(&vec![1f32; n])?, s.clone_htod(&[1f32])?);
        let mut d = s.alloc_zeros::<bf16>(M * n)?;
        let base = ScaledMatmulArgs::new(M, n, k);
        let scaled = |args: ScaledMatmulArgs| args.graph(DataType::F8E4M3, DataType::F8E4M3, DataType::BF16);
        // (label, graph, A's scales per token, B's scales per channel); no scale inputs where None.
        let graphs: [Form; 6] = [
            ("fp8 per-tensor scales", scaled(base), Some((false, false))),
            ("fp8 per-tensor x per-channel", scaled(base.per_channel()), Some((false, true))),
            ("fp8 per-token x per-tensor", scaled(base.per_token()), Some((true, false))),
            ("fp8 per-token x per-channel", scaled(base.per_channel().per_token()), Some((true, true))),
            ("fp8 no scales", plain(M, n, k, DataType::F8E4M3), None),
            ("bf16", plain(M, n, k, DataType::BF16), None),
        ];
        for (label, graph, scales) in graphs {
            let plan = match graph.build_tuned(&ctx, tuning) {
                Ok(p) => p,
                Err(e) => {
                    println!("{name} {label}: no plan: {e}");
                    continue;
                }
            };
            let run = |d: &mut cudnn_llm::cudnn_ops::cudarc::driver::CudaSlice<bf16>| {
                let mut b = Bindings::new(s);
                match label {
                    "bf16" => b.input(1, &a16).input(2, &b16),
                    _ => b.input(1, &a8).input(2, &b8),
                };
                if let Some((per_token, per_channel)) = scales {
                    b.input(3, if per_token { &sa_row } else { &sa_one });
                    b.input(4, if per_channel { &sb_col } else { &sb_one });
                }
                b.output(100, d);
                plan.execute(&ctx, &b)
            };
            run(&mut d)?; // autotunes
            let ms = median_call_ms(&ctx, 3, 15, 10, || run(&mut d))?;
            let mut timings = plan.timings();
            timings.sort_by(|a, b| a.1.total_cmp(&b.1));
            let best: Vec<String> = timings.iter().take(4).map(|(e, t)| format!("{e} {t:.4}")).collect();
            println!(
                "{name} {M}x{n}x{k} | {label} | {} candidates timed | chosen {} | {ms:.4} ms | {:.0} TFLOP/s | fastest: {}",
                timings.len(),
                plan.engine(),
                flops / ms / 1e9,
                best.join(", ")
            );
        }
    }
    Ok(())
}
