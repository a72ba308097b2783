//! Batch-1 decode against the memory roofline: a preset's shapes (Llama-3.1-8B by default) with random weights (all layers
//! unless `LAYERS` is given), a 512-token prompt, then fused decode steps launched plainly and replayed
//! as one CUDA graph per step, beside the floor (weight + KV bytes over the measured copy bandwidth),
//! and which attention the fused decode runs (`examples/06-decode-attention.rs` times it alone); then
//! each decode projection alone at 1, 4 and 8 tokens, the cuDNN graph against the decode GEMV, and the
//! GEMV's one-token fused forms (prenorm folded in, gate and up in one launch) against their unfused
//! launches. The step is timed with each [`DecodeFusion`] (none, norm, gate_up, norm+gate_up, norm+gate_up+rope) in turn,
//! with cuDNN's and the split-KV decode attention ([`Cudnn::set_decode_attention`]), then the default
//! fusion without programmatic dependent launch ([`Cudnn::set_programmatic_launch`]) and under the
//! block GEMV split ([`GemvSplit`]); then where a replayed step's time goes (CUPTI: kernels, and the
//! idle time between them, per kernel kind); the projections alone are timed in both splits:
//! `cargo run --release --example 05-decode [-- [PRESET] [LAYERS]]` on a GPU machine (`smollm2-135m`
//! and `llama-3.2-1b` time the step and its timeline; the per-projection tables are Llama-3.1-8B's).
use cudnn_llm::cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudnn_llm::cudarc::driver::CudaSlice;
use cudnn_llm::half::bf16;
use cudnn_llm::llama::profile::StepTimeline;
use cudnn_llm::llama::roofline::DecodeRoofline;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, DecodeFusion, Llama, LlamaConfig, NoObserver};
use cudnn_llm::{
    matmul, reference, rms_norm, Backend, Cudnn, DataType, DecodeAttention, Epilogue, GemvSplit, Layout,
    MatmulArgs, MatmulKernel, MatmulOperands, Prologue, RmsNormArgs, RmsNormOperands, SdpaArgs,
    DECODE_GEMV_MAX_TOKENS,
};
use cudnn_llm_app::bench_util::{copy_bandwidth_gbps, median, wall_ms};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Cudnn::new(0)?;
    // `[PRESET] [LAYERS]`: a preset name first (Llama-3.1-8B by default), then a layer count (all of
    // the preset's by default); a lone number is a layer count of Llama-3.1-8B.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let preset = match args.first() {
        Some(a) if a.parse::<usize>().is_err() => args.remove(0),
        _ => "llama-3.1-8b".to_string(),
    };
    let base = LlamaConfig::preset(&preset)?;
    let layers = args.first().map(|s| s.parse()).transpose()?.unwrap_or(base.layers);
    let cfg = base.with_layers(layers);
    let (prompt_len, steps) = (512, 64);
    let max_seq = prompt_len + 2 * steps + 2;
    let mut model = Llama::new(&ctx, &cfg, &Weights::<bf16>::random(&cfg, 0), max_seq)?;
    let fused = Backends::all(Backend::Fused);
    let prompt = vec![(0..prompt_len as u32).map(|t| (t * 7919) % cfg.vocab as u32).collect::<Vec<_>>()];
    let mut cache = model.cache(&ctx, 1, max_seq)?;
    model.forward(&ctx, &prompt, &mut cache, &fused, &mut NoObserver)?;
    let at = cache.lens()[0] + 1;
    let mut timed = Vec::new();
    // Each fusion with the defaults (the split chosen by shape, PDL where the GPU has it, the decode
    // attention the library picks) and with the split-KV attention kernel; then the default fusion
    // under each split and PDL setting, each with both attentions.
    let pdl = ctx.programmatic_launch();
    let (auto, split_kv) = (DecodeAttention::Auto, DecodeAttention::SplitKv);
    let mut settings: Vec<(DecodeFusion, GemvSplit, bool, DecodeAttention)> = Vec::new();
    for attention in [auto, split_kv] {
        settings.extend(DecodeFusion::EVERY.iter().map(|&f| (f, GemvSplit::Auto, pdl, attention)));
    }
    for (split, on) in [(GemvSplit::Auto, false), (GemvSplit::Block, true)] {
        if on || pdl {
            for attention in [auto, split_kv] {
                settings.push((DecodeFusion::default(), split, on && pdl, attention));
            }
        }
    }
    for &(fusion, split, on, attention) in &settings {
        model.set_decode_fusion(fusion);
        ctx.set_gemv_split(split);
        ctx.set_programmatic_launch(on);
        ctx.set_decode_attention(attention);
        cache.truncate_to(at - 1);
        // A plain step first: plans are built and kernels loaded outside the capture.
        model.forward(&ctx, &[vec![1]], &mut cache, &fused, &mut NoObserver)?;
        model.logits(&ctx, 1, &fused, &mut NoObserver)?;
        // What the step's attention runs (one query over the whole cache, the lengths on the device,
        // as the model calls it).
        let form = SdpaArgs::new(1, cfg.heads, cfg.kv_heads, 1, max_seq, cfg.head_dim, Layout::Bshd)
            .with_seq_lens()
            .with_decode_choice(attention, ctx.features())
            .fused_kernel(ctx.features(), false)
            .name();
        // SAFETY: one thread, no other stream of this context.
        let mut graph = unsafe { model.capture_decode(&ctx, &mut cache, &fused) }?;
        let (mut plain, mut replay) = (Vec::new(), Vec::new());
        for step in 0..steps {
            // Both at the same cache lengths, alternating.
            let token = 100 + step as u32;
            cache.truncate_to(at + step);
            plain.push(wall_ms(&ctx, || -> Result<(), cudnn_llm::llama::Error> {
                model.forward(&ctx, &[vec![token]], &mut cache, &fused, &mut NoObserver)?;
                model.logits(&ctx, 1, &fused, &mut NoObserver)?;
                Ok(())
            })?);
            cache.truncate_to(at + step);
            replay.push(wall_ms(&ctx, || model.decode(&ctx, &mut graph, &[token], &mut cache).map(drop))?);
        }
        timed.push((fusion, split, on, form, median(plain), median(replay)));
    }
    ctx.set_gemv_split(GemvSplit::Auto);
    ctx.set_programmatic_launch(pdl);
    ctx.set_decode_attention(auto);
    model.set_decode_fusion(DecodeFusion::default());
    let copy = copy_bandwidth_gbps(&ctx, 1 << 30, 20)?;
    let roof = DecodeRoofline::new(&cfg, 1, at + steps / 2, 2);
    // The defaults' row (the fusion a model starts with, auto split and attention, PDL where the GPU
    // has it) and the fastest row.
    let default = DecodeFusion::EVERY.iter().position(|&f| f == DecodeFusion::default()).unwrap_or(0);
    let best = (0..timed.len()).min_by(|&i, &j| timed[i].5.total_cmp(&timed[j].5)).unwrap_or(0);
    println!("{}: {} layers, batch 1, {} cached tokens, bf16, fused", cfg.name, layers, at + steps / 2);
    // What the fused backend runs for a decode step's attention by default (the defaults' row).
    println!(
        "decode attention by default: {} (one query over the {max_seq}-position cache)",
        timed[default].3
    );
    let qkv = MatmulArgs::linear(1, cfg.hidden, cfg.qkv_width()).fused_kernel(DataType::BF16, DataType::BF16);
    println!("decode projections: {} (qkv_proj; o_proj, the MLP and lm_head alike)", qkv.name());
    println!(
        "copy bandwidth {copy:.0} GB/s; floor {:.3} ms ({:.2} GB)",
        roof.floor_ms(copy),
        roof.bytes() as f64 / 1e9
    );
    for (label, i) in [("defaults", default), ("fastest", best)] {
        let (fusion, split, on, form, plain, replay) = timed[i];
        for (what, ms) in [("plain launches", plain), ("graph replay", replay)] {
            println!(
                "{label:>8} {what:>15}: {ms:.3} ms per step (with logits), {:.1}% of the roofline (decode \
                 fusion {}, gemv split {}, pdl {}, attention {form})",
                100.0 * roof.fraction(ms, copy),
                fusion.name(),
                split.name(),
                if on { "on" } else { "off" },
            );
        }
    }
    if !pdl {
        println!("pdl is off: it needs sm_90+ and CUDNN_LLM_PDL unset");
    }
    println!(
        "\nthe step with each decode fusion, gemv split, pdl setting and decode attention (same run, same \
         cache lengths):"
    );
    println!(
        "{:<14} {:<6} {:<4} {:<9} {:>9} {:>6} {:>9} {:>6}",
        "fusion", "split", "pdl", "attention", "graph ms", "%roof", "plain ms", "%roof"
    );
    for (fusion, split, on, form, plain, replay) in &timed {
        println!(
            "{:<14} {:<6} {:<4} {form:<9} {replay:>9.3} {:>5.1}% {plain:>9.3} {:>5.1}%",
            fusion.name(),
            split.name(),
            if *on { "on" } else { "off" },
            100.0 * roof.fraction(*replay, copy),
            100.0 * roof.fraction(*plain, copy)
        );
    }
    for run in ctx.kernel_runs() {
        println!("in place of a plan: {}, {} calls", run.name, run.calls);
    }
    cache.truncate_to(at - 1);
    timeline(&ctx, &mut model, &mut cache, &fused, &roof, copy)?;
    drop((cache, model));
    if preset != "llama-3.1-8b" {
        println!("\n(the per-projection tables are of Llama-3.1-8B's shapes: run without a preset for them)");
        return Ok(());
    }
    projections(&ctx, copy)?;
    fused_forms(&ctx, copy)
}

/// Where a replayed decode step's time goes (the defaults): CUPTI records every kernel of 8 graph
/// replays, tabled as a [`StepTimeline`]. Skipped, saying why, where CUPTI does not load.
fn timeline(
    ctx: &Cudnn,
    model: &mut Llama<bf16>,
    cache: &mut cudnn_llm::llama::KvCache<bf16>,
    fused: &Backends,
    roof: &DecodeRoofline,
    copy: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    const STEPS: usize = 8;
    let cupti = match cudnn_llm_cupti::Cupti::load() {
        Ok(c) => c,
        Err(e) => {
            println!("\nno replayed-step timeline: {e}");
            return Ok(());
        }
    };
    let at = cache.lens()[0] + 1;
    model.forward(ctx, &[vec![1]], cache, fused, &mut NoObserver)?;
    model.logits(ctx, 1, fused, &mut NoObserver)?;
    cache.truncate_to(at - 1);
    // SAFETY: one thread, no other stream of this context.
    let mut graph = unsafe { model.capture_decode(ctx, cache, fused) }?;
    for step in 0..3 {
        cache.truncate_to(at + step);
        model.decode(ctx, &mut graph, &[7 + step as u32], cache)?;
    }
    ctx.synchronize()?;
    cupti.start()?;
    for step in 0..STEPS {
        cache.truncate_to(at + step);
        model.decode(ctx, &mut graph, &[11 + step as u32], cache)?;
        ctx.synchronize()?;
    }
    let collected = cupti.stop_and_collect()?;
    let Some(t) = StepTimeline::of(&collected.kernels, ctx.info().ordinal as u32, STEPS) else {
        println!(
            "\nno replayed-step timeline: {} kernels recorded in {STEPS} replays",
            collected.kernels.len()
        );
        return Ok(());
    };
    println!(
        "\nreplayed step timeline (CUPTI, {STEPS} replays, defaults; {:.1}% of the roofline): {t}",
        100.0 * roof.fraction(t.span_us * 1e-3, copy)
    );
    Ok(())
}

/// The decode GEMV's one-token fused forms against the launches they replace, on Llama-3.1-8B's
/// shapes (CUDA-event median of 30, each after an L2 flush): the prenorm (RMSNorm graph) then the
/// qkv GEMV vs the qkv GEMV with the norm folded in; the up GEMV then the gate GEMV with SwiGLU vs
/// one gate-up GEMV; and the prenorm, up and gate vs one gate-up GEMV with the norm folded in.
fn fused_forms(ctx: &Cudnn, copy: f64) -> Result<(), Box<dyn std::error::Error>> {
    let (hidden, qkv_n, ffn, eps) = (4096, 6144, 14336, 1e-5f32);
    let x = filled(ctx, hidden, 10)?;
    let norm_w = filled(ctx, hidden, 11)?;
    let w_qkv = filled(ctx, qkv_n * hidden, 12)?;
    let w_gate = filled(ctx, ffn * hidden, 13)?;
    let w_up = filled(ctx, ffn * hidden, 14)?;
    let mut h = ctx.stream().alloc_zeros::<bf16>(hidden)?;
    let mut y = ctx.stream().alloc_zeros::<bf16>(ffn)?;
    let mut up = ctx.stream().alloc_zeros::<bf16>(ffn)?;
    let mut timer = Timer::new(ctx)?;
    let norm = Prologue::rms_norm(eps);
    let gemv = |n: usize| MatmulArgs::linear(1, hidden, n).with_form(MatmulKernel::DecodeGemv);
    let norm_args = RmsNormArgs::new(1, hidden, eps);
    println!("\none-token fused forms, bf16, median of 30 after an L2 flush; copy {copy:.0} GB/s");
    println!("{:<18} {:>11} {:>9} {:>6} {:>7}", "form", "unfused ms", "fused ms", "%copy", "speedup");
    let row = |name: &str, bytes: usize, unfused: f64, fused: f64| {
        let pct = 100.0 * bytes as f64 / (fused * 1e-3) / 1e9 / copy;
        println!("{name:<18} {unfused:>11.4} {fused:>9.4} {pct:>5.1}% {:>6.2}x", unfused / fused);
    };
    let unfused = timer.time(ctx, &mut || {
        rms_norm(ctx, norm_args, RmsNormOperands::new(&x, &norm_w, &mut h), Backend::Fused)?;
        matmul(ctx, &gemv(qkv_n), MatmulOperands::new(&h, &w_qkv, &mut y), Backend::Fused)
    })?;
    let fused = timer.time(ctx, &mut || {
        let ops = MatmulOperands::new(&x, &w_qkv, &mut y).norm_weight(&norm_w);
        matmul(ctx, &gemv(qkv_n).with_prologue(norm), ops, Backend::Fused)
    })?;
    row("norm + qkv", 2 * qkv_n * hidden, unfused, fused);
    let swiglu = gemv(ffn).with_epilogue(Epilogue::SWIGLU);
    let mut unfused_mlp = |x: &CudaSlice<bf16>, h: &mut CudaSlice<bf16>, with_norm: bool| {
        if with_norm {
            rms_norm(ctx, norm_args, RmsNormOperands::new(x, &norm_w, &mut *h), Backend::Fused)?;
        }
        let input: &CudaSlice<bf16> = if with_norm { h } else { x };
        matmul(ctx, &gemv(ffn), MatmulOperands::new(input, &w_up, &mut up), Backend::Fused)?;
        matmul(ctx, &swiglu, MatmulOperands::new(input, &w_gate, &mut y).up(&up), Backend::Fused)
    };
    let mut unfused = Vec::new();
    for with_norm in [false, true] {
        let mut h2 = ctx.stream().alloc_zeros::<bf16>(hidden)?;
        unfused.push(timer.time(ctx, &mut || unfused_mlp(&x, &mut h2, with_norm))?);
    }
    let mut y2 = ctx.stream().alloc_zeros::<bf16>(ffn)?;
    for (i, name) in ["up + gate", "norm + up + gate"].into_iter().enumerate() {
        let args =
            if i == 1 { swiglu.with_up_product().with_prologue(norm) } else { swiglu.with_up_product() };
        let fused = timer.time(ctx, &mut || {
            let mut ops = MatmulOperands::new(&x, &w_gate, &mut y2).up_weight(&w_up);
            if i == 1 {
                ops = ops.norm_weight(&norm_w);
            }
            matmul(ctx, &args, ops, Backend::Fused)
        })?;
        row(name, 4 * ffn * hidden, unfused[i], fused);
    }
    for run in ctx.kernel_runs().iter().filter(|r| r.name.contains("_m1_")) {
        println!("fused form: {}, {} calls", run.name, run.calls);
    }
    Ok(())
}

/// CUDA-event timings of a call after an L2 flush (a GEMV reading twice the L2 size).
struct Timer {
    flush_x: CudaSlice<bf16>,
    flush_w: CudaSlice<bf16>,
    flush_y: CudaSlice<bf16>,
    rows: usize,
}

impl Timer {
    fn new(ctx: &Cudnn) -> Result<Self, Box<dyn std::error::Error>> {
        let cuda = ctx.stream().context();
        let l2 = cuda.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(1) as usize;
        let rows = (2 * l2).div_ceil(2 * 4096).next_multiple_of(8);
        Ok(Timer {
            flush_x: filled(ctx, 4096, 2)?,
            flush_w: filled(ctx, rows * 4096, 1)?,
            flush_y: ctx.stream().alloc_zeros::<bf16>(rows)?,
            rows,
        })
    }

    /// Median ms of 30 timed calls (after 3 untimed ones), each after a flush.
    fn time(
        &mut self,
        ctx: &Cudnn,
        call: &mut dyn FnMut() -> cudnn_llm::Result<()>,
    ) -> Result<f64, Box<dyn std::error::Error>> {
        let cuda = ctx.stream().context();
        let (start, end) = (
            cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        let flush_args = MatmulArgs::linear(1, 4096, self.rows).with_form(MatmulKernel::DecodeGemv);
        for _ in 0..3 {
            call()?;
        }
        let mut samples = Vec::with_capacity(30);
        for _ in 0..30 {
            let flush = MatmulOperands::new(&self.flush_x, &self.flush_w, &mut self.flush_y);
            matmul(ctx, &flush_args, flush, Backend::Fused)?;
            start.record(ctx.stream())?;
            call()?;
            end.record(ctx.stream())?;
            samples.push(start.elapsed_ms(&end)? as f64);
        }
        Ok(median(samples))
    }
}

/// Each decode projection of Llama-3.1-8B (and its `lm_head`) alone, at 1, 4 and 8 tokens, in the cuDNN
/// graph form and the decode GEMV form: median of 30 CUDA-event timings, each after an L2 flush (a
/// GEMV reading twice the L2 size, which also keeps the GPU busy while the timed call is enqueued), and
/// the bytes moved (weight, x, D and the epilogue's inputs) over that time against `copy` GB/s.
fn projections(ctx: &Cudnn, copy: f64) -> Result<(), Box<dyn std::error::Error>> {
    let cuda = ctx.stream().context();
    let l2 = cuda.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(1) as usize;
    let flush_rows = (2 * l2).div_ceil(2 * 4096).next_multiple_of(8);
    let flush_w = filled(ctx, flush_rows * 4096, 1)?;
    let flush_x = filled(ctx, 4096, 2)?;
    let mut flush_y = ctx.stream().alloc_zeros::<bf16>(flush_rows)?;
    let flush_args = MatmulArgs::linear(1, 4096, flush_rows).with_form(MatmulKernel::DecodeGemv);
    let mut flush =
        || matmul(ctx, &flush_args, MatmulOperands::new(&flush_x, &flush_w, &mut flush_y), Backend::Fused);
    let (start, end) = (
        cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
    );
    println!(
        "\nper projection, bf16: median of 30 calls, each after reading {} MiB to flush the {} MiB L2; copy {copy:.0} GB/s",
        (flush_rows * 4096 * 2) >> 20,
        l2 >> 20
    );
    println!(
        "gemv: the warp split (what `GemvSplit::Auto` runs); block: the one-token block split, forced \
         ({} SMs here)",
        ctx.info().sm_count
    );
    println!(
        "{:<8} {:>2} {:>6} {:>7} {:<10} {:>9} {:>6} {:>6} {:>9} {:>6} {:>6} {:>7} {:>9} {:>6}",
        "proj",
        "m",
        "k",
        "n",
        "epilogue",
        "graph ms",
        "GB/s",
        "%copy",
        "gemv ms",
        "GB/s",
        "%copy",
        "speedup",
        "block ms",
        "%copy"
    );
    let shapes = [
        ("qkv", 4096, 6144, Epilogue::NONE),
        ("o", 4096, 4096, Epilogue::RESIDUAL),
        ("up", 4096, 14336, Epilogue::NONE),
        ("gate", 4096, 14336, Epilogue::SWIGLU),
        ("down", 14336, 4096, Epilogue::RESIDUAL),
        ("lm_head", 4096, 128256, Epilogue::NONE),
    ];
    for (proj, k, n, e) in shapes {
        let w = filled(ctx, n * k, 3)?;
        for m in [1, 4, DECODE_GEMV_MAX_TOKENS] {
            let args = MatmulArgs::linear(m, k, n).with_epilogue(e);
            let (x, side) = (filled(ctx, m * k, 4)?, filled(ctx, m * n, 5)?);
            let mut y = ctx.stream().alloc_zeros::<bf16>(m * n)?;
            let inputs = (e.gate as usize + e.residual as usize) * m * n;
            let bytes = 2.0 * (n * k + m * k + m * n + inputs) as f64;
            let mut ms = Vec::new();
            let forms = [
                (MatmulKernel::Graph, GemvSplit::Auto),
                (MatmulKernel::DecodeGemv, GemvSplit::Warp),
                (MatmulKernel::DecodeGemv, GemvSplit::Block),
            ];
            for (form, split) in forms.into_iter().take(if m == 1 { 3 } else { 2 }) {
                ctx.set_gemv_split(split);
                let a = args.with_form(form);
                let mut call = || {
                    let mut ops = MatmulOperands::new(&x, &w, &mut y);
                    if e.gate {
                        ops = ops.up(&side);
                    }
                    if e.residual {
                        ops = ops.residual(&side);
                    }
                    matmul(ctx, &a, ops, Backend::Fused)
                };
                // Plans are built (and autotuned) and kernels loaded outside the timings.
                for _ in 0..3 {
                    call()?;
                }
                let mut samples = Vec::with_capacity(30);
                for _ in 0..30 {
                    flush()?;
                    start.record(ctx.stream())?;
                    call()?;
                    end.record(ctx.stream())?;
                    samples.push(start.elapsed_ms(&end)? as f64);
                }
                ms.push(median(samples));
            }
            ctx.set_gemv_split(GemvSplit::Auto);
            let gbps = |ms: f64| bytes / (ms * 1e-3) / 1e9;
            let block = match ms.get(2) {
                Some(&b) => format!(" {b:>9.4} {:>5.1}%", 100.0 * gbps(b) / copy),
                None => String::new(),
            };
            println!(
                "{proj:<8} {m:>2} {k:>6} {n:>7} {:<10} {:>9.4} {:>6.0} {:>5.1}% {:>9.4} {:>6.0} {:>5.1}% {:>6.2}x{block}",
                e.name(),
                ms[0],
                gbps(ms[0]),
                100.0 * gbps(ms[0]) / copy,
                ms[1],
                gbps(ms[1]),
                100.0 * gbps(ms[1]) / copy,
                ms[0] / ms[1]
            );
        }
    }
    Ok(())
}

/// A bf16 device buffer of `len` values in [-1, 1): 1 Mi random values (from `seed`) uploaded once and
/// copied along the buffer, so that gigabytes of weights take no host memory.
fn filled(ctx: &Cudnn, len: usize, seed: u64) -> Result<CudaSlice<bf16>, Box<dyn std::error::Error>> {
    let block: Vec<bf16> = reference::to_elements(&reference::random_values(seed, len.min(1 << 20)));
    let block = ctx.stream().clone_htod(&block)?;
    let mut buf = ctx.stream().alloc_zeros::<bf16>(len)?;
    let mut at = 0;
    while at < len {
        let n = block.len().min(len - at);
        ctx.stream().memcpy_dtod(&block.slice(0..n), &mut buf.slice_mut(at..at + n))?;
        at += n;
    }
    Ok(buf)
}
