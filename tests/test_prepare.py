"""spds prepare: exact tokens, every row rule, atomic output, locking, reruns, backup."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, edit_config, make_tiny, read_rows

from spds.contract.gate import load_config
from spds.data.packed import PackedStore
from spds.data.prepare import prepare
from spds.errors import SpdsError


def test_packed_tokens_equal_source_tokens_plus_scaffold(tiny):
    manifest = prepare(load_config(tiny / "config.json"))
    store = PackedStore.open(tiny / "packed")
    rows = read_rows(tiny / "candidates.jsonl")
    tokenizer = make_tiny.chatml_tokenizer()
    header, close = manifest["scaffold"]["system_header"], manifest["scaffold"]["system_close"]
    assert manifest["records"] == len(rows) == len(store)
    for i, (row, entry) in enumerate(zip(rows, store.entries())):
        ids = store.ids(i).tolist()
        source = row.get("input_ids")
        if source is None:  # chat form: rendered by the template
            from spds.data.chat import render_chat_row

            source, _, _ = render_chat_row(tokenizer, row["messages"], row["response"], [tokenizer.eos_token_id], {})
        if entry["added_system"]:
            assert ids == header + close + source
        else:
            assert ids == source and source[: len(header)] == header
        assert entry["insert_at"] == len(header)
        assert entry["supervised_tokens"] == len(ids) - entry["prefix_tokens"]
        assert ids[entry["prefix_tokens"] :] == source[len(source) - entry["supervised_tokens"] :]
    assert manifest["tokens"] == int(store.length.sum()) == (store.directory / "tokens.uint32").stat().st_size // 4
    assert manifest["counts"]["added_empty_system"] + manifest["counts"]["existing_system"] == len(rows)


def test_prefix_placement_keeps_rows_verbatim(tiny):
    edit_config(tiny, soft_prompt={"placement": "prefix"})
    manifest = prepare(load_config(tiny / "config.json"))
    store = PackedStore.open(tiny / "packed")
    assert manifest["counts"]["prefix_placement"] == len(store)
    assert (store.insert_at == 0).all()
    first = read_rows(tiny / "candidates.jsonl")[0]
    assert store.ids(0).tolist() == first["input_ids"]


def _break(tiny, line: int, change) -> None:
    rows = read_rows(tiny / "candidates.jsonl")
    change(rows[line - 1])
    (tiny / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


BAD_ROWS = {
    "schema": lambda r: r.pop("question_id"),
    "labels mask": lambda r: r["labels"].__setitem__(0, 5),
    "non-empty supervision": lambda r: r.update(prefix_tokens=len(r["input_ids"]), labels=[-100] * len(r["input_ids"])),
    "supervised_tokens consistent": lambda r: r.update(supervised_tokens=r["supervised_tokens"] + 1),
    "ends with end-of-turn": lambda r: (
        r["input_ids"].append(65),
        r["labels"].append(65),
        r.update(supervised_tokens=r["supervised_tokens"] + 1),
    ),
    "token ids in vocabulary": lambda r: (
        r["input_ids"].insert(-1, 100000),
        r["labels"].insert(-1, 100000),
        r.update(supervised_tokens=r["supervised_tokens"] + 1),
    ),
    "conversation start": lambda r: r.update(
        input_ids=[65] + r["input_ids"], labels=[-100] + r["labels"], prefix_tokens=r["prefix_tokens"] + 1
    ),
    "context limit": lambda r: None,  # made to fail by the config below
}


@pytest.mark.parametrize("rule", sorted(BAD_ROWS))
def test_each_row_rule_names_file_line_request_and_rule(tiny, rule):
    line = 3
    _break(tiny, line, BAD_ROWS[rule])
    if rule == "context limit":
        edit_config(tiny, data={"context_limit": 120})
    request_id = read_rows(tiny / "candidates.jsonl")[line - 1]["request_id"]
    with pytest.raises(SpdsError) as caught:
        prepare(load_config(tiny / "config.json"))
    text = str(caught.value)
    if rule == "context limit":  # the first row too long may come before line 3
        assert "rule 'context limit'" in text and "candidates.jsonl:" in text
    else:
        assert f"candidates.jsonl:{line}: request_id {request_id}: rule '{rule}'" in text
    assert not (tiny / "packed").exists()
    assert not [p for p in tiny.iterdir() if p.name.startswith(".packed.partial")]


def test_invalid_json_and_blank_line(tiny):
    with open(tiny / "candidates.jsonl", "a") as stream:
        stream.write('{"request_id": "x", \n')
    with pytest.raises(SpdsError, match=r"candidates.jsonl:65: rule 'one JSON object per line'"):
        prepare(load_config(tiny / "config.json"))
    text = (tiny / "candidates.jsonl").read_text().splitlines()
    (tiny / "candidates.jsonl").write_text("\n".join(text[:10] + [""] + text[10:64]) + "\n")
    with pytest.raises(SpdsError, match=r"candidates.jsonl:11: rule 'one JSON object per line': blank line"):
        prepare(load_config(tiny / "config.json"))


def test_duplicate_request_id_names_both_lines(tiny):
    _break(tiny, 40, lambda r: r.update(request_id="q001-s0"))
    with pytest.raises(
        SpdsError,
        match=r"candidates.jsonl:40: request_id q001-s0: rule 'unique request_id': "
        r"already used at candidates.jsonl:3",
    ):
        prepare(load_config(tiny / "config.json"))
    assert not (tiny / "packed").exists()


def test_rerun_verifies_and_changed_sources_refuse(tiny):
    first = prepare(load_config(tiny / "config.json"))
    stamp = os.stat(tiny / "packed" / "tokens.uint32").st_mtime_ns
    assert prepare(load_config(tiny / "config.json")) == first
    assert os.stat(tiny / "packed" / "tokens.uint32").st_mtime_ns == stamp
    _break(tiny, 1, lambda r: r.update(sample_index=7))
    with pytest.raises(SpdsError, match="packed from other inputs \\(differs: sources\\)"):
        prepare(load_config(tiny / "config.json"))
    # A corrupted store is named, not silently reused.
    with open(tiny / "packed" / "tokens.uint32", "r+b") as stream:
        stream.write(b"\xff\xff\xff\xff")
    with pytest.raises(SpdsError, match="tokens.uint32: packed data changed since prepare"):
        PackedStore.open(tiny / "packed")


def test_concurrent_prepare_is_refused(tiny):
    from spds.fsio import exclusive_lock

    with exclusive_lock(tiny / ".packed.lock", "held by test"):
        result = subprocess.run(
            [sys.executable, "-m", "spds.cli", "prepare", str(tiny / "config.json")],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
    assert result.returncode == 1
    assert "already running" in result.stderr
    assert not (tiny / "packed").exists()


def test_verified_backup_with_receipt(tiny):
    edit_config(tiny, data={"backup_dir": "backup/packed"})
    prepare(load_config(tiny / "config.json"))
    receipt = json.loads((tiny / "backup" / "packed" / "receipt.json").read_text())
    assert receipt["status"] == "verified"
    assert (tiny / "backup/packed/tokens.uint32").read_bytes() == (tiny / "packed/tokens.uint32").read_bytes()


def test_eval_split_is_by_question(tiny):
    edit_config(tiny, data={"eval_fraction": 0.3})
    manifest = prepare(load_config(tiny / "config.json"))
    store = PackedStore.open(tiny / "packed")
    assert 0 < manifest["counts"]["eval"] < manifest["records"]
    split_of_question = {}
    for entry in store.entries():
        assert split_of_question.setdefault(entry["question_id"], entry["split"]) == entry["split"]


def test_llama3_student_rows(tmp_path, tiny):
    tokenizer = make_tiny.llama3_tokenizer()
    student = make_tiny.save_student(tmp_path / "llama-student", tokenizer)
    make_tiny.write_jsonl(tiny / "candidates.jsonl", make_tiny.synthetic_rows(tokenizer, 16))
    edit_config(tiny, student={"model_path": str(student)})
    manifest = prepare(load_config(tiny / "config.json"))
    store = PackedStore.open(tiny / "packed")
    assert manifest["scaffold"]["lead"] == [tokenizer.bos_token_id]
    assert (store.insert_at == 1 + len(manifest["scaffold"]["system_header"])).all()
    assert np.all([store.ids(i)[0] == tokenizer.bos_token_id for i in range(len(store))])


def test_schema_rule_checks_every_id(tiny):
    _break(tiny, 5, lambda r: r["input_ids"].__setitem__(2, -7))
    with pytest.raises(
        SpdsError,
        match=r"candidates.jsonl:5: request_id q002-s0: rule 'schema'.*"
        r"input_ids\[2\]: -7 is less than the minimum of 0",
    ):
        prepare(load_config(tiny / "config.json"))
    _break(tiny, 5, lambda r: r["input_ids"].__setitem__(2, 1.5))
    with pytest.raises(SpdsError, match=r"input_ids\[2\]: 1.5 is not of type 'integer'"):
        prepare(load_config(tiny / "config.json"))


def test_prepare_killed_midway_leaves_no_store_and_the_next_one_completes(tiny):
    import signal

    rows = read_rows(tiny / "candidates.jsonl")
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, os, signal; from spds.data import packed; original = packed.PackedWriter.add\n"
                "def add(self, record, split):\n"
                "    original(self, record, split)\n"
                "    if self.records == 10: os.kill(os.getpid(), signal.SIGKILL)\n"
                "packed.PackedWriter.add = add\n"
                "from spds.cli import main; main(['prepare', sys.argv[1]])"
            ),
            str(tiny / "config.json"),
        ],
        cwd=REPO,
    )
    assert process.wait(timeout=120) == -signal.SIGKILL
    assert not (tiny / "packed").exists()
    assert [p.name for p in tiny.glob(".packed.partial-*")]  # the killed writer's leftovers
    prepare(load_config(tiny / "config.json"))
    assert PackedStore.open(tiny / "packed").manifest["records"] == len(rows)
    assert not list(tiny.glob(".packed.partial-*"))
