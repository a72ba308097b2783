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
//! The backward ([`crate::ops::sdpa::sdpa_backward`]) is that graph's autograd, the probabilities
//! recomputed from the forward's saved log-sum-exp:
//!
//! ```python
//! k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # repeat_heads_16 x2 (GQA only)
//! s = (q @ k.transpose(-2, -1)) * scale              # GEMM per batch (f32 out), mul_scalar_f32
//! s = s.masked_fill(~causal, -inf)                   # causal_mask_f32     (causal only)
//! p = torch.exp(s - lse[..., None])                  # exp_sub_rows_f32
//! p16 = p.to(q.dtype)                                # cast_f32_*
//! dv = p16.transpose(-2, -1) @ do                    # GEMM per batch (f32 out with GQA)
//! dp = do @ v.transpose(-2, -1)                      # GEMM per batch, f32 out
//! delta = (do * o).sum(-1)                           # row_dot_*
//! ds = p * (dp - delta[..., None]) * scale           # softmax_backward_f32, mul_scalar_f32
//! ds16 = ds.to(q.dtype)                              # cast_f32_*
//! dq = ds16 @ k                                      # GEMM per batch into dQ's strides
//! dk = ds16.transpose(-2, -1) @ q                    # GEMM per batch (f32 out with GQA)
//! dk, dv = dk.unflatten(1, (h_kv, g)).sum(2), ...    # group_sum_f32_* x2 (GQA only)
//! ```
//!
//! The `b · h_q · s_q · s_kv` scores live in device memory in f32 (twice, plus a 16-bit copy), so long
//! sequences run out of memory: that is checked up front and returned as [`Error::OutOfMemory`].

use super::{Backward, SdpaArgs, SdpaGrads, SdpaOperands};
use crate::dtype::{DataType, Element};
use crate::graph::Mask;
use crate::kernels::blas::{gemm, Gemm, Operand};
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Error, Result};
use cudarc::driver::LaunchConfig;

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
        if self.pages.is_some() {
            return Err(Error::NotSupported {
                op: "sdpa".into(),
                reason: "paged K/V is fused only (the naive attention reads contiguous K/V; a paged cache \
                         gathers its pages for it)"
                    .into(),
            });
        }
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

/// Scratch of `total` f32 elements, after checking that growing it to that fits the free memory
/// ([`Error::OutOfMemory`] naming `what` otherwise, nothing allocated).
fn checked_scratch(
    ctx: &Cudnn,
    kernels: &Kernels,
    total: usize,
    what: impl FnOnce() -> String,
) -> Result<u64> {
    let held = kernels.scratch_len();
    if total > held {
        let (free, _) = ctx.memory_info()?;
        let available = (free + 4 * held).saturating_sub(crate::exec::MEMORY_HEADROOM);
        if 4 * total > available {
            return Err(Error::OutOfMemory { what: what(), needed: 4 * total, free: available });
        }
    }
    scratch(ctx, kernels, total)
}

/// The eager decomposition.
fn run<T: Element>(ctx: &Cudnn, args: SdpaArgs, x: SdpaOperands<'_, T>) -> Result<()> {
    let SdpaOperands { q, k, v, o, stats, .. } = x;
    let kernels = Kernels::get(ctx)?;
    let (total, [p_at, p_io_at, k_at, v_at]) = layout(&args, T::DTYPE)?;
    let what = || {
        format!(
            "naive attention scores (b {} x h {} x s_q {} x s_kv {}, f32 twice plus a {} copy)",
            args.batch,
            args.heads_q,
            args.seq_q,
            args.seq_kv,
            T::DTYPE
        )
    };
    let base = checked_scratch(ctx, kernels, total, what)?;
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
    scale_and_mask(ctx, kernels, &args, s_ptr, n)?;
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

/// Kernels launched per backward call (each cuBLAS GEMM counted as one).
pub fn backward_kernel_count(args: &SdpaArgs) -> usize {
    let args = args.normalized();
    let gqa = if args.heads_q == args.heads_kv { 0 } else { 4 };
    let mask = usize::from(args.mask != Mask::None);
    // 5 GEMMs per batch; scale, exp, cast, row dot, softmax backward, scale, cast.
    gqa + 5 * args.batch + mask + 7
}

/// Device bytes the backward's intermediates take (`usize::MAX` when that overflows).
pub fn backward_scratch_bytes(args: &SdpaArgs, dtype: DataType) -> usize {
    backward_layout(args, dtype).map_or(usize::MAX, |(f32s, _)| 4 * f32s)
}

/// Offsets (f32 units, each 16-byte aligned) of the backward's scratch regions.
struct BackwardLayout {
    /// f32 scores, then the probabilities in place.
    p: usize,
    /// f32 dP, then dS in place.
    dp: usize,
    /// 16-bit probabilities, then 16-bit dS (the dV GEMM has read the first by then).
    io: usize,
    /// f32 `rowsum(dO ⊙ O)`.
    delta: usize,
    /// Repeated K and V heads (16-bit), and the f32 full-head dK and dV (grouped heads only).
    k_rep: usize,
    v_rep: usize,
    dk_rep: usize,
    dv_rep: usize,
}

fn backward_layout(args: &SdpaArgs, dtype: DataType) -> Result<(usize, BackwardLayout)> {
    use crate::checked::{add, product};
    let what = "naive sdpa backward: scratch for batch*heads_q*seq_q*seq_kv scores";
    let scores = product(what, &[args.batch, args.heads_q, args.seq_q, args.seq_kv])?;
    let rows = product(what, &[args.batch, args.heads_q, args.seq_q])?;
    let halves = |n: usize| Ok::<usize, Error>(product(what, &[n, dtype.size()])?.div_ceil(4));
    let (rep_halves, rep_f32) = if args.heads_q == args.heads_kv {
        (0, 0)
    } else {
        let n = product(what, &[args.batch, args.heads_q, args.seq_kv, args.head_dim])?;
        (halves(n)?, n)
    };
    let mut at = 0;
    let mut region = |len: usize| -> Result<usize> {
        let start = at;
        at = add(what, at, len)?.next_multiple_of(4);
        Ok(start)
    };
    let layout = BackwardLayout {
        p: region(scores)?,
        dp: region(scores)?,
        io: region(halves(scores)?)?,
        delta: region(rows)?,
        k_rep: region(rep_halves)?,
        v_rep: region(rep_halves)?,
        dk_rep: region(rep_f32)?,
        dv_rep: region(rep_f32)?,
    };
    product(what, &[at, 4])?;
    Ok((at, layout))
}

/// A matrix operand per head: address, leading (row) stride and head stride, in elements.
#[derive(Clone, Copy)]
struct Mat {
    ptr: u64,
    dtype: DataType,
    ld: usize,
    head_stride: usize,
}

impl Mat {
    fn operand(self) -> Operand {
        Operand { ptr: self.ptr, dtype: self.dtype, ld: self.ld, batch_stride: self.head_stride }
    }
}

/// Row-major `C[m, n] = op(X)[m, k] · op(Y)[k, n]` for each of `heads`, `op` a transpose where
/// flagged (X then stored `[k, m]`, Y `[n, k]`): the column-major `Cᵀ = op(Y)ᵀ · op(X)ᵀ` of cuBLAS.
#[allow(clippy::too_many_arguments)]
fn gemm_rows(
    ctx: &Cudnn,
    [m, n, k]: [usize; 3],
    x: Mat,
    tx: bool,
    y: Mat,
    ty: bool,
    c: Mat,
    heads: usize,
) -> Result<()> {
    gemm(
        ctx,
        &Gemm {
            transpose_a: ty,
            transpose_b: tx,
            m: n,
            n: m,
            k,
            a: y.operand(),
            b: x.operand(),
            c: c.operand(),
            batch: heads,
            alpha: 1.0,
            beta: 0.0,
        },
    )
}

impl<T: Element> Naive<T> for Backward {
    fn naive(self, ctx: &Cudnn, x: SdpaGrads<'_, T>) -> Result<()> {
        backward(ctx, self.0, x)
    }
}

/// The eager backward.
fn backward<T: Element>(ctx: &Cudnn, args: SdpaArgs, x: SdpaGrads<'_, T>) -> Result<()> {
    let SdpaGrads { q, k, v, o, stats, d_o, dq, dk, dv } = x;
    let stats =
        stats.ok_or_else(|| Error::invalid("sdpa backward: the forward's training stats are missing"))?;
    let kernels = Kernels::get(ctx)?;
    let (total, at) = backward_layout(&args, T::DTYPE)?;
    let what = || {
        format!(
            "naive attention backward scores (b {} x h {} x s_q {} x s_kv {}, f32 twice plus a {} copy)",
            args.batch,
            args.heads_q,
            args.seq_q,
            args.seq_kv,
            T::DTYPE
        )
    };
    let base = checked_scratch(ctx, kernels, total, what)?;
    let f32_at = |offset: usize| base + 4 * offset as u64;

    let s = ctx.stream();
    let (q_ptr, _gq) = q.device_ptr(s);
    let (k_ptr, _gk) = k.device_ptr(s);
    let (v_ptr, _gv) = v.device_ptr(s);
    let (o_ptr, _go) = o.device_ptr(s);
    let (lse_ptr, _gs) = stats.device_ptr(s);
    let (do_ptr, _gdo) = d_o.device_ptr(s);
    let (dq_ptr, _gdq) = dq.device_ptr_mut(s);
    let (dk_ptr, _gdk) = dk.device_ptr_mut(s);
    let (dv_ptr, _gdv) = dv.device_ptr_mut(s);

    let SdpaArgs { batch, heads_q, heads_kv, seq_q, seq_kv, head_dim: d, .. } = args;
    let io = T::DTYPE;
    let gqa = heads_q != heads_kv;
    let group = heads_q / heads_kv;
    // A strided [b, h, s, d] tensor as per-batch row-major matrices: (address, batch stride) and the
    // matrix with its row and head strides.
    let strided = |ptr: u64, [sb, sh, ss, _]: [usize; 4], dtype: DataType| {
        (ptr, sb, Mat { ptr, dtype, ld: ss, head_stride: sh })
    };
    let packed = |ptr: u64, heads: usize, rows: usize, cols: usize, dtype: DataType| {
        (ptr, heads * rows * cols, Mat { ptr, dtype, ld: cols, head_stride: rows * cols })
    };
    let at_batch = |(ptr, batch_stride, m): (u64, usize, Mat), b: usize| {
        let size = m.dtype.size() as u64;
        Mat { ptr: ptr + size * (b * batch_stride) as u64, ..m }
    };

    // K and V as the query heads read them (repeated for grouped heads).
    let (kk, vv) = if gqa {
        let n = batch * heads_q * seq_kv * d;
        for (src, strides, dst) in
            [(k_ptr, args.k_strides, f32_at(at.k_rep)), (v_ptr, args.v_strides, f32_at(at.v_rep))]
        {
            let [sb, sh, ss, _] = strides.map(|x| x as i64);
            let shape = [heads_q, group, seq_kv, d].map(|x| Arg::I64(x as i64));
            let mut a = vec![Arg::Ptr(src)];
            a.extend(shape);
            a.extend([Arg::I64(sb), Arg::I64(sh), Arg::I64(ss), Arg::Ptr(dst)]);
            elementwise(ctx, kernels, "repeat_heads_16", n, &a)?;
        }
        (packed(f32_at(at.k_rep), heads_q, seq_kv, d, io), packed(f32_at(at.v_rep), heads_q, seq_kv, d, io))
    } else {
        (strided(k_ptr, args.k_strides, io), strided(v_ptr, args.v_strides, io))
    };
    let qq = strided(q_ptr, args.q_strides, io);
    let dd_o = strided(do_ptr, args.o_strides, io);
    let ddq = strided(dq_ptr, args.q_strides, io);
    let (ddk, ddv) = if gqa {
        let f = DataType::F32;
        (packed(f32_at(at.dk_rep), heads_q, seq_kv, d, f), packed(f32_at(at.dv_rep), heads_q, seq_kv, d, f))
    } else {
        (strided(dk_ptr, args.k_strides, io), strided(dv_ptr, args.v_strides, io))
    };
    let (p, dp) = (f32_at(at.p), f32_at(at.dp));
    let scores = |ptr: u64, dtype: DataType| packed(ptr, heads_q, seq_q, seq_kv, dtype);
    let n = batch * heads_q * seq_q * seq_kv;
    let cast = if io == DataType::BF16 { "cast_f32_bf16" } else { "cast_f32_f16" };

    // S = Q Kᵀ · scale, masked; P = exp(S − lse).
    for b in 0..batch {
        let (x, y, c) = (at_batch(qq, b), at_batch(kk, b), at_batch(scores(p, DataType::F32), b));
        gemm_rows(ctx, [seq_q, seq_kv, d], x, false, y, true, c, heads_q)?;
    }
    scale_and_mask(ctx, kernels, &args, p, n)?;
    let a = [Arg::Ptr(p), Arg::Ptr(lse_ptr), Arg::I64(seq_kv as i64), Arg::Ptr(p)];
    elementwise(ctx, kernels, "exp_sub_rows_f32", n, &a)?;
    let p_io = f32_at(at.io);
    elementwise(ctx, kernels, cast, n, &[Arg::Ptr(p), Arg::Ptr(p_io)])?;

    // dV = Pᵀ dO; dP = dO Vᵀ.
    for b in 0..batch {
        let (x, y, c) = (at_batch(scores(p_io, io), b), at_batch(dd_o, b), at_batch(ddv, b));
        gemm_rows(ctx, [seq_kv, d, seq_q], x, true, y, false, c, heads_q)?;
    }
    for b in 0..batch {
        let (x, y, c) = (at_batch(dd_o, b), at_batch(vv, b), at_batch(scores(dp, DataType::F32), b));
        gemm_rows(ctx, [seq_q, seq_kv, d], x, false, y, true, c, heads_q)?;
    }

    // dS = P ⊙ (dP − rowsum(dO ⊙ O)) · scale, in 16 bits for the GEMMs.
    let delta = f32_at(at.delta);
    let [ob, oh, os, _] = args.o_strides.map(|x| Arg::I64(x as i64));
    let rows = batch * heads_q * seq_q;
    let row_dot = if io == DataType::BF16 { "row_dot_bf16" } else { "row_dot_f16" };
    let dims = [heads_q, seq_q, d].map(|x| Arg::I64(x as i64));
    let mut a = vec![Arg::Ptr(do_ptr), Arg::Ptr(o_ptr)];
    a.extend(dims);
    a.extend([ob, oh, os, ob, oh, os, Arg::Ptr(delta)]);
    elementwise(ctx, kernels, row_dot, rows, &a)?;
    let a = [Arg::Ptr(p), Arg::Ptr(dp), Arg::Ptr(delta), Arg::I64(seq_kv as i64), Arg::Ptr(dp)];
    elementwise(ctx, kernels, "softmax_backward_f32", n, &a)?;
    elementwise(ctx, kernels, "mul_scalar_f32", n, &[Arg::Ptr(dp), Arg::F32(args.scale()), Arg::Ptr(dp)])?;
    let ds_io = f32_at(at.io);
    elementwise(ctx, kernels, cast, n, &[Arg::Ptr(dp), Arg::Ptr(ds_io)])?;

    // dQ = dS K; dK = dSᵀ Q.
    for b in 0..batch {
        let (x, y, c) = (at_batch(scores(ds_io, io), b), at_batch(kk, b), at_batch(ddq, b));
        gemm_rows(ctx, [seq_q, d, seq_kv], x, false, y, false, c, heads_q)?;
    }
    for b in 0..batch {
        let (x, y, c) = (at_batch(scores(ds_io, io), b), at_batch(qq, b), at_batch(ddk, b));
        gemm_rows(ctx, [seq_kv, d, seq_q], x, true, y, false, c, heads_q)?;
    }

    // Grouped heads: each K/V head's gradient is the sum over its query heads.
    if gqa {
        let sum = if io == DataType::BF16 { "group_sum_f32_bf16" } else { "group_sum_f32_f16" };
        let n = batch * heads_kv * seq_kv * d;
        for (src, dst, strides) in [(at.dk_rep, dk_ptr, args.k_strides), (at.dv_rep, dv_ptr, args.v_strides)]
        {
            let [sb, sh, ss, _] = strides.map(|x| Arg::I64(x as i64));
            let shape = [heads_kv, group, seq_kv, d].map(|x| Arg::I64(x as i64));
            let mut a = vec![Arg::Ptr(f32_at(src))];
            a.extend(shape);
            a.extend([sb, sh, ss, Arg::Ptr(dst)]);
            elementwise(ctx, kernels, sum, n, &a)?;
        }
    }
    Ok(())
}

/// `S = S · scale`, then the causal mask (top-left, or bottom-right aligned), in place on the `n` f32
/// scores at `scores` (`[.., seq_q, seq_kv]` packed): two eager kernels, the second only when masked.
fn scale_and_mask(ctx: &Cudnn, kernels: &Kernels, args: &SdpaArgs, scores: u64, n: usize) -> Result<()> {
    let (seq_q, seq_kv) = (args.seq_q, args.seq_kv);
    elementwise(
        ctx,
        kernels,
        "mul_scalar_f32",
        n,
        &[Arg::Ptr(scores), Arg::F32(args.scale()), Arg::Ptr(scores)],
    )?;
    if args.mask != Mask::None {
        let offset = if args.mask == Mask::CausalBottomRight { seq_kv - seq_q } else { 0 };
        let a = [
            Arg::Ptr(scores),
            Arg::I64(seq_kv as i64),
            Arg::I64(seq_q as i64),
            Arg::I64(offset as i64),
            Arg::Ptr(scores),
        ];
        elementwise(ctx, kernels, "causal_mask_f32", n, &a)?;
    }
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

    #[test]
    fn backward_kernel_counts_and_scratch() {
        let gqa = SdpaArgs::new(1, 32, 8, 2048, 2048, 128, Layout::Bshd).with_mask(Mask::CausalTopLeft);
        // 2 repeats, 5 GEMMs, scale, mask, exp, cast, row dot, softmax backward, scale, cast, 2 sums.
        assert_eq!(backward_kernel_count(&gqa), 2 + 5 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 2);
        let mha = SdpaArgs::new(2, 8, 8, 16, 16, 64, Layout::Bhsd);
        assert_eq!(backward_kernel_count(&mha), 5 * 2 + 7);
        // Scores f32 twice + 16-bit once, row sums; grouped: repeated K, V (16-bit), dK, dV (f32).
        let s = 32 * 2048 * 2048;
        let rep = 32 * 2048 * 128;
        let expected = 4 * s + 4 * s + 2 * s + 4 * 32 * 2048 + 2 * 2 * rep + 2 * 4 * rep;
        assert_eq!(backward_scratch_bytes(&gqa, DataType::BF16), expected);
        assert_eq!(backward_scratch_bytes(&mha, DataType::F16), 4 * (2 * 4096 + 2048 + 256));
    }
}
