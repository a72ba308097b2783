#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the shapes of `cargo bench --bench sdpa`, per backend.

For each case it times `torch.nn.functional.scaled_dot_product_attention` restricted (with
`torch.nn.attention.sdpa_kernel`) to one backend: CUDNN_ATTENTION, FLASH_ATTENTION and, where the
f32 scores fit, MATH. Inputs are bf16 in BSHD storage viewed as [b, h, s, d] (`.transpose(1, 2)`, as
a QKV projection produces them), batch 1, 32 query heads, 8 K/V heads, random normal values.
Grouped-query heads use `enable_gqa=True`; if a backend refuses it, K/V are repeated to 32 heads
before timing (noted in the `gqa` column). Causal prefill uses `is_causal=True` (top-left); the
decode step (s_q 1 against s_kv 4096) needs no mask, since bottom-right causal masking hides nothing
from the last query.

Timing: 10 warm-up calls, then the median of 21 CUDA-event samples, each over enough back-to-back
calls to cover about a millisecond. Writes CSV rows (one per case and backend, `ms` empty when the
backend does not run the case, `error` saying why, `torch` the versions) to the path given as the
first argument. Small cases are host-bound in PyTorch eager (tens of microseconds of Python and
dispatcher work per call), so their times measure that, not the kernel.
"""
import csv
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import time_ms  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def cases():
    for model, d in (("Llama-3.2-1B", 64), ("Llama-3.1-8B", 128)):
        for s in (512, 2048, 4096, 8192):
            yield model, 32, 8, s, s, d, "causal"
        yield model, 32, 8, 1, 4096, d, "causal_bottom_right"
    yield "Llama-3.1-8B", 32, 8, 2048, 2048, 128, "none"




def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "sdpa_torch.csv"
    dev = torch.device("cuda")
    version = f"torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()})"
    print(f"# {version}, {torch.cuda.get_device_name()}")
    rows = []
    for model, hq, hkv, sq, skv, d, mask in cases():
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn(1, skv, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        v = torch.randn(1, skv, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        causal = mask == "causal"
        for name, backend in BACKENDS.items():
            if name == "math" and hq * sq * skv * 4 * 3 > torch.cuda.mem_get_info()[0]:
                rows.append((model, hq, hkv, d, sq, skv, mask, name, "", "", "scores do not fit", version))
                continue
            ms, gqa, error = "", "enable_gqa", ""
            for attempt in ("enable_gqa", "repeated"):
                try:
                    if attempt == "enable_gqa":
                        kk, vv, kw = k, v, {"enable_gqa": True}
                    else:
                        kk = k.repeat_interleave(hq // hkv, dim=1)
                        vv = v.repeat_interleave(hq // hkv, dim=1)
                        kw = {}

                    def call():
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, **kw)

                    # The backend is chosen once, outside the timed loop (entering sdpa_kernel per call
                    # would add Python overhead to every call).
                    with sdpa_kernel(backend):
                        ms = f"{time_ms(call):.5f}"
                    gqa, error = attempt, ""
                    break
                except RuntimeError as e:  # the backend refuses this case
                    error = str(e).splitlines()[0][:160]
            rows.append((model, hq, hkv, d, sq, skv, mask, name, ms, gqa if ms else "", error, version))
            print(f"{model} {mask} sq{sq} skv{skv} d{d} {name}: {ms or error} ms {gqa if ms else ''}")
        torch.cuda.empty_cache()
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "heads_q", "heads_kv", "head_dim", "seq_q", "seq_kv", "mask", "backend", "ms", "gqa", "error", "torch"])
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
