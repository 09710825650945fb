"""generate.output is owned: one writer at a time, a provenance record that a rerun is checked
against, batch files checked before they are appended, and nothing a user wrote cut. Each case
is sent the way a user would (the CLI, a real file on disk); the output's bytes are compared
before and after."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from conftest import edit_config
from helpers import check, spds, start, wait_for_lines

from spds.errors import SpdsError
from spds.generation.batches import Output, Ranks

QUESTIONS = 6


@pytest.fixture
def asking(tiny):
    """The tiny student as its own teacher, six questions in batches of two, four new tokens."""
    with open(tiny / "questions.jsonl", "w") as stream:
        for i in range(QUESTIONS):
            stream.write(json.dumps({"question_id": f"q{i}", "question": f"What is item {i}?"}) + "\n")
    edit_config(
        tiny,
        context={"text": "Item 0 is a harbor. Item 1 is an orchard. Item 2 is a comet."},
        generate={"questions": "questions.jsonl", "output": "rows.jsonl", "max_new_tokens": 4, "batch_size": 2},
    )
    return tiny


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("generate", "seed", 7),
        ("generate", "temperature", 0.5),
        ("generate", "max_new_tokens", 5),
        ("generate", "batch_size", 3),  # batch k samples with seed + k: other batches, other rows
        ("context", "text", "Item 0 is a glacier."),
    ],
)
def test_a_rerun_under_settings_that_change_the_rows_is_refused_with_both_values(asking, section, key, value):
    check(spds(["generate", "config.json"], asking))
    rows = asking / "rows.jsonl"
    lines = rows.read_bytes().splitlines(keepends=True)
    rows.write_bytes(b"".join(lines[:3]))  # a partial output, as a stopped run leaves
    before = rows.read_bytes()
    edit_config(asking, **{section: {key: value}})
    result = spds(["generate", "config.json"], asking)
    assert result.returncode == 1 and "was written under other settings" in result.stderr, result.stderr
    named = "context_sha256" if section == "context" else f"generate.{key}"
    assert f"{named}: then" in result.stderr and "now" in result.stderr, result.stderr
    if section == "generate":
        assert f"now {value!r}" in result.stderr
    assert rows.read_bytes() == before, "a refused rerun changed the output"


def test_a_rerun_under_the_same_settings_completes_the_same_bytes(asking):
    check(spds(["generate", "config.json"], asking))
    rows = asking / "rows.jsonl"
    whole = rows.read_bytes()
    rows.write_bytes(b"".join(whole.splitlines(keepends=True)[:3]))
    edit_config(asking, distributed={"timeout_minutes": 7})  # not a setting of the rows
    check(spds(["generate", "config.json"], asking))
    assert rows.read_bytes() == whole
    assert json.loads((asking / "rows.jsonl.provenance.json").read_text())["generate.seed"] == 0


def test_a_second_generate_into_the_same_output_is_refused(asking):
    first = start(["generate", "config.json"], asking, SPDS_TEST_PACE="1")
    try:
        wait_for_lines(asking / "rows.jsonl", 1, first)
        second = spds(["generate", "config.json"], asking)
        assert second.returncode == 1 and "another spds generate writing" in second.stderr, second.stderr
    finally:
        first.communicate(timeout=120)
    assert first.returncode == 0
    ids = [json.loads(line)["request_id"] for line in (asking / "rows.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == QUESTIONS, "rows duplicated or lost"


def test_rows_a_user_wrote_without_a_final_newline_are_kept(asking):
    check(spds(["generate", "config.json"], asking))
    rows = asking / "rows.jsonl"
    whole = rows.read_bytes()
    first, *rest = whole.splitlines(keepends=True)
    rows.write_bytes(b"".join(rest) + first.rstrip(b"\n"))  # the user moved a row to the end, no newline
    check(spds(["generate", "config.json"], asking))
    assert sorted(rows.read_bytes().splitlines()) == sorted(whole.splitlines()), "a row was cut or added"
    # a file the user made (no provenance record): its settings are unknown, so generate refuses to
    # append rows of its own settings after its rows unless told to adopt them (nothing written)
    (asking / "mine.jsonl").write_bytes(first.rstrip(b"\n"))
    edit_config(asking, generate={"output": "mine.jsonl"})
    refused = spds(["generate", "config.json"], asking)
    assert refused.returncode == 1 and "mine.jsonl holds rows and no provenance record" in refused.stderr
    assert (asking / "mine.jsonl").read_bytes() == first.rstrip(b"\n") and not (
        asking / "mine.jsonl.provenance.json"
    ).exists()
    # adopted, a one-line file without its newline is kept
    check(spds(["generate", "config.json", "--adopt"], asking))
    assert (asking / "mine.jsonl").read_bytes().startswith(first)
    # and a torn line in a file spds did not write is named, not cut
    (asking / "theirs.jsonl").write_bytes(first + b'{"request_id": "half')
    edit_config(asking, generate={"output": "theirs.jsonl"})
    result = spds(["generate", "config.json", "--adopt"], asking)
    assert result.returncode == 1 and "theirs.jsonl:2: the last line is not a whole row" in result.stderr
    assert (asking / "theirs.jsonl").read_bytes() == first + b'{"request_id": "half'


@pytest.mark.parametrize("fault", ["garbled", "missing a row", "another batch's rows", "unnamed"])
def test_a_batch_file_is_checked_before_it_is_appended(tmp_path, fault):
    """The merge appends a waiting batch file only if its bytes are the ones written (sha256 in its
    name) and its rows are its batch's, in order; otherwise it names the file and changes nothing."""
    batches = [[f"r{b}-{i}" for i in range(3)] for b in range(3)]
    lines = {r: json.dumps({"request_id": r, "input_ids": [1, 2]}) + "\n" for batch in batches for r in batch}
    output = Output(tmp_path / "rows.jsonl", batches, Ranks(0, 1, torch.device("cpu")))
    output.start()
    output.write(0, [lines[r] for r in batches[0]])
    before = (tmp_path / "rows.jsonl").read_bytes()
    data = "".join(lines[r] for r in batches[1]).encode()
    name = f"00000001.{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
    if fault == "garbled":
        data = data.replace(b"r1-1", b"r1-X")
    elif fault == "missing a row":
        data = "".join(lines[r] for r in batches[1][1:]).encode() + b"}\n"
    elif fault == "another batch's rows":
        data = "".join(lines[r] for r in batches[2]).encode()
    if fault != "garbled":
        name = f"00000001.{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
    if fault == "unnamed":
        name = "00000001.jsonl"
    os.makedirs(output.directory, exist_ok=True)
    (output.directory / name).write_bytes(data)
    with pytest.raises(SpdsError, match=r"00000001\..*(not those spds generate wrote|does not hold batch)"):
        output.merge()
    assert (tmp_path / "rows.jsonl").read_bytes() == before


def test_a_questions_file_with_a_question_id_twice_or_past_64_mib_is_refused(asking):
    questions = asking / "questions.jsonl"
    questions.write_text(questions.read_text() + json.dumps({"question_id": "q2", "question": "Again?"}) + "\n")
    for verb in ("validate", "generate"):
        result = spds([verb, "config.json"], asking)
        assert result.returncode == 1 and "questions.jsonl:7: question_id 'q2': rule 'unique question_id'" in (
            result.stderr
        ), result.stderr
    with open(questions, "ab") as stream:  # sparse: the size is what is refused, before any line is kept
        stream.truncate(65 << 20)
    for verb in ("validate", "generate"):
        result = spds([verb, "config.json"], asking)
        assert result.returncode == 1 and "larger than 64 MiB" in result.stderr, result.stderr
    assert not (asking / "rows.jsonl").exists()


def test_a_refused_rerun_leaves_the_output_free_for_the_next(asking):
    """The lock goes with the run that held it, refused or failed, also when spds runs as a library
    in one process: the rerun under the first settings completes the same bytes."""
    check(spds(["generate", "config.json"], asking))
    rows = asking / "rows.jsonl"
    whole = rows.read_bytes()
    rows.write_bytes(b"".join(whole.splitlines(keepends=True)[:2]))
    first = (asking / "config.json").read_text()
    edit_config(asking, generate={"seed": 3})
    assert spds(["generate", "config.json"], asking).returncode == 1
    (asking / "config.json").write_text(first)
    check(spds(["generate", "config.json"], asking))
    assert rows.read_bytes() == whole
