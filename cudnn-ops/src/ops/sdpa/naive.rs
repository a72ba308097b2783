//! Attention as PyTorch's math path runs it, unfused:
//!
//! ```python
//! k = k.repeat_interleave(h_q // h_kv, dim=1)    # repeat_heads_16     (only when h_q != h_kv)
//! v = v.repeat_interleave(h_q // h_kv, dim=1)    # repeat_heads_16
//! s = q @ k.transpose(-2, -1)                    # cuBLAS strided-batched GEMM, f32 out (one per batch)
//! s = s * scale                                  # mul_scalar_f32
//! s = s.masked_fill(~causal, -inf)               # causal_mask_f32     (causal only)
//! p = torch.softmax(s, dim=-1)                   # softmax_rows_f32    (f32, plus stats in training)
//! o = p.to(q.dtype) @ v                          # cast_f32_*, cuBLAS GEMM into O's strides
//! ```
//!
//! The `b · h_q · s_q · s_kv` scores live in device memory in f32 (twice, plus the cast copy), so long
//! sequences run out of memory: that is checked up front and returned as [`Error::OutOfMemory`].

use super::{SdpaArgs, SdpaOperands};
use crate::dtype::{DataType, Element};
use crate::graph::Mask;
use crate::kernels::blas::{gemm, Gemm, Operand};
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Error, Result};
use cudarc::driver::LaunchConfig;

/// Headroom left free for cuBLAS's workspace and the rest of the process.
const HEADROOM: usize = 256 << 20;

/// Kernels launched per call (cuBLAS may split a GEMM into more than one kernel; counted as one).
pub fn kernel_count(args: &SdpaArgs) -> usize {
    let args = args.normalized();
    let repeats = if args.heads_q == args.heads_kv { 0 } else { 2 };
    let mask = usize::from(args.mask != Mask::None);
    repeats + 2 * args.batch + 1 + mask + 1 + 1
}

/// Device bytes the intermediates take: scores and probabilities in f32, probabilities in the I/O
/// type, and the repeated K/V heads (`usize::MAX` when that overflows: no device has it).
pub fn scratch_bytes(args: &SdpaArgs, dtype: DataType) -> usize {
    layout(args, dtype).map_or(usize::MAX, |(f32s, _)| 4 * f32s)
}

/// Scratch layout in f32 units: total, and the offsets of (probabilities, cast probabilities,
/// repeated K, repeated V).
fn layout(args: &SdpaArgs, dtype: DataType) -> Result<(usize, [usize; 4])> {
    use crate::checked::{add, product};
    let what = "naive sdpa: scratch for batch*heads_q*seq_q*seq_kv scores";
    let scores = product(what, &[args.batch, args.heads_q, args.seq_q, args.seq_kv])?;
    let halves = |n: usize| Ok::<usize, Error>(product(what, &[n, dtype.size()])?.div_ceil(4));
    let repeated = if args.heads_q == args.heads_kv {
        0
    } else {
        halves(product(what, &[args.batch, args.heads_q, args.seq_kv, args.head_dim])?)?
    };
    let p = scores;
    let p_io = add(what, p, scores)?;
    let k = add(what, p_io, halves(scores)?)?;
    let v = add(what, k, repeated)?;
    // Bytes of f32 scratch, so that `4 * total` below cannot wrap either.
    let total = add(what, v, repeated)?;
    product(what, &[total, 4])?;
    Ok((total, [p, p_io, k, v]))
}

impl<T: Element> Naive<T> for SdpaArgs {
    fn naive(self, ctx: &Cudnn, x: SdpaOperands<'_, T>) -> Result<()> {
        if x.seq_lens.is_some() {
            return Err(Error::NotSupported {
                op: "sdpa".into(),
                reason: "run-time sequence lengths are fused only (the naive attention runs every position)"
                    .into(),
            });
        }
        run(ctx, self, x)
    }
}

/// The eager decomposition.
fn run<T: Element>(ctx: &Cudnn, args: SdpaArgs, x: SdpaOperands<'_, T>) -> Result<()> {
    let SdpaOperands { q, k, v, o, stats, .. } = x;
    let kernels = Kernels::get(ctx)?;
    let (total, [p_at, p_io_at, k_at, v_at]) = layout(&args, T::DTYPE)?;
    let held = kernels.scratch_len();
    if total > held {
        let (free, _) = ctx.memory_info()?;
        let available = (free + 4 * held).saturating_sub(HEADROOM);
        if 4 * total > available {
            return Err(Error::OutOfMemory {
                what: format!(
                    "naive attention scores (b {} x h {} x s_q {} x s_kv {}, f32 twice plus a {} copy)",
                    args.batch,
                    args.heads_q,
                    args.seq_q,
                    args.seq_kv,
                    T::DTYPE
                ),
                needed: 4 * total,
                free: available,
            });
        }
    }
    let base = scratch(ctx, kernels, total)?;
    let f32_at = |offset: usize| base + 4 * offset as u64;
    let (s_ptr, p_ptr, p_io) = (f32_at(0), f32_at(p_at), f32_at(p_io_at));

    let (q_ptr, _gq) = q.device_ptr(ctx.stream());
    let (k_ptr, _gk) = k.device_ptr(ctx.stream());
    let (v_ptr, _gv) = v.device_ptr(ctx.stream());
    let (o_ptr, _go) = o.device_ptr_mut(ctx.stream());
    let mut stats_guard = None;
    let stats_ptr = match stats {
        Some(s) => {
            let (p, g) = s.device_ptr_mut(ctx.stream());
            stats_guard = Some(g);
            p
        }
        None => 0,
    };

    let SdpaArgs { batch, heads_q, heads_kv, seq_q, seq_kv, head_dim: d, .. } = args;
    let elem = T::DTYPE.size() as u64;
    // K and V as the GEMMs read them: (address, batch stride, head stride, row stride), in elements.
    let (kk, vv) = if heads_q == heads_kv {
        let [kb, kh, ks, _] = args.k_strides;
        let [vb, vh, vs, _] = args.v_strides;
        ((k_ptr, kb, kh, ks), (v_ptr, vb, vh, vs))
    } else {
        let group = heads_q / heads_kv;
        let n = batch * heads_q * seq_kv * d;
        for (src, strides, dst) in
            [(k_ptr, args.k_strides, f32_at(k_at)), (v_ptr, args.v_strides, f32_at(v_at))]
        {
            let [sb, sh, ss, _] = strides.map(|s| s as i64);
            let shape = [heads_q, group, seq_kv, d].map(|x| Arg::I64(x as i64));
            let mut a = vec![Arg::Ptr(src)];
            a.extend(shape);
            a.extend([Arg::I64(sb), Arg::I64(sh), Arg::I64(ss), Arg::Ptr(dst)]);
            elementwise(ctx, kernels, "repeat_heads_16", n, &a)?;
        }
        let packed = (heads_q * seq_kv * d, seq_kv * d, d);
        ((f32_at(k_at), packed.0, packed.1, packed.2), (f32_at(v_at), packed.0, packed.1, packed.2))
    };
    let per_batch_scores = heads_q * seq_q * seq_kv;
    let [qb, qh, qs, _] = args.q_strides;
    for b in 0..batch {
        // Column-major: Sᵀ (s_kv × s_q) = Kᵀ-view · Q, one GEMM per query head.
        gemm(
            ctx,
            &Gemm {
                transpose_a: true,
                transpose_b: false,
                m: seq_kv,
                n: seq_q,
                k: d,
                a: Operand {
                    ptr: kk.0 + elem * (b * kk.1) as u64,
                    dtype: T::DTYPE,
                    ld: kk.3,
                    batch_stride: kk.2,
                },
                b: Operand { ptr: q_ptr + elem * (b * qb) as u64, dtype: T::DTYPE, ld: qs, batch_stride: qh },
                c: Operand {
                    ptr: s_ptr + 4 * (b * per_batch_scores) as u64,
                    dtype: DataType::F32,
                    ld: seq_kv,
                    batch_stride: seq_q * seq_kv,
                },
                batch: heads_q,
                alpha: 1.0,
                beta: 0.0,
            },
        )?;
    }
    let n = batch * per_batch_scores;
    elementwise(
        ctx,
        kernels,
        "mul_scalar_f32",
        n,
        &[Arg::Ptr(s_ptr), Arg::F32(args.scale()), Arg::Ptr(s_ptr)],
    )?;
    if args.mask != Mask::None {
        let offset = if args.mask == Mask::CausalBottomRight { seq_kv - seq_q } else { 0 };
        let a = [
            Arg::Ptr(s_ptr),
            Arg::I64(seq_kv as i64),
            Arg::I64(seq_q as i64),
            Arg::I64(offset as i64),
            Arg::Ptr(s_ptr),
        ];
        elementwise(ctx, kernels, "causal_mask_f32", n, &a)?;
    }
    let rows = batch * heads_q * seq_q;
    let grid = crate::checked::launch_dim("naive sdpa: softmax rows", rows)?;
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(
        ctx,
        kernels,
        "softmax_rows_f32",
        cfg,
        &[Arg::Ptr(s_ptr), Arg::I64(seq_kv as i64), Arg::Ptr(p_ptr), Arg::Ptr(stats_ptr)],
    )?;
    let cast = if T::DTYPE == DataType::BF16 { "cast_f32_bf16" } else { "cast_f32_f16" };
    elementwise(ctx, kernels, cast, n, &[Arg::Ptr(p_ptr), Arg::Ptr(p_io)])?;
    let [ob, oh, os, _] = args.o_strides;
    for b in 0..batch {
        // Column-major: Oᵀ (d × s_q) = Vᵀ-view (d × s_kv) · Pᵀ-view (s_kv × s_q).
        gemm(
            ctx,
            &Gemm {
                transpose_a: false,
                transpose_b: false,
                m: d,
                n: seq_q,
                k: seq_kv,
                a: Operand {
                    ptr: vv.0 + elem * (b * vv.1) as u64,
                    dtype: T::DTYPE,
                    ld: vv.3,
                    batch_stride: vv.2,
                },
                b: Operand {
                    ptr: p_io + elem * (b * per_batch_scores) as u64,
                    dtype: T::DTYPE,
                    ld: seq_kv,
                    batch_stride: seq_q * seq_kv,
                },
                c: Operand { ptr: o_ptr + elem * (b * ob) as u64, dtype: T::DTYPE, ld: os, batch_stride: oh },
                batch: heads_q,
                alpha: 1.0,
                beta: 0.0,
            },
        )?;
    }
    drop(stats_guard);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::sdpa::Layout;

    #[test]
    fn kernel_counts_and_scratch() {
        let gqa = SdpaArgs::new(1, 32, 8, 2048, 2048, 128, Layout::Bshd).with_mask(Mask::CausalTopLeft);
        // 2 repeats, 2 GEMMs, scale, mask, softmax, cast.
        assert_eq!(kernel_count(&gqa), 8);
        let mha = SdpaArgs::new(2, 8, 8, 16, 16, 64, Layout::Bhsd);
        assert_eq!(kernel_count(&mha), 4 + 3);
        // Scores 32·2048² f32 twice + bf16 once + repeated K and V (32·2048·128 bf16 each).
        let s = 32 * 2048 * 2048;
        assert_eq!(scratch_bytes(&gqa, DataType::BF16), 4 * s + 4 * s + 2 * s + 2 * 2 * 32 * 2048 * 128);
        assert_eq!(scratch_bytes(&mha, DataType::F16), 10 * 8 * 16 * 16 * 2);
    }
}
