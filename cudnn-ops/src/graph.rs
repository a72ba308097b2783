//! The graph builder, in the shape of the cuDNN frontend: typed attributes in, named outputs out;
//! [`Graph::validate`] (no GPU needed), then [`Graph::build`] into a [`Plan`].
//!
//! ```no_run
//! # use cudnn_ops::{Cudnn, DataType, Graph, NormPhase, TensorSpec};
//! # fn main() -> cudnn_ops::Result<()> {
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

use crate::descriptor::{Attr, Descriptor};
use crate::dtype::DataType;
use crate::plan::Plan;
use crate::tensor::TensorSpec;
use crate::{Cudnn, Error, Result};
use cudnn_sys as sys;
use std::collections::HashMap;
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// A tensor of a [`Graph`], returned by the builder methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorId(usize);

/// Forward normalization phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
pub struct RmsNormOutputs {
    /// The normalized, scaled output (dims and strides of X, dtype of X).
    pub y: TensorId,
    /// f32 inverse RMS per row, `[rows, 1, ...]`; only in the training phase.
    pub inv_rms: Option<TensorId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Node {
    RmsNorm {
        x: TensorId,
        scale: TensorId,
        epsilon: TensorId,
        y: TensorId,
        inv_rms: Option<TensorId>,
        phase: NormPhase,
    },
}

/// An operation graph under construction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Graph {
    name: String,
    tensors: Vec<TensorSpec>,
    nodes: Vec<Node>,
}

impl Graph {
    /// An empty graph; `name` appears in errors.
    pub fn new(name: impl Into<String>) -> Self {
        Graph { name: name.into(), tensors: Vec::new(), nodes: Vec::new() }
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

    /// The spec of a tensor.
    pub fn spec(&self, id: TensorId) -> &TensorSpec {
        &self.tensors[id.0]
    }

    /// Every tensor, in creation order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Marks a node output as a graph output (backed by memory at execute time) and returns its spec
    /// for adjustments such as another dtype.
    pub fn output(&mut self, id: TensorId) -> &mut TensorSpec {
        let t = &mut self.tensors[id.0];
        t.is_virtual = false;
        t
    }

    fn intermediate(&mut self, name: String, dims: &[i64], strides: &[i64], dtype: DataType) -> TensorId {
        let spec =
            TensorSpec { is_virtual: true, ..TensorSpec::new(name, dims, dtype).with_strides(strides) };
        self.tensor(spec)
    }

    /// RMS normalization over every dimension but the first: `y = x / sqrt(mean(x²) + ε) * scale`,
    /// computed in f32. X is `[rows, hidden, 1, 1]`-like, scale `[1, hidden, 1, 1]`, epsilon a by-value f32
    /// scalar.
    pub fn rmsnorm(
        &mut self,
        x: TensorId,
        scale: TensorId,
        epsilon: TensorId,
        phase: NormPhase,
    ) -> RmsNormOutputs {
        let xs = self.spec(x).clone();
        let y = self.intermediate(format!("{}::Y", self.name), &xs.dims, &xs.strides, xs.dtype);
        let inv_rms = (phase == NormPhase::Training).then(|| {
            let mut dims = vec![1; xs.dims.len()];
            dims[0] = xs.dims[0];
            let strides = crate::tensor::packed_strides(&dims);
            self.intermediate(format!("{}::inv_rms", self.name), &dims, &strides, DataType::F32)
        });
        self.nodes.push(Node::RmsNorm { x, scale, epsilon, y, inv_rms, phase });
        RmsNormOutputs { y, inv_rms }
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
        for node in &self.nodes {
            match *node {
                Node::RmsNorm { x, scale, epsilon, y, inv_rms, .. } => {
                    self.check_rmsnorm(x, scale, epsilon, y, inv_rms)?
                }
            }
        }
        // Every virtual tensor must be consumed: a node output nobody reads and nobody marked as an output
        // would be computed for nothing (cuDNN rejects such graphs).
        for (i, t) in self.tensors.iter().enumerate() {
            if t.is_virtual && !self.nodes.iter().any(|n| n.inputs().contains(&TensorId(i))) {
                return Err(self.fail(TensorId(i), "is computed but never used: mark it with Graph::output"));
            }
        }
        Ok(())
    }

    fn check_rmsnorm(
        &self,
        x: TensorId,
        scale: TensorId,
        eps: TensorId,
        y: TensorId,
        inv: Option<TensorId>,
    ) -> Result<()> {
        let (xs, ss, es) = (self.spec(x), self.spec(scale), self.spec(eps));
        let float = [DataType::F32, DataType::F16, DataType::BF16];
        for id in [x, scale, y] {
            if !float.contains(&self.spec(id).dtype) {
                return Err(self.fail(id, format!("dtype {} is not f32, f16 or bf16", self.spec(id).dtype)));
            }
        }
        if xs.dims.len() < 2 {
            return Err(self.fail(x, format!("needs at least 2 dims, has {:?}", xs.dims)));
        }
        if xs.is_virtual || xs.by_value {
            return Err(self.fail(x, "must be a device tensor"));
        }
        let mut expected = xs.dims.clone();
        expected[0] = 1;
        if ss.dims != expected {
            return Err(self.fail(
                scale,
                format!("dims {:?} do not match X {:?}: expected {expected:?}", ss.dims, xs.dims),
            ));
        }
        if !es.by_value || es.dtype != DataType::F32 || es.dims.iter().any(|&d| d != 1) {
            return Err(self.fail(eps, "epsilon must be a by-value f32 scalar (all dims 1)"));
        }
        if self.spec(y).dims != xs.dims {
            return Err(self.fail(y, format!("dims {:?} differ from X {:?}", self.spec(y).dims, xs.dims)));
        }
        if let Some(inv) = inv {
            let s = self.spec(inv);
            if s.dtype != DataType::F32 || s.dims[0] != xs.dims[0] || s.dims[1..].iter().any(|&d| d != 1) {
                return Err(self.fail(
                    inv,
                    format!("must be f32 [{}, 1, ...], is {} {:?}", xs.dims[0], s.dtype, s.dims),
                ));
            }
        }
        Ok(())
    }

    /// Validates, lowers to backend descriptors, runs heuristics (mode A, then FALLBACK) and finalizes
    /// the first engine configuration that cuDNN accepts. [`Error::NotSupported`] if none does.
    pub fn build(&self, ctx: &Cudnn) -> Result<Plan> {
        self.validate()?;
        let started = std::time::Instant::now();
        ctx.bind()?;
        let mut descs: Vec<Option<Descriptor>> = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            descs.push(Some(t.descriptor()?));
        }
        let tensor = |id: TensorId| descs[id.0].as_ref().expect("every tensor has a descriptor");
        let mut ops = Vec::new();
        for node in &self.nodes {
            ops.push(node.lower(tensor)?);
        }
        let mut graph = Descriptor::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, Attr::Handle(ctx.raw_handle()))?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, Attr::Descriptors(&ops.iter().collect::<Vec<_>>()))?;
        graph.finalize(&format!("operation graph `{}`", self.name)).map_err(|e| self.unsupported(e))?;
        let bound = self.tensors.iter().filter(|t| !t.is_virtual).cloned().collect();
        let mut keep: Vec<Descriptor> = descs.into_iter().flatten().collect();
        keep.extend(ops);
        Plan::from_graph(ctx, &self.name, graph, keep, bound, started).map_err(|e| self.unsupported(e))
    }

    fn unsupported(&self, e: Error) -> Error {
        match e {
            Error::NotSupported { op, reason } => {
                Error::NotSupported { op: format!("{} ({op})", self.name), reason }
            }
            other => other,
        }
    }
}

impl Node {
    fn inputs(&self) -> Vec<TensorId> {
        match *self {
            Node::RmsNorm { x, scale, epsilon, .. } => vec![x, scale, epsilon],
        }
    }

    fn lower<'a>(&self, t: impl Fn(TensorId) -> &'a Descriptor) -> Result<Descriptor> {
        match *self {
            Node::RmsNorm { x, scale, epsilon, y, inv_rms, phase } => {
                let mut op = Descriptor::new(D::CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR)?;
                op.set(
                    A::CUDNN_ATTR_OPERATION_NORM_FWD_MODE,
                    Attr::NormMode(sys::cudnnBackendNormMode_t::CUDNN_RMS_NORM),
                )?;
                let raw_phase = match phase {
                    NormPhase::Inference => sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_INFERENCE,
                    NormPhase::Training => sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_TRAINING,
                };
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_PHASE, Attr::NormPhase(raw_phase))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, Attr::Descriptors(&[t(x)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, Attr::Descriptors(&[t(scale)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC, Attr::Descriptors(&[t(epsilon)]))?;
                op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, Attr::Descriptors(&[t(y)]))?;
                if let Some(inv) = inv_rms {
                    op.set(A::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC, Attr::Descriptors(&[t(inv)]))?;
                }
                op.finalize("rmsnorm operation")?;
                Ok(op)
            }
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
    fn empty_graph_is_invalid() {
        assert!(Graph::new("empty").validate().unwrap_err().to_string().contains("no operations"));
    }
}
