#!/usr/bin/env python3
"""Records llama/tests/fixtures/chat_templates.json: chat templates rendered by jinja2 with the settings
transformers' `apply_chat_template` compiles templates with (an immutable sandboxed environment,
`trim_blocks`, `lstrip_blocks`, the loop-controls extension, a `raise_exception` global; messages,
`add_generation_prompt` and the special tokens as variables), for llama/src/chat.rs's tests.

    python3 app/benches/chat_fixtures.py [PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf]

With the GGUF file the SmolLM2 template is read from it (`tokenizer.chat_template`, needs `gguf`);
without, the copy below (the same text) is used.
"""
import json
import os
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "llama", "tests", "fixtures",
                   "chat_templates.json")

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# What templates commonly use: bos_token, whitespace control, loop variables, Python string methods,
# alternation checked with raise_exception.
COMMON = """{{ bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) and message['role'] != 'system' %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message.role == 'system' %}
        {{- '[SYS] ' + message['content'].strip() + '\\n' }}
    {%- else %}
        {{- '<|' + message['role'].upper() + '|>' + message['content'] | trim }}
        {%- if not loop.last %}{{ '\\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '\\n<|ASSISTANT|>' }}
{%- else %}
    {{- eos_token }}
{%- endif %}"""

LLAMA3ISH = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

PY = """{% for m in messages %}{{ m.content.split(' ') | length }}:{% if m.content.startswith('Hi') %}hi{% endif %}:{{ m.content.replace('a', 'o') }}
{% endfor %}"""


def render(template, messages, add, bos, eos):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add, bos_token=bos, eos_token=eos)


def main():
    smollm2 = SMOLLM2
    if len(sys.argv) > 1:
        from gguf import GGUFReader
        smollm2 = GGUFReader(sys.argv[1]).fields["tokenizer.chat_template"].contents()
        assert smollm2 == SMOLLM2, "the GGUF file's template differs from the copy here"
    user = [{"role": "user", "content": "What is the capital of France?"}]
    convo = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi there"},
             {"role": "assistant", "content": " Paris. "}, {"role": "user", "content": "And Spain?"}]
    cases = [
        ("smollm2, one user message, generation prompt", smollm2, user, True, "<|im_start|>", "<|im_end|>"),
        ("smollm2, a conversation, no generation prompt", smollm2, convo, False, "<|im_start|>", "<|im_end|>"),
        ("common, a conversation, generation prompt", COMMON, convo, True, "<s>", "</s>"),
        ("common, no generation prompt", COMMON, user, False, "<s>", "</s>"),
        ("llama-3-like", LLAMA3ISH, convo, True, "<|begin_of_text|>", "<|eot_id|>"),
        ("python string methods", PY, convo, False, "", ""),
        ("roles out of order", COMMON, [{"role": "assistant", "content": "x"}], True, "<s>", "</s>"),
    ]
    out = []
    for name, template, messages, add, bos, eos in cases:
        case = {"name": name, "template": template, "messages": messages, "add_generation_prompt": add,
                "bos_token": bos, "eos_token": eos}
        try:
            case["expected"] = render(template, messages, add, bos, eos)
        except jinja2.exceptions.TemplateError as e:
            case["expected"] = None
            case["error"] = str(e)
        out.append(case)
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1, ensure_ascii=False)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
