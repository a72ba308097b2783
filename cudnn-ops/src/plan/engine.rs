//! Engine configurations: the heuristics' choices read back as (engine, knob values), the knobs an
//! engine exposes, and new configurations built from chosen knob values (the frontend's
//! `create_execution_plan(engine_id, knobs)`), for the knob search next to the heuristics.

use crate::descriptor::{Attr, Descriptor};
use crate::{Error, Result};
use cudnn_llm_sys as sys;
use sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D};

/// Values a knob search tries per knob at most (the first ones of its range).
pub(crate) const MAX_KNOB_VALUES: usize = 64;

/// One tunable knob of an engine: its type and the values it takes, `min..=max` by `stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct KnobRange {
    /// The raw `cudnnBackendKnobType_t` (see [`knob_name`]).
    pub kind: u32,
    /// Smallest value.
    pub min: i64,
    /// Largest value.
    pub max: i64,
    /// Step between values (at least 1).
    pub stride: i64,
}

impl KnobRange {
    /// The values, at most `cap` of them, from the smallest.
    pub fn values(&self, cap: usize) -> impl Iterator<Item = i64> {
        let stride = self.stride.max(1);
        // i128: cuDNN may report extreme ranges (e.g. i64::MIN..=i64::MAX).
        let span = self.max as i128 - self.min as i128;
        let count =
            if span < 0 { 0 } else { usize::try_from(span / stride as i128 + 1).unwrap_or(usize::MAX) };
        let min = self.min as i128;
        // In i128: `i · stride` alone may pass i64::MAX while `min + i · stride` stays <= max.
        (0..count.min(cap)).filter_map(move |i| i64::try_from(min + i as i128 * stride as i128).ok())
    }
}

/// The header's name of a knob type, lower case without the `CUDNN_KNOB_TYPE_` prefix.
pub fn knob_name(kind: u32) -> &'static str {
    const NAMES: [&str; 44] = [
        "split_k",
        "swizzle",
        "tile_size",
        "use_tex",
        "edge",
        "kblock",
        "ldga",
        "ldgb",
        "chunk_k",
        "split_h",
        "wino_tile",
        "multiply",
        "split_k_buf",
        "tilek",
        "stages",
        "reduction_mode",
        "cta_split_k_mode",
        "split_k_slc",
        "idx_mode",
        "sliced",
        "split_rs",
        "singlebuffer",
        "ldgc",
        "specfilt",
        "kernel_cfg",
        "workspace",
        "tile_cga",
        "tile_cga_m",
        "tile_cga_n",
        "block_size",
        "occupancy",
        "array_size_per_thread",
        "num_c_per_block",
        "split_cols",
        "tile_rows",
        "tile_cols",
        "load_size",
        "cta_count",
        "stream_k",
        "split_p_slc",
        "tile_m",
        "tile_n",
        "warp_spec_cfg",
        "swap_ab",
    ];
    NAMES.get(kind as usize).copied().unwrap_or("unknown")
}

/// An engine and its knob values: what an engine configuration descriptor holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EngineChoice {
    pub(crate) index: i64,
    /// (knob type, value) in the order cuDNN lists them.
    pub(crate) knobs: Vec<(u32, i64)>,
}

impl EngineChoice {
    /// Reads a (heuristics-made or finalized) engine configuration back.
    pub(crate) fn read(config: &Descriptor) -> Result<Self> {
        let engine = config.get_descriptors(
            A::CUDNN_ATTR_ENGINECFG_ENGINE,
            D::CUDNN_BACKEND_ENGINE_DESCRIPTOR,
            Some(1),
        )?;
        let engine = engine.first().ok_or_else(|| Error::invalid("engine config without engine"))?;
        let index = engine.get_i64(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
        let choices =
            knob_list(config, A::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, D::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)?;
        let mut knobs = Vec::with_capacity(choices.len());
        for k in choices {
            let kind = knob_type(&k, A::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE)?;
            knobs.push((kind, k.get_i64(A::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?));
        }
        Ok(EngineChoice { index, knobs })
    }

    /// The frontend's engine tag: `eng<global index>` then `_k<knob type>=<value>` per knob
    /// (`unknown` for a configuration that could not be read back).
    pub(crate) fn tag(&self) -> String {
        if self.index < 0 {
            return "unknown".into();
        }
        let mut tag = format!("eng{}", self.index);
        for (kind, value) in &self.knobs {
            tag += &format!("_k{kind}={value}");
        }
        tag
    }

    /// The same engine and knobs with `kind` set to `value` (added if the configuration lacks it).
    fn with(&self, kind: u32, value: i64) -> Self {
        let mut next = self.clone();
        match next.knobs.iter_mut().find(|(k, _)| *k == kind) {
            Some(slot) => slot.1 = value,
            None => next.knobs.push((kind, value)),
        }
        next
    }

    /// Whether `other` names the same configuration (knob order aside).
    pub(crate) fn same(&self, other: &Self) -> bool {
        let sorted = |c: &Self| {
            let mut k = c.knobs.clone();
            k.sort_unstable();
            k
        };
        self.index == other.index && sorted(self) == sorted(other)
    }

    /// Every configuration one knob away from this one: each knob of `ranges` set to each of its
    /// values (at most [`MAX_KNOB_VALUES`]), taking the knobs in turn (first value of each, then the
    /// second, ...) so that a budget cut short still varies every knob.
    pub(crate) fn neighbours(&self, ranges: &[KnobRange]) -> Vec<Self> {
        let per_knob: Vec<Vec<Self>> = ranges
            .iter()
            .map(|r| {
                r.values(MAX_KNOB_VALUES).map(|v| self.with(r.kind, v)).filter(|n| !n.same(self)).collect()
            })
            .collect();
        let longest = per_knob.iter().map(Vec::len).max().unwrap_or(0);
        (0..longest).flat_map(|i| per_knob.iter().filter_map(move |k| k.get(i).cloned())).collect()
    }

    /// Builds and finalizes this configuration for `graph`. The engine and knob-choice descriptors
    /// come back with it (the configuration refers to them).
    pub(crate) fn build(&self, graph: &Descriptor) -> Result<(Descriptor, Vec<Descriptor>)> {
        let engine = engine(graph, self.index)?;
        let mut parts = vec![engine];
        for &(kind, value) in &self.knobs {
            let mut choice = Descriptor::new(D::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)?;
            choice.set(
                A::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                Attr::KnobType(sys::cudnnBackendKnobType_t(kind)),
            )?;
            choice.set(A::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, Attr::I64(&[value]))?;
            choice.finalize("knob choice")?;
            parts.push(choice);
        }
        let mut config = Descriptor::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)?;
        config.set(A::CUDNN_ATTR_ENGINECFG_ENGINE, Attr::Descriptors(&[&parts[0]]))?;
        let choices: Vec<&Descriptor> = parts[1..].iter().collect();
        if !choices.is_empty() {
            config.set(A::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, Attr::Descriptors(&choices))?;
        }
        config.finalize(&format!("engine config {}", self.tag()))?;
        Ok((config, parts))
    }
}

/// The finalized engine `index` of `graph`.
fn engine(graph: &Descriptor, index: i64) -> Result<Descriptor> {
    let mut engine = Descriptor::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    engine.set(A::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, Attr::Descriptors(&[graph]))?;
    engine.set(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, Attr::I64(&[index]))?;
    engine.finalize(&format!("engine {index}"))?;
    Ok(engine)
}

/// The knob descriptors of `kind` that `d` (an engine or a configuration) lists under `name`.
fn knob_list(
    d: &Descriptor,
    name: sys::cudnnBackendAttributeName_t,
    kind: sys::cudnnBackendDescriptorType_t,
) -> Result<Vec<Descriptor>> {
    d.get_descriptors(name, kind, Some(sys::cudnnBackendKnobType_t::CUDNN_KNOB_TYPE_COUNTS.0 as usize))
}

/// The raw knob type `d` holds under `name`.
fn knob_type(d: &Descriptor, name: sys::cudnnBackendAttributeName_t) -> Result<u32> {
    d.get_enum(name, sys::cudnnBackendAttributeType_t::CUDNN_TYPE_KNOB_TYPE)
}

/// The knobs engine `index` of `graph` exposes.
pub(crate) fn knob_ranges(graph: &Descriptor, index: i64) -> Result<Vec<KnobRange>> {
    let engine = engine(graph, index)?;
    let infos = knob_list(&engine, A::CUDNN_ATTR_ENGINE_KNOB_INFO, D::CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR)?;
    let mut out = Vec::with_capacity(infos.len());
    for info in infos {
        out.push(KnobRange {
            kind: knob_type(&info, A::CUDNN_ATTR_KNOB_INFO_TYPE)?,
            min: info.get_i64(A::CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE)?,
            max: info.get_i64(A::CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE)?,
            stride: info.get_i64(A::CUDNN_ATTR_KNOB_INFO_STRIDE)?,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knob_values_follow_the_stride_and_the_cap() {
        let r = KnobRange { kind: 24, min: 2, max: 11, stride: 3 };
        assert_eq!(r.values(10).collect::<Vec<_>>(), [2, 5, 8, 11]);
        assert_eq!(r.values(2).collect::<Vec<_>>(), [2, 5]);
        let empty = KnobRange { kind: 24, min: 5, max: 4, stride: 1 };
        assert_eq!(empty.values(10).count(), 0);
        let huge = KnobRange { kind: 25, min: i64::MIN, max: i64::MAX, stride: 1 };
        assert_eq!(huge.values(3).collect::<Vec<_>>(), [i64::MIN, i64::MIN + 1, i64::MIN + 2]);
        // 2 · i64::MAX overflows i64 although i64::MIN + 2 · i64::MAX = i64::MAX - 1 is in range.
        let wide = KnobRange { kind: 25, min: i64::MIN, max: i64::MAX, stride: i64::MAX };
        assert_eq!(wide.values(10).collect::<Vec<_>>(), [i64::MIN, -1, i64::MAX - 1]);
        let top = KnobRange { kind: 25, min: i64::MAX - 1, max: i64::MAX, stride: i64::MAX };
        assert_eq!(top.values(10).collect::<Vec<_>>(), [i64::MAX - 1]);
        let negative = KnobRange { kind: 25, min: 0, max: 10, stride: i64::MIN };
        assert_eq!(negative.values(3).collect::<Vec<_>>(), [0, 1, 2]);
        let zero_stride = KnobRange { kind: 17, min: 1, max: 3, stride: 0 };
        assert_eq!(zero_stride.values(10).collect::<Vec<_>>(), [1, 2, 3]);
    }

    #[test]
    fn neighbours_change_one_knob_and_skip_the_base() {
        let base = EngineChoice { index: 7, knobs: vec![(24, 36)] };
        let ranges = [
            KnobRange { kind: 24, min: 35, max: 37, stride: 1 },
            KnobRange { kind: 17, min: 1, max: 2, stride: 1 },
        ];
        let tags: Vec<String> = base.neighbours(&ranges).iter().map(EngineChoice::tag).collect();
        assert_eq!(tags, ["eng7_k24=35", "eng7_k24=36_k17=1", "eng7_k24=37", "eng7_k24=36_k17=2"]);
        let reordered = EngineChoice { index: 7, knobs: vec![(17, 2), (24, 36)] };
        assert!(reordered.same(&base.with(17, 2)));
        assert!(!reordered.same(&base));
        assert_eq!(knob_name(24), "kernel_cfg");
        assert_eq!(knob_name(17), "split_k_slc");
        assert_eq!(knob_name(43), "swap_ab");
        assert_eq!(knob_name(99), "unknown");
    }
}
