//! RoPE in place on a QKV buffer: the fused kernel and the ten eager kernels against an f64 rotation.
//! GPU tests are ignored by default; run them with `--include-ignored` on a GPU machine.

use cudarc::driver::CudaSlice;
use cudnn_llm_ops::testing::{download, gpu, upload};
use cudnn_llm_ops::{reference, rope, Backend, Cudnn, Element, RopeArgs, RopeOperands, RopeTables};
use half::{bf16, f16};

/// Angles `pos · θ_j` for `positions` rows of `dim / 2` frequencies (plain RoPE; the model adds
/// Llama-3's scaling on top, which does not change the kernels).
fn tables(positions: usize, dim: usize) -> (Vec<f64>, Vec<f64>) {
    let half = dim / 2;
    let angle = |p: usize, j: usize| p as f64 * 500000f64.powf(-((2 * j) as f64) / dim as f64);
    let all = |f: fn(f64) -> f64| (0..positions * half).map(|i| f(angle(i / half, i % half))).collect();
    (all(f64::cos), all(f64::sin))
}

/// The rotation of Q and K heads (the first `heads_q + heads_kv` heads of each row); V and the
/// padding past it are untouched.
fn rotate(x: &[f64], a: &RopeArgs, cos: &[f64], sin: &[f64]) -> Vec<f64> {
    rotate_at(x, a, cos, sin, &vec![a.start; a.batch])
}

/// [`rotate`] with sequence `b` starting at position `starts[b]`.
fn rotate_at(x: &[f64], a: &RopeArgs, cos: &[f64], sin: &[f64], starts: &[usize]) -> Vec<f64> {
    let (d, half) = (a.head_dim, a.head_dim / 2);
    let mut y = x.to_vec();
    for r in 0..a.batch * a.seq {
        let pos = starts[r / a.seq] + r % a.seq;
        for h in 0..a.heads_q + a.heads_kv {
            let v = r * a.row_stride + h * d;
            for j in 0..half {
                let (c, s) = (cos[pos * half + j], sin[pos * half + j]);
                let (p, q) = (x[v + j], x[v + j + half]);
                y[v + j] = p * c - q * s;
                y[v + j + half] = q * c + p * s;
            }
        }
    }
    y
}

fn check<T: Element>(ctx: &Cudnn, a: RopeArgs, positions: usize) {
    let (cos, sin) = tables(positions, a.head_dim);
    let t = RopeTables::<T>::new(ctx, &cos, &sin, a.head_dim).unwrap();
    let n = a.batch * a.seq * a.row_stride;
    let (x, rounded) = upload::<T>(ctx, &reference::random_values(7, n)).unwrap();
    let want = rotate(&rounded, &a, &cos, &sin);
    for backend in [Backend::Fused, Backend::Naive] {
        let mut buf = x.clone();
        rope(ctx, a, RopeOperands::new(&t, &mut buf), backend).unwrap();
        let got = download(ctx, &buf).unwrap();
        let c = reference::compare(&got, &want);
        println!("{} {backend:?} {a:?}: {c}", T::DTYPE);
        assert!(c.passes(reference::tolerance(T::DTYPE)), "{backend:?} {a:?}: {c}");
        // V (and anything past Q and K) is left exactly as it was.
        let qk = (a.heads_q + a.heads_kv) * a.head_dim;
        for r in [0, a.batch * a.seq - 1] {
            let row = r * a.row_stride;
            assert!(
                got[row + qk..row + a.row_stride]
                    .iter()
                    .zip(&rounded[row + qk..])
                    .all(|(g, w)| g.to_f64() == *w),
                "{backend:?}: row {r} changed past Q and K"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_eager_rope_rotate_q_and_k_only() {
    let ctx = gpu();
    // Llama-3.1-8B widths (32 + 8 + 8 heads of 128) in a prefill, and a decode step deep in the cache.
    let prefill = RopeArgs::new(1, 2048, 32, 8, 128).with_row_stride(6144);
    check::<bf16>(&ctx, prefill, 4096);
    check::<f16>(&ctx, RopeArgs::new(3, 1, 32, 8, 128).with_row_stride(6144).with_start(4000), 4096);
    // Llama-3.2-1B widths, batch 3 x 10 after 5 cached tokens; odd head counts and a head dim of 8.
    check::<bf16>(&ctx, RopeArgs::new(3, 10, 32, 8, 64).with_row_stride(3072).with_start(5), 64);
    check::<bf16>(&ctx, RopeArgs::new(2, 7, 3, 1, 8).with_row_stride(48).with_start(1), 16);
}

/// RoPE with the K/V append: Q and K rotated as without it, and each row's rotated K heads and V
/// heads copied bit for bit to row `position` of its sequence's caches; every other cache row keeps its
/// poison (NaN). Fused with host and device positions, eager with host positions.
fn check_append<T: Element>(ctx: &Cudnn, a: RopeArgs, starts: Option<&[usize]>, max_seq: usize) {
    let positions = max_seq + 4;
    let (cos, sin) = tables(positions, a.head_dim);
    let t = RopeTables::<T>::new(ctx, &cos, &sin, a.head_dim).unwrap();
    let n = a.batch * a.seq * a.row_stride;
    let (x, rounded) = upload::<T>(ctx, &reference::random_values(11, n)).unwrap();
    let host_starts = starts.map(<[usize]>::to_vec).unwrap_or_else(|| vec![a.start; a.batch]);
    let want = rotate_at(&rounded, &a, &cos, &sin, &host_starts);
    let cols = a.heads_kv * a.head_dim;
    let poison = vec![f64::NAN; a.batch * max_seq * cols];
    let backends: &[Backend] =
        if starts.is_some() { &[Backend::Fused] } else { &[Backend::Fused, Backend::Naive] };
    for &backend in backends {
        let mut buf = x.clone();
        let (mut kc, _) = upload::<T>(ctx, &poison).unwrap();
        let (mut vc, _) = upload::<T>(ctx, &poison).unwrap();
        let dev_starts: Option<CudaSlice<i32>> = starts
            .map(|s| ctx.stream().clone_htod(&s.iter().map(|&p| p as i32).collect::<Vec<_>>()).unwrap());
        let mut ops = RopeOperands::new(&t, &mut buf).append(&mut kc, &mut vc, max_seq);
        if let Some(d) = &dev_starts {
            ops = ops.starts(d);
        }
        rope(ctx, a, ops, backend).unwrap();
        let got = download(ctx, &buf).unwrap();
        let c = reference::compare(&got, &want);
        assert!(c.passes(reference::tolerance(T::DTYPE)), "{backend:?} {a:?}: {c}");
        let (k, v) = (download(ctx, &kc).unwrap(), download(ctx, &vc).unwrap());
        let mut written = vec![false; a.batch * max_seq];
        for r in 0..a.batch * a.seq {
            let (b, pos) = (r / a.seq, host_starts[r / a.seq] + r % a.seq);
            let row = b * max_seq + pos;
            written[row] = true;
            let src = r * a.row_stride + a.heads_q * a.head_dim;
            for (cache, at, name) in [(&k, src, "K"), (&v, src + cols, "V")] {
                let same = (0..cols)
                    .all(|e| cache[row * cols + e].to_f64().to_bits() == got[at + e].to_f64().to_bits());
                assert!(same, "{backend:?} {a:?}: {name} cache row {row} differs from the rotated buffer");
            }
        }
        for (row, w) in written.iter().enumerate() {
            if !w {
                let untouched = (0..cols)
                    .all(|e| k[row * cols + e].to_f64().is_nan() && v[row * cols + e].to_f64().is_nan());
                assert!(untouched, "{backend:?} {a:?}: cache row {row} written without a token");
            }
        }
        println!("{} {backend:?} append {a:?} starts {starts:?}: {c}", T::DTYPE);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_appends_rotated_k_and_v_to_the_cache() {
    let ctx = gpu();
    // An 8B-width prefill chunk after 5 cached tokens, and 1B-width decode steps at device positions.
    let chunk = RopeArgs::new(2, 9, 32, 8, 128).with_row_stride(6144).with_start(5);
    check_append::<bf16>(&ctx, chunk, None, 32);
    let step = RopeArgs::new(3, 1, 32, 8, 64).with_row_stride(3072);
    check_append::<f16>(&ctx, step, Some(&[0, 17, 63]), 64);
    check_append::<bf16>(&ctx, step.with_start(40), None, 64);
}
