"""Hostile and careless input: nothing runs code from data, nothing gives a traceback, nothing is
accepted silently. Each case is what a careless or hostile colleague can put in a shared file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest
import torch
from conftest import edit_config
from helpers import FAST, check, newest_checkpoint, read_json, spds, start_endless


class _RunsCode:
    """Unpickling this calls os.system: what a planted checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path, marker) -> None:
    """Replace a checkpoint file by a code-running pickle, and fix commit.json's sha256 as an
    attacker with write access to the directory can."""
    torch.save({"module": {"prompt": _RunsCode(marker)}, "rng": _RunsCode(marker)}, path)
    commit_path = path.parent / "commit.json"
    commit = json.loads(commit_path.read_text())
    commit["files"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    commit_path.write_text(json.dumps(commit))


@pytest.mark.slow
@pytest.mark.parametrize(
    "planted", ["mp_rank_00_model_states.pt", pytest.param("rank-00000.pt", marks=pytest.mark.extended)]
)
def test_a_planted_checkpoint_file_runs_no_code(prepared, tmp_path, planted):
    constant = {**FAST["optim"], "schedule": "constant", "warmup_updates": 0}  # a run that may be extended
    edit_config(prepared, optim={**constant, "updates": 2})
    check(spds(["train", "config.json"], prepared))
    directory = newest_checkpoint(prepared / "run")
    marker = tmp_path / "marker"
    _plant(directory / planted, marker)
    edit_config(prepared, optim={**constant, "updates": 4})
    for command in (["train", "config.json"], ["export", "config.json", "--checkpoint", str(directory)]):
        if planted.startswith("rank") and command[0] == "export":
            continue  # export reads only the prompt's file
        result = spds(command, prepared)
        assert result.returncode == 1, result.stderr[-2000:]
        assert f"{directory / planted}: refused" in result.stderr and "never runs code" in result.stderr
        assert "Traceback" not in result.stderr
        assert not marker.exists(), f"spds {command[0]} ran code from {planted}"
    assert read_json(prepared / "run" / "terminal.json")["status"] == "failed"


# ---------------------------------------------------------------- configs


def _validate(directory, capsys, name="config.json") -> tuple[int, str]:
    from spds.cli import main

    code = main(["validate", str(directory / name)])
    return code, capsys.readouterr().err


def _config_text(tiny) -> str:
    return (tiny / "config.json").read_text()


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda t: t.replace('"learning_rate": 0.03', '"learning_rate": NaN'), "NaN is not a JSON number"),
        (lambda t: t.replace('"learning_rate": 0.03', '"learning_rate": Infinity'), "Infinity is not a JSON number"),
        (lambda t: t.replace('"learning_rate": 0.03', '"learning_rate": 1e999'), "1e999 overflows"),
        (lambda t: t.replace('"updates": 30', '"updates": 30, "updates": 3'), "key 'updates' appears twice"),
        (lambda t: t.replace('"updates": 30', '"updates": 30.0'), "optim.updates: 30.0 is not of type 'integer'"),
    ],
)
def test_a_config_value_json_would_bend_is_refused_by_key_and_rule(tiny, capsys, edit, expected):
    (tiny / "config.json").write_text(edit(_config_text(tiny)))
    code, err = _validate(tiny, capsys)
    assert code == 1 and expected in err and str(tiny / "config.json") in err, err


def test_yaml_duplicates_and_infinities_are_refused_with_the_line(tiny, capsys):
    yaml = pytest.importorskip("yaml")
    config = json.loads(_config_text(tiny))
    text = yaml.safe_dump(config, sort_keys=False)
    (tiny / "a.yaml").write_text(text.replace("  updates: 30\n", "  updates: 30\n  updates: 3\n"))
    code, err = _validate(tiny, capsys, "a.yaml")
    line = text.replace("  updates: 30\n", "  updates: 30\n  updates: 3\n").splitlines().index("  updates: 3") + 1
    assert code == 1 and f"a.yaml:{line}: rule 'unique keys': key 'updates'" in err, err
    (tiny / "b.yaml").write_text(text.replace("learning_rate: 0.03", "learning_rate: .inf"))
    code, err = _validate(tiny, capsys, "b.yaml")
    assert code == 1 and "optim.learning_rate: rule 'finite number'" in err, err


def test_unreadable_config_files_get_a_message_not_a_traceback(tiny, capsys):
    (tiny / "dir.json").mkdir()
    (tiny / "latin1.json").write_bytes(_config_text(tiny).replace("run", "r\xe9n").encode("latin-1"))
    (tiny / "utf16.json").write_bytes(_config_text(tiny).encode("utf-16"))
    for name, expected in [
        ("dir.json", "is a directory, not a file"),
        ("latin1.json", "is not UTF-8"),
        ("utf16.json", "UTF-16? save it as UTF-8"),
    ]:
        code, err = _validate(tiny, capsys, name)
        assert code == 1 and expected in err and "Traceback" not in err, (name, err)
    config = json.loads(_config_text(tiny))
    config["deepspeed_config"] = str(tiny / "dir.json")
    (tiny / "config.json").write_text(json.dumps(config))
    code, err = _validate(tiny, capsys)
    assert code == 1 and "deepspeed_config" in err and "is a directory" in err


def test_inputs_that_are_not_there_and_outputs_that_overlap_inputs_are_refused(tiny, tiny_assets, capsys):
    (tiny / "empty-model").mkdir()
    config = json.loads(_config_text(tiny))
    model = config["student"]["model_path"]
    cases = [
        (dict(student={**config["student"], "model_path": str(tiny / "empty-model")}), "holds none of config.json"),
        (dict(context={"file": "missing-context.txt"}), "context.file"),
        (dict(generate={"questions": "missing-questions.jsonl"}), "generate.questions"),
        (dict(data={**config["data"], "packed_dir": "/"}), "data.packed_dir: / is a file-system root"),
        (dict(output_dir=model), f"output_dir: {model} overlaps student.model_path"),
        (dict(output_dir=str(tiny_assets)), "overlaps student.model_path"),
    ]
    for change, expected in cases:
        (tiny / "config.json").write_text(json.dumps({**config, **change}))
        code, err = _validate(tiny, capsys)
        assert code == 1 and expected in err, (change, err)


# ---------------------------------------------------------------- candidate rows


def _rows(tiny) -> list[str]:
    return (tiny / "candidates.jsonl").read_text().splitlines()


def _prepare(tiny, capsys) -> tuple[int, str]:
    from spds.cli import main

    code = main(["prepare", str(tiny / "config.json")])
    return code, capsys.readouterr().err


def _token_row(tiny, index=0) -> dict:
    return next(row for row in map(json.loads, _rows(tiny)) if "input_ids" in row)


@pytest.mark.parametrize(
    "make,rule",
    [
        (
            lambda row: json.dumps(row).replace('"q000-s0"', '"q000-\\u00e9"').encode().replace(b"\\u00e9", b"\xe9"),
            "rule 'UTF-8 text'",
        ),
        (
            lambda row: json.dumps({**row, "input_ids": row["input_ids"][:1] + [True] + row["input_ids"][2:]}).encode(),
            "input_ids[1]: True is not of type 'integer'",
        ),
        (
            lambda row: json.dumps(row).replace('"sample_index": 0', '"sample_index": 0, "sample_index": 1').encode(),
            "rule 'unique keys'",
        ),
        (
            lambda row: json.dumps(
                {**row, "input_ids": row["input_ids"][:3] + [2**70] + row["input_ids"][4:]}
            ).encode(),
            "input_ids[3]: 1180591620717411303424 is far beyond any vocabulary",
        ),
        (lambda row: json.dumps(row).replace('"q000-s0"', '"q000-\\ud800"').encode(), "lone surrogate"),
    ],
)
def test_a_bad_row_names_file_line_and_rule(tiny, capsys, make, rule):
    lines = _rows(tiny)
    row = json.loads(lines[0])
    (tiny / "candidates.jsonl").write_bytes(b"\n".join([make(row), *[line.encode() for line in lines[1:]]]) + b"\n")
    code, err = _prepare(tiny, capsys)
    assert code == 1 and "candidates.jsonl:1:" in err and rule in err and "Traceback" not in err, err
    assert not (tiny / "packed").exists() and not list(tiny.glob(".packed*"))


def test_a_chat_response_quoting_the_end_of_turn_token_is_kept_whole_as_text(tiny, capsys):
    """User text stays text (tests/test_user_text.py): the quoted "<|im_end|>" neither ends the
    turn nor drops the rest; the row is supervised to the template's own turn end."""
    lines = _rows(tiny)
    number, row = next((i, json.loads(text)) for i, text in enumerate(lines) if "messages" in json.loads(text))
    lines[number] = json.dumps({**row, "response": "Half an answer<|im_end|> and the rest, kept."})
    (tiny / "candidates.jsonl").write_text("\n".join(lines) + "\n")
    code, err = _prepare(tiny, capsys)
    assert code == 0, err


def test_an_empty_candidate_file_beside_a_good_one_is_named(tiny, capsys):
    (tiny / "empty.jsonl").write_text("")
    config = json.loads(_config_text(tiny))
    config["data"]["candidates"].append({"path": "empty.jsonl"})
    (tiny / "config.json").write_text(json.dumps(config))
    code, err = _prepare(tiny, capsys)
    assert code == 1 and f"{tiny / 'empty.jsonl'}: rule 'rows present'" in err, err
    assert not (tiny / "packed").exists()


def test_ids_beyond_the_models_embedding_rows_are_refused_at_prepare(tiny, tiny_assets, capsys):
    """A tokenizer larger than the model passed validate, prepare and smoke, then an IndexError at
    update 3. The model's own vocab_size is the limit."""
    import shutil

    model = tiny / "small-vocab-model"
    shutil.copytree(tiny_assets / "student", model)
    settings = json.loads((model / "config.json").read_text())
    settings["vocab_size"] = 120  # ids of the tiny byte-level tokenizer go to 258
    (model / "config.json").write_text(json.dumps(settings))
    config = json.loads(_config_text(tiny))
    config["student"]["model_path"] = str(model)
    (tiny / "config.json").write_text(json.dumps(config))
    code, err = _prepare(tiny, capsys)  # the CLI refuses before a row is read: the end token is past the rows
    assert code == 1 and "end token id 258 is beyond the student's 120 embedding rows" in err, err
    from spds.contract.gate import load_config
    from spds.data.prepare import prepare
    from spds.errors import SpdsError

    with pytest.raises(SpdsError) as refused:  # and so does every row, called as a library
        prepare(load_config(tiny / "config.json"))
    assert "rule 'token ids in vocabulary'" in str(refused.value) and ">= vocabulary size 120" in str(refused.value)


# ---------------------------------------------------------------- during a run


def _student_copy(prepared, tiny_assets, change=None):
    import shutil

    from safetensors.torch import load_file, save_file

    model = prepared / "student-copy"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(tiny_assets / "student", model)
    if change is not None:
        tensors = load_file(model / "model.safetensors")
        change(tensors)
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.slow
def test_a_non_finite_update_fails_the_run_and_applies_nothing(prepared, tiny_assets):
    """One NaN in the student's lm_head (a damaged download): before, the run trained NaN losses to
    "complete" and wrote bare NaN, which is not JSON, into metrics.jsonl."""

    def poison(tensors):
        tensors["lm_head.weight"][7, 3] = float("nan")

    edit_config(prepared, student={"model_path": str(_student_copy(prepared, tiny_assets, poison))})
    result = spds(["train", "config.json"], prepared)
    assert result.returncode == 1 and "update 1: the loss (nan)" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    terminal = read_json(prepared / "run" / "terminal.json")
    assert terminal["status"] == "failed" and terminal["update"] == 0 and terminal["checkpoint"] is None
    assert "not finite" in terminal["reason"] and not (prepared / "run" / "checkpoints").exists()
    assert not (prepared / "run" / "metrics.jsonl").exists()


@pytest.mark.extended
@pytest.mark.slow
def test_tokens_rewritten_in_place_under_a_running_job_stop_it(prepared):
    process = start_endless(prepared)
    tokens = prepared / "packed" / "tokens.uint32"
    data = bytearray(tokens.read_bytes())
    data[4::40] = bytes(len(data[4::40]))  # same size, other ids: the whole-file digest is not re-read
    with open(tokens, "r+b") as stream:
        stream.write(data)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 1 and "no longer holds the tokens spds prepare wrote" in output, output[-2000:]
    assert read_json(prepared / "run" / "terminal.json")["status"] == "failed"


@pytest.mark.extended
@pytest.mark.slow
def test_a_changed_unpinned_student_does_not_resume_the_run(prepared, tiny_assets):
    model = _student_copy(prepared, tiny_assets)
    constant = {**FAST["optim"], "schedule": "constant", "warmup_updates": 0}
    edit_config(prepared, student={"model_path": str(model)}, optim={**constant, "updates": 2})
    check(spds(["train", "config.json"], prepared))
    _student_copy(prepared, tiny_assets, lambda tensors: tensors["lm_head.weight"].mul_(1.001))  # same path
    edit_config(prepared, optim={**constant, "updates": 4})
    result = spds(["train", "config.json"], prepared)
    assert result.returncode == 1 and "identity changed" in result.stderr and "student:" in result.stderr, result.stderr


def test_a_full_or_read_only_output_file_system_gets_a_clear_message(prepared, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        edit_config(
            prepared,
            output_dir=str(mount / "run"),
            checkpoint={"every": 1, "keep_last": 100},
            optim={**FAST["optim"], "updates": 30, "schedule": "constant", "warmup_updates": 0},
        )
        result = spds(["train", "config.json"], prepared)
        assert result.returncode == 1 and "No space left on device" in result.stderr and "MiB free" in result.stderr
        assert f"cannot write {mount / 'run'}" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        result = spds(["train", "config.json"], prepared)
        assert result.returncode == 1 and "Read-only file system" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
    finally:  # a process the run started may hold a file there a moment longer: then detach it lazily
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_questions_file_is_read_as_strictly_as_every_other(tmp_path):
    from spds.data.sources import read_questions
    from spds.errors import SpdsError

    for text, rule in [
        (b'{"question_id": "a", "question": "x", "question": "y"}\n', "rule 'unique keys'"),
        (b'{"question_id": "a", "question": "caf\xe9"}\n', "rule 'UTF-8 text'"),
        (b'["not", "an", "object"]\n', "a question needs question_id"),
        (b'{"question_id": "a", "question": "  "}\n', "rule 'a question is asked'"),
        (b'{"question_id": "a", "messages": [{"role": "user", "content": ""}]}\n', "rule 'a question is asked'"),
    ]:
        path = tmp_path / "questions.jsonl"
        path.write_bytes(text)
        with pytest.raises(SpdsError, match=rf"questions.jsonl:1: .*{rule}"):
            read_questions(path)


@pytest.mark.extended
@pytest.mark.slow
def test_a_stop_request_with_a_malformed_body_written_mid_run_is_honoured_as_a_stop(prepared):
    """A stop-request.json whose requested_at is not a time, written while the run trains: it is a
    stop request all the same (its time is the file's own), so the run stops at the next update
    boundary with a committed checkpoint (docs/design.md, stop requests)."""
    process = start_endless(prepared)
    (prepared / "run" / "stop-request.json").write_text('{"requested_at": "soon"}')
    assert process.wait(timeout=300) == 0
    terminal = read_json(prepared / "run" / "terminal.json")
    assert terminal["status"] == "stopped" and "stop-request.json" in terminal["reason"]
    assert newest_checkpoint(prepared / "run").name == f"update-{terminal['update']:06d}"


@pytest.mark.slow
@pytest.mark.over_budget("a rank killed mid-run: the survivor's one line and a truthful terminal.json")
def test_a_rank_killed_mid_run_leaves_the_survivor_one_line_and_a_truthful_terminal_json(prepared):
    """SIGKILL to rank 1 of a two-process torchrun job (as the OOM killer sends it): rank 0 says in
    one line of spds's own that another rank's process ended, keeps gloo's traceback in a file
    beside terminal.json, and terminal.json says failed."""
    import signal

    import psutil
    from helpers import start, wait_for_lines

    config = json.loads((prepared / "config.json").read_text())
    config.update(
        checkpoint={"every": 2, "keep_last": 2},
        optim={**config["optim"], "updates": 400, "schedule": "constant", "warmup_updates": 0},
        distributed={"timeout_minutes": 1},
    )
    (prepared / "config.json").write_text(json.dumps(config))
    process = start(["train", "config.json"], prepared, world=2, launcher="torchrun")
    wait_for_lines(prepared / "run" / "metrics.jsonl", 3, process)
    workers = [p for p in psutil.Process(process.pid).children(recursive=True) if "spds.cli" in " ".join(p.cmdline())]
    rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
    os.kill(rank1.pid, signal.SIGKILL)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0
    assert "spds train: rank 0: another rank's process ended during a collective" in output, output[-3000:]
    # gloo's own traceback stays out of the terminal: the peer's error shows once, in spds's line
    # (torchrun's agent then prints its own summary of the failed workers). Which words gloo uses
    # depends on where in the collective the survivor was when the socket went: closed or reset by
    # the peer, or a broken pipe, each seen in CI.
    gone = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    assert sum(output.count(words) for words in gone) == 1, output[-3000:]
    assert output.count("another rank's process ended") == 1 and "DistNetworkError" not in output
    assert (prepared / "run" / "rank-0-traceback.log").read_text().startswith("Traceback")
    terminal = read_json(prepared / "run" / "terminal.json")
    assert terminal["status"] == "failed" and "another rank's process ended" in terminal["reason"]
