"""GGUF: a model (a base plus an adapter, merged first, or a merged checkpoint) written as one
``.gguf`` file for llama.cpp, Ollama and LM Studio, with the ``gguf`` package (llama.cpp's own
Python writer: its architecture and tensor-name maps, metadata keys and quantizers).

What goes in follows llama.cpp's ``convert_hf_to_gguf.py`` (``TextModel.prepare_tensors``,
``set_gguf_parameters``, ``_set_vocab_gpt2``; ``LlamaModel.modify_tensors``): 1-D tensors and
norms stay F32 (llama.cpp's kernels take them so), every other weight gets the chosen type, and a
row a block quantizer cannot split falls back to F16; Llama's (and Mistral's) q/k rows are
permuted to llama.cpp's rotary layout; the tokenizer (tokens, their types, merges, the special
ids, the chat template) rides in the metadata. ``q4_0`` is llama-quantize's type, not convert's:
llama-quantize gives the output head Q6_K, which ``gguf`` cannot write, so it gets Q8_0 here.

Memory and disk: tensors are read one at a time from the safetensors files (memory-mapped) and
written one at a time (the writer is told every tensor's type and size first, as llama.cpp's lazy
mode does), so RAM holds one tensor and its quantized copy, never the model twice. The disk a
write needs (and a merge's temporary directory) is checked before anything is written; the file
is written under a temporary name beside DST and renamed into place, and any failure (a full
disk) removes it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune.errors import UserError
from finetune.export.adapters import (
    MLX_CONFIG,
    MLX_WEIGHTS,
    find_adapter_dir,
    read_adapter,
    read_json,
)
from finetune.export.basemodel import check_against_base, resolve_base
from finetune.export.merging import dequantize_cost, merge
from finetune.export.modelfile import modelfile
from finetune.io import umask_mode
from finetune.model.safetensors_io import header, tensors_of
from finetune.run.faults import Faults

# f32: every tensor as the checkpoint holds it in fp32 (convert_hf_to_gguf.py --outtype f32), the
# exact one; f16 rounds each weight to 11 significant bits, which moves the tiny fp32 models'
# logits by 3e-4 (Llama) to 2.7e-3 (Qwen2): the same numbers llama.cpp's convert writes
# (tests/test_gguf_export.py)
QUANTS = ("f16", "bf16", "q8_0", "q4_0", "f32")

# model_type -> (gguf architecture name, q/k rows permuted as llama.cpp's LlamaModel does). The
# families whose architecture gguf names with the tensor map of transformers' own names, and that
# finetune describes exactly (finetune/model/describe.py FAMILIES). llama.cpp writes Mistral as
# its llama architecture (convert_hf_to_gguf.py registers MistralForCausalLM on LlamaModel).
FAMILIES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),  # q/k norms: gguf's attn_q_norm / attn_k_norm, F32 as every norm
}

# the bytes a file's metadata may take beyond its tensors (the vocabulary and merges are counted
# from tokenizer.json's size on top): a margin for the disk check, not a measurement
_METADATA_MARGIN = 1 << 20


@dataclass
class Plan:
    """One tensor of the output: its GGUF name, the source (file, name) it comes from, its
    logical shape and its GGML type."""

    name: str
    file: Path
    src: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    dtype: str = "F32"  # safetensors' dtype of the source
    offset: int = 0  # where the source's bytes start in ``file``


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise UserError("--to gguf needs the gguf package (pip install '.[gguf]')") from None
    return gguf


def family(config: dict[str, Any], where: Path) -> tuple[str, bool]:
    """(gguf architecture, permute q/k) of the model whose config.json is ``config``; UserError
    naming the family otherwise, and for a RoPE scaling neither llama.cpp's metadata nor its
    rope_freqs tensor says."""
    mtype = config.get("model_type")
    if mtype not in FAMILIES:
        raise UserError(f"{where}: family {mtype!r} is not exported to GGUF (exported: {', '.join(FAMILIES)}); "
                        "convert it with llama.cpp's convert_hf_to_gguf.py from a --merge output")
    rope = _rope(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3") or (
            rope.get("rope_type") == "llama3" and FAMILIES[mtype][0] != "llama"):
        raise UserError(f"{where}: rope_type={rope.get('rope_type')!r} is not exported to GGUF (exported: default, "
                        "linear, llama3 on Llama); convert it with llama.cpp's convert_hf_to_gguf.py")
    return FAMILIES[mtype]


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters: transformers 5's ``rope_parameters``, or the older ``rope_scaling``
    beside ``rope_theta``."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved, (head, 2, d/2) -> (head, d/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype(gguf: Any, name: str, shape: tuple[int, ...], quant: str, head: bool) -> Any:
    """The GGML type of tensor ``name`` (its GGUF name) at ``quant``, as convert_hf_to_gguf.py's
    prepare_tensors picks it: 1-D tensors, norms and anything not a ``.weight`` stay F32; a row
    the block quantizer cannot split (its last dimension not a multiple of the block) is F16."""
    T = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return T.F32
    q = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q8_0 if head else T.Q4_0}[quant]
    block, _ = gguf.GGML_QUANT_SIZES[q]
    return q if shape[-1] % block == 0 else T.F16


def _nbytes(gguf: Any, shape: tuple[int, ...], qtype: Any) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape[:-1]) * shape[-1] // block * size


def plan(model_dir: Path, arch: str, quant: str) -> list[Plan]:
    """Every tensor of the checkpoint in ``model_dir`` (its safetensors headers; nothing loaded),
    under its GGUF name and type. UserError for a weight the architecture's map does not name."""
    gguf = _gguf()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} holds no *.safetensors weights; give a merged model directory or an adapter")
    shapes: dict[str, tuple[Path, tuple[int, ...], str, int]] = {}
    for f in files:
        head, start = header(f)
        shapes.update({k: (f, tuple(v["shape"]), v["dtype"], start + v["data_offsets"][0])
                       for k, v in tensors_of(head).items()})
    config = json.loads((model_dir / "config.json").read_text())
    tmap = gguf.get_tensor_name_map(_arch_enum(gguf, arch), int(config["num_hidden_layers"]))
    has_output = "lm_head.weight" in shapes
    out: list[Plan] = []
    for src, (f, shape, dtype, offset) in shapes.items():
        if src.endswith(".rotary_emb.inv_freq"):
            continue  # recomputed from rope_theta, as convert_hf_to_gguf.py drops it
        name = tmap.get_name(src, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(f"{model_dir}: weight {src} has no name in gguf's {arch} tensor map; "
                            "convert it with llama.cpp's convert_hf_to_gguf.py")
        is_head = name == "output.weight" or (name == "token_embd.weight" and not has_output)
        out.append(Plan(name, f, src, shape, _qtype(gguf, name, shape, quant, is_head), dtype, offset))
    return out


def _arch_enum(gguf: Any, arch: str) -> Any:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _read(p: Plan) -> np.ndarray:
    """Tensor ``p.src`` of ``p.file`` as float32, read from a memory map (bf16 widened by its bits)."""
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(p.dtype)
    if dtype is None:
        raise UserError(f"{p.file}: tensor {p.src} is {p.dtype}; only F32, F16 and BF16 weights are exported "
                        "(an MLX-quantized model needs --dequantize)")
    raw = np.memmap(p.file, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=p.offset,
                    shape=(math.prod(p.shape),))
    if p.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(p.shape)
    return np.asarray(raw, dtype=np.float32).reshape(p.shape)


def _llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for Llama-3 RoPE (LlamaModel.generate_extra_tensors):
    per rotary pair, the factor its frequency is divided by."""
    rope = _rope(config)
    dim = _head_dim(config)
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _pre_tokenizer(tok: dict[str, Any], where: Path) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE tokenizer as transformers loads it
    (``tok``: its backend's JSON; transformers 5 gives a Qwen2 or Llama tokenizer class its own
    splitting rule, whatever tokenizer.json says): GPT-2's own regex ("gpt-2"), or a Split on
    Qwen2's ("qwen2") or Llama-3's ("llama-bpe") regex before a regex-free ByteLevel.
    (convert_hf_to_gguf.py hashes the encoding of a fixed text against released tokenizers; a
    trained tokenizer is known by its splitting rule instead.)"""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "gpt-2"
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name in ("qwen2", "llama-bpe"):
            if regex == GGUF_PRE_TOKENIZER_SPLITS[name]:
                return name
    raise UserError(f"{where}: the tokenizer splits text in a way llama.cpp does not name (its pre_tokenizer is "
                    f"{json.dumps(pre)[:80]}); convert it with llama.cpp's convert_hf_to_gguf.py")


def load_tokenizer(model_dir: Path) -> tuple[Any, str]:
    """(the tokenizer transformers loads from ``model_dir``, llama.cpp's name of its
    pre-tokenizer); UserError, in one line, for one GGUF export does not write: not a fast
    byte-level BPE tokenizer, or one that splits text in a way llama.cpp does not name."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        tok = json.loads(tokenizer.backend_tokenizer.to_str())
    except (OSError, ValueError, AttributeError) as e:
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise UserError(f"{model_dir}: no fast tokenizer loads ({first}); only byte-level BPE tokenizers are "
                        "exported to GGUF") from None
    model = tok.get("model") or {}
    decoder = (tok.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise UserError(f"{model_dir}: a {model.get('type')} tokenizer with a {decoder} decoder; only byte-level BPE "
                        "tokenizers (Llama-3, Qwen2 and GPT-2 style) are exported to GGUF; convert it with "
                        "llama.cpp's convert_hf_to_gguf.py")
    return tokenizer, _pre_tokenizer(tok, model_dir)


def add_tokenizer(w: Any, model_dir: Path, vocab_size: int) -> None:
    """The tokenizer of ``model_dir`` into the writer ``w`` as convert_hf_to_gguf.py's
    ``_set_vocab_gpt2`` writes it: every id up to ``vocab_size`` (an id the tokenizer lacks as
    ``[PAD<id>]``, unused), each token's type (control for special added tokens), the merges,
    the special ids and add-flags, and the chat template (``gguf.SpecialVocab``)."""
    gguf = _gguf()
    tokenizer, pre = load_tokenizer(model_dir)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise UserError(f"{model_dir}: the tokenizer has id {max(vocab.values())} but the model's vocab_size is "
                        f"{vocab_size}; the tokenizer is not this model's")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder_of = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = reverse[i]
        if t in added:
            special = decoder_of[i].special or (t.startswith("<|") and t.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(w, quiet=True)


def add_parameters(w: Any, config: dict[str, Any], arch: str, ftype: int) -> None:
    """The model's hyperparameters as TextModel.set_gguf_parameters (and LlamaModel's) write them."""
    gguf = _gguf()
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_context_length(int(config.get("max_position_embeddings") or 4096))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(int(config["num_attention_heads"]))
    w.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    rope = _rope(config)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if config.get("head_dim"):
        w.add_key_length(int(config["head_dim"]))
        w.add_value_length(int(config["head_dim"]))
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(int(config["vocab_size"]))
        w.add_rope_dimension_count(_head_dim(config))
    w.add_file_type(ftype)


def _ftype(gguf: Any, quant: str) -> int:
    F = gguf.LlamaFileType
    return int({"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0}[quant])


def _tensors(plans: list[Plan], config: dict[str, Any], permute: bool, gguf: Any) -> Iterator[tuple[Plan, np.ndarray]]:
    """Each planned tensor in order, read, permuted where llama.cpp permutes it, and quantized."""
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    for p in plans:
        if p.src == "rope_freqs":
            data = _llama3_rope_freqs(config)
        else:
            data = _read(p)
            if permute and p.src.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, n_head)
            elif permute and p.src.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, n_kv)
        yield p, gguf.quants.quantize(np.ascontiguousarray(data), p.qtype)


def gguf_bytes(plans: list[Plan], model_dir: Path) -> int:
    """The bytes the GGUF of ``plans`` takes: every tensor at its type and 32-byte alignment, the
    tokenizer (at most tokenizer.json's size) and a margin for the rest of the metadata."""
    gguf = _gguf()
    tok = model_dir / "tokenizer.json"
    return (sum(_nbytes(gguf, p.shape, p.qtype) + 32 for p in plans)
            + (tok.stat().st_size if tok.is_file() else 0) + _METADATA_MARGIN)


def write_gguf(model_dir: Path, out: Path, quant: str, name: str) -> None:
    """Write the checkpoint in ``model_dir`` (an HF-format directory: config.json, safetensors,
    tokenizer) as the GGUF file ``out`` (written in place: the caller gives a temporary name)."""
    gguf = _gguf()
    config = json.loads((model_dir / "config.json").read_text())
    arch, permute = family(config, model_dir)
    plans = plan(model_dir, arch, quant)
    if arch == "llama" and _rope(config).get("rope_type") == "llama3":
        plans.append(Plan("rope_freqs.weight", model_dir, "rope_freqs", (_head_dim(config) // 2,),
                          gguf.GGMLQuantizationType.F32))
    w = gguf.GGUFWriter(str(out), arch)
    try:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name)
        add_parameters(w, config, arch, _ftype(gguf, quant))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(w, model_dir, int(config["vocab_size"]))
        for p in plans:  # every tensor's name, type and size first: then each is written as it is made
            byte_shape = gguf.quant_shape_to_byte_shape(p.shape, p.qtype)
            w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), _nbytes(gguf, p.shape, p.qtype), raw_dtype=p.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        Faults.from_env().pause_in_export()  # test-only: a disk filled from here on
        for _, data in _tensors(plans, config, permute, gguf):
            w.write_tensor_data(data.view(np.uint8) if data.dtype != np.uint8 else data)
        w.flush()
        for f in w.fout or ():
            os.fsync(f.fileno())
    finally:
        w.close()


def _nearly_full(where: Path) -> bool:
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)  # under 1 MiB left (finetune/io.py disk_errors' rule)


def check_free(where: Path, need: int, what: str) -> None:
    """UserError when the filesystem of ``where`` has less than ``need`` bytes free."""
    where = next(p for p in (where, *where.parents) if p.exists())  # DST's folder may be made later
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"{what} needs {need / 2**30:.2f} GiB ({need:,} bytes) free on {where}, which has "
                        f"{free / 2**30:.2f} GiB ({free:,} bytes); free space or choose another DST")


def _is_adapter(src: Path) -> bool:
    return (src / MLX_CONFIG).is_file() or (src / "adapter" / MLX_CONFIG).is_file()


def export_gguf(src: str | Path, dst: str | Path, quant: str = "f16", base: str | None = None,
                dequantize: bool = False, overwrite: bool = False, trust_remote_code: bool = False,
                allow_pickle: bool = False) -> Path:
    """Write ``src`` (an adapter in either format, or a run directory, with its base; or a merged
    HF-format model directory) as the GGUF file ``dst`` at ``quant``, and an Ollama Modelfile
    beside it (``<dst stem>.Modelfile``). An adapter is fused into its base first with
    ``merge`` (finetune/export/merging.py) into a temporary directory beside ``dst``; an
    MLX-quantized base is dequantized there only with ``dequantize``. Returns ``dst``."""
    if quant not in QUANTS:
        raise UserError(f"--quant {quant} is not a GGUF type here; choose one of: {', '.join(QUANTS)}")
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if dst.suffix != ".gguf":
        raise UserError(f"DST {dst} must be a file name ending in .gguf")
    if not src.exists():
        raise UserError(f"{src} does not exist; give an adapter directory, a run directory or a merged model")
    side = dst.with_suffix(".Modelfile")
    for p in (dst, side):
        if p.exists() and not overwrite:
            raise UserError(f"{p} exists; choose a new DST or add --overwrite")
    if dst.is_dir():
        raise UserError(f"DST {dst} is a directory; give a file name ending in .gguf")
    _gguf()
    if _is_adapter(src):
        return _from_adapter(src, dst, quant, base, dequantize, trust_remote_code, allow_pickle)
    if not (src / "config.json").is_file():
        raise UserError(f"{src} holds neither an adapter (adapter_config.json) nor a model (config.json); give an "
                        "adapter directory, a run directory or a merged model directory")
    config = json.loads((src / "config.json").read_text())
    family(config, src)
    load_tokenizer(src)
    if isinstance(config.get("quantization"), dict):
        return _from_quantized(src, dst, quant, dequantize)
    _write(src, dst, quant)
    return dst


def refuse_expert_adapter(src: Path) -> None:
    """UserError, in one line, for an adapter on the experts of a mixture-of-experts model: PEFT's
    ``target_parameters`` on stacked experts, or mlx-lm's switch LoRA ([experts, r, in] per
    projection). Read from the config and the safetensors header only, before anything is merged."""
    d = find_adapter_dir(src)
    config = read_json(d / MLX_CONFIG)
    experts = [str(t) for t in config.get("target_parameters") or [] if "experts" in str(t)]
    weights = d / MLX_WEIGHTS
    if not experts and "peft_type" not in config and weights.is_file():
        experts = [k for k, v in tensors_of(header(weights)[0]).items() if len(v.get("shape", ())) == 3]
    if experts:
        raise UserError(f"{d}: the adapter sits on the experts of a mixture-of-experts model ({experts[0]}); GGUF "
                        "export merges adapters on the attention and dense-MLP projections only: retrain without the "
                        "experts in method.lora.keys")


def _from_adapter(src: Path, dst: Path, quant: str, base: str | None, dequantize: bool,
                  trust_remote_code: bool, allow_pickle: bool) -> Path:
    refuse_expert_adapter(src)
    ad = read_adapter(src)
    b = resolve_base(base or ad.base, ad, flag=base is not None, allow_pickle=allow_pickle)
    family(b.config, b.path)
    check_against_base(ad, b)
    load_tokenizer(b.path)  # a tokenizer GGUF cannot carry is refused before the merge
    merged_bytes = (dequantize_cost(b)[1] if b.quantization
                    else sum(f.stat().st_size for f in b.path.iterdir() if f.suffix in (".safetensors", ".bin")))
    if not b.quantization and not b.pickle_only:  # the GGUF's size from the base's headers, before any merge
        arch, _ = family(b.config, b.path)
        check_free(dst.parent, merged_bytes + gguf_bytes(plan(b.path, arch, quant), b.path),
                   f"exporting {src} to {dst.name} (merged model {merged_bytes:,} bytes, then the GGUF)")
    else:  # the GGUF is at most as large as the (dequantized, 16-bit) merge; twice at f32
        check_free(dst.parent, merged_bytes * (3 if quant == "f32" else 2), f"exporting {src} to {dst.name} (the merge, then the GGUF)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dst.name}.", dir=dst.parent) as t:
        merged = Path(t) / "merged"
        merge(ad.path, merged, base=base, dequantize=dequantize,
              trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
        _write(merged, dst, quant)
    return dst


def _from_quantized(src: Path, dst: Path, quant: str, dequantize: bool) -> Path:
    """An MLX-quantized model directory: dequantized by mlx-lm (as ``--merge --dequantize``
    does) into a temporary directory, then written."""
    q = json.loads((src / "config.json").read_text())["quantization"]
    if not dequantize:
        raise UserError(f"{src} is MLX-quantized ({q.get('bits')}-bit); GGUF is written from float weights: "
                        "add --dequantize to dequantize it first (into a temporary directory beside DST)")
    try:
        from mlx_lm import convert as mlx_convert
    except ImportError:
        raise UserError("dequantizing an MLX-quantized model needs mlx-lm (pip install '.[mlx]')") from None
    # the dequantized copy (16-bit weights: 16 / bits times the packed ones), then the GGUF at most as large
    need = 2 * sum(f.stat().st_size for f in src.glob("*.safetensors")) * 16 // int(q.get("bits") or 4)
    check_free(dst.parent, need, f"dequantizing {src}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dst.name}.", dir=dst.parent) as t:
        out = Path(t) / "dequantized"
        mlx_convert(str(src), str(out), dequantize=True)
        _write(out, dst, quant)
    return dst


def _write(model_dir: Path, dst: Path, quant: str, extra_disk: int = 0) -> None:
    """The GGUF of ``model_dir`` and its Modelfile, each under a temporary name beside ``dst``,
    renamed into place once both are whole; a failure leaves neither."""
    config = json.loads((model_dir / "config.json").read_text())
    arch, _ = family(config, model_dir)
    check_free(dst.parent, gguf_bytes(plan(model_dir, arch, quant), model_dir) + extra_disk,
               f"writing {dst.name}")
    side = dst.with_suffix(".Modelfile")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)[1])
    tmp_side = Path(tempfile.mkstemp(prefix=f".{side.name}.", suffix=".tmp", dir=dst.parent)[1])
    try:
        write_gguf(model_dir, tmp, quant, name=dst.stem)
        tmp_side.write_text(modelfile(model_dir, dst.name))
        for p in (tmp, tmp_side):
            os.chmod(p, umask_mode())
        os.replace(tmp, dst)
        try:
            os.replace(tmp_side, side)
        except BaseException:
            dst.unlink(missing_ok=True)
            raise
    except BaseException as e:
        # numpy's tofile reports a short write without an errno ("65536 requested and 2752
        # written"): a full disk, when it is, is said as one (checked while the file still holds the space)
        full = isinstance(e, OSError) and e.errno is None and _nearly_full(dst.parent)
        tmp.unlink(missing_ok=True)
        tmp_side.unlink(missing_ok=True)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst)) from e
        raise
