//! The fused half: one cuDNN attention graph per shape, strides, dtype, mask and mode, in the unified
//! or the composite form ([`SdpaForm`]), bound by the uids the graph gives its tensors by name
//! ([`uid`]); a decode the split-KV kernel takes runs that instead (`decode.rs`,
//! [`SdpaArgs::fused_kernel`]). Padded attention reads its device sequence lengths clamped
//! (`seq_lens.rs`). The backward is the composite graph of [`Graph::sdpa_backward`], bound by the uids
//! of [`bwd_uid`], with its two f32 buffers (row sums, dQ accumulator) in one op-owned buffer.

use super::seq_lens::{kv_offset, launch_clamp};
use super::{Backward, DeviceSeqLens, SdpaArgs, SdpaGrads, SdpaKernel, SdpaOperands};
use crate::dtype::{DataType, Element};
use crate::graph::{Graph, SdpaBackwardOptions, SdpaForm, SdpaOptions};
use crate::kernels::{Kernels, Owned};
use crate::ops::Fused;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Error, Features, Result};
use std::rc::Rc;

/// `kv_lens` and `q_lens` of padded attention clamped into the plan's sequence lengths, for this call's
/// plan (see [`crate::SdpaOperands::seq_lens`]).
const CLAMPED_LENS: Owned<i32> = Owned::new("padded attention clamped lengths");
/// The fused attention backward's f32 row sums and dQ accumulator, in one buffer.
const BACKWARD_BUFFERS: Owned<f32> = Owned::new("attention backward row sums and dQ accumulator");

/// The uids [`SdpaArgs::graph`] gives the tensors a call binds. O and stats are node outputs created
/// after the graph's intermediates (numbered from 5, 7 with sequence lengths, 9 with page tables),
/// hence far above them.
mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const SCALE: i64 = 4;
    pub const SEQ_LEN_Q: i64 = 5;
    pub const SEQ_LEN_KV: i64 = 6;
    pub const PAGE_TABLE_K: i64 = 7;
    pub const PAGE_TABLE_V: i64 = 8;
    pub const O: i64 = 100;
    pub const STATS: i64 = 101;
}

/// The uids [`SdpaArgs::backward_graph`] gives the tensors a backward call binds: inputs first, the
/// gradients and the op-owned buffers far above the graph's intermediates.
mod bwd_uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const D_O: i64 = 5;
    pub const STATS: i64 = 6;
    pub const SCALE: i64 = 7;
    pub const DQ: i64 = 200;
    pub const DK: i64 = 201;
    pub const DV: i64 = 202;
    pub const SOFTMAX_SUM: i64 = 203;
    pub const DQ_ACCUM: i64 = 204;
}

impl SdpaArgs {
    /// The cuDNN graph in `form`: Q, K, V, the scale by value, with padded lengths the i32 `[b, 1, 1, 1]`
    /// seq_len_q and seq_len_kv, then O and, in training mode, stats (f32 `[b, h_q, s_q, 1]` packed); each
    /// bound tensor carries its named uid.
    pub fn graph(&self, dtype: DataType, stats: bool, form: SdpaForm, features: Features) -> Graph {
        let i = |v: [usize; 4]| v.map(|x| x as i64);
        let paged = self
            .pages
            .map_or(String::new(), |p| format!(" paged {}x{} {}", p.num_pages, p.page_size, p.order.name()));
        let mut g = Graph::new(format!(
            "sdpa b{} hq{} hkv{} sq{} skv{} d{} {dtype} {} {}{paged}",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_kv,
            self.head_dim,
            self.mask.name(),
            if stats { "training" } else { "inference" }
        ));
        let io = |name: &str, t: char, strides: [usize; 4], uid: i64| {
            TensorSpec::new(name, &i(self.dims(t)), dtype).with_strides(&i(strides)).with_uid(uid)
        };
        let q = g.tensor(io("Q", 'q', self.q_strides, uid::Q));
        let k = g.tensor(io("K", 'k', self.k_strides, uid::K));
        let v = g.tensor(io("V", 'v', self.v_strides, uid::V));
        let scale = g.tensor(TensorSpec::scalar("scale", DataType::F32, 4).with_uid(uid::SCALE));
        let seq_lens = self.padded.then(|| {
            let b = self.batch as i64;
            let lens = |name: &str, uid: i64| {
                TensorSpec::new(name, &[b, 1, 1, 1], DataType::I32).with_strides(&[1, 1, 1, 1]).with_uid(uid)
            };
            (g.tensor(lens("seq_len_q", uid::SEQ_LEN_Q)), g.tensor(lens("seq_len_kv", uid::SEQ_LEN_KV)))
        });
        let page_tables = self.pages.map(|p| {
            let (b, n) = (self.batch as i64, (self.seq_kv / p.page_size) as i64);
            let table = |name: &str, uid: i64| {
                TensorSpec::new(name, &[b, 1, n, 1], DataType::I32).with_strides(&[n, n, 1, 1]).with_uid(uid)
            };
            (
                g.tensor(table("page_table_k", uid::PAGE_TABLE_K)),
                g.tensor(table("page_table_v", uid::PAGE_TABLE_V)),
            )
        });
        let opts = SdpaOptions { mask: self.mask, stats, form, features, seq_lens, page_tables };
        let out = g.sdpa(q, k, v, scale, opts);
        let o = g.output(out.o);
        (o.name, o.uid) = ("O".into(), uid::O);
        o.strides = i(self.o_strides).to_vec();
        if let Some(s) = out.stats {
            let s = g.output(s);
            (s.name, s.uid) = ("stats".into(), uid::STATS);
        }
        g
    }

    /// What the fused backend runs for these arguments (training mode when `stats`): the form asked
    /// for ([`SdpaArgs::with_form`]), else the split-KV kernel where it takes the call (one query per
    /// sequence, unmasked once [`SdpaArgs::normalized`], inference, a head dim and strides it reads)
    /// and cuDNN's one-plan padded graph does not (host lengths, or device lengths before cuDNN 9.15),
    /// else the graph form [`SdpaForm::select`] picks for `features` (a unified graph the running cuDNN
    /// rejects is rebuilt as the composite graph; [`Plan::form`] says which one runs).
    pub fn fused_kernel(&self, features: Features, stats: bool) -> SdpaKernel {
        let a = self.normalized();
        match a.form {
            Some(kernel) => kernel,
            // Paged K/V: cuDNN's paged graph where the version has it (the padded graph's speed is
            // what to expect), else the split-KV kernel reading through the table.
            None if a.pages.is_some() => {
                if !features.sdpa_paged() && a.split_kv_refusal(stats).is_none() {
                    SdpaKernel::SplitKv
                } else {
                    SdpaKernel::Graph(SdpaForm::Unified)
                }
            }
            // Measured (H200, cuDNN 9.19, `examples/06-decode-attention`): the split-KV kernel's
            // tensor-core form beats cuDNN's one-plan padded graph at 545 keys replayed (7.1 vs
            // 8.4 us) but not at 4096 (10.7 vs 9.1), nor in the whole 8B step or at batch 64; so the
            // kernel runs by itself only where that graph is not there: host lengths (a graph would
            // be a plan per length) or cuDNN < 9.15.
            None if a.split_kv_refusal(stats).is_none() && !(a.padded && features.sdpa_seq_lens()) => {
                SdpaKernel::SplitKv
            }
            None => SdpaKernel::Graph(a.auto_form(features)),
        }
    }

    /// The graph form an automatic choice builds: [`SdpaForm::select`]'s, except that run-time lengths
    /// on a cuDNN whose unified operation lacks them (before 9.15) take the composite graph and its
    /// padding mask (paged K/V has no composite form here).
    pub(super) fn auto_form(&self, features: Features) -> SdpaForm {
        let form = SdpaForm::select(features, self.mask);
        if form == SdpaForm::Unified && self.padded && self.pages.is_none() && !features.sdpa_seq_lens() {
            SdpaForm::Composite
        } else {
            form
        }
    }

    /// The cached plan (for the [`SdpaArgs::normalized`] attention), built on first use. With an
    /// automatic form, a unified graph the running cuDNN rejects is rebuilt as the composite graph;
    /// [`Plan::form`] says which one runs. Arguments that ask for the split-KV kernel have no plan
    /// ([`Error::InvalidArgument`]); a decode with an automatic form has one (the graph that would run
    /// without the split-KV kernel), which the fused call does not use.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType, stats: bool) -> Result<Rc<Plan>> {
        let a = self.normalized();
        let asked = match a.form {
            Some(SdpaKernel::SplitKv) => {
                return Err(Error::invalid("sdpa: the split-KV kernel runs no cuDNN plan"));
            }
            Some(SdpaKernel::Graph(form)) => Some(form),
            None => None,
        };
        let (version, features) = (ctx.info().cudnn_version, ctx.features());
        if a.pages.is_some() && !features.sdpa_paged() {
            return Err(Error::NotSupported {
                op: "sdpa".into(),
                reason: format!(
                    "paged K/V (the unified operation's CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_KDESC and \
                     _VDESC) needs cuDNN 9.15 (library and headers), this is {} with {} headers",
                    crate::version_string(version),
                    crate::version_string(crate::HEADER_VERSION)
                ),
            });
        }
        let form = asked.unwrap_or_else(|| a.auto_form(features));
        if a.padded && form == SdpaForm::Unified && !features.sdpa_seq_lens() {
            return Err(Error::NotSupported {
                op: "sdpa".into(),
                reason: format!(
                    "run-time sequence lengths on the unified SDPA operation need cuDNN 9.15, this is {} \
                     (the composite form takes them on any cuDNN 9)",
                    crate::version_string(version)
                ),
            });
        }
        ctx.cache().get_or_build(&a.key(dtype, stats), || {
            match a.graph(dtype, stats, form, features).build(ctx) {
                Err(e)
                    if e.is_not_supported()
                        && asked.is_none()
                        && form == SdpaForm::Unified
                        && a.pages.is_none() =>
                {
                    a.graph(dtype, stats, SdpaForm::Composite, features).build(ctx)
                }
                other => other,
            }
        })
    }
}

/// `NotSupported` for `op` where `head_dim` exceeds `limit`, the largest head dim `what` takes on this
/// GPU and cuDNN.
pub(super) fn head_dim_within(
    ctx: &Cudnn,
    op: &str,
    what: &str,
    head_dim: usize,
    limit: usize,
) -> Result<()> {
    if head_dim <= limit {
        return Ok(());
    }
    let info = ctx.info();
    let (major, minor) = info.compute_capability;
    Err(Error::NotSupported {
        op: op.into(),
        reason: format!(
            "head_dim {head_dim} exceeds {limit}, the largest {what} takes on sm_{major}{minor} with cuDNN {}",
            info.cudnn_version_string()
        ),
    })
}

impl<T: Element> Fused<T> for SdpaArgs {
    fn fused(self, ctx: &Cudnn, x: SdpaOperands<'_, T>) -> Result<()> {
        if self.fused_kernel(ctx.features(), x.stats.is_some()) == SdpaKernel::SplitKv {
            return super::decode::split_kv(ctx, self, x);
        }
        head_dim_within(ctx, "sdpa", "fused attention", self.head_dim, ctx.features().max_sdpa_head_dim())?;
        let plan = self.plan(ctx, T::DTYPE, x.stats.is_some())?;
        let SdpaOperands { q, k, v, o, stats, seq_lens, pages } = x;
        let batch = self.batch;
        let owned; // the context's buffer, for lengths clamped by this call
        let lens = match seq_lens {
            Some(DeviceSeqLens::Raw(seq_len_q, seq_len_kv)) => {
                let kernels = Kernels::get(ctx)?;
                owned = kernels.owned(ctx, CLAMPED_LENS, 2 * kv_offset(batch))?;
                launch_clamp(
                    ctx,
                    kernels,
                    (seq_len_q, seq_len_kv),
                    (self.seq_q, self.seq_kv),
                    &owned,
                    batch,
                )?;
                let kv_at = kv_offset(batch);
                Some((owned.slice(0..batch), owned.slice(kv_at..kv_at + batch)))
            }
            Some(DeviceSeqLens::Clamped(l)) => Some(l.halves(batch)),
            None => None,
        };
        let table = pages.map(|t| t.rows(0, batch));
        let mut b = Bindings::new(ctx.stream());
        b.input(uid::Q, q).input(uid::K, k).input(uid::V, v).scalar_f32(uid::SCALE, self.scale());
        if let Some((lens_q, lens_kv)) = &lens {
            b.input_i32(uid::SEQ_LEN_Q, lens_q).input_i32(uid::SEQ_LEN_KV, lens_kv);
        }
        if let Some(t) = &table {
            b.input_i32(uid::PAGE_TABLE_K, t).input_i32(uid::PAGE_TABLE_V, t);
        }
        b.output(uid::O, o);
        if let Some(s) = stats {
            b.output(uid::STATS, s);
        }
        plan.execute(ctx, &b)
    }
}

impl SdpaArgs {
    /// The attention backward's composite graph: Q, K, V, O, dO in the I/O dtype with their strides,
    /// the forward's stats (f32 `[b, h_q, s_q, 1]` packed), the scale by value; dQ, dK, dV with the
    /// strides of Q, K, V; the f32 row sums and dQ accumulator the op binds. Each bound tensor
    /// carries its named uid (`bwd_uid`).
    pub fn backward_graph(&self, dtype: DataType, features: Features) -> Graph {
        let i = |v: [usize; 4]| v.map(|x| x as i64);
        let mut g = Graph::new(format!(
            "sdpa_backward b{} hq{} hkv{} sq{} skv{} d{} {dtype} {}",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_kv,
            self.head_dim,
            self.mask.name(),
        ));
        let io = |name: &str, t: char, strides: [usize; 4], uid: i64| {
            TensorSpec::new(name, &i(self.dims(t)), dtype).with_strides(&i(strides)).with_uid(uid)
        };
        let q = g.tensor(io("Q", 'q', self.q_strides, bwd_uid::Q));
        let k = g.tensor(io("K", 'k', self.k_strides, bwd_uid::K));
        let v = g.tensor(io("V", 'v', self.v_strides, bwd_uid::V));
        let o = g.tensor(io("O", 'o', self.o_strides, bwd_uid::O));
        let d_o = g.tensor(io("dO", 'o', self.o_strides, bwd_uid::D_O));
        let (b, h, s) = (self.batch as i64, self.heads_q as i64, self.seq_q as i64);
        let stats = g.tensor(
            TensorSpec::new("stats", &[b, h, s, 1], DataType::F32)
                .with_strides(&[h * s, s, 1, 1])
                .with_uid(bwd_uid::STATS),
        );
        let scale = g.tensor(TensorSpec::scalar("scale", DataType::F32, 4).with_uid(bwd_uid::SCALE));
        let out =
            g.sdpa_backward(q, k, v, o, d_o, stats, scale, SdpaBackwardOptions { mask: self.mask, features });
        for (t, name, uid, strides) in [
            (out.dq, "dQ", bwd_uid::DQ, self.q_strides),
            (out.dk, "dK", bwd_uid::DK, self.k_strides),
            (out.dv, "dV", bwd_uid::DV, self.v_strides),
        ] {
            let spec = g.output(t);
            (spec.name, spec.uid, spec.strides) = (name.into(), uid, i(strides).to_vec());
        }
        for (t, name, uid) in [
            (out.softmax_sum, "softmax_sum", bwd_uid::SOFTMAX_SUM),
            (out.dq_accum, "dq_accum", bwd_uid::DQ_ACCUM),
        ] {
            let spec = g.output(t);
            (spec.name, spec.uid) = (name.into(), uid);
        }
        g
    }

    /// The cached backward plan (for the [`SdpaArgs::normalized`] attention), built on first use.
    pub fn backward_plan(&self, ctx: &Cudnn, dtype: DataType) -> Result<Rc<Plan>> {
        let a = self.normalized();
        ctx.cache()
            .get_or_build(&a.backward_key(dtype), || a.backward_graph(dtype, ctx.features()).build(ctx))
    }

    /// Elements of the op-owned f32 buffer of a backward: the row sums (`b · h_q · s_q`) from 0, the
    /// dQ accumulator (`b · h_q · s_q · d`) from the returned offset (16-byte aligned), and the total.
    fn backward_buffers(&self) -> Result<(usize, usize, usize)> {
        use crate::checked::{add, product};
        let what = "sdpa backward: row sums and dQ accumulator";
        let rows = product(what, &[self.batch, self.heads_q, self.seq_q])?;
        let accum_at = rows.next_multiple_of(4);
        let accum = product(what, &[rows, self.head_dim])?;
        Ok((rows, accum_at, add(what, accum_at, accum)?))
    }
}

impl<T: Element> Fused<T> for Backward {
    fn fused(self, ctx: &Cudnn, x: SdpaGrads<'_, T>) -> Result<()> {
        let a = self.0;
        let info = ctx.info();
        let limit = ctx.features().max_sdpa_backward_head_dim();
        head_dim_within(ctx, "sdpa backward", "fused attention backward", a.head_dim, limit)?;
        if a.seq_q == 1 && a.seq_kv == 1 {
            return Err(Error::NotSupported {
                op: "sdpa backward".into(),
                reason: "s_q = s_kv = 1 (the frontend refuses it for the fused backward)".into(),
            });
        }
        if !a.seq_kv.is_multiple_of(128) && !ctx.features().sdpa_backward_any_seq_kv() {
            return Err(Error::NotSupported {
                op: "sdpa backward".into(),
                reason: format!(
                    "seq_kv {} is not a multiple of 128: cuDNN {} needs the frontend's padding-mask workaround \
                     there (fixed in 9.15.1), which is not built",
                    a.seq_kv,
                    info.cudnn_version_string()
                ),
            });
        }
        let plan = a.backward_plan(ctx, T::DTYPE)?;
        let (rows, accum_at, total) = a.backward_buffers()?;
        let mut buffer = Kernels::get(ctx)?.owned(ctx, BACKWARD_BUFFERS, total)?;
        let (mut softmax_sum, mut rest) = buffer.split_at_mut(accum_at);
        let mut softmax_sum = softmax_sum.slice_mut(..rows);
        let mut dq_accum = rest.slice_mut(..total - accum_at);
        if ctx.features().sdpa_backward_zeroes_dq_accum() {
            ctx.stream().memset_zeros(&mut dq_accum)?;
        }
        let SdpaGrads { q, k, v, o, stats, d_o, dq, dk, dv } = x;
        let stats =
            stats.ok_or_else(|| Error::invalid("sdpa backward: the forward's training stats are missing"))?;
        let mut b = Bindings::new(ctx.stream());
        b.input(bwd_uid::Q, q).input(bwd_uid::K, k).input(bwd_uid::V, v).input(bwd_uid::O, o);
        b.input(bwd_uid::D_O, d_o).input(bwd_uid::STATS, stats).scalar_f32(bwd_uid::SCALE, a.scale());
        b.output(bwd_uid::DQ, dq).output(bwd_uid::DK, dk).output(bwd_uid::DV, dv);
        b.output(bwd_uid::SOFTMAX_SUM, &mut softmax_sum).output(bwd_uid::DQ_ACCUM, &mut dq_accum);
        plan.execute(ctx, &b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Mask;
    use crate::ops::sdpa::Layout;

    #[test]
    fn padded_graphs_bind_sequence_lengths_in_both_forms() {
        let lens_uids = [("seq_len_q", uid::SEQ_LEN_Q), ("seq_len_kv", uid::SEQ_LEN_KV)];
        let a = SdpaArgs::new(2, 8, 2, 1, 256, 64, Layout::Bshd).with_seq_lens();
        assert_ne!(a.key(DataType::BF16, false), SdpaArgs { padded: false, ..a }.key(DataType::BF16, false));
        let g = a.graph(DataType::BF16, false, SdpaForm::Unified, Features::for_version(91900, (9, 0)));
        g.validate().unwrap();
        assert_eq!(&g.bound()[3..5], &lens_uids);
        let lens = g.tensors().iter().find(|t| t.name == "seq_len_kv").unwrap();
        assert_eq!((lens.dtype, lens.dims.clone()), (DataType::I32, vec![2, 1, 1, 1]));
        // The composite graph binds the same lengths (its padding mask and matmul overrides read
        // them); a causal mask cannot go on the unified node, so a padded causal chunk is composite.
        let f = Features::for_version(91900, (9, 0));
        let c = a.graph(DataType::BF16, false, SdpaForm::Composite, f);
        c.validate().unwrap();
        assert_eq!(&c.bound()[3..5], &lens_uids);
        let chunk = SdpaArgs { seq_q: 4, ..a }.with_mask(Mask::CausalBottomRight);
        assert!(chunk
            .graph(DataType::BF16, false, SdpaForm::Unified, f)
            .validate()
            .unwrap_err()
            .is_not_supported());
        chunk.graph(DataType::BF16, false, SdpaForm::Composite, f).validate().unwrap();
        assert_eq!(chunk.fused_kernel(f, false), SdpaKernel::Graph(SdpaForm::Composite));
        // Before 9.15 (no lengths on the unified operation) an unmasked padded prefill is composite.
        let prefill = SdpaArgs { seq_q: 256, ..a };
        assert_eq!(prefill.fused_kernel(f, false), SdpaKernel::Graph(SdpaForm::Unified));
        let old = Features::for_version(91400, (9, 0));
        assert_eq!(prefill.fused_kernel(old, false), SdpaKernel::Graph(SdpaForm::Composite));
    }

    /// A paged decode at Llama-3.1-8B heads: Q a view into fused QKV rows, a pool of 64 pages of 16.
    fn paged(order: crate::PageOrder) -> (SdpaArgs, crate::TableShape) {
        let (hq, hkv, d) = (32, 8, 128);
        let pages = crate::PageShape::new(64, 16, hkv, d, order).unwrap();
        let table = crate::TableShape::new(4, 8, pages).unwrap();
        let w = (hq + 2 * hkv) * d;
        let mut a = SdpaArgs::new(3, hq, hkv, 1, 1, d, Layout::Bshd).with_pages(table);
        a.q_strides = [w, d, w, 1];
        (a, table)
    }

    #[test]
    fn paged_graphs_bind_page_tables_on_the_unified_form_only() {
        let f = Features::for_version(91900, (9, 0));
        for order in [crate::PageOrder::HeadMajor, crate::PageOrder::TokenMajor] {
            let (a, table) = paged(order);
            assert_eq!((a.seq_kv, a.padded, a.k_strides), (128, true, table.pages.strides()));
            let g = a.graph(DataType::BF16, false, SdpaForm::Unified, f);
            g.validate().unwrap_or_else(|e| panic!("{order:?}: {e}"));
            let bound = g.bound();
            assert_eq!(
                &bound[3..7],
                &[
                    ("seq_len_q", uid::SEQ_LEN_Q),
                    ("seq_len_kv", uid::SEQ_LEN_KV),
                    ("page_table_k", uid::PAGE_TABLE_K),
                    ("page_table_v", uid::PAGE_TABLE_V)
                ]
            );
            let spec = |name: &str| g.tensors().iter().find(|t| t.name == name).unwrap().clone();
            let pt = spec("page_table_v");
            assert_eq!((pt.dtype, pt.dims, pt.strides), (DataType::I32, vec![3, 1, 8, 1], vec![8, 8, 1, 1]));
            // K and V are the pools: [num_pages, h_kv, page_size, d] over the order's strides.
            let k = spec("K");
            let strides: Vec<i64> = table.pages.strides().iter().map(|&x| x as i64).collect();
            assert_eq!((k.dims, k.strides), (vec![64, 8, 16, 128], strides));
            assert!(g.name().contains("paged 64x16"), "{}", g.name());
            // The composite form's paged cache loads are not built: refused by name.
            let e = a.graph(DataType::BF16, false, SdpaForm::Composite, f).validate().unwrap_err();
            assert!(e.is_not_supported(), "{e}");
        }
        // The plan key follows the pool's shape (order included).
        let (h, _) = paged(crate::PageOrder::HeadMajor);
        let (t, _) = paged(crate::PageOrder::TokenMajor);
        assert_ne!(h.key(DataType::BF16, false), t.key(DataType::BF16, false));
        let plain = SdpaArgs { pages: None, k_strides: [128 * 1024, 128, 1024, 1], ..h };
        assert_ne!(h.key(DataType::BF16, false), plain.key(DataType::BF16, false));
    }

    #[test]
    fn paged_decodes_take_cudnn_from_9_15_and_the_split_kv_kernel_before() {
        let (a, _) = paged(crate::PageOrder::HeadMajor);
        let at = |v| a.fused_kernel(Features::for_version(v, (9, 0)), false);
        assert_eq!(at(91900), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(at(91500), SdpaKernel::Graph(SdpaForm::Unified));
        assert_eq!(at(91400), SdpaKernel::SplitKv);
        // A head dim the kernel does not take: the graph, whose plan names the version it needs.
        let wide = SdpaArgs { head_dim: 96, ..a };
        assert_eq!(
            wide.fused_kernel(Features::for_version(91400, (9, 0)), false),
            SdpaKernel::Graph(SdpaForm::Unified)
        );
        // A form asked for wins (benches compare the two).
        let forced = a.with_form(SdpaKernel::SplitKv);
        assert_eq!(forced.fused_kernel(Features::for_version(91900, (9, 0)), false), SdpaKernel::SplitKv);
    }

    #[test]
    fn graphs_validate_in_both_forms() {
        for (mask, stats) in
            [(Mask::None, false), (Mask::CausalTopLeft, true), (Mask::CausalBottomRight, false)]
        {
            let a = SdpaArgs::new(1, 32, 8, 64, 128, 128, Layout::Bshd).with_mask(mask);
            let g = a.graph(DataType::BF16, stats, SdpaForm::Composite, Features::for_version(91900, (9, 0)));
            g.validate().unwrap();
            assert_eq!(g.form(), Some("composite"));
            let mut bound: Vec<&str> = g.bound().into_iter().map(|(name, _)| name).collect();
            let mut expected = vec!["Q", "K", "V", "O"];
            if stats {
                expected.push("stats");
            }
            bound.sort_unstable();
            expected.sort_unstable();
            assert_eq!(bound, expected);
            // K is the transposed view over the same memory: dims and strides swapped.
            let k = &g.tensors()[1];
            assert_eq!(
                (k.dims.clone(), k.strides.clone()),
                (vec![1, 8, 128, 128], vec![128 * 8 * 128, 128, 1, 8 * 128])
            );
            let o = g.tensors().iter().find(|t| t.name == "O").unwrap();
            assert_eq!(o.strides, vec![64 * 32 * 128, 128, 32 * 128, 1]);
            assert_eq!(o.dtype, DataType::BF16);
        }
        let u = SdpaArgs::new(1, 32, 8, 64, 64, 64, Layout::Bhsd).graph(
            DataType::F16,
            true,
            SdpaForm::Unified,
            Features::for_version(91900, (9, 0)),
        );
        u.validate().unwrap();
        assert_eq!(u.form(), Some("unified"));
        // A mask cannot go on the unified node with these bindings.
        let masked = SdpaArgs::new(1, 4, 4, 8, 8, 64, Layout::Bhsd).with_mask(Mask::CausalTopLeft);
        let e = masked
            .graph(DataType::F16, false, SdpaForm::Unified, Features::for_version(92100, (9, 0)))
            .validate()
            .unwrap_err();
        assert!(e.is_not_supported() && e.to_string().contains("9.21"), "{e}");
    }

    #[test]
    fn backward_graphs_bind_every_tensor_by_its_named_uid() {
        let features = Features::for_version(91900, (9, 0));
        for layout in [Layout::Bshd, Layout::Bhsd] {
            for mask in [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight] {
                for (hq, hkv) in [(8, 8), (8, 2), (8, 1)] {
                    for dtype in [DataType::BF16, DataType::F16] {
                        let a = SdpaArgs::new(2, hq, hkv, 48, 64, 64, layout).with_mask(mask);
                        let g = a.backward_graph(dtype, features);
                        let tag = format!("{} {mask:?} {hq}/{hkv} {dtype}", layout.name());
                        g.validate().unwrap_or_else(|e| panic!("{tag}: {e}"));
                        assert_eq!(g.form(), Some("composite"));
                        let bound = g.bound();
                        let expected = [
                            ("Q", bwd_uid::Q),
                            ("K", bwd_uid::K),
                            ("V", bwd_uid::V),
                            ("O", bwd_uid::O),
                            ("dO", bwd_uid::D_O),
                            ("stats", bwd_uid::STATS),
                        ];
                        assert_eq!(&bound[..6], &expected, "{tag}");
                        let mut rest = bound[6..].to_vec();
                        rest.sort_unstable();
                        let mut outputs = vec![
                            ("dK", bwd_uid::DK),
                            ("dQ", bwd_uid::DQ),
                            ("dV", bwd_uid::DV),
                            ("dq_accum", bwd_uid::DQ_ACCUM),
                            ("softmax_sum", bwd_uid::SOFTMAX_SUM),
                        ];
                        outputs.sort_unstable();
                        assert_eq!(rest, outputs, "{tag}");
                        // Gradients take the strides of what they differentiate, in the I/O dtype.
                        let spec = |name: &str| g.tensors().iter().find(|t| t.name == name).unwrap().clone();
                        let i = |v: [usize; 4]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
                        for (name, strides) in [
                            ("dQ", a.q_strides),
                            ("dK", a.k_strides),
                            ("dV", a.v_strides),
                            ("dO", a.o_strides),
                        ] {
                            assert_eq!(
                                (spec(name).strides, spec(name).dtype),
                                (i(strides), dtype),
                                "{tag} {name}"
                            );
                        }
                        // The op-owned buffers are as large as backward_buffers says.
                        let (rows, accum_at, total) = a.backward_buffers().unwrap();
                        assert_eq!(spec("softmax_sum").min_elements(), Some(rows));
                        assert_eq!(spec("dq_accum").min_elements(), Some(total - accum_at));
                        assert_eq!(accum_at % 4, 0, "the accumulator starts 16-byte aligned");
                    }
                }
            }
        }
    }

    #[test]
    fn backward_keys_differ_from_forward_keys_and_follow_the_shape() {
        use std::collections::HashSet;
        let a = SdpaArgs::new(2, 8, 2, 16, 16, 64, Layout::Bshd).with_mask(Mask::CausalTopLeft);
        let k = a.backward_key(DataType::BF16);
        // The scale and the forward's form are not part of the backward plan.
        assert_eq!(k, a.with_scale(0.5).with_form(SdpaForm::Composite).backward_key(DataType::BF16));
        let variants = [
            k,
            a.backward_key(DataType::F16),
            a.with_mask(Mask::None).backward_key(DataType::BF16),
            a.with_mask(Mask::CausalBottomRight).backward_key(DataType::BF16),
            SdpaArgs { heads_kv: 8, ..a }.backward_key(DataType::BF16),
            SdpaArgs { seq_kv: 32, ..a }.backward_key(DataType::BF16),
            SdpaArgs { v_strides: Layout::Bhsd.strides(2, 16, 64), ..a }.backward_key(DataType::BF16),
        ];
        assert_eq!(variants.iter().collect::<HashSet<_>>().len(), variants.len());
    }
}
