"""The Ollama ``Modelfile`` written beside an exported GGUF (``ollama create NAME -f X.Modelfile``):
``FROM`` the GGUF beside it, ``TEMPLATE`` the model's chat template in Ollama's Go-template form,
``PARAMETER stop`` for each special token the chat template writes and the end-of-sequence token.

Ollama's templates are Go templates over ``.Messages`` (each with ``.Role`` and ``.Content``); a
Jinja chat template has no general translation, so the two shapes nearly every chat model uses
are recognised: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``: Qwen, SmolLM, the tiny model) and
Llama-3 (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``). A shape is taken only
when the model's own template, rendered by transformers for a probe conversation, gives exactly
what the Go template gives; otherwise TEMPLATE is left out (Ollama then guesses from the GGUF's
own ``tokenizer.chat_template``) and the file says so. A default system prompt the template adds
when the conversation has none becomes ``SYSTEM`` (Ollama puts it first in ``.Messages``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Go templates, as Ollama's own library writes them for these shapes, without tool calls. The
# last message, when not the assistant's, is followed by the assistant's header (Jinja's
# add_generation_prompt).
GO_TEMPLATES = {
    "chatml": (
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 -}}\n"
        "<|im_start|>{{ .Role }}\n"
        "{{ .Content }}<|im_end|>\n"
        "{{ if and $last (ne .Role \"assistant\") }}<|im_start|>assistant\n"
        "{{ end }}\n"
        "{{- end }}"
    ),
    "llama3": (
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 -}}\n"
        "<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
        "{{ .Content }}<|eot_id|>\n"
        "{{- if and $last (ne .Role \"assistant\") }}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{{ end }}\n"
        "{{- end }}"
    ),
}

PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
         {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4+4?"}]


def go_render(shape: str, messages: list[dict[str, str]]) -> str:
    """What Ollama's Go template ``GO_TEMPLATES[shape]`` renders for ``messages`` (a last
    message that is not the assistant's is followed by the assistant's header)."""
    out = []
    for m in messages:
        if shape == "chatml":
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        else:
            out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>")
    if messages and messages[-1]["role"] != "assistant":
        out.append("<|im_start|>assistant\n" if shape == "chatml" else "<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def template_shape(tokenizer: Any) -> tuple[str | None, str | None]:
    """(shape, default system prompt) of the tokenizer's chat template: "chatml" or "llama3" when
    it renders the probe conversation exactly as that Go template does (a leading BOS left to
    the tokenizer, which llama.cpp adds as the GGUF's add_bos_token says), else (None, None)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None, None
    shape = ("chatml" if "<|im_start|>" in template and "<|im_end|>" in template
             else "llama3" if "<|start_header_id|>" in template and "<|eot_id|>" in template else None)
    if shape is None:
        return None, None

    def render(messages: list[dict[str, str]]) -> str:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        bos = getattr(tokenizer, "bos_token", None)
        return text[len(bos):] if bos and text.startswith(bos) else text

    try:
        if render(PROBE) != go_render(shape, PROBE):
            return None, None
        bare = render(PROBE[1:])
    except Exception:  # noqa: BLE001  (a template that raises on the probe: not this shape)
        return None, None
    if bare == go_render(shape, PROBE[1:]):
        return shape, None
    head = (re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", bare, re.DOTALL) if shape == "chatml"
            else re.match(r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", bare, re.DOTALL))
    if head and bare == go_render(shape, [{"role": "system", "content": head.group(1)}, *PROBE[1:]]):
        return shape, head.group(1)
    return None, None


def stop_tokens(tokenizer: Any) -> list[str]:
    """The special tokens the chat template writes, and the end-of-sequence token: where
    generation must stop (Ollama's ``PARAMETER stop``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    stops = [t for t in special if t in template]
    eos = getattr(tokenizer, "eos_token", None)
    if eos and eos not in stops:
        stops.append(eos)
    return stops


def _quoted(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile(model_dir: Path, gguf_name: str) -> str:
    """The Modelfile for the GGUF file ``gguf_name`` (in the same directory) of the model in
    ``model_dir`` (its tokenizer and chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    shape, system = template_shape(tokenizer)
    lines = [f"# ollama create NAME -f {Path(gguf_name).with_suffix('.Modelfile').name}   (written by finetune-export)",
             f"FROM ./{gguf_name}"]
    if shape:
        lines.append(f"TEMPLATE {_quoted(GO_TEMPLATES[shape])}")
    else:
        lines.append("# no TEMPLATE: the chat template is neither ChatML nor Llama-3 as recognised here; Ollama "
                     "picks one from the GGUF's tokenizer.chat_template")
    if system:
        lines.append(f"SYSTEM {_quoted(system)}")
    lines += [f'PARAMETER stop "{t}"' for t in stop_tokens(tokenizer)]
    return "\n".join(lines) + "\n"
