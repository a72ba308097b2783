#!/usr/bin/env bash
# Renames the publishable crates to names that are free on crates.io (`cudnn-sys` and `llama` are
# taken there by unrelated crates), and their library names with them:
#
#   package      -> package          library      -> library
#   cudnn-sys    -> cudnn-llm-sys    cudnn_sys    -> cudnn_llm_sys
#   cudnn-ops    -> cudnn-llm-ops    cudnn_ops    -> cudnn_llm_ops
#   cupti        -> cudnn-llm-cupti  cupti        -> cudnn_llm_cupti
#   llama        -> cudnn-llm-llama  llama        -> cudnn_llm_llama
#
# The root facade `cudnn-llm` keeps its name and keeps its module paths: `pub use cudnn_ops;` becomes
# `pub use cudnn_llm_ops as cudnn_ops;`, so `cudnn_llm::cudnn_ops::..` and `cudnn_llm::llama::..` stay.
# Directories keep their names (`cudnn-ops/`, `llama/`, ...).
#
# Mechanical and idempotent (a second run changes nothing), so it can be re-run after merging branches
# written against the old names. In every tracked or untracked, not ignored .rs/.md/.toml/.py/.sh file
# and `.ci/run` (not the bench results, the generated bindings or this script) it rewrites:
#   - Rust paths `cudnn_ops::..` (not `x::cudnn_ops::..`), `use cudnn_sys as sys;`, `extern crate`;
#   - package names: `[package] name`, dependency keys (`cudnn-ops.workspace = true`,
#     `cudnn-ops = {..}`, in manifests and in TOML snippets of docs), `dep:cupti` features, `-p llama`
#     command lines, `crates.io/crates/..` links, backquoted package names (`cudnn-ops`; `llama` and
#     `cupti` only in Markdown, where Rust sources also use them as words), crate README titles;
# then updates Cargo.lock (cargo metadata) and formats (cargo fmt: imports re-sort, lines re-wrap).
# It prints the files it changed. Usage: .ci/rename_crates.sh [--check] (--check: changes nothing and
# fails if a rename is left to do).
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
[[ ${1:-} == --check ]] && check=1

git ls-files -z --cached --others --exclude-standard \
  | python3 -c '
import re, sys

PACKAGES = {"cudnn-sys": "cudnn-llm-sys", "cudnn-ops": "cudnn-llm-ops", "cupti": "cudnn-llm-cupti", "llama": "cudnn-llm-llama"}
LIBS = {k.replace("-", "_"): v.replace("-", "_") for k, v in PACKAGES.items()}
CHECK = sys.argv[1] == "1"
SKIP = re.compile(r"^(benches/results/|.*/src/bindings\.rs$|\.ci/rename_crates\.sh$|target/)")
WANTED = re.compile(r"(\.(rs|md|toml|py|sh)$|^\.ci/run$)")

def rename(path, s):
    md, toml = path.endswith(".md"), path.endswith(".toml")
    for old, new in LIBS.items():
        # The facade keeps its module name for the renamed crate.
        s = re.sub(rf"(?<![\w:])pub use {old};", f"pub use {new} as {old};", s)
        # Paths rooted at the crate (not a module of that name inside another path).
        s = re.sub(rf"(?<![\w:]){old}::", f"{new}::", s)
        if path.endswith(".rs"):
            s = re.sub(rf"(?<![\w:])(use|extern crate) {old}\b(?!::)", rf"\1 {new}", s)
    for old, new in PACKAGES.items():
        o = re.escape(old)
        if toml:
            s = re.sub(rf"(\[package\]\s*\nname = )\"{o}\"", lambda m: f"{m[1]}\"{new}\"", s)
        if toml or md:  # dependency keys, in manifests and in the TOML snippets of docs
            s = re.sub(rf"(?m)^{o}(?=\s*=|\.workspace)", new, s)
        s = re.sub(rf"\"dep:{o}\"", f"\"dep:{new}\"", s)
        s = re.sub(rf"(?<![\w-])-p {o}(?![\w/.-])", f"-p {new}", s)
        s = re.sub(rf"crates\.io/crates/{o}(?![\w-])", f"crates.io/crates/{new}", s)
        if "-" in old or md:  # `llama`, `cupti` are also plain words in Rust sources (a model_type, a variable)
            s = s.replace(f"`{old}`", f"`{new}`")
        if md:
            s = re.sub(rf"(?m)^# {o}$", f"# {new}", s)
    return s

changed = []
for path in sys.stdin.read().split("\0"):
    if not path or SKIP.match(path) or not WANTED.search(path):
        continue
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
    except (FileNotFoundError, IsADirectoryError):
        continue
    new = rename(path, old)
    if new != old:
        changed.append(path)
        if not CHECK:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
for p in changed:
    print(("to rename: " if CHECK else "renamed: ") + p)
sys.exit(1 if CHECK and changed else 0)
' "$check"

if ((check)); then
  exit 0
fi
cargo metadata --format-version 1 >/dev/null   # Cargo.lock follows the new package names
cargo fmt --all
