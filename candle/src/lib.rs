//! cuDNN's fused ops on candle tensors: [`rms_norm`], [`sdpa`] and [`sdpa_padded`] (causal,
//! grouped-query heads, strided Q/K/V, per-sequence lengths) and [`linear`] (bias, activation, gate and
//! residual fused into the product), each a forward op returning a new candle tensor.
//!
//! On a CUDA tensor (feature `cuda`) an op binds candle's device buffers into the library's op and
//! enqueues it on candle's own stream: no copy, no synchronization between candle's kernels and these.
//! Each thread keeps one cuDNN context per candle device, with its plan cache (the first call of a
//! shape builds a plan; later calls reuse it). On a CPU tensor an op runs the library's f64 reference
//! and rounds once to the tensor's dtype, so the same model code runs, slowly, without a GPU.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use cudnn_llm_candle::{sdpa, Attention, Causal};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::new_cuda(0)?;
//! // Llama-3.2-1B's attention: 32 query heads over 8 K/V heads of 64, a 128-token prompt.
//! let q = Tensor::randn(0f32, 1.0, (1, 128, 32, 64), &dev)?.to_dtype(DType::BF16)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 128, 8, 64), &dev)?.to_dtype(DType::BF16)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 128, 8, 64), &dev)?.to_dtype(DType::BF16)?;
//! // [b, s, h, d] as the projections write it, viewed as [b, h, s, d]: no copy.
//! let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
//! let o = sdpa(&q, &k, &v, &Attention::causal(Causal::TopLeft))?; // [1, 32, 128, 64]
//! # Ok(())
//! # }
//! ```
//!
//! Shapes candle can express and these ops cannot run (an f32 attention, a head dimension cuDNN does
//! not take) are an error naming them, or, with [`Fallback::Candle`], the same function computed by
//! candle's own ops. A Linear on the GPU takes in- and out-features that are multiples of 8 (16-byte
//! rows).
//!
//! The ops are forward only: their outputs carry no gradient (candle's `*_no_bwd`), so they serve
//! inference; a model trained through them would not train what lies before them.
#![deny(missing_docs)]

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod shapes;

#[cfg(feature = "cuda")]
pub use cuda::release_contexts;

pub use cudnn_llm_ops::Backend;
pub use shapes::{Activation, Causal};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};

/// What an op does with a shape or dtype the fused path cannot run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Fallback {
    /// Return the error, which names what was refused.
    #[default]
    Error,
    /// Compute the same function with candle's own ops.
    Candle,
}

/// Attention options: the mask, the scale, what runs, and what to do where it cannot.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Attention {
    /// The causal mask, if any.
    pub causal: Causal,
    /// The scores' scale; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// The library's fused path (cuDNN) or its naive one (one kernel per step, as PyTorch eager does).
    pub backend: Backend,
    /// Where the fused path refuses the call.
    pub fallback: Fallback,
}

impl Default for Attention {
    /// No mask, the default scale, fused, no fallback.
    fn default() -> Self {
        Attention { causal: Causal::None, scale: None, backend: Backend::Fused, fallback: Fallback::Error }
    }
}

impl Attention {
    /// Causal attention (or none), default scale, fused, no fallback.
    pub fn causal(causal: Causal) -> Self {
        Attention { causal, ..Attention::default() }
    }

    /// With the scores scaled by `scale`.
    pub fn with_scale(self, scale: f32) -> Self {
        Attention { scale: Some(scale), ..self }
    }

    /// With a fallback.
    pub fn with_fallback(self, fallback: Fallback) -> Self {
        Attention { fallback, ..self }
    }

    /// On `backend`.
    pub fn on(self, backend: Backend) -> Self {
        Attention { backend, ..self }
    }
}

/// An operand as the fused path can bind it: as it is when its strides and alignment allow, else a
/// contiguous copy (made by candle, on its stream).
fn bindable(t: &Tensor, for_attention: bool) -> Result<Tensor> {
    let (storage, layout) = t.storage_and_layout();
    // cuDNN's tensors are declared 16-byte aligned; a view into the middle of a buffer may not be.
    let aligned = !t.device().is_cuda()
        || (layout.start_offset() * t.dtype().size_in_bytes())
            .is_multiple_of(cudnn_llm_ops::DEFAULT_ALIGNMENT as usize);
    let binds =
        if for_attention { shapes::attention_strides(layout).is_ok() } else { layout.is_contiguous() };
    drop(storage);
    if aligned && binds {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}

/// Runs `f`; where it fails because the fused path refused the call and `fallback` asks for it, runs
/// `candle` instead.
fn with_fallback(
    fallback: Fallback,
    f: impl FnOnce() -> Result<Tensor>,
    candle: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    let _ = cuda::take_refusal();
    match f() {
        Ok(t) => Ok(t),
        #[cfg(feature = "cuda")]
        Err(e) if fallback == Fallback::Candle => match cuda::take_refusal() {
            Some(_) => candle(),
            None => Err(e),
        },
        Err(e) => {
            let _ = (fallback, candle);
            Err(e)
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RmsNorm {
    eps: f32,
    backend: Backend,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "cudnn-llm-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = shapes::rms_norm(xl, wl, x.dtype(), w.dtype(), self.eps)?;
        let (xs, ws) = (cpu::gather(x, xl)?, cpu::gather(w, wl)?);
        let (y, _) =
            cudnn_llm_ops::reference::rms_norm(&xs, &ws, args.tokens, args.hidden, f64::from(self.eps));
        Ok((cpu::store(&y, x.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::rms_norm((x, xl), (w, wl), self.eps, self.backend)?, xl.shape().clone()))
    }
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) · weight`, x `[..., hidden]` and
/// weight `[hidden]` of one dtype (bf16, f16, f32), in one cuDNN graph on a CUDA tensor.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    rms_norm_on(x, weight, eps, Backend::Fused)
}

/// [`rms_norm`] on `backend` (the naive one runs one kernel per elementary step, as PyTorch eager does).
pub fn rms_norm_on(x: &Tensor, weight: &Tensor, eps: f32, backend: Backend) -> Result<Tensor> {
    let (x, w) = (bindable(x, false)?, bindable(weight, false)?);
    x.apply_op2_no_bwd(&w, &RmsNorm { eps, backend })
}

/// [`rms_norm`] in candle's elementwise ops, in f32 with one rounding to x's dtype (what candle-nn's
/// `rms_norm` computes in one kernel): the CPU-checkable reference of the op's semantics.
pub fn rms_norm_candle(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(&weight.to_dtype(DType::F32)?)?.to_dtype(dtype)
}

/// Scaled dot-product attention: `softmax(scale · Q Kᵀ, masked) V` with query head `h` reading K/V
/// head `h / (h_q / h_kv)`. Q `[b, h_q, s_q, d]`, K and V `[b, h_kv, s_kv, d]`, of one dtype (bf16
/// or f16 on the fused path), strided as candle has them wherever the head dimension steps by 1 (a
/// `[b, s, h, d]` projection output transposed to `[b, h, s, d]` binds without a copy). Returns O
/// `[b, h_q, s_q, d]`, contiguous.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, options: &Attention) -> Result<Tensor> {
    let options = *options;
    with_fallback(
        options.fallback,
        || {
            let (q, k, v) = (bindable(q, true)?, bindable(k, true)?, bindable(v, true)?);
            attend(&q, &k, &v, None, options)
        },
        || sdpa_candle(q, k, v, &options),
    )
}

/// Attention over a padded batch, as a KV cache of sequences at different lengths holds it: sequence
/// `i` has `q_lens[i]` queries (the first rows of its Q) and `kv_lens[i]` keys (the first rows of its
/// K and V), and the mask is aligned on those lengths (bottom-right: its last query sees its last key).
/// The lengths are I32 tensors `[b]` on Q's device, read there (one plan serves every length; each is
/// clamped into `0..=s_q` and `0..=s_kv` before cuDNN reads it, where the CPU form refuses a length
/// out of `1..=capacity`). O `[b, h_q, s_q, d]`: rows past a sequence's queries are zero (the output
/// starts zeroed on the GPU). Fused only (cuDNN 9.15+ for most forms); elsewhere an error,
/// or with [`Fallback::Candle`] candle's ops over a mask built from the lengths.
pub fn sdpa_padded(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_lens: &Tensor,
    kv_lens: &Tensor,
    options: &Attention,
) -> Result<Tensor> {
    let options = *options;
    with_fallback(
        options.fallback,
        || {
            let (q, k, v) = (bindable(q, true)?, bindable(k, true)?, bindable(v, true)?);
            let (ql, kvl) = (q_lens.contiguous()?, kv_lens.contiguous()?);
            attend(&q, &k, &v, Some((&ql, &kvl)), options)
        },
        || sdpa_candle_padded(q, k, v, q_lens, kv_lens, &options),
    )
}

/// Checks the lengths' tensors against Q: I32 `[b]` on Q's device.
fn check_lens(q: &Tensor, lens: [&Tensor; 2]) -> Result<()> {
    let b = q.dim(0)?;
    for (name, t) in ["q_lens", "kv_lens"].into_iter().zip(lens) {
        if t.dtype() != DType::I32 || t.dims() != [b] {
            return Err(shapes::refuse(
                "sdpa_padded",
                format!(
                    "{name} is {:?} {:?}; it takes I32 [{b}], one length per sequence",
                    t.dtype(),
                    t.dims()
                ),
            ));
        }
        if !t.device().same_device(q.device()) {
            return Err(shapes::refuse("sdpa_padded", format!("{name} is on another device than Q")));
        }
    }
    Ok(())
}

/// The lengths on the host, each checked against its capacity (the CPU form and the fallback).
fn host_lens(
    q_lens: &Tensor,
    kv_lens: &Tensor,
    (cap_q, cap_kv): (usize, usize),
    causal: Causal,
) -> Result<Vec<(usize, usize)>> {
    let (ql, kvl) = (q_lens.to_vec1::<i32>()?, kv_lens.to_vec1::<i32>()?);
    ql.iter()
        .zip(&kvl)
        .enumerate()
        .map(|(i, (&a, &b))| {
            let ok = a >= 1 && b >= 1 && a as usize <= cap_q && b as usize <= cap_kv;
            if !ok || (causal == Causal::BottomRight && a > b) {
                return Err(shapes::refuse(
                    "sdpa_padded",
                    format!("sequence {i}: {a} queries and {b} keys do not fit capacities {cap_q} and {cap_kv} ({causal:?})"),
                ));
            }
            Ok((a as usize, b as usize))
        })
        .collect()
}

/// Attention over the whole of each sequence, or over the lengths given (padded).
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: Option<(&Tensor, &Tensor)>,
    options: Attention,
) -> Result<Tensor> {
    use candle_core::Storage;
    let mut args = shapes::sdpa(
        (q.layout(), k.layout(), v.layout()),
        [q.dtype(), k.dtype(), v.dtype()],
        options.causal,
        options.scale,
    )?;
    if !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        return Err(shapes::refuse("sdpa", "Q, K and V must be on one device"));
    }
    if let Some((q_lens, kv_lens)) = lens {
        check_lens(q, [q_lens, kv_lens])?;
        args = args.with_seq_lens();
    }
    let storage = if q.device().is_cpu() {
        let lens = match lens {
            Some((q_lens, kv_lens)) => host_lens(q_lens, kv_lens, (args.seq_q, args.seq_kv), options.causal)?,
            None => vec![(args.seq_q, args.seq_kv); args.batch],
        };
        let (hq, hkv, d, sq, skv) = (args.heads_q, args.heads_kv, args.head_dim, args.seq_q, args.seq_kv);
        let all = |t: &Tensor| -> Result<Vec<f64>> {
            let (s, l) = t.storage_and_layout();
            match &*s {
                Storage::Cpu(c) => cpu::gather(c, l),
                _ => Err(shapes::refuse("sdpa", "operands on different devices")),
            }
        };
        let (qv, kv, vv) = (all(q)?, all(k)?, all(v)?);
        // Rows `0..n` of every head of sequence `b` of a packed `[b, h, s, d]` tensor.
        let rows = |x: &[f64], b: usize, h: usize, s: usize, n: usize| -> Vec<f64> {
            (0..h).flat_map(|head| x[((b * h + head) * s) * d..][..n * d].to_vec()).collect()
        };
        let mut o = vec![0.0; args.batch * hq * sq * d];
        for (b, &(nq, nkv)) in lens.iter().enumerate() {
            let shape = cudnn_llm_ops::reference::AttentionShape {
                batch: 1,
                heads_q: hq,
                heads_kv: hkv,
                seq_q: nq,
                seq_kv: nkv,
                dim: d,
            };
            let (ob, _) = cudnn_llm_ops::reference::attention(
                &rows(&qv, b, hq, sq, nq),
                &rows(&kv, b, hkv, skv, nkv),
                &rows(&vv, b, hkv, skv, nkv),
                shape,
                f64::from(args.scale()),
                args.mask,
            );
            for head in 0..hq {
                o[((b * hq + head) * sq) * d..][..nq * d].copy_from_slice(&ob[head * nq * d..][..nq * d]);
            }
        }
        Storage::Cpu(cpu::store(&o, q.dtype())?)
    } else {
        #[cfg(feature = "cuda")]
        {
            fn read(t: &Tensor) -> (candle_core::StorageRef<'_>, &Layout) {
                t.storage_and_layout()
            }
            let (qs, ks, vs) = (read(q), read(k), read(v));
            let lens = lens.map(|(a, b)| (read(a), read(b)));
            let lens = match lens.as_ref().map(|(a, b)| (&*a.0, a.1, &*b.0, b.1)) {
                None => None,
                Some((Storage::Cuda(lq), lql, Storage::Cuda(lkv), lkvl)) => Some([(lq, lql), (lkv, lkvl)]),
                Some(_) => return Err(shapes::refuse("sdpa", "the lengths are on another device than Q")),
            };
            match (&*qs.0, &*ks.0, &*vs.0) {
                (Storage::Cuda(qc), Storage::Cuda(kc), Storage::Cuda(vc)) => Storage::Cuda(cuda::sdpa(
                    [(qc, qs.1), (kc, ks.1), (vc, vs.1)],
                    lens,
                    args,
                    options.backend,
                )?),
                _ => return Err(shapes::refuse("sdpa", "operands on different devices")),
            }
        }
        #[cfg(not(feature = "cuda"))]
        return Err(shapes::refuse(
            "sdpa",
            format!("runs on CPU tensors here (built without `cuda`), not on {:?}", q.device().location()),
        ));
    };
    let dims = (args.batch, args.heads_q, args.seq_q, args.head_dim);
    Ok(Tensor::from_storage(storage, dims, candle_core::op::BackpropOp::none(), false))
}

/// [`sdpa_padded`] in candle's own ops, over a mask built from the lengths (read back to the host).
pub fn sdpa_candle_padded(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_lens: &Tensor,
    kv_lens: &Tensor,
    options: &Attention,
) -> Result<Tensor> {
    check_lens(q, [q_lens, kv_lens])?;
    let (b, _, s_q, _) = q.dims4()?;
    let s_kv = k.dim(2)?;
    let lens = host_lens(q_lens, kv_lens, (s_q, s_kv), options.causal)?;
    let keep = keep_mask(&lens, (s_q, s_kv), options.causal, q.device())?;
    let rows: Vec<f32> =
        lens.iter().flat_map(|&(nq, _)| (0..s_q).map(move |i| if i < nq { 1.0 } else { 0.0 })).collect();
    let rows = Tensor::from_vec(rows, (b, 1, s_q, 1), q.device())?.to_dtype(q.dtype())?;
    attention_candle(q, k, v, options.scale, Some(&keep))?.broadcast_mul(&rows)
}

/// [`sdpa`] in candle's own ops (scores and softmax in f32, then V), the baseline and the fallback.
pub fn sdpa_candle(q: &Tensor, k: &Tensor, v: &Tensor, options: &Attention) -> Result<Tensor> {
    let (s_q, s_kv) = (q.dim(2)?, k.dim(2)?);
    let keep = match options.causal {
        Causal::None => None,
        causal => Some(keep_mask(&[(s_q, s_kv)], (s_q, s_kv), causal, q.device())?),
    };
    attention_candle(q, k, v, options.scale, keep.as_ref())
}

/// `[sequences, 1, s_q, s_kv]`: 1 where query `i` of a sequence of `(queries, keys)` sees key `j` (the
/// mask within its own lengths, [`Mask::keeps`](cudnn_llm_ops::Mask::keeps)). A row past its queries
/// keeps key 0, so that it stays finite (the padded fallback zeroes it).
fn keep_mask(
    lens: &[(usize, usize)],
    (s_q, s_kv): (usize, usize),
    causal: Causal,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let mask = causal.mask();
    let keep: Vec<u8> = lens
        .iter()
        .flat_map(|&(nq, nkv)| {
            (0..s_q).flat_map(move |i| {
                (0..s_kv).map(move |j| {
                    u8::from(if i < nq { j < nkv && mask.keeps(i, j, nq, nkv) } else { j == 0 })
                })
            })
        })
        .collect();
    Tensor::from_vec(keep, (lens.len(), 1, s_q, s_kv), device)
}

/// `softmax(scale · Q Kᵀ where keep, else -inf) V` in candle's ops, K/V heads repeated for the groups.
fn attention_candle(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: Option<f32>,
    keep: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, h_q, _, d) = q.dims4()?;
    let (_, h_kv, s_kv, _) = k.dims4()?;
    if h_kv == 0 || h_q % h_kv != 0 {
        return Err(shapes::refuse(
            "sdpa",
            format!("{h_q} query heads are not a multiple of {h_kv} K/V heads"),
        ));
    }
    let group = h_q / h_kv;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        if group == 1 {
            return t.contiguous();
        }
        t.unsqueeze(2)?.expand((b, h_kv, group, s_kv, d))?.reshape((b, h_q, s_kv, d))
    };
    let dtype = q.dtype();
    let (k, v) = (repeat(k)?.to_dtype(DType::F32)?, repeat(v)?.to_dtype(DType::F32)?);
    let scale = scale.map(f64::from).unwrap_or(1.0 / (d as f64).sqrt());
    let scores = (q.to_dtype(DType::F32)?.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?;
    let scores = match keep {
        None => scores,
        Some(keep) => {
            let keep = keep.broadcast_as(scores.shape())?;
            let hidden = Tensor::full(f32::NEG_INFINITY, scores.shape(), q.device())?;
            keep.where_cond(&scores, &hidden)?
        }
    };
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)?.to_dtype(dtype)
}

/// The steps after a Linear's product, fused into its cuDNN graph in this order:
/// `y = act(x · Wᵀ + bias) ⊙ gate + residual` (each optional; gate and residual shaped like y).
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct LinearEpilogue<'a> {
    /// `[out]`, added to each row.
    pub bias: Option<&'a Tensor>,
    /// Applied after the bias.
    pub activation: Option<Activation>,
    /// Multiplied in after the activation: SwiGLU's `silu(x · W_gateᵀ) ⊙ up` is the gate projection
    /// with `activation(Silu).gate(&up)`.
    pub gate: Option<&'a Tensor>,
    /// Added last: a residual connection.
    pub residual: Option<&'a Tensor>,
}

impl<'a> LinearEpilogue<'a> {
    /// Nothing after the product.
    pub fn none() -> Self {
        LinearEpilogue::default()
    }

    /// With a bias.
    pub fn bias(self, bias: &'a Tensor) -> Self {
        LinearEpilogue { bias: Some(bias), ..self }
    }

    /// With an activation.
    pub fn activation(self, activation: Activation) -> Self {
        LinearEpilogue { activation: Some(activation), ..self }
    }

    /// With a gate multiplier.
    pub fn gate(self, gate: &'a Tensor) -> Self {
        LinearEpilogue { gate: Some(gate), ..self }
    }

    /// With a residual.
    pub fn residual(self, residual: &'a Tensor) -> Self {
        LinearEpilogue { residual: Some(residual), ..self }
    }
}

/// A Linear layer with its epilogue in one cuDNN graph: x `[..., in]`, weight `[out, in]` as
/// checkpoints store it, one dtype (bf16, f16, f32) for every operand. Returns `[..., out]`.
pub fn linear(x: &Tensor, weight: &Tensor, epilogue: &LinearEpilogue<'_>) -> Result<Tensor> {
    linear_on(x, weight, epilogue, Backend::Fused)
}

/// [`linear`] on `backend` (the naive one: cuBLAS, then one kernel per epilogue step).
pub fn linear_on(
    x: &Tensor,
    weight: &Tensor,
    epilogue: &LinearEpilogue<'_>,
    backend: Backend,
) -> Result<Tensor> {
    use candle_core::Storage;
    let op = "linear";
    let bind = |t: Option<&Tensor>| t.map(|t| bindable(t, false)).transpose();
    let (x, w) = (bindable(x, false)?, bindable(weight, false)?);
    let (bias, gate, residual) = (bind(epilogue.bias)?, bind(epilogue.gate)?, bind(epilogue.residual)?);
    let given = [Some(&w), bias.as_ref(), gate.as_ref(), residual.as_ref()];
    if let Some(t) = given.iter().flatten().find(|t| !t.device().same_device(x.device())) {
        return Err(shapes::refuse(
            op,
            format!("x is on {:?}, an operand on {:?}", x.device().location(), t.device().location()),
        ));
    }
    let dtypes: Vec<DType> = [Some(&x)].into_iter().chain(given).flatten().map(|t| t.dtype()).collect();
    let layout = |t: &Option<Tensor>| t.as_ref().map(|t| t.layout().clone());
    let (args, steps) = shapes::linear(
        shapes::LinearLayouts {
            x: x.layout(),
            w: w.layout(),
            bias: layout(&bias).as_ref(),
            gate: layout(&gate).as_ref(),
            residual: layout(&residual).as_ref(),
        },
        &dtypes,
        epilogue.activation,
    )?;
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = args.n();
    }
    let storage = {
        fn read(t: &Tensor) -> candle_core::StorageRef<'_> {
            t.storage_and_layout().0
        }
        let (xs, ws) = (read(&x), read(&w));
        let (bs, gs, rs) = (bias.as_ref().map(read), gate.as_ref().map(read), residual.as_ref().map(read));
        match (&*xs, &*ws) {
            (Storage::Cpu(xc), Storage::Cpu(wc)) => {
                let cpu = |s: &Option<candle_core::StorageRef<'_>>,
                           t: &Option<Tensor>|
                 -> Result<Option<Vec<f64>>> {
                    match (s.as_deref(), t) {
                        (Some(Storage::Cpu(c)), Some(t)) => Ok(Some(cpu::gather(c, t.layout())?)),
                        (None, _) => Ok(None),
                        _ => Err(shapes::refuse(op, "operands on different devices")),
                    }
                };
                let (bv, gv, rv) = (cpu(&bs, &bias)?, cpu(&gs, &gate)?, cpu(&rs, &residual)?);
                let (xv, wv) = (cpu::gather(xc, x.layout())?, cpu::gather(wc, w.layout())?);
                let y = cudnn_llm_ops::reference::matmul(
                    &args,
                    steps,
                    &xv,
                    &wv,
                    bv.as_deref(),
                    gv.as_deref(),
                    rv.as_deref(),
                );
                Storage::Cpu(cpu::store(&y, x.dtype())?)
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(xc), Storage::Cuda(wc)) => {
                fn cuda<'a>(
                    s: &'a Option<candle_core::StorageRef<'_>>,
                    t: &'a Option<Tensor>,
                ) -> Result<Option<(&'a candle_core::CudaStorage, &'a Layout)>> {
                    match (s.as_deref(), t) {
                        (Some(Storage::Cuda(c)), Some(t)) => Ok(Some((c, t.layout()))),
                        (None, _) => Ok(None),
                        _ => Err(shapes::refuse("linear", "operands on different devices")),
                    }
                }
                let extra = cuda::LinearExtras {
                    bias: cuda(&bs, &bias)?,
                    gate: cuda(&gs, &gate)?,
                    residual: cuda(&rs, &residual)?,
                };
                Storage::Cuda(cuda::linear((xc, x.layout()), (wc, w.layout()), extra, args, backend)?)
            }
            _ => {
                return Err(shapes::refuse(
                    op,
                    format!("runs on CPU and CUDA tensors, not on {:?}", x.device().location()),
                ))
            }
        }
    };
    let _ = backend;
    Ok(Tensor::from_storage(storage, dims, candle_core::op::BackpropOp::none(), false))
}

/// [`linear`] in candle's own ops, the baseline.
pub fn linear_candle(x: &Tensor, weight: &Tensor, epilogue: &LinearEpilogue<'_>) -> Result<Tensor> {
    let mut y = x.broadcast_matmul(&weight.t()?)?;
    if let Some(b) = epilogue.bias {
        y = y.broadcast_add(b)?;
    }
    if let Some(a) = epilogue.activation {
        y = match a {
            Activation::Silu => y.silu()?,
            Activation::Gelu => y.gelu_erf()?,
            Activation::GeluTanh => y.gelu()?,
            Activation::Relu => y.relu()?,
            other => {
                return Err(shapes::refuse(
                    "linear_candle",
                    format!("{} has no candle op here", other.name()),
                ))
            }
        };
    }
    if let Some(g) = epilogue.gate {
        y = (y * g)?;
    }
    if let Some(r) = epilogue.residual {
        y = (y + r)?;
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    //! The CPU forms against candle's own ops, on CPU tensors (the CUDA forms: `tests/cuda.rs`).
    use super::*;
    use candle_core::Device;

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(a.len(), b.len());
        let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> =
            cudnn_llm_ops::reference::random_values(seed, n).into_iter().map(|x| x as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn rms_norm_matches_candle() {
        let x = randn(&[2, 3, 64], 1);
        let w = randn(&[64], 2);
        let ours = rms_norm(&x, &w, 1e-5).unwrap();
        assert_eq!(ours.dims(), [2, 3, 64]);
        assert!(rel(&ours, &rms_norm_candle(&x, &w, 1e-5).unwrap()) < 1e-6);
        // bf16 in, bf16 out, one rounding.
        let (xb, wb) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap());
        let ours = rms_norm(&xb, &wb, 1e-5).unwrap();
        assert_eq!(ours.dtype(), DType::BF16);
        assert!(rel(&ours, &rms_norm_candle(&xb, &wb, 1e-5).unwrap()) < 1e-2);
        // A transposed x is copied first.
        let xt = randn(&[64, 3], 3).t().unwrap();
        let ours = rms_norm(&xt, &w, 1e-5).unwrap();
        assert!(rel(&ours, &rms_norm_candle(&xt.contiguous().unwrap(), &w, 1e-5).unwrap()) < 1e-6);
    }

    #[test]
    fn sdpa_matches_candle_for_every_mask_with_grouped_heads_and_strided_inputs() {
        // [b, s, h, d] transposed to [b, h, s, d], as a projection's output: strided, not copied.
        let q = randn(&[2, 5, 6, 16], 4).transpose(1, 2).unwrap();
        let k = randn(&[2, 9, 2, 16], 5).transpose(1, 2).unwrap();
        let v = randn(&[2, 9, 2, 16], 6).transpose(1, 2).unwrap();
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            for scale in [None, Some(0.3)] {
                let mut options = Attention::causal(causal);
                options.scale = scale;
                let ours = sdpa(&q, &k, &v, &options).unwrap();
                assert_eq!(ours.dims(), [2, 6, 5, 16]);
                let e = rel(&ours, &sdpa_candle(&q, &k, &v, &options).unwrap());
                assert!(e < 1e-6, "{causal:?} {scale:?}: {e}");
            }
        }
        // The masks differ where they should: top-left hides more of a 5x9 block than bottom-right.
        let tl = sdpa(&q, &k, &v, &Attention::causal(Causal::TopLeft)).unwrap();
        let br = sdpa(&q, &k, &v, &Attention::causal(Causal::BottomRight)).unwrap();
        assert!(rel(&tl, &br) > 1e-2);
    }

    #[test]
    fn linear_matches_candle_for_every_epilogue() {
        let x = randn(&[2, 3, 32], 7);
        let w = randn(&[24, 32], 8);
        let b = randn(&[24], 9);
        let u = randn(&[2, 3, 24], 10);
        let r = randn(&[2, 3, 24], 11);
        let epilogues = [
            LinearEpilogue::none(),
            LinearEpilogue::none().bias(&b),
            LinearEpilogue::none().bias(&b).activation(Activation::Silu),
            LinearEpilogue::none().activation(Activation::Silu).gate(&u),
            LinearEpilogue::none().residual(&r),
            LinearEpilogue::none().bias(&b).activation(Activation::Gelu).gate(&u).residual(&r),
        ];
        for e in epilogues {
            let ours = linear(&x, &w, &e).unwrap();
            assert_eq!(ours.dims(), [2, 3, 24]);
            let err = rel(&ours, &linear_candle(&x, &w, &e).unwrap());
            assert!(err < 1e-5, "{e:?}: {err}");
        }
        // The plain product is candle's matmul.
        let plain = x.broadcast_matmul(&w.t().unwrap()).unwrap();
        assert!(rel(&linear(&x, &w, &LinearEpilogue::none()).unwrap(), &plain) < 1e-6);
        // A gate of the wrong shape is named.
        let e = linear(&x, &w, &LinearEpilogue::none().gate(&b)).unwrap_err().to_string();
        assert!(e.contains("gate has shape [24]"), "{e}");
    }

    #[test]
    fn padded_attention_reads_each_sequence_to_its_length() {
        // Two sequences in a cache of 9 rows: 3 new tokens over 7 keys, and 1 over 4.
        let q = randn(&[2, 4, 3, 16], 12);
        let k = randn(&[2, 2, 9, 16], 13);
        let v = randn(&[2, 2, 9, 16], 14);
        let q_lens = Tensor::new(&[3i32, 1], &Device::Cpu).unwrap();
        let kv_lens = Tensor::new(&[7i32, 4], &Device::Cpu).unwrap();
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            let options = Attention::causal(causal);
            let ours = sdpa_padded(&q, &k, &v, &q_lens, &kv_lens, &options).unwrap();
            let theirs = sdpa_candle_padded(&q, &k, &v, &q_lens, &kv_lens, &options).unwrap();
            assert_eq!(ours.dims(), [2, 4, 3, 16]);
            // Each sequence's valid rows equal the unpadded attention over its own lengths.
            for (b, (nq, nkv)) in [(0usize, (3usize, 7usize)), (1, (1, 4))] {
                let part = |t: &Tensor, n: usize| t.narrow(0, b, 1).unwrap().narrow(2, 0, n).unwrap();
                let want = sdpa(&part(&q, nq), &part(&k, nkv), &part(&v, nkv), &options).unwrap();
                assert!(rel(&part(&ours, nq), &want) < 1e-6, "{causal:?} sequence {b}");
                assert!(rel(&part(&theirs, nq), &want) < 1e-6, "{causal:?} sequence {b}, candle's");
            }
        }
        // Rows past a sequence's queries are zero in both.
        for t in [
            &sdpa_padded(&q, &k, &v, &q_lens, &kv_lens, &Attention::default()).unwrap(),
            &sdpa_candle_padded(&q, &k, &v, &q_lens, &kv_lens, &Attention::default()).unwrap(),
        ] {
            let rest = t.narrow(0, 1, 1).unwrap().narrow(2, 1, 2).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(rest.to_scalar::<f32>().unwrap(), 0.0);
        }
        // Lengths past the capacities, of the wrong dtype or shape, are named.
        let e = |ql: &Tensor, kl: &Tensor| {
            sdpa_padded(&q, &k, &v, ql, kl, &Attention::default()).unwrap_err().to_string()
        };
        assert!(e(&q_lens, &Tensor::new(&[10i32, 4], &Device::Cpu).unwrap()).contains("sequence 0"));
        assert!(e(&q_lens, &Tensor::new(&[7u32, 4], &Device::Cpu).unwrap()).contains("takes I32 [2]"));
        assert!(e(&Tensor::new(&[3i32], &Device::Cpu).unwrap(), &kv_lens).contains("q_lens"));
        let br = Attention::causal(Causal::BottomRight);
        let more_queries = Tensor::new(&[3i32, 1], &Device::Cpu).unwrap();
        let fewer_keys = Tensor::new(&[2i32, 4], &Device::Cpu).unwrap();
        assert!(sdpa_padded(&q, &k, &v, &more_queries, &fewer_keys, &br).is_err());
    }

    #[test]
    fn refused_shapes_name_what_is_wrong() {
        let q = randn(&[1, 6, 4, 16], 10);
        let kv = randn(&[1, 4, 4, 16], 11);
        let e = sdpa(&q, &kv, &kv, &Attention::default()).unwrap_err().to_string();
        assert!(e.contains("not a multiple of 4"), "{e}");
        let e = rms_norm(&q, &randn(&[8], 12), 1e-5).unwrap_err().to_string();
        assert!(e.contains("last dimension is 16"), "{e}");
    }
}
