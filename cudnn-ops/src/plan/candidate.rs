//! One finalized engine configuration of a graph (a plan's candidate): built from an engine
//! configuration, or deserialized from a stored plan's JSON. Plans hold them ([`super::lifecycle`]
//! builds them from the heuristics, [`super::persist`] from the plan directory, [`super::autotune`]
//! from the knob search).

use super::engine::EngineChoice;
use crate::descriptor::{Attr, Descriptor};
use crate::exec::Exec;
use crate::Result;
use cudnn_llm_sys as sys;
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// One finalized engine configuration of a graph.
pub(super) struct Candidate {
    // Field order is drop order: the plan goes before the configuration it was finalized from.
    pub(super) plan: Descriptor,
    pub(super) workspace: usize,
    pub(super) choice: EngineChoice,
    /// The engine configuration and, for configurations built here, its engine and knob choices.
    _config: Vec<Descriptor>,
}

impl Candidate {
    /// Finalizes `config` for `ctx`'s handle; `parts` are the descriptors it was built from.
    pub(super) fn new(
        ctx: &Exec,
        config: Descriptor,
        choice: EngineChoice,
        parts: Vec<Descriptor>,
    ) -> Result<Self> {
        let plan = finalize_plan(ctx, &config)?;
        let workspace = plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
        let mut keep = vec![config];
        keep.extend(parts);
        Ok(Candidate { plan, workspace, choice, _config: keep })
    }

    /// Deserializes a plan from `json` (its `CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION`) and
    /// finalizes it for `ctx`'s handle, as the frontend's `loadFromJson` does. The engine
    /// configuration is read back from the plan; `stored` stands in where cuDNN does not give it.
    pub(super) fn from_json(ctx: &Exec, json: &[u8], stored: &EngineChoice) -> Result<Self> {
        let mut plan = Descriptor::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
        plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, Attr::Chars(json))?;
        plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Attr::Handle(ctx.raw_handle()))?;
        plan.finalize("execution plan (deserialized)")?;
        let workspace = plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
        let config = plan
            .get_descriptors(
                A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
                Some(1),
            )
            .ok()
            .and_then(|mut c| c.pop());
        let choice =
            config.as_ref().and_then(|c| EngineChoice::read(c).ok()).unwrap_or_else(|| stored.clone());
        Ok(Candidate { plan, workspace, choice, _config: config.into_iter().collect() })
    }
}

/// An execution plan of `config` finalized for `ctx`'s handle.
fn finalize_plan(ctx: &Exec, config: &Descriptor) -> Result<Descriptor> {
    let mut plan = Descriptor::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Attr::Handle(ctx.raw_handle()))?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, Attr::Descriptors(&[config]))?;
    plan.finalize("execution plan")?;
    Ok(plan)
}
