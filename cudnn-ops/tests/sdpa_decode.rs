//! The split-KV decode attention ([`SdpaKernel::SplitKv`]) end to end: one query per sequence over a
//! K/V cache laid out as Llama's decoder keeps it (Q a view into the fused QKV rows, K and V the cache
//! `[b, capacity, h_kv · d]`), per-sequence lengths on the device, against the f64 reference and
//! against cuDNN's padded plan on the same inputs; empty, negative and over-long lengths; no key read
//! past a length; a decode without device lengths; a CUDA graph replayed at new lengths; refusals that
//! touch nothing. GPU tests are ignored by default; run them with `--include-ignored` on a GPU machine.

use cudarc::driver::CudaSlice;
use cudnn_llm_ops::reference::{self, AttentionShape, Tolerance};
use cudnn_llm_ops::testing::{download, expect_untouched, gpu, poisoned, upload};
use cudnn_llm_ops::{
    sdpa, Backend, Cudnn, Element, Error, Layout, Mask, SdpaArgs, SdpaForm, SdpaKernel, SdpaOperands, SeqLens,
};
use half::{bf16, f16};

/// Attention outputs against the f64 reference, as `cudnn-ops/tests/sdpa.rs`: one rounding of O plus f32 sums.
const ATTN_BF16: Tolerance = Tolerance::rel_l2(2e-2);
const ATTN_F16: Tolerance = Tolerance::rel_l2(5e-3);

fn tol<T: Element>() -> Tolerance {
    if T::DTYPE == cudnn_llm_ops::DataType::BF16 {
        ATTN_BF16
    } else {
        ATTN_F16
    }
}

/// A decode's buffers and the rounded values the reference reads.
struct Decode<T> {
    args: SdpaArgs,
    /// `[b, (h_q + 2 h_kv) · d]`: Q heads first, as a QKV projection writes them.
    qkv: CudaSlice<T>,
    /// `[b, capacity, h_kv · d]` each.
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    /// Host copies of `qkv`, `k`, `v`, rounded to `T`.
    host: [Vec<f64>; 3],
}

/// A padded decode of `batch` sequences over a `cap`-key cache; sequence `b`'s first `filled[b]` cache
/// rows hold random values, the rest `pad` (zeros still change a softmax that reads them; NaN poisons
/// it). Q values are scaled by 3 so that the softmax is not flat.
fn decode<T: Element>(
    ctx: &Cudnn,
    (hq, hkv, d): (usize, usize, usize),
    cap: usize,
    filled: &[usize],
    pad: f64,
    seed: u64,
) -> Decode<T> {
    let batch = filled.len();
    let w = (hq + 2 * hkv) * d;
    let mut args = SdpaArgs::new(batch, hq, hkv, 1, cap, d, Layout::Bshd).with_seq_lens();
    args.q_strides = [w, d, w, 1];
    let kv = [cap * hkv * d, d, hkv * d, 1];
    (args.k_strides, args.v_strides) = (kv, kv);
    let qkv: Vec<f64> = reference::random_values(seed, batch * w).iter().map(|v| 3.0 * v).collect();
    let cache = |seed: u64| -> Vec<f64> {
        let row = hkv * d;
        let mut values = reference::random_iter(seed);
        let mut out = vec![pad; batch * cap * row];
        for (b, &n) in filled.iter().enumerate() {
            for x in &mut out[b * cap * row..][..n.min(cap) * row] {
                *x = values.next().unwrap_or(0.5);
            }
        }
        out
    };
    let (qkv, qkv_h) = upload::<T>(ctx, &qkv).unwrap();
    let (k, k_h) = upload::<T>(ctx, &cache(seed + 1)).unwrap();
    let (v, v_h) = upload::<T>(ctx, &cache(seed + 2)).unwrap();
    Decode { args, qkv, k, v, host: [qkv_h, k_h, v_h] }
}

/// The reference output `[h_q, d]` of sequence `b` over its first `len` keys (zeros for none).
fn expected<T>(x: &Decode<T>, b: usize, len: usize) -> Vec<f64> {
    let a = x.args;
    let (hq, hkv, d, cap) = (a.heads_q, a.heads_kv, a.head_dim, a.seq_kv);
    if len == 0 {
        return vec![0.0; hq * d];
    }
    let w = (hq + 2 * hkv) * d;
    let q = x.host[0][b * w..][..hq * d].to_vec();
    let heads_major = |cache: &[f64]| -> Vec<f64> {
        let mut out = Vec::with_capacity(hkv * len * d);
        for h in 0..hkv {
            for p in 0..len {
                out.extend_from_slice(&cache[((b * cap + p) * hkv + h) * d..][..d]);
            }
        }
        out
    };
    let shape = AttentionShape { batch: 1, heads_q: hq, heads_kv: hkv, seq_q: 1, seq_kv: len, dim: d };
    let (k, v) = (heads_major(&x.host[1]), heads_major(&x.host[2]));
    reference::attention(&q, &k, &v, shape, a.scale() as f64, Mask::None).0
}

/// How the key lengths reach the call.
#[derive(Debug, Clone, Copy)]
enum Lens {
    /// Device values as they are ([`SdpaOperands::seq_lens`]).
    Raw,
    /// Clamped first into a [`SeqLens`] ([`SdpaOperands::clamped_seq_lens`]), as a decoder's layers share.
    Clamped,
    /// None: `args` is not padded and every sequence has `seq_kv` keys.
    Host,
}

/// Runs `args` on the fused backend over `lens` (any i32 values; one query each); returns O
/// `[b, h_q, d]`, poisoned before the call.
fn run<T: Element>(
    ctx: &Cudnn,
    x: &Decode<T>,
    args: SdpaArgs,
    lens: &[i32],
    how: Lens,
) -> Result<Vec<T>, Error> {
    let (b, hq, d) = (args.batch, args.heads_q, args.head_dim);
    let mut o = poisoned::<T>(ctx, b * hq * d)?;
    let ops = SdpaOperands::new(&x.qkv, &x.k, &x.v, &mut o);
    if let Lens::Host = how {
        sdpa(ctx, args, ops, Backend::Fused)?;
        return download(ctx, &o);
    }
    let lq = ctx.stream().clone_htod(&vec![1i32; b])?;
    let lkv = ctx.stream().clone_htod(lens)?;
    if let Lens::Clamped = how {
        let mut l = SeqLens::new(ctx, b, 1, args.seq_kv)?;
        l.clamp(ctx, &lq, &lkv)?;
        sdpa(ctx, args, ops.clamped_seq_lens(&l), Backend::Fused)?;
    } else {
        sdpa(ctx, args, ops.seq_lens(&lq, &lkv), Backend::Fused)?;
    }
    download(ctx, &o)
}

/// Split-KV over `lens`, each sequence against the reference over its clamped length; then cuDNN's
/// padded plan on the same inputs (where this cuDNN has one) against the reference and the split-KV
/// output. Failures are collected.
fn check<T: Element>(ctx: &Cudnn, x: &Decode<T>, lens: &[i32], how: Lens, failures: &mut Vec<String>) {
    // Forced: with device lengths on cuDNN 9.15+ the fused backend picks the padded graph by itself.
    let a = x.args.with_form(SdpaKernel::SplitKv);
    let (hq, d) = (a.heads_q, a.head_dim);
    let tag = format!("{} h{hq}/{} d{d} cap {} lens {lens:?} {how:?}", T::DTYPE, a.heads_kv, a.seq_kv);
    let kernel = a.fused_kernel(ctx.features(), false);
    if kernel != SdpaKernel::SplitKv {
        failures.push(format!("{tag}: the fused backend picks {}, not split-kv", kernel.name()));
        return;
    }
    let clamped = |len: i32| len.clamp(0, a.seq_kv as i32) as usize;
    let rows = |o: &[T], b: usize| o[b * hq * d..][..hq * d].to_vec();
    let split = match run(ctx, x, a, lens, how) {
        Ok(o) => o,
        Err(e) => return failures.push(format!("{tag}: split-kv: {e}")),
    };
    for (b, &len) in lens.iter().enumerate() {
        let (out, want) = (rows(&split, b), expected(x, b, clamped(len)));
        let c = reference::compare(&out, &want);
        println!("{tag} sequence {b}: split-kv vs reference {c}");
        if clamped(len) == 0 && out.iter().any(|v| v.to_f64() != 0.0) {
            failures.push(format!("{tag} sequence {b}: no keys, but a non-zero output ({c})"));
        } else if !c.passes(tol::<T>()) {
            failures.push(format!("{tag} sequence {b}: split-kv vs reference {c}"));
        }
    }
    if !ctx.features().sdpa_seq_lens() {
        return println!("{tag}: cuDNN {} has no padded plan to compare", ctx.info().cudnn_version_string());
    }
    let cudnn = match run(ctx, x, a.with_form(SdpaForm::Unified), lens, how) {
        Ok(o) => o,
        Err(e) if e.is_not_supported() => return println!("{tag}: cuDNN's padded plan: {e}"),
        Err(e) => return failures.push(format!("{tag}: cuDNN's padded plan: {e}")),
    };
    for (b, &len) in lens.iter().enumerate() {
        let out = rows(&cudnn, b);
        if clamped(len) == 0 {
            let first: Vec<f64> = out.iter().take(4).map(|v| v.to_f64()).collect();
            println!("{tag} sequence {b}: cuDNN's padded plan gives {first:?}... for no keys");
            continue;
        }
        let theirs: Vec<f64> = out.iter().map(|v| v.to_f64()).collect();
        let vs_ref = reference::compare(&out, &expected(x, b, clamped(len)));
        let vs_split = reference::compare(&rows(&split, b), &theirs);
        println!("{tag} sequence {b}: cuDNN vs reference {vs_ref}; split-kv vs cuDNN {vs_split}");
        if !vs_split.passes(tol::<T>()) {
            failures.push(format!("{tag} sequence {b}: split-kv vs cuDNN's padded plan {vs_split}"));
        }
    }
}

/// GQA (Llama-3.1-8B's 32/8 at head dims 128 and 64, groups of 3 and 8), MQA, equal heads, head dims 32
/// and 256; lengths 1, 17, 545 at capacities 642 and 4096; bf16 and f16; lengths raw and clamped.
#[test]
#[ignore = "needs a CUDA GPU"]
fn split_kv_matches_the_reference_and_cudnn() {
    let ctx = gpu();
    let lens = [1, 17, 545];
    let filled = [577; 3]; // past the longest length, so a read past it shows
    let heads =
        [(32, 8, 128), (32, 8, 64), (32, 1, 128), (8, 8, 64), (16, 4, 256), (12, 4, 32), (64, 8, 128)];
    let mut failures = Vec::new();
    for (i, &h) in heads.iter().enumerate() {
        for (j, cap) in [642, 4096].into_iter().enumerate() {
            let how = if (i + j) % 2 == 0 { Lens::Raw } else { Lens::Clamped };
            let seed = 10 * i as u64 + j as u64;
            if (i + j) % 2 == 0 {
                check(&ctx, &decode::<bf16>(&ctx, h, cap, &filled, 0.0, seed), &lens, how, &mut failures);
            } else {
                check(&ctx, &decode::<f16>(&ctx, h, cap, &filled, 0.0, seed), &lens, how, &mut failures);
            }
        }
    }
    // Llama-3.1-8B's shape once more in the other dtype and length source.
    let x = decode::<f16>(&ctx, heads[0], 642, &filled, 0.0, 99);
    check(&ctx, &x, &lens, Lens::Clamped, &mut failures);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// A length of 0 (or less) writes zeros; a length past the capacity is clamped to it, as cuDNN's
/// padded plan clamps (its outputs are compared for the clamped one and printed for the empty ones).
#[test]
#[ignore = "needs a CUDA GPU"]
fn empty_and_overlong_lengths() {
    let ctx = gpu();
    let cap = 100;
    let lens = [0, 100, 250, -3, 1];
    let mut failures = Vec::new();
    for how in [Lens::Raw, Lens::Clamped] {
        let x = decode::<bf16>(&ctx, (8, 2, 64), cap, &[cap; 5], 0.0, 7);
        check(&ctx, &x, &lens, how, &mut failures);
        let x = decode::<f16>(&ctx, (32, 8, 128), cap, &[cap; 5], 0.0, 8);
        check(&ctx, &x, &lens, how, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Cache rows past each length hold NaN: a key read past its length would poison the output.
#[test]
#[ignore = "needs a CUDA GPU"]
fn no_key_past_the_length_is_read() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (h, cap, lens) in [((32, 8, 128), 4096, [5, 1000, 1]), ((8, 1, 64), 64, [63, 2, 17])] {
        let filled = lens.map(|l| l as usize);
        for how in [Lens::Raw, Lens::Clamped] {
            let x = decode::<bf16>(&ctx, h, cap, &filled, f64::NAN, 3);
            let a = x.args;
            let tag =
                format!("h{}/{} d{} cap {cap} lens {lens:?} {how:?}", a.heads_q, a.heads_kv, a.head_dim);
            let out = run(&ctx, &x, a, &lens, how).unwrap();
            for (b, &len) in lens.iter().enumerate() {
                let rows = &out[b * a.heads_q * a.head_dim..][..a.heads_q * a.head_dim];
                let c = reference::compare(rows, &expected(&x, b, len as usize));
                println!("{tag} sequence {b}: {c}");
                if !c.passes(ATTN_BF16) {
                    failures.push(format!("{tag} sequence {b}: {c}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// A decode without device lengths (`seq_kv` keys for every sequence, unmasked or bottom-right
/// causal, which hides nothing from one query) takes the split-KV kernel too, and agrees with the
/// reference and with cuDNN's composite graph.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_without_device_lengths() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (h, skv) in [((32, 8, 128), 77), ((32, 8, 64), 1000), ((4, 4, 128), 1)] {
        for mask in [Mask::None, Mask::CausalBottomRight] {
            let mut x = decode::<bf16>(&ctx, h, skv, &[skv; 2], 0.0, 5);
            x.args.padded = false;
            x.args = x.args.with_mask(mask);
            let a = x.args;
            let tag = format!("h{}/{} d{} s_kv {skv} {}", a.heads_q, a.heads_kv, a.head_dim, mask.name());
            assert_eq!(a.fused_kernel(ctx.features(), false), SdpaKernel::SplitKv, "{tag}");
            let split = run(&ctx, &x, a, &[], Lens::Host).unwrap();
            let graph = run(&ctx, &x, a.with_form(SdpaForm::Composite), &[], Lens::Host).unwrap();
            let n = a.heads_q * a.head_dim;
            for b in 0..2 {
                let c = reference::compare(&split[b * n..][..n], &expected(&x, b, skv));
                let theirs: Vec<f64> = graph[b * n..][..n].iter().map(|v| v.to_f64()).collect();
                let vs = reference::compare(&split[b * n..][..n], &theirs);
                println!("{tag} sequence {b}: split-kv vs reference {c}; vs cuDNN composite {vs}");
                if !c.passes(ATTN_BF16) || !vs.passes(ATTN_BF16) {
                    failures.push(format!("{tag} sequence {b}: vs reference {c}; vs cuDNN {vs}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// One call captured in a CUDA graph (after a plain call that allocates the partials) replays at
/// lengths changed on the device, bit for bit as plain calls at those lengths; the capture grows no
/// buffer of the context.
#[test]
#[ignore = "needs a CUDA GPU"]
fn split_kv_replays_in_a_cuda_graph() {
    let ctx = gpu();
    let cap = 256;
    let x = decode::<bf16>(&ctx, (32, 8, 128), cap, &[cap; 2], 0.0, 11);
    let a = x.args;
    let n = 2 * a.heads_q * a.head_dim;
    let lq = ctx.stream().clone_htod(&[1i32; 2]).unwrap();
    let mut lkv = ctx.stream().clone_htod(&[10i32, 20]).unwrap();
    let mut o = poisoned::<bf16>(&ctx, n).unwrap();
    let call = |o: &mut CudaSlice<bf16>, lkv: &CudaSlice<i32>| {
        sdpa(&ctx, a, SdpaOperands::new(&x.qkv, &x.k, &x.v, o).seq_lens(&lq, lkv), Backend::Fused)
    };
    call(&mut o, &lkv).unwrap();
    let epoch = ctx.buffer_epoch();
    // SAFETY: this test uses one thread and no other stream.
    let ((), graph) = unsafe { ctx.capture(|| call(&mut o, &lkv)) }.unwrap();
    assert_eq!(ctx.buffer_epoch(), epoch, "the capture grew a buffer of the context");
    for lens in [[1, 256], [100, 37], [256, 0], [300, 2]] {
        ctx.stream().memcpy_htod(&lens, &mut lkv).unwrap();
        ctx.stream().memcpy_htod(&vec![bf16::NAN; n], &mut o).unwrap();
        graph.launch().unwrap();
        let replayed = download(&ctx, &o).unwrap();
        let plain = run(&ctx, &x, a, &lens, Lens::Raw).unwrap();
        assert_eq!(replayed, plain, "lens {lens:?}: the replay differs from a plain call");
        for (b, &len) in lens.iter().enumerate() {
            let len = len.clamp(0, cap as i32) as usize;
            let c = reference::compare(&replayed[b * n / 2..][..n / 2], &expected(&x, b, len));
            println!("replay at lens {lens:?}, sequence {b}: {c}");
            assert!(c.passes(ATTN_BF16), "replay at lens {lens:?}, sequence {b}: {c}");
        }
    }
}

/// What the split-KV kernel does not take is an error when it is asked for, and touches nothing; a
/// misaligned Q is an error on the automatic choice too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn refusals_touch_nothing() {
    let ctx = gpu();
    let x = decode::<bf16>(&ctx, (8, 2, 64), 64, &[64; 2], 0.0, 2);
    let a = x.args;
    let lq = ctx.stream().clone_htod(&[1i32; 2]).unwrap();
    let lkv = ctx.stream().clone_htod(&[10i32, 64]).unwrap();
    let mut o = ctx.stream().alloc_zeros::<bf16>(2 * 8 * 64).unwrap();
    // Head dim 48 is a multiple of 8 (cuDNN takes it), but not a power of two.
    let mut d48 = SdpaArgs::new(2, 8, 2, 1, 64, 48, Layout::Bshd).with_form(SdpaKernel::SplitKv);
    d48.padded = true;
    let e = expect_untouched(&ctx, &mut o, "head_dim 48", |o| {
        sdpa(&ctx, d48, SdpaOperands::new(&x.qkv, &x.k, &x.v, o).seq_lens(&lq, &lkv), Backend::Fused)
    });
    assert!(e.is_not_supported(), "{e}");
    // Training stats: not on the split-KV kernel.
    let mut host = a.with_form(SdpaKernel::SplitKv);
    host.padded = false;
    let mut stats = ctx.stream().alloc_zeros::<f32>(16).unwrap();
    let e = expect_untouched(&ctx, &mut o, "training stats", |o| {
        let ops = SdpaOperands::new(&x.qkv, &x.k, &x.v, o).stats(&mut stats);
        sdpa(&ctx, host, ops, Backend::Fused)
    });
    assert!(e.is_not_supported(), "{e}");
    // Q 8 bytes into the rows: 16-byte loads cannot read it. NotSupported, as the other refusals
    // (KvCache::attend falls back on it).
    let q = x.qkv.slice(4..);
    let e = expect_untouched(&ctx, &mut o, "not 16-byte aligned", |o| {
        sdpa(&ctx, a, SdpaOperands::new(&q, &x.k, &x.v, o).seq_lens(&lq, &lkv), Backend::Fused)
    });
    assert!(e.is_not_supported(), "{e}");
}
