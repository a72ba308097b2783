//! The host side of a cache: its shape, the rows a step reads, and per-sequence lengths. Everything
//! here is checked without a GPU.

use crate::error::ensure;
use crate::ops::rope::RopeArgs;
use crate::ops::sdpa::{Layout, SdpaArgs};
use crate::{checked, Mask, Result};

/// Shape of a [`KvCache`](super::KvCache): per layer, one K and one V buffer of
/// `[batch, max_seq, heads_kv · head_dim]` elements, row `p` of sequence `b` holding the K (or V)
/// heads of the token at position `p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct KvCacheShape {
    /// Decoder layers (one K and one V buffer each).
    pub layers: usize,
    /// Sequences.
    pub batch: usize,
    /// Rows (positions) per sequence.
    pub max_seq: usize,
    /// K/V heads.
    pub heads_kv: usize,
    /// Head dim (a multiple of 8, as attention needs).
    pub head_dim: usize,
}

impl KvCacheShape {
    /// Checks the shape: every count > 0, positions and sequences fit the kernels' i32 values, the
    /// head dim a multiple of 8, and a layer's buffer addressable with i64 offsets.
    pub fn new(
        layers: usize,
        batch: usize,
        max_seq: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let s = KvCacheShape { layers, batch, max_seq, heads_kv, head_dim };
        ensure!(
            layers > 0 && batch > 0 && max_seq > 0 && heads_kv > 0 && head_dim > 0,
            "kv cache: empty shape {s:?}"
        );
        ensure!(head_dim.is_multiple_of(8), "kv cache: head dim {head_dim} is not a multiple of 8");
        for (name, v) in [("batch", batch), ("max_seq", max_seq)] {
            ensure!(v <= i32::MAX as usize, "kv cache: {name} {v} exceeds the device lengths' i32");
        }
        // Every offset the kernels and cuDNN compute into a layer's buffer stays below its bytes.
        checked::product(
            "kv cache: batch * max_seq * heads_kv * head_dim",
            &[batch, max_seq, heads_kv, head_dim],
        )?;
        Ok(s)
    }

    /// Elements of a cache row: `heads_kv · head_dim`.
    pub fn row_width(&self) -> usize {
        self.heads_kv * self.head_dim
    }

    /// Elements of one layer's K (or V) buffer: `batch · max_seq · heads_kv · head_dim`.
    pub fn layer_len(&self) -> usize {
        self.batch * self.max_seq * self.row_width()
    }

    /// Strides of a layer's K and V buffers over attention's logical `[b, h_kv, s_kv, d]` dims:
    /// `[max_seq · h_kv · d, d, h_kv · d, 1]` (BSHD storage with the whole cache as the sequence
    /// stride), whatever `s_kv` (the keys read) is.
    pub fn kv_strides(&self) -> [usize; 4] {
        let w = self.row_width();
        [self.max_seq * w, self.head_dim, w, 1]
    }

    /// The attention of `seq` new queries per sequence (rows as `rows` says) over the first
    /// `len + seq` cache rows of every sequence, O packed `[batch · seq, heads_q · d]`: a top-left causal
    /// mask for a prefill (`len == 0`), bottom-right aligned over the cache after (a single query runs
    /// unmasked). This is the per-length form: one plan per `len + seq`.
    pub fn attention(&self, rows: QkvRows, len: usize, seq: usize) -> SdpaArgs {
        let (b, hq, hkv, d) = (self.batch, rows.heads_q, self.heads_kv, self.head_dim);
        let mask = if len == 0 { Mask::CausalTopLeft } else { Mask::CausalBottomRight };
        let mut a = SdpaArgs::new(b, hq, hkv, seq, len.saturating_add(seq), d, Layout::Bshd).with_mask(mask);
        a.q_strides = rows.q_strides(seq, d);
        (a.k_strides, a.v_strides) = (self.kv_strides(), self.kv_strides());
        if let Some(s) = rows.scale {
            a = a.with_scale(s);
        }
        a
    }
}

/// Where a step's tokens are in a fused QKV buffer, and the attention scale: one row per token
/// (batch-major, `seq` rows per sequence), `row_stride` elements apart, the `heads_q` Q heads first,
/// then the cache's K heads, then its V heads, each `head_dim` wide. Attention reads Q through strides
/// (`[seq · row_stride, d, row_stride, 1]` over `[b, h_q, s, d]`) and writes O packed.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct QkvRows {
    /// Query heads (a multiple of the cache's K/V heads).
    pub heads_q: usize,
    /// Elements between consecutive tokens.
    pub row_stride: usize,
    /// Scale of the scores; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
}

impl QkvRows {
    /// `heads_q` Q heads at the start of rows `row_stride` apart; the default scale.
    pub fn new(heads_q: usize, row_stride: usize) -> Self {
        QkvRows { heads_q, row_stride, scale: None }
    }

    /// A packed QKV projection's output for `shape`: rows of `(heads_q + 2 · heads_kv) · head_dim`.
    pub fn packed(heads_q: usize, shape: &KvCacheShape) -> Self {
        QkvRows::new(heads_q, (heads_q + 2 * shape.heads_kv) * shape.head_dim)
    }

    /// With an explicit attention scale.
    pub fn with_scale(self, scale: f32) -> Self {
        QkvRows { scale: Some(scale), ..self }
    }

    /// RoPE's arguments for `seq` of these rows per sequence of `batch`, with `heads_kv` K/V heads of
    /// `head_dim` after the Q heads, each sequence from position 0.
    pub(crate) fn rope_args(&self, batch: usize, seq: usize, heads_kv: usize, head_dim: usize) -> RopeArgs {
        let QkvRows { heads_q, row_stride, .. } = *self;
        RopeArgs { batch, seq, heads_q, heads_kv, head_dim, row_stride, start: 0 }
    }

    /// Where the K and the V heads start in each row, `(heads_q · d, (heads_q + heads_kv) · d)`, for a
    /// step that attends over its own rows; an error where a row cannot hold Q, K and V (`row_stride <
    /// (heads_q + 2 · heads_kv) · head_dim`, or that width overflowing).
    pub(crate) fn kv_starts(&self, heads_kv: usize, head_dim: usize) -> Result<(usize, usize)> {
        let what = "paged cache: (heads_q + 2 * heads_kv) * head_dim";
        let kv = checked::mul(what, 2, heads_kv)?;
        let width = checked::mul(what, checked::add(what, self.heads_q, kv)?, head_dim)?;
        ensure!(
            self.row_stride >= width,
            "paged cache: rows of {} elements hold no K and V after {} Q heads",
            self.row_stride,
            self.heads_q
        );
        // Both below `width`, which did not overflow.
        Ok((self.heads_q * head_dim, (self.heads_q + heads_kv) * head_dim))
    }

    /// Strides of Q over `[b, h_q, seq, d]`.
    pub fn q_strides(&self, seq: usize, head_dim: usize) -> [usize; 4] {
        [seq.saturating_mul(self.row_stride), head_dim, self.row_stride, 1]
    }
}

/// What a step uploads: per sequence, the first position it writes, the keys it attends to and its
/// query count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepValues {
    pub(crate) positions: Vec<i32>,
    pub(crate) kv_lens: Vec<i32>,
    pub(crate) q_lens: Vec<i32>,
}

/// Per-sequence cached lengths and the step begun (new tokens per sequence, not yet counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lens {
    lens: Vec<usize>,
    max_seq: usize,
    step: Option<usize>,
}

impl Lens {
    pub(crate) fn new(batch: usize, max_seq: usize) -> Self {
        Lens { lens: vec![0; batch], max_seq, step: None }
    }

    pub(crate) fn get(&self) -> &[usize] {
        &self.lens
    }

    /// Begins a step of `seq` new tokens per sequence, each written from its own length on; what to
    /// upload. An unfinished step is dropped (nothing of it was counted).
    pub(crate) fn begin(&mut self, seq: usize) -> Result<StepValues> {
        let values = self.values(seq)?;
        self.step = Some(seq);
        Ok(values)
    }

    /// The device values of a step of `seq` tokens (an error where a sequence has no room), without
    /// beginning it.
    pub(crate) fn values(&self, seq: usize) -> Result<StepValues> {
        ensure!(seq > 0, "kv cache: a step of no tokens");
        for (b, &len) in self.lens.iter().enumerate() {
            let end = checked::add("kv cache: length + new tokens", len, seq)?;
            ensure!(
                end <= self.max_seq,
                "kv cache: sequence {b} holds {len} of {} rows, no room for {seq} more",
                self.max_seq
            );
        }
        // Each value is at most max_seq, which fits i32 (KvCacheShape::new).
        let i = |v: usize| v as i32;
        let values = StepValues {
            positions: self.lens.iter().map(|&l| i(l)).collect(),
            kv_lens: self.lens.iter().map(|&l| i(l + seq)).collect(),
            q_lens: vec![i(seq); self.lens.len()],
        };
        Ok(values)
    }

    /// New tokens per sequence of the step begun.
    pub(crate) fn step(&self) -> Result<usize> {
        self.step.ok_or_else(|| crate::Error::invalid("kv cache: no step begun (call KvCache::begin first)"))
    }

    /// Counts the step's tokens.
    pub(crate) fn finish(&mut self) -> Result<usize> {
        let seq = self.step()?;
        for l in &mut self.lens {
            *l += seq; // begin checked len + seq <= max_seq
        }
        self.step = None;
        Ok(seq)
    }

    /// Keeps the first `lens[b]` rows of sequence `b` (each at most what it holds); drops a step begun.
    pub(crate) fn truncate(&mut self, lens: &[usize]) -> Result<()> {
        ensure!(
            lens.len() == self.lens.len(),
            "kv cache: {} lengths for {} sequences",
            lens.len(),
            self.lens.len()
        );
        for (b, (&new, &old)) in lens.iter().zip(&self.lens).enumerate() {
            ensure!(
                new <= old,
                "kv cache: sequence {b} holds {old} rows, cannot grow to {new} by truncating"
            );
        }
        self.lens.copy_from_slice(lens);
        self.step = None;
        Ok(())
    }

    /// Keeps at most `len` rows of every sequence; drops a step begun.
    pub(crate) fn truncate_each(&mut self, len: usize) {
        for l in &mut self.lens {
            *l = (*l).min(len);
        }
        self.step = None;
    }

    /// Forgets every cached token and the step begun.
    pub(crate) fn clear(&mut self) {
        self.lens.iter_mut().for_each(|l| *l = 0);
        self.step = None;
    }

    /// The length every sequence holds, when they all hold the same.
    pub(crate) fn uniform(&self) -> Option<usize> {
        let first = *self.lens.first()?;
        self.lens.iter().all(|&l| l == first).then_some(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::sdpa::SdpaLens;

    #[test]
    fn rows_that_hold_no_k_and_v_are_refused_without_overflow() {
        let rows = QkvRows::new(32, 48 * 64);
        assert_eq!(rows.kv_starts(8, 64).unwrap(), (32 * 64, 40 * 64));
        for (rows, expected) in [
            (QkvRows::new(32, 48 * 64 - 1), "hold no K and V after 32 Q heads"),
            // A width that wraps would pass the stride check and slice K past the rows.
            (QkvRows::new(usize::MAX, 48 * 64), "overflows"),
            (QkvRows::new(usize::MAX / 64, usize::MAX), "overflows"),
        ] {
            let e = rows.kv_starts(8, 64).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
    }

    /// Llama-3.2-1B: 16 layers, 8 K/V heads of 64, 32 query heads.
    fn shape() -> KvCacheShape {
        KvCacheShape::new(16, 2, 256, 8, 64).unwrap()
    }

    #[test]
    fn shapes_are_checked() {
        let s = shape();
        assert_eq!((s.row_width(), s.layer_len()), (512, 2 * 256 * 512));
        for (bad, expected) in [
            (KvCacheShape::new(0, 2, 256, 8, 64), "empty shape"),
            (KvCacheShape::new(16, 2, 256, 8, 60), "multiple of 8"),
            (KvCacheShape::new(16, 2, 1 << 31, 8, 64), "max_seq 2147483648 exceeds"),
            (KvCacheShape::new(16, 1 << 31, 2, 8, 64), "batch 2147483648 exceeds"),
            (KvCacheShape::new(16, 1 << 30, 1 << 30, 1 << 30, 64), "overflows"),
            (KvCacheShape::new(16, 1 << 20, 1 << 20, 1 << 17, 64), "64-bit signed"),
        ] {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
    }

    #[test]
    fn attention_reads_the_cache_through_documented_strides() {
        let s = shape();
        let rows = QkvRows::packed(32, &s);
        assert_eq!(rows.row_stride, (32 + 16) * 64);
        assert_eq!(s.kv_strides(), [256 * 512, 64, 512, 1]);
        // A prefill of 5 tokens: top-left causal over 5 keys; a decode step after 5: one query over 6.
        let prefill = s.attention(rows, 0, 5);
        assert_eq!((prefill.seq_q, prefill.seq_kv, prefill.mask), (5, 5, Mask::CausalTopLeft));
        assert_eq!(prefill.q_strides, [5 * rows.row_stride, 64, rows.row_stride, 1]);
        assert_eq!(prefill.o_strides, Layout::Bshd.strides(32, 5, 64));
        let decode = s.attention(rows, 5, 1);
        assert_eq!((decode.seq_q, decode.seq_kv, decode.normalized().mask), (1, 6, Mask::None));
        assert_eq!(decode.k_strides, s.kv_strides());
        assert_eq!(s.attention(rows.with_scale(0.5), 5, 1).scale(), 0.5);
        // The cache's buffers are long enough for any length up to max_seq; Q and O for the step (Q
        // ends with the last row's Q heads).
        let q = 9 * rows.row_stride + 32 * 64;
        let lens = |q| SdpaLens { q, k: s.layer_len(), v: s.layer_len(), o: 2 * 5 * 32 * 64, stats: None };
        s.attention(rows, 251, 5).check(lens(q)).unwrap();
        assert!(s.attention(rows, 0, 5).check(lens(q - 1)).is_err());
        assert!(s.attention(QkvRows::packed(12, &s), 0, 5).check(lens(q)).is_err(), "12 % 8 heads");
    }

    #[test]
    fn steps_write_at_each_sequences_own_position() {
        let mut l = Lens::new(3, 8);
        assert!(l.step().is_err() && l.finish().is_err(), "no step begun");
        let v = l.begin(4).unwrap();
        assert_eq!(v, StepValues { positions: vec![0; 3], kv_lens: vec![4; 3], q_lens: vec![4; 3] });
        assert_eq!(l.get(), &[0, 0, 0], "a step counts when finished");
        assert_eq!(l.finish().unwrap(), 4);
        assert_eq!((l.get(), l.uniform()), (&[4, 4, 4][..], Some(4)));
        // Prompts of 2, 4 and 3 tokens padded to 4: keep each one's own length.
        l.truncate(&[2, 4, 3]).unwrap();
        assert_eq!(l.uniform(), None);
        let v = l.begin(1).unwrap();
        assert_eq!(v, StepValues { positions: vec![2, 4, 3], kv_lens: vec![3, 5, 4], q_lens: vec![1; 3] });
        l.finish().unwrap();
        assert_eq!(l.get(), &[3, 5, 4]);
        // Room is checked per sequence; a refused step changes nothing.
        let e = l.begin(4).unwrap_err().to_string();
        assert!(e.contains("sequence 1 holds 5 of 8 rows, no room for 4"), "{e}");
        assert!(l.step().is_err());
        assert!(l.begin(0).is_err());
        // truncate_each keeps at most a length of every sequence and drops a step begun.
        l.begin(1).unwrap();
        l.truncate_each(4);
        assert_eq!((l.get(), l.step().is_err()), (&[3, 4, 4][..], true));
        l.truncate_each(9);
        assert_eq!(l.get(), &[3, 4, 4]);
        for (bad, expected) in [(&[1, 1][..], "2 lengths for 3"), (&[4, 5, 4][..], "sequence 0 holds 3 rows")]
        {
            let e = l.truncate(bad).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        // Truncating or clearing drops a step begun.
        l.begin(3).unwrap();
        l.clear();
        assert!(l.step().is_err());
        assert_eq!((l.get(), l.uniform()), (&[0, 0, 0][..], Some(0)));
        assert!(matches!(Lens::new(1, 4).begin(usize::MAX).unwrap_err(), crate::Error::InvalidArgument(_)));
    }
}
