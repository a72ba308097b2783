//! Padded attention's run-time sequence lengths. cuDNN reads them on the device and bounds them by
//! nothing, so every length is first clamped into `0..=capacity` by a launch-only kernel
//! (`clamp_seq_lens` in `fused.cu`): either per call into a buffer of the context, or once into a
//! [`SeqLens`] that any number of calls then read (every layer of a decode step).

use crate::faults::Zeros;
use crate::kernels::{elementwise, Arg, Kernels};
use crate::{checked, Cudnn, Result};
use cudarc::driver::{CudaSlice, DevicePtr};

/// Where padded attention's sequence lengths come from.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum DeviceSeqLens<'a> {
    /// `(seq_len_q, seq_len_kv)`: device i32 buffers of `batch` values each, clamped by the call (one
    /// kernel) into a buffer of the context.
    Raw(&'a dyn DevicePtr<i32>, &'a dyn DevicePtr<i32>),
    /// Lengths clamped before, into capacities no larger than the call's.
    Clamped(&'a SeqLens),
}

/// Per-sequence lengths clamped into capacities, owned: [`SeqLens::clamp`] enqueues the clamp once
/// on the context's stream and later attention calls on that stream read the result, so a decode
/// step's layers share one clamp instead of one each. The buffer is never handed out, so what cuDNN
/// reads is always a clamped value (zeros before the first clamp).
pub struct SeqLens {
    buf: CudaSlice<i32>,
    batch: usize,
    kv_at: usize,
    capacities: (usize, usize),
}

/// Where the K/V half of a lengths buffer starts: 16-byte aligned (the alignment the graph declares).
pub(crate) fn kv_offset(batch: usize) -> usize {
    batch.next_multiple_of(4)
}

/// Enqueues `clamp_seq_lens`: the Q lengths into `out[0..batch]`, the K/V lengths into
/// `out[kv_at..kv_at + batch]`, each clamped into `0..=capacity`.
pub(crate) fn launch_clamp(
    ctx: &Cudnn,
    kernels: &Kernels,
    (seq_len_q, seq_len_kv): (&dyn DevicePtr<i32>, &dyn DevicePtr<i32>),
    (cap_q, cap_kv): (usize, usize),
    out: &CudaSlice<i32>,
    batch: usize,
) -> Result<()> {
    let (sq, _gq) = seq_len_q.device_ptr(ctx.stream());
    let (skv, _gkv) = seq_len_kv.device_ptr(ctx.stream());
    let (o, _go) = out.device_ptr(ctx.stream());
    let i = |v: usize| Arg::I64(v as i64); // each at most 2 * batch or a capacity, all < 2^31
    let a = [Arg::Ptr(sq), Arg::Ptr(skv), i(cap_q), i(cap_kv), i(kv_offset(batch)), Arg::Ptr(o)];
    elementwise(ctx, kernels, "clamp_seq_lens", batch, &a)
}

impl SeqLens {
    /// Zero lengths for `batch` sequences, to be clamped into `cap_q` queries and `cap_kv` keys.
    pub fn new(ctx: &Cudnn, batch: usize, cap_q: usize, cap_kv: usize) -> Result<Self> {
        crate::error::ensure!(batch > 0, "seq lens: no sequences");
        for (name, v) in [("batch", batch), ("query capacity", cap_q), ("key capacity", cap_kv)] {
            crate::error::ensure!(v <= i32::MAX as usize, "seq lens: {name} {v} exceeds i32");
        }
        let kv_at = kv_offset(batch);
        let len = checked::mul("seq lens: 2 * batch", 2, kv_at)?;
        let buf = ctx.stream().zeros::<i32>(len)?;
        Ok(SeqLens { buf, batch, kv_at, capacities: (cap_q, cap_kv) })
    }

    /// Enqueues the clamp of `seq_len_q` and `seq_len_kv` (device i32, at least `batch` values each).
    pub fn clamp(
        &mut self,
        ctx: &Cudnn,
        seq_len_q: &dyn DevicePtr<i32>,
        seq_len_kv: &dyn DevicePtr<i32>,
    ) -> Result<()> {
        for (name, len) in [("seq_len_q", seq_len_q.len()), ("seq_len_kv", seq_len_kv.len())] {
            crate::error::ensure!(
                len >= self.batch,
                "seq lens: {name} has {len} values, batch is {}",
                self.batch
            );
        }
        let kernels = Kernels::get(ctx)?;
        launch_clamp(ctx, kernels, (seq_len_q, seq_len_kv), self.capacities, &self.buf, self.batch)
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// `(queries, keys)` every length is clamped into.
    pub fn capacities(&self) -> (usize, usize) {
        self.capacities
    }

    /// The Q and K/V halves for `batch` sequences.
    pub(crate) fn halves(
        &self,
        batch: usize,
    ) -> (cudarc::driver::CudaView<'_, i32>, cudarc::driver::CudaView<'_, i32>) {
        (self.buf.slice(0..batch), self.buf.slice(self.kv_at..self.kv_at + batch))
    }
}
