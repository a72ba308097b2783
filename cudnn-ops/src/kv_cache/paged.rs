//! A paged KV cache ([`PagedKvCache`], whose docs hold the recipe): page pools per layer, one page
//! table, sequences that come and go; decode attention through the table, with an explicit contiguous
//! fallback.

use super::pages::{PagedBook, PagedStep, SeqId};
use super::{check_append, within, KvCacheShape, QkvRows};
use crate::dtype::Element;
use crate::error::ensure;
use crate::faults::Zeros;
use crate::ops::rope::{rope, RopeArgs, RopeOperands, RopeTables, TokenPositions};
use crate::ops::rows::{
    gather_pages, CacheRows, PageGather, PageGatherOperands, PageShape, PageTable, TableShape,
};
use crate::ops::sdpa::{
    sdpa, sdpa_ragged, DeviceRagged, Layout, RaggedArgs, RaggedOperands, RowStrides, SdpaArgs, SdpaKernel,
    SdpaOperands, SeqLens,
};
use crate::{Backend, Cudnn, Error, Mask, Result};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

/// Which attention [`PagedKvCache::attend`] ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PagedForm {
    /// cuDNN's unified SDPA reading K and V through the page table (cuDNN 9.15+): one plan for every
    /// decode step, lengths read on the device.
    Paged,
    /// The split-KV kernel reading K and V through the page table: one launch for every decode step,
    /// lengths read on the device (a cuDNN older than 9.15).
    SplitKv,
    /// A prefill of sequences holding nothing yet: causal attention over the step's own K/V rows of
    /// the QKV buffer (the pages are written, not read).
    Prefill,
    /// A packed prefill of several sequences of different lengths holding nothing yet: ragged causal
    /// attention ([`sdpa_ragged`](crate::sdpa_ragged)) over the step's own Q/K/V rows, read in place
    /// through row strides (the pages are written, not read).
    Ragged,
    /// The contiguous fallback: each sequence's pages copied into a contiguous buffer, then one
    /// attention call per sequence over its own length (lengths from the host).
    Gathered,
}

impl PagedForm {
    /// `paged`, `paged-split-kv`, `prefill`, `ragged` or `gathered`.
    pub fn name(self) -> &'static str {
        match self {
            PagedForm::Paged => "paged",
            PagedForm::SplitKv => "paged-split-kv",
            PagedForm::Prefill => "prefill",
            PagedForm::Ragged => "ragged",
            PagedForm::Gathered => "gathered",
        }
    }

    /// Whether the attention took every length and position from the device, so that a captured
    /// CUDA graph of the step serves every later step (true for [`PagedForm::Paged`] and
    /// [`PagedForm::SplitKv`]).
    pub fn reads_device_lengths(self) -> bool {
        matches!(self, PagedForm::Paged | PagedForm::SplitKv)
    }
}

/// How a paged cache's decode steps read the pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PagedPath {
    /// The fused backend's choice: cuDNN's paged plan (9.15+), else the split-KV kernel.
    Fused,
    /// The split-KV kernel (cuDNN's paged plan was refused).
    SplitKv,
    /// The contiguous fallback (the split-KV kernel was refused too).
    Gathered,
}

/// Shape of a [`PagedKvCache`]: `layers` pairs of page pools of `pages`, and a page table of
/// `max_batch` rows (the most sequences one step runs) of enough pages for `max_seq` positions each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PagedKvShape {
    /// Decoder layers (a K and a V pool each).
    pub layers: usize,
    /// Rows of the page table: the most sequences of one step.
    pub max_batch: usize,
    /// Positions a sequence may hold, rounded up to whole pages.
    pub max_seq: usize,
    /// Each pool's shape.
    pub pages: PageShape,
}

impl PagedKvShape {
    /// Checks the shape: every count > 0, the head dim a multiple of 8 (as attention needs), the table
    /// valid ([`TableShape::new`]).
    pub fn new(layers: usize, max_batch: usize, max_seq: usize, pages: PageShape) -> Result<Self> {
        let s = PagedKvShape { layers, max_batch, max_seq, pages };
        ensure!(layers > 0 && max_seq > 0, "paged cache: empty shape {s:?}");
        ensure!(
            pages.head_dim.is_multiple_of(8),
            "paged cache: head dim {} is not a multiple of 8",
            pages.head_dim
        );
        s.table_shape()?;
        Ok(s)
    }

    /// Pages of a table row: `ceil(max_seq / page_size)`.
    pub fn max_pages(&self) -> usize {
        self.pages.pages_for(self.max_seq)
    }

    /// Positions a sequence may hold: `max_pages · page_size` (`max_seq` rounded up).
    pub fn capacity(&self) -> usize {
        self.max_pages() * self.pages.page_size
    }

    fn table_shape(&self) -> Result<TableShape> {
        TableShape::new(self.max_batch, self.max_pages(), self.pages)
    }

    /// The page table's shape.
    pub fn table(&self) -> TableShape {
        // Checked by `PagedKvShape::new`.
        TableShape { batch: self.max_batch, max_pages: self.max_pages(), pages: self.pages }
    }
}

/// A paged KV cache: per layer, a K and a V page pool ([`PageShape`]); one page table for all layers
/// (a sequence's page `i` holds the same positions in every layer's pools); sequences that come and
/// go ([`PagedKvCache::add`], [`PagedKvCache::remove`]), each growing into pages as it needs them
/// (host allocator: a full pool is [`Error::OutOfPages`], with nothing changed).
///
/// Recipe for one step (a prefill of one sequence, a packed prefill of several, or a decode step of
/// several, each at its own length):
/// 1. `cache.begin(&ctx, &ids, seq, rows)?`: `seq` new tokens for each sequence of `ids` (row `i` of
///    the launch is `ids[i]`; `rows >= ids.len()` rows, e.g. a CUDA graph's batch bucket, the rows past
///    `ids` write nothing); gives them pages and uploads the page table, positions and lengths. Or
///    `cache.begin_packed(&ctx, &ids, &lens)?`: sequence `ids[i]` (holding nothing) gets `lens[i]`
///    tokens, all of them back to back in one row of `sum(lens)` tokens (each token's sequence and
///    position uploaded too);
/// 2. per layer, after the QKV projection: [`PagedKvCache::append_rotated`] (RoPE on Q and K in
///    place, the rotated K and the V rows into the pools through the table, one kernel fused);
/// 3. per layer, [`PagedKvCache::attend`]: decode attention reads K and V through the table
///    ([`PagedForm`]); a prefill from empty attends over the step's own K/V rows (a packed one with
///    ragged attention, one plan per sequence count and power-of-two bucket of the longest);
/// 4. `cache.finish()?`: the step's tokens count.
///
/// Where cuDNN refuses its paged plan (`NotSupported`, naming the page-table attributes and the
/// version they need, or cuDNN's own reason) the cache records why ([`PagedKvCache::paged_refusal`])
/// and reads the pages with the split-KV kernel instead; where that is refused too (a shape it does not
/// take), it falls back to the contiguous form, explicitly ([`PagedForm::Gathered`]): each sequence's
/// pages are copied into a contiguous buffer and attended to as the contiguous cache does, one call
/// per sequence. Neither refusal is retried. The naive backend always takes the contiguous form.
pub struct PagedKvCache<T> {
    shape: PagedKvShape,
    k: Vec<CudaSlice<T>>,
    v: Vec<CudaSlice<T>>,
    table: PageTable,
    book: PagedBook,
    /// Per table row, the first position the step writes (-1: none), the keys its query attends to,
    /// and its query count.
    positions: CudaSlice<i32>,
    kv_lens: CudaSlice<i32>,
    q_lens: CudaSlice<i32>,
    /// `q_lens` and `kv_lens` clamped into `(1, capacity)` by the step's first paged cuDNN attention
    /// (the split-KV kernel clamps as it reads).
    seq_lens: SeqLens,
    clamped: bool,
    /// How decode steps read the pages now: the refusals recorded move it from the fused choice to the
    /// split-KV kernel, then to the contiguous fallback.
    path: PagedPath,
    /// The refusals, in order.
    refusals: Vec<String>,
    last_form: Option<PagedForm>,
    /// Every append and attention of the step begun took positions and lengths from the device.
    on_device: bool,
    /// The contiguous K and V copies of the fallback (`[max_batch, capacity, h_kv · d]`), allocated by
    /// its first use.
    gathered: Option<(CudaSlice<T>, CudaSlice<T>)>,
    /// A packed step's tokens: each one's table row, then each one's position (`[2, tokens]`); grown
    /// by the packed steps that need more.
    tokens: CudaSlice<i32>,
    /// A packed step's ragged batch over the QKV rows, made by its first attention for the rows'
    /// `(heads_q, row_stride)` and kept for the step's other layers.
    ragged: Option<((usize, usize), DeviceRagged)>,
}

impl<T: Element> PagedKvCache<T> {
    /// An empty cache of `shape` (pools zero-filled) on `ctx`'s stream. Takes 16-bit elements.
    pub fn new(ctx: &Cudnn, shape: PagedKvShape) -> Result<Self> {
        if T::DTYPE.size() != 2 {
            return Err(Error::NotSupported {
                op: "paged kv cache".into(),
                reason: format!("takes 16-bit elements, not {}", T::DTYPE),
            });
        }
        let table = shape.table_shape()?;
        let bytes = crate::checked::product(
            "paged kv cache: bytes",
            &[2, shape.layers, shape.pages.num_pages, shape.pages.page_len(), T::DTYPE.size()],
        )?;
        ctx.ensure_free(bytes, || {
            format!("a paged KV cache of {} layers x {} pages", shape.layers, shape.pages.num_pages)
        })?;
        let s = ctx.stream();
        let (mut k, mut v) = (Vec::with_capacity(shape.layers), Vec::with_capacity(shape.layers));
        for _ in 0..shape.layers {
            k.push(s.zeros::<T>(shape.pages.pool_len())?);
            v.push(s.zeros::<T>(shape.pages.pool_len())?);
        }
        let n = shape.max_batch;
        Ok(PagedKvCache {
            shape,
            k,
            v,
            table: PageTable::new(ctx, table)?,
            book: PagedBook::new(shape.pages.num_pages, shape.pages.page_size, table.max_pages, n)?,
            positions: s.zeros::<i32>(n)?,
            kv_lens: s.zeros::<i32>(n)?,
            q_lens: s.zeros::<i32>(n)?,
            seq_lens: SeqLens::new(ctx, n, 1, shape.capacity())?,
            clamped: false,
            path: PagedPath::Fused,
            refusals: Vec::new(),
            last_form: None,
            on_device: true,
            gathered: None,
            tokens: s.zeros::<i32>(2)?,
            ragged: None,
        })
    }

    /// The shape.
    pub fn shape(&self) -> PagedKvShape {
        self.shape
    }

    /// A new sequence, holding nothing (its pages come with its steps).
    pub fn add(&mut self) -> SeqId {
        self.book.add()
    }

    /// Removes sequence `id` and gives its pages back to the pool (an error for an unknown sequence or
    /// one in the step begun).
    pub fn remove(&mut self, id: SeqId) -> Result<()> {
        self.book.remove(id)
    }

    /// Positions sequence `id` holds (the step begun not counted).
    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.book.len(id)
    }

    /// Pages sequence `id` holds, in position order.
    pub fn pages(&self, id: SeqId) -> Result<&[u32]> {
        self.book.pages(id)
    }

    /// The sequences, oldest first.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.book.ids()
    }

    /// Pages free in the pool.
    pub fn free_pages(&self) -> usize {
        self.book.allocator().free()
    }

    /// Begins a step of `seq` new tokens for each sequence of `ids` in a launch of `rows` rows (row `i`
    /// is `ids[i]`, rows past them write nothing and attend to one key): gives the sequences the pages
    /// their new positions need and uploads the page table, each row's first position and its key and
    /// query counts on `ctx`'s stream (read on the device by the step's appends and attention). An
    /// error, with nothing changed, where a sequence has no room, an id is unknown or repeated, or the
    /// pool has too few free pages ([`Error::OutOfPages`]). A step begun and not finished is dropped.
    pub fn begin(&mut self, ctx: &Cudnn, ids: &[SeqId], seq: usize, rows: usize) -> Result<()> {
        let v = self.book.begin(ids, seq, rows)?;
        self.new_step();
        self.upload(ctx, &v)
    }

    /// Begins a packed step: sequence `ids[i]` (each holding nothing) gets `lens[i]` new tokens, the
    /// sequences' tokens back to back in one row of `sum(lens)` tokens (the QKV rows of the step are
    /// in that order); one sequence is `begin(ctx, ids, lens[0], 1)`. Gives the sequences pages and
    /// uploads the page table, lengths, and each token's table row and position (RoPE's
    /// [`TokenPositions`]). An error, with nothing changed, where a sequence holds tokens, gets none,
    /// has no room, is unknown or repeated, where there are more sequences than table rows, or the
    /// pool has too few free pages ([`Error::OutOfPages`]). A step begun and not finished is dropped.
    pub fn begin_packed(&mut self, ctx: &Cudnn, ids: &[SeqId], lens: &[usize]) -> Result<()> {
        let v = self.book.begin_packed(ids, lens)?;
        self.new_step();
        self.upload(ctx, &v)
    }

    /// Forgets what the step before did (its lengths clamped, its form, its ragged batch), once a new
    /// step is begun; a refused begin leaves them to the step still begun.
    fn new_step(&mut self) {
        self.clamped = false;
        self.on_device = true;
        self.ragged = None;
    }

    /// Uploads a step's values (the step counts as begun already; a failed upload drops it).
    fn upload(&mut self, ctx: &Cudnn, v: &PagedStep) -> Result<()> {
        let done = (|| {
            let s = ctx.stream();
            self.table.upload(ctx, &v.table)?;
            s.memcpy_htod(&v.positions, &mut self.positions)?;
            s.memcpy_htod(&v.kv_lens, &mut self.kv_lens)?;
            s.memcpy_htod(&v.q_lens, &mut self.q_lens)?;
            if !v.tokens.is_empty() {
                if self.tokens.len() < v.tokens.len() {
                    self.tokens = s.zeros::<i32>(v.tokens.len())?;
                }
                s.memcpy_htod(&v.tokens, &mut self.tokens.slice_mut(..v.tokens.len()))?;
            }
            Ok(())
        })();
        if done.is_err() {
            self.book.cancel();
        }
        done
    }

    /// A packed step's new tokens per sequence (in the order begun), if the step begun is one.
    pub fn packed(&self) -> Option<&[usize]> {
        self.book.step().ok().and_then(|s| s.packed.as_deref())
    }

    /// Counts the step's tokens; returns how many each of its sequences got.
    pub fn finish(&mut self) -> Result<usize> {
        self.book.finish()
    }

    /// Drops the step begun, if any: nothing of it counts, the pages it gave its sequences go back to
    /// the pool, and its sequences may be removed.
    pub fn cancel(&mut self) {
        self.book.cancel();
    }

    /// The step begun: `(rows, seq)`, the rows of its launch and the new tokens of each sequence (a
    /// packed step: one row of all its tokens, [`PagedKvCache::packed`] has each sequence's).
    pub fn step(&self) -> Option<(usize, usize)> {
        self.book.step().ok().map(|s| (s.rows, s.seq))
    }

    /// Positions a sequence may hold ([`PagedKvShape::capacity`]).
    pub fn capacity(&self) -> usize {
        self.shape.capacity()
    }

    /// Layer `layer`'s K and V pools (each of [`PagedKvShape::pages`]).
    pub fn layer(&self, layer: usize) -> Result<(&CudaSlice<T>, &CudaSlice<T>)> {
        self.check_layer(layer)?;
        Ok((&self.k[layer], &self.v[layer]))
    }

    /// The page table (rows of the step begun first).
    pub fn table(&self) -> &PageTable {
        &self.table
    }

    /// Why decode steps here do not take the fused choice of paged attention: cuDNN's refusal of its
    /// paged plan (it names the page-table attributes and the version, or gives cuDNN's reason), then
    /// the split-KV kernel runs; and the split-KV kernel's refusal after it, then the contiguous
    /// fallback ([`PagedForm::Gathered`]) runs. Joined by `"; then "`, in the order met.
    pub fn paged_refusal(&self) -> Option<String> {
        (!self.refusals.is_empty()).then(|| self.refusals.join("; then "))
    }

    /// The form the last [`attend`](PagedKvCache::attend) ran.
    pub fn last_form(&self) -> Option<PagedForm> {
        self.last_form
    }

    /// Whether every [`append_rotated`](PagedKvCache::append_rotated) and
    /// [`attend`](PagedKvCache::attend) since the step began read its positions and lengths on the
    /// device (fused appends, [`PagedForm::reads_device_lengths`] forms): a CUDA graph captured of the
    /// step then serves every later step of as many rows.
    pub fn step_on_device(&self) -> bool {
        self.on_device
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        ensure!(
            layer < self.shape.layers,
            "paged cache: layer {layer} of a {}-layer cache",
            self.shape.layers
        );
        Ok(())
    }

    /// RoPE on the step's Q and K heads in place in `qkv` (rows as `rows` says, `seq` per table row,
    /// each sequence at its own positions), and the rotated K and the V rows into layer `layer`'s
    /// pools through the page table. Fused: one kernel reading the positions on the device (rows past
    /// the step's sequences write nothing); naive: the eager rotation and two row copies per sequence.
    /// An error, with nothing written, where a position falls outside `tables` or a shape does not fit.
    pub fn append_rotated(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        tables: &RopeTables<T>,
        rows: QkvRows,
        mut qkv: CudaViewMut<'_, T>,
        backend: Backend,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let step = self.book.step()?;
        if let Some(new) = step.packed.clone() {
            return self.append_packed(ctx, layer, tables, rows, qkv, &new, backend);
        }
        let (batch, seq) = (step.rows, step.seq);
        let lens = self.book.step_lens()?;
        let PageShape { heads_kv, head_dim, .. } = self.shape.pages;
        let args = rows.rope_args(batch, seq, heads_kv, head_dim);
        check_append("paged cache", &args, &lens, tables, qkv.len())?;
        let (k, v, table) = (&mut self.k[layer], &mut self.v[layer], &self.table);
        self.on_device &= backend == Backend::Fused;
        if backend == Backend::Fused {
            let x = RopeOperands::new(tables, &mut qkv).append_paged(k, v, table).starts(&self.positions);
            return rope(ctx, args, x, backend);
        }
        let (rows_len, qkv_len) = (seq * rows.row_stride, qkv.len());
        for (b, &start) in lens.iter().enumerate() {
            let mut q = within(qkv.try_slice_mut(b * rows_len..qkv_len))?;
            let x = RopeOperands::new(tables, &mut q).append_to(k, v, CacheRows::Paged { table, first: b });
            rope(ctx, RopeArgs { batch: 1, start, ..args }, x, backend)?;
        }
        Ok(())
    }

    /// [`PagedKvCache::append_rotated`] of a packed step (`new[i]` tokens of the step's sequence `i`,
    /// each holding nothing, back to back): fused, one kernel reading each token's table row and
    /// position on the device; naive, the eager rotation and two row copies per sequence.
    #[allow(clippy::too_many_arguments)]
    fn append_packed(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        tables: &RopeTables<T>,
        rows: QkvRows,
        mut qkv: CudaViewMut<'_, T>,
        new: &[usize],
        backend: Backend,
    ) -> Result<()> {
        let PageShape { heads_kv, head_dim, .. } = self.shape.pages;
        let total: usize = new.iter().sum();
        let args = rows.rope_args(1, total, heads_kv, head_dim);
        // The whole step, checked before anything runs (the sequences hold nothing: position p of
        // sequence i is its token p).
        let longest = new.iter().copied().max().unwrap_or(0);
        ensure!(
            longest <= tables.positions(),
            "paged cache: positions up to {longest} exceed the RoPE tables' {}",
            tables.positions()
        );
        args.check_rows(qkv.len(), tables.positions(), tables.head_dim())?;
        args.check_append_rows()?;
        let (k, v, table) = (&mut self.k[layer], &mut self.v[layer], &self.table);
        self.on_device = false; // a packed step is not replayed
        if backend == Backend::Fused {
            let at = TokenPositions { at: &self.tokens, sequences: new.len() };
            let x = RopeOperands::new(tables, &mut qkv).append_paged(k, v, table).tokens(at);
            return rope(ctx, args, x, backend);
        }
        let (mut first, qkv_len) = (0, qkv.len());
        for (b, &n) in new.iter().enumerate() {
            let mut q = within(qkv.try_slice_mut(first * rows.row_stride..qkv_len))?;
            let x = RopeOperands::new(tables, &mut q).append_to(k, v, CacheRows::Paged { table, first: b });
            rope(ctx, RopeArgs { batch: 1, seq: n, start: 0, ..args }, x, backend)?;
            first += n;
        }
        Ok(())
    }

    /// Attention of the step's queries (`q`: the QKV rows as `rows` says, Q heads first, the step's K
    /// and V appended first) over layer `layer`'s pages, each sequence over its own `len + seq` keys,
    /// causal; O packed `[rows · seq, heads_q · d]` (rows past the step's sequences hold values to
    /// ignore). Picks the form itself and returns it ([`PagedForm`]): a fused decode step reads K and V
    /// through the page table (cuDNN's paged plan, or the split-KV kernel before cuDNN 9.15 or once
    /// cuDNN refused its plan; the step's first cuDNN call clamps the lengths for all layers); a step
    /// of sequences holding nothing attends over its own K/V rows; the rest, and a decode step whose
    /// paged forms were both refused (`NotSupported`, recorded in [`PagedKvCache::paged_refusal`], not
    /// retried), take the contiguous fallback. Other errors are returned.
    pub fn attend(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        rows: QkvRows,
        q: CudaView<'_, T>,
        mut o: CudaViewMut<'_, T>,
        backend: Backend,
    ) -> Result<PagedForm> {
        self.check_layer(layer)?;
        let step = self.book.step()?;
        if let Some(new) = step.packed.clone() {
            self.attend_ragged(ctx, rows, &new, (q, o), backend)?;
            self.last_form = Some(PagedForm::Ragged);
            self.on_device = false;
            return Ok(PagedForm::Ragged);
        }
        let (batch, seq) = (step.rows, step.seq);
        let lens = self.book.step_lens()?;
        let PageShape { heads_kv, head_dim: d, .. } = self.shape.pages;
        // Q and O of the whole launch, checked for every form below.
        let mut own = SdpaArgs::new(batch, rows.heads_q, heads_kv, seq, seq, d, Layout::Bshd);
        own.q_strides = rows.q_strides(seq, d);
        if let Some(s) = rows.scale {
            own = own.with_scale(s);
        }
        let mut form = None;
        while seq == 1 && backend == Backend::Fused && form.is_none() && self.path != PagedPath::Gathered {
            let split_kv = self.path == PagedPath::SplitKv;
            match self.attend_paged(ctx, layer, own, &q, &mut o, split_kv) {
                Ok(f) => form = Some(f),
                Err(e) if e.is_not_supported() => {
                    self.refusals.push(e.to_string());
                    self.path = if split_kv { PagedPath::Gathered } else { PagedPath::SplitKv };
                }
                Err(e) => return Err(e),
            }
        }
        let form = match form {
            Some(f) => f,
            None if lens.iter().all(|&l| l == 0) => {
                // Every key is a row of this step: K and V straight from the QKV rows.
                let (k_at, v_at) = rows.kv_starts(heads_kv, d)?;
                let kv = [seq * rows.row_stride, d, rows.row_stride, 1];
                let a = SdpaArgs { k_strides: kv, v_strides: kv, ..own }.with_mask(Mask::CausalTopLeft);
                let k = within(q.try_slice(k_at..))?;
                let v = within(q.try_slice(v_at..))?;
                sdpa(ctx, a, SdpaOperands::new(&q, &k, &v, &mut o), backend)?;
                PagedForm::Prefill
            }
            None => {
                self.attend_gathered(ctx, layer, rows, (&lens, seq), (q, o), backend)?;
                PagedForm::Gathered
            }
        };
        self.last_form = Some(form);
        self.on_device &= form.reads_device_lengths();
        Ok(form)
    }

    /// The decode step through the page table (on the split-KV kernel when `split_kv`, else the
    /// fused choice): `own` is the launch's attention over its own rows (shape, Q strides, scale).
    fn attend_paged(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        own: SdpaArgs,
        q: &CudaView<'_, T>,
        o: &mut CudaViewMut<'_, T>,
        split_kv: bool,
    ) -> Result<PagedForm> {
        let a = own.with_pages(self.shape.table());
        let a = if split_kv {
            a.with_form(SdpaKernel::SplitKv)
        } else {
            a.with_decode_choice(ctx.decode_attention(), ctx.features())
        };
        let (k, v, table) = (&self.k[layer], &self.v[layer], &self.table);
        let x = SdpaOperands::new(q, k, v, o).pages(table);
        // The split-KV kernel clamps the lengths as it reads them; cuDNN reads a clamped copy.
        let (form, x) = if a.fused_kernel(ctx.features(), false) == SdpaKernel::SplitKv {
            (PagedForm::SplitKv, x.seq_lens(&self.q_lens, &self.kv_lens))
        } else {
            if !self.clamped {
                self.seq_lens.clamp(ctx, &self.q_lens, &self.kv_lens)?;
                self.clamped = true;
            }
            (PagedForm::Paged, x.clamped_seq_lens(&self.seq_lens))
        };
        sdpa(ctx, a, x, Backend::Fused)?;
        Ok(form)
    }

    /// A packed step's attention ([`PagedForm::Ragged`]): ragged causal attention of each sequence
    /// over its own rows, Q, K and V read in place in the QKV rows (tokens `rows.row_stride` apart), O
    /// packed; the batch's offsets are made by the step's first layer.
    fn attend_ragged(
        &mut self,
        ctx: &Cudnn,
        rows: QkvRows,
        new: &[usize],
        (q, mut o): (CudaView<'_, T>, CudaViewMut<'_, T>),
        backend: Backend,
    ) -> Result<()> {
        let PageShape { heads_kv, head_dim: d, .. } = self.shape.pages;
        let hq = rows.heads_q;
        let (k_at, v_at) = rows.kv_starts(heads_kv, d)?;
        let key = (hq, rows.row_stride);
        let batch = match self.ragged.take() {
            Some((made, batch)) if made == key => batch,
            // O packed: `k_at` is a token's Q heads.
            _ => {
                let strides = RowStrides { q: rows.row_stride, kv: rows.row_stride, o: k_at };
                DeviceRagged::strided(ctx, new, (hq, heads_kv, d), strides)?
            }
        };
        let (_, batch) = self.ragged.insert((key, batch));
        let mut a = RaggedArgs::new(new.len(), batch.bucket(), hq, heads_kv, d).with_rows(batch.rows());
        if let Some(s) = rows.scale {
            a = a.with_scale(s);
        }
        let k = within(q.try_slice(k_at..))?;
        let v = within(q.try_slice(v_at..))?;
        sdpa_ragged(ctx, a, RaggedOperands::new(&q, &k, &v, &mut o, batch), backend)
    }

    /// The contiguous fallback: the first `max(len) + seq` positions of every sequence copied out of
    /// the pages, then one attention per sequence over its own `len + seq` keys.
    fn attend_gathered(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        rows: QkvRows,
        (lens, seq): (&[usize], usize),
        (q, mut o): (CudaView<'_, T>, CudaViewMut<'_, T>),
        backend: Backend,
    ) -> Result<()> {
        let cap = self.shape.capacity();
        let PageShape { heads_kv, head_dim: d, .. } = self.shape.pages;
        let n = lens.len();
        let end = lens.iter().max().copied().unwrap_or(0) + seq; // begin checked each len + seq <= cap
        let contiguous = KvCacheShape::new(1, self.shape.max_batch, cap, heads_kv, d)?;
        if self.gathered.is_none() {
            let s = ctx.stream();
            self.gathered =
                Some((s.zeros::<T>(contiguous.layer_len())?, s.zeros::<T>(contiguous.layer_len())?));
        }
        let (gk, gv) = self.gathered.as_mut().expect("allocated above");
        let g = PageGather::new(n, end, cap);
        gather_pages(ctx, g, PageGatherOperands::new(&self.k[layer], &self.table, gk))?;
        gather_pages(ctx, g, PageGatherOperands::new(&self.v[layer], &self.table, gv))?;
        let one = KvCacheShape::new(1, 1, cap, heads_kv, d)?;
        let (q_rows, o_rows, row) =
            (seq * rows.row_stride, seq * rows.heads_q * d, cap * contiguous.row_width());
        let q_len = q.len();
        for (b, &len) in lens.iter().enumerate() {
            let qb = within(q.try_slice(b * q_rows..q_len))?;
            let mut ob = within(o.try_slice_mut(b * o_rows..(b + 1) * o_rows))?;
            let kb = within(gk.try_slice(b * row..(b + 1) * row))?;
            let vb = within(gv.try_slice(b * row..(b + 1) * row))?;
            sdpa(ctx, one.attention(rows, len, seq), SdpaOperands::new(&qb, &kb, &vb, &mut ob), backend)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PageOrder;

    #[test]
    fn shapes_round_up_to_whole_pages_and_are_checked() {
        let pages = PageShape::new(512, 16, 8, 128, PageOrder::HeadMajor).unwrap();
        let s = PagedKvShape::new(32, 64, 1000, pages).unwrap();
        assert_eq!((s.max_pages(), s.capacity()), (63, 1008));
        assert_eq!(s.table(), TableShape::new(64, 63, pages).unwrap());
        let odd = PageShape::new(512, 16, 8, 60, PageOrder::HeadMajor).unwrap();
        for (bad, expected) in [
            (PagedKvShape::new(0, 64, 1000, pages), "empty shape"),
            (PagedKvShape::new(32, 64, 0, pages), "empty shape"),
            (PagedKvShape::new(32, 0, 1000, pages), "0 sequences"),
            (PagedKvShape::new(32, 64, 1000, odd), "not a multiple of 8"),
            (PagedKvShape::new(32, 64, 1 << 31, pages), "exceeds i32 lengths"),
        ] {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
    }

    #[test]
    fn forms_say_whether_a_captured_step_serves_every_length() {
        for (f, name, device) in [
            (PagedForm::Paged, "paged", true),
            (PagedForm::SplitKv, "paged-split-kv", true),
            (PagedForm::Prefill, "prefill", false),
            (PagedForm::Ragged, "ragged", false),
            (PagedForm::Gathered, "gathered", false),
        ] {
            assert_eq!((f.name(), f.reads_device_lengths()), (name, device));
        }
    }
}
