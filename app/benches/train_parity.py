#!/usr/bin/env python3
"""Parity of this crate's training step with transformers + torch.optim.AdamW, on a checkpoint
transformers itself writes (the forward's parity is `app/benches/hf_parity.py`).

It
1. builds a random-init `LlamaForCausalLM` with Llama-3.2-1B's shapes and `--layers` layers (default
   2; tied embeddings, llama3 RoPE scaling) and writes it with `save_pretrained` (bf16 safetensors),
2. draws one batch of token ids (`--batch` x `--seq`, default 2 x 64, seeded) and writes it as
   tokens.json,
3. runs `--steps` steps (default 1) in PyTorch on that directory and batch:
   `loss = model(input_ids=ids, labels=ids, use_cache=False).loss; loss.backward(); opt.step();
   opt.zero_grad()` with `torch.optim.AdamW(fused=True)` at `--lr`, `--beta1`, `--beta2`, `--eps`,
   `--weight-decay` (defaults 1e-2, 0.9, 0.95, 1e-8, 0.1) over every parameter, no gradient
   clipping; in fp32 (the reference) and in bf16 (the yardstick: transformers' own bf16 step against
   its fp32 step),
4. runs this crate's `train` binary on the same directory and batch with the same hyperparameters
   (`--model DIR --tokens tokens.json --steps N --lr ... --save OUT`; no clipping, no master weights:
   bf16 weights, f32 gradients and AdamW moments), all naive and all fused,
5. compares the first step's loss, and per weight tensor the update (weights after minus the
   checkpoint's) by relative L2 error and sign agreement against the fp32 reference.

It fails (exit 1) when a backend's loss error or a tensor's update error exceeds 1.5x transformers'
bf16 error on the same quantity plus a floor (1e-3 for the loss, 1e-2 for an update). Writes
`train_parity.csv` (every tensor) and `train_parity.md` (the loss, the updates grouped by kind) to
`--out`.

What one step checks: from zero moments AdamW moves a weight by lr * g / (|g| + eps) (bias-corrected),
about +-lr wherever |g| >> eps, so one step compares the sign of every gradient element, the loss
(labels shifted by one, mean over the counted targets), the tied embedding's two gradient shares,
decoupled weight decay and the checkpoint written back; `--steps 2` makes the update depend on the
ratio of the two steps' gradients, i.e. on their magnitudes. (Gradient magnitudes are checked against
an f64 reference in tests/train.rs.) With bf16 weights an update of lr = 1e-2 is about 2 ulps of a norm
weight near 1 and ~80 of a weight of 0.02: both bf16 runs round alike, and the yardstick carries it.

    python3 app/benches/train_parity.py --runner "bash .gpu/run bin train" --out benches/results/h100
    python3 app/benches/train_parity.py   # runner: cargo run --release --bin train --
"""
import argparse
import csv
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoint import build  # noqa: E402

BOUND = 1.5
LOSS_FLOOR, UPDATE_FLOOR = 1e-3, 1e-2


def torch_steps(path, dtype, ids, hp, steps):
    """`steps` AdamW steps of transformers' model in `dtype` on `ids`: (first loss, params after as fp32)."""
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], fused=True)
    first = None
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = float(loss) if first is None else first
    after = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    del model, opt
    torch.cuda.empty_cache()
    return first, after


def ours(runner, path, tokens, hp, steps, backend, out):
    """The train binary on `path` and `tokens`: (first loss, saved weights as fp32 on the GPU)."""
    sel, standalone = ("fused=all", "fused") if backend == "fused" else ("", "naive")
    save, log = os.path.join(out, f"trained-{backend}"), os.path.join(out, f"train-{backend}.csv")
    cmd = shlex.split(runner) + [
        "--model", path, "--tokens", tokens, "--steps", str(steps), "--lr", repr(hp["lr"]),
        "--beta1", repr(hp["beta1"]), "--beta2", repr(hp["beta2"]), "--eps", repr(hp["eps"]),
        "--weight-decay", repr(hp["weight_decay"]), "--fuse", sel, "--standalone", standalone,
        "--csv", log, "--save", save]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise RuntimeError(f"the train binary ({backend}) exited {done.returncode}")
    with open(log) as f:
        first = float(next(csv.DictReader(f))["loss"])
    weights = {n: t.cuda().float() for n, t in load_file(os.path.join(save, "model.safetensors")).items()}
    return first, weights


def rel_l2(a, b):
    den = torch.linalg.vector_norm(b.double())
    return float(torch.linalg.vector_norm((a - b).double()) / den) if den > 0 else float("nan")


def sign_agreement(a, b):
    moved = b != 0
    return float((torch.sign(a[moved]) == torch.sign(b[moved])).double().mean()) if moved.any() else float("nan")


def kind(name):
    """`model.layers.3.self_attn.q_proj.weight` -> `self_attn.q_proj`."""
    return re.sub(r"^model\.(layers\.\d+\.)?|\.weight$", "", name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", default="cargo run --release --bin train --")
    ap.add_argument("--out", default="benches/results")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.batch * a.seq % 8 or a.seq < 2 or a.steps < 1:
        ap.error("--batch x --seq must be a multiple of 8 tokens, --seq at least 2, --steps at least 1")
    hp = {"lr": a.lr, "beta1": a.beta1, "beta2": a.beta2, "eps": a.eps, "weight_decay": a.weight_decay}
    os.makedirs(a.out, exist_ok=True)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"llama-3.2-1b-{a.layers}layers")
        build("llama-3.2-1b", path, a.seed, a.layers)
        ids = np.random.default_rng(a.seed).integers(0, 128256, size=(a.batch, a.seq)).tolist()
        tokens = os.path.join(tmp, "tokens.json")
        with open(tokens, "w") as f:
            json.dump(ids, f)
        ids_t = torch.tensor(ids, device="cuda")
        start = {n: t.cuda().float() for n, t in load_file(os.path.join(path, "model.safetensors")).items()}
        ref_loss, ref = torch_steps(path, torch.float32, ids_t, hp, a.steps)
        bf_loss, bf = torch_steps(path, torch.bfloat16, ids_t, hp, a.steps)
        mine = {}
        for backend in ("naive", "fused"):
            try:
                mine[backend] = ours(a.runner, path, tokens, hp, a.steps, backend, tmp)
            except (RuntimeError, OSError, KeyError, ValueError, StopIteration) as e:
                failed.append(f"{backend}: {e}")
        yard_loss = abs(bf_loss - ref_loss) / abs(ref_loss)
        losses = {"transformers fp32": ref_loss, "transformers bf16": bf_loss}
        for backend, (loss, weights) in mine.items():
            losses[backend] = loss
            err = abs(loss - ref_loss) / abs(ref_loss)
            if err > BOUND * yard_loss + LOSS_FLOOR:
                failed.append(f"{backend} loss {loss:.6f} vs fp32 {ref_loss:.6f}: {err:.2e} > {BOUND} x {yard_loss:.2e} "
                              f"+ {LOSS_FLOOR}")
            names = sorted(ref)  # the model's parameters (a tied lm_head is the embedding)
            missing = [n for n in names if n not in start or n not in weights]
            if missing:
                failed.append(f"{backend}: tensors missing from a checkpoint: {missing[:5]}")
            for name in (n for n in names if n not in missing):
                d_ref, d_bf, d_ours = ref[name] - start[name], bf[name] - start[name], weights[name] - start[name]
                ref_norm = float(torch.linalg.vector_norm(d_ref.double()))
                yard, got = rel_l2(d_bf, d_ref), rel_l2(d_ours, d_ref)
                row = {"backend": backend, "tensor": name, "kind": kind(name), "numel": d_ref.numel(),
                       "ref_update_l2": ref_norm, "transformers_bf16_update_rel_l2": yard, "update_rel_l2": got,
                       "vs_yardstick": got / yard if yard > 0 else float("inf") if got > 0 else 1.0,
                       "transformers_bf16_sign_agreement": sign_agreement(d_bf, d_ref),
                       "sign_agreement": sign_agreement(d_ours, d_ref),
                       "weights_rel_l2_vs_transformers_bf16": rel_l2(weights[name], bf[name])}
                rows.append(row)
                if ref_norm == 0:  # nothing moved in the reference: nothing may move here
                    if float(torch.linalg.vector_norm(d_ours.double())) > 0:
                        failed.append(f"{backend} {name}: moved where the fp32 reference did not")
                elif not got <= BOUND * yard + UPDATE_FLOOR:
                    failed.append(f"{backend} {name}: update rel L2 {got:.3e} > {BOUND} x {yard:.3e} + {UPDATE_FLOOR}")
    if not rows:
        print("FAILED (nothing compared):", *failed, sep="\n  ")
        sys.exit(1)
    with open(os.path.join(a.out, "train_parity.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    gpu = torch.cuda.get_device_name()
    with open(os.path.join(a.out, "train_parity.md"), "w") as f:
        f.write(f"# Training-step parity with transformers {transformers.__version__} (torch {torch.__version__})\n\n")
        f.write(f"GPU: {gpu}. A random-init Llama-3.2-1B-shaped checkpoint with {a.layers} layers written by "
                f"`save_pretrained` (bf16, tied embeddings), {a.batch} x {a.seq} random tokens (labels = inputs), "
                f"{a.steps} step(s) of AdamW(fused=True) lr {a.lr}, betas ({a.beta1}, {a.beta2}), eps {a.eps}, "
                f"weight decay {a.weight_decay}, no clipping. Reference: transformers fp32; yardstick: transformers "
                f"bf16 (bf16 gradients and moments); ours: bf16 weights, f32 gradients and moments. "
                f"Bound: {BOUND}x the yardstick + {UPDATE_FLOOR} (updates), + {LOSS_FLOOR} (loss). "
                f"`app/benches/train_parity.py`.\n\n")
        f.write("| run | first-step loss | rel. error vs fp32 |\n|---|---:|---:|\n")
        for run, loss in losses.items():
            f.write(f"| {run} | {loss:.6f} | {abs(loss - ref_loss) / abs(ref_loss):.2e} |\n")
        f.write("\nWeight updates against the fp32 reference's, by tensor kind (worst layer; sign agreement: "
                "the fraction of moved weights moved the same way):\n\n")
        f.write("| kind | transformers bf16 rel L2 | sign | naive rel L2 | sign | x yardstick | fused rel L2 | sign "
                "| x yardstick |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        kinds = sorted({r["kind"] for r in rows}, key=lambda k: [r["kind"] for r in rows].index(k))
        for k in kinds:
            def worst(backend, key, low=False):
                vals = [r[key] for r in rows if r["kind"] == k and r["backend"] == backend]
                return min(vals) if low else max(vals)
            any_backend = next(iter(mine))
            f.write(f"| {k} | {worst(any_backend, 'transformers_bf16_update_rel_l2'):.3e} | "
                    f"{worst(any_backend, 'transformers_bf16_sign_agreement', True):.2%} |")
            for b in ("naive", "fused"):
                if b not in mine:
                    f.write(" — | — | — |")
                    continue
                f.write(f" {worst(b, 'update_rel_l2'):.3e} | {worst(b, 'sign_agreement', True):.2%} | "
                        f"{worst(b, 'vs_yardstick'):.2f} |")
            f.write("\n")
        f.write(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'All within the bound.'}\n")
    print(f"wrote {a.out}/train_parity.csv and train_parity.md")
    if failed:
        print("FAILED:", *failed, sep="\n  ")
        sys.exit(1)
    print("training parity: every update and the loss within", BOUND, "x transformers' bf16 error (+ floors)")


if __name__ == "__main__":
    main()
