//! The fused half: the composite attention graph over THD tensors ([`RaggedArgs::graph`]), one plan
//! per [`RaggedKey`](super::RaggedKey), bound by the uids of [`uid`].

use super::{RaggedArgs, RaggedOperands};
use crate::dtype::{DataType, Element};
use crate::graph::{Graph, SdpaForm, SdpaOptions};
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Features, Result};
use std::rc::Rc;

/// The uids [`RaggedArgs::graph`] gives the tensors a call binds; O far above the intermediates.
pub(super) mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const SCALE: i64 = 4;
    pub const SEQ_LEN_Q: i64 = 5;
    pub const SEQ_LEN_KV: i64 = 6;
    pub const Q_OFFSETS: i64 = 7;
    pub const KV_OFFSETS: i64 = 8;
    pub const O_OFFSETS: i64 = 9;
    pub const O: i64 = 100;
}

impl RaggedArgs {
    /// The composite attention graph of a ragged batch: Q, K, V and O over logical
    /// `[batch, heads, bucket, head_dim]` dims with token-major strides (a token's heads side by side,
    /// tokens [`RaggedArgs::rows`] apart), each carrying ragged offsets (Q's, K and V's, O's, i32
    /// `[batch + 1, 1, 1, 1]`), the lengths as both `seq_len_q` and `seq_len_kv` (i32 `[batch, 1, 1,
    /// 1]`), the scale by value; inference (the stats stay virtual, with no offsets).
    pub fn graph(&self, dtype: DataType, features: Features) -> Graph {
        let a = self.normalized();
        let (b, s, d) = (a.batch as i64, a.bucket as i64, a.head_dim as i64);
        let mut g = Graph::new(format!(
            "sdpa_ragged b{} bucket{} hq{} hkv{} d{} {dtype} {}",
            a.batch,
            a.bucket,
            a.heads_q,
            a.heads_kv,
            a.head_dim,
            a.mask.name()
        ));
        // A padded sequence's extent as the batch stride: cuDNN replaces it by the offsets.
        let thd = |row: usize| [s * row as i64, d, row as i64, 1];
        let (hq, hkv) = (a.heads_q as i64, a.heads_kv as i64);
        let io = |name: &str, h: i64, row: usize, uid: i64, offsets: i64| {
            TensorSpec::new(name, &[b, h, s, d], dtype)
                .with_strides(&thd(row))
                .with_uid(uid)
                .with_ragged_offset(offsets)
        };
        let q = g.tensor(io("Q", hq, a.rows.q, uid::Q, uid::Q_OFFSETS));
        let k = g.tensor(io("K", hkv, a.rows.kv, uid::K, uid::KV_OFFSETS));
        let v = g.tensor(io("V", hkv, a.rows.kv, uid::V, uid::KV_OFFSETS));
        let scale = g.tensor(TensorSpec::scalar("scale", DataType::F32, 4).with_uid(uid::SCALE));
        let column = |name: &str, n: i64, uid: i64| {
            TensorSpec::new(name, &[n, 1, 1, 1], DataType::I32).with_strides(&[1, 1, 1, 1]).with_uid(uid)
        };
        let seq_q = g.tensor(column("seq_len_q", b, uid::SEQ_LEN_Q));
        let seq_kv = g.tensor(column("seq_len_kv", b, uid::SEQ_LEN_KV));
        g.tensor(column("q_offsets", b + 1, uid::Q_OFFSETS));
        g.tensor(column("kv_offsets", b + 1, uid::KV_OFFSETS));
        g.tensor(column("o_offsets", b + 1, uid::O_OFFSETS));
        let opts = SdpaOptions::new(a.mask, SdpaForm::Composite, features).with_seq_lens(seq_q, seq_kv);
        let out = g.sdpa(q, k, v, scale, opts);
        let o = g.output(out.o);
        (o.name, o.uid) = ("O".into(), uid::O);
        o.strides = thd(a.rows.o).to_vec();
        o.ragged_offset = Some(uid::O_OFFSETS);
        g
    }

    /// The cached plan, built on first use.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType) -> Result<Rc<Plan>> {
        ctx.cache().get_or_build(&self.key(dtype), || self.graph(dtype, ctx.features()).build(ctx))
    }
}

impl<T: Element> Fused<T> for RaggedArgs {
    fn fused(self, ctx: &Cudnn, x: RaggedOperands<'_, T>) -> Result<()> {
        let limit = ctx.features().max_sdpa_head_dim();
        super::super::fused::head_dim_within(ctx, "sdpa ragged", "fused attention", self.head_dim, limit)?;
        let plan = self.plan(ctx, T::DTYPE)?;
        let RaggedOperands { q, k, v, o, batch } = x;
        let [q_offsets, kv_offsets, o_offsets, lens] = batch.device();
        let mut b = Bindings::new(ctx.stream());
        b.input(uid::Q, q).input(uid::K, k).input(uid::V, v).scalar_f32(uid::SCALE, self.scale());
        b.input_i32(uid::SEQ_LEN_Q, &lens).input_i32(uid::SEQ_LEN_KV, &lens);
        b.input_i32(uid::Q_OFFSETS, &q_offsets).input_i32(uid::KV_OFFSETS, &kv_offsets);
        b.input_i32(uid::O_OFFSETS, &o_offsets);
        b.output(uid::O, o);
        plan.execute(ctx, &b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Mask;

    #[test]
    fn ragged_graphs_bind_offsets_and_lengths_by_named_uids() {
        let f = Features::for_version(91900, (9, 0));
        for mask in [Mask::CausalTopLeft, Mask::None] {
            let a = RaggedArgs::new(8, 2048, 32, 8, 128).with_mask(mask);
            let g = a.graph(DataType::BF16, f);
            g.validate().unwrap_or_else(|e| panic!("{mask:?}: {e}"));
            assert_eq!(g.form(), Some("composite"));
            let bound = g.bound();
            assert_eq!(
                bound,
                [
                    ("Q", uid::Q),
                    ("K", uid::K),
                    ("V", uid::V),
                    ("seq_len_q", uid::SEQ_LEN_Q),
                    ("seq_len_kv", uid::SEQ_LEN_KV),
                    ("q_offsets", uid::Q_OFFSETS),
                    ("kv_offsets", uid::KV_OFFSETS),
                    ("o_offsets", uid::O_OFFSETS),
                    ("O", uid::O)
                ]
            );
            let spec = |name: &str| g.tensors().iter().find(|t| t.name == name).unwrap().clone();
            // Q and O token-major over the query heads, with the Q/O offsets; K (its transposed view)
            // and V over the K/V heads with theirs.
            let (q, o, k, v) = (spec("Q"), spec("O"), spec("K"), spec("V"));
            assert_eq!(
                (q.dims.clone(), q.strides.clone()),
                (vec![8, 32, 2048, 128], vec![2048 * 4096, 128, 4096, 1])
            );
            assert_eq!(
                (o.strides, o.ragged_offset, o.dtype),
                (q.strides.clone(), Some(uid::O_OFFSETS), DataType::BF16)
            );
            assert_eq!((k.dims, k.strides), (vec![8, 8, 128, 2048], vec![2048 * 1024, 128, 1, 1024]));
            assert_eq!((k.ragged_offset, v.ragged_offset), (Some(uid::KV_OFFSETS), Some(uid::KV_OFFSETS)));
            let offsets = spec("kv_offsets");
            assert_eq!((offsets.dtype, offsets.dims), (DataType::I32, vec![9, 1, 1, 1]));
            // A ragged tensor's plan-level length bound is one token (its extent is on the device).
            assert_eq!(q.min_elements(), Some(32 * 128));
        }
        // Fused QKV rows: Q, K and V tokens a row apart, O packed; the K/V views share Q's offsets'
        // scale but keep their own uid.
        let rows = super::super::RowStrides::fused_qkv(32, 8, 128);
        let g = RaggedArgs::new(4, 1024, 32, 8, 128).with_rows(rows).graph(DataType::BF16, f);
        g.validate().unwrap();
        let spec = |name: &str| g.tensors().iter().find(|t| t.name == name).unwrap().clone();
        let w = 48 * 128;
        assert_eq!(spec("Q").strides, vec![1024 * w, 128, w, 1]);
        assert_eq!(spec("V").strides, vec![1024 * w, 128, w, 1]);
        assert_eq!(spec("K").strides, vec![1024 * w, 128, 1, w]);
        assert_eq!(spec("O").strides, vec![1024 * 4096, 128, 4096, 1]);
    }
}
