//! The fused half of [`fp8_linear`](super::fp8_linear): the FP8-weight GEMV of `fp8_gemv.cu` for a
//! decode step's few tokens.

use super::{Fp8LinearArgs, Fp8LinearOperands};
use crate::dtype::{DataType, Element};
use crate::kernels::{float_suffix, fp8_suffix, launch, Arg, Kernels};
use crate::ops::Fused;
use crate::{Cudnn, Error, Result};
use cudarc::driver::LaunchConfig;

/// Threads per block (the kernels' `__launch_bounds__`).
const BLOCK: u32 = 128;
/// Rows of W per warp (the kernels' R).
const ROWS_PER_WARP: usize = 2;

/// The kernel for x's dtype, W's format and `m` tokens: the smallest tile of 1, 2, 4 or 8 that holds
/// them.
fn kernel(x: DataType, w: DataType, m: usize) -> Result<String> {
    // The checks keep x to bf16 and f16, the dtypes the kernels take.
    let sx = float_suffix("fp8_linear", "activations", x)?;
    let sw = fp8_suffix("fp8_linear", "weights", w)?;
    let tile = [1, 2, 4, 8].into_iter().find(|&t| t >= m).ok_or_else(|| Error::NotSupported {
        op: format!("fp8_linear {m} tokens"),
        reason: format!(
            "the FP8-weight GEMV takes at most {} tokens: quantize the activations and run scaled_matmul, \
             or run the naive backend",
            Fp8LinearArgs::MAX_GEMV_TOKENS
        ),
    })?;
    Ok(format!("f8gemv_{sx}_{sw}_m{tile}"))
}

impl<T: Element, W: Element> Fused<(T, W)> for Fp8LinearArgs {
    fn fused(self, ctx: &Cudnn, x: Fp8LinearOperands<'_, T, W>) -> Result<()> {
        let Fp8LinearArgs { m, n, k, .. } = self;
        let name = kernel(T::DTYPE, W::DTYPE, m)?;
        let kernels = Kernels::get(ctx)?;
        let s = ctx.stream();
        let (xp, _gx) = x.x.device_ptr(s);
        let (wp, _gw) = x.w.device_ptr(s);
        // 16-byte loads of x and W: their starts (rows follow, k being a multiple of 16).
        if xp % 16 != 0 || wp % 16 != 0 {
            return Err(Error::invalid(format!(
                "fp8_linear: x (at {xp:#x}) and W (at {wp:#x}) must start 16-byte aligned"
            )));
        }
        let (sp, _gs) = x.w_scale.device_ptr(s);
        let (yp, _gy) = x.y.device_ptr_mut(s);
        let warps = n.div_ceil(ROWS_PER_WARP);
        let blocks = warps.div_ceil((BLOCK / 32) as usize);
        let cfg = LaunchConfig {
            grid_dim: (crate::checked::launch_dim("fp8_linear: blocks", blocks)?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let per_row = (self.w_scales() > 1) as i64;
        let args = [
            Arg::Ptr(xp),
            Arg::I64(k as i64),
            Arg::Ptr(wp),
            Arg::I64(k as i64),
            Arg::Ptr(sp),
            Arg::I64(per_row),
            Arg::I64(m as i64),
            Arg::I64(k as i64),
            Arg::I64(n as i64),
            Arg::Ptr(yp),
        ];
        launch(ctx, kernels, &name, cfg, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tile_holds_the_tokens_and_more_are_refused() {
        let (bf, e4) = (DataType::BF16, DataType::F8E4M3);
        assert_eq!(kernel(bf, e4, 1).unwrap(), "f8gemv_bf16_e4m3_m1");
        assert_eq!(kernel(bf, e4, 3).unwrap(), "f8gemv_bf16_e4m3_m4");
        assert_eq!(kernel(DataType::F16, DataType::F8E5M2, 8).unwrap(), "f8gemv_f16_e5m2_m8");
        assert!(matches!(kernel(bf, e4, 9), Err(Error::NotSupported { .. })));
        // Every name is a kernel of fp8_gemv.cu.
        let source = include_str!("fp8_gemv.cu");
        for (x, xs) in [(bf, "bf16"), (DataType::F16, "f16")] {
            for (w, ws) in [(e4, "e4m3"), (DataType::F8E5M2, "e5m2")] {
                for m in [1, 2, 4, 8] {
                    let name = kernel(x, w, m).unwrap();
                    assert!(name.starts_with(&format!("f8gemv_{xs}_{ws}_m")), "{name}");
                    assert!(source.contains(&format!("F8GEMV_TILES({xs}, ")), "{name}");
                    assert!(source.contains(&format!("F8GEMV_KERNEL(sfx, D, fmt, E5M2, {m}, ")), "{name}");
                }
            }
        }
    }
}
