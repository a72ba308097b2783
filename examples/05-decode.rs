//! Batch-1 decode against the memory roofline: Llama-3.1-8B shapes with random weights (all 32 layers
//! unless `LAYERS` is given), a 512-token prompt, then fused decode steps launched plainly and replayed
//! as one CUDA graph per step, beside the floor (weight + KV bytes over the measured copy bandwidth),
//! and which attention the fused decode runs (`examples/06-decode-attention.rs` times it alone); then
//! each decode projection alone at 1, 4 and 8 tokens, the cuDNN graph against the decode GEMV:
//! `cargo run --release --features app --example 05-decode [-- LAYERS]` on a GPU machine.
use cudnn_llm::bench_util::{copy_bandwidth_gbps, median, wall_ms};
use cudnn_llm::cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudnn_llm::cudarc::driver::CudaSlice;
use cudnn_llm::half::bf16;
use cudnn_llm::llama::roofline::DecodeRoofline;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Llama, LlamaConfig, NoObserver};
use cudnn_llm::{
    matmul, reference, Backend, Cudnn, DataType, Epilogue, Layout, MatmulArgs, MatmulKernel, MatmulOperands,
    SdpaArgs, DECODE_GEMV_MAX_TOKENS,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Cudnn::new(0)?;
    let layers = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(layers);
    let (prompt_len, steps) = (512, 64);
    let max_seq = prompt_len + 2 * steps + 2;
    let mut model = Llama::new(&ctx, &cfg, &Weights::<bf16>::random(&cfg, 0), max_seq)?;
    let fused = Backends::all(Backend::Fused);
    let prompt = vec![(0..prompt_len as u32).map(|t| (t * 7919) % cfg.vocab as u32).collect::<Vec<_>>()];
    let mut cache = model.cache(&ctx, 1, max_seq)?;
    model.forward(&ctx, &prompt, &mut cache, &fused, &mut NoObserver)?;
    // A plain step first: plans are built and kernels loaded outside the capture.
    model.forward(&ctx, &[vec![1]], &mut cache, &fused, &mut NoObserver)?;
    model.logits(&ctx, 1, &fused, &mut NoObserver)?;
    // SAFETY: one thread, no other stream of this context.
    let mut graph = unsafe { model.capture_decode(&ctx, &mut cache, &fused) }?;
    let at = cache.len();
    let (mut plain, mut replay) = (Vec::new(), Vec::new());
    for step in 0..steps {
        // Both at the same cache lengths, alternating.
        let token = 100 + step as u32;
        cache.truncate(at + step);
        plain.push(wall_ms(&ctx, || -> Result<(), cudnn_llm::llama::Error> {
            model.forward(&ctx, &[vec![token]], &mut cache, &fused, &mut NoObserver)?;
            model.logits(&ctx, 1, &fused, &mut NoObserver)?;
            Ok(())
        })?);
        cache.truncate(at + step);
        replay.push(wall_ms(&ctx, || model.decode(&ctx, &mut graph, &[token], &mut cache).map(drop))?);
    }
    let copy = copy_bandwidth_gbps(&ctx, 1 << 30, 20)?;
    let roof = DecodeRoofline::new(&cfg, 1, at + steps / 2, 2);
    let (plain, replay) = (median(plain), median(replay));
    println!("{}: {} layers, batch 1, {} cached tokens, bf16, fused", cfg.name, layers, at + steps / 2);
    // What the fused backend runs for a decode step's attention (one query over the whole cache, the
    // lengths on the device, as the model calls it).
    let attention = SdpaArgs::new(1, cfg.heads, cfg.kv_heads, 1, max_seq, cfg.head_dim, Layout::Bshd)
        .with_seq_lens()
        .fused_kernel(ctx.features(), false);
    println!("decode attention: {} (one query over the {max_seq}-position cache)", attention.name());
    let qkv = MatmulArgs::linear(1, cfg.hidden, cfg.qkv_width()).fused_kernel(DataType::BF16, DataType::BF16);
    println!("decode projections: {} (qkv_proj; o_proj, the MLP and lm_head alike)", qkv.name());
    println!(
        "copy bandwidth {copy:.0} GB/s; floor {:.3} ms ({:.2} GB)",
        roof.floor_ms(copy),
        roof.bytes() as f64 / 1e9
    );
    for (what, ms) in [("plain launches", plain), ("graph replay", replay)] {
        println!(
            "{what:>15}: {ms:.3} ms per step (with logits), {:.1}% of the roofline",
            100.0 * roof.fraction(ms, copy)
        );
    }
    for run in ctx.kernel_runs() {
        println!("in place of a plan: {}, {} calls", run.name, run.calls);
    }
    drop((graph, cache, model));
    projections(&ctx, copy)
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
        "{:<8} {:>2} {:>6} {:>7} {:<10} {:>9} {:>6} {:>6} {:>9} {:>6} {:>6} {:>7}",
        "proj", "m", "k", "n", "epilogue", "graph ms", "GB/s", "%copy", "gemv ms", "GB/s", "%copy", "speedup"
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
            for form in [MatmulKernel::Graph, MatmulKernel::DecodeGemv] {
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
            let gbps = |ms: f64| bytes / (ms * 1e-3) / 1e9;
            println!(
                "{proj:<8} {m:>2} {k:>6} {n:>7} {:<10} {:>9.4} {:>6.0} {:>5.1}% {:>9.4} {:>6.0} {:>5.1}% {:>6.2}x",
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
