"""Data and models as other tools leave them (issue 20): a byte-order mark and CRLF, a JSON
array, gzip / bz2 / xz / zstd told by their bytes, a pipe, a record of an unknown shape named by
file and line, a budget without its unit, a truncated safetensors file, one giant record, and
the temporaries of killed writers. Each case goes through the console script: its exit code,
the message, no traceback, and on a refusal nothing written (no run dir, no cache entry, the
inputs unchanged)."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import importlib.util
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import _NO_GSM8K, GSM8K, IN_CI, finetune_cmd, make_spec, needs_torch
import warm_cli

from finetune import data as data_mod
from finetune.data import cache as tokcache
from finetune.config import compose

LINES = 64  # GSM8K records per input: enough for the default batch and a validation split
COMMON = ("backend=cuda", "train.steps=2", "train.eval_every=0", "train.progress=false", "memory.sample_every=0",
          "train.warmup_steps=0", "train.seq_len=128", "data=jsonl")
BIG_ARRAY_LIMIT = 4096  # JSON_ARRAY_MAX_BYTES for the case that must exceed it, set in the child process


def _zstd_frame(payload: bytes) -> bytes:
    """A real zstd frame with the payload in raw blocks (RFC 8878 3.1.1): built by hand so the
    case needs neither the zstd tool nor the zstandard module."""
    out = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0xA0]) + len(payload).to_bytes(4, "little"))  # single segment, 4-byte size
    blocks = [payload[i : i + 2**17] for i in range(0, len(payload), 2**17)] or [b""]
    for i, b in enumerate(blocks):
        out += ((len(b) << 3) | int(i == len(blocks) - 1)).to_bytes(3, "little") + b  # raw block, last flag
    return bytes(out)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every input the cases point at, made from GSM8K's first records and the tiny model
    (skipped where GSM8K is absent, failed in CI, as conftest's ``gsm8k`` fixture does)."""
    if not GSM8K.is_file():
        (pytest.fail if IN_CI else pytest.skip)(_NO_GSM8K)
    gsm8k = GSM8K
    d = tmp_path_factory.mktemp("as_they_come")
    with gsm8k.open("rb") as f:
        head = b"".join(f.readline() for _ in range(LINES))
    recs = [json.loads(x) for x in head.splitlines()]
    crlf = b"\xef\xbb\xbf" + head.replace(b"\n", b"\r\n")
    (d / "plain.jsonl").write_bytes(head)
    (d / "bom_crlf.jsonl").write_bytes(crlf)
    (d / "pretty.json").write_text(json.dumps(recs, indent=2))
    (d / "big_array.json").write_text(json.dumps(recs, indent=2))  # > BIG_ARRAY_LIMIT
    (d / "gz_named.jsonl").write_bytes(gzip.compress(crlf))
    (d / "data.bz2.jsonl").write_bytes(bz2.compress(head))
    (d / "data.xz.jsonl").write_bytes(lzma.compress(head))
    (d / "data.zst.jsonl").write_bytes(_zstd_frame(head))
    (d / "truncated.jsonl").write_bytes(gzip.compress(head)[:500])
    lines = head.splitlines(keepends=True)
    (d / "shape27.jsonl").write_bytes(b"".join(lines[:26]) + b'{"instruction": "x", "output": "y"}\n'
                                      + b"".join(lines[26:]))
    (d / "data.gz").write_bytes(gzip.compress(crlf))
    from finetune.model.source import resolve_model_dir

    tiny = resolve_model_dir(compose(d / "x").model)
    shutil.copytree(tiny, d / "cut_model")
    st = d / "cut_model" / "model.safetensors"
    os.truncate(st, st.stat().st_size * 2 // 3)  # what an interrupted download leaves
    return d


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` and a hash of its bytes: "changed" means any byte changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# id, data.path (or "PIPE:<file>": a process substitution that cats it), extra overrides, exit
# code, a fragment of the message ({i}: the inputs dir); with 0, a line the run prints. Two
# cases train (a run costs ~15 s here): a pipe carrying gzip bytes of a BOM + CRLF file, and a
# pretty-printed JSON array; the other accepted forms are read in-process below
# (test_every_accepted_form_reads_the_records_of_the_plain_file).
CASES: list[tuple[str, str, tuple[str, ...], int, str]] = [
    ("pipe-of-gzip-bom-crlf", "PIPE:data.gz", (), 0, "(data.path is a pipe, read once: nothing cached)"),
    ("json-array-read-directly", "pretty.json", (), 0, "tokenized"),
    ("json-array-too-big", "big_array.json", (), 2,
     ("{i}/big_array.json is one JSON array of more than 4,096 bytes, too big to read whole; convert it to JSONL "
      "(one object a line): jq -c '.[]' {i}/big_array.json > big_array.jsonl")),
    # zstd is read where the zstandard module is installed, else refused naming the tool
    ("zstd", "data.zst.jsonl", (), *((0, "tokenized") if importlib.util.find_spec("zstandard") else
                                    (2, ("{i}/data.zst.jsonl is zstd-compressed and cannot be read as it is; "
                                         "decompress it first: zstd -d {i}/data.zst.jsonl")))),
    ("gzip-truncated", "truncated.jsonl", (), 2,
     ("{i}/truncated.jsonl cannot be decompressed (Compressed file ended before the end-of-stream marker was "
      "reached): it is damaged or truncated; copy or download it again")),
    ("unknown-shape-line-27", "shape27.jsonl", (), 2,
     "{i}/shape27.jsonl:27: a record with keys ['instruction', 'output'] has no known format"),
    ("budget-without-unit", "plain.jsonl", ("memory.budget=40",), 2,
     "memory.budget=40 is 40 bytes: did you mean 40GB?"),
    ("safetensors-truncated", "plain.jsonl", ("model=qwen2-0.5b", "model.path={i}/cut_model"), 2,
     "{i}/cut_model/model.safetensors is damaged (tensor "),
]


def _run_case(case: tuple[str, str, tuple[str, ...], int, str], inputs: Path, work: Path) -> dict[str, Any]:
    case_id, path, extra, _, _ = case
    run_dir, cache = work / case_id / "run", work / case_id / "cache"
    args = [*COMMON, *(e.format(i=inputs) for e in extra), f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    cmd = finetune_cmd()
    if case_id == "json-array-too-big":  # the CLI's own main, with the array limit lowered in that process
        cmd = [sys.executable, "-c", (f"import sys, finetune.data.formats as d; d.JSON_ARRAY_MAX_BYTES = {BIG_ARRAY_LIMIT}; "
                                      "sys.argv[0] = 'finetune'; from finetune.cli import main; main()")]
    if path.startswith("PIPE:"):  # bash hands the child /dev/fd/63, a pipe cat writes into
        cmd = ["bash", "-c", 'exec "$@" data.path=<(cat "$PIPE_SRC")', "bash", *cmd]
        env = {**os.environ, "PIPE_SRC": str(inputs / path[5:])}
    else:
        args.append(f"data.path={inputs / path}")
        env = dict(os.environ)
    r = warm_cli.run([*cmd, *args], check=False, capture_output=True, text=True, timeout=300,
                       env=env)
    return {"rc": r.returncode, "stderr": r.stderr, "run_dir": run_dir, "cache": cache}


@needs_torch
def test_each_input_as_it_comes_is_read_or_refused_in_one_line(inputs: Path, tmp_path: Path) -> None:
    """The whole table through the console script, two cases at a time."""
    before = _tree(inputs)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _run_case(c, inputs, tmp_path), CASES))
    failures = []
    for (case_id, _, _, rc, fragment), got in zip(CASES, results):
        fragment, err = fragment.format(i=inputs), got["stderr"]
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        if got["rc"] != rc:
            failures.append(f"{case_id}: exit {got['rc']}, expected {rc}: {err[-1500:]}")
        elif "Traceback" in err:
            failures.append(f"{case_id}: a traceback: {err[-1500:]}")
        elif fragment not in err:
            failures.append(f"{case_id}: {fragment!r} not in {err[-1500:]!r}")
        elif rc == 0:
            if errors or not (got["run_dir"] / "summary.json").is_file():
                failures.append(f"{case_id}: no result: {err[-800:]}")
        else:
            if len(errors) != 1:
                failures.append(f"{case_id}: {len(errors)} error lines: {err[-800:]}")
            if got["run_dir"].exists():  # a refused command leaves nothing that looks like a run
                failures.append(f"{case_id}: left {sorted(p.name for p in got['run_dir'].iterdir())}")
            if list(tokcache.entries(got["cache"])):
                failures.append(f"{case_id}: wrote a token cache entry")
    budget = results[[c[0] for c in CASES].index("budget-without-unit")]["stderr"]
    assert [ln for ln in budget.splitlines() if ln.strip()] == [
        "error: memory.budget=40 is 40 bytes: did you mean 40GB? (a number without a unit counts bytes)"], budget
    pipe = results[[c[0] for c in CASES].index("pipe-of-gzip-bom-crlf")]
    assert not list(tokcache.entries(pipe["cache"])), "a pipe has no identity to key a cache entry on"
    assert _tree(inputs) == before, "an input was changed"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["bom_crlf.jsonl", "pretty.json", "gz_named.jsonl", "data.bz2.jsonl",
                                  "data.xz.jsonl", "data.gz"])
def test_every_accepted_form_reads_the_records_of_the_plain_file(inputs: Path, name: str) -> None:
    """The same records, in the same order, as the plain JSONL they were made from."""
    def read(p: Path) -> list[dict[str, Any]]:
        return data_mod.load_records(compose(inputs / "r", "data=jsonl", f"data.path={p}").data, 0)

    assert read(inputs / name) == read(inputs / "plain.jsonl")


def test_a_fifo_is_read_once_and_never_cached(inputs: Path, tmp_path: Path) -> None:
    """A named pipe (mkfifo) streams once through the tokenizer: no second read to hash it, no
    cache entry keyed on a path whose bytes the next reader cannot see again."""
    from transformers import AutoTokenizer

    from finetune.model.source import resolve_model_dir

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"cat {inputs / 'bom_crlf.jsonl'} > {fifo}"])
    cfg = make_spec(tmp_path / "run", "data=jsonl", f"data.path={fifo}", f"data.cache_dir={tmp_path / 'cache'}",
                    "train.progress=false", "train.seq_len=128")
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(cfg.model)))
    try:
        got = data_mod.prepare(cfg, tok)
    finally:
        writer.wait(timeout=30)
    plain = data_mod.prepare(make_spec(tmp_path / "run", "data=jsonl", f"data.path={inputs / 'plain.jsonl'}",
                                       "data.cache=false", "train.seq_len=128"), tok)
    assert [list(x) for x in got.ids] == [list(x) for x in plain.ids]
    assert not list(tokcache.entries(tmp_path / "cache"))


def test_a_5mb_record_keeps_its_first_tokens_and_costs_only_its_cap(tmp_path: Path) -> None:
    """One record of 5 MB (real text, with a 3,000-space run and a 3,000-letter word where the
    cut falls for seq_len 256: the places where a token spans the most characters), cut to
    ``record_char_cap`` characters before tokenizing: the same first seq_len tokens as the
    uncapped text, in a small part of the time."""
    from transformers import AutoTokenizer

    from finetune.model.source import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(compose(tmp_path / "x").model)))
    seq_len = 256
    cap = data_mod.record_char_cap(tok, seq_len)
    prose = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. "
    text = prose * (cap // len(prose) // 2) + " " * 3000 + "a" * 3000 + "\n"
    text = (text + prose * (5_000_000 // len(prose)))[:5_000_000]
    assert len(text) > 100 * cap
    t0 = time.perf_counter()
    capped = data_mod.tokenize([{"text": text}], tok, seq_len, True)
    capped_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    whole = tok(text, add_special_tokens=False)["input_ids"]
    whole_s = time.perf_counter() - t0
    assert list(capped.ids[0]) == whole[:seq_len]
    assert capped.truncated == 1 and capped.masks[0].sum() == seq_len
    assert capped_s < whole_s / 10, (capped_s, whole_s)


def _stale_setup(root: Path, now: float) -> dict[str, Path]:
    """One temporary of each kind under ``root``; returns them by name."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = tokcache._host()
    entry = "train.jsonl-0123456789abcdef0123"
    made = {
        "dead-writer": root / f".{entry}.tmp-{host}-{dead.pid}-abcd1234",
        "live-writer-old": root / f".{entry}.tmp-{host}-{os.getpid()}-abcd1234",
        "old-untagged-cache": root / f".{entry}.q2w3e4r5.tmp",
        "old-tiny": root / ".tmp-tiny-a1b2c3d4",
        "fresh-tiny": root / ".tmp-tiny-e5f6g7h8",
        "other-hosts-fresh": root / f".{entry}.tmp-otherhost-{dead.pid}-abcd1234",
        "not-ours": root / ".something.tmp",
    }
    for name, p in made.items():
        p.mkdir(parents=True)
        (p / "ids.npy").write_bytes(b"x")
        if name not in ("fresh-tiny", "other-hosts-fresh"):
            for q in (p / "ids.npy", p):
                os.utime(q, (now - 7200, now - 7200))  # two hours untouched
    return made


def test_the_next_run_removes_temporaries_of_dead_writers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """``prepare`` (what every run does before tokenizing) clears the token cache dir and the
    tiny models' dir of temporaries whose writer is dead (by pid) or long gone (by age, when
    no pid of this host is named), and keeps a live writer's however old, and what is not ours."""
    from transformers import AutoTokenizer

    from finetune.model.source import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(compose(tmp_path / "x").model)))
    now = time.time()
    cache, root = tmp_path / "tokens", tmp_path / "finetune-cache"
    made = {**{f"cache/{k}": v for k, v in _stale_setup(cache, now).items()},
            **{f"root/{k}": v for k, v in _stale_setup(root, now).items()}}
    monkeypatch.setenv("FINETUNE_CACHE", str(root))
    data_mod.prepare(make_spec(tmp_path / "run", "data.num_samples=8", f"data.cache_dir={cache}",
                               "train.progress=false"), tok)
    gone = sorted(k for k, p in made.items() if not p.exists())
    assert gone == sorted(f"{where}/{k}" for where in ("cache", "root")
                          for k in ("dead-writer", "old-untagged-cache", "old-tiny")), gone
