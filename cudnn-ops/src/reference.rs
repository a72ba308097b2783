//! CPU references in f64, and the comparison used by tests and the report.

use crate::dtype::{DataType, Element};

/// References for the backward pass, the loss and the optimizer, with finite-difference tests.
pub mod backward;

/// RMSNorm of row-major `[tokens, hidden]` in f64: returns `(y, inv_rms)`.
pub fn rms_norm(
    x: &[f64],
    weight: &[f64],
    tokens: usize,
    hidden: usize,
    epsilon: f64,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(x.len(), tokens * hidden, "reference rms_norm: x length");
    assert_eq!(weight.len(), hidden, "reference rms_norm: weight length");
    let mut y = Vec::with_capacity(x.len());
    let mut inv = Vec::with_capacity(tokens);
    for row in x.chunks_exact(hidden) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let r = 1.0 / (mean_sq + epsilon).sqrt();
        inv.push(r);
        y.extend(row.iter().zip(weight).map(|(v, w)| v * r * w));
    }
    (y, inv)
}

/// Greedy picks in f64: the pick word ([`crate::Pick::word`]) of each row of `logits` as
/// [`crate::argmax`] writes it: the first NaN or +inf id of a row, else every logit -inf, else the
/// largest logit's lowest id (values compared as given: pass them rounded to the logits' dtype).
pub fn argmax_rows(logits: &[f64], args: crate::ArgmaxArgs) -> Vec<u32> {
    use crate::Pick;
    (0..args.rows)
        .map(|r| {
            let row = &logits[r * args.row_stride..r * args.row_stride + args.vocab];
            if let Some(id) = row.iter().position(|v| v.is_nan() || *v == f64::INFINITY) {
                let value = if row[id].is_nan() { f32::NAN } else { f32::INFINITY };
                return Pick::Broken { id: id as u32, value }.word();
            }
            if row.iter().all(|v| *v == f64::NEG_INFINITY) {
                return Pick::Masked.word();
            }
            let mut best = 0;
            for (i, v) in row.iter().enumerate() {
                if *v > row[best] {
                    best = i;
                }
            }
            Pick::Id(best as u32).word()
        })
        .collect()
}

/// Shape of a reference attention: Q `[batch, heads_q, seq_q, dim]`, K/V `[batch, heads_kv, seq_kv, dim]`,
/// all packed BHSD. Exhaustive on purpose (built as a literal by tests and downstream checks): the
/// reference's shape is complete, and six named dims read better than six positional ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Batch.
    pub batch: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads (divides `heads_q`).
    pub heads_kv: usize,
    /// Query length.
    pub seq_q: usize,
    /// Key/value length.
    pub seq_kv: usize,
    /// Head dim.
    pub dim: usize,
}

/// Attention in f64: `softmax(scale · Q Kᵀ masked) V` with query head `h` reading K/V head
/// `h / (heads_q / heads_kv)`. Returns `(o, stats)`: O packed `[b, h_q, s_q, d]`, stats the natural-log
/// log-sum-exp of each scaled, masked score row `[b, h_q, s_q]`.
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    shape: AttentionShape,
    scale: f64,
    mask: crate::Mask,
) -> (Vec<f64>, Vec<f64>) {
    let AttentionShape { batch, heads_q, heads_kv, seq_q, seq_kv, dim } = shape;
    assert!(heads_kv > 0 && heads_q % heads_kv == 0, "reference attention: heads");
    assert_eq!(q.len(), batch * heads_q * seq_q * dim, "reference attention: q length");
    assert_eq!(k.len(), batch * heads_kv * seq_kv * dim, "reference attention: k length");
    assert_eq!(v.len(), k.len(), "reference attention: v length");
    let group = heads_q / heads_kv;
    let mut o = vec![0.0; q.len()];
    let mut stats = vec![0.0; batch * heads_q * seq_q];
    let mut scores = vec![0.0; seq_kv];
    for b in 0..batch {
        for h in 0..heads_q {
            let kv = (b * heads_kv + h / group) * seq_kv * dim;
            for i in 0..seq_q {
                let qi = &q[((b * heads_q + h) * seq_q + i) * dim..][..dim];
                let mut max = f64::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = if mask.keeps(i, j, seq_q, seq_kv) {
                        let kj = &k[kv + j * dim..][..dim];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    } else {
                        f64::NEG_INFINITY
                    };
                    max = max.max(*s);
                }
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let row = (b * heads_q + h) * seq_q + i;
                stats[row] = max + sum.ln();
                let oi = &mut o[row * dim..][..dim];
                for (j, p) in scores.iter().enumerate() {
                    let vj = &v[kv + j * dim..][..dim];
                    for (out, x) in oi.iter_mut().zip(vj) {
                        *out += p / sum * x;
                    }
                }
            }
        }
    }
    (o, stats)
}

/// Ragged (THD) attention in f64: Q `[total, heads_q, dim]`, K and V `[total, heads_kv, dim]` packed
/// token-major, sequence `i` the `lens[i]` tokens after those of the sequences before it, attending to
/// its own keys only ([`attention`] per sequence). Returns O `[total, heads_q, dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_ragged(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    lens: &[usize],
    (heads_q, heads_kv, dim): (usize, usize, usize),
    scale: f64,
    mask: crate::Mask,
) -> Vec<f64> {
    use crate::ops::sdpa::Layout;
    let total: usize = lens.iter().sum();
    assert_eq!(q.len(), total * heads_q * dim, "reference ragged attention: q length");
    assert_eq!(k.len(), total * heads_kv * dim, "reference ragged attention: k length");
    assert_eq!(v.len(), k.len(), "reference ragged attention: v length");
    let mut o = Vec::with_capacity(q.len());
    let mut start = 0;
    for &n in lens {
        let slice = |x: &[f64], h: usize| {
            backward::to_bhsd(&x[start * h * dim..(start + n) * h * dim], Layout::Bshd, 1, h, n, dim)
        };
        let shape = AttentionShape { batch: 1, heads_q, heads_kv, seq_q: n, seq_kv: n, dim };
        let (seq_o, _) =
            attention(&slice(q, heads_q), &slice(k, heads_kv), &slice(v, heads_kv), shape, scale, mask);
        o.extend(backward::from_bhsd(&seq_o, Layout::Bshd, 1, heads_q, n, dim));
        start += n;
    }
    o
}

/// Named tolerances per dtype: relative L2 error `‖out − ref‖ / ‖ref‖`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Tolerance {
    /// Maximum relative L2 error.
    pub rel_l2: f64,
}

impl Tolerance {
    /// At most `rel_l2` relative L2 error.
    pub const fn rel_l2(rel_l2: f64) -> Self {
        Tolerance { rel_l2 }
    }
}

/// bf16 outputs: 8 bits of mantissa, a rounding of ~2e-3 per element; the bound.
pub const BF16_TOL: Tolerance = Tolerance { rel_l2: 1e-2 };
/// f16 outputs: 11 bits of mantissa.
pub const F16_TOL: Tolerance = Tolerance { rel_l2: 2e-3 };
/// f32 outputs with f32 compute.
pub const F32_TOL: Tolerance = Tolerance { rel_l2: 1e-5 };
/// FP8 E4M3 outputs: 4 bits of mantissa (3 stored), a rounding of up to 1/16 per element, about 2%
/// in relative L2 over many elements.
pub const F8E4M3_TOL: Tolerance = Tolerance { rel_l2: 5e-2 };
/// FP8 E5M2 outputs: 3 bits of mantissa (2 stored), twice E4M3's rounding.
pub const F8E5M2_TOL: Tolerance = Tolerance { rel_l2: 1e-1 };

/// The tolerance for outputs of `dtype`.
pub fn tolerance(dtype: DataType) -> Tolerance {
    match dtype {
        DataType::BF16 => BF16_TOL,
        DataType::F16 => F16_TOL,
        DataType::F8E4M3 => F8E4M3_TOL,
        DataType::F8E5M2 => F8E5M2_TOL,
        _ => F32_TOL,
    }
}

/// How an output compares with its reference.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Comparison {
    /// `‖out − ref‖ / ‖ref‖`.
    pub rel_l2: f64,
    /// Largest `|out − ref|`.
    pub max_abs: f64,
    /// Index of the largest difference.
    pub worst_index: usize,
    /// Elements that are NaN or infinite (unwritten poisoned elements show here).
    pub non_finite: usize,
    /// Elements compared.
    pub len: usize,
}

impl Comparison {
    /// True when every element is finite and the relative error is within `tol`.
    pub fn passes(&self, tol: Tolerance) -> bool {
        self.non_finite == 0 && self.rel_l2 <= tol.rel_l2 && self.rel_l2.is_finite()
    }
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rel_l2 {:.3e}, max |diff| {:.3e} at {}, {} non-finite of {}",
            self.rel_l2, self.max_abs, self.worst_index, self.non_finite, self.len
        )
    }
}

/// Compares `out` with `reference` (lengths must match).
pub fn compare<T: Element>(out: &[T], reference: &[f64]) -> Comparison {
    assert_eq!(out.len(), reference.len(), "compare: lengths differ");
    let (mut diff2, mut ref2, mut max_abs, mut worst, mut non_finite) = (0.0, 0.0, 0.0, 0, 0);
    for (i, (o, r)) in out.iter().zip(reference).enumerate() {
        let o = o.to_f64();
        if !o.is_finite() {
            non_finite += 1;
            continue;
        }
        let d = (o - r).abs();
        diff2 += d * d;
        ref2 += r * r;
        if d > max_abs {
            max_abs = d;
            worst = i;
        }
    }
    let rel_l2 = if ref2 > 0.0 { (diff2 / ref2).sqrt() } else { diff2.sqrt() };
    Comparison { rel_l2, max_abs, worst_index: worst, non_finite, len: out.len() }
}

/// Deterministic pseudo-random values in `[-1, 1)` (SplitMix64), never exactly zero.
pub fn random_values(seed: u64, n: usize) -> Vec<f64> {
    random_iter(seed).take(n).collect()
}

/// Shuffles `items` in place, seeded (Fisher-Yates over [`random_iter`]`(seed)`): the same order on
/// every machine, and any prefix of the result is a uniform sample.
pub fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut draw = random_iter(seed);
    for i in (1..items.len()).rev() {
        let u = draw.next().expect("random_iter is endless") * 0.5 + 0.5; // [0, 1)
        items.swap(i, ((u * (i + 1) as f64) as usize).min(i));
    }
}

/// The endless sequence [`random_values`] takes its values from (no buffer of f64s for large tensors).
pub fn random_iter(seed: u64) -> impl Iterator<Item = f64> {
    random_iter_from(seed, 0)
}

/// [`random_iter`] from its value `skip` on, without drawing the ones before (SplitMix64's state after
/// `skip` draws is `seed + skip·γ`): a shard of a large random tensor is drawn alone.
pub fn random_iter_from(seed: u64, skip: u64) -> impl Iterator<Item = f64> {
    let mut state = seed.wrapping_add(skip.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    std::iter::repeat_with(move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let v = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        if v == 0.0 {
            0.5
        } else {
            v
        }
    })
}

/// Rounds f64 values to `T` (what the GPU will actually see).
pub fn to_elements<T: Element>(values: &[f64]) -> Vec<T> {
    values.iter().map(|&v| T::from_f64(v)).collect()
}

/// Rows `rows` (indices into the `batch · m` rows of D) of the matmul `A · B` in f64, with A and B laid
/// out as `args` says; `rows.len() · n` values, row-major. Sampling rows keeps references of large shapes
/// cheap.
pub fn matmul_rows(args: &crate::MatmulArgs, a: &[f64], b: &[f64], rows: &[usize]) -> Vec<f64> {
    let (m, n, k) = (args.m(), args.n(), args.k());
    let ([sa0, sa1, sa2], [sb0, sb1, sb2]) = (args.a.strides, args.b.strides);
    assert!(a.len() >= args.a.min_elements().unwrap_or(usize::MAX), "reference matmul: A length");
    assert!(b.len() >= args.b.min_elements().unwrap_or(usize::MAX), "reference matmul: B length");
    let mut out = vec![0.0; rows.len() * n];
    for (row, d) in rows.iter().zip(out.chunks_exact_mut(n)) {
        let (batch, i) = (row / m, row % m);
        assert!(batch < args.batch(), "reference matmul: row {row} out of range");
        let a_row = batch * sa0 + i * sa1;
        let b_mat = if args.b.dims[0] == 1 { 0 } else { batch * sb0 };
        if sb1 == 1 {
            // Column-major B (a transposed weight): each output is a dot product of contiguous vectors.
            for (j, dj) in d.iter_mut().enumerate() {
                let col = b_mat + j * sb2;
                *dj = (0..k).map(|p| a[a_row + p * sa2] * b[col + p]).sum();
            }
        } else {
            for p in 0..k {
                let (ap, b_row) = (a[a_row + p * sa2], b_mat + p * sb1);
                for (j, dj) in d.iter_mut().enumerate() {
                    *dj += ap * b[b_row + j * sb2];
                }
            }
        }
    }
    out
}

/// An activation in f64.
pub fn activation(act: crate::Activation, x: f64) -> f64 {
    use crate::Activation as A;
    match act {
        A::Silu => x / (1.0 + (-x).exp()),
        A::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        A::GeluTanh => {
            let beta = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (beta * (x + 0.044715 * x * x * x)).tanh())
        }
        A::Relu => x.max(0.0),
    }
}

/// The error function to about 1e-15 relative: a series of positive terms below 2, the continued
/// fraction of erfc above.
fn erf(x: f64) -> f64 {
    let ax = x.abs();
    let v = if ax < 2.0 {
        // erf(x) = 2/√π e^(-x²) Σ 2^j x^(2j+1) / (1·3·…·(2j+1)): no cancellation, ~30 terms at 2.
        let (mut term, mut sum, mut j) = (ax, ax, 0.0);
        while term > 1e-17 * sum {
            j += 1.0;
            term *= 2.0 * ax * ax / (2.0 * j + 1.0);
            sum += term;
        }
        sum * (-ax * ax).exp() * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(x) = e^(-x²)/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...)))), evaluated from the tail;
        // 80 terms are exact to f64 from 2 up.
        let mut t = ax;
        for j in (1..=80).rev() {
            t = ax + (j as f64 / 2.0) / t;
        }
        1.0 - (-ax * ax).exp() / (std::f64::consts::PI.sqrt() * t)
    };
    v.copysign(x)
}

/// An epilogue in f64 on rows of `A · B` (`product` as [`matmul_rows`] returns it): `+ bias [n]`, the
/// activation, `⊙ gate`, `+ residual`, with the gate U and residual R packed `[batch · m, n]` and read at
/// `rows`.
pub fn matmul_epilogue(
    epilogue: crate::Epilogue,
    product: &[f64],
    n: usize,
    rows: &[usize],
    bias: Option<&[f64]>,
    gate: Option<&[f64]>,
    residual: Option<&[f64]>,
) -> Vec<f64> {
    assert_eq!(product.len(), rows.len() * n, "reference matmul epilogue: product length");
    for (step, wanted, given) in [
        ("bias", epilogue.bias, bias.is_some()),
        ("gate", epilogue.gate, gate.is_some()),
        ("residual", epilogue.residual, residual.is_some()),
    ] {
        assert_eq!(wanted, given, "reference matmul epilogue: {step} input");
    }
    let mut out = product.to_vec();
    for (&row, d) in rows.iter().zip(out.chunks_exact_mut(n)) {
        for (j, v) in d.iter_mut().enumerate() {
            if let Some(bias) = bias {
                *v += bias[j];
            }
            if let Some(act) = epilogue.activation {
                *v = activation(act, *v);
            }
            if let Some(u) = gate {
                *v *= u[row * n + j];
            }
            if let Some(r) = residual {
                *v += r[row * n + j];
            }
        }
    }
    out
}

/// `D = epilogue(A · B)` in f64, every row: `[batch · m, n]` row-major.
pub fn matmul(
    args: &crate::MatmulArgs,
    epilogue: crate::Epilogue,
    a: &[f64],
    b: &[f64],
    bias: Option<&[f64]>,
    gate: Option<&[f64]>,
    residual: Option<&[f64]>,
) -> Vec<f64> {
    let rows: Vec<usize> = (0..args.batch() * args.m()).collect();
    let product = matmul_rows(args, a, b, &rows);
    matmul_epilogue(epilogue, &product, args.n(), &rows, bias, gate, residual)
}

/// The decode GEMV's one-token fused forms in f64: x (`[k]`) normalized by [`rms_norm`] with
/// `norm = (weight [k], ε)` (not rounded: the prologue multiplies the normalized row as it is), then
/// the product with W (row-major `[n, k]`, a Linear weight); with `w_up` (`[n, k]`) the gate step's
/// multiplier is `x · W_upᵀ` rounded to `T` (the up projection's output); then the epilogue (`bias`
/// `[n]`, `residual` `[n]`).
pub fn decode_fused<T: Element>(
    epilogue: crate::Epilogue,
    x: &[f64],
    w: &[f64],
    norm: Option<(&[f64], f64)>,
    w_up: Option<&[f64]>,
    bias: Option<&[f64]>,
    residual: Option<&[f64]>,
) -> Vec<f64> {
    let k = x.len();
    let n = w.len() / k;
    let round = |v: Vec<f64>| -> Vec<f64> { to_elements::<T>(&v).iter().map(|e| e.to_f64()).collect() };
    let x = match norm {
        // The normalized row unrounded, as the GEMV's prologue multiplies it.
        Some((weight, eps)) => rms_norm(x, weight, 1, k, eps).0,
        None => x.to_vec(),
    };
    let args = crate::MatmulArgs::linear(1, k, n);
    let product = |w: &[f64]| matmul_rows(&args, &x, w, &[0]);
    let up = w_up.map(|w| round(product(w)));
    matmul_epilogue(epilogue, &product(w), n, &[0], bias, up.as_deref(), residual)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn the_reference_argmax_ties_low_and_flags_unsampleable_rows() {
        let (ni, pi, nan) = (f64::NEG_INFINITY, f64::INFINITY, f64::NAN);
        let rows = [
            vec![0.5, 2.0, 2.0, 1.9],
            vec![ni, -5.0, ni, -5.0],
            vec![ni, ni, ni, ni],
            vec![1.0, nan, pi, 3.0],
            vec![pi, nan, 0.0, 0.0],
            vec![-0.0, 0.0, -1.0, ni],
        ];
        let flat: Vec<f64> = rows.concat();
        let words = argmax_rows(&flat, crate::ArgmaxArgs::new(rows.len(), 4));
        let picks: Vec<crate::Pick> = words.into_iter().map(crate::Pick::from_word).collect();
        assert_eq!(picks[0], crate::Pick::Id(1));
        assert_eq!(picks[1], crate::Pick::Id(1));
        assert_eq!(picks[2], crate::Pick::Masked);
        assert!(matches!(picks[3], crate::Pick::Broken { id: 1, value } if value.is_nan()), "{:?}", picks[3]);
        assert_eq!(picks[4], crate::Pick::Broken { id: 0, value: f32::INFINITY });
        assert_eq!(picks[5], crate::Pick::Id(0), "-0 equals +0: the lower id");
        // A stride skips the elements between rows.
        let strided = [1.0, 3.0, 99.0, 4.0, 2.0, 99.0];
        let w = argmax_rows(&strided, crate::ArgmaxArgs::new(2, 2).with_row_stride(3));
        assert_eq!(w, vec![1, 0]);
    }

    #[test]
    fn ragged_attention_is_each_sequence_alone() {
        // Two sequences (3 and 1 tokens), 4/2 heads of 8: each sequence's output is its own padded
        // attention's, and the single token sees only itself (its output is its V head).
        let (hq, hkv, d, lens) = (4, 2, 8, [3usize, 1]);
        let q = random_values(1, 4 * hq * d);
        let k = random_values(2, 4 * hkv * d);
        let v = random_values(3, 4 * hkv * d);
        let o = attention_ragged(&q, &k, &v, &lens, (hq, hkv, d), 0.3, crate::Mask::CausalTopLeft);
        let shape = AttentionShape { batch: 1, heads_q: hq, heads_kv: hkv, seq_q: 3, seq_kv: 3, dim: d };
        let bhsd = |x: &[f64], h| backward::to_bhsd(x, crate::Layout::Bshd, 1, h, 3, d);
        let (first, _) = attention(
            &bhsd(&q[..3 * hq * d], hq),
            &bhsd(&k[..3 * hkv * d], hkv),
            &bhsd(&v[..3 * hkv * d], hkv),
            shape,
            0.3,
            crate::Mask::CausalTopLeft,
        );
        let first = backward::from_bhsd(&first, crate::Layout::Bshd, 1, hq, 3, d);
        assert_eq!(&o[..3 * hq * d], &first[..]);
        let last_v = &v[3 * hkv * d..];
        for h in 0..hq {
            let kv_head = h / (hq / hkv);
            for (a, b) in o[3 * hq * d + h * d..][..d].iter().zip(&last_v[kv_head * d..][..d]) {
                assert!((a - b).abs() < 1e-15);
            }
        }
    }

    #[test]
    fn rms_norm_by_hand() {
        // Row [3, 4]: mean square 12.5, inverse RMS 1/sqrt(12.5).
        let (y, inv) = rms_norm(&[3.0, 4.0, 0.0, 2.0], &[1.0, 2.0], 2, 2, 0.0);
        let r = 1.0 / 12.5f64.sqrt();
        assert!((inv[0] - r).abs() < 1e-15 && (inv[1] - 1.0 / 2.0f64.sqrt()).abs() < 1e-15);
        assert!((y[0] - 3.0 * r).abs() < 1e-15 && (y[1] - 8.0 * r).abs() < 1e-15);
        assert_eq!(y[2], 0.0);
        // Epsilon matters for a zero row.
        let (y, inv) = rms_norm(&[0.0, 0.0], &[1.0, 1.0], 1, 2, 1e-4);
        assert_eq!(y, vec![0.0, 0.0]);
        assert!((inv[0] - 100.0).abs() < 1e-9);
    }

    #[test]
    fn rms_norm_is_scale_invariant() {
        let x = random_values(1, 64);
        let w = random_values(2, 16);
        let (y1, _) = rms_norm(&x, &w, 4, 16, 0.0);
        let x1000: Vec<f64> = x.iter().map(|v| v * 1000.0).collect();
        let (y2, _) = rms_norm(&x1000, &w, 4, 16, 0.0);
        for (a, b) in y1.iter().zip(&y2) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn attention_by_hand() {
        // One head, two keys: scores 2·s·(q·k) with q = [1, 0], k0 = [1, 0], k1 = [0, 1].
        let shape = AttentionShape { batch: 1, heads_q: 1, heads_kv: 1, seq_q: 2, seq_kv: 2, dim: 2 };
        let q = [1.0, 0.0, 1.0, 0.0];
        let k = [1.0, 0.0, 0.0, 1.0];
        let v = [1.0, 2.0, 3.0, 4.0];
        let (o, stats) = attention(&q, &k, &v, shape, 0.5, crate::Mask::None);
        // Scores [0.5, 0]: p0 = e^0.5 / (e^0.5 + 1).
        let p0 = 0.5f64.exp() / (0.5f64.exp() + 1.0);
        assert!(
            (o[0] - (p0 + 3.0 * (1.0 - p0))).abs() < 1e-12
                && (o[1] - (2.0 * p0 + 4.0 * (1.0 - p0))).abs() < 1e-12
        );
        assert!((stats[0] - (0.5f64.exp() + 1.0).ln()).abs() < 1e-12);
        // Causal: the first query sees only the first key.
        let (o, stats) = attention(&q, &k, &v, shape, 0.5, crate::Mask::CausalTopLeft);
        assert_eq!(&o[..2], &[1.0, 2.0]);
        assert!((stats[0] - 0.5).abs() < 1e-12);
        assert!((o[2] - (p0 + 3.0 * (1.0 - p0))).abs() < 1e-12);
    }

    #[test]
    fn attention_groups_query_heads_onto_kv_heads() {
        // Four query heads on two K/V heads equal four query heads on K/V repeated per group.
        let shape = AttentionShape { batch: 2, heads_q: 4, heads_kv: 2, seq_q: 3, seq_kv: 5, dim: 8 };
        let q = random_values(1, 2 * 4 * 3 * 8);
        let k = random_values(2, 2 * 2 * 5 * 8);
        let v = random_values(3, 2 * 2 * 5 * 8);
        let repeat =
            |x: &[f64]| -> Vec<f64> { x.chunks(5 * 8).flat_map(|head| [head, head].concat()).collect() };
        let full = AttentionShape { heads_kv: 4, ..shape };
        for mask in [crate::Mask::None, crate::Mask::CausalBottomRight] {
            let (a, sa) = attention(&q, &k, &v, shape, 0.3, mask);
            let (b, sb) = attention(&q, &repeat(&k), &repeat(&v), full, 0.3, mask);
            assert_eq!(a, b);
            assert_eq!(sa, sb);
        }
    }

    #[test]
    fn compare_detects_errors_and_nan() {
        let r = vec![1.0, -2.0, 3.0];
        let exact: Vec<bf16> = to_elements(&r);
        let c = compare(&exact, &r);
        assert!(c.passes(BF16_TOL) && c.rel_l2 == 0.0, "{c}");
        let off: Vec<bf16> = to_elements(&[1.0, -2.0, 3.5]);
        let c = compare(&off, &r);
        assert!(!c.passes(BF16_TOL) && c.worst_index == 2 && (c.max_abs - 0.5).abs() < 1e-12, "{c}");
        let nan = vec![bf16::NAN, bf16::from_f64(-2.0), bf16::from_f64(3.0)];
        let c = compare(&nan, &r);
        assert_eq!(c.non_finite, 1);
        assert!(!c.passes(BF16_TOL));
    }

    #[test]
    fn shuffle_is_a_seeded_permutation_drawn_as_the_loops_it_replaced() {
        let mut v: Vec<u32> = (0..1000).collect();
        shuffle(&mut v, 7);
        // The loop the paged tests and examples wrote before, on the same stream.
        let mut w: Vec<u32> = (0..1000).collect();
        let mut r = random_iter(7);
        for i in (1..w.len()).rev() {
            let j = ((r.next().unwrap() * 0.5 + 0.5) * (i + 1) as f64) as usize;
            w.swap(i, j.min(i));
        }
        assert_eq!(v, w);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>(), "a permutation");
        let mut again: Vec<u32> = (0..1000).collect();
        shuffle(&mut again, 7);
        assert_eq!(v, again, "the same seed, the same order");
        shuffle(&mut [0u8; 0], 1);
        shuffle(&mut [5u8], 1);
    }

    #[test]
    fn random_values_are_reproducible_nonzero_and_spread() {
        let a = random_values(7, 10_000);
        assert_eq!(a, random_values(7, 10_000));
        assert_ne!(a, random_values(8, 10_000));
        assert!(a.iter().all(|v| *v != 0.0 && (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        // Skipping ahead lands on the same values as drawing through.
        for skip in [0, 1, 4095, 9_999] {
            let tail: Vec<f64> = random_iter_from(7, skip as u64).take(10_000 - skip).collect();
            assert_eq!(tail, a[skip..], "skip {skip}");
        }
    }
}
