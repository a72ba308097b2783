//! A tensor-parallel rank's long prefill as two halves of its rows, interleaved module by module, so
//! that each half's sums over the ranks travel while the other half computes:
//!
//! ```text
//! for each layer:                                    main stream                 copy engines
//!     for half in [A, B]:
//!         half.x = sum(half's MLP gather)            (the layer before's)
//!         attention(half) -> half's slot             norm qkv rope gqa o_proj    A's gather under B's attention
//!     for half in [A, B]:
//!         half.x = sum(half's attention gather)
//!         mlp(half) -> half's slot                   norm gate up down           B's under A's MLP, A's under B's
//! ```
//!
//! Half A is rows `0..at` at the pass's position; half B the rows after, a chunked prefill over the
//! cache A's K and V rows were appended to earlier in stream order (attention bottom-right
//! aligned). Each half's `o_proj` and `down` write the rank's part of the half's own slot of the
//! gather window whole, the copy engines gather it ([`RankSum::half`]), and the half sums it just
//! before its next module reads x. So the stream waits for no gather but half B's last, where the
//! chunked form of `modules/reduce.rs` has one gather exposed per projection. Half A runs in the
//! model's activations, half B in buffers of its own (kept, as the activations are: for 8B shapes
//! on two ranks about 70 MB a rank at 1024 rows); B's output rows are copied after A's.

use super::{Activations, KvCache, Llama, Observer};
use crate::backends::Backends;
use crate::modules::dispatch::Dispatch;
use crate::modules::reduce::RankSum;
use crate::modules::{Pass, Tokens, ATTN_ALLREDUCE_RANGE, MLP_ALLREDUCE_RANGE};
use crate::Result;
use cudnn_llm_ops::{Cudnn, Element};

impl<T: Element> Llama<T> {
    /// [`Llama::run`] of a pass of `tokens` halved, where it runs halved (`None` where not): a
    /// tensor-parallel rank with a gather window, one sequence, and halves
    /// [`RankSum::halves_at`] takes.
    pub(super) fn run_halves(
        &mut self,
        ctx: &Cudnn,
        tokens: Tokens,
        cache: &mut KvCache<T>,
        backends: &Backends,
        obs: &mut dyn Observer,
    ) -> Result<Option<bool>> {
        let (Some(comm), Some(gather)) = (&self.comm, &self.gather) else { return Ok(None) };
        if tokens.batch != 1 || !RankSum::<T>::may_halve(tokens.seq) {
            return Ok(None);
        }
        let hidden = self.cfg.hidden;
        let whole = RankSum::new(ctx, comm, Some(gather), hidden)?;
        let Some(at) = whole.halves_at(tokens.seq) else { return Ok(None) };
        let ranks = [whole.half(0), whole.half(1)];
        let halves = [
            Tokens { seq: at, ..tokens },
            Tokens { seq: tokens.seq - at, start: tokens.start + at, ..tokens },
        ];
        if self.half.as_ref().is_none_or(|a| a.rows < halves[1].seq) {
            self.half = Some(Activations::new(ctx, &self.cfg, halves[1].seq, None)?);
        }
        let (a, b) =
            (self.acts.as_mut().expect("allocated by upload"), self.half.as_mut().expect("made above"));
        let err = cudnn_llm_ops::Error::from;
        ctx.stream()
            .memcpy_dtod(&a.ids.slice(at..tokens.seq), &mut b.ids.slice_mut(..halves[1].seq))
            .map_err(err)?;
        let dispatch = Dispatch::new(&mut self.fallbacks, backends, obs);
        let mut p = Pass::new(ctx, dispatch, halves[0], &self.rope, self.padded_decode);
        let mut bufs =
            [(&a.ids, &mut a.x, &mut a.scratch, &mut a.out), (&b.ids, &mut b.x, &mut b.scratch, &mut b.out)];
        for (h, (ids, x, ..)) in bufs.iter_mut().enumerate() {
            p.set_tokens(halves[h]);
            self.embed.forward(&mut p, ids, x.first_mut())?;
        }
        let blocks = &self.blocks;
        for (l, block) in blocks.iter().enumerate() {
            for (h, (_, x, s, _)) in bufs.iter_mut().enumerate() {
                p.set_tokens(halves[h]);
                let r = Some(&ranks[h]);
                if let Some(before) = l.checked_sub(1).map(|l| &blocks[l]) {
                    before.sum_over_ranks(&mut p, r, MLP_ALLREDUCE_RANGE, x)?;
                }
                block.attention(&mut p, x, s, cache.layer_step(l)?, r)?;
            }
            for (h, (_, x, s, _)) in bufs.iter_mut().enumerate() {
                p.set_tokens(halves[h]);
                let r = Some(&ranks[h]);
                block.sum_over_ranks(&mut p, r, ATTN_ALLREDUCE_RANGE, x)?;
                block.mlp(&mut p, x, s, r)?;
            }
        }
        for (h, (_, x, _, out)) in bufs.iter_mut().enumerate() {
            p.set_tokens(halves[h]);
            if let Some(last) = blocks.last() {
                last.sum_over_ranks(&mut p, Some(&ranks[h]), MLP_ALLREDUCE_RANGE, x)?;
            }
            self.norm.forward(&mut p, x.get(), out)?;
        }
        let n = halves[1].seq * hidden;
        ctx.stream()
            .memcpy_dtod(&b.out.slice(..n), &mut a.out.slice_mut(at * hidden..at * hidden + n))
            .map_err(err)?;
        self.padded_decode = p.positions.padded;
        self.halved += 1;
        cache.finish()?;
        Ok(Some(p.positions.baked))
    }
}
