"""Secrets kept out of what a run writes, on the edges: an empty value is no secret, and a
damaged .safetensors file shorter than its 8-byte header length is searched without failing.
Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.redact import is_secret_key, secrets_in_dir

SECRET = "hf_" + "x7Qp2" * 6


def test_only_a_non_empty_value_under_a_secret_name_is_a_secret() -> None:
    assert is_secret_key("hf_token", SECRET)
    assert not is_secret_key("hf_token", "")
    assert not is_secret_key("hf_token", None)
    assert not is_secret_key("eos_token", "</s>")  # vocabulary, not a credential


def test_secrets_in_dir_reads_headers_and_text_and_survives_a_truncated_file(tmp_path: Path) -> None:
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00")  # 3 bytes: no header length
    header = json.dumps({"__metadata__": {"token": SECRET}}).encode()
    (tmp_path / "leaky.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (tmp_path / "log.txt").write_text(f"token={SECRET}\n")
    (tmp_path / "clean.txt").write_text("nothing here\n")
    assert secrets_in_dir(tmp_path, [SECRET]) == [(tmp_path / "leaky.safetensors", SECRET),
                                                  (tmp_path / "log.txt", SECRET)]
