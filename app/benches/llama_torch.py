#!/usr/bin/env python3
"""The model of `cargo bench --bench llama_layer` in PyTorch eager, for a wall-time comparison.

What it runs: a Llama-3.1-8B-shaped decoder (hidden 4096, 32 query heads, 8 K/V heads, head dim 128,
FFN 14336, vocabulary 128256, RoPE theta 500000 with Llama-3 scaling) with 1 and 4 layers, bf16,
random weights (PyTorch's default init), batch 1, a prefill of 2048 tokens under
`torch.inference_mode()`. The modules are written the way Hugging Face's `modeling_llama.py` writes
them: `LlamaRMSNorm` (upcast to f32, pow, mean, rsqrt, scale, downcast, weight multiply), rotary
embedding computed per forward and applied with `rotate_half`, separate q/k/v/o `nn.Linear`s without
bias, `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` with PyTorch's default
backend choice (what recent Transformers versions call), and the SwiGLU MLP `down(silu(gate(x)) *
up(x))` with residual adds. No torch.compile, no CUDA graphs.

Timing: 3 warm-up forwards, then the median of 11 wall-clock samples (host clock around forward +
`torch.cuda.synchronize()`) and of 11 CUDA-event samples. Writes CSV to the path given as the first
argument (scenario, layers, wall_ms, gpu_ms, torch).
"""
import csv
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, EPS = 4096, 32, 8, 128, 14336, 128256, 1e-5
THETA, FACTOR, LOW, HIGH, OLD_CTX = 500000.0, 8.0, 1.0, 4.0, 8192


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + EPS)
        return self.weight * h.to(dtype)


def llama3_inv_freq():
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
    low_wavelen, high_wavelen = OLD_CTX / LOW, OLD_CTX / HIGH
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / FACTOR, inv_freq)
    smooth = (OLD_CTX / wavelen - LOW) / (HIGH - LOW)
    smoothed = (1 - smooth) * scaled / FACTOR + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", llama3_inv_freq(), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = LlamaAttention()
        self.mlp = LlamaMLP()
        self.input_layernorm = LlamaRMSNorm(HIDDEN)
        self.post_attention_layernorm = LlamaRMSNorm(HIDDEN)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(layers))
        self.norm = LlamaRMSNorm(HIDDEN)
        self.rotary_emb = LlamaRotaryEmbedding()

    def forward(self, ids):
        x = self.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


def measure(model, ids):
    for _ in range(3):
        model(ids)
    torch.cuda.synchronize()
    wall, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(11):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
        start.record()
        model(ids)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(wall), statistics.median(gpu)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "llama_torch.csv"
    version = f"torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()})"
    print(f"# {version}, {torch.cuda.get_device_name()}")
    rows = []
    with torch.inference_mode():
        for layers in (1, 4):
            torch.manual_seed(0)
            model = LlamaModel(layers).to(device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, VOCAB, (1, 2048), device="cuda")
            wall, gpu = measure(model, ids)
            print(f"prefill 2048, {layers} layer(s): {wall:.3f} ms wall, {gpu:.3f} ms GPU")
            rows.append(("prefill 2048", layers, f"{wall:.4f}", f"{gpu:.4f}", version))
            del model
            torch.cuda.empty_cache()
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "layers", "wall_ms", "gpu_ms", "torch"])
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
