//! A Linear layer's three products (forward, data and weight gradients) over `rows` tokens, and the
//! add that gradients need where no op adds for them.

use crate::modules::linear::Then;
use cudnn_llm_ops::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::{
    linear_backward_data, linear_backward_weight, matmul, Backend, Cudnn, DataGrad, Element, Epilogue,
    LinearGradArgs, MatmulArgs, MatmulOperands, Result, WeightGrad,
};

/// `y[rows, out] = x[rows, inp] · W[out, inp]ᵀ`, W row-major as checkpoints store it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Linear {
    pub(crate) rows: usize,
    pub(crate) inp: usize,
    pub(crate) out: usize,
}

impl Linear {
    pub(crate) fn new(rows: usize, inp: usize, out: usize) -> Self {
        Linear { rows, inp, out }
    }

    /// `y = then(x · Wᵀ)`.
    pub(crate) fn forward<T: Element>(
        self,
        ctx: &Cudnn,
        b: Backend,
        x: &dyn DevicePtr<T>,
        w: &dyn DevicePtr<T>,
        then: Then<'_, T>,
        y: &mut dyn DevicePtrMut<T>,
    ) -> Result<()> {
        let mut shape = MatmulArgs::linear(self.rows, self.inp, self.out);
        let operands = MatmulOperands::new(x, w, y);
        let (epilogue, operands) = match then {
            Then::Nothing => (Epilogue::NONE, operands),
            Then::SwiGlu(up) => (Epilogue::SWIGLU, operands.up(up)),
            Then::AddTo(residual) => (Epilogue::RESIDUAL, operands.residual(residual)),
            Then::SwiGluOf(up) => {
                shape = shape.with_up_product();
                let up = up.plain().ok_or_else(|| cudnn_llm_ops::Error::NotSupported {
                    op: "training over FP8 weights".into(),
                    reason: "training runs the model's 16-bit weights".into(),
                })?;
                (Epilogue::SWIGLU, operands.up_weight(up))
            }
            Then::Rotate(rotary, r) => {
                shape = shape.with_rotary(rotary);
                (Epilogue::NONE, operands.rotary(r))
            }
        };
        matmul(ctx, &shape.with_epilogue(epilogue), operands, b)
    }

    fn grad_args(self, accumulate: bool) -> LinearGradArgs {
        let a = LinearGradArgs::new(self.rows, self.inp, self.out);
        if accumulate {
            a.accumulating()
        } else {
            a
        }
    }

    /// `dx = dy · W`, or `dx += dy · W` when `accumulate`.
    pub(crate) fn data_grad<T: Element>(
        self,
        ctx: &Cudnn,
        b: Backend,
        dy: &dyn DevicePtr<T>,
        w: &dyn DevicePtr<T>,
        dx: &mut dyn DevicePtrMut<T>,
        accumulate: bool,
    ) -> Result<()> {
        linear_backward_data(ctx, &self.grad_args(accumulate), DataGrad::new(dy, w, dx), b)
    }

    /// The f32 weight gradient `dW = dyᵀ · x`, or `dW += dyᵀ · x` when `accumulate`.
    pub(crate) fn weight_grad<T: Element>(
        self,
        ctx: &Cudnn,
        b: Backend,
        dy: &dyn DevicePtr<T>,
        x: &dyn DevicePtr<T>,
        dw: &mut dyn DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<()> {
        linear_backward_weight::<T, f32>(ctx, &self.grad_args(accumulate), WeightGrad::new(dy, x, dw), b)
    }
}

/// The widths of the identities [`add_into`] multiplies by, widest first.
const WIDTHS: [usize; 4] = [64, 32, 16, 8];

/// The identities [`add_into`] multiplies by, `64 × 64`, `32 × 32`, `16 × 16` and `8 × 8`, one after
/// the other, in `T`.
pub(crate) fn identities<T: Element>() -> Vec<T> {
    WIDTHS
        .iter()
        .flat_map(|&w| (0..w * w).map(move |i| T::from_f64(if i % (w + 1) == 0 { 1.0 } else { 0.0 })))
        .collect()
}

/// `y = x` or `y += x` (`accumulate`) over `n` elements (a multiple of 8), `x` in `T` and `y` in `T`
/// or f32: the data gradient of a Linear layer whose weight is a `w × w` identity of `eye`
/// ([`identities`]; the widest of 64, 32, 16 and 8 that divides `n`), `x` read as `[n / w, w]` rows.
/// The product is exact (one non-zero term per output, f32 accumulation), so `y` gets `x` converted,
/// or `y + x` rounded once by the GEMM's epilogue, which reads and writes `y` in place: the one add
/// the ops' calls do not fuse for a trainer (a norm weight's bf16 gradient into its f32 sum over
/// micro-batches, and, where cuDNN's norm backward cannot add the residual stream's gradient, that
/// add). Fused: one matmul graph; naive: a cuBLAS GEMM (and the eager add when accumulating).
pub(crate) fn add_into<T: Element, O: Element>(
    ctx: &Cudnn,
    b: Backend,
    eye: &CudaSlice<T>,
    x: &dyn DevicePtr<T>,
    y: &mut dyn DevicePtrMut<O>,
    n: usize,
    accumulate: bool,
) -> Result<()> {
    let Some(at) = WIDTHS.iter().position(|w| n.is_multiple_of(*w)) else {
        return Err(cudnn_llm_ops::Error::InvalidArgument(format!(
            "train: an add of {n} elements, not a multiple of 8"
        )));
    };
    let (w, offset) = (WIDTHS[at], WIDTHS[..at].iter().map(|w| w * w).sum::<usize>());
    let identity = eye.slice(offset..offset + w * w);
    let args = LinearGradArgs::new(n / w, w, w);
    let args = if accumulate { args.accumulating() } else { args };
    linear_backward_data(ctx, &args, DataGrad::new(x, &identity, y), b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identities_are_identities() {
        let e: Vec<f32> = identities();
        let mut at = 0;
        for w in WIDTHS {
            for r in 0..w {
                for c in 0..w {
                    assert_eq!(e[at + r * w + c], if r == c { 1.0 } else { 0.0 }, "{w}: ({r}, {c})");
                }
            }
            at += w * w;
        }
        assert_eq!(at, e.len());
    }
}
