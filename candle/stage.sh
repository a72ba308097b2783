#!/usr/bin/env bash
# Builds cudnn-llm-candle's GPU tests and its Llama example in release mode with CUDA (nvcc from PyPI
# through nvcc.sh; no GPU needed) and stages them in .gpu-candle/ with a runner, for a GPU machine with
# no Rust toolchain:
#
#   bash candle/stage.sh                      # here (also packs .gpu-candle-pack/candle.tgz)
#   tar xzf .gpu-candle-pack/candle.tgz       # there, with carry: [".gpu-candle-pack"]
#   bash .gpu-candle/run tests                # there: the GPU tests, ignored ones included
#   bash .gpu-candle/run llama --preset 1b    # there: candle's Llama against the fused ops
#
# The runner puts the CUDA 13 libraries of the machine's Python packages (cuBLAS, cuRAND, NVRTC, the
# runtime, cuDNN) on LD_LIBRARY_PATH: candle links them.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
cu=$(bash candle/nvcc.sh)
export PATH=$cu/bin:$PATH CUDA_ROOT=$cu CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
out=.gpu-candle
rm -rf "$out"; mkdir -p "$out"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qxF "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
pick() { # reads cargo's JSON messages; prints the executables of targets named $1
  python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$1"
}
tests=$(cargo test -p cudnn-llm-candle --features cuda --release --no-run --message-format=json | pick cuda)
llama=$(cargo build -p cudnn-llm-candle --features cuda,example --release --example llama --message-format=json | pick llama)
cp "$tests" "$out/tests"; cp "$llama" "$out/llama"; strip -s "$out/tests" "$out/llama"
cat > "$out/run" <<'RUN'
#!/usr/bin/env bash
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
libs=$(python3 -c '
import glob, os, nvidia
dirs = set()
for root in nvidia.__path__:
    for so in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))' 2>/dev/null)
export LD_LIBRARY_PATH=${libs:+$libs:}${LD_LIBRARY_PATH:-}
what=${1:?usage: run tests|llama [args...]}; shift
case "$what" in
  tests) exec "$here/tests" --include-ignored --test-threads=1 "$@" ;;
  llama) exec "$here/llama" "$@" ;;
  *) echo "usage: run tests|llama [args...]"; exit 2 ;;
esac
RUN
chmod +x "$out/run"
du -sh "$out" | awk '{print "staged in .gpu-candle/: " $1}'
# One gzipped tarball for a device call (which carries at most 64 MiB; the binaries are about 90 MB
# and pack to about 25): carry .gpu-candle-pack and unpack it there with `tar xzf .gpu-candle-pack/candle.tgz`.
pack=.gpu-candle-pack
mkdir -p "$pack" && tar czf "$pack/candle.tgz" "$out"
grep -qxF "/$pack/" "$exclude" 2>/dev/null || echo "/$pack/" >> "$exclude"
ls -la "$pack/candle.tgz" | awk '{print "packed " $9 ": " $5 " bytes"}'
