//! Graph nodes: what each builder method records, and how it lowers to backend operation descriptors.

use super::{NormPhase, TensorId};
use crate::descriptor::{Attr, Descriptor};
use crate::dtype::DataType;
use crate::Result;
use cudnn_llm_sys as sys;
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// Elementwise operations with one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unary {
    /// `y = x` (a cast when the output dtype differs).
    Identity,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// `max(x, 0)`.
    Relu,
    /// `x · sigmoid(x)` (SiLU, cuDNN's SWISH with β = 1).
    Silu,
    /// `x · Φ(x)` (erf form).
    Gelu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
}

/// Elementwise operations with two inputs (the second broadcast over dims of size 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a − b`.
    Sub,
    /// `a · b`.
    Mul,
    /// `a / b`.
    Div,
    /// `a ≥ b`, a boolean.
    CmpGe,
    /// `a < b`, a boolean.
    CmpLt,
    /// `a ∧ b` of two booleans.
    LogicalAnd,
}

impl Binary {
    /// Whether the result is a boolean (comparisons and logic).
    pub fn is_boolean(self) -> bool {
        matches!(self, Binary::CmpGe | Binary::CmpLt | Binary::LogicalAnd)
    }
}

/// Reductions over the dims where the output has size 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reduce {
    /// Maximum.
    Max,
    /// Sum.
    Sum,
}

/// A pointwise node's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pointwise {
    Unary(Unary),
    Binary(Binary),
    /// The index of each element along an axis.
    GenIndex,
    /// `y = t ? x : b`.
    Select,
    /// The backward of an activation: `dx = dy · f'(x)`; cuDNN's `*_BWD` modes, which read the forward
    /// input as X and the incoming gradient as DY and write DX (the node's `x`, `b` and `y`).
    Backward(Unary),
}

impl Pointwise {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Pointwise::Unary(u) => match u {
                Unary::Identity => "identity",
                Unary::Exp => "exp",
                Unary::Log => "log",
                Unary::Relu => "relu",
                Unary::Silu => "silu",
                Unary::Gelu => "gelu",
                Unary::GeluTanh => "gelu_tanh",
                Unary::Sigmoid => "sigmoid",
            },
            Pointwise::Binary(b) => match b {
                Binary::Add => "add",
                Binary::Sub => "sub",
                Binary::Mul => "mul",
                Binary::Div => "div",
                Binary::CmpGe => "cmp_ge",
                Binary::CmpLt => "cmp_lt",
                Binary::LogicalAnd => "logical_and",
            },
            Pointwise::GenIndex => "gen_index",
            Pointwise::Select => "select",
            Pointwise::Backward(u) => match u {
                Unary::Relu => "relu_backward",
                Unary::Silu => "silu_backward",
                Unary::Gelu => "gelu_backward",
                Unary::GeluTanh => "gelu_tanh_backward",
                Unary::Sigmoid => "sigmoid_backward",
                Unary::Identity | Unary::Exp | Unary::Log => "backward",
            },
        }
    }

    /// The activations with a cuDNN backward mode.
    pub(crate) fn has_backward(u: Unary) -> bool {
        matches!(u, Unary::Relu | Unary::Silu | Unary::Gelu | Unary::GeluTanh | Unary::Sigmoid)
    }

    fn raw(self) -> sys::cudnnPointwiseMode_t {
        use sys::cudnnPointwiseMode_t as M;
        match self {
            Pointwise::Unary(u) => match u {
                Unary::Identity => M::CUDNN_POINTWISE_IDENTITY,
                Unary::Exp => M::CUDNN_POINTWISE_EXP,
                Unary::Log => M::CUDNN_POINTWISE_LOG,
                Unary::Relu => M::CUDNN_POINTWISE_RELU_FWD,
                Unary::Silu => M::CUDNN_POINTWISE_SWISH_FWD,
                Unary::Gelu => M::CUDNN_POINTWISE_GELU_FWD,
                Unary::GeluTanh => M::CUDNN_POINTWISE_GELU_APPROX_TANH_FWD,
                Unary::Sigmoid => M::CUDNN_POINTWISE_SIGMOID_FWD,
            },
            Pointwise::Binary(b) => match b {
                Binary::Add => M::CUDNN_POINTWISE_ADD,
                Binary::Sub => M::CUDNN_POINTWISE_SUB,
                Binary::Mul => M::CUDNN_POINTWISE_MUL,
                Binary::Div => M::CUDNN_POINTWISE_DIV,
                Binary::CmpGe => M::CUDNN_POINTWISE_CMP_GE,
                Binary::CmpLt => M::CUDNN_POINTWISE_CMP_LT,
                Binary::LogicalAnd => M::CUDNN_POINTWISE_LOGICAL_AND,
            },
            Pointwise::GenIndex => M::CUDNN_POINTWISE_GEN_INDEX,
            Pointwise::Select => M::CUDNN_POINTWISE_BINARY_SELECT,
            // Validation refuses the others (`has_backward`) before anything is lowered.
            Pointwise::Backward(u) => match u {
                Unary::Relu => M::CUDNN_POINTWISE_RELU_BWD,
                Unary::Gelu => M::CUDNN_POINTWISE_GELU_BWD,
                Unary::GeluTanh => M::CUDNN_POINTWISE_GELU_APPROX_TANH_BWD,
                Unary::Sigmoid => M::CUDNN_POINTWISE_SIGMOID_BWD,
                _ => M::CUDNN_POINTWISE_SWISH_BWD,
            },
        }
    }
}

/// Per-batch sizes a matmul takes from device tensors instead of its dims (the frontend's
/// `set_m_override` etc., `CUDNN_ATTR_OPERATION_MATMUL_GEMM_{M,N,K}_OVERRIDE_DESC`): i32 tensors with
/// the output's batch dims and 1s for the matrix dims, each entry at most the dim it overrides. Padded
/// attention's matmuls run each sequence's lengths this way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct MatmulOverrides {
    pub m: Option<TensorId>,
    pub n: Option<TensorId>,
    pub k: Option<TensorId>,
}

impl MatmulOverrides {
    /// The override tensors present, with the dim each overrides.
    pub(crate) fn present(&self) -> impl Iterator<Item = (char, TensorId)> {
        [('M', self.m), ('N', self.n), ('K', self.k)].into_iter().filter_map(|(c, t)| t.map(|t| (c, t)))
    }
}

/// Which normalization a [`Node::Norm`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum NormMode {
    /// Root mean square (no mean subtracted, no bias).
    Rms,
    /// Mean and variance, with a bias.
    Layer,
}

impl NormMode {
    /// The operation's name in errors.
    fn operation(self) -> &'static str {
        match self {
            NormMode::Rms => "rmsnorm operation",
            NormMode::Layer => "layernorm operation",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Node {
    /// cuDNN's norm forward: RMS (`y = x · rsqrt(mean(x²) + ε) · scale`) or layer
    /// (`y = (x − mean) · rsqrt(var + ε) · scale + bias`) normalization of each row; in training the
    /// f32 statistics per row (the inverse RMS or standard deviation, and the layer norm's mean).
    Norm {
        mode: NormMode,
        x: TensorId,
        scale: TensorId,
        /// The layer norm's bias (like scale); none in RMS mode.
        bias: Option<TensorId>,
        epsilon: TensorId,
        y: TensorId,
        /// The layer norm's f32 mean per row (training only).
        mean: Option<TensorId>,
        /// The f32 inverse RMS or standard deviation per row (training only).
        inv_var: Option<TensorId>,
        phase: NormPhase,
    },
    /// cuDNN's norm backward in RMS mode, from the forward's saved f32 inverse RMS (no epsilon: it is
    /// inside the saved statistic).
    RmsNormBackward {
        dy: TensorId,
        x: TensorId,
        scale: TensorId,
        inv_rms: TensorId,
        dx: TensorId,
        dscale: TensorId,
    },
    /// `x` is cuDNN's X, `b` its B (second operand, or the false branch of a select), `t` the condition.
    Pointwise {
        op: Pointwise,
        compute: DataType,
        x: TensorId,
        b: Option<TensorId>,
        t: Option<TensorId>,
        y: TensorId,
        axis: Option<i64>,
    },
    Matmul {
        a: TensorId,
        b: TensorId,
        c: TensorId,
        overrides: MatmulOverrides,
    },
    Reduction {
        op: Reduce,
        x: TensorId,
        y: TensorId,
    },
    /// A view of `x` with other dims and strides over the same elements (a transpose), possibly in
    /// another dtype: cuDNN's `OPERATION_RESHAPE`, as the frontend's attention backward uses it.
    Reshape {
        x: TensorId,
        y: TensorId,
    },
    /// cuDNN's single SDPA forward operation (9.13.1+): Q, K, V `[b, h, s, d]` (K not transposed).
    SdpaFwd {
        q: TensorId,
        k: TensorId,
        v: TensorId,
        scale: TensorId,
        o: TensorId,
        stats: Option<TensorId>,
        /// Only [`Mask::None`] lowers with 9.19 bindings; validation rejects the rest.
        mask: super::Mask,
        /// Per-sequence lengths (q, kv), i32 `[b, 1, 1, 1]`: padded attention.
        seq_lens: Option<(TensorId, TensorId)>,
        /// Page tables (k, v), i32 `[b, 1, max_pages, 1]`: K and V are page pools (paged attention).
        page_tables: Option<(TensorId, TensorId)>,
    },
}

impl Node {
    pub(crate) fn inputs(&self) -> Vec<TensorId> {
        match *self {
            Node::Norm { x, scale, bias, epsilon, .. } => {
                [Some(x), Some(scale), bias, Some(epsilon)].into_iter().flatten().collect()
            }
            Node::RmsNormBackward { dy, x, scale, inv_rms, .. } => vec![dy, x, scale, inv_rms],
            Node::Pointwise { x, b, t, .. } => [Some(x), b, t].into_iter().flatten().collect(),
            Node::Matmul { a, b, overrides, .. } => {
                let mut v = vec![a, b];
                v.extend(overrides.present().map(|(_, t)| t));
                v
            }
            Node::Reduction { x, .. } | Node::Reshape { x, .. } => vec![x],
            Node::SdpaFwd { q, k, v, scale, seq_lens, page_tables, .. } => {
                let mut v = vec![q, k, v, scale];
                v.extend(seq_lens.into_iter().flat_map(|(a, b)| [a, b]));
                v.extend(page_tables.into_iter().flat_map(|(a, b)| [a, b]));
                v
            }
        }
    }

    pub(crate) fn outputs(&self) -> Vec<TensorId> {
        match *self {
            Node::Norm { y, mean, inv_var, .. } => [Some(y), mean, inv_var].into_iter().flatten().collect(),
            Node::RmsNormBackward { dx, dscale, .. } => vec![dx, dscale],
            Node::Pointwise { y, .. } | Node::Reduction { y, .. } | Node::Reshape { y, .. } => vec![y],
            Node::Matmul { c, .. } => vec![c],
            Node::SdpaFwd { o, stats, .. } => [Some(o), stats].into_iter().flatten().collect(),
        }
    }

    /// Creates and finalizes the operation descriptor; `t` maps tensors to their descriptors.
    pub(crate) fn lower<'a>(&self, t: impl Fn(TensorId) -> &'a Descriptor) -> Result<Descriptor> {
        match *self {
            Node::Norm { mode, x, scale, bias, epsilon, y, mean, inv_var, phase } => {
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR)?;
                let raw_mode = match mode {
                    NormMode::Rms => sys::cudnnBackendNormMode_t::CUDNN_RMS_NORM,
                    NormMode::Layer => sys::cudnnBackendNormMode_t::CUDNN_LAYER_NORM,
                };
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_MODE, Attr::NormMode(raw_mode))?;
                let raw_phase = match phase {
                    NormPhase::Inference => sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_INFERENCE,
                    NormPhase::Training => sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_TRAINING,
                };
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_PHASE, Attr::NormPhase(raw_phase))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, Attr::Descriptors(&[t(x)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, Attr::Descriptors(&[t(scale)]))?;
                if let Some(bias) = bias {
                    op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC, Attr::Descriptors(&[t(bias)]))?;
                }
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC, Attr::Descriptors(&[t(epsilon)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, Attr::Descriptors(&[t(y)]))?;
                if let Some(mean) = mean {
                    op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC, Attr::Descriptors(&[t(mean)]))?;
                }
                if let Some(inv) = inv_var {
                    op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC, Attr::Descriptors(&[t(inv)]))?;
                }
                op.finalize(mode.operation())?;
                Ok(op)
            }
            Node::RmsNormBackward { dy, x, scale, inv_rms, dx, dscale } => {
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_NORM_BACKWARD_DESCRIPTOR)?;
                op.set(
                    A::CUDNN_ATTR_OPERATION_NORM_BWD_MODE,
                    Attr::NormMode(sys::cudnnBackendNormMode_t::CUDNN_RMS_NORM),
                )?;
                // As the frontend's DRMSNormNode: no epsilon and no mean for RMS mode, no dbias.
                op.set(A::CUDNN_ATTR_OPERATION_NORM_BWD_XDESC, Attr::Descriptors(&[t(x)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC, Attr::Descriptors(&[t(dy)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_BWD_SCALE_DESC, Attr::Descriptors(&[t(scale)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_BWD_INV_VARIANCE_DESC, Attr::Descriptors(&[t(inv_rms)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_BWD_DSCALE_DESC, Attr::Descriptors(&[t(dscale)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_BWD_DXDESC, Attr::Descriptors(&[t(dx)]))?;
                op.finalize("rmsnorm backward operation")?;
                Ok(op)
            }
            Node::Pointwise { op: mode, compute, x, b, t: cond, y, axis } => {
                // The parameter descriptor is copied into the operation at finalize and dropped here.
                let mut pw = Descriptor::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
                pw.set(A::CUDNN_ATTR_POINTWISE_MODE, Attr::PointwiseMode(mode.raw()))?;
                pw.set(A::CUDNN_ATTR_POINTWISE_MATH_PREC, Attr::DataType(compute))?;
                if let Some(axis) = axis {
                    pw.set(A::CUDNN_ATTR_POINTWISE_AXIS, Attr::I64(&[axis]))?;
                }
                if matches!(mode, Pointwise::Unary(Unary::Silu) | Pointwise::Backward(Unary::Silu)) {
                    pw.set(A::CUDNN_ATTR_POINTWISE_SWISH_BETA, Attr::F64(1.0))?;
                }
                pw.finalize(&format!("pointwise {} descriptor", mode.name()))?;
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
                op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, Attr::Descriptors(&[&pw]))?;
                op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, Attr::Descriptors(&[t(x)]))?;
                if let Pointwise::Backward(_) = mode {
                    // Activation backward: X the forward input, DY the incoming gradient, DX the result.
                    let Some(dy) = b else {
                        return Err(crate::Error::invalid(format!(
                            "{} without its gradient input",
                            mode.name()
                        )));
                    };
                    op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, Attr::Descriptors(&[t(dy)]))?;
                    op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, Attr::Descriptors(&[t(y)]))?;
                } else {
                    if let Some(b) = b {
                        op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, Attr::Descriptors(&[t(b)]))?;
                    }
                    if let Some(c) = cond {
                        op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, Attr::Descriptors(&[t(c)]))?;
                    }
                    op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, Attr::Descriptors(&[t(y)]))?;
                }
                op.finalize(&format!("pointwise {} operation", mode.name()))?;
                Ok(op)
            }
            Node::Matmul { a, b, c, overrides } => {
                let mut mm = Descriptor::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
                mm.set(A::CUDNN_ATTR_MATMUL_COMP_TYPE, Attr::DataType(DataType::F32))?;
                // The frontend's padded bmm1 also sets a padding value of 0.0, which it lowers only
                // when non-zero (`CUDNN_ATTR_MATMUL_PADDING_VALUE`): the default, so nothing to set.
                mm.finalize("matmul descriptor")?;
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
                op.set(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, Attr::Descriptors(&[t(a)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, Attr::Descriptors(&[t(b)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, Attr::Descriptors(&[t(c)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, Attr::Descriptors(&[&mm]))?;
                for (dim, tensor) in overrides.present() {
                    let name = match dim {
                        'M' => A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
                        'N' => A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
                        _ => A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
                    };
                    op.set(name, Attr::Descriptors(&[t(tensor)]))?;
                }
                op.finalize("matmul operation")?;
                Ok(op)
            }
            Node::Reduction { op: reduce, x, y } => {
                use sys::cudnnReduceTensorOp_t as R;
                let raw = match reduce {
                    Reduce::Max => R::CUDNN_REDUCE_TENSOR_MAX,
                    Reduce::Sum => R::CUDNN_REDUCE_TENSOR_ADD,
                };
                let mut red = Descriptor::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
                red.set(A::CUDNN_ATTR_REDUCTION_OPERATOR, Attr::ReduceOp(raw))?;
                red.set(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, Attr::DataType(DataType::F32))?;
                red.finalize("reduction descriptor")?;
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
                op.set(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, Attr::Descriptors(&[t(x)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, Attr::Descriptors(&[t(y)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, Attr::Descriptors(&[&red]))?;
                op.finalize("reduction operation")?;
                Ok(op)
            }
            Node::Reshape { x, y } => {
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
                op.set(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, Attr::Descriptors(&[t(x)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, Attr::Descriptors(&[t(y)]))?;
                op.finalize("reshape operation")?;
                Ok(op)
            }
            Node::SdpaFwd { q, k, v, scale, o, stats, seq_lens, page_tables, .. } => {
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR)?;
                op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, Attr::Descriptors(&[t(q)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, Attr::Descriptors(&[t(k)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, Attr::Descriptors(&[t(v)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, Attr::Descriptors(&[t(scale)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, Attr::Descriptors(&[t(o)]))?;
                if let Some(s) = stats {
                    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC, Attr::Descriptors(&[t(s)]))?;
                }
                if let Some((sq, skv)) = seq_lens {
                    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_SEQ_LEN_QDESC, Attr::Descriptors(&[t(sq)]))?;
                    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_SEQ_LEN_KVDESC, Attr::Descriptors(&[t(skv)]))?;
                }
                if let Some((pk, pv)) = page_tables {
                    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_KDESC, Attr::Descriptors(&[t(pk)]))?;
                    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_VDESC, Attr::Descriptors(&[t(pv)]))?;
                }
                op.finalize("sdpa forward operation")?;
                Ok(op)
            }
        }
    }
}
