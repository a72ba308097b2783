#!/usr/bin/env python3
"""Link-time stand-ins for the CUDA libraries candle links, for building on a machine without them.

candle's CUDA backend turns on cudarc's `dynamic-linking`: an executable that uses it (a test binary, an
example) names libcuda.so.1, libcublas.so.13, libcublasLt.so.13, libcurand.so.10 and libnvrtc.so.13 (and
libnccl.so.2 where cudnn-llm-nccl is in it, for cudarc's NCCL types) and needs them to link. A machine with no GPU driver and no CUDA toolkit has none of them, and PyPI carries no
libcuda. This writes one shared library per name into OUT, with that soname and an empty function for
every symbol cudarc's bindings of it can call (read from cudarc's sources), plus `libcudart.so` pointing
at the CUDA runtime given (candle's kernels link it). Binaries linked against these run where the real
libraries are (a GPU machine: `LD_LIBRARY_PATH` at its CUDA 13 libraries); the stand-ins are never loaded
there, and are never to be run.

    python3 candle/link_stubs.py OUT CUDART_SO

then build with `CUDA_ROOT` at a folder whose `lib/stubs` is OUT (cudarc's build script searches it).
"""

import json
import os
import re
import subprocess
import sys
import tempfile

# cudarc module folder -> the soname the real library has (CUDA 13.0).
LIBRARIES = {
    "driver": ("cuda", "libcuda.so.1"),
    "cublas": ("cublas", "libcublas.so.13"),
    "cublaslt": ("cublasLt", "libcublasLt.so.13"),
    "curand": ("curand", "libcurand.so.10"),
    "nvrtc": ("nvrtc", "libnvrtc.so.13"),
    # cudnn-llm-nccl takes cudarc's NCCL types (it opens NCCL itself), so under `dynamic-linking` a
    # binary that has the decoder in it (the Llama example's GGUF loader) links libnccl too.
    "nccl": ("nccl", "libnccl.so.2"),
}


def cudarc_src():
    meta = json.loads(subprocess.check_output(["cargo", "metadata", "--format-version", "1"]))
    dirs = [os.path.dirname(p["manifest_path"]) for p in meta["packages"] if p["name"] == "cudarc"]
    if len(dirs) != 1:
        sys.exit(f"link_stubs: expected one cudarc in the dependency graph, found {dirs}")
    return os.path.join(dirs[0], "src")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, cudart = sys.argv[1], os.path.abspath(sys.argv[2])
    if not os.path.isfile(cudart):
        sys.exit(f"link_stubs: no CUDA runtime at {cudart}")
    os.makedirs(out, exist_ok=True)
    src = cudarc_src()
    for module, (name, soname) in LIBRARIES.items():
        with open(os.path.join(src, module, "sys", "mod.rs")) as f:
            symbols = sorted(set(re.findall(r'load::<_F>\("(\w+)"\)', f.read())))
        if not symbols:
            sys.exit(f"link_stubs: no symbols found for {module} in {src}")
        with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as c:
            c.write("/* Link-time stand-in: never loaded or run. */\n")
            c.writelines(f"void {s}(void) {{}}\n" for s in symbols)
        target = os.path.join(out, soname)
        subprocess.check_call(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", target, c.name])
        os.unlink(c.name)
        link = os.path.join(out, f"lib{name}.so")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(soname, link)
        print(f"{link} -> {soname}: {len(symbols)} symbols")
    link = os.path.join(out, "libcudart.so")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(cudart, link)
    print(f"{link} -> {cudart}")


if __name__ == "__main__":
    main()
