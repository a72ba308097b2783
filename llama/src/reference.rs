//! The whole model in f64 on the CPU, written the way Hugging Face's `LlamaForCausalLM` computes it, for
//! checking GPU forwards on small configs (the tiny preset); [`train`] adds the training loss and its
//! gradients.

pub mod train;

use crate::config::LlamaConfig;
use crate::rope;
use crate::weights::{Tensor, Weights};
use cudnn_llm_ops::reference::{attention, rms_norm, AttentionShape};
use cudnn_llm_ops::{Element, Mask};

fn f64s<T: Element>(t: &Tensor<T>) -> Vec<f64> {
    t.data.iter().map(|v| v.to_f64()).collect()
}

/// `y[rows, out] = x[rows, in] · W[out, in]ᵀ`, the weights widened as they are read.
fn linear<T: Element>(x: &[f64], w: &Tensor<T>, rows: usize, inp: usize, out: usize) -> Vec<f64> {
    let w = &w.data;
    let mut y = vec![0.0; rows * out];
    for r in 0..rows {
        let xr = &x[r * inp..][..inp];
        for (o, yo) in y[r * out..][..out].iter_mut().enumerate() {
            *yo = xr.iter().zip(&w[o * inp..][..inp]).map(|(a, b)| a * b.to_f64()).sum();
        }
    }
    y
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// The keys (rotated) and values of the positions a [`Cache`] has seen, per layer, `[batch, kv_heads,
/// positions, head_dim]` flattened per (sequence, head).
pub struct Cache {
    start: usize,
    len: usize,
    k: Vec<Vec<Vec<f64>>>,
    v: Vec<Vec<Vec<f64>>>,
}

impl Cache {
    /// An empty cache whose first token goes to position `start`.
    pub fn new(cfg: &LlamaConfig, batch: usize, start: usize) -> Cache {
        let empty = || vec![vec![Vec::new(); batch * cfg.kv_heads]; cfg.layers];
        Cache { start, len: 0, k: empty(), v: empty() }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Final hidden states (after the output norm), `[batch, seq, hidden]`, of `tokens` (`batch` sequences
/// of equal length) placed at positions `start..start + seq`, attending causally to themselves only.
pub fn forward<T: Element>(cfg: &LlamaConfig, w: &Weights<T>, tokens: &[Vec<u32>], start: usize) -> Vec<f64> {
    forward_cached(cfg, w, tokens, &mut Cache::new(cfg, tokens.len(), start))
}

/// [`forward`] of `tokens` following the positions `cache` holds (attending to them and causally to
/// themselves), appending their keys and values to it: a prompt, then one token a step, gives the rows
/// the whole sequence at once gives.
pub fn forward_cached<T: Element>(
    cfg: &LlamaConfig,
    w: &Weights<T>,
    tokens: &[Vec<u32>],
    cache: &mut Cache,
) -> Vec<f64> {
    let batch = tokens.len();
    let seq = tokens.first().map_or(0, |t| t.len());
    assert!(tokens.iter().all(|t| t.len() == seq), "reference forward: sequences of equal length");
    assert_eq!(
        cache.k.first().map_or(batch * cfg.kv_heads, Vec::len),
        batch * cfg.kv_heads,
        "reference forward: cache batch"
    );
    let (hid, d, hq, hkv) = (cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads);
    let rows = batch * seq;
    let past = cache.len;
    let kv_len = past + seq;
    let mut x: Vec<f64> = tokens
        .iter()
        .flatten()
        .flat_map(|&t| w.embed.data[t as usize * hid..][..hid].iter().map(|v| v.to_f64()))
        .collect();
    let (cos, sin) = rope::tables(cfg, cache.start + past, seq)
        .expect("reference forward: a config LlamaConfig::check accepts");
    let half = d / 2;
    // [b, s, heads, d] rows to per-(sequence, head) runs of `seq` rows, rotating Q and K by position.
    let per_head = |m: &[f64], heads: usize, rotate: bool| {
        let mut out = vec![Vec::with_capacity(seq * d); batch * heads];
        for b in 0..batch {
            for s in 0..seq {
                for hh in 0..heads {
                    let mut row = m[((b * seq + s) * heads + hh) * d..][..d].to_vec();
                    if rotate {
                        rope::rotate(&mut row, &cos[s * half..][..half], &sin[s * half..][..half]);
                    }
                    out[b * heads + hh].extend(row);
                }
            }
        }
        out
    };
    for (l, layer) in w.layers.iter().enumerate() {
        let (h, _) = rms_norm(&x, &f64s(&layer.attn_norm), rows, hid, cfg.rms_eps);
        let q = per_head(&linear(&h, &layer.q_proj, rows, hid, hq * d), hq, true).concat();
        for (store, new) in [
            (&mut cache.k[l], per_head(&linear(&h, &layer.k_proj, rows, hid, hkv * d), hkv, true)),
            (&mut cache.v[l], per_head(&linear(&h, &layer.v_proj, rows, hid, hkv * d), hkv, false)),
        ] {
            store.iter_mut().zip(new).for_each(|(run, rows)| run.extend(rows));
        }
        let shape = AttentionShape { batch, heads_q: hq, heads_kv: hkv, seq_q: seq, seq_kv: kv_len, dim: d };
        let scale = 1.0 / (d as f64).sqrt();
        let (o, _) =
            attention(&q, &cache.k[l].concat(), &cache.v[l].concat(), shape, scale, Mask::CausalBottomRight);
        // Back to [b, s, heads · d].
        let mut attn = vec![0.0; rows * hq * d];
        for b in 0..batch {
            for hh in 0..hq {
                for s in 0..seq {
                    let src = &o[((b * hq + hh) * seq + s) * d..][..d];
                    attn[((b * seq + s) * hq + hh) * d..][..d].copy_from_slice(src);
                }
            }
        }
        let proj = linear(&attn, &layer.o_proj, rows, hq * d, hid);
        x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        let (h, _) = rms_norm(&x, &f64s(&layer.mlp_norm), rows, hid, cfg.rms_eps);
        let gate = linear(&h, &layer.gate_proj, rows, hid, cfg.ffn);
        let up = linear(&h, &layer.up_proj, rows, hid, cfg.ffn);
        let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        let down = linear(&act, &layer.down_proj, rows, cfg.ffn, hid);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    cache.len = kv_len;
    rms_norm(&x, &f64s(&w.norm), rows, hid, cfg.rms_eps).0
}

/// Greedy continuation of one prompt: `steps` token ids, each the arg-max of the logits (the lowest
/// id among equal maxima), with the margin of each choice over the runner-up.
pub fn greedy<T: Element>(
    cfg: &LlamaConfig,
    w: &Weights<T>,
    prompt: &[u32],
    steps: usize,
) -> Vec<(u32, f64)> {
    let mut cache = Cache::new(cfg, 1, 0);
    let mut next = prompt.to_vec();
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let hidden = forward_cached(cfg, w, &[next], &mut cache);
        let last = &hidden[hidden.len() - cfg.hidden..];
        let row = logits(cfg, w, last);
        let (mut best, mut second) = ((0usize, f64::NEG_INFINITY), f64::NEG_INFINITY);
        for (i, &v) in row.iter().enumerate() {
            if v > best.1 {
                second = best.1;
                best = (i, v);
            } else if v > second {
                second = v;
            }
        }
        out.push((best.0 as u32, best.1 - second));
        next = vec![best.0 as u32];
    }
    out
}

/// Logits `[rows, vocab]` of final hidden states (`lm_head`, or the embedding when tied).
pub fn logits<T: Element>(cfg: &LlamaConfig, w: &Weights<T>, hidden: &[f64]) -> Vec<f64> {
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    linear(hidden, head, hidden.len() / cfg.hidden, cfg.hidden, cfg.vocab)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudnn_llm_ops::half::bf16;

    #[test]
    fn forward_is_deterministic_causal_and_batch_independent() {
        let cfg = LlamaConfig::tiny();
        let w = Weights::<bf16>::random(&cfg, 7);
        let a = vec![3u32, 17, 200, 5, 9];
        let b = vec![400u32, 1, 2, 3, 4];
        let both = forward(&cfg, &w, &[a.clone(), b.clone()], 0);
        assert_eq!(both.len(), 2 * 5 * cfg.hidden);
        assert!(both.iter().all(|v| v.is_finite()));
        // Each sequence alone gives the same rows.
        assert_eq!(&both[..5 * cfg.hidden], &forward(&cfg, &w, std::slice::from_ref(&a), 0)[..]);
        assert_eq!(&both[5 * cfg.hidden..], &forward(&cfg, &w, &[b], 0)[..]);
        // Causal: the first three rows do not depend on later tokens.
        let prefix = forward(&cfg, &w, &[a[..3].to_vec()], 0);
        for (x, y) in prefix.iter().zip(&both[..3 * cfg.hidden]) {
            assert!((x - y).abs() < 1e-12);
        }
        // RoPE scores depend on relative positions only: the same tokens at positions 10.. give the
        // same states.
        let shifted = forward(&cfg, &w, std::slice::from_ref(&a), 10);
        assert!(shifted.iter().zip(&both[..5 * cfg.hidden]).all(|(x, y)| (x - y).abs() < 1e-9));
        let row = cfg.hidden;
        // The output norm leaves rows of RMS close to the norm weights' scale.
        let rms = (both[..row].iter().map(|v| v * v).sum::<f64>() / row as f64).sqrt();
        assert!(rms > 0.5 && rms < 1.5, "{rms}");
        let l = logits(&cfg, &w, &both);
        assert_eq!(l.len(), 10 * cfg.vocab);
    }

    #[test]
    fn a_prompt_then_tokens_one_by_one_equals_the_whole_sequence() {
        let cfg = LlamaConfig::tiny();
        let w = Weights::<bf16>::random(&cfg, 11);
        let seqs = [vec![3u32, 17, 200, 5, 9, 44, 8], vec![400u32, 1, 2, 3, 4, 5, 6]];
        let whole = forward(&cfg, &w, &seqs, 0);
        let mut cache = Cache::new(&cfg, 2, 0);
        let mut rows = [Vec::new(), Vec::new()];
        let prompt: Vec<Vec<u32>> = seqs.iter().map(|s| s[..4].to_vec()).collect();
        let mut push = |hidden: Vec<f64>, n: usize| {
            for (b, r) in rows.iter_mut().enumerate() {
                r.extend_from_slice(&hidden[b * n * cfg.hidden..][..n * cfg.hidden]);
            }
        };
        push(forward_cached(&cfg, &w, &prompt, &mut cache), 4);
        for s in 4..7 {
            let step: Vec<Vec<u32>> = seqs.iter().map(|q| vec![q[s]]).collect();
            push(forward_cached(&cfg, &w, &step, &mut cache), 1);
        }
        assert_eq!(cache.len(), 7);
        let stepped = rows.concat();
        let worst = whole.iter().zip(&stepped).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-9, "{worst}");
        // Greedy picks the arg-max of the logits the whole sequence gives.
        let g = greedy(&cfg, &w, &seqs[0][..4], 2);
        let l = logits(&cfg, &w, &forward(&cfg, &w, &[seqs[0][..4].to_vec()], 0)[3 * cfg.hidden..]);
        let arg = (0..cfg.vocab).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap();
        assert_eq!(g[0].0 as usize, arg);
        assert!(g.iter().all(|&(_, margin)| margin >= 0.0));
    }
}
