//! One way to open an NVIDIA library at run time, shared by every library of the workspace that is
//! loaded rather than linked (cuDNN, CUPTI, NCCL), so that each finds its library, reports a failure
//! and refuses an incomplete library the same way:
//!
//! 1. [`candidates`]: the environment variable's path alone when it is set and not empty (the user
//!    named the library: nothing else is tried), otherwise the library's own list of names and paths;
//! 2. [`open_first`]: the first candidate that opens, or every candidate with the loader's reason
//!    ([`Candidate`], listed in errors by [`tried`]);
//! 3. [`required_symbols!`]: the functions a binding calls, checked once the library is open, so that
//!    no call can reach a missing symbol later.
//!
//! Each library keeps its own error type (its message says how to install it) and its own checks
//! after these steps (versions, sub-libraries).
#![deny(missing_docs, rustdoc::broken_intra_doc_links)]

use std::ffi::OsString;
use std::fmt::Display;
use std::path::{Path, PathBuf};

/// A place the loader tried, and why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// A path or a bare soname handed to the system loader.
    pub name: String,
    /// The loader's error text.
    pub error: String,
}

/// Where to look: `env` (the value of the library's variable, e.g. `$CUDNN_LIBRARY`) alone when it is
/// set and not empty, otherwise `defaults` in order.
pub fn candidates(env: Option<OsString>, defaults: impl IntoIterator<Item = PathBuf>) -> Vec<PathBuf> {
    match env {
        Some(path) if !path.is_empty() => vec![PathBuf::from(path)],
        _ => defaults.into_iter().collect(),
    }
}

/// The first candidate `open` opens, with its name; otherwise every candidate with `open`'s reason.
pub fn open_first<L, E: Display>(
    candidates: &[PathBuf],
    mut open: impl FnMut(&Path) -> Result<L, E>,
) -> Result<(L, String), Vec<Candidate>> {
    let mut failed = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        let name = candidate.display().to_string();
        match open(candidate) {
            Ok(lib) => return Ok((lib, name)),
            Err(e) => failed.push(Candidate { name, error: e.to_string() }),
        }
    }
    Err(failed)
}

/// The candidates tried, for an error message: `` `a` (reason), `b` (reason) ``.
pub fn tried(list: &[Candidate]) -> String {
    list.iter().map(|c| format!("`{}` ({})", c.name, c.error)).collect::<Vec<_>>().join(", ")
}

/// Declares the functions a bindgen binding `$lib` (a struct of `Result` fields, one per symbol, as
/// bindgen's `dynamic_library_name` writes it) calls: a public `REQUIRED_SYMBOLS` list and a
/// `first_missing(&$lib) -> Option<&'static str>` that names the first one the opened library lacks.
#[macro_export]
macro_rules! required_symbols {
    ($lib:ty: $($sym:ident),* $(,)?) => {
        /// The symbols this binding calls; a library missing any is refused when it is opened, so that
        /// no call can later hit bindgen's "Expected function" panic.
        pub const REQUIRED_SYMBOLS: &[&str] = &[$(stringify!($sym)),*];

        fn first_missing(lib: &$lib) -> Option<&'static str> {
            $(if lib.$sym.is_err() { return Some(stringify!($sym)); })*
            None
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_alone_when_set_else_the_defaults() {
        let defaults = || vec![PathBuf::from("liba.so.1"), PathBuf::from("liba.so")];
        assert_eq!(candidates(None, defaults()), defaults());
        assert_eq!(candidates(Some("".into()), defaults()), defaults());
        assert_eq!(candidates(Some("/x/liba.so.1".into()), defaults()), vec![PathBuf::from("/x/liba.so.1")]);
    }

    #[test]
    fn the_first_that_opens_or_every_reason() {
        let c = [PathBuf::from("a"), PathBuf::from("b"), PathBuf::from("c")];
        let open = |p: &Path| if p == Path::new("b") { Ok(2) } else { Err(format!("no {}", p.display())) };
        assert_eq!(open_first(&c, open), Ok((2, "b".to_string())));
        let none = open_first(&c[..1], open).unwrap_err();
        assert_eq!(none, vec![Candidate { name: "a".into(), error: "no a".into() }]);
        let all = open_first(&[c[0].clone(), c[2].clone()], open).unwrap_err();
        assert_eq!(tried(&all), "`a` (no a), `c` (no c)");
    }

    struct Lib {
        present: Result<fn(), String>,
        absent: Result<fn(), String>,
    }
    required_symbols!(Lib: present, absent);

    #[test]
    fn the_first_missing_symbol_is_named() {
        assert_eq!(REQUIRED_SYMBOLS, ["present", "absent"]);
        let lib = Lib { present: Ok(|| ()), absent: Err("missing".into()) };
        assert_eq!(first_missing(&lib), Some("absent"));
        let whole = Lib { present: Ok(|| ()), absent: Ok(|| ()) };
        assert_eq!(first_missing(&whole), None);
        // Both fields are read through the macro only.
        let _ = (whole.present, whole.absent);
    }
}
