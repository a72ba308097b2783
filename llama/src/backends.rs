//! Which backend each module runs on: one choice per module kind, overridable per layer, with a string
//! form for command lines (`fused=all`, `fused=prenorm,gqa`, `fused=all;naive=rope@0-3`). Layer
//! overrides are kept as ranges, never expanded layer by layer, and [`Backends::check_layers`] (which
//! the model runs on every forward) refuses ranges past a model's last layer.

use crate::{Backend, Error, Result};
use std::collections::BTreeMap;

/// The kinds of module a forward pass is made of. Each has a range name like an NVTX profile of the
/// PyTorch model (`fwd.layer.attn.prenorm`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ModuleKind {
    /// The RMSNorms before attention and before the MLP.
    Prenorm,
    /// The fused Q/K/V projection.
    QkvProj,
    /// Rotary position embedding of Q and K.
    Rope,
    /// Grouped-query attention.
    Gqa,
    /// The attention output projection (with the residual add).
    OProj,
    /// Gate, up and down projections with SiLU and the residual add.
    Mlp,
    /// The final RMSNorm.
    OutputNorm,
    /// The vocabulary projection.
    LmHead,
}

impl ModuleKind {
    /// Every kind, in forward order.
    pub const ALL: [ModuleKind; 8] = [
        ModuleKind::Prenorm,
        ModuleKind::QkvProj,
        ModuleKind::Rope,
        ModuleKind::Gqa,
        ModuleKind::OProj,
        ModuleKind::Mlp,
        ModuleKind::OutputNorm,
        ModuleKind::LmHead,
    ];

    /// The name used in selection strings: `prenorm`, `qkv_proj`, `rope`, `gqa`, `o_proj`, `mlp`,
    /// `output_norm`, `lm_head`.
    pub fn name(self) -> &'static str {
        match self {
            ModuleKind::Prenorm => "prenorm",
            ModuleKind::QkvProj => "qkv_proj",
            ModuleKind::Rope => "rope",
            ModuleKind::Gqa => "gqa",
            ModuleKind::OProj => "o_proj",
            ModuleKind::Mlp => "mlp",
            ModuleKind::OutputNorm => "output_norm",
            ModuleKind::LmHead => "lm_head",
        }
    }

    /// Parses [`ModuleKind::name`].
    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            Error::Backends(format!(
                "unknown module `{s}`: valid modules are all, {}",
                Self::names().join(", ")
            ))
        })
    }

    fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(|k| k.name()).collect()
    }

    /// Whether the kind runs once per layer (the rest run once per forward).
    pub fn per_layer(self) -> bool {
        !matches!(self, ModuleKind::OutputNorm | ModuleKind::LmHead)
    }

    /// Range names of this kind's calls, as an NVTX profile of the reference model shows them.
    pub fn ranges(self) -> &'static [&'static str] {
        match self {
            ModuleKind::Prenorm => &[Site::ATTN_PRENORM.range, Site::MLP_PRENORM.range],
            ModuleKind::QkvProj => &[Site::QKV_PROJ.range],
            ModuleKind::Rope => &[Site::ROPE.range],
            ModuleKind::Gqa => &[Site::GQA.range],
            ModuleKind::OProj => &[Site::O_PROJ.range],
            ModuleKind::Mlp => &[Site::MLP.range],
            ModuleKind::OutputNorm => &[Site::OUTPUT_NORM.range],
            ModuleKind::LmHead => &[Site::LM_HEAD.range],
        }
    }
}

/// A place in the forward where a module runs: its range name (what NVTX, the observer and the report
/// show) and the kind whose backend it runs on. The two prenorms are two sites of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Site {
    /// Range name, e.g. `fwd.layer.attn.prenorm`.
    pub range: &'static str,
    /// The kind whose backend selection applies.
    pub kind: ModuleKind,
}

impl Site {
    /// The RMSNorm before attention.
    pub const ATTN_PRENORM: Site = Site { range: "fwd.layer.attn.prenorm", kind: ModuleKind::Prenorm };
    /// The fused Q/K/V projection.
    pub const QKV_PROJ: Site = Site { range: "fwd.layer.attn.qkv_proj", kind: ModuleKind::QkvProj };
    /// RoPE on Q and K, and the K/V cache append.
    pub const ROPE: Site = Site { range: "fwd.layer.attn.rope", kind: ModuleKind::Rope };
    /// Grouped-query attention over the cache.
    pub const GQA: Site = Site { range: "fwd.layer.attn.gqa", kind: ModuleKind::Gqa };
    /// The attention output projection with the residual add.
    pub const O_PROJ: Site = Site { range: "fwd.layer.attn.o_proj", kind: ModuleKind::OProj };
    /// The RMSNorm before the MLP.
    pub const MLP_PRENORM: Site = Site { range: "fwd.layer.mlp.prenorm", kind: ModuleKind::Prenorm };
    /// The SwiGLU MLP with the residual add.
    pub const MLP: Site = Site { range: "fwd.layer.mlp.mlp", kind: ModuleKind::Mlp };
    /// The final RMSNorm.
    pub const OUTPUT_NORM: Site = Site { range: "fwd.output_norm", kind: ModuleKind::OutputNorm };
    /// The vocabulary projection.
    pub const LM_HEAD: Site = Site { range: "fwd.lm_head", kind: ModuleKind::LmHead };

    /// Every site, in forward order (the embedding, which has one backend, is
    /// [`EMBED_RANGE`](crate::model::EMBED_RANGE)).
    pub const ALL: [Site; 9] = [
        Site::ATTN_PRENORM,
        Site::QKV_PROJ,
        Site::ROPE,
        Site::GQA,
        Site::O_PROJ,
        Site::MLP_PRENORM,
        Site::MLP,
        Site::OUTPUT_NORM,
        Site::LM_HEAD,
    ];

    /// The backward of each site of [`Site::ALL`], in the same order: the same kind (so a selection
    /// picks one backend for a module's forward and backward) under the range `bwd.` + the forward's
    /// name without `fwd.` (`bwd.layer.mlp.mlp`, ...).
    pub const BACKWARD: [Site; 9] = [
        Site { range: "bwd.layer.attn.prenorm", kind: ModuleKind::Prenorm },
        Site { range: "bwd.layer.attn.qkv_proj", kind: ModuleKind::QkvProj },
        Site { range: "bwd.layer.attn.rope", kind: ModuleKind::Rope },
        Site { range: "bwd.layer.attn.gqa", kind: ModuleKind::Gqa },
        Site { range: "bwd.layer.attn.o_proj", kind: ModuleKind::OProj },
        Site { range: "bwd.layer.mlp.prenorm", kind: ModuleKind::Prenorm },
        Site { range: "bwd.layer.mlp.mlp", kind: ModuleKind::Mlp },
        Site { range: "bwd.output_norm", kind: ModuleKind::OutputNorm },
        Site { range: "bwd.lm_head", kind: ModuleKind::LmHead },
    ];

    /// The backward of this forward site ([`Site::BACKWARD`]); a backward site is its own.
    pub fn backward(self) -> Site {
        match Site::ALL.iter().position(|s| *s == self) {
            Some(i) => Site::BACKWARD[i],
            None => self,
        }
    }
}

/// A backend per module kind, with per-layer overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backends {
    kinds: BTreeMap<ModuleKind, Backend>,
    /// Per kind, inclusive layer ranges `(first, last, backend)`: disjoint, in increasing order, and
    /// touching ranges merged when they agree (so equal selections compare equal).
    layers: BTreeMap<ModuleKind, Vec<(usize, usize, Backend)>>,
}

impl Backends {
    /// Every module on `backend`.
    pub fn all(backend: Backend) -> Self {
        Backends { kinds: ModuleKind::ALL.iter().map(|&k| (k, backend)).collect(), layers: BTreeMap::new() }
    }

    /// This kind on `backend` in every layer (clearing its per-layer overrides).
    pub fn with(mut self, kind: ModuleKind, backend: Backend) -> Self {
        self.kinds.insert(kind, backend);
        self.layers.remove(&kind);
        self
    }

    /// This kind on `backend` in one layer.
    pub fn with_layer(self, layer: usize, kind: ModuleKind, backend: Backend) -> Self {
        self.with_layers(layer, layer, kind, backend)
    }

    /// This kind on `backend` in layers `first..=last` (nothing when `first > last`). Kept as one
    /// range, whatever its length.
    pub fn with_layers(mut self, first: usize, last: usize, kind: ModuleKind, backend: Backend) -> Self {
        if first > last {
            return self;
        }
        let old = self.layers.remove(&kind).unwrap_or_default();
        let mut ranges = Vec::with_capacity(old.len() + 2);
        for (a, b, be) in old {
            if b < first || a > last {
                ranges.push((a, b, be));
                continue;
            }
            // The parts of an overlapped range outside the new one stay (a < first ≥ 1, b > last).
            if a < first {
                ranges.push((a, first - 1, be));
            }
            if b > last {
                ranges.push((last + 1, b, be));
            }
        }
        ranges.push((first, last, backend));
        ranges.sort_unstable_by_key(|r| r.0);
        let mut merged: Vec<(usize, usize, Backend)> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(m) if m.2 == r.2 && m.1.checked_add(1) == Some(r.0) => m.1 = r.1,
                _ => merged.push(r),
            }
        }
        self.layers.insert(kind, merged);
        self
    }

    /// The backend of `kind` in `layer` (`None` for the once-per-forward kinds).
    pub fn get(&self, layer: Option<usize>, kind: ModuleKind) -> Backend {
        layer
            .and_then(|l| {
                let ranges = self.layers.get(&kind)?;
                ranges.iter().find(|&&(a, b, _)| (a..=b).contains(&l)).map(|r| r.2)
            })
            .unwrap_or(self.kinds[&kind])
    }

    /// Checks every per-layer override against a model of `layers` layers: a range reaching past the
    /// last layer is an error naming it.
    pub fn check_layers(&self, layers: usize) -> Result<()> {
        for (kind, ranges) in &self.layers {
            if let Some(&(a, b, be)) = ranges.iter().find(|r| r.1 >= layers) {
                let at = if a == b { format!("{a}") } else { format!("{a}-{b}") };
                return Err(Error::Backends(format!(
                    "`{}={}@{at}` reaches past layer {}, the last of a {layers}-layer model",
                    be.name(),
                    kind.name(),
                    layers.saturating_sub(1)
                )));
            }
        }
        Ok(())
    }

    /// [`Backends::parse`], then [`Backends::check_layers`] for a model of `layers` layers.
    pub fn parse_for(s: &str, layers: usize) -> Result<Self> {
        let b = Self::parse(s)?;
        b.check_layers(layers)?;
        Ok(b)
    }

    /// Parses a selection: clauses `fused=LIST` or `naive=LIST` separated by `;` and applied left to
    /// right over an all-naive start; LIST is comma-separated module names or `all`, each optionally
    /// limited to layers with `@N` or `@N-M` (inclusive). `fused=prenorm,gqa` fuses those two kinds,
    /// `fused=all;naive=rope@0-3` fuses everything but RoPE in layers 0 to 3. Empty means all naive.
    /// Ranges are not checked against a model (use [`Backends::parse_for`]), and cost the same whatever
    /// their length.
    pub fn parse(s: &str) -> Result<Self> {
        let mut out = Backends::all(Backend::Naive);
        for clause in s.split(';').map(str::trim).filter(|c| !c.is_empty()) {
            let (side, list) = clause.split_once('=').ok_or_else(|| {
                Error::Backends(format!("`{clause}`: expected fused=MODULES or naive=MODULES"))
            })?;
            let backend = match side.trim() {
                "fused" => Backend::Fused,
                "naive" => Backend::Naive,
                other => {
                    return Err(Error::Backends(format!("`{other}` is not a backend: use fused or naive")))
                }
            };
            for item in list.split(',').map(str::trim) {
                let (name, layers) = match item.split_once('@') {
                    Some((n, l)) => (n, Some(parse_layers(l)?)),
                    None => (item, None),
                };
                let kinds =
                    if name == "all" { ModuleKind::ALL.to_vec() } else { vec![ModuleKind::parse(name)?] };
                for kind in kinds {
                    out = match layers {
                        None => out.with(kind, backend),
                        Some(_) if !kind.per_layer() => {
                            return Err(Error::Backends(format!(
                                "`{item}`: {} runs once per forward, not per layer",
                                kind.name()
                            )))
                        }
                        Some((a, b)) => out.with_layers(a, b, kind, backend),
                    };
                }
            }
        }
        Ok(out)
    }

    /// The shortest selection string that [`Backends::parse`] reads back as this (kinds first, then
    /// per-layer overrides).
    pub fn to_selection(&self) -> String {
        let fused: Vec<&str> =
            ModuleKind::ALL.iter().filter(|&&k| self.kinds[&k] == Backend::Fused).map(|k| k.name()).collect();
        let mut clauses = Vec::new();
        if fused.len() == ModuleKind::ALL.len() {
            clauses.push("fused=all".to_string());
        } else if !fused.is_empty() {
            clauses.push(format!("fused={}", fused.join(",")));
        }
        for (kind, ranges) in &self.layers {
            for &(a, b, be) in ranges {
                let at = if a == b { format!("{a}") } else { format!("{a}-{b}") };
                clauses.push(format!("{}={}@{at}", be.name(), kind.name()));
            }
        }
        clauses.join(";")
    }
}

fn parse_layers(s: &str) -> Result<(usize, usize)> {
    let num = |x: &str| {
        x.trim().parse::<usize>().map_err(|_| Error::Backends(format!("`{s}` is not a layer or a range N-M")))
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(s)?, num(s)?),
    };
    if a > b {
        return Err(Error::Backends(format!("layer range `{s}` is empty")));
    }
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use Backend::{Fused, Naive};

    #[test]
    fn selections_parse() {
        let all = Backends::parse("fused=all").unwrap();
        assert!(ModuleKind::ALL.iter().all(|&k| all.get(Some(3), k) == Fused && all.get(None, k) == Fused));
        assert_eq!(Backends::parse("").unwrap(), Backends::all(Naive));
        let two = Backends::parse("fused=prenorm,gqa").unwrap();
        assert_eq!(two.get(Some(0), ModuleKind::Prenorm), Fused);
        assert_eq!(two.get(Some(0), ModuleKind::Gqa), Fused);
        assert_eq!(two.get(Some(0), ModuleKind::Rope), Naive);
        assert_eq!(two.get(None, ModuleKind::OutputNorm), Naive);
        let mixed = Backends::parse("fused=all; naive=rope@0-1, mlp@3").unwrap();
        assert_eq!(mixed.get(Some(0), ModuleKind::Rope), Naive);
        assert_eq!(mixed.get(Some(1), ModuleKind::Rope), Naive);
        assert_eq!(mixed.get(Some(2), ModuleKind::Rope), Fused);
        assert_eq!(mixed.get(Some(3), ModuleKind::Mlp), Naive);
        assert_eq!(mixed.get(Some(3), ModuleKind::Gqa), Fused);
        // A later whole-kind clause clears earlier per-layer overrides.
        let again = Backends::parse("naive=gqa@2;fused=gqa").unwrap();
        assert_eq!(again.get(Some(2), ModuleKind::Gqa), Fused);
    }

    #[test]
    fn bad_selections_list_the_valid_names() {
        let e = Backends::parse("fused=prenorm,attention").unwrap_err().to_string();
        assert!(
            e.contains("`attention`")
                && e.contains("all, prenorm, qkv_proj, rope, gqa, o_proj, mlp, output_norm, lm_head"),
            "{e}"
        );
        for (bad, expected) in [
            ("prenorm", "expected fused=MODULES"),
            ("cudnn=all", "`cudnn` is not a backend"),
            ("fused=gqa@x", "not a layer"),
            ("fused=gqa@3-1", "is empty"),
            ("fused=output_norm@0", "once per forward"),
            ("fused=", "unknown module ``"),
        ] {
            let e = Backends::parse(bad).unwrap_err().to_string();
            assert!(e.contains(expected), "{bad}: {e}");
        }
    }

    #[test]
    fn selection_strings_round_trip() {
        for s in [
            "fused=all",
            "fused=prenorm,gqa",
            "",
            "fused=all;naive=rope@0;naive=rope@1",
            "fused=qkv_proj;fused=mlp@2",
        ] {
            let b = Backends::parse(s).unwrap();
            assert_eq!(Backends::parse(&b.to_selection()).unwrap(), b, "{s} -> {}", b.to_selection());
        }
        assert_eq!(Backends::all(Fused).to_selection(), "fused=all");
        assert_eq!(Backends::parse("fused=gqa,prenorm").unwrap().to_selection(), "fused=prenorm,gqa");
    }

    #[test]
    fn layer_ranges_are_kept_as_ranges_and_checked_against_the_model() {
        // One range to the end of usize: parsed at once, one entry (the old parser made one per layer).
        let huge = Backends::parse("fused=gqa@0-18446744073709551615").unwrap();
        assert_eq!(huge.layers[&ModuleKind::Gqa], vec![(0, usize::MAX, Fused)]);
        assert_eq!(huge.get(Some(usize::MAX), ModuleKind::Gqa), Fused);
        assert_eq!(huge.to_selection(), "fused=gqa@0-18446744073709551615");
        let e = huge.check_layers(32).unwrap_err().to_string();
        assert!(
            e.contains(
                "`fused=gqa@0-18446744073709551615` reaches past layer 31, the last of a 32-layer model"
            ),
            "{e}"
        );
        let e = Backends::parse_for("fused=all;naive=mlp@32", 32).unwrap_err().to_string();
        assert!(e.contains("`naive=mlp@32` reaches past layer 31"), "{e}");
        let ok = Backends::parse_for("fused=all;naive=mlp@0-31", 32).unwrap();
        assert_eq!(ok.get(Some(31), ModuleKind::Mlp), Naive);
        Backends::all(Fused).check_layers(1).unwrap();
        // Overlapping ranges split and merge like per-layer writes applied in order.
        let sel = "fused=rope@2-9;naive=rope@4-5;fused=rope@5-6;naive=rope@0-2;fused=rope@3";
        let b = Backends::parse(sel).unwrap();
        let mut expected = [Naive; 12];
        for (range, be) in [(2..=9, Fused), (4..=5, Naive), (5..=6, Fused), (0..=2, Naive), (3..=3, Fused)] {
            for l in range {
                expected[l] = be;
            }
        }
        for (l, e) in expected.iter().enumerate() {
            assert_eq!(b.get(Some(l), ModuleKind::Rope), *e, "layer {l}");
        }
        assert_eq!(
            b.layers[&ModuleKind::Rope],
            vec![(0, 2, Naive), (3, 3, Fused), (4, 4, Naive), (5, 9, Fused)]
        );
        assert_eq!(Backends::parse(&b.to_selection()).unwrap(), b);
        // Layer by layer or as one range: the same selection.
        assert_eq!(
            Backends::parse("naive=gqa@1;naive=gqa@2;naive=gqa@3").unwrap(),
            Backends::parse("naive=gqa@1-3").unwrap()
        );
    }

    #[test]
    fn kinds_have_names_and_ranges() {
        for k in ModuleKind::ALL {
            assert_eq!(ModuleKind::parse(k.name()).unwrap(), k);
            assert!(k.ranges().iter().all(|r| r.starts_with("fwd.")));
        }
        assert_eq!(ModuleKind::Prenorm.ranges(), &["fwd.layer.attn.prenorm", "fwd.layer.mlp.prenorm"]);
        assert!(!ModuleKind::LmHead.per_layer() && ModuleKind::Gqa.per_layer());
    }

    #[test]
    fn every_range_is_one_site_and_every_kind_has_its_sites() {
        for k in ModuleKind::ALL {
            let sites: Vec<&str> = Site::ALL.iter().filter(|s| s.kind == k).map(|s| s.range).collect();
            assert_eq!(k.ranges(), sites.as_slice(), "{k:?}");
        }
        let mut ranges: Vec<&str> = Site::ALL.iter().map(|s| s.range).collect();
        ranges.sort_unstable();
        ranges.dedup();
        assert_eq!(ranges.len(), Site::ALL.len());
        // Forward order: the kinds' first sites come in ModuleKind::ALL's order.
        let mut order: Vec<ModuleKind> = Vec::new();
        for s in Site::ALL {
            if !order.contains(&s.kind) {
                order.push(s.kind);
            }
        }
        assert_eq!(order, ModuleKind::ALL);
    }

    #[test]
    fn backward_sites_mirror_the_forward_ones() {
        for (f, b) in Site::ALL.iter().zip(Site::BACKWARD) {
            assert_eq!(f.backward(), b);
            assert_eq!(b.backward(), b);
            assert_eq!(b.kind, f.kind);
            assert_eq!(b.range.strip_prefix("bwd."), f.range.strip_prefix("fwd."), "{}", b.range);
        }
    }
}
