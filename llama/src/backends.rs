//! Which backend each module runs on: one choice per module kind, overridable per layer, with a string
//! form for command lines (`fused=all`, `fused=prenorm,gqa`, `fused=all;naive=rope@0-3`).

use crate::{Backend, Error, Result};
use std::collections::BTreeMap;

/// The kinds of module a forward pass is made of. Each has a range name like an NVTX profile of the
/// PyTorch model (`fwd.layer.attn.prenorm`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
            ModuleKind::Prenorm => &["fwd.layer.attn.prenorm", "fwd.layer.mlp.prenorm"],
            ModuleKind::QkvProj => &["fwd.layer.attn.qkv_proj"],
            ModuleKind::Rope => &["fwd.layer.attn.rope"],
            ModuleKind::Gqa => &["fwd.layer.attn.gqa"],
            ModuleKind::OProj => &["fwd.layer.attn.o_proj"],
            ModuleKind::Mlp => &["fwd.layer.mlp.mlp"],
            ModuleKind::OutputNorm => &["fwd.output_norm"],
            ModuleKind::LmHead => &["fwd.lm_head"],
        }
    }
}

/// A backend per module kind, with per-layer overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backends {
    kinds: BTreeMap<ModuleKind, Backend>,
    layers: BTreeMap<(usize, ModuleKind), Backend>,
}

impl Backends {
    /// Every module on `backend`.
    pub fn all(backend: Backend) -> Self {
        Backends { kinds: ModuleKind::ALL.iter().map(|&k| (k, backend)).collect(), layers: BTreeMap::new() }
    }

    /// This kind on `backend` in every layer (clearing its per-layer overrides).
    pub fn with(mut self, kind: ModuleKind, backend: Backend) -> Self {
        self.kinds.insert(kind, backend);
        self.layers.retain(|&(_, k), _| k != kind);
        self
    }

    /// This kind on `backend` in one layer.
    pub fn with_layer(mut self, layer: usize, kind: ModuleKind, backend: Backend) -> Self {
        self.layers.insert((layer, kind), backend);
        self
    }

    /// The backend of `kind` in `layer` (`None` for the once-per-forward kinds).
    pub fn get(&self, layer: Option<usize>, kind: ModuleKind) -> Backend {
        layer.and_then(|l| self.layers.get(&(l, kind)).copied()).unwrap_or(self.kinds[&kind])
    }

    /// Parses a selection: clauses `fused=LIST` or `naive=LIST` separated by `;` and applied left to
    /// right over an all-naive start; LIST is comma-separated module names or `all`, each optionally
    /// limited to layers with `@N` or `@N-M` (inclusive). `fused=prenorm,gqa` fuses those two kinds,
    /// `fused=all;naive=rope@0-3` fuses everything but RoPE in layers 0 to 3. Empty means all naive.
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
                        Some((a, b)) => (a..=b).fold(out, |o, l| o.with_layer(l, kind, backend)),
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
        for (&(layer, kind), &b) in &self.layers {
            clauses.push(format!("{}={}@{layer}", b.name(), kind.name()));
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
    fn kinds_have_names_and_ranges() {
        for k in ModuleKind::ALL {
            assert_eq!(ModuleKind::parse(k.name()).unwrap(), k);
            assert!(k.ranges().iter().all(|r| r.starts_with("fwd.")));
        }
        assert_eq!(ModuleKind::Prenorm.ranges(), &["fwd.layer.attn.prenorm", "fwd.layer.mlp.prenorm"]);
        assert!(!ModuleKind::LmHead.per_layer() && ModuleKind::Gqa.per_layer());
    }
}
