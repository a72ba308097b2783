//! RoPE backward: the gradient of a rotation by θ is the rotation by −θ, applied in place to the
//! gradient of the Q and K heads of a QKV buffer (same [`RopeArgs`] and tables as the forward; V's
//! gradient is left as it is). Fused: the forward's kernel with the sine negated (f32 math, one
//! rounding). Naive: eager autograd of Hugging Face's `apply_rotary_pos_emb`, five kernels for Q
//! and five for K in the I/O dtype (`g·cos`, `g·sin`, `−` of the first half, `cat`, `+`).

use super::{suffix, RopeArgs, RopeTables};
use crate::dtype::Element;
use crate::kernels::{elementwise, scratch, Arg, Kernels};
use crate::ops::{Fused, Naive, Op};
use crate::{Backend, Cudnn, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Kernels the eager path launches per call.
pub const NAIVE_KERNELS: usize = 10;

/// The buffers of a RoPE backward call: the forward's tables and the gradient of its QKV buffer,
/// rotated in place (Q and K; V's gradient is left as it is).
#[non_exhaustive]
pub struct RopeBackwardOperands<'a, T: Element> {
    /// The cos/sin tables of the forward.
    pub tables: &'a RopeTables<T>,
    /// The gradient of the forward's output on entry, of its input on return.
    pub dqkv: &'a mut dyn DevicePtrMut<T>,
}

impl<'a, T: Element> RopeBackwardOperands<'a, T> {
    /// `dqkv` rotated in place with `tables`.
    pub fn new(tables: &'a RopeTables<T>, dqkv: &'a mut dyn DevicePtrMut<T>) -> Self {
        RopeBackwardOperands { tables, dqkv }
    }
}

/// The backward phase of the op's arguments (the forward's [`RopeArgs`]), for the dispatch.
struct Backward(RopeArgs);

impl<T: Element> Op<T> for Backward {
    type Operands<'a> = RopeBackwardOperands<'a, T>;

    fn checked(self, x: &RopeBackwardOperands<'_, T>) -> Result<Self> {
        self.0.check(x.dqkv.len(), x.tables.positions, x.tables.dim)?;
        suffix(T::DTYPE)?;
        Ok(self)
    }
}

/// Rotates the gradient of Q and K in the operands' `dqkv` by −θ in place on `backend`, with the
/// forward's arguments and tables.
pub fn rope_backward<T: Element>(
    ctx: &Cudnn,
    args: RopeArgs,
    x: RopeBackwardOperands<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, Backward(args), x, backend)
}

impl<T: Element> Fused<T> for Backward {
    fn fused(self, ctx: &Cudnn, x: RopeBackwardOperands<'_, T>) -> Result<()> {
        let RopeBackwardOperands { tables, dqkv } = x;
        let (g, _gg) = dqkv.device_ptr_mut(ctx.stream());
        super::fused::rotate(
            ctx,
            self.0,
            tables,
            g,
            (0, Default::default()),
            super::fused::Rotation::Backward,
        )
    }
}

impl<T: Element> Naive<T> for Backward {
    fn naive(self, ctx: &Cudnn, x: RopeBackwardOperands<'_, T>) -> Result<()> {
        let sfx = suffix(T::DTYPE)?;
        let kernels = Kernels::get(ctx)?;
        let RopeArgs { batch, seq, heads_q, heads_kv, head_dim: d, row_stride, start } = self.0;
        let RopeBackwardOperands { tables, dqkv } = x;
        let rows = batch * seq; // checked by `RopeArgs::check`, as every size below
        let (x, _gx) = dqkv.device_ptr_mut(ctx.stream());
        let i = |v: usize| Arg::I64(v as i64);
        let (c, _gc) = tables.cos_full.device_ptr(ctx.stream());
        let (s, _gs) = tables.sin_full.device_ptr(ctx.stream());
        let elem = T::DTYPE.size() as u64;
        // t1, t2, t4 hold rows · heads · d elements, t3 half of that (the forward's scratch size).
        let n = rows * heads_q.max(heads_kv) * d;
        let base = scratch(ctx, kernels, (n * 7 / 2 * T::DTYPE.size()).div_ceil(4))?;
        let (t1, t2, t3, t4) =
            (base, base + elem * n as u64, base + elem * (2 * n) as u64, base + elem * (5 * n / 2) as u64);
        for (offset, heads) in [(0, heads_q), (heads_q * d, heads_kv)] {
            let xh = x + elem * offset as u64;
            let n = rows * heads * d;
            let k = |name: &str| format!("{name}_{sfx}");
            let strided = |t: u64, table: u64| {
                [Arg::Ptr(xh), i(row_stride), i(seq), i(heads), i(d), i(start), Arg::Ptr(table), Arg::Ptr(t)]
            };
            elementwise(ctx, kernels, &k("rope_mul_cos"), n, &strided(t1, c))?;
            elementwise(ctx, kernels, &k("rope_bwd_mul_sin"), n, &strided(t2, s))?;
            elementwise(ctx, kernels, &k("rope_bwd_neg_first"), n / 2, &[Arg::Ptr(t2), i(d), Arg::Ptr(t3)])?;
            elementwise(
                ctx,
                kernels,
                &k("rope_bwd_cat"),
                n,
                &[Arg::Ptr(t2), Arg::Ptr(t3), i(d), Arg::Ptr(t4)],
            )?;
            let add = [Arg::Ptr(t1), Arg::Ptr(t4), i(row_stride), i(heads), i(d), Arg::Ptr(xh)];
            elementwise(ctx, kernels, &k("rope_add"), n, &add)?;
        }
        Ok(())
    }
}
