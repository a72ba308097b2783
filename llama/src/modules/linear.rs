//! A linear layer and what its epilogue adds.

use cudnn_llm_ops::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::{matmul, Backend, Cudnn, Element, Epilogue, MatmulArgs, MatmulOperands};

/// What a linear layer's epilogue does with `x · Wᵀ` (fused into the GEMM's graph, or one more naive
/// kernel).
pub(crate) enum Then<'a, T: Element> {
    /// Nothing: `x · Wᵀ`.
    Nothing,
    /// `silu(x · Wᵀ) · up` (the gate projection of a SwiGLU MLP).
    SwiGlu(&'a dyn DevicePtr<T>),
    /// `residual + x · Wᵀ`.
    AddTo(&'a dyn DevicePtr<T>),
}

/// A weight `[out_features, in_features]` (row-major, as checkpoints store it) applied as `x · Wᵀ`.
pub(crate) struct Linear<T> {
    pub(crate) weight: CudaSlice<T>,
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
}

impl<T: Element> Linear<T> {
    pub(crate) fn new(weight: CudaSlice<T>, in_features: usize, out_features: usize) -> Self {
        Linear { weight, in_features, out_features }
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
        let shape = MatmulArgs::linear(tokens, self.in_features, self.out_features);
        let operands = MatmulOperands::new(x, &self.weight, out);
        let (epilogue, operands) = match then {
            Then::Nothing => (Epilogue::NONE, operands),
            Then::SwiGlu(up) => (Epilogue::SWIGLU, operands.up(up)),
            Then::AddTo(residual) => (Epilogue::RESIDUAL, operands.residual(residual)),
        };
        matmul(ctx, &shape.with_epilogue(epilogue), operands, backend)
    }
}
