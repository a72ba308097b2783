//! Property tests over every op's argument checks and the graph specs (CPU only): random sizes and
//! strides, including values near `usize::MAX` and `i64::MAX`, either pass for a consistent shape or
//! give a typed error; nothing panics (debug builds panic on overflow) and nothing that passes reaches
//! past a buffer.

use crate::graph::{Graph, NormPhase, SdpaForm};
use crate::ops::matmul::{BufferLens, MatmulArgs, MatrixLayout};
use crate::ops::rmsnorm::RmsNormArgs;
use crate::ops::rope::RopeArgs;
use crate::ops::rows::{CacheWrite, EmbeddingArgs};
use crate::ops::sdpa::{Layout, SdpaArgs, SdpaLens};
use crate::{packed_strides, DataType, Error, KnobRange, Mask, TensorSpec};
use proptest::prelude::*;

/// Small sizes mostly, and the edges where arithmetic wraps.
fn size() -> BoxedStrategy<usize> {
    const I64: usize = i64::MAX as usize;
    prop_oneof![
        6 => 0usize..48,
        1 => Just(usize::MAX),
        1 => (usize::MAX - 8)..=usize::MAX,
        1 => (I64 - 4)..=(I64 + 4),
        1 => (1usize << 30)..(1usize << 33),
        1 => (1usize << 60)..=(1usize << 62),
        1 => any::<usize>(),
    ]
    .boxed()
}

/// A buffer length: often exactly large, sometimes anything.
fn len() -> BoxedStrategy<usize> {
    prop_oneof![2 => Just(usize::MAX), 1 => Just(i64::MAX as usize), 2 => size()].boxed()
}

fn i64_dim() -> impl Strategy<Value = i64> {
    prop_oneof![6 => -2i64..40, 1 => Just(i64::MAX), 1 => (i64::MAX - 4)..=i64::MAX, 1 => Just(i64::MIN), 1 => any::<i64>()]
}

/// Only typed argument errors (or an unsupported dtype), never anything else.
fn typed(r: crate::Result<()>) -> std::result::Result<bool, TestCaseError> {
    match r {
        Ok(()) => Ok(true),
        Err(Error::InvalidArgument(m)) => {
            prop_assert!(!m.is_empty());
            Ok(false)
        }
        Err(e) if e.is_not_supported() => Ok(false),
        Err(e) => Err(TestCaseError::fail(format!("unexpected error kind: {e:?}"))),
    }
}

/// Every non-virtual, non-by-value tensor of a validated graph fits the buffer `lens` gives it.
fn bound_tensors_fit(g: &Graph, lens: &[(&str, usize)]) -> std::result::Result<(), TestCaseError> {
    for t in g.tensors().iter().filter(|t| !t.is_virtual && !t.by_value) {
        if let Some(&(_, len)) = lens.iter().find(|(n, _)| *n == t.name) {
            let need = t.min_elements();
            prop_assert!(need.is_some_and(|n| n <= len), "{} needs {need:?}, has {len}", t.name);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn tensor_specs(dims in prop::collection::vec(i64_dim(), 0..6), strides in prop::collection::vec(i64_dim(), 0..6)) {
        let packed = packed_strides(&dims);
        prop_assert_eq!(packed.len(), dims.len());
        prop_assert!(packed.iter().all(|&s| s >= 1));
        for spec in [TensorSpec::new("t", &dims, DataType::BF16), TensorSpec::new("t", &dims, DataType::F32).with_strides(&strides)] {
            let need = spec.min_elements();
            if spec.check().is_ok() {
                // A valid spec's furthest byte is addressable with cuDNN's i64.
                let bytes = need.and_then(|n| n.checked_mul(spec.dtype.size()));
                prop_assert!(bytes.is_some_and(|b| i64::try_from(b).is_ok()));
            }
        }
    }

    #[test]
    fn rmsnorm_args(tokens in size(), hidden in size(), x in len(), w in size(), y in len(), inv in prop::option::of(len())) {
        let a = RmsNormArgs { tokens, hidden, epsilon: 1e-5 };
        if typed(a.check(x, w, y, inv))? {
            let n = tokens.checked_mul(hidden);
            prop_assert!(n.is_some_and(|n| n <= x && n <= y && i64::try_from(n).is_ok()));
            let phase = if inv.is_some() { NormPhase::Training } else { NormPhase::Inference };
            let g = a.graph(DataType::BF16, phase);
            prop_assert!(g.validate().is_ok(), "{:?}", g.validate());
            bound_tensors_fit(&g, &[("X", x), ("scale", w), ("Y", y), ("inv_rms", inv.unwrap_or(0))])?;
        }
    }

    #[test]
    fn sdpa_args(
        dims in prop::collection::vec(prop_oneof![4 => 1usize..6, 1 => size()].boxed(), 6),
        s in prop::collection::vec(prop_oneof![3 => 1usize..4096, 1 => size()].boxed(), 16),
        packed in any::<bool>(),
        padded in any::<bool>(),
        l in prop::collection::vec(len(), 5),
    ) {
        let [batch, heads_q, heads_kv, seq_q, seq_kv, d] = [dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]];
        let strides: Vec<[usize; 4]> = s.chunks(4).map(|c| [c[0], c[1], c[2], c[3]]).collect();
        let head_dim = d.saturating_mul(8);
        let mut a = SdpaArgs::new(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, Layout::Bshd).with_mask(Mask::None);
        if !packed {
            let unit = |s: [usize; 4]| [s[0], s[1], s[2], 1];
            a = SdpaArgs { q_strides: unit(strides[0]), k_strides: unit(strides[1]), v_strides: unit(strides[2]), o_strides: unit(strides[3]), ..a };
        }
        if padded {
            a = a.with_seq_lens();
        }
        let lens = SdpaLens { q: l[0], k: l[1], v: l[2], o: l[3], stats: Some(l[4]) };
        if typed(a.validated(DataType::BF16, lens).map(|_| ()))? {
            for form in [SdpaForm::Unified, SdpaForm::Composite] {
                let g = a.graph(DataType::BF16, true, form, crate::Features::for_version(91900, (9, 0)));
                // A valid shape gives specs cuDNN can take; the graph may still be unsupported.
                if let Err(e) = g.validate() {
                    prop_assert!(e.is_not_supported(), "{e:?}");
                }
                for t in g.tensors() {
                    prop_assert!(t.check().is_ok(), "{}: {:?}", t.name, t.check());
                }
                bound_tensors_fit(&g, &[("Q", l[0]), ("K", l[1]), ("V", l[2]), ("O", l[3]), ("stats", l[4])])?;
            }
        }
    }

    #[test]
    fn matmul_args(
        a_dims in prop::array::uniform3(prop_oneof![4 => 1usize..5, 1 => size()]),
        b_dims in prop::array::uniform3(prop_oneof![4 => 1usize..5, 1 => size()]),
        a_strides in prop::array::uniform3(size()),
        b_strides in prop::array::uniform3(size()),
        layouts in 0u8..4,
        l in prop::array::uniform3(len()),
    ) {
        let scale = |d: [usize; 3]| [d[0], d[1].saturating_mul(8), d[2].saturating_mul(8)];
        let (ad, bd) = (scale(a_dims), scale(b_dims));
        let args = match layouts {
            0 => MatmulArgs::new(MatrixLayout::row_major(ad[0], ad[1], ad[2]), MatrixLayout::column_major(bd[0], ad[2], bd[2])),
            1 => MatmulArgs::new(MatrixLayout::row_major(ad[0], ad[1], ad[2]), MatrixLayout::row_major(1, ad[2], bd[2])),
            2 => MatmulArgs::new(MatrixLayout { dims: ad, strides: a_strides }, MatrixLayout { dims: bd, strides: b_strides }),
            _ => MatmulArgs::new(MatrixLayout { dims: ad, strides: [a_strides[0], a_strides[1], 1] }, MatrixLayout::row_major(1, ad[2], bd[2])),
        };
        let _ = args.folded();
        let _ = args.d_len();
        let _ = args.decode_gemv(DataType::BF16, DataType::BF16, DataType::BF16);
        let lens = BufferLens { a: l[0], b: l[1], d: l[2], ..BufferLens::default() };
        if typed(args.check(DataType::BF16, DataType::BF16, &lens))? {
            let g = args.graph(DataType::BF16, DataType::BF16);
            prop_assert!(g.validate().is_ok(), "{:?}", g.validate());
            bound_tensors_fit(&g, &[("A", l[0]), ("B", l[1]), ("D", l[2])])?;
        }
    }

    #[test]
    fn rope_args(
        v in prop::array::uniform7(size()),
        half in prop_oneof![3 => 1usize..32, 1 => size()],
        buffer in len(),
        positions in len(),
    ) {
        let [batch, seq, heads_q, heads_kv, row_stride, start, _] = v;
        let head_dim = half.saturating_mul(2);
        let a = RopeArgs { batch, seq, heads_q, heads_kv, head_dim, row_stride, start };
        if typed(a.check(buffer, positions, head_dim))? {
            // What the kernels index: the last row's K heads, and the tables at start + seq - 1.
            let last = (batch * seq - 1) * row_stride + (heads_q + heads_kv) * head_dim;
            prop_assert!(last <= buffer && i64::try_from(last).is_ok());
            prop_assert!(start + seq <= positions);
            prop_assert!(batch * seq <= i32::MAX as usize);
        }
    }

    #[test]
    fn cache_writes(v in prop::array::uniform6(size()), src in len(), cache in len()) {
        let [batch, seq, cols, src_stride, max_seq, start] = v;
        let w = CacheWrite { batch, seq, cols, src_stride, max_seq, start };
        if typed(w.check(src, cache))? {
            // The kernel's furthest write, (b · max_seq + start + s) · cols + c, stays in the cache.
            let last_write = ((batch - 1) * max_seq + start + seq - 1) * cols + cols - 1;
            prop_assert!(last_write < cache);
            prop_assert!((batch * seq - 1) * src_stride + cols <= src);
        }
    }

    #[test]
    fn embedding_sizes(v in prop::array::uniform6(size())) {
        let [ids, rows, table, vocab, hidden, y] = v;
        if typed(EmbeddingArgs { rows, vocab, hidden }.check(ids, table, y))? {
            prop_assert!(vocab * hidden <= table && rows * hidden <= y && rows <= ids);
        }
    }

    #[test]
    fn knob_values(kind in 0u32..50, min in any::<i64>(), max in any::<i64>(), stride in any::<i64>(), cap in 0usize..80) {
        let r = KnobRange { kind, min, max, stride };
        let values: Vec<i64> = r.values(cap).collect();
        prop_assert!(values.len() <= cap);
        prop_assert!(values.iter().all(|&v| v >= min && v <= max));
        prop_assert!(values.windows(2).all(|w| w[0] < w[1]));
    }
}
