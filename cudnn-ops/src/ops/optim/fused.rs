//! The fused half: one multi-tensor launch for AdamW, two (three with clipping) for the gradient
//! norm, over device tables of the tensors' addresses (`optim.cu`).

use super::{
    adamw_addresses, grad_addresses, grid, rows, AdamWArgs, AdamWOperands, GradNormArgs, GradNormOperands,
    Grads,
};
use crate::dtype::Element;
use crate::kernels::{launch, optional_ptr, Arg, Kernels};
use crate::ops::Fused;
use crate::{Cudnn, Result};
use cudarc::driver::LaunchConfig;

impl<P: Element, G: Element> Fused<(P, G)> for AdamWArgs {
    fn fused(self, ctx: &Cudnn, x: AdamWOperands<'_, P, G>) -> Result<()> {
        let (ps, gs) = (P::DTYPE.name(), G::DTYPE.name());
        let AdamWOperands { mut tensors, clip, tables } = x;
        let s = ctx.stream();
        let (addrs, _guards) = adamw_addresses(s, &mut tensors);
        let (c, _gc) = optional_ptr(clip, s);
        let (host, blocks, count) = rows(addrs.iter().map(|a| a.0), addrs.iter().map(|a| a.1))?;
        if count == 0 {
            return Ok(());
        }
        let kernels = Kernels::get(ctx)?;
        let table = tables.adamw.upload(ctx, host)?;
        let AdamWArgs { lr, beta1, beta2, eps, weight_decay, .. } = self;
        let (step_size, bc2_sqrt) = self.corrections();
        let f = |v: f64| Arg::F32(v as f32);
        let args = [
            Arg::Ptr(table),
            Arg::I64(count as i64),
            f(lr),
            f(beta1),
            f(beta2),
            f(eps),
            f(weight_decay),
            f(step_size),
            f(bc2_sqrt),
            Arg::Ptr(c),
        ];
        launch(ctx, kernels, &format!("adamw_{ps}_{gs}"), grid(blocks)?, &args)
    }
}

impl<G: Element> Fused<G> for GradNormArgs {
    fn fused(self, ctx: &Cudnn, x: GradNormOperands<'_, G>) -> Result<()> {
        let sfx = G::DTYPE.name();
        let GradNormOperands { mut grads, norm, tables } = x;
        let clip = matches!(grads, Grads::Clip(_));
        let s = ctx.stream();
        let (addrs, _guards) = grad_addresses(s, &mut grads);
        let (host, blocks, count) = rows(addrs.iter().map(|a| [0, a.0, 0, 0, 0]), addrs.iter().map(|a| a.1))?;
        let kernels = Kernels::get(ctx)?;
        let part = tables.partial(ctx, blocks)?;
        let table = tables.grads.upload(ctx, host)?;
        let (o, _go) = norm.device_ptr_mut(s);
        if count > 0 {
            launch(
                ctx,
                kernels,
                &format!("grad_sumsq_{sfx}"),
                grid(blocks)?,
                &[Arg::Ptr(table), Arg::I64(count as i64), Arg::Ptr(part)],
            )?;
        }
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let finish =
            [Arg::Ptr(part), Arg::I64(blocks as i64), Arg::F32(self.max_norm.unwrap_or(0.0)), Arg::Ptr(o)];
        launch(ctx, kernels, "grad_norm_finish", one, &finish)?;
        if clip && count > 0 {
            let scale = [Arg::Ptr(table), Arg::I64(count as i64), Arg::Ptr(o)];
            launch(ctx, kernels, &format!("grad_scale_{sfx}"), grid(blocks)?, &scale)?;
        }
        Ok(())
    }
}
