//! Row moves a decoder needs on both backends (one kernel each, as in eager): the embedding lookup and
//! writing K/V rows into a preallocated cache.

use crate::dtype::Element;
use crate::error::ensure;
use crate::naive::{elementwise, Arg, Kernels};
use crate::{Cudnn, Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

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

/// `y[r] = table[ids[r]]` for the first `rows` device ids and a `[vocab, hidden]` table. The ids must
/// have passed [`check_ids`] (the kernel does not bound them). Launch-only, so it can be captured in a
/// CUDA graph.
pub fn embedding<T: Element>(
    ctx: &Cudnn,
    ids: &(impl DevicePtr<u32> + ?Sized),
    rows: usize,
    table: &(impl DevicePtr<T> + ?Sized),
    vocab: usize,
    hidden: usize,
    y: &mut (impl DevicePtrMut<T> + ?Sized),
) -> Result<()> {
    sixteen_bit::<T>("embedding")?;
    ensure!(rows > 0 && hidden > 0, "embedding: no tokens or zero hidden size");
    ensure!(ids.len() >= rows, "embedding: {} ids for {rows} rows", ids.len());
    ensure!(
        table.len() >= vocab * hidden,
        "embedding: table has {} elements, needs {}",
        table.len(),
        vocab * hidden
    );
    let n = rows * hidden;
    ensure!(y.len() >= n, "embedding: output has {} elements, needs {n}", y.len());
    let kernels = Kernels::get(ctx)?;
    let (i, _gi) = ids.device_ptr(ctx.stream());
    let (t, _gt) = table.device_ptr(ctx.stream());
    let (o, _go) = y.device_ptr_mut(ctx.stream());
    elementwise(
        ctx,
        kernels,
        "embedding_16",
        n,
        &[Arg::Ptr(i), Arg::Ptr(t), Arg::I64(hidden as i64), Arg::Ptr(o)],
    )
}

/// Where rows go in a `[batch, max_seq, cols]` cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Copies `batch · seq` rows of `src` into the cache at rows `start..start + seq` of each sequence.
pub fn write_cache<T: Element>(
    ctx: &Cudnn,
    w: CacheWrite,
    src: &(impl DevicePtr<T> + ?Sized),
    cache: &mut (impl DevicePtrMut<T> + ?Sized),
) -> Result<()> {
    copy_rows(ctx, w, src, cache, None)
}

/// [`write_cache`] with sequence `b`'s rows going to `starts[b]..` (device i32, one per sequence;
/// `w.start` is not used), read when the kernel runs, so a captured CUDA graph serves every decode
/// position. Rows that would land outside the cache are skipped (the kernel bounds them).
pub fn write_cache_at<T: Element>(
    ctx: &Cudnn,
    w: CacheWrite,
    src: &(impl DevicePtr<T> + ?Sized),
    cache: &mut (impl DevicePtrMut<T> + ?Sized),
    starts: &CudaSlice<i32>,
) -> Result<()> {
    ensure!(starts.len() >= w.batch, "write_cache: {} start rows for {} sequences", starts.len(), w.batch);
    copy_rows(ctx, CacheWrite { start: 0, ..w }, src, cache, Some(starts))
}

fn copy_rows<T: Element>(
    ctx: &Cudnn,
    w: CacheWrite,
    src: &(impl DevicePtr<T> + ?Sized),
    cache: &mut (impl DevicePtrMut<T> + ?Sized),
    starts: Option<&CudaSlice<i32>>,
) -> Result<()> {
    sixteen_bit::<T>("write_cache")?;
    let CacheWrite { batch, seq, cols, src_stride, max_seq, start } = w;
    ensure!(batch > 0 && seq > 0 && cols > 0, "write_cache: empty shape {w:?}");
    ensure!(src_stride >= cols, "write_cache: source stride {src_stride} < row width {cols}");
    ensure!(
        start + seq <= max_seq,
        "write_cache: rows {}..{} overflow a cache of {max_seq}",
        start,
        start + seq
    );
    let need = (batch * seq - 1) * src_stride + cols;
    ensure!(src.len() >= need, "write_cache: source has {} elements, needs {need}", src.len());
    ensure!(
        cache.len() >= batch * max_seq * cols,
        "write_cache: cache has {} elements, needs {}",
        cache.len(),
        batch * max_seq * cols
    );
    let kernels = Kernels::get(ctx)?;
    let (s, _gs) = src.device_ptr(ctx.stream());
    let (c, _gc) = cache.device_ptr_mut(ctx.stream());
    let (p, _gp) = match starts {
        Some(p) => {
            let (p, g) = p.device_ptr(ctx.stream());
            (p, Some(g))
        }
        None => (0, None),
    };
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
}
