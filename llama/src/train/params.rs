//! The trainer's parameters: one list of device tensors with their gradients (f32), AdamW moments
//! (f32) and optional f32 master copies, and where each model tensor is in it.
//!
//! The list holds the Hugging Face tensors in [`Weights::names`] order except that each layer's Q, K
//! and V projections are one `[(h_q + 2·h_kv)·d, hidden]` tensor (Q rows, then K, then V), as the
//! forward runs them ([`fuse`]); [`split`] undoes that for checkpoints. A layer's seven tensors are
//! consecutive ([`Layer`]); a tied `lm_head` is the embedding itself.

use crate::config::LlamaConfig;
use crate::weights::{Tensor, Weights};
use crate::Result;
use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::faults::Zeros;
use cudnn_llm_ops::{Cudnn, Element};

/// Tensors per layer in the parameter list.
const PER_LAYER: usize = 7;

/// One layer's tensors (references to device buffers, or their indices): the order in the list.
pub(crate) struct Layer<R> {
    pub(crate) attn_norm: R,
    pub(crate) qkv: R,
    pub(crate) o_proj: R,
    pub(crate) mlp_norm: R,
    pub(crate) gate: R,
    pub(crate) up: R,
    pub(crate) down: R,
}

impl<R> Layer<R> {
    fn from_array([attn_norm, qkv, o_proj, mlp_norm, gate, up, down]: [R; PER_LAYER]) -> Self {
        Layer { attn_norm, qkv, o_proj, mlp_norm, gate, up, down }
    }
}

/// Where the model's tensors are in the parameter list of `layers` layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ids {
    layers: usize,
    tied: bool,
}

impl Ids {
    pub(crate) fn new(cfg: &LlamaConfig) -> Self {
        Ids { layers: cfg.layers, tied: cfg.tie_embeddings }
    }

    /// Tensors in the list.
    pub(crate) fn len(&self) -> usize {
        2 + PER_LAYER * self.layers + usize::from(!self.tied)
    }

    pub(crate) fn embed(&self) -> usize {
        0
    }

    fn layer_start(&self, layer: usize) -> usize {
        1 + PER_LAYER * layer
    }

    pub(crate) fn norm(&self) -> usize {
        1 + PER_LAYER * self.layers
    }

    /// `lm_head`'s weight: its own tensor, or the embedding when tied.
    pub(crate) fn head(&self) -> usize {
        if self.tied {
            self.embed()
        } else {
            self.norm() + 1
        }
    }

    /// Layer `layer`'s tensors in `list` (one entry per parameter).
    pub(crate) fn layer<'a, X>(&self, list: &'a [X], layer: usize) -> Layer<&'a X> {
        let start = self.layer_start(layer);
        let chunk: &[X; PER_LAYER] =
            list[start..start + PER_LAYER].try_into().expect("a layer is PER_LAYER consecutive tensors");
        Layer::from_array(chunk.each_ref())
    }

    /// Layer `layer`'s tensors in `list`, mutably.
    pub(crate) fn layer_mut<'a, X>(&self, list: &'a mut [X], layer: usize) -> Layer<&'a mut X> {
        let start = self.layer_start(layer);
        let chunk: &mut [X; PER_LAYER] = (&mut list[start..start + PER_LAYER])
            .try_into()
            .expect("a layer is PER_LAYER consecutive tensors");
        Layer::from_array(chunk.each_mut())
    }
}

/// `w`'s tensors in parameter-list order, Q, K and V of each layer concatenated row-wise.
pub(crate) fn fuse<E: Copy>(w: &Weights<E>) -> Vec<Vec<E>> {
    let mut out = vec![w.embed.data.clone()];
    for l in &w.layers {
        let qkv = [&l.q_proj, &l.k_proj, &l.v_proj].iter().flat_map(|t| t.data.iter().copied()).collect();
        out.extend([
            l.attn_norm.data.clone(),
            qkv,
            l.o_proj.data.clone(),
            l.mlp_norm.data.clone(),
            l.gate_proj.data.clone(),
            l.up_proj.data.clone(),
            l.down_proj.data.clone(),
        ]);
    }
    out.push(w.norm.data.clone());
    out.extend(w.lm_head.as_ref().map(|h| h.data.clone()));
    out
}

/// The inverse of [`fuse`]: tensors in parameter-list order (as long as [`Ids::len`] says) back to
/// Hugging Face tensors of `cfg`'s shapes, each fused QKV split into its Q, K and V rows.
pub(crate) fn split<E: Copy>(cfg: &LlamaConfig, tensors: Vec<Vec<E>>) -> Weights<E> {
    let (q_rows, kv_rows) = (cfg.attn_width() * cfg.hidden, cfg.kv_heads * cfg.head_dim * cfg.hidden);
    let mut hf = Vec::with_capacity(tensors.len() + 2 * cfg.layers);
    for (i, t) in tensors.into_iter().enumerate() {
        let in_layer = i.checked_sub(1).map(|j| (j / PER_LAYER, j % PER_LAYER));
        match in_layer {
            Some((layer, 1)) if layer < cfg.layers => {
                hf.push(t[..q_rows].to_vec());
                hf.push(t[q_rows..q_rows + kv_rows].to_vec());
                hf.push(t[q_rows + kv_rows..].to_vec());
            }
            _ => hf.push(t),
        }
    }
    let names = Weights::<f32>::names(cfg);
    debug_assert_eq!(names.len(), hf.len());
    Weights::from_tensors(cfg, names.into_iter().zip(hf).map(|((_, shape), data)| Tensor { shape, data }))
}

/// The parameters on the device, each with its gradient and AdamW state.
pub(crate) struct Params<T> {
    pub(crate) ids: Ids,
    /// The weights the model runs.
    pub(crate) values: Vec<CudaSlice<T>>,
    /// Their gradients, f32: the sum over a step's micro-batches.
    pub(crate) grads: Vec<CudaSlice<f32>>,
    /// AdamW's first and second moments.
    pub(crate) m: Vec<CudaSlice<f32>>,
    pub(crate) v: Vec<CudaSlice<f32>>,
    /// f32 master copies that AdamW updates (the weights receive their rounding), if asked for.
    pub(crate) master: Option<Vec<CudaSlice<f32>>>,
}

impl<T: Element> Params<T> {
    /// Uploads `w`'s tensors (fused as [`fuse`] says) with zero gradients and moments and, with
    /// `master`, f32 copies of the weights.
    pub(crate) fn new(ctx: &Cudnn, cfg: &LlamaConfig, w: &Weights<T>, master: bool) -> Result<Self> {
        let s = ctx.stream();
        let host = fuse(w);
        let ops = cudnn_llm_ops::Error::from;
        let zeros = |n: usize| s.zeros::<f32>(n);
        let mut p = Params {
            ids: Ids::new(cfg),
            values: Vec::new(),
            grads: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            master: master.then(Vec::new),
        };
        for t in &host {
            p.values.push(s.clone_htod(t).map_err(ops)?);
            p.grads.push(zeros(t.len())?);
            p.m.push(zeros(t.len())?);
            p.v.push(zeros(t.len())?);
            if let Some(m) = &mut p.master {
                let wide: Vec<f32> = t.iter().map(|v| v.to_f64() as f32).collect();
                m.push(s.clone_htod(&wide).map_err(ops)?);
            }
        }
        debug_assert_eq!(p.values.len(), p.ids.len());
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_tensors_split_back_into_the_hugging_face_ones() {
        for tied in [false, true] {
            let cfg = LlamaConfig { tie_embeddings: tied, ..LlamaConfig::tiny() };
            let w = Weights::<f32>::random(&cfg, 9);
            let ids = Ids::new(&cfg);
            let fused = fuse(&w);
            assert_eq!(fused.len(), ids.len());
            let layer = ids.layer(&fused, 1);
            // Q rows, then K, then V.
            let l1 = &w.layers[1];
            assert_eq!(layer.qkv.len(), cfg.qkv_width() * cfg.hidden);
            assert_eq!(&layer.qkv[..l1.q_proj.len()], &l1.q_proj.data[..]);
            assert_eq!(&layer.qkv[layer.qkv.len() - l1.v_proj.len()..], &l1.v_proj.data[..]);
            assert_eq!(layer.down, &l1.down_proj.data);
            assert_eq!(fused[ids.norm()], w.norm.data);
            assert_eq!(fused[ids.head()], w.lm_head.as_ref().unwrap_or(&w.embed).data);
            assert_eq!(split(&cfg, fused), w, "tied {tied}");
        }
    }

    #[test]
    fn layers_are_disjoint_and_cover_the_list() {
        let cfg = LlamaConfig::tiny().with_layers(3);
        let ids = Ids::new(&cfg);
        let mut list: Vec<usize> = (0..ids.len()).collect();
        let mut seen = vec![ids.embed(), ids.norm(), ids.head()];
        for l in 0..3 {
            let t = ids.layer_mut(&mut list, l);
            seen.extend([*t.attn_norm, *t.qkv, *t.o_proj, *t.mlp_norm, *t.gate, *t.up, *t.down]);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..ids.len()).collect::<Vec<_>>());
        assert_eq!(Ids::new(&LlamaConfig { tie_embeddings: true, ..cfg }).head(), 0);
    }
}
