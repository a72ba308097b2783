//! Host weights in Hugging Face layout: seeded random init for tests and benches, and `safetensors`
//! checkpoints (one file, or shards named by `model.safetensors.index.json`).
//!
//! Linear weights are stored as Hugging Face stores them, `[out_features, in_features]`, so a layer
//! computes `y = x · Wᵀ`. Every tensor has one name and shape, given by [`Weights::names`] in a stable
//! order; [`Weights::random`], [`Weights::load`] and [`Weights::save`] all walk that list.
//!
//! 1. `Weights::<bf16>::random(&cfg, seed)` needs no files.
//! 2. `Weights::<bf16>::load(&cfg, dir)` memory-maps the checkpoint and converts bf16, f16 or f32 to `T`.
//! 3. `weights.save(&cfg, file, DataType::BF16)` writes one `safetensors` file with the same names.

use crate::json::UniqueMap;
use crate::{Error, LlamaConfig, Result};
use cudnn_llm_ops::half::{bf16, f16};
use cudnn_llm_ops::reference::random_iter;
use cudnn_llm_ops::staging::Source;
use cudnn_llm_ops::{DataType, Element};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A host tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` elements.
    pub data: Vec<T>,
}

impl<T: Element> Tensor<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The values widened to f64 (exact), for CPU references.
    pub fn to_f64(&self) -> Vec<f64> {
        self.data.iter().map(|v| v.to_f64()).collect()
    }
}

/// One decoder layer's weights. Linear weights are `[out_features, in_features]`.
///
/// Exhaustive on purpose, like [`Weights`]: a loader of another checkpoint format builds it as a
/// literal, and a new tensor here (a bias, a norm) is a new model architecture, which no default
/// could fill.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights<T> {
    /// RMSNorm scale before attention, `[hidden]`.
    pub attn_norm: Tensor<T>,
    /// `[heads · head_dim, hidden]`.
    pub q_proj: Tensor<T>,
    /// `[kv_heads · head_dim, hidden]`.
    pub k_proj: Tensor<T>,
    /// `[kv_heads · head_dim, hidden]`.
    pub v_proj: Tensor<T>,
    /// `[hidden, heads · head_dim]`.
    pub o_proj: Tensor<T>,
    /// RMSNorm scale before the MLP, `[hidden]`.
    pub mlp_norm: Tensor<T>,
    /// `[ffn, hidden]`.
    pub gate_proj: Tensor<T>,
    /// `[ffn, hidden]`.
    pub up_proj: Tensor<T>,
    /// `[hidden, ffn]`.
    pub down_proj: Tensor<T>,
}

impl<T> LayerWeights<T> {
    /// The nine tensors in [`Weights::names`] order, mutably.
    #[cfg(test)]
    fn tensors_mut(&mut self) -> [&mut Tensor<T>; 9] {
        [
            &mut self.attn_norm,
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.mlp_norm,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
        ]
    }

    /// The nine tensors in [`Weights::names`] order, as upload sources.
    pub(crate) fn sources(&self) -> [&dyn Source<T>; 9]
    where
        T: Copy + Sync,
    {
        self.tensors().map(|t| t as &dyn Source<T>)
    }

    /// The nine tensors in [`Weights::names`] order.
    fn tensors(&self) -> [&Tensor<T>; 9] {
        [
            &self.attn_norm,
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.mlp_norm,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }
}

/// The whole model's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights<T> {
    /// Token embeddings, `[vocab, hidden]`.
    pub embed: Tensor<T>,
    /// Decoder layers, first to last.
    pub layers: Vec<LayerWeights<T>>,
    /// Final RMSNorm scale, `[hidden]`.
    pub norm: Tensor<T>,
    /// Output projection, `[vocab, hidden]`; `None` when tied to [`Weights::embed`].
    pub lm_head: Option<Tensor<T>>,
}

/// Hugging Face's per-layer suffixes, in [`LayerWeights::tensors`] order.
pub(crate) const LAYER_TENSORS: [&str; 9] = [
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

pub(crate) const EMBED: &str = "model.embed_tokens.weight";
pub(crate) const NORM: &str = "model.norm.weight";
pub(crate) const LM_HEAD: &str = "lm_head.weight";
const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

impl<T: Element> Weights<T> {
    /// Hugging Face names and shapes of every tensor `cfg` needs, in a stable order: the embedding, each
    /// layer's nine tensors, the final norm, then `lm_head.weight` unless the embeddings are tied.
    /// Meant for configs [`LlamaConfig::check`] accepts (shapes saturate otherwise).
    pub fn names(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
        let (h, q, kv, f) =
            (cfg.hidden, cfg.attn_width(), cfg.kv_heads.saturating_mul(cfg.head_dim), cfg.ffn);
        let layer = [
            vec![h],
            vec![q, h],
            vec![kv, h],
            vec![kv, h],
            vec![h, q],
            vec![h],
            vec![f, h],
            vec![f, h],
            vec![h, f],
        ];
        let mut names = vec![(EMBED.to_string(), vec![cfg.vocab, h])];
        for i in 0..cfg.layers {
            for (suffix, shape) in LAYER_TENSORS.iter().zip(&layer) {
                names.push((format!("model.layers.{i}.{suffix}.weight"), shape.clone()));
            }
        }
        names.push((NORM.to_string(), vec![h]));
        if !cfg.tie_embeddings {
            names.push((LM_HEAD.to_string(), vec![cfg.vocab, h]));
        }
        names
    }

    /// Seeded random weights, deterministic for a seed. Each tensor draws from
    /// [`cudnn_llm_ops::reference::random_values`] with its own seed, mixed from `seed` and its name: the embedding is uniform in
    /// ±1, Linear weights in ±1/√in_features, and norm scales are `1 + 0.1·u`, never zero. Values are
    /// rounded to `T`. `cfg` must pass [`LlamaConfig::check`] (its sizes are what gets allocated).
    pub fn random(cfg: &LlamaConfig, seed: u64) -> Self {
        let names = Self::names(cfg);
        let make = |name: &str, shape: &[usize]| -> Tensor<T> {
            let n = shape.iter().product();
            let value = random_init(name, shape);
            let data = random_iter(tensor_seed(seed, name)).take(n).map(|u| T::from_f64(value(u))).collect();
            Tensor { shape: shape.to_vec(), data }
        };
        // Tensors are independent streams: fill them on every core (an 8B model is 8e9 draws).
        let next = std::sync::atomic::AtomicUsize::new(0);
        let slots: Vec<std::sync::Mutex<Option<Tensor<T>>>> =
            names.iter().map(|_| Default::default()).collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(names.len());
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((name, shape)) = names.get(i) else { break };
                    let t = make(name, shape);
                    *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
                });
            }
        });
        let tensors = slots
            .into_iter()
            .map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every slot was filled"));
        Self::from_tensors(cfg, tensors)
    }

    /// Loads a Hugging Face checkpoint. `path` is a directory holding `model.safetensors` or
    /// `model.safetensors.index.json` plus the shards its `weight_map` names, an index file itself, or
    /// a single `.safetensors` file.
    ///
    /// Files are memory-mapped; bf16, f16 and f32 tensors are converted to `T`. Tensors the config
    /// does not need (such as `rotary_emb.inv_freq`) are ignored, and so is `lm_head.weight` when
    /// `cfg.tie_embeddings`. A missing or mis-shaped tensor, another dtype, a tensor name a file's
    /// header lists twice, an unreadable file or a bad index (one naming a tensor twice, or a shard that
    /// is not a plain file name in the index's directory) is an [`Error::Weights`] naming the tensor
    /// and the file. A config [`LlamaConfig::check`] refuses is an [`Error::Config`].
    pub fn load(cfg: &LlamaConfig, path: &Path) -> Result<Self> {
        cudnn_llm_ops::startup::timed("weights read", || Self::read(cfg, path), |_| "safetensors".into())
    }

    fn read(cfg: &LlamaConfig, path: &Path) -> Result<Self> {
        cfg.check()?;
        let wanted = Self::names(cfg);
        let files = locate(path, &wanted)?;
        let (shards, maps) = map_shards(&files)?;
        let tables = shards
            .iter()
            .zip(&maps)
            .map(|(p, map)| SafeTensors::deserialize(map).map_err(st_fail(p)))
            .collect::<Result<Vec<_>>>()?;
        let jobs: Vec<_> = wanted.into_iter().zip(&files).collect();
        let tensors = map_parallel(&jobs, |((name, shape), file)| {
            let table = &tables[shards.binary_search(file).expect("every file was mapped")];
            read(table, name.clone(), shape.clone(), file, cfg.fp8.as_ref())
        })
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_tensors(cfg, tensors))
    }

    /// Writes one `safetensors` file at `path` with Hugging Face names, in `dtype` (bf16, f16 or f32),
    /// with the metadata `{"format": "pt"}` that `save_pretrained` writes (transformers checks it). The
    /// weights must have the shapes [`Weights::names`] gives for `cfg`.
    pub fn save(&self, cfg: &LlamaConfig, path: &Path, dtype: DataType) -> Result<()> {
        let names = Self::names(cfg);
        let tensors: Vec<&Tensor<T>> = self.tensors().collect();
        if names.len() != tensors.len() {
            let (n, m) = (names.len(), tensors.len());
            return Err(fail(format!("config `{}` has {n} tensors, these weights {m}", cfg.name)));
        }
        for ((name, shape), t) in names.iter().zip(&tensors) {
            if *shape != t.shape || t.len() != shape.iter().product::<usize>() {
                let (found, len) = (&t.shape, t.len());
                return Err(fail(format!("`{name}` has shape {found:?} ({len} values), expected {shape:?}")));
            }
        }
        let file_dtype = match dtype {
            DataType::BF16 => Dtype::BF16,
            DataType::F16 => Dtype::F16,
            DataType::F32 => Dtype::F32,
            other => return Err(fail(format!("cannot save weights as {other}: expected bf16, f16 or f32"))),
        };
        let bytes: Vec<Vec<u8>> = tensors.iter().map(|t| encode(&t.data, dtype)).collect();
        let views = names
            .into_iter()
            .zip(&bytes)
            .map(|((name, shape), b)| {
                Ok((name, TensorView::new(file_dtype, shape, b).map_err(st_fail(path))?))
            })
            .collect::<Result<Vec<_>>>()?;
        // transformers refuses a safetensors file whose metadata names another format than its own.
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(metadata), path).map_err(st_fail(path))
    }

    /// Total elements over all tensors.
    pub fn len(&self) -> usize {
        self.tensors().map(Tensor::len).sum()
    }

    /// Whether there are no elements at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Element> Weights<T> {
    /// These weights as an FP8 model multiplies by them
    /// ([`Llama::quantize_to_fp8`](crate::Llama::quantize_to_fp8) with `scales`): each layer
    /// projection quantized to E4M3 with one factor per output row, or one per tensor (the host's
    /// `quantize`, the device kernel's rule) and dequantized; the rest as it is. In f32, for CPU
    /// references of FP8 models.
    pub fn fp8_dequantized(&self, scales: cudnn_llm_ops::WeightScales) -> Weights<f32> {
        use cudnn_llm_ops::ops::quantize::quantize;
        use cudnn_llm_ops::F8E4M3;
        let per_row = scales != cudnn_llm_ops::WeightScales::PerTensor;
        self.map(|t, projection| {
            let values: Vec<f32> = t.data.iter().map(|v| v.to_f64() as f32).collect();
            if !projection {
                return Tensor { shape: t.shape.clone(), data: values };
            }
            let cols = t.shape[1];
            let (codes, factors) = quantize::<F8E4M3>(&values, t.shape[0], cols, per_row);
            let factor = |i: usize| factors[if per_row { i / cols } else { 0 }] as f64;
            let data = codes.iter().enumerate().map(|(i, c)| (c.to_f64() * factor(i)) as f32).collect();
            Tensor { shape: t.shape.clone(), data }
        })
    }
}

/// What needs no arithmetic on the elements (so also host tensors of f64, as the CPU references
/// compute them).
impl<T> Weights<T> {
    /// Every tensor through `f`, which is told whether the tensor is a layer projection (Q, K, V, O,
    /// gate, up, down) rather than a norm, the embedding or `lm_head`.
    pub fn map<U>(&self, f: impl Fn(&Tensor<T>, bool) -> Tensor<U>) -> Weights<U> {
        Weights {
            embed: f(&self.embed, false),
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    attn_norm: f(&l.attn_norm, false),
                    q_proj: f(&l.q_proj, true),
                    k_proj: f(&l.k_proj, true),
                    v_proj: f(&l.v_proj, true),
                    o_proj: f(&l.o_proj, true),
                    mlp_norm: f(&l.mlp_norm, false),
                    gate_proj: f(&l.gate_proj, true),
                    up_proj: f(&l.up_proj, true),
                    down_proj: f(&l.down_proj, true),
                })
                .collect(),
            norm: f(&self.norm, false),
            lm_head: self.lm_head.as_ref().map(|t| f(t, false)),
        }
    }

    /// Every tensor in [`Weights::names`] order.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = &Tensor<T>> {
        std::iter::once(&self.embed)
            .chain(self.layers.iter().flat_map(LayerWeights::tensors))
            .chain(std::iter::once(&self.norm))
            .chain(self.lm_head.as_ref())
    }

    /// Every tensor in [`Weights::names`] order, mutably.
    #[cfg(test)]
    pub(crate) fn tensors_mut(&mut self) -> impl Iterator<Item = &mut Tensor<T>> {
        std::iter::once(&mut self.embed)
            .chain(self.layers.iter_mut().flat_map(LayerWeights::tensors_mut))
            .chain(std::iter::once(&mut self.norm))
            .chain(self.lm_head.as_mut())
    }

    /// Assembles weights from tensors given in [`Weights::names`] order.
    pub(crate) fn from_tensors(cfg: &LlamaConfig, tensors: impl IntoIterator<Item = Tensor<T>>) -> Self {
        let mut it = tensors.into_iter();
        let mut next = || it.next().expect("one tensor per name");
        let embed = next();
        let layers = (0..cfg.layers)
            .map(|_| LayerWeights {
                attn_norm: next(),
                q_proj: next(),
                k_proj: next(),
                v_proj: next(),
                o_proj: next(),
                mlp_norm: next(),
                gate_proj: next(),
                up_proj: next(),
                down_proj: next(),
            })
            .collect();
        let norm = next();
        let lm_head = (!cfg.tie_embeddings).then(next);
        Weights { embed, layers, norm, lm_head }
    }
}

/// Where one tensor's bytes are.
pub(crate) struct Entry {
    pub(crate) file: usize,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    /// Byte offset of its data in the file.
    pub(crate) offset: usize,
}

/// A Hugging Face checkpoint (one `safetensors` file, or shards named by an index) with every tensor
/// a config needs located and checked, its files memory-mapped; reads copy only the slices asked for.
pub struct Checkpoint {
    pub(crate) files: Vec<PathBuf>,
    pub(crate) maps: Vec<memmap2::Mmap>,
    pub(crate) tensors: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (as [`Weights::load`] takes it) for `cfg`: maps its files and
    /// checks that every tensor `cfg` needs is there with its shape and a bf16, f16 or f32 dtype,
    /// reading headers only. The errors are [`Weights::load`]'s.
    pub fn open(cfg: &LlamaConfig, path: &Path) -> Result<Self> {
        cfg.check()?;
        let wanted = Weights::<f32>::names(cfg);
        let located = locate(path, &wanted)?;
        let (files, maps) = map_shards(&located)?;
        let mut tensors = HashMap::with_capacity(wanted.len());
        for (i, (file, map)) in files.iter().zip(&maps).enumerate() {
            let table = SafeTensors::deserialize(map).map_err(st_fail(file))?;
            for ((name, shape), _) in wanted.iter().zip(&located).filter(|(_, f)| *f == file) {
                let view = tensor_view(&table, name, shape, file)?;
                if !matches!(view.dtype(), Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                    return Err(dtype_error(name, file, view.dtype()));
                }
                let offset = view.data().as_ptr() as usize - map.as_ptr() as usize;
                tensors.insert(
                    name.clone(),
                    Entry { file: i, dtype: view.dtype(), shape: shape.clone(), offset },
                );
            }
        }
        Ok(Checkpoint { files, maps, tensors })
    }

    /// The files mapped.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Tensor `name` as it lies in its file, for an upload that converts it to the model's dtype as
    /// it is staged ([`Uploader::upload_from`](cudnn_llm_ops::Uploader::upload_from)): no host copy
    /// of the whole is made. An [`Error::Weights`] for a name the checkpoint was not opened with.
    pub fn mapped(&self, name: &str) -> Result<Mapped<'_>> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| fail(format!("tensor `{name}` was not located when the checkpoint opened")))?;
        let len: usize = e.shape.iter().product();
        let bytes = &self.maps[e.file][e.offset..e.offset + len * (e.dtype.bitsize() / 8)];
        Ok(Mapped { bytes, dtype: e.dtype, len })
    }

    /// Layer `layer`'s nine tensors in [`Weights::names`] order, as [`Checkpoint::mapped`] gives them.
    pub(crate) fn layer(&self, layer: usize) -> Result<[Mapped<'_>; 9]> {
        let mut out = Vec::with_capacity(9);
        for suffix in LAYER_TENSORS {
            out.push(self.mapped(&format!("model.layers.{layer}.{suffix}.weight"))?);
        }
        Ok(out.try_into().unwrap_or_else(|_| unreachable!("nine layer tensors")))
    }
}

/// A checkpoint's tensor in its file's bytes and dtype (bf16, f16 or f32, checked when the checkpoint
/// opened), written into an upload's staging buffer converted to `T` ([`Checkpoint::mapped`]).
pub struct Mapped<'a> {
    bytes: &'a [u8],
    dtype: Dtype,
    len: usize,
}

impl<T: Element> Source<T> for Mapped<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn write(&self, start: usize, out: &mut [T]) {
        let size = self.dtype.bitsize() / 8;
        decode_to(self.dtype, &self.bytes[start * size..(start + out.len()) * size], out);
    }
}

impl<T: Copy + Sync> Source<T> for Tensor<T> {
    fn len(&self) -> usize {
        self.data.len()
    }

    fn write(&self, start: usize, out: &mut [T]) {
        self.data.write(start, out)
    }
}

/// How [`Weights::random`] turns a draw `u` in [-1, 1) into a value of the tensor `name` of `shape`:
/// norm scales `1 + 0.1·u`, the embedding `u`, Linear weights `u / √in_features`.
pub(crate) fn random_init(name: &str, shape: &[usize]) -> impl Fn(f64) -> f64 {
    let (offset, scale) = match shape {
        [_] => (1.0, 0.1),
        _ if name == EMBED => (0.0, 1.0),
        [_, fan_in] => (0.0, 1.0 / (*fan_in as f64).sqrt()),
        _ => unreachable!("weights are 1-D or 2-D"),
    };
    move |u| offset + scale * u
}

/// A per-tensor seed: FNV-1a over the model seed and the tensor name.
pub(crate) fn tensor_seed(seed: u64, name: &str) -> u64 {
    seed.to_le_bytes()
        .iter()
        .chain(name.as_bytes())
        .fold(0xCBF2_9CE4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01B3))
}

/// The file holding each wanted tensor, in `wanted` order.
pub(crate) fn locate(path: &Path, wanted: &[(String, Vec<usize>)]) -> Result<Vec<PathBuf>> {
    let index = if path.is_dir() {
        if path.join(SINGLE_FILE).is_file() {
            return Ok(vec![path.join(SINGLE_FILE); wanted.len()]);
        }
        if !path.join(INDEX_FILE).is_file() {
            return Err(fail(format!("{}: holds neither {SINGLE_FILE} nor {INDEX_FILE}", path.display())));
        }
        path.join(INDEX_FILE)
    } else if path.extension().is_some_and(|e| e == "json") {
        path.to_path_buf()
    } else {
        return Ok(vec![path.to_path_buf(); wanted.len()]);
    };

    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: UniqueMap<String>,
    }
    let bad = |e: &dyn std::fmt::Display| fail(format!("{}: bad index: {e}", index.display()));
    let json = std::fs::read_to_string(&index).map_err(|e| bad(&e))?;
    let index_map: Index = serde_json::from_str(&json).map_err(|e| bad(&e))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    // Shards are files next to the index: a path (`../x`, `/x`, `a/b`) could name any file.
    let mut shards: Vec<(&String, &String)> = index_map.weight_map.0.iter().collect();
    shards.sort();
    for (name, shard) in shards {
        let mut parts = Path::new(shard).components();
        let plain = matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None))
            && !shard.contains(['/', '\\']);
        if !plain {
            return Err(bad(&format!(
                "shard `{shard}` of tensor `{name}` is not a plain file name in {}",
                dir.display()
            )));
        }
    }
    wanted
        .iter()
        .map(|(name, _)| match index_map.weight_map.0.get(name) {
            Some(shard) => Ok(dir.join(shard)),
            None => Err(fail(format!("tensor `{name}` is missing from {}", index.display()))),
        })
        .collect()
}

/// Refuses a `safetensors` header listing a tensor name twice (the `safetensors` crate keeps the
/// last entry). A header too short or malformed to read is left to `SafeTensors::deserialize` to
/// report.
pub(crate) fn unique_header_names(path: &Path, bytes: &[u8]) -> Result<()> {
    let Some((len, rest)) = bytes.split_first_chunk::<8>() else { return Ok(()) };
    let Some(header) = usize::try_from(u64::from_le_bytes(*len)).ok().and_then(|n| rest.get(..n)) else {
        return Ok(());
    };
    match serde_json::from_slice::<UniqueMap<serde::de::IgnoredAny>>(header) {
        Err(e) if e.is_data() => Err(fail(format!("{}: bad safetensors header: tensor {e}", path.display()))),
        _ => Ok(()),
    }
}

/// Memory-maps a whole file read-only.
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    // SAFETY: the map is read-only and lives only for this load; as with every memory-mapped
    // checkpoint reader, the file must not be truncated or rewritten by another process meanwhile.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| fail(format!("{}: {e}", path.display())))
}

/// Reads one tensor from a file's table, checking its shape and converting it to `T`; in an FP8
/// checkpoint (`fp8`) a weight in E4M3 is dequantized with its factors ([`fp8_weight`]).
fn read<T: Element>(
    table: &SafeTensors,
    name: String,
    shape: Vec<usize>,
    file: &Path,
    fp8: Option<&crate::config::Fp8Checkpoint>,
) -> Result<Tensor<T>> {
    let view = tensor_view(table, &name, &shape, file)?;
    if matches!(view.dtype(), Dtype::F8_E4M3 | Dtype::F8_E5M2) && shape.len() == 2 {
        let Some(scheme) = fp8 else {
            return Err(fail(format!(
                "tensor `{name}` in {} is {:?}, but config.json has no FP8 `quantization_config`",
                file.display(),
                view.dtype()
            )));
        };
        return fp8_weight(table, &name, &view, scheme, file);
    }
    let mut data = Vec::with_capacity(shape.iter().product());
    if !decode_into(view.dtype(), view.data(), &mut data) {
        return Err(dtype_error(&name, file, view.dtype()));
    }
    Ok(Tensor { shape, data })
}

/// The files a checkpoint's tensors are in (`located`, one per tensor), sorted and each once,
/// memory-mapped, each header checked for a name listed twice ([`unique_header_names`]).
fn map_shards(located: &[PathBuf]) -> Result<(Vec<PathBuf>, Vec<memmap2::Mmap>)> {
    let mut files = located.to_vec();
    files.sort();
    files.dedup();
    let maps = files.iter().map(|p| map_file(p)).collect::<Result<Vec<_>>>()?;
    for (file, map) in files.iter().zip(&maps) {
        unique_header_names(file, map)?;
    }
    Ok((files, maps))
}

/// Tensor `name` of `file`'s table, which must be there with `shape`.
fn tensor_view<'a>(
    table: &'a SafeTensors<'a>,
    name: &str,
    shape: &[usize],
    file: &Path,
) -> Result<TensorView<'a>> {
    let view = table
        .tensor(name)
        .map_err(|_| fail(format!("tensor `{name}` is missing from {}", file.display())))?;
    if view.shape() != shape {
        return Err(fail(format!(
            "tensor `{name}` in {} has shape {:?}, expected {shape:?}",
            file.display(),
            view.shape()
        )));
    }
    Ok(view)
}

/// The error for tensor `name` of `file` in a dtype the loaders do not convert.
fn dtype_error(name: &str, file: &Path, dtype: Dtype) -> Error {
    fail(format!("tensor `{name}` in {} has dtype {dtype:?}, expected BF16, F16 or F32", file.display()))
}

/// An FP8 checkpoint's weight `[n, k]` dequantized into `T`: each E4M3 code times its factor from
/// `<name>_scale` (per tensor or per channel) or `<name>_scale_inv` (per block), in f64, rounded
/// once. The factor tensor must be in the same file, of the scheme's shape, finite and positive; a
/// NaN code or an E5M2 weight is an error.
fn fp8_weight<T: Element>(
    table: &SafeTensors,
    name: &str,
    view: &TensorView<'_>,
    scheme: &crate::config::Fp8Checkpoint,
    file: &Path,
) -> Result<Tensor<T>> {
    use crate::config::Fp8Factors;
    use cudnn_llm_ops::F8E4M3;
    let at = |what: String| fail(format!("tensor `{name}` in {}: {what}", file.display()));
    if view.dtype() != Dtype::F8_E4M3 {
        return Err(at(format!("{:?} weights are not supported (E4M3 only)", view.dtype())));
    }
    let (n, k) = (view.shape()[0], view.shape()[1]);
    let factor_name = scheme.factor_name(name);
    let f = table.tensor(&factor_name).map_err(|_| {
        at(format!("its factors `{factor_name}` ({}) are not in the same file", scheme.describe()))
    })?;
    let shapes = scheme.factor_shapes(n, k);
    if !shapes.iter().any(|s| s.as_slice() == f.shape()) {
        return Err(at(format!("`{factor_name}` has shape {:?}, expected {:?}", f.shape(), shapes[0])));
    }
    let mut factors: Vec<f32> = Vec::new();
    if !decode_into(f.dtype(), f.data(), &mut factors) {
        return Err(at(format!("`{factor_name}` is {:?}, expected BF16, F16 or F32", f.dtype())));
    }
    if let Some(bad) = factors.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        return Err(at(format!("`{factor_name}` holds {bad}: factors must be finite and positive")));
    }
    let factor = |i: usize, j: usize| -> f64 {
        f64::from(match scheme.factors {
            Fp8Factors::PerTensor => factors[0],
            Fp8Factors::PerChannel => factors[i],
            Fp8Factors::Blocks { rows, cols } => factors[(i / rows) * k.div_ceil(cols) + j / cols],
        })
    };
    let mut data = Vec::with_capacity(n * k);
    for (idx, &code) in view.data().iter().enumerate() {
        let v = F8E4M3(code).to_f64();
        if v.is_nan() {
            return Err(at(format!("element {idx} is a NaN code")));
        }
        data.push(T::from_f64(v * factor(idx / k, idx % k)));
    }
    Ok(Tensor { shape: vec![n, k], data })
}

/// Appends the little-endian `dtype` values of `bytes` to `out`, converted to `T`; false (and nothing
/// appended) for a dtype other than bf16, f16 or f32.
pub(crate) fn decode_into<T: Element>(dtype: Dtype, bytes: &[u8], out: &mut Vec<T>) -> bool {
    match dtype {
        Dtype::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|c| T::from_bf16(bf16::from_le_bytes([c[0], c[1]]))))
        }
        Dtype::F16 => {
            out.extend(bytes.chunks_exact(2).map(|c| T::from_f16(f16::from_le_bytes([c[0], c[1]]))))
        }
        Dtype::F32 => out
            .extend(bytes.chunks_exact(4).map(|c| T::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))),
        _ => return false,
    }
    true
}

/// Writes the little-endian `dtype` values of `bytes` (bf16, f16 or f32, as many as `out` holds) into
/// `out`, converted to `T`; another dtype leaves `out` as it is (checked before by the caller).
fn decode_to<T: Element>(dtype: Dtype, bytes: &[u8], out: &mut [T]) {
    match dtype {
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .zip(out)
            .for_each(|(c, o)| *o = T::from_bf16(bf16::from_le_bytes([c[0], c[1]]))),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .zip(out)
            .for_each(|(c, o)| *o = T::from_f16(f16::from_le_bytes([c[0], c[1]]))),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .zip(out)
            .for_each(|(c, o)| *o = T::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        _ => {}
    }
}

/// Little-endian bytes of `data` rounded to `dtype` (bf16, f16 or f32).
fn encode<T: Element>(data: &[T], dtype: DataType) -> Vec<u8> {
    match dtype {
        // Every Element is exact in f32; half's f32 routes round right (its f64 -> bf16 misjudges ties).
        DataType::BF16 => data.iter().flat_map(|v| bf16::from_f32(v.to_f64() as f32).to_le_bytes()).collect(),
        DataType::F16 => data.iter().flat_map(|v| f16::from_f32(v.to_f64() as f32).to_le_bytes()).collect(),
        DataType::F32 => data.iter().flat_map(|v| (v.to_f64() as f32).to_le_bytes()).collect(),
        other => unreachable!("save checked the dtype, got {other}"),
    }
}

/// An [`Error::Weights`].
pub(crate) fn fail(message: String) -> Error {
    Error::Weights(message)
}

/// Maps a `safetensors` error to one naming `path`.
pub(crate) fn st_fail(path: &Path) -> impl Fn(safetensors::SafeTensorError) -> Error + '_ {
    move |e| fail(format!("{}: {e}", path.display()))
}

/// `f` of every item, in order, computed on one thread per core, each taking the next item left (the
/// tensors of a checkpoint convert independently).
pub(crate) fn map_parallel<I: Sync, O: Send>(items: &[I], f: impl Fn(&I) -> O + Sync) -> Vec<O> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len()).max(1);
    let mut done: Vec<(usize, O)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break mine };
                        mine.push((i, f(item)));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("a worker thread panicked")).collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, o)| o).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    fn temp_dir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("llama-weights-{tag}-")).tempdir().unwrap()
    }

    fn tiny() -> LlamaConfig {
        LlamaConfig::tiny().with_layers(1)
    }

    /// Writes `(name, dtype, shape, bytes)` tensors as one `safetensors` file.
    fn write(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
        let views =
            tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// The tensors of `w` as `write` takes them, in bf16.
    fn entries(cfg: &LlamaConfig, w: &Weights<f32>) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        Weights::<f32>::names(cfg)
            .into_iter()
            .zip(w.tensors())
            .map(|((n, s), t)| (n, Dtype::BF16, s, encode(&t.data, DataType::BF16)))
            .collect()
    }

    fn load_err(cfg: &LlamaConfig, path: &Path) -> String {
        Weights::<f32>::load(cfg, path).unwrap_err().to_string()
    }

    /// `v` rounded to `dtype`, as a file in that dtype holds it.
    fn round(v: f64, dtype: DataType) -> f64 {
        match dtype {
            // The values here are f32s: round through f32, as the loader does.
            DataType::BF16 => bf16::from_f32(v as f32).to_f64(),
            DataType::F16 => f16::from_f32(v as f32).to_f64(),
            DataType::F8E4M3 => cudnn_llm_ops::F8E4M3::from_f64(v).to_f64(),
            DataType::F8E5M2 => cudnn_llm_ops::F8E5M2::from_f64(v).to_f64(),
            _ => v as f32 as f64,
        }
    }

    fn all_f64<T: Element>(w: &Weights<T>) -> Vec<f64> {
        w.tensors().flat_map(Tensor::to_f64).collect()
    }

    /// A tensor as `write` takes it: name, dtype, shape, bytes.
    type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

    /// The tensors of `w` as an FP8 checkpoint of `scheme` holds them: each layer projection as E4M3
    /// codes (from `codes(name, i)`) with f32 factors (from `factor(name, i)`) in `<name>_scale[_inv]`,
    /// the rest in bf16; and the values a load must give for the projections.
    fn fp8_entries(
        cfg: &LlamaConfig,
        w: &Weights<f32>,
        scheme: &crate::config::Fp8Checkpoint,
        code: impl Fn(&str, usize) -> u8,
        factor: impl Fn(&str, usize) -> f32,
    ) -> (Vec<Entry>, HashMap<String, Vec<f64>>) {
        let mut out = Vec::new();
        let mut want = HashMap::new();
        for ((name, shape), t) in Weights::<f32>::names(cfg).into_iter().zip(w.tensors()) {
            let projection = shape.len() == 2 && name != EMBED && name != "lm_head.weight";
            if !projection {
                out.push((name, Dtype::BF16, shape, encode(&t.data, DataType::BF16)));
                continue;
            }
            let (n, k) = (shape[0], shape[1]);
            let fshape = scheme.factor_shapes(n, k).swap_remove(0);
            let fcount: usize = fshape.iter().product();
            let factors: Vec<f32> = (0..fcount).map(|i| factor(&name, i)).collect();
            let codes: Vec<u8> = (0..n * k).map(|i| code(&name, i)).collect();
            let at = |i: usize, j: usize| match scheme.factors {
                crate::config::Fp8Factors::PerTensor => factors[0],
                crate::config::Fp8Factors::PerChannel => factors[i],
                crate::config::Fp8Factors::Blocks { rows, cols } => {
                    factors[(i / rows) * k.div_ceil(cols) + j / cols]
                }
            };
            let values = codes
                .iter()
                .enumerate()
                .map(|(idx, &c)| cudnn_llm_ops::F8E4M3(c).to_f64() * at(idx / k, idx % k) as f64)
                .map(|v| v as f32 as f64)
                .collect();
            want.insert(name.clone(), values);
            let fbytes = factors.iter().flat_map(|f| f.to_le_bytes()).collect();
            out.push((scheme.factor_name(&name), Dtype::F32, fshape, fbytes));
            out.push((name, Dtype::F8_E4M3, shape, codes));
        }
        (out, want)
    }

    #[test]
    fn an_fp8_checkpoint_loads_dequantized_and_what_is_wrong_in_it_is_named() {
        use crate::config::{Fp8Checkpoint, Fp8Factors};
        let dir = temp_dir("fp8");
        let base = tiny();
        let w = Weights::<f32>::random(&base, 9);
        let code = |name: &str, i: usize| {
            ((i * 7 + name.len()) % 0x7f) as u8 | if i.is_multiple_of(3) { 0x80 } else { 0 }
        };
        let factor = |name: &str, i: usize| 2f32.powi(-(((i + name.len()) % 9) as i32)) * 0.75;
        for factors in
            [Fp8Factors::PerChannel, Fp8Factors::PerTensor, Fp8Factors::Blocks { rows: 32, cols: 48 }]
        {
            let scheme = Fp8Checkpoint { method: "test", factors, static_activations: false };
            let cfg = LlamaConfig { fp8: Some(scheme.clone()), ..base.clone() };
            let (entries, want) = fp8_entries(&cfg, &w, &scheme, code, factor);
            let file = dir.path().join("model.safetensors");
            write(&file, &entries);
            let loaded = Weights::<f32>::load(&cfg, &file).unwrap();
            for ((name, _), t) in Weights::<f32>::names(&cfg).iter().zip(loaded.tensors()) {
                if let Some(values) = want.get(name) {
                    assert_eq!(&t.to_f64(), values, "{factors:?} {name}");
                }
            }
            let norm: Vec<f64> = w.norm.to_f64().iter().map(|&v| round(v, DataType::BF16)).collect();
            assert_eq!(loaded.norm.to_f64(), norm);
            // What is wrong in the file is named: a missing or mis-shaped factor tensor, a bad factor,
            // a NaN code, FP8 without a quantization_config.
            let q = "model.layers.0.self_attn.q_proj.weight";
            let fname = scheme.factor_name(q);
            let edited = |f: &dyn Fn(&mut Vec<Entry>)| {
                let mut e = entries.clone();
                f(&mut e);
                write(&file, &e);
                load_err(&cfg, &file)
            };
            let e = edited(&|e| e.retain(|t| t.0 != fname));
            assert!(
                e.contains(&format!("its factors `{fname}`")) && e.contains("not in the same file"),
                "{e}"
            );
            let e = edited(&|e| {
                let t = e.iter_mut().find(|t| t.0 == fname).unwrap();
                t.2 = vec![7, 7];
                t.3 = vec![0; 49 * 4];
            });
            assert!(e.contains("has shape [7, 7], expected"), "{e}");
            let e = edited(&|e| {
                let t = e.iter_mut().find(|t| t.0 == fname).unwrap();
                t.3[..4].copy_from_slice(&0f32.to_le_bytes());
            });
            assert!(e.contains("holds 0: factors must be finite and positive"), "{e}");
            let e = edited(&|e| e.iter_mut().find(|t| t.0 == q).unwrap().3[5] = 0x7f);
            assert!(e.contains("element 5 is a NaN code"), "{e}");
            write(&file, &entries);
            let e = load_err(&base, &file);
            assert!(e.contains("has no FP8 `quantization_config`"), "{e}");
        }
    }

    #[test]
    fn weights_names_and_shapes_of_the_tiny_preset() {
        let cfg = LlamaConfig::tiny();
        let names = Weights::<f32>::names(&cfg);
        assert_eq!(names.len(), 1 + 2 * 9 + 2);
        assert_eq!(names[0], (EMBED.to_string(), vec![512, 128]));
        let layer1: Vec<_> = names[10..19].iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
        assert_eq!(
            layer1,
            [
                ("model.layers.1.input_layernorm.weight", &[128][..]),
                ("model.layers.1.self_attn.q_proj.weight", &[128, 128]),
                ("model.layers.1.self_attn.k_proj.weight", &[64, 128]),
                ("model.layers.1.self_attn.v_proj.weight", &[64, 128]),
                ("model.layers.1.self_attn.o_proj.weight", &[128, 128]),
                ("model.layers.1.post_attention_layernorm.weight", &[128]),
                ("model.layers.1.mlp.gate_proj.weight", &[256, 128]),
                ("model.layers.1.mlp.up_proj.weight", &[256, 128]),
                ("model.layers.1.mlp.down_proj.weight", &[128, 256]),
            ]
        );
        assert_eq!(names[19], ("model.norm.weight".to_string(), vec![128]));
        assert_eq!(names[20], ("lm_head.weight".to_string(), vec![512, 128]));
    }

    #[test]
    fn weights_names_count_every_parameter_of_the_presets() {
        for (cfg, tensors) in
            [(LlamaConfig::llama_3_2_1b(), 1 + 16 * 9 + 1), (LlamaConfig::llama_3_1_8b(), 1 + 32 * 9 + 2)]
        {
            let names = Weights::<bf16>::names(&cfg);
            assert_eq!(names.len(), tensors, "{}", cfg.name);
            assert_eq!(names.iter().any(|(n, _)| n == "lm_head.weight"), !cfg.tie_embeddings);
            let total: usize = names.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
            assert_eq!(total, cfg.parameters(), "{}", cfg.name);
        }
    }

    #[test]
    fn weights_random_is_seeded_bounded_and_never_zero() {
        let cfg = LlamaConfig::tiny();
        let a = Weights::<bf16>::random(&cfg, 7);
        assert_eq!(a, Weights::<bf16>::random(&cfg, 7));
        assert_ne!(a, Weights::<bf16>::random(&cfg, 8));
        assert_eq!((a.len(), a.layers.len(), a.lm_head.is_some()), (cfg.parameters(), 2, true));
        // Distinct seeds per tensor: same-shaped tensors differ.
        assert_ne!(a.layers[0].q_proj, a.layers[1].q_proj);
        assert_ne!(a.layers[0].attn_norm, a.layers[0].mlp_norm);

        let w = Weights::<f32>::random(&cfg, 7);
        // The same draws, rounded to each type (bf16 within half an ulp of the f32 value, plus f32's).
        let close =
            all_f64(&a).iter().zip(all_f64(&w)).all(|(b, f)| (b - f).abs() <= f.abs() * (1.0 / 256.0));
        assert!(close, "bf16 and f32 random weights disagree");
        for ((name, shape), t) in Weights::<f32>::names(&cfg).iter().zip(w.tensors()) {
            assert_eq!(&t.shape, shape);
            assert_eq!(t.len(), shape.iter().product::<usize>());
            let (lo, hi) = match shape[..] {
                [_] => (0.9, 1.1),
                _ if name == EMBED => (-1.0, 1.0),
                [_, fan_in] => (-1.0 / (fan_in as f64).sqrt(), 1.0 / (fan_in as f64).sqrt()),
                _ => unreachable!(),
            };
            let v = t.to_f64();
            assert!(v.iter().all(|&v| v != 0.0 && (lo..=hi).contains(&v)), "{name} outside [{lo}, {hi}]");
            // Spread over the range, not stuck near zero.
            let max = v.iter().fold(f64::MIN, |m, &v| m.max(v));
            assert!(max > hi - (hi - lo) * 0.05, "{name}: max {max}");
        }
        assert!(all_f64(&a).iter().all(|&v| v != 0.0));
    }

    #[test]
    fn fp8_dequantized_weights_round_the_projections_only() {
        use cudnn_llm_ops::WeightScales;
        let cfg = LlamaConfig::tiny();
        let w = Weights::<f32>::random(&cfg, 4);
        for scales in [WeightScales::PerChannel, WeightScales::PerTensor] {
            let q = w.fp8_dequantized(scales);
            assert_eq!(q.embed, w.embed);
            assert_eq!(q.layers[0].attn_norm, w.layers[0].attn_norm);
            let (orig, deq) = (&w.layers[1].down_proj, &q.layers[1].down_proj);
            assert_eq!(orig.shape, deq.shape);
            let cols = orig.shape[1];
            let whole = orig.data.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (r, (a, b)) in orig.data.chunks(cols).zip(deq.data.chunks(cols)).enumerate() {
                let row = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                let amax = if scales == WeightScales::PerTensor { whole } else { row };
                // E4M3 keeps 3 mantissa bits: within 2^-4 of each value, or of the factor's step near zero.
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= x.abs() / 16.0 + amax / 448.0 / 8.0,
                        "{scales:?} row {r}: {x} -> {y}"
                    );
                }
                assert!(a.iter().zip(b).any(|(x, y)| x != y), "{scales:?} row {r} unchanged: not quantized");
            }
        }
        // One factor per tensor is not one per row: the two differ on some value.
        let (c, t) =
            (w.fp8_dequantized(WeightScales::PerChannel), w.fp8_dequantized(WeightScales::PerTensor));
        assert_ne!(c.layers[1].down_proj, t.layers[1].down_proj);
    }

    /// Every tensor of a checkpoint as [`Checkpoint::mapped`] stages it, in runs of `run` values.
    fn staged<T: Element>(cfg: &LlamaConfig, ckpt: &Checkpoint, run: usize) -> Vec<Vec<T>> {
        Weights::<f32>::names(cfg)
            .iter()
            .map(|(name, _)| {
                let m = ckpt.mapped(name).unwrap();
                let mut out = vec![T::default(); Source::<T>::len(&m)];
                for (i, chunk) in out.chunks_mut(run).enumerate() {
                    m.write(i * run, chunk);
                }
                out
            })
            .collect()
    }

    #[test]
    fn a_mapped_checkpoint_stages_the_values_load_reads() {
        let cfg = tiny();
        let dir = temp_dir("mapped");
        let w = Weights::<f32>::random(&cfg, 3);
        for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
            let file = dir.path().join(format!("{dtype}.safetensors"));
            w.save(&cfg, &file, dtype).unwrap();
            let ckpt = Checkpoint::open(&cfg, &file).unwrap();
            let loaded = Weights::<bf16>::load(&cfg, &file).unwrap();
            let want: Vec<Vec<bf16>> = loaded.tensors().map(|t| t.data.clone()).collect();
            for run in [1, 7, 64, 1 << 20] {
                assert_eq!(staged::<bf16>(&cfg, &ckpt, run), want, "{dtype} into bf16, runs of {run}");
            }
            let loaded = Weights::<f32>::load(&cfg, &file).unwrap();
            let want: Vec<Vec<f32>> = loaded.tensors().map(|t| t.data.clone()).collect();
            assert_eq!(staged::<f32>(&cfg, &ckpt, 33), want, "{dtype} into f32");
            // The layer's nine come in names order.
            let layer = ckpt.layer(0).unwrap();
            let host = w.layers[0].sources();
            assert_eq!(layer.each_ref().map(Source::<f32>::len), host.map(|t| t.len()));
            let e = ckpt.layer(cfg.layers).err().unwrap().to_string();
            assert!(
                e.contains(
                    "`model.layers.1.input_layernorm.weight` was not located when the checkpoint opened"
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn weights_save_load_round_trips_every_dtype() {
        let cfg = tiny();
        let dir = temp_dir("round-trip");
        let w = Weights::<f32>::random(&cfg, 1);
        for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
            let file = dir.path().join(format!("{dtype}.safetensors"));
            w.save(&cfg, &file, dtype).unwrap();
            let bytes = std::fs::read(&file).unwrap();
            let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
            let format = meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str);
            assert_eq!(format, Some("pt"), "transformers reads this metadata");
            let as_f32 = Weights::<f32>::load(&cfg, &file).unwrap();
            let in_file: Vec<f64> = all_f64(&w).iter().map(|&v| round(v, dtype)).collect();
            assert_eq!(all_f64(&as_f32), in_file, "{dtype} into f32");
            let as_bf16 = Weights::<bf16>::load(&cfg, &file).unwrap();
            let expected: Vec<f64> = in_file.iter().map(|&v| round(v, DataType::BF16)).collect();
            assert_eq!(all_f64(&as_bf16), expected, "{dtype} into bf16");
            if dtype == DataType::F32 {
                assert_eq!(as_f32, w);
            }
            if dtype == DataType::BF16 {
                // Same dtype both ways is exact, also through a directory holding model.safetensors.
                let model_dir = dir.path().join("bf16-model");
                std::fs::create_dir_all(&model_dir).unwrap();
                as_bf16.save(&cfg, &model_dir.join(SINGLE_FILE), dtype).unwrap();
                assert_eq!(Weights::<bf16>::load(&cfg, &model_dir).unwrap(), as_bf16);
            }
        }
        let e = w.save(&cfg, &dir.path().join("x.safetensors"), DataType::I64).unwrap_err().to_string();
        assert!(e.contains("i64"), "{e}");
        let e = w
            .save(&LlamaConfig::tiny(), &dir.path().join("x.safetensors"), DataType::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("config `tiny` has 21 tensors, these weights 12"), "{e}");
        let mut bad = w.clone();
        bad.norm.shape = vec![127];
        let e = bad.save(&cfg, &dir.path().join("x.safetensors"), DataType::F32).unwrap_err().to_string();
        assert!(e.contains("`model.norm.weight` has shape [127] (128 values), expected [128]"), "{e}");
    }

    #[test]
    fn weights_load_a_sharded_checkpoint() {
        let cfg = tiny();
        let dir = temp_dir("sharded");
        let w = Weights::<f32>::random(&cfg, 2);
        let mut all = entries(&cfg, &w);
        // Checkpoints often carry buffers the model does not need.
        let inv_freq = vec![0u8; 16 * 4];
        all.push(("model.layers.0.self_attn.rotary_emb.inv_freq".into(), Dtype::F32, vec![16], inv_freq));
        let second = all.split_off(6);
        let shards =
            [("model-00001-of-00002.safetensors", all), ("model-00002-of-00002.safetensors", second)];
        let mut weight_map = serde_json::Map::new();
        for (file, tensors) in &shards {
            write(&dir.path().join(file), tensors);
            for (name, ..) in tensors {
                weight_map.insert(name.clone(), (*file).into());
            }
        }
        let index =
            serde_json::json!({ "metadata": { "total_size": w.len() * 2 }, "weight_map": weight_map });
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();

        let expected: Vec<f64> = all_f64(&w).iter().map(|&v| round(v, DataType::BF16)).collect();
        let from_dir = Weights::<f32>::load(&cfg, dir.path()).unwrap();
        assert_eq!(all_f64(&from_dir), expected);
        assert_eq!(Weights::<f32>::load(&cfg, &dir.path().join(INDEX_FILE)).unwrap(), from_dir);

        // A shard the index names but that is not there.
        std::fs::remove_file(dir.path().join(shards[1].0)).unwrap();
        let e = load_err(&cfg, dir.path());
        assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
    }

    #[test]
    fn weights_load_reports_missing_and_mis_shaped_tensors() {
        let cfg = tiny();
        let dir = temp_dir("bad-tensors");
        let file = dir.path().join("model.safetensors");
        let good = entries(&cfg, &Weights::random(&cfg, 3));

        let mut missing = good.clone();
        missing.retain(|(n, ..)| n != "model.layers.0.mlp.up_proj.weight");
        write(&file, &missing);
        let e = load_err(&cfg, &file);
        assert!(
            e.contains("`model.layers.0.mlp.up_proj.weight` is missing") && e.contains("model.safetensors"),
            "{e}"
        );

        let mut transposed = good.clone();
        transposed[3].2 = vec![128, 64];
        write(&file, &transposed);
        let e = load_err(&cfg, &file);
        assert!(e.contains("model.layers.0.self_attn.k_proj.weight"), "{e}");
        assert!(e.contains("has shape [128, 64], expected [64, 128]"), "{e}");

        let mut ints = good.clone();
        let norm = ints.iter_mut().find(|(n, ..)| n == "model.norm.weight").unwrap();
        (norm.1, norm.3) = (Dtype::I64, vec![1u8; 128 * 8]);
        write(&file, &ints);
        let e = load_err(&cfg, &file);
        assert!(e.contains("`model.norm.weight`") && e.contains("dtype I64"), "{e}");

        // Untied configs need lm_head.weight.
        let mut headless = good;
        headless.retain(|(n, ..)| n != "lm_head.weight");
        write(&file, &headless);
        let e = load_err(&cfg, &file);
        assert!(e.contains("`lm_head.weight` is missing"), "{e}");
    }

    #[test]
    fn weights_load_reports_bad_files_and_indexes() {
        let cfg = tiny();
        let dir = temp_dir("bad-files");
        let e = load_err(&cfg, &dir.path().join("nowhere.safetensors"));
        assert!(e.contains("nowhere.safetensors"), "{e}");
        let e = load_err(&cfg, dir.path());
        assert!(e.contains("neither model.safetensors nor model.safetensors.index.json"), "{e}");

        std::fs::write(dir.path().join(INDEX_FILE), "{\"weight_map\": [").unwrap();
        let e = load_err(&cfg, dir.path());
        assert!(e.contains("model.safetensors.index.json: bad index"), "{e}");
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"weight_map": {"model.norm.weight": "a.safetensors"}}"#,
        )
        .unwrap();
        let e = load_err(&cfg, dir.path());
        assert!(e.contains("`model.embed_tokens.weight` is missing from") && e.contains("index.json"), "{e}");

        let junk = dir.path().join("junk.safetensors");
        std::fs::write(&junk, b"not a safetensors file").unwrap();
        let e = load_err(&cfg, &junk);
        assert!(e.starts_with("weights: ") && e.contains("junk.safetensors"), "{e}");
    }

    #[test]
    fn weights_load_refuses_a_tensor_named_twice_in_a_header() {
        let cfg = tiny();
        let dir = temp_dir("duplicate");
        let file = dir.path().join("model.safetensors");
        Weights::<f32>::random(&cfg, 5).save(&cfg, &file, DataType::F32).unwrap();
        Weights::<f32>::load(&cfg, &file).unwrap();
        // Repeat the final norm's entry (same offsets, so that the `safetensors` crate, which keeps
        // the last entry, loads it without complaint) at the front of the header.
        let bytes = std::fs::read(&file).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let entry = header["model.norm.weight"].to_string();
        let text = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        let doubled = format!("{{\"model.norm.weight\":{entry},{}", &text[1..]);
        let mut out = (doubled.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(doubled.as_bytes());
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&file, &out).unwrap();
        assert!(SafeTensors::deserialize(&out).is_ok(), "the safetensors crate alone accepts it");
        let e = load_err(&cfg, &file);
        assert!(e.contains("`model.norm.weight` is given twice") && e.contains("model.safetensors"), "{e}");
    }

    #[test]
    fn weights_index_shards_must_be_plain_file_names() {
        let cfg = tiny();
        let dir = temp_dir("escape");
        let ckpt = dir.path().join("ckpt");
        std::fs::create_dir_all(&ckpt).unwrap();
        // A complete checkpoint one level up, which `../` would reach.
        Weights::<f32>::random(&cfg, 6)
            .save(&cfg, &dir.path().join("outside.safetensors"), DataType::F32)
            .unwrap();
        let index = |shard: &str| {
            let map: serde_json::Map<String, serde_json::Value> =
                Weights::<f32>::names(&cfg).into_iter().map(|(n, _)| (n, shard.into())).collect();
            std::fs::write(ckpt.join(INDEX_FILE), serde_json::json!({ "weight_map": map }).to_string())
                .unwrap();
        };
        let outside = dir.path().join("outside.safetensors");
        for shard in ["../outside.safetensors", outside.to_str().unwrap(), "sub/x.safetensors", "..", ".", ""]
        {
            index(shard);
            let e = load_err(&cfg, &ckpt);
            assert!(
                e.contains(&format!("shard `{shard}` of tensor `")) && e.contains("not a plain file name"),
                "{e}"
            );
        }
        // The same shard as a plain name inside the directory loads.
        std::fs::copy(&outside, ckpt.join("inside.safetensors")).unwrap();
        index("inside.safetensors");
        Weights::<f32>::load(&cfg, &ckpt).unwrap();
        // An index naming a tensor twice.
        let json = r#"{"weight_map": {"model.norm.weight": "inside.safetensors", "model.norm.weight": "x.safetensors"}}"#;
        std::fs::write(ckpt.join(INDEX_FILE), json).unwrap();
        let e = load_err(&cfg, &ckpt);
        assert!(e.contains("bad index: `model.norm.weight` is given twice"), "{e}");
        // A config check refuses is refused before any file is read.
        let e =
            Weights::<f32>::load(&LlamaConfig { rope_theta: -1.0, ..cfg }, &ckpt).unwrap_err().to_string();
        assert!(e.starts_with("config: ") && e.contains("rope_theta -1"), "{e}");
    }

    #[test]
    fn weights_tied_config_ignores_lm_head_in_the_file() {
        let untied = tiny();
        let tied = LlamaConfig { tie_embeddings: true, ..tiny() };
        let dir = temp_dir("tied");
        let file = dir.path().join("model.safetensors");
        let w = Weights::<f32>::random(&untied, 4);
        w.save(&untied, &file, DataType::F32).unwrap();
        let loaded = Weights::<f32>::load(&tied, &file).unwrap();
        assert!(loaded.lm_head.is_none());
        assert_eq!((loaded.embed, loaded.layers, loaded.norm), (w.embed, w.layers, w.norm));
        assert_eq!(Weights::<f32>::random(&tied, 4).lm_head, None);
    }

    /// The largest shape `LlamaConfig::check` accepts names its tensors (its sizes do not overflow).
    #[test]
    fn the_largest_accepted_shape_names_its_tensors() {
        use crate::config::{MAX_LAYERS, MAX_TENSOR_ELEMENTS};
        let big = LlamaConfig {
            vocab: MAX_TENSOR_ELEMENTS / (1 << 14),
            hidden: 1 << 14,
            layers: MAX_LAYERS,
            ffn: MAX_TENSOR_ELEMENTS / (1 << 14),
            ..LlamaConfig::tiny()
        };
        big.check().unwrap();
        assert_eq!(Weights::<f32>::names(&big).len(), 1 + 9 * MAX_LAYERS + 2);
    }
}
