//! The naive half: Hugging Face's `apply_rotary_pos_emb` as eager runs it (`naive.cu`), five kernels
//! for Q and five for K in the I/O dtype, temporaries in the scratch.

use super::{suffix, KvAppend, RopeArgs, RopeOperands};
use crate::dtype::Element;
use crate::kernels::{elementwise, optional_ptr, scratch, Arg, Kernels};
use crate::ops::rows::CacheRows;
use crate::ops::Naive;
use crate::{Cudnn, Error, Result};
use cudarc::driver::DevicePtr;

impl<T: Element> Naive<T> for RopeArgs {
    fn naive(self, ctx: &Cudnn, x: RopeOperands<'_, T>) -> Result<()> {
        if x.starts.is_some() || x.tokens.is_some() {
            return Err(Error::NotSupported {
                op: "rope".into(),
                reason:
                    "positions read on the device are fused only (the eager kernels take the start position)"
                        .into(),
            });
        }
        let sfx = suffix(T::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let RopeArgs { batch, seq, heads_q, heads_kv, head_dim: d, row_stride, start } = self;
        let RopeOperands { tables, qkv, append, .. } = x;
        let rows = batch * seq;
        let (x, _gx) = qkv.device_ptr_mut(ctx.stream());
        let i = |v: usize| Arg::I64(v as i64);
        let (c, _gc) = tables.cos_full.device_ptr(ctx.stream());
        let (s, _gs) = tables.sin_full.device_ptr(ctx.stream());
        let elem = T::DTYPE.size() as u64;
        // t1, t3, t4 hold rows · heads · d elements, t2 half of that, all in the I/O dtype (sized for
        // the wider of the Q and K passes).
        let n = rows * heads_q.max(heads_kv) * d;
        let base = scratch(ctx, kernels, (n * 7 / 2 * T::DTYPE.size()).div_ceil(4))?;
        let (t1, t2, t3, t4) = (
            base,
            base + elem * n as u64,
            base + elem * (3 * n / 2) as u64,
            base + elem * (5 * n / 2) as u64,
        );
        for (offset, heads) in [(0, heads_q), (heads_q * d, heads_kv)] {
            let xh = x + elem * offset as u64;
            let n = rows * heads * d;
            let k = |name: &str| format!("rope_{name}_{sfx}");
            elementwise(
                ctx,
                kernels,
                &k("mul_cos"),
                n,
                &[Arg::Ptr(xh), i(row_stride), i(seq), i(heads), i(d), i(start), Arg::Ptr(c), Arg::Ptr(t1)],
            )?;
            elementwise(
                ctx,
                kernels,
                &k("neg_half"),
                n / 2,
                &[Arg::Ptr(xh), i(row_stride), i(heads), i(d), Arg::Ptr(t2)],
            )?;
            elementwise(
                ctx,
                kernels,
                &k("cat"),
                n,
                &[Arg::Ptr(t2), Arg::Ptr(xh), i(row_stride), i(heads), i(d), Arg::Ptr(t3)],
            )?;
            elementwise(
                ctx,
                kernels,
                &k("mul_sin"),
                n,
                &[Arg::Ptr(t3), i(seq), i(heads), i(d), i(start), Arg::Ptr(s), Arg::Ptr(t4)],
            )?;
            elementwise(
                ctx,
                kernels,
                &k("add"),
                n,
                &[Arg::Ptr(t1), Arg::Ptr(t4), i(row_stride), i(heads), i(d), Arg::Ptr(xh)],
            )?;
        }
        // The K/V append: one row copy per cache, as `StaticCache.update`'s `index_copy_` (the rows
        // room's kernel; the shapes were checked by `CacheWrite::check`).
        if let Some(KvAppend { k, v, rows: target }) = append {
            let cols = heads_kv * d;
            let table = match target {
                CacheRows::Paged { table, first } => Some(table.rows(first, batch)),
                CacheRows::Contiguous { .. } => None,
            };
            let (t, _gt) = optional_ptr(table.as_ref().map(|t| t as &dyn DevicePtr<i32>), ctx.stream());
            for (offset, cache) in [(heads_q * d, k), ((heads_q + heads_kv) * d, v)] {
                let (dst, _gd) = cache.device_ptr_mut(ctx.stream());
                let src = x + elem * offset as u64;
                let head = [Arg::Ptr(src), i(row_stride), i(seq), i(cols)];
                match target {
                    CacheRows::Contiguous { max_seq } => {
                        let a = [i(max_seq), i(start), Arg::Ptr(0), Arg::Ptr(dst)];
                        elementwise(
                            ctx,
                            kernels,
                            "cache_rows_16",
                            rows * cols,
                            &[head.as_slice(), &a].concat(),
                        )?;
                    }
                    CacheRows::Paged { table, .. } => {
                        let a = [i(start), Arg::Ptr(0), Arg::Ptr(t), i(table.shape().max_pages)];
                        let addressing = table.shape().pages.kernel_args();
                        let all = [head.as_slice(), &a, &addressing, &[Arg::Ptr(dst)]].concat();
                        elementwise(ctx, kernels, "cache_rows_paged_16", rows * cols, &all)?;
                    }
                }
            }
        }
        Ok(())
    }
}
