//! Kernel collection for the report: CUPTI when it loads and works, else nothing (event times only).

use cudnn_llm_llama::profile::KernelRecord;
use cudnn_llm_llama::trace::Tracer;

/// Kernel collection: CUPTI when it loads and works, else nothing (event times only). A CUPTI error
/// during the run turns collection off with a warning instead of ending the run.
pub(crate) struct Kernels(std::cell::RefCell<Option<cudnn_llm_cupti::Cupti>>);

impl Kernels {
    /// Loads CUPTI and proves it can collect (a start/stop pair), or says why not.
    pub(crate) fn probe() -> Self {
        let tried = cudnn_llm_cupti::Cupti::load().map_err(|e| e.to_string()).and_then(|c| {
            c.start().map_err(|e| e.to_string())?;
            c.stop_and_collect().map_err(|e| e.to_string())?;
            Ok(c)
        });
        match tried {
            Ok(c) => Kernels(std::cell::RefCell::new(Some(c))),
            Err(e) => {
                eprintln!(
                    "speedup-report: CUPTI unavailable ({e}); reporting CUDA-event times, no kernel counts"
                );
                Kernels(std::cell::RefCell::new(None))
            }
        }
    }

    pub(crate) fn active(&self) -> bool {
        self.0.borrow().is_some()
    }

    pub(crate) fn disable(&self, why: impl std::fmt::Display) {
        eprintln!("speedup-report: CUPTI failed ({why}); kernel counts are off from here on");
        *self.0.borrow_mut() = None;
    }

    pub(crate) fn clock(&self) -> Box<dyn FnMut() -> u64> {
        clock(self.handle())
    }

    /// The CUPTI handle while collection works, for [`clock`] on other threads (`--tp`'s ranks).
    pub(crate) fn handle(&self) -> Option<cudnn_llm_cupti::Cupti> {
        self.0.borrow().clone()
    }

    pub(crate) fn start(&self) {
        let failed = self.0.borrow().as_ref().and_then(|c| c.start().err());
        if let Some(e) = failed {
            self.disable(e);
        }
    }

    pub(crate) fn stop(&self) -> Vec<KernelRecord> {
        let got = self.0.borrow().as_ref().map(|c| c.stop_and_collect());
        match got {
            None => Vec::new(),
            Some(Err(e)) => {
                self.disable(e);
                Vec::new()
            }
            Some(Ok(got)) => {
                if got.dropped > 0 || got.unmatched > 0 {
                    eprintln!(
                        "speedup-report: CUPTI dropped {} records; {} kernels had no launch record",
                        got.dropped, got.unmatched
                    );
                }
                got.kernels
            }
        }
    }
}

/// CUPTI's clock, the clock of the kernel records (its process-wide timestamp, the same on every
/// thread), or without CUPTI a host clock.
pub(crate) fn clock(cupti: Option<cudnn_llm_cupti::Cupti>) -> Box<dyn FnMut() -> u64> {
    match cupti {
        Some(c) => Box::new(move || cudnn_llm_cupti::timestamp(&c).unwrap_or(0)),
        None => Tracer::host_clock(),
    }
}
