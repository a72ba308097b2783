//! The ops' CUDA forms: candle's device buffers bound straight into the library's ops, on candle's
//! stream, through one cuDNN context per thread and device.

use crate::shapes::refuse;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, CudaView};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CudaStorage, DType, Layout, Result};
use cudnn_llm_ops::{Backend, Cudnn, Element};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

thread_local! {
    /// This thread's contexts, one per candle stream (each holds its stream, so a key's address is
    /// not reused while its entry lives).
    static CONTEXTS: RefCell<Vec<(usize, Rc<Cudnn>)>> = const { RefCell::new(Vec::new()) };
    /// Why the last fused call on this thread was refused (cuDNN or the library cannot run the shape),
    /// for the public functions' fallback to candle's own ops.
    static REFUSED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Drops this thread's cuDNN contexts (handles, workspaces, plan caches), e.g. after dropping the candle
/// devices they served: each `Device::new_cuda` has a stream of its own and so a context of its own,
/// kept until the thread ends or this is called.
pub fn release_contexts() {
    CONTEXTS.with_borrow_mut(Vec::clear);
}

/// This thread's cuDNN context on `device`'s stream, made on first use.
pub(crate) fn context(device: &CudaDevice) -> Result<Rc<Cudnn>> {
    let stream: Arc<CudaStream> = device.cuda_stream();
    let key = Arc::as_ptr(&stream) as usize;
    if let Some(ctx) = CONTEXTS.with_borrow(|c| c.iter().find(|(k, _)| *k == key).map(|(_, c)| c.clone())) {
        return Ok(ctx);
    }
    let ctx = Rc::new(Cudnn::with_stream(stream).map_err(candle_core::Error::wrap)?);
    CONTEXTS.with_borrow_mut(|c| c.push((key, ctx.clone())));
    Ok(ctx)
}

/// Takes the refusal the last call on this thread recorded, if any.
pub(crate) fn take_refusal() -> Option<String> {
    REFUSED.with_borrow_mut(Option::take)
}

/// The library's error as candle's; a refusal is also recorded for the fallback.
pub(crate) fn error(op: &str, e: cudnn_llm_ops::Error) -> candle_core::Error {
    if let cudnn_llm_ops::Error::NotSupported { .. } = e {
        REFUSED.with_borrow_mut(|r| *r = Some(e.to_string()));
    }
    refuse(op, e)
}

/// The elements of `storage` from the layout's first one on.
pub(crate) fn view<'a, T: CudaDType>(storage: &'a CudaStorage, layout: &Layout) -> Result<CudaView<'a, T>> {
    let slice: &CudaSlice<T> = storage.as_cuda_slice::<T>()?;
    let start = layout.start_offset();
    // The tensor's own elements only (a narrowed weight's buffer runs on past it, and the ops check a
    // view's length against what they read).
    let extent = extent(layout);
    match start.checked_add(extent) {
        Some(end) if end <= slice.len() => Ok(slice.slice(start..end)),
        _ => Err(refuse(
            "view",
            format!("{extent} elements from offset {start} past a buffer of {}", slice.len()),
        )),
    }
}

/// The elements a layout spans from its first one: one past its last element's offset.
fn extent(layout: &Layout) -> usize {
    let dims = layout.dims();
    if dims.contains(&0) {
        return 0;
    }
    1 + dims.iter().zip(crate::shapes::strides(layout)).map(|(&d, s)| (d - 1) * s).sum::<usize>()
}

/// [`view`] of an optional operand.
fn optional<'a, T: CudaDType>(
    operand: Option<(&'a CudaStorage, &Layout)>,
) -> Result<Option<CudaView<'a, T>>> {
    operand.map(|(s, l)| view::<T>(s, l)).transpose()
}

/// A new output buffer of `len` elements on `device`, for an op that writes every one of them.
pub(crate) fn output<T: CudaDType + cudnn_llm_ops::cudarc::driver::DeviceRepr>(
    device: &CudaDevice,
    len: usize,
) -> Result<CudaSlice<T>> {
    // SAFETY: the buffer is handed to an op that writes every one of its `len` elements before anything
    // reads it (RMSNorm, a Linear, unpadded attention; the GPU tests poison the pool and check every
    // element is written); on an error the buffer is dropped unread. Padded attention, which leaves
    // rows, allocates zeroed.
    unsafe { device.alloc::<T>(len) }
}

/// Runs `$body` with `$t` the Rust element type of `$dtype`.
macro_rules! with_float {
    ($op:expr, $dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            other => {
                Err($crate::shapes::refuse($op, format!("takes bf16, f16 or f32 tensors, not {other:?}")))
            }
        }
    };
}

/// RMSNorm of x over its last dimension.
pub(crate) fn rms_norm(
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    eps: f32,
    backend: Backend,
) -> Result<CudaStorage> {
    let args = crate::shapes::rms_norm(xl, wl, x.dtype(), w.dtype(), eps)?;
    let dev = x.device().clone();
    let ctx = context(&dev)?;
    with_float!("rms_norm", x.dtype(), T => {
        let mut y = output::<T>(&dev, args.tokens * args.hidden)?;
        let (xv, wv) = (view::<T>(x, xl)?, view::<T>(w, wl)?);
        cudnn_llm_ops::rms_norm(&ctx, args, cudnn_llm_ops::RmsNormOperands::new(&xv, &wv, &mut y), backend)
            .map_err(|e| error("rms_norm", e))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev))
    })
}

/// Attention, over each sequence's lengths where they are given (i32 device tensors `[b]`); O packed
/// `[b, h_q, s_q, d]`.
pub(crate) fn sdpa(
    qkv: [(&CudaStorage, &Layout); 3],
    lens: Option<[(&CudaStorage, &Layout); 2]>,
    args: cudnn_llm_ops::SdpaArgs,
    backend: Backend,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + Element + cudnn_llm_ops::cudarc::driver::ValidAsZeroBits>(
        ctx: &Cudnn,
        dev: &CudaDevice,
        [(q, ql), (k, kl), (v, vl)]: [(&CudaStorage, &Layout); 3],
        lens: Option<[CudaView<'_, i32>; 2]>,
        args: cudnn_llm_ops::SdpaArgs,
        backend: Backend,
    ) -> Result<CudaStorage> {
        let n = args.batch * args.heads_q * args.seq_q * args.head_dim;
        // Padded attention leaves the rows past a sequence's queries: they start zeroed.
        let mut o = if lens.is_some() { dev.alloc_zeros::<T>(n)? } else { output::<T>(dev, n)? };
        let (qv, kv, vv) = (view::<T>(q, ql)?, view::<T>(k, kl)?, view::<T>(v, vl)?);
        let mut ops = cudnn_llm_ops::SdpaOperands::new(&qv, &kv, &vv, &mut o);
        if let Some([lq, lkv]) = &lens {
            ops = ops.seq_lens(lq, lkv);
        }
        cudnn_llm_ops::sdpa(ctx, args, ops, backend).map_err(|e| error("sdpa", e))?;
        Ok(CudaStorage::wrap_cuda_slice(o, dev.clone()))
    }
    let dev = qkv[0].0.device().clone();
    let ctx = context(&dev)?;
    let lens = match lens {
        Some([(lq, lql), (lkv, lkvl)]) => Some([view::<i32>(lq, lql)?, view::<i32>(lkv, lkvl)?]),
        None => None,
    };
    if !args.head_dim.is_multiple_of(8) {
        // cuDNN's attention and the library's kernels take 16-byte rows: a refusal (the fallback's
        // case), not the caller's error.
        let e = cudnn_llm_ops::Error::NotSupported {
            op: "sdpa".into(),
            reason: format!("head_dim {} is not a multiple of 8", args.head_dim),
        };
        return Err(error("sdpa", e));
    }
    match qkv[0].0.dtype() {
        DType::BF16 => run::<half::bf16>(&ctx, &dev, qkv, lens, args, backend),
        DType::F16 => run::<half::f16>(&ctx, &dev, qkv, lens, args, backend),
        other => {
            let e = cudnn_llm_ops::Error::NotSupported {
                op: "sdpa".into(),
                reason: format!("cuDNN's attention takes bf16 or f16, not {other:?}"),
            };
            Err(error("sdpa", e))
        }
    }
}

/// A Linear's epilogue inputs.
pub(crate) struct LinearExtras<'a> {
    pub(crate) bias: Option<(&'a CudaStorage, &'a Layout)>,
    pub(crate) gate: Option<(&'a CudaStorage, &'a Layout)>,
    pub(crate) residual: Option<(&'a CudaStorage, &'a Layout)>,
}

/// A Linear with its epilogue; y `[tokens, out]`.
pub(crate) fn linear(
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    extra: LinearExtras<'_>,
    args: cudnn_llm_ops::MatmulArgs,
    backend: Backend,
) -> Result<CudaStorage> {
    let dev = x.device().clone();
    let ctx = context(&dev)?;
    with_float!("linear", x.dtype(), T => {
        let mut y = output::<T>(&dev, args.m() * args.n())?;
        let (xv, wv) = (view::<T>(x, xl)?, view::<T>(w, wl)?);
        let (bv, gv, rv) = (optional::<T>(extra.bias)?, optional::<T>(extra.gate)?, optional::<T>(extra.residual)?);
        let mut operands = cudnn_llm_ops::MatmulOperands::new(&xv, &wv, &mut y);
        if let Some(b) = &bv {
            operands = operands.bias(b);
        }
        if let Some(g) = &gv {
            operands = operands.up(g);
        }
        if let Some(r) = &rv {
            operands = operands.residual(r);
        }
        cudnn_llm_ops::matmul(&ctx, &args, operands, backend).map_err(|e| error("linear", e))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev))
    })
}
