//! Fault injection, for tests of what a failure in the middle of a run leaves behind: the Nth call
//! of a site from now fails with [`Error::Injected`] instead of doing its work.
//!
//! | site | where |
//! |---|---|
//! | [`Site::Alloc`] | every device allocation of the library ([`Zeros::zeros`]) |
//! | [`Site::PlanBuild`] | a graph's cuDNN plan made on a cache miss (built, or loaded from disk), as a whole |
//! | [`Site::Compile`] | an NVRTC compile of a kernel room |
//! | [`Site::Collective`] | an NCCL collective enqueued (`cudnn-llm-nccl`) |
//! | [`Site::Replay`] | a captured decode step launched (`cudnn-llm-llama`) |
//!
//! The failure is [`Error::Injected`] at the allocation, plan and replay sites; an NVRTC compile's
//! comes back as [`Error::Nvrtc`] and a collective's as `NcclError::Injected`, their text naming the
//! injection ([`Error::is_injected`] tells all three apart from real failures).
//!
//! Off unless asked: [`fail_nth`] from a test, or `CUDNN_LLM_FAULTS=alloc:3,plan:1` (sites `alloc`,
//! `plan`, `compile`, `collective`, `replay`, each with the call that fails, counted from the first
//! context made), read by [`crate::Cudnn::new`], which refuses a value it cannot read. When nothing is
//! armed a site costs one atomic load. The counts are the process's (the ranks' threads of a
//! tensor-parallel model share them), so tests that arm faults run one at a time.

use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A place where a failure can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Site {
    /// A device allocation.
    Alloc,
    /// A cuDNN plan finalized.
    PlanBuild,
    /// An NVRTC compile.
    Compile,
    /// An NCCL collective.
    Collective,
    /// A captured decode step's launch.
    Replay,
}

impl Site {
    /// Every site, in [`Site::name`] order.
    pub const ALL: [Site; 5] = [Site::Alloc, Site::PlanBuild, Site::Compile, Site::Collective, Site::Replay];

    /// Its name in `CUDNN_LLM_FAULTS`.
    pub fn name(self) -> &'static str {
        match self {
            Site::Alloc => "alloc",
            Site::PlanBuild => "plan",
            Site::Compile => "compile",
            Site::Collective => "collective",
            Site::Replay => "replay",
        }
    }
}

/// Environment variable that arms faults for a whole process (see the [module docs](self)).
pub const FAULTS_ENV: &str = "CUDNN_LLM_FAULTS";

/// Countdowns per site: 0 off, n the calls until the one that fails (1: the next).
struct Injector {
    armed: AtomicBool,
    countdown: [AtomicU64; 5],
    injected: [AtomicU64; 5],
}

impl Injector {
    const fn new() -> Self {
        Injector {
            armed: AtomicBool::new(false),
            countdown: [const { AtomicU64::new(0) }; 5],
            injected: [const { AtomicU64::new(0) }; 5],
        }
    }

    fn fail_nth(&self, site: Site, nth: u64) {
        self.countdown[site as usize].store(nth, Ordering::SeqCst);
        self.armed.store(self.countdown.iter().any(|c| c.load(Ordering::SeqCst) > 0), Ordering::SeqCst);
    }

    fn disarm(&self) {
        for c in &self.countdown {
            c.store(0, Ordering::SeqCst);
        }
        self.armed.store(false, Ordering::SeqCst);
    }

    fn hit(&self, site: Site) -> Result<()> {
        if !self.armed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let c = &self.countdown[site as usize];
        let before = c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).unwrap_or(0);
        if before != 1 {
            return Ok(());
        }
        let count = self.injected[site as usize].fetch_add(1, Ordering::SeqCst) + 1;
        Err(Error::Injected { site: site.name(), count })
    }
}

static GLOBAL: Injector = Injector::new();

/// Makes the `nth` call of `site` from now fail (once; 1: the next call; 0: none), replacing what was
/// armed there.
pub fn fail_nth(site: Site, nth: u64) {
    GLOBAL.fail_nth(site, nth);
}

/// Disarms every site.
pub fn disarm() {
    GLOBAL.disarm();
}

/// Failures injected at `site` so far in this process.
pub fn injected(site: Site) -> u64 {
    GLOBAL.injected[site as usize].load(Ordering::SeqCst)
}

/// The check at a site: `Err(Error::Injected)` when this is the call armed to fail.
pub fn hit(site: Site) -> Result<()> {
    GLOBAL.hit(site)
}

/// Arms what `CUDNN_LLM_FAULTS` asks, once per process (later calls do nothing); an error names a
/// value it cannot read (and arms nothing).
pub(crate) fn from_env() -> Result<()> {
    static READ: once_cell::sync::OnceCell<std::result::Result<(), String>> =
        once_cell::sync::OnceCell::new();
    let read = READ.get_or_init(|| {
        let Some(value) = std::env::var_os(FAULTS_ENV) else { return Ok(()) };
        let value = value.to_str().ok_or_else(|| format!("{FAULTS_ENV}: not UTF-8"))?;
        for (site, nth) in parse(value)? {
            fail_nth(site, nth);
        }
        Ok(())
    });
    read.clone().map_err(Error::InvalidArgument)
}

/// `site:n,site:n` as pairs; an error names the part it cannot read.
fn parse(value: &str) -> std::result::Result<Vec<(Site, u64)>, String> {
    let names: Vec<&str> = Site::ALL.iter().map(|s| s.name()).collect();
    value
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|part| {
            let (name, n) = part.trim().split_once(':').ok_or_else(|| {
                format!("{FAULTS_ENV}: `{part}` is not site:call (sites: {})", names.join(", "))
            })?;
            let site = Site::ALL.into_iter().find(|s| s.name() == name.trim()).ok_or_else(|| {
                format!("{FAULTS_ENV}: unknown site `{name}` (sites: {})", names.join(", "))
            })?;
            match n.trim().parse::<u64>() {
                Ok(n) if n > 0 => Ok((site, n)),
                _ => Err(format!("{FAULTS_ENV}: `{part}`: the call that fails is a number from 1")),
            }
        })
        .collect()
}

/// The one way the library takes device memory: zero-filled, on a stream, counted by the injector
/// ([`Site::Alloc`]).
pub trait Zeros {
    /// `len` zeroed elements of `T` on this stream.
    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>>;
}

impl Zeros for std::sync::Arc<CudaStream> {
    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        hit(Site::Alloc)?;
        Ok(self.alloc_zeros::<T>(len)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nth_call_of_an_armed_site_fails_once_and_others_pass() {
        let f = Injector::new();
        assert!(Site::ALL.iter().all(|&s| f.hit(s).is_ok()), "nothing armed");
        f.fail_nth(Site::PlanBuild, 3);
        assert!(
            f.hit(Site::PlanBuild).is_ok() && f.hit(Site::Alloc).is_ok() && f.hit(Site::PlanBuild).is_ok()
        );
        match f.hit(Site::PlanBuild) {
            Err(Error::Injected { site: "plan", count: 1 }) => {}
            other => panic!("{other:?}"),
        }
        assert!((0..10).all(|_| f.hit(Site::PlanBuild).is_ok()), "once");
        f.fail_nth(Site::Alloc, 1);
        f.fail_nth(Site::Replay, 2);
        f.disarm();
        assert!((0..3).all(|_| Site::ALL.iter().all(|&s| f.hit(s).is_ok())), "disarmed");
        f.fail_nth(Site::Alloc, 1);
        f.fail_nth(Site::Alloc, 0);
        assert!(f.hit(Site::Alloc).is_ok(), "0 replaces 1: none");
        let e = {
            f.fail_nth(Site::Collective, 1);
            f.hit(Site::Collective).unwrap_err().to_string()
        };
        assert_eq!(
            e,
            "injected failure: the 1st injected `collective` failure (CUDNN_LLM_FAULTS or faults::fail_nth)"
        );
    }

    #[test]
    fn the_environment_names_sites_and_calls_or_is_refused() {
        assert_eq!(parse("alloc:3, plan:1,").unwrap(), [(Site::Alloc, 3), (Site::PlanBuild, 1)]);
        assert_eq!(parse("").unwrap(), []);
        for (bad, says) in [
            ("alloc", "is not site:call"),
            ("gpu:1", "unknown site `gpu`"),
            ("alloc:0", "a number from 1"),
            ("alloc:-1", "a number from 1"),
            ("alloc:18446744073709551616", "a number from 1"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(says) && e.contains(FAULTS_ENV), "{bad}: {e}");
        }
    }
}
