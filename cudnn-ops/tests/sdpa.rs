//! Attention end to end: fused (cuDNN, composite and unified graphs) and naive (PyTorch math path)
//! against the f64 CPU reference, and against each other at Llama sizes. GPU tests are ignored by
//! default; run them with `--include-ignored` on a GPU machine.

use cudarc::driver::{CudaSlice, DevicePtrMut};
use cudnn_llm_ops::reference::{self, AttentionShape, Tolerance};
use cudnn_llm_ops::testing::{download, gpu, poisoned, upload};
use cudnn_llm_ops::{sdpa, Backend, Cudnn, Element, Error, Layout, Mask, SdpaArgs, SdpaForm, SdpaOperands};
use half::{bf16, f16};

/// Attention outputs: bf16 as the issue asks; f16 has three more mantissa bits.
const ATTN_BF16: Tolerance = Tolerance::rel_l2(2e-2);
const ATTN_F16: Tolerance = Tolerance::rel_l2(5e-3);
/// Log-sum-exp rows are f32 on both sides.
const STATS_TOL: Tolerance = Tolerance::rel_l2(1e-4);

fn tol<T: Element>() -> Tolerance {
    if T::DTYPE == cudnn_llm_ops::DataType::BF16 {
        ATTN_BF16
    } else {
        ATTN_F16
    }
}

/// Element offset of logical `[b, h, s, e]` under `strides`.
fn offset(idx: [usize; 4], strides: [usize; 4]) -> usize {
    idx.iter().zip(strides).map(|(i, s)| i * s).sum()
}

/// Places packed-BHSD `logical` values into storage of `len` elements with `strides` (gaps hold 0).
fn scatter(logical: &[f64], dims: [usize; 4], strides: [usize; 4], len: usize) -> Vec<f64> {
    let mut out = vec![0.0; len];
    for (i, v) in logical.iter().enumerate() {
        out[offset(unpack(i, dims), strides)] = *v;
    }
    out
}

/// Reads packed-BHSD values out of strided storage.
fn gather<T: Element>(storage: &[T], dims: [usize; 4], strides: [usize; 4]) -> Vec<T> {
    (0..dims.iter().product()).map(|i| storage[offset(unpack(i, dims), strides)]).collect()
}

fn unpack(mut i: usize, dims: [usize; 4]) -> [usize; 4] {
    let mut idx = [0; 4];
    for d in (0..4).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

fn extent(dims: [usize; 4], strides: [usize; 4]) -> usize {
    1 + dims.iter().zip(strides).map(|(d, s)| (d - 1) * s).sum::<usize>()
}

struct Run<T: Element> {
    o: Vec<T>,
    stats: Option<Vec<f32>>,
}

struct Inputs<T: Element> {
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    /// The rounded values in packed BHSD order, for the reference.
    logical: [Vec<f64>; 3],
}

fn inputs<T: Element>(ctx: &Cudnn, a: &SdpaArgs, seed: u64) -> Inputs<T> {
    let qd = [a.batch, a.heads_q, a.seq_q, a.head_dim];
    let kd = [a.batch, a.heads_kv, a.seq_kv, a.head_dim];
    let mut logical: [Vec<f64>; 3] = Default::default();
    let mut bufs = Vec::new();
    for (i, (dims, strides)) in
        [(qd, a.q_strides), (kd, a.k_strides), (kd, a.v_strides)].into_iter().enumerate()
    {
        let values = reference::random_values(seed + i as u64, dims.iter().product());
        let (buf, rounded) =
            upload::<T>(ctx, &scatter(&values, dims, strides, extent(dims, strides))).unwrap();
        let host: Vec<T> = reference::to_elements(&rounded);
        logical[i] = gather(&host, dims, strides).iter().map(|v| v.to_f64()).collect();
        bufs.push(buf);
    }
    let v = bufs.pop().unwrap();
    let k = bufs.pop().unwrap();
    let q = bufs.pop().unwrap();
    Inputs { q, k, v, logical }
}

fn run<T: Element>(
    ctx: &Cudnn,
    backend: Backend,
    a: &SdpaArgs,
    x: &Inputs<T>,
    train: bool,
) -> Result<Run<T>, Error> {
    let od = [a.batch, a.heads_q, a.seq_q, a.head_dim];
    let mut o = poisoned::<T>(ctx, extent(od, a.o_strides))?;
    let mut stats = poisoned::<f32>(ctx, a.batch * a.heads_q * a.seq_q)?;
    let s: Option<&mut dyn DevicePtrMut<f32>> = if train { Some(&mut stats) } else { None };
    let mut operands = SdpaOperands::new(&x.q, &x.k, &x.v, &mut o);
    operands.stats = s;
    sdpa(ctx, *a, operands, backend)?;
    let o = gather(&download(ctx, &o)?, od, a.o_strides);
    let stats = if train { Some(ctx.stream().clone_dtoh(&stats)?) } else { None };
    Ok(Run { o, stats })
}

fn describe(a: &SdpaArgs, layout: Layout, train: bool) -> String {
    format!(
        "b{} hq{} hkv{} sq{} skv{} d{} {} {}{}",
        a.batch,
        a.heads_q,
        a.heads_kv,
        a.seq_q,
        a.seq_kv,
        a.head_dim,
        layout.name(),
        a.mask.name(),
        if train { " training" } else { "" }
    )
}

/// Runs both backends against the reference; returns the failures.
fn check_case<T: Element>(ctx: &Cudnn, a: SdpaArgs, layout: Layout, train: bool, failures: &mut Vec<String>) {
    let x = inputs::<T>(ctx, &a, 11);
    let shape = AttentionShape {
        batch: a.batch,
        heads_q: a.heads_q,
        heads_kv: a.heads_kv,
        seq_q: a.seq_q,
        seq_kv: a.seq_kv,
        dim: a.head_dim,
    };
    let [q, k, v] = &x.logical;
    let (o_ref, stats_ref) = reference::attention(q, k, v, shape, a.scale() as f64, a.mask);
    for backend in [Backend::Fused, Backend::Naive] {
        let tag = format!("{} {} {}", backend.name(), T::DTYPE, describe(&a, layout, train));
        match run(ctx, backend, &a, &x, train) {
            Err(e) => failures.push(format!("{tag}: {e}")),
            Ok(r) => {
                let c = reference::compare(&r.o, &o_ref);
                if !c.passes(tol::<T>()) {
                    failures.push(format!("{tag}: O {c}"));
                }
                if let Some(stats) = r.stats {
                    let c = reference::compare(&stats, &stats_ref);
                    if !c.passes(STATS_TOL) {
                        failures.push(format!("{tag}: stats {c}"));
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_naive_match_the_reference() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let mut cases = 0;
    // (heads_q, heads_kv): GQA ratios 1, 4, 8 and MQA.
    let heads = [(8, 8), (8, 2), (16, 2), (8, 1)];
    // (seq_q, seq_kv, mask): prefill, decode-like chunks against a longer KV (bottom-right), odd lengths.
    let seqs = [
        (128, 128, Mask::None),
        (128, 128, Mask::CausalTopLeft),
        (96, 200, Mask::CausalBottomRight),
        (64, 256, Mask::CausalTopLeft),
        (1, 77, Mask::CausalBottomRight),
        (40, 40, Mask::None),
    ];
    for (i, &(hq, hkv)) in heads.iter().enumerate() {
        for (j, &(sq, skv, mask)) in seqs.iter().enumerate() {
            for d in [64, 128] {
                // Alternate layouts, dtypes, batch sizes and modes across the grid rather than multiplying.
                let layout = if (i + j) % 2 == 0 { Layout::Bshd } else { Layout::Bhsd };
                let batch = 1 + (i + j + d / 64) % 2;
                let train = (i + j + d / 64) % 3 == 0;
                let a = SdpaArgs::new(batch, hq, hkv, sq, skv, d, layout).with_mask(mask);
                if (i + j) % 2 == 0 {
                    check_case::<bf16>(&ctx, a, layout, train, &mut failures);
                } else {
                    check_case::<f16>(&ctx, a, layout, !train, &mut failures);
                }
                cases += 1;
            }
        }
    }
    // Every combination once more in the other dtype for the Llama head shapes.
    for mask in [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight] {
        for layout in [Layout::Bshd, Layout::Bhsd] {
            let a = SdpaArgs::new(2, 32, 8, 100, 160, 64, layout).with_mask(mask);
            check_case::<f16>(&ctx, a, layout, true, &mut failures);
            check_case::<bf16>(&ctx, a, layout, false, &mut failures);
            cases += 2;
        }
    }
    println!("{cases} cases x 2 backends; cache {:?}", ctx.cache().stats());
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn both_graph_forms_and_head_dim_256() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let version = ctx.info().cudnn_version;
    for form in [SdpaForm::Composite, SdpaForm::Unified] {
        if form == SdpaForm::Unified && version < 91301 {
            continue;
        }
        for train in [false, true] {
            let a = SdpaArgs::new(2, 16, 4, 128, 192, 128, Layout::Bshd).with_form(form);
            check_case::<bf16>(&ctx, a, Layout::Bshd, train, &mut failures);
            let plan = a.plan(&ctx, cudnn_llm_ops::DataType::BF16, train).unwrap();
            assert_eq!(plan.form(), form.name());
            println!("{} training={train}: {} {}", form.name(), plan.engine(), plan.name());
        }
    }
    // Automatic choice: unified for unmasked (9.13.1+) unless rejected, composite for causal.
    let auto = SdpaArgs::new(1, 8, 8, 64, 64, 64, Layout::Bhsd);
    let unmasked = auto.plan(&ctx, cudnn_llm_ops::DataType::F16, false).unwrap();
    let causal = auto.with_mask(Mask::CausalTopLeft).plan(&ctx, cudnn_llm_ops::DataType::F16, false).unwrap();
    println!("automatic forms on cuDNN {version}: unmasked {}, causal {}", unmasked.form(), causal.form());
    assert_eq!(causal.form(), "composite");
    if version >= 91301 {
        assert_eq!(unmasked.form(), "unified", "the unified graph was rejected on {version}");
    }
    let (major, _) = ctx.info().compute_capability;
    if major == 9 {
        for mask in [Mask::None, Mask::CausalTopLeft] {
            let a = SdpaArgs::new(1, 8, 2, 128, 128, 256, Layout::Bshd).with_mask(mask);
            check_case::<bf16>(&ctx, a, Layout::Bshd, true, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Fused vs naive where the f64 reference would be too slow: Llama head shapes at s = 2048, and decode.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_matches_naive_at_llama_sizes() {
    let ctx = gpu();
    let mut failures = Vec::new();
    let cases = [
        (32, 8, 2048, 2048, 128, Mask::CausalTopLeft, Layout::Bshd, true),
        (32, 8, 2048, 2048, 128, Mask::None, Layout::Bhsd, false),
        (32, 8, 2048, 2048, 64, Mask::CausalTopLeft, Layout::Bhsd, false),
        (32, 8, 1, 4096, 128, Mask::CausalBottomRight, Layout::Bshd, false),
        (32, 8, 1, 4096, 64, Mask::CausalBottomRight, Layout::Bshd, true),
        (32, 32, 512, 2048, 128, Mask::CausalBottomRight, Layout::Bshd, false),
        (32, 1, 2048, 2048, 64, Mask::CausalTopLeft, Layout::Bshd, false),
    ];
    for (hq, hkv, sq, skv, d, mask, layout, train) in cases {
        let a = SdpaArgs::new(1, hq, hkv, sq, skv, d, layout).with_mask(mask);
        let x = inputs::<bf16>(&ctx, &a, 5);
        let tag = describe(&a, layout, train);
        let (fused, naive) =
            match (run(&ctx, Backend::Fused, &a, &x, train), run(&ctx, Backend::Naive, &a, &x, train)) {
                (Ok(f), Ok(n)) => (f, n),
                (f, n) => {
                    failures.push(format!("{tag}: fused {:?} naive {:?}", f.err(), n.err()));
                    continue;
                }
            };
        let naive_o: Vec<f64> = naive.o.iter().map(|v| v.to_f64()).collect();
        let c = reference::compare(&fused.o, &naive_o);
        println!("{tag}: fused vs naive O {c}");
        if !c.passes(ATTN_BF16) {
            failures.push(format!("{tag}: O {c}"));
        }
        if let (Some(fs), Some(ns)) = (fused.stats, naive.stats) {
            let c = reference::compare(&fs, &ns.iter().map(|&v| v as f64).collect::<Vec<_>>());
            if !c.passes(STATS_TOL) {
                failures.push(format!("{tag}: stats {c}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Q, K and V read by strides out of one `[tokens, (h_q + 2 h_kv) · d]` QKV projection buffer.
#[test]
#[ignore = "needs a CUDA GPU"]
fn views_into_one_qkv_buffer() {
    let ctx = gpu();
    let (b, s, hq, hkv, d) = (2, 96, 8, 2, 64);
    let width = (hq + 2 * hkv) * d;
    // One row per token holds the token's Q, K and V heads; the three views differ only in where they start.
    let strides = [s * width, d, width, 1];
    let mut a = SdpaArgs::new(b, hq, hkv, s, s, d, Layout::Bshd).with_mask(Mask::CausalTopLeft);
    (a.q_strides, a.k_strides, a.v_strides) = (strides, strides, strides);
    let values = reference::random_values(3, b * s * width);
    let (qkv, rounded) = upload::<bf16>(&ctx, &values).unwrap();
    let host: Vec<bf16> = reference::to_elements(&rounded);
    let split = |start_head: usize, heads: usize| -> Vec<f64> {
        gather(&host[start_head * d..], [b, heads, s, d], strides).iter().map(|v| v.to_f64()).collect()
    };
    let shape = AttentionShape { batch: b, heads_q: hq, heads_kv: hkv, seq_q: s, seq_kv: s, dim: d };
    let (o_ref, _) = reference::attention(
        &split(0, hq),
        &split(hq, hkv),
        &split(hq + hkv, hkv),
        shape,
        a.scale() as f64,
        a.mask,
    );
    for backend in [Backend::Fused, Backend::Naive] {
        let mut o = poisoned::<bf16>(&ctx, b * s * hq * d).unwrap();
        let (q, k, v) = (qkv.slice(..), qkv.slice(hq * d..), qkv.slice((hq + hkv) * d..));
        sdpa(&ctx, a, SdpaOperands::new(&q, &k, &v, &mut o), backend).unwrap();
        let out = gather(&download(&ctx, &o).unwrap(), [b, hq, s, d], a.o_strides);
        let c = reference::compare(&out, &o_ref);
        println!("{} qkv views: {c}", backend.name());
        assert!(c.passes(ATTN_BF16), "{}: {c}", backend.name());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_touch_nothing_and_naive_reports_out_of_memory() {
    let ctx = gpu();
    let a = SdpaArgs::new(1, 8, 2, 64, 64, 64, Layout::Bshd).with_mask(Mask::CausalTopLeft);
    let x = inputs::<bf16>(&ctx, &a, 1);
    let n = 64 * 8 * 64;
    for backend in [Backend::Fused, Backend::Naive] {
        let fill = bf16::from_f32(7.0);
        let mut short: CudaSlice<bf16> = ctx.stream().clone_htod(&vec![fill; n - 1]).unwrap();
        let e = sdpa(&ctx, a, SdpaOperands::new(&x.q, &x.k, &x.v, &mut short), backend).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("O has"), "{e}");
        let mut o: CudaSlice<bf16> = ctx.stream().clone_htod(&vec![fill; n]).unwrap();
        let mut bad = a;
        bad.heads_kv = 3;
        assert!(sdpa(&ctx, bad, SdpaOperands::new(&x.q, &x.k, &x.v, &mut o), backend).is_err());
        let mut bad = a.with_mask(Mask::CausalBottomRight);
        bad.seq_q = 65;
        assert!(sdpa(&ctx, bad, SdpaOperands::new(&x.q, &x.k, &x.v, &mut o), backend).is_err());
        let f32_q = ctx.stream().alloc_zeros::<f32>(n).unwrap();
        let mut f32_o = ctx.stream().alloc_zeros::<f32>(n).unwrap();
        let f32_kv = ctx.stream().alloc_zeros::<f32>(n).unwrap();
        let e = sdpa(&ctx, a, SdpaOperands::new(&f32_q, &f32_kv, &f32_kv, &mut f32_o), backend).unwrap_err();
        assert!(e.is_not_supported(), "{e}");
        assert!(download(&ctx, &short).unwrap().iter().all(|&v| v == fill));
        assert!(download(&ctx, &o).unwrap().iter().all(|&v| v == fill));
    }
    // Scores for 32 heads x 131072² in f32 need terabytes: a clear error, not a crash.
    let big = SdpaArgs::new(1, 32, 8, 131072, 131072, 128, Layout::Bshd).with_mask(Mask::CausalTopLeft);
    let q = ctx.stream().alloc_zeros::<bf16>(131072 * 32 * 128).unwrap();
    let kv = ctx.stream().alloc_zeros::<bf16>(131072 * 8 * 128).unwrap();
    let mut o = ctx.stream().alloc_zeros::<bf16>(131072 * 32 * 128).unwrap();
    let e = sdpa(&ctx, big, SdpaOperands::new(&q, &kv, &kv, &mut o), Backend::Naive).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    println!("{e}");
}

/// One padded cuDNN plan for decode steps of any length: per-sequence lengths from device buffers.
/// (The fused backend runs such a decode on the split-KV kernel unless a graph form is asked for;
/// `cudnn-ops/tests/sdpa_decode.rs` tests that kernel and compares the two.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_decode_matches_exact_lengths() {
    let ctx = gpu();
    if ctx.info().cudnn_version < 91500 {
        println!(
            "SKIPPED: cuDNN {} has no sequence lengths on the unified SDPA",
            ctx.info().cudnn_version_string()
        );
        return;
    }
    let (b, hq, hkv, cap, d) = (2, 8, 2, 256, 64);
    let args =
        SdpaArgs::new(b, hq, hkv, 1, cap, d, Layout::Bshd).with_seq_lens().with_form(SdpaForm::Unified);
    let x = inputs::<bf16>(&ctx, &args, 21);
    let [q, k, v] = &x.logical;
    for lens in [[100usize, 200], [1, 256], [37, 64]] {
        let mut o = poisoned::<bf16>(&ctx, b * hq * d).unwrap();
        let lq = ctx.stream().clone_htod(&[1i32; 2]).unwrap();
        let lkv = ctx.stream().clone_htod(&lens.map(|l| l as i32)).unwrap();
        sdpa(&ctx, args, SdpaOperands::new(&x.q, &x.k, &x.v, &mut o).seq_lens(&lq, &lkv), Backend::Fused)
            .unwrap();
        let out = gather(&download(&ctx, &o).unwrap(), [b, hq, 1, d], args.o_strides);
        for (bi, &len) in lens.iter().enumerate() {
            // The reference over the first `len` keys of sequence bi alone.
            let kv = |t: &[f64]| -> Vec<f64> {
                (0..hkv).flat_map(|h| t[((bi * hkv + h) * cap) * d..][..len * d].to_vec()).collect()
            };
            let shape =
                AttentionShape { batch: 1, heads_q: hq, heads_kv: hkv, seq_q: 1, seq_kv: len, dim: d };
            let (o_ref, _) = reference::attention(
                &q[bi * hq * d..][..hq * d],
                &kv(k),
                &kv(v),
                shape,
                args.scale() as f64,
                Mask::None,
            );
            let c = reference::compare(&out[bi * hq * d..][..hq * d], &o_ref);
            println!("lens {lens:?} sequence {bi}: {c}");
            assert!(c.passes(ATTN_BF16), "lens {lens:?} sequence {bi}: {c}");
        }
    }
    assert_eq!(ctx.cache().stats().entries, 1, "one plan for every length");
}
