//! The optimizer step and gradient clipping over many tensors at once (custom kernels).
//!
//! Fused: one launch covers every tensor. A [`MultiTensor`] keeps a device table of the tensors'
//! addresses and sizes (uploaded only when the list changes); each block of a launch takes
//! `OPT_CHUNK` (65536) consecutive elements of one tensor, found by a binary search over the table.
//! - [`MultiTensor::adamw`]: AdamW as `torch.optim.AdamW` computes it (decoupled weight decay, bias
//!   correction), bf16 or f32 parameters and gradients, f32 moments, an optional f32 master copy,
//!   optionally scaled by a clipping coefficient read on the device.
//! - [`MultiTensor::grad_norm`]: the global L2 norm of all gradients and `clip_grad_norm_`'s
//!   coefficient, two passes (per-block partial sums, then one block in a fixed order): no atomics,
//!   the same bits on every run.
//! - [`MultiTensor::clip_grads`]: the gradients scaled by that coefficient in place.
//!
//! Naive (AdamW only): `torch.optim.AdamW(foreach=False, fused=False)`, one tensor at a time and one
//! kernel per elementary op (`mul_`, `lerp_`, `mul_`, `addcmul_`, `sqrt`, `div`, `add_`, `addcdiv_`).

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

/// Elements per block of the multi-tensor kernels (`OPT_CHUNK` in optim.cu).
const CHUNK: usize = 65536;
/// 64-bit fields per tensor in the device table (`OPT_FIELDS`).
const FIELDS: usize = 8;
/// Threads per block of the multi-tensor kernels.
const THREADS: u32 = 512;

/// Kernels the eager AdamW launches per tensor (one more with a clipping coefficient, one more with a
/// master copy).
pub const NAIVE_KERNELS_PER_TENSOR: usize = 8;

/// AdamW's hyperparameters, as `torch.optim.AdamW` names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay, in `[0, 1)`.
    pub beta1: f64,
    /// Second-moment decay, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the bias-corrected RMS of the gradient (> 0).
    pub eps: f64,
    /// Decoupled weight decay: the parameter is multiplied by `1 − lr · weight_decay` first.
    pub weight_decay: f64,
}

impl AdamW {
    /// Checks the hyperparameters and the step (counted from 1).
    pub fn check(&self, step: u64) -> Result<()> {
        let AdamW { lr, beta1, beta2, eps, weight_decay } = *self;
        ensure!(step >= 1, "adamw: steps count from 1, not {step}");
        ensure!(lr.is_finite() && lr >= 0.0, "adamw: learning rate {lr}");
        ensure!(
            (0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2),
            "adamw: betas ({beta1}, {beta2}) must lie in [0, 1)"
        );
        ensure!(eps.is_finite() && eps > 0.0, "adamw: eps {eps} must be positive");
        ensure!(weight_decay.is_finite() && weight_decay >= 0.0, "adamw: weight decay {weight_decay}");
        Ok(())
    }
}

/// One tensor of an AdamW step: the parameter (bf16 or f32), its gradient (bf16 or f32), the f32
/// moments and, optionally, an f32 master copy that the update reads and writes (the parameter then
/// receives its rounding). All have the parameter's length.
pub struct AdamWTensor<'a, P, G> {
    /// The parameter.
    pub param: &'a mut CudaSlice<P>,
    /// Its gradient.
    pub grad: &'a CudaSlice<G>,
    /// First moment.
    pub m: &'a mut CudaSlice<f32>,
    /// Second moment.
    pub v: &'a mut CudaSlice<f32>,
    /// f32 master weights.
    pub master: Option<&'a mut CudaSlice<f32>>,
}

/// A device table of tensor addresses, re-uploaded only when its contents change.
#[derive(Default)]
struct Table {
    host: Vec<i64>,
    device: Option<CudaSlice<i64>>,
}

impl Table {
    /// Uploads `host` unless it is what the device holds; returns the table's address. The address is
    /// only valid for the current call (the caller holds the borrowed tensors for as long).
    fn upload(&mut self, ctx: &Cudnn, host: Vec<i64>) -> Result<u64> {
        if self.device.as_ref().is_none_or(|d| d.len() < host.len()) {
            self.device = None;
            self.device = Some(ctx.stream().alloc_zeros::<i64>(host.len())?);
            self.host.clear();
        }
        let dev = self.device.as_mut().expect("just allocated");
        if self.host != host {
            ctx.stream().memcpy_htod(&host, dev)?;
            self.host = host;
        }
        let (p, _g) = dev.device_ptr(ctx.stream());
        Ok(p)
    }
}

/// The rows of a multi-tensor table: per non-empty tensor its fields (addresses, length, first
/// block), and the blocks of the whole launch.
fn rows(
    fields: impl Iterator<Item = [u64; 5]>,
    lens: impl Iterator<Item = usize>,
) -> Result<(Vec<i64>, usize, usize)> {
    let (mut host, mut blocks, mut tensors) = (Vec::new(), 0usize, 0usize);
    for (f, n) in fields.zip(lens) {
        if n == 0 {
            continue;
        }
        let len = checked::to_i64("multi-tensor: tensor length", n)?;
        host.extend(f.iter().map(|&a| a as i64));
        host.extend([len, blocks as i64, 0]);
        blocks = checked::add("multi-tensor: blocks", blocks, n.div_ceil(CHUNK))?;
        tensors += 1;
    }
    checked::launch_dim("multi-tensor: blocks", blocks)?;
    ensure!(tensors <= i32::MAX as usize, "multi-tensor: {tensors} tensors");
    debug_assert_eq!(host.len(), tensors * FIELDS);
    Ok((host, blocks, tensors))
}

fn grid(blocks: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (checked::launch_dim("multi-tensor: blocks", blocks)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn suffix(op: &str, dtype: DataType, allowed: &[DataType]) -> Result<&'static str> {
    if allowed.contains(&dtype) {
        return Ok(dtype.name());
    }
    let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
    Err(Error::NotSupported { op: op.into(), reason: format!("takes {}, not {dtype}", names.join(" or ")) })
}

/// The device tables of the multi-tensor kernels and the grad norm's partial sums; keep one per
/// parameter set (a training loop's), so that the tables upload once.
#[derive(Default)]
pub struct MultiTensor {
    adamw: Table,
    grads: Table,
    partial: Option<CudaSlice<f32>>,
}

impl MultiTensor {
    /// Empty tables.
    pub fn new() -> Self {
        Self::default()
    }

    /// One AdamW step (`step` counts from 1) over every tensor. With `clip`, gradients are multiplied
    /// by `clip[1]` (the coefficient [`MultiTensor::grad_norm`] writes) as they are read; the
    /// gradient buffers are not changed.
    pub fn adamw<P: Element, G: Element>(
        &mut self,
        backend: Backend,
        ctx: &Cudnn,
        hp: AdamW,
        step: u64,
        tensors: &mut [AdamWTensor<'_, P, G>],
        clip: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        hp.check(step)?;
        let both = [DataType::BF16, DataType::F32];
        let (ps, gs) = (suffix("adamw", P::DTYPE, &both)?, suffix("adamw", G::DTYPE, &both)?);
        for (i, t) in tensors.iter().enumerate() {
            let n = t.param.len();
            ensure!(
                t.grad.len() == n && t.m.len() == n && t.v.len() == n,
                "adamw: tensor {i}: param {n}, grad {}, m {}, v {} elements differ",
                t.grad.len(),
                t.m.len(),
                t.v.len()
            );
            if let Some(w) = &t.master {
                ensure!(w.len() == n, "adamw: tensor {i}: master copy has {} elements, param {n}", w.len());
            }
        }
        if let Some(c) = clip {
            ensure!(
                c.len() >= 2,
                "adamw: the clipping buffer holds [norm, coefficient], got {} elements",
                c.len()
            );
        }
        let AdamW { lr, beta1, beta2, eps, weight_decay } = hp;
        let step_size = lr / (1.0 - beta1.powf(step as f64));
        let bc2_sqrt = (1.0 - beta2.powf(step as f64)).sqrt();
        let kernels = Kernels::get(ctx)?;
        let s = ctx.stream();
        let mut guards = Vec::new();
        let mut addrs = Vec::with_capacity(tensors.len());
        for t in tensors.iter_mut() {
            let n = t.param.len();
            let (p, g1) = t.param.device_ptr_mut(s);
            let (g, g2) = t.grad.device_ptr(s);
            let (m, g3) = t.m.device_ptr_mut(s);
            let (v, g4) = t.v.device_ptr_mut(s);
            let w = match t.master.as_mut() {
                Some(w) => {
                    let (w, g5) = w.device_ptr_mut(s);
                    guards.push(g5);
                    w
                }
                None => 0,
            };
            guards.extend([g1, g2, g3, g4]);
            addrs.push(([p, g, m, v, w], n));
        }
        let (c, _gc) = crate::kernels::optional_ptr(clip.map(|c| c as &dyn DevicePtr<f32>), s);
        match backend {
            Backend::Fused => {
                let (host, blocks, count) = rows(addrs.iter().map(|a| a.0), addrs.iter().map(|a| a.1))?;
                if count == 0 {
                    return Ok(());
                }
                let table = self.adamw.upload(ctx, host)?;
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
            Backend::Naive => {
                let most = addrs.iter().map(|a| a.1).max().unwrap_or(0);
                // f32 scratch: denom, then the clipped gradient.
                let tmp =
                    scratch(ctx, kernels, checked::product("adamw: eager scratch", &[most, 2])?.max(1))?;
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
                        e(
                            &format!("adamw_eager_scale_{gs}"),
                            &[Arg::Ptr(g), Arg::Ptr(c), Arg::Ptr(clipped)],
                        )?;
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
                    let update =
                        [Arg::Ptr(target), Arg::Ptr(m), Arg::Ptr(denom), Arg::F32(-step_size as f32)];
                    e(&format!("adamw_eager_addcdiv_{td}"), &update)?;
                    if w != 0 {
                        // param.copy_(master)
                        let copy =
                            if ps == "f32" { "copy_f32".to_string() } else { format!("cast_f32_{ps}") };
                        e(&copy, &[Arg::Ptr(w), Arg::Ptr(p)])?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The global L2 norm of `grads` into `out[0]` and the clipping coefficient
    /// `min(1, max_norm / (norm + 1e-6))` into `out[1]` (1 without `max_norm`), on the device:
    /// nothing is read back. Deterministic (two passes, no atomics).
    pub fn grad_norm<G: Element>(
        &mut self,
        ctx: &Cudnn,
        grads: &[&CudaSlice<G>],
        max_norm: Option<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let sfx = suffix("grad_norm", G::DTYPE, &[DataType::BF16, DataType::F16, DataType::F32])?;
        ensure!(
            out.len() >= 2,
            "grad_norm: the output holds [norm, coefficient], got {} elements",
            out.len()
        );
        if let Some(m) = max_norm {
            ensure!(m.is_finite() && m > 0.0, "grad_norm: max_norm {m} must be positive");
        }
        let s = ctx.stream();
        let ptrs: Vec<_> = grads.iter().map(|g| g.device_ptr(s)).collect();
        let (host, blocks, count) =
            rows(ptrs.iter().map(|(p, _)| [0, *p, 0, 0, 0]), grads.iter().map(|g| g.len()))?;
        let kernels = Kernels::get(ctx)?;
        if self.partial.as_ref().is_none_or(|p| p.len() < blocks.max(1)) {
            self.partial = None;
            self.partial = Some(s.alloc_zeros::<f32>(blocks.max(1))?);
        }
        let table = self.grads.upload(ctx, host)?;
        let (part, _gp) = self.partial.as_mut().expect("just allocated").device_ptr_mut(s);
        let (o, _go) = out.device_ptr_mut(s);
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
            [Arg::Ptr(part), Arg::I64(blocks as i64), Arg::F32(max_norm.unwrap_or(0.0)), Arg::Ptr(o)];
        launch(ctx, kernels, "grad_norm_finish", one, &finish)
    }

    /// Scales every gradient in place by `norm[1]`, the coefficient [`MultiTensor::grad_norm`] wrote
    /// (`clip_grad_norm_`'s multiplication).
    pub fn clip_grads<G: Element>(
        &mut self,
        ctx: &Cudnn,
        grads: &mut [&mut CudaSlice<G>],
        norm: &CudaSlice<f32>,
    ) -> Result<()> {
        let sfx = suffix("clip_grads", G::DTYPE, &[DataType::BF16, DataType::F16, DataType::F32])?;
        ensure!(
            norm.len() >= 2,
            "clip_grads: the norm buffer holds [norm, coefficient], got {} elements",
            norm.len()
        );
        let s = ctx.stream();
        let lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        let ptrs: Vec<_> = grads.iter_mut().map(|g| g.device_ptr_mut(s)).collect();
        let (host, blocks, count) = rows(ptrs.iter().map(|(p, _)| [0, *p, 0, 0, 0]), lens.into_iter())?;
        if count == 0 {
            return Ok(());
        }
        let kernels = Kernels::get(ctx)?;
        let table = self.grads.upload(ctx, host)?;
        let (c, _gc) = norm.device_ptr(s);
        launch(
            ctx,
            kernels,
            &format!("grad_scale_{sfx}"),
            grid(blocks)?,
            &[Arg::Ptr(table), Arg::I64(count as i64), Arg::Ptr(c)],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyperparameters_are_checked() {
        let hp = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        hp.check(1).unwrap();
        for (bad, step, expected) in [
            (hp, 0, "count from 1"),
            (AdamW { lr: f64::NAN, ..hp }, 1, "learning rate"),
            (AdamW { lr: -1.0, ..hp }, 1, "learning rate"),
            (AdamW { beta1: 1.0, ..hp }, 1, "betas"),
            (AdamW { beta2: -0.1, ..hp }, 1, "betas"),
            (AdamW { eps: 0.0, ..hp }, 1, "eps"),
            (AdamW { weight_decay: f64::INFINITY, ..hp }, 1, "weight decay"),
        ] {
            let e = bad.check(step).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected),
                "{expected}: {e}"
            );
        }
    }

    #[test]
    fn tables_skip_empty_tensors_and_count_blocks() {
        let fields = [[1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [9, 10, 11, 12, 13]];
        let (host, blocks, count) = rows(fields.into_iter(), [CHUNK + 1, 0, 3].into_iter()).unwrap();
        assert_eq!((blocks, count), (3, 2));
        assert_eq!(&host[..FIELDS], &[1, 2, 3, 4, 0, CHUNK as i64 + 1, 0, 0]);
        assert_eq!(&host[FIELDS..], &[9, 10, 11, 12, 13, 3, 2, 0]);
        // Blocks beyond a launch dimension are an error, not a wrapped grid.
        let e = rows([[0; 5]].into_iter(), [CHUNK << 31].into_iter()).unwrap_err();
        assert!(e.to_string().contains("launch dimension"), "{e}");
    }

    #[test]
    fn dtypes_outside_the_kernels_are_not_supported() {
        assert!(suffix("adamw", DataType::F16, &[DataType::BF16, DataType::F32])
            .unwrap_err()
            .is_not_supported());
        assert_eq!(suffix("adamw", DataType::BF16, &[DataType::BF16, DataType::F32]).unwrap(), "bf16");
    }
}
