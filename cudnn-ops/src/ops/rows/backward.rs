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
//! Ids outside the vocabulary add nothing (the forward gave them a zero row).

use super::EmbeddingArgs;
use crate::dtype::{DataType, Element};
use crate::kernels::{elementwise, launch, Arg, Kernels};
use crate::{checked, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Vocabulary rows per block of the deterministic kernel (`EMB_TILE` in backward.cu).
const TILE: usize = 32;

/// How the scatter-add resolves rows that share an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EmbeddingGrad {
    /// f32 atomics: fast, run-to-run differences in the last bits.
    Atomic,
    /// Token-order sums without atomics or sorting: bitwise reproducible.
    Deterministic,
}

/// The gradient of the `[vocab, hidden]` table from `dy [rows, hidden]` and the first `rows` device
/// ids, into `dtable` (f32), added to what it holds with `accumulate`, else overwriting it.
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward<T: Element>(
    ctx: &Cudnn,
    how: EmbeddingGrad,
    ids: &(impl DevicePtr<u32> + ?Sized),
    rows: usize,
    dy: &(impl DevicePtr<T> + ?Sized),
    vocab: usize,
    hidden: usize,
    dtable: &mut (impl DevicePtrMut<f32> + ?Sized),
    accumulate: bool,
) -> Result<()> {
    let sfx = match T::DTYPE {
        DataType::BF16 | DataType::F16 | DataType::F32 => T::DTYPE.name(),
        other => {
            return Err(Error::NotSupported {
                op: "embedding_backward".into(),
                reason: format!("takes bf16, f16 or f32 gradients, not {other}"),
            })
        }
    };
    // The forward's check with the roles of the buffers swapped: dy is the [rows, hidden] one.
    EmbeddingArgs { rows, vocab, hidden }.check(ids.len(), dtable.len(), dy.len())?;
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
