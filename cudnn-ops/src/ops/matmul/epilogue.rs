//! Matmul epilogues: the elementwise steps after `A·B` that a fused graph runs in the same kernel, in a
//! fixed order: `D = ((A·B + bias) → activation) ⊙ U + R`.

use crate::graph::Unary;
use crate::{Error, Result};

/// An elementwise activation applied after the bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Activation {
    /// `x · sigmoid(x)`.
    Silu,
    /// `x · Φ(x)`, the erf form.
    Gelu,
    /// GELU, tanh approximation: `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
}

impl Activation {
    /// Every activation.
    pub const ALL: [Activation; 4] =
        [Activation::Silu, Activation::Gelu, Activation::GeluTanh, Activation::Relu];

    /// `silu`, `gelu`, `gelu_tanh` or `relu`.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Relu => "relu",
        }
    }

    /// The graph's pointwise operation.
    pub fn unary(self) -> Unary {
        match self {
            Activation::Silu => Unary::Silu,
            Activation::Gelu => Unary::Gelu,
            Activation::GeluTanh => Unary::GeluTanh,
            Activation::Relu => Unary::Relu,
        }
    }
}

/// Which epilogue steps follow the matmul; see the [module docs](self) for their fixed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct Epilogue {
    /// Add a bias `[n]`, broadcast over rows.
    pub bias: bool,
    /// Apply an activation (after the bias).
    pub activation: Option<Activation>,
    /// Multiply by an input `U [batch, m, n]` (after the activation).
    pub gate: bool,
    /// Add an input `R [batch, m, n]` (last).
    pub residual: bool,
}

impl Epilogue {
    /// The plain matmul.
    pub const NONE: Epilogue = Epilogue { bias: false, activation: None, gate: false, residual: false };
    /// `A·B + bias`.
    pub const BIAS: Epilogue = Epilogue { bias: true, ..Epilogue::NONE };
    /// `A·B + R`.
    pub const RESIDUAL: Epilogue = Epilogue { residual: true, ..Epilogue::NONE };
    /// The SwiGLU gate `silu(A·B) ⊙ U`.
    pub const SWIGLU: Epilogue =
        Epilogue { activation: Some(Activation::Silu), gate: true, ..Epilogue::NONE };

    /// This epilogue with a bias add.
    pub const fn with_bias(self) -> Self {
        Epilogue { bias: true, ..self }
    }

    /// This epilogue with `activation`.
    pub const fn with_activation(self, activation: Activation) -> Self {
        Epilogue { activation: Some(activation), ..self }
    }

    /// This epilogue with the gate multiply.
    pub const fn with_gate(self) -> Self {
        Epilogue { gate: true, ..self }
    }

    /// This epilogue with the residual add.
    pub const fn with_residual(self) -> Self {
        Epilogue { residual: true, ..self }
    }

    /// Number of steps after the matmul (each one separate kernel on the naive path).
    pub fn steps(self) -> usize {
        self.bias as usize + self.activation.is_some() as usize + self.gate as usize + self.residual as usize
    }

    /// The steps joined by `+` in their order, e.g. `bias+silu+residual`; `none` for the plain matmul.
    /// Used in cache keys' debug output, errors and reports.
    pub fn name(self) -> String {
        let mut parts: Vec<&str> = Vec::with_capacity(4);
        if self.bias {
            parts.push("bias");
        }
        if let Some(a) = self.activation {
            parts.push(a.name());
        }
        if self.gate {
            parts.push("gate");
        }
        if self.residual {
            parts.push("residual");
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("+")
        }
    }

    /// Parses [`Epilogue::name`]; the steps may come in any order (they always run in the fixed one),
    /// and `swiglu` stands for `silu+gate`.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "none" {
            return Ok(Epilogue::NONE);
        }
        let mut e = Epilogue::NONE;
        for part in s.split('+').map(str::trim) {
            let dup = |set: bool| {
                if set {
                    Err(Error::invalid(format!("epilogue `{s}`: `{part}` twice")))
                } else {
                    Ok(())
                }
            };
            match part {
                "bias" => {
                    dup(e.bias)?;
                    e.bias = true;
                }
                "gate" => {
                    dup(e.gate)?;
                    e.gate = true;
                }
                "residual" => {
                    dup(e.residual)?;
                    e.residual = true;
                }
                "swiglu" => {
                    dup(e.gate || e.activation.is_some())?;
                    e.activation = Some(Activation::Silu);
                    e.gate = true;
                }
                other => {
                    let Some(a) = Activation::ALL.into_iter().find(|a| a.name() == other) else {
                        return Err(Error::invalid(format!(
                            "epilogue `{s}`: unknown step `{other}`; steps are bias, silu, gelu, gelu_tanh, \
                             relu, gate, residual, swiglu (= silu+gate), or `none` alone"
                        )));
                    };
                    if e.activation.is_some() {
                        return Err(Error::invalid(format!("epilogue `{s}`: more than one activation")));
                    }
                    e.activation = Some(a);
                }
            }
        }
        Ok(e)
    }

    /// Every combination of the steps (2 · 5 · 2 · 2 = 40), plain first.
    pub fn all() -> impl Iterator<Item = Epilogue> {
        let activations = [None].into_iter().chain(Activation::ALL.map(Some));
        activations.flat_map(|activation| {
            [false, true].into_iter().flat_map(move |bias| {
                [false, true].into_iter().flat_map(move |gate| {
                    [false, true].into_iter().map(move |residual| Epilogue {
                        bias,
                        activation,
                        gate,
                        residual,
                    })
                })
            })
        })
    }
}

impl std::fmt::Display for Epilogue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl std::str::FromStr for Epilogue {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Epilogue::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn invalid(r: Result<()>, expected: &str) {
        let e = r.expect_err(expected);
        assert!(matches!(e, Error::InvalidArgument(_)), "{expected}: {e:?}");
        assert!(e.to_string().contains(expected), "expected `{expected}` in: {e}");
    }

    #[test]
    fn epilogue_names_round_trip() {
        let all: Vec<Epilogue> = Epilogue::all().collect();
        assert_eq!(all.len(), 40);
        assert_eq!(all[0], Epilogue::NONE);
        let names: HashSet<String> = all.iter().map(|e| e.name()).collect();
        assert_eq!(names.len(), 40);
        for e in all {
            assert_eq!(Epilogue::parse(&e.name()).unwrap(), e);
            assert_eq!(e.to_string().parse::<Epilogue>().unwrap(), e);
        }
        assert_eq!(Epilogue::NONE.name(), "none");
        let full = Epilogue::BIAS.with_activation(Activation::GeluTanh).with_gate().with_residual();
        assert_eq!(full.name(), "bias+gelu_tanh+gate+residual");
        assert_eq!(full.steps(), 4);
        assert_eq!(Epilogue::parse("residual + silu+ bias").unwrap().name(), "bias+silu+residual");
        assert_eq!(Epilogue::parse("swiglu").unwrap(), Epilogue::SWIGLU);
        assert_eq!(Epilogue::SWIGLU.name(), "silu+gate");
        for (bad, msg) in [
            ("tanh", "unknown step `tanh`"),
            ("bias+bias", "`bias` twice"),
            ("silu+relu", "more than one activation"),
            ("swiglu+gate", "`gate` twice"),
            ("", "unknown step ``"),
        ] {
            invalid(Epilogue::parse(bad).map(drop), msg);
        }
    }
}
