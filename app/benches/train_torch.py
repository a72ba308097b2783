#!/usr/bin/env python3
"""PyTorch's side of `cargo bench --bench train_step`: one training step of the same model in
transformers, at the same batch x sequence settings.

The model is `LlamaForCausalLM` from a `LlamaConfig` with Llama-3.2-1B's shapes (hidden 2048, 16
layers, 32/8 heads of 64, MLP 8192, vocabulary 128256, tied embeddings, RoPE theta 500000 with llama3
scaling factor 32; `random_checkpoint.llama_config`), transformers' random init (seeded), cast with
`.to(torch.bfloat16)`, `attn_implementation="sdpa"`. One iteration is

    loss = model(input_ids=ids, labels=ids, use_cache=False).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

with `torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
fused=True)` (bf16 parameters, gradients and moments, as torch keeps them; `use_cache=False`, as
training does: no KV cache is built). It runs once per
variant (`backend` column):
- `sdpa-cudnn`, `sdpa-flash`, `sdpa-efficient`: eager, with SDPA restricted to one backend by
  `torch.nn.attention.sdpa_kernel` (CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION) around
  the whole iteration;
- `compile`: `torch.compile(model)` (default options and SDPA dispatch; dynamo reset for each
  setting, so every setting compiles for its own static shapes, in its cold iteration).

Per variant and setting: a fresh optimizer; the first (cold) iteration's wall seconds; then `--warm`
iterations (default 3; `--quick`: 1), each timed with CUDA events around the forward (the loss
included), `loss.backward()` and `opt.step()` + `opt.zero_grad()`, and on the host (wall, to the
end of the iteration's GPU work); medians are written; `torch.cuda.max_memory_allocated()` since
the optimizer was made is the peak (parameters, gradients, optimizer state, activations). A setting
that runs out of memory is run again with `model.gradient_checkpointing_enable()` (the `checkpoint`
column says so; `--checkpoint on|off` changes that); one that still fails, or a backend that refuses
(e.g. "No available kernel"), is a row with `note` and empty times, not a crash.

Token ids are those of the Rust bench ((b * 7919 + t * 104729 + 1) mod vocab). Writes CSV rows
(setting, batch, seq, tokens, backend, checkpoint, cold_s, iter_s, gpu_s, forward_s, backward_s,
optimizer_s, tokens_per_s, peak_gib, loss, note, torch, gpu) to OUT, rewritten after every row so that
a run cut short keeps what it measured. The Rust bench joins them by setting (`TORCH_TRAIN_CSV`).

    python3 app/benches/train_torch.py OUT.csv                       # 2x8192,12x1024, every variant
    python3 app/benches/train_torch.py OUT.csv --settings all        # the six settings
    python3 app/benches/train_torch.py OUT.csv --settings 6x2048 --variants sdpa-cudnn,compile --quick
"""
import argparse
import csv
import gc
import os
import statistics
import sys
import time

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoint import llama_config  # noqa: E402

SETTINGS = ["1x16384", "2x8192", "3x4096", "6x2048", "12x1024", "24x768"]
DEFAULT_SETTINGS = "2x8192,12x1024"
VARIANTS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "compile": None}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.0
COLUMNS = ["setting", "batch", "seq", "tokens", "backend", "checkpoint", "cold_s", "iter_s", "gpu_s",
           "forward_s", "backward_s", "optimizer_s", "tokens_per_s", "peak_gib", "loss", "note", "torch", "gpu"]


def parse_settings(text):
    """`all` or a comma-separated list of BATCHxSEQ, each a step of a multiple of 8 tokens."""
    names = SETTINGS if text.strip() == "all" else [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("no setting given: expected e.g. 2x8192,12x1024 or all")
    out = []
    for name in names:
        try:
            batch, seq = (int(x) for x in name.split("x"))
        except ValueError:
            raise ValueError(f"setting `{name}`: expected BATCHxSEQ, e.g. 2x8192") from None
        if batch < 1 or seq < 2 or batch * seq % 8:
            raise ValueError(f"setting `{name}`: at least 1 sequence of at least 2 tokens, a multiple of 8 tokens")
        out.append((f"{batch}x{seq}", batch, seq))
    return out


def parse_variants(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise ValueError(f"variants {bad or text!r}: expected a list of {', '.join(VARIANTS)}")
    return names


def token_ids(batch, seq, vocab):
    t = torch.arange(seq, dtype=torch.int64)
    b = torch.arange(batch, dtype=torch.int64)[:, None]
    return ((b * 7919 + t * 104729 + 1) % vocab).cuda()


def out_of_memory(e):
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def make_model(layers, seed):
    cfg = llama_config("llama-3.2-1b", layers)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        try:
            model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        except (TypeError, ValueError, AttributeError):
            cfg._attn_implementation = "sdpa"
            model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.train()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise SystemExit(f"transformers set attention `{impl}`, not sdpa")
    return model


def cleanup(model):
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()


def run_variant(model, variant, ids, warm, checkpoint):
    """One variant at one setting: (cold wall s, warm medians per phase, peak GiB, first loss)."""
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    run = model
    if variant == "compile":
        torch._dynamo.reset()
        run = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            fused=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def iteration():
        ev[0].record()
        loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        return loss

    backend = VARIANTS[variant]
    samples = []
    try:
        for i in range(warm + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if backend is None:
                loss = iteration()
            else:
                with sdpa_kernel(backend):
                    loss = iteration()
            ev[3].synchronize()
            wall = time.perf_counter() - start
            if i == 0:
                cold, first_loss = wall, float(loss)
            else:
                samples.append((wall, ev[0].elapsed_time(ev[3]) * 1e-3, ev[0].elapsed_time(ev[1]) * 1e-3,
                                ev[1].elapsed_time(ev[2]) * 1e-3, ev[2].elapsed_time(ev[3]) * 1e-3))
            del loss
        peak = torch.cuda.max_memory_allocated() / 2**30
    finally:
        del opt, run
        model.gradient_checkpointing_disable()
        if variant == "compile":
            torch._dynamo.reset()
    med = [statistics.median(col) for col in zip(*samples)]
    return cold, med, peak, first_loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="train_torch.csv")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"BATCHxSEQ list, or all ({','.join(SETTINGS)})")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a list of " + ", ".join(VARIANTS))
    ap.add_argument("--warm", type=int, default=3, help="warm iterations (medians)")
    ap.add_argument("--quick", action="store_true", help="one warm iteration")
    ap.add_argument("--checkpoint", choices=["auto", "on", "off"], default="auto",
                    help="gradient checkpointing: auto (only after running out of memory), on, off")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers, for a quick look")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        settings, variants = parse_settings(a.settings), parse_variants(a.variants)
    except ValueError as e:
        ap.error(str(e))
    warm = 1 if a.quick else a.warm
    if warm < 1:
        ap.error("--warm must be at least 1")
    version = f"torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()}), transformers {transformers.__version__}"
    gpu = torch.cuda.get_device_name()
    print(f"# {version}, {gpu}; settings {','.join(s[0] for s in settings)}; variants {','.join(variants)}; "
          f"{warm} warm iterations", flush=True)
    model = make_model(a.layers, a.seed)
    vocab = model.config.vocab_size
    print(f"# {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, "
          f"{model.config.num_hidden_layers} layers, attention {model.config._attn_implementation}", flush=True)
    rows = []

    def write():
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)

    for name, batch, seq in settings:
        ids = token_ids(batch, seq, vocab)
        for variant in variants:
            row = {k: "" for k in COLUMNS}
            row.update(setting=name, batch=batch, seq=seq, tokens=batch * seq, backend=variant, torch=version, gpu=gpu)
            tries = {"on": [True], "off": [False], "auto": [False, True]}[a.checkpoint]
            result = None
            for checkpoint in tries:
                error = None
                try:
                    result = run_variant(model, variant, ids, warm, checkpoint)
                except Exception as e:  # out of memory, a refused backend, a compile failure: a row
                    error = (first_line(e), out_of_memory(e))
                cleanup(model)
                row["checkpoint"] = ("no" if not checkpoint else "gradient checkpointing (asked)" if a.checkpoint == "on"
                                     else "gradient checkpointing (out of memory without)")
                if error is None:
                    break
                retried = checkpoint and a.checkpoint == "auto"
                row["note"] = f"out of memory without gradient checkpointing; with it: {error[0]}" if retried else error[0]
                print(f"{name} {variant} checkpoint={checkpoint}: {error[0]}", flush=True)
                if not error[1]:
                    break  # not a matter of memory: checkpointing would not help
            if result is not None:
                cold, (wall, gpu_s, fwd, bwd, opt), peak, loss = result
                row.update(cold_s=f"{cold:.3f}", iter_s=f"{wall:.5f}", gpu_s=f"{gpu_s:.5f}", forward_s=f"{fwd:.5f}",
                           backward_s=f"{bwd:.5f}", optimizer_s=f"{opt:.5f}", tokens_per_s=f"{batch * seq / wall:.0f}",
                           peak_gib=f"{peak:.2f}", loss=f"{loss:.4f}", note="")
                print(f"{name} {variant}: cold {cold:.2f} s, warm {wall:.4f} s/iteration (fwd {fwd:.4f}, bwd {bwd:.4f}, "
                      f"opt {opt:.4f} GPU s), {batch * seq / wall:.0f} tokens/s, peak {peak:.2f} GiB, "
                      f"checkpoint {row['checkpoint']}", flush=True)
            rows.append(row)
            write()
        del ids
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
