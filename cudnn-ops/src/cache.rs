//! The plan cache: op-declared keys to shared plans, with hit/miss counters, and optionally a plan
//! directory behind it ([`Cudnn::set_plan_dir`](crate::Cudnn::set_plan_dir)): a miss first looks
//! there for the plan an earlier process built and tuned, and a plan built on a miss is saved there
//! once final.
//!
//! In the directory, a key is its type's name and its `Debug` text (stable across processes and
//! builds of one crate version, unlike `DefaultHasher`, whose output may change between Rust
//! releases): the file is named by a stable hash of that text, which is stored whole and compared on
//! load. A stored plan is also tied to the graph it was built from (its whole `Debug` text and the
//! tuning), the GPU, driver, cuDNN and crate versions.
//!
//! Each op declares its own key type (`ops::rmsnorm::Key`, `ops::sdpa::Key`, `ops::matmul::Key`): any
//! `Clone + Eq + Hash + Debug` type is a [`PlanKey`]. The cache knows no op: keys of different types
//! never match, even with equal fields.
//!
//! Plans are `Rc`, not `Arc`: a plan is bound to its context's cuDNN handle, which must not be used
//! from two threads at once, so neither plans nor the context are `Send`.

use crate::plan::store::{DiskLog, PlanStore, Slot};
use crate::plan::{DiskEvent, Plan};
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
    /// Misses served from the plan directory: a stored plan (or its engine choice) was loaded, and
    /// neither heuristics nor autotuning ran.
    pub disk_hits: u64,
    /// Misses the plan directory had no plan for (no file, or one for another graph of the key): built
    /// as without one, and saved.
    pub disk_misses: u64,
    /// Misses whose stored plan was unusable (stale, corrupt, or refused by cuDNN): rebuilt, the file
    /// replaced, an event recorded ([`PlanCache::disk_events`]).
    pub disk_rejects: u64,
    /// Plans written to the plan directory.
    pub disk_writes: u64,
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
    /// The plan directory, if plans persist.
    store: RefCell<Option<PlanStore>>,
    /// Counters and events of the plan directory.
    disk: Rc<DiskLog>,
    /// The slots of the misses whose build closures run now, innermost last: what a graph built
    /// inside one loads from and saves to ([`PlanCache::building`]).
    building: RefCell<Vec<Rc<Slot>>>,
    /// Misses being built now, nested ones included (with or without a plan directory): only the
    /// outermost's time goes to the start-up record.
    depth: std::cell::Cell<usize>,
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
        let started = std::time::Instant::now();
        let outermost = self.depth.get() == 0;
        self.depth.set(self.depth.get() + 1);
        /// Leaves the nesting count when the build returns (or unwinds).
        struct Leave<'a>(&'a std::cell::Cell<usize>);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.set(self.0.get() - 1);
            }
        }
        let leave = Leave(&self.depth);
        let slot = self.store.borrow().as_ref().map(|s| {
            let text = format!("{}\n{key:?}", std::any::type_name::<K>());
            Rc::new(s.slot(text, self.disk.clone()))
        });
        let built = match &slot {
            Some(slot) => {
                /// Pops the slot when the build returns (or unwinds).
                struct Pop<'a>(&'a RefCell<Vec<Rc<Slot>>>);
                impl Drop for Pop<'_> {
                    fn drop(&mut self) {
                        self.0.borrow_mut().pop();
                    }
                }
                self.building.borrow_mut().push(slot.clone());
                let _pop = Pop(&self.building);
                build()
            }
            None => build(),
        };
        if let Some(slot) = slot {
            slot.count();
        }
        drop(leave);
        let plan = Rc::new(built?);
        if outermost {
            crate::startup::record("plans", started.elapsed(), "");
        }
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
        let d = &self.disk;
        CacheStats {
            hits: self.hits.get(),
            misses: self.misses.get(),
            entries,
            disk_hits: d.hits.get(),
            disk_misses: d.misses.get(),
            disk_rejects: d.rejects.get(),
            disk_writes: d.writes.get(),
        }
    }

    /// Problems with plan files since the context opened (stale, corrupt or refused files, failed
    /// writes), oldest first. None of them failed an op: each plan was rebuilt (or not saved).
    pub fn disk_events(&self) -> Vec<DiskEvent> {
        self.disk.events()
    }

    /// Drops every plan and resets the counters (the plan directory's files stay).
    pub fn clear(&self) {
        self.plans.borrow_mut().clear();
        self.hits.set(0);
        self.misses.set(0);
        self.disk.reset_counters();
        self.epoch.set(crate::exec::next_epoch());
    }

    /// Plans persist in `store`'s directory from now on (`None`: not at all).
    pub(crate) fn set_store(&self, store: Option<PlanStore>) {
        *self.store.borrow_mut() = store;
    }

    /// The plan directory, if plans persist.
    pub(crate) fn store_dir(&self) -> Option<std::path::PathBuf> {
        self.store.borrow().as_ref().map(|s| s.dir().to_path_buf())
    }

    /// The plan directory slot of the innermost miss being built now, if plans persist: a graph built
    /// inside [`PlanCache::get_or_build`]'s closure loads its plan from there and saves it there.
    pub(crate) fn building(&self) -> Option<Rc<Slot>> {
        self.building.borrow().last().cloned()
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
        assert_eq!(cache.stats(), CacheStats { hits: 0, misses: 2, ..CacheStats::default() });
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

    /// A miss with a plan directory opens the key's slot for the build closure (innermost first when
    /// builds nest) and counts it as a disk hit, miss or rejection afterwards; without a directory there
    /// is no slot. The directory is named by the key, never by the user's home.
    #[test]
    fn misses_open_a_slot_for_the_build_and_count_what_it_found() {
        use crate::plan::store::tests::{env, temp_dir};
        use crate::plan::DiskEventKind;
        let dir = temp_dir("cache");
        let cache = PlanCache::default();
        let fail = || Err(crate::Error::invalid("no GPU here"));
        cache
            .get_or_build(&KeyA(1), || {
                assert!(cache.building().is_none(), "no plan directory, no slot");
                fail()
            })
            .unwrap_err();
        assert_eq!(cache.stats().disk_misses, 0);
        cache.set_store(Some(PlanStore::new(dir.path().to_path_buf(), env())));
        assert_eq!(cache.store_dir(), Some(dir.path().to_path_buf()));
        let outer = |cache: &PlanCache| cache.building().unwrap().path();
        cache
            .get_or_build(&KeyA(1), || {
                let a = outer(&cache);
                assert!(a.starts_with(dir.path()), "{a:?}");
                cache.get_or_build(&KeyB(1), || {
                    assert_ne!(outer(&cache), a, "the inner miss has its own slot");
                    fail()
                })?;
                fail()
            })
            .unwrap_err();
        assert!(cache.building().is_none(), "slots are popped when builds return");
        let s = cache.stats();
        assert_eq!((s.disk_hits, s.disk_misses, s.disk_rejects), (0, 2, 0));
        // A damaged file for KeyA(1): the build that reads it counts a rejection.
        let path = std::cell::RefCell::new(std::path::PathBuf::new());
        cache
            .get_or_build(&KeyA(1), || {
                *path.borrow_mut() = outer(&cache);
                fail()
            })
            .unwrap_err();
        let path = path.into_inner();
        std::fs::write(&path, b"CDNNPLAN but cut short").unwrap();
        cache
            .get_or_build(&KeyA(1), || {
                assert!(cache.building().unwrap().record().is_none());
                fail()
            })
            .unwrap_err();
        let s = cache.stats();
        assert_eq!((s.disk_hits, s.disk_misses, s.disk_rejects), (0, 3, 1));
        let events = cache.disk_events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!((events[0].kind, &events[0].path), (DiskEventKind::Corrupt, &path));
        cache.clear();
        assert_eq!(cache.stats(), CacheStats::default());
        assert_eq!(cache.disk_events().len(), 1, "clear keeps the events");
        cache.set_store(None);
        assert_eq!(cache.store_dir(), None);
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
