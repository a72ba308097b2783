//! A tensor-parallel rank's sum of a row-parallel projection (`o_proj`, `down`) over the ranks:
//! an all-reduce after the projection, or, for long passes, the ranks' partial rows gathered
//! by the copy engines while the rank computes something else, and summed by the rank itself.
//!
//! ```text
//! all-reduce: main  [ GEMM rows 0..n (+x on rank 0) -> sum ][ all-reduce sum ]
//! chunks:     main  [ GEMM chunk 0 -> slot 0 ][ GEMM chunk 1 -> slot 1 ]        [ x+sum 0 ][ x+sum 1 ]
//!             side                            [ gather 0 ]           [ gather 1 ]
//! halves:     main  [ A: ... o_proj -> slot 0 ][ B: ... o_proj -> slot 1 ][ A: x+sum 0, MLP ... ][ B: x+sum 1, ...
//!             side                             [ gather 0 ]               [ gather 1 ]
//! ```
//!
//! In the gathered forms a GEMM writes the rank's part of a slot in its communicator's gather window
//! ([`Comm::gather_slots`]), with no residual on any rank; an in-place all-gather on a side stream
//! copies every rank's part into every rank's slot with the copy engines (NCCL's zero-CTA path: no
//! kernel, no SM taken from the GEMMs); then [`sum_partials`] adds the residual `x` and the parts in
//! rank order on the context's stream, rounding once. So every rank runs the same GEMMs (on two
//! H200s a rank-0 GEMM with the residual epilogue took about 1 ms more over an 8B prefill, and the
//! other rank waited for it at every gather), and the sum is one rounding of `x + Σ parts` where the
//! all-reduce rounds rank 0's `x + part` first. The streams are ordered by the slots' own cudarc
//! events: a gather waits for its GEMM's write, a sum for its gather, a GEMM reusing a slot for the
//! sum that read it.
//!
//! Chunks: a pass of at least [`MIN_GATHER_ROWS`] rows runs each projection in row chunks
//! ([`chunk_rows`]), a chunk's gather beside the next chunk's GEMM; the last chunk's gather is
//! waited for. Halves: one sequence whose halves each hold [`MIN_GATHER_ROWS`] rows and fit a slot
//! runs as two halves interleaved module by module ([`RankSum::half`], `model/halves.rs`), each
//! projection whole into its half's slot, its gather beside the other half's modules; only the
//! second half's last gather is waited for. Either way, every rank chooses alike (by shape, never by backend: a rank's
//! backend may differ where one fell back), and only outside a CUDA graph capture (decode steps and
//! short passes keep the all-reduce: NCCL's one-row all-reduces are faster than a copy's fixed
//! cost). On two H200s (Llama-3.1-8B, TP2, prefill 1 x 2048, 1024-row slots): halves 27.68 ms,
//! chunks 28.33 (the build before the residual moved into the sum), all-reduced 29.30, in one call;
//! chunks of 512 rows gained nothing over all-reduces and of 256 lost 4.5 ms (each gather has a
//! fixed cost, its two flag handshakes, beside the copy). `benches/results/h200-x2/tensor-parallel.md`
//! has the calls.

use crate::nccl::{Comm, NcclError, WindowBuf};
use crate::Result;
use cudnn_llm_ops::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use cudnn_llm_ops::{sum_partials, Backend, Cudnn, Element};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

/// Fewest rows of a pass whose sums are gathered.
pub const MIN_GATHER_ROWS: usize = 512;

/// Slots of the gather window: a chunk's gather overlaps the next chunk's GEMM, which writes the
/// other slot.
pub const GATHER_SLOTS: usize = 2;

/// A rank's gather window as [`GATHER_SLOTS`] slots of `ranks · slot_rows · width` elements, and the
/// side stream its gathers run on.
pub(crate) struct Gather<T> {
    /// Views only (dropping them frees nothing): the communicator frees the window after its
    /// destroy, which waits for the gathers still queued; an aborted one leaves it allocated. No
    /// wait here: a side stream held by a failed peer's handshake would never return.
    slots: Vec<WindowBuf<T>>,
    side: Arc<CudaStream>,
    slot_rows: usize,
    /// Chunks gathered so far.
    gathered: u64,
}

impl<T: Element> Gather<T> {
    /// Bytes of the gather window whose slots hold `slot_rows` rows `width` wide of each of `ranks`
    /// ranks (`None` when that overflows); [`Gather::new`] cuts such a window back into those slots.
    pub(crate) fn window_bytes(ranks: usize, slot_rows: usize, width: usize) -> Option<usize> {
        [ranks, slot_rows, width, std::mem::size_of::<T>()]
            .iter()
            .try_fold(GATHER_SLOTS, |a, &b| a.checked_mul(b))
    }

    /// `comm`'s gather window cut into slots of rows `width` wide, or `None` where the rank has no
    /// window ([`Comm::gather_bytes`] 0) or it holds no row.
    pub(crate) fn new(ctx: &Cudnn, comm: &Comm, width: usize) -> Result<Option<Self>> {
        let row_bytes = Self::window_bytes(comm.ranks(), 1, width).unwrap_or(usize::MAX);
        let slot_rows = comm.gather_bytes() / row_bytes.max(1);
        if slot_rows == 0 {
            return Ok(None);
        }
        let Some(slots) =
            comm.gather_slots::<T>(ctx.stream(), comm.ranks() * slot_rows * width, GATHER_SLOTS)
        else {
            return Ok(None);
        };
        let side = ctx.stream().context().new_stream().map_err(cudnn_llm_ops::Error::from)?;
        Ok(Some(Gather { slots, side, slot_rows, gathered: 0 }))
    }

    /// Chunks gathered so far (every projection's, every pass's).
    pub(crate) fn chunks_gathered(&self) -> u64 {
        self.gathered
    }
}

/// The row ranges a gathered projection of `rows` rows runs in: chunks of at most `slot_rows`, at
/// least two (so that one gather overlaps a GEMM), equal but the last; `None` under
/// [`MIN_GATHER_ROWS`].
pub(crate) fn chunk_rows(rows: usize, slot_rows: usize) -> Option<Vec<Range<usize>>> {
    if rows < MIN_GATHER_ROWS || slot_rows == 0 {
        return None;
    }
    let chunks = rows.div_ceil(slot_rows).max(2);
    let size = rows.div_ceil(chunks);
    Some((0..chunks).map(|c| c * size..((c + 1) * size).min(rows)).filter(|r| !r.is_empty()).collect())
}

/// One pass's sums over the ranks: [`RankSum::project`] runs a row-parallel projection (and, gathered,
/// its chunks' gathers), [`RankSum::finish`] completes the sum.
pub(crate) struct RankSum<'a, T> {
    comm: &'a Comm,
    /// The gather window, where this pass may use it.
    gather: Option<&'a RefCell<Gather<T>>>,
    /// One half of a pass whose halves interleave ([`RankSum::half`]): each projection whole, in
    /// this slot.
    lane: Option<usize>,
    width: usize,
    /// Chunks gathered and not summed yet: their slot and rows.
    pending: RefCell<VecDeque<(usize, Range<usize>)>>,
    /// The last projection was gathered (`finish` sums its chunks instead of all-reducing).
    gathered: Cell<bool>,
    /// A gather that failed to enqueue (`finish` returns it).
    failed: Cell<Option<NcclError>>,
}

impl<'a, T: Element> RankSum<'a, T> {
    /// The sums of a pass on `ctx`'s stream over rows `width` wide; `gather` is used unless the
    /// stream is capturing a graph (NCCL's copy-engine path is not used inside graphs here).
    pub(crate) fn new(
        ctx: &Cudnn,
        comm: &'a Comm,
        gather: Option<&'a RefCell<Gather<T>>>,
        width: usize,
    ) -> Result<Self> {
        use cudnn_llm_ops::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let gather = match gather {
            Some(g) => {
                let capturing = ctx.stream().capture_status().map_err(cudnn_llm_ops::Error::from)?;
                (capturing == CU_STREAM_CAPTURE_STATUS_NONE).then_some(g)
            }
            None => None,
        };
        let (pending, gathered, failed) = (RefCell::default(), Cell::new(false), Cell::new(None));
        Ok(RankSum { comm, gather, lane: None, width, pending, gathered, failed })
    }

    /// The rows at which a pass of `rows` rows (one sequence) splits into two halves that
    /// interleave module by module ([`crate::Llama`]'s halved pass), each half's sums gathered
    /// whole in a slot of its own while the other half computes: `None` unless this pass gathers
    /// ([`RankSum::new`]: a window, no capture) and each half holds [`MIN_GATHER_ROWS`] rows or
    /// more and fits a slot. It depends on the shape alone, so every rank splits alike.
    pub(crate) fn halves_at(&self, rows: usize) -> Option<usize> {
        Self::may_halve(rows).then_some(())?;
        let slot_rows = self.gather?.borrow().slot_rows;
        let first = rows.div_ceil(2);
        (first <= slot_rows).then_some(first)
    }

    /// Whether a pass of `rows` rows is long enough for halves of [`MIN_GATHER_ROWS`] rows each.
    pub(crate) fn may_halve(rows: usize) -> bool {
        rows / 2 >= MIN_GATHER_ROWS
    }

    /// The sums of half `half` (0 or 1) of this pass, run halved ([`RankSum::halves_at`]): every
    /// projection gathers its rows whole into slot `half`, and [`RankSum::finish`], called before
    /// the half's next projection, sums them.
    pub(crate) fn half(&self, half: usize) -> Self {
        debug_assert!(half < GATHER_SLOTS);
        let (pending, gathered, failed) = (RefCell::default(), Cell::new(false), Cell::new(None));
        let (comm, gather, width) = (self.comm, self.gather, self.width);
        RankSum { comm, gather, lane: Some(half), width, pending, gathered, failed }
    }

    /// Runs the projection `project(backend, rows, residual, out)`, which writes rows `rows` of its
    /// output (plus those of `residual`, where given) into `out` (exactly those rows), over the pass's
    /// `rows`: into `sum` whole, `x` added where `adds_residual` (the first rank's epilogue); or
    /// (gathered: `reduce` with a window and [`chunk_rows`] splitting them) chunk by chunk into the
    /// gather slots without `x`, each chunk's gather enqueued after its GEMM, and every rank adds
    /// `x` when it sums the parts (so no rank's GEMM carries an epilogue the others lack). Every
    /// rank must make the same choice (their collectives differ), so it depends on the pass's shape
    /// only, not on the backend: a naive projection gathers too. A fused chunk refused
    /// (`NotSupported`) after a gather was enqueued runs naive on its own; before, the refusal is
    /// returned, for the caller's fallback. A half of a halved pass ([`RankSum::half`]) gathers
    /// the projection whole into its own slot, and its previous projection's sum must have been
    /// completed ([`RankSum::finish`]) before.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn project(
        reduce: Option<&Self>,
        ctx: &Cudnn,
        backend: Backend,
        rows: usize,
        x: &CudaSlice<T>,
        adds_residual: bool,
        sum: &mut CudaSlice<T>,
        mut project: impl FnMut(
            Backend,
            Range<usize>,
            Option<&CudaSlice<T>>,
            &mut dyn DevicePtrMut<T>,
        ) -> cudnn_llm_ops::Result<()>,
    ) -> cudnn_llm_ops::Result<()> {
        let gathered = reduce.and_then(|r| {
            let g = r.gather?;
            let slot_rows = g.borrow().slot_rows;
            let chunks = match r.lane {
                Some(_) => (rows > 0 && rows <= slot_rows).then(|| std::iter::once(0..rows).collect())?,
                None => chunk_rows(rows, slot_rows)?,
            };
            Some((r, g, chunks))
        });
        let Some((reduce, gather, chunks)) = gathered else {
            return project(backend, 0..rows, adds_residual.then_some(x), sum);
        };
        let (comm, width) = (reduce.comm, reduce.width);
        let (rank, ranks) = (comm.rank(), comm.ranks());
        // A half's slot holds one projection: the last one's sum ran (`finish`) before this.
        debug_assert!(reduce.lane.is_none() || reduce.pending.borrow().is_empty());
        reduce.gathered.set(true);
        let mut enqueued = false;
        let ran = (|| -> cudnn_llm_ops::Result<()> {
            for (j, r) in chunks.into_iter().enumerate() {
                let slot = reduce.lane.unwrap_or(j % GATHER_SLOTS);
                if j >= GATHER_SLOTS {
                    reduce.sum_next(ctx, x, sum)?;
                }
                let n = r.len() * width;
                let mut g = gather.borrow_mut();
                let Gather { side, slots, .. } = &mut *g;
                let mut mine = slots[slot].slice_mut(rank * n..(rank + 1) * n);
                match project(backend, r.clone(), None, &mut mine) {
                    Err(e) if enqueued && backend == Backend::Fused && e.is_not_supported() => {
                        project(Backend::Naive, r.clone(), None, &mut mine)?
                    }
                    other => other?,
                }
                if let Err(e) = comm.gather_in_place(side, &mut slots[slot].slice_mut(..ranks * n)) {
                    reduce.failed.set(Some(e));
                    break;
                }
                enqueued = true;
                reduce.pending.borrow_mut().push_back((slot, r));
                g.gathered += 1;
            }
            Ok(())
        })();
        match ran {
            Err(e) => {
                reduce.gathered.set(false);
                reduce.pending.borrow_mut().clear();
                Err(e)
            }
            Ok(()) => Ok(()),
        }
    }

    /// Sums the oldest gathered chunk's parts and its rows of `x` into its rows of `sum`.
    fn sum_next(&self, ctx: &Cudnn, x: &CudaSlice<T>, sum: &mut CudaSlice<T>) -> cudnn_llm_ops::Result<()> {
        let Some((slot, r)) = self.pending.borrow_mut().pop_front() else { return Ok(()) };
        let Some(gather) = self.gather else { return Ok(()) };
        let (ranks, n, w) = (self.comm.ranks(), r.len() * self.width, self.width);
        let g = gather.borrow();
        let base = x.slice(r.start * w..r.end * w);
        sum_partials(
            ctx,
            &g.slots[slot].slice(..ranks * n),
            ranks,
            Some(&base),
            &mut sum.slice_mut(r.start * w..r.end * w),
        )
    }

    /// Completes the sum of `sum`'s first `n` elements (the pass's rows) over the ranks on the
    /// context's stream: sums the gathered chunks of the last projection with `x` (the residual its
    /// [`RankSum::project`] was given), or all-reduces them in place.
    pub(crate) fn finish(
        &self,
        ctx: &Cudnn,
        x: &CudaSlice<T>,
        sum: &mut CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        if let Some(e) = self.failed.take() {
            self.pending.borrow_mut().clear();
            self.gathered.set(false);
            return Err(e.into());
        }
        if !self.gathered.take() {
            return Ok(self.comm.all_reduce_sum(ctx.stream(), &mut sum.slice_mut(..n))?);
        }
        while !self.pending.borrow().is_empty() {
            self.sum_next(ctx, x, sum)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_passes_split_into_chunks_of_a_slot_at_most_and_two_at_least() {
        assert_eq!(chunk_rows(2048, 1024), Some(vec![0..1024, 1024..2048]));
        assert_eq!(chunk_rows(2048, 4096), Some(vec![0..1024, 1024..2048]));
        assert_eq!(chunk_rows(2048, 512).unwrap().len(), 4);
        assert_eq!(chunk_rows(4096, 1024).unwrap()[3], 3072..4096);
        // Uneven: equal chunks but the last.
        assert_eq!(chunk_rows(3000, 1024), Some(vec![0..1000, 1000..2000, 2000..3000]));
        assert_eq!(chunk_rows(1001, 1024), Some(vec![0..501, 501..1001]));
        assert_eq!(chunk_rows(MIN_GATHER_ROWS, 1024).unwrap().len(), 2);
        // Short passes and decode steps keep the all-reduce.
        for rows in [0, 1, 64, MIN_GATHER_ROWS - 1] {
            assert_eq!(chunk_rows(rows, 1024), None, "{rows} rows");
        }
        assert_eq!(chunk_rows(2048, 0), None);
        // Every row once, in order, each chunk within a slot.
        for (rows, slot) in [(2048, 1000), (777, 300), (5000, 1024), (513, 4096)] {
            let chunks = chunk_rows(rows, slot).unwrap();
            assert!(chunks.iter().all(|r| r.len() <= slot), "{rows} in {slot}: {chunks:?}");
            let flat: Vec<usize> = chunks.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..rows).collect::<Vec<_>>());
        }
    }
}
