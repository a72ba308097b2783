//! The plan cache: op-declared keys to shared plans, with hit/miss counters.
//!
//! Each op declares its own key type (`ops::rmsnorm::Key`, `ops::sdpa::Key`, `ops::matmul::Key`): any
//! `Clone + Eq + Hash + Debug` type is a [`PlanKey`]. The cache knows no op: keys of different types
//! never match, even with equal fields.
//!
//! Plans are `Rc`, not `Arc`: a plan is bound to its context's cuDNN handle, which must not be used
//! from two threads at once, so neither plans nor the context are `Send`.

use crate::plan::Plan;
use crate::Result;
use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::rc::Rc;

/// What identifies a plan: the op (the key's type) and everything that changes its graph (dims,
/// strides, dtypes, flags). Runtime scalars (epsilon, attention scale) are by-value tensors and never
/// part of a key. Implemented for every `Clone + Eq + Hash + Debug + 'static` type.
pub trait PlanKey: Any + Clone + Eq + Hash + Debug {}

impl<K: Any + Clone + Eq + Hash + Debug> PlanKey for K {}

/// A key of some op's type and its plan.
struct Entry {
    key: Box<dyn Any>,
    plan: Rc<Plan>,
}

/// The hash of a key together with its type, so that equal fields of two ops' keys land apart.
fn hash_of<K: PlanKey>(key: &K) -> u64 {
    let mut h = DefaultHasher::new();
    TypeId::of::<K>().hash(&mut h);
    key.hash(&mut h);
    h.finish()
}

/// Cache counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
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
    /// Entries by [`hash_of`] their key; a bucket holds more than one only on a hash collision.
    plans: RefCell<HashMap<u64, Vec<Entry>>>,
    hits: Cell<u64>,
    misses: Cell<u64>,
    /// Drawn from the process-wide epoch counter at each clear (0 before any).
    epoch: Cell<u64>,
}

impl PlanCache {
    /// Returns the plan for `key`, building it with `build` on a miss.
    pub fn get_or_build<K: PlanKey>(
        &self,
        key: &K,
        build: impl FnOnce() -> Result<Plan>,
    ) -> Result<Rc<Plan>> {
        let hash = hash_of(key);
        if let Some(plan) = self.find(hash, key) {
            self.hits.set(self.hits.get() + 1);
            return Ok(plan);
        }
        self.misses.set(self.misses.get() + 1);
        let plan = Rc::new(build()?);
        let entry = Entry { key: Box::new(key.clone()), plan: plan.clone() };
        self.plans.borrow_mut().entry(hash).or_default().push(entry);
        Ok(plan)
    }

    /// The plan for `key`, if built.
    pub fn get<K: PlanKey>(&self, key: &K) -> Option<Rc<Plan>> {
        self.find(hash_of(key), key)
    }

    fn find<K: PlanKey>(&self, hash: u64, key: &K) -> Option<Rc<Plan>> {
        let plans = self.plans.borrow();
        let bucket = plans.get(&hash)?;
        bucket.iter().find(|e| e.key.downcast_ref::<K>() == Some(key)).map(|e| e.plan.clone())
    }

    /// Every plan held, in no particular order (e.g. to report which engine each chose).
    pub fn plans(&self) -> Vec<Rc<Plan>> {
        self.plans.borrow().values().flatten().map(|e| e.plan.clone()).collect()
    }

    /// Counters and size.
    pub fn stats(&self) -> CacheStats {
        let entries = self.plans.borrow().values().map(Vec::len).sum();
        CacheStats { hits: self.hits.get(), misses: self.misses.get(), entries }
    }

    /// Drops every plan and resets the counters.
    pub fn clear(&self) {
        self.plans.borrow_mut().clear();
        self.hits.set(0);
        self.misses.set(0);
        self.epoch.set(crate::exec::next_epoch());
    }

    /// Changes at every [`PlanCache::clear`] (part of [`Cudnn::buffer_epoch`](crate::Cudnn::buffer_epoch)).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ops' keys with equal fields.
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct KeyA(usize);
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct KeyB(usize);

    #[test]
    fn failed_builds_count_as_misses_and_are_not_cached() {
        let cache = PlanCache::default();
        let k = KeyA(1);
        for _ in 0..2 {
            let err = cache.get_or_build(&k, || Err(crate::Error::invalid("no"))).unwrap_err();
            assert!(err.to_string().contains("no"));
        }
        assert_eq!(cache.stats(), CacheStats { hits: 0, misses: 2, entries: 0 });
        assert!(cache.get(&k).is_none());
        cache.clear();
        assert_eq!(cache.stats(), CacheStats::default());
    }

    #[test]
    fn keys_of_two_ops_with_equal_fields_differ() {
        assert_ne!(hash_of(&KeyA(7)), hash_of(&KeyB(7)));
        assert_eq!(hash_of(&KeyA(7)), hash_of(&KeyA(7)));
        assert_ne!(hash_of(&KeyA(7)), hash_of(&KeyA(8)));
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
