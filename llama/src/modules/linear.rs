//! A linear layer and what its epilogue adds.

use super::norm::Normed;
use cudnn_llm_ops::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudnn_llm_ops::{
    matmul, quantize_fp8, Backend, Cudnn, DataType, Element, Epilogue, MatmulArgs, MatmulOperands, Prologue,
    QuantizeArgs, QuantizeOperands, Rotary, RotaryOperands, WeightScales, F8E4M3,
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

/// A Linear layer's weight `[out_features, in_features]` (row-major, as checkpoints store it): in the
/// model's dtype, or E4M3 codes with one dequantization factor per output channel or one for the
/// whole weight ([`Linear::fp8_weight`]).
pub(crate) enum Weight<T> {
    Plain(CudaSlice<T>),
    Fp8 { codes: CudaSlice<F8E4M3>, scales: CudaSlice<f32> },
}

/// A weight applied as `x · Wᵀ`.
pub(crate) struct Linear<T> {
    pub(crate) weight: Weight<T>,
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
    /// An all-reduce reads the output next ([`MatmulOperands::before_collective`]).
    before_collective: bool,
}

impl<T: Element> Linear<T> {
    pub(crate) fn new(weight: CudaSlice<T>, in_features: usize, out_features: usize) -> Self {
        Linear { weight: Weight::Plain(weight), in_features, out_features, before_collective: false }
    }

    /// The weight in the model's dtype (the embedding table, a tied `lm_head`); `None` once in FP8.
    pub(crate) fn plain(&self) -> Option<&CudaSlice<T>> {
        match &self.weight {
            Weight::Plain(w) => Some(w),
            Weight::Fp8 { .. } => None,
        }
    }

    /// The weight's element: the model's dtype or [`DataType::F8E4M3`].
    pub(crate) fn weight_dtype(&self) -> DataType {
        match self.weight {
            Weight::Plain(_) => T::DTYPE,
            Weight::Fp8 { .. } => DataType::F8E4M3,
        }
    }

    /// Bytes of the weight on the device (codes and factors in FP8).
    pub(crate) fn weight_bytes(&self) -> usize {
        let elems = self.in_features * self.out_features;
        match self.weight {
            Weight::Plain(_) => elems * T::DTYPE.size(),
            Weight::Fp8 { .. } => elems + 4 * self.out_features,
        }
    }

    /// The weight quantized to E4M3 with one factor per output channel (its row's largest
    /// magnitude over 448) or one for the whole weight (its largest magnitude over 448), on the
    /// device (`quantize_fp8`, the fused kernel); `None` for a weight already in FP8. The layer keeps
    /// its weight until [`Linear::set_weight`].
    pub(crate) fn fp8_weight(
        &self,
        ctx: &Cudnn,
        factors: WeightScales,
    ) -> cudnn_llm_ops::Result<Option<Weight<T>>> {
        let Weight::Plain(w) = &self.weight else { return Ok(None) };
        let (rows, cols) = (self.out_features, self.in_features);
        if !cols.is_multiple_of(16) {
            return Err(cudnn_llm_ops::Error::NotSupported {
                op: format!("an FP8 weight [{rows}, {cols}]"),
                reason: format!("{cols} input features: FP8 weights need a multiple of 16 (16-byte rows)"),
            });
        }
        let (args, count) = match factors {
            WeightScales::PerTensor => (QuantizeArgs::per_tensor(rows, cols), 1),
            WeightScales::PerChannel => (QuantizeArgs::per_row(rows, cols), rows),
            other => {
                return Err(cudnn_llm_ops::Error::NotSupported {
                    op: format!("an FP8 weight [{rows}, {cols}]"),
                    reason: format!(
                        "{other:?} factors: a model's FP8 weights take per-channel or per-tensor ones"
                    ),
                })
            }
        };
        let s = ctx.stream();
        let mut codes = s.alloc_zeros::<F8E4M3>(rows * cols)?;
        let mut scales = s.alloc_zeros::<f32>(count)?;
        quantize_fp8(ctx, args, QuantizeOperands::new(w, &mut codes, &mut scales), Backend::Fused)?;
        Ok(Some(Weight::Fp8 { codes, scales }))
    }

    /// Replaces the weight (dropping the old one).
    pub(crate) fn set_weight(&mut self, weight: Weight<T>) {
        self.weight = weight;
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

    /// The one matmul call: the prologue's norm weight and ε when given; the weight in the model's
    /// dtype or FP8 (`SwiGluOf`'s up weight in the same form).
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
        match &self.weight {
            Weight::Plain(w) => {
                let operands = MatmulOperands::new(x, w, out);
                self.run(backend, ctx, tokens, operands, norm, then, plain_up)
            }
            Weight::Fp8 { codes, scales } => {
                let operands = MatmulOperands::fp8_weight(x, codes, scales, out);
                self.run(backend, ctx, tokens, operands, norm, then, fp8_up)
            }
        }
    }

    /// [`Linear::call`] over the weight's operands; `up_of` gives `SwiGluOf`'s up weight (and its
    /// factors) in the same form.
    #[allow(clippy::too_many_arguments)]
    fn run<'a, W: Element>(
        &self,
        backend: Backend,
        ctx: &Cudnn,
        tokens: usize,
        mut operands: MatmulOperands<'a, T, T, W>,
        norm: Option<(&'a CudaSlice<T>, f32)>,
        then: Then<'a, T>,
        up_of: fn(&'a Linear<T>) -> cudnn_llm_ops::Result<UpWeight<'a, W>>,
    ) -> cudnn_llm_ops::Result<()> {
        let mut shape = MatmulArgs::linear(tokens, self.in_features, self.out_features);
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
                let (weight, scale) = up_of(up)?;
                let operands = operands.up_weight(weight);
                (Epilogue::SWIGLU, if let Some(s) = scale { operands.up_scale(s) } else { operands })
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
        shape.decode_gemv(T::DTYPE, self.weight_dtype(), T::DTYPE).is_ok()
    }

    /// Whether the fused decode GEMV takes this layer at one token with `rotary` as its epilogue
    /// (and the RMSNorm prologue with `norm`).
    pub(crate) fn takes_rotary(&self, norm: bool, rotary: Rotary) -> bool {
        let mut shape = MatmulArgs::linear(1, self.in_features, self.out_features).with_rotary(rotary);
        if norm {
            shape = shape.with_prologue(Prologue::rms_norm(1e-5));
        }
        shape.decode_gemv(T::DTYPE, self.weight_dtype(), T::DTYPE).is_ok()
    }
}

/// An up weight of the up product and its factors (FP8).
type UpWeight<'a, W> = (&'a dyn DevicePtr<W>, Option<&'a dyn DevicePtr<f32>>);

/// The up product's weight beside a gate weight in the model's dtype.
fn plain_up<T: Element>(up: &Linear<T>) -> cudnn_llm_ops::Result<UpWeight<'_, T>> {
    match &up.weight {
        Weight::Plain(u) => Ok((u, None)),
        Weight::Fp8 { .. } => Err(forms_differ(up)),
    }
}

/// The up product's weight and factors beside an FP8 gate weight.
fn fp8_up<T: Element>(up: &Linear<T>) -> cudnn_llm_ops::Result<UpWeight<'_, F8E4M3>> {
    match &up.weight {
        Weight::Fp8 { codes, scales } => Ok((codes, Some(scales))),
        Weight::Plain(_) => Err(forms_differ(up)),
    }
}

fn forms_differ<T: Element>(up: &Linear<T>) -> cudnn_llm_ops::Error {
    cudnn_llm_ops::Error::InvalidArgument(format!(
        "linear: the up weight is {}, the gate weight is not: both run in one GEMV",
        up.weight_dtype()
    ))
}
