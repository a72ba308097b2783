//! The training loss and its gradients in f64 on the CPU: next-token cross-entropy of the whole model
//! and the gradient of every weight tensor, written layer by layer from the op references of
//! [`cudnn_llm_ops::reference::backward`] (each checked there against finite differences of its own
//! forward), for checking the GPU trainer on small configs. The tests at the bottom check the whole
//! backward against central finite differences of [`loss`].
//!
//! Weights are f64 here ([`widen`] turns a model's weights into them exactly), so that finite
//! differences can perturb them. Targets are one per token row (`batch · seq`, batch-major), as
//! [`crate::train::shift_labels`] makes them: a token id, or [`IGNORE_INDEX`] for rows that predict
//! nothing. The loss is the mean over the counted rows.

use crate::config::LlamaConfig;
use crate::rope;
use crate::train::IGNORE_INDEX;
use crate::weights::{LayerWeights, Tensor, Weights};
use cudnn_llm_ops::reference::backward::{self as rb, RopeShape};
use cudnn_llm_ops::reference::{attention, rms_norm, AttentionShape};
use cudnn_llm_ops::{Element, Layout, Mask};

/// `w` with every value widened to f64 (exact).
pub fn widen<T: Element>(w: &Weights<T>) -> Weights<f64> {
    w.map(|t, _| Tensor { shape: t.shape.clone(), data: t.to_f64() })
}

/// What one layer's forward keeps for its backward (rows are `batch · seq` tokens, batch-major).
struct Saved {
    /// The layer's input `[rows, hidden]`.
    x: Vec<f64>,
    inv1: Vec<f64>,
    h1: Vec<f64>,
    /// Rotated Q `[b, h_q, s, d]`, rotated K and V `[b, h_kv, s, d]`.
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    /// Attention output `[b, h_q, s, d]` and its log-sum-exp `[b, h_q, s]`.
    o: Vec<f64>,
    stats: Vec<f64>,
    /// The attention output as rows `[rows, h_q · d]` (o_proj's input).
    attn: Vec<f64>,
    /// After the attention's residual add.
    x_mid: Vec<f64>,
    inv2: Vec<f64>,
    h2: Vec<f64>,
    gate: Vec<f64>,
    up: Vec<f64>,
    act: Vec<f64>,
}

/// A whole forward with what the backward reads.
struct Forward {
    layers: Vec<Saved>,
    /// The last layer's output, the output norm's input.
    x: Vec<f64>,
    inv: Vec<f64>,
    /// The output norm's output.
    y: Vec<f64>,
    logits: Vec<f64>,
}

/// The shape of one forward: `batch` sequences of `seq` tokens from position 0.
#[derive(Clone, Copy)]
struct Shape {
    batch: usize,
    seq: usize,
}

impl Shape {
    fn of(inputs: &[Vec<u32>]) -> Self {
        let seq = inputs.first().map_or(0, Vec::len);
        assert!(
            !inputs.is_empty() && seq > 0 && inputs.iter().all(|t| t.len() == seq),
            "reference training forward: one or more sequences of equal, non-zero length"
        );
        Shape { batch: inputs.len(), seq }
    }

    fn rows(self) -> usize {
        self.batch * self.seq
    }
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// RoPE of `[rows, heads, d]` rows at positions `r % seq` (a row's position in its sequence).
struct Rotation {
    positions: Vec<usize>,
    cos: Vec<f64>,
    sin: Vec<f64>,
    dim: usize,
}

impl Rotation {
    fn new(cfg: &LlamaConfig, s: Shape) -> Self {
        let (cos, sin) = rope::tables(cfg, 0, s.seq).expect("reference: a config LlamaConfig::check accepts");
        Rotation { positions: (0..s.rows()).map(|r| r % s.seq).collect(), cos, sin, dim: cfg.head_dim }
    }

    fn shape(&self, heads: usize) -> RopeShape<'_> {
        RopeShape { heads, dim: self.dim, positions: &self.positions, cos: &self.cos, sin: &self.sin }
    }
}

fn forward(cfg: &LlamaConfig, w: &Weights<f64>, inputs: &[Vec<u32>]) -> Forward {
    let s = Shape::of(inputs);
    let (rows, hid, d, hq, hkv, ffn) = (s.rows(), cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn);
    let ids: Vec<u32> = inputs.iter().flatten().copied().collect();
    let mut x = rb::embedding(&ids, &w.embed.data, hid);
    let rot = Rotation::new(cfg, s);
    let attn_shape =
        AttentionShape { batch: s.batch, heads_q: hq, heads_kv: hkv, seq_q: s.seq, seq_kv: s.seq, dim: d };
    let scale = 1.0 / (d as f64).sqrt();
    let mut layers = Vec::with_capacity(w.layers.len());
    for l in &w.layers {
        let (h1, inv1) = rms_norm(&x, &l.attn_norm.data, rows, hid, cfg.rms_eps);
        let heads = |proj: &Tensor<f64>, heads: usize, rotate: bool| {
            let m = rb::linear(&h1, &proj.data, rows, hid, heads * d);
            let m = if rotate { rb::rope(&m, rot.shape(heads)) } else { m };
            rb::to_bhsd(&m, Layout::Bshd, s.batch, heads, s.seq, d)
        };
        let (q, k, v) =
            (heads(&l.q_proj, hq, true), heads(&l.k_proj, hkv, true), heads(&l.v_proj, hkv, false));
        let (o, stats) = attention(&q, &k, &v, attn_shape, scale, Mask::CausalTopLeft);
        let attn = rb::from_bhsd(&o, Layout::Bshd, s.batch, hq, s.seq, d);
        let x_mid = add(&x, &rb::linear(&attn, &l.o_proj.data, rows, hq * d, hid));
        let (h2, inv2) = rms_norm(&x_mid, &l.mlp_norm.data, rows, hid, cfg.rms_eps);
        let gate = rb::linear(&h2, &l.gate_proj.data, rows, hid, ffn);
        let up = rb::linear(&h2, &l.up_proj.data, rows, hid, ffn);
        let act = rb::swiglu(&gate, &up);
        let next = add(&x_mid, &rb::linear(&act, &l.down_proj.data, rows, ffn, hid));
        let x_in = std::mem::replace(&mut x, next);
        layers.push(Saved { x: x_in, inv1, h1, q, k, v, o, stats, attn, x_mid, inv2, h2, gate, up, act });
    }
    let (y, inv) = rms_norm(&x, &w.norm.data, rows, hid, cfg.rms_eps);
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    let logits = rb::linear(&y, &head.data, rows, hid, cfg.vocab);
    Forward { layers, x, inv, y, logits }
}

fn targets64(targets: &[i32]) -> Vec<i64> {
    targets.iter().map(|&t| t as i64).collect()
}

/// The mean next-token cross-entropy of `inputs` (`batch` sequences of equal length from position 0,
/// causal attention) against `targets` (one per token row, [`IGNORE_INDEX`] not counted). NaN when no
/// row is counted (0 / 0, as PyTorch).
pub fn loss(cfg: &LlamaConfig, w: &Weights<f64>, inputs: &[Vec<u32>], targets: &[i32]) -> f64 {
    let f = forward(cfg, w, inputs);
    rb::cross_entropy(&f.logits, &targets64(targets), cfg.vocab, Some(IGNORE_INDEX as i64)).0
}

/// The final hidden states (after the output norm), `[rows, hidden]`: the same as
/// [`super::forward`] at position 0, through this module's layer-by-layer forward.
pub fn hidden(cfg: &LlamaConfig, w: &Weights<f64>, inputs: &[Vec<u32>]) -> Vec<f64> {
    forward(cfg, w, inputs).y
}

/// [`loss`] and its gradient with respect to every weight tensor, in [`Weights::names`] order and
/// shapes. With tied embeddings the embedding's gradient is the sum of the lookup's and `lm_head`'s.
pub fn gradients(
    cfg: &LlamaConfig,
    w: &Weights<f64>,
    inputs: &[Vec<u32>],
    targets: &[i32],
) -> (f64, Weights<f64>) {
    let s = Shape::of(inputs);
    assert_eq!(targets.len(), s.rows(), "reference gradients: one target per token");
    let (rows, hid, d, hq, hkv, ffn, vocab) =
        (s.rows(), cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab);
    let f = forward(cfg, w, inputs);
    let t64 = targets64(targets);
    let ignore = Some(IGNORE_INDEX as i64);
    let (loss, lse) = rb::cross_entropy(&f.logits, &t64, vocab, ignore);
    let dlogits = rb::cross_entropy_backward(&f.logits, &t64, &lse, vocab, ignore, 1.0);
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    let dy = rb::linear_backward_data(&dlogits, &head.data, rows, hid, vocab);
    let d_head = rb::linear_backward_weight(&dlogits, &f.y, rows, hid, vocab, None);
    let (mut g, d_norm) = rb::rms_norm_backward(&dy, &f.x, &w.norm.data, &f.inv, rows, hid, None);

    let rot = Rotation::new(cfg, s);
    let attn_shape =
        AttentionShape { batch: s.batch, heads_q: hq, heads_kv: hkv, seq_q: s.seq, seq_kv: s.seq, dim: d };
    let scale = 1.0 / (d as f64).sqrt();
    let tensor = |shape: &[usize], data: Vec<f64>| Tensor { shape: shape.to_vec(), data };
    let mut layers = Vec::with_capacity(w.layers.len());
    for (l, a) in w.layers.iter().zip(&f.layers).rev() {
        // MLP: x_next = x_mid + down(silu(gate(h2)) ⊙ up(h2)).
        let d_act = rb::linear_backward_data(&g, &l.down_proj.data, rows, ffn, hid);
        let d_down = rb::linear_backward_weight(&g, &a.act, rows, ffn, hid, None);
        let (d_gate, d_up) = rb::swiglu_backward(&d_act, &a.gate, &a.up);
        let d_gate_w = rb::linear_backward_weight(&d_gate, &a.h2, rows, hid, ffn, None);
        let d_up_w = rb::linear_backward_weight(&d_up, &a.h2, rows, hid, ffn, None);
        let dh2 = add(
            &rb::linear_backward_data(&d_gate, &l.gate_proj.data, rows, hid, ffn),
            &rb::linear_backward_data(&d_up, &l.up_proj.data, rows, hid, ffn),
        );
        let (g_mid, d_mlp_norm) =
            rb::rms_norm_backward(&dh2, &a.x_mid, &l.mlp_norm.data, &a.inv2, rows, hid, Some(&g));
        // Attention: x_mid = x + o_proj(attn(rope(q(h1)), rope(k(h1)), v(h1))).
        let d_attn = rb::linear_backward_data(&g_mid, &l.o_proj.data, rows, hq * d, hid);
        let d_o_w = rb::linear_backward_weight(&g_mid, &a.attn, rows, hq * d, hid, None);
        let d_o = rb::to_bhsd(&d_attn, Layout::Bshd, s.batch, hq, s.seq, d);
        let (dq, dk, dv) = rb::sdpa_backward(
            &d_o,
            &a.q,
            &a.k,
            &a.v,
            &a.o,
            &a.stats,
            attn_shape,
            scale,
            Mask::CausalTopLeft,
            Layout::Bhsd,
        );
        let rows_of = |t: &[f64], heads: usize, rotated: bool| {
            let m = rb::from_bhsd(t, Layout::Bshd, s.batch, heads, s.seq, d);
            if rotated {
                rb::rope_backward(&m, rot.shape(heads))
            } else {
                m
            }
        };
        let (dq, dk, dv) = (rows_of(&dq, hq, true), rows_of(&dk, hkv, true), rows_of(&dv, hkv, false));
        let proj_w = |dp: &[f64], out: usize| rb::linear_backward_weight(dp, &a.h1, rows, hid, out, None);
        let (dwq, dwk, dwv) = (proj_w(&dq, hq * d), proj_w(&dk, hkv * d), proj_w(&dv, hkv * d));
        let mut dh1 = rb::linear_backward_data(&dq, &l.q_proj.data, rows, hid, hq * d);
        for (dp, proj) in [(&dk, &l.k_proj), (&dv, &l.v_proj)] {
            dh1 = add(&dh1, &rb::linear_backward_data(dp, &proj.data, rows, hid, hkv * d));
        }
        let (g_in, d_attn_norm) =
            rb::rms_norm_backward(&dh1, &a.x, &l.attn_norm.data, &a.inv1, rows, hid, Some(&g_mid));
        g = g_in;
        layers.push(LayerWeights {
            attn_norm: tensor(&l.attn_norm.shape, d_attn_norm),
            q_proj: tensor(&l.q_proj.shape, dwq),
            k_proj: tensor(&l.k_proj.shape, dwk),
            v_proj: tensor(&l.v_proj.shape, dwv),
            o_proj: tensor(&l.o_proj.shape, d_o_w),
            mlp_norm: tensor(&l.mlp_norm.shape, d_mlp_norm),
            gate_proj: tensor(&l.gate_proj.shape, d_gate_w),
            up_proj: tensor(&l.up_proj.shape, d_up_w),
            down_proj: tensor(&l.down_proj.shape, d_down),
        });
    }
    layers.reverse();
    let ids: Vec<u32> = inputs.iter().flatten().copied().collect();
    let tied = w.lm_head.is_none();
    let d_embed = rb::embedding_backward(&ids, &g, vocab, hid, tied.then_some(d_head.as_slice()));
    let grads = Weights {
        embed: tensor(&w.embed.shape, d_embed),
        layers,
        norm: tensor(&w.norm.shape, d_norm),
        lm_head: w.lm_head.as_ref().map(|h| tensor(&h.shape, d_head)),
    };
    (loss, grads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::shift_labels;
    use cudnn_llm_ops::half::bf16;
    use cudnn_llm_ops::reference::random_values;

    /// Small enough for finite differences of every tensor: hidden 16, 2 layers, 2 query heads
    /// sharing 1 K/V head of dim 8, MLP 24, vocabulary 11.
    fn micro(tied: bool) -> LlamaConfig {
        LlamaConfig {
            name: "micro".into(),
            hidden: 16,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            ffn: 24,
            vocab: 11,
            tie_embeddings: tied,
            ..LlamaConfig::tiny()
        }
    }

    fn batch(cfg: &LlamaConfig) -> (Vec<Vec<u32>>, Vec<i32>) {
        let inputs: Vec<Vec<u32>> =
            (0..2).map(|b| (0..5).map(|t| ((7 * b + 3 * t + 1) % cfg.vocab) as u32).collect()).collect();
        let mut labels: Vec<Vec<i32>> =
            inputs.iter().map(|s| s.iter().map(|&t| t as i32).collect()).collect();
        labels[1][2] = IGNORE_INDEX;
        (inputs, shift_labels(&labels))
    }

    /// The random init (norms near 1, projections ±1/√fan_in, the embedding ±1), in f64.
    fn weights(cfg: &LlamaConfig, seed: u64) -> Weights<f64> {
        widen(&Weights::<f32>::random(cfg, seed))
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Central differences of the loss along a random direction of each tensor (so every element
    /// counts) and along three single elements, against the analytic gradient; returns the failures.
    fn finite_difference_failures(
        cfg: &LlamaConfig,
        w: &Weights<f64>,
        grads: &Weights<f64>,
        (inputs, targets): &(Vec<Vec<u32>>, Vec<i32>),
    ) -> Vec<String> {
        let names = Weights::<f32>::names(cfg);
        let eps = 1e-5;
        let mut failures = Vec::new();
        let at = |i: usize, dir: &[f64], step: f64| {
            let mut p = w.clone();
            let t = p.tensors_mut().nth(i).expect("one tensor per name");
            t.data.iter_mut().zip(dir).for_each(|(v, d)| *v += step * d);
            loss(cfg, &p, inputs, targets)
        };
        for (i, ((name, _), g)) in names.iter().zip(grads.tensors()).enumerate() {
            let n = g.data.len();
            let mut dirs = vec![random_values(100 + i as u64, n)];
            for k in [0, n / 2, n - 1] {
                let mut e = vec![0.0; n];
                e[k] = 1.0;
                dirs.push(e);
            }
            for (j, dir) in dirs.iter().enumerate() {
                let numeric = (at(i, dir, eps) - at(i, dir, -eps)) / (2.0 * eps);
                let analytic = dot(&g.data, dir);
                let err = (numeric - analytic).abs();
                if err > 1e-6 * numeric.abs().max(1e-3) {
                    failures
                        .push(format!("{name} direction {j}: numeric {numeric:e}, analytic {analytic:e}"));
                }
            }
        }
        failures
    }

    #[test]
    fn the_layer_by_layer_forward_is_the_reference_forward() {
        let cfg = LlamaConfig::tiny();
        let w = Weights::<bf16>::random(&cfg, 3);
        let inputs = vec![vec![3u32, 17, 200, 5], vec![400, 1, 2, 3]];
        let ours = hidden(&cfg, &widen(&w), &inputs);
        let theirs = crate::reference::forward(&cfg, &w, &inputs, 0);
        assert_eq!(ours.len(), theirs.len());
        let worst = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-12, "{worst}");
    }

    #[test]
    fn gradients_match_finite_differences_of_the_loss() {
        for tied in [false, true] {
            let cfg = micro(tied);
            cfg.check().unwrap();
            let w = weights(&cfg, 11);
            let data = batch(&cfg);
            let (l, grads) = gradients(&cfg, &w, &data.0, &data.1);
            assert!((l - loss(&cfg, &w, &data.0, &data.1)).abs() < 1e-14);
            assert!(l.is_finite() && l > 0.5, "{l}");
            println!("tied {tied}: loss {l}");
            // Every tensor's gradient has its weight's shape and is not zero.
            for ((name, shape), g) in Weights::<f32>::names(&cfg).iter().zip(grads.tensors()) {
                assert_eq!(&g.shape, shape, "{name}");
                assert!(g.data.iter().any(|&v| v != 0.0), "{name} has a zero gradient");
            }
            let failures = finite_difference_failures(&cfg, &w, &grads, &data);
            assert!(failures.is_empty(), "tied {tied}: {failures:#?}");
        }
    }

    #[test]
    fn finite_differences_catch_a_wrong_gradient() {
        // The untied embedding gradient given for a tied model (lm_head's share missing) fails; so
        // does a gradient with two layers' tensors swapped.
        let cfg = micro(true);
        let w = weights(&cfg, 12);
        let data = batch(&cfg);
        let (_, grads) = gradients(&cfg, &w, &data.0, &data.1);
        let untied_cfg = micro(false);
        let untied = Weights { lm_head: Some(w.embed.clone()), ..w.clone() };
        let (_, untied_grads) = gradients(&untied_cfg, &untied, &data.0, &data.1);
        let missing_head = Weights { embed: untied_grads.embed.clone(), ..grads.clone() };
        let failures = finite_difference_failures(&cfg, &w, &missing_head, &data);
        assert!(failures.iter().any(|f| f.starts_with("model.embed_tokens.weight")), "{failures:?}");
        let mut swapped = grads.clone();
        swapped.layers.swap(0, 1);
        assert!(!finite_difference_failures(&cfg, &w, &swapped, &data).is_empty());
    }

    #[test]
    fn tied_gradients_sum_the_lookup_and_the_head() {
        // A tied model is an untied one whose lm_head equals the embedding: same loss, and the tied
        // embedding gradient is the untied embedding's plus the untied head's.
        let (tied_cfg, untied_cfg) = (micro(true), micro(false));
        let w = weights(&tied_cfg, 13);
        let data = batch(&tied_cfg);
        let (lt, gt) = gradients(&tied_cfg, &w, &data.0, &data.1);
        let untied = Weights { lm_head: Some(w.embed.clone()), ..w.clone() };
        let (lu, gu) = gradients(&untied_cfg, &untied, &data.0, &data.1);
        assert!((lt - lu).abs() < 1e-14);
        assert!(gt.lm_head.is_none());
        let head = gu.lm_head.as_ref().unwrap();
        let sum = add(&gu.embed.data, &head.data);
        assert!(gt.embed.data.iter().zip(&sum).all(|(a, b)| (a - b).abs() < 1e-13));
        // Both parts are there: neither alone is the sum.
        assert!(gt.embed.data.iter().zip(&gu.embed.data).any(|(a, b)| (a - b).abs() > 1e-6));
        assert!(gt.embed.data.iter().zip(&head.data).any(|(a, b)| (a - b).abs() > 1e-6));
    }

    #[test]
    fn ignored_targets_count_for_nothing() {
        let cfg = micro(false);
        let w = weights(&cfg, 14);
        let (inputs, targets) = batch(&cfg);
        // Changing the input of the ignored row's target position changes nothing the loss reads
        // there, and the mean is over the counted rows: ignoring every row but one gives that row's
        // loss alone.
        let counted: Vec<usize> = (0..targets.len()).filter(|&i| targets[i] != IGNORE_INDEX).collect();
        assert_eq!(counted.len(), 2 * 5 - 2 - 1, "two last positions and one ignored label");
        let only = |k: usize| {
            let t: Vec<i32> =
                targets.iter().enumerate().map(|(i, &t)| if i == k { t } else { IGNORE_INDEX }).collect();
            loss(&cfg, &w, &inputs, &t)
        };
        let mean = counted.iter().map(|&k| only(k)).sum::<f64>() / counted.len() as f64;
        assert!((mean - loss(&cfg, &w, &inputs, &targets)).abs() < 1e-12);
        let none = vec![IGNORE_INDEX; targets.len()];
        assert!(loss(&cfg, &w, &inputs, &none).is_nan());
    }
}
