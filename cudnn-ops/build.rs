//! Finds the sources that no hand-kept list should have to name, so that a new op room cannot be
//! forgotten (writes `$OUT_DIR/sources.rs`, included by `kernels` and `plan::store`):
//!
//! - the CUDA kernels: every `.cu` file under `src/` (`kernels/common.cu` first, it defines what the
//!   others use; then the rooms' files in path order), each room's file compiled as its own NVRTC
//!   program after `common.cu`;
//! - the sources that decide what a graph lowers to: `descriptor.rs`, everything under `graph/` and
//!   `plan/`, and every file under `ops/` that builds a graph (`Graph::new(`). Their hash is part of a
//!   stored plan's environment, so a build whose lowering changed does not load older plans.
//!
//! It reads only this crate's own files: no tools, no headers, no network.
use std::path::{Path, PathBuf};

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=src");
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src = root.join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let rel = |p: &Path| p.strip_prefix(&src).expect("under src").to_string_lossy().replace('\\', "/");

    let mut kernels: Vec<String> = files.iter().map(|p| rel(p)).filter(|r| r.ends_with(".cu")).collect();
    kernels.sort_by_key(|r| (r != "kernels/common.cu", r.clone()));

    let lowering: Vec<String> = files
        .iter()
        .filter(|p| {
            let r = rel(p);
            r.ends_with(".rs")
                && (r == "descriptor.rs"
                    || r.starts_with("graph/")
                    || r.starts_with("plan/")
                    || (r.starts_with("ops/")
                        && std::fs::read_to_string(p).is_ok_and(|t| t.contains("Graph::new("))))
        })
        .map(|p| rel(p))
        .collect();

    let include = |r: &String| format!("include_str!({:?})", src.join(r).to_string_lossy());
    let list = |v: &[String]| v.iter().map(|r| format!("{r:?}")).collect::<Vec<_>>().join(", ");
    let text = format!(
        "/// Every `.cu` file under `src/`, `kernels/common.cu` first (found by `build.rs`; the tests check it).\n\
         #[cfg_attr(not(test), allow(dead_code))]\n\
         pub(crate) const KERNEL_FILES: &[&str] = &[{}];\n\
         /// `kernels/common.cu`, the start of every room's NVRTC program.\n\
         pub(crate) const KERNEL_COMMON: &str = {};\n\
         /// The other files of [`KERNEL_FILES`] and their text: one NVRTC program each, after [`KERNEL_COMMON`].\n\
         pub(crate) const KERNEL_ROOMS: &[(&str, &str)] = &[{}];\n\
         /// The sources that decide what a graph lowers to (found by `build.rs`; the tests check it).\n\
         #[cfg_attr(not(test), allow(dead_code))]\n\
         pub(crate) const LOWERING_FILES: &[&str] = &[{}];\n\
         /// Their text, in [`LOWERING_FILES`]' order.\n\
         pub(crate) const LOWERING_SOURCES: &[&str] = &[{}];\n",
        list(&kernels),
        include(&kernels[0]),
        kernels[1..].iter().map(|r| format!("({r:?}, {})", include(r))).collect::<Vec<_>>().join(", "),
        list(&lowering),
        lowering.iter().map(include).collect::<Vec<_>>().join(", "),
    );
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("sources.rs");
    std::fs::write(&out, text).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}
