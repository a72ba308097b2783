//! Scaled dot-product attention as a graph: the composite pattern cuDNN's fused attention engines
//! recognize (what the C++ frontend's `CompositeSDPANode` expands to), or the single SDPA operation.

use super::node::{Binary, Node, Reduce, Unary};
use super::{Graph, TensorId};
use crate::plan::Scalar;
use crate::Features;

/// Causal masking of the attention scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mask {
    /// Every query sees every key.
    None,
    /// Query `i` sees keys `0..=i` (prefill: the diagonal starts at the top-left corner).
    CausalTopLeft,
    /// Query `i` sees keys `0..=i + s_kv − s_q` (decode or chunked prefill against a KV cache: the
    /// diagonal ends at the bottom-right corner). Needs `s_q ≤ s_kv`.
    CausalBottomRight,
}

impl Mask {
    /// `none`, `causal` or `causal_bottom_right`.
    pub fn name(self) -> &'static str {
        match self {
            Mask::None => "none",
            Mask::CausalTopLeft => "causal",
            Mask::CausalBottomRight => "causal_bottom_right",
        }
    }

    /// Whether key `col` is visible to query `row`.
    pub fn keeps(self, row: usize, col: usize, s_q: usize, s_kv: usize) -> bool {
        match self {
            Mask::None => true,
            Mask::CausalTopLeft => col <= row,
            Mask::CausalBottomRight => col + s_q <= row + s_kv,
        }
    }
}

/// Which graph an attention lowers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SdpaForm {
    /// Matmul, scale, index-compare-select mask, softmax with stats, matmul: 15-20 nodes that the fused
    /// flash-attention engines match as a whole. Every cuDNN 9 version.
    Composite,
    /// One `OPERATION_SDPA_FWD` node: unmasked from cuDNN 9.13.1. Masks on it need 9.21 headers and
    /// library (this build's bindings are 9.19).
    Unified,
}

impl SdpaForm {
    /// `composite` or `unified`.
    pub fn name(self) -> &'static str {
        match self {
            SdpaForm::Composite => "composite",
            SdpaForm::Unified => "unified",
        }
    }

    /// The form for a request, as the frontend's automatic choice makes it: the unified operation where
    /// the features (of the older of the running library and the headers) support everything asked,
    /// the composite graph otherwise.
    pub fn select(features: Features, mask: Mask) -> SdpaForm {
        let unified_ok = match mask {
            Mask::None => features.unified_sdpa(),
            Mask::CausalTopLeft | Mask::CausalBottomRight => features.unified_sdpa_causal(),
        };
        if unified_ok {
            SdpaForm::Unified
        } else {
            SdpaForm::Composite
        }
    }
}

/// What [`Graph::sdpa`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SdpaOptions {
    /// Causal masking.
    pub mask: Mask,
    /// Also output the f32 log-sum-exp of each score row (training mode).
    pub stats: bool,
    /// Graph form.
    pub form: SdpaForm,
    /// What the cuDNN the graph is for can do (the mask fill is `-inf` from 9.10, the lowest float
    /// before).
    pub features: Features,
    /// Per-sequence lengths `(seq_len_q, seq_len_kv)`, i32 `[b, 1, 1, 1]` device tensors: the seq dims
    /// are then capacities and positions past a sequence's length are masked out (one plan serves every
    /// length up to the capacity). Unified form only (cuDNN 9.15+).
    pub seq_lens: Option<(TensorId, TensorId)>,
}

/// Outputs of [`Graph::sdpa`].
#[derive(Debug, Clone, Copy)]
pub struct SdpaOutputs {
    /// `[b, h_q, s_q, d_v]` in the dtype of Q (packed BHSD until the caller sets strides).
    pub o: TensorId,
    /// f32 `[b, h_q, s_q, 1]` log-sum-exp of the scaled, masked scores, when asked for.
    pub stats: Option<TensorId>,
}

impl Graph {
    /// Attention `softmax(scale · Q Kᵀ + mask) V`. Q `[b, h_q, s_q, d]`, K `[b, h_kv, s_kv, d]`,
    /// V `[b, h_kv, s_kv, d_v]` over any strides with a unit last stride; `h_q` a multiple of `h_kv`
    /// (grouped-query heads need no copies); `scale` a by-value f32. f32 compute, f16/bf16 I/O.
    ///
    /// The composite form turns K into its `[b, h_kv, d, s_kv]` transposed view (a stride swap on the
    /// same uid), as the frontend does.
    pub fn sdpa(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        scale: TensorId,
        opts: SdpaOptions,
    ) -> SdpaOutputs {
        let (qd, vd) = (self.spec(q).dims.clone(), self.spec(v).dims.clone());
        let io = self.spec(q).dtype;
        let bad_rank = qd.len() != 4 || vd.len() != 4 || self.spec(k).dims.len() != 4;
        let o_dims = if bad_rank { qd.clone() } else { vec![qd[0], qd[1], qd[2], vd[3]] };
        let stats_dims = if bad_rank { qd.clone() } else { vec![qd[0], qd[1], qd[2], 1] };
        self.set_form(opts.form.name());
        if bad_rank || opts.form == SdpaForm::Unified {
            let o =
                self.intermediate(format!("{}::O", self.name), &o_dims, &crate::packed_strides(&o_dims), io);
            let stats = opts.stats.then(|| {
                let s = crate::packed_strides(&stats_dims);
                self.intermediate(format!("{}::stats", self.name), &stats_dims, &s, crate::DataType::F32)
            });
            self.nodes.push(Node::SdpaFwd {
                q,
                k,
                v,
                scale,
                o,
                stats,
                mask: opts.mask,
                seq_lens: opts.seq_lens,
            });
            return SdpaOutputs { o, stats };
        }

        if let Some((sq, _)) = opts.seq_lens {
            // The composite padding mask (and its matmul overrides) is not built here: refuse it.
            self.padded_composite = Some(sq);
        }
        // bmm1 against the transposed view of K.
        let kt = self.spec_mut(k);
        kt.dims.swap(2, 3);
        kt.strides.swap(2, 3);
        let s = self.matmul(q, k);
        let s = self.binary(Binary::Mul, s, scale);
        let s = match opts.mask {
            Mask::None => s,
            mask => {
                let mut row = self.gen_index(s, 2);
                let col = self.gen_index(s, 3);
                if mask == Mask::CausalBottomRight {
                    // row + s_kv − s_q ≥ col, with both lengths as i32 constants (no padding).
                    let sdims = self.spec(s).dims.clone();
                    let skv = self.constant("seq_len_kv", Scalar::I32(sdims[3] as i32), 4);
                    let sq = self.constant("seq_len_q", Scalar::I32(sdims[2] as i32), 4);
                    row = self.index_arith(Binary::Add, row, skv);
                    row = self.index_arith(Binary::Sub, row, sq);
                }
                let keep = self.binary(Binary::CmpGe, row, col);
                let fill = if opts.features.neg_infinity_mask_fill() { f32::NEG_INFINITY } else { f32::MIN };
                let fill = self.constant("mask_fill", Scalar::F32(fill), 4);
                self.select(keep, s, fill)
            }
        };
        // Softmax with its statistics: max, exp(s − max), sum, stats = max + ln(sum), p = e / sum.
        let max = self.reduce(Reduce::Max, s, &stats_dims);
        let z = self.binary(Binary::Sub, s, max);
        let e = self.unary(Unary::Exp, z);
        let sum = self.reduce(Reduce::Sum, e, &stats_dims);
        let log_sum = self.unary(Unary::Log, sum);
        let stats = self.binary(Binary::Add, max, log_sum);
        self.spec_mut(stats).name = format!("{}::stats", self.name);
        if !opts.stats {
            // The engines match the pattern with its stats node; inference leaves the result virtual.
            self.discarded.push(stats);
        }
        let p = self.binary(Binary::Div, e, sum);
        // cuDNN requires bmm2's A operand in the I/O type.
        self.spec_mut(p).dtype = io;
        let o = self.matmul(p, v);
        let name = format!("{}::O", self.name);
        let spec = self.spec_mut(o);
        spec.dtype = io;
        spec.name = name;
        self.attentions.push(([q, k, v, o], opts.stats.then_some(stats)));
        SdpaOutputs { o, stats: opts.stats.then_some(stats) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_follows_the_effective_version() {
        let select = |runtime, header, mask| SdpaForm::select(Features::new(runtime, header, (9, 0)), mask);
        let h = 91900;
        assert_eq!(select(91300, h, Mask::None), SdpaForm::Composite);
        assert_eq!(select(91301, h, Mask::None), SdpaForm::Unified);
        assert_eq!(select(91400, h, Mask::None), SdpaForm::Unified);
        assert_eq!(select(91900, h, Mask::CausalTopLeft), SdpaForm::Composite);
        assert_eq!(select(91900, h, Mask::CausalBottomRight), SdpaForm::Composite);
        // A 9.21 library with 9.19 headers: the mask attributes are not in the bindings.
        assert_eq!(select(92100, h, Mask::CausalTopLeft), SdpaForm::Composite);
        assert_eq!(select(92100, 92100, Mask::CausalTopLeft), SdpaForm::Unified);
        // Old headers hold the unified node back even on a new library.
        assert_eq!(select(91900, 91200, Mask::None), SdpaForm::Composite);
    }

    /// A composite graph over Q, K, V of the given dims (packed), returning the validation error's tensor.
    fn invalid(
        qd: [i64; 4],
        kd: [i64; 4],
        vd: [i64; 4],
        dtype: crate::DataType,
        tweak: impl Fn(&mut Graph),
    ) -> (String, String) {
        let mut g = Graph::new("attn");
        let q = g.tensor(crate::TensorSpec::new("Q", &qd, dtype));
        let k = g.tensor(crate::TensorSpec::new("K", &kd, dtype));
        let v = g.tensor(crate::TensorSpec::new("V", &vd, dtype));
        let scale = g.tensor(crate::TensorSpec::scalar("scale", crate::DataType::F32, 4));
        let opts = SdpaOptions {
            mask: Mask::CausalTopLeft,
            stats: false,
            form: SdpaForm::Composite,
            features: Features::for_version(91900, (9, 0)),
            seq_lens: None,
        };
        let out = g.sdpa(q, k, v, scale, opts);
        g.output(out.o);
        tweak(&mut g);
        match g.validate() {
            Err(crate::Error::InvalidGraph { tensor, reason, .. }) => (tensor, reason),
            other => panic!("expected InvalidGraph, got {other:?}"),
        }
    }

    #[test]
    fn attention_validation_names_the_tensor() {
        use crate::DataType::{BF16, F32};
        let none = |_: &mut Graph| {};
        let (t, r) = invalid([1, 8, 16, 64], [2, 2, 16, 64], [2, 2, 16, 64], BF16, none);
        assert!(t == "K" && r.contains("batch differs"), "{t}: {r}");
        let (t, r) = invalid([1, 8, 16, 64], [1, 2, 16, 64], [1, 2, 24, 64], BF16, none);
        assert!(t == "V" && r.contains("sequence lengths differ"), "{t}: {r}");
        let (t, r) = invalid([1, 6, 16, 64], [1, 4, 16, 64], [1, 4, 16, 64], BF16, none);
        assert!(t == "K" && r.contains("multiple of the K/V heads"), "{t}: {r}");
        let (t, r) = invalid([1, 8, 16, 64], [1, 2, 16, 32], [1, 2, 16, 64], BF16, none);
        assert!(t == "K" && r.contains("head dims differ"), "{t}: {r}");
        let (t, r) = invalid([1, 8, 16, 64], [1, 2, 16, 64], [1, 2, 16, 64], F32, none);
        assert!(t == "Q" && r.contains("f16 or bf16"), "{t}: {r}");
        let strided = |g: &mut Graph| g.spec_mut(TensorId(0)).strides = vec![8 * 16 * 128, 16 * 128, 128, 2];
        let (t, r) = invalid([1, 8, 16, 64], [1, 2, 16, 64], [1, 2, 16, 64], BF16, strided);
        assert!(t == "Q" && r.contains("stride 1"), "{t}: {r}");
    }

    #[test]
    fn masks_keep_the_right_keys() {
        assert!(Mask::None.keeps(0, 9, 4, 10));
        assert!(Mask::CausalTopLeft.keeps(3, 3, 4, 10) && !Mask::CausalTopLeft.keeps(3, 4, 4, 10));
        // s_q 4 against s_kv 10: the last query sees all 10 keys, the first sees 7.
        assert!(Mask::CausalBottomRight.keeps(3, 9, 4, 10));
        assert!(Mask::CausalBottomRight.keeps(0, 6, 4, 10) && !Mask::CausalBottomRight.keeps(0, 7, 4, 10));
        // Equal lengths: both alignments agree.
        for (r, c) in [(0, 0), (2, 1), (1, 2), (5, 5)] {
            assert_eq!(Mask::CausalTopLeft.keeps(r, c, 6, 6), Mask::CausalBottomRight.keeps(r, c, 6, 6));
        }
    }
}
