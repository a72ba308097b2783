//! A plan to and from the plan directory: on a plan cache miss, the stored plan of the very graph
//! being built is loaded (its JSON deserialized and finalized, else its stored engine choice rebuilt);
//! a plan built here is saved once final, with its JSON when cuDNN can serialize the engine and its
//! engine choice always. The file side (format, checks, atomic write, counters) is [`super::store`].
//!
//! Not every engine can be serialized (cuDNN's plan serialization started out as runtime-fusion
//! engines only): for those the file holds the engine and knobs alone, and the next process finalizes
//! that one configuration, skipping heuristics and autotuning but not the engine's compilation.

use super::candidate::Candidate;
use super::store::{DiskEventKind, Slot};
use super::{Plan, PlanOrigin};
use crate::descriptor::Descriptor;
use crate::exec::Exec;
use cudnn_llm_sys::cudnnBackendAttributeName_t as A;
use std::rc::Rc;

/// A graph's slot in the plan directory: the key's file, and the graph's description that a stored
/// plan must match.
#[derive(Debug)]
pub(crate) struct Persist {
    slot: Rc<Slot>,
    /// The graph's `Debug` text and the tuning it is built with.
    graph: String,
    /// Save without the plan JSON (the stored JSON did not finalize here; storing it again would
    /// only fail again).
    choice_only: bool,
}

/// What [`Persist::load`] gives: the stored plan, if one was usable, and the slot to save the plan
/// to once final, if it must be saved.
pub(super) struct Loaded {
    pub(super) plan: Option<(Candidate, PlanOrigin)>,
    pub(super) save: Option<Persist>,
}

impl Persist {
    /// The slot `slot` for a graph described by `graph` (its `Debug` text and tuning).
    pub(crate) fn new(slot: Rc<Slot>, graph: String) -> Self {
        Persist { slot, graph, choice_only: false }
    }

    /// The stored plan of this graph, finalized for `ctx`'s handle (`graph` is its operation graph,
    /// for rebuilding a stored engine choice). No plan without a usable file, or when the file is of
    /// another graph of the same key (e.g. the composite attention a first unified attempt does not
    /// match); a file cuDNN refuses is recorded as an event, and the plan is then built from scratch.
    /// The slot comes back to save the plan once final when it is built here, and when the stored
    /// JSON failed and the engine choice stood in (saved then without JSON).
    pub(super) fn load(self, ctx: &Exec, graph: &Descriptor) -> Loaded {
        let Some(record) = self.slot.record().filter(|r| r.graph == self.graph) else {
            return Loaded { plan: None, save: Some(self) };
        };
        let mut json_failed = false;
        if let Some(json) = &record.json {
            let why = match Candidate::from_json(ctx, json, &record.engine) {
                Ok(c) if c.workspace as u64 != record.workspace => format!(
                    "the deserialized plan needs {} bytes of workspace, the file says {}",
                    c.workspace, record.workspace
                ),
                // The engine read back from the plan (its knobs as cuDNN lists them there).
                Ok(c) if c.choice.index != record.engine.index => {
                    format!(
                        "the deserialized plan runs {}, the file says {}",
                        c.choice.tag(),
                        record.engine.tag()
                    )
                }
                Ok(c) => {
                    self.slot.loaded();
                    return Loaded { plan: Some((c, PlanOrigin::Deserialized)), save: None };
                }
                Err(e) => format!("the plan JSON did not finalize: {e}"),
            };
            let next =
                if record.engine.index >= 0 { "rebuilding the stored engine choice" } else { "rebuilding" };
            self.slot.note(DiskEventKind::Unloadable, format!("{why}; {next}"));
            json_failed = true;
        }
        if record.engine.index < 0 {
            self.slot.reject(DiskEventKind::Unloadable, "no usable plan JSON and no engine choice".into());
            return Loaded { plan: None, save: Some(self) };
        }
        let rebuilt = record
            .engine
            .build(graph)
            .and_then(|(config, parts)| Candidate::new(ctx, config, record.engine.clone(), parts));
        match rebuilt {
            Ok(c) => {
                self.slot.loaded();
                let save = json_failed.then_some(Persist { choice_only: true, ..self });
                Loaded { plan: Some((c, PlanOrigin::StoredChoice)), save }
            }
            Err(e) => {
                let why = format!("the stored engine choice {} did not finalize: {e}", record.engine.tag());
                self.slot.reject(DiskEventKind::Unloadable, why);
                Loaded { plan: None, save: Some(self) }
            }
        }
    }
}

impl Plan {
    /// Saves the plan to its slot if it has one (once: the slot is taken), with the running
    /// engine's JSON when cuDNN serializes it and its engine choice always. Called when the plan is
    /// final: at build for an untuned plan, after autotuning otherwise.
    pub(super) fn save(&self) {
        let Some(persist) = self.persist.borrow_mut().take() else { return };
        let chosen = self.chosen();
        // Engines cuDNN cannot serialize answer with an error: their engine choice is stored alone.
        let json = if persist.choice_only {
            None
        } else {
            chosen
                .plan
                .get_chars(A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION)
                .ok()
                .filter(|j| !j.is_empty())
        };
        if json.is_none() && chosen.choice.index < 0 {
            return; // nothing a later process could use
        }
        persist.slot.save(persist.graph, chosen.choice.clone(), chosen.workspace as u64, json);
    }
}
