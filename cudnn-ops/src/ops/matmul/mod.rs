//! Matmul with fused epilogues: `D = epilogue(A · B)` for `A [batch, m, k]` and `B [batch or 1, k, n]`
//! over any row- or column-major strides, f32 accumulation, one cuDNN graph per shape, layout, dtypes and
//! epilogue.
//!
//! The epilogue steps always run in this order, each optional:
//!
//! ```text
//! D = ((A·B + bias) → activation) ⊙ U + R
//!      matmul   bias   SiLU/GELU/…   gate  residual
//! ```
//!
//! - `bias` is `[n]`, broadcast over rows (a Linear bias);
//! - the activation is one of [`Activation`];
//! - the gate multiplies by an input `U [batch, m, n]`: with SiLU this is the SwiGLU gate
//!   `silu(x·W_gate) ⊙ up`, where `up` was computed by the previous graph;
//! - the residual adds an input `R [batch, m, n]` (`x + o_proj(attn)`, `x + down_proj(mlp)`).
//!
//! A Linear layer `y[tokens, n] = x[tokens, k] · W[n, k]ᵀ` is [`MatmulArgs::linear`]: the batch is folded
//! into the rows (`[1, tokens, k]`) and the row-major weight is read through its `[1, k, n]` transposed
//! view (strides `[n·k, 1, k]`), never copied. The fused graph ([`MatmulArgs::graph`]) keeps every
//! intermediate in f32 and rounds once when writing D; the naive path ([`naive`]) rounds after every
//! step, as eager does.
//!
//! D, U and R are packed row-major `[batch, m, n]`. The output dtype is the input dtype or f32 (e.g.
//! logits from bf16 weights); bias, U and R have the output dtype.
//!
//! The fused backend runs a Linear layer over [`DECODE_GEMV_AUTO_TOKENS`] token (a batch-1 decode
//! step) with its own kernel, the decode GEMV ([`MatmulKernel::DecodeGemv`]), which streams the weight
//! once, every epilogue fused the same way (f32, one rounding); asked for, it takes up to
//! [`DECODE_GEMV_MAX_TOKENS`] (measured slower than the graph there); everything else runs the cuDNN
//! graph. [`MatmulArgs::fused_kernel`] says which runs, [`MatmulArgs::with_form`]
//! forces one, [`MatmulArgs::decode_gemv`] says why the GEMV does not take a call, and
//! [`Cudnn::kernel_runs`] lists the GEMV shapes a context ran (the plan cache lists the graphs).
//!
//! Two forms belong to the decode GEMV alone, for a one-token decode step (the cuDNN graph and the
//! naive backend refuse them as [`Error::NotSupported`]; a decoder composes [`rms_norm`](crate::rms_norm)
//! and separate matmuls there):
//! - a [`Prologue`] before the product: [`Prologue::rms_norm`] normalizes A's row over its k elements
//!   with a weight `[k]` ([`MatmulOperands::norm_weight`]) in f32 and multiplies, with no rounding of
//!   the normalized row in between ([`MatmulArgs::with_prologue`]): the prenorm before `qkv_proj`, or
//!   before the MLP's gate and up, in the projection's launch;
//! - the gate step's multiplier as a second product ([`MatmulArgs::with_up_product`]): `U = A · B_up`
//!   for a second weight of B's layout ([`MatmulOperands::up_weight`]), rounded to the output dtype as
//!   an up projection's output would be, instead of an input buffer: SwiGLU's gate and up in one
//!   launch that streams both weights;
//! - RoPE and the K/V append after the product ([`MatmulArgs::with_rotary`]): D is one token's
//!   `[Q heads, K heads, V heads]` row (`qkv_proj`), rotated in its Q and K heads by the position on
//!   the device and written, K and V heads also to that row of the caches ([`MatmulOperands::rotary`]),
//!   exactly as the projection followed by [`rope`](crate::rope) with a K/V append would (the same
//!   roundings): RoPE's launch folded into the projection's.

pub mod backward;
mod decode;
pub mod epilogue;
mod fused;
pub mod naive;
mod partials;

pub use backward::{
    linear_backward_data, linear_backward_weight, swiglu_down_backward, DataGrad, LinearGradArgs, SwigluForm,
    SwigluGrads, WeightGrad,
};
pub use decode::{DECODE_GEMV_AUTO_TOKENS, DECODE_GEMV_MAX_TOKENS};
pub use epilogue::{Activation, Epilogue};
pub use partials::{sum_partials, sum_partials_reference};

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::ops::rope::RopeTables;
use crate::ops::Op;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// Bytes every device tensor's rows must be aligned to (the alignment the fused graph declares).
const ALIGN_BYTES: usize = 16;

/// A rank-3 matrix operand: logical dims `[batch, rows, cols]` over element strides. One of the last
/// two strides must be 1 (row- or column-major); the batch stride is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct MatrixLayout {
    /// `[batch, rows, cols]`.
    pub dims: [usize; 3],
    /// Element strides of the three dims.
    pub strides: [usize; 3],
}

impl MatrixLayout {
    /// Logical dims `[batch, rows, cols]` over element `strides` (checked by the call, not here).
    pub fn strided(dims: [usize; 3], strides: [usize; 3]) -> Self {
        MatrixLayout { dims, strides }
    }

    /// Packed row-major `[batch, rows, cols]`.
    pub fn row_major(batch: usize, rows: usize, cols: usize) -> Self {
        MatrixLayout { dims: [batch, rows, cols], strides: [rows.saturating_mul(cols), cols, 1] }
    }

    /// Packed column-major `[batch, rows, cols]`: the transposed view of a row-major `[cols, rows]`
    /// matrix, e.g. a Linear weight stored `[n, k]` read as `[k, n]`.
    pub fn column_major(batch: usize, rows: usize, cols: usize) -> Self {
        MatrixLayout { dims: [batch, rows, cols], strides: [rows.saturating_mul(cols), 1, rows] }
    }

    /// Elements a buffer must hold: one past the furthest element the strides reach (`None` on
    /// overflow or a zero dim).
    pub fn min_elements(&self) -> Option<usize> {
        let mut last = 0usize;
        for (&d, &s) in self.dims.iter().zip(&self.strides) {
            last = last.checked_add(d.checked_sub(1)?.checked_mul(s)?)?;
        }
        last.checked_add(1)
    }

    /// The dims, marked `col-major` or followed by the strides when not row-major, for names and errors.
    fn describe(&self) -> String {
        let [b, r, c] = self.dims;
        if *self == MatrixLayout::row_major(b, r, c) {
            format!("{:?}", self.dims)
        } else if *self == MatrixLayout::column_major(b, r, c) {
            format!("{:?} col-major", self.dims)
        } else {
            format!("{:?}/{:?}", self.dims, self.strides)
        }
    }

    /// `(leading dim, its stride, extent of the unit-stride dim)`: for row-major `(rows, row stride,
    /// cols)`, for column-major `(cols, col stride, rows)`. `None` without a unit stride.
    pub(crate) fn leading(&self) -> Option<(usize, usize, usize)> {
        let [_, rows, cols] = self.dims;
        let [_, sr, sc] = self.strides;
        if sc == 1 {
            Some((rows, sr, cols))
        } else if sr == 1 {
            Some((cols, sc, rows))
        } else {
            None
        }
    }

    fn check(&self, name: &str, dtype: DataType) -> Result<()> {
        let MatrixLayout { dims, strides } = *self;
        ensure!(dims.iter().all(|&d| d > 0), "matmul: {name} dims {dims:?} must all be > 0");
        ensure!(strides.iter().all(|&s| s > 0), "matmul: {name} strides {strides:?} must all be > 0");
        // cuDNN takes dims and strides as i64, and the furthest element must be addressable.
        for (&d, &s) in dims.iter().zip(&strides) {
            crate::checked::fits_i64(&format!("matmul: {name} dim"), d)?;
            crate::checked::fits_i64(&format!("matmul: {name} stride"), s)?;
        }
        crate::checked::extent(&format!("matmul: {name} extent"), &dims, &strides)?;
        let Some((lead, lead_stride, unit_extent)) = self.leading() else {
            return Err(Error::invalid(format!(
                "matmul: {name} strides {strides:?} have no unit stride in the last two dims; \
                 the matrix must be row- or column-major"
            )));
        };
        let align = ALIGN_BYTES / dtype.size();
        if lead > 1 {
            ensure!(
                lead_stride >= unit_extent,
                "matmul: {name} dims {dims:?} with strides {strides:?}: rows or columns overlap"
            );
            ensure!(
                lead_stride.is_multiple_of(align),
                "matmul: misaligned {name} for {dtype}: leading stride {lead_stride} (strides {strides:?}) must \
                 be a multiple of {align} elements ({ALIGN_BYTES} bytes)"
            );
        }
        if dims[0] > 1 {
            ensure!(
                strides[0].is_multiple_of(align),
                "matmul: misaligned {name} for {dtype}: batch stride {} must be a multiple of {align} elements",
                strides[0]
            );
        }
        Ok(())
    }
}

/// Element counts of the buffers of one call, checked by [`MatmulArgs::check`] (no GPU needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BufferLens {
    /// A.
    pub a: usize,
    /// B.
    pub b: usize,
    /// The bias, when given.
    pub bias: Option<usize>,
    /// The multiplier U of the gate step, when given.
    pub up: Option<usize>,
    /// The prologue's norm weight, when given.
    pub norm_weight: Option<usize>,
    /// The second weight `B_up` of the up product, when given.
    pub up_weight: Option<usize>,
    /// The residual R, when given.
    pub residual: Option<usize>,
    /// The rotary epilogue's tables and buffers, when given.
    pub rotary: Option<RotaryLens>,
    /// The output D.
    pub d: usize,
}

/// What [`MatmulArgs::check`] checks of a rotary epilogue's operands ([`RotaryOperands`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RotaryLens {
    /// Positions the tables cover (a position past them leaves the row unrotated and unappended, as
    /// the RoPE op does; not an error, since the position is a device value).
    pub table_positions: usize,
    /// The head dim the tables are for.
    pub table_dim: usize,
    /// Elements of the device position.
    pub position: usize,
    /// Elements of the K cache.
    pub k: usize,
    /// Elements of the V cache.
    pub v: usize,
}

/// What the fused backend runs for a matmul ([`MatmulArgs::fused_kernel`]; forced with
/// [`MatmulArgs::with_form`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MatmulKernel {
    /// The cuDNN graph ([`MatmulArgs::graph`]): every shape, layout and dtype.
    Graph,
    /// The decode GEMV (`decode.rs`, `decode.cu`): a Linear layer over at most [`DECODE_GEMV_MAX_TOKENS`] tokens, bf16
    /// or f16 in and out, x and W 16-byte aligned; anything else is [`Error::NotSupported`] naming why.
    DecodeGemv,
}

impl MatmulKernel {
    /// `graph` or `decode gemv`.
    pub fn name(self) -> &'static str {
        match self {
            MatmulKernel::Graph => "graph",
            MatmulKernel::DecodeGemv => "decode gemv",
        }
    }
}

/// Shapes and layouts of a matmul, `A [batch, m, k] · B [batch or 1, k, n]`, its epilogue and, for the
/// fused backend, the kernel asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct MatmulArgs {
    /// A `[batch, m, k]`.
    pub a: MatrixLayout,
    /// B `[batch or 1, k, n]` (batch 1 is shared by every batch of A).
    pub b: MatrixLayout,
    /// The steps after the matmul; the operands carry the inputs it needs.
    pub epilogue: Epilogue,
    /// What the fused backend runs; `None` chooses ([`MatmulArgs::fused_kernel`]): the decode GEMV where
    /// it applies ([`MatmulArgs::decode_gemv`]), the cuDNN graph otherwise. The naive backend ignores it.
    pub form: Option<MatmulKernel>,
    /// A step on A's rows before the product (the decode GEMV only; the operands carry its weight).
    pub prologue: Option<Prologue>,
    /// The gate step's multiplier U is `A · B_up`, a second weight of B's layout
    /// ([`MatmulOperands::up_weight`]), computed in the same kernel (the decode GEMV only).
    pub up_product: bool,
    /// RoPE and the K/V append after the product (the decode GEMV only; the operands carry the
    /// tables, the position and the caches).
    pub rotary: Option<Rotary>,
}

/// D as one token's `[Q heads, K heads, V heads]` row (`heads_q + 2 · heads_kv` heads of `head_dim`):
/// the decode GEMV rounds it as the projection's output, rotates the Q and K heads by the position on
/// the device (f32, one rounding, as [`rope`](crate::rope) does) and writes the K and V heads also to
/// that row of the caches `[max_seq, heads_kv · head_dim]` ([`MatmulArgs::with_rotary`],
/// [`MatmulOperands::rotary`]). A position outside the tables or the cache leaves D unrotated and
/// the caches untouched, as the RoPE op does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Rotary {
    /// Query heads.
    pub heads_q: usize,
    /// K (and V) heads.
    pub heads_kv: usize,
    /// Elements per head (even).
    pub head_dim: usize,
    /// Rows of each cache.
    pub max_seq: usize,
}

impl Rotary {
    /// `heads_q` query heads and `heads_kv` K/V heads of `head_dim`, caches of `max_seq` rows.
    pub fn new(heads_q: usize, heads_kv: usize, head_dim: usize, max_seq: usize) -> Self {
        Rotary { heads_q, heads_kv, head_dim, max_seq }
    }

    /// `rope(32/8x128)`, for names and errors.
    pub fn name(self) -> String {
        format!("rope({}/{}x{})", self.heads_q, self.heads_kv, self.head_dim)
    }
}

/// A step on each row of A before the product ([`MatmulArgs::with_prologue`]); the decode GEMV
/// runs it at one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Prologue {
    /// RMSNorm over the row's k elements with a weight `[k]` in the input dtype:
    /// `a ← a / sqrt(mean(a²) + ε) · w`, then the product, in f32 with the one rounding of the
    /// output (the decode GEMV sums `B · (a ∘ w)` and scales the sums by `rsqrt(mean(a²) + ε)`; an
    /// RMSNorm graph followed by a matmul rounds the normalized row to the input dtype in between, so
    /// the two differ by that rounding). ε is kept as its bits (so the arguments hash);
    /// [`Prologue::rms_norm`] builds it, [`Prologue::epsilon`] reads it.
    RmsNorm {
        /// `f32::to_bits` of ε.
        epsilon_bits: u32,
    },
}

impl Prologue {
    /// RMSNorm with `epsilon` added to the mean square.
    pub fn rms_norm(epsilon: f32) -> Self {
        Prologue::RmsNorm { epsilon_bits: epsilon.to_bits() }
    }

    /// ε of the RMSNorm.
    pub fn epsilon(self) -> f32 {
        match self {
            Prologue::RmsNorm { epsilon_bits } => f32::from_bits(epsilon_bits),
        }
    }

    /// `rms_norm(eps)`, for names and errors.
    pub fn name(self) -> String {
        format!("rms_norm({:e})", self.epsilon())
    }
}

impl MatmulArgs {
    /// A `[batch, m, k]` and B `[batch or 1, k, n]` in any layouts (strided views), no epilogue.
    pub fn new(a: MatrixLayout, b: MatrixLayout) -> Self {
        MatmulArgs {
            a,
            b,
            epilogue: Epilogue::NONE,
            form: None,
            prologue: None,
            up_product: false,
            rotary: None,
        }
    }

    /// Row-major A `[batch, m, k]` and B `[batch, k, n]`, no epilogue.
    pub fn packed(batch: usize, m: usize, k: usize, n: usize) -> Self {
        MatmulArgs::new(MatrixLayout::row_major(batch, m, k), MatrixLayout::row_major(batch, k, n))
    }

    /// A Linear layer `y[tokens, out] = x[tokens, in] · W[out, in]ᵀ`: A `[1, tokens, in]` row-major, B the
    /// `[1, in, out]` transposed view of the row-major weight; no epilogue.
    pub fn linear(tokens: usize, in_features: usize, out_features: usize) -> Self {
        MatmulArgs::new(
            MatrixLayout::row_major(1, tokens, in_features),
            MatrixLayout::column_major(1, in_features, out_features),
        )
    }

    /// The same product followed by `epilogue`.
    pub fn with_epilogue(self, epilogue: Epilogue) -> Self {
        MatmulArgs { epilogue, ..self }
    }

    /// The same product with the fused backend's kernel fixed (e.g. [`MatmulKernel::Graph`] to compare
    /// the cuDNN graph with the decode GEMV); a GEMV that does not take the call is
    /// [`Error::NotSupported`].
    pub fn with_form(self, form: MatmulKernel) -> Self {
        MatmulArgs { form: Some(form), ..self }
    }

    /// The same product after `prologue` on A's rows (the decode GEMV's form: the graph and the naive
    /// backend refuse it); the operands carry its weight ([`MatmulOperands::norm_weight`]).
    pub fn with_prologue(self, prologue: Prologue) -> Self {
        MatmulArgs { prologue: Some(prologue), ..self }
    }

    /// The same product whose gate step multiplies by `A · B_up` computed in the same kernel (the
    /// decode GEMV's form) instead of an input U; the epilogue must have the gate step, the operands
    /// carry `B_up` ([`MatmulOperands::up_weight`]) and no U.
    pub fn with_up_product(self) -> Self {
        MatmulArgs { up_product: true, ..self }
    }

    /// The same product followed by RoPE and the K/V append ([`Rotary`]; the decode GEMV's form at
    /// one token: the graph and the naive backend refuse it); the operands carry the tables, the
    /// position and the caches ([`MatmulOperands::rotary`]).
    pub fn with_rotary(self, rotary: Rotary) -> Self {
        MatmulArgs { rotary: Some(rotary), ..self }
    }

    /// The prologue and the up product, when there are any: `rms_norm(1e-5) up-product`, for names.
    pub(crate) fn forms(&self) -> Option<String> {
        let parts: Vec<String> = self
            .prologue
            .map(Prologue::name)
            .into_iter()
            .chain(self.up_product.then(|| "up-product".to_string()))
            .chain(self.rotary.map(Rotary::name))
            .collect();
        (!parts.is_empty()).then(|| parts.join(" "))
    }

    /// Batch of A and D.
    pub fn batch(&self) -> usize {
        self.a.dims[0]
    }

    /// Rows of A and D.
    pub fn m(&self) -> usize {
        self.a.dims[1]
    }

    /// Rows each read of a B matrix serves: every batch's (`batch · m`) where all batches share one B
    /// (a linear layer over packed rows), else one batch's `m`. Autotuning goes by it
    /// ([`Tuning::for_rows`](crate::Tuning::for_rows)).
    pub fn weight_rows(&self) -> usize {
        if self.b.dims[0] == 1 {
            self.batch().saturating_mul(self.m())
        } else {
            self.m()
        }
    }

    /// The inner dimension (of A; B's must match).
    pub fn k(&self) -> usize {
        self.a.dims[2]
    }

    /// Columns of B and D.
    pub fn n(&self) -> usize {
        self.b.dims[2]
    }

    /// Elements of D (and of U and R): `batch · m · n`.
    pub fn d_len(&self) -> usize {
        self.batch().saturating_mul(self.m()).saturating_mul(self.n())
    }

    /// `2 · batch · m · n · k`, the matmul's floating-point operations (epilogues not counted).
    pub fn flops(&self) -> f64 {
        2.0 * self.batch() as f64 * self.m() as f64 * self.n() as f64 * self.k() as f64
    }

    /// Checks shapes, dtypes, layouts, alignment, the operands the epilogue needs and the buffer lengths
    /// shared by every backend; nothing is touched on error. Shape and length errors are
    /// [`Error::InvalidArgument`]; a dtype pair with no implementation is [`Error::NotSupported`].
    pub fn check(&self, dtype: DataType, out: DataType, lens: &BufferLens) -> Result<()> {
        let (a, b, epilogue) = (self.a, self.b, self.epilogue);
        ensure!(a.dims.iter().all(|&d| d > 0), "matmul: A dims {:?} must all be > 0", a.dims);
        ensure!(b.dims.iter().all(|&d| d > 0), "matmul: B dims {:?} must all be > 0", b.dims);
        ensure!(
            a.dims[2] == b.dims[1],
            "matmul: inner dimensions differ: A {:?} has k = {}, B {:?} has k = {}",
            a.dims,
            a.dims[2],
            b.dims,
            b.dims[1]
        );
        ensure!(
            b.dims[0] == 1 || b.dims[0] == a.dims[0],
            "matmul: batch mismatch: A {:?} has batch {}, B {:?} has batch {} (must be 1 or {})",
            a.dims,
            a.dims[0],
            b.dims,
            b.dims[0],
            a.dims[0]
        );
        check_dtypes(dtype, out)?;
        let (k, n) = (self.k(), self.n());
        let align_in = ALIGN_BYTES / dtype.size();
        let align_n = align_in.max(ALIGN_BYTES / out.size());
        ensure!(
            k.is_multiple_of(align_in),
            "matmul: misaligned k for {dtype}: k = {k} must be a multiple of {align_in} ({ALIGN_BYTES} bytes)"
        );
        ensure!(
            n.is_multiple_of(align_n),
            "matmul: misaligned n for {dtype} -> {out}: n = {n} must be a multiple of {align_n} ({ALIGN_BYTES} \
             bytes)"
        );
        a.check("A", dtype)?;
        b.check("B", dtype)?;
        let d_len = self.batch().checked_mul(self.m()).and_then(|r| r.checked_mul(n));
        let (Some(d_len), Some(a_need), Some(b_need)) = (d_len, a.min_elements(), b.min_elements()) else {
            return Err(Error::invalid(format!("matmul: {} overflows", self.describe())));
        };
        ensure!(d_len <= i64::MAX as usize, "matmul: {} overflows", self.describe());
        let name = epilogue.name();
        ensure!(
            !self.up_product || epilogue.gate,
            "matmul: the up product is the gate step's multiplier, epilogue `{name}` has no gate step"
        );
        let u_buffer = epilogue.gate && !self.up_product;
        ensure!(
            !(self.up_product && lens.up.is_some()),
            "matmul: a multiplier U was given, but the up product computes it (A · B_up)"
        );
        ensure!(
            self.up_product || lens.up_weight.is_none(),
            "matmul: an up weight B_up was given without the up product (MatmulArgs::with_up_product)"
        );
        ensure!(
            !self.up_product || lens.up_weight.is_some(),
            "matmul: the up product needs a second weight B_up (MatmulOperands::up_weight), none was given"
        );
        ensure!(
            self.prologue.is_some() || lens.norm_weight.is_none(),
            "matmul: a norm weight was given without a prologue (MatmulArgs::with_prologue)"
        );
        if let Some(p) = self.prologue {
            let eps = p.epsilon();
            ensure!(
                eps.is_finite() && eps >= 0.0,
                "matmul: prologue {}: epsilon must be finite and >= 0",
                p.name()
            );
            let Some(len) = lens.norm_weight else {
                return Err(Error::invalid(format!(
                    "matmul: prologue {} needs a norm weight [k] (MatmulOperands::norm_weight), none was given",
                    p.name()
                )));
            };
            ensure!(len == k, "matmul: prologue {}: norm weight has {len} elements, k is {k}", p.name());
        }
        self.check_rotary(dtype, out, lens)?;
        if let Some(len) = lens.up_weight {
            ensure!(
                len >= b_need,
                "matmul: B_up has {len} elements, needs {b_need} for {} (B's layout)",
                b.describe()
            );
        }
        for (step, wanted, given, what) in [
            ("bias", epilogue.bias, lens.bias, "a bias"),
            ("gate", u_buffer, lens.up, "a multiplier U (the up projection)"),
            ("residual", epilogue.residual, lens.residual, "a residual R"),
        ] {
            ensure!(!wanted || given.is_some(), "matmul: epilogue `{name}` needs {what}, none was given");
            ensure!(
                wanted || given.is_none(),
                "matmul: {what} was given, but epilogue `{name}` has no {step} step"
            );
        }
        ensure!(lens.a >= a_need, "matmul: A has {} elements, needs {a_need} for {}", lens.a, a.describe());
        ensure!(lens.b >= b_need, "matmul: B has {} elements, needs {b_need} for {}", lens.b, b.describe());
        if let Some(len) = lens.bias {
            ensure!(len == n, "matmul: bias has {len} elements, n is {n}");
        }
        for (what, len) in [("gate multiplier U", lens.up), ("residual R", lens.residual)] {
            if let Some(len) = len {
                ensure!(len >= d_len, "matmul: {what} has {len} elements, needs batch*m*n = {d_len}");
            }
        }
        ensure!(lens.d >= d_len, "matmul: output has {} elements, needs batch*m*n = {d_len}", lens.d);
        Ok(())
    }

    /// The rotary epilogue's shape and operands ([`Rotary`]): one token, D of exactly `heads_q +
    /// 2 · heads_kv` heads, no step but the bias before it, tables for the head dim, caches of
    /// `max_seq` rows.
    fn check_rotary(&self, dtype: DataType, out: DataType, lens: &BufferLens) -> Result<()> {
        let (Some(r), Some(l)) = (self.rotary, lens.rotary) else {
            ensure!(
                self.rotary.is_none(),
                "matmul: the rotary epilogue needs its tables, position and caches (MatmulOperands::rotary),                  none were given"
            );
            ensure!(
                lens.rotary.is_none(),
                "matmul: rotary operands were given without the rotary epilogue (MatmulArgs::with_rotary)"
            );
            return Ok(());
        };
        let name = r.name();
        ensure!(
            self.batch() == 1 && self.m() == 1,
            "matmul: {name}: the rotary epilogue takes one token, A is {}",
            self.a.describe()
        );
        ensure!(
            out == dtype,
            "matmul: {name}: the output dtype {out} must be the input dtype {dtype} (the caches')"
        );
        ensure!(
            r.heads_q > 0
                && r.heads_kv > 0
                && r.head_dim > 0
                && r.head_dim.is_multiple_of(2)
                && r.max_seq > 0,
            "matmul: {name}: heads, an even head dim and max_seq must be > 0 (max_seq {})",
            r.max_seq
        );
        let e = self.epilogue;
        ensure!(
            e.activation.is_none() && !e.gate && !e.residual && !self.up_product,
            "matmul: {name}: the rotary epilogue follows the product (and a bias) only, not `{}`{}",
            e.name(),
            if self.up_product { " with the up product" } else { "" }
        );
        let heads = checked::add("matmul: heads_q + 2 * heads_kv", r.heads_q, 2 * r.heads_kv)?;
        let width = checked::mul("matmul: rotary row width", heads, r.head_dim)?;
        ensure!(
            self.n() == width,
            "matmul: {name}: n = {} must be (heads_q + 2 * heads_kv) * head_dim = {width}",
            self.n()
        );
        ensure!(
            l.table_dim == r.head_dim,
            "matmul: {name}: the RoPE tables are for head dim {}, not {}",
            l.table_dim,
            r.head_dim
        );
        ensure!(l.position >= 1, "matmul: {name}: the device position buffer is empty");
        let cache = checked::mul("matmul: rotary cache elements", r.max_seq, r.heads_kv * r.head_dim)?;
        for (what, len) in [("K", l.k), ("V", l.v)] {
            ensure!(
                len >= cache,
                "matmul: {name}: the {what} cache has {len} elements, needs max_seq * heads_kv * head_dim = {cache}"
            );
        }
        Ok(())
    }

    /// `[b, m, k] x [b, k, n]` with layouts marked, for names and errors.
    fn describe(&self) -> String {
        format!("{} x {}", self.a.describe(), self.b.describe())
    }

    /// The plan-cache key (the form is not part of it: the graph is the same whichever way it was chosen;
    /// the graph refuses a prologue and the up product, so no key of a plan carries them).
    pub fn key(&self, dtype: DataType, out: DataType) -> Key {
        Key { args: MatmulArgs { form: None, ..*self }, dtype, out_dtype: out }
    }
}

/// What identifies a matmul plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Key {
    /// Layouts of A and B, and the epilogue (the form is always `None`).
    pub args: MatmulArgs,
    /// Dtype of A and B.
    pub dtype: DataType,
    /// Dtype of D and of the epilogue's inputs.
    pub out_dtype: DataType,
}

fn check_dtypes(dtype: DataType, out: DataType) -> Result<()> {
    const FLOATS: [DataType; 3] = [DataType::BF16, DataType::F16, DataType::F32];
    ensure!(FLOATS.contains(&dtype), "matmul: input dtype {dtype} is not bf16, f16 or f32");
    ensure!(FLOATS.contains(&out), "matmul: output dtype {out} is not bf16, f16 or f32");
    if out != dtype && out != DataType::F32 {
        return Err(Error::NotSupported {
            op: format!("matmul {dtype} -> {out}"),
            reason: format!("{dtype} inputs with a {out} output: the output dtype must be {dtype} or f32"),
        });
    }
    Ok(())
}

/// The device buffers of one call: A and B in the input dtype `T`; bias, U and R (the epilogue's
/// inputs) and the output D in the output dtype `O`.
#[non_exhaustive]
pub struct MatmulOperands<'a, T: Element, O: Element = T, W: Element = T> {
    /// A, laid out as [`MatmulArgs::a`].
    pub a: &'a dyn DevicePtr<T>,
    /// B, laid out as [`MatmulArgs::b`]: in A's dtype, or a Linear's FP8 weight
    /// ([`MatmulOperands::fp8_weight`]).
    pub b: &'a dyn DevicePtr<W>,
    /// An FP8 B's dequantization factors (`value = code · factor`): one, or one per output channel.
    pub b_scale: Option<&'a dyn DevicePtr<f32>>,
    /// An FP8 B_up's factors, as `b_scale`.
    pub up_scale: Option<&'a dyn DevicePtr<f32>>,
    /// The bias `[n]`.
    pub bias: Option<&'a dyn DevicePtr<O>>,
    /// The multiplier U of the gate step (`⊙ U`), packed `[batch, m, n]`: in SwiGLU, the up
    /// projection `x · W_upᵀ` (A · B being the gate projection).
    pub up: Option<&'a dyn DevicePtr<O>>,
    /// The residual R, packed `[batch, m, n]`.
    pub residual: Option<&'a dyn DevicePtr<O>>,
    /// The weight `[k]` of the RMSNorm prologue ([`MatmulArgs::with_prologue`]).
    pub norm_weight: Option<&'a dyn DevicePtr<T>>,
    /// The second weight `B_up` of the up product ([`MatmulArgs::with_up_product`]), laid out as B.
    pub up_weight: Option<&'a dyn DevicePtr<W>>,
    /// The rotary epilogue's tables, position and caches ([`MatmulArgs::with_rotary`]).
    pub rotary: Option<RotaryOperands<'a, T>>,
    /// The next kernel reads D without waiting for this call in its code ([`MatmulOperands::before_collective`]).
    pub before_collective: bool,
    /// The output D, packed `[batch, m, n]`.
    pub d: &'a mut dyn DevicePtrMut<O>,
}

/// What the rotary epilogue reads and writes besides D ([`Rotary`]).
#[non_exhaustive]
pub struct RotaryOperands<'a, T: Element> {
    /// The cos/sin tables.
    pub tables: &'a RopeTables<T>,
    /// The token's position, on the device (`[1]` i32; a decode step's position buffer).
    pub position: &'a CudaSlice<i32>,
    /// The K cache `[max_seq, heads_kv · head_dim]`.
    pub k: &'a mut CudaSlice<T>,
    /// The V cache, as K.
    pub v: &'a mut CudaSlice<T>,
}

impl<'a, T: Element> RotaryOperands<'a, T> {
    /// The tables, the device position and the K and V caches.
    pub fn new(
        tables: &'a RopeTables<T>,
        position: &'a CudaSlice<i32>,
        k: &'a mut CudaSlice<T>,
        v: &'a mut CudaSlice<T>,
    ) -> Self {
        RotaryOperands { tables, position, k, v }
    }
}

impl<'a, T: Element, O: Element> MatmulOperands<'a, T, O> {
    /// A and B in, D out, no epilogue inputs.
    pub fn new(a: &'a dyn DevicePtr<T>, b: &'a dyn DevicePtr<T>, d: &'a mut dyn DevicePtrMut<O>) -> Self {
        MatmulOperands::with_weight(a, b, None, d)
    }
}

impl<'a, T: Element, O: Element, W: Element> MatmulOperands<'a, T, O, W> {
    /// A Linear layer's x, its FP8 weight `[n, k]` (E4M3, or E5M2 for the plain product) with the
    /// dequantization factors `b_scale` (one, or one per output channel), and D: on the fused
    /// backend the decode GEMV streams the codes (up to 8 tokens, every form); more tokens, and the
    /// naive backend, dequantize the weight into A's dtype first.
    pub fn fp8_weight(
        a: &'a dyn DevicePtr<T>,
        b: &'a dyn DevicePtr<W>,
        b_scale: &'a dyn DevicePtr<f32>,
        d: &'a mut dyn DevicePtrMut<O>,
    ) -> Self {
        MatmulOperands::with_weight(a, b, Some(b_scale), d)
    }

    fn with_weight(
        a: &'a dyn DevicePtr<T>,
        b: &'a dyn DevicePtr<W>,
        b_scale: Option<&'a dyn DevicePtr<f32>>,
        d: &'a mut dyn DevicePtrMut<O>,
    ) -> Self {
        MatmulOperands {
            a,
            b,
            b_scale,
            up_scale: None,
            bias: None,
            up: None,
            residual: None,
            norm_weight: None,
            up_weight: None,
            rotary: None,
            before_collective: false,
            d,
        }
    }

    /// Adds the bias.
    pub fn bias(mut self, bias: &'a dyn DevicePtr<O>) -> Self {
        self.bias = Some(bias);
        self
    }

    /// Adds the multiplier U of the gate step: in SwiGLU (`silu(x · W_gateᵀ) ⊙ (x · W_upᵀ)`, with
    /// [`Epilogue::SWIGLU`]) the up projection, A and B being x and the gate weight.
    pub fn up(mut self, u: &'a dyn DevicePtr<O>) -> Self {
        self.up = Some(u);
        self
    }

    /// Adds the residual R.
    pub fn residual(mut self, r: &'a dyn DevicePtr<O>) -> Self {
        self.residual = Some(r);
        self
    }

    /// Adds the weight `[k]` of the RMSNorm prologue.
    pub fn norm_weight(mut self, w: &'a dyn DevicePtr<T>) -> Self {
        self.norm_weight = Some(w);
        self
    }

    /// Adds the second weight `B_up` of the up product (B's layout): the gate step multiplies by
    /// `A · B_up` instead of a U.
    pub fn up_weight(mut self, w: &'a dyn DevicePtr<W>) -> Self {
        self.up_weight = Some(w);
        self
    }

    /// Adds an FP8 `B_up`'s dequantization factors (as many as B's).
    pub fn up_scale(mut self, s: &'a dyn DevicePtr<f32>) -> Self {
        self.up_scale = Some(s);
        self
    }

    /// Adds the rotary epilogue's tables, position and caches.
    pub fn rotary(mut self, r: RotaryOperands<'a, T>) -> Self {
        self.rotary = Some(r);
        self
    }

    /// The kernel after this call reads D without waiting for it in its code: NCCL's symmetric
    /// collectives (2.28), launched as programmatic dependents of the kernel before them that never
    /// call `griddepcontrol.wait`, start as soon as that kernel lets its dependents launch. So the
    /// fused backend's decode GEMV, which lets them launch early (`decode.rs`), does not here; its
    /// fused forms, which always do, refuse the call ([`Error::NotSupported`]). Other kernels run as
    /// they always do: only the decode GEMV is known here not to let the next kernel start early
    /// this way.
    pub fn before_collective(mut self) -> Self {
        self.before_collective = true;
        self
    }

    /// These operands with B in A's dtype in place of an FP8 B (its dequantized copy, `b`); B_up and
    /// the factors go (the forms that read them run in the decode GEMV only).
    pub(crate) fn with_b<'b>(self, b: &'b dyn DevicePtr<T>) -> MatmulOperands<'b, T, O>
    where
        'a: 'b,
    {
        MatmulOperands {
            a: self.a,
            b,
            b_scale: None,
            up_scale: None,
            bias: self.bias,
            up: self.up,
            residual: self.residual,
            norm_weight: self.norm_weight,
            up_weight: None,
            rotary: self.rotary,
            before_collective: self.before_collective,
            d: self.d,
        }
    }

    /// The buffer lengths.
    pub fn lens(&self) -> BufferLens {
        BufferLens {
            a: self.a.len(),
            b: self.b.len(),
            bias: self.bias.map(|x| x.len()),
            up: self.up.map(|x| x.len()),
            norm_weight: self.norm_weight.map(|x| x.len()),
            up_weight: self.up_weight.map(|x| x.len()),
            residual: self.residual.map(|x| x.len()),
            rotary: self.rotary.as_ref().map(|r| RotaryLens {
                table_positions: r.tables.positions(),
                table_dim: r.tables.dim(),
                position: r.position.len(),
                k: r.k.len(),
                v: r.v.len(),
            }),
            d: self.d.len(),
        }
    }
}

impl<T: Element, O: Element, W: Element> Op<(T, O, W)> for MatmulArgs {
    type Operands<'a> = MatmulOperands<'a, T, O, W>;

    fn checked(self, x: &MatmulOperands<'_, T, O, W>) -> Result<Self> {
        let scales = (x.b_scale.map(|s| s.len()), x.up_scale.map(|s| s.len()));
        self.check_weight(T::DTYPE, W::DTYPE, scales)?;
        // An FP8 weight's layout and length are checked as B in A's dtype (one code per element).
        self.check(T::DTYPE, O::DTYPE, &x.lens())?;
        Ok(self)
    }
}

impl MatmulArgs {
    /// B's element and, for FP8 codes, their factors (`scales`: B's and B_up's counts): B in A's
    /// dtype takes none; an FP8 B is a Linear's row-major `[n, k]` weight ([`MatmulArgs::linear`])
    /// with k a multiple of 16, one factor or one per output channel (B_up's as many as B's).
    pub fn check_weight(
        &self,
        dtype: DataType,
        weight: DataType,
        (b_scale, up_scale): (Option<usize>, Option<usize>),
    ) -> Result<()> {
        if weight == dtype {
            ensure!(
                b_scale.is_none() && up_scale.is_none(),
                "matmul: weight factors were given for a {weight} weight (they dequantize FP8 codes)"
            );
            return Ok(());
        }
        if !matches!(weight, DataType::F8E4M3 | DataType::F8E5M2) {
            return Err(Error::NotSupported {
                op: format!("matmul {} {dtype} x {weight}", self.describe()),
                reason: format!("B in {weight}: B is in A's dtype {dtype}, or FP8 codes (E4M3, E5M2)"),
            });
        }
        let (k, n) = (self.k(), self.n());
        let linear = MatmulArgs::linear(self.batch() * self.m(), k, n).b;
        ensure!(
            self.b == linear,
            "matmul: an FP8 weight is a Linear's row-major [n, k] weight (MatmulArgs::linear), not {}",
            self.b.describe()
        );
        ensure!(k.is_multiple_of(16), "matmul: FP8 weight: k = {k} must be a multiple of 16 (16-byte rows)");
        let Some(count) = b_scale else {
            return Err(Error::invalid(format!(
                "matmul: a {weight} weight needs its dequantization factors (MatmulOperands::fp8_weight)"
            )));
        };
        ensure!(
            count == 1 || count == n,
            "matmul: FP8 weight factors: {count} given, needs 1 or one per output channel ({n})"
        );
        ensure!(
            up_scale.is_some() == self.up_product,
            "matmul: an FP8 B_up's factors come with the up product, and only with it (MatmulOperands::up_scale)"
        );
        if let Some(up) = up_scale {
            ensure!(up == count, "matmul: B_up has {up} factors, B has {count}: give as many");
        }
        Ok(())
    }
}

/// `D = epilogue(A · B)` on `backend`: the fused cuDNN graph, or a cuBLAS GEMM followed by one kernel
/// per epilogue step. A Linear layer is [`MatmulArgs::linear`] with `MatmulOperands::new(&x, &weight,
/// &mut y)` plus the epilogue's inputs, e.g. `.residual(&h)` for `h + o_proj(attn)` or `.up(&up)`
/// with [`Epilogue::SWIGLU`] (A·B being x and the gate weight).
pub fn matmul<T: Element, O: Element, W: Element>(
    ctx: &Cudnn,
    args: &MatmulArgs,
    x: MatmulOperands<'_, T, O, W>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<(T, O, W), _>(ctx, *args, x, backend)
}

/// The f64 reference of a Linear over an FP8 weight ([`MatmulOperands::fp8_weight`]):
/// `y[m, n] = Σ_k x[m, k] · w[n, k] · w_scale[n or 0]`, `x` the activations as the device holds them.
pub fn fp8_weight_reference<W: Element>(
    (m, n, k): (usize, usize, usize),
    x: &[f64],
    w: &[W],
    w_scale: &[f32],
) -> Vec<f64> {
    assert!(w_scale.len() == 1 || w_scale.len() == n, "reference FP8 weight: {} factors", w_scale.len());
    assert_eq!((x.len(), w.len()), (m * k, n * k), "reference FP8 weight");
    let mut y = Vec::with_capacity(m * n);
    for row in x.chunks(k) {
        for (j, col) in w.chunks(k).enumerate() {
            let s = w_scale[if w_scale.len() == 1 { 0 } else { j }] as f64;
            y.push(row.iter().zip(col).map(|(a, b)| a * b.to_f64()).sum::<f64>() * s);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::DefaultHasher;
    use std::collections::HashSet;
    use std::hash::{Hash, Hasher};

    fn lens(args: &MatmulArgs, e: Epilogue) -> BufferLens {
        let d = args.d_len();
        BufferLens {
            a: args.a.min_elements().unwrap(),
            b: args.b.min_elements().unwrap(),
            bias: e.bias.then_some(args.n()),
            up: e.gate.then_some(d),
            residual: e.residual.then_some(d),
            d,
            ..Default::default()
        }
    }

    #[test]
    fn the_rotary_epilogue_checks_its_shape_and_operands_before_anything_runs() {
        let bf = DataType::BF16;
        // 4 query heads, 2 K/V heads of 16: rows of 128; caches of 10 rows of 32.
        let rotary = Rotary::new(4, 2, 16, 10);
        let args = MatmulArgs::linear(1, 64, 128).with_rotary(rotary);
        let rl = RotaryLens { table_positions: 20, table_dim: 16, position: 1, k: 320, v: 320 };
        let ok = BufferLens { rotary: Some(rl), ..lens(&args, Epilogue::NONE) };
        args.check(bf, bf, &ok).unwrap();
        args.with_prologue(Prologue::rms_norm(1e-5))
            .check(bf, bf, &BufferLens { norm_weight: Some(64), ..ok })
            .unwrap();
        args.with_epilogue(Epilogue::BIAS).check(bf, bf, &BufferLens { bias: Some(128), ..ok }).unwrap();
        let plain = lens(&args, Epilogue::NONE);
        invalid(args.check(bf, bf, &plain), "the rotary epilogue needs its tables, position and caches");
        invalid(
            MatmulArgs::linear(1, 64, 128).check(bf, bf, &ok),
            "rotary operands were given without the rotary epilogue",
        );
        let two = MatmulArgs::linear(2, 64, 128).with_rotary(rotary);
        invalid(
            two.check(bf, bf, &BufferLens { rotary: Some(rl), ..lens(&two, Epilogue::NONE) }),
            "takes one token",
        );
        let wide = MatmulArgs::linear(1, 64, 136).with_rotary(rotary);
        invalid(
            wide.check(bf, bf, &BufferLens { rotary: Some(rl), ..lens(&wide, Epilogue::NONE) }),
            "n = 136 must be (heads_q + 2 * heads_kv) * head_dim = 128",
        );
        invalid(args.check(bf, DataType::F32, &ok), "the output dtype f32 must be the input dtype bf16");
        let residual = args.with_epilogue(Epilogue::RESIDUAL);
        invalid(
            residual.check(bf, bf, &BufferLens { residual: Some(128), ..ok }),
            "follows the product (and a bias) only",
        );
        let odd = MatmulArgs::linear(1, 64, 120).with_rotary(Rotary::new(4, 2, 15, 10));
        invalid(
            odd.check(bf, bf, &BufferLens { rotary: Some(rl), ..lens(&odd, Epilogue::NONE) }),
            "an even head dim",
        );
        let lens_with = |r: RotaryLens| BufferLens { rotary: Some(r), ..ok };
        invalid(
            args.check(bf, bf, &lens_with(RotaryLens { table_dim: 32, ..rl })),
            "tables are for head dim 32, not 16",
        );
        invalid(args.check(bf, bf, &lens_with(RotaryLens { position: 0, ..rl })), "position buffer is empty");
        invalid(
            args.check(bf, bf, &lens_with(RotaryLens { k: 319, ..rl })),
            "the K cache has 319 elements, needs max_seq * heads_kv * head_dim = 320",
        );
        invalid(args.check(bf, bf, &lens_with(RotaryLens { v: 0, ..rl })), "the V cache has 0 elements");
        // The graph and the naive backend refuse it by name (it is a form of the decode GEMV).
        assert_eq!(args.forms().as_deref(), Some("rope(4/2x16)"));
    }

    #[test]
    fn prologue_and_up_product_need_their_weights_and_nothing_else() {
        let bf = DataType::BF16;
        let args = MatmulArgs::linear(1, 64, 128);
        let plain = lens(&args, Epilogue::NONE);
        let norm = args.with_prologue(Prologue::rms_norm(1e-5));
        assert_eq!(Prologue::rms_norm(1e-5).epsilon(), 1e-5);
        norm.check(bf, bf, &BufferLens { norm_weight: Some(64), ..plain }).unwrap();
        invalid(norm.check(bf, bf, &plain), "prologue rms_norm(1e-5) needs a norm weight [k]");
        invalid(
            norm.check(bf, bf, &BufferLens { norm_weight: Some(63), ..plain }),
            "norm weight has 63 elements, k is 64",
        );
        invalid(
            args.check(bf, bf, &BufferLens { norm_weight: Some(64), ..plain }),
            "a norm weight was given without a prologue",
        );
        invalid(
            args.with_prologue(Prologue::rms_norm(f32::NAN)).check(
                bf,
                bf,
                &BufferLens { norm_weight: Some(64), ..plain },
            ),
            "epsilon must be finite",
        );
        // The up product replaces U: the gate step without a U buffer, with B_up in B's layout.
        let swiglu = args.with_epilogue(Epilogue::SWIGLU).with_up_product();
        let dual = BufferLens { up_weight: Some(64 * 128), ..plain };
        swiglu.check(bf, bf, &dual).unwrap();
        swiglu
            .with_prologue(Prologue::rms_norm(1e-6))
            .check(bf, bf, &BufferLens { norm_weight: Some(64), ..dual })
            .unwrap();
        invalid(swiglu.check(bf, bf, &plain), "the up product needs a second weight B_up");
        invalid(
            swiglu.check(bf, bf, &BufferLens { up_weight: Some(100), ..plain }),
            "B_up has 100 elements, needs 8192",
        );
        invalid(
            swiglu.check(bf, bf, &BufferLens { up: Some(128), ..dual }),
            "a multiplier U was given, but the up product computes it",
        );
        invalid(
            args.with_up_product().check(bf, bf, &dual),
            "the up product is the gate step's multiplier, epilogue `none` has no gate step",
        );
        invalid(
            args.with_epilogue(Epilogue::SWIGLU).check(bf, bf, &BufferLens { up: Some(128), ..dual }),
            "an up weight B_up was given without the up product",
        );
        assert_eq!(
            swiglu.with_prologue(Prologue::rms_norm(1e-5)).forms().unwrap(),
            "rms_norm(1e-5) up-product"
        );
        assert_eq!(args.forms(), None);
    }

    fn invalid(r: Result<()>, expected: &str) {
        let e = r.expect_err(expected);
        assert!(matches!(e, Error::InvalidArgument(_)), "{expected}: {e:?}");
        assert!(e.to_string().contains(expected), "expected `{expected}` in: {e}");
    }

    #[test]
    fn linear_is_a_transposed_weight_view() {
        let a = MatmulArgs::linear(30, 4096, 6144);
        assert_eq!(a.a, MatrixLayout { dims: [1, 30, 4096], strides: [30 * 4096, 4096, 1] });
        assert_eq!(a.b, MatrixLayout { dims: [1, 4096, 6144], strides: [4096 * 6144, 1, 4096] });
        assert_eq!((a.batch(), a.m(), a.k(), a.n()), (1, 30, 4096, 6144));
        assert_eq!(a.b.min_elements(), Some(4096 * 6144));
        assert_eq!(a.flops(), 2.0 * 30.0 * 4096.0 * 6144.0);
        assert_eq!(a.epilogue, Epilogue::NONE);
        assert_eq!(a.b.leading(), Some((6144, 4096, 4096)));
        assert_eq!(a.a.leading(), Some((30, 4096, 4096)));
    }

    #[test]
    fn argument_errors() {
        let args = MatmulArgs::linear(7, 64, 128);
        let e = Epilogue::NONE;
        let ok = lens(&args, e);
        let bf = DataType::BF16;
        args.with_epilogue(e).check(bf, bf, &ok).unwrap();
        // Inner dimension and batch.
        let inner = MatmulArgs { b: MatrixLayout::column_major(1, 72, 128), ..args };
        invalid(
            inner.with_epilogue(e).check(bf, bf, &lens(&inner, e)),
            "inner dimensions differ: A [1, 7, 64] has k = 64",
        );
        let batched = MatmulArgs::packed(3, 7, 64, 128);
        batched.with_epilogue(e).check(bf, bf, &lens(&batched, e)).unwrap();
        let shared = MatmulArgs { b: MatrixLayout::row_major(1, 64, 128), ..batched };
        shared.with_epilogue(e).check(bf, bf, &lens(&shared, e)).unwrap();
        let wrong = MatmulArgs { b: MatrixLayout::row_major(2, 64, 128), ..batched };
        invalid(
            wrong.with_epilogue(e).check(bf, bf, &lens(&wrong, e)),
            "batch mismatch: A [3, 7, 64] has batch 3",
        );
        let zero = MatmulArgs::linear(0, 64, 128);
        invalid(zero.with_epilogue(e).check(bf, bf, &ok), "A dims [1, 0, 64] must all be > 0");
        // Alignment: 16 bytes is 8 bf16/f16 elements, 4 f32 ones.
        let odd_k = MatmulArgs::linear(7, 63, 128);
        invalid(
            odd_k.with_epilogue(e).check(bf, bf, &lens(&odd_k, e)),
            "misaligned k for bf16: k = 63 must be a multiple of 8",
        );
        let odd_n = MatmulArgs::linear(7, 64, 100);
        invalid(
            odd_n.with_epilogue(e).check(bf, bf, &lens(&odd_n, e)),
            "misaligned n for bf16 -> bf16: n = 100",
        );
        let f32_ok = MatmulArgs::linear(7, 12, 100);
        f32_ok.with_epilogue(e).check(DataType::F32, DataType::F32, &lens(&f32_ok, e)).unwrap();
        invalid(
            f32_ok.with_epilogue(e).check(DataType::F16, DataType::F16, &lens(&f32_ok, e)),
            "misaligned k for f16: k = 12",
        );
        invalid(
            MatmulArgs::linear(7, 16, 12).with_epilogue(e).check(
                bf,
                DataType::F32,
                &lens(&MatmulArgs::linear(7, 16, 12), e),
            ),
            "misaligned n for bf16 -> f32: n = 12 must be a multiple of 8",
        );
        let padded_rows =
            MatmulArgs { a: MatrixLayout { dims: [1, 7, 64], strides: [7 * 68, 68, 1] }, ..args };
        invalid(
            padded_rows.with_epilogue(e).check(bf, bf, &lens(&padded_rows, e)),
            "misaligned A for bf16: leading stride 68",
        );
        let padded_ok = MatmulArgs { a: MatrixLayout { dims: [1, 7, 64], strides: [7 * 72, 72, 1] }, ..args };
        padded_ok.with_epilogue(e).check(bf, bf, &lens(&padded_ok, e)).unwrap();
        let no_unit = MatmulArgs { a: MatrixLayout { dims: [1, 7, 64], strides: [7 * 128, 128, 2] }, ..args };
        invalid(no_unit.with_epilogue(e).check(bf, bf, &lens(&no_unit, e)), "no unit stride");
        let overlap = MatmulArgs { a: MatrixLayout { dims: [1, 7, 64], strides: [64, 8, 1] }, ..args };
        invalid(overlap.with_epilogue(e).check(bf, bf, &lens(&overlap, e)), "overlap");
        let batch_stride =
            MatmulArgs { a: MatrixLayout { dims: [2, 7, 64], strides: [7 * 64 + 1, 64, 1] }, ..args };
        invalid(batch_stride.with_epilogue(e).check(bf, bf, &lens(&batch_stride, e)), "batch stride 449");
        // Dtypes.
        for (input, out) in
            [(bf, DataType::F16), (DataType::F16, bf), (DataType::F32, bf), (DataType::F32, DataType::F16)]
        {
            let err = args.with_epilogue(e).check(input, out, &ok).unwrap_err();
            assert!(err.is_not_supported(), "{err:?}");
            assert!(err.to_string().contains(&format!("matmul {input} -> {out}")), "{err}");
        }
        for (input, out) in [(bf, bf), (bf, DataType::F32), (DataType::F16, DataType::F32)] {
            args.with_epilogue(e).check(input, out, &ok).unwrap();
        }
        invalid(
            args.with_epilogue(e).check(DataType::I32, DataType::I32, &ok),
            "input dtype i32 is not bf16, f16 or f32",
        );
        // Buffer lengths.
        invalid(
            args.with_epilogue(e).check(bf, bf, &BufferLens { a: 7 * 64 - 1, ..ok }),
            "A has 447 elements, needs 448",
        );
        invalid(
            args.with_epilogue(e).check(bf, bf, &BufferLens { b: 100, ..ok }),
            "B has 100 elements, needs 8192",
        );
        invalid(
            args.with_epilogue(e).check(bf, bf, &BufferLens { d: 7 * 128 - 1, ..ok }),
            "output has 895 elements",
        );
        let full = Epilogue::BIAS.with_activation(Activation::Silu).with_gate().with_residual();
        let all = lens(&args, full);
        args.with_epilogue(full).check(bf, bf, &all).unwrap();
        invalid(
            args.with_epilogue(full).check(bf, bf, &BufferLens { bias: Some(127), ..all }),
            "bias has 127 elements, n is 128",
        );
        invalid(
            args.with_epilogue(full).check(bf, bf, &BufferLens { up: Some(10), ..all }),
            "gate multiplier U has 10 elements",
        );
        invalid(
            args.with_epilogue(full).check(bf, bf, &BufferLens { residual: Some(10), ..all }),
            "residual R has 10 elements",
        );
        // Operands must match the epilogue.
        invalid(
            args.with_epilogue(full).check(bf, bf, &BufferLens { residual: None, ..all }),
            "epilogue `bias+silu+gate+residual` needs a residual R",
        );
        invalid(args.with_epilogue(full).check(bf, bf, &BufferLens { bias: None, ..all }), "needs a bias");
        invalid(
            args.with_epilogue(Epilogue::RESIDUAL).check(bf, bf, &all),
            "a bias was given, but epilogue `residual` has no bias step",
        );
        invalid(
            args.with_epilogue(Epilogue::NONE).check(bf, bf, &BufferLens { up: Some(896), ..ok }),
            "has no gate step",
        );
        // Overflow.
        let huge = MatmulArgs::packed(usize::MAX / 8, 8, 64, 128);
        invalid(huge.with_epilogue(e).check(bf, bf, &ok), "overflows");
    }

    fn hash(k: &Key) -> u64 {
        let mut h = DefaultHasher::new();
        k.hash(&mut h);
        h.finish()
    }

    #[test]
    fn cache_keys() {
        let args = MatmulArgs::linear(2048, 4096, 14336);
        let bf = DataType::BF16;
        let base = args.with_epilogue(Epilogue::SWIGLU).key(bf, bf);
        assert_eq!(
            base,
            MatmulArgs::linear(2048, 4096, 14336)
                .with_epilogue(Epilogue::parse("silu+gate").unwrap())
                .key(bf, bf)
        );
        assert_eq!(
            hash(&base),
            hash(&MatmulArgs::linear(2048, 4096, 14336).with_epilogue(Epilogue::SWIGLU).key(bf, bf))
        );
        let row_major_b = MatmulArgs { b: MatrixLayout::row_major(1, 4096, 14336), ..args };
        let changed = [
            MatmulArgs::linear(2047, 4096, 14336).with_epilogue(Epilogue::SWIGLU).key(bf, bf),
            MatmulArgs::linear(2048, 4104, 14336).with_epilogue(Epilogue::SWIGLU).key(bf, bf),
            MatmulArgs::linear(2048, 4096, 14344).with_epilogue(Epilogue::SWIGLU).key(bf, bf),
            MatmulArgs::packed(2, 1024, 4096, 14336).with_epilogue(Epilogue::SWIGLU).key(bf, bf),
            row_major_b.with_epilogue(Epilogue::SWIGLU).key(bf, bf),
            args.with_epilogue(Epilogue::SWIGLU).key(DataType::F16, DataType::F16),
            args.with_epilogue(Epilogue::SWIGLU).key(bf, DataType::F32),
            args.with_epilogue(Epilogue::NONE).key(bf, bf),
            args.with_epilogue(Epilogue::SWIGLU.with_bias()).key(bf, bf),
            args.with_epilogue(Epilogue::SWIGLU.with_residual()).key(bf, bf),
            args.with_epilogue(Epilogue { gate: false, ..Epilogue::SWIGLU }).key(bf, bf),
            args.with_epilogue(Epilogue::SWIGLU.with_activation(Activation::Gelu)).key(bf, bf),
        ];
        for k in &changed {
            assert_ne!(&base, k);
            assert_ne!(hash(&base), hash(k), "{k:?}");
        }
        let distinct: HashSet<Key> = Epilogue::all().map(|e| args.with_epilogue(e).key(bf, bf)).collect();
        assert_eq!(distinct.len(), 40);
        // The form picks between the graph and the GEMV; the graph is one plan whichever form asked.
        for form in [MatmulKernel::Graph, MatmulKernel::DecodeGemv] {
            let k = args.with_epilogue(Epilogue::SWIGLU).with_form(form).key(bf, bf);
            assert_eq!((k, hash(&k)), (base, hash(&base)));
        }
        assert_eq!(
            MatmulArgs::linear(1, 64, 64).with_form(MatmulKernel::Graph).form,
            Some(MatmulKernel::Graph)
        );
        assert_eq!(MatmulArgs::linear(1, 64, 64).form, None);
        assert_eq!(MatmulKernel::DecodeGemv.name(), "decode gemv");
    }
}
