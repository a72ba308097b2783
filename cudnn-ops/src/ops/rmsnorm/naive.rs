//! Hugging Face's `LlamaRMSNorm.forward` as PyTorch eager runs it, one kernel per line:
//!
//! ```python
//! h = x.to(torch.float32)                      # cast_*_f32      (no kernel when x is f32)
//! variance = h.pow(2).mean(-1, keepdim=True)   # pow2_f32, mean_rows_f32
//! h = h * torch.rsqrt(variance + eps)          # add_scalar_f32, rsqrt_f32, mul_rows_f32
//! return weight * h.to(input_dtype)            # cast_f32_*      (no kernel when x is f32), mul_weight_*
//! ```
//!
//! 8 kernels for bf16/f16, 6 for f32, every intermediate an f32 tensor in device memory. In the
//! training phase the rsqrt output is the inverse RMS and is written straight to the caller's buffer.
//!
//! The backward is the sequence eager autograd runs for those lines, from the last node back, with
//! the tensors autograd saved (`h`, `rsqrt(...)`, `h.to(input_dtype)`) recomputed first from x and
//! the saved inverse RMS (eager keeps them from the forward; our forward saves only the inverse RMS):
//!
//! ```text
//! recompute   h = x.float()                      cast_*_f32        (none for f32)
//!             n = h * r                          mul_rows_f32
//!             nd = n.to(dtype)                   cast_f32_*        (none for f32)
//! MulBackward0 (y = weight * nd)
//!             g_w = dy * nd                      rms_bwd_mul_*
//!             dweight = g_w.sum(0)               colsum_*_*        (sum_to the weight's shape)
//!             g_nd = dy * weight                 mul_weight_*
//! ToCopyBackward0   g_n = g_nd.float()           cast_*_f32        (none for f32)
//! MulBackward0 (n = h * r)
//!             g_h1 = g_n * r                     mul_rows_f32
//!             g_r = (g_n * h).sum(-1, keepdim)   mul_f32, sum_rows_f32
//! RsqrtBackward0    g_v = -0.5 * g_r * r.pow(3)  pow3_f32, mul_scalar_f32, mul_f32
//! AddBackward0      (eps: no kernel)
//! MeanBackward1     g_sq = g_v.expand(..) / cols expand_div_f32
//! PowBackward0      g_h2 = g_sq * (2 * h.pow(1)) copy_f32, mul_scalar_f32, mul_f32
//! accumulate        g_h = g_h1 + g_h2            add_f32
//! ToCopyBackward0   dx = g_h.to(dtype)           cast_f32_*        (none for f32)
//! residual fork     dx = d_residual + dx         epi_add_*         (only with a residual gradient)
//! ```
//!
//! 3 + 16 = 19 kernels for bf16/f16, 1 + 14 = 15 for f32, one more with the residual gradient
//! ([`backward_kernel_count`]).

use super::{Grad, RmsNormArgs, RmsNormGrads, RmsNormOperands};
use crate::dtype::{DataType, Element};
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Result};
use cudarc::driver::LaunchConfig;

/// Kernels launched per call for an I/O dtype (the report checks its counts against this).
pub fn kernel_count(dtype: DataType) -> usize {
    if dtype == DataType::F32 {
        6
    } else {
        8
    }
}

/// Kernels the eager backward launches per call (recomputing the saved activations included).
pub fn backward_kernel_count(dtype: DataType, d_residual: bool) -> usize {
    let base = if dtype == DataType::F32 { 15 } else { 19 };
    base + d_residual as usize
}

/// The kernel-name suffix of a float dtype.
fn suffix(dtype: DataType, op: &str) -> Result<&'static str> {
    crate::kernels::float_suffix(op, "elements", dtype)
}

/// `y[cols] = x[rows, cols].sum(0)` as eager's reduction kernel: reads `input`, writes `output` (the
/// same dtype, or f32), f32 accumulation. Shared with the naive matmul backward (bias gradient).
pub(crate) fn column_sum(
    ctx: &Cudnn,
    kernels: &Kernels,
    (input, output): (DataType, DataType),
    x: u64,
    rows: usize,
    cols: usize,
    y: u64,
) -> Result<()> {
    let name = format!("colsum_{}_{}", suffix(input, "column sum")?, suffix(output, "column sum")?);
    let cfg = LaunchConfig {
        grid_dim: (crate::checked::launch_dim("column sum: column blocks", cols.div_ceil(32))?, 1, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    };
    launch(
        ctx,
        kernels,
        &name,
        cfg,
        &[Arg::Ptr(x), Arg::I64(rows as i64), Arg::I64(cols as i64), Arg::Ptr(y)],
    )
}

impl<T: Element> Naive<Grad<T>> for RmsNormArgs {
    fn naive(self, ctx: &Cudnn, x: RmsNormGrads<'_, T>) -> Result<()> {
        backward(ctx, self, x)
    }
}

/// The eager autograd sequence of the module docs.
fn backward<T: Element>(ctx: &Cudnn, args: RmsNormArgs, x: RmsNormGrads<'_, T>) -> Result<()> {
    let RmsNormGrads { dy, x, weight, inv_rms, d_residual, dx, dweight } = x;
    let sfx = suffix(T::DTYPE, "rms_norm_backward")?;
    let f32_io = T::DTYPE == DataType::F32;
    let kernels = Kernels::get(ctx)?;
    let (rows, cols) = (args.tokens, args.hidden);
    let n = rows * cols; // checked by `check_backward`
    crate::error::ensure!(
        n <= u32::MAX as usize,
        "naive rms_norm_backward: {n} elements exceed the kernels' 32-bit indexing"
    );
    // Intermediates, one f32 slot of n (or of rows) each, as eager allocates them.
    const FULL: usize = 13;
    let base = scratch(ctx, kernels, FULL * n + 4 * rows)?;
    let full = |k: usize| base + 4 * (k * n) as u64;
    let row = |k: usize| base + 4 * (FULL * n + k * rows) as u64;

    let s = ctx.stream();
    let (dy, _g1) = dy.device_ptr(s);
    let (x, _g2) = x.device_ptr(s);
    let (w, _g3) = weight.device_ptr(s);
    let (r, _g4) = inv_rms.device_ptr(s);
    let (dx, _g5) = dx.device_ptr_mut(s);
    let (dw, _g6) = dweight.device_ptr_mut(s);
    let ew = |name: &str, len: usize, a: &[Arg]| elementwise(ctx, kernels, name, len, a);
    let (p, c) = (Arg::Ptr, Arg::I64(cols as i64));

    // Recompute what autograd saved in the forward.
    let h = if f32_io {
        x
    } else {
        ew(&format!("cast_{sfx}_f32"), n, &[p(x), p(full(0))])?;
        full(0)
    };
    ew("mul_rows_f32", n, &[p(h), p(r), c, p(full(1))])?;
    let nd = if f32_io {
        full(1)
    } else {
        ew(&format!("cast_f32_{sfx}"), n, &[p(full(1)), p(full(2))])?;
        full(2)
    };
    // MulBackward0 of y = weight * nd.
    ew(&format!("rms_bwd_mul_{sfx}"), n, &[p(dy), p(nd), p(full(3))])?;
    column_sum(ctx, kernels, (T::DTYPE, T::DTYPE), full(3), rows, cols, dw)?;
    ew(&format!("mul_weight_{sfx}"), n, &[p(w), p(dy), c, p(full(4))])?;
    // ToCopyBackward0.
    let g_n = if f32_io {
        full(4)
    } else {
        ew(&format!("cast_{sfx}_f32"), n, &[p(full(4)), p(full(5))])?;
        full(5)
    };
    // MulBackward0 of n = h * r.
    ew("mul_rows_f32", n, &[p(g_n), p(r), c, p(full(6))])?;
    ew("mul_f32", n, &[p(g_n), p(h), p(full(7))])?;
    let grid = crate::checked::launch_dim("naive rms_norm_backward: rows", rows)?;
    let rows_cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(ctx, kernels, "sum_rows_f32", rows_cfg, &[p(full(7)), c, p(row(0))])?;
    // RsqrtBackward0: -0.5 * grad * result.pow(3).
    ew("pow3_f32", rows, &[p(r), p(row(1))])?;
    ew("mul_scalar_f32", rows, &[p(row(0)), Arg::F32(-0.5), p(row(2))])?;
    ew("mul_f32", rows, &[p(row(2)), p(row(1)), p(row(3))])?;
    // MeanBackward1.
    ew("expand_div_f32", n, &[p(row(3)), c, Arg::F32(cols as f32), p(full(8))])?;
    // PowBackward0: grad * (2 * h.pow(1)).
    ew("copy_f32", n, &[p(h), p(full(9))])?;
    ew("mul_scalar_f32", n, &[p(full(9)), Arg::F32(2.0), p(full(10))])?;
    ew("mul_f32", n, &[p(full(8)), p(full(10)), p(full(11))])?;
    // The two gradients of h, then ToCopyBackward0.
    if f32_io {
        ew("add_f32", n, &[p(full(6)), p(full(11)), p(dx)])?;
    } else {
        ew("add_f32", n, &[p(full(6)), p(full(11)), p(full(12))])?;
        ew(&format!("cast_f32_{sfx}"), n, &[p(full(12)), p(dx)])?;
    }
    if let Some(res) = d_residual {
        let (res, _g7) = res.device_ptr(s);
        ew(&format!("epi_add_{sfx}"), n, &[p(dx), p(res)])?;
    }
    Ok(())
}

impl<T: Element> Naive<T> for RmsNormArgs {
    fn naive(self, ctx: &Cudnn, x: RmsNormOperands<'_, T>) -> Result<()> {
        run(ctx, self, x)
    }
}

/// The eager decomposition; the training phase writes the rsqrt output straight to `inv_rms`.
fn run<T: Element>(ctx: &Cudnn, args: RmsNormArgs, x: RmsNormOperands<'_, T>) -> Result<()> {
    let RmsNormOperands { x, weight, y, inv_rms } = x;
    let suffix = suffix(T::DTYPE, "rms_norm")?;
    let kernels = Kernels::get(ctx)?;
    let (rows, cols) = (args.tokens, args.hidden);
    let n = rows * cols;
    crate::error::ensure!(
        n <= u32::MAX as usize,
        "naive rms_norm: {n} elements exceed the kernels' 32-bit indexing"
    );
    // Intermediates, as PyTorch allocates them: h, h², mean, mean+eps, rsqrt, h*rsqrt, (cast-down).
    let elem = T::DTYPE.size();
    let down_f32s = if T::DTYPE == DataType::F32 { 0 } else { (n * elem).div_ceil(4) };
    let base = scratch(ctx, kernels, 3 * n + 3 * rows + down_f32s)?;
    let f32_at = |offset: usize| base + 4 * offset as u64;
    let (sq, normed, mean, var_eps, rs) =
        (f32_at(n), f32_at(2 * n), f32_at(3 * n), f32_at(3 * n + rows), f32_at(3 * n + 2 * rows));

    let (x_ptr, _gx) = x.device_ptr(ctx.stream());
    let (w_ptr, _gw) = weight.device_ptr(ctx.stream());
    let (y_ptr, _gy) = y.device_ptr_mut(ctx.stream());
    let mut inv_guard = None;
    let rs = match inv_rms {
        Some(inv) => {
            let (p, g) = inv.device_ptr_mut(ctx.stream());
            inv_guard = Some(g);
            p
        }
        None => rs,
    };

    let h = if T::DTYPE == DataType::F32 {
        x_ptr
    } else {
        elementwise(ctx, kernels, &format!("cast_{suffix}_f32"), n, &[Arg::Ptr(x_ptr), Arg::Ptr(f32_at(0))])?;
        f32_at(0)
    };
    elementwise(ctx, kernels, "pow2_f32", n, &[Arg::Ptr(h), Arg::Ptr(sq)])?;
    let grid = crate::checked::launch_dim("naive rms_norm: rows", rows)?;
    let mean_cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(ctx, kernels, "mean_rows_f32", mean_cfg, &[Arg::Ptr(sq), Arg::I64(cols as i64), Arg::Ptr(mean)])?;
    elementwise(
        ctx,
        kernels,
        "add_scalar_f32",
        rows,
        &[Arg::Ptr(mean), Arg::F32(args.epsilon), Arg::Ptr(var_eps)],
    )?;
    elementwise(ctx, kernels, "rsqrt_f32", rows, &[Arg::Ptr(var_eps), Arg::Ptr(rs)])?;
    elementwise(
        ctx,
        kernels,
        "mul_rows_f32",
        n,
        &[Arg::Ptr(h), Arg::Ptr(rs), Arg::I64(cols as i64), Arg::Ptr(normed)],
    )?;
    let down = if T::DTYPE == DataType::F32 {
        normed
    } else {
        let down = f32_at(3 * n + 3 * rows);
        elementwise(ctx, kernels, &format!("cast_f32_{suffix}"), n, &[Arg::Ptr(normed), Arg::Ptr(down)])?;
        down
    };
    let mul = format!("mul_weight_{suffix}");
    elementwise(
        ctx,
        kernels,
        &mul,
        n,
        &[Arg::Ptr(w_ptr), Arg::Ptr(down), Arg::I64(cols as i64), Arg::Ptr(y_ptr)],
    )?;
    drop(inv_guard);
    Ok(())
}
