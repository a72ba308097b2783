//! The two implementations every op comes in.

/// Which implementation a module runs on.
///
/// Exhaustive on purpose: every op comes as a fused graph and as its eager baseline, and callers
/// match on the two (a third implementation would change what every comparison means, a breaking
/// change either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// cuDNN graphs.
    Fused,
    /// One kernel per elementary op, as PyTorch eager.
    Naive,
}

impl Backend {
    /// `fused` or `naive`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Fused => "fused",
            Backend::Naive => "naive",
        }
    }
}
