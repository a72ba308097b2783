//! Ragged (THD) prefill attention end to end: the fused composite graph with ragged offsets and the
//! padding mask, and the naive per-sequence loop, against the f64 reference per sequence and against
//! each sequence run alone through the contiguous attention; one plan for two mixes of lengths; bad
//! input refused before anything runs. Also the padded (BSHD with device lengths) causal prefill the
//! same composite padding mask serves. GPU tests are ignored by default; run them with
//! `cargo test --test ragged -- --include-ignored` on a GPU machine.

use cudarc::driver::CudaSlice;
use cudnn_llm_ops::reference::{self, Tolerance};
use cudnn_llm_ops::testing::{download, expect_untouched, gpu, poisoned, upload};
use cudnn_llm_ops::{
    sdpa, sdpa_ragged, Backend, Cudnn, DeviceRagged, Element, Layout, Mask, RaggedArgs, RaggedOperands,
    RowStrides, SdpaArgs, SdpaOperands,
};
use half::{bf16, f16};

/// bf16 attention outputs, as cudnn-ops/tests/sdpa.rs; f16 has three more mantissa bits.
const ATTN_BF16: Tolerance = Tolerance::rel_l2(2e-2);
const ATTN_F16: Tolerance = Tolerance::rel_l2(5e-3);

fn tol<T: Element>() -> Tolerance {
    if T::DTYPE == cudnn_llm_ops::DataType::BF16 {
        ATTN_BF16
    } else {
        ATTN_F16
    }
}

/// `n` lengths in `lo..hi` drawn from `seed`, the first forced to 1 and the second to 65 (a sequence
/// of one token and one just past a 64-row tile).
fn seeded_lens(seed: u64, n: usize, lo: usize, hi: usize) -> Vec<usize> {
    let mut lens: Vec<usize> = reference::random_iter(seed)
        .take(n)
        .map(|x| lo + (((x + 1.0) / 2.0) * (hi - lo) as f64) as usize)
        .collect();
    lens[0] = 1;
    if n > 1 {
        lens[1] = 65;
    }
    lens
}

/// Packed Q, K, V on the device and their rounded values.
struct Packed<T: Element> {
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    values: [Vec<f64>; 3],
}

fn packed<T: Element>(
    ctx: &Cudnn,
    total: usize,
    (hq, hkv, d): (usize, usize, usize),
    seed: u64,
) -> Packed<T> {
    let up = |i: u64, h: usize| upload::<T>(ctx, &reference::random_values(seed + i, total * h * d)).unwrap();
    let ((q, qv), (k, kv), (v, vv)) = (up(0, hq), up(1, hkv), up(2, hkv));
    Packed { q, k, v, values: [qv, kv, vv] }
}

/// Ragged attention on `backend` into a poisoned O; the O values.
fn run_ragged<T: Element>(
    ctx: &Cudnn,
    args: RaggedArgs,
    batch: &DeviceRagged,
    x: &Packed<T>,
    backend: Backend,
) -> cudnn_llm_ops::Result<Vec<T>> {
    let mut o = poisoned::<T>(ctx, batch.queries().buffer_len())?;
    sdpa_ragged(ctx, args, RaggedOperands::new(&x.q, &x.k, &x.v, &mut o, batch), backend)?;
    download(ctx, &o)
}

/// Each sequence alone through the contiguous attention (`b = 1`, BSHD, its own length) on
/// `backend`, over slices of the packed buffers, into a poisoned O.
fn run_alone<T: Element>(
    ctx: &Cudnn,
    args: RaggedArgs,
    batch: &DeviceRagged,
    x: &Packed<T>,
) -> cudnn_llm_ops::Result<Vec<T>> {
    let mut o = poisoned::<T>(ctx, batch.queries().buffer_len())?;
    let (qo, kvo) = (batch.queries().offsets(), batch.keys().offsets());
    for (i, &n) in batch.seq_lens().iter().enumerate() {
        let n = n as usize;
        let a = SdpaArgs::new(1, args.heads_q, args.heads_kv, n, n, args.head_dim, Layout::Bshd)
            .with_mask(args.mask);
        let (q0, q1, k0, k1) = (qo[i] as usize, qo[i + 1] as usize, kvo[i] as usize, kvo[i + 1] as usize);
        let (q, k, v) = (x.q.slice(q0..q1), x.k.slice(k0..k1), x.v.slice(k0..k1));
        let mut os = o.slice_mut(q0..q1);
        sdpa(ctx, a, SdpaOperands::new(&q, &k, &v, &mut os), Backend::Fused)?;
    }
    download(ctx, &o)
}

/// One ragged case: fused and naive against the reference, and fused against each sequence alone.
fn check<T: Element>(
    ctx: &Cudnn,
    lens: &[usize],
    heads: (usize, usize, usize),
    mask: Mask,
    failures: &mut Vec<String>,
) {
    let (hq, hkv, d) = heads;
    let batch = DeviceRagged::new(ctx, lens, hq, hkv, d).unwrap();
    let args = RaggedArgs::new(lens.len(), batch.bucket(), hq, hkv, d).with_mask(mask);
    let x = packed::<T>(ctx, batch.total_tokens(), heads, 31);
    let [q, k, v] = &x.values;
    let want = reference::attention_ragged(q, k, v, lens, heads, args.scale() as f64, mask);
    let tag =
        format!("{} lens {lens:?} bucket {} hq{hq} hkv{hkv} d{d} {}", T::DTYPE, args.bucket, mask.name());
    let mut fused = None;
    for backend in [Backend::Fused, Backend::Naive] {
        match run_ragged(ctx, args, &batch, &x, backend) {
            Err(e) => failures.push(format!("{tag} {}: {e}", backend.name())),
            Ok(o) => {
                let c = reference::compare(&o, &want);
                println!("{tag} {} vs f64 reference: {c}", backend.name());
                if !c.passes(tol::<T>()) {
                    failures.push(format!("{tag} {} vs reference: {c}", backend.name()));
                }
                if backend == Backend::Fused {
                    fused = Some(o);
                }
            }
        }
    }
    match (fused, run_alone(ctx, args, &batch, &x)) {
        (Some(ragged), Ok(alone)) => {
            let alone: Vec<f64> = alone.iter().map(|v| v.to_f64()).collect();
            let c = reference::compare(&ragged, &alone);
            println!("{tag} fused ragged vs each sequence alone (contiguous fused sdpa): {c}");
            if !c.passes(tol::<T>()) {
                failures.push(format!("{tag} ragged vs each sequence alone: {c}"));
            }
        }
        (_, Err(e)) => failures.push(format!("{tag} each sequence alone: {e}")),
        (None, _) => {}
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ragged_matches_each_sequence_alone_and_the_reference() {
    let ctx = gpu();
    let mut failures = Vec::new();
    // Llama-3.1-8B heads (GQA 32/8, d 128), lengths 1, 65 and seeded ones that are not multiples of 64.
    check::<bf16>(&ctx, &seeded_lens(7, 5, 2, 400), (32, 8, 128), Mask::CausalTopLeft, &mut failures);
    // A small shape, both dtypes, masked and unmasked, many sequences.
    check::<bf16>(&ctx, &seeded_lens(8, 9, 2, 300), (4, 2, 64), Mask::CausalTopLeft, &mut failures);
    check::<f16>(&ctx, &seeded_lens(9, 6, 2, 200), (4, 2, 64), Mask::CausalTopLeft, &mut failures);
    check::<f16>(&ctx, &seeded_lens(10, 4, 2, 130), (8, 8, 64), Mask::None, &mut failures);
    // One sequence is the plain causal prefill.
    check::<bf16>(&ctx, &[777], (32, 8, 128), Mask::CausalTopLeft, &mut failures);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Q, K and V read in place in a decoder's fused QKV rows (`(h_q + 2·h_kv)·d` elements a token,
/// [`RowStrides::fused_qkv`]), O packed: fused and naive against the f64 reference of the same values
/// copied out packed, into poisoned outputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_qkv_rows_are_read_in_place() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (lens, (hq, hkv, d)) in
        [(seeded_lens(21, 5, 2, 300), (32usize, 8usize, 128usize)), (seeded_lens(22, 7, 2, 200), (4, 2, 64))]
    {
        let rows = RowStrides::fused_qkv(hq, hkv, d);
        let batch = DeviceRagged::strided(&ctx, &lens, (hq, hkv, d), rows).unwrap();
        let total = batch.total_tokens();
        let w = rows.q;
        let (qkv, host) = upload::<bf16>(&ctx, &reference::random_values(60, total * w)).unwrap();
        let part = |from: usize, width: usize| -> Vec<f64> {
            (0..total).flat_map(|t| host[t * w + from..][..width].to_vec()).collect()
        };
        let (q, k, v) = (part(0, hq * d), part(hq * d, hkv * d), part((hq + hkv) * d, hkv * d));
        let args = RaggedArgs::new(lens.len(), batch.bucket(), hq, hkv, d).with_rows(rows);
        let want = reference::attention_ragged(
            &q,
            &k,
            &v,
            &lens,
            (hq, hkv, d),
            args.scale() as f64,
            Mask::CausalTopLeft,
        );
        let kv = qkv.slice(hq * d..);
        let vv = qkv.slice((hq + hkv) * d..);
        for backend in [Backend::Fused, Backend::Naive] {
            let tag = format!("fused QKV rows lens {lens:?} hq{hq} hkv{hkv} d{d} {}", backend.name());
            let mut o = poisoned::<bf16>(&ctx, batch.outputs().buffer_len()).unwrap();
            let run = sdpa_ragged(&ctx, args, RaggedOperands::new(&qkv, &kv, &vv, &mut o, &batch), backend);
            match run.and_then(|()| download(&ctx, &o)) {
                Err(e) => failures.push(format!("{tag}: {e}")),
                Ok(o) => {
                    let c = reference::compare(&o, &want);
                    println!("{tag} vs f64 reference: {c}");
                    if !c.passes(ATTN_BF16) {
                        failures.push(format!("{tag}: {c}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_plan_serves_two_mixes_of_lengths() {
    let ctx = gpu();
    let heads = (32, 8, 128);
    // Two mixes of 6 sequences whose longest lies in one bucket (512): one plan.
    let mixes = [vec![300, 1, 65, 200, 17, 400], vec![5, 511, 128, 3, 90, 260]];
    let mut entries = None;
    for (i, lens) in mixes.iter().enumerate() {
        let batch = DeviceRagged::new(&ctx, lens, 32, 8, 128).unwrap();
        assert_eq!(batch.bucket(), 512, "{lens:?}");
        let args = RaggedArgs::new(lens.len(), 512, 32, 8, 128);
        let x = packed::<bf16>(&ctx, batch.total_tokens(), heads, 40 + i as u64);
        let o = run_ragged(&ctx, args, &batch, &x, Backend::Fused).unwrap();
        let [q, k, v] = &x.values;
        let want =
            reference::attention_ragged(q, k, v, lens, heads, args.scale() as f64, Mask::CausalTopLeft);
        let c = reference::compare(&o, &want);
        let stats = ctx.cache().stats();
        println!("mix {i} {lens:?}: {c}; plan cache {} entries, {} misses", stats.entries, stats.misses);
        assert!(c.passes(ATTN_BF16), "mix {i} {lens:?}: {c}");
        match entries {
            None => entries = Some(stats.entries),
            Some(n) => assert_eq!(stats.entries, n, "the second mix built another plan"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_ragged_input_touches_nothing() {
    let ctx = gpu();
    let lens = [100, 1, 250, 64];
    let batch = DeviceRagged::new(&ctx, &lens, 8, 2, 64).unwrap();
    let x = packed::<bf16>(&ctx, batch.total_tokens(), (8, 2, 64), 3);
    let args = RaggedArgs::new(4, 256, 8, 2, 64);
    let mut o = ctx.stream().alloc_zeros::<bf16>(batch.queries().buffer_len()).unwrap();
    let short_q = x.q.slice(..batch.queries().buffer_len() - 1);
    let short_v = x.v.slice(..batch.keys().buffer_len() - 64);
    type Case<'a> = (
        RaggedArgs,
        &'a dyn cudarc::driver::DevicePtr<bf16>,
        &'a dyn cudarc::driver::DevicePtr<bf16>,
        &'a str,
    );
    let cases: [Case; 6] = [
        (
            RaggedArgs::new(3, 256, 8, 2, 64),
            &x.q,
            &x.v,
            "holds 4 sequences (offsets of 5 entries), the arguments 3",
        ),
        (RaggedArgs::new(4, 128, 8, 2, 64), &x.q, &x.v, "250 tokens is longer than the bucket 128"),
        (RaggedArgs::new(4, 256, 8, 4, 64), &x.q, &x.v, "offsets are for 8/2 heads of 64"),
        (args, &short_q, &x.v, "Q has"),
        (args, &x.q, &short_v, "V has"),
        (RaggedArgs::new(4, 256, 8, 3, 64), &x.q, &x.v, "not a multiple of heads_kv"),
    ];
    for backend in [Backend::Fused, Backend::Naive] {
        for (a, q, v, expected) in cases {
            expect_untouched(&ctx, &mut o, expected, |o| {
                sdpa_ragged(&ctx, a, RaggedOperands::new(q, &x.k, v, o, &batch), backend)
            });
        }
        // An O one element short.
        let mut short_o = o.slice_mut(..batch.queries().buffer_len() - 1);
        let e = sdpa_ragged(&ctx, args, RaggedOperands::new(&x.q, &x.k, &x.v, &mut short_o, &batch), backend);
        assert!(e.unwrap_err().to_string().contains("O has"));
    }
    // f32 I/O is not supported (both backends take f16/bf16).
    let f = ctx.stream().alloc_zeros::<f32>(batch.queries().buffer_len()).unwrap();
    let mut fo = ctx.stream().alloc_zeros::<f32>(batch.queries().buffer_len()).unwrap();
    let e = sdpa_ragged(&ctx, args, RaggedOperands::new(&f, &f, &f, &mut fo, &batch), Backend::Fused)
        .unwrap_err();
    assert!(e.is_not_supported(), "{e}");
}

/// Padded BSHD causal prefill with device lengths: the composite graph's padding mask (no ragged
/// offsets). Rows past each sequence's length are unspecified; the valid rows match the reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_causal_prefill_matches_the_reference() {
    let ctx = gpu();
    let (b, hq, hkv, d, cap) = (3, 8, 2, 64, 256);
    let lens = [1usize, 100, 256];
    let a =
        SdpaArgs::new(b, hq, hkv, cap, cap, d, Layout::Bshd).with_mask(Mask::CausalTopLeft).with_seq_lens();
    let (q, qv) = upload::<bf16>(&ctx, &reference::random_values(1, b * cap * hq * d)).unwrap();
    let (k, kv) = upload::<bf16>(&ctx, &reference::random_values(2, b * cap * hkv * d)).unwrap();
    let (v, vv) = upload::<bf16>(&ctx, &reference::random_values(3, b * cap * hkv * d)).unwrap();
    let host_lens: Vec<i32> = lens.iter().map(|&n| n as i32).collect();
    let dev_lens = ctx.stream().clone_htod(&host_lens).unwrap();
    let mut o = poisoned::<bf16>(&ctx, b * cap * hq * d).unwrap();
    let ops = SdpaOperands::new(&q, &k, &v, &mut o).seq_lens(&dev_lens, &dev_lens);
    sdpa(&ctx, a, ops, Backend::Fused).unwrap();
    let o = download(&ctx, &o).unwrap();
    // The valid rows of each sequence, packed, against the ragged reference over the same rows.
    let rows = |x: &[f64], h: usize| -> Vec<f64> {
        lens.iter().enumerate().flat_map(|(i, &n)| x[i * cap * h * d..][..n * h * d].to_vec()).collect()
    };
    let want = reference::attention_ragged(
        &rows(&qv, hq),
        &rows(&kv, hkv),
        &rows(&vv, hkv),
        &lens,
        (hq, hkv, d),
        a.scale() as f64,
        Mask::CausalTopLeft,
    );
    let got: Vec<bf16> =
        lens.iter().enumerate().flat_map(|(i, &n)| o[i * cap * hq * d..][..n * hq * d].to_vec()).collect();
    let c = reference::compare(&got, &want);
    println!("padded causal prefill lens {lens:?} cap {cap}: {c}");
    assert!(c.passes(ATTN_BF16), "{c}");
}
