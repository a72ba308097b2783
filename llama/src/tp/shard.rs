//! The sharding math: which slice of each Hugging Face tensor a rank holds, and the rank's shapes.
//!
//! | tensor (HF layout, `[out, in]`) | parallel | rank r of n holds |
//! |---|---|---|
//! | `embed_tokens` `[vocab, hidden]` | replicated | all of it |
//! | `input_layernorm`, `post_attention_layernorm`, `norm` | replicated | all of it |
//! | `q_proj` `[heads·d, hidden]` | column (by query head) | rows of heads `r·h/n .. (r+1)·h/n` |
//! | `k_proj`, `v_proj` `[kv·d, hidden]` | column (by K/V head) | rows of K/V heads `r·kv/n ..`, or the one head its query heads read when `n > kv` (replicated over `n / kv` ranks) |
//! | `o_proj` `[hidden, heads·d]` | row (input features), then all-reduce | columns of its query heads |
//! | `gate_proj`, `up_proj` `[ffn, hidden]` | column | rows `r·ffn/n .. (r+1)·ffn/n` |
//! | `down_proj` `[hidden, ffn]` | row, then all-reduce | columns `r·ffn/n .. (r+1)·ffn/n` |
//! | `lm_head` `[vocab, hidden]` (the embedding when tied) | column (vocabulary), then all-gather | rows `r·vocab/n .. (r+1)·vocab/n` |
//!
//! A rank's fused QKV weight is its Q rows, then its K rows, then its V rows (as the single-GPU
//! model's is all Q, all K, all V): [`ShardPlan::fused_qkv_rows`] says which rows of the single-GPU
//! fused weight those are. With these slices a rank is the same decoder at smaller shapes
//! ([`ShardPlan::local`]): `heads / n` query heads over its K/V heads, `ffn / n` MLP rows, the whole
//! hidden size and vocabulary, and `vocab / n` rows of `lm_head`.
//!
//! Why the embedding is replicated and `lm_head` split: a lookup reads one row per token (so a
//! replicated table costs memory, 1.05 GB for Llama-3's 128256 × 4096 in bf16, 2.1 GB at 8192, and
//! no time), while a vocabulary-parallel lookup would need a masked lookup kernel and one more
//! all-reduce per forward. `lm_head` is read whole by every decode step: split, each rank reads
//! `1/n` of it, and the logits come back with one all-gather of `vocab / n` values per row.

use crate::config::LlamaConfig;
use crate::roofline::DecodeRoofline;
use crate::{Error, Result};
use std::ops::Range;

/// The tensors of a Llama checkpoint, by their role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Part {
    /// `model.embed_tokens.weight`.
    Embed,
    /// `input_layernorm.weight`.
    AttnNorm,
    /// `self_attn.q_proj.weight`.
    QProj,
    /// `self_attn.k_proj.weight`.
    KProj,
    /// `self_attn.v_proj.weight`.
    VProj,
    /// `self_attn.o_proj.weight`.
    OProj,
    /// `post_attention_layernorm.weight`.
    MlpNorm,
    /// `mlp.gate_proj.weight`.
    GateProj,
    /// `mlp.up_proj.weight`.
    UpProj,
    /// `mlp.down_proj.weight`.
    DownProj,
    /// `model.norm.weight`.
    Norm,
    /// `lm_head.weight` (or the embedding's rows when tied).
    LmHead,
}

impl Part {
    /// A layer's nine tensors in [`crate::weights::Weights::names`] order.
    pub const LAYER: [Part; 9] = [
        Part::AttnNorm,
        Part::QProj,
        Part::KProj,
        Part::VProj,
        Part::OProj,
        Part::MlpNorm,
        Part::GateProj,
        Part::UpProj,
        Part::DownProj,
    ];
}

/// A slice of a tensor: all of it, rows `r` of a 2-D `[rows, cols]` tensor (contiguous), or columns
/// `c` of each of its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slice {
    /// The whole tensor.
    Whole,
    /// Rows (the outer dimension).
    Rows(Range<usize>),
    /// Columns (the inner dimension) of every row.
    Cols(Range<usize>),
}

impl Slice {
    /// The shape of this slice of a tensor of `shape`.
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        match (self, shape) {
            (Slice::Rows(r), [_, cols]) => vec![r.len(), *cols],
            (Slice::Cols(c), [rows, _]) => vec![*rows, c.len()],
            _ => shape.to_vec(),
        }
    }

    /// The elements of a row-major tensor of `shape` this slice takes, as (start, length) runs in
    /// order: one run for whole tensors and row slices, one per row for column slices.
    pub fn runs(&self, shape: &[usize]) -> Vec<(usize, usize)> {
        match (self, shape) {
            (Slice::Rows(r), [_, cols]) => vec![(r.start * cols, r.len() * cols)],
            (Slice::Cols(c), [rows, cols]) => (0..*rows).map(|i| (i * cols + c.start, c.len())).collect(),
            _ => vec![(0, shape.iter().product())],
        }
    }
}

/// How a model splits over `ranks` GPUs (see the module docs): per rank, `heads` query heads,
/// `kv_heads` K/V heads (each shared by `kv_replicas` ranks; 1 when they split), `ffn` MLP rows and
/// `vocab` rows of `lm_head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardPlan {
    /// Ranks (GPUs).
    pub ranks: usize,
    /// Query heads per rank.
    pub heads: usize,
    /// K/V heads per rank.
    pub kv_heads: usize,
    /// Ranks holding the same K/V head (1 when the K/V heads split, `ranks / kv_heads` otherwise).
    pub kv_replicas: usize,
    /// MLP rows (`gate`/`up` rows, `down` columns) per rank.
    pub ffn: usize,
    /// `lm_head` rows per rank.
    pub vocab: usize,
    /// Head dim (whole on every rank).
    pub head_dim: usize,
}

impl ShardPlan {
    /// The plan for `cfg` over `ranks` ranks. [`Error::Tp`] names what does not split: no ranks,
    /// query heads not divisible by the ranks, K/V heads that neither split over the ranks nor
    /// replicate evenly (one of the two counts must divide the other), an MLP size or vocabulary not
    /// divisible by the ranks. A config [`LlamaConfig::check`] refuses is an [`Error::Config`].
    pub fn new(cfg: &LlamaConfig, ranks: usize) -> Result<Self> {
        cfg.check()?;
        let fail = |m: String| Err(Error::Tp(format!("{}: {m}", cfg.name)));
        if ranks == 0 {
            return fail("0 ranks".into());
        }
        if !cfg.heads.is_multiple_of(ranks) {
            return fail(format!("{} query heads do not split over {ranks} ranks", cfg.heads));
        }
        let (kv_heads, kv_replicas) = if cfg.kv_heads.is_multiple_of(ranks) {
            (cfg.kv_heads / ranks, 1)
        } else if ranks.is_multiple_of(cfg.kv_heads) {
            (1, ranks / cfg.kv_heads)
        } else {
            return fail(format!(
                "{} K/V heads neither split over {ranks} ranks nor replicate evenly across them",
                cfg.kv_heads
            ));
        };
        for (what, n) in [("MLP size", cfg.ffn), ("vocabulary", cfg.vocab)] {
            if !n.is_multiple_of(ranks) {
                return fail(format!("the {what} {n} does not split over {ranks} ranks"));
            }
        }
        Ok(ShardPlan {
            ranks,
            heads: cfg.heads / ranks,
            kv_heads,
            kv_replicas,
            ffn: cfg.ffn / ranks,
            vocab: cfg.vocab / ranks,
            head_dim: cfg.head_dim,
        })
    }

    /// A rank's shapes: `cfg` with this plan's heads, K/V heads and MLP size (hidden size,
    /// vocabulary and everything else whole). `lm_head` has [`ShardPlan::vocab`] rows on each rank.
    pub fn local(&self, cfg: &LlamaConfig) -> LlamaConfig {
        LlamaConfig { heads: self.heads, kv_heads: self.kv_heads, ffn: self.ffn, ..cfg.clone() }
    }

    /// Rank `rank`'s query heads.
    pub fn q_heads(&self, rank: usize) -> Range<usize> {
        rank * self.heads..(rank + 1) * self.heads
    }

    /// Rank `rank`'s K/V heads: those its query heads read.
    pub fn kv_heads(&self, rank: usize) -> Range<usize> {
        let first = rank / self.kv_replicas * self.kv_heads;
        first..first + self.kv_heads
    }

    /// Rank `rank`'s MLP rows.
    pub fn ffn_rows(&self, rank: usize) -> Range<usize> {
        rank * self.ffn..(rank + 1) * self.ffn
    }

    /// Rank `rank`'s `lm_head` rows (vocabulary entries).
    pub fn vocab_rows(&self, rank: usize) -> Range<usize> {
        rank * self.vocab..(rank + 1) * self.vocab
    }

    /// The slice of the tensor `part` rank `rank` holds (of the embedding's rows for a tied
    /// `lm_head`).
    pub fn slice(&self, rank: usize, part: Part) -> Slice {
        let d = self.head_dim;
        let heads = |h: Range<usize>| h.start * d..h.end * d;
        match part {
            Part::Embed | Part::AttnNorm | Part::MlpNorm | Part::Norm => Slice::Whole,
            Part::QProj => Slice::Rows(heads(self.q_heads(rank))),
            Part::KProj | Part::VProj => Slice::Rows(heads(self.kv_heads(rank))),
            Part::OProj => Slice::Cols(heads(self.q_heads(rank))),
            Part::GateProj | Part::UpProj => Slice::Rows(self.ffn_rows(rank)),
            Part::DownProj => Slice::Cols(self.ffn_rows(rank)),
            Part::LmHead => Slice::Rows(self.vocab_rows(rank)),
        }
    }

    /// The rows of the single-GPU fused `[(h + 2·kv)·d, hidden]` QKV weight that make rank `rank`'s
    /// fused weight, in its order: its Q rows, its K rows, its V rows.
    pub fn fused_qkv_rows(&self, cfg: &LlamaConfig, rank: usize) -> [Range<usize>; 3] {
        let d = self.head_dim;
        let (q, kv) = (self.q_heads(rank), self.kv_heads(rank));
        let (k0, v0) = (cfg.heads * d, (cfg.heads + cfg.kv_heads) * d);
        [q.start * d..q.end * d, k0 + kv.start * d..k0 + kv.end * d, v0 + kv.start * d..v0 + kv.end * d]
    }

    /// The bytes one rank reads in a decode step of `batch` sequences holding `cached` tokens
    /// (`elem` bytes per element): its layers' slices, its `lm_head` rows, the norms, one embedding
    /// row per sequence and its K/V heads' cache. The all-reduces' traffic is not in it.
    pub fn decode_roofline(
        &self,
        cfg: &LlamaConfig,
        batch: usize,
        cached: usize,
        elem: usize,
    ) -> DecodeRoofline {
        let local = LlamaConfig { tie_embeddings: false, ..self.local(cfg) };
        let mut r = DecodeRoofline::new(&local, batch, cached, elem);
        // `local` counts a whole `lm_head`; a rank reads its rows.
        r.weight_bytes -= ((cfg.vocab - self.vocab) * cfg.hidden * elem) as u64;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(s: Slice) -> Range<usize> {
        match s {
            Slice::Rows(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn eight_b_over_two_ranks() {
        let cfg = LlamaConfig::llama_3_1_8b();
        let p = ShardPlan::new(&cfg, 2).unwrap();
        assert_eq!(
            (p.heads, p.kv_heads, p.kv_replicas, p.ffn, p.vocab, p.head_dim),
            (16, 4, 1, 7168, 64128, 128)
        );
        // Rank 1: query heads 16..32, K/V heads 4..8.
        assert_eq!(p.slice(1, Part::QProj), Slice::Rows(2048..4096));
        assert_eq!(p.slice(1, Part::KProj), Slice::Rows(512..1024));
        assert_eq!(p.slice(1, Part::VProj), Slice::Rows(512..1024));
        assert_eq!(p.slice(1, Part::OProj), Slice::Cols(2048..4096));
        assert_eq!(p.slice(1, Part::GateProj), Slice::Rows(7168..14336));
        assert_eq!(p.slice(1, Part::UpProj), Slice::Rows(7168..14336));
        assert_eq!(p.slice(1, Part::DownProj), Slice::Cols(7168..14336));
        assert_eq!(p.slice(1, Part::LmHead), Slice::Rows(64128..128256));
        for part in [Part::Embed, Part::AttnNorm, Part::MlpNorm, Part::Norm] {
            assert_eq!(p.slice(0, part), Slice::Whole, "{part:?}");
        }
        // The single-GPU fused QKV is [4096 Q; 1024 K; 1024 V] rows.
        assert_eq!(p.fused_qkv_rows(&cfg, 0), [0..2048, 4096..4608, 5120..5632]);
        assert_eq!(p.fused_qkv_rows(&cfg, 1), [2048..4096, 4608..5120, 5632..6144]);
        let local = p.local(&cfg);
        assert_eq!(
            (local.heads, local.kv_heads, local.ffn, local.hidden, local.vocab),
            (16, 4, 7168, 4096, 128256)
        );
        assert_eq!(local.qkv_width(), 3072);
        local.check().unwrap();
    }

    #[test]
    fn every_rank_together_holds_each_split_tensor_once() {
        for (cfg, ranks) in [
            (LlamaConfig::tiny(), 2),
            (LlamaConfig::llama_3_1_8b(), 4),
            (LlamaConfig::llama_3_1_8b(), 8),
            (LlamaConfig::llama_3_1_70b(), 2),
            (LlamaConfig::llama_3_2_1b(), 2),
        ] {
            let p = ShardPlan::new(&cfg, ranks).unwrap();
            let d = cfg.head_dim;
            for (part, total) in [
                (Part::QProj, cfg.heads * d),
                (Part::KProj, cfg.kv_heads * d),
                (Part::GateProj, cfg.ffn),
                (Part::LmHead, cfg.vocab),
            ] {
                let mut covered: Vec<usize> = (0..ranks).flat_map(|r| rows(p.slice(r, part))).collect();
                covered.sort_unstable();
                assert_eq!(covered, (0..total).collect::<Vec<_>>(), "{} {part:?}", cfg.name);
            }
            // The fused QKV rows of all ranks cover the single-GPU fused weight once.
            let mut fused: Vec<usize> =
                (0..ranks).flat_map(|r| p.fused_qkv_rows(&cfg, r).into_iter().flatten()).collect();
            fused.sort_unstable();
            assert_eq!(fused, (0..cfg.qkv_width()).collect::<Vec<_>>(), "{}", cfg.name);
            // A rank's query heads read only its K/V heads (GQA: query head h reads K/V head h / group).
            let group = cfg.heads / cfg.kv_heads;
            for r in 0..ranks {
                let kv = p.kv_heads(r);
                assert!(p.q_heads(r).all(|h| kv.contains(&(h / group))), "{} rank {r}", cfg.name);
            }
            // Each rank is the decoder at smaller shapes.
            p.local(&cfg).check().unwrap();
        }
    }

    #[test]
    fn kv_heads_replicate_when_ranks_outnumber_them() {
        // 8 K/V heads over 16 ranks: each head on two ranks, each rank's 4 query heads on one.
        let cfg = LlamaConfig::llama_3_1_70b();
        let p = ShardPlan::new(&cfg, 16).unwrap();
        assert_eq!((p.heads, p.kv_heads, p.kv_replicas), (4, 1, 2));
        assert_eq!(
            (0..16).map(|r| p.kv_heads(r).start).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
        );
        assert_eq!(p.slice(3, Part::KProj), Slice::Rows(128..256));
        assert_eq!(p.slice(3, Part::OProj), Slice::Cols(1536..2048));
        let group = cfg.heads / cfg.kv_heads;
        assert!((0..16).all(|r| p.q_heads(r).all(|h| p.kv_heads(r).contains(&(h / group)))));
        p.local(&cfg).check().unwrap();
    }

    #[test]
    fn what_does_not_split_is_an_error_naming_it() {
        let cfg = LlamaConfig::llama_3_1_8b();
        for (cfg, ranks, expected) in [
            (cfg.clone(), 0, "0 ranks"),
            (cfg.clone(), 3, "32 query heads do not split over 3 ranks"),
            (
                LlamaConfig { heads: 48, kv_heads: 12, ..cfg.clone() },
                8,
                "12 K/V heads neither split over 8 ranks",
            ),
            (LlamaConfig { ffn: 14337, ..cfg.clone() }, 2, "the MLP size 14337 does not split over 2 ranks"),
            (
                LlamaConfig { vocab: 128257, ..cfg.clone() },
                2,
                "the vocabulary 128257 does not split over 2 ranks",
            ),
        ] {
            let e = ShardPlan::new(&cfg, ranks).unwrap_err();
            assert!(matches!(e, Error::Tp(_)), "{e:?}");
            assert!(
                e.to_string().contains(expected) && e.to_string().contains("llama-3.1-8b"),
                "{expected}: {e}"
            );
        }
        let e = ShardPlan::new(&LlamaConfig { rope_theta: 0.0, ..cfg }, 2).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e:?}");
    }

    #[test]
    fn slices_give_shapes_and_element_runs() {
        let shape = [4, 6];
        assert_eq!(Slice::Rows(1..3).shape(&shape), [2, 6]);
        assert_eq!(Slice::Rows(1..3).runs(&shape), [(6, 12)]);
        assert_eq!(Slice::Cols(2..5).shape(&shape), [4, 3]);
        assert_eq!(Slice::Cols(2..5).runs(&shape), [(2, 3), (8, 3), (14, 3), (20, 3)]);
        assert_eq!(Slice::Whole.shape(&[7]), [7]);
        assert_eq!(Slice::Whole.runs(&shape), [(0, 24)]);
    }

    #[test]
    fn a_rank_reads_its_share_of_a_decode_step() {
        let cfg = LlamaConfig::llama_3_1_8b();
        let whole = DecodeRoofline::new(&cfg, 1, 512, 2);
        let p = ShardPlan::new(&cfg, 2).unwrap();
        let half = p.decode_roofline(&cfg, 1, 512, 2);
        // Everything splits in two but the norms (2 per layer and the final one) and the embedding
        // row, which every rank reads.
        let replicated = 2 * ((2 * cfg.layers + 1) * cfg.hidden + cfg.hidden) as u64;
        assert_eq!(2 * half.weight_bytes - replicated, whole.weight_bytes);
        assert_eq!(2 * half.kv_bytes, whole.kv_bytes);
        // One rank is the whole model.
        assert_eq!(ShardPlan::new(&cfg, 1).unwrap().decode_roofline(&cfg, 1, 512, 2), whole);
    }
}
