//! A plan's life before its first execution: heuristics, engine configurations, finalization for one
//! context's handle, which the plan records and checks on every execution.

use super::candidate::Candidate;
use super::engine::EngineChoice;
use super::persist::Loaded;
use super::Tuning;
use super::{Plan, PlanOrigin, PlanParts};
use crate::descriptor::{Attr, Descriptor};
use crate::exec::Exec;
use crate::raw::HandleId;
use crate::{Error, Result};
use cudnn_llm_sys as sys;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

impl Plan {
    /// Finalizes engine configurations in heuristics order (mode A, then B when several candidates
    /// are wanted, then FALLBACK) until `tuning.candidates` succeed, for `ctx`'s handle, which the
    /// plan records. [`Error::NotSupported`] if none does. With a plan directory slot in `parts`,
    /// the stored plan of this very graph is loaded instead when there is a usable one, and a plan
    /// built here is saved once final (now, or after the autotuning of its first execution).
    pub(crate) fn from_graph(ctx: &Exec, parts: PlanParts, started: Instant, tuning: Tuning) -> Result<Plan> {
        // A graph's plan as a whole (not one engine configuration, whose failure is routine: the next
        // is tried), loaded or built: the fault-injection site.
        crate::faults::hit(crate::faults::Site::PlanBuild)?;
        let PlanParts { name, form, graph, descriptors, tensors, constants, persist } = parts;
        let Loaded { plan: stored, save } = match persist {
            Some(p) => p.load(ctx, &graph),
            None => Loaded { plan: None, save: None },
        };
        let (candidates, origin) = match stored {
            Some((candidate, origin)) => (vec![Rc::new(candidate)], origin),
            None => (heuristic_candidates(ctx, &name, &graph, tuning.candidates)?, PlanOrigin::Built),
        };
        let plan = Plan {
            // A stored plan is final: it was tuned by the process that stored it.
            tuned: Cell::new(
                origin != PlanOrigin::Built || (candidates.len() == 1 && tuning.knob_search == 0),
            ),
            knob_search: tuning.knob_search,
            flush: tuning.flush,
            candidates: RefCell::new(candidates),
            chosen: Cell::new(0),
            timings: RefCell::new(Vec::new()),
            _graph: graph,
            _parts: descriptors,
            tensors,
            constants: constants.into_iter().map(|(uid, v)| (uid, v.boxed())).collect(),
            name,
            form,
            build_time: started.elapsed(),
            tune_time: Cell::new(Duration::ZERO),
            handle: ctx.handle_id(),
            origin,
            persist: RefCell::new(save),
        };
        if plan.tuned.get() {
            plan.save();
        }
        Ok(plan)
    }

    /// [`Error::WrongContext`] unless `ctx`'s handle is the one the plan was finalized for (its
    /// engines were built for that handle, stream and device, and the plan cache is per context).
    pub(super) fn check_handle(&self, ctx: &Exec) -> Result<()> {
        same_handle(&self.name, self.handle, ctx.handle_id())
    }
}

/// [`Error::WrongContext`] unless a plan finalized for handle `plan` runs on handle `ctx`.
fn same_handle(name: &str, plan: HandleId, ctx: HandleId) -> Result<()> {
    if plan == ctx {
        return Ok(());
    }
    Err(Error::WrongContext(format!(
        "plan `{name}` was finalized for cuDNN handle {plan} and cannot run on handle {ctx} (another context)"
    )))
}

/// Finalizes `graph`'s engine configurations in heuristics order until `max_candidates` succeed
/// ([`Plan::from_graph`]); `name` is the graph's, for errors.
fn heuristic_candidates(
    ctx: &Exec,
    name: &str,
    graph: &Descriptor,
    max_candidates: usize,
) -> Result<Vec<Rc<Candidate>>> {
    let mut last_error = None;
    let mut candidates: Vec<Rc<Candidate>> = Vec::new();
    // Mode B (a costlier heuristic, with more configurations) only when several candidates are
    // wanted; the frontend serializes its finalize process-wide, and so do we.
    let modes: &[sys::cudnnBackendHeurMode_t] = if max_candidates > 1 {
        &[
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B,
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ]
    } else {
        &[
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ]
    };
    'modes: for &mode in modes {
        let configs = match engine_configs(graph, mode) {
            Ok(c) => c,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        for config in configs {
            // An unreadable configuration still runs; it is only left out of the knob search.
            let choice = EngineChoice::read(&config).unwrap_or(EngineChoice { index: -1, knobs: Vec::new() });
            if choice.index >= 0 && candidates.iter().any(|c| c.choice.same(&choice)) {
                continue; // later modes repeat configurations earlier ones listed
            }
            match Candidate::new(ctx, config, choice, Vec::new()) {
                Ok(c) => {
                    candidates.push(Rc::new(c));
                    if candidates.len() >= max_candidates.max(1) {
                        break 'modes;
                    }
                }
                Err(e) => last_error = Some(e),
            }
        }
    }
    if candidates.is_empty() {
        let reason = match last_error {
            Some(e) => format!("no engine configuration finalized (last error: {e})"),
            None => "heuristics returned no engine configuration".into(),
        };
        return Err(Error::NotSupported { op: name.to_string(), reason });
    }
    Ok(candidates)
}

/// Heuristics mode B's finalize is not thread-safe (the frontend holds a process-wide mutex around it).
static HEUR_B: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The engine configurations heuristics `mode` lists for `graph`, best first.
fn engine_configs(graph: &Descriptor, mode: sys::cudnnBackendHeurMode_t) -> Result<Vec<Descriptor>> {
    let mut heur = Descriptor::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, Attr::Descriptors(&[graph]))?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, Attr::HeurMode(mode))?;
    if mode == sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B {
        let _serialized = HEUR_B.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        heur.finalize("engine heuristics (mode B)")?;
    } else {
        heur.finalize("engine heuristics")?;
    }
    heur.get_descriptors(A::CUDNN_ATTR_ENGINEHEUR_RESULTS, D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_refuses_another_handle() {
        let (mine, other) = (HandleId::for_test(3), HandleId::for_test(4));
        same_handle("rmsnorm", mine, mine).unwrap();
        let e = same_handle("rmsnorm", mine, other).unwrap_err();
        assert!(matches!(e, Error::WrongContext(_)), "{e:?}");
        assert!(e.to_string().contains("finalized for cuDNN handle #3 and cannot run on handle #4"), "{e}");
    }
}
