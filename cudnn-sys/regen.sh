#!/usr/bin/env bash
# Regenerates cudnn-sys/src/bindings.rs from the cuDNN 9.19 headers of the PyPI wheel (never committed).
#   cudnn-sys/regen.sh           # write the bindings
#   cudnn-sys/regen.sh --check   # regenerate into a temporary file and diff against the committed one
# Needs libclang (installed with apt-get when missing) and pip to fetch the wheel.
set -euo pipefail
wheel_version=9.19.0.56
here=$(cd "$(dirname "$0")" && pwd)
out=$here/src/bindings.rs
cache=${CUDNN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cudnn-sys}
inc=$cache/$wheel_version/nvidia/cudnn/include
if ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 && ! ldconfig -p | grep -q libclang; then
  echo "installing libclang-dev" >&2
  apt-get update -qq && apt-get install -y -qq libclang-dev >/dev/null
fi
if [[ ! -f $inc/cudnn_graph.h ]]; then
  mkdir -p "$cache/$wheel_version"
  python3 -m pip download -q --no-deps -d "$cache/$wheel_version" "nvidia-cudnn-cu13==$wheel_version"
  (cd "$cache/$wheel_version" && python3 -m zipfile -e nvidia_cudnn_cu13-*.whl . >/dev/null 2>&1 || true)
  [[ -f $inc/cudnn_graph.h ]] || { echo "cudnn_graph.h not found in the wheel" >&2; exit 1; }
fi
target=$out
[[ "${1:-}" == "--check" ]] && target=$(mktemp --suffix=.rs)
cargo run -q --release -p cudnn-sys-regen -- "$inc" "$target"
rustfmt --edition 2021 "$target"
printf 'nvidia-cudnn-cu13==%s %s\n' "$wheel_version" \
  "$(awk '/define CUDNN_MAJOR/{a=$3} /define CUDNN_MINOR/{b=$3} /define CUDNN_PATCHLEVEL/{c=$3} END{print a"."b"."c}' "$inc/cudnn_version.h")" \
  > "$here/HEADER_VERSION.tmp"
if [[ "${1:-}" == "--check" ]]; then
  rm -f "$here/HEADER_VERSION.tmp"
  if diff -q "$out" "$target" >/dev/null; then echo "bindings are up to date"; rm -f "$target"
  else diff -u "$out" "$target" | head -50; echo "bindings differ from the headers: run cudnn-sys/regen.sh" >&2; exit 1; fi
else
  mv "$here/HEADER_VERSION.tmp" "$here/HEADER_VERSION"
  echo "wrote $out ($(wc -l < "$out") lines)"
fi
