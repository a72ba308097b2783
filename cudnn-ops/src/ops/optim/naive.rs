//! The naive half: PyTorch's single-tensor paths, one kernel per elementary op (`optim.cu`).
//!
//! AdamW, `torch.optim.AdamW(foreach=False, fused=False)` (`_single_tensor_adamw`), per tensor:
//! `param.mul_(1 − lr·wd)`, `exp_avg.lerp_(grad, 1 − β₁)`, `exp_avg_sq.mul_(β₂)`,
//! `exp_avg_sq.addcmul_(grad, grad, 1 − β₂)`, `denom = exp_avg_sq.sqrt()`, `/ bias_correction2_sqrt`,
//! `.add_(eps)`, `param.addcdiv_(exp_avg, denom, -step_size)`; with a clipping coefficient, the
//! gradient times it first; with a master copy, the update runs on it and `param.copy_(master)`
//! follows.
//!
//! The gradient norm, `clip_grad_norm_(foreach=False)`: `torch.linalg.vector_norm(g)` per tensor (one
//! reduction launch each: PyTorch's reduce kernel, blocks' partial sums finished by the last block to
//! arrive), `torch.stack` of the norms, `vector_norm` of the stack, then the coefficient
//! `clamp(max_norm / (total + 1e-6), max=1)` (an add, `reciprocal` and `mul` for the scalar division,
//! a `clamp`); clipping is `g.mul_(coefficient)` per tensor. N tensors: N + 6 kernels for the norm,
//! N more to clip.

use super::{
    adamw_addresses, grad_addresses, AdamWArgs, AdamWOperands, GradNormArgs, GradNormOperands, Grads,
};
use crate::checked;
use crate::dtype::Element;
use crate::kernels::{elementwise, launch, optional_ptr, scratch, Arg, Kernels};
use crate::ops::Naive;
use crate::{Cudnn, Result};
use cudarc::driver::LaunchConfig;

/// Threads and the most blocks of the eager per-tensor norm launch.
const NORM_THREADS: u32 = 512;
const NORM_BLOCKS: usize = 1024;

impl<P: Element, G: Element> Naive<(P, G)> for AdamWArgs {
    fn naive(self, ctx: &Cudnn, x: AdamWOperands<'_, P, G>) -> Result<()> {
        let (ps, gs) = (P::DTYPE.name(), G::DTYPE.name());
        let AdamWOperands { mut tensors, clip, .. } = x;
        let s = ctx.stream();
        let (addrs, _guards) = adamw_addresses(s, &mut tensors);
        let (c, _gc) = optional_ptr(clip, s);
        let AdamWArgs { lr, beta1, beta2, eps, weight_decay, .. } = self;
        let (step_size, bc2_sqrt) = self.corrections();
        let kernels = Kernels::get(ctx)?;
        let most = addrs.iter().map(|a| a.1).max().unwrap_or(0);
        // f32 scratch: denom, then the clipped gradient.
        let tmp = scratch(ctx, kernels, checked::product("adamw: eager scratch", &[most, 2])?.max(1))?;
        let (denom, clipped) = (tmp, tmp + 4 * most as u64);
        for ([p, g, m, v, w], n) in addrs {
            if n == 0 {
                continue;
            }
            let e = |name: &str, args: &[Arg]| elementwise(ctx, kernels, name, n, args);
            let (target, td) = if w != 0 { (w, "f32") } else { (p, ps) };
            e(
                &format!("adamw_eager_decay_{td}"),
                &[Arg::Ptr(target), Arg::F32((1.0 - lr * weight_decay) as f32)],
            )?;
            let (grad, gd) = if c != 0 {
                e(&format!("adamw_eager_scale_{gs}"), &[Arg::Ptr(g), Arg::Ptr(c), Arg::Ptr(clipped)])?;
                (clipped, "f32")
            } else {
                (g, gs)
            };
            e(
                &format!("adamw_eager_lerp_{gd}"),
                &[Arg::Ptr(m), Arg::Ptr(grad), Arg::F32((1.0 - beta1) as f32)],
            )?;
            e("adamw_eager_mul_f32", &[Arg::Ptr(v), Arg::F32(beta2 as f32)])?;
            e(
                &format!("adamw_eager_addcmul_{gd}"),
                &[Arg::Ptr(v), Arg::Ptr(grad), Arg::F32((1.0 - beta2) as f32)],
            )?;
            e("adamw_eager_sqrt_f32", &[Arg::Ptr(v), Arg::Ptr(denom)])?;
            e("adamw_eager_div_f32", &[Arg::Ptr(denom), Arg::F32(bc2_sqrt as f32)])?;
            e("add_scalar_f32", &[Arg::Ptr(denom), Arg::F32(eps as f32), Arg::Ptr(denom)])?;
            e(
                &format!("adamw_eager_addcdiv_{td}"),
                &[Arg::Ptr(target), Arg::Ptr(m), Arg::Ptr(denom), Arg::F32(-step_size as f32)],
            )?;
            if w != 0 {
                // param.copy_(master)
                let copy = if ps == "f32" { "copy_f32".to_string() } else { format!("cast_f32_{ps}") };
                e(&copy, &[Arg::Ptr(w), Arg::Ptr(p)])?;
            }
        }
        Ok(())
    }
}

impl<G: Element> Naive<G> for GradNormArgs {
    fn naive(self, ctx: &Cudnn, x: GradNormOperands<'_, G>) -> Result<()> {
        let sfx = G::DTYPE.name();
        let GradNormOperands { mut grads, norm, tables } = x;
        let clip = matches!(grads, Grads::Clip(_));
        let s = ctx.stream();
        let (addrs, _guards) = grad_addresses(s, &mut grads);
        let kernels = Kernels::get(ctx)?;
        let partial = tables.partial(ctx, NORM_BLOCKS)?;
        let counter = tables.counter(ctx)?;
        let (o, _go) = norm.device_ptr_mut(s);
        let tensors = addrs.len();
        // f32 scratch: the per-tensor norms, their stack, two scalar temporaries.
        let base = scratch(ctx, kernels, 2 * tensors + 2)?;
        let (norms, stack, t1, t2) =
            (base, base + 4 * tensors as u64, base + 8 * tensors as u64, base + 8 * tensors as u64 + 4);
        // vector_norm of a tensor: one launch; the empty tensor's norm is 0 (its one block writes it).
        let vector_norm = |sfx: &str, g: u64, n: usize, out: u64| {
            let blocks = n.div_ceil(NORM_THREADS as usize * 8).clamp(1, NORM_BLOCKS);
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (NORM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = [Arg::Ptr(g), Arg::I64(n as i64), Arg::Ptr(partial), Arg::Ptr(counter), Arg::Ptr(out)];
            launch(ctx, kernels, &format!("grad_norm_eager_{sfx}"), cfg, &args)
        };
        for (k, &(g, n)) in addrs.iter().enumerate() {
            vector_norm(sfx, g, n, norms + 4 * k as u64)?;
        }
        let coefficient = o + 4;
        if tensors == 0 {
            // clip_grad_norm_ of no gradients: a norm of 0 (torch.tensor(0.0)).
            elementwise(ctx, kernels, "bwd_fill_f32", 1, &[Arg::Ptr(o), Arg::F32(0.0)])?;
        } else {
            elementwise(ctx, kernels, "copy_f32", tensors, &[Arg::Ptr(norms), Arg::Ptr(stack)])?;
            vector_norm("f32", stack, tensors, o)?;
        }
        match self.max_norm {
            Some(max_norm) => {
                let one = |name: &str, args: &[Arg]| elementwise(ctx, kernels, name, 1, args);
                one("add_scalar_f32", &[Arg::Ptr(o), Arg::F32(1e-6), Arg::Ptr(t1)])?;
                one("clip_eager_reciprocal_f32", &[Arg::Ptr(t1), Arg::Ptr(t2)])?;
                one("clip_eager_mul_scalar_f32", &[Arg::Ptr(t2), Arg::F32(max_norm), Arg::Ptr(t1)])?;
                one("clip_eager_clamp_max_f32", &[Arg::Ptr(t1), Arg::F32(1.0), Arg::Ptr(coefficient)])?;
            }
            None => elementwise(ctx, kernels, "bwd_fill_f32", 1, &[Arg::Ptr(coefficient), Arg::F32(1.0)])?,
        }
        if clip {
            for &(g, n) in addrs.iter().filter(|a| a.1 > 0) {
                elementwise(
                    ctx,
                    kernels,
                    &format!("clip_eager_mul_{sfx}"),
                    n,
                    &[Arg::Ptr(g), Arg::Ptr(coefficient)],
                )?;
            }
        }
        Ok(())
    }
}
