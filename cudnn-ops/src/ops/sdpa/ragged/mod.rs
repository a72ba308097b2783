//! Ragged (THD) prefill attention ([`sdpa_ragged`]): the prompts of several sequences packed back to
//! back without padding, Q and O `[total_tokens, h_q, d]`, K and V `[total_tokens, h_kv, d]`, each
//! sequence attending to its own keys only (causal, or every key of the sequence).
//!
//! The fused backend runs cuDNN's composite attention graph with ragged offsets on Q, K, V and O and
//! the frontend's padding mask (`padding_mask=true`: per-sequence lengths compared with the row and
//! column indices, and the matmuls' M, N, K overridden by them), over a seq dim that is a bucket (a
//! capacity at least the longest sequence): one plan per (batch, bucket, heads, head dim, dtype,
//! mask) serves every mix of lengths up to the bucket. The number of sequences is part of the plan
//! (the graph's batch dim, as the frontend keys it): a server keeps a few batch sizes warm, as it does
//! for decode. The naive backend runs the naive attention once per sequence, as PyTorch eager loops
//! (or pads) a ragged batch.
//!
//! The offsets and lengths live in a [`DeviceRagged`] the op owns the buffers of: built from host
//! lengths (checked there), so every value cuDNN reads agrees with what the host checked the Q/K/V/O
//! buffers against.
//!
//! Tokens need not be packed: each tensor's tokens are [`RowStrides`] apart, so a decoder's fused
//! QKV rows (`(h_q + 2·h_kv)·d` elements: Q, K and V heads side by side) are read in place, Q, K and V
//! as views from their first head, the offsets scaled by the row stride (cuDNN's `t3hd` ragged
//! layout, generalized to grouped K/V heads); O is written packed.

mod batch;
mod fused;
mod naive;

pub use batch::RaggedBatch;

use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::Mask;
use crate::ops::Op;
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

/// Elements between consecutive tokens of each tensor of a ragged call (part of the plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RowStrides {
    /// Q's tokens.
    pub q: usize,
    /// K's and V's tokens.
    pub kv: usize,
    /// O's tokens.
    pub o: usize,
}

impl RowStrides {
    /// Packed Q, K, V and O: tokens `heads · head_dim` apart.
    pub fn packed(heads_q: usize, heads_kv: usize, head_dim: usize) -> Self {
        let (q, kv) = (heads_q.saturating_mul(head_dim), heads_kv.saturating_mul(head_dim));
        RowStrides { q, kv, o: q }
    }

    /// Q, K and V read in place in fused QKV rows of `(h_q + 2·h_kv)·d` elements (Q heads, then K,
    /// then V), O packed.
    pub fn fused_qkv(heads_q: usize, heads_kv: usize, head_dim: usize) -> Self {
        let row = heads_kv.saturating_mul(2).saturating_add(heads_q).saturating_mul(head_dim);
        RowStrides { q: row, kv: row, o: heads_q.saturating_mul(head_dim) }
    }
}

/// A ragged batch on the device: the element offsets of each sequence in the Q buffer (query
/// heads), in the K/V buffers (K/V heads) and in the O buffer, `batch + 1` i32 each (tokens as far
/// apart as [`RowStrides`] say), and the per-sequence lengths, `batch` i32, in one buffer (each part
/// 16-byte aligned) that is never handed out; plus the host's copy of them.
pub struct DeviceRagged {
    q: RaggedBatch,
    kv: RaggedBatch,
    o: RaggedBatch,
    buf: CudaSlice<i32>,
    part: usize,
}

impl DeviceRagged {
    /// Sequences of `lens` tokens (self-attention: as many keys as queries), Q and O with `heads_q`
    /// heads of `head_dim`, K and V with `heads_kv`, each packed: the offsets of every family and the
    /// lengths, uploaded. Errors as [`RaggedBatch::new`] (no sequences, an empty one, offsets past
    /// i32).
    pub fn new(
        ctx: &Cudnn,
        lens: &[usize],
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::strided(
            ctx,
            lens,
            (heads_q, heads_kv, head_dim),
            RowStrides::packed(heads_q, heads_kv, head_dim),
        )
    }

    /// The same with tokens `rows` apart (e.g. [`RowStrides::fused_qkv`]). Errors as
    /// [`RaggedBatch::strided`].
    pub fn strided(
        ctx: &Cudnn,
        lens: &[usize],
        (heads_q, heads_kv, head_dim): (usize, usize, usize),
        rows: RowStrides,
    ) -> Result<Self> {
        let q = RaggedBatch::strided(lens, heads_q, head_dim, rows.q)?;
        let kv = RaggedBatch::strided(lens, heads_kv, head_dim, rows.kv)?;
        let o = RaggedBatch::strided(lens, heads_q, head_dim, rows.o)?;
        let host = Self::host_values(&q, &kv, &o);
        let buf = ctx.stream().clone_htod(&host)?;
        let part = (q.batch() + 1).next_multiple_of(4);
        Ok(DeviceRagged { q, kv, o, buf, part })
    }

    /// What [`DeviceRagged::strided`] uploads: the Q, K/V and O offsets and the lengths, each part
    /// starting at a multiple of 4 values (16 bytes).
    fn host_values(q: &RaggedBatch, kv: &RaggedBatch, o: &RaggedBatch) -> Vec<i32> {
        let b = q.batch();
        let part = (b + 1).next_multiple_of(4);
        let mut host = vec![0i32; 3 * part + b];
        host[..=b].copy_from_slice(q.offsets());
        host[part..=part + b].copy_from_slice(kv.offsets());
        host[2 * part..=2 * part + b].copy_from_slice(o.offsets());
        host[3 * part..].copy_from_slice(q.seq_lens());
        host
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.q.batch()
    }

    /// Per-sequence token counts.
    pub fn seq_lens(&self) -> &[i32] {
        self.q.seq_lens()
    }

    /// The longest sequence.
    pub fn longest(&self) -> usize {
        self.seq_lens().iter().copied().max().unwrap_or(0) as usize
    }

    /// Tokens of all sequences together.
    pub fn total_tokens(&self) -> usize {
        self.q.total_tokens()
    }

    /// The next power of two of the longest sequence: the smallest bucket a call takes, and the one
    /// to use where nothing else fixes it.
    pub fn bucket(&self) -> usize {
        self.q.bucket()
    }

    /// The host side of the Q family (offsets in Q's elements).
    pub fn queries(&self) -> &RaggedBatch {
        &self.q
    }

    /// The host side of the K/V family (offsets in K's and V's elements).
    pub fn keys(&self) -> &RaggedBatch {
        &self.kv
    }

    /// The host side of the O family (offsets in O's elements).
    pub fn outputs(&self) -> &RaggedBatch {
        &self.o
    }

    /// Query heads and K/V heads of a token, and the head dim.
    pub fn heads(&self) -> (usize, usize, usize) {
        (self.q.heads(), self.kv.heads(), self.q.head_dim())
    }

    /// Elements between consecutive tokens of each tensor.
    pub fn rows(&self) -> RowStrides {
        RowStrides { q: self.q.row_stride(), kv: self.kv.row_stride(), o: self.o.row_stride() }
    }

    /// The device Q offsets, K/V offsets, O offsets and lengths.
    pub(crate) fn device(&self) -> [CudaView<'_, i32>; 4] {
        let (b, p) = (self.batch(), self.part);
        [
            self.buf.slice(0..b + 1),
            self.buf.slice(p..p + b + 1),
            self.buf.slice(2 * p..2 * p + b + 1),
            self.buf.slice(3 * p..3 * p + b),
        ]
    }
}

/// Shape and options of a ragged attention call: the plan is keyed by all of them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RaggedArgs {
    /// Number of sequences.
    pub batch: usize,
    /// The seq dim of the plan: a capacity no sequence may exceed. A power of two
    /// ([`DeviceRagged::bucket`]) makes every mix with the same longest-sequence bucket share a plan;
    /// a fixed larger one (e.g. the longest prompt a server takes) shares one plan for all mixes.
    pub bucket: usize,
    /// Query (and output) heads.
    pub heads_q: usize,
    /// Key/value heads; divides `heads_q`.
    pub heads_kv: usize,
    /// Head dim of Q, K and V; a multiple of 8.
    pub head_dim: usize,
    /// [`Mask::CausalTopLeft`] (prefill) or [`Mask::None`] (each sequence sees all its keys);
    /// [`Mask::CausalBottomRight`] is the top-left one here (each sequence has as many keys as
    /// queries).
    pub mask: Mask,
    /// Scale of the scores; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Elements between consecutive tokens of Q, K/V and O (the batch's [`DeviceRagged::rows`]).
    pub rows: RowStrides,
}

/// What identifies a ragged attention plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RaggedKey {
    /// `[batch, bucket, heads_q, heads_kv, head_dim]`.
    pub dims: [usize; 5],
    /// Elements between consecutive tokens of Q, K/V and O.
    pub rows: RowStrides,
    /// I/O dtype.
    pub dtype: DataType,
    /// Causal masking.
    pub mask: Mask,
}

impl RaggedArgs {
    /// Causal prefill of `batch` sequences of at most `bucket` tokens each, packed, default scale.
    pub fn new(batch: usize, bucket: usize, heads_q: usize, heads_kv: usize, head_dim: usize) -> Self {
        let rows = RowStrides::packed(heads_q, heads_kv, head_dim);
        RaggedArgs {
            batch,
            bucket,
            heads_q,
            heads_kv,
            head_dim,
            mask: Mask::CausalTopLeft,
            scale: None,
            rows,
        }
    }

    /// With tokens `rows` apart (e.g. [`RowStrides::fused_qkv`]).
    pub fn with_rows(self, rows: RowStrides) -> Self {
        RaggedArgs { rows, ..self }
    }

    /// With a mask.
    pub fn with_mask(self, mask: Mask) -> Self {
        RaggedArgs { mask, ..self }
    }

    /// With an explicit scale.
    pub fn with_scale(self, scale: f32) -> Self {
        RaggedArgs { scale: Some(scale), ..self }
    }

    /// The scale applied to the scores.
    pub fn scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// The same call with the bottom-right mask as the top-left one it equals here.
    pub fn normalized(self) -> Self {
        match self.mask {
            Mask::CausalBottomRight => RaggedArgs { mask: Mask::CausalTopLeft, ..self },
            _ => self,
        }
    }

    /// The plan-cache key (the scale is bound by value and is not part of it).
    pub fn key(&self, dtype: DataType) -> RaggedKey {
        let a = self.normalized();
        RaggedKey {
            dims: [a.batch, a.bucket, a.heads_q, a.heads_kv, a.head_dim],
            rows: a.rows,
            dtype,
            mask: a.mask,
        }
    }

    /// FLOPs of the two matmuls over the visible pairs of sequences of `lens` tokens (causal: `n(n+1)/2`
    /// pairs per sequence, the exact count).
    pub fn flops(&self, lens: &[i32]) -> f64 {
        let pairs: f64 = lens
            .iter()
            .map(|&n| {
                let n = n as f64;
                if self.mask == Mask::None {
                    n * n
                } else {
                    n * (n + 1.0) / 2.0
                }
            })
            .sum();
        4.0 * self.heads_q as f64 * self.head_dim as f64 * pairs
    }

    /// Shape checks of both backends; nothing is touched on error.
    pub fn check(&self) -> Result<()> {
        let a = self;
        super::check_heads(
            "sdpa ragged",
            &[
                ("batch", a.batch),
                ("bucket", a.bucket),
                ("heads_q", a.heads_q),
                ("heads_kv", a.heads_kv),
                ("head_dim", a.head_dim),
            ],
            (a.heads_q, a.heads_kv, a.head_dim),
        )?;
        if let Some(s) = a.scale {
            ensure!(s.is_finite(), "sdpa ragged: scale {s} is not finite");
        }
        let RowStrides { q, kv, o } = a.rows;
        for (name, stride, heads) in [("Q", q, a.heads_q), ("K/V", kv, a.heads_kv), ("O", o, a.heads_q)] {
            ensure!(
                stride >= heads * a.head_dim && stride <= i32::MAX as usize,
                "sdpa ragged: {name} tokens {stride} elements apart, a token holds {}",
                heads * a.head_dim
            );
        }
        // The plan's padded extents (batch · bucket tokens) in i64 strides.
        crate::checked::product(
            "sdpa ragged: batch*bucket*row_stride",
            &[a.batch, a.bucket, q.max(kv).max(o)],
        )
        .and_then(|n| crate::checked::fits_i64("sdpa ragged: batch*bucket*row_stride", n))?;
        Ok(())
    }
}

/// The buffers of a ragged attention call: Q, K, V in, O out (tokens as far apart as the batch
/// says, [`RowStrides`]), and the batch's device offsets and lengths.
#[non_exhaustive]
pub struct RaggedOperands<'a, T: Element> {
    /// Q, `total_tokens` tokens of `h_q` heads of `d`.
    pub q: &'a dyn DevicePtr<T>,
    /// K, `total_tokens` tokens of `h_kv` heads of `d`.
    pub k: &'a dyn DevicePtr<T>,
    /// V, as K.
    pub v: &'a dyn DevicePtr<T>,
    /// O, `total_tokens` tokens of `h_q` heads of `d`; tokens past `total_tokens` (and the elements
    /// between tokens where they are not packed) are not written.
    pub o: &'a mut dyn DevicePtrMut<T>,
    /// Which tokens belong to which sequence.
    pub batch: &'a DeviceRagged,
}

impl<'a, T: Element> RaggedOperands<'a, T> {
    /// Q, K, V in, O out, packed as `batch` says.
    pub fn new(
        q: &'a dyn DevicePtr<T>,
        k: &'a dyn DevicePtr<T>,
        v: &'a dyn DevicePtr<T>,
        o: &'a mut dyn DevicePtrMut<T>,
        batch: &'a DeviceRagged,
    ) -> Self {
        RaggedOperands { q, k, v, o, batch }
    }
}

impl<T: Element> Op<T> for RaggedArgs {
    type Operands<'a> = RaggedOperands<'a, T>;

    /// f16/bf16, [`RaggedArgs::check`], the batch against the arguments (sequences, heads, longest
    /// sequence within the bucket), every buffer long enough for the batch's tokens; then
    /// [`RaggedArgs::normalized`].
    fn checked(self, x: &RaggedOperands<'_, T>) -> Result<Self> {
        super::check_dtype(T::DTYPE)?;
        self.check()?;
        let r = x.batch;
        ensure!(
            r.batch() == self.batch,
            "sdpa ragged: the batch holds {} sequences (offsets of {} entries), the arguments {}",
            r.batch(),
            r.batch() + 1,
            self.batch
        );
        let (hq, hkv, d) = r.heads();
        ensure!(
            (hq, hkv, d) == (self.heads_q, self.heads_kv, self.head_dim),
            "sdpa ragged: the batch's offsets are for {hq}/{hkv} heads of {d}, the arguments {}/{} heads of {}",
            self.heads_q,
            self.heads_kv,
            self.head_dim
        );
        ensure!(
            r.rows() == self.rows,
            "sdpa ragged: the batch's tokens are {:?} elements apart, the arguments' {:?}",
            r.rows(),
            self.rows
        );
        ensure!(
            r.longest() <= self.bucket,
            "sdpa ragged: a sequence of {} tokens is longer than the bucket {}",
            r.longest(),
            self.bucket
        );
        let (q_need, kv_need, o_need) =
            (r.queries().buffer_len(), r.keys().buffer_len(), r.outputs().buffer_len());
        for (name, len, need) in [
            ("Q", x.q.len(), q_need),
            ("K", x.k.len(), kv_need),
            ("V", x.v.len(), kv_need),
            ("O", x.o.len(), o_need),
        ] {
            ensure!(
                len >= need,
                "sdpa ragged: {name} has {len} elements, {} tokens need {need}",
                r.total_tokens()
            );
        }
        Ok(self.normalized())
    }
}

/// Ragged attention on `backend`: every sequence of `x.batch` attends to its own keys (causal or not,
/// as `args.mask` says), reading packed Q, K, V and writing packed O.
///
/// Errors, with nothing written ([`Error::InvalidArgument`](crate::Error::InvalidArgument)): a batch
/// of another number of sequences or heads than `args`, a sequence longer than the bucket, a buffer
/// shorter than the batch's tokens, bad shapes; f32 I/O or a head dim beyond what fused attention
/// takes on this GPU ([`Error::NotSupported`](crate::Error::NotSupported)).
pub fn sdpa_ragged<T: Element>(
    ctx: &Cudnn,
    args: RaggedArgs,
    x: RaggedOperands<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, args, x, backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_errors() {
        let a = RaggedArgs::new(8, 2048, 32, 8, 128);
        a.check().unwrap();
        for (bad, expected) in [
            (RaggedArgs { heads_kv: 3, ..a }, "not a multiple of heads_kv"),
            (RaggedArgs { head_dim: 60, ..a }, "not a multiple of 8"),
            (RaggedArgs { bucket: 0, ..a }, "bucket must be > 0"),
            (RaggedArgs { batch: 0, ..a }, "batch must be > 0"),
            (a.with_scale(f32::INFINITY), "not finite"),
            (RaggedArgs { batch: 1 << 30, bucket: 1 << 30, ..a }, "overflows"),
            (a.with_rows(RowStrides { o: 100, ..a.rows }), "O tokens 100 elements apart"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
    }

    #[test]
    fn keys_follow_the_plan_and_not_the_scale() {
        use std::collections::HashSet;
        let a = RaggedArgs::new(8, 2048, 32, 8, 128);
        assert_eq!(a.key(DataType::BF16), a.with_scale(0.1).key(DataType::BF16));
        assert_eq!(a.key(DataType::BF16), a.with_mask(Mask::CausalBottomRight).key(DataType::BF16));
        let variants = [
            a.key(DataType::BF16),
            a.key(DataType::F16),
            a.with_mask(Mask::None).key(DataType::BF16),
            RaggedArgs { batch: 4, ..a }.key(DataType::BF16),
            RaggedArgs { bucket: 1024, ..a }.key(DataType::BF16),
            RaggedArgs { heads_kv: 32, ..a }.key(DataType::BF16),
            RaggedArgs { head_dim: 64, ..a }.key(DataType::BF16),
            a.with_rows(RowStrides::fused_qkv(32, 8, 128)).key(DataType::BF16),
        ];
        assert_eq!(variants.iter().collect::<HashSet<_>>().len(), variants.len());
    }

    #[test]
    fn row_strides_of_fused_qkv_rows() {
        let r = RowStrides::fused_qkv(32, 8, 128);
        assert_eq!((r.q, r.kv, r.o), (48 * 128, 48 * 128, 32 * 128));
        let p = RowStrides::packed(32, 8, 128);
        assert_eq!((p.q, p.kv, p.o), (32 * 128, 8 * 128, 32 * 128));
        assert_eq!(RaggedArgs::new(8, 2048, 32, 8, 128).rows, p);
        RaggedArgs::new(8, 2048, 32, 8, 128).with_rows(r).check().unwrap();
        // What a batch of fused rows uploads: Q and K/V offsets in rows, O's packed, then the lengths.
        let lens = [3usize, 1, 2];
        let fam = |h: usize, s: usize| RaggedBatch::strided(&lens, h, 8, s).unwrap();
        let (q, kv, o) = (fam(4, 64), fam(2, 64), fam(4, 32));
        let host = DeviceRagged::host_values(&q, &kv, &o);
        assert_eq!(
            host,
            [0, 192, 256, 384, 0, 192, 256, 384, 0, 96, 128, 192, 3, 1, 2],
            "parts of 4 values: Q, K/V, O offsets, lengths"
        );
        assert_eq!((q.buffer_len(), kv.buffer_len(), o.buffer_len()), (5 * 64 + 32, 5 * 64 + 16, 6 * 32));
    }

    #[test]
    fn flops_count_each_sequence_alone() {
        let a = RaggedArgs::new(2, 8, 1, 1, 8);
        // 3 tokens causal: 6 pairs; 1 token: 1 pair.
        assert_eq!(a.flops(&[3, 1]), 4.0 * 8.0 * 7.0);
        assert_eq!(a.with_mask(Mask::None).flops(&[3, 1]), 4.0 * 8.0 * 10.0);
    }
}
