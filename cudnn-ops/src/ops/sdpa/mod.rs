//! Scaled dot-product attention forward: `O = softmax(scale · Q Kᵀ + mask) V`, f16/bf16 I/O, f32
//! compute, grouped-query heads through head counts alone, any strides with a unit last stride.
//!
//! Q is `[b, h_q, s_q, d]`, K and V `[b, h_kv, s_kv, d]`, O like Q: logical dims over strided storage.
//! [`Layout::Bshd`] is what a QKV projection produces (`[b, s, h, d]` in memory), [`Layout::Bhsd`] the
//! head-major layout; Q, K and V views into one fused QKV buffer are just other strides.

use crate::cache::PlanKey;
use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::graph::{Graph, Mask, SdpaForm, SdpaOptions};
use crate::naive::Arg;
use crate::plan::{Bindings, Plan};
use crate::tensor::TensorSpec;
use crate::{Backend, Cudnn, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::rc::Rc;

/// Storage order of a `[b, h, s, d]` tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

/// Shape, strides and options of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// Graph form for the fused backend; `None` lets the running cuDNN version decide
    /// ([`SdpaForm::select`]), falling back to the composite graph if the unified one is rejected.
    pub form: Option<SdpaForm>,
    /// `seq_q` and `seq_kv` are capacities and each sequence's lengths come from device tensors at run
    /// time ([`sdpa_padded`]): one plan for every length up to the capacity (e.g. every decode step).
    pub padded: bool,
}

/// Buffer lengths (elements) of an attention call, checked before anything runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

    /// With a fixed graph form.
    pub fn with_form(self, form: SdpaForm) -> Self {
        SdpaArgs { form: Some(form), ..self }
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

    /// What both backends do first: [`check_dtype`], [`SdpaArgs::check`], then [`SdpaArgs::normalized`].
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
        match tensor {
            'q' | 'o' => [self.batch, self.heads_q, self.seq_q, self.head_dim],
            _ => [self.batch, self.heads_kv, self.seq_kv, self.head_dim],
        }
    }

    /// Checks shapes, strides, mask and buffer lengths (shared by both backends); nothing is touched on
    /// error.
    pub fn check(&self, lens: SdpaLens) -> Result<()> {
        let a = self;
        for (name, v) in [
            ("batch", a.batch),
            ("heads_q", a.heads_q),
            ("heads_kv", a.heads_kv),
            ("seq_q", a.seq_q),
            ("seq_kv", a.seq_kv),
            ("head_dim", a.head_dim),
        ] {
            ensure!(v > 0, "sdpa: {name} must be > 0");
            ensure!(v <= i32::MAX as usize, "sdpa: {name} = {v} is too large");
        }
        ensure!(
            a.heads_q.is_multiple_of(a.heads_kv),
            "sdpa: heads_q = {} is not a multiple of heads_kv = {}",
            a.heads_q,
            a.heads_kv
        );
        ensure!(a.head_dim.is_multiple_of(8), "sdpa: head_dim = {} is not a multiple of 8", a.head_dim);
        ensure!(
            a.mask != Mask::CausalBottomRight || a.seq_q <= a.seq_kv,
            "sdpa: a bottom-right causal mask needs seq_q <= seq_kv, got {} > {}",
            a.seq_q,
            a.seq_kv
        );
        if let Some(s) = a.scale {
            ensure!(s.is_finite(), "sdpa: scale {s} is not finite");
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
    pub fn key(&self, dtype: DataType, stats: bool) -> PlanKey {
        PlanKey::Sdpa {
            dims: [self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_kv, self.head_dim],
            strides: [self.q_strides, self.k_strides, self.v_strides, self.o_strides],
            dtype,
            mask: self.mask,
            stats,
            form: self.form,
            padded: self.padded,
        }
    }

    /// The cuDNN graph in `form`: Q, K, V (uids 1-3), the scale by value (4), then O and, in training
    /// mode, stats (f32 `[b, h_q, s_q, 1]` packed), named `O` and `stats`.
    pub fn graph(&self, dtype: DataType, stats: bool, form: SdpaForm, cudnn_version: usize) -> Graph {
        let i = |v: [usize; 4]| v.map(|x| x as i64);
        let mut g = Graph::new(format!(
            "sdpa b{} hq{} hkv{} sq{} skv{} d{} {dtype} {} {}",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_kv,
            self.head_dim,
            self.mask.name(),
            if stats { "training" } else { "inference" }
        ));
        let q = g.tensor(TensorSpec::new("Q", &i(self.dims('q')), dtype).with_strides(&i(self.q_strides)));
        let k = g.tensor(TensorSpec::new("K", &i(self.dims('k')), dtype).with_strides(&i(self.k_strides)));
        let v = g.tensor(TensorSpec::new("V", &i(self.dims('v')), dtype).with_strides(&i(self.v_strides)));
        let scale = g.tensor(TensorSpec::scalar("scale", DataType::F32, 4));
        let seq_lens = self.padded.then(|| {
            let b = self.batch as i64;
            let lens =
                |name: &str| TensorSpec::new(name, &[b, 1, 1, 1], DataType::I32).with_strides(&[1, 1, 1, 1]);
            (g.tensor(lens("seq_len_q")), g.tensor(lens("seq_len_kv")))
        });
        let out =
            g.sdpa(q, k, v, scale, SdpaOptions { mask: self.mask, stats, form, cudnn_version, seq_lens });
        let o = g.output(out.o);
        o.name = "O".into();
        o.strides = i(self.o_strides).to_vec();
        if let Some(s) = out.stats {
            g.output(s).name = "stats".into();
        }
        g
    }

    /// The cached plan (for the [`SdpaArgs::normalized`] attention), built on first use. With an automatic form, a unified graph the running cuDNN
    /// rejects is rebuilt as the composite graph; [`Plan::form`] says which one runs.
    pub fn plan(&self, ctx: &Cudnn, dtype: DataType, stats: bool) -> Result<Rc<Plan>> {
        let a = self.normalized();
        let version = ctx.info().cudnn_version;
        if a.padded && version.min(crate::HEADER_VERSION) < 91500 {
            return Err(Error::NotSupported {
                op: "sdpa".into(),
                reason: format!(
                    "attention with run-time sequence lengths needs cuDNN 9.15 (the unified operation), this is {}",
                    crate::version_string(version)
                ),
            });
        }
        ctx.cache().get_or_build(&a.key(dtype, stats), || {
            let form = a.form.unwrap_or_else(|| SdpaForm::select(version, crate::HEADER_VERSION, a.mask));
            match a.graph(dtype, stats, form, version).build(ctx) {
                Err(e)
                    if e.is_not_supported() && a.form.is_none() && form == SdpaForm::Unified && !a.padded =>
                {
                    a.graph(dtype, stats, SdpaForm::Composite, version).build(ctx)
                }
                other => other,
            }
        })
    }
}

/// The largest head dim cuDNN's fused attention takes on a GPU of this compute capability with this
/// cuDNN version: 256 on Hopper, and on Blackwell from 9.11; 128 on Ampere/Ada (decode is capped
/// there); 0 before Ampere (no fused attention).
pub fn max_head_dim(compute_capability: (i32, i32), cudnn_version: usize) -> usize {
    match compute_capability.0 {
        ..=7 => 0,
        8 => 128,
        9 => 256,
        _ if cudnn_version >= 91100 => 256,
        _ => 128,
    }
}

/// Fused attention, inference mode.
pub fn sdpa<T: Element>(
    ctx: &Cudnn,
    args: SdpaArgs,
    q: &(impl DevicePtr<T> + ?Sized),
    k: &(impl DevicePtr<T> + ?Sized),
    v: &(impl DevicePtr<T> + ?Sized),
    o: &mut (impl DevicePtrMut<T> + ?Sized),
) -> Result<()> {
    fused::<T>(ctx, args, q, k, v, o, None)
}

/// Fused attention, training mode: also writes the f32 log-sum-exp of each score row.
pub fn sdpa_train<T: Element>(
    ctx: &Cudnn,
    args: SdpaArgs,
    q: &(impl DevicePtr<T> + ?Sized),
    k: &(impl DevicePtr<T> + ?Sized),
    v: &(impl DevicePtr<T> + ?Sized),
    o: &mut (impl DevicePtrMut<T> + ?Sized),
    stats: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    fused::<T>(ctx, args, q, k, v, o, Some(stats))
}

/// Attention on the chosen backend; `stats` selects training mode.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_with<T: Element>(
    backend: Backend,
    ctx: &Cudnn,
    args: SdpaArgs,
    q: &(impl DevicePtr<T> + ?Sized),
    k: &(impl DevicePtr<T> + ?Sized),
    v: &(impl DevicePtr<T> + ?Sized),
    o: &mut (impl DevicePtrMut<T> + ?Sized),
    stats: Option<&mut dyn DevicePtrMut<f32>>,
) -> Result<()> {
    match backend {
        Backend::Fused => fused::<T>(ctx, args, q, k, v, o, stats),
        Backend::Naive => crate::naive::attention::run::<T>(ctx, args, q, k, v, o, stats),
    }
}

/// Fused attention with per-sequence lengths read from device i32 buffers of `batch` values each:
/// `args` must be [`SdpaArgs::with_seq_lens`], its seq dims the capacities (buffers are sized by them);
/// keys past `seq_len_kv[b]` and queries past `seq_len_q[b]` are masked out (their output rows are
/// unspecified). One plan serves every length, e.g. every step of a decode over a growing cache.
/// Needs cuDNN 9.15+ and no causal mask (a single decode query needs none).
///
/// The lengths are device values the host cannot check, and cuDNN bounds them by nothing: a length past
/// the capacity would read K/V (and write O) past the buffers. So a launch-only kernel first copies
/// them, clamped into `0..=capacity`, into an op-owned buffer, and cuDNN reads that copy.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_padded<T: Element>(
    ctx: &Cudnn,
    args: SdpaArgs,
    q: &(impl DevicePtr<T> + ?Sized),
    k: &(impl DevicePtr<T> + ?Sized),
    v: &(impl DevicePtr<T> + ?Sized),
    o: &mut (impl DevicePtrMut<T> + ?Sized),
    seq_len_q: &(impl DevicePtr<i32> + ?Sized),
    seq_len_kv: &(impl DevicePtr<i32> + ?Sized),
) -> Result<()> {
    ensure!(args.padded, "sdpa_padded: build the arguments with SdpaArgs::with_seq_lens");
    for (name, len) in [("seq_len_q", seq_len_q.len()), ("seq_len_kv", seq_len_kv.len())] {
        ensure!(len >= args.batch, "sdpa_padded: {name} has {len} values, batch is {}", args.batch);
    }
    let lens = SdpaLens { q: q.len(), k: k.len(), v: v.len(), o: o.len(), stats: None };
    let args = args.validated(T::DTYPE, lens)?;
    let plan = args.plan(ctx, T::DTYPE, false)?;
    let (uid_q, uid_kv, uid_o) = (plan.uid("seq_len_q")?, plan.uid("seq_len_kv")?, plan.uid("O")?);
    let kernels = crate::naive::Kernels::get(ctx)?;
    // The K/V half starts 16-byte aligned (the alignment the graph declares).
    let kv_at = args.batch.next_multiple_of(4);
    let clamped = kernels.seq_lens(ctx, 2 * kv_at)?;
    {
        let (sq, _gq) = seq_len_q.device_ptr(ctx.stream());
        let (skv, _gkv) = seq_len_kv.device_ptr(ctx.stream());
        let (out, _go) = clamped.device_ptr(ctx.stream());
        let i = |v: usize| Arg::I64(v as i64); // each at most 2 * batch or a capacity, all < 2^31
        let a = [Arg::Ptr(sq), Arg::Ptr(skv), i(args.seq_q), i(args.seq_kv), i(kv_at), Arg::Ptr(out)];
        crate::naive::elementwise(ctx, kernels, "clamp_seq_lens", args.batch, &a)?;
    }
    let (lens_q, lens_kv) = (clamped.slice(0..args.batch), clamped.slice(kv_at..kv_at + args.batch));
    let mut b = Bindings::new(ctx.stream());
    b.input(1, q).input(2, k).input(3, v).scalar_f32(4, args.scale());
    b.input_i32(uid_q, &lens_q).input_i32(uid_kv, &lens_kv);
    b.output(uid_o, o);
    plan.execute(ctx, &b)
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

fn fused<T: Element>(
    ctx: &Cudnn,
    args: SdpaArgs,
    q: &(impl DevicePtr<T> + ?Sized),
    k: &(impl DevicePtr<T> + ?Sized),
    v: &(impl DevicePtr<T> + ?Sized),
    o: &mut (impl DevicePtrMut<T> + ?Sized),
    stats: Option<&mut dyn DevicePtrMut<f32>>,
) -> Result<()> {
    let lens =
        SdpaLens { q: q.len(), k: k.len(), v: v.len(), o: o.len(), stats: stats.as_ref().map(|s| s.len()) };
    let args = args.validated(T::DTYPE, lens)?;
    let info = ctx.info();
    let limit = max_head_dim(info.compute_capability, info.cudnn_version);
    if args.head_dim > limit {
        let (major, minor) = info.compute_capability;
        return Err(Error::NotSupported {
            op: "sdpa".into(),
            reason: format!(
                "head_dim {} exceeds {limit}, the largest fused attention takes on sm_{major}{minor} with cuDNN {}",
                args.head_dim,
                info.cudnn_version_string()
            ),
        });
    }
    let plan = args.plan(ctx, T::DTYPE, stats.is_some())?;
    let mut b = Bindings::new(ctx.stream());
    // Q, K, V and the scale are created first (uids 1-4); O and stats are found by name.
    b.input(1, q).input(2, k).input(3, v).scalar_f32(4, args.scale()).output(plan.uid("O")?, o);
    if let Some(s) = stats {
        b.output(plan.uid("stats")?, s);
    }
    plan.execute(ctx, &b)
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
    fn padded_graphs_bind_sequence_lengths_on_the_unified_form_only() {
        let a = SdpaArgs::new(2, 8, 2, 1, 256, 64, Layout::Bshd).with_seq_lens();
        assert_ne!(a.key(DataType::BF16, false), SdpaArgs { padded: false, ..a }.key(DataType::BF16, false));
        let g = a.graph(DataType::BF16, false, SdpaForm::Unified, 91900);
        g.validate().unwrap();
        let bound: Vec<(&str, i64)> = g
            .tensors()
            .iter()
            .filter(|t| !t.is_virtual && !t.by_value)
            .map(|t| (t.name.as_str(), t.uid))
            .collect();
        assert_eq!(&bound[3..5], &[("seq_len_q", 5), ("seq_len_kv", 6)]);
        let lens = g.tensors().iter().find(|t| t.name == "seq_len_kv").unwrap();
        assert_eq!((lens.dtype, lens.dims.clone()), (DataType::I32, vec![2, 1, 1, 1]));
        // The composite graph has no padding mask here; a causal mask cannot go on the unified node.
        let e = a.graph(DataType::BF16, false, SdpaForm::Composite, 91900).validate().unwrap_err();
        assert!(e.is_not_supported() && e.to_string().contains("unified SDPA operation"), "{e}");
        let chunk = SdpaArgs { seq_q: 4, ..a }.with_mask(Mask::CausalBottomRight);
        assert!(chunk
            .graph(DataType::BF16, false, SdpaForm::Unified, 91900)
            .validate()
            .unwrap_err()
            .is_not_supported());
    }

    #[test]
    fn head_dim_limits() {
        assert_eq!(max_head_dim((9, 0), 91400), 256);
        assert_eq!(max_head_dim((8, 0), 91900), 128);
        assert_eq!(max_head_dim((10, 0), 91000), 128);
        assert_eq!(max_head_dim((10, 0), 91900), 256);
        assert_eq!(max_head_dim((7, 5), 91900), 0);
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
    fn graphs_validate_in_both_forms() {
        for (mask, stats) in
            [(Mask::None, false), (Mask::CausalTopLeft, true), (Mask::CausalBottomRight, false)]
        {
            let a = SdpaArgs::new(1, 32, 8, 64, 128, 128, Layout::Bshd).with_mask(mask);
            let g = a.graph(DataType::BF16, stats, SdpaForm::Composite, 91900);
            g.validate().unwrap();
            assert_eq!(g.form(), Some("composite"));
            let mut bound: Vec<&str> = g
                .tensors()
                .iter()
                .filter(|t| !t.is_virtual && !t.by_value)
                .map(|t| t.name.as_str())
                .collect();
            let mut expected = vec!["Q", "K", "V", "O"];
            if stats {
                expected.push("stats");
            }
            bound.sort_unstable();
            expected.sort_unstable();
            assert_eq!(bound, expected);
            // K is the transposed view over the same memory: dims and strides swapped.
            let k = &g.tensors()[1];
            assert_eq!(
                (k.dims.clone(), k.strides.clone()),
                (vec![1, 8, 128, 128], vec![128 * 8 * 128, 128, 1, 8 * 128])
            );
            let o = g.tensors().iter().find(|t| t.name == "O").unwrap();
            assert_eq!(o.strides, vec![64 * 32 * 128, 128, 32 * 128, 1]);
            assert_eq!(o.dtype, DataType::BF16);
        }
        let u = SdpaArgs::new(1, 32, 8, 64, 64, 64, Layout::Bhsd).graph(
            DataType::F16,
            true,
            SdpaForm::Unified,
            91900,
        );
        u.validate().unwrap();
        assert_eq!(u.form(), Some("unified"));
        // A mask cannot go on the unified node with these bindings.
        let masked = SdpaArgs::new(1, 4, 4, 8, 8, 64, Layout::Bhsd).with_mask(Mask::CausalTopLeft);
        let e = masked.graph(DataType::F16, false, SdpaForm::Unified, 92100).validate().unwrap_err();
        assert!(e.is_not_supported() && e.to_string().contains("9.21"), "{e}");
    }
}
