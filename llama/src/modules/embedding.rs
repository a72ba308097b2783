//! The token embedding.

use super::linear::Linear;
use super::Pass;
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::{embedding, Element, EmbeddingArgs, EmbeddingOperands};

/// The range of the embedding lookup (one kernel on both backends).
pub const EMBED_RANGE: &str = "fwd.embed";

/// Rows of a `[vocab, hidden]` table by token id. The table is also a hidden → vocab [`Linear`]: the
/// `lm_head` of a model with tied embeddings.
pub(crate) struct Embedding<T> {
    pub(crate) table: Linear<T>,
}

impl<T: Element> Embedding<T> {
    pub(crate) fn new(table: CudaSlice<T>, vocab: usize, hidden: usize) -> Self {
        Embedding { table: Linear::new(table, hidden, vocab) }
    }

    /// `out[i] = table[ids[i]]` for the pass's rows.
    pub(crate) fn forward(
        &self,
        p: &mut Pass<'_, T>,
        ids: &CudaSlice<u32>,
        out: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (rows, ctx) = (p.tokens.rows(), p.ctx);
        let Linear { in_features: hidden, out_features: vocab, .. } = &self.table;
        let weight = self.table.plain().expect("the embedding table stays in the model's dtype");
        let args = EmbeddingArgs::new(rows, *vocab, *hidden);
        let embedded = p
            .dispatch
            .observe(EMBED_RANGE, None, || embedding(ctx, args, EmbeddingOperands::new(ids, weight, out)));
        Ok(embedded?)
    }
}
