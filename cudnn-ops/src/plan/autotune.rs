//! Autotuning: a plan with several candidates, or a knob-search budget, times them on the first
//! execution's buffers (each timed run after an L2 flush), may build more configurations one knob
//! away from the fastest, and keeps the fastest (and saves it to the plan directory, if the plan
//! has one). cuDNN plans are the only thing this crate tunes: cuBLAS serves only the L2 flush and
//! the naive baselines, with cuBLAS's own heuristic choice.

use super::candidate::Candidate;
use super::engine::{knob_ranges, EngineChoice, KnobRange};
use super::{Bindings, Plan};
use crate::exec::Exec;
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

/// Timed executions per autotuning candidate (the median is kept).
const TUNE_SAMPLES: usize = 9;

impl Plan {
    /// Median ms of candidate `i`: one warm-up, then [`TUNE_SAMPLES`] single executions, each after an
    /// L2 flush (the plan's [`L2Flush`]). The flush evicts the plan's inputs, as a forward evicts
    /// a layer's weights before the next layer reads its own, and keeps the GPU busy while the timed
    /// launch is enqueued, so that a kernel shorter than its launch is timed as the kernel, not as the
    /// host.
    fn time_candidate(
        &self,
        ctx: &Exec,
        b: &Bindings<'_>,
        i: usize,
        (start, end): (&CudaEvent, &CudaEvent),
        flush: &mut Flusher,
    ) -> Result<f64> {
        let prepared = self.prepare_candidate(ctx, b, i)?;
        prepared.execute()?;
        let mut samples = Vec::with_capacity(TUNE_SAMPLES);
        for _ in 0..TUNE_SAMPLES {
            if flush.run(ctx).is_err() {
                // The flush only serves the timing: without it the timing goes on, hot.
                *flush = Flusher::Off;
            }
            start.record(ctx.stream())?;
            prepared.execute()?;
            end.record(ctx.stream())?;
            samples.push(start.elapsed_ms(end)? as f64);
        }
        samples.sort_by(f64::total_cmp);
        Ok(samples[TUNE_SAMPLES / 2])
    }

    /// Times every candidate on these bindings (see `time_candidate`), runs the knob search if the
    /// plan has a budget for one (`knob_search`), and keeps the fastest. Outputs are overwritten;
    /// inputs are only read.
    pub fn autotune(&self, ctx: &Exec, b: &Bindings<'_>) -> Result<()> {
        self.check_context(ctx, b)?;
        let started = Instant::now();
        let cuda = ctx.stream().context();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (cuda.new_event(flags)?, cuda.new_event(flags)?);
        let mut flush = Flusher::new(ctx, self.flush);
        let mut timings = Vec::new();
        let mut last_error = None;
        let mut injected = None;
        let mut time = |i: usize, timings: &mut Vec<(String, f64)>| {
            let engine = self.candidates.borrow()[i].choice.tag();
            // A configuration can finalize and still fail to run: it is timed as never finishing. An
            // injected failure (a test's, `crate::faults`) is the call's, not the configuration's.
            match self.time_candidate(ctx, b, i, (&start, &end), &mut flush) {
                Ok(ms) => timings.push((engine, ms)),
                Err(e @ crate::Error::Injected { .. }) => {
                    timings.push((engine, f64::INFINITY));
                    injected.get_or_insert(e);
                }
                Err(e) => {
                    timings.push((engine, f64::INFINITY));
                    last_error = Some(e);
                }
            }
        };
        let heuristics = self.candidates.borrow().len();
        for i in 0..heuristics {
            time(i, &mut timings);
        }
        let fastest =
            |t: &[(String, f64)]| (0..t.len()).min_by(|&x, &y| t[x].1.total_cmp(&t[y].1)).unwrap_or(0);
        // Knob search: every configuration one knob away from the fastest so far, again around a new
        // fastest, until none is faster or the budget is spent. Finalize failures (combinations an
        // engine rejects) cost an attempt, not the budget; attempts are capped at four times it. A
        // configuration needing more workspace than every heuristics' one is not kept (the context's
        // workspace only grows).
        let (mut built, mut attempts) = (0, 0);
        let max_attempts = self.knob_search.saturating_mul(4);
        let max_workspace = self.candidates.borrow().iter().map(|c| c.workspace).max().unwrap_or(0);
        let mut tried: Vec<EngineChoice> =
            self.candidates.borrow().iter().map(|c| c.choice.clone()).collect();
        let mut ranges: HashMap<i64, Vec<KnobRange>> = HashMap::new();
        let mut searched: Vec<usize> = Vec::new();
        while built < self.knob_search && attempts < max_attempts {
            let best = fastest(&timings);
            let base = self.candidates.borrow()[best].choice.clone();
            if searched.contains(&best) || base.index < 0 || timings[best].1.is_infinite() {
                break;
            }
            searched.push(best);
            let knobs = ranges
                .entry(base.index)
                .or_insert_with(|| knob_ranges(&self._graph, base.index).unwrap_or_default());
            for next in base.neighbours(knobs) {
                if built >= self.knob_search || attempts >= max_attempts {
                    break;
                }
                if tried.iter().any(|t| t.same(&next)) {
                    continue;
                }
                tried.push(next.clone());
                attempts += 1;
                let Ok((config, parts)) = next.build(&self._graph) else { continue };
                let Ok(candidate) = Candidate::new(ctx, config, next, parts) else { continue };
                if candidate.workspace > max_workspace {
                    continue;
                }
                built += 1;
                let index = {
                    let mut candidates = self.candidates.borrow_mut();
                    candidates.push(Rc::new(candidate));
                    candidates.len() - 1
                };
                time(index, &mut timings);
            }
        }
        if let Some(e) = injected {
            // Nothing is chosen: the next call tunes again.
            return Err(e);
        }
        if timings.iter().all(|(_, ms)| ms.is_infinite()) {
            return Err(last_error.unwrap_or_else(|| Error::invalid("autotune: no candidate ran")));
        }
        self.chosen.set(fastest(&timings));
        self.tuned.set(true);
        self.tune_time.set(started.elapsed());
        *self.timings.borrow_mut() = timings;
        // The plan is final now: the plan directory, if any, keeps the fastest for later processes.
        self.save();
        Ok(())
    }
}

/// How autotuning empties L2 before each timed execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum L2Flush {
    /// Read twice the L2 size (a cuBLAS GEMV over a scratch matrix): L2 ends up holding clean lines,
    /// as after the kernels that run before a layer in a forward. The default.
    Read,
    /// Write twice the L2 size (a memset): L2 ends up full of dirty lines whose write-back the timed
    /// execution pays for.
    Write,
    /// No flush: what the warm-up left in L2 stays (hot timing, as in a microbenchmark's loop).
    Off,
}

impl L2Flush {
    /// `read`, `write` or `off`.
    pub fn name(self) -> &'static str {
        match self {
            L2Flush::Read => "read",
            L2Flush::Write => "write",
            L2Flush::Off => "off",
        }
    }

    /// The flush [`L2Flush::name`] names.
    pub fn parse(s: &str) -> Option<Self> {
        [L2Flush::Read, L2Flush::Write, L2Flush::Off].into_iter().find(|f| f.name() == s.trim())
    }
}

/// How a plan that autotunes picks its engine configuration (what
/// [`Cudnn::tuning`](crate::Cudnn::tuning) hands to [`Graph::build_tuned`](crate::Graph::build_tuned)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tuning {
    /// Heuristics' configurations to finalize and time on the first execution (1 without a knob
    /// search: take the first, untimed).
    pub candidates: usize,
    /// Further configurations the first execution may build and time: knob by knob around the
    /// fastest one so far, while that improves (0: none).
    pub knob_search: usize,
    /// How L2 is emptied before each timed execution.
    pub flush: L2Flush,
    /// Matmuls of fewer rows than this (per batch) take the heuristics' first choice, untimed
    /// ([`Tuning::for_rows`]); 0 tunes every size.
    pub min_rows: usize,
}

impl Tuning {
    /// The heuristics' first choice, untimed.
    pub const FIRST: Tuning = Tuning { candidates: 1, knob_search: 0, flush: L2Flush::Read, min_rows: 0 };

    /// What a matmul of `rows` rows per batch is built with: this tuning, or the heuristics' first
    /// choice below [`Tuning::min_rows`]. On Hopper a GEMM of under about 128 rows is bound by reading
    /// its weights (bf16 arithmetic intensity is about the row count, the H200's ridge near 200
    /// FLOP/byte), so engines differ little there, while finalizing and timing each candidate costs
    /// tens to hundreds of milliseconds: the first token of a short prompt in a new process waited
    /// on it.
    pub const fn for_rows(self, rows: usize) -> Self {
        if rows < self.min_rows {
            Tuning { candidates: 1, knob_search: 0, ..self }
        } else {
            self
        }
    }

    /// The same timing the heuristics' first `candidates` configurations.
    pub const fn with_candidates(self, candidates: usize) -> Self {
        Tuning { candidates, ..self }
    }

    /// The same with up to `knob_search` further configurations tried knob by knob.
    pub const fn with_knob_search(self, knob_search: usize) -> Self {
        Tuning { knob_search, ..self }
    }

    /// The same emptying L2 by `flush` before each timed execution.
    pub const fn with_flush(self, flush: L2Flush) -> Self {
        Tuning { flush, ..self }
    }

    /// The same tuning matmuls of at least `min_rows` rows only.
    pub const fn with_min_rows(self, min_rows: usize) -> Self {
        Tuning { min_rows, ..self }
    }
}

/// Columns of the GEMV's scratch matrix (its rows follow from the L2 size).
const FLUSH_COLS: usize = 4096;

/// The buffers of one flush mode, allocated once per autotuning.
pub(crate) enum Flusher {
    Read { a: CudaSlice<f32>, x: CudaSlice<f32>, y: CudaSlice<f32>, rows: usize },
    Write(CudaSlice<u8>),
    Off,
}

impl Flusher {
    /// Buffers of twice the L2 size for `mode`. Falls back to writing when cuBLAS is missing, and to
    /// no flush when the device has no L2 size or too little free memory.
    pub(crate) fn new(ctx: &Exec, mode: L2Flush) -> Self {
        let cuda = ctx.stream().context();
        let l2 = cuda
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_or(0, |b| b.max(0) as usize);
        if mode == L2Flush::Off || l2 == 0 || !ctx.memory_info().is_ok_and(|(free, _)| free > 4 * l2) {
            return Flusher::Off;
        }
        let rows = (2 * l2).div_ceil(4 * FLUSH_COLS);
        let stream = ctx.stream();
        if mode == L2Flush::Read && ctx.blas().is_ok() {
            // Plain allocations, not fault-injection sites: a flush buffer that cannot be made only
            // turns the flush off.
            if let (Ok(a), Ok(x), Ok(y)) = (
                stream.alloc_zeros(rows * FLUSH_COLS),
                stream.alloc_zeros(FLUSH_COLS),
                stream.alloc_zeros(rows),
            ) {
                return Flusher::Read { a, x, y, rows };
            }
        }
        stream.alloc_zeros::<u8>(2 * l2).map_or(Flusher::Off, Flusher::Write)
    }

    /// Enqueues the flush on the context's stream (autotuning carries on without one if this fails).
    pub(crate) fn run(&mut self, ctx: &Exec) -> Result<()> {
        match self {
            Flusher::Read { a, x, y, rows } => {
                crate::raw::cublas::sgemv(ctx.blas()?, (*rows, FLUSH_COLS), a, x, y)
            }
            Flusher::Write(buf) => Ok(ctx.stream().memset_zeros(buf)?),
            Flusher::Off => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_names_round_trip() {
        for f in [L2Flush::Read, L2Flush::Write, L2Flush::Off] {
            assert_eq!(L2Flush::parse(f.name()), Some(f));
        }
        assert_eq!(L2Flush::parse(" write "), Some(L2Flush::Write));
        assert_eq!(L2Flush::parse("cold"), None);
    }
}
