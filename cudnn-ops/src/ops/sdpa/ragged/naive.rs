//! The eager half: what PyTorch eager does with a ragged batch short of padding it, a loop over the
//! sequences, each the naive attention of [`crate::ops::sdpa::naive`] over its slice of the packed
//! buffers (one `b = 1` BSHD call per sequence: `[len, h, d]` is BSHD with one batch, its tokens a
//! row stride apart).

use super::{RaggedArgs, RaggedOperands};
use crate::dtype::Element;
use crate::kernels::View;
use crate::ops::sdpa::{sdpa, Layout, SdpaArgs, SdpaOperands};
use crate::ops::Naive;
use crate::{Backend, Cudnn, Result};

impl<T: Element> Naive<T> for RaggedArgs {
    fn naive(self, ctx: &Cudnn, x: RaggedOperands<'_, T>) -> Result<()> {
        let RaggedOperands { q, k, v, o, batch } = x;
        let stream = ctx.stream();
        let (lens, owner) = ([q.len(), k.len(), v.len(), o.len()], stream.clone());
        let (q_ptr, _gq) = q.device_ptr(stream);
        let (k_ptr, _gk) = k.device_ptr(stream);
        let (v_ptr, _gv) = v.device_ptr(stream);
        let (o_ptr, _go) = o.device_ptr_mut(stream);
        let elem = T::DTYPE.size() as u64;
        // Offsets the op checked against the buffers: each view lies inside its buffer.
        // A view of a buffer from an element on: the buffer's guard (held for the whole loop) orders it.
        let at = |ptr: u64, len: usize, offset: i32| View {
            addr: ptr + elem * offset as u64,
            len: len - offset as usize,
            stream: owner.clone(),
        };
        let (qo, kv, oo) = (batch.queries().offsets(), batch.keys().offsets(), batch.outputs().offsets());
        let (rows, d) = (self.rows, self.head_dim);
        for (i, &n) in batch.seq_lens().iter().enumerate() {
            let n = n as usize;
            let mut args = SdpaArgs::new(1, self.heads_q, self.heads_kv, n, n, d, Layout::Bshd)
                .with_mask(self.mask)
                .with_scale(self.scale());
            // BSHD of one sequence, its tokens a row stride apart.
            let bshd = |row: usize| [n * row, d, row, 1];
            (args.q_strides, args.k_strides, args.v_strides, args.o_strides) =
                (bshd(rows.q), bshd(rows.kv), bshd(rows.kv), bshd(rows.o));
            let (qs, ks, vs) =
                (at(q_ptr, lens[0], qo[i]), at(k_ptr, lens[1], kv[i]), at(v_ptr, lens[2], kv[i]));
            let mut os = at(o_ptr, lens[3], oo[i]);
            sdpa::<T>(ctx, args, SdpaOperands::new(&qs, &ks, &vs, &mut os), Backend::Naive)?;
        }
        Ok(())
    }
}
