"""spds generate on several ranks (spds/generation/batches.py): the output is byte for byte the
one-rank output, on 1, 2 and 3 ranks, through torchrun and spds's launch script; a rank killed
mid-run, or a SIGTERM to the launch script, leaves whole batches behind, and the rerun (on any
number of ranks) completes the same bytes. (Each stopped run's rows are checked as a prefix of the
one-rank bytes, and each completion against the whole: 2 ranks then 3, 2 ranks then 1.)"""

from __future__ import annotations

import hashlib
import json
import signal

import pytest
from conftest import REPO, make_tiny
from helpers import check, free_port, spds, start, wait_for_lines

pytestmark = pytest.mark.slow  # process launches, several ranks each

QUESTIONS = 10
SAMPLES = 2  # 20 requests in batches of 3: 7 batches, the last one short


def sheet() -> str:
    return "".join(f"{i}. The {s} keeps ledger {7 * i} in drawer {i}.\n" for i, s in enumerate(make_tiny.SUBJECTS * 3))


@pytest.fixture
def asked(tiny):
    """The tiny student as its own teacher, a questions file, and the one-rank output."""
    (tiny / "questions.jsonl").write_text(
        "".join(
            json.dumps({"question_id": f"q{i}", "question": f"Where is ledger {7 * i}?"}) + "\n"
            for i in range(QUESTIONS)
        )
    )
    one = one_rank(tiny, questions="questions.jsonl", samples_per_question=SAMPLES, temperature=1.0)
    assert len(one.splitlines()) == QUESTIONS * SAMPLES
    return tiny, one


def one_rank(tiny, **generate) -> bytes:
    """The one-rank output of the tiny student as its own teacher with `generate` settings, after
    the context sheet; the output file removed again."""
    (tiny / "context.md").write_text(sheet())
    config = json.loads((tiny / "config.json").read_text())
    settings = dict(output="teacher.jsonl", batch_size=3, max_new_tokens=8, top_k_logprobs=3, **generate)
    config.update(context={"file": "context.md"}, generate=settings)
    (tiny / "config.json").write_text(json.dumps(config, indent=2))
    check(spds(["generate", "config.json"], tiny))
    one = (tiny / "teacher.jsonl").read_bytes()
    (tiny / "teacher.jsonl").unlink()
    return one


def test_self_study_on_two_ranks_writes_the_one_rank_bytes(tiny):
    """Every kind (the teacher writes questions, recites, answers facts), the writing batches
    spread over the ranks with the answering."""
    study = dict(
        conversations=10, chunk_tokens=128, question_max_tokens=12, kinds={"recite": 1, "fact": 1, "detail": 1}
    )
    one = one_rank(tiny, self_study=study)
    kinds = {json.loads(line)["self_study"]["kind"] for line in one.splitlines()}
    assert {"recite", "fact"} <= kinds, kinds
    check(spds(["generate", "config.json"], tiny, world=2, launcher="torchrun"))
    assert (tiny / "teacher.jsonl").read_bytes() == one


@pytest.mark.over_budget("a rank killed mid-generate loses no row and the rerun completes the same bytes")
def test_a_killed_rank_leaves_whole_batches_and_the_rerun_completes_the_same_bytes(asked):
    """SIGKILL to rank 1 right after it wrote batch 3 (the OOM killer, a node lost): torchrun ends
    the other rank; what is on disk is whole batches, in files or appended in order; a rerun on
    three ranks completes them to the one-rank bytes."""
    directory, one = asked
    killed = spds(["generate", "config.json"], directory, world=2, launcher="torchrun", SPDS_FAULT="kill-after-batch:3")
    assert killed.returncode != 0
    # the survivor says so in one line, gloo's traceback in a file (torchrun's own report follows it)
    assert "rank 0: another rank's process ended during a collective" in killed.stderr, killed.stderr[-3000:]
    assert (directory / "run" / "rank-0-traceback.log").exists()
    assert "spds/generation" not in killed.stderr, "spds's own stack reached the terminal"
    waiting = sorted(p.name for p in (directory / ".teacher.jsonl.batches").glob("*.jsonl"))
    assert (
        any(name.startswith("00000003.") for name in waiting)
        or len((directory / "teacher.jsonl").read_bytes().splitlines()) >= 12
    )
    written = (directory / "teacher.jsonl").read_bytes() if (directory / "teacher.jsonl").exists() else b""
    assert one.startswith(written) and written.count(b"\n") < QUESTIONS * SAMPLES  # in order, and not all
    result = check(spds(["generate", "config.json"], directory, world=3, launcher="torchrun"))
    assert "by 3 ranks" in result.stdout, result.stdout
    assert (directory / "teacher.jsonl").read_bytes() == one
    assert not (directory / ".teacher.jsonl.batches").exists()  # every batch appended, its file gone


@pytest.mark.over_budget("a SIGTERM to the launch script stops generate at a batch boundary")
def test_sigterm_to_the_launch_script_stops_at_a_batch_and_the_rerun_completes_the_same_bytes(asked):
    directory, one = asked
    command = ["bash", str(REPO / "launch" / "single_node.sh"), "config.json", "--gpus", "2", "--verb", "generate"]
    command += ["--port", str(free_port())]
    process = start([], directory, command=command, SPDS_TEST_PACE="0.5")
    wait_for_lines(directory / "teacher.jsonl", 1, process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-4000:]
    assert "stopped with" in output and "run the same command again" in output, output[-4000:]
    written = (directory / "teacher.jsonl").read_bytes()
    assert one.startswith(written) and len(written) < len(one)
    assert not (directory / "run" / "stop-request.json").exists()  # answered: it cannot stop the next launch
    result = check(spds(["generate", "config.json"], directory))
    assert "were already there" in result.stdout
    assert (directory / "teacher.jsonl").read_bytes() == one


def test_a_merge_killed_between_its_append_and_the_files_removal_appends_no_row_twice(tmp_path):
    """Rank 0 appends a batch file to the output, then removes the file: a kill in between (or a
    torn append) leaves rows that are in both. The next merge appends only the rows not there,
    in order, and the output ends the same bytes as an uninterrupted merge."""
    import torch

    from spds.generation.batches import Output, Ranks

    batches = [[f"r{b}-{i}" for i in range(3)] for b in range(3)]
    lines = {r: json.dumps({"request_id": r, "input_ids": [1, 2]}) + "\n" for batch in batches for r in batch}
    straight = "".join(lines[r] for batch in batches for r in batch).encode()
    output = Output(tmp_path / "rows.jsonl", batches, Ranks(0, 1, torch.device("cpu")))
    assert output.start() == {0: [], 1: [], 2: []}
    output.write(0, [lines[r] for r in batches[0]])
    output.write(2, [lines[r] for r in batches[2]])  # waits: batch 1 comes first
    assert (tmp_path / "rows.jsonl").read_bytes() == straight[: len("".join(lines[r] for r in batches[0]))]
    # batch 1's file written, then a merge that appended its first row and a half, and died
    data = "".join(lines[r] for r in batches[1]).encode()
    output.directory.joinpath(f"00000001.{hashlib.sha256(data).hexdigest()[:16]}.jsonl").write_bytes(data)
    with open(tmp_path / "rows.jsonl", "a") as stream:
        stream.write(lines[batches[1][0]] + lines[batches[1][1]][:9])
    output.release()  # the killed merge's process is gone, and its lock with it
    again = Output(tmp_path / "rows.jsonl", batches, Ranks(0, 1, torch.device("cpu")))
    assert again.start() == {}  # the torn line cut, batch 1 and 2 appended from their files, nothing left
    assert (tmp_path / "rows.jsonl").read_bytes() == straight
    assert not again.directory.exists()
