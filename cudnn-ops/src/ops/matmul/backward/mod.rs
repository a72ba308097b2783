//! The backward of a Linear layer `y[tokens, out] = x[tokens, in] · W[out, in]ᵀ (+ bias)`, and of the
//! SwiGLU MLP's down projection, as matmul graphs over the stored layouts (no transposed copies):
//!
//! | call | product | A | B | D |
//! |---|---|---|---|---|
//! | [`linear_backward_data`] | `dX = dY · W` | dY `[1, tokens, out]` row-major | W `[1, out, in]`, the weight as stored | dX `[1, tokens, in]` |
//! | [`linear_backward_weight`] | `dW = dYᵀ · X` | dY read as `[1, out, tokens]` column-major (strides `[·, 1, out]`) | X `[1, tokens, in]` | dW `[1, out, in]`, the weight's layout |
//! | [`swiglu_down_backward`] | `d_act = dY · W_down`, then `d_up = d_act ⊙ silu(gate)`, `d_gate = silu'(gate) ⊙ d_act ⊙ up` | dY `[1, tokens, hidden]` | W_down `[1, hidden, inter]` as stored | d_gate, d_up `[1, tokens, inter]` |
//!
//! Both gradients can accumulate into an existing buffer (`beta = 1`, gradient accumulation over
//! micro-batches; [`LinearGradArgs::accumulating`]): the fused graph is the matmul with the residual
//! epilogue `D = A·B + R`, and the gradient buffer is bound as both R and D (each element is read and
//! written by the same epilogue thread, in f32, rounded once; cuBLASLt's in-place `C = D` the same
//! way). The buffer may be f32 or the input dtype. The bias gradient (the column sums of dY over the
//! tokens) is a separate reduction graph, added to the old bias gradient in the same way.
//!
//! The SwiGLU backward fuses into the data-gradient graph of the down projection (matmul, then SiLU,
//! two multiplies and cuDNN's SWISH backward on the f32 result, two outputs) where cuDNN builds that
//! graph; where it refuses, the call runs two graphs instead, the plain data gradient into an op-owned
//! f32 buffer and a pointwise graph reading it ([`SwigluForm`]; the refusal is remembered per shape,
//! dtype and cuDNN version, so it is tried once).
//!
//! Naive: the cuBLAS GEMMs of the forward's naive matmul, then one eager kernel per elementwise step
//! ([`naive`]).

mod fused;
pub mod naive;

pub use fused::SwigluForm;

use super::{BufferLens, Epilogue, MatmulArgs, MatrixLayout};
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::ops::Op;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::marker::PhantomData;

/// The shape of a Linear layer's backward, `y[tokens, out] = x[tokens, in] · W[out, in]ᵀ`, and whether
/// the gradients it writes add to what their buffers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct LinearGradArgs {
    /// Rows of x and y.
    pub tokens: usize,
    /// Columns of x (the weight's rows are this long).
    pub in_features: usize,
    /// Columns of y (rows of the weight).
    pub out_features: usize,
    /// Add the gradient to the output buffer's contents (`beta = 1`) instead of overwriting it.
    pub accumulate: bool,
}

impl LinearGradArgs {
    /// The backward of a `tokens × in → out` Linear layer, overwriting its outputs.
    pub fn new(tokens: usize, in_features: usize, out_features: usize) -> Self {
        LinearGradArgs { tokens, in_features, out_features, accumulate: false }
    }

    /// The same, adding to the gradient buffers (gradient accumulation).
    pub fn accumulating(self) -> Self {
        LinearGradArgs { accumulate: true, ..self }
    }

    fn epilogue(&self) -> Epilogue {
        if self.accumulate {
            Epilogue::RESIDUAL
        } else {
            Epilogue::NONE
        }
    }

    /// `dX = dY · W` as a matmul: dY `[1, tokens, out]` and the weight `[1, out, in]` as stored, both
    /// row-major; with the residual epilogue (R = D = dX) when accumulating.
    pub fn data_grad(&self) -> MatmulArgs {
        let (t, i, o) = (self.tokens, self.in_features, self.out_features);
        MatmulArgs::new(MatrixLayout::row_major(1, t, o), MatrixLayout::row_major(1, o, i))
            .with_epilogue(self.epilogue())
    }

    /// `dW = dYᵀ · X` as a matmul: dY read through its transposed view `[1, out, tokens]` (column-major,
    /// strides `[tokens·out, 1, out]`), X `[1, tokens, in]` row-major; D `[1, out, in]` is the weight's
    /// own layout. With the residual epilogue (R = D = dW) when accumulating.
    pub fn weight_grad(&self) -> MatmulArgs {
        let (t, i, o) = (self.tokens, self.in_features, self.out_features);
        MatmulArgs::new(MatrixLayout::column_major(1, o, t), MatrixLayout::row_major(1, t, i))
            .with_epilogue(self.epilogue())
    }

    /// `2 · tokens · in · out`, the floating-point operations of either gradient.
    pub fn flops(&self) -> f64 {
        2.0 * self.tokens as f64 * self.in_features as f64 * self.out_features as f64
    }

    /// Checks a data gradient's shapes, dtypes and buffer lengths (`T` in, `out` for dX); nothing is
    /// touched on error.
    pub fn check_data(&self, dtype: DataType, out: DataType, lens: &DataGradLens) -> Result<()> {
        self.check_shape("linear_backward_data")?;
        let m = self.data_grad();
        let lens = BufferLens {
            a: lens.dy,
            b: lens.weight,
            residual: self.accumulate.then_some(lens.dx),
            d: lens.dx,
            ..Default::default()
        };
        renamed(m.check(dtype, out, &lens), "linear_backward_data (A = dY, B = W, D = dX)")
    }

    /// Checks a weight gradient's shapes, dtypes and buffer lengths (`T` in, `out` for dW and the bias
    /// gradient); nothing is touched on error.
    pub fn check_weight(&self, dtype: DataType, out: DataType, lens: &WeightGradLens) -> Result<()> {
        self.check_shape("linear_backward_weight")?;
        let m = self.weight_grad();
        let mlens = BufferLens {
            a: lens.dy,
            b: lens.x,
            residual: self.accumulate.then_some(lens.dw),
            d: lens.dw,
            ..Default::default()
        };
        renamed(m.check(dtype, out, &mlens), "linear_backward_weight (A = dYᵀ, B = X, D = dW)")?;
        if let Some(len) = lens.dbias {
            ensure!(
                len == self.out_features,
                "linear_backward_weight: the bias gradient has {len} elements, out_features is {}",
                self.out_features
            );
        }
        Ok(())
    }

    /// Checks a SwiGLU down-projection backward (`in_features` is the MLP's intermediate size,
    /// `out_features` its hidden size); nothing is touched on error.
    pub fn check_swiglu(&self, dtype: DataType, lens: &SwigluGradLens) -> Result<()> {
        self.check_shape("swiglu_down_backward")?;
        ensure!(
            !self.accumulate,
            "swiglu_down_backward: d_gate and d_up are fresh gradients; accumulating into them is not an option"
        );
        let m = self.data_grad();
        let d = m.d_len();
        let mlens = BufferLens { a: lens.dy, b: lens.w_down, d, ..Default::default() };
        renamed(m.check(dtype, dtype, &mlens), "swiglu_down_backward (A = dY, B = W_down)")?;
        for (what, len) in
            [("gate", lens.gate), ("up", lens.up), ("d_gate", lens.d_gate), ("d_up", lens.d_up)]
        {
            ensure!(
                len >= d,
                "swiglu_down_backward: {what} has {len} elements, needs tokens*intermediate = {d}"
            );
        }
        Ok(())
    }

    fn check_shape(&self, op: &str) -> Result<()> {
        let LinearGradArgs { tokens, in_features, out_features, .. } = *self;
        ensure!(
            tokens > 0 && in_features > 0 && out_features > 0,
            "{op}: tokens {tokens}, in_features {in_features} and out_features {out_features} must all be > 0"
        );
        Ok(())
    }
}

/// Prefixes an argument error with what the matmul's A, B and D are in this gradient.
fn renamed(r: Result<()>, what: &str) -> Result<()> {
    r.map_err(|e| match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{what}: {m}")),
        other => other,
    })
}

/// Element counts of a data gradient's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DataGradLens {
    /// dY.
    pub dy: usize,
    /// The weight.
    pub weight: usize,
    /// dX.
    pub dx: usize,
}

/// Element counts of a weight gradient's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WeightGradLens {
    /// dY.
    pub dy: usize,
    /// X.
    pub x: usize,
    /// dW.
    pub dw: usize,
    /// The bias gradient, when given.
    pub dbias: Option<usize>,
}

/// Element counts of a SwiGLU down-projection backward's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct SwigluGradLens {
    /// dY (the down projection's output gradient).
    pub dy: usize,
    /// The down projection's weight.
    pub w_down: usize,
    /// The gate projection's output.
    pub gate: usize,
    /// The up projection's output.
    pub up: usize,
    /// d_gate.
    pub d_gate: usize,
    /// d_up.
    pub d_up: usize,
}

/// The buffers of a data gradient: dY and the weight in `T`, dX in `O` (`T` or f32).
#[non_exhaustive]
pub struct DataGrad<'a, T: Element, O: Element = T> {
    /// `[tokens, out]`.
    pub dy: &'a dyn DevicePtr<T>,
    /// `[out, in]`, as the forward read it.
    pub weight: &'a dyn DevicePtr<T>,
    /// `[tokens, in]`; read too when accumulating.
    pub dx: &'a mut dyn DevicePtrMut<O>,
}

impl<'a, T: Element, O: Element> DataGrad<'a, T, O> {
    /// dY and the weight in, dX out.
    pub fn new(
        dy: &'a dyn DevicePtr<T>,
        weight: &'a dyn DevicePtr<T>,
        dx: &'a mut dyn DevicePtrMut<O>,
    ) -> Self {
        DataGrad { dy, weight, dx }
    }

    /// The buffer lengths.
    pub fn lens(&self) -> DataGradLens {
        DataGradLens { dy: self.dy.len(), weight: self.weight.len(), dx: self.dx.len() }
    }
}

/// The buffers of a weight gradient: dY and X in `T`, dW (and the bias gradient) in `O` (`T` or f32,
/// e.g. an f32 gradient accumulator for bf16 weights).
#[non_exhaustive]
pub struct WeightGrad<'a, T: Element, O: Element = T> {
    /// `[tokens, out]`.
    pub dy: &'a dyn DevicePtr<T>,
    /// The forward's input, `[tokens, in]`.
    pub x: &'a dyn DevicePtr<T>,
    /// `[out, in]`, the weight's layout; read too when accumulating.
    pub dw: &'a mut dyn DevicePtrMut<O>,
    /// The bias gradient `[out]`, for a layer with a bias; read too when accumulating.
    pub dbias: Option<&'a mut dyn DevicePtrMut<O>>,
}

impl<'a, T: Element, O: Element> WeightGrad<'a, T, O> {
    /// dY and X in, dW out.
    pub fn new(dy: &'a dyn DevicePtr<T>, x: &'a dyn DevicePtr<T>, dw: &'a mut dyn DevicePtrMut<O>) -> Self {
        WeightGrad { dy, x, dw, dbias: None }
    }

    /// Also writes the bias gradient (the column sums of dY).
    pub fn bias(mut self, dbias: &'a mut dyn DevicePtrMut<O>) -> Self {
        self.dbias = Some(dbias);
        self
    }

    /// The buffer lengths.
    pub fn lens(&self) -> WeightGradLens {
        WeightGradLens {
            dy: self.dy.len(),
            x: self.x.len(),
            dw: self.dw.len(),
            dbias: self.dbias.as_ref().map(|b| b.len()),
        }
    }
}

/// The buffers of the SwiGLU MLP's backward through its down projection: `y = W_down · (silu(gate) ⊙
/// up)` per token, so dY `[tokens, hidden]`, W_down `[hidden, inter]` as stored, and the forward's
/// gate and up `[tokens, inter]` in; d_gate and d_up `[tokens, inter]` out, all in `T`.
#[non_exhaustive]
pub struct SwigluGrads<'a, T: Element> {
    /// The MLP output's gradient, `[tokens, hidden]`.
    pub dy: &'a dyn DevicePtr<T>,
    /// The down projection's weight, `[hidden, inter]`.
    pub w_down: &'a dyn DevicePtr<T>,
    /// The gate projection's output, `[tokens, inter]`.
    pub gate: &'a dyn DevicePtr<T>,
    /// The up projection's output, `[tokens, inter]`.
    pub up: &'a dyn DevicePtr<T>,
    /// The gradient of gate, `[tokens, inter]`.
    pub d_gate: &'a mut dyn DevicePtrMut<T>,
    /// The gradient of up, `[tokens, inter]`.
    pub d_up: &'a mut dyn DevicePtrMut<T>,
}

impl<'a, T: Element> SwigluGrads<'a, T> {
    /// The SwiGLU backward's buffers.
    pub fn new(
        dy: &'a dyn DevicePtr<T>,
        w_down: &'a dyn DevicePtr<T>,
        gate: &'a dyn DevicePtr<T>,
        up: &'a dyn DevicePtr<T>,
        d_gate: &'a mut dyn DevicePtrMut<T>,
        d_up: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        SwigluGrads { dy, w_down, gate, up, d_gate, d_up }
    }

    /// The buffer lengths.
    pub fn lens(&self) -> SwigluGradLens {
        SwigluGradLens {
            dy: self.dy.len(),
            w_down: self.w_down.len(),
            gate: self.gate.len(),
            up: self.up.len(),
            d_gate: self.d_gate.len(),
            d_up: self.d_up.len(),
        }
    }
}

/// Element types of the data-gradient phase (`Op<DataOf<T, O>>`).
pub(crate) struct DataOf<T, O>(PhantomData<(T, O)>);
/// Element types of the weight-gradient phase.
pub(crate) struct WeightOf<T, O>(PhantomData<(T, O)>);
/// Element type of the SwiGLU backward.
pub(crate) struct SwigluOf<T>(PhantomData<T>);

impl<T: Element, O: Element> Op<DataOf<T, O>> for LinearGradArgs {
    type Operands<'a> = DataGrad<'a, T, O>;

    fn checked(self, x: &DataGrad<'_, T, O>) -> Result<Self> {
        self.check_data(T::DTYPE, O::DTYPE, &x.lens())?;
        Ok(self)
    }
}

impl<T: Element, O: Element> Op<WeightOf<T, O>> for LinearGradArgs {
    type Operands<'a> = WeightGrad<'a, T, O>;

    fn checked(self, x: &WeightGrad<'_, T, O>) -> Result<Self> {
        self.check_weight(T::DTYPE, O::DTYPE, &x.lens())?;
        Ok(self)
    }
}

impl<T: Element> Op<SwigluOf<T>> for LinearGradArgs {
    type Operands<'a> = SwigluGrads<'a, T>;

    fn checked(self, x: &SwigluGrads<'_, T>) -> Result<Self> {
        self.check_swiglu(T::DTYPE, &x.lens())?;
        Ok(self)
    }
}

/// `dX = dY · W` (or `dX += dY · W` with [`LinearGradArgs::accumulating`]) on `backend`: the fused
/// matmul graph, or a cuBLAS GEMM (and one add kernel when accumulating).
pub fn linear_backward_data<T: Element, O: Element>(
    ctx: &Cudnn,
    args: &LinearGradArgs,
    x: DataGrad<'_, T, O>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<DataOf<T, O>, _>(ctx, *args, x, backend)
}

/// `dW = dYᵀ · X` and, with [`WeightGrad::bias`], `dbias = Σ_tokens dY` (or `+=` both with
/// [`LinearGradArgs::accumulating`]) on `backend`: the fused matmul graph and a reduction graph, or a
/// cuBLAS GEMM and a column-sum kernel (and one add kernel each when accumulating).
pub fn linear_backward_weight<T: Element, O: Element>(
    ctx: &Cudnn,
    args: &LinearGradArgs,
    x: WeightGrad<'_, T, O>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<WeightOf<T, O>, _>(ctx, *args, x, backend)
}

/// The SwiGLU MLP's backward through its down projection (`args` is the down projection's:
/// `in_features` the intermediate size, `out_features` the hidden size): d_gate and d_up from dY, the
/// down weight and the forward's gate and up. Fused: one graph where cuDNN builds it, else two
/// ([`SwigluForm`]); naive: a cuBLAS GEMM and four eager kernels. The weight gradient of the down
/// projection needs the forward's activation `silu(gate) ⊙ up` and is [`linear_backward_weight`]'s.
pub fn swiglu_down_backward<T: Element>(
    ctx: &Cudnn,
    args: &LinearGradArgs,
    x: SwigluGrads<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<SwigluOf<T>, _>(ctx, *args, x, backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(r: Result<()>, expected: &str) {
        let e = r.expect_err(expected);
        assert!(matches!(e, Error::InvalidArgument(_)), "{expected}: {e:?}");
        assert!(e.to_string().contains(expected), "expected `{expected}` in: {e}");
    }

    #[test]
    fn gradients_read_the_stored_layouts_through_strides() {
        let a = LinearGradArgs::new(32, 4096, 6144);
        let d = a.data_grad();
        assert_eq!((d.a.dims, d.a.strides), ([1, 32, 6144], [32 * 6144, 6144, 1]));
        assert_eq!((d.b.dims, d.b.strides), ([1, 6144, 4096], [6144 * 4096, 4096, 1]));
        assert_eq!((d.m(), d.k(), d.n(), d.epilogue), (32, 6144, 4096, Epilogue::NONE));
        let w = a.weight_grad();
        // dY [32, 6144] row-major read as its transpose [6144, 32]: unit stride along the rows.
        assert_eq!((w.a.dims, w.a.strides), ([1, 6144, 32], [6144 * 32, 1, 6144]));
        assert_eq!((w.b.dims, w.b.strides), ([1, 32, 4096], [32 * 4096, 4096, 1]));
        assert_eq!((w.m(), w.k(), w.n()), (6144, 32, 4096));
        assert_eq!(a.accumulating().weight_grad().epilogue, Epilogue::RESIDUAL);
        assert_eq!(a.accumulating().data_grad().epilogue, Epilogue::RESIDUAL);
        assert_eq!(a.flops(), d.flops());
        assert_eq!(a.flops(), w.flops());
    }

    #[test]
    fn argument_errors_name_the_gradient() {
        let (bf, f) = (DataType::BF16, DataType::F32);
        let a = LinearGradArgs::new(16, 64, 128);
        let data = DataGradLens { dy: 16 * 128, weight: 128 * 64, dx: 16 * 64 };
        a.check_data(bf, bf, &data).unwrap();
        a.accumulating().check_data(bf, f, &data).unwrap();
        invalid(a.check_data(bf, bf, &DataGradLens { dx: 16 * 64 - 1, ..data }), "linear_backward_data");
        invalid(a.check_data(bf, bf, &DataGradLens { weight: 10, ..data }), "B has 10 elements");
        invalid(LinearGradArgs::new(0, 64, 128).check_data(bf, bf, &data), "must all be > 0");
        // f16 gradients of bf16 inputs have no implementation.
        assert!(matches!(a.check_data(bf, DataType::F16, &data), Err(Error::NotSupported { .. })));

        let weight = WeightGradLens { dy: 16 * 128, x: 16 * 64, dw: 128 * 64, dbias: Some(128) };
        a.check_weight(bf, bf, &weight).unwrap();
        a.accumulating().check_weight(bf, f, &weight).unwrap();
        invalid(
            a.check_weight(bf, bf, &WeightGradLens { dbias: Some(64), ..weight }),
            "bias gradient has 64",
        );
        invalid(a.check_weight(bf, bf, &WeightGradLens { dw: 5, ..weight }), "output has 5 elements");
        invalid(a.check_weight(bf, bf, &WeightGradLens { x: 5, ..weight }), "linear_backward_weight");
        // The tokens are the weight gradient's inner dimension: 16-byte rows of dYᵀ.
        let odd = LinearGradArgs::new(15, 64, 128);
        let lens = WeightGradLens { dy: 15 * 128, x: 15 * 64, dw: 128 * 64, dbias: None };
        invalid(odd.check_weight(bf, bf, &lens), "misaligned k");

        let sw = SwigluGradLens {
            dy: 16 * 128,
            w_down: 128 * 64,
            gate: 16 * 64,
            up: 16 * 64,
            d_gate: 16 * 64,
            d_up: 16 * 64,
        };
        a.check_swiglu(bf, &sw).unwrap();
        invalid(a.check_swiglu(bf, &SwigluGradLens { up: 3, ..sw }), "up has 3 elements");
        invalid(a.check_swiglu(bf, &SwigluGradLens { d_gate: 3, ..sw }), "d_gate has 3 elements");
        invalid(a.accumulating().check_swiglu(bf, &sw), "not an option");
    }
}
