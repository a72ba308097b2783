#!/usr/bin/env bash
# Regenerates cupti/src/bindings.rs from the CUPTI 13.0 headers of the PyPI wheels (never committed).
#   cupti/regen.sh           # write the bindings
#   cupti/regen.sh --check   # regenerate into a temporary file and diff against the committed one
# Needs libclang (installed with apt-get when missing) and pip to fetch the wheels. CUPTI's headers
# include cuda.h and builtin_types.h (the nvidia-cuda-runtime wheel) and crt/host_defines.h (the
# nvidia-cuda-crt wheel); all three unpack into the same nvidia/cu13/include.
set -euo pipefail
cupti_version=13.0.85
runtime_version=13.0.96
crt_version=13.0.88
here=$(cd "$(dirname "$0")" && pwd)
out=$here/src/bindings.rs
cache=${CUPTI_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cupti-sys}
root=$cache/$cupti_version
inc=$root/nvidia/cu13/include
if ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 && ! ldconfig -p | grep -q libclang; then
  echo "installing libclang-dev" >&2
  apt-get update -qq && apt-get install -y -qq libclang-dev >/dev/null
fi
fetch() { # fetch <pip name> <version> <file that proves it is unpacked>
  [[ -f $inc/$3 ]] && return
  mkdir -p "$cache/wheels"
  python3 -m pip download -q --no-deps -d "$cache/wheels" "$1==$2"
  local whl
  whl=$(ls "$cache/wheels/${1//-/_}-$2-"*.whl)
  (cd "$root" && python3 -m zipfile -e "$whl" .)
  [[ -f $inc/$3 ]] || { echo "$3 not found in $whl" >&2; exit 1; }
}
mkdir -p "$root"
fetch nvidia-cuda-cupti "$cupti_version" cupti_activity.h
fetch nvidia-cuda-runtime "$runtime_version" cuda.h
fetch nvidia-cuda-crt "$crt_version" crt/host_defines.h
target=$out
[[ "${1:-}" == "--check" ]] && target=$(mktemp --suffix=.rs)
cargo run -q --release -p cupti-regen -- "$inc" "$target"
rustfmt --edition 2021 --config-path "$here/../rustfmt.toml" "$target"
printf 'nvidia-cuda-cupti==%s CUPTI_API_VERSION=%s (headers also from nvidia-cuda-runtime==%s, nvidia-cuda-crt==%s)\n' \
  "$cupti_version" "$(awk '/define CUPTI_API_VERSION/{print $3}' "$inc/cupti_version.h")" \
  "$runtime_version" "$crt_version" > "$here/HEADER_VERSION.tmp"
if [[ "${1:-}" == "--check" ]]; then
  rm -f "$here/HEADER_VERSION.tmp"
  if diff -q "$out" "$target" >/dev/null; then echo "bindings are up to date"; rm -f "$target"
  else diff -u "$out" "$target" | head -50; echo "bindings differ from the headers: run cupti/regen.sh" >&2; exit 1; fi
else
  mv "$here/HEADER_VERSION.tmp" "$here/HEADER_VERSION"
  echo "wrote $out ($(wc -l < "$out") lines)"
fi
