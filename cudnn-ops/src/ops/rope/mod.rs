//! Rotary position embedding of Q and K in place, inside a fused QKV buffer. Fused: one custom kernel
//! (f32 math, one rounding; `fused.cu`). Naive: Hugging Face's `apply_rotary_pos_emb` as eager runs
//! it, five kernels for Q and five for K in the I/O dtype (`x·cos`, `-x₂`, `cat`, `·sin`, `+`;
//! `naive.cu`).
//!
//! A QKV buffer holds one row per token: Q heads, then K heads, then V heads, each `head_dim` wide;
//! rows are `row_stride` elements apart. Row `r` of a call is the token at position
//! `start + r % seq` (batch-major rows), or at a position each sequence (fused: read on the device,
//! [`RopeOperands::starts`]) or each token ([`TokenPositions`], a packed batch of sequences of
//! different lengths) gives.

pub mod backward;
mod freqs;
mod fused;
mod naive;

pub use freqs::{rotate, Llama3Scaling, RopeFrequencies};

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::ops::rows::{CacheRows, CacheWrite, PageTable};
use crate::ops::Op;
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// Shape of a RoPE call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RopeArgs {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence in this call.
    pub seq: usize,
    /// Query heads (rotated), first in each row.
    pub heads_q: usize,
    /// Key heads (rotated), right after the query heads.
    pub heads_kv: usize,
    /// Head dim (even).
    pub head_dim: usize,
    /// Elements between consecutive tokens.
    pub row_stride: usize,
    /// Position of each sequence's first token in this call.
    pub start: usize,
}

impl RopeArgs {
    /// `seq` tokens of `batch` sequences in a packed fused QKV buffer (per token `heads_q` query
    /// heads, then `heads_kv` key heads, then `heads_kv` value heads, so `row_stride` is
    /// `(heads_q + 2 · heads_kv) · head_dim`), each sequence starting at position 0. A row stride
    /// that does not fit `usize` saturates, and the call's length check rejects it.
    pub fn new(batch: usize, seq: usize, heads_q: usize, heads_kv: usize, head_dim: usize) -> Self {
        let heads = heads_kv.saturating_mul(2).saturating_add(heads_q);
        RopeArgs {
            batch,
            seq,
            heads_q,
            heads_kv,
            head_dim,
            row_stride: heads.saturating_mul(head_dim),
            start: 0,
        }
    }

    /// The same with `row_stride` elements between consecutive tokens (a wider or strided buffer).
    pub fn with_row_stride(self, row_stride: usize) -> Self {
        RopeArgs { row_stride, ..self }
    }

    /// The same with each sequence's first token at position `start` (a decode step, a chunk).
    pub fn with_start(self, start: usize) -> Self {
        RopeArgs { start, ..self }
    }
}

/// The cos/sin tables both backends read, on the device: f32 `[positions, dim / 2]` for the fused
/// kernel, and `[positions, dim]` in the I/O dtype (both halves) for the eager path, as Hugging Face
/// casts them to the activations' dtype.
pub struct RopeTables<T> {
    positions: usize,
    dim: usize,
    cos_half: CudaSlice<f32>,
    sin_half: CudaSlice<f32>,
    cos_full: CudaSlice<T>,
    sin_full: CudaSlice<T>,
}

impl<T: Element> RopeTables<T> {
    /// Uploads host tables `cos`, `sin` of `[positions, dim / 2]` angles.
    pub fn new(ctx: &Cudnn, cos: &[f64], sin: &[f64], dim: usize) -> Result<Self> {
        ensure!(dim > 0 && dim.is_multiple_of(2), "rope: head dim {dim} must be even and > 0");
        let half = dim / 2;
        ensure!(
            cos.len() == sin.len() && cos.len().is_multiple_of(half),
            "rope: tables must be [positions, dim / 2]"
        );
        let full = |t: &[f64]| -> Vec<T> {
            t.chunks(half).flat_map(|row| row.iter().chain(row.iter()).map(|&v| T::from_f64(v))).collect()
        };
        let f32s = |t: &[f64]| t.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let s = ctx.stream();
        Ok(RopeTables {
            positions: cos.len() / half,
            dim,
            cos_half: s.clone_htod(&f32s(cos))?,
            sin_half: s.clone_htod(&f32s(sin))?,
            cos_full: s.clone_htod(&full(cos))?,
            sin_full: s.clone_htod(&full(sin))?,
        })
    }

    /// Positions covered.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The head dim the tables are for.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The f32 `[positions, dim / 2]` cos and sin tables the fused kernels read (the decode GEMV's
    /// rotary epilogue too, `ops/matmul/decode.rs`).
    pub(crate) fn half_tables(&self) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (&self.cos_half, &self.sin_half)
    }
}

impl RopeArgs {
    /// With a [`KvAppend`], each row must hold its V heads after Q and K (`row_stride >= (h_q +
    /// 2·h_kv)·d`): a narrower stride would read the next row's Q heads as V while another block
    /// rotates them.
    pub fn check_append_rows(&self) -> Result<()> {
        let kv = checked::mul("rope: 2 * heads_kv", 2, self.heads_kv)?;
        let heads = checked::add("rope: heads_q + 2 * heads_kv", self.heads_q, kv)?;
        let width = checked::mul("rope: (heads_q + 2 * heads_kv) * head_dim", heads, self.head_dim)?;
        ensure!(
            self.row_stride >= width,
            "rope: a K/V append needs rows of Q, K and V ({width} elements), the row stride is {}",
            self.row_stride
        );
        Ok(())
    }

    /// The cache rows a [`KvAppend`] writes: the K (or V) heads of each row, `row_stride` apart, to
    /// rows `start..start + seq` of each sequence's `max_seq`.
    pub fn cache_write(&self, max_seq: usize) -> CacheWrite {
        let RopeArgs { batch, seq, heads_kv, head_dim, row_stride, start, .. } = *self;
        CacheWrite { batch, seq, cols: heads_kv * head_dim, src_stride: row_stride, max_seq, start }
    }

    /// Checks the shape against the buffer length and the tables; every size is computed with checked
    /// arithmetic and checked to fit the kernels' index types (an overflow is an error, never a wrapped
    /// size that passes the length check).
    pub fn check(&self, len: usize, positions: usize, dim: usize) -> Result<()> {
        self.check_rows(len, positions, dim)?;
        let end = checked::add("rope: start + seq", self.start, self.seq)?;
        ensure!(end <= positions, "rope: positions up to {end} exceed the tables' {positions}");
        Ok(())
    }

    /// [`RopeArgs::check`] short of the positions `start..start + seq` (per-token positions come
    /// from the device).
    pub(crate) fn check_rows(&self, len: usize, positions: usize, dim: usize) -> Result<()> {
        let RopeArgs { batch, seq, heads_q, heads_kv, head_dim, row_stride, .. } = *self;
        ensure!(batch > 0 && seq > 0 && heads_q > 0 && heads_kv > 0, "rope: empty shape {self:?}");
        ensure!(head_dim == dim, "rope: head_dim {head_dim} differs from the tables' {dim}");
        ensure!(head_dim > 0 && head_dim.is_multiple_of(2), "rope: head dim {head_dim} must be even and > 0");
        let heads = checked::add("rope: heads_q + heads_kv", heads_q, heads_kv)?;
        let width = checked::mul("rope: (heads_q + heads_kv) * head_dim", heads, head_dim)?;
        // The fused kernel indexes a row's (head, pair)s with 32-bit integers.
        ensure!(
            width <= i32::MAX as usize,
            "rope: (heads_q + heads_kv) * head_dim = {width} exceeds the kernel's 32-bit row index"
        );
        ensure!(row_stride >= width, "rope: row stride {row_stride} is narrower than Q and K ({width})");
        let rows = checked::mul("rope: batch * seq", batch, seq)?;
        checked::launch_dim("rope: batch * seq (one block per row)", rows)?;
        let last = checked::mul("rope: (batch * seq - 1) * row_stride", rows - 1, row_stride)?;
        let need =
            checked::fits_i64("rope: buffer extent", checked::add("rope: buffer extent", last, width)?)?;
        ensure!(len >= need, "rope: buffer has {len} elements, needs {need}");
        // The tables are f32 [positions, dim / 2] and [positions, dim] in the I/O dtype.
        checked::product("rope: tables' positions * head_dim", &[positions, head_dim, 4])?;
        // The eager path's scratch: 7/2 rows * heads * dim elements of the I/O dtype (at most 4 bytes).
        checked::product("rope: eager scratch", &[rows, heads_q.max(heads_kv), head_dim, 4 * 7])?;
        Ok(())
    }
}

/// Kernels the eager path launches per call (two more with a [`KvAppend`]).
pub const NAIVE_KERNELS: usize = 10;

/// The kernels' name suffix for an I/O dtype (f16 and bf16 only).
fn suffix(dtype: DataType) -> Result<&'static str> {
    crate::kernels::suffix_of("rope", "I/O", dtype, &[DataType::F16, DataType::BF16])
}

/// The buffers of a RoPE call: the tables, the QKV buffer rotated in place and, optionally, each
/// sequence's first position on the device.
#[non_exhaustive]
pub struct RopeOperands<'a, T: Element> {
    /// The cos/sin tables.
    pub tables: &'a RopeTables<T>,
    /// The QKV rows, Q and K rotated in place.
    pub qkv: &'a mut dyn DevicePtrMut<T>,
    /// Device i32, one per sequence: sequence `b` starts at position `starts[b]` (`RopeArgs::start` is
    /// not used). The positions are read on the device when the kernel runs, so a captured CUDA graph
    /// serves every decode position; a row whose position falls outside the tables is left unrotated
    /// (the kernel bounds it; no host check can). Fused only.
    pub starts: Option<&'a dyn DevicePtr<i32>>,
    /// Positions per token from the device (a packed batch; see [`TokenPositions`]). Fused only;
    /// excludes `starts`.
    pub tokens: Option<TokenPositions<'a>>,
    /// Also append the tokens' rotated K and their V rows to a KV cache (see [`KvAppend`]).
    pub append: Option<KvAppend<'a, T>>,
}

/// Per-token positions on the device, for the rows of a packed batch (the prompts of several
/// sequences back to back, each of its own length): `at` holds i32 `[2, rows]` (`rows = batch ·
/// seq` of the call): row `r` is a token of sequence `at[r]` (in `0..sequences`; with a paged append,
/// the page table's row `first + at[r]`) at position `at[rows + r]`. [`RopeArgs::start`] and the
/// sequence split of `batch · seq` are not used; a row whose sequence or position falls outside the
/// tables, the page table or `0..sequences` is left unrotated and not appended (the kernel bounds
/// the device values; the host checks the rest). Takes a paged append or none.
#[derive(Clone, Copy)]
pub struct TokenPositions<'a> {
    /// i32 `[2, rows]`: each row's sequence, then each row's position.
    pub at: &'a dyn DevicePtr<i32>,
    /// Sequences the rows belong to.
    pub sequences: usize,
}

/// The caches a RoPE call appends the rotated K heads and the V heads of its tokens to, as a decoder
/// does before attention: the token at position `p` of sequence `b` to the cache row of `(b, p)`
/// ([`CacheRows`]: row `p` of sequence `b`'s `[max_seq, h_kv · d]`, or through a page table into a
/// page pool), positions from [`RopeArgs::start`] or the device starts. Fused: the same single kernel
/// writes them; naive: the eager rotation, then one row copy per cache (`StaticCache.update`'s
/// `index_copy_`, as [`write_cache`](crate::write_cache) does). With device starts, a row whose
/// position falls outside the cache is skipped.
#[non_exhaustive]
pub struct KvAppend<'a, T: Element> {
    /// The K cache (or page pool).
    pub k: &'a mut dyn DevicePtrMut<T>,
    /// The V cache (or page pool).
    pub v: &'a mut dyn DevicePtrMut<T>,
    /// Where the rows go.
    pub rows: CacheRows<'a>,
}

impl<'a, T: Element> RopeOperands<'a, T> {
    /// Positions from [`RopeArgs::start`].
    pub fn new(tables: &'a RopeTables<T>, qkv: &'a mut dyn DevicePtrMut<T>) -> Self {
        RopeOperands { tables, qkv, starts: None, tokens: None, append: None }
    }

    /// Also append the rotated K and the V rows to the contiguous `[batch, max_seq, h_kv · d]` caches
    /// `k` and `v` (see [`KvAppend`]).
    pub fn append(
        self,
        k: &'a mut dyn DevicePtrMut<T>,
        v: &'a mut dyn DevicePtrMut<T>,
        max_seq: usize,
    ) -> Self {
        self.append_to(k, v, CacheRows::Contiguous { max_seq })
    }

    /// Also append the rotated K and the V rows to the page pools `k` and `v` through `table` (see
    /// [`KvAppend`]).
    pub fn append_paged(
        self,
        k: &'a mut dyn DevicePtrMut<T>,
        v: &'a mut dyn DevicePtrMut<T>,
        table: &'a PageTable,
    ) -> Self {
        self.append_to(k, v, CacheRows::Paged { table, first: 0 })
    }

    /// Also append the rotated K and the V rows to `k` and `v` where `rows` says (see [`KvAppend`]).
    pub fn append_to(
        mut self,
        k: &'a mut dyn DevicePtrMut<T>,
        v: &'a mut dyn DevicePtrMut<T>,
        rows: CacheRows<'a>,
    ) -> Self {
        self.append = Some(KvAppend { k, v, rows });
        self
    }

    /// Positions from the device (see [`RopeOperands::starts`](#structfield.starts)).
    pub fn starts(mut self, starts: &'a dyn DevicePtr<i32>) -> Self {
        self.starts = Some(starts);
        self
    }

    /// Positions per token from the device (see [`TokenPositions`]).
    pub fn tokens(mut self, tokens: TokenPositions<'a>) -> Self {
        self.tokens = Some(tokens);
        self
    }
}

impl<T: Element> Op<T> for RopeArgs {
    type Operands<'a> = RopeOperands<'a, T>;

    fn checked(self, x: &RopeOperands<'_, T>) -> Result<Self> {
        let (len, positions, dim) = (x.qkv.len(), x.tables.positions, x.tables.dim);
        let host = match x.starts {
            None => self,
            Some(_) => RopeArgs { start: 0, ..self },
        };
        if let Some(t) = &x.tokens {
            ensure!(x.starts.is_none(), "rope: positions per sequence and per token both given");
            host.check_rows(len, positions, dim)?;
            let rows = self.batch * self.seq; // checked above
            ensure!(
                t.at.len() >= 2 * rows && t.sequences > 0,
                "rope: per-token positions of {} values for {rows} rows of {} sequences (2 per row)",
                t.at.len(),
                t.sequences
            );
            ensure!(
                matches!(x.append, None | Some(KvAppend { rows: CacheRows::Paged { .. }, .. })),
                "rope: per-token positions append to pages only (not to a contiguous cache)"
            );
        } else {
            host.check(len, positions, dim)?;
        }
        if let Some(KvAppend { k, v, rows }) = &x.append {
            host.check_append_rows()?;
            let w = match x.tokens {
                // Per-token positions: the source rows only (the kernel bounds each position by the
                // page table).
                Some(_) => host.with_start(0).cache_write(host.seq),
                None => host.cache_write(rows.max_seq()),
            };
            let (k_at, v_at) = (self.heads_q * self.head_dim, (self.heads_q + self.heads_kv) * self.head_dim);
            let (k_len, v_len) = match rows {
                CacheRows::Contiguous { .. } => (k.len(), v.len()),
                CacheRows::Paged { table, first } => {
                    let what = "rope: paged K/V append";
                    let heads = (self.heads_kv, self.head_dim);
                    let sequences = x.tokens.map_or(self.batch, |t| t.sequences);
                    table.shape().check_call(what, (*first, sequences), heads, &[k.len(), v.len()])?;
                    // The source rows and the positions against the table's capacity; the pools were
                    // checked above.
                    (usize::MAX, usize::MAX)
                }
            };
            w.check(len.saturating_sub(k_at), k_len)?;
            w.check(len.saturating_sub(v_at), v_len)?;
        }
        if let Some(starts) = x.starts {
            ensure!(
                starts.len() >= self.batch,
                "rope: {} start positions for {} sequences",
                starts.len(),
                self.batch
            );
        }
        suffix(T::DTYPE)?;
        Ok(self)
    }
}

/// Rotates Q and K of the operands' QKV buffer in place on `backend`.
pub fn rope<T: Element>(ctx: &Cudnn, args: RopeArgs, x: RopeOperands<'_, T>, backend: Backend) -> Result<()> {
    crate::ops::run::<T, _>(ctx, args, x, backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_errors() {
        let a =
            RopeArgs { batch: 2, seq: 5, heads_q: 4, heads_kv: 2, head_dim: 32, row_stride: 256, start: 3 };
        let len = 9 * 256 + 6 * 32;
        a.check(len, 8, 32).unwrap();
        for (bad, l, expected) in [
            (a, len - 1, "needs"),
            // Wrapped `start + seq` would pass the table check and read position -1.
            (RopeArgs { start: usize::MAX, ..a }, len, "start + seq overflows"),
            (RopeArgs { start: usize::MAX - 4, ..a }, len, "start + seq overflows"),
            (RopeArgs { heads_kv: usize::MAX, ..a }, len, "heads_q + heads_kv overflows"),
            (RopeArgs { heads_kv: usize::MAX / 16, ..a }, len, "(heads_q + heads_kv) * head_dim overflows"),
            (RopeArgs { heads_q: 1 << 26, row_stride: 1 << 32, ..a }, usize::MAX, "32-bit row index"),
            (RopeArgs { batch: usize::MAX, ..a }, usize::MAX, "batch * seq overflows"),
            (RopeArgs { batch: 1 << 40, seq: 1, ..a }, usize::MAX, "launch dimension"),
            (RopeArgs { row_stride: usize::MAX / 4, ..a }, usize::MAX, "row_stride overflows"),
            (RopeArgs { row_stride: 1 << 62, seq: 1, batch: 3, ..a }, usize::MAX, "64-bit signed"),
            (RopeArgs { start: 4, ..a }, len, "exceed the tables' 8"),
            (RopeArgs { row_stride: 100, ..a }, len, "narrower"),
            (RopeArgs { seq: 0, ..a }, len, "empty shape"),
            (RopeArgs { head_dim: 16, ..a }, len, "differs from the tables"),
        ] {
            let e = bad.check(l, 8, 32).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        assert!(suffix(DataType::F32).unwrap_err().is_not_supported());
        // An append reads V after Q and K in each row: a stride that holds only Q and K is refused.
        let mut qk_only = a;
        qk_only.row_stride = (a.heads_q + a.heads_kv) * a.head_dim;
        let e = qk_only.check_append_rows().unwrap_err().to_string();
        assert!(e.contains("needs rows of Q, K and V"), "{e}");
        let mut full = a;
        full.row_stride = (a.heads_q + 2 * a.heads_kv) * a.head_dim;
        full.check_append_rows().unwrap();
    }

    #[test]
    fn the_constructor_packs_a_fused_qkv_row() {
        let a = RopeArgs::new(2, 5, 32, 8, 64);
        let literal = RopeArgs {
            batch: 2,
            seq: 5,
            heads_q: 32,
            heads_kv: 8,
            head_dim: 64,
            row_stride: 48 * 64,
            start: 0,
        };
        assert_eq!(a, literal);
        assert_eq!(a.with_row_stride(9).with_start(7), RopeArgs { row_stride: 9, start: 7, ..literal });
        // A saturated stride is rejected by the check, not wrapped.
        let huge = RopeArgs::new(1, 1, 1, usize::MAX / 2, 2);
        assert_eq!(huge.row_stride, usize::MAX);
        assert!(huge.check(usize::MAX, 8, 2).is_err());
    }
}
