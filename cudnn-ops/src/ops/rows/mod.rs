//! Row moves a decoder needs on both backends (one kernel each, as in eager, so no call takes a
//! [`Backend`](crate::Backend)): the embedding lookup, writing K/V rows into a preallocated cache, and
//! a paged cache's pages and page tables with the copy of its rows into a contiguous buffer
//! ([`gather_pages`]). Their kernels are in `rows.cu`.

pub mod backward;
mod pages;

pub use pages::{
    gather_pages, CacheRows, PageGather, PageGatherOperands, PageOrder, PageShape, PageTable, TableShape,
};

use crate::checked;
use crate::dtype::Element;
use crate::error::ensure;
use crate::kernels::{elementwise, optional_ptr, Arg, Kernels};
use crate::{Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

fn sixteen_bit<T: Element>(op: &str) -> Result<()> {
    if T::DTYPE.size() == 2 {
        return Ok(());
    }
    Err(Error::NotSupported { op: op.into(), reason: format!("takes 16-bit elements, not {}", T::DTYPE) })
}

/// Checks token ids against the vocabulary on the host (before they are uploaded).
pub fn check_ids(ids: &[u32], vocab: usize) -> Result<()> {
    ensure!(!ids.is_empty(), "embedding: no tokens");
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::invalid(format!(
            "embedding: token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// Shape of an embedding lookup: the first `rows` ids into a `[vocab, hidden]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EmbeddingArgs {
    /// Ids looked up (rows of the output).
    pub rows: usize,
    /// Rows of the table.
    pub vocab: usize,
    /// Row length.
    pub hidden: usize,
}

impl EmbeddingArgs {
    /// The first `rows` ids into a `[vocab, hidden]` table.
    pub fn new(rows: usize, vocab: usize, hidden: usize) -> Self {
        EmbeddingArgs { rows, vocab, hidden }
    }

    /// Checks the shape against the buffer lengths (ids, table, output) with checked arithmetic (no GPU
    /// needed).
    pub fn check(&self, ids: usize, table: usize, y: usize) -> Result<()> {
        let EmbeddingArgs { rows, vocab, hidden } = *self;
        ensure!(rows > 0 && hidden > 0, "embedding: no tokens or zero hidden size");
        ensure!(vocab > 0, "embedding: empty vocabulary");
        ensure!(ids >= rows, "embedding: {ids} ids for {rows} rows");
        let need = checked::product("embedding: vocab * hidden", &[vocab, hidden])?;
        ensure!(table >= need, "embedding: table has {table} elements, needs {need}");
        let n = checked::product("embedding: rows * hidden", &[rows, hidden])?;
        ensure!(y >= n, "embedding: output has {y} elements, needs {n}");
        Ok(())
    }
}

/// The buffers of an embedding lookup.
#[non_exhaustive]
pub struct EmbeddingOperands<'a, T: Element> {
    /// Token ids on the device.
    pub ids: &'a dyn DevicePtr<u32>,
    /// `[vocab, hidden]`.
    pub table: &'a dyn DevicePtr<T>,
    /// `[rows, hidden]`.
    pub y: &'a mut dyn DevicePtrMut<T>,
}

impl<'a, T: Element> EmbeddingOperands<'a, T> {
    /// Ids and table in, `y` out.
    pub fn new(
        ids: &'a dyn DevicePtr<u32>,
        table: &'a dyn DevicePtr<T>,
        y: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        EmbeddingOperands { ids, table, y }
    }
}

/// `y[r] = table[ids[r]]` for the first `rows` device ids and a `[vocab, hidden]` table. Launch-only, so
/// it can be captured in a CUDA graph.
///
/// The ids live on the device, where the host cannot check them before the launch ([`check_ids`] checks
/// host ids before upload). The kernel therefore bounds every id itself: an id `>= vocab` reads nothing
/// and yields a row of zeros. Zeros rather than a clamped id, so that a bad id is visible (an all-zero
/// embedding row, which a real vocabulary row practically never is) instead of silently aliasing the
/// last token; rather than an error flag, because reading a flag back needs a synchronization that
/// a launch-only op (captured in a CUDA graph) cannot do.
pub fn embedding<T: Element>(ctx: &Cudnn, args: EmbeddingArgs, x: EmbeddingOperands<'_, T>) -> Result<()> {
    sixteen_bit::<T>("embedding")?;
    let EmbeddingOperands { ids, table, y } = x;
    args.check(ids.len(), table.len(), y.len())?;
    let EmbeddingArgs { rows, vocab, hidden } = args;
    let n = rows * hidden; // checked by EmbeddingArgs::check
    let kernels = Kernels::get(ctx)?;
    let (i, _gi) = ids.device_ptr(ctx.stream());
    let (t, _gt) = table.device_ptr(ctx.stream());
    let (o, _go) = y.device_ptr_mut(ctx.stream());
    // Ids are u32: a vocabulary above u32::MAX bounds nothing more than u32::MAX does.
    let bound = vocab.min(u32::MAX as usize) as i64;
    elementwise(
        ctx,
        kernels,
        "embedding_16",
        n,
        &[Arg::Ptr(i), Arg::Ptr(t), Arg::I64(bound), Arg::I64(hidden as i64), Arg::Ptr(o)],
    )
}

/// Where rows go in a `[batch, max_seq, cols]` cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheWrite {
    /// Sequences.
    pub batch: usize,
    /// Rows per sequence written now.
    pub seq: usize,
    /// Elements per row.
    pub cols: usize,
    /// Elements between source rows (a view into a wider buffer).
    pub src_stride: usize,
    /// Cache rows per sequence.
    pub max_seq: usize,
    /// First cache row written in each sequence.
    pub start: usize,
}

impl CacheWrite {
    /// `seq` packed rows of `cols` elements per sequence (source stride `cols`) into a cache of
    /// `max_seq` rows per sequence, from row 0.
    pub fn new(batch: usize, seq: usize, cols: usize, max_seq: usize) -> Self {
        CacheWrite { batch, seq, cols, src_stride: cols, max_seq, start: 0 }
    }

    /// The same with `src_stride` elements between source rows (a view into a wider buffer, e.g. the
    /// K or V heads of a fused QKV row).
    pub fn with_src_stride(self, src_stride: usize) -> Self {
        CacheWrite { src_stride, ..self }
    }

    /// The same writing from cache row `start` of each sequence.
    pub fn with_start(self, start: usize) -> Self {
        CacheWrite { start, ..self }
    }

    /// Checks the rows against the source and cache lengths with checked arithmetic (no GPU needed):
    /// every offset the kernel computes stays below the lengths and fits its 64-bit indices.
    pub fn check(&self, src_len: usize, cache_len: usize) -> Result<()> {
        let w = *self;
        let CacheWrite { batch, seq, cols, src_stride, max_seq, start } = w;
        ensure!(batch > 0 && seq > 0 && cols > 0, "write_cache: empty shape {w:?}");
        ensure!(src_stride >= cols, "write_cache: source stride {src_stride} < row width {cols}");
        let end = checked::add("write_cache: start + seq", start, seq)?;
        ensure!(end <= max_seq, "write_cache: rows {start}..{end} overflow a cache of {max_seq}");
        let rows = checked::mul("write_cache: batch * seq", batch, seq)?;
        let last = checked::mul("write_cache: (batch * seq - 1) * src_stride", rows - 1, src_stride)?;
        let need = checked::fits_i64(
            "write_cache: source extent",
            checked::add("write_cache: source extent", last, cols)?,
        )?;
        ensure!(src_len >= need, "write_cache: source has {src_len} elements, needs {need}");
        let cache = checked::product("write_cache: batch * max_seq * cols", &[batch, max_seq, cols])?;
        ensure!(cache_len >= cache, "write_cache: cache has {cache_len} elements, needs {cache}");
        checked::product("write_cache: batch * seq * cols", &[rows, cols])?;
        Ok(())
    }
}

/// The buffers of a cache write.
#[non_exhaustive]
pub struct CacheWriteOperands<'a, T: Element> {
    /// The rows, `src_stride` elements apart (e.g. a view into the QKV buffer).
    pub src: &'a dyn DevicePtr<T>,
    /// `[batch, max_seq, cols]`.
    pub cache: &'a mut dyn DevicePtrMut<T>,
    /// Device i32, one per sequence: sequence `b`'s rows go to `starts[b]..` ([`CacheWrite::start`] is
    /// not used), read when the kernel runs, so a captured CUDA graph serves every decode position.
    /// Rows that would land outside the cache are skipped (the kernel bounds them).
    pub starts: Option<&'a dyn DevicePtr<i32>>,
}

impl<'a, T: Element> CacheWriteOperands<'a, T> {
    /// Rows from `src` into `cache` at [`CacheWrite::start`].
    pub fn new(src: &'a dyn DevicePtr<T>, cache: &'a mut dyn DevicePtrMut<T>) -> Self {
        CacheWriteOperands { src, cache, starts: None }
    }

    /// Start rows from the device (see [`CacheWriteOperands::starts`](#structfield.starts)).
    pub fn starts(mut self, starts: &'a dyn DevicePtr<i32>) -> Self {
        self.starts = Some(starts);
        self
    }
}

/// Copies `batch · seq` rows of `src` into the cache at rows `start..start + seq` of each sequence (or
/// from the device start rows of [`CacheWriteOperands::starts`]).
pub fn write_cache<T: Element>(ctx: &Cudnn, w: CacheWrite, x: CacheWriteOperands<'_, T>) -> Result<()> {
    let w = match x.starts {
        Some(starts) => {
            ensure!(
                starts.len() >= w.batch,
                "write_cache: {} start rows for {} sequences",
                starts.len(),
                w.batch
            );
            CacheWrite { start: 0, ..w }
        }
        None => w,
    };
    sixteen_bit::<T>("write_cache")?;
    let CacheWriteOperands { src, cache, starts } = x;
    w.check(src.len(), cache.len())?;
    let CacheWrite { batch, seq, cols, src_stride, max_seq, start } = w;
    let kernels = Kernels::get(ctx)?;
    let (s, _gs) = src.device_ptr(ctx.stream());
    let (c, _gc) = cache.device_ptr_mut(ctx.stream());
    let (p, _gp) = optional_ptr(starts, ctx.stream());
    // Every value below was checked to fit i64 by `CacheWrite::check` (each is at most an extent).
    let i = |v: usize| Arg::I64(v as i64);
    let args = [Arg::Ptr(s), i(src_stride), i(seq), i(cols), i(max_seq), i(start), Arg::Ptr(p), Arg::Ptr(c)];
    elementwise(ctx, kernels, "cache_rows_16", batch * seq * cols, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_against_the_vocabulary() {
        check_ids(&[0, 5, 9], 10).unwrap();
        let e = check_ids(&[0, 10], 10).unwrap_err().to_string();
        assert!(e.contains("token id 10 is outside the vocabulary of 10"), "{e}");
        assert!(check_ids(&[], 10).is_err());
    }

    fn check_embedding(
        ids: usize,
        rows: usize,
        table: usize,
        vocab: usize,
        hidden: usize,
        y: usize,
    ) -> Result<()> {
        EmbeddingArgs { rows, vocab, hidden }.check(ids, table, y)
    }

    #[test]
    fn cache_write_constructor_packs_rows_from_row_zero() {
        let w = CacheWrite::new(2, 3, 64, 16);
        assert_eq!(w, CacheWrite { batch: 2, seq: 3, cols: 64, src_stride: 64, max_seq: 16, start: 0 });
        let w = w.with_src_stride(192).with_start(13);
        assert_eq!((w.src_stride, w.start), (192, 13));
        // Rows 13..16 fit; the stride widens the source extent to (2·3 − 1)·192 + 64.
        w.check(5 * 192 + 64, 2 * 16 * 64).unwrap();
        assert!(w.check(5 * 192 + 63, 2 * 16 * 64).is_err());
        assert!(w.with_start(14).check(usize::MAX, usize::MAX).is_err());
    }

    #[test]
    fn embedding_sizes_are_checked() {
        check_embedding(4, 4, 10 * 8, 10, 8, 32).unwrap();
        for ((ids, rows, table, vocab, hidden, y), expected) in [
            ((4, 4, 80, 10, 8, 31), "output has 31"),
            ((3, 4, 80, 10, 8, 32), "3 ids for 4 rows"),
            ((4, 4, 79, 10, 8, 32), "table has 79"),
            ((4, 4, 80, 0, 8, 32), "empty vocabulary"),
            // vocab * hidden wraps to 0 without checks: any table would pass.
            ((4, 4, 0, 1 << 32, 1 << 32, usize::MAX), "vocab * hidden overflows"),
            ((4, 4, 0, 1 << 62, 2, usize::MAX), "vocab * hidden"),
            ((usize::MAX, usize::MAX, usize::MAX, 1, 2, usize::MAX), "rows * hidden overflows"),
        ] {
            let e = check_embedding(ids, rows, table, vocab, hidden, y).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected), "{e}");
        }
    }

    #[test]
    fn cache_writes_are_checked() {
        let w = CacheWrite { batch: 2, seq: 3, cols: 8, src_stride: 24, max_seq: 16, start: 5 };
        let src = 5 * 24 + 8;
        w.check(src, 2 * 16 * 8).unwrap();
        for (bad, (s, c), expected) in [
            (w, (src - 1, 256), "source has"),
            (w, (src, 255), "cache has 255"),
            (CacheWrite { start: 14, ..w }, (src, 256), "overflow a cache of 16"),
            // start + seq wraps to 2 without checks and the kernel writes far outside the cache.
            (CacheWrite { start: usize::MAX - 1, ..w }, (src, 256), "start + seq overflows"),
            (CacheWrite { batch: usize::MAX, ..w }, (usize::MAX, usize::MAX), "batch * seq overflows"),
            (CacheWrite { src_stride: usize::MAX / 2, ..w }, (usize::MAX, 256), "src_stride overflows"),
            (CacheWrite { src_stride: 1 << 61, ..w }, (usize::MAX, 256), "64-bit signed"),
            (CacheWrite { max_seq: 1 << 62, ..w }, (src, usize::MAX), "batch * max_seq * cols"),
            (CacheWrite { seq: 0, ..w }, (src, 256), "empty shape"),
            (CacheWrite { src_stride: 7, ..w }, (src, 256), "source stride 7"),
        ] {
            let e = bad.check(s, c).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected),
                "{expected}: {e}"
            );
        }
    }
}
