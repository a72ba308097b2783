//! Paged K/V rows: a cache buffer as a pool of `num_pages` pages of `page_size` token rows
//! ([`PageShape`]), and a device page table ([`PageTable`]) mapping each sequence's positions to
//! pages: position `p` of sequence `b` is row `p % page_size` of page `table[b][p / page_size]`.
//!
//! A table's entries are always pages of its pool: they reach the device only through
//! [`PageTable::upload`], which checks every one on the host, so the kernels and cuDNN that read
//! them never leave the pool whatever the table says (the kernels bound them once more). Rows
//! written through a table ([`CacheRows::Paged`], the RoPE append) and read back into a contiguous
//! buffer ([`gather_pages`], the fallback of a paged cache's attention) use the same addressing;
//! paged attention reads the pool in place (`ops/sdpa`).

use super::sixteen_bit;
use crate::checked;
use crate::dtype::Element;
use crate::error::ensure;
use crate::faults::Zeros;
use crate::kernels::{elementwise, Arg, Kernels};
use crate::{Cudnn, Result};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

/// How a page stores its `page_size` token rows of `h_kv` heads of `d` elements. Both are the logical
/// `[num_pages, h_kv, page_size, d]` pool cuDNN's paged attention reads, with other strides
/// ([`PageShape::strides`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PageOrder {
    /// `[num_pages, h_kv, page_size, d]` in memory: each head's rows together (the containers of the
    /// cuDNN frontend's paged-attention samples and tests).
    HeadMajor,
    /// `[num_pages, page_size, h_kv, d]` in memory: a page is `page_size` whole cache rows (the layout
    /// of flash-attention's and vLLM's paged caches, and of a contiguous cache's rows).
    TokenMajor,
}

impl PageOrder {
    /// `head-major` or `token-major`.
    pub fn name(self) -> &'static str {
        match self {
            PageOrder::HeadMajor => "head-major",
            PageOrder::TokenMajor => "token-major",
        }
    }
}

/// The shape of a page pool (one K or V buffer of a paged cache): `num_pages` pages of `page_size`
/// token rows, each row `heads_kv` heads of `head_dim` elements, stored in `order`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PageShape {
    /// Pages of the pool.
    pub num_pages: usize,
    /// Token rows per page.
    pub page_size: usize,
    /// K/V heads of a row.
    pub heads_kv: usize,
    /// Head dim.
    pub head_dim: usize,
    /// Storage order inside a page.
    pub order: PageOrder,
}

impl PageShape {
    /// Checks the shape: every count > 0, page indices fit the table's i32, and the pool's elements
    /// fit 64-bit signed offsets.
    pub fn new(
        num_pages: usize,
        page_size: usize,
        heads_kv: usize,
        head_dim: usize,
        order: PageOrder,
    ) -> Result<Self> {
        let s = PageShape { num_pages, page_size, heads_kv, head_dim, order };
        ensure!(
            num_pages > 0 && page_size > 0 && heads_kv > 0 && head_dim > 0,
            "pages: empty page shape {s:?}"
        );
        ensure!(num_pages <= i32::MAX as usize, "pages: {num_pages} pages exceed the page table's i32");
        ensure!(page_size <= i32::MAX as usize, "pages: page size {page_size} exceeds i32");
        checked::product(
            "pages: num_pages * page_size * heads_kv * head_dim",
            &[num_pages, page_size, heads_kv, head_dim],
        )?;
        Ok(s)
    }

    /// Elements of a token row: `heads_kv · head_dim`.
    pub fn row_width(&self) -> usize {
        self.heads_kv * self.head_dim
    }

    /// Elements of a page: `page_size · heads_kv · head_dim`.
    pub fn page_len(&self) -> usize {
        self.page_size * self.row_width()
    }

    /// Elements of the pool: `num_pages · page_size · heads_kv · head_dim`.
    pub fn pool_len(&self) -> usize {
        self.num_pages * self.page_len()
    }

    /// Element strides of the pool over its logical `[num_pages, h_kv, page_size, d]` dims (what
    /// paged attention binds K and V with): `[page, d·page_size... ]` by [`PageOrder`].
    pub fn strides(&self) -> [usize; 4] {
        let (ps, h, d) = (self.page_size, self.heads_kv, self.head_dim);
        match self.order {
            PageOrder::HeadMajor => [h * ps * d, ps * d, d, 1],
            PageOrder::TokenMajor => [ps * h * d, d, h * d, 1],
        }
    }

    /// Pages that hold `tokens` rows: `ceil(tokens / page_size)`.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// The kernels' addressing arguments: page size, page, head and slot strides, head dim, pages.
    pub(crate) fn kernel_args(&self) -> [Arg; 6] {
        let [page, head, slot, _] = self.strides();
        let i = |v: usize| Arg::I64(v as i64); // each at most the pool's length (checked to fit i64)
        [i(self.page_size), i(page), i(head), i(slot), i(self.head_dim), i(self.num_pages)]
    }
}

/// The shape of a page table: `batch` rows (sequences) of `max_pages` pages of a pool of `pages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TableShape {
    /// Sequences (rows).
    pub batch: usize,
    /// Pages per sequence.
    pub max_pages: usize,
    /// The pool the entries index.
    pub pages: PageShape,
}

impl TableShape {
    /// Checks the shape: `batch` and `max_pages` > 0, and a row's capacity (`max_pages · page_size`
    /// positions) fits the i32 sequence lengths.
    pub fn new(batch: usize, max_pages: usize, pages: PageShape) -> Result<Self> {
        ensure!(batch > 0 && max_pages > 0, "page table: {batch} sequences of {max_pages} pages");
        let cap = checked::mul("page table: max_pages * page_size", max_pages, pages.page_size)?;
        ensure!(cap <= i32::MAX as usize, "page table: a capacity of {cap} positions exceeds i32 lengths");
        checked::product("page table: batch * max_pages", &[batch, max_pages])?;
        Ok(TableShape { batch, max_pages, pages })
    }

    /// Positions a row holds: `max_pages · page_size`.
    pub fn capacity(&self) -> usize {
        self.max_pages * self.pages.page_size
    }

    /// Checks a call over rows `first..first + batch` writing or reading rows of `heads_kv` heads of
    /// `head_dim` in pools of the given lengths (elements); nothing is touched on error.
    pub fn check_call(
        &self,
        what: &str,
        (first, batch): (usize, usize),
        (heads_kv, head_dim): (usize, usize),
        pools: &[usize],
    ) -> Result<()> {
        let s = self.pages;
        ensure!(
            first.checked_add(batch).is_some_and(|end| end <= self.batch),
            "{what}: sequences {first}..{} of a page table of {}",
            first.saturating_add(batch),
            self.batch
        );
        ensure!(
            (heads_kv, head_dim) == (s.heads_kv, s.head_dim),
            "{what}: rows of {heads_kv} heads of {head_dim}, the pages hold {} heads of {}",
            s.heads_kv,
            s.head_dim
        );
        for &len in pools {
            ensure!(
                len >= s.pool_len(),
                "{what}: a page pool has {len} elements, its shape needs {}",
                s.pool_len()
            );
        }
        Ok(())
    }
}

/// A page table on the device: i32 `[batch, max_pages]` (cuDNN's `[b, 1, max_pages, 1]`) of
/// [`TableShape`]. Every entry is a page of the pool (zeros until the first [`PageTable::upload`]);
/// the buffer is never handed out mutably.
pub struct PageTable {
    buf: CudaSlice<i32>,
    shape: TableShape,
}

impl PageTable {
    /// A table of `shape`, every entry page 0.
    pub fn new(ctx: &Cudnn, shape: TableShape) -> Result<Self> {
        let buf = ctx.stream().zeros::<i32>(shape.batch * shape.max_pages)?;
        Ok(PageTable { buf, shape })
    }

    /// The shape.
    pub fn shape(&self) -> TableShape {
        self.shape
    }

    /// Positions a row holds: `max_pages · page_size`.
    pub fn capacity(&self) -> usize {
        self.shape.capacity()
    }

    /// Uploads `entries` (`batch · max_pages` pages, row-major) on `ctx`'s stream. An entry outside the
    /// pool, or a wrong count, is an error naming it, and nothing is uploaded.
    pub fn upload(&mut self, ctx: &Cudnn, entries: &[u32]) -> Result<()> {
        let TableShape { batch, max_pages, pages } = self.shape;
        check_entries(entries, batch, max_pages, pages.num_pages)?;
        let values: Vec<i32> = entries.iter().map(|&p| p as i32).collect(); // each < num_pages <= i32::MAX
        ctx.stream().memcpy_htod(&values, &mut self.buf)?;
        Ok(())
    }

    /// Rows `first..first + batch`, for a call over those sequences (checked by the caller: an
    /// out-of-range request gives the rows that exist).
    pub(crate) fn rows(&self, first: usize, batch: usize) -> CudaView<'_, i32> {
        let n = self.shape.batch;
        let (a, b) = (first.min(n), first.saturating_add(batch).min(n));
        self.buf.slice(a * self.shape.max_pages..b * self.shape.max_pages)
    }
}

/// Checks host table entries: `batch · max_pages` of them, each a page of a `num_pages` pool.
pub(crate) fn check_entries(entries: &[u32], batch: usize, max_pages: usize, num_pages: usize) -> Result<()> {
    ensure!(
        entries.len() == batch * max_pages,
        "page table: {} entries for {batch} sequences of {max_pages} pages",
        entries.len()
    );
    if let Some(i) = entries.iter().position(|&p| p as usize >= num_pages) {
        return Err(crate::Error::invalid(format!(
            "page table: sequence {} page {} is {}, outside the pool of {num_pages} pages",
            i / max_pages,
            i % max_pages,
            entries[i]
        )));
    }
    Ok(())
}

/// Where a K/V cache keeps the row of position `p` of sequence `b`.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum CacheRows<'a> {
    /// A contiguous `[batch, max_seq, h_kv · d]` buffer: row `b · max_seq + p`.
    Contiguous {
        /// Rows per sequence.
        max_seq: usize,
    },
    /// A page pool read through rows `first..` of a page table: sequence `b` of the call is row
    /// `first + b`, its position `p` row `p % page_size` of page `table[first + b][p / page_size]`.
    Paged {
        /// The table.
        table: &'a PageTable,
        /// Its row of the call's first sequence.
        first: usize,
    },
}

impl CacheRows<'_> {
    /// Positions a sequence holds: `max_seq`, or the table's capacity.
    pub fn max_seq(&self) -> usize {
        match self {
            CacheRows::Contiguous { max_seq } => *max_seq,
            CacheRows::Paged { table, .. } => table.capacity(),
        }
    }
}

/// A copy of the first `rows` positions of each of `batch` sequences out of a page pool into a
/// contiguous `[batch, max_seq, h_kv · d]` buffer (row `b · max_seq + p`), as a paged cache's attention
/// falls back to the contiguous form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PageGather {
    /// Sequences (the first rows of the table).
    pub batch: usize,
    /// Positions copied per sequence.
    pub rows: usize,
    /// Rows per sequence of the destination.
    pub max_seq: usize,
}

impl PageGather {
    /// The first `rows` positions of `batch` sequences into a destination of `max_seq` rows each.
    pub fn new(batch: usize, rows: usize, max_seq: usize) -> Self {
        PageGather { batch, rows, max_seq }
    }
}

/// The buffers of a [`gather_pages`].
#[non_exhaustive]
pub struct PageGatherOperands<'a, T: Element> {
    /// The pool, of the table's [`PageShape`].
    pub pool: &'a dyn DevicePtr<T>,
    /// The page table.
    pub table: &'a PageTable,
    /// `[batch, max_seq, h_kv · d]`.
    pub dst: &'a mut dyn DevicePtrMut<T>,
}

impl<'a, T: Element> PageGatherOperands<'a, T> {
    /// Rows of `pool` through `table` into `dst`.
    pub fn new(pool: &'a dyn DevicePtr<T>, table: &'a PageTable, dst: &'a mut dyn DevicePtrMut<T>) -> Self {
        PageGatherOperands { pool, table, dst }
    }
}

impl PageGather {
    /// Checks the copy against the table and the buffer lengths (no GPU needed).
    pub fn check(&self, table: TableShape, pool: usize, dst: usize) -> Result<()> {
        let PageGather { batch, rows, max_seq } = *self;
        ensure!(batch > 0 && rows > 0, "gather_pages: empty copy {self:?}");
        let s = table.pages;
        table.check_call("gather_pages", (0, batch), (s.heads_kv, s.head_dim), &[pool])?;
        ensure!(rows <= max_seq, "gather_pages: {rows} rows into a destination of {max_seq} per sequence");
        ensure!(
            rows <= table.capacity(),
            "gather_pages: {rows} rows past the table's {} positions per sequence",
            table.capacity()
        );
        let need = checked::product("gather_pages: batch * max_seq * row", &[batch, max_seq, s.row_width()])?;
        ensure!(dst >= need, "gather_pages: destination has {dst} elements, needs {need}");
        Ok(())
    }
}

/// Copies the first `rows` positions of each sequence out of the pool into the contiguous
/// destination (one kernel, the same on both backends). Positions past a sequence's length copy
/// whatever its pages hold.
pub fn gather_pages<T: Element>(ctx: &Cudnn, g: PageGather, x: PageGatherOperands<'_, T>) -> Result<()> {
    sixteen_bit::<T>("gather_pages")?;
    let PageGatherOperands { pool, table, dst } = x;
    g.check(table.shape(), pool.len(), dst.len())?;
    let kernels = Kernels::get(ctx)?;
    let s = ctx.stream();
    let (src, _gs) = pool.device_ptr(s);
    let rows_view = table.rows(0, g.batch);
    let (t, _gt) = rows_view.device_ptr(s);
    let (d, _gd) = dst.device_ptr_mut(s);
    let TableShape { max_pages, pages: shape, .. } = table.shape();
    let i = |v: usize| Arg::I64(v as i64); // checked sizes
    let head = [Arg::Ptr(src), Arg::Ptr(t), i(max_pages)];
    let tail = [i(shape.row_width()), i(g.rows), i(g.max_seq), Arg::Ptr(d)];
    let args = [head.as_slice(), &shape.kernel_args(), &tail].concat();
    elementwise(ctx, kernels, "gather_rows_paged_16", g.batch * g.rows * shape.row_width(), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_shapes_are_checked_and_strided_by_order() {
        let s = PageShape::new(100, 16, 8, 128, PageOrder::HeadMajor).unwrap();
        assert_eq!((s.row_width(), s.page_len(), s.pool_len()), (1024, 16 * 1024, 100 * 16 * 1024));
        assert_eq!(s.strides(), [8 * 16 * 128, 16 * 128, 128, 1]);
        let t = PageShape { order: PageOrder::TokenMajor, ..s };
        assert_eq!(t.strides(), [16 * 8 * 128, 128, 8 * 128, 1]);
        assert_eq!((s.pages_for(0), s.pages_for(1), s.pages_for(16), s.pages_for(17)), (0, 1, 1, 2));
        for (bad, expected) in [
            (PageShape::new(0, 16, 8, 128, PageOrder::HeadMajor), "empty page shape"),
            (PageShape::new(100, 0, 8, 128, PageOrder::HeadMajor), "empty page shape"),
            (PageShape::new(1 << 31, 16, 8, 128, PageOrder::HeadMajor), "exceed the page table's i32"),
            (PageShape::new(1 << 30, 1 << 30, 8, 128, PageOrder::HeadMajor), "overflows"),
        ] {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
    }

    #[test]
    fn table_entries_outside_the_pool_are_refused() {
        check_entries(&[0, 1, 2, 3, 4, 5], 2, 3, 6).unwrap();
        let e = check_entries(&[0, 1, 2, 3, 6, 5], 2, 3, 6).unwrap_err().to_string();
        assert!(e.contains("sequence 1 page 1 is 6, outside the pool of 6 pages"), "{e}");
        let e = check_entries(&[0, 1, 2], 2, 3, 6).unwrap_err().to_string();
        assert!(e.contains("3 entries for 2 sequences of 3 pages"), "{e}");
        assert!(check_entries(&[u32::MAX; 6], 2, 3, 6).is_err());
    }

    #[test]
    fn table_shapes_and_gathers_are_checked() {
        let pages = PageShape::new(64, 16, 8, 64, PageOrder::HeadMajor).unwrap();
        let t = TableShape::new(4, 8, pages).unwrap();
        assert_eq!(t.capacity(), 128);
        for (bad, expected) in [
            (TableShape::new(0, 8, pages), "0 sequences of 8 pages"),
            (TableShape::new(4, 0, pages), "4 sequences of 0 pages"),
            (TableShape::new(4, 1 << 28, pages), "exceeds i32 lengths"),
        ] {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        let pool = pages.pool_len();
        let g = PageGather::new(3, 100, 128);
        g.check(t, pool, 3 * 128 * 512).unwrap();
        for (bad, (p, d), expected) in [
            (g, (pool - 1, 3 * 128 * 512), "a page pool has"),
            (g, (pool, 3 * 128 * 512 - 1), "destination has"),
            (PageGather { batch: 5, ..g }, (pool, usize::MAX), "sequences 0..5 of a page table of 4"),
            (PageGather { rows: 129, max_seq: 200, ..g }, (pool, usize::MAX), "past the table's 128"),
            (PageGather { rows: 101, max_seq: 100, ..g }, (pool, usize::MAX), "101 rows into"),
            (PageGather { rows: 0, ..g }, (pool, usize::MAX), "empty copy"),
        ] {
            let e = bad.check(t, p, d).unwrap_err();
            assert!(matches!(e, crate::Error::InvalidArgument(_)), "{expected}: {e:?}");
            assert!(e.to_string().contains(expected), "{expected}: {e}");
        }
        let e = t.check_call("x", (0, 2), (8, 128), &[pool]).unwrap_err().to_string();
        assert!(e.contains("rows of 8 heads of 128, the pages hold 8 heads of 64"), "{e}");
        t.check_call("x", (3, 1), (8, 64), &[pool]).unwrap();
        let e = t.check_call("x", (3, 2), (8, 64), &[pool]).unwrap_err().to_string();
        assert!(e.contains("sequences 3..5 of a page table of 4"), "{e}");
        assert!(t.check_call("x", (usize::MAX, 2), (8, 64), &[pool]).is_err());
    }

    #[test]
    fn cache_rows_report_their_capacity() {
        assert_eq!(CacheRows::Contiguous { max_seq: 77 }.max_seq(), 77);
        assert_eq!(PageOrder::HeadMajor.name(), "head-major");
        assert_eq!(PageOrder::TokenMajor.name(), "token-major");
    }
}
