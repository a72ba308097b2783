//! Execution plans: what a finalized graph is and what it reports. The rest of a plan's life is in
//! the submodules: [`lifecycle`] (heuristics, finalization for one handle), [`binding`] (bindings,
//! their checks, the variant pack, execution), [`autotune`] (timing candidates, the knob search, the
//! L2 flush), [`engine`] (engine configurations and knobs), [`persist`] (a plan to and from the plan
//! directory: the plan's JSON, else its engine choice) and [`store`] (that directory's files, without
//! a GPU).

use crate::descriptor::Descriptor;
use crate::exec::Exec;
use crate::raw::HandleId;
use crate::tensor::TensorSpec;
use crate::{Error, Result};
use candidate::Candidate;
use engine::knob_ranges;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

mod autotune;
mod binding;
mod candidate;
mod engine;
mod lifecycle;
mod persist;
pub(crate) mod store;

pub use autotune::{L2Flush, Tuning};
pub use binding::{Bindings, Prepared, Scalar};
pub use engine::{knob_name, KnobRange};
pub(crate) use persist::Persist;
pub use store::{DiskEvent, DiskEventKind};

/// What a graph hands over to become a plan.
pub(crate) struct PlanParts {
    pub(crate) name: String,
    pub(crate) form: String,
    pub(crate) graph: Descriptor,
    pub(crate) descriptors: Vec<Descriptor>,
    /// Tensors the caller binds.
    pub(crate) tensors: Vec<TensorSpec>,
    /// By-value tensors the plan binds itself (uid, value).
    pub(crate) constants: Vec<(i64, Scalar)>,
    /// The plan directory's slot for this graph's plan key, when the graph is built for the plan
    /// cache of a context with a plan directory.
    pub(crate) persist: Option<Persist>,
}

/// Where a plan's engine configuration came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanOrigin {
    /// Heuristics (and autotuning, if the plan tunes) in this process.
    Built,
    /// Deserialized from the plan directory: the finalized plan an earlier process built and tuned,
    /// without heuristics or autotuning.
    Deserialized,
    /// Rebuilt from the engine and knobs stored in the plan directory (the engine's plan could not be
    /// serialized, or its JSON did not finalize): finalized here, without heuristics or autotuning.
    StoredChoice,
}

/// A finalized execution plan and what it needs bound at execute time.
///
/// A plan may hold several finalized engine configurations (see [`crate::Graph::build_tuned`]): the
/// first execution then times each on the caller's buffers, may build more by changing one knob at a
/// time around the fastest ([`crate::Tuning::knob_search`]), and keeps the fastest (the frontend's
/// autotuning); until then, and with one candidate and no knob search, the heuristics' first choice
/// runs.
pub struct Plan {
    // Field order is drop order: the plans go before the graph descriptors they were built from.
    candidates: RefCell<Vec<Rc<Candidate>>>,
    chosen: Cell<usize>,
    tuned: Cell<bool>,
    knob_search: usize,
    flush: L2Flush,
    timings: RefCell<Vec<(String, f64)>>,
    _graph: Descriptor,
    _parts: Vec<Descriptor>,
    tensors: Vec<TensorSpec>,
    constants: Vec<(i64, Box<[u8; 4]>)>,
    name: String,
    form: String,
    build_time: Duration,
    tune_time: Cell<Duration>,
    /// The handle the plan was finalized for: executions on another are refused ([`Plan::check_context`]).
    handle: HandleId,
    origin: PlanOrigin,
    /// Where the plan is saved once final (built, and tuned if it tunes); taken when saved.
    persist: RefCell<Option<Persist>>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("name", &self.name)
            .field("form", &self.form)
            .field("engine", &self.engine())
            .field("candidates", &self.candidates.borrow().len())
            .field("workspace", &self.workspace_size())
            .field("build_time", &self.build_time)
            .field("origin", &self.origin)
            .finish()
    }
}

impl Plan {
    fn chosen(&self) -> Rc<Candidate> {
        self.candidates.borrow()[self.chosen.get()].clone()
    }

    /// Engines that finalized, in heuristics order (the first is the heuristics' choice), then those
    /// the knob search built.
    pub fn candidates(&self) -> Vec<String> {
        self.candidates.borrow().iter().map(|c| c.choice.tag()).collect()
    }

    /// The knobs the running engine exposes (what a knob search varies).
    pub fn knob_ranges(&self) -> Result<Vec<KnobRange>> {
        let index = self.chosen().choice.index;
        if index < 0 {
            return Err(Error::invalid(format!(
                "plan `{}`: the running engine could not be read",
                self.name
            )));
        }
        knob_ranges(&self._graph, index)
    }

    /// Median milliseconds per candidate from autotuning, in the order timed (empty until the first
    /// execution of a plan that autotunes: several candidates or a knob search).
    pub fn timings(&self) -> Vec<(String, f64)> {
        self.timings.borrow().clone()
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The graph's form label (e.g. `composite` or `unified` for attention); empty when unlabeled.
    pub fn form(&self) -> &str {
        &self.form
    }

    /// The engine that runs, as the frontend tags it: `eng<global index>` then `_k<knob type>=<value>`
    /// per knob ([`crate::knob_name`] names the types).
    pub fn engine(&self) -> String {
        self.chosen().choice.tag()
    }

    /// Workspace bytes the running engine needs per execution.
    pub fn workspace_size(&self) -> usize {
        self.chosen().workspace
    }

    /// Wall time from validation to the finalized plan (the cold cost a cache hit avoids; for a plan
    /// from the plan directory, the cost of loading it).
    pub fn build_time(&self) -> Duration {
        self.build_time
    }

    /// Whether the plan was built here or came from the plan directory
    /// ([`Cudnn::set_plan_dir`](crate::Cudnn::set_plan_dir)).
    pub fn origin(&self) -> PlanOrigin {
        self.origin
    }

    /// Wall time the first execution spent autotuning (timing candidates, building and timing those
    /// of the knob search); zero until then and for untuned plans.
    pub fn tune_time(&self) -> Duration {
        self.tune_time.get()
    }

    /// The tensors that must be bound at execute time.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The uid of the bound tensor called `name`.
    pub fn uid(&self, name: &str) -> Result<i64> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.uid)
            .ok_or_else(|| Error::invalid(format!("plan `{}` has no tensor `{name}`", self.name)))
    }

    /// Checks the bindings and enqueues the plan on the context's stream (`ctx`: a
    /// [`Cudnn`](crate::Cudnn) derefs to its [`Exec`], so `&ctx` will do). The first execution of a
    /// plan with several candidates times them first (synchronizing the stream), so run it once before
    /// capturing a CUDA graph.
    pub fn execute(&self, ctx: &Exec, b: &Bindings<'_>) -> Result<()> {
        self.check_context(ctx, b)?;
        if !self.tuned.get() {
            self.autotune(ctx, b)?;
        }
        self.prepare(ctx, b)?.execute()
    }
}
