//! Rotary position embedding of Q and K in place, inside a fused QKV buffer. Fused: one custom kernel
//! (f32 math, one rounding). Naive: Hugging Face's `apply_rotary_pos_emb` as eager runs it, five kernels
//! for Q and five for K in the I/O dtype (`x·cos`, `-x₂`, `cat`, `·sin`, `+`).
//!
//! A QKV buffer holds one row per token: Q heads, then K heads, then V heads, each `head_dim` wide;
//! rows are `row_stride` elements apart. Row `r` of a call is the token at position
//! `start + r % seq` (batch-major rows).

pub mod backward;

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::naive::{elementwise, launch, scratch, Arg, Kernels};
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

/// Shape of a RoPE call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RopeArgs {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence in this call.
    pub seq: usize,
    /// Query heads (rotated), first in each row.
    pub heads_q: usize,
    /// Key heads (rotated), right after the query heads.
    pub heads_kv: usize,
    /// Head dim (even).
    pub head_dim: usize,
    /// Elements between consecutive tokens.
    pub row_stride: usize,
    /// Position of each sequence's first token in this call.
    pub start: usize,
}

/// The cos/sin tables both backends read, on the device: f32 `[positions, dim / 2]` for the fused
/// kernel, and `[positions, dim]` in the I/O dtype (both halves) for the eager path, as Hugging Face
/// casts them to the activations' dtype.
pub struct RopeTables<T> {
    positions: usize,
    dim: usize,
    cos_half: CudaSlice<f32>,
    sin_half: CudaSlice<f32>,
    cos_full: CudaSlice<T>,
    sin_full: CudaSlice<T>,
}

impl<T: Element> RopeTables<T> {
    /// Uploads host tables `cos`, `sin` of `[positions, dim / 2]` angles.
    pub fn new(ctx: &Cudnn, cos: &[f64], sin: &[f64], dim: usize) -> Result<Self> {
        ensure!(dim > 0 && dim.is_multiple_of(2), "rope: head dim {dim} must be even and > 0");
        let half = dim / 2;
        ensure!(
            cos.len() == sin.len() && cos.len().is_multiple_of(half),
            "rope: tables must be [positions, dim / 2]"
        );
        let full = |t: &[f64]| -> Vec<T> {
            t.chunks(half).flat_map(|row| row.iter().chain(row.iter()).map(|&v| T::from_f64(v))).collect()
        };
        let f32s = |t: &[f64]| t.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let s = ctx.stream();
        Ok(RopeTables {
            positions: cos.len() / half,
            dim,
            cos_half: s.clone_htod(&f32s(cos))?,
            sin_half: s.clone_htod(&f32s(sin))?,
            cos_full: s.clone_htod(&full(cos))?,
            sin_full: s.clone_htod(&full(sin))?,
        })
    }

    /// Positions covered.
    pub fn positions(&self) -> usize {
        self.positions
    }
}

impl RopeArgs {
    /// Checks the shape against the buffer length and the tables; every size is computed with checked
    /// arithmetic and checked to fit the kernels' index types (an overflow is an error, never a wrapped
    /// size that passes the length check).
    pub fn check(&self, len: usize, positions: usize, dim: usize) -> Result<()> {
        let RopeArgs { batch, seq, heads_q, heads_kv, head_dim, row_stride, start } = *self;
        ensure!(batch > 0 && seq > 0 && heads_q > 0 && heads_kv > 0, "rope: empty shape {self:?}");
        ensure!(head_dim == dim, "rope: head_dim {head_dim} differs from the tables' {dim}");
        ensure!(head_dim > 0 && head_dim.is_multiple_of(2), "rope: head dim {head_dim} must be even and > 0");
        let heads = checked::add("rope: heads_q + heads_kv", heads_q, heads_kv)?;
        let width = checked::mul("rope: (heads_q + heads_kv) * head_dim", heads, head_dim)?;
        // The fused kernel indexes a row's (head, pair)s with 32-bit integers.
        ensure!(
            width <= i32::MAX as usize,
            "rope: (heads_q + heads_kv) * head_dim = {width} exceeds the kernel's 32-bit row index"
        );
        ensure!(row_stride >= width, "rope: row stride {row_stride} is narrower than Q and K ({width})");
        let rows = checked::mul("rope: batch * seq", batch, seq)?;
        checked::launch_dim("rope: batch * seq (one block per row)", rows)?;
        let last = checked::mul("rope: (batch * seq - 1) * row_stride", rows - 1, row_stride)?;
        let need =
            checked::fits_i64("rope: buffer extent", checked::add("rope: buffer extent", last, width)?)?;
        ensure!(len >= need, "rope: buffer has {len} elements, needs {need}");
        let end = checked::add("rope: start + seq", start, seq)?;
        ensure!(end <= positions, "rope: positions up to {end} exceed the tables' {positions}");
        // The tables are f32 [positions, dim / 2] and [positions, dim] in the I/O dtype.
        checked::product("rope: tables' positions * head_dim", &[positions, head_dim, 4])?;
        // The eager path's scratch: 7/2 rows * heads * dim elements of the I/O dtype (at most 4 bytes).
        checked::product("rope: eager scratch", &[rows, heads_q.max(heads_kv), head_dim, 4 * 7])?;
        Ok(())
    }
}

/// Kernels the eager path launches per call.
pub const NAIVE_KERNELS: usize = 10;

fn suffix(dtype: DataType) -> Result<&'static str> {
    match dtype {
        DataType::BF16 => Ok("bf16"),
        DataType::F16 => Ok("f16"),
        other => {
            Err(Error::NotSupported { op: "rope".into(), reason: format!("takes f16 or bf16, not {other}") })
        }
    }
}

/// Rotates Q and K of `qkv` in place on the chosen backend.
pub fn rope_with<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: RopeArgs,
    tables: &RopeTables<T>,
    qkv: &mut (impl DevicePtrMut<T> + ?Sized),
) -> Result<()> {
    args.check(qkv.len(), tables.positions, tables.dim)?;
    rotate(backend, ctx, args, tables, qkv, None)
}

/// Rotates Q and K of `qkv` in place with the fused kernel, sequence `b` starting at position
/// `starts[b]` (device i32, one per sequence; `args.start` is not used). The positions are read on the
/// device when the kernel runs, so a captured CUDA graph serves every decode position; a row whose
/// position falls outside the tables is left unrotated (the kernel bounds it; no host check can).
pub fn rope_at<T: Element>(
    ctx: &Cudnn,
    args: RopeArgs,
    tables: &RopeTables<T>,
    qkv: &mut (impl DevicePtrMut<T> + ?Sized),
    starts: &CudaSlice<i32>,
) -> Result<()> {
    RopeArgs { start: 0, ..args }.check(qkv.len(), tables.positions, tables.dim)?;
    ensure!(
        starts.len() >= args.batch,
        "rope: {} start positions for {} sequences",
        starts.len(),
        args.batch
    );
    rotate(Backend::Fused, ctx, args, tables, qkv, Some(starts))
}

fn rotate<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: RopeArgs,
    tables: &RopeTables<T>,
    qkv: &mut (impl DevicePtrMut<T> + ?Sized),
    starts: Option<&CudaSlice<i32>>,
) -> Result<()> {
    let sfx = suffix(T::DTYPE)?;
    let kernels = Kernels::get(ctx)?;
    let RopeArgs { batch, seq, heads_q, heads_kv, head_dim: d, row_stride, start } = args;
    let rows = batch * seq;
    let (x, _gx) = qkv.device_ptr_mut(ctx.stream());
    let i = |v: usize| Arg::I64(v as i64);
    match backend {
        Backend::Fused => {
            let (c, _gc) = tables.cos_half.device_ptr(ctx.stream());
            let (s, _gs) = tables.sin_half.device_ptr(ctx.stream());
            let heads = heads_q + heads_kv;
            let (p, _gp) = crate::naive::optional_ptr(starts, ctx.stream());
            let a = [
                Arg::Ptr(x),
                i(row_stride),
                i(seq),
                i(heads),
                i(d),
                i(start),
                Arg::Ptr(p),
                i(tables.positions),
                Arg::Ptr(c),
                Arg::Ptr(s),
            ];
            // One block per row; enough warps for the row's pairs (40 heads x 64 pairs: 256 threads).
            let threads = (heads * d / 2).next_multiple_of(32).clamp(32, 256) as u32;
            let cfg = LaunchConfig {
                grid_dim: (checked::launch_dim("rope: rows", rows)?, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(ctx, kernels, &format!("rope_fused_{sfx}"), cfg, &a)
        }
        Backend::Naive => {
            let (c, _gc) = tables.cos_full.device_ptr(ctx.stream());
            let (s, _gs) = tables.sin_full.device_ptr(ctx.stream());
            let elem = T::DTYPE.size() as u64;
            // t1, t3, t4 hold rows · heads · d elements, t2 half of that, all in the I/O dtype (sized for
            // the wider of the Q and K passes).
            let n = rows * heads_q.max(heads_kv) * d;
            let base = scratch(ctx, kernels, (n * 7 / 2 * T::DTYPE.size()).div_ceil(4))?;
            let (t1, t2, t3, t4) = (
                base,
                base + elem * n as u64,
                base + elem * (3 * n / 2) as u64,
                base + elem * (5 * n / 2) as u64,
            );
            for (offset, heads) in [(0, heads_q), (heads_q * d, heads_kv)] {
                let xh = x + elem * offset as u64;
                let n = rows * heads * d;
                let k = |name: &str| format!("rope_{name}_{sfx}");
                elementwise(
                    ctx,
                    kernels,
                    &k("mul_cos"),
                    n,
                    &[
                        Arg::Ptr(xh),
                        i(row_stride),
                        i(seq),
                        i(heads),
                        i(d),
                        i(start),
                        Arg::Ptr(c),
                        Arg::Ptr(t1),
                    ],
                )?;
                elementwise(
                    ctx,
                    kernels,
                    &k("neg_half"),
                    n / 2,
                    &[Arg::Ptr(xh), i(row_stride), i(heads), i(d), Arg::Ptr(t2)],
                )?;
                elementwise(
                    ctx,
                    kernels,
                    &k("cat"),
                    n,
                    &[Arg::Ptr(t2), Arg::Ptr(xh), i(row_stride), i(heads), i(d), Arg::Ptr(t3)],
                )?;
                elementwise(
                    ctx,
                    kernels,
                    &k("mul_sin"),
                    n,
                    &[Arg::Ptr(t3), i(seq), i(heads), i(d), i(start), Arg::Ptr(s), Arg::Ptr(t4)],
                )?;
                elementwise(
                    ctx,
                    kernels,
                    &k("add"),
                    n,
                    &[Arg::Ptr(t1), Arg::Ptr(t4), i(row_stride), i(heads), i(d), Arg::Ptr(xh)],
                )?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_errors() {
        let a =
            RopeArgs { batch: 2, seq: 5, heads_q: 4, heads_kv: 2, head_dim: 32, row_stride: 256, start: 3 };
        let len = 9 * 256 + 6 * 32;
        a.check(len, 8, 32).unwrap();
        for (bad, l, expected) in [
            (a, len - 1, "needs"),
            // Wrapped `start + seq` would pass the table check and read position -1.
            (RopeArgs { start: usize::MAX, ..a }, len, "start + seq overflows"),
            (RopeArgs { start: usize::MAX - 4, ..a }, len, "start + seq overflows"),
            (RopeArgs { heads_kv: usize::MAX, ..a }, len, "heads_q + heads_kv overflows"),
            (RopeArgs { heads_kv: usize::MAX / 16, ..a }, len, "(heads_q + heads_kv) * head_dim overflows"),
            (RopeArgs { heads_q: 1 << 26, row_stride: 1 << 32, ..a }, usize::MAX, "32-bit row index"),
            (RopeArgs { batch: usize::MAX, ..a }, usize::MAX, "batch * seq overflows"),
            (RopeArgs { batch: 1 << 40, seq: 1, ..a }, usize::MAX, "launch dimension"),
            (RopeArgs { row_stride: usize::MAX / 4, ..a }, usize::MAX, "row_stride overflows"),
            (RopeArgs { row_stride: 1 << 62, seq: 1, batch: 3, ..a }, usize::MAX, "64-bit signed"),
            (RopeArgs { start: 4, ..a }, len, "exceed the tables' 8"),
            (RopeArgs { row_stride: 100, ..a }, len, "narrower"),
            (RopeArgs { seq: 0, ..a }, len, "empty shape"),
            (RopeArgs { head_dim: 16, ..a }, len, "differs from the tables"),
        ] {
            let e = bad.check(l, 8, 32).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        assert!(suffix(DataType::F32).unwrap_err().is_not_supported());
    }
}
