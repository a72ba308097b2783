#!/usr/bin/env python3
"""Writes a random-init Llama checkpoint the way transformers does, for runs without real weights.

    python3 app/benches/random_checkpoint.py llama-3.1-8b OUT_DIR [--layers 32] [--seed 0]

OUT_DIR gets what `save_pretrained` writes (config.json with `rope_parameters`, generation_config.json,
bf16 safetensors, sharded past 5 GB) and a small byte-level BPE `tokenizer.json` trained on this
repository's README (real Llama-3 tokenizers cannot be downloaded here; its ids are a prefix of the
model's vocabulary, so generated ids past it decode to nothing). The model is `LlamaForCausalLM` with
transformers' own initialization (normal, std 0.02), built on the GPU.
"""
import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, factor=32.0,
                         num_hidden_layers=16),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, factor=8.0,
                         num_hidden_layers=32),
}
BOS, EOS = 128000, [128001, 128008, 128009]


def llama_config(shape, layers=None):
    """The LlamaConfig of `shape` (a key of SHAPES): the model's RoPE (llama3 scaling), vocabulary and
    norms, optionally with fewer layers."""
    s = dict(SHAPES[shape])
    factor = s.pop("factor")
    if layers is not None:
        s["num_hidden_layers"] = layers
    return LlamaConfig(
        vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072,
        bos_token_id=BOS, eos_token_id=EOS,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        **s)


def build(shape, path, seed, layers=None):
    """A random-init LlamaForCausalLM of `shape` (a key of SHAPES) saved to `path` in bf16."""
    cfg = llama_config(shape, layers)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def tokenizer(path, corpus):
    """A byte-level BPE tokenizer.json trained on `corpus` (a list of strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build(a.shape, a.out, a.seed, a.layers)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "README.md")) as f:
        corpus = f.read().split("\n\n")
    tokenizer(a.out, corpus)
    print("wrote", a.out, sorted(os.listdir(a.out)))


if __name__ == "__main__":
    main()
