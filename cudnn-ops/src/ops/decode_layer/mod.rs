//! A whole Llama decoder layer of a one-token decode step in one launch: the persistent kernel of
//! `layer.cu` (a block per SM, a grid barrier between its five phases), for models whose step is
//! bound by launches rather than bytes (SmolLM2-135M's layer reads 7 MB and ran six kernels).
//!
//! `y = x1 + down(silu(gate(n2)) · up(n2))` with `n2 = rms_norm(x1)`, `x1 = x + o_proj(attn(q, K, V))`
//! and `q, k, v = rope(qkv_proj(rms_norm(x)))` at the token's position, read on the device; `k` and
//! `v` are appended to the caches at that row first and attention reads the `position + 1` rows
//! (clamped into the cache). Rounded as the fused decode kernels round each phase
//! ([`reference()`] follows them in f64). A position outside the RoPE tables or the cache leaves the
//! caches untouched and q unrotated, as the rotary GEMV does.
//!
//! The baseline is the same layer through the modules' op calls (the fused decode GEMVs and cuDNN's
//! attention, or the naive backend): the decoder takes this launch where asked
//! (`DecodeFusion::LAYER` in `cudnn_llm_llama`), and its tests compare the two.
//!
//! **Where it wins, measured** (H200, cuDNN 9.19, `examples/05-decode`, 545 cached tokens, step
//! with logits; `benches/results/h200/decode-small/`): launched plainly, SmolLM2-135M's step takes
//! 0.824 ms against 1.740 with the default folds (1.383 at their fastest setting); replayed as a
//! CUDA graph it loses, 0.728 ms against 0.592 (0.553 at the fastest setting), and on
//! Llama-3.2-1B it loses both ways (1.154 against 0.935 replayed). A grid barrier costs about what a
//! kernel boundary costs under programmatic dependent launch: in block 0 a phase took 2.6-4.0 µs
//! with its barrier (attention 5.4-6.4 µs) and the last phase, which has none, 1.9 µs; so the layer
//! saves the CPU's launches, not the GPU's synchronizations, and stays opt-in.
//!
//! **Co-residency**: the grid barrier needs every block of the launch on the GPU at once (a block
//! per SM, up to two fit). The launch is an ordinary (programmatic) one, not a cooperative launch,
//! so the driver does not check it: kernels on other streams only delay the blocks they hold back,
//! but a GPU shared with a persistent kernel that never yields its SMs, or an MPS client limited to
//! under half the SMs, would leave the barrier waiting. Run it on a GPU this process has to itself.

mod fused;

pub use fused::phase_times;

use crate::error::ensure;
use crate::ops::rope::RopeTables;
use crate::{checked, Cudnn, DataType, Element, Error, Result};
use cudarc::driver::CudaSlice;

/// The shapes of a decoder layer for [`decode_layer`].
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct DecodeLayerArgs {
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub heads_q: usize,
    /// K/V heads (dividing `heads_q`).
    pub heads_kv: usize,
    /// Elements per head: 32, 64, 96 or 128.
    pub head_dim: usize,
    /// MLP width.
    pub ffn: usize,
    /// RMSNorm epsilon of both norms.
    pub eps: f32,
    /// Rows of each cache.
    pub max_seq: usize,
}

/// The most f32 elements of the vector a phase stages in shared memory (48 KiB: the most a launch
/// gets without opting in): `max(hidden, heads_q · head_dim, ffn)`.
pub const DECODE_LAYER_MAX_WIDTH: usize = 12 * 1024;

impl DecodeLayerArgs {
    /// A layer of `hidden` width, `heads_q`/`heads_kv` heads of `head_dim`, an MLP of `ffn`, norms'
    /// `eps`, caches of `max_seq` rows.
    pub fn new(
        hidden: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
        ffn: usize,
        eps: f32,
        max_seq: usize,
    ) -> Self {
        DecodeLayerArgs { hidden, heads_q, heads_kv, head_dim, ffn, eps, max_seq }
    }

    /// Elements of the fused Q/K/V projection's output: `(h_q + 2·h_kv)·d`.
    pub fn qkv_width(&self) -> usize {
        (self.heads_q + 2 * self.heads_kv) * self.head_dim
    }

    /// Elements of the attention output: `h_q·d`.
    pub fn attn_width(&self) -> usize {
        self.heads_q * self.head_dim
    }

    /// Elements of a cache row: `h_kv·d`.
    pub fn kv_width(&self) -> usize {
        self.heads_kv * self.head_dim
    }

    /// Why [`decode_layer`] does not take these shapes, if it does not (before any buffer is
    /// looked at): a decoder asks this before choosing the launch.
    pub fn refusal(&self) -> Option<String> {
        let a = self;
        if a.hidden == 0 || a.heads_q == 0 || a.heads_kv == 0 || a.ffn == 0 || a.max_seq == 0 {
            return Some("a zero dimension".into());
        }
        if !a.heads_q.is_multiple_of(a.heads_kv) {
            return Some(format!("{} query heads are not a multiple of {} K/V heads", a.heads_q, a.heads_kv));
        }
        if ![32, 64, 96, 128].contains(&a.head_dim) {
            return Some(format!("head dim {} (it takes 32, 64, 96 and 128)", a.head_dim));
        }
        if !a.hidden.is_multiple_of(8) || !a.ffn.is_multiple_of(8) {
            return Some(format!(
                "hidden {} and ffn {} must be multiples of 8 (16-byte loads)",
                a.hidden, a.ffn
            ));
        }
        let widest = a.hidden.max(a.attn_width()).max(a.ffn);
        if widest > DECODE_LAYER_MAX_WIDTH {
            return Some(format!(
                "a phase's input of {widest} elements (at most {DECODE_LAYER_MAX_WIDTH} in shared memory)"
            ));
        }
        if a.max_seq > i32::MAX as usize {
            return Some(format!("{} cache rows exceed i32 positions", a.max_seq));
        }
        None
    }
}

/// A decoder layer's weights, in the model's dtype: the norms `[hidden]`, Q/K/V fused
/// `[(h_q + 2·h_kv)·d, hidden]` (Q heads, then K, then V), `o_proj` `[hidden, h_q·d]`, gate and
/// up `[ffn, hidden]`, down `[hidden, ffn]` (row-major, as Linear layers hold them).
#[derive(Clone, Copy)]
pub struct DecodeLayerWeights<'a, T> {
    /// Attention's RMSNorm weight.
    pub attn_norm: &'a CudaSlice<T>,
    /// The fused Q/K/V projection.
    pub qkv: &'a CudaSlice<T>,
    /// The output projection.
    pub o: &'a CudaSlice<T>,
    /// The MLP's RMSNorm weight.
    pub mlp_norm: &'a CudaSlice<T>,
    /// The gate projection (SwiGLU's `silu` side).
    pub gate: &'a CudaSlice<T>,
    /// The up projection.
    pub up: &'a CudaSlice<T>,
    /// The down projection.
    pub down: &'a CudaSlice<T>,
}

/// The buffers of one [`decode_layer`] call.
pub struct DecodeLayerOperands<'a, T: Element> {
    /// The hidden state in, `[hidden]`.
    pub x: &'a CudaSlice<T>,
    /// The layer's weights.
    pub w: DecodeLayerWeights<'a, T>,
    /// RoPE's tables (head dim `head_dim`).
    pub tables: &'a RopeTables<T>,
    /// The token's position (`[1]` i32 on the device: the cache's length before the step).
    pub position: &'a CudaSlice<i32>,
    /// The layer's K cache `[max_seq, h_kv·d]`; the token's row is written.
    pub k: &'a mut CudaSlice<T>,
    /// The V cache, as K.
    pub v: &'a mut CudaSlice<T>,
    /// The hidden state out, `[hidden]` (not `x`).
    pub y: &'a mut CudaSlice<T>,
}

/// Runs the layer (one launch; see the [module docs](self)). Shapes it does not take
/// ([`DecodeLayerArgs::refusal`]), dtypes other than bf16 and f16, GPUs below compute capability 7.0
/// and buffers too short are errors, before anything runs.
pub fn decode_layer<T: Element>(
    ctx: &Cudnn,
    a: DecodeLayerArgs,
    x: DecodeLayerOperands<'_, T>,
) -> Result<()> {
    check(&a, &x)?;
    fused::launch(ctx, a, x)
}

fn check<T: Element>(a: &DecodeLayerArgs, x: &DecodeLayerOperands<'_, T>) -> Result<()> {
    let refused = |reason: String| Error::NotSupported { op: "decode layer".into(), reason };
    if let Some(reason) = a.refusal() {
        return Err(refused(reason));
    }
    if !matches!(T::DTYPE, DataType::BF16 | DataType::F16) {
        return Err(refused(format!("{} (it takes bf16 and f16)", T::DTYPE)));
    }
    let w = &x.w;
    let mul = |what: &str, p: usize, q: usize| checked::mul(what, p, q);
    let need = [
        ("x", x.x.len(), a.hidden),
        ("y", x.y.len(), a.hidden),
        ("attn_norm", w.attn_norm.len(), a.hidden),
        ("mlp_norm", w.mlp_norm.len(), a.hidden),
        ("qkv", w.qkv.len(), mul("decode layer: qkv", a.qkv_width(), a.hidden)?),
        ("o", w.o.len(), mul("decode layer: o", a.hidden, a.attn_width())?),
        ("gate", w.gate.len(), mul("decode layer: gate", a.ffn, a.hidden)?),
        ("up", w.up.len(), mul("decode layer: up", a.ffn, a.hidden)?),
        ("down", w.down.len(), mul("decode layer: down", a.hidden, a.ffn)?),
        ("k cache", x.k.len(), mul("decode layer: cache", a.max_seq, a.kv_width())?),
        ("v cache", x.v.len(), mul("decode layer: cache", a.max_seq, a.kv_width())?),
        ("position", x.position.len(), 1),
    ];
    for (name, have, want) in need {
        ensure!(have >= want, "decode layer: {name} has {have} elements, the shapes need {want}");
    }
    ensure!(
        x.tables.dim() == a.head_dim,
        "decode layer: RoPE tables of head dim {}, the layer's is {}",
        x.tables.dim(),
        a.head_dim
    );
    Ok(())
}

/// The f64 reference of [`decode_layer`] over host values (each buffer as the GPU's; `k` and `v`
/// are updated at row `position`), rounding with `round` (the I/O dtype's rounding) where the
/// kernel rounds: the projections' outputs, the rotated pair, attention's output, `x1`, `u` and
/// `act`, `y`. `cos`/`sin`: `[positions, head_dim / 2]`.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    a: &DecodeLayerArgs,
    x: &[f64],
    w: [&[f64]; 7],
    cos: &[f64],
    sin: &[f64],
    position: usize,
    k: &mut [f64],
    v: &mut [f64],
    round: impl Fn(f64) -> f64,
) -> Vec<f64> {
    let [attn_norm, qkv_w, o_w, mlp_norm, gate_w, up_w, down_w] = w;
    let (h, d, half) = (a.hidden, a.head_dim, a.head_dim / 2);
    let (kv_w, positions) = (a.kv_width(), cos.len() / half.max(1));
    let normed = |v: &[f64], g: &[f64]| -> (Vec<f64>, f64) {
        let ss = v.iter().map(|e| e * e).sum::<f64>() / v.len() as f64;
        let inv = 1.0 / (ss + a.eps as f64).sqrt();
        (v.iter().zip(g).map(|(e, g)| e * g).collect(), inv)
    };
    let dots = |wm: &[f64], xv: &[f64], rows: usize| -> Vec<f64> {
        let k = xv.len();
        (0..rows).map(|r| wm[r * k..(r + 1) * k].iter().zip(xv).map(|(w, x)| w * x).sum()).collect()
    };
    // A. qkv, rotated; K and V into the cache row.
    let (xn, inv) = normed(x, attn_norm);
    let qkv: Vec<f64> = dots(qkv_w, &xn, a.qkv_width()).into_iter().map(|s| round(s * inv)).collect();
    let inside = position < positions && position < a.max_seq;
    let mut q = vec![0.0; a.attn_width()];
    for head in 0..a.heads_q + 2 * a.heads_kv {
        for j in 0..half {
            let (r0, r1) = (head * d + j, head * d + j + half);
            let (x0, x1) = (qkv[r0], qkv[r1]);
            let rotated = head < a.heads_q + a.heads_kv;
            let (lo, hi) = if inside && rotated {
                let (c, s) = (cos[position * half + j], sin[position * half + j]);
                (round(x0 * c - x1 * s), round(x1 * c + x0 * s))
            } else {
                (x0, x1)
            };
            if head < a.heads_q {
                (q[r0], q[r1]) = (lo, hi);
            } else if inside {
                let (cache, hh) = if rotated {
                    (&mut *k, head - a.heads_q)
                } else {
                    (&mut *v, head - a.heads_q - a.heads_kv)
                };
                let at = position * kv_w + hh * d + j;
                (cache[at], cache[at + half]) = (lo, hi);
            }
        }
    }
    // B. attention over the position + 1 rows.
    let len = (position + 1).min(a.max_seq);
    let scale = 1.0 / (d as f64).sqrt();
    let group = a.heads_q / a.heads_kv;
    let mut o = vec![0.0; a.attn_width()];
    for head in 0..a.heads_q {
        let kvh = head / group;
        let qh = &q[head * d..(head + 1) * d];
        let scores: Vec<f64> = (0..len)
            .map(|t| (0..d).map(|e| qh[e] * k[t * kv_w + kvh * d + e]).sum::<f64>() * scale)
            .collect();
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let sum: f64 = p.iter().sum();
        for e in 0..d {
            let acc: f64 = (0..len).map(|t| p[t] * v[t * kv_w + kvh * d + e]).sum();
            o[head * d + e] = if sum > 0.0 { round(acc / sum) } else { 0.0 };
        }
    }
    // C. x1 = x + o_proj(o).
    let x1: Vec<f64> = dots(o_w, &o, h).iter().zip(x).map(|(s, x)| round(s + x)).collect();
    // D. act = silu(g) · round(u).
    let (x1n, inv) = normed(&x1, mlp_norm);
    let (g, u) = (dots(gate_w, &x1n, a.ffn), dots(up_w, &x1n, a.ffn));
    let act: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| {
            let g = g * inv;
            round(g / (1.0 + (-g).exp()) * round(u * inv))
        })
        .collect();
    // E. y = x1 + down(act).
    dots(down_w, &act, h).iter().zip(&x1).map(|(s, x)| round(s + x)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launch_takes_small_llama_layers_and_says_why_not_others() {
        // SmolLM2-135M and Llama-3.2-1B.
        assert_eq!(DecodeLayerArgs::new(576, 9, 3, 64, 1536, 1e-5, 8192).refusal(), None);
        assert_eq!(DecodeLayerArgs::new(2048, 32, 8, 64, 8192, 1e-5, 8192).refusal(), None);
        // Llama-3.1-8B's MLP input does not fit the shared memory a launch gets.
        let b8 = DecodeLayerArgs::new(4096, 32, 8, 128, 14336, 1e-5, 8192).refusal().unwrap();
        assert!(b8.contains("14336 elements"), "{b8}");
        let odd = DecodeLayerArgs::new(576, 9, 3, 80, 1536, 1e-5, 64).refusal().unwrap();
        assert!(odd.contains("head dim 80"), "{odd}");
        let gqa = DecodeLayerArgs::new(576, 9, 2, 64, 1536, 1e-5, 64).refusal().unwrap();
        assert!(gqa.contains("9 query heads"), "{gqa}");
        assert!(DecodeLayerArgs::new(578, 9, 3, 64, 1536, 1e-5, 64).refusal().is_some());
    }

    #[test]
    fn the_reference_appends_its_row_and_attends_to_the_cache() {
        // One head of dim 32 (no rotation: position outside 1-row tables), hidden 32, ffn 8, every
        // weight zero but the V projection (identity): q = k = 0, so attention averages V's rows;
        // o_proj is zero, so x1 = x; the MLP is zero, so y = x.
        let a = DecodeLayerArgs::new(32, 1, 1, 32, 8, 1e-5, 4);
        let x: Vec<f64> = (0..32).map(|i| i as f64 / 8.0 - 2.0).collect();
        let mut qkv = vec![0.0; 96 * 32];
        for i in 0..32 {
            qkv[(64 + i) * 32 + i] = 1.0;
        }
        let ones = vec![1.0; 32];
        let zeros = |n| vec![0.0; n];
        let (o, g, u, dn) = (zeros(32 * 32), zeros(8 * 32), zeros(8 * 32), zeros(32 * 8));
        let (cos, sin) = (vec![1.0; 16], vec![0.0; 16]);
        let mut k = zeros(4 * 32);
        let mut v: Vec<f64> = (0..4 * 32).map(|i| i as f64).collect();
        let w = [&ones[..], &qkv, &o, &ones, &g, &u, &dn];
        let y = reference(&a, &x, w, &cos, &sin, 1, &mut k, &mut v, |v| v);
        assert_eq!(y, x);
        // Position 1 is outside the one-position tables: nothing appended.
        assert!(v[32..64].iter().enumerate().all(|(i, &e)| e == (32 + i) as f64));
        // Inside the tables (two positions), V's row 1 becomes the normed x.
        let (cos, sin) = (vec![1.0; 32], vec![0.0; 32]);
        reference(&a, &x, w, &cos, &sin, 1, &mut k, &mut v, |v| v);
        let inv = 1.0 / (x.iter().map(|e| e * e).sum::<f64>() / 32.0 + 1e-5f32 as f64).sqrt();
        for i in 0..32 {
            assert!((v[32 + i] - x[i] * inv).abs() < 1e-12);
        }
    }
}
