//! Scaled dot-product attention: the forward `O = softmax(scale · Q Kᵀ + mask) V` ([`sdpa`]) and its
//! backward from the forward's saved log-sum-exp stats ([`sdpa_backward`]); f16/bf16 I/O, f32
//! compute, grouped-query heads through head counts alone, any strides with a unit last stride.
//!
//! Q is `[b, h_q, s_q, d]`, K and V `[b, h_kv, s_kv, d]`, O like Q: logical dims over strided storage.
//! [`Layout::Bshd`] is what a QKV projection produces (`[b, s, h, d]` in memory), [`Layout::Bhsd`] the
//! head-major layout; Q, K and V views into one fused QKV buffer are just other strides.
//!
//! The fused backend runs a cuDNN graph ([`SdpaForm`]), except for a decode (one query per
//! sequence, nothing masked, inference) that cuDNN's one-plan padded graph does not take (lengths on
//! the host, where a graph would need a plan per length, or cuDNN < 9.15): that one takes the
//! split-KV kernel (`decode.rs`). With device lengths on cuDNN 9.15+ the padded graph runs: it was
//! the faster of the two on an H200 (8.3 vs 15.7 us per Llama-3.1-8B decode attention in a CUDA
//! graph). [`SdpaArgs::fused_kernel`] says which runs; [`SdpaArgs::with_form`] forces one.
//!
//! Ragged (THD) prefill ([`sdpa_ragged`], `ragged/`): sequences of different lengths packed without
//! padding, one plan per batch size and length bucket (the composite graph with ragged offsets and
//! the frontend's padding mask).
//!
//! Paged K/V ([`SdpaArgs::with_pages`], [`SdpaOperands::pages`]): K and V are page pools
//! `[num_pages, h_kv, page_size, d]` (strides by [`PageOrder`](crate::PageOrder)) read through a page
//! table, one row per sequence, lengths on the device: cuDNN's unified operation with its page-table
//! attributes (`CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_KDESC` / `_VDESC`, cuDNN 9.15+), or, for a
//! decode on an older cuDNN, the split-KV kernel reading each key's row through the table.

mod decode;
mod fused;
pub mod naive;
mod ragged;
mod seq_lens;

pub use ragged::{sdpa_ragged, DeviceRagged, RaggedArgs, RaggedBatch, RaggedKey, RaggedOperands, RowStrides};
pub use seq_lens::{DeviceSeqLens, SeqLens};

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::{Mask, SdpaForm};
use crate::ops::rows::{PageShape, PageTable, TableShape};
use crate::ops::Op;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Storage order of a `[b, h, s, d]` tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Layout {
    /// `[batch, seq, heads, dim]` in memory (a projection's output).
    Bshd,
    /// `[batch, heads, seq, dim]` in memory.
    Bhsd,
}

impl Layout {
    /// Strides of the logical `[b, h, s, d]` dims of a packed tensor stored in this order. A stride past
    /// `usize::MAX` saturates there; [`SdpaArgs::check`] rejects it (it does not fit cuDNN's `i64`).
    pub fn strides(self, heads: usize, seq: usize, dim: usize) -> [usize; 4] {
        let m = |a: usize, b: usize| a.saturating_mul(b);
        match self {
            Layout::Bshd => [m(m(seq, heads), dim), dim, m(heads, dim), 1],
            Layout::Bhsd => [m(m(heads, seq), dim), m(seq, dim), dim, 1],
        }
    }

    /// `bshd` or `bhsd`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Bshd => "bshd",
            Layout::Bhsd => "bhsd",
        }
    }
}

/// What the fused backend runs for an attention call ([`SdpaArgs::fused_kernel`]; forced with
/// [`SdpaArgs::with_form`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SdpaKernel {
    /// The cuDNN attention graph in this form.
    Graph(SdpaForm),
    /// The split-KV ("flash-decoding") kernel for one query per sequence: a CTA per (sequence, K/V
    /// head, split of the keys) for all query heads of the K/V head, the last of them to finish merging
    /// the splits into O (one launch). Unmasked inference, f16/bf16, head dims 8 to 256 in powers of
    /// two, K/V batch, head and key strides and Q batch and head strides multiples of 8 elements, Q, K
    /// and V 16-byte aligned; lengths from the device (padded) or `seq_kv` keys each. Any cuDNN version.
    SplitKv,
}

impl SdpaKernel {
    /// `composite`, `unified` or `split-kv`.
    pub fn name(self) -> &'static str {
        match self {
            SdpaKernel::Graph(form) => form.name(),
            SdpaKernel::SplitKv => "split-kv",
        }
    }

    /// The graph form, `None` for the split-KV kernel.
    pub fn graph_form(self) -> Option<SdpaForm> {
        match self {
            SdpaKernel::Graph(form) => Some(form),
            SdpaKernel::SplitKv => None,
        }
    }
}

impl From<SdpaForm> for SdpaKernel {
    fn from(form: SdpaForm) -> Self {
        SdpaKernel::Graph(form)
    }
}

/// Shape, strides and options of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SdpaArgs {
    /// Batch size.
    pub batch: usize,
    /// Query (and output) heads.
    pub heads_q: usize,
    /// Key/value heads; divides `heads_q` (1 is multi-query attention).
    pub heads_kv: usize,
    /// Query length.
    pub seq_q: usize,
    /// Key/value length.
    pub seq_kv: usize,
    /// Head dim of Q, K and V; a multiple of 8.
    pub head_dim: usize,
    /// Causal masking.
    pub mask: Mask,
    /// Scale of the scores; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Element strides of Q over `[b, h_q, s_q, d]`.
    pub q_strides: [usize; 4],
    /// Element strides of K over `[b, h_kv, s_kv, d]`.
    pub k_strides: [usize; 4],
    /// Element strides of V over `[b, h_kv, s_kv, d]`.
    pub v_strides: [usize; 4],
    /// Element strides of O over `[b, h_q, s_q, d]`.
    pub o_strides: [usize; 4],
    /// What the fused backend runs; `None` chooses ([`SdpaArgs::fused_kernel`]): the split-KV kernel for
    /// a decode it takes, else the graph form the running cuDNN version selects ([`SdpaForm::select`]),
    /// falling back to the composite graph if the unified one is rejected.
    pub form: Option<SdpaKernel>,
    /// `seq_q` and `seq_kv` are capacities and each sequence's lengths come from device tensors at run
    /// time ([`SdpaOperands::seq_lens`]): one plan for every length up to the capacity (e.g. every decode
    /// step).
    pub padded: bool,
    /// K and V are page pools of this shape, read through a page table ([`SdpaOperands::pages`]):
    /// their dims are `[num_pages, h_kv, page_size, d]` (strides over those), `seq_kv` is a table row's
    /// capacity (`max_pages · page_size`) and the lengths come from the device
    /// ([`SdpaArgs::with_pages`]).
    pub pages: Option<PageShape>,
}

/// Buffer lengths (elements) of an attention call, checked before anything runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct SdpaLens {
    /// Q buffer.
    pub q: usize,
    /// K buffer.
    pub k: usize,
    /// V buffer.
    pub v: usize,
    /// O buffer.
    pub o: usize,
    /// Stats buffer, in training mode.
    pub stats: Option<usize>,
}

impl SdpaArgs {
    /// Packed tensors in `layout`, no mask, default scale, automatic form.
    pub fn new(
        batch: usize,
        heads_q: usize,
        heads_kv: usize,
        seq_q: usize,
        seq_kv: usize,
        head_dim: usize,
        layout: Layout,
    ) -> Self {
        let (q, kv) = (layout.strides(heads_q, seq_q, head_dim), layout.strides(heads_kv, seq_kv, head_dim));
        SdpaArgs {
            batch,
            heads_q,
            heads_kv,
            seq_q,
            seq_kv,
            head_dim,
            mask: Mask::None,
            scale: None,
            q_strides: q,
            k_strides: kv,
            v_strides: kv,
            o_strides: q,
            form: None,
            padded: false,
            pages: None,
        }
    }

    /// With a mask.
    pub fn with_mask(self, mask: Mask) -> Self {
        SdpaArgs { mask, ..self }
    }

    /// With an explicit scale.
    pub fn with_scale(self, scale: f32) -> Self {
        SdpaArgs { scale: Some(scale), ..self }
    }

    /// With per-sequence lengths bound at run time (see [`SdpaArgs::padded`]).
    pub fn with_seq_lens(self) -> Self {
        SdpaArgs { padded: true, ..self }
    }

    /// Paged K/V: K and V are page pools read through a page table of `table`'s shape (the call's
    /// sequences its first rows), bound strided as the pool's [`PageOrder`](crate::PageOrder) says;
    /// `seq_kv` becomes a row's capacity and the lengths come from the device (as
    /// [`SdpaArgs::with_seq_lens`]). Fused only: cuDNN's unified operation with page tables (9.15+),
    /// or the split-KV kernel reading through the table for a decode on an older cuDNN.
    pub fn with_pages(self, table: TableShape) -> Self {
        let strides = table.pages.strides();
        SdpaArgs {
            seq_kv: table.capacity(),
            k_strides: strides,
            v_strides: strides,
            pages: Some(table.pages),
            padded: true,
            ..self
        }
    }

    /// With a fixed form: a graph form ([`SdpaForm`], e.g. to compare cuDNN's padded decode with the
    /// split-KV kernel) or [`SdpaKernel::SplitKv`] (an error, [`Error::NotSupported`], where that kernel
    /// does not take the call).
    pub fn with_form(self, form: impl Into<SdpaKernel>) -> Self {
        SdpaArgs { form: Some(form.into()), ..self }
    }

    /// The same attention with a mask that hides nothing dropped: a single query aligned bottom-right
    /// sees every key (a decode step), so it runs unmasked (and may use the unified graph).
    pub fn normalized(self) -> Self {
        if self.mask == Mask::CausalBottomRight && self.seq_q == 1 {
            SdpaArgs { mask: Mask::None, ..self }
        } else {
            self
        }
    }

    /// What both backends do first: `check_dtype` (f16 or bf16 I/O), [`SdpaArgs::check`], then
    /// [`SdpaArgs::normalized`].
    pub fn validated(self, dtype: DataType, lens: SdpaLens) -> Result<Self> {
        check_dtype(dtype)?;
        self.check(lens)?;
        Ok(self.normalized())
    }

    /// The scale applied to the scores.
    pub fn scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Query-key pairs that take part. Causal square attention counts half the pairs (the usual
    /// convention, so TFLOP/s compare with published figures); otherwise the exact count.
    pub fn visible_pairs(&self) -> f64 {
        let (sq, skv) = (self.seq_q as f64, self.seq_kv as f64);
        match self.mask {
            Mask::None => sq * skv,
            _ if self.seq_q == self.seq_kv => sq * skv / 2.0,
            // Row i sees i + 1 keys (top-left) or i + 1 + s_kv − s_q keys (bottom-right), capped at s_kv.
            Mask::CausalTopLeft => (0..self.seq_q).map(|i| (i + 1).min(self.seq_kv) as f64).sum(),
            Mask::CausalBottomRight => {
                (0..self.seq_q).map(|i| (i + 1 + self.seq_kv).saturating_sub(self.seq_q) as f64).sum()
            }
        }
    }

    /// FLOPs of the two matmuls: `4 · b · h_q · d · visible pairs`.
    pub fn flops(&self) -> f64 {
        4.0 * self.batch as f64 * self.heads_q as f64 * self.head_dim as f64 * self.visible_pairs()
    }

    fn dims(&self, tensor: char) -> [usize; 4] {
        match (tensor, self.pages) {
            ('q' | 'o', _) => [self.batch, self.heads_q, self.seq_q, self.head_dim],
            (_, Some(p)) => [p.num_pages, self.heads_kv, p.page_size, self.head_dim],
            (_, None) => [self.batch, self.heads_kv, self.seq_kv, self.head_dim],
        }
    }

    /// Checks shapes, strides, mask and buffer lengths (shared by both backends); nothing is touched on
    /// error.
    pub fn check(&self, lens: SdpaLens) -> Result<()> {
        let a = self;
        check_heads(
            "sdpa",
            &[
                ("batch", a.batch),
                ("heads_q", a.heads_q),
                ("heads_kv", a.heads_kv),
                ("seq_q", a.seq_q),
                ("seq_kv", a.seq_kv),
                ("head_dim", a.head_dim),
            ],
            (a.heads_q, a.heads_kv, a.head_dim),
        )?;
        ensure!(
            a.mask != Mask::CausalBottomRight || a.seq_q <= a.seq_kv,
            "sdpa: a bottom-right causal mask needs seq_q <= seq_kv, got {} > {}",
            a.seq_q,
            a.seq_kv
        );
        if let Some(s) = a.scale {
            ensure!(s.is_finite(), "sdpa: scale {s} is not finite");
        }
        if let Some(p) = a.pages {
            ensure!(
                a.padded,
                "sdpa: paged K/V needs run-time sequence lengths (SdpaArgs::with_pages sets them)"
            );
            ensure!(
                (p.heads_kv, p.head_dim) == (a.heads_kv, a.head_dim),
                "sdpa: pages of {} heads of {}, the attention has {} K/V heads of {}",
                p.heads_kv,
                p.head_dim,
                a.heads_kv,
                a.head_dim
            );
            ensure!(
                a.seq_kv.is_multiple_of(p.page_size),
                "sdpa: seq_kv {} of paged K/V is not a whole number of {}-row pages",
                a.seq_kv,
                p.page_size
            );
        }
        let tensors = [('q', "Q", a.q_strides, lens.q), ('k', "K", a.k_strides, lens.k)];
        let more = [('v', "V", a.v_strides, lens.v), ('o', "O", a.o_strides, lens.o)];
        for (t, name, strides, len) in tensors.into_iter().chain(more) {
            ensure!(strides[3] == 1, "sdpa: {name} strides {strides:?}: the head dim must have stride 1");
            ensure!(strides.iter().all(|&s| s > 0), "sdpa: {name} strides {strides:?} must be positive");
            for s in strides {
                checked::fits_i64(&format!("sdpa: {name} stride"), s)?;
            }
            let need = checked::extent(&format!("sdpa: {name} extent"), &a.dims(t), &strides)?;
            ensure!(
                len >= need,
                "sdpa: {name} has {len} elements, its dims {:?} and strides need {need}",
                a.dims(t)
            );
        }
        if let Some(len) = lens.stats {
            let need = checked::product("sdpa: batch*heads_q*seq_q", &[a.batch, a.heads_q, a.seq_q])?;
            ensure!(len >= need, "sdpa: stats has {len} elements, needs batch*heads_q*seq_q = {need}");
        }
        Ok(())
    }

    /// The plan-cache key.
    pub fn key(&self, dtype: DataType, stats: bool) -> Key {
        Key {
            dims: [self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_kv, self.head_dim],
            strides: [self.q_strides, self.k_strides, self.v_strides, self.o_strides],
            dtype,
            mask: self.mask,
            stats,
            form: self.form.and_then(SdpaKernel::graph_form),
            padded: self.padded,
            pages: self.pages,
        }
    }
}

/// What identifies an attention plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Key {
    /// `[batch, heads_q, heads_kv, seq_q, seq_kv, head_dim]`.
    pub dims: [usize; 6],
    /// Element strides of Q, K, V and O over their logical `[b, h, s, d]` dims.
    pub strides: [[usize; 4]; 4],
    /// I/O dtype.
    pub dtype: DataType,
    /// Causal masking.
    pub mask: Mask,
    /// Training mode (stats written).
    pub stats: bool,
    /// The graph form asked for (`None`: chosen by version).
    pub form: Option<SdpaForm>,
    /// Sequence lengths bound at run time (seq dims are capacities).
    pub padded: bool,
    /// Paged K/V: the pools' shape.
    pub pages: Option<PageShape>,
}

/// Rejects what no backend runs: f32 I/O (both backends take f16/bf16).
pub(crate) fn check_dtype(dtype: DataType) -> Result<()> {
    if dtype == DataType::F16 || dtype == DataType::BF16 {
        return Ok(());
    }
    Err(Error::NotSupported {
        op: "sdpa".into(),
        reason: format!("attention takes f16 or bf16 I/O (f32 compute inside), not {dtype}"),
    })
}

/// The buffers of an attention call: Q, K, V in, O out (strided as [`SdpaArgs`] says), and optionally
/// the training stats and the run-time sequence lengths of padded attention.
#[non_exhaustive]
pub struct SdpaOperands<'a, T: Element> {
    /// Q over `[b, h_q, s_q, d]`.
    pub q: &'a dyn DevicePtr<T>,
    /// K over `[b, h_kv, s_kv, d]`.
    pub k: &'a dyn DevicePtr<T>,
    /// V over `[b, h_kv, s_kv, d]`.
    pub v: &'a dyn DevicePtr<T>,
    /// O over `[b, h_q, s_q, d]`.
    pub o: &'a mut dyn DevicePtrMut<T>,
    /// The f32 log-sum-exp of each score row, `[b, h_q, s_q]` packed; given, it selects training mode.
    pub stats: Option<&'a mut dyn DevicePtrMut<f32>>,
    /// `(seq_len_q, seq_len_kv)`: device i32 buffers of `batch` values each, for arguments made with
    /// [`SdpaArgs::with_seq_lens`] (and only for those), whose seq dims are then capacities (buffers
    /// are sized by them); keys past `seq_len_kv[b]` and queries past `seq_len_q[b]` are masked out
    /// (their output rows are unspecified). One plan serves every length, e.g. every step of a decode
    /// over a growing cache. Fused only. A decode (`seq_q` 1) may run the split-KV kernel
    /// ([`SdpaKernel::SplitKv`], any cuDNN); unmasked calls run the unified operation with its length
    /// inputs (cuDNN 9.15+), causal ones (and unmasked ones before 9.15) the composite graph with the
    /// frontend's padding mask and per-sequence matmul sizes (any cuDNN 9).
    ///
    /// The lengths are device values the host cannot check, and cuDNN bounds them by nothing: a length
    /// past the capacity would read K/V (and write O) past the buffers. So a launch-only kernel first
    /// copies them, clamped into `0..=capacity`, into an op-owned buffer, and cuDNN reads that copy.
    /// The split-KV kernel clamps as it reads (no copy) and reads only `seq_len_kv`: a sequence with
    /// no keys (length 0 or less) gets a zero output row, as the reference's empty sum gives.
    pub seq_lens: Option<DeviceSeqLens<'a>>,
    /// The page table K and V are read through, for arguments made with [`SdpaArgs::with_pages`] (and
    /// only for those): the call's sequence `b` is its row `b`. cuDNN binds it as both the K and the V
    /// table. Its entries are pages of the pool by construction ([`PageTable`]); a sequence's length
    /// is clamped into the row's capacity as the lengths above are.
    pub pages: Option<&'a PageTable>,
}

impl<'a, T: Element> SdpaOperands<'a, T> {
    /// Inference: Q, K, V in, O out.
    pub fn new(
        q: &'a dyn DevicePtr<T>,
        k: &'a dyn DevicePtr<T>,
        v: &'a dyn DevicePtr<T>,
        o: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        SdpaOperands { q, k, v, o, stats: None, seq_lens: None, pages: None }
    }

    /// Training: also writes the f32 log-sum-exp of each score row.
    pub fn stats(mut self, stats: &'a mut dyn DevicePtrMut<f32>) -> Self {
        self.stats = Some(stats);
        self
    }

    /// Per-sequence lengths read on the device (see [`SdpaOperands::seq_lens`](#structfield.seq_lens)).
    pub fn seq_lens(mut self, seq_len_q: &'a dyn DevicePtr<i32>, seq_len_kv: &'a dyn DevicePtr<i32>) -> Self {
        self.seq_lens = Some(DeviceSeqLens::Raw(seq_len_q, seq_len_kv));
        self
    }

    /// Per-sequence lengths clamped before (see [`SeqLens`]): the call launches no clamp of its own.
    pub fn clamped_seq_lens(mut self, lens: &'a SeqLens) -> Self {
        self.seq_lens = Some(DeviceSeqLens::Clamped(lens));
        self
    }

    /// K and V are page pools read through `table` (see [`SdpaOperands::pages`](#structfield.pages)).
    pub fn pages(mut self, table: &'a PageTable) -> Self {
        self.pages = Some(table);
        self
    }

    /// The buffer lengths.
    pub fn lens(&self) -> SdpaLens {
        let (q, k, v, o) = (self.q.len(), self.k.len(), self.v.len(), self.o.len());
        SdpaLens { q, k, v, o, stats: self.stats.as_ref().map(|s| s.len()) }
    }
}

impl<T: Element> Op<T> for SdpaArgs {
    type Operands<'a> = SdpaOperands<'a, T>;

    /// [`check_dtype`], the sequence-length operands against [`SdpaArgs::padded`], [`SdpaArgs::check`],
    /// then [`SdpaArgs::normalized`].
    fn checked(self, x: &SdpaOperands<'_, T>) -> Result<Self> {
        match (self.pages, x.pages) {
            (None, None) => {}
            (Some(p), Some(table)) => {
                let t = table.shape();
                ensure!(
                    t.pages == p,
                    "sdpa: a page table of pages {:?}, the arguments were made for {p:?}",
                    t.pages
                );
                ensure!(
                    t.capacity() == self.seq_kv,
                    "sdpa: a page table of {} positions per sequence, the arguments' seq_kv is {}",
                    t.capacity(),
                    self.seq_kv
                );
                ensure!(
                    t.batch >= self.batch,
                    "sdpa: a page table of {} sequences, batch is {}",
                    t.batch,
                    self.batch
                );
            }
            (Some(_), None) => {
                return Err(Error::invalid(
                    "sdpa: arguments made with SdpaArgs::with_pages need the page table (SdpaOperands::pages)",
                ));
            }
            (None, Some(_)) => {
                return Err(Error::invalid(
                    "sdpa: a page table needs arguments made with SdpaArgs::with_pages",
                ));
            }
        }
        if let Some(lens) = x.seq_lens {
            ensure!(self.padded, "sdpa: sequence lengths need arguments made with SdpaArgs::with_seq_lens");
            match lens {
                DeviceSeqLens::Raw(q, kv) => {
                    for (name, len) in [("seq_len_q", q.len()), ("seq_len_kv", kv.len())] {
                        ensure!(len >= self.batch, "sdpa: {name} has {len} values, batch is {}", self.batch);
                    }
                }
                DeviceSeqLens::Clamped(l) => {
                    let (cap_q, cap_kv) = l.capacities();
                    ensure!(
                        l.batch() >= self.batch,
                        "sdpa: lengths of {} sequences, batch is {}",
                        l.batch(),
                        self.batch
                    );
                    ensure!(
                        cap_q <= self.seq_q && cap_kv <= self.seq_kv,
                        "sdpa: lengths clamped into {cap_q} x {cap_kv}, more than the call's capacities {} x {}",
                        self.seq_q,
                        self.seq_kv
                    );
                }
            }
            if x.stats.is_some() {
                return Err(Error::NotSupported {
                    op: "sdpa".into(),
                    reason: "training stats with run-time sequence lengths".into(),
                });
            }
        } else {
            ensure!(
                !self.padded,
                "sdpa: arguments made with SdpaArgs::with_seq_lens need the seq_len_q and seq_len_kv operands"
            );
        }
        self.validated(T::DTYPE, x.lens())
    }
}

/// Attention on `backend`; training mode and padded lengths follow the operands
/// ([`SdpaOperands::stats`], [`SdpaOperands::seq_lens`]).
pub fn sdpa<T: Element>(ctx: &Cudnn, args: SdpaArgs, x: SdpaOperands<'_, T>, backend: Backend) -> Result<()> {
    crate::ops::run::<T, _>(ctx, args, x, backend)
}

/// The buffers of an attention backward: the forward's Q, K, V, O and training stats, the gradient
/// dO of its output in; dQ, dK, dV out. Each gradient has the strides of what it differentiates
/// ([`SdpaArgs`]: dO and dQ like O and Q, dK and dV like K and V), so gradients of views into one QKV
/// buffer land in the same views of one dQKV buffer. With grouped-query heads, dK and dV sum over
/// the query heads of each K/V head.
#[non_exhaustive]
pub struct SdpaGrads<'a, T: Element> {
    /// Q over `[b, h_q, s_q, d]`.
    pub q: &'a dyn DevicePtr<T>,
    /// K over `[b, h_kv, s_kv, d]`.
    pub k: &'a dyn DevicePtr<T>,
    /// V over `[b, h_kv, s_kv, d]`.
    pub v: &'a dyn DevicePtr<T>,
    /// The forward's O over `[b, h_q, s_q, d]`.
    pub o: &'a dyn DevicePtr<T>,
    /// The forward's f32 log-sum-exp of each score row, `[b, h_q, s_q]` packed (what [`sdpa`] writes
    /// with [`SdpaOperands::stats`]). Required: a backward without it is an error.
    pub stats: Option<&'a dyn DevicePtr<f32>>,
    /// The gradient of O, with O's strides.
    pub d_o: &'a dyn DevicePtr<T>,
    /// The gradient of Q, with Q's strides (overwritten).
    pub dq: &'a mut dyn DevicePtrMut<T>,
    /// The gradient of K, with K's strides (overwritten).
    pub dk: &'a mut dyn DevicePtrMut<T>,
    /// The gradient of V, with V's strides (overwritten).
    pub dv: &'a mut dyn DevicePtrMut<T>,
}

impl<'a, T: Element> SdpaGrads<'a, T> {
    /// The forward's inputs and output, the output's gradient, and the three gradients to write; add
    /// the forward's stats with [`SdpaGrads::stats`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        q: &'a dyn DevicePtr<T>,
        k: &'a dyn DevicePtr<T>,
        v: &'a dyn DevicePtr<T>,
        o: &'a dyn DevicePtr<T>,
        d_o: &'a dyn DevicePtr<T>,
        dq: &'a mut dyn DevicePtrMut<T>,
        dk: &'a mut dyn DevicePtrMut<T>,
        dv: &'a mut dyn DevicePtrMut<T>,
    ) -> Self {
        SdpaGrads { q, k, v, o, stats: None, d_o, dq, dk, dv }
    }

    /// The forward's training stats.
    pub fn stats(mut self, stats: &'a dyn DevicePtr<f32>) -> Self {
        self.stats = Some(stats);
        self
    }

    /// The forward's buffer lengths (stats `None` when missing).
    pub fn lens(&self) -> SdpaLens {
        let (q, k, v, o) = (self.q.len(), self.k.len(), self.v.len(), self.o.len());
        SdpaLens { q, k, v, o, stats: self.stats.map(|s| s.len()) }
    }

    /// The gradients' buffer lengths, as [`SdpaLens`] of the tensors they differentiate (dO in `o`).
    pub fn grad_lens(&self) -> SdpaLens {
        let (q, k, v, o) = (self.dq.len(), self.dk.len(), self.dv.len(), self.d_o.len());
        SdpaLens { q, k, v, o, stats: None }
    }
}

/// What identifies an attention backward plan (its own key type: never equal to a forward's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct BackwardKey {
    /// `[batch, heads_q, heads_kv, seq_q, seq_kv, head_dim]`.
    pub dims: [usize; 6],
    /// Element strides of Q, K, V and O (and of dQ, dK, dV and dO, which follow them).
    pub strides: [[usize; 4]; 4],
    /// I/O dtype.
    pub dtype: DataType,
    /// Causal masking.
    pub mask: Mask,
}

impl SdpaArgs {
    /// The attention backward's plan-cache key (composite graph: the form asked for is not part of it).
    pub fn backward_key(&self, dtype: DataType) -> BackwardKey {
        let Key { dims, strides, mask, .. } = self.key(dtype, true);
        BackwardKey { dims, strides, dtype, mask }
    }

    /// The backward's checks (both backends): f16/bf16, no run-time sequence lengths, not the unified
    /// form, the forward's stats present and long enough, every forward buffer and gradient long
    /// enough for its dims and strides ([`SdpaArgs::check`]); then [`SdpaArgs::normalized`]. Nothing is
    /// touched on error.
    pub fn validated_backward(self, dtype: DataType, lens: SdpaLens, grads: SdpaLens) -> Result<Self> {
        check_dtype(dtype)?;
        if self.padded {
            return Err(Error::NotSupported {
                op: "sdpa backward".into(),
                reason: "run-time sequence lengths (padded attention) have no backward here".into(),
            });
        }
        if self.form == Some(SdpaKernel::Graph(SdpaForm::Unified)) {
            return Err(Error::NotSupported {
                op: "sdpa backward".into(),
                reason: "the unified SDPA backward operation does not finalize on this cuDNN (9.19 and \
                         9.20 reject it); the backward is the composite graph"
                    .into(),
            });
        }
        ensure!(
            lens.stats.is_some(),
            "sdpa backward: the forward's training stats are missing (run sdpa with SdpaOperands::stats \
             and pass them with SdpaGrads::stats)"
        );
        self.check(lens)?;
        let gradients = [
            ('q', "dQ", self.q_strides, grads.q),
            ('k', "dK", self.k_strides, grads.k),
            ('v', "dV", self.v_strides, grads.v),
            ('o', "dO", self.o_strides, grads.o),
        ];
        for (t, name, strides, len) in gradients {
            let need = checked::extent(&format!("sdpa backward: {name} extent"), &self.dims(t), &strides)?;
            ensure!(
                len >= need,
                "sdpa backward: {name} has {len} elements, its dims {:?} and strides need {need}",
                self.dims(t)
            );
        }
        Ok(self.normalized())
    }
}

/// The backward phase of [`sdpa`] as an op (its own operands and plan key).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backward(pub(crate) SdpaArgs);

impl<T: Element> Op<T> for Backward {
    type Operands<'a> = SdpaGrads<'a, T>;

    /// [`SdpaArgs::validated_backward`].
    fn checked(self, x: &SdpaGrads<'_, T>) -> Result<Self> {
        Ok(Backward(self.0.validated_backward(T::DTYPE, x.lens(), x.grad_lens())?))
    }
}

/// Attention backward on `backend`: dQ, dK and dV of the attention `args` describes (the forward's
/// arguments: shape, strides, mask, scale) from the forward's Q, K, V, O, its training stats and the
/// gradient dO ([`SdpaGrads`]).
///
/// The fused backend runs the composite cuDNN graph (one plan per shape, strides, dtype and mask; the
/// f32 row sums and dQ accumulator it needs live in a buffer the op owns on the context); the naive
/// backend runs PyTorch's math-path autograd, one kernel per elementary op ([`naive`]).
///
/// Errors, with nothing written: missing stats, a stats buffer shorter than `b · h_q · s_q`, a buffer
/// shorter than its dims and strides, bad shapes ([`Error::InvalidArgument`]); f32 I/O, padded
/// attention, the unified form, or a head dim beyond what the fused backward takes on this GPU
/// ([`Error::NotSupported`]).
pub fn sdpa_backward<T: Element>(
    ctx: &Cudnn,
    args: SdpaArgs,
    x: SdpaGrads<'_, T>,
    backend: Backend,
) -> Result<()> {
    crate::ops::run::<T, _>(ctx, Backward(args), x, backend)
}

/// The checks every attention call shares, as `op` names them: each of `dims` positive and within
/// i32, `heads_q` a multiple of `heads_kv`, `head_dim` a multiple of 8.
fn check_heads(op: &str, dims: &[(&str, usize)], heads: (usize, usize, usize)) -> Result<()> {
    for &(name, v) in dims {
        ensure!(v > 0, "{op}: {name} must be > 0");
        ensure!(v <= i32::MAX as usize, "{op}: {name} = {v} is too large");
    }
    let (heads_q, heads_kv, head_dim) = heads;
    ensure!(
        heads_q.is_multiple_of(heads_kv),
        "{op}: heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv}"
    );
    ensure!(head_dim.is_multiple_of(8), "{op}: head_dim = {head_dim} is not a multiple of 8");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> SdpaArgs {
        SdpaArgs::new(2, 8, 2, 16, 16, 64, Layout::Bshd).with_mask(Mask::CausalTopLeft)
    }

    fn lens(a: &SdpaArgs) -> SdpaLens {
        let q = a.batch * a.heads_q * a.seq_q * a.head_dim;
        let kv = a.batch * a.heads_kv * a.seq_kv * a.head_dim;
        SdpaLens { q, k: kv, v: kv, o: q, stats: Some(a.batch * a.heads_q * a.seq_q) }
    }

    fn err(a: SdpaArgs, l: SdpaLens) -> String {
        match a.check(l) {
            Err(e @ Error::InvalidArgument(_)) => e.to_string(),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn layouts_give_the_right_strides() {
        assert_eq!(Layout::Bshd.strides(32, 100, 128), [100 * 32 * 128, 128, 32 * 128, 1]);
        assert_eq!(Layout::Bhsd.strides(32, 100, 128), [32 * 100 * 128, 100 * 128, 128, 1]);
    }

    #[test]
    fn argument_errors() {
        let a = args();
        a.check(lens(&a)).unwrap();
        let cases = [
            (SdpaArgs { heads_kv: 3, ..a }, "not a multiple of heads_kv"),
            (SdpaArgs { head_dim: 60, ..a }, "not a multiple of 8"),
            (SdpaArgs { seq_q: 0, ..a }, "seq_q must be > 0"),
            (SdpaArgs { batch: 0, ..a }, "batch must be > 0"),
            (SdpaArgs { seq_q: 17, ..a.with_mask(Mask::CausalBottomRight) }, "needs seq_q <= seq_kv"),
            (SdpaArgs { q_strides: [16 * 8 * 64, 64, 8 * 64, 2], ..a }, "Q strides"),
            (SdpaArgs { k_strides: [1, 1, 1, 1], v_strides: [0, 64, 128, 1], ..a }, "must be positive"),
            (a.with_scale(f32::NAN), "not finite"),
        ];
        for (bad, expected) in cases {
            let e = err(bad, lens(&bad));
            assert!(e.contains(expected), "{expected}: {e}");
        }
        let l = lens(&a);
        for (short, expected) in [
            (SdpaLens { q: l.q - 1, ..l }, "Q has"),
            (SdpaLens { k: l.k - 1, ..l }, "K has"),
            (SdpaLens { v: l.v - 1, ..l }, "V has"),
            (SdpaLens { o: l.o - 1, ..l }, "O has"),
            (SdpaLens { stats: Some(255), ..l }, "stats has 255"),
        ] {
            let e = err(a, short);
            assert!(e.contains(expected), "{expected}: {e}");
        }
        // A Q view into a fused QKV buffer (row stride 3 heads wider) is fine with a long enough buffer.
        let fused_qkv = SdpaArgs { q_strides: [16 * 12 * 64, 64, 12 * 64, 1], ..a };
        assert!(fused_qkv.check(lens(&fused_qkv)).is_err());
        fused_qkv.check(SdpaLens { q: 2 * 16 * 12 * 64, ..lens(&fused_qkv) }).unwrap();
    }

    #[test]
    fn paged_argument_errors() {
        use crate::{PageOrder, PageShape, TableShape};
        let pages = PageShape::new(32, 16, 2, 64, PageOrder::HeadMajor).unwrap();
        let table = TableShape::new(4, 8, pages).unwrap();
        let a = SdpaArgs::new(2, 8, 2, 1, 1, 64, Layout::Bshd).with_pages(table);
        let pool = pages.pool_len();
        let l = SdpaLens { q: 2 * 8 * 64, k: pool, v: pool, o: 2 * 8 * 64, stats: None };
        a.check(l).unwrap();
        assert_eq!(a.dims('k'), [32, 2, 16, 64], "K and V are the pools");
        let cases = [
            (SdpaArgs { seq_kv: 120, ..a }, "not a whole number of 16-row pages"),
            (SdpaArgs { padded: false, ..a }, "needs run-time sequence lengths"),
            (SdpaArgs { heads_kv: 1, heads_q: 8, ..a }, "pages of 2 heads of 64"),
            (
                SdpaArgs {
                    head_dim: 128,
                    q_strides: [8 * 128, 128, 8 * 128, 1],
                    o_strides: [8 * 128, 128, 8 * 128, 1],
                    ..a
                },
                "heads of 64",
            ),
        ];
        for (bad, expected) in cases {
            let e = err(bad, SdpaLens { q: usize::MAX / 16, o: usize::MAX / 16, ..l });
            assert!(e.contains(expected), "{expected}: {e}");
        }
        let e = err(a, SdpaLens { k: pool - 1, ..l });
        assert!(e.contains("K has"), "{e}");
        // The backward refuses paged attention (it has run-time lengths).
        let e = a.validated_backward(DataType::BF16, SdpaLens { stats: Some(16), ..l }, l).unwrap_err();
        assert!(e.is_not_supported(), "{e}");
    }

    #[test]
    fn overflowing_strides_and_extents_are_rejected() {
        // The review's reproduction: batch 5 with a 2^62 batch stride wraps the extent to a small
        // number, the length check passed and the strides reached cuDNN.
        let a = SdpaArgs::new(5, 1, 1, 1, 1, 8, Layout::Bhsd);
        a.check(lens(&a)).unwrap();
        let wrapped = SdpaArgs { q_strides: [1 << 62, 8, 8, 1], ..a };
        let e = err(wrapped, lens(&a));
        assert!(e.contains("Q extent overflows"), "{e}");
        // A stride that does not fit i64 would reach cuDNN negative, even where its dim is 1.
        let e = err(SdpaArgs { k_strides: [8, 1 << 63, 8, 1], ..a }, lens(&a));
        assert!(e.contains("K stride") && e.contains("64-bit signed"), "{e}");
        // Packed strides of huge dims saturate instead of wrapping, and are rejected.
        let huge = SdpaArgs::new(2, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30, Layout::Bshd);
        assert_eq!(huge.q_strides[0], usize::MAX);
        let big =
            SdpaLens { q: usize::MAX, k: usize::MAX, v: usize::MAX, o: usize::MAX, stats: Some(usize::MAX) };
        let e = err(huge, big);
        assert!(e.contains("64-bit signed") || e.contains("overflows"), "{e}");
        let e = err(SdpaArgs::new(1 << 30, 1 << 30, 1, 1 << 30, 1, 8, Layout::Bhsd), big);
        assert!(e.contains("overflows") || e.contains("64-bit signed"), "{e}");
    }

    #[test]
    fn f32_is_not_supported() {
        assert!(check_dtype(DataType::F32).unwrap_err().is_not_supported());
        check_dtype(DataType::BF16).unwrap();
        check_dtype(DataType::F16).unwrap();
    }

    #[test]
    fn a_single_bottom_right_query_runs_unmasked() {
        let decode = SdpaArgs::new(1, 32, 8, 1, 4096, 128, Layout::Bshd).with_mask(Mask::CausalBottomRight);
        assert_eq!(decode.normalized().mask, Mask::None);
        // Top-left with one query sees one key; longer chunks keep their mask.
        assert_eq!(decode.with_mask(Mask::CausalTopLeft).normalized().mask, Mask::CausalTopLeft);
        let chunk = SdpaArgs { seq_q: 2, ..decode };
        assert_eq!(chunk.normalized().mask, Mask::CausalBottomRight);
    }

    #[test]
    fn flops_count_causal_as_half_and_decode_in_full() {
        let a = SdpaArgs::new(1, 32, 8, 8192, 8192, 128, Layout::Bshd);
        let full = 4.0 * 32.0 * 128.0 * 8192.0 * 8192.0;
        assert_eq!(a.flops(), full);
        assert_eq!(a.with_mask(Mask::CausalTopLeft).flops(), full / 2.0);
        let decode = SdpaArgs::new(1, 32, 8, 1, 4096, 128, Layout::Bshd).with_mask(Mask::CausalBottomRight);
        assert_eq!(decode.flops(), 4.0 * 32.0 * 128.0 * 4096.0);
        // 2 queries against 4 keys, bottom-right: 3 + 4 visible pairs; top-left: 1 + 2.
        let c = SdpaArgs::new(1, 1, 1, 2, 4, 8, Layout::Bhsd);
        assert_eq!(c.with_mask(Mask::CausalBottomRight).visible_pairs(), 7.0);
        assert_eq!(c.with_mask(Mask::CausalTopLeft).visible_pairs(), 3.0);
    }

    #[test]
    fn cache_keys_change_with_every_field() {
        use std::collections::HashSet;
        let a = args();
        assert_eq!(a.key(DataType::BF16, false), args().key(DataType::BF16, false));
        // The scale is bound by value at execute time and does not change the plan.
        assert_eq!(a.key(DataType::BF16, false), a.with_scale(0.3).key(DataType::BF16, false));
        let variants = [
            a.key(DataType::BF16, false),
            a.key(DataType::F16, false),
            a.key(DataType::BF16, true),
            SdpaArgs { batch: 3, ..a }.key(DataType::BF16, false),
            SdpaArgs { heads_kv: 8, ..a }.key(DataType::BF16, false),
            SdpaArgs { seq_kv: 32, ..a }.key(DataType::BF16, false),
            a.with_mask(Mask::None).key(DataType::BF16, false),
            a.with_mask(Mask::CausalBottomRight).key(DataType::BF16, false),
            SdpaArgs { o_strides: Layout::Bhsd.strides(8, 16, 64), ..a }.key(DataType::BF16, false),
            a.with_form(SdpaForm::Composite).key(DataType::BF16, false),
        ];
        assert_eq!(variants.iter().collect::<HashSet<_>>().len(), variants.len());
    }

    #[test]
    fn backward_argument_errors_and_refusals() {
        let a = args();
        let l = lens(&a);
        let grads = SdpaLens { stats: None, ..l };
        a.validated_backward(DataType::BF16, l, grads).unwrap();
        let invalid = |a: SdpaArgs, l: SdpaLens, g: SdpaLens, expected: &str| match a.validated_backward(
            DataType::BF16,
            l,
            g,
        ) {
            Err(e @ Error::InvalidArgument(_)) => {
                assert!(e.to_string().contains(expected), "{expected}: {e}")
            }
            other => panic!("{expected}: expected InvalidArgument, got {other:?}"),
        };
        invalid(a, SdpaLens { stats: None, ..l }, grads, "training stats are missing");
        invalid(a, SdpaLens { stats: Some(255), ..l }, grads, "stats has 255");
        invalid(a, SdpaLens { o: l.o - 1, ..l }, grads, "O has");
        invalid(a, l, SdpaLens { q: l.q - 1, ..grads }, "dQ has");
        invalid(a, l, SdpaLens { k: l.k - 1, ..grads }, "dK has");
        invalid(a, l, SdpaLens { v: l.v - 1, ..grads }, "dV has");
        invalid(a, l, SdpaLens { o: l.o - 1, ..grads }, "dO has");
        invalid(SdpaArgs { heads_kv: 3, ..a }, l, grads, "not a multiple of heads_kv");
        let not_supported = |a: SdpaArgs, dtype: DataType, expected: &str| {
            let e = a.validated_backward(dtype, l, grads).unwrap_err();
            assert!(e.is_not_supported() && e.to_string().contains(expected), "{expected}: {e}");
        };
        not_supported(a, DataType::F32, "f16 or bf16");
        not_supported(a.with_form(SdpaForm::Unified), DataType::BF16, "unified SDPA backward");
        not_supported(a.with_seq_lens(), DataType::BF16, "sequence lengths");
        // The composite form may be asked for; a single bottom-right query runs unmasked.
        a.with_form(SdpaForm::Composite).validated_backward(DataType::BF16, l, grads).unwrap();
        let decode = SdpaArgs::new(2, 8, 2, 1, 16, 64, Layout::Bshd).with_mask(Mask::CausalBottomRight);
        let (dl, dg) = (lens(&decode), SdpaLens { stats: None, ..lens(&decode) });
        assert_eq!(decode.validated_backward(DataType::BF16, dl, dg).unwrap().mask, Mask::None);
    }
}
