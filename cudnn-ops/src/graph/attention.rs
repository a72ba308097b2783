//! Scaled dot-product attention as a graph: the composite pattern cuDNN's fused attention engines
//! recognize (what the C++ frontend's `CompositeSDPANode` expands to), or the single SDPA operation.

use super::node::{Binary, MatmulOverrides, Node, Reduce, Unary};
use super::{Graph, TensorId};
use crate::plan::Scalar;
use crate::Features;

/// Causal masking of the attention scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
#[non_exhaustive]
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
#[non_exhaustive]
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
    /// length up to the capacity). The unified form takes them as its `SEQ_LEN_QDESC`/`_KVDESC`
    /// (cuDNN 9.15+); the composite form builds the frontend's padding mask from them and overrides
    /// the matmuls' M, N, K by them (every cuDNN 9). They are also what ragged (THD) Q, K, V and O
    /// need ([`TensorSpec::ragged_offset`](crate::TensorSpec::ragged_offset)).
    pub seq_lens: Option<(TensorId, TensorId)>,
    /// Page tables `(k, v)`, i32 `[b, 1, max_pages, 1]` device tensors: K and V are then page pools
    /// (containers) `[num_pages, h_kv, page_size, d]` and sequence `b`'s key `p` is row `p % page_size`
    /// of page `table[b][p / page_size]`; the seq dim of the attention is `max_pages · page_size`.
    /// Needs [`SdpaOptions::seq_lens`]; unified form only (cuDNN 9.15+:
    /// `CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_KDESC` / `_VDESC`).
    pub page_tables: Option<(TensorId, TensorId)>,
}

impl SdpaOptions {
    /// Inference (no stats) with `mask`, in `form`, for the cuDNN `features` describe; fixed lengths.
    pub fn new(mask: Mask, form: SdpaForm, features: Features) -> Self {
        SdpaOptions { mask, stats: false, form, features, seq_lens: None, page_tables: None }
    }

    /// The same, also outputting the log-sum-exp stats (training mode).
    pub fn with_stats(self) -> Self {
        SdpaOptions { stats: true, ..self }
    }

    /// The same with per-sequence lengths from the i32 `[b, 1, 1, 1]` tensors `q` and `kv` (see
    /// [`SdpaOptions::seq_lens`](#structfield.seq_lens)).
    pub fn with_seq_lens(self, q: TensorId, kv: TensorId) -> Self {
        SdpaOptions { seq_lens: Some((q, kv)), ..self }
    }

    /// The same reading K and V through the i32 `[b, 1, max_pages, 1]` page tables `k` and `v` (see
    /// [`SdpaOptions::page_tables`](#structfield.page_tables)).
    pub fn with_page_tables(self, k: TensorId, v: TensorId) -> Self {
        SdpaOptions { page_tables: Some((k, v)), ..self }
    }
}

/// Outputs of [`Graph::sdpa`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
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
                page_tables: opts.page_tables,
            });
            return SdpaOutputs { o, stats };
        }

        if let Some((pk, _)) = opts.page_tables {
            // The composite form reads pages through PAGED_CACHE_LOAD operations, not built here.
            self.paged_composite = Some(pk);
        }
        let lens = opts.seq_lens;
        // bmm1 against the transposed view of K; with lengths, its M and N are each sequence's.
        let kt = self.spec_mut(k);
        kt.dims.swap(2, 3);
        kt.strides.swap(2, 3);
        let s = self.matmul_overridden(
            q,
            k,
            MatmulOverrides { m: lens.map(|l| l.0), n: lens.map(|l| l.1), k: None },
        );
        let s = self.binary(Binary::Mul, s, scale);
        // The frontend's order: the padding mask, then the causal band.
        let s = match lens {
            Some((sq, skv)) => self.padding_mask(s, sq, skv, opts.features),
            None => s,
        };
        let s = self.causal_mask(s, opts.mask, opts.features, lens);
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
        // bmm2: M the sequence's queries, K its keys.
        let o = self.matmul_overridden(
            p,
            v,
            MatmulOverrides { m: lens.map(|l| l.0), n: None, k: lens.map(|l| l.1) },
        );
        let name = format!("{}::O", self.name);
        let spec = self.spec_mut(o);
        spec.dtype = io;
        spec.name = name;
        let stats = opts.stats.then_some(stats);
        self.attentions.push(SdpaTensors { qkvo: [q, k, v, o], stats, seq_lens: lens });
        SdpaOutputs { o, stats }
    }

    /// The scores `s` (`[b, h, s_q, s_kv]`) with the keys `mask` hides filled with `-inf` (the lowest
    /// float before cuDNN 9.10): the frontend's right-bound diagonal band, GEN_INDEX row and column,
    /// CMP_GE, BINARY_SELECT; bottom-right alignment shifts the row by `s_kv − s_q` first (each
    /// sequence's lengths where `lens` gives them, the capacities otherwise).
    fn causal_mask(
        &mut self,
        s: TensorId,
        mask: Mask,
        features: Features,
        lens: Option<(TensorId, TensorId)>,
    ) -> TensorId {
        if mask == Mask::None {
            return s;
        }
        let mut row = self.gen_index(s, 2);
        let col = self.gen_index(s, 3);
        if mask == Mask::CausalBottomRight {
            // row + s_kv − s_q ≥ col: per sequence from the length tensors, else i32 constants.
            let (sq, skv) = match lens {
                Some(l) => l,
                None => {
                    let sdims = self.spec(s).dims.clone();
                    let skv = self.constant("seq_len_kv", Scalar::I32(sdims[3] as i32), 4);
                    let sq = self.constant("seq_len_q", Scalar::I32(sdims[2] as i32), 4);
                    (sq, skv)
                }
            };
            row = self.index_arith(Binary::Add, row, skv);
            row = self.index_arith(Binary::Sub, row, sq);
        }
        let keep = self.binary(Binary::CmpGe, row, col);
        let fill = self.mask_fill(features);
        self.select(keep, s, fill)
    }

    /// The by-value fill of masked scores: `-inf` from cuDNN 9.10, the lowest float before.
    fn mask_fill(&mut self, features: Features) -> TensorId {
        let fill = if features.neg_infinity_mask_fill() { f32::NEG_INFINITY } else { f32::MIN };
        self.constant("mask_fill", Scalar::F32(fill), 4)
    }

    /// The scores `s` with every position past a sequence's lengths filled (the frontend's
    /// `padding_mask`): GEN_INDEX row and column (i32), row CMP_LT `seq_len_q`, column CMP_LT
    /// `seq_len_kv` (the `[b, 1, 1, 1]` lengths broadcast over heads and positions), LOGICAL_AND,
    /// BINARY_SELECT.
    fn padding_mask(
        &mut self,
        s: TensorId,
        seq_q: TensorId,
        seq_kv: TensorId,
        features: Features,
    ) -> TensorId {
        let row = self.index_of(s, 2);
        let col = self.index_of(s, 3);
        let row_in = self.binary(Binary::CmpLt, row, seq_q);
        let col_in = self.binary(Binary::CmpLt, col, seq_kv);
        let keep = self.binary(Binary::LogicalAnd, row_in, col_in);
        let fill = self.mask_fill(features);
        self.select(keep, s, fill)
    }

    /// Attention backward from the forward's saved log-sum-exp `stats`: the composite graph of the
    /// frontend's `CompositeSDPABackwardNode` (cuDNN's unified `OPERATION_SDPA_BWD` does not finalize
    /// on 9.19). Q, O, dO `[b, h_q, s_q, d]`, K, V `[b, h_kv, s_kv, d]` over any strides with a unit
    /// last stride, `h_q` a multiple of `h_kv`; stats f32 `[b, h_q, s_q, 1]`; `scale` a by-value f32,
    /// the forward's. Returns dQ, dK, dV (virtual, I/O dtype, packed until the caller marks and strides
    /// them) and the two f32 buffers the graph writes and reads back, which the caller binds.
    ///
    /// Node by node (K and V become their `[b, h, d, s_kv]` transposed views, a stride swap on the
    /// same uids):
    /// 1. `softmax_sum = rowsum(dO ⊙ O) · 1` (MUL, REDUCTION ADD, MUL by a constant 1.0);
    /// 2. `P = exp(mask(scale · Q Kᵀ − stats))` (MATMUL, MUL, SUB, mask chain, EXP);
    /// 3. `dV = Pᵀ dO` through a transposed RESHAPE of P in the I/O dtype (grouped heads: full-head
    ///    product, then REDUCTION ADD over each group);
    /// 4. `dS = scale · P ⊙ (dO Vᵀ − softmax_sum)` (MATMUL, SUB, MUL, MUL);
    /// 5. `dK = dSᵀ Q` through a transposed RESHAPE of dS (grouped heads: REDUCTION ADD);
    /// 6. `dQ = dS K` into the f32 `dq_accum` (K viewed back through a RESHAPE), then IDENTITY to dQ.
    #[allow(clippy::too_many_arguments)]
    pub fn sdpa_backward(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        o: TensorId,
        d_o: TensorId,
        stats: TensorId,
        scale: TensorId,
        opts: SdpaBackwardOptions,
    ) -> SdpaGradients {
        let io = self.spec(q).dtype;
        let rank4 = [q, k, v, o, d_o].iter().all(|&t| self.spec(t).dims.len() == 4);
        let dims = |g: &Graph, t: TensorId| -> [i64; 4] {
            let d = &g.spec(t).dims;
            if rank4 {
                [d[0], d[1], d[2], d[3]]
            } else {
                [1; 4] // validation names the tensor of the wrong rank
            }
        };
        let [b, h_q, s_q, d_qk] = dims(self, q);
        let [_, h_k, s_kv, _] = dims(self, k);
        let [_, h_v, _, d_v] = dims(self, v);
        self.set_form(SdpaForm::Composite.name());
        let f32 = crate::DataType::F32;
        let packed = |d: &[i64]| crate::packed_strides(d);
        let one = self.constant("one", Scalar::F32(1.0), 4);

        // 1. softmax_sum = rowsum(dO ⊙ O), an f32 buffer the graph writes and reads back.
        let d_o_o = self.binary(Binary::Mul, d_o, o);
        // The frontend's strides for this virtual product (BSHD-like over BHSD dims).
        self.spec_mut(d_o_o).strides = vec![h_q * s_q * d_v, s_q * d_v, h_q * d_v, 1];
        let row_dims = [b, h_q, s_q, 1];
        let row_sum = self.reduce(Reduce::Sum, d_o_o, &row_dims);
        let softmax_sum = self.binary(Binary::Mul, row_sum, one);
        let name = format!("{}::softmax_sum", self.name);
        let spec = self.output(softmax_sum);
        spec.name = name;
        spec.strides = vec![h_q * s_q, s_q, 1, 1];

        // 2. P = exp(mask(scale · Q Kᵀ − stats)), recomputed from the forward's log-sum-exp.
        for t in [k, v] {
            let spec = self.spec_mut(t);
            if spec.dims.len() == 4 {
                spec.dims.swap(2, 3);
                spec.strides.swap(2, 3);
            }
        }
        let s = self.matmul(q, k);
        let s = self.binary(Binary::Mul, s, scale);
        let s = self.binary(Binary::Sub, s, stats);
        let s = self.causal_mask(s, opts.mask, opts.features, None);
        let p = self.unary(Unary::Exp, s);

        // The `[b, h_q, s_kv, s_q]` transposed view of a score-shaped tensor, in the I/O dtype.
        let transposed = [b, h_q, s_kv, s_q];
        let t_strides = [h_q * s_q * s_kv, s_q * s_kv, 1, s_kv];
        // A full-head gradient reduced over each group of query heads when K/V have fewer heads.
        let grouped = |g: &mut Graph, full: TensorId, heads: i64, dim: i64| -> TensorId {
            g.spec_mut(full).dtype = io;
            if heads == h_q {
                return full;
            }
            g.spec_mut(full).strides = packed(&[b, h_q, s_kv, dim]);
            g.reduce(Reduce::Sum, full, &[b, heads, s_kv, dim])
        };

        // 3. dV = Pᵀ dO.
        let p_t = self.reshape(p, &transposed, &t_strides, io);
        let dv_full = self.matmul(p_t, d_o);
        let dv = grouped(self, dv_full, h_v, d_v);

        // 4. dS = scale · P ⊙ (dO Vᵀ − softmax_sum).
        let dp = self.matmul(d_o, v);
        let ds = self.binary(Binary::Sub, dp, softmax_sum);
        let ds = self.binary(Binary::Mul, ds, p);
        let ds = self.binary(Binary::Mul, ds, scale);

        // 5. dK = dSᵀ Q.
        let ds_t = self.reshape(ds, &transposed, &t_strides, io);
        let dk_full = self.matmul(ds_t, q);
        let dk = grouped(self, dk_full, h_k, d_qk);

        // 6. dQ = dS K, accumulated in f32, then cast.
        let (kd, ks) = (self.spec(k).dims.clone(), self.spec(k).strides.clone());
        let (k_dims, k_strides) = if rank4 {
            ([kd[0], kd[1], kd[3], kd[2]], [ks[0], ks[1], ks[3], ks[2]])
        } else {
            ([1; 4], [1; 4])
        };
        let k_view = self.reshape(k, &k_dims, &k_strides, f32);
        let dq_accum = self.matmul(ds, k_view);
        let name = format!("{}::dq_accum", self.name);
        let spec = self.output(dq_accum);
        spec.name = name;
        spec.strides = packed(&[b, h_q, s_q, d_qk]);
        let dq = self.unary(Unary::Identity, dq_accum);
        self.spec_mut(dq).dtype = io;

        for (t, name) in [(dq, "dQ"), (dk, "dK"), (dv, "dV")] {
            let n = format!("{}::{name}", self.name);
            self.spec_mut(t).name = n;
            self.spec_mut(t).dtype = io;
        }
        let tensors = SdpaBackwardTensors { q, k, v, o, d_o, stats, dq, dk, dv };
        self.backward_attentions.push(tensors);
        SdpaGradients { dq, dk, dv, softmax_sum, dq_accum }
    }
}

/// What [`Graph::sdpa_backward`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct SdpaBackwardOptions {
    /// The forward's causal masking.
    pub mask: Mask,
    /// What the cuDNN the graph is for can do (the mask fill).
    pub features: Features,
}

impl SdpaBackwardOptions {
    /// The backward of a forward with `mask`, for the cuDNN `features` describe.
    pub fn new(mask: Mask, features: Features) -> Self {
        SdpaBackwardOptions { mask, features }
    }
}

/// Outputs of [`Graph::sdpa_backward`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SdpaGradients {
    /// `[b, h_q, s_q, d]` in the I/O dtype, virtual until marked with [`Graph::output`].
    pub dq: TensorId,
    /// `[b, h_kv, s_kv, d]` in the I/O dtype (summed over each group of query heads), virtual until
    /// marked.
    pub dk: TensorId,
    /// `[b, h_kv, s_kv, d_v]` in the I/O dtype, virtual until marked.
    pub dv: TensorId,
    /// f32 `[b, h_q, s_q, 1]` (strides `[h_q·s_q, s_q, 1, 1]`) row sums of `dO ⊙ O`: a device buffer
    /// the graph writes, then reads (the frontend keeps it in its part of the workspace).
    pub softmax_sum: TensorId,
    /// f32 `[b, h_q, s_q, d]` packed accumulator of dQ: a device buffer the graph's engines accumulate
    /// into (cuDNN before 9.6 needs it zeroed before each execution).
    pub dq_accum: TensorId,
}

/// The tensors of one composite attention forward, checked as a whole by [`Graph::validate`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct SdpaTensors {
    /// Q, K (its transposed view), V, O.
    pub qkvo: [TensorId; 4],
    /// The stats, when they are an output.
    pub stats: Option<TensorId>,
    /// `(seq_len_q, seq_len_kv)` of a padded (or ragged) attention.
    pub seq_lens: Option<(TensorId, TensorId)>,
}

/// The tensors of one attention backward, checked as a whole by [`Graph::validate`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct SdpaBackwardTensors {
    pub q: TensorId,
    pub k: TensorId,
    pub v: TensorId,
    pub o: TensorId,
    pub d_o: TensorId,
    pub stats: TensorId,
    pub dq: TensorId,
    pub dk: TensorId,
    pub dv: TensorId,
}

#[cfg(test)]
mod tests {
    use super::super::node::MatmulOverrides;
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
            page_tables: None,
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
    fn page_tables_are_validated_by_name() {
        use crate::DataType::{BF16, I32};
        let f = Features::for_version(91900, (9, 0));
        let build = |tweak: &dyn Fn(&mut Graph, TensorId), with_lens: bool| {
            let mut g = Graph::new("paged");
            let q = g.tensor(crate::TensorSpec::new("Q", &[2, 8, 1, 64], BF16));
            let k = g.tensor(crate::TensorSpec::new("K", &[32, 2, 16, 64], BF16));
            let v = g.tensor(crate::TensorSpec::new("V", &[32, 2, 16, 64], BF16));
            let scale = g.tensor(crate::TensorSpec::scalar("scale", crate::DataType::F32, 4));
            let lens = |g: &mut Graph, name: &str| {
                g.tensor(crate::TensorSpec::new(name, &[2, 1, 1, 1], I32).with_strides(&[1, 1, 1, 1]))
            };
            let (sq, skv) = (lens(&mut g, "seq_len_q"), lens(&mut g, "seq_len_kv"));
            let table = |g: &mut Graph, name: &str| {
                g.tensor(crate::TensorSpec::new(name, &[2, 1, 8, 1], I32).with_strides(&[8, 8, 1, 1]))
            };
            let (pk, pv) = (table(&mut g, "page_table_k"), table(&mut g, "page_table_v"));
            let mut opts = SdpaOptions::new(Mask::None, SdpaForm::Unified, f).with_page_tables(pk, pv);
            if with_lens {
                opts = opts.with_seq_lens(sq, skv);
            }
            let out = g.sdpa(q, k, v, scale, opts);
            g.output(out.o);
            tweak(&mut g, pv);
            g.validate()
        };
        build(&|_, _| {}, true).unwrap();
        let fails = |r: crate::Result<()>, tensor: &str, reason: &str| match r {
            Err(crate::Error::InvalidGraph { tensor: t, reason: why, .. }) => {
                assert!(t == tensor && why.contains(reason), "{t}: {why}")
            }
            other => panic!("expected InvalidGraph for {tensor}, got {other:?}"),
        };
        fails(build(&|_, _| {}, false), "page_table_k", "need the sequence lengths");
        fails(
            build(&|g, pv| g.spec_mut(pv).dims = vec![3, 1, 8, 1], true),
            "page_table_v",
            "[2, 1, max_pages, 1]",
        );
        fails(build(&|g, pv| g.spec_mut(pv).dtype = BF16, true), "page_table_v", "i32");
        // K and V pools of different page sizes.
        fails(
            build(&|g, _| g.spec_mut(TensorId(2)).dims = vec![32, 2, 8, 64], true),
            "V",
            "page sizes differ",
        );
    }

    /// A unified THD attention over 4 sequences in a 256 bucket: Q, K, V, O ragged through two offset
    /// tensors, `tweak` applied before validation.
    fn ragged(form: SdpaForm, with_lens: bool, tweak: &dyn Fn(&mut Graph)) -> crate::Result<()> {
        use crate::DataType::{BF16, I32};
        let f = Features::for_version(91900, (9, 0));
        let mut g = Graph::new("ragged");
        let thd = |h: i64| [256 * h * 64, 64, h * 64, 1];
        let q = g.tensor(crate::TensorSpec::new("Q", &[4, 8, 256, 64], BF16).with_strides(&thd(8)));
        let k = g.tensor(crate::TensorSpec::new("K", &[4, 2, 256, 64], BF16).with_strides(&thd(2)));
        let v = g.tensor(crate::TensorSpec::new("V", &[4, 2, 256, 64], BF16).with_strides(&thd(2)));
        let scale = g.tensor(crate::TensorSpec::scalar("scale", crate::DataType::F32, 4));
        let i32_col = |g: &mut Graph, name: &str, n: i64| {
            g.tensor(crate::TensorSpec::new(name, &[n, 1, 1, 1], I32).with_strides(&[1, 1, 1, 1]))
        };
        let (sq, skv) = (i32_col(&mut g, "seq_len_q", 4), i32_col(&mut g, "seq_len_kv", 4));
        let q_off = i32_col(&mut g, "q_offsets", 5);
        let kv_off = i32_col(&mut g, "kv_offsets", 5);
        let (q_uid, kv_uid) = (g.spec(q_off).uid, g.spec(kv_off).uid);
        g.spec_mut(q).ragged_offset = Some(q_uid);
        g.spec_mut(k).ragged_offset = Some(kv_uid);
        g.spec_mut(v).ragged_offset = Some(kv_uid);
        let mut opts = SdpaOptions::new(Mask::None, form, f);
        if with_lens {
            opts = opts.with_seq_lens(sq, skv);
        }
        let out = g.sdpa(q, k, v, scale, opts);
        let o = g.output(out.o);
        o.strides = thd(8).to_vec();
        o.ragged_offset = Some(q_uid);
        tweak(&mut g);
        g.validate()
    }

    #[test]
    fn ragged_offsets_are_validated_by_name() {
        use crate::DataType::{BF16, I32};
        let find = |g: &Graph, name: &str| TensorId(g.tensors().iter().position(|t| t.name == name).unwrap());
        ragged(SdpaForm::Unified, true, &|_| {}).unwrap();
        let fails = |r: crate::Result<()>, tensor: &str, reason: &str| match r {
            Err(crate::Error::InvalidGraph { tensor: t, reason: why, .. }) => {
                assert!(t == tensor && why.contains(reason), "{tensor}: {t}: {why}")
            }
            other => panic!("expected InvalidGraph for {tensor}, got {other:?}"),
        };
        fails(ragged(SdpaForm::Unified, false, &|_| {}), "Q", "need the sequence lengths");
        fails(
            ragged(SdpaForm::Unified, true, &|g| g.spec_mut(find(g, "Q")).ragged_offset = Some(99)),
            "Q",
            "uid 99 is no tensor",
        );
        // B + 1 entries, i32, on the device, not ragged itself.
        type Tweak<'a> = &'a dyn Fn(&mut Graph);
        let tweaks: [(Tweak, &str); 4] = [
            (&|g| g.spec_mut(find(g, "kv_offsets")).dims = vec![4, 1, 1, 1], "[5, 1, 1, 1]"),
            (&|g| g.spec_mut(find(g, "kv_offsets")).dtype = BF16, "i32"),
            (&|g| g.spec_mut(find(g, "kv_offsets")).by_value = true, "device tensor"),
            (
                &|g| {
                    let uid = g.spec(find(g, "q_offsets")).uid;
                    g.spec_mut(find(g, "kv_offsets")).ragged_offset = Some(uid);
                },
                "device tensor",
            ),
        ];
        for (tweak, reason) in tweaks {
            fails(ragged(SdpaForm::Unified, true, tweak), "kv_offsets", reason);
        }
        // Only the attention's Q, K, V and O take offsets: not its sequence lengths.
        fails(
            ragged(SdpaForm::Unified, true, &|g| {
                let uid = g.spec(find(g, "q_offsets")).uid;
                g.spec_mut(find(g, "seq_len_q")).ragged_offset = Some(uid);
            }),
            "seq_len_q",
            "only taken by the Q, K, V or O",
        );
        // The composite form takes them with its padding mask, and names Q without lengths.
        ragged(SdpaForm::Composite, true, &|_| {}).unwrap();
        fails(ragged(SdpaForm::Composite, false, &|_| {}), "Q", "need the sequence lengths");
        // A ragged tensor outside attention.
        let mut g = Graph::new("norm");
        let off = g.tensor(crate::TensorSpec::new("offsets", &[31, 1, 1, 1], I32));
        let uid = g.spec(off).uid;
        let x = g.tensor(crate::TensorSpec::new("X", &[30, 2048, 1, 1], BF16).with_ragged_offset(uid));
        let w = g.tensor(crate::TensorSpec::new("scale", &[1, 2048, 1, 1], BF16));
        let e = g.tensor(crate::TensorSpec::scalar("epsilon", crate::DataType::F32, 4));
        let y = g.rmsnorm(x, w, e, super::super::NormPhase::Inference).y;
        g.output(y);
        fails(g.validate(), "X", "only taken by the Q, K, V or O");
    }

    #[test]
    fn composite_ragged_attention_follows_the_frontend_padding_mask() {
        // A causal ragged (THD) attention on the composite form, as the frontend expands
        // `padding_mask=true` with ragged offsets and a top-left right bound of 0.
        let f = Features::for_version(91900, (9, 0));
        let thd_graph = |mask: Mask| {
            let mut g = Graph::new("thd");
            let thd = |h: i64| [256 * h * 64, 64, h * 64, 1];
            use crate::DataType::{BF16, I32};
            let q = g.tensor(crate::TensorSpec::new("Q", &[4, 8, 256, 64], BF16).with_strides(&thd(8)));
            let k = g.tensor(crate::TensorSpec::new("K", &[4, 2, 256, 64], BF16).with_strides(&thd(2)));
            let v = g.tensor(crate::TensorSpec::new("V", &[4, 2, 256, 64], BF16).with_strides(&thd(2)));
            let scale = g.tensor(crate::TensorSpec::scalar("scale", crate::DataType::F32, 4));
            let col = |g: &mut Graph, name: &str, n: i64| {
                g.tensor(crate::TensorSpec::new(name, &[n, 1, 1, 1], I32).with_strides(&[1, 1, 1, 1]))
            };
            let (sq, skv) = (col(&mut g, "seq_len_q", 4), col(&mut g, "seq_len_kv", 4));
            let (q_off, kv_off) = (col(&mut g, "q_offsets", 5), col(&mut g, "kv_offsets", 5));
            let (qu, kvu) = (g.spec(q_off).uid, g.spec(kv_off).uid);
            g.spec_mut(q).ragged_offset = Some(qu);
            g.spec_mut(k).ragged_offset = Some(kvu);
            g.spec_mut(v).ragged_offset = Some(kvu);
            let opts = SdpaOptions::new(mask, SdpaForm::Composite, f).with_seq_lens(sq, skv);
            let out = g.sdpa(q, k, v, scale, opts);
            let o = g.output(out.o);
            o.strides = thd(8).to_vec();
            o.ragged_offset = Some(qu);
            (g, sq, skv)
        };
        let (g, sq, skv) = thd_graph(Mask::CausalTopLeft);
        g.validate().unwrap();
        assert_eq!(g.form(), Some("composite"));
        let expected = [
            "matmul",
            "mul",
            // padding: row < seq_len_q and col < seq_len_kv, else -inf
            "gen_index",
            "gen_index",
            "cmp_lt",
            "cmp_lt",
            "logical_and",
            "select",
            // causal band: row >= col, else -inf
            "gen_index",
            "gen_index",
            "cmp_ge",
            "select",
            // softmax with its (virtual) stats
            "reduce_max",
            "sub",
            "exp",
            "reduce_sum",
            "log",
            "add",
            "div",
            "matmul",
        ];
        assert_eq!(pattern(&g), expected);
        // bmm1 runs M = seq_len_q by N = seq_len_kv, bmm2 M = seq_len_q with K = seq_len_kv.
        let overrides: Vec<MatmulOverrides> = g
            .nodes
            .iter()
            .filter_map(|n| if let Node::Matmul { overrides, .. } = n { Some(*overrides) } else { None })
            .collect();
        assert_eq!(
            overrides,
            [
                MatmulOverrides { m: Some(sq), n: Some(skv), k: None },
                MatmulOverrides { m: Some(sq), n: None, k: Some(skv) }
            ]
        );
        // The padding compares read the length tensors; its index is i32 and its mask boolean.
        let reads: Vec<TensorId> = g
            .nodes
            .iter()
            .filter_map(|n| match n {
                Node::Pointwise { op: super::super::node::Pointwise::Binary(Binary::CmpLt), b, .. } => *b,
                _ => None,
            })
            .collect();
        assert_eq!(reads, [sq, skv]);
        // Bottom-right alignment shifts the row by each sequence's lengths, not the capacities.
        let (br, sq, skv) = thd_graph(Mask::CausalBottomRight);
        br.validate().unwrap();
        let shifts: Vec<TensorId> = br
            .nodes
            .iter()
            .filter_map(|n| match n {
                Node::Pointwise {
                    op: super::super::node::Pointwise::Binary(Binary::Add | Binary::Sub),
                    b,
                    axis: Some(3),
                    ..
                } => *b,
                _ => None,
            })
            .collect();
        assert_eq!(shifts, [skv, sq]);
        // Without lengths the composite matmuls have no overrides.
        let (plain, ..) = backward([1, 8, 2, 16, 16, 64], Mask::CausalTopLeft, crate::DataType::BF16);
        assert!(plain.nodes.iter().all(|n| match n {
            Node::Matmul { overrides, .. } => overrides.present().next().is_none(),
            _ => true,
        }));
    }

    #[test]
    fn padded_composite_validation_names_the_tensor() {
        use crate::DataType::{BF16, I32};
        let fails = |r: crate::Result<()>, tensor: &str, reason: &str| match r {
            Err(crate::Error::InvalidGraph { tensor: t, reason: why, .. }) => {
                assert!(t == tensor && why.contains(reason), "{tensor}: {t}: {why}")
            }
            other => panic!("expected InvalidGraph for {tensor}, got {other:?}"),
        };
        let find = |g: &Graph, name: &str| TensorId(g.tensors().iter().position(|t| t.name == name).unwrap());
        // Lengths of the wrong batch or dtype, named.
        fails(
            ragged(SdpaForm::Composite, true, &|g| g.spec_mut(find(g, "seq_len_kv")).dims = vec![3, 1, 1, 1]),
            "seq_len_kv",
            "sequence lengths must be an i32 [4, 1, 1, 1]",
        );
        fails(
            ragged(SdpaForm::Composite, true, &|g| g.spec_mut(find(g, "seq_len_q")).dtype = BF16),
            "seq_len_q",
            "i32",
        );
        fails(
            ragged(SdpaForm::Composite, true, &|g| g.spec_mut(find(g, "seq_len_q")).by_value = true),
            "seq_len_q",
            "device tensor",
        );
        // Offsets on the virtual stats of an inference attention, or on the scale: refused by name.
        fails(
            ragged(SdpaForm::Composite, true, &|g| {
                let uid = g.spec(find(g, "q_offsets")).uid;
                g.spec_mut(find(g, "ragged::stats")).ragged_offset = Some(uid);
            }),
            "ragged::stats",
            "device tensors",
        );
        fails(
            ragged(SdpaForm::Composite, true, &|g| {
                let uid = g.spec(find(g, "q_offsets")).uid;
                let s = find(g, "scale");
                g.spec_mut(s).ragged_offset = Some(uid);
                g.spec_mut(s).by_value = false;
                g.spec_mut(s).dims = vec![4, 1, 1, 1];
            }),
            "scale",
            "only taken by the Q, K, V or O",
        );
        // A matmul override must be i32 with the output's batch dims and 1s for the matrix dims.
        for (dims, dtype, ok) in [
            (vec![2, 1, 1], I32, true),
            (vec![1, 1, 1], I32, true),
            (vec![2, 4, 1], I32, false),
            (vec![2, 1, 1], BF16, false),
        ] {
            let mut g = Graph::new("mm");
            let a = g.tensor(crate::TensorSpec::new("A", &[2, 4, 8], BF16));
            let b = g.tensor(crate::TensorSpec::new("B", &[2, 8, 16], BF16));
            let m = g.tensor(crate::TensorSpec::new("m", &dims, dtype));
            let c = g.matmul_overridden(a, b, MatmulOverrides { m: Some(m), ..Default::default() });
            g.output(c);
            match ok {
                true => g.validate().unwrap(),
                false => fails(g.validate(), "m", "M override must be an i32 [2, 1, 1]"),
            }
        }
        // A padded (not ragged) composite attention validates too: BSHD with per-sequence lengths.
        let mut g = Graph::new("padded");
        let q = g.tensor(crate::TensorSpec::new("Q", &[2, 8, 64, 64], BF16));
        let k = g.tensor(crate::TensorSpec::new("K", &[2, 2, 64, 64], BF16));
        let v = g.tensor(crate::TensorSpec::new("V", &[2, 2, 64, 64], BF16));
        let scale = g.tensor(crate::TensorSpec::scalar("scale", crate::DataType::F32, 4));
        let lens = |g: &mut Graph, name: &str| {
            g.tensor(crate::TensorSpec::new(name, &[2, 1, 1, 1], I32).with_strides(&[1, 1, 1, 1]))
        };
        let (sq, skv) = (lens(&mut g, "seq_len_q"), lens(&mut g, "seq_len_kv"));
        let f = Features::for_version(91900, (9, 0));
        let opts =
            SdpaOptions::new(Mask::CausalTopLeft, SdpaForm::Composite, f).with_seq_lens(sq, skv).with_stats();
        let out = g.sdpa(q, k, v, scale, opts);
        g.output(out.o);
        g.output(out.stats.unwrap());
        g.validate().unwrap();
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

    /// The node sequence of a graph, in cuDNN's op-graph tag spelling (pointwise modes by name).
    fn pattern(g: &Graph) -> Vec<String> {
        use super::super::node::Pointwise;
        g.nodes
            .iter()
            .map(|n| match n {
                Node::Matmul { .. } => "matmul".to_string(),
                Node::Reduction { op, .. } => format!("reduce_{op:?}").to_lowercase(),
                Node::Reshape { .. } => "reshape".to_string(),
                Node::Pointwise { op, .. } => match op {
                    Pointwise::Unary(u) => format!("{u:?}").to_lowercase(),
                    other => other.name().to_string(),
                },
                other => format!("{other:?}"),
            })
            .collect()
    }

    /// A backward graph over packed BHSD tensors: `[b, h_q, h_kv, s_q, s_kv, d]`.
    fn backward(shape: [i64; 6], mask: Mask, dtype: crate::DataType) -> (Graph, SdpaGradients) {
        let [b, hq, hkv, sq, skv, d] = shape;
        let mut g = Graph::new("bwd");
        let t =
            |g: &mut Graph, name: &str, dims: [i64; 4]| g.tensor(crate::TensorSpec::new(name, &dims, dtype));
        let q = t(&mut g, "Q", [b, hq, sq, d]);
        let k = t(&mut g, "K", [b, hkv, skv, d]);
        let v = t(&mut g, "V", [b, hkv, skv, d]);
        let o = t(&mut g, "O", [b, hq, sq, d]);
        let d_o = t(&mut g, "dO", [b, hq, sq, d]);
        let stats = g.tensor(crate::TensorSpec::new("stats", &[b, hq, sq, 1], crate::DataType::F32));
        let scale = g.tensor(crate::TensorSpec::scalar("scale", crate::DataType::F32, 4));
        let opts = SdpaBackwardOptions { mask, features: Features::for_version(91900, (9, 0)) };
        let out = g.sdpa_backward(q, k, v, o, d_o, stats, scale, opts);
        for t in [out.dq, out.dk, out.dv] {
            g.output(t);
        }
        (g, out)
    }

    #[test]
    fn backward_follows_the_frontend_composite_node_by_node() {
        let (g, out) = backward([2, 8, 2, 64, 96, 64], Mask::CausalTopLeft, crate::DataType::BF16);
        g.validate().unwrap();
        assert_eq!(g.form(), Some("composite"));
        let expected = [
            // softmax_sum = rowsum(dO ⊙ O) · 1
            "mul",
            "reduce_sum",
            "mul",
            // P = exp(mask(scale · Q Kᵀ − stats))
            "matmul",
            "mul",
            "sub",
            "gen_index",
            "gen_index",
            "cmp_ge",
            "select",
            "exp",
            // dV = Pᵀ dO, grouped heads summed
            "reshape",
            "matmul",
            "reduce_sum",
            // dS = scale · P ⊙ (dO Vᵀ − softmax_sum)
            "matmul",
            "sub",
            "mul",
            "mul",
            // dK = dSᵀ Q, grouped heads summed
            "reshape",
            "matmul",
            "reduce_sum",
            // dQ = dS K through the f32 accumulator
            "reshape",
            "matmul",
            "identity",
        ];
        assert_eq!(pattern(&g), expected);
        // K and V are their transposed views over the same memory; the row sums and the dQ
        // accumulator are f32 device buffers the caller binds.
        for name in ["K", "V"] {
            let t = g.tensors().iter().find(|t| t.name == name).unwrap();
            assert_eq!(
                (t.dims.clone(), t.strides.clone()),
                (vec![2, 2, 64, 96], vec![96 * 2 * 64, 96 * 64, 1, 64])
            );
        }
        let sum = g.spec(out.softmax_sum);
        assert!(!sum.is_virtual && sum.dtype == crate::DataType::F32);
        assert_eq!((sum.dims.clone(), sum.strides.clone()), (vec![2, 8, 64, 1], vec![8 * 64, 64, 1, 1]));
        let acc = g.spec(out.dq_accum);
        assert!(!acc.is_virtual && acc.dtype == crate::DataType::F32);
        assert_eq!(
            (acc.dims.clone(), acc.strides.clone()),
            (vec![2, 8, 64, 64], vec![8 * 64 * 64, 64 * 64, 64, 1])
        );
        // The transposed P and dS views go to their matmuls in the I/O dtype.
        let views: Vec<_> = g
            .nodes
            .iter()
            .filter_map(|n| if let Node::Reshape { y, .. } = n { Some(g.spec(*y).clone()) } else { None })
            .collect();
        for v in &views[..2] {
            assert_eq!(
                (v.dims.clone(), v.strides.clone(), v.dtype),
                (vec![2, 8, 96, 64], vec![8 * 64 * 96, 64 * 96, 1, 96], crate::DataType::BF16)
            );
        }
        assert_eq!(
            (views[2].dims.clone(), views[2].strides.clone()),
            (vec![2, 2, 96, 64], vec![96 * 2 * 64, 96 * 64, 64, 1])
        );
        for (t, dims) in [(out.dq, [2, 8, 64, 64]), (out.dk, [2, 2, 96, 64]), (out.dv, [2, 2, 96, 64])] {
            assert_eq!((g.spec(t).dims.clone(), g.spec(t).dtype), (dims.to_vec(), crate::DataType::BF16));
        }
    }

    #[test]
    fn backward_graphs_validate_for_every_mask_and_head_grouping() {
        for mask in [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight] {
            for (hq, hkv) in [(8, 8), (8, 2), (8, 1)] {
                for dtype in [crate::DataType::BF16, crate::DataType::F16] {
                    let (g, _) = backward([1, hq, hkv, 32, 48, 128], mask, dtype);
                    g.validate().unwrap_or_else(|e| panic!("{mask:?} {hq}/{hkv} {dtype}: {e}"));
                    let p = pattern(&g);
                    let masks = p.iter().filter(|n| *n == "select").count();
                    assert_eq!(masks, usize::from(mask != Mask::None), "{mask:?}");
                    // Bottom-right shifts the row index by s_kv − s_q (an add and a sub on i32).
                    let shifts = p.iter().filter(|n| *n == "add").count();
                    assert_eq!(shifts, usize::from(mask == Mask::CausalBottomRight), "{mask:?}");
                    // Multi-head: the matmuls write dV and dK directly; grouped: a head reduction each.
                    let reductions = p.iter().filter(|n| *n == "reduce_sum").count();
                    assert_eq!(reductions, 1 + if hq == hkv { 0 } else { 2 }, "{hq}/{hkv}");
                }
            }
        }
    }

    #[test]
    fn backward_validation_names_the_tensor() {
        use crate::DataType::{BF16, F16, F32};
        let expect = |g: &Graph, tensor: &str, reason: &str| match g.validate() {
            Err(crate::Error::InvalidGraph { tensor: t, reason: r, .. }) => {
                assert!(t.contains(tensor) && r.contains(reason), "{t}: {r}")
            }
            other => panic!("expected InvalidGraph for {tensor}, got {other:?}"),
        };
        let find = |g: &Graph, name: &str| TensorId(g.tensors().iter().position(|t| t.name == name).unwrap());
        let (mut g, _) = backward([1, 8, 2, 16, 16, 64], Mask::None, BF16);
        let d_o = find(&g, "dO");
        g.spec_mut(d_o).dims = vec![1, 8, 16, 32];
        expect(&g, "dO", "differ from O");
        let (mut g, _) = backward([1, 8, 2, 16, 16, 64], Mask::None, BF16);
        let d_o = find(&g, "dO");
        g.spec_mut(d_o).dtype = F16;
        expect(&g, "dO", "I/O dtype");
        let (mut g, out) = backward([1, 8, 2, 16, 16, 64], Mask::None, BF16);
        g.spec_mut(out.dk).strides = vec![2 * 16 * 64, 16 * 64, 1, 16];
        expect(&g, "dK", "stride 1");
        let (mut g, _) = backward([1, 8, 2, 16, 16, 64], Mask::None, BF16);
        let stats = find(&g, "stats");
        g.spec_mut(stats).dims = vec![1, 8, 16, 2];
        expect(&g, "stats", "stats must be f32");
        let (mut g, _) = backward([1, 8, 2, 16, 16, 64], Mask::None, BF16);
        let stats = find(&g, "stats");
        g.spec_mut(stats).dtype = F32;
        g.spec_mut(stats).by_value = true;
        expect(&g, "stats", "device tensor");
        let (g, _) = backward([1, 6, 4, 16, 16, 64], Mask::None, BF16);
        expect(&g, "K", "multiple of the K/V heads");
    }

    #[test]
    fn reshapes_and_grouped_reductions_are_checked() {
        let mut g = Graph::new("views");
        let x = g.tensor(crate::TensorSpec::new("X", &[1, 8, 16, 32], crate::DataType::F32));
        let y = g.reshape(x, &[1, 8, 32, 16], &[4096, 512, 1, 32], crate::DataType::BF16);
        let r = g.reduce(Reduce::Sum, y, &[1, 2, 32, 16]);
        g.output(r);
        g.validate().unwrap();
        let mut bad = g.clone();
        bad.spec_mut(y).dims = vec![1, 8, 32, 8];
        bad.spec_mut(y).strides = vec![2048, 256, 1, 32];
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("not a permutation"), "{e}");
        let mut bad = g.clone();
        bad.spec_mut(r).dims = vec![1, 3, 32, 16];
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("must divide"), "{e}");
    }
}
