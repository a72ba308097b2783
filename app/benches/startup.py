#!/usr/bin/env python3
"""Start-up latency: wall time from `exec` to the first generated token, one fresh process per sample.

For each model (a checkpoint directory or a GGUF file) it runs `generate` (8 new tokens):
- cold: every sample with a new, empty plan directory (kernels compiled, plans built);
- warm: after one priming run, every sample with that plan directory (kernels and plans loaded);
and, as the anchor, transformers in a fresh Python process: `import torch, transformers`,
`from_pretrained(..., dtype=bfloat16)` onto the GPU, the tokenizer, then one greedy token
(`generate(max_new_tokens=1)`), timed from the parent's spawn to the child's first token.

`generate` reports its own time from exec to the first token handed to the output (the kernel's
process start time, 10 ms ticks) and its start-up phases; this script records both, and the wall time
of the whole process. Weights are read once before timing so that they sit in the page cache.
Writes `startup.csv` and `startup.md` to `--out`.

    python3 app/benches/startup.py --runner "bash .gpu/run bin generate" --model DIR --model FILE.gguf --out OUT
"""
import argparse
import csv
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "The quick brown fox"

HF = r'''
import sys, time
t0 = float(sys.argv[2])
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
kw = {}
if path.endswith(".gguf"):
    import os
    kw["gguf_file"] = os.path.basename(path)
    path = os.path.dirname(os.path.abspath(path))
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).cuda().eval()
tok = AutoTokenizer.from_pretrained(path, **kw)
ids = tok(sys.argv[3], return_tensors="pt").input_ids.cuda()
with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=1, do_sample=False)
print(tok.decode(out[0, -1:]), flush=True)
print("FIRST_TOKEN_AT", time.time() - t0, flush=True)
'''


def ours(runner, model, plan_dir):
    cmd = shlex.split(runner) + ["--model", model, "--prompt", PROMPT, "--max-new-tokens", "8",
                                 "--plan-dir", plan_dir]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    line = next(l for l in p.stderr.splitlines() if "generate: startup:" in l)
    m = re.search(r"first token handed to the output ([\d.]+) (ms|s) after exec", line)
    first = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    return {"first_token_s": first, "process_wall_s": wall, "phases": line.split("after exec; ", 1)[1]}


def anchor(model):
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", HF, model, repr(t0), PROMPT], capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        print(f"transformers failed on {model}:\n{p.stderr[-3000:]}", flush=True)
        return None
    first = float(next(l for l in p.stdout.splitlines() if l.startswith("FIRST_TOKEN_AT")).split()[1])
    return {"first_token_s": first, "process_wall_s": wall, "phases": ""}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", default="cargo run --release --bin generate --")
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--out", default="benches/results")
    ap.add_argument("--no-anchor", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for model in a.model:
        name = os.path.basename(model.rstrip("/"))
        # Into the page cache.
        for root, _, files in os.walk(model) if os.path.isdir(model) else [("", [], [model])]:
            for f in files:
                with open(os.path.join(root, f), "rb") as fh:
                    while fh.read(1 << 24):
                        pass
        runs = {"cold": [], "warm": [], "transformers": []}
        for _ in range(a.samples):
            with tempfile.TemporaryDirectory() as d:
                runs["cold"].append(ours(a.runner, model, d))
        with tempfile.TemporaryDirectory() as d:
            ours(a.runner, model, d)
            for _ in range(a.samples):
                runs["warm"].append(ours(a.runner, model, d))
        if not a.no_anchor:
            if anchor(model):  # its own imports into the page cache
                runs["transformers"] = [r for r in (anchor(model) for _ in range(a.samples)) if r]
        for kind, rs in runs.items():
            if not rs:
                continue
            med = statistics.median(r["first_token_s"] for r in rs)
            row = {"model": name, "run": kind, "samples": len(rs), "first_token_median_s": med,
                   "first_token_min_s": min(r["first_token_s"] for r in rs),
                   "first_token_max_s": max(r["first_token_s"] for r in rs),
                   "process_wall_median_s": statistics.median(r["process_wall_s"] for r in rs),
                   "phases_of_median_sample": min(rs, key=lambda r: abs(r["first_token_s"] - med))["phases"]}
            rows.append(row)
            print(row, flush=True)
    with open(os.path.join(a.out, "startup.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    with open(os.path.join(a.out, "startup.md"), "w") as f:
        f.write(f"# Start-up: exec to the first token\n\nGPU: {gpu}. `app/benches/startup.py`, {a.samples} fresh "
                f"processes per row, prompt {PROMPT!r}, weights in the page cache. cold: an empty plan "
                "directory (kernels compiled, plans built); warm: a primed one (both loaded). transformers: "
                "a fresh Python process, `from_pretrained` (bf16, onto the GPU) and one greedy token.\n\n")
        f.write("| model | run | first token, median (min-max) | process wall, median | phases (median sample) |\n"
                "|---|---|---:|---:|---|\n")
        for r in rows:
            f.write(f"| {r['model']} | {r['run']} | {r['first_token_median_s']:.2f} s ({r['first_token_min_s']:.2f}-"
                    f"{r['first_token_max_s']:.2f}) | {r['process_wall_median_s']:.2f} s | "
                    f"{r['phases_of_median_sample']} |\n")
    print("wrote", os.path.join(a.out, "startup.md"))


if __name__ == "__main__":
    main()
