//! The optimizer step and gradient clipping over many tensors at once (custom kernels).
//!
//! | call | fused | naive |
//! |---|---|---|
//! | [`adamw`] | one multi-tensor launch | `torch.optim.AdamW(foreach=False, fused=False)`: 8 kernels per tensor |
//! | [`grad_norm`] | two launches (+1 to clip) | `clip_grad_norm_(foreach=False)`: a norm per tensor, stack, norm, 4 for the coefficient (+1 per tensor to clip) |
//!
//! Fused: one launch covers every tensor. A [`MultiTensor`] keeps a device table of the tensors'
//! addresses and sizes (uploaded only when the list changes); each block of a launch takes
//! `OPT_CHUNK` (65536) consecutive elements of one tensor, found by a binary search over the table.
//! - [`adamw`]: AdamW as `torch.optim.AdamW` computes it (decoupled weight decay, bias correction),
//!   bf16 or f32 parameters and gradients, f32 moments, an optional f32 master copy, optionally
//!   scaled by a clipping coefficient read on the device.
//! - [`grad_norm`]: the global L2 norm of all gradients and `clip_grad_norm_`'s coefficient, two
//!   passes (per-block partial sums, then one block in a fixed order): no atomics, the same bits on
//!   every run; with [`GradNormOperands::clip`] the gradients are then scaled in place.
//!
//! Naive (`naive.rs`): PyTorch's single-tensor paths, one kernel per elementary op, f32
//! intermediates. Eager's norm of a bf16 gradient is a bf16 tensor; the naive path keeps it in f32
//! (the same kernels and traffic, a more accurate result).

mod fused;
mod naive;

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::faults::Zeros;
use crate::ops::Op;
use crate::{Backend, Cudnn, Result};
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

/// One AdamW step, with `torch.optim.AdamW`'s hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct AdamWArgs {
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
    /// The step, counted from 1 (bias correction).
    pub step: u64,
}

impl AdamWArgs {
    /// Step 1 at learning rate `lr` with `torch.optim.AdamW`'s other defaults: betas `(0.9, 0.999)`,
    /// eps `1e-8`, weight decay `0.01`.
    pub fn new(lr: f64) -> Self {
        AdamWArgs { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 1 }
    }

    /// The same with moment decays `beta1` and `beta2`.
    pub fn with_betas(self, beta1: f64, beta2: f64) -> Self {
        AdamWArgs { beta1, beta2, ..self }
    }

    /// The same with `eps`.
    pub fn with_eps(self, eps: f64) -> Self {
        AdamWArgs { eps, ..self }
    }

    /// The same with decoupled weight decay `weight_decay`.
    pub fn with_weight_decay(self, weight_decay: f64) -> Self {
        AdamWArgs { weight_decay, ..self }
    }

    /// The same at step `step` (counted from 1).
    pub fn with_step(self, step: u64) -> Self {
        AdamWArgs { step, ..self }
    }

    /// Checks the hyperparameters and the step.
    pub fn check(&self) -> Result<()> {
        let AdamWArgs { lr, beta1, beta2, eps, weight_decay, step } = *self;
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

    /// `lr / (1 − β₁^step)` and `√(1 − β₂^step)`, as torch computes them.
    fn corrections(&self) -> (f64, f64) {
        let step_size = self.lr / (1.0 - self.beta1.powf(self.step as f64));
        (step_size, (1.0 - self.beta2.powf(self.step as f64)).sqrt())
    }
}

/// One tensor of an AdamW step: the parameter (bf16 or f32), its gradient (bf16 or f32), the f32
/// moments and, optionally, an f32 master copy that the update reads and writes (the parameter then
/// receives its rounding). All have the parameter's length.
#[non_exhaustive]
pub struct AdamWTensor<'a, P, G> {
    /// The parameter.
    pub param: &'a mut dyn DevicePtrMut<P>,
    /// Its gradient.
    pub grad: &'a dyn DevicePtr<G>,
    /// First moment.
    pub m: &'a mut dyn DevicePtrMut<f32>,
    /// Second moment.
    pub v: &'a mut dyn DevicePtrMut<f32>,
    /// f32 master weights.
    pub master: Option<&'a mut dyn DevicePtrMut<f32>>,
}

impl<'a, P, G> AdamWTensor<'a, P, G> {
    /// A tensor without a master copy.
    pub fn new(
        param: &'a mut dyn DevicePtrMut<P>,
        grad: &'a dyn DevicePtr<G>,
        m: &'a mut dyn DevicePtrMut<f32>,
        v: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        AdamWTensor { param, grad, m, v, master: None }
    }

    /// With an f32 master copy of the parameter.
    pub fn master(mut self, master: &'a mut dyn DevicePtrMut<f32>) -> Self {
        self.master = Some(master);
        self
    }
}

/// The buffers of an AdamW step: every tensor, an optional clipping buffer and the device tables.
#[non_exhaustive]
pub struct AdamWOperands<'a, P, G> {
    /// The tensors updated (empty ones are skipped).
    pub tensors: Vec<AdamWTensor<'a, P, G>>,
    /// `[norm, coefficient]` as [`grad_norm`] writes it: gradients are multiplied by the coefficient
    /// as they are read (the gradient buffers are not changed).
    pub clip: Option<&'a dyn DevicePtr<f32>>,
    /// The device tables of the fused launch (keep one per parameter set).
    pub tables: &'a mut MultiTensor,
}

impl<'a, P, G> AdamWOperands<'a, P, G> {
    /// The tensors of one step, unclipped.
    pub fn new(tables: &'a mut MultiTensor, tensors: Vec<AdamWTensor<'a, P, G>>) -> Self {
        AdamWOperands { tensors, clip: None, tables }
    }

    /// Gradients scaled by the coefficient in `clip[1]` (see [`AdamWOperands::clip`](#structfield.clip)).
    pub fn clip(mut self, clip: &'a dyn DevicePtr<f32>) -> Self {
        self.clip = Some(clip);
        self
    }
}

impl<P: Element, G: Element> Op<(P, G)> for AdamWArgs {
    type Operands<'a> = AdamWOperands<'a, P, G>;

    fn checked(self, x: &AdamWOperands<'_, P, G>) -> Result<Self> {
        self.check()?;
        let both = [DataType::BF16, DataType::F32];
        suffix("adamw", P::DTYPE, &both)?;
        suffix("adamw", G::DTYPE, &both)?;
        for (i, t) in x.tensors.iter().enumerate() {
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
        if let Some(c) = x.clip {
            ensure!(
                c.len() >= 2,
                "adamw: the clipping buffer holds [norm, coefficient], got {} elements",
                c.len()
            );
        }
        Ok(self)
    }
}

/// One AdamW step over every tensor of the operands on `backend`.
pub fn adamw<P: Element, G: Element>(
    ctx: &Cudnn,
    args: AdamWArgs,
    x: AdamWOperands<'_, P, G>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<(P, G), _>(ctx, args, x, backend)
}

/// The global gradient norm, as `torch.nn.utils.clip_grad_norm_` computes it (L2, `1e-6` added before
/// the division).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct GradNormArgs {
    /// The clipping threshold: the coefficient is `min(1, max_norm / (norm + 1e-6))`; without it the
    /// coefficient is 1 (the norm alone).
    pub max_norm: Option<f32>,
}

impl GradNormArgs {
    /// The norm alone (coefficient 1, nothing clipped).
    pub fn norm() -> Self {
        GradNormArgs { max_norm: None }
    }

    /// The norm and the clipping coefficient for threshold `max_norm`.
    pub fn clip(max_norm: f32) -> Self {
        GradNormArgs { max_norm: Some(max_norm) }
    }
}

/// The gradients of a [`grad_norm`] call: read (the norm and coefficient only), or scaled in place.
#[non_exhaustive]
pub enum Grads<'a, G> {
    /// Read only.
    Read(Vec<&'a dyn DevicePtr<G>>),
    /// Scaled in place by the coefficient after the norm (`clip_grad_norm_`).
    Clip(Vec<&'a mut dyn DevicePtrMut<G>>),
}

impl<G> Grads<'_, G> {
    fn lens(&self) -> Vec<usize> {
        match self {
            Grads::Read(g) => g.iter().map(|g| g.len()).collect(),
            Grads::Clip(g) => g.iter().map(|g| g.len()).collect(),
        }
    }
}

/// The buffers of a [`grad_norm`] call.
#[non_exhaustive]
pub struct GradNormOperands<'a, G> {
    /// The gradients (empty ones count for nothing).
    pub grads: Grads<'a, G>,
    /// f32 `[2]`: the norm, then the clipping coefficient, written on the device (nothing is read
    /// back; [`AdamWOperands::clip`] reads them there).
    pub norm: &'a mut dyn DevicePtrMut<f32>,
    /// The device tables of the fused launches, and the eager path's reduction counter.
    pub tables: &'a mut MultiTensor,
}

impl<'a, G> GradNormOperands<'a, G> {
    /// The norm and coefficient of `grads`, which are only read.
    pub fn new(
        tables: &'a mut MultiTensor,
        grads: Vec<&'a dyn DevicePtr<G>>,
        norm: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        GradNormOperands { grads: Grads::Read(grads), norm, tables }
    }

    /// `clip_grad_norm_`: the norm and coefficient, then every gradient scaled in place by it (needs
    /// [`GradNormArgs::max_norm`]).
    pub fn clip(
        tables: &'a mut MultiTensor,
        grads: Vec<&'a mut dyn DevicePtrMut<G>>,
        norm: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        GradNormOperands { grads: Grads::Clip(grads), norm, tables }
    }
}

impl<G: Element> Op<G> for GradNormArgs {
    type Operands<'a> = GradNormOperands<'a, G>;

    fn checked(self, x: &GradNormOperands<'_, G>) -> Result<Self> {
        suffix("grad_norm", G::DTYPE, &[DataType::BF16, DataType::F16, DataType::F32])?;
        ensure!(
            x.norm.len() >= 2,
            "grad_norm: the output holds [norm, coefficient], got {} elements",
            x.norm.len()
        );
        if let Some(m) = self.max_norm {
            ensure!(m.is_finite() && m > 0.0, "grad_norm: max_norm {m} must be positive");
        }
        ensure!(
            self.max_norm.is_some() || matches!(x.grads, Grads::Read(_)),
            "grad_norm: clipping in place needs a max_norm"
        );
        for (i, &n) in x.grads.lens().iter().enumerate() {
            checked::to_i64(&format!("grad_norm: tensor {i} length"), n)?;
        }
        Ok(self)
    }
}

/// The global L2 norm of the operands' gradients into `norm[0]` and `clip_grad_norm_`'s coefficient
/// into `norm[1]`, on the device; with [`GradNormOperands::clip`] the gradients are then multiplied
/// by the coefficient in place. Fused: deterministic (two passes, no atomics).
pub fn grad_norm<G: Element>(
    ctx: &Cudnn,
    args: GradNormArgs,
    x: GradNormOperands<'_, G>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<G, _>(ctx, args, x, backend)
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
            self.device = Some(ctx.stream().zeros::<i64>(host.len())?);
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
    crate::kernels::suffix_of(op, "tensors", dtype, allowed)
}

/// The device tables of the multi-tensor kernels, the grad norm's partial sums and the eager norm's
/// counter; keep one per parameter set (a training loop's), so that the tables upload once.
#[derive(Default)]
pub struct MultiTensor {
    adamw: Table,
    grads: Table,
    partial: Option<CudaSlice<f32>>,
    /// The eager per-tensor norm's finishing counter (zero between launches: its last block resets it).
    counter: Option<CudaSlice<u32>>,
}

impl MultiTensor {
    /// Empty tables.
    pub fn new() -> Self {
        Self::default()
    }

    /// An f32 buffer of at least `len` partial sums (grown, never shrunk), as a device address.
    fn partial(&mut self, ctx: &Cudnn, len: usize) -> Result<u64> {
        if self.partial.as_ref().is_none_or(|p| p.len() < len.max(1)) {
            self.partial = None;
            self.partial = Some(ctx.stream().zeros::<f32>(len.max(1))?);
        }
        let (p, _g) = self.partial.as_ref().expect("just allocated").device_ptr(ctx.stream());
        Ok(p)
    }

    /// The zeroed counter of the eager norm kernel, as a device address.
    fn counter(&mut self, ctx: &Cudnn) -> Result<u64> {
        if self.counter.is_none() {
            self.counter = Some(ctx.stream().zeros::<u32>(1)?);
        }
        let (p, _g) = self.counter.as_ref().expect("just allocated").device_ptr(ctx.stream());
        Ok(p)
    }
}

/// The device addresses of AdamW tensors (`[param, grad, m, v, master or 0]`) with their lengths, and
/// the guards that record the accesses when they drop.
fn adamw_addresses<'a, P, G>(
    s: &'a cudarc::driver::CudaStream,
    tensors: &'a mut [AdamWTensor<'_, P, G>],
) -> (Vec<([u64; 5], usize)>, Vec<cudarc::driver::SyncOnDrop<'a>>) {
    let mut guards = Vec::new();
    let mut addrs = Vec::with_capacity(tensors.len());
    for t in tensors.iter_mut() {
        let n = t.param.len();
        let (p, g1) = t.param.device_ptr_mut(s);
        let (g, g2) = t.grad.device_ptr(s);
        let (m, g3) = t.m.device_ptr_mut(s);
        let (v, g4) = t.v.device_ptr_mut(s);
        guards.extend([g1, g2, g3, g4]);
        let w = match t.master.as_mut() {
            Some(w) => {
                let (w, g5) = w.device_ptr_mut(s);
                guards.push(g5);
                w
            }
            None => 0,
        };
        addrs.push(([p, g, m, v, w], n));
    }
    (addrs, guards)
}

/// The device addresses of gradients with their lengths, and the guards of the accesses.
fn grad_addresses<'a, G>(
    s: &'a cudarc::driver::CudaStream,
    grads: &'a mut Grads<'_, G>,
) -> (Vec<(u64, usize)>, Vec<cudarc::driver::SyncOnDrop<'a>>) {
    let mut guards = Vec::new();
    let mut addrs = Vec::new();
    match grads {
        Grads::Read(gs) => {
            for g in gs.iter() {
                let (p, guard) = g.device_ptr(s);
                addrs.push((p, g.len()));
                guards.push(guard);
            }
        }
        Grads::Clip(gs) => {
            for g in gs.iter_mut() {
                let n = g.len();
                let (p, guard) = g.device_ptr_mut(s);
                addrs.push((p, n));
                guards.push(guard);
            }
        }
    }
    (addrs, guards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn hyperparameters_are_checked() {
        let hp = AdamWArgs { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 1 };
        hp.check().unwrap();
        for (bad, expected) in [
            (AdamWArgs { step: 0, ..hp }, "count from 1"),
            (AdamWArgs { lr: f64::NAN, ..hp }, "learning rate"),
            (AdamWArgs { lr: -1.0, ..hp }, "learning rate"),
            (AdamWArgs { beta1: 1.0, ..hp }, "betas"),
            (AdamWArgs { beta2: -0.1, ..hp }, "betas"),
            (AdamWArgs { eps: 0.0, ..hp }, "eps"),
            (AdamWArgs { weight_decay: f64::INFINITY, ..hp }, "weight decay"),
        ] {
            let e = bad.check().unwrap_err();
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
