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

/// `y[rows, out] = x[rows, in] · W[out, in]ᵀ`.
fn linear(x: &[f64], w: &[f64], rows: usize, inp: usize, out: usize) -> Vec<f64> {
    let mut y = vec![0.0; rows * out];
    for r in 0..rows {
        let xr = &x[r * inp..][..inp];
        for (o, yo) in y[r * out..][..out].iter_mut().enumerate() {
            *yo = xr.iter().zip(&w[o * inp..][..inp]).map(|(a, b)| a * b).sum();
        }
    }
    y
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// Final hidden states (after the output norm), `[batch, seq, hidden]`, of `tokens` (`batch` sequences
/// of equal length) placed at positions `start..start + seq`, attending causally to themselves only.
pub fn forward<T: Element>(cfg: &LlamaConfig, w: &Weights<T>, tokens: &[Vec<u32>], start: usize) -> Vec<f64> {
    let batch = tokens.len();
    let seq = tokens.first().map_or(0, |t| t.len());
    assert!(tokens.iter().all(|t| t.len() == seq), "reference forward: sequences of equal length");
    let (hid, d, hq, hkv) = (cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads);
    let rows = batch * seq;
    let embed = f64s(&w.embed);
    let mut x: Vec<f64> =
        tokens.iter().flatten().flat_map(|&t| embed[t as usize * hid..][..hid].to_vec()).collect();
    let (cos, sin) =
        rope::tables(cfg, start, seq).expect("reference forward: a config LlamaConfig::check accepts");
    let half = d / 2;
    for layer in &w.layers {
        let (h, _) = rms_norm(&x, &f64s(&layer.attn_norm), rows, hid, cfg.rms_eps);
        let q = linear(&h, &f64s(&layer.q_proj), rows, hid, hq * d);
        let k = linear(&h, &f64s(&layer.k_proj), rows, hid, hkv * d);
        let v = linear(&h, &f64s(&layer.v_proj), rows, hid, hkv * d);
        // [b, s, heads, d] rows to [b, heads, s, d], rotating Q and K by their position.
        let to_bhsd = |m: &[f64], heads: usize, rotate: bool| {
            let mut out = vec![0.0; m.len()];
            for b in 0..batch {
                for s in 0..seq {
                    for hh in 0..heads {
                        let src = &m[((b * seq + s) * heads + hh) * d..][..d];
                        let dst = &mut out[((b * heads + hh) * seq + s) * d..][..d];
                        dst.copy_from_slice(src);
                        if rotate {
                            rope::rotate(dst, &cos[s * half..][..half], &sin[s * half..][..half]);
                        }
                    }
                }
            }
            out
        };
        let shape = AttentionShape { batch, heads_q: hq, heads_kv: hkv, seq_q: seq, seq_kv: seq, dim: d };
        let scale = 1.0 / (d as f64).sqrt();
        let (o, _) = attention(
            &to_bhsd(&q, hq, true),
            &to_bhsd(&k, hkv, true),
            &to_bhsd(&v, hkv, false),
            shape,
            scale,
            Mask::CausalTopLeft,
        );
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
        let proj = linear(&attn, &f64s(&layer.o_proj), rows, hq * d, hid);
        x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        let (h, _) = rms_norm(&x, &f64s(&layer.mlp_norm), rows, hid, cfg.rms_eps);
        let gate = linear(&h, &f64s(&layer.gate_proj), rows, hid, cfg.ffn);
        let up = linear(&h, &f64s(&layer.up_proj), rows, hid, cfg.ffn);
        let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        let down = linear(&act, &f64s(&layer.down_proj), rows, cfg.ffn, hid);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    rms_norm(&x, &f64s(&w.norm), rows, hid, cfg.rms_eps).0
}

/// Logits `[rows, vocab]` of final hidden states (`lm_head`, or the embedding when tied).
pub fn logits<T: Element>(cfg: &LlamaConfig, w: &Weights<T>, hidden: &[f64]) -> Vec<f64> {
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    linear(hidden, &f64s(head), hidden.len() / cfg.hidden, cfg.hidden, cfg.vocab)
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
}
