//! f64 CPU references for the backward pass, the training loss and the optimizer step, each next to
//! the small forward it differentiates where [`super`] has none. The tests at the bottom check every
//! gradient against central finite differences of its forward on tiny shapes.
//!
//! Conventions: row-major packed tensors; `dy` is the gradient of a scalar loss with respect to the
//! forward's output; a gradient has the shape of what it differentiates.

use crate::{Layout, Mask};

/// RMSNorm backward of `y = x · inv_rms · scale` over `[tokens, hidden]`, from the forward's saved
/// `inv_rms` (one per token): returns `(dx, dscale)`. With `d_residual`, it is added to `dx` (the
/// gradient that reaches a pre-norm residual stream along both paths, norm and skip).
pub fn rms_norm_backward(
    dy: &[f64],
    x: &[f64],
    scale: &[f64],
    inv_rms: &[f64],
    tokens: usize,
    hidden: usize,
    d_residual: Option<&[f64]>,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(x.len(), tokens * hidden, "reference rms_norm_backward: x length");
    assert_eq!(dy.len(), x.len(), "reference rms_norm_backward: dy length");
    assert_eq!(scale.len(), hidden, "reference rms_norm_backward: scale length");
    assert_eq!(inv_rms.len(), tokens, "reference rms_norm_backward: inv_rms length");
    if let Some(r) = d_residual {
        assert_eq!(r.len(), x.len(), "reference rms_norm_backward: d_residual length");
    }
    let mut dx = vec![0.0; x.len()];
    let mut dscale = vec![0.0; hidden];
    for (t, &r) in inv_rms.iter().enumerate() {
        let row = t * hidden..(t + 1) * hidden;
        let (xr, dyr) = (&x[row.clone()], &dy[row.clone()]);
        // d/dx_i of x_j · r: r·δ_ij − x_j · r³ · x_i / hidden.
        let dot: f64 = (0..hidden).map(|j| dyr[j] * scale[j] * xr[j]).sum();
        for i in 0..hidden {
            dx[row.start + i] = r * dyr[i] * scale[i] - r * r * r * xr[i] * dot / hidden as f64;
            dscale[i] += dyr[i] * xr[i] * r;
        }
    }
    if let Some(res) = d_residual {
        dx.iter_mut().zip(res).for_each(|(d, r)| *d += r);
    }
    (dx, dscale)
}

/// Reorders a `[b, h, s, d]` tensor stored in `layout` into packed BHSD.
pub fn to_bhsd(x: &[f64], layout: Layout, batch: usize, heads: usize, seq: usize, dim: usize) -> Vec<f64> {
    let st = layout.strides(heads, seq, dim);
    let mut out = Vec::with_capacity(batch * heads * seq * dim);
    for b in 0..batch {
        for h in 0..heads {
            for s in 0..seq {
                let at = b * st[0] + h * st[1] + s * st[2];
                out.extend_from_slice(&x[at..at + dim]);
            }
        }
    }
    out
}

/// The inverse of [`to_bhsd`]: packed BHSD into `layout`.
pub fn from_bhsd(x: &[f64], layout: Layout, batch: usize, heads: usize, seq: usize, dim: usize) -> Vec<f64> {
    assert_eq!(x.len(), batch * heads * seq * dim, "reference from_bhsd: length");
    let st = layout.strides(heads, seq, dim);
    let mut out = vec![0.0; x.len()];
    for (i, row) in x.chunks_exact(dim).enumerate() {
        let (s, h, b) = (i % seq, (i / seq) % heads, i / (seq * heads));
        let at = b * st[0] + h * st[1] + s * st[2];
        out[at..at + dim].copy_from_slice(row);
    }
    out
}

/// Attention backward: `(dq, dk, dv)` from `d_o`, Q, K, V, the forward's O and its log-sum-exp
/// `stats` (`[b, h_q, s_q]`, as [`super::attention`] returns them), in the forward's `scale` and
/// `mask`. Q, O, dO and dQ are `[b, h_q, s_q, d]`, K, V, dK, dV `[b, h_kv, s_kv, d]`, all stored in
/// `layout`; query head `h` reads K/V head `h / (h_q / h_kv)`, so dK and dV sum over each group.
///
/// With `P = exp(scale · QKᵀ − lse)` (masked entries 0): `dV = Pᵀ dO`, `dP = dO Vᵀ`,
/// `dS = P ⊙ (dP − rowsum(dO ⊙ O))`, `dQ = scale · dS K`, `dK = scale · dSᵀ Q`. A row whose stats are
/// not finite (every key masked) contributes nothing.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_backward(
    d_o: &[f64],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    o: &[f64],
    stats: &[f64],
    shape: super::AttentionShape,
    scale: f64,
    mask: Mask,
    layout: Layout,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let super::AttentionShape { batch, heads_q, heads_kv, seq_q, seq_kv, dim } = shape;
    assert!(heads_kv > 0 && heads_q % heads_kv == 0, "reference sdpa_backward: heads");
    let nq = batch * heads_q * seq_q * dim;
    let nkv = batch * heads_kv * seq_kv * dim;
    for (name, t, n) in [("q", q, nq), ("o", o, nq), ("d_o", d_o, nq), ("k", k, nkv), ("v", v, nkv)] {
        assert_eq!(t.len(), n, "reference sdpa_backward: {name} length");
    }
    assert_eq!(stats.len(), batch * heads_q * seq_q, "reference sdpa_backward: stats length");
    let packed_q = |t: &[f64]| to_bhsd(t, layout, batch, heads_q, seq_q, dim);
    let packed_kv = |t: &[f64]| to_bhsd(t, layout, batch, heads_kv, seq_kv, dim);
    let (q, o, d_o, k, v) = (packed_q(q), packed_q(o), packed_q(d_o), packed_kv(k), packed_kv(v));
    let (mut dq, mut dk, mut dv) = (vec![0.0; nq], vec![0.0; nkv], vec![0.0; nkv]);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let group = heads_q / heads_kv;
    for b in 0..batch {
        for h in 0..heads_q {
            let kv = (b * heads_kv + h / group) * seq_kv * dim;
            for i in 0..seq_q {
                let row = (b * heads_q + h) * seq_q + i;
                let lse = stats[row];
                if !lse.is_finite() {
                    continue;
                }
                let qi = &q[row * dim..][..dim];
                let doi = &d_o[row * dim..][..dim];
                let delta = dot(doi, &o[row * dim..][..dim]);
                for j in (0..seq_kv).filter(|&j| mask.keeps(i, j, seq_q, seq_kv)) {
                    let (kj, vj) = (&k[kv + j * dim..][..dim], &v[kv + j * dim..][..dim]);
                    let p = (scale * dot(qi, kj) - lse).exp();
                    let ds = p * (dot(doi, vj) - delta);
                    for e in 0..dim {
                        dv[kv + j * dim + e] += p * doi[e];
                        dq[row * dim + e] += scale * ds * kj[e];
                        dk[kv + j * dim + e] += scale * ds * qi[e];
                    }
                }
            }
        }
    }
    (
        from_bhsd(&dq, layout, batch, heads_q, seq_q, dim),
        from_bhsd(&dk, layout, batch, heads_kv, seq_kv, dim),
        from_bhsd(&dv, layout, batch, heads_kv, seq_kv, dim),
    )
}

/// A linear layer `y = x Wᵀ` with `x [tokens, in]` and `W [out, in]` (nn.Linear's layout):
/// `y [tokens, out]`.
pub fn linear(x: &[f64], w: &[f64], tokens: usize, inp: usize, out: usize) -> Vec<f64> {
    assert_eq!(x.len(), tokens * inp, "reference linear: x length");
    assert_eq!(w.len(), out * inp, "reference linear: w length");
    let mut y = vec![0.0; tokens * out];
    for t in 0..tokens {
        for o in 0..out {
            y[t * out + o] = (0..inp).map(|i| x[t * inp + i] * w[o * inp + i]).sum();
        }
    }
    y
}

/// Data gradient of [`linear`]: `dx = dy · W`, `[tokens, in]`.
pub fn linear_backward_data(dy: &[f64], w: &[f64], tokens: usize, inp: usize, out: usize) -> Vec<f64> {
    assert_eq!(dy.len(), tokens * out, "reference linear_backward_data: dy length");
    assert_eq!(w.len(), out * inp, "reference linear_backward_data: w length");
    let mut dx = vec![0.0; tokens * inp];
    for t in 0..tokens {
        for o in 0..out {
            let g = dy[t * out + o];
            for i in 0..inp {
                dx[t * inp + i] += g * w[o * inp + i];
            }
        }
    }
    dx
}

/// Weight gradient of [`linear`]: `dW = dyᵀ · x`, `[out, in]`, added to `accumulate` when given
/// (gradient accumulation over micro-batches).
pub fn linear_backward_weight(
    dy: &[f64],
    x: &[f64],
    tokens: usize,
    inp: usize,
    out: usize,
    accumulate: Option<&[f64]>,
) -> Vec<f64> {
    assert_eq!(dy.len(), tokens * out, "reference linear_backward_weight: dy length");
    assert_eq!(x.len(), tokens * inp, "reference linear_backward_weight: x length");
    let mut dw = match accumulate {
        Some(a) => {
            assert_eq!(a.len(), out * inp, "reference linear_backward_weight: accumulator length");
            a.to_vec()
        }
        None => vec![0.0; out * inp],
    };
    for t in 0..tokens {
        for o in 0..out {
            let g = dy[t * out + o];
            for i in 0..inp {
                dw[o * inp + i] += g * x[t * inp + i];
            }
        }
    }
    dw
}

/// Bias gradient of `y = x Wᵀ + bias`: the column sums of `dy [tokens, out]`.
pub fn bias_grad(dy: &[f64], tokens: usize, out: usize) -> Vec<f64> {
    assert_eq!(dy.len(), tokens * out, "reference bias_grad: dy length");
    let mut db = vec![0.0; out];
    for row in dy.chunks_exact(out) {
        db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
    }
    db
}

/// SwiGLU's gate: `silu(gate) ⊙ up`, elementwise.
pub fn swiglu(gate: &[f64], up: &[f64]) -> Vec<f64> {
    assert_eq!(gate.len(), up.len(), "reference swiglu: lengths");
    gate.iter().zip(up).map(|(&g, &u)| super::activation(crate::Activation::Silu, g) * u).collect()
}

/// Backward of [`swiglu`]: `(d_gate, d_up)` from `d_act`, with `silu'(g) = σ(g)(1 + g(1 − σ(g)))`.
pub fn swiglu_backward(d_act: &[f64], gate: &[f64], up: &[f64]) -> (Vec<f64>, Vec<f64>) {
    assert!(d_act.len() == gate.len() && gate.len() == up.len(), "reference swiglu_backward: lengths");
    let mut d_gate = Vec::with_capacity(gate.len());
    let mut d_up = Vec::with_capacity(gate.len());
    for ((&d, &g), &u) in d_act.iter().zip(gate).zip(up) {
        let s = 1.0 / (1.0 + (-g).exp());
        d_gate.push(d * u * s * (1.0 + g * (1.0 - s)));
        d_up.push(d * g * s);
    }
    (d_gate, d_up)
}

/// Shape of a reference RoPE: `x [rows, heads, dim]` packed, row `r` at position `positions[r]`;
/// `cos`/`sin` are `[max position, dim / 2]` tables of the angles, as `RopeTables` takes them.
#[derive(Debug, Clone, Copy)]
pub struct RopeShape<'a> {
    /// Heads per row (all rotated).
    pub heads: usize,
    /// Head dim (even).
    pub dim: usize,
    /// Position of each row.
    pub positions: &'a [usize],
    /// `cos θ`, `[positions, dim / 2]`.
    pub cos: &'a [f64],
    /// `sin θ`, `[positions, dim / 2]`.
    pub sin: &'a [f64],
}

fn rotate(x: &[f64], s: RopeShape<'_>, sign: f64) -> Vec<f64> {
    let (d, half) = (s.dim, s.dim / 2);
    assert_eq!(x.len(), s.positions.len() * s.heads * d, "reference rope: x length");
    let mut y = x.to_vec();
    for (r, &pos) in s.positions.iter().enumerate() {
        for h in 0..s.heads {
            let at = (r * s.heads + h) * d;
            for j in 0..half {
                let (c, sn) = (s.cos[pos * half + j], sign * s.sin[pos * half + j]);
                let (a, b) = (x[at + j], x[at + j + half]);
                y[at + j] = a * c - b * sn;
                y[at + j + half] = b * c + a * sn;
            }
        }
    }
    y
}

/// RoPE as the fused kernel (and Hugging Face's `apply_rotary_pos_emb`) computes it: the pair
/// `(a, b) = (x_j, x_{j + dim/2})` becomes `(a cos θ_j − b sin θ_j, b cos θ_j + a sin θ_j)`.
pub fn rope(x: &[f64], shape: RopeShape<'_>) -> Vec<f64> {
    rotate(x, shape, 1.0)
}

/// Backward of [`rope`]: the transpose of a rotation is the rotation by `−θ`.
pub fn rope_backward(dy: &[f64], shape: RopeShape<'_>) -> Vec<f64> {
    rotate(dy, shape, -1.0)
}

/// Embedding lookup: row `ids[r]` of `table [vocab, hidden]` for each id.
pub fn embedding(ids: &[u32], table: &[f64], hidden: usize) -> Vec<f64> {
    ids.iter().flat_map(|&id| table[id as usize * hidden..][..hidden].iter().copied()).collect()
}

/// Backward of [`embedding`]: `dtable [vocab, hidden]`, row `ids[r]` summing `dy` row `r` (a
/// scatter-add), added to `accumulate` when given.
pub fn embedding_backward(
    ids: &[u32],
    dy: &[f64],
    vocab: usize,
    hidden: usize,
    accumulate: Option<&[f64]>,
) -> Vec<f64> {
    assert_eq!(dy.len(), ids.len() * hidden, "reference embedding_backward: dy length");
    let mut dt = accumulate.map_or_else(|| vec![0.0; vocab * hidden], <[f64]>::to_vec);
    assert_eq!(dt.len(), vocab * hidden, "reference embedding_backward: accumulator length");
    for (r, &id) in ids.iter().enumerate() {
        assert!((id as usize) < vocab, "reference embedding_backward: id {id} outside the vocabulary");
        for c in 0..hidden {
            dt[id as usize * hidden + c] += dy[r * hidden + c];
        }
    }
    dt
}

/// Cross-entropy forward over `logits [tokens, vocab]` and one target per token, as
/// `F.cross_entropy(reduction="mean", ignore_index=…)`: returns `(loss, lse)`, the mean of
/// `lse_t − logits[t, target_t]` over the tokens whose target is not `ignore_index`, and the
/// log-sum-exp of every row. With no counted token the loss is NaN (0 / 0), as in PyTorch.
pub fn cross_entropy(
    logits: &[f64],
    targets: &[i64],
    vocab: usize,
    ignore_index: Option<i64>,
) -> (f64, Vec<f64>) {
    assert_eq!(logits.len(), targets.len() * vocab, "reference cross_entropy: logits length");
    let mut lse = Vec::with_capacity(targets.len());
    let (mut sum, mut count) = (0.0, 0usize);
    for (row, &t) in logits.chunks_exact(vocab).zip(targets) {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let l = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        lse.push(l);
        if Some(t) == ignore_index {
            continue;
        }
        assert!((0..vocab as i64).contains(&t), "reference cross_entropy: target {t} outside the vocabulary");
        sum += l - row[t as usize];
        count += 1;
    }
    (sum / count as f64, lse)
}

/// Backward of [`cross_entropy`]: `dlogits = grad_loss · (softmax − onehot(target)) / count` on
/// counted rows, 0 on ignored ones (`count` is the number of counted rows).
pub fn cross_entropy_backward(
    logits: &[f64],
    targets: &[i64],
    lse: &[f64],
    vocab: usize,
    ignore_index: Option<i64>,
    grad_loss: f64,
) -> Vec<f64> {
    assert_eq!(logits.len(), targets.len() * vocab, "reference cross_entropy_backward: logits length");
    assert_eq!(lse.len(), targets.len(), "reference cross_entropy_backward: lse length");
    let count = targets.iter().filter(|&&t| Some(t) != ignore_index).count();
    let mut d = vec![0.0; logits.len()];
    for (r, &t) in targets.iter().enumerate() {
        if Some(t) == ignore_index {
            continue;
        }
        let row = &mut d[r * vocab..(r + 1) * vocab];
        for (j, g) in row.iter_mut().enumerate() {
            let p = (logits[r * vocab + j] - lse[r]).exp();
            *g = grad_loss * (p - f64::from(j as i64 == t)) / count as f64;
        }
    }
    d
}

/// AdamW's hyperparameters, as `torch.optim.AdamW` names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the bias-corrected RMS of the gradient.
    pub eps: f64,
    /// Decoupled weight decay (multiplies the parameter by `1 − lr · weight_decay`).
    pub weight_decay: f64,
}

/// One AdamW step on one tensor at step `t` (1 for the first step), in place, as
/// `torch.optim.AdamW` (`amsgrad=False`, `maximize=False`):
/// `p ← p(1 − lr·wd)`, `m ← β₁m + (1 − β₁)g`, `v ← β₂v + (1 − β₂)g²`,
/// `p ← p − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + eps)`.
pub fn adamw_step(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], t: u64, hp: AdamWParams) {
    assert!(t >= 1, "reference adamw_step: steps count from 1");
    assert!(p.len() == g.len() && g.len() == m.len() && m.len() == v.len(), "reference adamw_step: lengths");
    let bc1 = 1.0 - hp.beta1.powf(t as f64);
    let bc2_sqrt = (1.0 - hp.beta2.powf(t as f64)).sqrt();
    for i in 0..p.len() {
        p[i] *= 1.0 - hp.lr * hp.weight_decay;
        m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * g[i];
        v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * g[i] * g[i];
        p[i] -= hp.lr / bc1 * m[i] / (v[i].sqrt() / bc2_sqrt + hp.eps);
    }
}

/// The L2 norm of all gradients together, as `torch.nn.utils.clip_grad_norm_` computes it.
pub fn global_grad_norm(grads: &[&[f64]]) -> f64 {
    grads.iter().flat_map(|g| g.iter()).map(|v| v * v).sum::<f64>().sqrt()
}

/// The factor `clip_grad_norm_` multiplies every gradient by: `min(1, max_norm / (norm + 1e-6))`.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// Scales every gradient by `coefficient` in place (the clipping step).
pub fn clip_grads(grads: &mut [&mut [f64]], coefficient: f64) {
    grads.iter_mut().flat_map(|g| g.iter_mut()).for_each(|v| *v *= coefficient);
}

#[cfg(test)]
mod tests {
    use super::super::{attention, random_values, rms_norm, AttentionShape};
    use super::*;

    /// Largest `|analytic − numeric|` over every input, relative to the largest numeric gradient
    /// (at least 1): the numeric gradient of `f` at `x` by central differences of step `h`.
    fn fd_error(f: impl Fn(&[f64]) -> f64, x: &[f64], analytic: &[f64]) -> f64 {
        assert_eq!(x.len(), analytic.len(), "fd_error: lengths");
        let h = 1e-5;
        let mut xp = x.to_vec();
        let (mut worst, mut largest) = (0.0f64, 1.0f64);
        for i in 0..x.len() {
            xp[i] = x[i] + h;
            let up = f(&xp);
            xp[i] = x[i] - h;
            let down = f(&xp);
            xp[i] = x[i];
            let numeric = (up - down) / (2.0 * h);
            worst = worst.max((numeric - analytic[i]).abs());
            largest = largest.max(numeric.abs());
        }
        worst / largest
    }

    /// Central differences of f64 in these tiny shapes agree to about 1e-9; 1e-6 leaves room and
    /// still catches any wrong term (each deliberate error below is off by more than 1e-2).
    const FD_TOL: f64 = 1e-6;

    fn assert_fd(what: &str, f: impl Fn(&[f64]) -> f64, x: &[f64], analytic: &[f64]) {
        let e = fd_error(f, x, analytic);
        assert!(e < FD_TOL, "{what}: finite differences differ by {e:.3e}");
    }

    fn assert_fd_fails(what: &str, f: impl Fn(&[f64]) -> f64, x: &[f64], wrong: &[f64]) {
        let e = fd_error(f, x, wrong);
        assert!(e > 1e-3, "{what}: a wrong gradient passed the finite-difference check ({e:.3e})");
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn fd_check_catches_a_wrong_gradient() {
        // d/dx Σ x³ = 3x²: the right gradient passes, 2x² does not.
        let x = random_values(1, 5);
        let f = |x: &[f64]| x.iter().map(|v| v * v * v).sum::<f64>();
        assert_fd("cube", f, &x, &x.iter().map(|v| 3.0 * v * v).collect::<Vec<_>>());
        assert_fd_fails("cube", f, &x, &x.iter().map(|v| 2.0 * v * v).collect::<Vec<_>>());
    }

    #[test]
    fn rms_norm_backward_matches_finite_differences() {
        let (tokens, hidden, eps) = (3, 5, 1e-5);
        let x = random_values(1, tokens * hidden);
        let w = random_values(2, hidden);
        let dy = random_values(3, tokens * hidden);
        let res = random_values(4, tokens * hidden);
        let (_, inv) = rms_norm(&x, &w, tokens, hidden, eps);
        let (dx, dw) = rms_norm_backward(&dy, &x, &w, &inv, tokens, hidden, None);
        let loss_x = |x: &[f64]| dot(&dy, &rms_norm(x, &w, tokens, hidden, eps).0);
        let loss_w = |w: &[f64]| dot(&dy, &rms_norm(&x, w, tokens, hidden, eps).0);
        assert_fd("rms_norm dx", loss_x, &x, &dx);
        assert_fd("rms_norm dscale", loss_w, &w, &dw);
        // The residual variant: y = rms_norm(h) and the skip path both read h, so the loss
        // dy·rms_norm(h) + res·h has gradient dx + res.
        let (dx_res, dw_res) = rms_norm_backward(&dy, &x, &w, &inv, tokens, hidden, Some(&res));
        assert_eq!(dw_res, dw);
        assert_fd("rms_norm dx + residual", |h: &[f64]| loss_x(h) + dot(&res, h), &x, &dx_res);
        // Without the projection term (dx = r · w · dy), the check fails.
        let naive: Vec<f64> = (0..x.len()).map(|i| inv[i / hidden] * w[i % hidden] * dy[i]).collect();
        assert_fd_fails("rms_norm dx without the projection", loss_x, &x, &naive);
    }

    #[test]
    fn sdpa_backward_matches_finite_differences() {
        let base = AttentionShape { batch: 2, heads_q: 4, heads_kv: 2, seq_q: 3, seq_kv: 5, dim: 4 };
        let scale = 0.45;
        for (shape, mask, layout) in [
            (base, Mask::None, Layout::Bhsd),
            (base, Mask::CausalBottomRight, Layout::Bshd),
            (AttentionShape { seq_q: 4, seq_kv: 4, ..base }, Mask::CausalTopLeft, Layout::Bhsd),
            // Multi-query: one K/V head for every query head; top-left with s_q > s_kv.
            (AttentionShape { heads_kv: 1, seq_q: 5, seq_kv: 3, ..base }, Mask::CausalTopLeft, Layout::Bshd),
        ] {
            let nq = shape.batch * shape.heads_q * shape.seq_q * shape.dim;
            let nkv = shape.batch * shape.heads_kv * shape.seq_kv * shape.dim;
            let (q, k, v, d_o) =
                (random_values(1, nq), random_values(2, nkv), random_values(3, nkv), random_values(4, nq));
            // The forward reference is BHSD; run it on the BHSD view of each `layout` tensor.
            let (bq, bkv) = (
                |t: &[f64]| to_bhsd(t, layout, shape.batch, shape.heads_q, shape.seq_q, shape.dim),
                |t: &[f64]| to_bhsd(t, layout, shape.batch, shape.heads_kv, shape.seq_kv, shape.dim),
            );
            let fwd = |q: &[f64], k: &[f64], v: &[f64]| {
                let (o, stats) = attention(&bq(q), &bkv(k), &bkv(v), shape, scale, mask);
                (from_bhsd(&o, layout, shape.batch, shape.heads_q, shape.seq_q, shape.dim), stats)
            };
            let (o, stats) = fwd(&q, &k, &v);
            let (dq, dk, dv) = sdpa_backward(&d_o, &q, &k, &v, &o, &stats, shape, scale, mask, layout);
            let what = format!("{shape:?} {mask:?} {layout:?}");
            assert_fd(&format!("dq {what}"), |q: &[f64]| dot(&d_o, &fwd(q, &k, &v).0), &q, &dq);
            assert_fd(&format!("dk {what}"), |k: &[f64]| dot(&d_o, &fwd(&q, k, &v).0), &k, &dk);
            assert_fd(&format!("dv {what}"), |v: &[f64]| dot(&d_o, &fwd(&q, &k, v).0), &v, &dv);
            // The wrong mask gives gradients the forward does not have.
            let other = if mask == Mask::None { Mask::CausalTopLeft } else { Mask::None };
            let (wrong_dq, _, _) = sdpa_backward(&d_o, &q, &k, &v, &o, &stats, shape, scale, other, layout);
            assert_fd_fails(
                &format!("dq with {other:?}"),
                |q: &[f64]| dot(&d_o, &fwd(q, &k, &v).0),
                &q,
                &wrong_dq,
            );
        }
    }

    #[test]
    fn layouts_round_trip() {
        let x = random_values(5, 2 * 3 * 4 * 2);
        let bshd = from_bhsd(&x, Layout::Bshd, 2, 3, 4, 2);
        assert_ne!(bshd, x);
        assert_eq!(to_bhsd(&bshd, Layout::Bshd, 2, 3, 4, 2), x);
        assert_eq!(to_bhsd(&x, Layout::Bhsd, 2, 3, 4, 2), x);
    }

    #[test]
    fn linear_gradients_match_finite_differences() {
        let (tokens, inp, out) = (3, 4, 5);
        let x = random_values(1, tokens * inp);
        let w = random_values(2, out * inp);
        let dy = random_values(3, tokens * out);
        let dx = linear_backward_data(&dy, &w, tokens, inp, out);
        let dw = linear_backward_weight(&dy, &x, tokens, inp, out, None);
        assert_fd("linear dx", |x: &[f64]| dot(&dy, &linear(x, &w, tokens, inp, out)), &x, &dx);
        assert_fd("linear dw", |w: &[f64]| dot(&dy, &linear(&x, w, tokens, inp, out)), &w, &dw);
        // Accumulation adds to what is there rather than overwriting it.
        let acc = random_values(4, out * inp);
        let sum = linear_backward_weight(&dy, &x, tokens, inp, out, Some(&acc));
        assert!(sum.iter().zip(&dw).zip(&acc).all(|((s, d), a)| (s - d - a).abs() < 1e-12));
        // The untransposed product (dy · x instead of dyᵀ · x, read as [out, in]) is wrong.
        let reversed: Vec<f64> = dw.iter().rev().copied().collect();
        assert_fd_fails(
            "linear dw reversed",
            |w: &[f64]| dot(&dy, &linear(&x, w, tokens, inp, out)),
            &w,
            &reversed,
        );
        // Bias: y = x Wᵀ + b.
        let b = random_values(5, out);
        let with_bias = |b: &[f64]| {
            let y = linear(&x, &w, tokens, inp, out);
            dot(&dy, &y.iter().enumerate().map(|(i, v)| v + b[i % out]).collect::<Vec<_>>())
        };
        assert_fd("bias", with_bias, &b, &bias_grad(&dy, tokens, out));
        assert_fd_fails("bias of the first row only", with_bias, &b, &dy[..out]);
    }

    #[test]
    fn swiglu_backward_matches_finite_differences() {
        let n = 7;
        let gate: Vec<f64> = random_values(1, n).iter().map(|v| 3.0 * v).collect();
        let up = random_values(2, n);
        let d = random_values(3, n);
        let (dg, du) = swiglu_backward(&d, &gate, &up);
        assert_fd("swiglu d_gate", |g: &[f64]| dot(&d, &swiglu(g, &up)), &gate, &dg);
        assert_fd("swiglu d_up", |u: &[f64]| dot(&d, &swiglu(&gate, u)), &up, &du);
        // σ(g) · u · d alone (the derivative of silu taken as σ) is wrong.
        let wrong: Vec<f64> = (0..n).map(|i| d[i] * up[i] / (1.0 + (-gate[i]).exp())).collect();
        assert_fd_fails("swiglu d_gate as sigmoid", |g: &[f64]| dot(&d, &swiglu(g, &up)), &gate, &wrong);
    }

    #[test]
    fn rope_backward_matches_finite_differences() {
        let (heads, dim, max_pos) = (3, 6, 9);
        let half = dim / 2;
        let angle = |i: usize| (i / half) as f64 * 10f64.powf(-((2 * (i % half)) as f64) / dim as f64);
        let cos: Vec<f64> = (0..max_pos * half).map(|i| angle(i).cos()).collect();
        let sin: Vec<f64> = (0..max_pos * half).map(|i| angle(i).sin()).collect();
        let positions = [0, 4, 8, 3];
        let shape = RopeShape { heads, dim, positions: &positions, cos: &cos, sin: &sin };
        let n = positions.len() * heads * dim;
        let (x, dy) = (random_values(1, n), random_values(2, n));
        // Same convention as the fused kernel: pair (x_j, x_{j+half}), a cos − b sin first.
        let y = rope(&x, shape);
        // Row 1 (position 4), head 0, pair 1.
        let at = heads * dim + 1;
        let (a, b, c, s) = (x[at], x[at + half], cos[4 * half + 1], sin[4 * half + 1]);
        assert!((y[at] - (a * c - b * s)).abs() < 1e-15 && (y[at + half] - (b * c + a * s)).abs() < 1e-15);
        assert_fd("rope", |x: &[f64]| dot(&dy, &rope(x, shape)), &x, &rope_backward(&dy, shape));
        // Rotating the gradient by +θ (the forward again) is wrong.
        assert_fd_fails("rope by +θ", |x: &[f64]| dot(&dy, &rope(x, shape)), &x, &rope(&dy, shape));
        // And the backward undoes the forward (a rotation's transpose is its inverse).
        let back = rope_backward(&y, shape);
        assert!(back.iter().zip(&x).all(|(p, q)| (p - q).abs() < 1e-12));
    }

    #[test]
    fn embedding_backward_matches_finite_differences() {
        let (vocab, hidden) = (5, 3);
        let ids = [3, 0, 3, 4, 3];
        let table = random_values(1, vocab * hidden);
        let dy = random_values(2, ids.len() * hidden);
        let dt = embedding_backward(&ids, &dy, vocab, hidden, None);
        let loss = |t: &[f64]| dot(&dy, &embedding(&ids, t, hidden));
        assert_fd("embedding", loss, &table, &dt);
        // Row 1 and 2 are never looked up: exactly zero.
        assert!(dt[hidden..3 * hidden].iter().all(|&v| v == 0.0));
        // Overwriting instead of adding (last id wins) is wrong: id 3 occurs three times.
        let mut last = vec![0.0; vocab * hidden];
        for (r, &id) in ids.iter().enumerate() {
            last[id as usize * hidden..][..hidden].copy_from_slice(&dy[r * hidden..][..hidden]);
        }
        assert_fd_fails("embedding overwrite", loss, &table, &last);
        let acc = random_values(3, vocab * hidden);
        let sum = embedding_backward(&ids, &dy, vocab, hidden, Some(&acc));
        assert!(sum.iter().zip(&dt).zip(&acc).all(|((s, d), a)| (s - d - a).abs() < 1e-12));
    }

    #[test]
    fn cross_entropy_matches_finite_differences_and_by_hand() {
        // By hand: logits [0, ln 3] and target 1: loss ln(4) − ln(3); the ignored row counts nothing.
        let (loss, lse) = cross_entropy(&[0.0, 3f64.ln(), 5.0, 1.0], &[1, -100], 2, Some(-100));
        assert!((loss - (4f64.ln() - 3f64.ln())).abs() < 1e-15 && (lse[0] - 4f64.ln()).abs() < 1e-15);
        let (loss, _) = cross_entropy(&[1.0, 2.0], &[-100], 2, Some(-100));
        assert!(loss.is_nan(), "no counted token: 0 / 0");

        let (tokens, vocab) = (5, 7);
        let logits: Vec<f64> = random_values(1, tokens * vocab).iter().map(|v| 4.0 * v).collect();
        let targets = [3, -100, 0, 6, 2];
        let grad_loss = 0.7;
        for ignore in [Some(-100), None] {
            let targets: Vec<i64> =
                targets.iter().map(|&t| if ignore.is_none() && t < 0 { 1 } else { t }).collect();
            let (_, lse) = cross_entropy(&logits, &targets, vocab, ignore);
            let d = cross_entropy_backward(&logits, &targets, &lse, vocab, ignore, grad_loss);
            let f = |l: &[f64]| grad_loss * cross_entropy(l, &targets, vocab, ignore).0;
            assert_fd(&format!("cross_entropy ignore {ignore:?}"), f, &logits, &d);
            // Dividing by every token instead of the counted ones is wrong where a row is ignored;
            // dropping the one-hot is wrong everywhere.
            let count = targets.iter().filter(|&&t| Some(t) != ignore).count() as f64;
            let no_onehot: Vec<f64> = d
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    let t = targets[i / vocab];
                    if Some(t) != ignore && (i % vocab) as i64 == t {
                        g + grad_loss / count
                    } else {
                        *g
                    }
                })
                .collect();
            assert_fd_fails("cross_entropy without the one-hot", f, &logits, &no_onehot);
            if ignore.is_some() {
                let by_all: Vec<f64> = d.iter().map(|g| g * count / tokens as f64).collect();
                assert_fd_fails("cross_entropy over all tokens", f, &logits, &by_all);
                assert!(d[vocab..2 * vocab].iter().all(|&g| g == 0.0), "ignored row");
            }
        }
    }

    #[test]
    fn adamw_step_by_hand() {
        let hp = AdamWParams { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        // Step 1: m̂ = g and v̂ = g², so p moves by lr · g / (|g| + eps) after decaying by 1 − lr · wd.
        let (mut p, g, mut m, mut v) = (vec![2.0, -1.0], vec![0.5, -3.0], vec![0.0; 2], vec![0.0; 2]);
        adamw_step(&mut p, &g, &mut m, &mut v, 1, hp);
        let want = [2.0 * 0.999 - 0.1 * 0.5 / (0.5 + 1e-8), -0.999 + 0.1 * 3.0 / (3.0 + 1e-8)];
        assert!(p.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{p:?}");
        assert!((m[0] - 0.05).abs() < 1e-15 && (v[1] - 0.009).abs() < 1e-15);
        // Step 2 with the same gradient, by the formula written out.
        let (m2, v2): (f64, f64) = (0.9 * 0.05 + 0.1 * 0.5, 0.999 * 0.00025 + 0.001 * 0.25);
        let p0 = p[0] * 0.999;
        let want = p0 - 0.1 / (1.0 - 0.81) * m2 / (v2.sqrt() / (1.0 - 0.999f64 * 0.999).sqrt() + 1e-8);
        adamw_step(&mut p, &g, &mut m, &mut v, 2, hp);
        assert!((p[0] - want).abs() < 1e-12, "{} vs {want}", p[0]);
        // Weight decay is decoupled: a zero gradient still shrinks the parameter (and only by it).
        let (mut p, mut m, mut v) = (vec![3.0], vec![0.0], vec![0.0]);
        adamw_step(&mut p, &[0.0], &mut m, &mut v, 1, hp);
        assert!((p[0] - 3.0 * 0.999).abs() < 1e-15);
    }

    #[test]
    fn grad_norm_and_clipping_by_hand() {
        let (a, b) = (vec![3.0, 0.0], vec![4.0]);
        let norm = global_grad_norm(&[&a, &b]);
        assert_eq!(norm, 5.0);
        let c = clip_coefficient(norm, 1.0);
        assert!((c - 1.0 / (5.0 + 1e-6)).abs() < 1e-15);
        assert_eq!(clip_coefficient(norm, 10.0), 1.0, "below the limit nothing changes");
        let (mut a, mut b) = (a, b);
        clip_grads(&mut [&mut a, &mut b], c);
        assert!((global_grad_norm(&[&a, &b]) - 1.0).abs() < 1e-6);
    }
}
