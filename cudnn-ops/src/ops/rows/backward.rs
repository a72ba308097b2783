//! Embedding backward: `dtable[ids[r]] += dy[r]`, a scatter-add into an f32 gradient of the
//! `[vocab, hidden]` table (dy in bf16, f16 or f32).
//!
//! - [`EmbeddingGrad::Atomic`]: one thread per element of `dy` and an f32 `atomicAdd` (what
//!   `index_add_` runs); rows of a repeated id land in the hardware's order, so the low bits vary
//!   between runs.
//! - [`EmbeddingGrad::Deterministic`]: sort-free, one block per tile of 32 vocabulary rows, the only
//!   writer of their gradient: it scans every id (in segments of 4096 tokens), compacts the tokens of
//!   its tile in token order with a block-wide ballot prefix, and adds their rows, each column by one
//!   thread. Every element is summed in token order: the same bits on every run. The scan reads
//!   `vocab / 32 · tokens` ids (from L2); a tile that holds most tokens serializes on its block.
//!
//! Both are [`Backend::Fused`]; [`Backend::Naive`] is eager's `embedding_dense_backward` for more than
//! 3072 ids (the dense path PyTorch takes at training token counts): `zeros` for the gradient, a
//! stable sort of the ids with their positions (cub's radix sort in PyTorch; here one rank kernel
//! with the same output), then a reduction over each run of equal ids that adds the run's `dy` rows
//! into its gradient row in sorted (token) order (PyTorch splits it into partial segments over four
//! kernels and two scans; here one kernel). No atomics: deterministic. The naive time is therefore a
//! lower bound of eager's, which runs 8 to 10 kernels where this runs 3.
//!
//! Ids outside the vocabulary add nothing (the forward gave them a zero row).

use super::EmbeddingArgs;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::kernels::{elementwise, launch, scratch, Arg, Kernels};
use crate::ops::{Fused, Naive, Op};
use crate::{checked, Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Vocabulary rows per block of the deterministic kernel (`EMB_TILE` in backward.cu).
const TILE: usize = 32;

/// How the scatter-add resolves rows that share an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EmbeddingGrad {
    /// f32 atomics: fast, run-to-run differences in the last bits.
    Atomic,
    /// Token-order sums without atomics or sorting: bitwise reproducible.
    Deterministic,
}

/// The buffers and options of an embedding backward call.
#[non_exhaustive]
pub struct EmbeddingBackwardOperands<'a, T: Element> {
    /// The forward's token ids on the device.
    pub ids: &'a dyn DevicePtr<u32>,
    /// `[rows, hidden]`: the gradient of the forward's output.
    pub dy: &'a dyn DevicePtr<T>,
    /// f32 `[vocab, hidden]`: the gradient of the table.
    pub dtable: &'a mut dyn DevicePtrMut<f32>,
    /// Adds to what `dtable` holds (gradient accumulation) instead of overwriting it.
    pub accumulate: bool,
    /// How the fused backend resolves repeated ids (the naive one is always deterministic).
    pub how: EmbeddingGrad,
}

impl<'a, T: Element> EmbeddingBackwardOperands<'a, T> {
    /// Overwrites `dtable` with the gradient, atomically summed.
    pub fn new(
        ids: &'a dyn DevicePtr<u32>,
        dy: &'a dyn DevicePtr<T>,
        dtable: &'a mut dyn DevicePtrMut<f32>,
    ) -> Self {
        EmbeddingBackwardOperands { ids, dy, dtable, accumulate: false, how: EmbeddingGrad::Atomic }
    }

    /// Adds the gradient to what `dtable` holds.
    pub fn accumulate(mut self) -> Self {
        self.accumulate = true;
        self
    }

    /// Resolves repeated ids as `how` says (fused backend).
    pub fn how(mut self, how: EmbeddingGrad) -> Self {
        self.how = how;
        self
    }
}

/// The backward phase of the lookup's arguments, for the dispatch.
struct Backward(EmbeddingArgs);

fn suffix(dtype: DataType) -> Result<&'static str> {
    crate::kernels::float_suffix("embedding_backward", "gradients", dtype)
}

impl<T: Element> Op<T> for Backward {
    type Operands<'a> = EmbeddingBackwardOperands<'a, T>;

    fn checked(self, x: &EmbeddingBackwardOperands<'_, T>) -> Result<Self> {
        suffix(T::DTYPE)?;
        // The forward's check with the roles of the buffers swapped: dy is the [rows, hidden] one.
        self.0.check(x.ids.len(), x.dtable.len(), x.dy.len())?;
        // The eager path sorts (id, position) pairs of i32 in the f32 scratch.
        ensure!(
            self.0.rows <= i32::MAX as usize,
            "embedding_backward: {} rows exceed i32 positions",
            self.0.rows
        );
        Ok(self)
    }
}

/// The gradient of the `[vocab, hidden]` table of a lookup with `args` ([`EmbeddingArgs`]), from
/// `dy [rows, hidden]` and the first `rows` device ids, into the operands' f32 `dtable`, on `backend`.
pub fn embedding_backward<T: Element>(
    ctx: &Cudnn,
    args: EmbeddingArgs,
    x: EmbeddingBackwardOperands<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, Backward(args), x, backend)
}

impl<T: Element> Fused<T> for Backward {
    fn fused(self, ctx: &Cudnn, x: EmbeddingBackwardOperands<'_, T>) -> Result<()> {
        let sfx = suffix(T::DTYPE)?;
        let EmbeddingArgs { rows, vocab, hidden } = self.0;
        let EmbeddingBackwardOperands { ids, dy, dtable, accumulate, how } = x;
        let n = rows * hidden; // checked by EmbeddingArgs::check
        let kernels = Kernels::get(ctx)?;
        let (i, _gi) = ids.device_ptr(ctx.stream());
        let (g, _gg) = dy.device_ptr(ctx.stream());
        let (t, _gt) = dtable.device_ptr_mut(ctx.stream());
        // Ids are u32: a vocabulary above u32::MAX bounds nothing more than u32::MAX does.
        let bound = vocab.min(u32::MAX as usize) as i64;
        let table = vocab * hidden; // checked by EmbeddingArgs::check
        match how {
            EmbeddingGrad::Atomic => {
                if !accumulate {
                    elementwise(ctx, kernels, "bwd_fill_f32", table, &[Arg::Ptr(t), Arg::F32(0.0)])?;
                }
                let args = [Arg::Ptr(i), Arg::Ptr(g), Arg::I64(bound), Arg::I64(hidden as i64), Arg::Ptr(t)];
                elementwise(ctx, kernels, &format!("embedding_backward_atomic_{sfx}"), n, &args)
            }
            EmbeddingGrad::Deterministic => {
                let cfg = LaunchConfig {
                    grid_dim: (
                        checked::launch_dim("embedding_backward: vocabulary tiles", vocab.div_ceil(TILE))?,
                        1,
                        1,
                    ),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let args = [
                    Arg::Ptr(i),
                    Arg::I64(rows as i64),
                    Arg::Ptr(g),
                    Arg::I64(bound),
                    Arg::I64(hidden as i64),
                    Arg::Ptr(t),
                    Arg::I64(accumulate as i64),
                ];
                launch(ctx, kernels, &format!("embedding_backward_det_{sfx}"), cfg, &args)
            }
        }
    }
}

/// Threads per block of the eager rank sort.
const SORT_THREADS: u32 = 256;

impl<T: Element> Naive<T> for Backward {
    fn naive(self, ctx: &Cudnn, x: EmbeddingBackwardOperands<'_, T>) -> Result<()> {
        let sfx = suffix(T::DTYPE)?;
        let EmbeddingArgs { rows, vocab, hidden } = self.0;
        if vocab > i32::MAX as usize {
            return Err(Error::NotSupported {
                op: "embedding_backward".into(),
                reason: format!("the eager sort keeps ids as i32; a vocabulary of {vocab} does not fit"),
            });
        }
        let EmbeddingBackwardOperands { ids, dy, dtable, accumulate, .. } = x;
        let kernels = Kernels::get(ctx)?;
        let (i, _gi) = ids.device_ptr(ctx.stream());
        let (g, _gg) = dy.device_ptr(ctx.stream());
        let (t, _gt) = dtable.device_ptr_mut(ctx.stream());
        let bound = vocab.min(u32::MAX as usize) as i64;
        let (n, table) = (rows * hidden, vocab * hidden); // checked by EmbeddingArgs::check
                                                          // i32 scratch: the sorted ids, then their positions.
        let sorted = scratch(ctx, kernels, 2 * rows)?;
        let order = sorted + 4 * rows as u64;
        if !accumulate {
            elementwise(ctx, kernels, "bwd_fill_f32", table, &[Arg::Ptr(t), Arg::F32(0.0)])?;
        }
        let cfg = LaunchConfig {
            grid_dim: (
                checked::launch_dim("embedding_backward: sort blocks", rows.div_ceil(SORT_THREADS as usize))?,
                1,
                1,
            ),
            block_dim: (SORT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let sort = [Arg::Ptr(i), Arg::I64(rows as i64), Arg::I64(bound), Arg::Ptr(sorted), Arg::Ptr(order)];
        launch(ctx, kernels, "embedding_eager_sort", cfg, &sort)?;
        let sum = [
            Arg::Ptr(sorted),
            Arg::Ptr(order),
            Arg::I64(rows as i64),
            Arg::Ptr(g),
            Arg::I64(bound),
            Arg::I64(hidden as i64),
            Arg::Ptr(t),
        ];
        elementwise(ctx, kernels, &format!("embedding_eager_segment_sum_{sfx}"), n, &sum)
    }
}
