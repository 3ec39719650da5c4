"""The token cache: a second run reuses it with the same bytes and the same losses; any change
to the data's content, the tokenizer or a setting that shapes tokens misses it; a damaged entry
is rebuilt with a warning; two jobs building one entry at once agree; tokenizing a file into the
cache holds one chunk in memory, however long the file."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import GSM8K, REPO, make_spec, needs_torch
from transformers import AutoTokenizer

from finetune import data as data_mod
from finetune.data import cache as tokcache
from finetune.config import ModelConfig
from finetune.errors import UserError
from finetune.model.tiny import build_tiny

RECORDS = [{"prompt": f"Question: {n} + {n}?\nAnswer: ", "completion": f"{2 * n} apples."} for n in range(60)]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(build_tiny(ModelConfig())))


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cfg(tmp_path: Path, data: Path, *extra: str):
    return make_spec(tmp_path / "run", "data=jsonl", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
                    "train.progress=false", "train.batch_size=2", *extra)


def _flat(t: data_mod.Tokenized) -> tuple[bytes, bytes, list[int]]:
    ids = np.concatenate([np.asarray(x) for x in t.ids]) if len(t.ids) else np.zeros(0)
    masks = np.concatenate([np.asarray(x) for x in t.masks]) if len(t.masks) else np.zeros(0)
    return ids.tobytes(), masks.tobytes(), t.lengths.tolist()


def _said(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "token" in ln]
    assert len(lines) == 1, lines  # one line: tokenized (cached to ...) or reused
    return lines[0]


def test_second_run_reuses_the_cache_with_the_same_bytes(tmp_path, tok, capsys):
    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    first = data_mod.prepare(_cfg(tmp_path, data), tok)
    said = _said(capsys)
    assert said.startswith("tokenized 60 samples") and "cached to" in said
    entry = Path(said.split("cached to ")[1].rstrip(")"))
    assert entry.parent == tmp_path / "cache" and sorted(p.name for p in entry.iterdir()) == [
        "ids.npy", "manifest.json", "mask.npy", "offsets.npy"]
    assert np.load(entry / "ids.npy").dtype == np.uint16  # a 512-token vocabulary: 2 bytes an id

    again = data_mod.prepare(_cfg(tmp_path, data), tok)
    assert _said(capsys).startswith(f"reused the token cache at {entry} (60 samples")
    assert isinstance(again.ids, tokcache.Ragged) and isinstance(again.ids.flat, np.memmap)

    off_dir = tmp_path / "off"
    fresh = data_mod.prepare(_cfg(tmp_path, data, "data.cache=false", f"data.cache_dir={off_dir}"), tok)
    assert "data.cache=false: nothing cached" in _said(capsys)
    assert not off_dir.exists()  # cache off writes nothing
    assert _flat(first) == _flat(again) == _flat(fresh)
    assert (again.truncated, again.dropped_no_target, again.longest, again.records) == \
           (fresh.truncated, fresh.dropped_no_target, fresh.longest, fresh.records) == (0, 0, fresh.longest, 60)
    # the source over the memory-mapped arrays yields the same batches as the in-memory one
    a, stats_a = data_mod.build(_cfg(tmp_path, data), tok)
    b, stats_b = data_mod.build(_cfg(tmp_path, data, "data.cache=false"), tok)
    assert stats_a == stats_b
    for s in (0, 3, a.steps_per_epoch + 1):
        ba, bb = a.train_batch(s), b.train_batch(s)
        assert np.array_equal(ba.input_ids, bb.input_ids) and np.array_equal(ba.loss_mask, bb.loss_mask)
    assert [v.indices.tolist() for v in a.val_batches(2, 0)] == [v.indices.tolist() for v in b.val_batches(2, 0)]


def test_the_cache_matches_tokenizing_in_memory_on_gsm8k(tmp_path, tok, gsm8k, capsys):
    """Real text with truncation: the cached entry holds exactly what ``tokenize`` makes."""
    cfg = make_spec(tmp_path / "run", "data=jsonl", f"data.path={gsm8k}", "data.max_samples=300", "train.seq_len=128",
                   f"data.cache_dir={tmp_path / 'cache'}", "train.progress=false")
    cached = data_mod.prepare(cfg, tok)
    data_mod.prepare(cfg, tok)
    assert "reused the token cache" in capsys.readouterr().err
    direct = data_mod.tokenize(data_mod.load_records(cfg.data, 0), tok, 128, True)
    assert _flat(data_mod.prepare(cfg, tok)) == _flat(cached) == _flat(direct)
    assert cached.truncated == direct.truncated > 0 and cached.records == 300


@needs_torch
def test_losses_equal_with_a_reused_cache_and_without_one(tmp_path, tok, capfd):
    """One tiny real run reading a reused entry, one with data.cache=false: the same losses."""
    from finetune.run.loop import train

    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    run = ("backend=cuda", "train.steps=3", "train.eval_every=0", "train.warmup_steps=0", "memory.sample_every=0")
    data_mod.prepare(_cfg(tmp_path, data), tok)  # the entry the run will find
    common = ("data=jsonl", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "train.progress=false",
              "train.batch_size=2", *run)
    train(make_spec(tmp_path / "cached", *common))
    assert "reused the token cache" in capfd.readouterr().err
    train(make_spec(tmp_path / "plain", *common, "data.cache=false"))

    def losses(run_dir: Path) -> list[float]:
        return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
                if ln.startswith('{"step"')]

    assert losses(tmp_path / "cached") == losses(tmp_path / "plain") and len(losses(tmp_path / "plain")) == 3


def _entries(tmp_path: Path) -> list[str]:
    return [p.name for p in tokcache.entries(tmp_path / "cache")]


@pytest.mark.parametrize("change", ["content, same size and mtime", "seq_len", "mask_prompt", "max_samples",
                                    "chat template"])
def test_what_changes_tokens_misses_the_cache(tmp_path, tok, capsys, change):
    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    data_mod.prepare(_cfg(tmp_path, data), tok)
    assert len(_entries(tmp_path)) == 1
    extra: list[str] = []
    t = tok
    if change.startswith("content"):
        st = data.stat()
        text = data.read_text()
        edited = text.replace("7 + 7?", "7 - 7?")  # one byte: same size
        assert len(edited) == len(text) and edited != text
        data.write_text(edited)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    elif change == "seq_len":
        extra = ["train.seq_len=16"]
    elif change == "mask_prompt":
        extra = ["data.mask_prompt=false"]
    elif change == "max_samples":
        extra = ["data.max_samples=30"]
    else:
        t = AutoTokenizer.from_pretrained(tok.name_or_path)
        t.chat_template = tok.chat_template + "{# another template #}"
    capsys.readouterr()
    got = data_mod.prepare(_cfg(tmp_path, data, *extra), t)
    assert "cached to" in _said(capsys) and len(_entries(tmp_path)) == 2
    if change.startswith("content"):
        expect = data_mod.tokenize(data_mod.load_records(_cfg(tmp_path, data).data, 0), tok, 256, True)
        assert _flat(got) == _flat(expect)  # the edited line's tokens, not the stale ones


def test_a_seed_or_a_split_setting_reuses_the_cache(tmp_path, tok, capsys):
    """What decides only the order or the split (train.seed for a file, val_fraction, batch)
    shares one entry: a sweep over them tokenizes once."""
    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    data_mod.prepare(_cfg(tmp_path, data), tok)
    capsys.readouterr()
    data_mod.build(_cfg(tmp_path, data, "train.seed=7", "data.val_fraction=0.2", "train.batch_size=4"), tok)
    assert "reused the token cache" in capsys.readouterr().err and len(_entries(tmp_path)) == 1


@pytest.mark.parametrize("damage", ["truncate ids.npy", "flip a byte of mask.npy", "truncate offsets.npy",
                                    "remove manifest.json", "garble manifest.json"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path, tok, capsys, caplog, damage):
    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    good = _flat(data_mod.prepare(_cfg(tmp_path, data), tok))
    (entry,) = tokcache.entries(tmp_path / "cache")
    what, name = damage.split(" ")[0], damage.split(" ")[-1]
    p = entry / name
    if what == "truncate":
        with p.open("r+b") as f:
            f.truncate(p.stat().st_size - 7)
    elif what == "flip":
        b = bytearray(p.read_bytes())
        b[-3] ^= 1
        p.write_bytes(bytes(b))
    elif what == "garble":
        p.write_text("[]")
    else:
        p.unlink()
    capsys.readouterr()
    caplog.clear()
    again = data_mod.prepare(_cfg(tmp_path, data), tok)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"token cache at {entry} is damaged" in warnings[0] and "rebuilding it" in warnings[0]
    assert "cached to" in _said(capsys)
    assert _flat(again) == good  # rebuilt, never read from the damaged files
    assert _entries(tmp_path) == [entry.name] and not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    data_mod.prepare(_cfg(tmp_path, data), tok)
    assert "reused the token cache" in _said(capsys)


def test_bad_data_with_the_cache_on_keeps_its_error_and_leaves_nothing(tmp_path, tok):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n' * 100 + '{not json\n')
    with pytest.raises(UserError, match=r"bad.jsonl:101 is not valid JSON"):
        data_mod.build(_cfg(tmp_path, bad), tok)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="holds no records"):
        data_mod.build(_cfg(tmp_path, empty), tok)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())  # no entry, no temporary
    long_prompt = _jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 200, "completion": "end"}] * 8)
    for _ in range(2):  # built, then reused: the same one-line error both times
        with pytest.raises(UserError, match="no completion tokens left in any of the 8 samples"):
            data_mod.build(_cfg(tmp_path, long_prompt, "train.seq_len=32"), tok)


_RACER = """
import hashlib, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from finetune import data
from finetune.config import compose
from finetune.resolver import resolve
root, me, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = resolve(compose(root / ("run" + me), "data=jsonl", f"data.path={root / 'train.jsonl'}", f"data.cache_dir={root / 'cache'}",
              "train.progress=false", "train.seq_len=4096"))
tok = AutoTokenizer.from_pretrained(sys.argv[4])
(root / ("ready" + me)).touch()
while not (root / ("ready" + other)).exists():  # start together: both miss, both build
    time.sleep(0.01)
t = data.prepare(cfg, tok)
h = hashlib.sha256()
for a, m in zip(t.ids, t.masks):
    h.update(bytes(a)); h.update(bytes(m))
print(h.hexdigest(), len(t.ids))
"""


def test_two_jobs_building_one_entry_at_once_both_succeed_and_agree(tmp_path, tok):
    lines = (GSM8K.read_text().splitlines()[:1500] if GSM8K.is_file()  # ~1 s of tokenizing: both miss
             else [json.dumps(r) for r in RECORDS] * 25)
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), me, other, tok.name_or_path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me, other in (("a", "b"), ("b", "a"))]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].split()[1] == str(len(lines))
    assert len(_entries(tmp_path)) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temporary left
    cfg = _cfg(tmp_path, tmp_path / "train.jsonl", "train.seq_len=4096")
    t = data_mod.prepare(cfg, tok)  # the published entry passes every check
    h = hashlib.sha256()
    for a, m in zip(t.ids, t.masks):
        h.update(bytes(a))
        h.update(bytes(m))
    assert h.hexdigest() == outs[0][0].split()[0]


def test_the_first_published_entry_wins_and_the_second_is_dropped(tmp_path):
    """What the slower of two racing jobs does (taken step by step here, not left to timing):
    its rename onto the published entry fails, it drops its own copy and reads the first."""
    final = tmp_path / "cache" / "x-0"
    writers = [tokcache.TokenWriter(np.dtype(np.uint16), final) for _ in range(2)]
    for w, fill in zip(writers, (1, 2)):
        w.add(np.full(5, fill), np.ones(5, np.int8), np.array([2, 3]))
    key = {"k": 1}
    assert writers[0].publish({"records": 2}, key) == final
    assert writers[1].publish({"records": 2}, key) == final
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["x-0"]  # the loser's temporary is gone
    ids, _, manifest = tokcache.load(final, key)
    assert ids.flat.tolist() == [1] * 5 and [len(x) for x in ids] == [2, 3] and manifest["samples"] == 2
    assert tokcache.load(tmp_path / "cache" / "absent", key) is None
    with pytest.raises(tokcache.Damaged, match="key"):
        tokcache.load(final, {"k": 2})


def _peak_traced_bytes(cfg, tok) -> tuple[int, data_mod.Tokenized]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = data_mod.prepare(cfg, tok)
        return tracemalloc.get_traced_memory()[1] - base, t
    finally:
        tracemalloc.stop()


def test_tokenizing_into_the_cache_holds_one_chunk_however_long_the_file(tmp_path, tok, gsm8k):
    """Python-heap peak (tracemalloc: Python objects and numpy buffers) while a file streams
    into the cache: the same for a file 4x longer, and within what one chunk of
    ``TOKENIZE_CHUNK`` records can hold. seq_len is wide so nothing is cut: every token is kept."""
    lines = gsm8k.read_text().splitlines()
    peaks, sizes = [], []
    for n in (1000, 4000):
        data = tmp_path / f"g{n}.jsonl"
        data.write_text("\n".join(itertools.islice(itertools.cycle(lines), n)) + "\n")
        peak, t = _peak_traced_bytes(_cfg(tmp_path, data, "train.seq_len=4096"), tok)
        peaks.append(peak)
        sizes.append(int(t.lengths.sum()) * 3)  # bytes the kept samples take: 2 (uint16 id) + 1 (mask) a token
        longest = t.longest
    # One chunk's tokenizer output as Python objects: per token an id (28 B int + 8 B list slot)
    # and an offset tuple (56 B + two 28 B ints + 8 B slot) = 156 B, ~6 int64 numpy temporaries
    # (48 B); 256 B a token over a chunk of the longest records bounds it.
    chunk_bound = data_mod.TOKENIZE_CHUNK * longest * 256
    assert peaks[1] < chunk_bound, (peaks, chunk_bound)
    assert peaks[1] < 1.25 * peaks[0], peaks  # 4x the file, not more memory
    # what the longer file added went to disk as it came: under a tenth of it stayed in memory
    assert peaks[1] - peaks[0] < (sizes[1] - sizes[0]) / 10, (peaks, sizes)
