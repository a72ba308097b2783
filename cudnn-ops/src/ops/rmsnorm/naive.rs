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

use super::{RmsNormArgs, RmsNormOperands};
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

impl<T: Element> Naive<T> for RmsNormArgs {
    fn naive(self, ctx: &Cudnn, x: RmsNormOperands<'_, T>) -> Result<()> {
        run(ctx, self, x)
    }
}

/// The eager decomposition; the training phase writes the rsqrt output straight to `inv_rms`.
fn run<T: Element>(ctx: &Cudnn, args: RmsNormArgs, x: RmsNormOperands<'_, T>) -> Result<()> {
    let RmsNormOperands { x, weight, y, inv_rms } = x;
    let suffix = match T::DTYPE {
        DataType::BF16 => "bf16",
        DataType::F16 => "f16",
        DataType::F32 => "f32",
        other => return Err(crate::Error::invalid(format!("rms_norm: dtype {other} is not a float type"))),
    };
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
