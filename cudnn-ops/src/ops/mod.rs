//! The ops, one room each. A room's `mod.rs` holds the arguments, their checks, the plan key and the
//! op's one public call per phase; `fused.rs` builds and binds the cuDNN graph (or launches the fused
//! custom kernel); `naive.rs` with its `.cu` is the eager baseline.
//!
//! | room | public call | fused | naive |
//! |---|---|---|---|
//! | [`rmsnorm`] | [`rms_norm`](rmsnorm::rms_norm) | `NORM_FORWARD` graph | 8 eager kernels ([`rmsnorm::naive`]) |
//! | | [`rms_norm_backward`](rmsnorm::rms_norm_backward) | `NORM_BACKWARD` graph (+ residual add, 9.21) | 19 eager autograd kernels |
//! | [`layernorm`] | [`layer_norm`](layernorm::layer_norm) | `NORM_FORWARD` (LAYER_NORM) graph | eager's one `layer_norm` kernel ([`layernorm::naive`]) |
//! | [`sdpa`] | [`sdpa`](sdpa::sdpa) | SDPA graph (unified or composite; paged K/V through page tables on the unified one); a decode: the split-KV kernel (one launch, contiguous or paged K/V) | math-path attention ([`sdpa::naive`]) |
//! | | [`sdpa_backward`](sdpa::sdpa_backward) | composite backward graph | math-path autograd ([`sdpa::naive`]) |
//! | [`matmul`] | [`matmul`](matmul::matmul) (B in A's dtype, or a Linear's FP8 weight with its factors) | matmul + epilogue graph; a custom GEMV for a Linear layer over at most 8 tokens ([`MatmulKernel`](matmul::MatmulKernel)), streaming FP8 codes where the weight is FP8 | cuBLAS GEMM + one kernel per step ([`matmul::naive`]); an FP8 weight dequantized first |
//! | | [`linear_backward_data`](matmul::linear_backward_data), [`linear_backward_weight`](matmul::linear_backward_weight), [`swiglu_down_backward`](matmul::swiglu_down_backward) | matmul graphs over transposed views, reduction (bias), matmul + SwiGLU backward graph | cuBLAS GEMMs + eager kernels ([`matmul::backward::naive`]) |
//! | [`quantize`] | [`quantize_fp8`](quantize::quantize_fp8) (FP8 codes and factors per row or per tensor) | one kernel per row; per tensor three | eager: cast, abs, amax, factor, divide, cast ([`quantize::naive`]) |
//! | [`scaled_matmul`] | [`scaled_matmul`](scaled_matmul::scaled_matmul) (FP8 A and B, per-tensor or per-channel scales) | FP8 matmul + scale multiplies graph | dequantize to bf16 (2 kernels) + cuBLAS GEMM ([`scaled_matmul::naive`]) |
//! | [`rope`] | [`rope`](rope::rope) | one custom kernel | 10 eager kernels |
//! | [`rows`] | [`embedding`](rows::embedding), [`write_cache`](rows::write_cache), [`gather_pages`](rows::gather_pages) (page pools and tables: [`PageTable`](rows::PageTable)) | one kernel, the same on both backends | |
//! | [`rope::backward`] | [`rope_backward`](rope::backward::rope_backward) | one custom kernel (rotation by −θ) | 10 eager kernels |
//! | [`rows::backward`] | [`embedding_backward`](rows::backward::embedding_backward) | atomic scatter-add or a deterministic tiled kernel | `embedding_dense_backward`: zeros, sort, segment sums |
//! | [`loss`] | [`cross_entropy`](loss::cross_entropy) (loss, or loss and gradient) | 3 launches, no f32 logits | `.float()`, `log_softmax`, `nll_loss` and their backward |
//! | [`argmax`] | [`argmax`](argmax::argmax) (greedy picks, optionally into the next step's input ids) | one kernel, a block per row, the same on both backends | |
//! | [`decode_layer`] | [`decode_layer`](decode_layer::decode_layer) (a whole decoder layer of a one-token step) | one persistent launch, grid barriers between its five phases | the layer's module calls (the decoder's own path; [`decode_layer::reference`] in f64) |
//! | [`optim`] | [`adamw`](optim::adamw), [`grad_norm`](optim::grad_norm) (norm, or norm and clip) | one multi-tensor launch each (+1 to clip) | single-tensor `AdamW`, `clip_grad_norm_(foreach=False)` |
//!
//! Every public call takes the op's arguments, an operands struct (inputs by name, outputs, optional
//! training outputs) and the [`Backend`]. Inside the crate, the arguments type implements `Op` (its
//! checks, in the room's `mod.rs`), `Fused` (in `fused.rs`) and `Naive` (in `naive.rs`); `ops::run`
//! checks once and dispatches, so the room's `mod.rs` never names its halves and the halves only import
//! `mod.rs`.

pub mod argmax;
pub mod decode_layer;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod optim;
pub mod quantize;
pub mod rmsnorm;
pub mod rope;
pub mod rows;
pub mod scaled_matmul;
pub mod sdpa;

use crate::{Backend, Cudnn, Result};

/// An op's arguments (shape, strides, options), with the checks both backends rely on. `E` names the
/// element types of the operands (`T`, or `(T, O)` for a matmul with another output type).
pub(crate) trait Op<E>: Sized {
    /// The buffers of one call: inputs by name, outputs, optional training outputs.
    type Operands<'a>;

    /// Checks the arguments against the operands (shapes, buffer lengths, dtypes, options); nothing is
    /// touched on error. Returns the arguments both halves run (e.g. a mask that hides nothing dropped).
    fn checked(self, x: &Self::Operands<'_>) -> Result<Self>;
}

/// An op's cuDNN half (the room's `fused.rs`): arguments already [`Op::checked`].
pub(crate) trait Fused<E>: Op<E> {
    /// Builds (once, through the plan cache) and executes the graph, or launches the fused kernel.
    fn fused(self, ctx: &Cudnn, x: Self::Operands<'_>) -> Result<()>;
}

/// An op's eager half (the room's `naive.rs`): arguments already [`Op::checked`].
pub(crate) trait Naive<E>: Op<E> {
    /// Launches the eager decomposition, one kernel per elementary op.
    fn naive(self, ctx: &Cudnn, x: Self::Operands<'_>) -> Result<()>;
}

/// The one dispatch: checks `args` against `x` once, then runs the half `backend` names.
pub(crate) fn run<E, A: Fused<E> + Naive<E>>(
    ctx: &Cudnn,
    args: A,
    x: A::Operands<'_>,
    backend: Backend,
) -> Result<()> {
    let args = args.checked(&x)?;
    match backend {
        Backend::Fused => args.fused(ctx, x),
        Backend::Naive => args.naive(ctx, x),
    }
}
