//! From candle layouts to the library's op arguments: what each op takes, checked before any memory is
//! touched, the same for the CPU and the CUDA forms.

use candle_core::{DType, Layout, Result};
use cudnn_llm_ops::{Epilogue, Mask, MatmulArgs, RmsNormArgs, SdpaArgs};

/// An error naming the op and what it does not take.
pub(crate) fn refuse(op: &str, reason: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("cudnn-llm-candle {op}: {reason}"))
}

/// The element strides of a candle layout, with every dimension of size 1 given the stride a packed
/// tensor would have there (candle leaves any stride on such a dimension, cuDNN wants them positive
/// and the value is never used to step).
pub(crate) fn strides(layout: &Layout) -> Vec<usize> {
    let dims = layout.dims();
    let mut out = layout.stride().to_vec();
    let mut packed = 1usize;
    for i in (0..dims.len()).rev() {
        if dims[i] == 1 {
            out[i] = packed.max(1);
        }
        packed = packed.saturating_mul(dims[i]);
    }
    out
}

/// Whether a layout is row-major packed (any offset): what the row-reading ops (RMSNorm, a Linear's
/// operands) bind.
fn rows_packed(layout: &Layout) -> bool {
    layout.is_contiguous()
}

/// The dtypes the ops take: the library's 16-bit floats and f32.
pub(crate) fn check_float(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::BF16 | DType::F16 | DType::F32 => Ok(()),
        other => Err(refuse(op, format!("takes bf16, f16 or f32 tensors, not {other:?}"))),
    }
}

/// RMSNorm over the last dimension: x `[..., hidden]` (contiguous), weight `[hidden]` of x's dtype.
pub(crate) fn rms_norm(
    x: &Layout,
    w: &Layout,
    dtype: DType,
    w_dtype: DType,
    eps: f32,
) -> Result<RmsNormArgs> {
    let op = "rms_norm";
    check_float(op, dtype)?;
    if w_dtype != dtype {
        return Err(refuse(op, format!("the weight is {w_dtype:?}, x is {dtype:?}")));
    }
    let dims = x.dims();
    let Some(&hidden) = dims.last() else {
        return Err(refuse(op, "x is a scalar; it needs a last dimension to normalize over"));
    };
    if w.dims() != [hidden] {
        return Err(refuse(
            op,
            format!("the weight has shape {:?}, x's last dimension is {hidden}", w.dims()),
        ));
    }
    if !rows_packed(x) || !rows_packed(w) {
        return Err(refuse(op, "x and the weight must be contiguous (call .contiguous() first)"));
    }
    if !eps.is_finite() || eps < 0.0 {
        return Err(refuse(op, format!("epsilon {eps} is not a finite non-negative number")));
    }
    let tokens = dims[..dims.len() - 1].iter().product::<usize>();
    Ok(RmsNormArgs::new(tokens, hidden, eps))
}

/// Which causal mask, if any, attention applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Causal {
    /// Every query sees every key.
    #[default]
    None,
    /// Query `i` sees keys `0..=i` (a prompt attending to itself).
    TopLeft,
    /// Query `i` sees keys `0..=i + s_kv - s_q` (new tokens attending to a KV cache and themselves).
    BottomRight,
}

impl Causal {
    pub(crate) fn mask(self) -> Mask {
        match self {
            Causal::None => Mask::None,
            Causal::TopLeft => Mask::CausalTopLeft,
            Causal::BottomRight => Mask::CausalBottomRight,
        }
    }
}

/// The four dimensions `[b, h, s, d]` of an attention operand.
fn bhsd(op: &str, name: &str, l: &Layout) -> Result<[usize; 4]> {
    match *l.dims() {
        [b, h, s, d] => Ok([b, h, s, d]),
        _ => Err(refuse(
            op,
            format!("{name} has shape {:?}; it takes [batch, heads, seq, head_dim]", l.dims()),
        )),
    }
}

/// Strides as the attention arguments take them, or why this layout needs a copy first (a head
/// dimension that does not step by 1, a broadcast dimension).
pub(crate) fn attention_strides(layout: &Layout) -> std::result::Result<[usize; 4], String> {
    let s = strides(layout);
    let s: [usize; 4] = s.try_into().map_err(|_| "not four dimensions".to_string())?;
    if s[3] != 1 {
        return Err(format!("its head dimension steps by {} elements, not 1", s[3]));
    }
    if s.contains(&0) {
        return Err(format!("strides {s:?} broadcast a dimension"));
    }
    Ok(s)
}

/// Scaled dot-product attention over Q `[b, h_q, s_q, d]`, K and V `[b, h_kv, s_kv, d]` (`h_kv`
/// divides `h_q`: grouped-query heads), O `[b, h_q, s_q, d]` packed. Strides are taken as candle has
/// them where the head dimension steps by 1; a layout that cannot be bound is an error naming it (the
/// public function makes such an operand contiguous first).
pub(crate) fn sdpa(
    (q, k, v): (&Layout, &Layout, &Layout),
    dtypes: [DType; 3],
    causal: Causal,
    scale: Option<f32>,
) -> Result<SdpaArgs> {
    let op = "sdpa";
    check_float(op, dtypes[0])?;
    if dtypes[1] != dtypes[0] || dtypes[2] != dtypes[0] {
        return Err(refuse(op, format!("Q, K and V are {:?}; they must share one dtype", dtypes)));
    }
    let [b, h_q, s_q, d] = bhsd(op, "Q", q)?;
    let [bk, h_kv, s_kv, dk] = bhsd(op, "K", k)?;
    if v.dims() != k.dims() {
        return Err(refuse(op, format!("V has shape {:?}, K {:?}", v.dims(), k.dims())));
    }
    if bk != b || dk != d {
        return Err(refuse(
            op,
            format!("Q has shape {:?} and K {:?}: batch and head_dim must agree", q.dims(), k.dims()),
        ));
    }
    if h_kv == 0 || h_q % h_kv != 0 {
        return Err(refuse(op, format!("{h_q} query heads are not a multiple of {h_kv} K/V heads")));
    }
    if causal == Causal::BottomRight && s_q > s_kv {
        return Err(refuse(
            op,
            format!("a bottom-right causal mask needs seq_q <= seq_kv, got {s_q} > {s_kv}"),
        ));
    }
    if let Some(s) = scale {
        if !s.is_finite() {
            return Err(refuse(op, format!("scale {s} is not finite")));
        }
    }
    let mut args =
        SdpaArgs::new(b, h_q, h_kv, s_q, s_kv, d, cudnn_llm_ops::Layout::Bhsd).with_mask(causal.mask());
    if let Some(s) = scale {
        args = args.with_scale(s);
    }
    for (name, l, slot) in [("Q", q, 0), ("K", k, 1), ("V", v, 2)] {
        let s = attention_strides(l).map_err(|why| refuse(op, format!("{name}: {why}")))?;
        match slot {
            0 => args.q_strides = s,
            1 => args.k_strides = s,
            _ => args.v_strides = s,
        }
    }
    Ok(args)
}

/// An activation after a Linear's bias.
pub use cudnn_llm_ops::Activation;

/// The layouts of a Linear's operands.
pub(crate) struct LinearLayouts<'a> {
    pub(crate) x: &'a Layout,
    pub(crate) w: &'a Layout,
    pub(crate) bias: Option<&'a Layout>,
    pub(crate) gate: Option<&'a Layout>,
    pub(crate) residual: Option<&'a Layout>,
}

/// `y [..., out] = act(x [..., inp] · wᵀ + bias) ⊙ gate + residual`, w `[out, inp]` as checkpoints
/// store it, gate and residual shaped like y, all contiguous and of one dtype.
pub(crate) fn linear(
    l: LinearLayouts<'_>,
    dtypes: &[DType],
    activation: Option<Activation>,
) -> Result<(MatmulArgs, Epilogue)> {
    let op = "linear";
    check_float(op, dtypes[0])?;
    if dtypes.iter().any(|&t| t != dtypes[0]) {
        return Err(refuse(op, format!("the operands are {dtypes:?}; they must share one dtype")));
    }
    let Some(&inp) = l.x.dims().last() else {
        return Err(refuse(op, "x is a scalar"));
    };
    let [out, w_inp] = *l.w.dims() else {
        return Err(refuse(
            op,
            format!("the weight has shape {:?}; it takes [out_features, in_features]", l.w.dims()),
        ));
    };
    if w_inp != inp {
        return Err(refuse(op, format!("x has {inp} features, the weight takes {w_inp}")));
    }
    if let Some(b) = l.bias {
        if b.dims() != [out] {
            return Err(refuse(op, format!("the bias has shape {:?}, the weight {out} outputs", b.dims())));
        }
    }
    let mut y = l.x.dims().to_vec();
    if let Some(last) = y.last_mut() {
        *last = out;
    }
    for (name, t) in [("gate", l.gate), ("residual", l.residual)] {
        if let Some(t) = t {
            if t.dims() != y {
                return Err(refuse(op, format!("the {name} has shape {:?}, the output {y:?}", t.dims())));
            }
        }
    }
    let all = [Some(l.x), Some(l.w), l.bias, l.gate, l.residual];
    if !all.into_iter().flatten().all(rows_packed) {
        return Err(refuse(op, "every operand must be contiguous (call .contiguous() first)"));
    }
    let tokens = l.x.dims()[..l.x.dims().len() - 1].iter().product::<usize>();
    let mut epilogue = Epilogue::NONE;
    if l.bias.is_some() {
        epilogue = epilogue.with_bias();
    }
    if let Some(a) = activation {
        epilogue = epilogue.with_activation(a);
    }
    if l.gate.is_some() {
        epilogue = epilogue.with_gate();
    }
    if l.residual.is_some() {
        epilogue = epilogue.with_residual();
    }
    Ok((MatmulArgs::linear(tokens, inp, out).with_epilogue(epilogue), epilogue))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Shape;

    fn layout(dims: &[usize]) -> Layout {
        Layout::contiguous(Shape::from(dims))
    }

    fn lin<'a>(x: &'a Layout, w: &'a Layout, bias: Option<&'a Layout>) -> LinearLayouts<'a> {
        LinearLayouts { x, w, bias, gate: None, residual: None }
    }

    #[test]
    fn unit_dimensions_get_packed_strides() {
        let l = Layout::new(Shape::from((2, 1, 3, 8)), vec![24, 0, 8, 1], 0);
        assert_eq!(strides(&l), vec![24, 24, 8, 1]);
        assert_eq!(attention_strides(&l), Ok([24, 24, 8, 1]));
    }

    #[test]
    fn transposed_heads_bind_without_a_copy() {
        // [b, s, h, d] viewed as [b, h, s, d], as a projection's output transposed in candle.
        let l = layout(&[2, 5, 4, 8]).transpose(1, 2).unwrap();
        assert_eq!(l.dims(), [2, 4, 5, 8]);
        assert_eq!(attention_strides(&l), Ok([160, 8, 32, 1]));
        let args = sdpa(
            (&l, &layout(&[2, 2, 7, 8]), &layout(&[2, 2, 7, 8])),
            [DType::BF16; 3],
            Causal::BottomRight,
            None,
        )
        .unwrap();
        assert_eq!((args.heads_q, args.heads_kv, args.seq_q, args.seq_kv), (4, 2, 5, 7));
        assert_eq!(args.q_strides, [160, 8, 32, 1]);
        assert_eq!(args.mask, Mask::CausalBottomRight);
    }

    #[test]
    fn layouts_the_ops_cannot_bind_are_named() {
        let t = layout(&[1, 2, 8, 4]).transpose(2, 3).unwrap();
        assert!(attention_strides(&t).unwrap_err().contains("steps by 4"));
        let b = Layout::new(Shape::from((1, 2, 3, 8)), vec![0, 24, 8, 1], 0);
        let b = Layout::new(Shape::from((2, 2, 3, 8)), b.stride().to_vec(), 0);
        assert!(attention_strides(&b).unwrap_err().contains("broadcast"));
    }

    #[test]
    fn argument_errors_name_what_is_wrong() {
        let q = layout(&[1, 6, 4, 8]);
        let kv = layout(&[1, 4, 4, 8]);
        let cases: Vec<(Result<()>, &str)> = vec![
            (sdpa((&q, &kv, &kv), [DType::BF16; 3], Causal::None, None).map(drop), "not a multiple of 4"),
            (
                sdpa((&layout(&[6, 4, 8]), &kv, &kv), [DType::BF16; 3], Causal::None, None).map(drop),
                "[batch, heads, seq, head_dim]",
            ),
            (
                sdpa((&kv, &kv, &layout(&[1, 4, 5, 8])), [DType::BF16; 3], Causal::None, None).map(drop),
                "V has shape",
            ),
            (
                sdpa((&kv, &kv, &kv), [DType::BF16, DType::F16, DType::BF16], Causal::None, None).map(drop),
                "one dtype",
            ),
            (sdpa((&kv, &kv, &kv), [DType::U8; 3], Causal::None, None).map(drop), "not U8"),
            (
                sdpa((&layout(&[1, 4, 5, 8]), &kv, &kv), [DType::BF16; 3], Causal::BottomRight, None)
                    .map(drop),
                "5 > 4",
            ),
            (sdpa((&kv, &kv, &kv), [DType::BF16; 3], Causal::None, Some(f32::NAN)).map(drop), "not finite"),
            (
                rms_norm(&layout(&[3, 8]), &layout(&[7]), DType::F32, DType::F32, 1e-5).map(drop),
                "x's last dimension is 8",
            ),
            (
                rms_norm(&layout(&[3, 8]), &layout(&[8]), DType::F32, DType::BF16, 1e-5).map(drop),
                "the weight is BF16",
            ),
            (
                rms_norm(
                    &layout(&[3, 8]).transpose(0, 1).unwrap(),
                    &layout(&[3]),
                    DType::F32,
                    DType::F32,
                    1e-5,
                )
                .map(drop),
                "contiguous",
            ),
            (rms_norm(&layout(&[3, 8]), &layout(&[8]), DType::F32, DType::F32, -1.0).map(drop), "epsilon"),
            (
                linear(lin(&layout(&[3, 8]), &layout(&[4, 7]), None), &[DType::F32; 2], None).map(drop),
                "takes 7",
            ),
            (
                linear(lin(&layout(&[3, 8]), &layout(&[4, 8]), Some(&layout(&[5]))), &[DType::F32; 3], None)
                    .map(drop),
                "bias has shape [5]",
            ),
            (
                linear(lin(&layout(&[3, 8]), &layout(&[8]), None), &[DType::F32; 2], None).map(drop),
                "[out_features, in_features]",
            ),
            (
                linear(lin(&layout(&[3, 8]), &layout(&[4, 8]), None), &[DType::F32, DType::F16], None)
                    .map(drop),
                "one dtype",
            ),
            (
                linear(
                    LinearLayouts {
                        residual: Some(&layout(&[3, 5])),
                        ..lin(&layout(&[3, 8]), &layout(&[4, 8]), None)
                    },
                    &[DType::F32; 3],
                    None,
                )
                .map(drop),
                "the residual has shape [3, 5], the output [3, 4]",
            ),
        ];
        for (r, expected) in cases {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(expected), "{e:?} does not say {expected:?}");
        }
    }

    #[test]
    fn arguments_follow_the_shapes() {
        let a = rms_norm(&layout(&[2, 3, 64]), &layout(&[64]), DType::BF16, DType::BF16, 1e-6).unwrap();
        assert_eq!((a.tokens, a.hidden), (6, 64));
        let (m, e) = linear(
            lin(&layout(&[2, 3, 64]), &layout(&[32, 64]), Some(&layout(&[32]))),
            &[DType::F16; 3],
            Some(Activation::Silu),
        )
        .unwrap();
        assert_eq!((m.m(), m.k(), m.n()), (6, 64, 32));
        assert_eq!(e, Epilogue::NONE.with_bias().with_activation(Activation::Silu));
    }
}
