//! Records build metadata for reports: git revision, rustc version, and the cuDNN header version the
//! bindings in cudnn-sys were generated from (`BUILD`). The library crates have no build script: a
//! crate depending on them runs no git or rustc.
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let git = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .is_some_and(|o| o.status.success() && !o.stdout.is_empty());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let header = std::fs::read_to_string("../cudnn-sys/HEADER_VERSION").unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=BUILD_GIT_REVISION={git}{}", if dirty { "-dirty" } else { "" });
    println!("cargo:rustc-env=BUILD_RUSTC_VERSION={rustc}");
    println!("cargo:rustc-env=BUILD_CUDNN_HEADERS={}", header.trim());
    println!("cargo:rerun-if-changed=../cudnn-sys/HEADER_VERSION");
    println!("cargo:rerun-if-changed=../.git/HEAD");
    println!("cargo:rerun-if-changed=../.git/index");
}
