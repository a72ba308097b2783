//! The graph builder, in the shape of the cuDNN frontend: typed attributes in, named outputs out;
//! [`Graph::validate`] (no GPU needed), then [`Graph::build`] into a [`Plan`].
//!
//! ```no_run
//! # use cudnn_llm_ops::{Cudnn, DataType, Graph, NormPhase, TensorSpec};
//! # fn main() -> cudnn_llm_ops::Result<()> {
//! let ctx = Cudnn::new(0)?;
//! let mut g = Graph::new("rmsnorm");
//! let x = g.tensor(TensorSpec::new("X", &[30, 2048, 1, 1], DataType::BF16));
//! let w = g.tensor(TensorSpec::new("scale", &[1, 2048, 1, 1], DataType::BF16));
//! let eps = g.tensor(TensorSpec::scalar("epsilon", DataType::F32, 4));
//! let out = g.rmsnorm(x, w, eps, NormPhase::Inference);
//! g.output(out.y);
//! g.validate()?;
//! let plan = g.build(&ctx)?;
//! println!("{} needs {} bytes of workspace", plan.engine(), plan.workspace_size());
//! # Ok(()) }
//! ```
//!
//! Builders: [`Graph::rmsnorm`] and its [`Graph::rmsnorm_backward`], the elementary [`Graph::unary`],
//! [`Graph::binary`], [`Graph::select`], [`Graph::gen_index`], [`Graph::reduce`],
//! [`Graph::activation_backward`], [`Graph::matmul`], [`Graph::reshape`], and the attention patterns of
//! [`Graph::sdpa`] and [`Graph::sdpa_backward`]. Node outputs are virtual f32 tensors until marked with
//! [`Graph::output`].

mod attention;
mod builders;
mod check;
mod node;

pub use attention::{Mask, SdpaBackwardOptions, SdpaForm, SdpaGradients, SdpaOptions, SdpaOutputs};
pub use node::{Binary, Reduce, Unary};

use crate::descriptor::{Attr, Descriptor};
use crate::dtype::DataType;
use crate::plan::{Plan, Scalar};
use crate::tensor::TensorSpec;
use crate::{Cudnn, Error, Result};
use cudnn_llm_sys as sys;
use node::Node;
use std::collections::HashMap;
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// A tensor of a [`Graph`], returned by the builder methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorId(usize);

/// Forward normalization phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NormPhase {
    /// Output only.
    Inference,
    /// Output plus the per-row statistic saved for the backward pass (f32 inverse RMS).
    Training,
}

impl NormPhase {
    /// `inference` or `training`.
    pub fn name(self) -> &'static str {
        match self {
            NormPhase::Inference => "inference",
            NormPhase::Training => "training",
        }
    }
}

/// Outputs of [`Graph::rmsnorm`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RmsNormOutputs {
    /// The normalized, scaled output (dims and strides of X, dtype of X).
    pub y: TensorId,
    /// f32 inverse RMS per row, `[rows, 1, ...]`; only in the training phase.
    pub inv_rms: Option<TensorId>,
}

/// Outputs of [`Graph::layernorm`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct LayerNormOutputs {
    /// The normalized, scaled and shifted output (dims and strides of X, dtype of X).
    pub y: TensorId,
    /// f32 mean per row, `[rows, 1, ...]`; only in the training phase.
    pub mean: Option<TensorId>,
    /// f32 inverse standard deviation per row, `[rows, 1, ...]`; only in the training phase.
    pub inv_std: Option<TensorId>,
}

/// Outputs of [`Graph::rmsnorm_backward`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RmsNormGradOutputs {
    /// The gradient of X (dims, strides and dtype of X).
    pub dx: TensorId,
    /// The gradient of the scale (dims, strides and dtype of the scale).
    pub dscale: TensorId,
}

/// An operation graph under construction.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    name: String,
    tensors: Vec<TensorSpec>,
    nodes: Vec<Node>,
    /// By-value tensors whose value is part of the graph (the -inf mask fill, sequence lengths): the
    /// plan binds them itself.
    constants: Vec<(TensorId, Scalar)>,
    /// Virtual outputs a pattern computes and nobody reads (the stats of inference attention).
    discarded: Vec<TensorId>,
    /// Composite attentions, checked as a whole before their nodes.
    attentions: Vec<attention::SdpaTensors>,
    /// Composite attention backwards, checked as a whole before their nodes.
    backward_attentions: Vec<attention::SdpaBackwardTensors>,
    /// A composite attention was asked for with page tables (its paged cache loads are not built).
    paged_composite: Option<TensorId>,
    form: Option<String>,
}

impl Graph {
    /// An empty graph; `name` appears in errors.
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            tensors: Vec::new(),
            nodes: Vec::new(),
            constants: Vec::new(),
            discarded: Vec::new(),
            attentions: Vec::new(),
            backward_attentions: Vec::new(),
            paged_composite: None,
            form: None,
        }
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Adds an input tensor (device memory, or a host scalar when `spec.by_value`). A zero uid is
    /// replaced by the next free one.
    pub fn tensor(&mut self, mut spec: TensorSpec) -> TensorId {
        if spec.uid == 0 {
            spec.uid = self.tensors.iter().map(|t| t.uid).max().unwrap_or(0) + 1;
        }
        self.tensors.push(spec);
        TensorId(self.tensors.len() - 1)
    }

    /// A by-value scalar whose value is fixed in the graph; the plan binds it on every execution.
    pub fn constant(&mut self, name: impl Into<String>, value: Scalar, rank: usize) -> TensorId {
        let id = self.tensor(TensorSpec::scalar(name, value.dtype(), rank));
        self.constants.push((id, value));
        id
    }

    /// The spec of a tensor.
    pub fn spec(&self, id: TensorId) -> &TensorSpec {
        &self.tensors[id.0]
    }

    /// The spec of a tensor, for adjustments (another dtype for a virtual intermediate, a name).
    pub fn spec_mut(&mut self, id: TensorId) -> &mut TensorSpec {
        &mut self.tensors[id.0]
    }

    /// Every tensor, in creation order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The name and uid of every tensor a call binds (not virtual, not by value), in order.
    #[cfg(test)]
    pub(crate) fn bound(&self) -> Vec<(&str, i64)> {
        self.tensors
            .iter()
            .filter(|t| !t.is_virtual && !t.by_value)
            .map(|t| (t.name.as_str(), t.uid))
            .collect()
    }

    /// Marks a node output as a graph output (backed by memory at execute time) and returns its spec
    /// for adjustments such as another dtype.
    pub fn output(&mut self, id: TensorId) -> &mut TensorSpec {
        let t = &mut self.tensors[id.0];
        t.is_virtual = false;
        t
    }

    /// Labels the graph's form (e.g. which SDPA pattern it lowers to); plans report it.
    pub fn set_form(&mut self, form: impl Into<String>) {
        self.form = Some(form.into());
    }

    /// The form label, if one was set.
    pub fn form(&self) -> Option<&str> {
        self.form.as_deref()
    }

    fn intermediate(&mut self, name: String, dims: &[i64], strides: &[i64], dtype: DataType) -> TensorId {
        let spec =
            TensorSpec { is_virtual: true, ..TensorSpec::new(name, dims, dtype).with_strides(strides) };
        self.tensor(spec)
    }

    fn fail(&self, id: TensorId, reason: impl Into<String>) -> Error {
        Error::InvalidGraph {
            graph: self.name.clone(),
            tensor: self.spec(id).name.clone(),
            reason: reason.into(),
        }
    }

    /// Checks every tensor and node without touching a GPU. Errors name the offending tensor.
    pub fn validate(&self) -> Result<()> {
        let mut uids: HashMap<i64, usize> = HashMap::new();
        for (i, t) in self.tensors.iter().enumerate() {
            t.check().map_err(|r| self.fail(TensorId(i), r))?;
            if let Some(&j) = uids.get(&t.uid) {
                let other = &self.tensors[j].name;
                return Err(self.fail(TensorId(i), format!("uid {} is also used by `{other}`", t.uid)));
            }
            uids.insert(t.uid, i);
        }
        if self.nodes.is_empty() {
            return Err(Error::InvalidGraph {
                graph: self.name.clone(),
                tensor: "-".into(),
                reason: "no operations".into(),
            });
        }
        if let Some(t) = self.paged_composite {
            return Err(Error::NotSupported {
                op: format!("{} (tensor `{}`)", self.name, self.spec(t).name),
                reason: "paged K/V needs the unified SDPA operation (its PAGE_TABLE_KDESC/VDESC attributes, \
                         cuDNN 9.15+); the composite form's PAGED_CACHE_LOAD operations are not built"
                    .into(),
            });
        }
        self.check_ragged_offsets()?;
        for a in &self.attentions {
            let [q, k, v, o] = a.qkvo;
            self.check_sdpa_tensors(q, k, v, o, a.stats, [true, false])?;
            if let Some(lens) = a.seq_lens {
                self.check_seq_lens(q, lens)?;
            }
        }
        for t in &self.backward_attentions {
            self.check_sdpa_backward_tensors(t)?;
        }
        for node in &self.nodes {
            self.check_node(node)?;
        }
        for (i, t) in self.tensors.iter().enumerate() {
            let id = TensorId(i);
            let produced = self.nodes.iter().any(|n| n.outputs().contains(&id));
            // A virtual tensor nobody reads and nobody marked as an output would be computed for nothing
            // (cuDNN rejects such graphs); one nobody produces would never hold a value.
            let read = self.nodes.iter().any(|n| n.inputs().contains(&id));
            if t.is_virtual && !read && !self.discarded.contains(&id) {
                return Err(self.fail(id, "is computed but never used: mark it with Graph::output"));
            }
            if t.is_virtual && !produced {
                return Err(self.fail(id, "is virtual but no operation produces it"));
            }
        }
        Ok(())
    }

    /// Validates, lowers to backend descriptors, runs heuristics (mode A, then FALLBACK) and finalizes
    /// the first engine configuration that cuDNN accepts. [`Error::NotSupported`] if none does.
    pub fn build(&self, ctx: &Cudnn) -> Result<Plan> {
        self.build_tuned(ctx, crate::Tuning::FIRST)
    }

    /// Like [`Graph::build`], but finalizes up to `tuning.candidates` engine configurations; the plan's
    /// first execution times them, searches knobs around the fastest if `tuning.knob_search` allows,
    /// and keeps the fastest ([`Plan::autotune`]).
    pub fn build_tuned(&self, ctx: &Cudnn, tuning: crate::Tuning) -> Result<Plan> {
        self.validate()?;
        let started = std::time::Instant::now();
        ctx.bind()?;
        // Heuristics, finalization and autotuning synchronize and execute: inside a stream capture
        // they would invalidate it (and a NotSupported from there would look like a real refusal).
        let capturing = ctx.stream().capture_status()?;
        if capturing != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::invalid(format!(
                "graph `{}`: no plan is built while the stream captures a CUDA graph; run the op once \
                 before capturing",
                self.name
            )));
        }
        // Ragged-offset tensors first: a packed tensor's descriptor points at its offsets' (validation
        // made sure those exist and carry no offsets of their own).
        let mut descs: Vec<Option<Descriptor>> = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            descs.push(if t.ragged_offset.is_none() { Some(t.descriptor(None)?) } else { None });
        }
        for (i, t) in self.tensors.iter().enumerate() {
            if let Some(uid) = t.ragged_offset {
                let offsets = self.tensors.iter().position(|o| o.uid == uid).and_then(|j| descs[j].as_ref());
                let Some(offsets) = offsets else {
                    return Err(self.fail(TensorId(i), format!("ragged offsets uid {uid} has no descriptor")));
                };
                let d = t.descriptor(Some(offsets))?;
                descs[i] = Some(d);
            }
        }
        let tensor = |id: TensorId| descs[id.0].as_ref().expect("every tensor has a descriptor");
        let mut ops = Vec::new();
        for node in &self.nodes {
            ops.push(node.lower(tensor).map_err(|e| self.unsupported(e))?);
        }
        let mut graph = Descriptor::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, Attr::Handle(ctx.raw_handle()))?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, Attr::Descriptors(&ops.iter().collect::<Vec<_>>()))?;
        graph.finalize(&format!("operation graph `{}`", self.name)).map_err(|e| self.unsupported(e))?;
        let constants: Vec<(i64, Scalar)> =
            self.constants.iter().map(|&(id, v)| (self.spec(id).uid, v)).collect();
        let bound = self
            .tensors
            .iter()
            .filter(|t| !t.is_virtual && !constants.iter().any(|(uid, _)| *uid == t.uid))
            .cloned()
            .collect();
        let mut keep: Vec<Descriptor> = descs.into_iter().flatten().collect();
        keep.extend(ops);
        // Built for the plan cache of a context with a plan directory: the stored plan must be of this
        // very graph (its whole description) and tuning.
        let persist = ctx
            .cache()
            .building()
            .map(|slot| crate::plan::Persist::new(slot, format!("{self:?}\n{tuning:?}")));
        let parts = crate::plan::PlanParts {
            name: self.name.clone(),
            form: self.form.clone().unwrap_or_default(),
            graph,
            descriptors: keep,
            tensors: bound,
            constants,
            persist,
        };
        Plan::from_graph(ctx, parts, started, tuning).map_err(|e| self.unsupported(e))
    }

    fn unsupported(&self, e: Error) -> Error {
        match e {
            Error::NotSupported { op, reason } if !op.starts_with(&self.name) => {
                Error::NotSupported { op: format!("{} ({op})", self.name), reason }
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rmsnorm_graph(phase: NormPhase) -> (Graph, RmsNormOutputs) {
        let mut g = Graph::new("rms");
        let x = g.tensor(TensorSpec::new("X", &[30, 2048, 1, 1], DataType::BF16));
        let w = g.tensor(TensorSpec::new("scale", &[1, 2048, 1, 1], DataType::BF16));
        let e = g.tensor(TensorSpec::scalar("epsilon", DataType::F32, 4));
        let out = g.rmsnorm(x, w, e, phase);
        (g, out)
    }

    fn invalid_tensor(g: &Graph) -> String {
        match g.validate() {
            Err(Error::InvalidGraph { tensor, .. }) => tensor,
            other => panic!("expected InvalidGraph, got {other:?}"),
        }
    }

    #[test]
    fn valid_rmsnorm_graph_and_uids() {
        let (mut g, out) = rmsnorm_graph(NormPhase::Training);
        g.output(out.y);
        g.output(out.inv_rms.unwrap());
        g.validate().unwrap();
        let uids: Vec<i64> = g.tensors.iter().map(|t| t.uid).collect();
        assert_eq!(uids, vec![1, 2, 3, 4, 5]);
        assert_eq!(g.spec(out.inv_rms.unwrap()).dims, vec![30, 1, 1, 1]);
        assert_eq!(g.spec(out.y).dtype, DataType::BF16);
    }

    #[test]
    fn unmarked_output_is_named() {
        let (g, _) = rmsnorm_graph(NormPhase::Inference);
        assert_eq!(invalid_tensor(&g), "rms::Y");
        let (mut g, out) = rmsnorm_graph(NormPhase::Training);
        g.output(out.y);
        assert_eq!(invalid_tensor(&g), "rms::inv_rms");
    }

    #[test]
    fn validation_names_the_offending_tensor() {
        // Scale of the wrong width.
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("X", &[4, 64, 1, 1], DataType::F16));
        let w = g.tensor(TensorSpec::new("gamma", &[1, 32, 1, 1], DataType::F16));
        let e = g.tensor(TensorSpec::scalar("eps", DataType::F32, 4));
        let y = g.rmsnorm(x, w, e, NormPhase::Inference).y;
        g.output(y);
        assert_eq!(invalid_tensor(&g), "gamma");
        let err = g.validate().unwrap_err().to_string();
        assert!(err.contains("`gamma`") && err.contains("[1, 32, 1, 1]"), "{err}");

        // Epsilon not by value.
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("X", &[4, 64, 1, 1], DataType::F16));
        let w = g.tensor(TensorSpec::new("gamma", &[1, 64, 1, 1], DataType::F16));
        let e = g.tensor(TensorSpec::new("eps", &[1, 1, 1, 1], DataType::F32));
        let y = g.rmsnorm(x, w, e, NormPhase::Inference).y;
        g.output(y);
        assert_eq!(invalid_tensor(&g), "eps");

        // Integer input.
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("ids", &[4, 64, 1, 1], DataType::I32));
        let w = g.tensor(TensorSpec::new("gamma", &[1, 64, 1, 1], DataType::F16));
        let e = g.tensor(TensorSpec::scalar("eps", DataType::F32, 4));
        let y = g.rmsnorm(x, w, e, NormPhase::Inference).y;
        g.output(y);
        assert_eq!(invalid_tensor(&g), "ids");

        // Bad strides and duplicate uids.
        let mut g = Graph::new("g");
        let x = g.tensor(TensorSpec::new("X", &[4, 64, 1, 1], DataType::F16).with_strides(&[64, 1, 64]));
        let w = g.tensor(TensorSpec::new("gamma", &[1, 64, 1, 1], DataType::F16));
        let e = g.tensor(TensorSpec::scalar("eps", DataType::F32, 4).with_uid(2));
        let y = g.rmsnorm(x, w, e, NormPhase::Inference).y;
        g.output(y);
        assert_eq!(invalid_tensor(&g), "X");
        g.tensors[0].strides = vec![64, 1, 64, 64];
        assert_eq!(invalid_tensor(&g), "eps");
        assert!(g.validate().unwrap_err().to_string().contains("uid 2 is also used by `gamma`"));
    }

    #[test]
    fn rank_zero_rmsnorm_is_an_error_not_a_panic() {
        for phase in [NormPhase::Inference, NormPhase::Training] {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorSpec::new("X", &[], DataType::F16));
            let w = g.tensor(TensorSpec::new("gamma", &[], DataType::F16));
            let e = g.tensor(TensorSpec::scalar("eps", DataType::F32, 0));
            let out = g.rmsnorm(x, w, e, phase);
            g.output(out.y);
            if let Some(inv) = out.inv_rms {
                assert!(g.spec(inv).dims.is_empty());
                g.output(inv);
            }
            assert_eq!(invalid_tensor(&g), "X");
        }
    }

    #[test]
    fn empty_graph_is_invalid() {
        assert!(Graph::new("empty").validate().unwrap_err().to_string().contains("no operations"));
    }
}
