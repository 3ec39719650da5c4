"""``finetune-export``: move a LoRA/DoRA adapter between PEFT and mlx-lm, or fuse it into its base.

    finetune-export --to peft SRC DST      # mlx-lm adapter (or a backend=mlx run) -> PEFT
    finetune-export --to mlx SRC DST       # PEFT adapter (or a backend=cuda run) -> mlx-lm
    finetune-export --merge SRC DST        # adapter + base -> one HF-format model directory
    finetune-export --to gguf SRC DST.gguf [--quant f16|bf16|q8_0|q4_0]
                                           # adapter + base, or a merged model -> one GGUF file for
                                           # llama.cpp / Ollama, and DST.Modelfile beside it

SRC is an adapter directory in either format (ours or the peers' own: mlx-lm's
``adapters.safetensors`` + ``adapter_config.json``, PEFT's ``adapter_config.json`` +
``adapter_model.safetensors``) or a run directory holding one in ``adapter/``.

The two formats hold the same numbers in other shapes (read from mlx_lm/tuner/lora.py, dora.py and
peft/tuners/lora/layer.py, dora.py):

=================  ==============================  ==========================================
                   mlx-lm 0.32                      PEFT 0.21
=================  ==============================  ==========================================
down-projection    ``lora_a`` [in, r]              ``lora_A.weight`` [r, in]
up-projection      ``lora_b`` [r, out]             ``lora_B.weight`` [out, r]
update             ``scale * (x @ a) @ b``         ``lora_alpha / r * B(A(x))`` (rsLoRA: / sqrt r)
DoRA magnitude     ``m`` [out]                     ``lora_magnitude_vector`` [out]
layers             top ``num_layers`` blocks       ``layers_to_transform`` (any list)
modules            ``keys``: paths in a block      ``target_modules``: name suffixes
tensor names       ``model.layers.0.self_attn.     ``base_model.model.model.layers.0.self_attn.
                   q_proj.lora_a``                 q_proj.lora_A.weight``
=================  ==============================  ==========================================

DoRA's magnitude has one meaning on both sides: the norm of each output row of the adapted
weight ``W + scale * B @ A`` ([out, in], norm over ``in``; mlx ``norm(w, axis=1)``, PEFT
``norm(w, dim=1)``), so it is copied as is. Converting reorders and transposes tensors and never
does arithmetic on them (``lora_alpha = scale * r``), so every value, bf16 included, crosses
bit for bit. Reading and writing is the project's own safetensors code (finetune/model/safetensors_io.py,
numpy, which has no bf16), so ``--to`` imports neither torch nor mlx; ``--merge`` uses
transformers + PEFT, or mlx-lm for an MLX-quantized base.

Safety, as training has it: every loader gets ``trust_remote_code`` (off unless
``--trust-remote-code``), and base weights load from safetensors only unless ``--allow-pickle``
(a pickle runs code when loaded; see finetune/model/source.py ``check_weights``). No token or key
(an HF/W&B/MLflow environment variable's value, a value under a secret-named key of the adapter's
or the base's config) reaches a file this writes: each output is scrubbed in its temporary
directory (finetune/redact.py) and checked before it is renamed into place.

The package, one job a module: ``adapters`` reads an adapter in either format, ``basemodel``
reads its base and checks the adapter against it, ``conversion`` writes the other format
(``--to``), ``merging`` fuses it into its base (``--merge``), ``gguf_file`` writes a merged model
as GGUF (``--to gguf``) and ``modelfile`` the Ollama Modelfile beside it; this module is the
command line.
"""

from __future__ import annotations

import argparse
import sys

from finetune.errors import UserError
from finetune.export.conversion import WRITERS, convert
from finetune.export.gguf_file import QUANTS, export_gguf
from finetune.export.merging import merge

__all__ = ["convert", "export_gguf", "main", "merge"]


def main(argv: list[str] | None = None) -> int:
    """``finetune-export``: see the module docstring. Exit 0, or 2 with one ``error:`` line."""
    ap = argparse.ArgumentParser(
        prog="finetune-export", description="Move a LoRA/DoRA adapter between PEFT and mlx-lm, merge it into "
        "its base, or write the merged model as GGUF (llama.cpp, Ollama).",
        epilog="e.g. finetune-export --to peft outputs/RUN peft-adapter/;  "
        "finetune-export --merge outputs/RUN merged/;  finetune-export --to gguf outputs/RUN model.gguf --quant q8_0")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--to", choices=[*sorted(WRITERS), "gguf"],
                     help="write the adapter in this format; gguf: the model (adapter merged into its base, or a "
                     "merged model directory) as one .gguf file with an Ollama Modelfile beside it")
    how.add_argument("--merge", action="store_true", help="fuse the adapter into its base: an HF model directory")
    ap.add_argument("src", help="adapter directory (PEFT or mlx-lm) or a finetune run directory")
    ap.add_argument("dst", help="output directory, or with --to gguf a .gguf file (written whole or not at all)")
    ap.add_argument("--base", default=None, help="base model directory or hub id (default: the adapter's own config)")
    ap.add_argument("--dequantize", action="store_true",
                    help="--merge onto an MLX-quantized base: write it dequantized (in the dtype of its "
                    "scales, usually 16-bit), which costs disk; without it the cost is printed")
    ap.add_argument("--quant", choices=QUANTS, default="f16",
                    help="--to gguf: the weights' type (default f16; norms and biases stay f32 as llama.cpp keeps them)")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="--merge: let the base's own Python code run (custom architectures); only for a source you "
                    "trust (default: off, as model.trust_remote_code)")
    ap.add_argument("--allow-pickle", action="store_true",
                    help="accept a base whose weights are pickles (*.bin), which run code when loaded; only for a "
                    "source you trust (default: safetensors only, as model.allow_pickle)")
    a = ap.parse_args(argv)
    try:
        if a.merge:
            out = merge(a.src, a.dst, base=a.base, dequantize=a.dequantize, overwrite=a.overwrite,
                        trust_remote_code=a.trust_remote_code, allow_pickle=a.allow_pickle)
        elif a.to == "gguf":
            out = export_gguf(a.src, a.dst, quant=a.quant, base=a.base, dequantize=a.dequantize,
                              overwrite=a.overwrite, trust_remote_code=a.trust_remote_code,
                              allow_pickle=a.allow_pickle)
        else:
            out = convert(a.src, a.dst, a.to, base=a.base, overwrite=a.overwrite, allow_pickle=a.allow_pickle)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or missing parent: DST is left as it was
        where = e.filename or a.dst
        print(f"error: cannot write {where} ({e.strerror or e}); nothing was written to {a.dst}: free space or "
              "choose another output directory", file=sys.stderr)
        return 2
    if a.to == "gguf":
        side = out.with_suffix(".Modelfile")
        print(f"wrote {out} ({out.stat().st_size:,} bytes, {a.quant}) and {side}; run it: ollama create NAME -f {side}",
              file=sys.stderr)
    else:
        print(f"wrote {out}", file=sys.stderr)
    return 0

