//! The plan cache: derived-`Hash` keys to shared plans, with hit/miss counters.
//!
//! Plans are `Rc`, not `Arc`: a plan is bound to its context's cuDNN handle, which must not be used
//! from two threads at once, so neither plans nor the context are `Send`.

use crate::graph::NormPhase;

use crate::plan::Plan;
use crate::{DataType, Result};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// What identifies a plan: the op kind and everything that changes the graph (dims, strides, dtypes,
/// flags). Runtime scalars (epsilon, attention scale) are by-value tensors and never part of a key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PlanKey {
    /// Fused RMSNorm over row-major `[tokens, hidden]`.
    RmsNorm {
        /// Rows.
        tokens: usize,
        /// Row length.
        hidden: usize,
        /// Element stride between rows (`hidden` when packed).
        row_stride: usize,
        /// I/O dtype (x, weight, y).
        dtype: DataType,
        /// Inference or training.
        phase: NormPhase,
    },
    /// Fused matmul with an epilogue (`ops::matmul`).
    Matmul {
        /// A `[batch, m, k]` dims and strides.
        a: crate::ops::matmul::MatrixLayout,
        /// B `[batch or 1, k, n]` dims and strides.
        b: crate::ops::matmul::MatrixLayout,
        /// Dtype of A and B.
        dtype: DataType,
        /// Dtype of D and of the epilogue's inputs.
        out_dtype: DataType,
        /// The steps after the matmul.
        epilogue: crate::ops::matmul::Epilogue,
    },
    /// Fused attention forward.
    Sdpa {
        /// `[batch, heads_q, heads_kv, seq_q, seq_kv, head_dim]`.
        dims: [usize; 6],
        /// Element strides of Q, K, V and O over their logical `[b, h, s, d]` dims.
        strides: [[usize; 4]; 4],
        /// I/O dtype.
        dtype: DataType,
        /// Causal masking.
        mask: crate::Mask,
        /// Training mode (stats written).
        stats: bool,
        /// The form asked for (`None`: chosen by version).
        form: Option<crate::SdpaForm>,
        /// Sequence lengths bound at run time (seq dims are capacities).
        padded: bool,
    },
}

/// Cache counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Lookups that found a plan.
    pub hits: u64,
    /// Lookups that built one.
    pub misses: u64,
    /// Plans held.
    pub entries: usize,
}

/// Plans by key. Failed builds are not cached: each call retries (and fails the same way).
#[derive(Default)]
pub struct PlanCache {
    plans: RefCell<HashMap<PlanKey, Rc<Plan>>>,
    hits: Cell<u64>,
    misses: Cell<u64>,
    /// Drawn from the process-wide epoch counter at each clear (0 before any).
    epoch: Cell<u64>,
}

impl PlanCache {
    /// Returns the plan for `key`, building it with `build` on a miss.
    pub fn get_or_build(&self, key: &PlanKey, build: impl FnOnce() -> Result<Plan>) -> Result<Rc<Plan>> {
        if let Some(plan) = self.plans.borrow().get(key) {
            self.hits.set(self.hits.get() + 1);
            return Ok(plan.clone());
        }
        self.misses.set(self.misses.get() + 1);
        let plan = Rc::new(build()?);
        self.plans.borrow_mut().insert(key.clone(), plan.clone());
        Ok(plan)
    }

    /// The plan for `key`, if built.
    pub fn get(&self, key: &PlanKey) -> Option<Rc<Plan>> {
        self.plans.borrow().get(key).cloned()
    }

    /// Every plan held, in no particular order (e.g. to report which engine each chose).
    pub fn plans(&self) -> Vec<Rc<Plan>> {
        self.plans.borrow().values().cloned().collect()
    }

    /// Counters and size.
    pub fn stats(&self) -> CacheStats {
        CacheStats { hits: self.hits.get(), misses: self.misses.get(), entries: self.plans.borrow().len() }
    }

    /// Drops every plan and resets the counters.
    pub fn clear(&self) {
        self.plans.borrow_mut().clear();
        self.hits.set(0);
        self.misses.set(0);
        self.epoch.set(crate::context::next_epoch());
    }

    /// Changes at every [`PlanCache::clear`] (part of [`Cudnn::buffer_epoch`](crate::Cudnn::buffer_epoch)).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};

    fn key(tokens: usize, hidden: usize, dtype: DataType, phase: NormPhase) -> PlanKey {
        PlanKey::RmsNorm { tokens, hidden, row_stride: hidden, dtype, phase }
    }

    fn hash(k: &PlanKey) -> u64 {
        let mut h = DefaultHasher::new();
        k.hash(&mut h);
        h.finish()
    }

    #[test]
    fn same_shape_same_key_any_change_different_key() {
        let base = key(30, 4096, DataType::BF16, NormPhase::Inference);
        assert_eq!(base, key(30, 4096, DataType::BF16, NormPhase::Inference));
        assert_eq!(hash(&base), hash(&key(30, 4096, DataType::BF16, NormPhase::Inference)));
        let changed = [
            key(31, 4096, DataType::BF16, NormPhase::Inference),
            key(30, 2048, DataType::BF16, NormPhase::Inference),
            key(30, 4096, DataType::F16, NormPhase::Inference),
            key(30, 4096, DataType::BF16, NormPhase::Training),
            PlanKey::RmsNorm {
                tokens: 30,
                hidden: 4096,
                row_stride: 4104,
                dtype: DataType::BF16,
                phase: NormPhase::Inference,
            },
        ];
        for k in changed {
            assert_ne!(base, k);
            assert_ne!(hash(&base), hash(&k), "{k:?}");
        }
    }

    #[test]
    fn failed_builds_count_as_misses_and_are_not_cached() {
        let cache = PlanCache::default();
        let k = key(1, 8, DataType::F32, NormPhase::Inference);
        for _ in 0..2 {
            let err = cache.get_or_build(&k, || Err(crate::Error::invalid("no"))).unwrap_err();
            assert!(err.to_string().contains("no"));
        }
        assert_eq!(cache.stats(), CacheStats { hits: 0, misses: 2, entries: 0 });
        cache.clear();
        assert_eq!(cache.stats(), CacheStats::default());
    }

    /// A captured graph launches kernels its plans own: every clear moves the epoch graphs check, to
    /// a value no other cache or context has shown.
    #[test]
    fn every_clear_moves_the_epoch_past_all_earlier_ones() {
        let (a, b) = (PlanCache::default(), PlanCache::default());
        assert_eq!((a.epoch(), b.epoch()), (0, 0));
        a.clear();
        let first = a.epoch();
        assert!(first > 0);
        b.clear();
        assert!(b.epoch() > first, "epochs come from one process-wide counter");
        a.clear();
        assert!(a.epoch() > b.epoch());
    }
}
