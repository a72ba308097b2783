//! The one-launch decoder layer of a decode step (`decode_layer`) against its f64 reference, which
//! rounds where the kernel rounds: the output, the appended K/V row and the cache rows it must leave
//! alone. GPU tests are ignored by default; run them with `--include-ignored` on a GPU machine.

use cudnn_llm_ops::testing::{download, gpu, poisoned, upload};
use cudnn_llm_ops::{
    decode_layer, reference, Cudnn, DecodeLayerArgs, DecodeLayerOperands, DecodeLayerWeights, Element,
    RopeTables,
};
use half::{bf16, f16};

/// Plain RoPE angles `pos · θ_j`, `positions` rows of `dim / 2`.
fn tables(positions: usize, dim: usize) -> (Vec<f64>, Vec<f64>) {
    let half = dim / 2;
    let angle = |p: usize, j: usize| p as f64 * 10000f64.powf(-((2 * j) as f64) / dim as f64);
    let all = |f: fn(f64) -> f64| (0..positions * half).map(|i| f(angle(i / half, i % half))).collect();
    (all(f64::cos), all(f64::sin))
}

/// The layer at `position` over a cache whose earlier rows hold random K/V (later rows too: they
/// must stay as they are), tables of `positions` rows; returns the output's comparison.
fn check<T: Element>(ctx: &Cudnn, a: DecodeLayerArgs, position: usize, positions: usize) {
    let (h, f, kv) = (a.hidden, a.ffn, a.max_seq * a.kv_width());
    // Weights scaled by 1/sqrt(fan-in), as trained layers keep their activations in range.
    let weight = |seed: u64, rows: usize, cols: usize| {
        let s = 1.0 / (cols as f64).sqrt();
        let v: Vec<f64> = reference::random_values(seed, rows * cols).iter().map(|x| x * s).collect();
        upload::<T>(ctx, &v).unwrap()
    };
    let norm = |seed: u64| {
        let v: Vec<f64> = reference::random_values(seed, h).iter().map(|x| 1.0 + 0.5 * x).collect();
        upload::<T>(ctx, &v).unwrap()
    };
    let (x, xh) = upload::<T>(ctx, &reference::random_values(1, h)).unwrap();
    let (an, anh) = norm(2);
    let (qkv, qkvh) = weight(3, a.qkv_width(), h);
    let (o, oh) = weight(4, h, a.attn_width());
    let (mn, mnh) = norm(5);
    let (g, gh) = weight(6, f, h);
    let (u, uh) = weight(7, f, h);
    let (d, dh) = weight(8, h, f);
    let (mut k, mut kh) = upload::<T>(ctx, &reference::random_values(9, kv)).unwrap();
    let (mut v, mut vh) = upload::<T>(ctx, &reference::random_values(10, kv)).unwrap();
    let (cos, sin) = tables(positions, a.head_dim);
    let t = RopeTables::<T>::new(ctx, &cos, &sin, a.head_dim).unwrap();
    let pos = ctx.stream().clone_htod(&[position as i32]).unwrap();
    let mut y = poisoned::<T>(ctx, h).unwrap();
    let w =
        DecodeLayerWeights { attn_norm: &an, qkv: &qkv, o: &o, mlp_norm: &mn, gate: &g, up: &u, down: &d };
    let ops = DecodeLayerOperands { x: &x, w, tables: &t, position: &pos, k: &mut k, v: &mut v, y: &mut y };
    decode_layer(ctx, a, ops).unwrap();
    let first = download(ctx, &y).unwrap();
    // Timed again (the same inputs: the K/V row is rewritten with the same values), the phases of
    // block 0 by the GPU's timer, medians of 20.
    let mut phases = vec![Vec::new(); 6];
    for _ in 0..20 {
        let ops =
            DecodeLayerOperands { x: &x, w, tables: &t, position: &pos, k: &mut k, v: &mut v, y: &mut y };
        decode_layer(ctx, a, ops).unwrap();
        let p = cudnn_llm_ops::ops::decode_layer::phase_times(ctx).unwrap().unwrap();
        for (all, ns) in phases.iter_mut().zip(p) {
            all.push(ns);
        }
    }
    let med: Vec<u64> = phases
        .into_iter()
        .map(|mut v| {
            v.sort();
            v[v.len() / 2]
        })
        .collect();
    println!(
        "phases (ns, block 0, median of 20): wait {} A {} B {} C {} D {} E {}",
        med[0], med[1], med[2], med[3], med[4], med[5]
    );
    let again = download(ctx, &y).unwrap();
    assert!(
        first.iter().zip(&again).all(|(a, b)| a.to_f64().to_bits() == b.to_f64().to_bits()),
        "a launch again gave another y"
    );
    let round = |v: f64| T::from_f64(v).to_f64();
    let w = [&anh[..], &qkvh, &oh, &mnh, &gh, &uh, &dh];
    let want = cudnn_llm_ops::ops::decode_layer::reference(
        &a, &xh, w, &cos, &sin, position, &mut kh, &mut vh, round,
    );
    let got = download(ctx, &y).unwrap();
    let c = reference::compare(&got, &want);
    let tol = reference::tolerance(T::DTYPE);
    println!("{} {a:?} at {position} (tables {positions}): y {c}", T::DTYPE);
    assert!(c.passes(tol), "{a:?} at {position}: y {c}");
    // The caches: the appended row as the reference's; every other row exactly as it was.
    for (name, buf, host) in [("k", &k, &kh), ("v", &v, &vh)] {
        let got = download(ctx, buf).unwrap();
        let row = a.kv_width();
        for r in 0..a.max_seq {
            let (g, w) = (&got[r * row..(r + 1) * row], &host[r * row..(r + 1) * row]);
            if r == position {
                let c = reference::compare(g, w);
                assert!(c.passes(tol), "{name} row {r}: {c}");
            } else {
                let same = g.iter().zip(w).all(|(g, w)| g.to_f64() == *w);
                assert!(same, "{name} row {r} changed; only row {position} is the step's");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_launch_layers_match_the_reference() {
    let ctx = gpu();
    // SmolLM2-135M's layer, 71 keys (several splits of 32); Llama-3.2-1B's at 300 keys.
    check::<bf16>(&ctx, DecodeLayerArgs::new(576, 9, 3, 64, 1536, 1e-5, 96), 70, 96);
    check::<bf16>(&ctx, DecodeLayerArgs::new(2048, 32, 8, 64, 8192, 1e-5, 320), 299, 320);
    // Head dim 128 at the first position (one key), and 32 and 96 in f16.
    check::<bf16>(&ctx, DecodeLayerArgs::new(256, 2, 1, 128, 512, 1e-5, 40), 0, 40);
    check::<f16>(&ctx, DecodeLayerArgs::new(128, 4, 2, 32, 256, 1e-6, 64), 33, 64);
    check::<f16>(&ctx, DecodeLayerArgs::new(192, 2, 2, 96, 384, 1e-5, 48), 47, 48);
    // A long cache: more keys than the grid's warps split finely.
    check::<bf16>(&ctx, DecodeLayerArgs::new(576, 9, 3, 64, 1536, 1e-5, 4100), 4099, 4100);
    // Again on the same buffers and barrier: the launch leaves its counters ready for the next.
    check::<bf16>(&ctx, DecodeLayerArgs::new(576, 9, 3, 64, 1536, 1e-5, 96), 12, 96);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_position_outside_the_tables_leaves_the_caches_alone() {
    // 20 is past the 16-position tables: q is not rotated, nothing appended, attention reads the
    // 21 rows as they are (the reference does the same).
    let ctx = gpu();
    check::<bf16>(&ctx, DecodeLayerArgs::new(576, 9, 3, 64, 1536, 1e-5, 32), 20, 16);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn short_buffers_and_other_shapes_are_refused_before_anything_runs() {
    let ctx = gpu();
    let a = DecodeLayerArgs::new(128, 4, 2, 32, 256, 1e-5, 8);
    let s = ctx.stream();
    let buf = |n: usize| s.clone_htod(&vec![bf16::from_f32(7.0); n]).unwrap();
    let (x, an, mn) = (buf(128), buf(128), buf(128));
    let (qkv, o, g, u, d) = (buf(256 * 128), buf(128 * 128), buf(256 * 128), buf(256 * 128), buf(128 * 256));
    let (cos, sin) = tables(8, 32);
    let t = RopeTables::<bf16>::new(&ctx, &cos, &sin, 32).unwrap();
    let pos = s.clone_htod(&[3i32]).unwrap();
    let (mut k, mut v) = (buf(8 * 64), buf(8 * 64 - 1));
    let mut y = buf(128);
    let w =
        DecodeLayerWeights { attn_norm: &an, qkv: &qkv, o: &o, mlp_norm: &mn, gate: &g, up: &u, down: &d };
    let ops = DecodeLayerOperands { x: &x, w, tables: &t, position: &pos, k: &mut k, v: &mut v, y: &mut y };
    let e = decode_layer(&ctx, a, ops).unwrap_err().to_string();
    assert!(e.contains("v cache has 511 elements"), "{e}");
    let mut v = buf(8 * 64);
    let ops = DecodeLayerOperands { x: &x, w, tables: &t, position: &pos, k: &mut k, v: &mut v, y: &mut y };
    let odd = DecodeLayerArgs::new(128, 4, 2, 80, 256, 1e-5, 8);
    let e = decode_layer(&ctx, odd, ops).unwrap_err().to_string();
    assert!(e.contains("head dim 80"), "{e}");
    for b in [&y, &k] {
        assert!(download(&ctx, b).unwrap().iter().all(|v| v.to_f32() == 7.0), "a refused call wrote");
    }
}
