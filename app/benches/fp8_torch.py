#!/usr/bin/env python3
"""PyTorch's FP8 GEMM (`torch._scaled_mm`) on the shapes of `cargo bench --bench fp8`: the anchor for it.

For each of Llama-3.1-8B's projections (qkv_proj 6144 x 4096, o_proj 4096 x 4096, gate_up 28672 x 4096,
down 4096 x 14336) at m = 1 (decode) and m = 2048 (prefill) it times, on the same inputs:
- `bf16`: `torch.nn.functional.linear` in bf16 (cuBLAS);
- `scaled_mm`: `torch._scaled_mm` of E4M3 activations (one factor per row) by the E4M3 weight (one
  factor per output channel), bf16 out, the scales as the Rust bench makes them (absmax / 448);
- `quantize + scaled_mm`: the same with the activations' per-row quantization in the timed region
  (amax, divide, cast: PyTorch eager, one kernel per elementary op).
Each FP8 product is checked against the bf16 product of the dequantized operands (relative L2).

Timing: 10 warm-up calls, then the median of 21 CUDA-event samples, each over enough back-to-back calls
to cover about a millisecond. Writes CSV rows to the path given as the first argument.
"""
import csv
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import time_ms  # noqa: E402

LINEARS = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
E4M3_MAX = 448.0


def quantize_rows(t):
    """E4M3 codes and one f32 factor per row (absmax / 448), as the Rust quantizer makes them."""
    scale = (t.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "fp8_torch.csv"
    torch.manual_seed(0)
    rows = []
    for name, n, k in LINEARS:
        w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16)
        wq, ws = quantize_rows(w)
        wq_t, ws_t = wq.t(), ws.t().contiguous()  # [k, n] column-major, [1, n]
        for m in (1, 2048):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            xq, xs = quantize_rows(x)
            # m = 1: cuBLASLt wants at least 16 rows for FP8; pad the activation and keep row 0.
            pad = 16 if m < 16 else m
            xq_p = torch.zeros(pad, k, device="cuda", dtype=torch.float8_e4m3fn)
            xq_p[:m] = xq
            xs_p = torch.ones(pad, 1, device="cuda")
            xs_p[:m] = xs

            def scaled():
                return torch._scaled_mm(xq_p, wq_t, scale_a=xs_p, scale_b=ws_t, out_dtype=torch.bfloat16)

            def quant_scaled():  # timed only where m needs no padding
                q, s = quantize_rows(x)
                return torch._scaled_mm(q, wq_t, scale_a=s, scale_b=ws_t, out_dtype=torch.bfloat16)

            want = F.linear(xq.float() * xs, wq.float() * ws).float()
            err = ""
            try:
                got = scaled()[:m].float()
                rel = ((got - want).norm() / want.norm()).item()
            except RuntimeError as e:  # noqa: PERF203
                got, rel, err = None, float("nan"), str(e).splitlines()[0]
            flops = 2.0 * m * n * k
            cases = [("bf16", lambda: F.linear(x, w), float("nan"))]
            if got is not None:
                cases.append(("scaled_mm", scaled, rel))
                if pad == m:
                    cases.append(("quantize + scaled_mm", quant_scaled, rel))
            for path, fn, r in cases:
                ms = time_ms(fn)
                wbytes = n * k * (2 if path == "bf16" else 1)
                rows.append({"linear": name, "m": m, "n": n, "k": k, "path": path, "ms": f"{ms:.4f}",
                             "weight_gbs": f"{wbytes / ms / 1e6:.0f}", "tflops": f"{flops / ms / 1e9:.1f}",
                             "rel_l2": "" if math.isnan(r) else f"{r:.2e}", "error": "",
                             "torch": torch.__version__, "gpu": torch.cuda.get_device_name()})
                print(name, m, path, rows[-1]["ms"], "ms", rows[-1]["tflops"], "TFLOP/s", flush=True)
            if err:
                rows.append({"linear": name, "m": m, "n": n, "k": k, "path": "scaled_mm", "ms": "",
                             "weight_gbs": "", "tflops": "", "rel_l2": "", "error": err,
                             "torch": torch.__version__, "gpu": torch.cuda.get_device_name()})
    with open(out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    main()
