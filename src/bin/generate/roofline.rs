//! The memory floor of decode steps: what one step must read from device memory at least (every
//! weight once, one embedding row, and the keys and values attended to), over a measured bandwidth.

use llama::LlamaConfig;

/// The bytes the decode steps of one generation must read, and the time that takes at a bandwidth.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeFloor {
    /// Weight bytes one step reads: every layer's weights, the final norm, `lm_head` (the embedding
    /// when tied) and one embedding row.
    pub weight_bytes: u64,
    /// KV-cache bytes all the steps read together: step `i` (after a prompt of `p`) attends to `p + i + 1`
    /// keys and values in every layer.
    pub kv_bytes: u64,
    /// Steps.
    pub steps: usize,
    /// Bytes per second the floor assumes.
    pub bytes_per_s: f64,
}

impl DecodeFloor {
    /// The floor of `steps` decode steps after `prompt` tokens, with `elem`-byte values, at
    /// `bandwidth_gbps` GB/s.
    pub fn new(cfg: &LlamaConfig, elem: usize, prompt: usize, steps: usize, bandwidth_gbps: f64) -> Self {
        let layer = 2 * cfg.hidden
            + cfg.hidden * cfg.qkv_width()
            + cfg.attn_width() * cfg.hidden
            + 3 * cfg.hidden * cfg.ffn;
        let values = cfg.layers * layer + cfg.hidden + cfg.vocab * cfg.hidden + cfg.hidden;
        let kv_row = (2 * cfg.layers * cfg.kv_heads * cfg.head_dim * elem) as u64;
        // Σ over steps of (prompt + i + 1) attended positions.
        let positions: u64 = (0..steps).map(|i| (prompt + i + 1) as u64).sum();
        DecodeFloor {
            weight_bytes: (values * elem) as u64,
            kv_bytes: kv_row * positions,
            steps,
            bytes_per_s: bandwidth_gbps * 1e9,
        }
    }

    /// Mean KV bytes per step.
    pub fn mean_kv_bytes(&self) -> f64 {
        self.kv_bytes as f64 / self.steps.max(1) as f64
    }

    /// The floor of all the steps, ms.
    pub fn total_ms(&self) -> f64 {
        (self.weight_bytes as f64 * self.steps as f64 + self.kv_bytes as f64) / self.bytes_per_s * 1e3
    }

    /// The floor of a mean step, ms.
    pub fn mean_step_ms(&self) -> f64 {
        self.total_ms() / self.steps.max(1) as f64
    }

    /// The floor over the measured time of the steps (1 is at the roofline).
    pub fn fraction(&self, measured_ms: f64) -> f64 {
        self.total_ms() / measured_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_1b_floor_counts_each_weight_once_and_the_attended_cache() {
        let cfg = LlamaConfig::llama_3_2_1b();
        // Tied embeddings: the parameter count already holds the table once (read as lm_head); plus
        // one embedding row.
        let f = DecodeFloor::new(&cfg, 2, 100, 4, 2000.0);
        assert_eq!(f.weight_bytes, 2 * (cfg.parameters() + cfg.hidden) as u64);
        // 16 layers × K and V × 8 heads × 64 × 2 bytes = 32 KiB a position; steps attend 101..=104.
        assert_eq!(f.kv_bytes, 32768 * (101 + 102 + 103 + 104));
        let ms = (4.0 * f.weight_bytes as f64 + f.kv_bytes as f64) / 2e12 * 1e3;
        assert!((f.total_ms() - ms).abs() < 1e-12);
        assert!((f.mean_step_ms() - ms / 4.0).abs() < 1e-12);
        assert!((f.fraction(2.0 * ms) - 0.5).abs() < 1e-12);
        // Untied (8B): lm_head is read, the embedding table is not (one row only).
        let b8 = LlamaConfig::llama_3_1_8b();
        let f = DecodeFloor::new(&b8, 2, 0, 1, 1000.0);
        assert_eq!(f.weight_bytes, 2 * (b8.parameters() - b8.vocab * b8.hidden + b8.hidden) as u64);
    }
}
