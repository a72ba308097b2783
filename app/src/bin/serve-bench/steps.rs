//! Per-step timing of the serving loop: each engine call (a decode step or a prefill forward) with
//! its GPU time (CUDA events on the context's stream around the call, read after the run), its wall
//! time (the call, launch to ids back on the host) and the host time after it (the loop's bookkeeping
//! and admission until the next call, idle waits for arrivals left out); the summary's step rows and
//! `serve-steps.csv` are made of them.

use crate::workload::percentile;
use cudnn_llm_llama::StepTimes;
use cudnn_llm_ops::cudarc::driver::sys::CUevent_flags;
use cudnn_llm_ops::cudarc::driver::CudaEvent;
use cudnn_llm_ops::Cudnn;
use serde::Serialize;
use std::time::Instant;

/// What an engine call ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    Decode,
    Prefill,
}

/// One engine call of the timed run (a row of `serve-steps.csv`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRow {
    pub kind: StepKind,
    /// Sequences of a decode step; prompts of a prefill forward.
    pub rows: usize,
    /// The launch's rows: a decode step's bucket; a prefill's prompt tokens.
    pub bucket: usize,
    /// GPU time between events around the call (empty with `--no-step-timing`). It spans the stream
    /// from the call's first work to its last: gaps where the GPU waited for the host count.
    pub gpu_ms: Option<f64>,
    /// Wall time of the call: launch to ids back on the host (the engine's own host work inside).
    pub wall_ms: f64,
    /// Host time after the call until the next one (bookkeeping, admission; idle waits left out).
    pub host_ms: f64,
    /// A decode step's wall time split as the engine took it ([`cudnn_llm_llama::StepTimes`]): before
    /// the launch (page table, positions, lengths built and uploaded), launch to ids back, and the
    /// host sampling after; empty for a prefill.
    pub prepare_ms: Option<f64>,
    pub run_ms: Option<f64>,
    pub sample_ms: Option<f64>,
    /// Whether the call captured a decode graph (a first capture, or again of a stale one).
    pub captured: bool,
}

/// What the engine says of a call besides its times: its split of a decode step's wall time
/// (`None` for a prefill) and whether it captured a graph.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallDetail {
    pub split: Option<StepTimes>,
    pub captured: bool,
}

/// The steps of a run as they happen; [`StepLog::finish`] reads the events once the run is over.
pub struct StepLog<'a> {
    ctx: &'a Cudnn,
    events: bool,
    rows: Vec<StepRow>,
    pending: Vec<Option<(CudaEvent, CudaEvent)>>,
    /// The open call: its start instant and start event.
    open: Option<(Instant, Option<CudaEvent>)>,
    /// End of the last call, and idle time (waits for arrivals) since.
    last_end: Option<Instant>,
    idle: f64,
}

type Result<T> = std::result::Result<T, cudnn_llm_ops::Error>;

impl<'a> StepLog<'a> {
    /// A log of steps on `ctx`'s stream; `events`: time each call on the GPU too.
    pub fn new(ctx: &'a Cudnn, events: bool) -> Self {
        StepLog { ctx, events, rows: Vec::new(), pending: Vec::new(), open: None, last_end: None, idle: 0.0 }
    }

    fn event(&self) -> Result<Option<CudaEvent>> {
        if !self.events {
            return Ok(None);
        }
        let e = self.ctx.stream().context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        e.record(self.ctx.stream())?;
        Ok(Some(e))
    }

    /// Time waited for arrivals since the last call (not host work).
    pub fn idle(&mut self, seconds: f64) {
        self.idle += seconds;
    }

    /// A call begins: closes the host time of the one before and records the start event.
    pub fn begin(&mut self) -> Result<()> {
        let now = Instant::now();
        if let (Some(end), Some(last)) = (self.last_end, self.rows.last_mut()) {
            last.host_ms = ((now - end).as_secs_f64() - self.idle).max(0.0) * 1e3;
        }
        self.idle = 0.0;
        let start = self.event()?;
        self.open = Some((Instant::now(), start));
        Ok(())
    }

    /// The call begun ends (`rows` and `bucket` as [`StepRow`] has them): records the end event.
    pub fn end(&mut self, kind: StepKind, rows: usize, bucket: usize, detail: CallDetail) -> Result<()> {
        let (at, start) = self.open.take().expect("begin before end");
        let end = self.event()?;
        let now = Instant::now();
        self.last_end = Some(now);
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        self.rows.push(StepRow {
            kind,
            rows,
            bucket,
            gpu_ms: None,
            wall_ms: ms(now - at),
            host_ms: 0.0,
            prepare_ms: detail.split.map(|t| ms(t.prepare)),
            run_ms: detail.split.map(|t| ms(t.run)),
            sample_ms: detail.split.map(|t| ms(t.sample)),
            captured: detail.captured,
        });
        self.pending.push(start.zip(end));
        Ok(())
    }

    /// The steps, with the GPU time of each read from its events (the run is over: no wait).
    pub fn finish(mut self) -> Result<Vec<StepRow>> {
        for (row, events) in self.rows.iter_mut().zip(&self.pending) {
            if let Some((start, end)) = events {
                row.gpu_ms = Some(start.elapsed_ms(end)? as f64);
            }
        }
        Ok(std::mem::take(&mut self.rows))
    }
}

/// A distribution's mean, p50, p90 and p99 (`None` where empty).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dist {
    pub mean: Option<f64>,
    pub p: [Option<f64>; 3],
}

impl Dist {
    pub fn of(v: &[f64]) -> Self {
        let mean = (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        Dist { mean, p: [0.5, 0.9, 0.99].map(|q| percentile(v, q)) }
    }
}

/// What the summary says of the steps.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSummary {
    pub decode_gpu: Dist,
    pub decode_wall: Dist,
    pub decode_host: Dist,
    pub decode_prepare: Dist,
    pub decode_run: Dist,
    pub decode_sample: Dist,
    pub prefill_gpu: Dist,
    pub prefill_wall: Dist,
    /// Prefill forwards between consecutive decode steps, on average (`None` for under two steps).
    pub prefills_between: Option<f64>,
}

impl StepSummary {
    pub fn of(steps: &[StepRow]) -> Self {
        let of = |kind: StepKind, f: fn(&StepRow) -> Option<f64>| -> Dist {
            let v: Vec<f64> = steps.iter().filter(|s| s.kind == kind).filter_map(f).collect();
            Dist::of(&v)
        };
        let decodes: Vec<usize> =
            steps.iter().enumerate().filter(|(_, s)| s.kind == StepKind::Decode).map(|(i, _)| i).collect();
        // Every call between two decode steps is a prefill.
        let gaps: Vec<usize> = decodes.windows(2).map(|w| w[1] - w[0] - 1).collect();
        let prefills_between =
            (!gaps.is_empty()).then(|| gaps.iter().sum::<usize>() as f64 / gaps.len() as f64);
        StepSummary {
            decode_gpu: of(StepKind::Decode, |s| s.gpu_ms),
            decode_wall: of(StepKind::Decode, |s| Some(s.wall_ms)),
            decode_host: of(StepKind::Decode, |s| Some(s.host_ms)),
            decode_prepare: of(StepKind::Decode, |s| s.prepare_ms),
            decode_run: of(StepKind::Decode, |s| s.run_ms),
            decode_sample: of(StepKind::Decode, |s| s.sample_ms),
            prefill_gpu: of(StepKind::Prefill, |s| s.gpu_ms),
            prefill_wall: of(StepKind::Prefill, |s| Some(s.wall_ms)),
            prefills_between,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(kind: StepKind, gpu: Option<f64>, wall: f64, host: f64) -> StepRow {
        let run = (kind == StepKind::Decode).then_some(wall - 1.0);
        StepRow {
            kind,
            rows: 1,
            bucket: 1,
            gpu_ms: gpu,
            wall_ms: wall,
            host_ms: host,
            prepare_ms: run.map(|_| 0.5),
            run_ms: run,
            sample_ms: run.map(|_| 0.5),
            captured: false,
        }
    }

    #[test]
    fn summaries_split_decode_and_prefill_and_count_prefills_between_steps() {
        use StepKind::{Decode as D, Prefill as P};
        // P D D P P D (P): gaps between decode steps 0 and 2 prefills, mean 1.
        let steps = vec![
            row(P, Some(30.0), 31.0, 0.1),
            row(D, Some(8.0), 9.0, 0.5),
            row(D, Some(10.0), 12.0, 1.5),
            row(P, Some(50.0), 52.0, 0.2),
            row(P, Some(40.0), 41.0, 0.2),
            row(D, Some(12.0), 15.0, 2.5),
            row(P, Some(20.0), 21.0, 0.0),
        ];
        let s = StepSummary::of(&steps);
        assert_eq!(s.decode_gpu.p, [Some(10.0), Some(12.0), Some(12.0)]);
        assert_eq!(s.decode_gpu.mean, Some(10.0));
        assert_eq!(s.decode_wall.p, [Some(12.0), Some(15.0), Some(15.0)]);
        assert_eq!(s.decode_host.p[0], Some(1.5));
        assert_eq!(
            (s.decode_run.p[0], s.decode_prepare.mean, s.decode_sample.p[2]),
            (Some(11.0), Some(0.5), Some(0.5))
        );
        assert_eq!(s.prefill_gpu.p, [Some(30.0), Some(50.0), Some(50.0)]);
        assert_eq!(s.prefill_gpu.mean, Some(35.0));
        assert_eq!(s.prefill_wall.p[0], Some(31.0));
        assert_eq!(s.prefills_between, Some(1.0));
    }

    #[test]
    fn missing_events_and_few_steps_give_no_values() {
        let s = StepSummary::of(&[row(StepKind::Decode, None, 9.0, 0.0)]);
        assert_eq!(s.decode_gpu, Dist { mean: None, p: [None; 3] });
        assert_eq!(s.decode_wall.p[0], Some(9.0));
        assert_eq!((s.prefill_wall.mean, s.prefills_between), (None, None));
        let d = Dist::of(&(1..=100).map(f64::from).collect::<Vec<_>>());
        assert_eq!((d.mean, d.p), (Some(50.5), [Some(50.0), Some(90.0), Some(99.0)]));
    }
}
