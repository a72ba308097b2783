//! The host side of a paged cache: the page allocator, and the sequences with their pages and
//! lengths, from which each step's page-table rows and device lengths are made. Everything here is
//! checked without a GPU.

use crate::error::ensure;
use crate::{checked, Error, Result};
use std::collections::BTreeMap;

/// Pages of a pool handed out and taken back: a free list (the lowest pages first) and a mark per
/// page, so that a page is never handed out twice and never freed twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageAllocator {
    /// Free pages, the next one to hand out last.
    free: Vec<u32>,
    used: Vec<bool>,
}

impl PageAllocator {
    /// All `total` pages free (at most `u32::MAX`).
    pub fn new(total: usize) -> Result<Self> {
        ensure!(total > 0, "page allocator: a pool of no pages");
        ensure!(total <= u32::MAX as usize, "page allocator: {total} pages exceed u32");
        Ok(PageAllocator { free: (0..total as u32).rev().collect(), used: vec![false; total] })
    }

    /// Pages of the pool.
    pub fn total(&self) -> usize {
        self.used.len()
    }

    /// Pages free.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// `n` pages, or [`Error::OutOfPages`] (naming `what`) with nothing handed out.
    pub fn alloc(&mut self, n: usize, what: impl FnOnce() -> String) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(Error::OutOfPages {
                what: what(),
                needed: n,
                free: self.free.len(),
                total: self.total(),
            });
        }
        let pages = self.free.split_off(self.free.len() - n);
        for &p in &pages {
            self.used[p as usize] = true;
        }
        Ok(pages.into_iter().rev().collect())
    }

    /// Takes `pages` back. A page outside the pool or not handed out is an error, and then none of
    /// them is taken back.
    pub fn release(&mut self, pages: &[u32]) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for &p in pages {
            ensure!(
                (p as usize) < self.used.len() && self.used[p as usize] && seen.insert(p),
                "page allocator: page {p} is not handed out (outside the pool, free, or given twice)"
            );
        }
        for &p in pages.iter().rev() {
            self.used[p as usize] = false;
            self.free.push(p);
        }
        Ok(())
    }
}

/// A sequence of a [`PagedKvCache`](super::PagedKvCache), handed out by
/// [`add`](super::PagedKvCache::add) and valid until [`remove`](super::PagedKvCache::remove).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(u64);

impl SeqId {
    /// The handle's number (unique for the cache's life).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// One sequence: its pages in position order and the positions it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Seq {
    pages: Vec<u32>,
    len: usize,
}

/// The step begun: the sequences in row order, their new tokens each, the rows of the launch. A
/// packed step (several sequences of their own token counts `packed`, back to back) is one row of
/// all their tokens: `rows` 1, `seq` their sum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) order: Vec<SeqId>,
    pub(crate) seq: usize,
    pub(crate) rows: usize,
    pub(crate) packed: Option<Vec<usize>>,
}

impl Step {
    /// New tokens of each sequence, in row order.
    pub(crate) fn new_tokens(&self) -> Vec<usize> {
        match &self.packed {
            Some(lens) => lens.clone(),
            None => vec![self.seq; self.order.len()],
        }
    }
}

/// What a step uploads: the page table (`batch · max_pages` entries, row `i` the pages of the
/// step's sequence `i`, page 0 elsewhere), and per row the first position it writes (-1 for rows past
/// the sequences: nothing is written there), the keys it attends to (1 past the sequences, so that
/// every row reads one valid key) and its query count; for a packed step also each token's table row
/// and position (`[2, tokens]`: RoPE's [`TokenPositions`](crate::TokenPositions); empty otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedStep {
    pub(crate) table: Vec<u32>,
    pub(crate) positions: Vec<i32>,
    pub(crate) kv_lens: Vec<i32>,
    pub(crate) q_lens: Vec<i32>,
    pub(crate) tokens: Vec<i32>,
}

/// The sequences of a paged cache: pages and lengths, the allocator, and the step begun.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedBook {
    alloc: PageAllocator,
    seqs: BTreeMap<SeqId, Seq>,
    next: u64,
    page_size: usize,
    max_pages: usize,
    /// Table rows (the most sequences one step runs).
    batch: usize,
    step: Option<Step>,
}

impl PagedBook {
    pub(crate) fn new(num_pages: usize, page_size: usize, max_pages: usize, batch: usize) -> Result<Self> {
        ensure!(page_size > 0 && max_pages > 0 && batch > 0, "paged cache: empty geometry");
        Ok(PagedBook {
            alloc: PageAllocator::new(num_pages)?,
            seqs: BTreeMap::new(),
            next: 0,
            page_size,
            max_pages,
            batch,
            step: None,
        })
    }

    /// Positions a sequence may hold.
    pub(crate) fn capacity(&self) -> usize {
        self.max_pages * self.page_size
    }

    pub(crate) fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }

    /// A new empty sequence (no pages yet).
    pub(crate) fn add(&mut self) -> SeqId {
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.insert(id, Seq::default());
        id
    }

    fn get(&self, id: SeqId) -> Result<&Seq> {
        self.seqs.get(&id).ok_or_else(|| Error::invalid(format!("paged cache: no sequence {}", id.0)))
    }

    /// Removes a sequence and frees its pages; an error for an unknown one or one in the step begun.
    pub(crate) fn remove(&mut self, id: SeqId) -> Result<()> {
        self.get(id)?;
        if self.step.as_ref().is_some_and(|s| s.order.contains(&id)) {
            return Err(Error::invalid(format!(
                "paged cache: sequence {} is in the step begun; finish it first",
                id.0
            )));
        }
        let seq = self.seqs.remove(&id).expect("checked above");
        self.alloc.release(&seq.pages)
    }

    /// Positions sequence `id` holds.
    pub(crate) fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.get(id)?.len)
    }

    /// Pages sequence `id` holds, in position order.
    pub(crate) fn pages(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.get(id)?.pages)
    }

    /// The live sequences, oldest first.
    pub(crate) fn ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    pub(crate) fn step(&self) -> Result<&Step> {
        self.step
            .as_ref()
            .ok_or_else(|| Error::invalid("paged cache: no step begun (call PagedKvCache::begin first)"))
    }

    /// Lengths of the step's sequences, in row order.
    pub(crate) fn step_lens(&self) -> Result<Vec<usize>> {
        let step = self.step()?;
        step.order.iter().map(|&id| self.len(id)).collect()
    }

    /// Begins a step of `seq` new tokens for each of `order` (distinct live sequences, row `i` the
    /// sequence `order[i]`) in a launch of `rows >= order.len()` rows (at most the table's batch):
    /// gives each the pages its new positions need, and returns what to upload. An error, with nothing
    /// changed (no page handed out), where a sequence has no room or the pool has too few free pages.
    /// A step begun and not finished is dropped (its pages stay with their sequences).
    pub(crate) fn begin(&mut self, order: &[SeqId], seq: usize, rows: usize) -> Result<PagedStep> {
        ensure!(seq > 0, "paged cache: a step of no tokens");
        ensure!(!order.is_empty(), "paged cache: a step of no sequences");
        ensure!(
            order.len() <= rows && rows <= self.batch,
            "paged cache: {} sequences in a launch of {rows} rows, the table has {}",
            order.len(),
            self.batch
        );
        self.grow(order, &vec![seq; order.len()], false)?;
        self.step = Some(Step { order: order.to_vec(), seq, rows, packed: None });
        Ok(self.values(order, &vec![seq; order.len()]))
    }

    /// Begins a packed step: sequence `order[i]` (distinct live sequences holding nothing, at most
    /// the table's batch) gets `lens[i] > 0` new tokens, the sequences' tokens back to back in one
    /// row; one sequence is the step `begin(order, lens[0], 1)`. Gives each the pages it needs and
    /// returns what to upload (with each token's table row and position). Errors as
    /// [`PagedBook::begin`], with nothing changed, and for a sequence that holds tokens (a packed step
    /// attends over its own rows only).
    pub(crate) fn begin_packed(&mut self, order: &[SeqId], lens: &[usize]) -> Result<PagedStep> {
        ensure!(!order.is_empty(), "paged cache: a step of no sequences");
        ensure!(
            order.len() == lens.len(),
            "paged cache: {} sequences with {} token counts",
            order.len(),
            lens.len()
        );
        if let ([one], [n]) = (order, lens) {
            return self.begin(&[*one], *n, 1);
        }
        ensure!(
            order.len() <= self.batch,
            "paged cache: {} sequences in one packed step, the table has {}",
            order.len(),
            self.batch
        );
        for (&id, &n) in order.iter().zip(lens) {
            ensure!(n > 0, "paged cache: sequence {} gets no tokens in a packed step", id.0);
            let held = self.get(id)?.len;
            ensure!(
                held == 0,
                "paged cache: a packed step prefills sequences holding nothing; sequence {} holds {held}",
                id.0
            );
        }
        let total = lens.iter().try_fold(0usize, |a, &n| checked::add("paged cache: packed tokens", a, n))?;
        self.grow(order, lens, true)?;
        self.step = Some(Step { order: order.to_vec(), seq: total, rows: 1, packed: Some(lens.to_vec()) });
        Ok(self.values(order, lens))
    }

    /// Gives each of `order` (distinct live sequences) the pages its next `lens[i]` positions need:
    /// all of them, or an error with nothing handed out (naming a `packed` step or a plain one).
    fn grow(&mut self, order: &[SeqId], lens: &[usize], packed: bool) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        let mut need = Vec::with_capacity(order.len());
        for (&id, &seq) in order.iter().zip(lens) {
            ensure!(seen.insert(id), "paged cache: sequence {} twice in one step", id.0);
            let s = self.get(id)?;
            let end = checked::add("paged cache: length + new tokens", s.len, seq)?;
            ensure!(
                end <= self.capacity(),
                "paged cache: sequence {} holds {} of {} positions, no room for {seq} more",
                id.0,
                s.len,
                self.capacity()
            );
            need.push(end.div_ceil(self.page_size).saturating_sub(s.pages.len()));
        }
        let total: usize = need.iter().sum();
        let tokens: usize = lens.iter().sum();
        let what = || match (packed, lens) {
            (false, [seq, ..]) => format!("a step of {seq} tokens for {} sequences", order.len()),
            _ => format!("a packed step of {tokens} tokens for {} sequences", order.len()),
        };
        let mut fresh = self.alloc.alloc(total, what)?.into_iter();
        for (&id, &n) in order.iter().zip(&need) {
            let s = self.seqs.get_mut(&id).expect("checked above");
            s.pages.extend(fresh.by_ref().take(n));
        }
        Ok(())
    }

    /// What a step of `lens[i]` new tokens for sequence `order[i]` uploads; each token's table row and
    /// position for a packed step.
    fn values(&self, order: &[SeqId], lens: &[usize]) -> PagedStep {
        let (batch, max_pages) = (self.batch, self.max_pages);
        let seq = lens[0];
        let mut v = PagedStep {
            table: vec![0; batch * max_pages],
            positions: vec![-1; batch],
            kv_lens: vec![1; batch],
            q_lens: vec![seq as i32; batch], // each count <= capacity, which fits i32 (TableShape)
            tokens: Vec::new(),
        };
        for (i, (id, &n)) in order.iter().zip(lens).enumerate() {
            let s = &self.seqs[id];
            v.table[i * max_pages..][..s.pages.len()].copy_from_slice(&s.pages);
            v.positions[i] = s.len as i32;
            v.kv_lens[i] = (s.len + n) as i32;
            v.q_lens[i] = n as i32;
        }
        if self.step.as_ref().is_some_and(|s| s.packed.is_some()) {
            let rows =
                order.iter().zip(lens).enumerate().flat_map(|(i, (_, &n))| std::iter::repeat_n(i as i32, n));
            let positions = order.iter().zip(lens).flat_map(|(id, &n)| {
                let start = self.seqs[id].len as i32;
                (0..n as i32).map(move |p| start + p)
            });
            v.tokens = rows.chain(positions).collect();
        }
        v
    }

    /// Drops the step begun, if any: nothing of it counts, and the pages it handed out go back to the
    /// pool (each of its sequences keeps the pages its length needs), so a failed step changes nothing.
    pub(crate) fn cancel(&mut self) {
        let Some(step) = self.step.take() else { return };
        // Last sequence first: the pool's free list ends as it was before the step.
        for id in step.order.iter().rev() {
            let Some(s) = self.seqs.get_mut(id) else { continue };
            let keep = s.len.div_ceil(self.page_size);
            if s.pages.len() > keep {
                let extra = s.pages.split_off(keep);
                // Handed out by this step's `grow` and held by this sequence alone: always taken back.
                let taken = self.alloc.release(&extra);
                debug_assert!(taken.is_ok(), "{taken:?}");
            }
        }
    }

    /// Counts the step's tokens; returns how many each of its sequences got (a packed step: all of
    /// them together).
    pub(crate) fn finish(&mut self) -> Result<usize> {
        let step = self.step.take().ok_or_else(|| Error::invalid("paged cache: no step begun"))?;
        for (id, n) in step.order.iter().zip(step.new_tokens()) {
            if let Some(s) = self.seqs.get_mut(id) {
                s.len += n; // begin checked len + n <= capacity
            }
        }
        Ok(step.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allocator_hands_out_each_page_once_and_takes_only_its_own_back() {
        let mut a = PageAllocator::new(4).unwrap();
        assert_eq!(a.alloc(3, String::new).unwrap(), vec![0, 1, 2]);
        assert_eq!(a.free(), 1);
        match a.alloc(2, || "two more".into()).unwrap_err() {
            Error::OutOfPages { what, needed, free, total } => {
                assert_eq!((what.as_str(), needed, free, total), ("two more", 2, 1, 4))
            }
            other => panic!("expected OutOfPages, got {other:?}"),
        }
        assert_eq!(a.free(), 1, "a refused allocation hands out nothing");
        a.release(&[1]).unwrap();
        for bad in [&[1][..], &[7], &[0, 0], &[3]] {
            let before = a.clone();
            assert!(a.release(bad).is_err(), "{bad:?}");
            assert_eq!(a, before, "a refused release takes nothing back");
        }
        assert_eq!(a.alloc(2, String::new).unwrap(), vec![1, 3]);
        assert!(PageAllocator::new(0).is_err());
    }

    #[test]
    fn add_remove_cycles_leak_no_page() {
        let mut book = PagedBook::new(10, 16, 4, 3).unwrap();
        let fresh = book.allocator().clone();
        for cycle in 0..50usize {
            let ids: Vec<SeqId> = (0..3).map(|_| book.add()).collect();
            // Prompts of different lengths, one sequence at a time, then decode steps together.
            for (i, &id) in ids.iter().enumerate() {
                book.begin(&[id], 1 + (cycle * 7 + i * 13) % 20, 1).unwrap();
                book.finish().unwrap();
            }
            for _ in 0..(cycle % 5) {
                book.begin(&ids, 1, 3).unwrap();
                book.finish().unwrap();
            }
            let held: usize = ids.iter().map(|&id| book.pages(id).unwrap().len()).sum();
            assert_eq!(held + book.allocator().free(), 10, "cycle {cycle}");
            for (&id, want) in ids.iter().zip(0..) {
                let len = book.len(id).unwrap();
                assert_eq!(book.pages(id).unwrap().len(), len.div_ceil(16), "cycle {cycle} sequence {want}");
            }
            for id in ids {
                book.remove(id).unwrap();
            }
            assert_eq!(book.allocator().free(), 10, "cycle {cycle}: every page back");
        }
        let mut a = book.allocator().clone();
        let mut b = fresh;
        assert_eq!(a.alloc(10, String::new).unwrap().len(), b.alloc(10, String::new).unwrap().len());
    }

    #[test]
    fn steps_build_page_table_rows_and_device_lengths() {
        let mut book = PagedBook::new(8, 4, 3, 4).unwrap();
        let (a, b) = (book.add(), book.add());
        let v = book.begin(&[a], 5, 1).unwrap();
        assert_eq!(&v.table[..3], &[0, 1, 0], "5 positions take 2 pages, the rest of the row page 0");
        assert_eq!((v.positions[0], v.kv_lens[0], v.q_lens[0]), (0, 5, 5));
        assert_eq!(&v.positions[1..], &[-1, -1, -1], "rows past the step's sequences write nothing");
        book.finish().unwrap();
        book.begin(&[b], 3, 1).unwrap();
        book.finish().unwrap();
        // A decode step of both in a launch of 4 rows: b first, then a.
        let v = book.begin(&[b, a], 1, 4).unwrap();
        assert_eq!(v.table, vec![2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(v.positions, vec![3, 5, -1, -1]);
        assert_eq!(v.kv_lens, vec![4, 6, 1, 1], "rows past the sequences read one key");
        assert_eq!(v.q_lens, vec![1; 4]);
        book.finish().unwrap();
        assert_eq!((book.len(a).unwrap(), book.len(b).unwrap()), (6, 4));
        // b grows into a new page at position 4.
        let v = book.begin(&[b], 1, 1).unwrap();
        assert_eq!(&v.table[..3], &[2, 3, 0]);
        book.finish().unwrap();
    }

    #[test]
    fn packed_steps_give_each_token_its_table_row_and_position() {
        let mut book = PagedBook::new(8, 4, 3, 4).unwrap();
        let (a, b, c) = (book.add(), book.add(), book.add());
        // Rows in the order given (b, a, c), pages handed out in that order, lowest first.
        let v = book.begin_packed(&[b, a, c], &[5, 1, 3]).unwrap();
        assert_eq!(v.table, vec![0, 1, 0, 2, 0, 0, 3, 0, 0, 0, 0, 0]);
        assert_eq!(v.positions, vec![0, 0, 0, -1]);
        assert_eq!(v.kv_lens, vec![5, 1, 3, 1]);
        assert_eq!(&v.q_lens[..3], &[5, 1, 3]);
        let (rows, positions) = v.tokens.split_at(9);
        assert_eq!(rows, &[0, 0, 0, 0, 0, 1, 2, 2, 2], "each token's table row");
        assert_eq!(positions, &[0, 1, 2, 3, 4, 0, 0, 1, 2], "each token's position in its sequence");
        let step = book.step().unwrap();
        assert_eq!((step.rows, step.seq, step.new_tokens()), (1, 9, vec![5, 1, 3]));
        assert_eq!(book.finish().unwrap(), 9);
        assert_eq!((book.len(a).unwrap(), book.len(b).unwrap(), book.len(c).unwrap()), (1, 5, 3));
        // They decode together afterwards, each at its own length.
        let v = book.begin(&[a, b, c], 1, 4).unwrap();
        assert_eq!(v.positions, vec![1, 5, 3, -1]);
        book.finish().unwrap();
        // One sequence is the plain step of its tokens (no per-token values).
        let d = book.add();
        let v = book.begin_packed(&[d], &[2]).unwrap();
        assert!(v.tokens.is_empty());
        let step = book.step().unwrap();
        assert_eq!((step.rows, step.seq, step.packed.clone()), (1, 2, None));
        book.cancel();
        // Refused, with nothing changed.
        let e = book.add();
        let before = book.clone();
        for (order, lens, expected) in [
            (vec![a, e], vec![2, 2], "sequence 0 holds 2"),
            (vec![e, d], vec![2, 0], "gets no tokens"),
            (vec![e, d], vec![2], "2 sequences with 1 token counts"),
            (vec![e, e], vec![1, 1], "twice in one step"),
            (vec![e, d], vec![13, 1], "no room for 13 more"),
            (vec![], vec![], "no sequences"),
        ] {
            let err = book.begin_packed(&order, &lens).unwrap_err().to_string();
            assert!(err.contains(expected), "{expected}: {err}");
            assert_eq!(book, before, "{expected}: nothing changed");
        }
        let err = book.begin_packed(&[e, d], &[12, 12]).unwrap_err();
        assert!(matches!(err, Error::OutOfPages { needed: 6, free: 4, .. }), "{err:?}"); // d's cancelled step took its page back
        assert!(err.to_string().contains("a packed step of 24 tokens for 2 sequences"), "{err}");
        assert_eq!(book, before);
        let mut full = PagedBook::new(8, 4, 3, 2).unwrap();
        let ids: Vec<SeqId> = (0..3).map(|_| full.add()).collect();
        let err = full.begin_packed(&ids, &[1, 1, 1]).unwrap_err().to_string();
        assert!(err.contains("3 sequences in one packed step, the table has 2"), "{err}");
    }

    #[test]
    fn cancelled_steps_give_their_pages_back() {
        let mut book = PagedBook::new(8, 4, 3, 3).unwrap();
        let (a, b) = (book.add(), book.add());
        book.begin(&[a], 4, 1).unwrap(); // a fills its first page
        book.finish().unwrap();
        book.begin(&[b], 2, 1).unwrap();
        book.finish().unwrap();
        let before = book.clone();
        // A decode step that needs a new page for a (position 4), none for b (position 2).
        book.begin(&[a, b], 1, 2).unwrap();
        assert_eq!(book.allocator().free(), 5);
        book.cancel();
        assert_eq!(book, before, "a cancelled step leaves the book as it was");
        // A packed prefill of two new sequences, cancelled: every page back, the sequences empty.
        let (c, d) = (book.add(), book.add());
        let with_cd = book.clone();
        book.begin_packed(&[c, d], &[5, 3]).unwrap();
        assert_eq!(book.allocator().free(), 3);
        book.cancel();
        assert_eq!(book, with_cd);
        // The same steps afterwards get the same pages and count their tokens.
        book.begin(&[a, b], 1, 2).unwrap();
        book.finish().unwrap();
        assert_eq!((book.len(a).unwrap(), book.pages(a).unwrap().len()), (5, 2));
    }

    #[test]
    fn refused_steps_change_nothing() {
        let mut book = PagedBook::new(3, 4, 2, 2).unwrap();
        let (a, b) = (book.add(), book.add());
        book.begin(&[a], 8, 1).unwrap();
        book.finish().unwrap();
        let before = book.clone();
        let cases: Vec<(Vec<SeqId>, usize, usize, &str)> = vec![
            (vec![a], 1, 1, "sequence 0 holds 8 of 8 positions, no room for 1"),
            (vec![b, b], 1, 2, "sequence 1 twice"),
            (vec![a, b], 1, 1, "2 sequences in a launch of 1 rows"),
            (vec![b], 1, 3, "the table has 2"),
            (vec![b], 0, 1, "no tokens"),
            (vec![], 1, 1, "no sequences"),
        ];
        for (order, seq, rows, expected) in cases {
            let e = book.begin(&order, seq, rows).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected),
                "{expected}: {e}"
            );
            assert_eq!(book, before, "{expected}: nothing changed");
        }
        // b needs 2 pages, 1 is free: out of pages, typed, nothing handed out.
        let e = book.begin(&[b], 5, 1).unwrap_err();
        assert!(matches!(e, Error::OutOfPages { needed: 2, free: 1, total: 3, .. }), "{e:?}");
        assert_eq!(book, before);
        // Unknown and removed sequences; a sequence in a step begun cannot be removed.
        book.remove(b).unwrap();
        assert!(book.begin(&[b], 1, 1).unwrap_err().to_string().contains("no sequence 1"));
        assert!(book.remove(b).is_err());
        let c = book.add();
        book.begin(&[c], 1, 1).unwrap();
        assert!(book.remove(c).unwrap_err().to_string().contains("finish it first"));
        book.cancel();
        assert_eq!(book.len(c).unwrap(), 0, "a cancelled step counts nothing");
        assert_eq!((book.pages(c).unwrap().len(), book.allocator().free()), (0, 1), "and holds no page");
        book.begin(&[c], 1, 1).unwrap();
        book.finish().unwrap();
        book.remove(c).unwrap();
        book.remove(a).unwrap();
        assert_eq!(book.allocator().free(), 3);
        assert!(book.finish().is_err(), "no step begun");
    }
}
