//! Attention over a paged KV cache (continuous batching): the same projections as
//! [`Attention::forward`](super::attention::Attention), with RoPE's K/V append and the attention
//! going through cudnn-ops' [`PagedKvCache`] (page pools read through a page table, each sequence at
//! its own length, positions and lengths on the device).

use super::attention::{Attention, AttnBuffers};
use super::norm::Normed;
use super::Pass;
use crate::backends::Site;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{Element, PagedKvCache, QkvRows};

impl<T: Element> Attention<T> {
    /// `sum = x + attn(h)` (as [`Attention::forward`]) over the step begun on `cache` (its rows are the
    /// pass's batch, its new tokens the pass's seq; a packed step is one row of every sequence's
    /// tokens): RoPE with the append into the pages ([`PagedKvCache::append_rotated`], per-token
    /// positions for a packed step), then attention through the page table or, for a prefill from
    /// empty, over the step's own rows ([`PagedKvCache::attend`]; ragged for a packed step).
    pub(crate) fn forward_paged(
        &self,
        p: &mut Pass<'_, T>,
        h: &CudaSlice<T>,
        bufs: &mut AttnBuffers<T>,
        cache: &mut PagedKvCache<T>,
        x: &CudaSlice<T>,
        sum: &mut CudaSlice<T>,
    ) -> Result<()> {
        let AttnBuffers { qkv, o } = bufs;
        self.project_qkv(p, Normed::Done(h), qkv)?;
        let qkv_rows = QkvRows::new(self.heads, self.width());
        let (ctx, at, layer, tables) = (p.ctx, Some(self.layer), self.layer, p.rope);
        // Its own fallback key: the paged append is another kernel than the contiguous one.
        let packed = if cache.packed().is_some() { " packed" } else { "" };
        let rope_shape = format!("{} paged{packed}", p.shape);
        p.dispatch.run(Site::ROPE, at, &rope_shape, |b| {
            cache.append_rotated(ctx, layer, tables, qkv_rows, qkv.as_view_mut(), b)
        })?;
        // The fallback key leaves the lengths out, so later steps do not retry a shape that failed; a
        // packed step (ragged attention) keys by its sequence count.
        let attn_shape = match cache.packed() {
            Some(lens) => format!("{} packed", lens.len()),
            None => format!("{}x{} paged", p.tokens.batch, p.tokens.seq),
        };
        p.dispatch.run(Site::GQA, at, &attn_shape, |b| {
            cache.attend(ctx, layer, qkv_rows, qkv.as_view(), o.as_view_mut(), b).map(drop)
        })?;
        self.project_o(p, o, x, sum, None)
    }
}
