//! A rank's weights, read slice by slice: from a memory-mapped Hugging Face checkpoint (only the
//! bytes of the rank's slices are touched, so no rank reads the whole file into host memory), or
//! drawn as [`Weights::random`] draws them, skipping to the slice's values (equal, value for value,
//! to the same slices of the whole random model).

use super::shard::{Part, ShardPlan, Slice};
use crate::config::LlamaConfig;
use crate::weights::{self, Checkpoint, LayerWeights, Tensor, Weights};
use crate::{Error, Result};
use cudnn_llm_ops::reference::random_iter_from;
use cudnn_llm_ops::Element;
use std::path::Path;
use std::sync::Arc;

/// Where the ranks' weights come from.
#[derive(Clone)]
pub enum WeightSource {
    /// [`Weights::random`] with this seed, each rank drawing only its slices.
    Random {
        /// The model seed.
        seed: u64,
    },
    /// A checkpoint opened (headers checked, files mapped) by [`Checkpoint::open`].
    Checkpoint(Arc<Checkpoint>),
}

impl std::fmt::Debug for WeightSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightSource::Random { seed } => write!(f, "Random {{ seed: {seed} }}"),
            WeightSource::Checkpoint(c) => write!(f, "Checkpoint({:?})", c.files),
        }
    }
}

impl Checkpoint {
    /// `slice` of the tensor `name`, converted to `T` (only its bytes are read).
    pub fn read<T: Element>(&self, name: &str, slice: &Slice) -> Result<Tensor<T>> {
        let e = self.tensors.get(name).ok_or_else(|| {
            weights::fail(format!("tensor `{name}` was not located when the checkpoint opened"))
        })?;
        check_slice(name, &e.shape, slice)?;
        let size = e.dtype.bitsize() / 8;
        let map = &self.maps[e.file];
        let shape = slice.shape(&e.shape);
        let mut data = Vec::with_capacity(shape.iter().product());
        for (start, len) in slice.runs(&e.shape) {
            let bytes = &map[e.offset + start * size..e.offset + (start + len) * size];
            // The dtype was checked when the checkpoint opened.
            weights::decode_into(e.dtype, bytes, &mut data);
        }
        Ok(Tensor { shape, data })
    }
}

/// An [`Error::Weights`] unless `slice` fits a tensor of `shape`.
fn check_slice(name: &str, shape: &[usize], slice: &Slice) -> Result<()> {
    let fits = match (slice, shape) {
        (Slice::Whole, _) => true,
        (Slice::Rows(r), [rows, _]) => r.start <= r.end && r.end <= *rows,
        (Slice::Cols(c), [_, cols]) => c.start <= c.end && c.end <= *cols,
        _ => false,
    };
    if fits {
        Ok(())
    } else {
        Err(Error::Weights(format!("slice {slice:?} does not fit tensor `{name}` of shape {shape:?}")))
    }
}

/// `slice` of the tensor `name` of `shape` as [`Weights::random`] draws it for `seed`, drawing only
/// the slice's values, on up to `threads` threads.
pub fn random_slice<T: Element>(
    seed: u64,
    name: &str,
    shape: &[usize],
    slice: &Slice,
    threads: usize,
) -> Result<Tensor<T>> {
    check_slice(name, shape, slice)?;
    let (tensor_seed, value) = (weights::tensor_seed(seed, name), weights::random_init(name, shape));
    let out_shape = slice.shape(shape);
    let mut data = vec![T::default(); out_shape.iter().product()];
    // One contiguous piece of the output per thread (at least 64 Ki values each), as runs of the
    // tensor's elements: a run that crosses a piece's end is split there.
    let per = data.len().div_ceil(threads.max(1)).max(1 << 16);
    let mut pieces: Vec<Vec<(usize, usize)>> = vec![Vec::new(); data.len().div_ceil(per)];
    let mut out = 0;
    for (start, len) in slice.runs(shape) {
        let mut done = 0;
        while done < len {
            let k = (out + done) / per;
            let n = ((k + 1) * per - (out + done)).min(len - done);
            pieces[k].push((start + done, n));
            done += n;
        }
        out += len;
    }
    std::thread::scope(|scope| {
        for (chunk, runs) in data.chunks_mut(per).zip(&pieces) {
            let value = &value;
            scope.spawn(move || {
                let mut at = 0;
                for &(start, n) in runs {
                    let draws = random_iter_from(tensor_seed, start as u64);
                    for (slot, u) in chunk[at..at + n].iter_mut().zip(draws) {
                        *slot = T::from_f64(value(u));
                    }
                    at += n;
                }
            });
        }
    });
    Ok(Tensor { shape: out_shape, data })
}

impl WeightSource {
    /// A checkpoint source: [`Checkpoint::open`].
    pub fn checkpoint(cfg: &LlamaConfig, path: &Path) -> Result<Self> {
        Ok(WeightSource::Checkpoint(Arc::new(Checkpoint::open(cfg, path)?)))
    }

    /// `slice` of the tensor `name` of `shape` (`threads` for random draws).
    pub fn tensor<T: Element>(
        &self,
        name: &str,
        shape: &[usize],
        slice: &Slice,
        threads: usize,
    ) -> Result<Tensor<T>> {
        match self {
            WeightSource::Random { seed } => random_slice(*seed, name, shape, slice, threads),
            WeightSource::Checkpoint(c) => c.read(name, slice),
        }
    }
}

/// What one rank builds its shard from: the plan, the whole model's tensor names and shapes, the
/// source, and the threads it may draw random weights on.
pub(crate) struct RankSource<'a> {
    pub(crate) cfg: &'a LlamaConfig,
    pub(crate) plan: &'a ShardPlan,
    pub(crate) rank: usize,
    pub(crate) source: &'a WeightSource,
    pub(crate) threads: usize,
    names: Vec<(String, Vec<usize>)>,
}

impl<'a> RankSource<'a> {
    pub(crate) fn new(
        cfg: &'a LlamaConfig,
        plan: &'a ShardPlan,
        rank: usize,
        source: &'a WeightSource,
        threads: usize,
    ) -> Self {
        RankSource { cfg, plan, rank, source, threads, names: Weights::<f32>::names(cfg) }
    }

    fn read<T: Element>(&self, index: usize, part: Part) -> Result<Tensor<T>> {
        let (name, shape) = &self.names[index];
        self.source.tensor(name, shape, &self.plan.slice(self.rank, part), self.threads)
    }

    /// Layer `layer`'s weights in the rank's shapes ([`ShardPlan::local`]).
    pub(crate) fn layer<T: Element>(&self, layer: usize) -> Result<LayerWeights<T>> {
        let at = 1 + 9 * layer;
        let [attn_norm, q_proj, k_proj, v_proj, o_proj, mlp_norm, gate_proj, up_proj, down_proj] =
            std::array::from_fn::<_, 9, _>(|i| (at + i, Part::LAYER[i]));
        Ok(LayerWeights {
            attn_norm: self.read(attn_norm.0, attn_norm.1)?,
            q_proj: self.read(q_proj.0, q_proj.1)?,
            k_proj: self.read(k_proj.0, k_proj.1)?,
            v_proj: self.read(v_proj.0, v_proj.1)?,
            o_proj: self.read(o_proj.0, o_proj.1)?,
            mlp_norm: self.read(mlp_norm.0, mlp_norm.1)?,
            gate_proj: self.read(gate_proj.0, gate_proj.1)?,
            up_proj: self.read(up_proj.0, up_proj.1)?,
            down_proj: self.read(down_proj.0, down_proj.1)?,
        })
    }

    /// The whole embedding table.
    pub(crate) fn embed<T: Element>(&self) -> Result<Tensor<T>> {
        self.read(0, Part::Embed)
    }

    /// The final norm.
    pub(crate) fn norm<T: Element>(&self) -> Result<Tensor<T>> {
        self.read(1 + 9 * self.cfg.layers, Part::Norm)
    }

    /// The rank's `lm_head` rows (of the embedding when tied).
    pub(crate) fn lm_head<T: Element>(&self) -> Result<Tensor<T>> {
        let index = if self.cfg.tie_embeddings { 0 } else { 2 + 9 * self.cfg.layers };
        self.read(index, Part::LmHead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudnn_llm_ops::half::bf16;
    use cudnn_llm_ops::DataType;

    /// Rows `r` (or columns `c`) of a 2-D host tensor, the slow obvious way.
    fn take<T: Copy>(t: &Tensor<T>, s: &Slice) -> Tensor<T> {
        let (rows, cols) = match t.shape[..] {
            [r, c] => (r, c),
            _ => return t.clone(),
        };
        let mut data = Vec::new();
        for i in 0..rows {
            for j in 0..cols {
                let keep = match s {
                    Slice::Whole => true,
                    Slice::Rows(r) => r.contains(&i),
                    Slice::Cols(c) => c.contains(&j),
                };
                if keep {
                    data.push(t.data[i * cols + j]);
                }
            }
        }
        Tensor { shape: s.shape(&t.shape), data }
    }

    /// Every rank's layer weights and head from `source`, against slices of `whole`.
    fn assert_shards_match<T: Element + PartialEq + std::fmt::Debug>(
        cfg: &LlamaConfig,
        ranks: usize,
        whole: &Weights<T>,
        source: &WeightSource,
    ) {
        let plan = ShardPlan::new(cfg, ranks).unwrap();
        let local = plan.local(cfg);
        for rank in 0..ranks {
            let rs = RankSource::new(cfg, &plan, rank, source, 3);
            for (l, w) in whole.layers.iter().enumerate() {
                let got: LayerWeights<T> = rs.layer(l).unwrap();
                let expected = [
                    &w.attn_norm,
                    &w.q_proj,
                    &w.k_proj,
                    &w.v_proj,
                    &w.o_proj,
                    &w.mlp_norm,
                    &w.gate_proj,
                    &w.up_proj,
                    &w.down_proj,
                ];
                let got_all = [
                    &got.attn_norm,
                    &got.q_proj,
                    &got.k_proj,
                    &got.v_proj,
                    &got.o_proj,
                    &got.mlp_norm,
                    &got.gate_proj,
                    &got.up_proj,
                    &got.down_proj,
                ];
                for ((part, e), g) in Part::LAYER.iter().zip(expected).zip(got_all) {
                    assert_eq!(*g, take(e, &plan.slice(rank, *part)), "rank {rank} layer {l} {part:?}");
                }
                // The rank's tensors have the local config's Hugging Face shapes.
                let names = Weights::<T>::names(&local);
                for ((_, shape), g) in names[1 + 9 * l..10 + 9 * l].iter().zip(got_all) {
                    assert_eq!(&g.shape, shape, "rank {rank} layer {l}");
                }
            }
            assert_eq!(rs.embed::<T>().unwrap(), whole.embed);
            assert_eq!(rs.norm::<T>().unwrap(), whole.norm);
            let head = whole.lm_head.as_ref().unwrap_or(&whole.embed);
            let rows = plan.vocab_rows(rank);
            let got = rs.lm_head::<T>().unwrap();
            assert_eq!(got, take(head, &Slice::Rows(rows.clone())), "rank {rank} lm_head");
            assert_eq!(got.shape, [plan.vocab, cfg.hidden]);
        }
    }

    #[test]
    fn random_shards_are_slices_of_the_whole_random_model() {
        let cfg = LlamaConfig::tiny();
        let whole = Weights::<f32>::random(&cfg, 11);
        for ranks in [1, 2, 4] {
            assert_shards_match(&cfg, ranks, &whole, &WeightSource::Random { seed: 11 });
        }
        // Tied embeddings: lm_head's rows come from the embedding.
        let tied = LlamaConfig { tie_embeddings: true, ..LlamaConfig::tiny().with_layers(1) };
        assert_shards_match(&tied, 2, &Weights::<bf16>::random(&tied, 3), &WeightSource::Random { seed: 3 });
        // K/V heads replicated: 2 K/V heads over 4 ranks.
        let plan = ShardPlan::new(&cfg, 4).unwrap();
        assert_eq!((plan.kv_heads, plan.kv_replicas), (1, 2));
    }

    #[test]
    fn random_slices_split_over_threads_draw_the_same_values() {
        let shape = [300, 700];
        let whole: Tensor<f32> = random_slice(5, "x.weight", &shape, &Slice::Whole, 1).unwrap();
        for threads in [1, 2, 7] {
            for s in [Slice::Whole, Slice::Rows(17..290), Slice::Cols(3..650), Slice::Cols(0..1)] {
                let t: Tensor<f32> = random_slice(5, "x.weight", &shape, &s, threads).unwrap();
                assert_eq!(t, take(&whole, &s), "{s:?} on {threads} threads");
            }
        }
        let e = random_slice::<f32>(5, "x.weight", &shape, &Slice::Rows(299..301), 2).unwrap_err();
        assert!(e.to_string().contains("does not fit tensor `x.weight` of shape [300, 700]"), "{e}");
    }

    #[test]
    fn checkpoint_shards_are_slices_of_the_whole_checkpoint() {
        let cfg = LlamaConfig::tiny();
        let dir = tempfile::Builder::new().prefix("llama-tp-shards-").tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        let w = Weights::<f32>::random(&cfg, 21);
        for dtype in [DataType::BF16, DataType::F32] {
            w.save(&cfg, &file, dtype).unwrap();
            let whole = Weights::<f32>::load(&cfg, &file).unwrap();
            let source = WeightSource::checkpoint(&cfg, &file).unwrap();
            for ranks in [1, 2, 4] {
                assert_shards_match(&cfg, ranks, &whole, &source);
            }
        }
        // A shard-by-shard read of a directory with an index, as Hugging Face stores 8B and 70B.
        let sharded = dir.path().join("sharded");
        std::fs::create_dir_all(&sharded).unwrap();
        let names = Weights::<f32>::names(&cfg);
        let (first, second) = names.split_at(names.len() / 2);
        let mut map = serde_json::Map::new();
        let all: Vec<&Tensor<f32>> = w.tensors().collect();
        for (k, part) in [first, second].iter().enumerate() {
            let shard = format!("model-0000{}-of-00002.safetensors", k + 1);
            let offset = if k == 0 { 0 } else { first.len() };
            let bytes: Vec<Vec<u8>> = all[offset..offset + part.len()]
                .iter()
                .map(|t| t.data.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect())
                .collect();
            let views = part.iter().zip(&bytes).map(|((n, s), b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::tensor::Dtype::BF16, s.clone(), b)
                        .unwrap(),
                )
            });
            safetensors::serialize_to_file(views, None, &sharded.join(&shard)).unwrap();
            for (n, _) in part.iter() {
                map.insert(n.clone(), shard.clone().into());
            }
        }
        let index = serde_json::json!({ "weight_map": map }).to_string();
        std::fs::write(sharded.join("model.safetensors.index.json"), index).unwrap();
        let whole = Weights::<bf16>::load(&cfg, &sharded).unwrap();
        let source = WeightSource::checkpoint(&cfg, &sharded).unwrap();
        let WeightSource::Checkpoint(c) = &source else { unreachable!() };
        assert_eq!(c.files().len(), 2);
        assert_shards_match(&cfg, 2, &whole, &source);
    }

    #[test]
    fn checkpoint_errors_name_the_tensor_and_file() {
        let cfg = LlamaConfig::tiny();
        let dir = tempfile::Builder::new().prefix("llama-tp-bad-").tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        Weights::<f32>::random(&cfg.clone().with_layers(1), 1)
            .save(&cfg.clone().with_layers(1), &file, DataType::BF16)
            .unwrap();
        // Two layers asked, one in the file.
        let e = Checkpoint::open(&cfg, &file).err().unwrap().to_string();
        assert!(
            e.contains("`model.layers.1.input_layernorm.weight` is missing")
                && e.contains("model.safetensors"),
            "{e}"
        );
        let one = cfg.with_layers(1);
        let c = Checkpoint::open(&one, &file).unwrap();
        let e = c.read::<f32>("model.norm.weight", &Slice::Rows(0..1)).unwrap_err().to_string();
        assert!(e.contains("does not fit tensor `model.norm.weight` of shape [128]"), "{e}");
        let e = c.read::<f32>("lm_head.bias", &Slice::Whole).unwrap_err().to_string();
        assert!(e.contains("`lm_head.bias` was not located"), "{e}");
        let e = Checkpoint::open(&one, &dir.path().join("nowhere")).err().unwrap().to_string();
        assert!(e.contains("nowhere"), "{e}");
    }
}
