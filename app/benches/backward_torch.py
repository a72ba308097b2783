#!/usr/bin/env python3
"""PyTorch's side of `cargo bench --bench backward`: forward + backward of each training op at the
issue's Llama shapes, bf16 activations, random non-zero inputs.

Ops and what is timed (each row names its `phase`):
- rmsnorm: `F.rms_norm` (eager) at 16384 x 4096 and 16384 x 2048: `fwd` (the training forward,
  recording the graph), `bwd` alone (the graph kept with `retain_graph=True`) and `fwd+bwd`; GB/s
  count what the Rust bench counts: `fwd` x and the weight read, y and an f32 inverse RMS per row
  written; `bwd` dy, x, the weight and the inverse RMS read, dx and dweight written; `fwd+bwd` both.
- sdpa: `F.scaled_dot_product_attention` restricted to CUDNN_ATTENTION and FLASH_ATTENTION, causal
  (top-left), GQA 32/8 heads, BSHD storage viewed as [b, h, s, d]; `fwd+bwd` and `bwd`. If a backend
  refuses `enable_gqa`, K/V are repeated to 32 heads first (the `note` column says so). TFLOP/s count
  the causal half of 4·s²·d·h per forward and 2.5 times that per backward.
- matmul: `nn.Linear` (no bias) on Llama-3.1-8B's projections (qkv, o, gate_up: gate and up are
  one shape, down) at 2048 and 16384 tokens; `dx` is `autograd.grad` of the input alone (one GEMM),
  `dw` of the weight alone (one GEMM, a bf16 gradient); on the down projection `dx+swiglu` is the
  gradient of gate and up through `down(F.silu(gate) * up)` (the GEMM, two muls, silu backward).
  TFLOP/s count the GEMM's 2·T·in·out.
- cross_entropy: `F.cross_entropy(logits.float(), targets)` as Hugging Face's loss runs it
  (`eager_float`), and `F.cross_entropy(logits, targets)` on the bf16 logits (`eager`), 16384 and
  4096 tokens x 128256, `fwd` (the loss, no graph) and `fwd+bwd`; GB/s count the bf16 logits read
  once (and dlogits written once), what a fused kernel must move.
- adamw: `torch.optim.AdamW(fused=True)` over Llama-3.2-1B's 1.24 B parameters (tied embedding),
  f32 and bf16 parameters (gradients of the same dtype), `step`; GB/s count p, m, v read and written
  and g read, m and v in the parameters' dtype as torch keeps them (the Rust side keeps f32 moments).
- grad_norm: `clip_grad_norm_(max_norm=1.0)` over the same gradients, `foreach=False` (`single`)
  and `foreach=True` (`foreach`), `norm+clip`; and the norm alone (`norm`, through
  `torch.nn.utils.get_total_norm` where this torch has it); GB/s count g read (and read + written by
  the clip).
- rope: Hugging Face's `apply_rotary_pos_emb` on Q and K ([b, h, s, d] views of [b, s, h, d]
  storage), 4 x 4096 tokens, `fwd` (no graph) and `bwd` (its autograd); GB/s count Q and K read and
  written.
- embedding: `F.embedding` of 16384 ids into a bf16 128256 x hidden table, `fwd` (no graph) and
  `bwd` (`embedding_dense_backward`, a bf16 table gradient); GB/s count dy read and the table
  gradient written (bf16 here, f32 on the Rust side).

Shapes, phases and units are those of `cargo bench --bench backward` (its rows join these on op,
model, shape, dtype and phase). Gradients come from `torch.autograd.grad` (returned, not accumulated
into `.grad`, so no extra add kernel per call). Timing: 5 warm-up calls, then the median of 15
CUDA-event samples, each over enough back-to-back calls to cover about 2 ms (as the Rust bench). Writes CSV rows (op, model, shape, dtype,
backend, phase, ms, gbps, tflops, note, torch) to the path given as the first argument; a case that
fails (a refused backend, out of memory) is a row with `ms` empty and the error in `note`.
"""
import csv
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_timing  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
LLAMA_8B = {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128}
LLAMA_1B = {"hidden": 2048, "inter": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64, "layers": 16, "vocab": 128256}


def time_ms(fn):
    return cuda_timing.time_ms(fn, warmup=5, samples=15, cover_ms=2.0, max_batch=100)


def randn(*shape, dtype=BF16, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, dtype=torch.float32, generator=g).mul_(scale).to(dtype)


def rmsnorm_cases():
    for model, tokens, hidden in (("Llama-3.1-8B", 16384, 4096), ("Llama-3.2-1B", 16384, 2048)):
        x = randn(tokens, hidden, seed=1).requires_grad_()
        w = (1.0 + 0.1 * randn(hidden, seed=2)).requires_grad_()
        dy = randn(tokens, hidden, seed=3)
        rows, row, stat = tokens * hidden * 2, hidden * 2, tokens * 4
        moved = {"fwd": 2 * rows + row + stat, "bwd": 3 * rows + 2 * row + stat}
        moved["fwd+bwd"] = moved["fwd"] + moved["bwd"]

        def fwd(x=x, w=w, hidden=hidden):
            F.rms_norm(x, (hidden,), w, 1e-5)

        def fwd_bwd(x=x, w=w, dy=dy, hidden=hidden):
            y = F.rms_norm(x, (hidden,), w, 1e-5)
            torch.autograd.grad(y, (x, w), dy)

        y = F.rms_norm(x, (hidden,), w, 1e-5)

        def bwd(y=y, x=x, w=w, dy=dy):
            torch.autograd.grad(y, (x, w), dy, retain_graph=True)

        for phase, fn in (("fwd", fwd), ("bwd", bwd), ("fwd+bwd", fwd_bwd)):
            yield "rmsnorm", model, f"{tokens}x{hidden}", "bf16", "eager", phase, fn, moved[phase], None, ""


def sdpa_cases():
    for model, cfg in (("Llama-3.1-8B", LLAMA_8B), ("Llama-3.2-1B", LLAMA_1B)):
        hq, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        for s in (4096, 8192):
            q = randn(1, s, hq, d, seed=4).transpose(1, 2).requires_grad_()
            k = randn(1, s, hkv, d, seed=5).transpose(1, 2).requires_grad_()
            v = randn(1, s, hkv, d, seed=6).transpose(1, 2).requires_grad_()
            do = randn(1, s, hq, d, seed=7).transpose(1, 2)
            fwd_flops = 4 * s * s * d * hq / 2
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                yield from sdpa_backend_cases(model, s, q, k, v, do, hq, hkv, d, name, backend, fwd_flops)


def sdpa_backend_cases(model, s, q, k, v, do, hq, hkv, d, name, backend, fwd_flops):
    shape = f"b1 s{s} h{hq}/{hkv} d{d} causal"
    for note in ("enable_gqa", "repeated K/V"):
        if note == "enable_gqa":
            kk, vv, kw = k, v, {"enable_gqa": True}
        else:
            kk = k.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            vv = v.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            kw = {}
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
                torch.autograd.grad(o, (q, kk, vv), do, retain_graph=True)
        except RuntimeError as e:  # the backend refuses this case
            if note == "enable_gqa":
                continue
            yield "sdpa", model, shape, "bf16", name, "fwd+bwd", None, None, None, str(e).splitlines()[0][:160]
            return

        def fwd_bwd(kk=kk, vv=vv, kw=kw):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
                torch.autograd.grad(o, (q, kk, vv), do)

        def bwd(o=o, kk=kk, vv=vv):
            torch.autograd.grad(o, (q, kk, vv), do, retain_graph=True)

        yield "sdpa", model, shape, "bf16", name, "fwd+bwd", fwd_bwd, None, 3.5 * fwd_flops, note
        yield "sdpa", model, shape, "bf16", name, "bwd", bwd, None, 2.5 * fwd_flops, note
        return


def matmul_cases():
    h, inter = LLAMA_8B["hidden"], LLAMA_8B["inter"]
    kv = LLAMA_8B["kv_heads"] * LLAMA_8B["head_dim"]
    projections = (("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, inter), ("down", inter, h))
    for tokens in (2048, 16384):
        for name, inp, out in projections:
            lin = torch.nn.Linear(inp, out, bias=False, device=DEV, dtype=BF16)
            with torch.no_grad():
                lin.weight.copy_(randn(out, inp, scale=inp**-0.5, seed=8))
            x = randn(tokens, inp, seed=9).requires_grad_()
            dy = randn(tokens, out, seed=10)
            y = lin(x)

            def dx(y=y, x=x, dy=dy):
                torch.autograd.grad(y, x, dy, retain_graph=True)

            def dw(y=y, lin=lin, dy=dy):
                torch.autograd.grad(y, lin.weight, dy, retain_graph=True)

            flops = 2 * tokens * inp * out
            shape = f"{name} {tokens}x{inp}->{out}"
            yield "matmul", "Llama-3.1-8B", shape, "bf16", "eager", "dx", dx, None, flops, ""
            yield "matmul", "Llama-3.1-8B", shape, "bf16", "eager", "dw", dw, None, flops, ""
            if name == "down":
                gate = randn(tokens, inp, scale=2.0, seed=11).requires_grad_()
                up = randn(tokens, inp, seed=12).requires_grad_()
                out_swiglu = lin(F.silu(gate) * up)

                def swiglu(o=out_swiglu, gate=gate, up=up, dy=dy):
                    torch.autograd.grad(o, (gate, up), dy, retain_graph=True)

                yield "matmul", "Llama-3.1-8B", shape, "bf16", "eager", "dx+swiglu", swiglu, None, flops, ""


def cross_entropy_cases():
    vocab = LLAMA_1B["vocab"]
    for tokens in (16384, 4096):
        logits = randn(tokens, vocab, scale=2.0, seed=11).requires_grad_()
        g = torch.Generator(device=DEV).manual_seed(12)
        targets = torch.randint(0, vocab, (tokens,), device=DEV, generator=g)
        targets[::7] = -100
        n = tokens * vocab * 2

        def upcast_fwd(logits=logits, targets=targets):
            with torch.no_grad():
                F.cross_entropy(logits.float(), targets, ignore_index=-100)

        def direct_fwd(logits=logits, targets=targets):
            with torch.no_grad():
                F.cross_entropy(logits, targets, ignore_index=-100)

        def upcast(logits=logits, targets=targets):
            torch.autograd.grad(F.cross_entropy(logits.float(), targets, ignore_index=-100), logits)

        def direct(logits=logits, targets=targets):
            torch.autograd.grad(F.cross_entropy(logits, targets, ignore_index=-100), logits)

        for backend, fwd, fwd_bwd in (("eager_float", upcast_fwd, upcast), ("eager", direct_fwd, direct)):
            shape = f"{tokens}x{vocab}"
            yield "cross_entropy", "Llama-3", shape, "bf16", backend, "fwd", fwd, n, None, ""
            yield "cross_entropy", "Llama-3", shape, "bf16", backend, "fwd+bwd", fwd_bwd, 2 * n, None, ""
        del logits
        torch.cuda.empty_cache()


def rope_cases():
    batch, seq = 4, 4096
    for model, cfg in (("Llama-3.1-8B", LLAMA_8B), ("Llama-3.2-1B", LLAMA_1B)):
        hq, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        inv_freq = 500000.0 ** (-torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d)
        freqs = torch.outer(torch.arange(seq, device=DEV, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(BF16)[None].expand(batch, seq, d).unsqueeze(1)
        sin = emb.sin().to(BF16)[None].expand(batch, seq, d).unsqueeze(1)
        q = randn(batch, seq, hq, d, seed=14).transpose(1, 2).requires_grad_()
        k = randn(batch, seq, hkv, d, seed=15).transpose(1, 2).requires_grad_()
        dq = randn(batch, seq, hq, d, seed=16).transpose(1, 2)
        dk = randn(batch, seq, hkv, d, seed=17).transpose(1, 2)

        def rotate_half(x):
            return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

        def apply(q=q, k=k, cos=cos, sin=sin):
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        def fwd(apply=apply):
            with torch.no_grad():
                apply()

        qe, ke = apply()

        def bwd(qe=qe, ke=ke, q=q, k=k, dq=dq, dk=dk):
            torch.autograd.grad((qe, ke), (q, k), (dq, dk), retain_graph=True)

        moved = 2 * batch * seq * (hq + hkv) * d * 2
        shape = f"b{batch} s{seq} h{hq}/{hkv} d{d}"
        yield "rope", model, shape, "bf16", "eager", "fwd", fwd, moved, None, ""
        yield "rope", model, shape, "bf16", "eager", "bwd", bwd, moved, None, ""


def embedding_cases():
    tokens, vocab = 16384, LLAMA_1B["vocab"]
    g = torch.Generator(device=DEV).manual_seed(18)
    ids = torch.randint(0, vocab, (tokens,), device=DEV, generator=g)
    for model, hidden in (("Llama-3.1-8B", LLAMA_8B["hidden"]), ("Llama-3.2-1B", LLAMA_1B["hidden"])):
        w = randn(vocab, hidden, seed=19).requires_grad_()
        dy = randn(tokens, hidden, seed=20)

        def fwd(w=w):
            with torch.no_grad():
                F.embedding(ids, w)

        y = F.embedding(ids, w)

        def bwd(y=y, w=w, dy=dy):
            torch.autograd.grad(y, w, dy, retain_graph=True)

        shape = f"{tokens}x{hidden} vocab {vocab}"
        yield "embedding", model, shape, "bf16", "eager", "fwd", fwd, 2 * tokens * hidden * 2, None, ""
        yield "embedding", model, shape, "bf16", "eager", "bwd", bwd, tokens * hidden * 2 + vocab * hidden * 2, None, "bf16 table gradient"


def llama_1b_shapes():
    c = LLAMA_1B
    h, i, kv = c["hidden"], c["inter"], c["kv_heads"] * c["head_dim"]
    shapes = [(c["vocab"], h), (h,)]
    for _ in range(c["layers"]):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    return shapes


def adamw_cases():
    """AdamW, then the gradient norm and clipping on the same gradients (the Rust bench's order)."""
    shapes = llama_1b_shapes()
    count = sum(math.prod(s) for s in shapes)
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    for dtype, name in ((torch.float32, "f32"), (BF16, "bf16")):
        params = [torch.nn.Parameter(randn(*s, dtype=dtype, scale=0.02, seed=13 + k)) for k, s in enumerate(shapes)]
        for k, p in enumerate(params):
            p.grad = randn(*p.shape, dtype=dtype, scale=1e-3, seed=1000 + k)
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        size = torch.finfo(dtype).bits // 8
        # p read + written, g read, m and v read + written (in the parameters' dtype, as torch keeps them)
        moved = count * size * 7
        shape = f"{count} params"
        yield "adamw", "Llama-3.2-1B", shape, name, "fused", "step", opt.step, moved, None, "m, v in the parameters' dtype"
        for backend, foreach in (("single", False), ("foreach", True)):
            grads = [p.grad for p in params]
            if get_total_norm is not None:

                def norm(grads=grads, foreach=foreach):
                    get_total_norm(grads, 2.0, foreach=foreach)

                yield "grad_norm", "Llama-3.2-1B", shape, name, backend, "norm", norm, count * size, None, ""
            else:
                yield "grad_norm", "Llama-3.2-1B", shape, name, backend, "norm", None, None, None, "no torch.nn.utils.get_total_norm in this torch"

            def clip(params=params, foreach=foreach):
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)

            yield "grad_norm", "Llama-3.2-1B", shape, name, backend, "norm+clip", clip, 3 * count * size, None, ""
        del opt, params
        torch.cuda.empty_cache()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "backward_torch.csv"
    version = f"torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()})"
    print(f"# {version}, {torch.cuda.get_device_name()}")
    rows = []
    # The order of the Rust bench: the largest buffers (the logits) last.
    for cases in (adamw_cases, rope_cases, embedding_cases, rmsnorm_cases, sdpa_cases, matmul_cases, cross_entropy_cases):
        try:
            for op, model, shape, dtype, backend, phase, fn, moved, flops, note in cases():
                ms = gbps = tflops = ""
                if fn is not None:
                    try:
                        t = time_ms(fn)
                        ms = f"{t:.5f}"
                        gbps = f"{moved / (t * 1e-3) / 1e9:.1f}" if moved else ""
                        tflops = f"{flops / (t * 1e-3) / 1e12:.1f}" if flops else ""
                    except RuntimeError as e:  # out of memory, a refused backend
                        note = str(e).splitlines()[0][:160]
                rows.append((op, model, shape, dtype, backend, phase, ms, gbps, tflops, note, version))
                print(f"{op} {model} {shape} {dtype} {backend} {phase}: {ms or note} ms {gbps} GB/s {tflops} TFLOP/s")
        except RuntimeError as e:  # a whole group failed to set up (out of memory)
            rows.append((cases.__name__.removesuffix("_cases"), "", "", "", "", "", "", "", "", str(e).splitlines()[0][:160], version))
        torch.cuda.empty_cache()
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "model", "shape", "dtype", "backend", "phase", "ms", "gbps", "tflops", "note", "torch"])
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
