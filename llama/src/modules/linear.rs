//! A linear layer and what its epilogue adds.

use super::norm::Normed;
use cudnn_llm_ops::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::{
    matmul, Backend, Cudnn, Element, Epilogue, MatmulArgs, MatmulOperands, Prologue, Rotary, RotaryOperands,
};
use std::ops::Range;

/// What a linear layer's epilogue does with `x · Wᵀ` (fused into the GEMM's graph, or one more naive
/// kernel).
pub(crate) enum Then<'a, T: Element> {
    /// Nothing: `x · Wᵀ`.
    Nothing,
    /// `silu(x · Wᵀ) · up` (the gate projection of a SwiGLU MLP).
    SwiGlu(&'a dyn DevicePtr<T>),
    /// `residual + x · Wᵀ`.
    AddTo(&'a dyn DevicePtr<T>),
    /// `silu(x · Wᵀ) · (x · W_upᵀ)`, both products in one decode GEMV (the up product; fused, one
    /// token).
    SwiGluOf(&'a Linear<T>),
    /// `x · Wᵀ` as one token's Q/K/V row, rotated and its K and V appended to the caches (the
    /// rotary epilogue; fused, one token).
    Rotate(Rotary, RotaryOperands<'a, T>),
}

/// A weight `[out_features, in_features]` (row-major, as checkpoints store it) applied as `x · Wᵀ`.
pub(crate) struct Linear<T> {
    pub(crate) weight: CudaSlice<T>,
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
    /// An all-reduce reads the output next ([`MatmulOperands::before_collective`]).
    before_collective: bool,
}

impl<T: Element> Linear<T> {
    pub(crate) fn new(weight: CudaSlice<T>, in_features: usize, out_features: usize) -> Self {
        Linear { weight, in_features, out_features, before_collective: false }
    }

    /// This layer with its output all-reduced next (a tensor-parallel rank's o_proj and down): its
    /// decode GEMV does not let the next kernel start early.
    pub(crate) fn before_collective(self, yes: bool) -> Self {
        Linear { before_collective: yes, ..self }
    }

    /// `out = then(x · Wᵀ)` over `tokens` rows of `x`, on `backend`.
    pub(crate) fn forward(
        &self,
        backend: Backend,
        ctx: &Cudnn,
        tokens: usize,
        x: &dyn DevicePtr<T>,
        then: Then<'_, T>,
        out: &mut dyn DevicePtrMut<T>,
    ) -> cudnn_llm_ops::Result<()> {
        self.call(backend, ctx, tokens, x, None, then, out)
    }

    /// `out = residual + x · Wᵀ` (`x · Wᵀ` without `residual`) over the rows `rows` of `x` and
    /// `residual`; `out` holds those rows only (a row-parallel projection's chunk, or every row).
    pub(crate) fn forward_rows(
        &self,
        backend: Backend,
        ctx: &Cudnn,
        rows: Range<usize>,
        x: &CudaSlice<T>,
        residual: Option<&CudaSlice<T>>,
        out: &mut dyn DevicePtrMut<T>,
    ) -> cudnn_llm_ops::Result<()> {
        let (i, o) = (self.in_features, self.out_features);
        let short = |what: &str, len: usize, width: usize| {
            cudnn_llm_ops::Error::InvalidArgument(format!(
                "linear rows {rows:?}: {what} holds {len} elements, not {} rows of {width}",
                rows.end
            ))
        };
        let x = x.try_slice(rows.start * i..rows.end * i).ok_or_else(|| short("x", x.len(), i))?;
        let residual = residual
            .map(|r| r.try_slice(rows.start * o..rows.end * o).ok_or_else(|| short("residual", r.len(), o)))
            .transpose()?;
        let then = residual.as_ref().map_or(Then::Nothing, |r| Then::AddTo(r));
        self.forward(backend, ctx, rows.len(), &x, then, out)
    }

    /// `out = then(input · Wᵀ)`: a folded norm runs in the fused GEMV (or, naive, first into its `h`).
    pub(crate) fn forward_normed(
        &self,
        backend: Backend,
        ctx: &Cudnn,
        tokens: usize,
        input: &mut Normed<'_, T>,
        then: Then<'_, T>,
        out: &mut dyn DevicePtrMut<T>,
    ) -> cudnn_llm_ops::Result<()> {
        match input {
            Normed::Done(h) => self.call(backend, ctx, tokens, *h, None, then, out),
            Normed::Folded { x, norm, .. } if backend == Backend::Fused => {
                self.call(backend, ctx, tokens, *x, Some((norm.weight(), norm.epsilon())), then, out)
            }
            Normed::Folded { x, norm, h } => {
                norm.apply(ctx, tokens, x, h, backend)?;
                self.call(backend, ctx, tokens, &**h, None, then, out)
            }
        }
    }

    /// The one matmul call: the prologue's norm weight and ε when given.
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        backend: Backend,
        ctx: &Cudnn,
        tokens: usize,
        x: &dyn DevicePtr<T>,
        norm: Option<(&CudaSlice<T>, f32)>,
        then: Then<'_, T>,
        out: &mut dyn DevicePtrMut<T>,
    ) -> cudnn_llm_ops::Result<()> {
        let mut shape = MatmulArgs::linear(tokens, self.in_features, self.out_features);
        let mut operands = MatmulOperands::new(x, &self.weight, out);
        if self.before_collective {
            operands = operands.before_collective();
        }
        if let Some((weight, eps)) = norm {
            shape = shape.with_prologue(Prologue::rms_norm(eps));
            operands = operands.norm_weight(weight);
        }
        let (epilogue, operands) = match then {
            Then::Nothing => (Epilogue::NONE, operands),
            Then::SwiGlu(up) => (Epilogue::SWIGLU, operands.up(up)),
            Then::AddTo(residual) => (Epilogue::RESIDUAL, operands.residual(residual)),
            Then::SwiGluOf(up) => {
                shape = shape.with_up_product();
                (Epilogue::SWIGLU, operands.up_weight(&up.weight))
            }
            Then::Rotate(rotary, r) => {
                shape = shape.with_rotary(rotary);
                (Epilogue::NONE, operands.rotary(r))
            }
        };
        matmul(ctx, &shape.with_epilogue(epilogue), operands, backend)
    }

    /// Whether the fused decode GEMV takes this layer at one token in the given form (with the
    /// RMSNorm prologue, with `up` as the up product).
    pub(crate) fn takes_decode_form(&self, norm: bool, up: bool) -> bool {
        let mut shape = MatmulArgs::linear(1, self.in_features, self.out_features);
        if norm {
            shape = shape.with_prologue(Prologue::rms_norm(1e-5));
        }
        if up {
            shape = shape.with_epilogue(Epilogue::SWIGLU).with_up_product();
        }
        shape.decode_gemv(T::DTYPE, T::DTYPE).is_ok()
    }

    /// Whether the fused decode GEMV takes this layer at one token with `rotary` as its epilogue
    /// (and the RMSNorm prologue with `norm`).
    pub(crate) fn takes_rotary(&self, norm: bool, rotary: Rotary) -> bool {
        let mut shape = MatmulArgs::linear(1, self.in_features, self.out_features).with_rotary(rotary);
        if norm {
            shape = shape.with_prologue(Prologue::rms_norm(1e-5));
        }
        shape.decode_gemv(T::DTYPE, T::DTYPE).is_ok()
    }
}
