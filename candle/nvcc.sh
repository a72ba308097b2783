#!/usr/bin/env bash
# Prints a CUDA 13.0 folder with nvcc, its headers and link-time stand-ins for the CUDA libraries, for
# building cudnn-llm-candle with `--features cuda` on a machine without a CUDA toolkit or GPU driver:
# PyPI's CUDA 13.0 wheels (nvcc, NVVM, the C runtime headers, the runtime, CCCL; PTX a 13.0 driver
# loads), unpacked once into the cache (${XDG_CACHE_HOME:-~/.cache}/cudnn-llm/nvcc-13.0), and
# link_stubs.py's libraries in its lib/. Exits 1 if the wheels cannot be had.
#
#   cu=$(bash candle/nvcc.sh) && PATH=$cu/bin:$PATH CUDA_ROOT=$cu CUDA_COMPUTE_CAP=90 cargo build -p cudnn-llm-candle --features cuda
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${XDG_CACHE_HOME:-$HOME/.cache}/cudnn-llm/nvcc-13.0
cu=$dir/nvidia/cu13
if [[ ! -x $cu/bin/nvcc || ! -d $cu/nvvm ]]; then
  # Unpacked beside and moved into place: an interrupted run leaves no half folder.
  rm -rf "$dir.partial" && mkdir -p "$dir.partial"
  (cd "$dir.partial" && python3 -m pip download -q --no-deps 'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' \
     'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*' -d . \
     && for w in *.whl; do unzip -q -o "$w"; done && rm -f ./*.whl) >&2 \
    || { echo "nvcc.sh: the CUDA 13.0 wheels are not available" >&2; exit 1; }
  rm -rf "$dir" && mv "$dir.partial" "$dir"
fi
python3 "$here/link_stubs.py" "$cu/lib" "$cu/lib/libcudart.so.13" >&2
echo "$cu"
