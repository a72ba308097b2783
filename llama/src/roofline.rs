//! The memory floor of a decode step: one token per sequence reads every weight once (the embedding
//! only for its rows) and every cached K/V row once, so no step can beat those bytes over the device's
//! copy bandwidth.

use crate::config::LlamaConfig;

/// Bytes a decode step must read, and what they say about a measured step time.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct DecodeRoofline {
    /// Weight bytes read per step: every layer, the final norm, `lm_head` (the embedding when tied)
    /// and one embedding row per sequence.
    pub weight_bytes: u64,
    /// K and V bytes read per step: every cached row of every layer, the new one included.
    pub kv_bytes: u64,
}

impl DecodeRoofline {
    /// The bytes of a step of `batch` sequences that hold `cached` tokens each before it, with
    /// `elem` bytes per weight and cache element.
    pub fn new(cfg: &LlamaConfig, batch: usize, cached: usize, elem: usize) -> Self {
        let (e, b) = (elem as u64, batch as u64);
        let table = (cfg.vocab * cfg.hidden) as u64;
        // parameters() counts the embedding and lm_head (once when tied): the untied embedding is
        // read only for the batch's rows.
        let untied_embed = if cfg.tie_embeddings { 0 } else { table };
        let weights = cfg.parameters() as u64 - untied_embed + b * cfg.hidden as u64;
        let kv_row = 2 * (cfg.kv_heads * cfg.head_dim) as u64;
        let kv = cfg.layers as u64 * b * (cached as u64 + 1) * kv_row;
        DecodeRoofline { weight_bytes: weights * e, kv_bytes: kv * e }
    }

    /// [`DecodeRoofline::new`] for a model whose layer projections are FP8 codes with one f32 factor
    /// per output channel ([`Llama::quantize_to_fp8`](crate::Llama::quantize_to_fp8)), everything else (embedding,
    /// `lm_head`, norms, K/V cache) `elem` bytes an element.
    pub fn fp8(cfg: &LlamaConfig, batch: usize, cached: usize, elem: usize) -> Self {
        let all = DecodeRoofline::new(cfg, batch, cached, elem);
        let (h, layers) = (cfg.hidden as u64, cfg.layers as u64);
        let outputs = cfg.qkv_width() as u64 + h + 3 * cfg.ffn as u64;
        let linear =
            layers * (h * cfg.qkv_width() as u64 + cfg.attn_width() as u64 * h + 3 * h * cfg.ffn as u64);
        let weight_bytes = all.weight_bytes - linear * elem as u64 + linear + layers * outputs * 4;
        DecodeRoofline { weight_bytes, ..all }
    }

    /// All bytes read.
    pub fn bytes(&self) -> u64 {
        self.weight_bytes + self.kv_bytes
    }

    /// The fastest possible step in ms at `copy_gbps`: GB/s of a large device-to-device copy measured
    /// on the same GPU, counting bytes read and written (a copy moves each byte twice, a decode step's
    /// reads once, so this is the rate at which the GPU moves bytes through its memory).
    pub fn floor_ms(&self, copy_gbps: f64) -> f64 {
        self.bytes() as f64 / (copy_gbps * 1e9) * 1e3
    }

    /// The floor as a fraction of a measured step (1.0 = at the roofline).
    pub fn fraction(&self, step_ms: f64, copy_gbps: f64) -> f64 {
        self.floor_ms(copy_gbps) / step_ms
    }
}

/// What bounds a measured step of `step_ms` against its memory floor of `floor_ms`
/// ([`DecodeRoofline::floor_ms`]) when its bytes do not, for reports; `None` at [`BYTES_BOUND`] of
/// the floor or more. Below it, the time above the floor is the step's chain of kernels (each one's
/// latency: waiting for the one before, reading its input, reducing, writing), which `kernels` (the
/// kernels a replayed step launches, or why they are not known) puts a number on. Under half the
/// floor the step is bound by its kernels; between half and [`BYTES_BOUND`], partly.
pub fn bound(floor_ms: f64, step_ms: f64, kernels: Result<usize, String>) -> Option<String> {
    let f = floor_ms / step_ms;
    if f >= BYTES_BOUND {
        return None;
    }
    let above_us = (step_ms - floor_ms) * 1e3;
    let how = if f < 0.5 { "bound by its kernels" } else { "partly bound by its kernels" };
    let count = match kernels {
        Ok(k) => format!("{k} kernels a step, {:.2} us each above the floor", above_us / k.max(1) as f64),
        Err(e) => format!("its kernels are not counted: {e}"),
    };
    Some(format!(
        "the step is {how} and the gaps between them, not by its bytes: {above_us:.1} us a step above the \
         {:.1} us floor ({count})",
        floor_ms * 1e3
    ))
}

/// The fraction of the floor from which a step counts as bound by its bytes
/// ([`bound`]): Llama-3.1-8B's step replays at 86-88% of it on an H200.
pub const BYTES_BOUND: f64 = 0.8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_far_from_its_floor_says_its_kernels_bound_it() {
        // SmolLM2-135M's shapes: 0.28 GB, 0.067 ms at 4231 GB/s; its step replays in 0.592 ms.
        let r = DecodeRoofline::new(&LlamaConfig::smollm2_135m(), 1, 545, 2);
        let floor = r.floor_ms(4231.0);
        assert!((floor - 0.067).abs() < 0.001, "{floor}");
        let line = bound(floor, 0.592, Ok(184)).unwrap();
        assert!(line.starts_with("the step is bound by its kernels"), "{line}");
        assert!(
            line.contains("525.4 us a step above the 66.6 us floor (184 kernels a step, 2.86 us each"),
            "{line}"
        );
        let uncounted = bound(floor, 0.592, Err("no captured graph".into())).unwrap();
        assert!(uncounted.ends_with("(its kernels are not counted: no captured graph)"), "{uncounted}");
        // Between half and 80% of the floor: partly; from 80%: the bytes bound it, nothing to say.
        let half = bound(floor, floor / 0.63, Ok(100)).unwrap();
        assert!(half.starts_with("the step is partly bound by its kernels"), "{half}");
        assert_eq!(bound(floor, floor / 0.8, Ok(100)), None);
        assert_eq!(bound(floor, floor / 0.87, Ok(196)), None);
    }

    #[test]
    fn fp8_projections_halve_the_layers_bytes() {
        let cfg = LlamaConfig::llama_3_1_8b();
        let (bf, f8) = (DecodeRoofline::new(&cfg, 1, 512, 2), DecodeRoofline::fp8(&cfg, 1, 512, 2));
        // 32 layers of 218,103,808 projection weights: a byte each instead of two, plus 4 bytes of
        // factor per output row (6144 + 4096 + 3 · 14336 rows).
        let linear = 32 * 218_103_808u64;
        let factors = 32 * 4 * (6144 + 4096 + 3 * 14336u64);
        assert_eq!(bf.weight_bytes - f8.weight_bytes, linear - factors);
        assert_eq!(bf.kv_bytes, f8.kv_bytes);
    }

    #[test]
    fn eight_b_decode_reads_its_weights_once() {
        let cfg = LlamaConfig::llama_3_1_8b();
        let r = DecodeRoofline::new(&cfg, 1, 512, 2);
        // 8.03 B parameters less the 525 M-entry embedding table, plus one row; bf16.
        let weights = 8_030_261_248 - 128_256 * 4096 + 4096;
        assert_eq!(r.weight_bytes, 2 * weights);
        // 32 layers x 513 rows x (K + V) x 8 heads x 128 x 2 bytes.
        assert_eq!(r.kv_bytes, 32 * 513 * 2 * 1024 * 2);
        // At 4.2 TB/s: 15.08 GB -> 3.59 ms.
        let floor = r.floor_ms(4200.0);
        assert!((floor - 3.590).abs() < 0.001, "{floor}");
        assert!((r.fraction(2.0 * floor, 4200.0) - 0.5).abs() < 1e-12);
        // Tied embeddings (1B): the table is read once, as lm_head.
        let b1 = LlamaConfig::llama_3_2_1b();
        let r1 = DecodeRoofline::new(&b1, 2, 0, 2);
        assert_eq!(r1.weight_bytes, 2 * (1_235_814_400 + 2 * 2048));
    }
}
