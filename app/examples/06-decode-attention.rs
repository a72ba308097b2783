//! Decode attention alone at Llama-3.1-8B shapes: batch 1, 32 query heads over 8 K/V heads of 128, bf16,
//! one query over a cache of 4352 positions as the decoder keeps it (Q a view into the fused QKV row, K/V
//! `[1, 4352, 8 · 128]`, the length on the device), at 545 and 4096 cached tokens: the split-KV kernel
//! (`with_form(SdpaKernel::SplitKv)`) against cuDNN's padded plan (`with_form(SdpaForm::Unified)`).
//! Each is timed replaying a CUDA graph of 32 calls (as a captured decode step runs them) and as plain
//! launches, CUDA-event medians after warm-up, beside the time its K/V bytes take at the copy bandwidth:
//! `cargo run --release --example 06-decode-attention` on a GPU machine.
use cudnn_llm::half::bf16;
use cudnn_llm::{
    reference, sdpa, Backend, Cudnn, Error, Layout, SdpaArgs, SdpaForm, SdpaKernel, SdpaOperands, SeqLens,
};
use cudnn_llm_app::bench_util::{copy_bandwidth_gbps, environment, median_call_ms, upload};

/// Calls per captured graph.
const CALLS: usize = 32;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Cudnn::new(0)?;
    let (hq, hkv, d, cap) = (32, 8, 128, 4352);
    let w = (hq + 2 * hkv) * d;
    let mut args = SdpaArgs::new(1, hq, hkv, 1, cap, d, Layout::Bshd).with_seq_lens();
    args.q_strides = [w, d, w, 1];
    let kv = [cap * hkv * d, d, hkv * d, 1];
    (args.k_strides, args.v_strides) = (kv, kv);
    let (qkv, _) = upload::<bf16>(&ctx, &reference::random_values(1, w))?;
    let (k, _) = upload::<bf16>(&ctx, &reference::random_values(2, cap * hkv * d))?;
    let (v, _) = upload::<bf16>(&ctx, &reference::random_values(3, cap * hkv * d))?;
    let mut o = ctx.stream().alloc_zeros::<bf16>(hq * d)?;
    let lq = ctx.stream().clone_htod(&[1i32])?;
    let mut lkv = ctx.stream().clone_htod(&[0i32])?;
    let mut lens = SeqLens::new(&ctx, 1, 1, cap)?;
    let copy = copy_bandwidth_gbps(&ctx, 1 << 30, 20)?;
    println!("{}", environment(ctx.info()));
    println!(
        "decode attention b1 h{hq}/{hkv} d{d} bf16, capacity {cap}; copy bandwidth {copy:.0} GB/s; {} SMs",
        ctx.info().sm_count
    );
    for form in [SdpaKernel::SplitKv, SdpaKernel::from(SdpaForm::Unified)] {
        let a = args.with_form(form);
        let name = a.fused_kernel(ctx.features(), false).name();
        for len in [545i32, 4096] {
            ctx.stream().memcpy_htod(&[len], &mut lkv)?;
            lens.clamp(&ctx, &lq, &lkv)?;
            let mut call = || {
                sdpa(&ctx, a, SdpaOperands::new(&qkv, &k, &v, &mut o).clamped_seq_lens(&lens), Backend::Fused)
            };
            // The first call builds the plan (or compiles the kernels) and allocates outside the capture.
            if let Err(e) = call() {
                println!("{name:>9} {len:>5} keys: {e}");
                continue;
            }
            let plain = median_call_ms(&ctx, 10, 21, 50, &mut call)?;
            // SAFETY: one thread, no other stream of this context.
            let ((), graph) = unsafe {
                ctx.capture(|| {
                    for _ in 0..CALLS {
                        call()?;
                    }
                    Ok::<_, Error>(())
                })
            }?;
            let replay = median_call_ms(&ctx, 3, 21, 1, || Ok(graph.launch()?))? / CALLS as f64;
            let bytes = 2.0 * len as f64 * (hkv * d * 2) as f64;
            println!(
                "{name:>9} {len:>5} keys: {:6.2} us per call replayed in a graph ({:4.0} GB/s of K/V, floor {:.2} us), \
                 {:6.2} us as plain launches",
                replay * 1e3,
                bytes / (replay * 1e-3) / 1e9,
                bytes / (copy * 1e9) * 1e6,
                plain * 1e3
            );
        }
    }
    Ok(())
}
