//! Attention of a step's queries over the cache, in the cheapest form that runs: one padded launch
//! for every decode step (the split-KV kernel, or cuDNN's padded plan where it takes run-time lengths
//! and the kernel does not take the shape), else a plan per length, else per sequence.

use super::{within, KvCache, QkvRows};
use crate::dtype::Element;
use crate::ops::sdpa::{sdpa, SdpaArgs, SdpaKernel, SdpaLens, SdpaOperands};
use crate::{Backend, Cudnn, Mask, Result};
use cudarc::driver::{CudaView, CudaViewMut};

/// Which attention [`KvCache::attend`] ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttendForm {
    /// One launch for every decode step on the split-KV kernel ([`SdpaKernel::SplitKv`]): the whole
    /// cache as key capacity, each sequence's length read on the device (fused decode steps, one query
    /// per sequence, a head dim the kernel takes; any cuDNN).
    SplitKv,
    /// One cuDNN plan for every decode step: the whole cache as key capacity, each sequence's lengths
    /// read on the device (cuDNN 9.15+; fused decode steps the split-KV kernel does not take).
    Padded,
    /// One call over the first `len + seq` keys, all sequences at the same length: a plan per length.
    PerLength,
    /// One call per sequence, for sequences at different lengths: a plan per length and sequence.
    PerSequence,
}

impl AttendForm {
    /// `split-kv`, `padded`, `per-length` or `per-sequence`.
    pub fn name(self) -> &'static str {
        match self {
            AttendForm::SplitKv => "split-kv",
            AttendForm::Padded => "padded",
            AttendForm::PerLength => "per-length",
            AttendForm::PerSequence => "per-sequence",
        }
    }
}

impl<T: Element> KvCache<T> {
    /// Attention of the step's queries (`q`: rows as `rows` says, Q heads first; append the step's K and
    /// V first) over layer `layer`'s cache, each sequence over its own `len + seq` keys, causal; O
    /// packed `[batch · seq, heads_q · d]`. Picks the form itself and returns it ([`AttendForm`]):
    /// a fused decode step (one query per sequence) runs the one padded launch, on cuDNN's padded plan
    /// where the running cuDNN has it (9.15+; the step's first such call clamps the lengths for all
    /// layers), else on the split-KV kernel where it takes the shape; when that is refused (`NotSupported`: cuDNN < 9.15 or a refused plan
    /// for a shape the kernel does not take) the cache records why ([`KvCache::padded_refusal`]) and
    /// runs, now and after, a plan per length (per sequence where lengths differ). Other errors are
    /// returned.
    pub fn attend(
        &mut self,
        ctx: &Cudnn,
        layer: usize,
        rows: QkvRows,
        q: CudaView<'_, T>,
        mut o: CudaViewMut<'_, T>,
        backend: Backend,
    ) -> Result<AttendForm> {
        self.check_layer(layer)?;
        let seq = self.lens.step()?;
        let shape = self.shape;
        // The whole cache as capacity: checks Q, O and the cache for every form below.
        let capacity = SdpaArgs { seq_kv: shape.max_seq, ..shape.attention(rows, 1, seq) };
        let (k, v) = (&self.k[layer], &self.v[layer]);
        let (q_len, o_len) = (q.len(), o.len());
        capacity.check(SdpaLens { q: q_len, k: k.len(), v: v.len(), o: o_len, stats: None })?;
        let form = if seq == 1 && backend == Backend::Fused && self.uploaded && self.padded_refusal.is_none()
        {
            let padded = capacity.with_mask(Mask::None).with_seq_lens();
            let padded = padded.with_decode_choice(ctx.decode_attention(), ctx.features());
            let x = SdpaOperands::new(&q, k, v, &mut o);
            // The split-KV kernel clamps the lengths as it reads them; cuDNN reads a clamped copy.
            let (ran, x) = if padded.fused_kernel(ctx.features(), false) == SdpaKernel::SplitKv {
                (AttendForm::SplitKv, x.seq_lens(&self.q_lens, &self.kv_lens))
            } else {
                if !self.clamped {
                    self.seq_lens.clamp(ctx, &self.q_lens, &self.kv_lens)?;
                    self.clamped = true;
                }
                (AttendForm::Padded, x.clamped_seq_lens(&self.seq_lens))
            };
            match sdpa(ctx, padded, x, backend) {
                Ok(()) => Some(ran),
                Err(e) if e.is_not_supported() => {
                    self.padded_refusal = Some(e.to_string());
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let form = match form {
            Some(f) => f,
            None => match self.lens.uniform() {
                Some(len) => {
                    sdpa(ctx, shape.attention(rows, len, seq), SdpaOperands::new(&q, k, v, &mut o), backend)?;
                    AttendForm::PerLength
                }
                None => {
                    let one = super::KvCacheShape { batch: 1, ..shape };
                    let (q_rows, o_rows) = (seq * rows.row_stride, seq * rows.heads_q * shape.head_dim);
                    let cache = shape.max_seq * shape.row_width();
                    for (b, &len) in self.lens.get().iter().enumerate() {
                        let qb = within(q.try_slice(b * q_rows..q_len))?;
                        let mut ob = within(o.try_slice_mut(b * o_rows..(b + 1) * o_rows))?;
                        let kb = within(k.try_slice(b * cache..(b + 1) * cache))?;
                        let vb = within(v.try_slice(b * cache..(b + 1) * cache))?;
                        let x = SdpaOperands::new(&qb, &kb, &vb, &mut ob);
                        sdpa(ctx, one.attention(rows, len, seq), x, backend)?;
                    }
                    AttendForm::PerSequence
                }
            },
        };
        self.last_form = Some(form);
        Ok(form)
    }
}
