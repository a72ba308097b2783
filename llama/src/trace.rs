//! An [`Observer`] that records every module call three ways: an NVTX range (so Nsight Systems shows
//! the same names), a pair of CUDA events on the stream (GPU time per call), and host timestamps on a
//! caller-chosen clock (CUPTI's, so kernels can be attributed with [`crate::profile::attribute`]).

use crate::modules::Observer;
use crate::profile::RangeRecord;
use cudnn_llm_ops::cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream, DriverError};
use std::sync::Arc;

/// One recorded module call.
pub struct Call {
    /// Host interval on the tracer's clock.
    pub range: RangeRecord,
    start: CudaEvent,
    end: CudaEvent,
}

impl Call {
    /// GPU milliseconds between the call's start and end events (valid once the stream has run past
    /// the end event).
    pub fn gpu_ms(&self) -> Result<f64, DriverError> {
        Ok(self.start.elapsed_ms(&self.end)? as f64)
    }
}

/// Records module calls; see the module docs.
pub struct Tracer {
    stream: Arc<CudaStream>,
    clock: Box<dyn FnMut() -> u64>,
    open: Vec<(&'static str, Option<usize>, u64, CudaEvent)>,
    calls: Vec<Call>,
    error: Option<DriverError>,
}

impl Tracer {
    /// A tracer recording events on `stream`, stamping ranges with `clock` (ns).
    pub fn new(stream: Arc<CudaStream>, clock: Box<dyn FnMut() -> u64>) -> Self {
        Tracer { stream, clock, open: Vec::new(), calls: Vec::new(), error: None }
    }

    /// A host clock: nanoseconds since the tracer was made (use CUPTI's clock when attributing kernels).
    pub fn host_clock() -> Box<dyn FnMut() -> u64> {
        let epoch = std::time::Instant::now();
        Box::new(move || epoch.elapsed().as_nanos() as u64)
    }

    fn event(&mut self) -> Option<CudaEvent> {
        let made = self.stream.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let recorded = made.and_then(|e| e.record(&self.stream).map(|()| e));
        match recorded {
            Ok(e) => Some(e),
            Err(err) => {
                self.error.get_or_insert(err);
                None
            }
        }
    }

    /// The calls recorded so far, or the first CUDA error met while recording.
    pub fn finish(self) -> Result<Vec<Call>, DriverError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.calls),
        }
    }
}

impl Observer for Tracer {
    fn begin(&mut self, range: &'static str, layer: Option<usize>) {
        // NVTX keeps its own per-thread stack: every push here has its pop in `end`. Without an
        // attached tool (Nsight sets NVTX_INJECTION64_PATH) a push is a null check in NVTX's C code.
        nvtx::range_push!("{range}");
        let t = (self.clock)();
        match self.event() {
            Some(e) => self.open.push((range, layer, t, e)),
            None => {
                nvtx::range_pop!();
            }
        }
    }

    fn end(&mut self, range: &'static str, layer: Option<usize>) {
        let end = self.event();
        let t = (self.clock)();
        let Some(pos) = self.open.iter().rposition(|o| o.0 == range && o.1 == layer) else { return };
        let (name, layer, start_ns, start) = self.open.remove(pos);
        nvtx::range_pop!();
        if let Some(end) = end {
            let range = RangeRecord { name: name.to_string(), layer, start_ns, end_ns: t };
            self.calls.push(Call { range, start, end });
        }
    }
}
