"""Hostile and careless input, by class: files read with bounds, numbers bounded by what consumes
them, paths compared as the file system resolves them, DeepSpeed sections checked or refused,
and no command that fails changes a file the user had. Each case ends in a message naming the
file and the rule, a non-zero exit, within seconds."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from conftest import REPO, edit_config, read_rows
from helpers import check, environment, final_state, launch_command, metrics, newest_checkpoint, read_json, spds, start

LAUNCH = REPO / "launch"


def _validate(directory, capsys, name="config.json") -> tuple[int, str]:
    from spds.cli import main

    code = main(["validate", str(directory / name)])
    return code, capsys.readouterr().err


def _prepare(directory, capsys) -> tuple[int, str]:
    from spds.cli import main

    code = main(["prepare", str(directory / "config.json")])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- bounded reading


def test_a_file_that_is_not_a_regular_file_is_refused_at_once(tiny):
    """A FIFO nobody writes once made `spds validate` wait forever."""
    os.mkfifo(tiny / "fifo.json")
    os.mkfifo(tiny / "fifo.txt")
    edit_config(tiny, context={"file": "fifo.txt"})
    for config, expected in [
        ("fifo.json", "fifo.json: is a FIFO (named pipe), not a regular file"),
        ("config.json", "fifo.txt is not a file"),
    ]:
        started = time.monotonic()
        result = (
            spds(["validate", config], tiny, timeout=60)
            if config == "fifo.json"
            else spds(["generate", config], tiny, timeout=60)
        )
        assert result.returncode == 1 and expected in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and time.monotonic() - started < 30


def _laughs() -> str:
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for level in range(1, 9):
        name, previous = chr(ord("a") + level), chr(ord("a") + level - 1)
        text += f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]\n"
    return text


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("laughs.yaml", _laughs(), "laughs.yaml:2: rule 'no aliases'"),
        ("deep.yaml", "x: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml: rule 'nesting depth'"),
        ("keys.yaml", "1: x\n", "keys.yaml:1: rule 'string keys': key 1 is not a string but int"),
        ("on.yaml", "optim:\n  on: 1\n", "on.yaml:2: rule 'string keys': key True is not a string but bool (YAML 1.1"),
        ("deep.json", '{"x": ' + "[" * 100000 + "]" * 100000 + "}", "deep.json: rule 'nesting depth'"),
        (
            "deep64.json",
            '{"x": ' + "[" * 70 + "]" * 70 + "}",
            "deep64.json: rule 'nesting depth': arrays and objects nest deeper than 64 levels",
        ),
    ],
)
def test_yaml_and_json_bombs_are_refused_by_rule_in_moments(tiny, capsys, name, text, expected):
    (tiny / name).write_text(text)
    started = time.monotonic()
    code, err = _validate(tiny, capsys, name)
    assert code == 1 and expected in err, err
    assert time.monotonic() - started < 10


def test_an_upper_case_yaml_suffix_is_read_as_yaml(tiny, capsys):
    yaml = pytest.importorskip("yaml")
    (tiny / "config.YAML").write_text(yaml.safe_dump(json.loads((tiny / "config.json").read_text())))
    code, err = _validate(tiny, capsys, "config.YAML")
    assert code == 0, err


def _write_table(path, rows) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_rows_the_readers_cannot_take_are_named_by_file_and_rule(tiny, capsys):
    pytest.importorskip("datasets")
    import datasets

    rows = read_rows(tiny / "candidates.jsonl")
    first = json.loads((tiny / "candidates.jsonl").read_text().splitlines()[0])
    deep = json.dumps({**first, "extra": None}).replace("null", "[" * 100000 + "]" * 100000)
    (tiny / "deep.jsonl").write_text(deep + "\n")
    _write_table(tiny / "good.parquet", rows[:4])
    (tiny / "truncated.parquet").write_bytes((tiny / "good.parquet").read_bytes()[:200])
    (tiny / "jsonl.parquet").write_bytes((tiny / "candidates.jsonl").read_bytes())
    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(tiny / "bad-state"))
    (tiny / "bad-state" / "state.json").write_text("{not json")
    datasets.Dataset.from_list(rows[:1]).select([]).save_to_disk(str(tiny / "no-rows"))
    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(tiny / "no-arrow"))
    for arrow in (tiny / "no-arrow").glob("*.arrow"):
        arrow.unlink()  # a partial copy
    assistant_first = {k: first[k] for k in ("request_id", "question_id", "sample_index")}
    assistant_first.update(messages=[{"role": "assistant", "content": "Hello."}], response="Hi.")
    (tiny / "assistant-first.jsonl").write_text(json.dumps(assistant_first) + "\n")
    cases = [
        ("deep.jsonl", "deep.jsonl:1: request_id ? : rule 'nesting depth'"),
        ("truncated.parquet", "truncated.parquet: rule 'readable table': not readable as a parquet file"),
        ("jsonl.parquet", "jsonl.parquet: rule 'readable table'"),
        ("bad-state", "bad-state: rule 'readable table': not readable as a datasets save_to_disk directory"),
        ("no-rows", "no-rows: rule 'rows present'"),
        (
            "no-arrow",
            "no-arrow: rule 'data files present': state.json lists data-00000-of-00001.arrow, which is missing",
        ),
        ("assistant-first.jsonl", "rule 'conversation start': the conversation opens with an assistant turn"),
    ]
    for name, expected in cases:
        config = json.loads((tiny / "config.json").read_text())
        config["data"]["candidates"] = [{"path": name}]
        config["data"]["packed_dir"] = f"packed-{name}"
        (tiny / "config.json").write_text(json.dumps(config))
        code, err = _prepare(tiny, capsys)
        assert code == 1 and expected.replace("request_id ? : ", "") in err.replace("request_id ?: ", ""), (name, err)
        assert "Traceback" not in err and not (tiny / f"packed-{name}").exists()


# ---------------------------------------------------------------- numbers bounded by their consumer


def _numeric_fields(schema: dict):
    """(dotted name, field schema) of every integer or number field of the config schema."""

    def walk(node, path):
        node = {**schema["$defs"][node["$ref"].split("/")[-1]], **node} if "$ref" in node else node
        kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "integer" in kinds or "number" in kinds:
            yield path, node
        for key, child in node.get("properties", {}).items():
            yield from walk(child, f"{path}.{key}" if path else key)
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{path}[]")
        for option in node.get("oneOf", []) + node.get("anyOf", []):
            yield from walk(option, path)

    yield from walk(schema, "")


def _consume_seed(value):
    random_state = np.random.default_rng(value)  # numpy's range is the narrowest: [0, 2**32)
    np.random.seed(value)
    torch.manual_seed(value)
    assert random_state is not None


def _consume_timeout(value):
    timeout = datetime.timedelta(minutes=value)  # what engine.init_distributed hands torch
    assert 0 < timeout.total_seconds() * 1000 < 2**63  # torch holds it in milliseconds, int64


def _consume_std(value):
    assert torch.isfinite(torch.empty(4096, 64).normal_(std=value)).all()  # the FP32 prompt's init


def _consume_temperature(value):
    logits = torch.full((4,), 1e4, dtype=torch.float32)  # bf16 students' logits stay far below 1e4
    assert torch.isfinite(torch.log_softmax(logits / value, -1)).all()


def _consume_grad_norm(value):
    prompt = torch.nn.Parameter(torch.ones(3))
    prompt.grad = torch.full((3,), 50.0)
    torch.nn.utils.clip_grad_norm_([prompt], value)  # its scale factor value / norm stays finite in fp32
    assert torch.isfinite(prompt.grad).all() and prompt.grad.abs().max() > 0


CONSUMERS = {
    "optim.seed": _consume_seed,
    "generate.seed": _consume_seed,
    "distributed.timeout_minutes": _consume_timeout,
    "soft_prompt.init.std": _consume_std,
    "loss.kl.temperature": _consume_temperature,
    "optim.max_grad_norm": _consume_grad_norm,
}


def test_every_numeric_field_is_bounded_and_its_bounds_are_what_its_consumer_takes(tiny, capsys):
    """Every number the schema accepts must be one its consumer can take: a seed of 2**32 once
    passed the schema and crashed numpy, a timeout of 1e300 minutes crashed timedelta."""
    from spds.contract.schema import load_schema

    schema = load_schema("config")
    fields = list(_numeric_fields(schema))
    assert len(fields) > 30
    for name, field in fields:
        low = field.get("minimum", field.get("exclusiveMinimum"))
        high = field.get("maximum", field.get("exclusiveMaximum"))
        assert low is not None and high is not None, f"{name}: no minimum or maximum in the schema"
        if name in CONSUMERS:
            CONSUMERS[name](high)
            CONSUMERS[name](low if "minimum" in field else low + 1e-3)
    for name, bounds in [("optim.seed", (0, 2**32 - 1)), ("distributed.timeout_minutes", (1, 525600))]:
        for value in bounds:
            CONSUMERS[name](value)
    section, key = "optim", "seed"
    for value, accepted in [(2**32 - 1, True), (2**32, False), (2**64, False)]:
        edit_config(tiny, **{section: {key: value}})
        code, err = _validate(tiny, capsys)
        assert (code == 0) == accepted, (value, err)
    edit_config(tiny, optim={"seed": 0})
    for value, accepted in [(1e300, False), (1e-6, False), (30, True)]:
        edit_config(tiny, distributed={"timeout_minutes": value})
        code, err = _validate(tiny, capsys)
        assert (code == 0) == accepted and ("distributed.timeout_minutes" in err) != accepted, (value, err)


# ---------------------------------------------------------------- paths, as the file system resolves them


def test_written_paths_are_compared_with_inputs_after_links_and_dots_are_resolved(tiny, tiny_assets, capsys):
    student = tiny_assets / "student"
    (tiny / "link-to-student").symlink_to(student)
    (tiny / "questions.jsonl").write_text('{"question_id": "q", "question": "hi"}\n')
    (tiny / "monitor.json").write_text(
        json.dumps(
            {"zero_optimization": {"stage": 0}, "csv_monitor": {"enabled": True, "output_path": str(student / "csv")}}
        )
    )
    cases = [
        (dict(output_dir="link-to-student"), "overlaps student.model_path"),
        (dict(output_dir="run/../link-to-student/x"), "overlaps student.model_path"),
        (dict(checkpoint={"backup_dir": "link-to-student/backup"}), "checkpoint.backup_dir"),
        (dict(data={"backup_dir": str(student / "packed-copy")}), "data.backup_dir"),
        (dict(deepspeed_config="monitor.json"), "deepspeed_config csv_monitor.output_path"),
        (
            dict(generate={"questions": "questions.jsonl", "output": "questions.jsonl"}),
            "generate.output: " + str(tiny / "questions.jsonl") + " would replace generate.questions",
        ),
        (dict(generate={"output": "link-to-student/config.json"}), "generate.output"),
        (dict(output_dir="."), None),  # the config is config.json, not a file a run writes
    ]
    original = (tiny / "config.json").read_text()
    for change, expected in cases:
        (tiny / "config.json").write_text(original)
        edit_config(tiny, **change)
        code, err = _validate(tiny, capsys)
        if expected is None:
            assert code == 0, (change, err)
        else:
            assert code == 1 and expected in err, (change, err)
    (tiny / "run.json").write_text(original)  # a config named like a file the run writes beside it
    edit_config(tiny, output_dir=".")
    (tiny / "run.json").write_text((tiny / "config.json").read_text())
    code, err = _validate(tiny, capsys, "run.json")
    assert code == 1 and "output_dir: " in err and "would replace the config" in err, err


def _snapshot(directory) -> dict:
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.is_file()}


def test_a_failed_pin_or_init_changes_no_file_of_the_users(tiny, tiny_assets, capsys):
    from spds.cli import main

    assert main(["pin", str(tiny / "config.json")]) == 0
    capsys.readouterr()
    edit_config(tiny, optim={"lerning_rate": 1.0})
    before = _snapshot(tiny)
    assert main(["pin", str(tiny / "config.json")]) == 1
    assert "did you mean 'learning_rate'" in capsys.readouterr().err
    assert _snapshot(tiny) == before  # the pins file too
    (tiny / ".init-run.yaml").write_text("mine\n")
    (tiny / "bad.jsonl").write_text("not rows\n")
    before = _snapshot(tiny)
    assert main(["init", str(tiny_assets / "student"), "candidates.jsonl", "--out", str(tiny / "config.json")]) == 1
    assert main(["init", "/nonexistent-model", "candidates.jsonl", "--out", str(tiny / "run.yaml")]) == 1
    assert _snapshot(tiny) == before


def test_init_writes_json_under_a_json_name_and_takes_any_file_name(tiny, tiny_assets, capsys):
    from spds.cli import main

    os.rename(tiny / "candidates.jsonl", tiny / "données 🙂.jsonl")
    assert main(["init", str(tiny_assets / "student"), "données 🙂.jsonl", "--out", str(tiny / "run.json")]) == 0, (
        capsys.readouterr().err
    )
    config = json.loads((tiny / "run.json").read_text(encoding="utf-8"))
    assert [c["path"] for c in config["data"]["candidates"]] == ["données 🙂.jsonl"]
    assert main(["validate", str(tiny / "run.json")]) == 0
    assert [p.name for p in tiny.iterdir() if p.name.startswith(".init-")] == []


def test_generate_never_drops_a_row_it_wrote(tmp_path):
    """A blank line once made the rerun cut every row after it (64 rows before, 44 after)."""
    from spds.errors import SpdsError
    from spds.generation.batches import repair_and_read

    rows = [json.dumps({"request_id": f"r{i}", "input_ids": [1, 2]}) + "\n" for i in range(6)]
    output = tmp_path / "generated.jsonl"
    output.write_text("".join(rows[:3]) + "\n" + "".join(rows[3:]))
    before = output.read_bytes()
    with pytest.raises(SpdsError, match=r"generated.jsonl:4: not a row spds generate wrote .*nothing was changed"):
        repair_and_read(output)
    assert output.read_bytes() == before
    output.write_text("".join(rows) + rows[0][:10])  # a crash mid-append: the torn last line goes
    assert repair_and_read(output) == {f"r{i}" for i in range(6)}
    assert output.read_text() == "".join(rows)


# ---------------------------------------------------------------- the DeepSpeed config


@pytest.mark.parametrize(
    "ds,expected",
    [
        (
            {"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param: a ZeRO stage 3 setting, which DeepSpeed ignores at stage 0",
        ),
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage: spds supports ZeRO stage 0"),
        (
            {"flops_profiler": {"enabled": False, "profile_stp": 3}},
            "flops_profiler.profile_stp: unknown key; did you mean",
        ),
        ({"comms_logger": {"enabled": "maybe"}}, "comms_logger.enabled: 'maybe' is not of type 'boolean'"),
        ({"wandb": {"enabled": True, "project": "p"}}, "wandb: enabled, but the wandb package is not installed"),
        ({"tensorboard": {"enabled": True, "output_path": "tb"}}, None),
    ],
)
def test_deepspeed_sections_are_checked_or_refused_at_validate(tiny, capsys, ds, expected):
    import importlib.util

    (tiny / "ds.json").write_text(json.dumps(ds))
    edit_config(tiny, deepspeed_config="ds.json")
    code, err = _validate(tiny, capsys)
    if expected is None:  # tensorboard: refused exactly when its package is missing
        installed = importlib.util.find_spec("tensorboard") is not None
        assert (code == 0) == installed and ("tensorboard package is not installed" in err) != installed, err
    else:
        assert code == 1 and expected in err, err


# ---------------------------------------------------------------- locks, stop requests, run files


def test_a_refused_process_never_releases_a_lock_it_does_not_hold(tiny, capsys):
    from spds.errors import SpdsError
    from spds.fsio import exclusive_lock
    from spds.training.train import rank_zero_lock

    lock = tiny / ".packed.lock"
    with exclusive_lock(lock, "the first prepare", remove=True):
        code, err = _prepare(tiny, capsys)
        assert code == 1 and "is already running" in err
        assert lock.exists()  # the refused one left it: a third is refused too
        code, err = _prepare(tiny, capsys)
        assert code == 1 and "is already running" in err
    assert not lock.exists()  # its holder removed it
    out = tiny / "run"
    with rank_zero_lock(out, 0):
        for leftover in out.iterdir():
            leftover.unlink()  # what a user deleting files under a running job does
        with pytest.raises(SpdsError, match="another spds trainer"):
            rank_zero_lock(out, 0).__enter__()


def test_stop_requests_that_are_garbled_or_stale_never_crash_or_stop_a_new_run(tmp_path, monkeypatch, capsys):
    from spds import stop

    monkeypatch.setenv("SPDS_LAUNCH_STARTED", "abc")
    request = stop.StopRequest()
    assert "SPDS_LAUNCH_STARTED='abc' is not a time" in capsys.readouterr().err
    assert abs(request.launch_started - time.time()) < 60
    path = tmp_path / stop.REQUEST_FILE
    for text in ['{"requested_at": "yesterday"}', "{garbled", '["a list"]', '{"requested_at": 1e999}']:
        path.write_text(text)
        hour_ago = time.time() - 3600
        os.utime(path, (hour_ago, hour_ago))
        request = stop.StopRequest()
        request.watch(tmp_path)  # stale: written before this launch, so removed, whatever it holds
        assert not path.exists() and not request.vote(), text
        path.write_text(text)  # written now: a live request, whatever it holds
        assert request.vote(), text


def test_run_files_of_the_wrong_shape_are_refused_or_skipped_by_name(prepared):
    from spds.contract.gate import load_config
    from spds.errors import SpdsError
    from spds.training.identity import check_smoke_evidence
    from spds.training.records import keep_metrics_before

    metrics = prepared / "metrics.jsonl"
    metrics.write_bytes(b'{"update": 1, "loss": 1.0}\n\xff\xfe{"update": 2}\n{"update": 3, "loss": 2.0}\n')
    keep_metrics_before(metrics, 3)
    assert metrics.read_bytes() == b'{"update": 1, "loss": 1.0}\n'
    edit_config(prepared, train={"require_smoke": True})
    evidence = prepared / "run" / "smoke" / "evidence.json"
    evidence.parent.mkdir(parents=True)
    config = load_config(prepared / "config.json")
    identities = {key: "0" * 64 for key in ("code", "config", "data", "student", "topology")}
    for shape in (["a", "list"], {"status": "passed", "identities": "x"}):
        evidence.write_text(json.dumps(shape))
        with pytest.raises(SpdsError, match="not smoke evidence spds wrote"):
            check_smoke_evidence(config, identities)


# ---------------------------------------------------------------- checkpoints and faults during runs


@pytest.mark.extended
@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_the_run_resumes_from_the_newest_intact_one(prepared, tmp_path):
    check(spds(["train", "config.json"], prepared))
    straight = final_state(prepared / "run")
    newest = newest_checkpoint(prepared / "run")
    (newest / "commit.json").write_text((newest / "commit.json").read_text()[:40])  # truncated
    weights = prepared / "run" / "checkpoints" / "update-000004" / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    weights.write_bytes(bytes(data))
    result = check(spds(["train", "config.json"], prepared))
    assert "update-000002, the newest intact checkpoint; damaged, and skipped:" in result.stderr, result.stderr
    assert f"\n  {newest}" in result.stderr and f"checkpoint file {weights} is corrupted" in result.stderr
    assert read_json(prepared / "run" / "run.json")["start_update"] == 3
    assert [m["update"] for m in metrics(prepared / "run")] == list(range(1, 7))
    resumed = final_state(prepared / "run")
    for key in ("prompt", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(resumed[key], straight[key]), key
    # weights-only files of the wrong structure, their digests fixed as a writer could: named, no traceback
    newest = newest_checkpoint(prepared / "run")
    for name in ("mp_rank_00_model_states.pt", "rank-00000.pt"):
        saved = (newest / name).read_bytes()
        torch.save({"something": torch.zeros(2)}, newest / name)
        commit = json.loads((newest / "commit.json").read_text())
        import hashlib

        commit["files"][name] = hashlib.sha256((newest / name).read_bytes()).hexdigest()
        (newest / "commit.json").write_text(json.dumps(commit))
        verbs = [["export", "config.json", "--out", str(tmp_path / name)], ["eval", "config.json"]]
        verbs += [["train", "config.json"]]
        for verb in verbs if name.startswith("mp_rank") else verbs[2:]:
            result = spds(verb, prepared)
            assert result.returncode == 1 and "Traceback" not in result.stderr, (verb, result.stderr[-2000:])
            assert name in result.stderr or "soft prompt" in result.stderr, (verb, result.stderr[-2000:])
        (newest / name).write_bytes(saved)
        commit["files"][name] = hashlib.sha256(saved).hexdigest()
        (newest / "commit.json").write_text(json.dumps(commit))
    commit = json.loads((newest / "commit.json").read_text())
    commit["prompt_sha256"] = "0" * 64
    (newest / "commit.json").write_text(json.dumps(commit))
    result = spds(["export", "config.json", "--out", str(tmp_path / "altered")], prepared)
    assert result.returncode == 1 and "does not match the one its commit record names" in result.stderr


@pytest.mark.slow
def test_sigterm_during_smoke_start_up_stops_it_cleanly(prepared):
    process = start(["smoke", "config.json"], prepared)
    time.sleep(1.0)  # imports: nothing is loaded yet
    process.send_signal(signal.SIGTERM)
    # about 50 s alone on 2 cores (start-up, then the clean stop); the bound is for a hang, with
    # room for a machine that runs other tests beside it
    output = process.communicate(timeout=360)[0]
    assert process.returncode == 0, output[-3000:]
    terminal = read_json(prepared / "run" / "smoke" / "terminal.json")
    assert terminal["status"] == "stopped" and terminal["update"] == 0, terminal
    assert not (prepared / "run" / "smoke" / "evidence.json").exists()


@pytest.mark.extended
@pytest.mark.slow
def test_a_rank_killed_mid_run_leaves_a_truthful_terminal_json(prepared):
    """SIGKILL (the OOM killer) to both ranks after update 2's DeepSpeed save: no rank can record
    it; the launch script does, naming the last update and the resume point (update 2 was never
    committed: none)."""
    edit_config(prepared, data_parallel_size=2, checkpoint={"every": 2, "keep_last": 3})
    result = subprocess.run(
        ["bash", str(LAUNCH / "single_node.sh"), "config.json", "--gpus", "2"],
        cwd=prepared,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment(SPDS_FAULT="kill-after-deepspeed-save:4"),
    )
    assert result.returncode != 0
    terminal = read_json(prepared / "run" / "terminal.json")
    assert terminal["status"] == "failed" and terminal["update"] == 4, terminal
    assert terminal["checkpoint"].endswith("update-000002") and "before rank 0 recorded" in terminal["reason"]
    assert "Traceback" not in result.stderr[-3000:], result.stderr[-3000:]


def test_a_pins_file_holding_what_is_no_digest_is_refused_by_key(tiny, capsys):
    from spds.cli import main

    assert main(["pin", str(tiny / "config.json")]) == 0
    capsys.readouterr()
    pins_file = tiny / "config.json.pins.json"
    pins = json.loads(pins_file.read_text())
    for bad in ("not-hex", 12345):
        pins["pins"]["student.model_sha256"] = bad
        pins_file.write_text(json.dumps(pins))
        code, err = _validate(tiny, capsys)
        assert code == 1 and f"pin student.model_sha256: {bad!r} is not a sha256" in err, err


def test_a_candidate_file_appended_to_while_prepare_reads_it_is_refused(tiny, capsys, monkeypatch):
    """The manifest once recorded the sha256 of the file as it was, over a store of more rows."""
    import spds.data.prepare as prepare

    reading = prepare.read_records

    def appending(path, tokenizer, rules):
        for index, record in enumerate(reading(path, tokenizer, rules)):
            if index == 1:
                row = json.loads((tiny / "candidates.jsonl").read_text().splitlines()[0])
                row.update(request_id="appended", question_id="appended")
                with open(path, "a") as stream:
                    stream.write(json.dumps(row) + "\n")
            yield record

    monkeypatch.setattr(prepare, "read_records", appending)
    code, err = _prepare(tiny, capsys)
    assert code == 1 and "changed while spds prepare read it" in err, err
    assert not (tiny / "packed").exists()


def test_a_value_of_several_allowed_shapes_is_told_what_its_own_shape_lacks(tiny, capsys):
    edit_config(tiny, student={"attention_kernel": {"below": 4096, "short": "flash"}})
    code, err = _validate(tiny, capsys)
    assert code == 1 and "student.attention_kernel: 'long' is a required property" in err, err


def test_arguments_spds_sets_itself_and_numbers_of_hundreds_of_digits_are_refused(tiny, capsys):
    for key in ("tokenize", "add_generation_prompt"):
        edit_config(tiny, data={"chat_template_kwargs": {key: False}})
        code, err = _validate(tiny, capsys)
        assert code == 1 and f"data.chat_template_kwargs key '{key}': spds sets this argument" in err, err
    from spds.fsio import parse_json

    with pytest.raises(ValueError, match="an integer of 400 digits"):
        parse_json('{"logprob": -' + "9" * 400 + "}")
    with pytest.raises(ValueError, match="overflows a 64-bit float"):
        parse_json('{"logprob": -' + "9" * 400 + ".5}")


def test_init_refuses_chat_rows_for_a_tokenizer_without_a_chat_template(tiny, tiny_assets, capsys):
    """It once wrote a config that prepare then refused, with transformers' own message."""
    import shutil

    from spds.cli import main

    student = tiny / "bare-student"
    shutil.copytree(tiny_assets / "student", student)
    settings = json.loads((student / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (student / "tokenizer_config.json").write_text(json.dumps(settings))
    (student / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["init", str(student), "candidates.jsonl", "--out", str(tiny / "bare.yaml")]) == 1
    err = capsys.readouterr().err
    assert "rule 'chat template': a chat-form row (messages)" in err and "candidates.jsonl:" in err, err
    assert not (tiny / "bare.yaml").exists()


@pytest.mark.slow
@pytest.mark.over_budget("a model directory's own code never runs: a process of its own per attempt")
def test_code_a_model_directory_brings_never_runs_not_even_on_a_yes(tiny, tiny_assets):
    """A student directory whose config.json maps AutoModelForCausalLM (and AutoConfig) to its own
    modeling file, as a hub repository with custom code does: every command refuses it by name
    before any work, with "y" waiting on standard input (transformers' prompt would take it) and
    with none; the planted code never runs. student.trust_remote_code is the explicit opt-in."""
    import shutil

    student = tiny / "custom-student"
    shutil.copytree(tiny_assets / "student", student)
    marker = tiny / "the-planted-code-ran"
    (student / "modeling_planted.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen3Config as PlantedConfig, Qwen3ForCausalLM as PlantedForCausalLM\n"
    )
    config = json.loads((student / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_planted.PlantedConfig",
        "AutoModelForCausalLM": "modeling_planted.PlantedForCausalLM",
    }
    (student / "config.json").write_text(json.dumps(config))
    edit_config(tiny, student={"model_path": str(student)}, context={"text": "A context."})
    (tiny / "questions.jsonl").write_text('{"question_id": "a", "question": "Why?"}\n')
    for args in (["validate", "config.json"], ["prepare", "config.json"], ["smoke", "config.json"]):
        for stdin in ("y\n", None):
            result = subprocess.run(
                launch_command(args),
                cwd=tiny,
                env=environment(),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=300,
                stdin=subprocess.DEVNULL if stdin is None else None,
            )
            assert result.returncode == 1, (args, result.stderr[-2000:])
            assert "config.json names custom code in auto_map (modeling_planted.py)" in result.stderr, args
            assert "student.trust_remote_code" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()
    init = spds(["init", str(student), "candidates.jsonl", "--out", "init.yaml"], tiny, fresh=True)
    assert init.returncode == 1 and "modeling_planted.py" in init.stderr and not (tiny / "init.yaml").exists()
    assert not marker.exists()
    # The opt-in: validate passes (the code is the user's to run now; it registers its classes in
    # transformers' process-wide tables, so in a process of its own).
    edit_config(tiny, student={"model_path": str(student), "trust_remote_code": True})
    check(spds(["validate", "config.json"], tiny, fresh=True))


@pytest.mark.slow
def test_pickled_weights_a_template_leaving_the_sandbox_and_a_missing_model_are_named(tiny, tiny_assets):
    """Three careless or hostile model directories, each refused by a message naming the file and
    the rule, no traceback, and nothing run: a pytorch_model.bin pickle that calls os.system as it
    loads; a chat template that reaches for Python internals (cycler.__init__.__globals__ -> os);
    and `spds init` on a directory that does not exist."""
    import pickle
    import shutil

    marker = tiny / "the-pickle-ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    student = tiny / "pickled-student"
    shutil.copytree(tiny_assets / "student", student)
    (student / "model.safetensors").unlink()
    (student / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Planted()}))
    edit_config(tiny, student={"model_path": str(student)})
    check(spds(["prepare", "config.json"], tiny))
    result = spds(["smoke", "config.json"], tiny)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "its weights (pytorch_model.bin) are not plain tensors" in result.stderr and "safetensors" in result.stderr
    assert "Traceback" not in result.stderr and not marker.exists()

    escaping = tiny / "escaping-student"
    shutil.copytree(tiny_assets / "student", escaping)
    (escaping / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((escaping / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}"
    (escaping / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    edit_config(tiny, student={"model_path": str(escaping)}, data={"packed_dir": "packed-2"})
    result = spds(["validate", "config.json"], tiny)
    assert result.returncode == 1 and "rule 'sandboxed template'" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not marker.exists()

    result = spds(["init", str(tiny / "nowhere"), "candidates.jsonl", "--out", "new.yaml"], tiny)
    assert result.returncode == 1
    assert "no such directory, and not a model id (org/name) in the local Hugging Face cache" in result.stderr


@pytest.mark.slow
def test_a_packed_store_whose_manifest_was_edited_is_named_not_indexed_past(prepared):
    manifest_path = prepared / "packed" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["records"] = 10
    manifest_path.write_text(json.dumps(manifest))
    result = spds(["train", "config.json"], prepared)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "rule 'consistent store': manifest.json says 10 records" in result.stderr
    assert "holds 64 records" in result.stderr and "Traceback" not in result.stderr
    assert read_json(prepared / "run" / "terminal.json")["status"] == "failed"
    manifest_path.write_text(json.dumps({**manifest, "files": "none"}))
    result = spds(["train", "config.json"], prepared)
    assert result.returncode == 1 and "manifest.json: rule 'consistent store'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (b'{"request_id": "r-17", "question_id": "q", "sample_index": 0, "response": "caf\xe9"}', "request_id r-17:"),
        (b'{"request_id": "r-\xe9", "question_id": "q"}', "request_id (could not be read):"),
    ],
)
def test_a_line_that_is_not_utf8_is_named_with_its_request_id_where_it_reads(tiny, capsys, line, named):
    (tiny / "latin1.jsonl").write_bytes(line + b"\n")
    edit_config(tiny, data={"candidates": [{"path": "latin1.jsonl"}], "packed_dir": "packed-latin1"})
    code, err = _prepare(tiny, capsys)
    assert code == 1 and "latin1.jsonl:1: " + named in err and "rule 'UTF-8 text'" in err, err


@pytest.mark.slow
def test_a_disk_that_fills_while_a_checkpoint_is_written_is_named_and_the_resume_is_bit_exact(prepared, tmp_path):
    """output_dir on a small tmpfs, a checkpoint every update: the save that finds the disk full
    stops the run with a message naming the checkpoint, the room it needed against the room there
    is, and that the previous checkpoint stands; terminal.json says failed. Moved to a disk with
    room, the same command resumes, and the final state equals a straight run's bit for bit."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(small)], check=True)
    try:
        edit_config(prepared, checkpoint={"every": 1, "keep_last": 10}, output_dir=str(small / "run"))
        result = spds(["train", "config.json"], prepared)
        assert result.returncode == 1, result.stdout[-2000:]
        assert "(a checkpoint): the file system is full" in result.stderr, result.stderr[-3000:]
        assert "MiB free there, about" in result.stderr and "stands and the same command resumes" in result.stderr
        assert "Traceback" not in result.stderr
        terminal = read_json(small / "run" / "terminal.json")
        assert terminal["status"] == "failed" and "(a checkpoint)" in terminal["reason"]
        shutil.copytree(small / "run", prepared / "moved")
    finally:
        subprocess.run(["umount", str(small)], check=True)
    edit_config(prepared, output_dir="moved")
    check(spds(["train", "config.json"], prepared))
    edit_config(prepared, output_dir="straight")
    check(spds(["train", "config.json"], prepared))
    resumed, straight = final_state(prepared / "moved"), final_state(prepared / "straight")
    for key in ("prompt", "exp_avg", "exp_avg_sq"):
        assert torch.equal(resumed[key], straight[key]), key


@pytest.mark.slow
def test_a_disk_that_fills_during_prepare_is_named_and_nothing_the_user_had_changes(tiny, tmp_path):
    """packed_dir on a small tmpfs, rows enough to fill it: prepare names the file it could not
    write, the room there is and the room the rows need; the partial store is gone, the candidates
    and a packed store that was already complete are as they were."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    rows = read_rows(tiny / "candidates.jsonl")
    many = [dict(row, request_id=f"{row['request_id']}-{k}") for k in range(40) for row in rows]
    (tiny / "candidates.jsonl").write_text("".join(json.dumps(row) + "\n" for row in many))
    before = (tiny / "candidates.jsonl").read_bytes()
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(small)], check=True)
    try:
        edit_config(tiny, data={"packed_dir": str(small / "packed")})
        result = spds(["prepare", "config.json"], tiny)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "spds prepare: cannot write" in result.stderr and "No space left on device" in result.stderr
        assert "MiB free there; the candidate files hold" in result.stderr
        assert "the partial store was removed, and nothing you had changed" in result.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert (tiny / "candidates.jsonl").read_bytes() == before
