//! Per-node validation: shapes, dtypes and flags cuDNN would otherwise reject with a bare status.

use super::node::{Binary, MatmulOverrides, Node, Pointwise};
use super::{Graph, TensorId};
use crate::dtype::DataType;
use crate::Result;

const FLOATS: [DataType; 3] = [DataType::F32, DataType::F16, DataType::BF16];

impl Graph {
    pub(super) fn check_node(&self, node: &Node) -> Result<()> {
        match *node {
            Node::Norm { x, scale, bias, epsilon, y, mean, inv_var, .. } => {
                self.check_norm(x, [Some(scale), bias], epsilon, y, [mean, inv_var])
            }
            Node::RmsNormBackward { dy, x, scale, inv_rms, dx, dscale } => {
                self.check_rmsnorm_backward(dy, x, scale, inv_rms, dx, dscale)
            }
            Node::Pointwise { op, x, b, t, y, .. } => self.check_pointwise(op, x, b, t, y),
            Node::Matmul { a, b, c, overrides } => {
                self.check_matmul(a, b, c)?;
                self.check_matmul_overrides(c, overrides)
            }
            Node::Reduction { x, y, .. } => self.check_reduction(x, y),
            Node::Reshape { x, y } => self.check_reshape(x, y),
            Node::SdpaFwd { q, k, v, o, stats, mask, seq_lens, page_tables, .. } => {
                if let Some((pk, pv)) = page_tables {
                    self.check_page_tables(q, [k, v], [pk, pv], seq_lens.is_some())?;
                }
                if let Some(lens) = seq_lens {
                    self.check_seq_lens(q, lens)?;
                }
                if mask != super::Mask::None {
                    return Err(crate::Error::NotSupported {
                        op: self.name.clone(),
                        reason: format!(
                            "a {} mask on the unified SDPA operation needs cuDNN 9.21 bindings (these are {}); \
                             use the composite form",
                            mask.name(),
                            crate::version_string(crate::HEADER_VERSION)
                        ),
                    });
                }
                self.check_sdpa_tensors_paged(q, k, v, o, stats, [false, false], page_tables.is_some())
            }
        }
    }

    /// Per-sequence lengths of an attention over Q: i32 `[b, 1, 1, 1]` device tensors.
    pub(super) fn check_seq_lens(&self, q: TensorId, (sq, skv): (TensorId, TensorId)) -> Result<()> {
        let b = self.spec(q).dims.first().copied().unwrap_or(0);
        for t in [sq, skv] {
            let s = self.spec(t);
            if s.dtype != DataType::I32 || s.dims[..] != [b, 1, 1, 1] || s.is_virtual || s.by_value {
                return Err(
                    self.fail(t, format!("sequence lengths must be an i32 [{b}, 1, 1, 1] device tensor"))
                );
            }
        }
        Ok(())
    }

    /// A matmul's M/N/K overrides: i32 device tensors with the output's batch dims and 1 for the two
    /// matrix dims (one size per matrix of the batch).
    fn check_matmul_overrides(&self, c: TensorId, overrides: MatmulOverrides) -> Result<()> {
        let cd = &self.spec(c).dims;
        let r = cd.len();
        for (dim, t) in overrides.present() {
            let s = self.spec(t);
            let ok = s.dtype == DataType::I32
                && s.dims.len() == r
                && s.dims[..r - 2].iter().zip(&cd[..r - 2]).all(|(&a, &b)| a == b || a == 1)
                && s.dims[r - 2..].iter().all(|&d| d == 1)
                && !s.is_virtual
                && !s.by_value;
            if !ok {
                let mut want = cd.clone();
                want[r - 2..].fill(1);
                return Err(
                    self.fail(t, format!("a matmul {dim} override must be an i32 {want:?} device tensor"))
                );
            }
        }
        Ok(())
    }

    /// Ragged (THD) tensors: a tensor's ragged offsets name an i32 `[b + 1, 1, 1, 1]` device tensor of
    /// the graph (with no offsets of its own); only the Q, K, V and O of an attention with sequence
    /// lengths take them (the unified operation's, or the composite graph's with its padding mask;
    /// there also its stats, when they are an output), K and V not paged, as the frontend's THD
    /// attention ("Ragged offsets are only supported with padding mask").
    pub(super) fn check_ragged_offsets(&self) -> Result<()> {
        for (i, t) in self.tensors.iter().enumerate() {
            let Some(uid) = t.ragged_offset else { continue };
            let id = TensorId(i);
            let Some(j) = self.tensors.iter().position(|o| o.uid == uid) else {
                return Err(self.fail(id, format!("its ragged offsets uid {uid} is no tensor of this graph")));
            };
            let b = t.dims.first().copied().unwrap_or(0);
            let o = &self.tensors[j];
            let ok = o.dtype == DataType::I32
                && o.dims[..] == [b + 1, 1, 1, 1]
                && !o.is_virtual
                && !o.by_value
                && o.ragged_offset.is_none();
            if !ok {
                return Err(self.fail(
                    TensorId(j),
                    format!("ragged offsets must be an i32 [{}, 1, 1, 1] device tensor (batch + 1)", b + 1),
                ));
            }
            if t.is_virtual || t.by_value {
                return Err(self
                    .fail(id, "ragged offsets are only taken by device tensors (graph inputs and outputs)"));
            }
            // (has sequence lengths, is a paged K or V) of the attention the tensor belongs to.
            let composite = self.attentions.iter().find_map(|a| {
                (a.qkvo.contains(&id) || a.stats == Some(id)).then_some((a.seq_lens.is_some(), false))
            });
            let unified = || {
                self.nodes.iter().find_map(|n| match *n {
                    Node::SdpaFwd { q, k, v, o, seq_lens, page_tables, .. } if [q, k, v, o].contains(&id) => {
                        Some((seq_lens.is_some(), page_tables.is_some() && (id == k || id == v)))
                    }
                    _ => None,
                })
            };
            match composite.or_else(unified) {
                None => {
                    return Err(self.fail(
                        id,
                        "ragged offsets are only taken by the Q, K, V or O of an SDPA with sequence lengths",
                    ))
                }
                Some((false, _)) => return Err(self.fail(
                    id,
                    "ragged offsets need the sequence lengths (seq_len_q, seq_len_kv): the frontend takes \
                         THD tensors only with its padding mask",
                )),
                Some((_, true)) => {
                    return Err(self.fail(id, "paged K/V are read through page tables, not ragged offsets"))
                }
                Some((true, false)) => {}
            }
        }
        Ok(())
    }

    /// Page tables of an attention: i32 `[b, 1, max_pages, 1]` device tensors, one per pool (K and V
    /// containers `[num_pages, h_kv, page_size, d]`), with the sequence lengths the paged engines need
    /// (the frontend: "Paged caches can only be used in combination with padding mask and variable
    /// sequence lengths for both Q and KV").
    fn check_page_tables(
        &self,
        q: TensorId,
        pools: [TensorId; 2],
        tables: [TensorId; 2],
        has_seq_lens: bool,
    ) -> Result<()> {
        let b = self.spec(q).dims.first().copied().unwrap_or(0);
        if !has_seq_lens {
            return Err(self.fail(tables[0], "page tables need the sequence lengths (seq_len_q, seq_len_kv)"));
        }
        for (t, pool) in tables.into_iter().zip(pools) {
            let s = self.spec(t);
            let ok = s.dtype == DataType::I32
                && s.dims.len() == 4
                && s.dims[0] == b
                && s.dims[1] == 1
                && s.dims[3] == 1
                && s.dims[2] > 0
                && !s.is_virtual
                && !s.by_value;
            if !ok {
                return Err(
                    self.fail(t, format!("a page table must be an i32 [{b}, 1, max_pages, 1] device tensor"))
                );
            }
            if self.spec(pool).dims.iter().any(|&d| d <= 0) || self.spec(pool).dims.len() != 4 {
                return Err(self.fail(pool, "a page pool is [num_pages, h_kv, page_size, d]"));
            }
        }
        Ok(())
    }

    /// Every dim of `small` equals the one of `full` or is 1 (ranks equal).
    fn check_broadcast(&self, small: TensorId, full: TensorId, what: &str) -> Result<()> {
        let (s, f) = (&self.spec(small).dims, &self.spec(full).dims);
        if s.len() != f.len() {
            return Err(
                self.fail(small, format!("{what}: rank {} differs from rank {} of {f:?}", s.len(), f.len()))
            );
        }
        if s.iter().zip(f).any(|(&a, &b)| a != b && a != 1 && b != 1) {
            return Err(self.fail(small, format!("{what}: dims {s:?} do not broadcast with {f:?}")));
        }
        Ok(())
    }

    /// Every output dim equals the input's, is 1 (reduced), or divides it (a sum over groups of
    /// consecutive entries: the query heads of one K/V head, in the attention backward).
    fn check_reduction(&self, x: TensorId, y: TensorId) -> Result<()> {
        let (xd, yd) = (&self.spec(x).dims, &self.spec(y).dims);
        if xd.len() != yd.len() {
            return Err(
                self.fail(y, format!("reduction: rank {} differs from input rank {}", yd.len(), xd.len()))
            );
        }
        if xd.iter().zip(yd).any(|(&a, &b)| b != 1 && (b > a || a % b != 0)) {
            return Err(self
                .fail(y, format!("reduction of {xd:?} to {yd:?}: each output dim must divide the input's")));
        }
        Ok(())
    }

    /// A view: the same rank, and dims that are a permutation of the input's (every element once).
    fn check_reshape(&self, x: TensorId, y: TensorId) -> Result<()> {
        let (mut xd, mut yd) = (self.spec(x).dims.clone(), self.spec(y).dims.clone());
        xd.sort_unstable();
        yd.sort_unstable();
        if xd != yd {
            return Err(self.fail(
                y,
                format!(
                    "reshape view dims {:?} are not a permutation of the input's {:?}",
                    self.spec(y).dims,
                    self.spec(x).dims
                ),
            ));
        }
        Ok(())
    }

    fn check_pointwise(
        &self,
        op: Pointwise,
        x: TensorId,
        b: Option<TensorId>,
        t: Option<TensorId>,
        y: TensorId,
    ) -> Result<()> {
        for id in [Some(x), b, t].into_iter().flatten() {
            self.check_broadcast(id, y, op.name())?;
        }
        let needs = match op {
            Pointwise::Unary(_) | Pointwise::GenIndex => (false, false),
            Pointwise::Binary(_) | Pointwise::Backward(_) => (true, false),
            Pointwise::Select => (true, true),
        };
        if needs != (b.is_some(), t.is_some()) {
            return Err(self.fail(y, format!("{} has the wrong number of inputs", op.name())));
        }
        if let (Pointwise::Select, Some(t)) = (op, t) {
            if self.spec(t).dtype != DataType::Bool {
                return Err(self.fail(t, "a select condition must be boolean"));
            }
        }
        if let Pointwise::Backward(u) = op {
            if !Pointwise::has_backward(u) {
                return Err(
                    self.fail(y, format!("{} has no cuDNN backward mode", Pointwise::Unary(u).name()))
                );
            }
        }
        if let Pointwise::Binary(op) = op {
            if op.is_boolean() && self.spec(y).dtype != DataType::Bool {
                return Err(self.fail(y, "a comparison gives booleans"));
            }
            if op == Binary::LogicalAnd {
                for id in [Some(x), b].into_iter().flatten() {
                    if self.spec(id).dtype != DataType::Bool {
                        return Err(self.fail(id, "a logical and takes booleans"));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_matmul(&self, a: TensorId, b: TensorId, c: TensorId) -> Result<()> {
        let (ad, bd, cd) = (&self.spec(a).dims, &self.spec(b).dims, &self.spec(c).dims);
        let r = ad.len();
        if r < 2 || bd.len() != r || cd.len() != r {
            return Err(self.fail(b, format!("matmul needs operands of one rank >= 2, got {ad:?} x {bd:?}")));
        }
        if ad[r - 1] != bd[r - 2] {
            return Err(self.fail(
                b,
                format!(
                    "inner dimensions differ: A {ad:?} has k = {}, B {bd:?} has k = {}",
                    ad[r - 1],
                    bd[r - 2]
                ),
            ));
        }
        for i in 0..r - 2 {
            // Batch dims broadcast, or divide (a K/V head serving a group of query heads).
            let (x, y, z) = (ad[i], bd[i], cd[i]);
            if z % x != 0 || z % y != 0 || x.max(y) != z {
                return Err(self.fail(b, format!("batch dims of A {ad:?} and B {bd:?} do not match")));
            }
        }
        if cd[r - 2] != ad[r - 2] || cd[r - 1] != bd[r - 1] {
            return Err(
                self.fail(c, format!("output dims {cd:?} are not [.., {}, {}]", ad[r - 2], bd[r - 1]))
            );
        }
        let (da, db) = (self.spec(a).dtype, self.spec(b).dtype);
        if da.is_fp8() || db.is_fp8() {
            // Hopper's FP8 tensor cores: both operands FP8, not both E5M2.
            if !(da.is_fp8() && db.is_fp8()) {
                return Err(self.fail(b, format!("an FP8 matmul takes two FP8 operands, not {da} x {db}")));
            }
            if da == DataType::F8E5M2 && db == DataType::F8E5M2 {
                return Err(self.fail(b, "an FP8 matmul of two E5M2 operands has no tensor-core form"));
            }
            return Ok(());
        }
        for id in [a, b] {
            if !FLOATS.contains(&self.spec(id).dtype) {
                return Err(
                    self.fail(id, format!("matmul operand dtype {} is not a float", self.spec(id).dtype))
                );
            }
        }
        Ok(())
    }

    /// Shapes of an attention: Q `[b, h_q, s_q, d]`, K `[b, h_k, s_kv, d]`, V `[b, h_k, s_kv, d_v]` (K
    /// or V as the `[b, h_k, d, s_kv]` transposed view where `transposed` says so: `[k, v]`), O
    /// `[b, h_q, s_q, d_v]`, stats `[b, h_q, s_q, 1]` f32; f16/bf16 with unit head-dim strides.
    pub(super) fn check_sdpa_tensors(
        &self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        o: TensorId,
        stats: Option<TensorId>,
        transposed: [bool; 2],
    ) -> Result<()> {
        self.check_sdpa_tensors_paged(q, k, v, o, stats, transposed, false)
    }

    /// [`Graph::check_sdpa_tensors`]; with `paged`, K and V are page pools `[num_pages, h_k, page_size,
    /// d]` whose first dim is not the batch.
    #[allow(clippy::too_many_arguments)]
    fn check_sdpa_tensors_paged(
        &self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        o: TensorId,
        stats: Option<TensorId>,
        transposed: [bool; 2],
        paged: bool,
    ) -> Result<()> {
        let [k_transposed, v_transposed] = transposed;
        for id in [q, k, v, o] {
            let s = self.spec(id);
            if s.dims.len() != 4 {
                return Err(self.fail(id, format!("attention tensors are [b, h, s, d], got {:?}", s.dims)));
            }
            if s.dtype != DataType::F16 && s.dtype != DataType::BF16 {
                return Err(self.fail(id, format!("attention I/O must be f16 or bf16, is {}", s.dtype)));
            }
            let swapped = (id == k && k_transposed) || (id == v && v_transposed);
            let unit = if swapped { s.strides[2] } else { s.strides[3] };
            if unit != 1 {
                return Err(
                    self.fail(id, format!("the head dim must have stride 1, strides are {:?}", s.strides))
                );
            }
        }
        let (qd, od) = (&self.spec(q).dims, &self.spec(o).dims);
        let (mut kd, mut vd) = (self.spec(k).dims.clone(), self.spec(v).dims.clone());
        if k_transposed {
            kd.swap(2, 3);
        }
        if v_transposed {
            vd.swap(2, 3);
        }
        if !paged && (kd[0] != qd[0] || vd[0] != qd[0]) {
            return Err(self.fail(k, format!("batch differs: Q {qd:?}, K {kd:?}, V {vd:?}")));
        }
        if kd[1] != vd[1] || qd[1] % kd[1] != 0 {
            return Err(self.fail(
                k,
                format!("query heads {} must be a multiple of the K/V heads ({}, {})", qd[1], kd[1], vd[1]),
            ));
        }
        if kd[2] != vd[2] {
            let what = if paged { "page sizes" } else { "sequence lengths" };
            return Err(self.fail(v, format!("K and V {what} differ: {} vs {}", kd[2], vd[2])));
        }
        if kd[3] != qd[3] {
            return Err(self.fail(k, format!("Q and K head dims differ: {} vs {}", qd[3], kd[3])));
        }
        if od[..] != [qd[0], qd[1], qd[2], vd[3]] {
            return Err(self.fail(
                o,
                format!("output dims {od:?}, expected [{}, {}, {}, {}]", qd[0], qd[1], qd[2], vd[3]),
            ));
        }
        if let Some(s) = stats {
            let sp = self.spec(s);
            if sp.dtype != DataType::F32 || sp.dims[..] != [qd[0], qd[1], qd[2], 1] {
                return Err(self.fail(s, format!("stats must be f32 [{}, {}, {}, 1]", qd[0], qd[1], qd[2])));
            }
        }
        Ok(())
    }

    /// An attention backward as a whole: the forward's tensors (K and V as their transposed views),
    /// the stats a device input, dO like O, and dQ, dK, dV with the dims of Q, K, V in the I/O dtype,
    /// unit head-dim strides.
    pub(super) fn check_sdpa_backward_tensors(
        &self,
        t: &super::attention::SdpaBackwardTensors,
    ) -> Result<()> {
        self.check_sdpa_tensors(t.q, t.k, t.v, t.o, Some(t.stats), [true, true])?;
        let stats = self.spec(t.stats);
        if stats.is_virtual || stats.by_value {
            return Err(self.fail(t.stats, "the forward's stats must be a device tensor"));
        }
        let io = self.spec(t.q).dtype;
        let untransposed = |id: TensorId| {
            let mut d = self.spec(id).dims.clone();
            d.swap(2, 3);
            d
        };
        let pairs = [
            (t.d_o, self.spec(t.o).dims.clone(), "O"),
            (t.dq, self.spec(t.q).dims.clone(), "Q"),
            (t.dk, untransposed(t.k), "K"),
            (t.dv, untransposed(t.v), "V"),
        ];
        for (id, dims, like) in pairs {
            let s = self.spec(id);
            if s.dims != dims {
                return Err(self.fail(id, format!("dims {:?} differ from {like}'s {dims:?}", s.dims)));
            }
            if s.dtype != io {
                return Err(self.fail(id, format!("dtype {} differs from the I/O dtype {io}", s.dtype)));
            }
            if s.strides.last() != Some(&1) {
                return Err(
                    self.fail(id, format!("the head dim must have stride 1, strides are {:?}", s.strides))
                );
            }
        }
        Ok(())
    }

    /// A norm forward: X, the scale and bias (`[1, hidden, ...]`) and Y float tensors, epsilon a
    /// by-value f32 scalar, each statistic f32 `[rows, 1, ...]`.
    fn check_norm(
        &self,
        x: TensorId,
        params: [Option<TensorId>; 2],
        eps: TensorId,
        y: TensorId,
        stats: [Option<TensorId>; 2],
    ) -> Result<()> {
        let (xs, es) = (self.spec(x), self.spec(eps));
        for id in [Some(x), Some(y)].into_iter().chain(params).flatten() {
            if !FLOATS.contains(&self.spec(id).dtype) {
                return Err(self.fail(id, format!("dtype {} is not f32, f16 or bf16", self.spec(id).dtype)));
            }
        }
        if xs.dims.len() < 2 {
            return Err(self.fail(x, format!("needs at least 2 dims, has {:?}", xs.dims)));
        }
        if xs.is_virtual || xs.by_value {
            return Err(self.fail(x, "must be a device tensor"));
        }
        let mut expected = xs.dims.clone();
        expected[0] = 1;
        for p in params.into_iter().flatten() {
            if self.spec(p).dims != expected {
                return Err(self.fail(
                    p,
                    format!(
                        "dims {:?} do not match X {:?}: expected {expected:?}",
                        self.spec(p).dims,
                        xs.dims
                    ),
                ));
            }
        }
        if !es.by_value || es.dtype != DataType::F32 || es.dims.iter().any(|&d| d != 1) {
            return Err(self.fail(eps, "epsilon must be a by-value f32 scalar (all dims 1)"));
        }
        if self.spec(y).dims != xs.dims {
            return Err(self.fail(y, format!("dims {:?} differ from X {:?}", self.spec(y).dims, xs.dims)));
        }
        for stat in stats.into_iter().flatten() {
            let s = self.spec(stat);
            if s.dtype != DataType::F32 || s.dims[0] != xs.dims[0] || s.dims[1..].iter().any(|&d| d != 1) {
                return Err(self.fail(
                    stat,
                    format!("must be f32 [{}, 1, ...], is {} {:?}", xs.dims[0], s.dtype, s.dims),
                ));
            }
        }
        Ok(())
    }

    /// The norm backward: dY and dX like X, scale and dscale `[1, hidden, ...]`, the saved inverse RMS
    /// f32 `[rows, 1, ...]`; X, dY, scale and the statistic are device tensors (cuDNN reads them from
    /// memory).
    fn check_rmsnorm_backward(
        &self,
        dy: TensorId,
        x: TensorId,
        scale: TensorId,
        inv: TensorId,
        dx: TensorId,
        dscale: TensorId,
    ) -> Result<()> {
        for id in [dy, x, scale, dx, dscale] {
            if !FLOATS.contains(&self.spec(id).dtype) {
                return Err(self.fail(id, format!("dtype {} is not f32, f16 or bf16", self.spec(id).dtype)));
            }
        }
        let xs = self.spec(x);
        if xs.dims.len() < 2 {
            return Err(self.fail(x, format!("needs at least 2 dims, has {:?}", xs.dims)));
        }
        for id in [dy, x, scale, inv] {
            let s = self.spec(id);
            if s.is_virtual || s.by_value {
                return Err(self.fail(id, "must be a device tensor"));
            }
        }
        for id in [dy, dx] {
            if self.spec(id).dims != xs.dims {
                return Err(
                    self.fail(id, format!("dims {:?} differ from X {:?}", self.spec(id).dims, xs.dims))
                );
            }
        }
        let mut expected = xs.dims.clone();
        expected[0] = 1;
        for id in [scale, dscale] {
            if self.spec(id).dims != expected {
                return Err(self.fail(
                    id,
                    format!(
                        "dims {:?} do not match X {:?}: expected {expected:?}",
                        self.spec(id).dims,
                        xs.dims
                    ),
                ));
            }
        }
        let s = self.spec(inv);
        if s.dtype != DataType::F32
            || s.dims.len() != xs.dims.len()
            || s.dims[0] != xs.dims[0]
            || s.dims[1..].iter().any(|&d| d != 1)
        {
            return Err(self.fail(
                inv,
                format!(
                    "the saved inverse RMS must be f32 [{}, 1, ...] (the training forward's), is {} {:?}",
                    xs.dims[0], s.dtype, s.dims
                ),
            ));
        }
        Ok(())
    }
}
