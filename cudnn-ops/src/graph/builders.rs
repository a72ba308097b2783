//! Builder methods: each records a node and returns its (virtual) outputs.

use super::node::{Binary, MatmulOverrides, Node, NormMode, Pointwise, Reduce, Unary};
use super::{Graph, LayerNormOutputs, NormPhase, RmsNormGradOutputs, RmsNormOutputs, TensorId};
use crate::dtype::DataType;
use crate::tensor::packed_strides;

impl Graph {
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
        let (y, _, inv_rms) = self.norm(NormMode::Rms, x, scale, None, epsilon, phase);
        RmsNormOutputs { y, inv_rms }
    }

    /// Layer normalization over every dimension but the first:
    /// `y = (x − mean) / sqrt(var + ε) * scale + bias` (the biased variance, as PyTorch's
    /// `layer_norm`), computed in f32. X is `[rows, hidden, 1, 1]`-like, scale and bias
    /// `[1, hidden, 1, 1]`, epsilon a by-value f32 scalar; in training also the f32 mean and inverse
    /// standard deviation per row.
    pub fn layernorm(
        &mut self,
        x: TensorId,
        scale: TensorId,
        bias: TensorId,
        epsilon: TensorId,
        phase: NormPhase,
    ) -> LayerNormOutputs {
        let (y, mean, inv_std) = self.norm(NormMode::Layer, x, scale, Some(bias), epsilon, phase);
        LayerNormOutputs { y, mean, inv_std }
    }

    /// A norm forward node: Y like X, and in training the f32 statistics `[rows, 1, ...]` the mode
    /// has (the mean for layer norm only, the inverse RMS or standard deviation for both).
    fn norm(
        &mut self,
        mode: NormMode,
        x: TensorId,
        scale: TensorId,
        bias: Option<TensorId>,
        epsilon: TensorId,
        phase: NormPhase,
    ) -> (TensorId, Option<TensorId>, Option<TensorId>) {
        let xs = self.spec(x).clone();
        let y = self.intermediate(format!("{}::Y", self.name), &xs.dims, &xs.strides, xs.dtype);
        let stat = |g: &mut Self, name: &str| {
            // A rank-0 X has no rows: the statistic gets rank 0 too, and validation rejects both.
            let mut dims = vec![1; xs.dims.len()];
            if let (Some(d), Some(&rows)) = (dims.first_mut(), xs.dims.first()) {
                *d = rows;
            }
            let strides = packed_strides(&dims);
            g.intermediate(format!("{}::{name}", g.name), &dims, &strides, DataType::F32)
        };
        let training = phase == NormPhase::Training;
        let mean = (training && mode == NormMode::Layer).then(|| stat(self, "mean"));
        let inv_var = training.then(|| stat(self, if mode == NormMode::Rms { "inv_rms" } else { "inv_std" }));
        self.nodes.push(Node::Norm { mode, x, scale, bias, epsilon, y, mean, inv_var, phase });
        (y, mean, inv_var)
    }

    /// The backward of [`Graph::rmsnorm`] (cuDNN's norm backward in RMS mode), from the forward's saved
    /// f32 inverse RMS `[rows, 1, ...]`: `dx` (dims, strides and dtype of X) and `dscale` (those of
    /// scale), f32 compute. Epsilon is not an input: it is inside the saved statistic.
    pub fn rmsnorm_backward(
        &mut self,
        dy: TensorId,
        x: TensorId,
        scale: TensorId,
        inv_rms: TensorId,
    ) -> RmsNormGradOutputs {
        let (xs, ss) = (self.spec(x).clone(), self.spec(scale).clone());
        let dx = self.intermediate(format!("{}::dX", self.name), &xs.dims, &xs.strides, xs.dtype);
        let dscale = self.intermediate(format!("{}::dscale", self.name), &ss.dims, &ss.strides, ss.dtype);
        self.nodes.push(Node::RmsNormBackward { dy, x, scale, inv_rms, dx, dscale });
        RmsNormGradOutputs { dx, dscale }
    }

    /// The backward of the activation `act` at the forward input `x`: `dy · act'(x)` elementwise
    /// (cuDNN's `*_BWD` pointwise modes), f32. Activations without one (identity, exp, log) fail
    /// validation.
    pub fn activation_backward(&mut self, act: Unary, dy: TensorId, x: TensorId) -> TensorId {
        let dims = self.broadcast(x, dy);
        self.pointwise(Pointwise::Backward(act), DataType::F32, DataType::F32, x, Some(dy), None, &dims, None)
    }

    /// `op(x)` elementwise, f32 compute; the output is f32 (change it with [`Graph::spec_mut`] or
    /// [`Graph::output`]).
    pub fn unary(&mut self, op: Unary, x: TensorId) -> TensorId {
        let dims = self.spec(x).dims.clone();
        self.pointwise(Pointwise::Unary(op), DataType::F32, DataType::F32, x, None, None, &dims, None)
    }

    /// `a op b` elementwise, with dims of size 1 broadcast (ranks must match). Comparisons and logic
    /// give booleans; integer inputs give integer arithmetic; everything else is f32.
    pub fn binary(&mut self, op: Binary, a: TensorId, b: TensorId) -> TensorId {
        let dims = self.broadcast(a, b);
        let ints = self.spec(a).dtype == DataType::I32 && self.spec(b).dtype == DataType::I32;
        let (compute, out) = match op {
            _ if op.is_boolean() => (DataType::Bool, DataType::Bool),
            _ if ints => (DataType::I32, DataType::I32),
            _ => (DataType::F32, DataType::F32),
        };
        self.pointwise(Pointwise::Binary(op), compute, out, a, Some(b), None, &dims, None)
    }

    /// Integer arithmetic with FE's axis hint, used by the bottom-right causal mask.
    pub(crate) fn index_arith(&mut self, op: Binary, index: TensorId, by: TensorId) -> TensorId {
        let dims = self.broadcast(index, by);
        self.pointwise(
            Pointwise::Binary(op),
            DataType::I32,
            DataType::I32,
            index,
            Some(by),
            None,
            &dims,
            Some(3),
        )
    }

    /// `cond ? if_true : if_false` elementwise (cuDNN's BINARY_SELECT).
    pub fn select(&mut self, cond: TensorId, if_true: TensorId, if_false: TensorId) -> TensorId {
        let dims = self.broadcast(if_true, if_false);
        self.pointwise(
            Pointwise::Select,
            DataType::F32,
            DataType::F32,
            if_true,
            Some(if_false),
            Some(cond),
            &dims,
            None,
        )
    }

    /// The index of every element of `like` along `axis`, as i32.
    pub fn gen_index(&mut self, like: TensorId, axis: usize) -> TensorId {
        self.index_in(DataType::F32, like, axis)
    }

    /// The index of every element of `like` along `axis`, computed in i32 (the frontend's padding
    /// mask; [`Graph::gen_index`] keeps the causal band's f32 compute).
    pub(crate) fn index_of(&mut self, like: TensorId, axis: usize) -> TensorId {
        self.index_in(DataType::I32, like, axis)
    }

    /// GEN_INDEX along `axis` of `like`'s dims with `compute` as the compute type, as i32.
    fn index_in(&mut self, compute: DataType, like: TensorId, axis: usize) -> TensorId {
        let dims = self.spec(like).dims.clone();
        self.pointwise(
            Pointwise::GenIndex,
            compute,
            DataType::I32,
            like,
            None,
            None,
            &dims,
            Some(axis as i64),
        )
    }

    /// Reduces `x` to `dims` (each equal to x's or 1), f32.
    pub fn reduce(&mut self, op: Reduce, x: TensorId, dims: &[i64]) -> TensorId {
        let name =
            format!("{}::{}{}", self.name, if op == Reduce::Max { "max" } else { "sum" }, self.nodes.len());
        let y = self.intermediate(name, dims, &packed_strides(dims), DataType::F32);
        self.nodes.push(Node::Reduction { op, x, y });
        y
    }

    /// `a · b` over the last two dims (`[.., m, k] × [.., k, n]`), f32 accumulation; batch dims of `b`
    /// may divide those of `a` (grouped-query heads). The output is f32, packed.
    pub fn matmul(&mut self, a: TensorId, b: TensorId) -> TensorId {
        self.matmul_overridden(a, b, MatmulOverrides::default())
    }

    /// [`Graph::matmul`] whose M, N or K come per batch from i32 device tensors.
    pub(crate) fn matmul_overridden(
        &mut self,
        a: TensorId,
        b: TensorId,
        overrides: MatmulOverrides,
    ) -> TensorId {
        let (ad, bd) = (&self.spec(a).dims, &self.spec(b).dims);
        let mut dims: Vec<i64> = ad.iter().zip(bd.iter()).map(|(&x, &y)| x.max(y)).collect();
        let r = dims.len();
        if r >= 2 {
            dims[r - 2] = ad[r - 2];
            dims[r - 1] = bd[r - 1];
        }
        let name = format!("{}::matmul{}", self.name, self.nodes.len());
        let c = self.intermediate(name, &dims, &packed_strides(&dims), DataType::F32);
        self.nodes.push(Node::Matmul { a, b, c, overrides });
        c
    }

    /// A view of `x` as `dims` over `strides` (the same elements, e.g. a transpose: dims and strides
    /// permuted), in `dtype`; virtual. cuDNN's reshape operation: no data moves.
    pub fn reshape(&mut self, x: TensorId, dims: &[i64], strides: &[i64], dtype: DataType) -> TensorId {
        let name = format!("{}::reshape{}", self.name, self.nodes.len());
        let y = self.intermediate(name, dims, strides, dtype);
        self.nodes.push(Node::Reshape { x, y });
        y
    }

    fn broadcast(&self, a: TensorId, b: TensorId) -> Vec<i64> {
        let (ad, bd) = (&self.spec(a).dims, &self.spec(b).dims);
        if ad.len() != bd.len() {
            return ad.clone(); // validation reports the rank mismatch
        }
        ad.iter().zip(bd).map(|(&x, &y)| x.max(y)).collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn pointwise(
        &mut self,
        op: Pointwise,
        compute: DataType,
        out: DataType,
        x: TensorId,
        b: Option<TensorId>,
        t: Option<TensorId>,
        dims: &[i64],
        axis: Option<i64>,
    ) -> TensorId {
        let name = format!("{}::{}{}", self.name, op.name(), self.nodes.len());
        let y = self.intermediate(name, dims, &packed_strides(dims), out);
        self.nodes.push(Node::Pointwise { op, compute, x, b, t, y, axis });
        y
    }
}
