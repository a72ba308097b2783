#!/usr/bin/env python3
"""PyTorch's F.layer_norm (eager, bf16, inference) at the shapes of app/benches/layernorm.rs, timed with
CUDA events (median of 30 samples of a batch of calls after warm-up). Writes `tokens,hidden,ms` to OUT.

    python3 app/benches/layernorm_torch.py OUT.csv
    TORCH_LN_CSV=OUT.csv cargo bench --bench layernorm
"""
import statistics
import sys

import torch
import torch.nn.functional as F

HIDDEN = [768, 1024, 2560, 4096]
TOKENS = [30, 2048, 16384]


def main(out):
    torch.manual_seed(0)
    rows = ["tokens,hidden,ms"]
    for hidden in HIDDEN:
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
            batch = 50 if tokens * hidden < (1 << 22) else 5
            with torch.inference_mode():
                for _ in range(20):
                    F.layer_norm(x, (hidden,), w, b, 1e-5)
                samples = []
                for _ in range(30):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(batch):
                        F.layer_norm(x, (hidden,), w, b, 1e-5)
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / batch)
            ms = statistics.median(samples)
            rows.append(f"{tokens},{hidden},{ms:.6f}")
            print(f"torch layer_norm {tokens}x{hidden}: {ms:.4f} ms", flush=True)
    with open(out, "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "torch_layernorm.csv")
