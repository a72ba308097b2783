//! Ragged (THD) batches: sequences of different lengths packed back to back without padding, as a
//! `[total_tokens, h, d]` buffer. cuDNN reads them through per-tensor ragged offsets (i32, `b + 1`
//! entries, in elements) and per-sequence lengths; the attention's seq dim is then a bucket (the next
//! power of two of the longest sequence, as PyTorch rounds it) so that one plan serves every mix of
//! lengths up to it.
//!
//! What the host can check and what it cannot: [`RaggedBatch::new`] checks the lengths it is given
//! (none empty, offsets within i32) and gives the buffer length they need. Once the offsets and
//! lengths are on the device their values are out of the host's sight: a call can check only that
//! the offset buffers hold `b + 1` values and the length buffers `b`, not that the last offset fits
//! the Q/K/V/O buffers nor that the lengths agree with the offsets.

use crate::error::ensure;
use crate::Result;

/// The host side of a ragged batch for one tensor family (Q, K/V or O): per-sequence lengths,
/// element offsets in a token-major buffer (a token's `heads` heads of `head_dim` side by side,
/// tokens `row_stride` elements apart: `heads · head_dim` packed, wider where the family is a view
/// into rows of a fused QKV buffer), and the bucket the plan is keyed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaggedBatch {
    seq_lens: Vec<i32>,
    offsets: Vec<i32>,
    total_tokens: usize,
    bucket: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
}

impl RaggedBatch {
    /// Sequences of `lens` tokens, each token `heads · head_dim` elements, packed in order. Errors
    /// ([`Error::InvalidArgument`](crate::Error::InvalidArgument)): no sequences, an empty sequence
    /// (cuDNN takes zero-length sequences only from 9.25: refused here), zero heads or head dim, or a
    /// batch whose element count (or bucket) does not fit the i32 offsets.
    pub fn new(lens: &[usize], heads: usize, head_dim: usize) -> Result<Self> {
        Self::strided(lens, heads, head_dim, heads.saturating_mul(head_dim))
    }

    /// The same with tokens `row_stride` elements apart (at least `heads · head_dim`): sequence `i`
    /// starts at element `row_stride ·` (the tokens before it), e.g. the Q heads of fused QKV rows
    /// of `(h_q + 2·h_kv)·d` elements. Errors as [`RaggedBatch::new`], and a stride narrower than a
    /// token's heads.
    pub fn strided(lens: &[usize], heads: usize, head_dim: usize, row_stride: usize) -> Result<Self> {
        ensure!(!lens.is_empty(), "ragged batch: no sequences");
        ensure!(heads > 0 && head_dim > 0, "ragged batch: heads {heads} and head_dim {head_dim} must be > 0");
        let token = heads.checked_mul(head_dim).filter(|&t| t <= i32::MAX as usize);
        let Some(token) = token else {
            return Err(crate::Error::invalid(format!(
                "ragged batch: a token of {heads} x {head_dim} elements does not fit i32 offsets"
            )));
        };
        ensure!(
            row_stride >= token,
            "ragged batch: a row stride of {row_stride} elements is narrower than a token's {token}"
        );
        let mut offsets = Vec::with_capacity(lens.len() + 1);
        offsets.push(0i32);
        let mut total = 0usize;
        for (i, &len) in lens.iter().enumerate() {
            ensure!(
                len > 0,
                "ragged batch: sequence {i} is empty (zero-length sequences need cuDNN 9.25; not taken here)"
            );
            total = total.saturating_add(len);
            let end = total.checked_mul(row_stride).and_then(|e| i32::try_from(e).ok());
            let Some(end) = end else {
                return Err(crate::Error::invalid(format!(
                    "ragged batch: {total} tokens {row_stride} elements apart pass the i32 offsets (sequence {i})"
                )));
            };
            offsets.push(end);
        }
        let longest = lens.iter().copied().max().unwrap_or(1);
        let bucket = longest.checked_next_power_of_two().filter(|&b| b <= i32::MAX as usize);
        let Some(bucket) = bucket else {
            return Err(crate::Error::invalid(format!(
                "ragged batch: the bucket of a {longest}-token sequence does not fit i32"
            )));
        };
        // Each length fits i32: it is at most the total, whose elements fit.
        let seq_lens = lens.iter().map(|&l| l as i32).collect();
        Ok(RaggedBatch { seq_lens, offsets, total_tokens: total, bucket, heads, head_dim, row_stride })
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.seq_lens.len()
    }

    /// Per-sequence token counts (the device `seq_len` tensor's values).
    pub fn seq_lens(&self) -> &[i32] {
        &self.seq_lens
    }

    /// `batch + 1` element offsets: sequence `i`'s tokens start at `offsets[i]`, `row_stride` apart
    /// (packed: it spans `offsets[i]..offsets[i + 1]`).
    pub fn offsets(&self) -> &[i32] {
        &self.offsets
    }

    /// Tokens of all sequences together.
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// The next power of two of the longest sequence: the seq dim (capacity) of the plan.
    pub fn bucket(&self) -> usize {
        self.bucket
    }

    /// Heads of a token.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Head dim.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Elements between consecutive tokens.
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// Elements a buffer needs to hold every token: the last token's start plus its heads,
    /// `(total_tokens - 1) · row_stride + heads · head_dim` (packed: `total_tokens · heads · head_dim`).
    pub fn buffer_len(&self) -> usize {
        // The last offset, which `strided` checked to fit i32, less the stride plus a token.
        self.offsets[self.batch()] as usize - self.row_stride + self.heads * self.head_dim
    }

    /// Strides of the logical `[batch, heads, bucket, head_dim]` dims over a token-major buffer: a
    /// token's heads side by side, tokens `row_stride` apart; the batch stride (a padded sequence's
    /// extent) is what cuDNN replaces by the offsets.
    pub fn strides(&self) -> [usize; 4] {
        [self.bucket * self.row_stride, self.head_dim, self.row_stride, 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_lengths_and_bucket() {
        let b = RaggedBatch::new(&[100, 700, 3, 257], 8, 128).unwrap();
        let t = 8 * 128;
        assert_eq!(b.batch(), 4);
        assert_eq!(b.seq_lens(), &[100, 700, 3, 257]);
        assert_eq!(b.offsets(), &[0, 100 * t, 800 * t, 803 * t, 1060 * t]);
        assert_eq!((b.total_tokens(), b.buffer_len()), (1060, 1060 * t as usize));
        assert_eq!(b.bucket(), 1024);
        assert_eq!(b.strides(), [1024 * 1024, 128, 1024, 1]);
        // A power of two is its own bucket; one token buckets to 1.
        assert_eq!(RaggedBatch::new(&[512, 2], 1, 8).unwrap().bucket(), 512);
        assert_eq!(RaggedBatch::new(&[1], 1, 8).unwrap().bucket(), 1);
        // Two compositions of one bucket: the plan key (the bucket) is the same.
        let other = RaggedBatch::new(&[600, 600, 600, 600], 8, 128).unwrap();
        assert_eq!(other.bucket(), b.bucket());
    }

    #[test]
    fn bad_batches_are_refused() {
        let err = |lens: &[usize], h: usize, d: usize| match RaggedBatch::new(lens, h, d) {
            Err(e @ crate::Error::InvalidArgument(_)) => e.to_string(),
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        assert!(err(&[], 8, 64).contains("no sequences"));
        assert!(err(&[5, 0, 3], 8, 64).contains("sequence 1 is empty"));
        assert!(err(&[5], 0, 64).contains("must be > 0"));
        assert!(err(&[5], 8, 0).contains("must be > 0"));
        // 2^31 elements: one past the i32 offsets, in the last sequence.
        let e = err(&[1 << 20, 1 << 20], 16, 64);
        assert!(e.contains("pass the i32 offsets") && e.contains("sequence 1"), "{e}");
        assert!(err(&[1], 1 << 20, 1 << 12).contains("does not fit i32"));
        // Huge lengths saturate rather than wrap.
        assert!(err(&[usize::MAX, usize::MAX], 1, 8).contains("pass the i32 offsets"));
        // Tokens wider apart than their heads: offsets scale with the stride, the buffer ends at the
        // last token's heads.
        let fused = RaggedBatch::strided(&[3, 2], 2, 8, 48).unwrap();
        assert_eq!(fused.offsets(), &[0, 3 * 48, 5 * 48]);
        assert_eq!((fused.buffer_len(), fused.strides()), (4 * 48 + 16, [4 * 48, 8, 48, 1]));
        assert_eq!((fused.heads(), fused.head_dim(), fused.row_stride()), (2, 8, 48));
        let e = RaggedBatch::strided(&[3], 2, 8, 15).unwrap_err().to_string();
        assert!(e.contains("narrower than a token's 16"), "{e}");
        // The largest batch that fits.
        let b = RaggedBatch::new(&[(i32::MAX as usize) / 8], 1, 8).unwrap();
        assert_eq!(b.buffer_len(), (i32::MAX as usize) / 8 * 8);
    }
}
