"""The run contract: schemas, defaults, unknown keys, every problem at once, pins."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing

import jsonschema
import pytest
from conftest import REPO, edit_config

from spds import fsio
from spds.cli import main
from spds.contract.digests import sha256_path
from spds.contract.gate import load_config, pin_config
from spds.contract.schema import load_schema
from spds.contract.settings import SECTIONS, CandidateSettings
from spds.errors import SpdsError


def test_every_schema_is_valid_draft_2020_12():
    names = sorted(p.name.removesuffix(".schema.json") for p in (REPO / "schemas").glob("*.schema.json"))
    assert {"config", "ds_config", "candidate", "manifest"} <= set(names)
    for name in names:
        schema = load_schema(name)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_shipped_deepspeed_config_validates(tiny):
    for ds_config in sorted((REPO / "ds_configs").glob("*.json")):
        edit_config(tiny, deepspeed_config=str(ds_config))
        assert main(["validate", str(tiny / "config.json")]) == 0, ds_config


def test_defaults_come_from_the_schema(tiny):
    config = load_config(tiny / "config.json")
    schema = load_schema("config")
    assert list(config.optim.betas) == schema["properties"]["optim"]["properties"]["betas"]["default"]
    assert config.student.attn_implementation == "sdpa"
    assert config.data_parallel_size == "any"
    assert config.data.candidates[0].sha256 is None
    assert (
        config.soft_prompt.init.std
        == schema["properties"]["soft_prompt"]["properties"]["init"]["properties"]["std"]["default"]
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optim.learning_rate = 1.0  # a run's settings do not change under it


def test_every_schema_field_has_a_typed_setting_and_no_more():
    """settings.py declares types only; the schema owns the fields. Renamed keys (refused by the
    schema with a message) have no setting."""
    schema = load_schema("config")

    def fields_of(node: dict) -> set[str]:
        return {key for key, sub in node["properties"].items() if "not" not in sub}

    for key, cls in SECTIONS.items():
        section = schema["properties"][key]
        assert {f.name for f in dataclasses.fields(cls)} == fields_of(section), key
        for f in dataclasses.fields(cls):
            nested = section["properties"][f.name]
            if nested.get("type") == "object" and "properties" in nested:
                hint = typing.get_type_hints(cls)[f.name]
                assert {g.name for g in dataclasses.fields(hint)} == fields_of(nested), f"{key}.{f.name}"
    candidate = schema["properties"]["data"]["properties"]["candidates"]["items"]
    assert {f.name for f in dataclasses.fields(CandidateSettings)} == fields_of(candidate)


def test_all_problems_reported_together_with_nearest_key(tiny, capsys):
    edit_config(tiny, optim={"lerning_rate": 0.1, "updates": 0}, soft_prompt={"placement": "middle"})
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    text = str(caught.value)
    assert "optim.lerning_rate: unknown key; did you mean 'learning_rate'?" in text
    assert "optim.updates: 0 is less than the minimum of 1" in text
    assert "soft_prompt.placement" in text
    assert main(["validate", str(tiny / "config.json")]) == 1
    assert "lerning_rate" in capsys.readouterr().err


def test_mixed_precision_section_is_refused_with_the_reason(tiny, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "train_batch_size": 8}))
    edit_config(tiny, deepspeed_config=str(ds))
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    text = str(caught.value)
    assert "bf16: remove the bf16 section" in text and "FP32 soft prompt" in text
    assert "train_batch_size: remove train_batch_size" in text


def test_zero_stage_choices_are_checked(tiny, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    edit_config(tiny, deepspeed_config=str(ds))
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    assert "zero_optimization.stage: spds supports ZeRO stage 0" in str(caught.value)
    # Two ways of sharding the student at once is a choice left unmade.
    edit_config(tiny, deepspeed_config="ds_configs/zero3.json", sharding="fsdp")
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    assert "both shard the student; choose one" in str(caught.value)
    edit_config(tiny, sharding="deepspeed")
    load_config(tiny / "config.json")  # the shipped ZeRO-3 file passes its schema


def test_missing_inputs_are_named(tiny):
    edit_config(tiny, student={"model_path": "nowhere"}, data={"candidates": [{"path": "missing.jsonl"}]})
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    assert "student.model_path" in str(caught.value) and "data.candidates[0].path" in str(caught.value)


def test_pin_then_changed_input_refuses_naming_expected_and_actual(tiny):
    before = (tiny / "config.json").read_bytes()
    pins = pin_config(tiny / "config.json")
    assert (tiny / "config.json").read_bytes() == before  # the user's file is never rewritten
    lock = json.loads((tiny / "config.json.pins.json").read_text())
    digest = sha256_path(tiny / "candidates.jsonl")
    assert lock["pins"]["data.candidates[0].sha256"] == pins["data.candidates[0].sha256"] == digest
    assert load_config(tiny / "config.json").data.candidates[0].sha256 == pins["data.candidates[0].sha256"]
    with open(tiny / "candidates.jsonl", "a") as stream:
        stream.write("\n")
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    text = str(caught.value)
    assert "data.candidates[0].sha256" in text
    assert pins["data.candidates[0].sha256"] in text and sha256_path(tiny / "candidates.jsonl") in text
    assert main(["prepare", str(tiny / "config.json")]) == 1
    assert not (tiny / "packed").exists()


def test_directory_digest_covers_names_and_contents(tmp_path):
    (tmp_path / "a").write_text("x")
    first = sha256_path(tmp_path)
    (tmp_path / "a").rename(tmp_path / "b")
    second = sha256_path(tmp_path)
    (tmp_path / "b").write_text("y")
    assert len({first, second, sha256_path(tmp_path)}) == 3
    # The definition, recomputed with hashlib: sorted relative names, each with its file's digest.
    (tmp_path / "sub").mkdir()
    for name, text in [("sub/shard-2.bin", "two"), ("sub/shard-1.bin", "one"), ("config.json", "{}")]:
        (tmp_path / name).write_text(text)
    expected = hashlib.sha256()
    for name in sorted(["b", "config.json", "sub/shard-1.bin", "sub/shard-2.bin"]):
        content = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        expected.update(name.encode() + b"\0" + content.encode() + b"\n")
    assert sha256_path(tmp_path) == expected.hexdigest()


def test_remembered_digests_are_hashed_again_after_any_write(tmp_path, monkeypatch):
    """A file's digest is remembered under (device, inode, size, mtime, ctime): a rewrite with the
    same size and the old mtime put back still changes ctime, so it is hashed again."""
    from spds.contract import digests

    monkeypatch.setenv("SPDS_DIGEST_CACHE", str(tmp_path / "cache"))
    hashed = []
    monkeypatch.setattr(digests, "sha256_file", lambda path: hashed.append(path) or fsio.sha256_file(path))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"A" * 1000)
    truth = lambda: hashlib.sha256(weights.read_bytes()).hexdigest()  # noqa: E731
    assert sha256_path(weights) == truth() and len(hashed) == 1
    assert sha256_path(weights) == truth() and len(hashed) == 2  # written just now: not remembered (racy)
    monkeypatch.setattr(digests, "RACY_SECONDS", 0.0)
    assert sha256_path(weights) == truth() and len(hashed) == 3  # remembered from here on
    assert sha256_path(weights) == truth() and len(hashed) == 3
    before = os.stat(weights)
    weights.write_bytes(b"B" * 1000)  # same size; then the old mtime put back
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(weights).st_mtime_ns == before.st_mtime_ns
    assert sha256_path(weights) == truth() == hashlib.sha256(b"B" * 1000).hexdigest() and len(hashed) == 4
    for entry in (tmp_path / "cache").rglob("*"):  # a damaged cache is skipped, never believed
        if entry.is_file():
            entry.write_text("not a digest")
    assert sha256_path(weights) == truth() and len(hashed) == 5
    monkeypatch.setenv("SPDS_DIGEST_CACHE", "off")
    assert sha256_path(weights) == truth() and sha256_path(weights) == truth() and len(hashed) == 7


def test_yaml_config_keeps_its_comments_when_pinned(tiny):
    yaml = pytest.importorskip("yaml")
    config = json.loads((tiny / "config.json").read_text())
    text = "# the tiny run: lr chosen by hand\n" + yaml.safe_dump(config)
    (tiny / "config.yaml").write_text(text)
    assert load_config(tiny / "config.yaml").optim.effective_batch == 8
    pins = pin_config(tiny / "config.yaml")
    assert (tiny / "config.yaml").read_text() == text
    assert load_config(tiny / "config.yaml").student.model_sha256 == pins["student.model_sha256"]
    (tiny / "candidates.jsonl").write_text((tiny / "candidates.jsonl").read_text() + "\n")
    with pytest.raises(SpdsError, match="changed since it was pinned"):
        load_config(tiny / "config.yaml")


def test_world_size_contract(tiny):
    from spds.contract.gate import validate_run_world

    edit_config(tiny, data_parallel_size=4, optim={"effective_batch": 8})
    config = load_config(tiny / "config.json")
    validate_run_world(config, 4)
    with pytest.raises(SpdsError, match="data_parallel_size is 4 but this launch has world size 2"):
        validate_run_world(config, 2)
    edit_config(tiny, data_parallel_size="any", optim={"effective_batch": 8})
    with pytest.raises(SpdsError, match="does not divide by the world size 3"):
        validate_run_world(load_config(tiny / "config.json"), 3)


def test_renamed_settings_are_refused_naming_their_new_names(tiny):
    config = json.loads((tiny / "config.json").read_text())
    config.update(backend="fsdp", loss={"backend": "chunked"}, distributed={"backend": "gloo"})
    config["student"]["sdpa_backend"] = "fa4"
    (tiny / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    text = str(caught.value)
    for old, new in [
        ("backend", "'sharding'"),
        ("loss.backend", "'loss.kernel'"),
        ("distributed.backend", "'distributed.communication'"),
        ("student.sdpa_backend", "'student.attention_kernel'"),
    ]:
        assert f"{old}: renamed to {new}" in text, text


def test_deterministic_training_refuses_attention_without_a_deterministic_backward(tiny):
    """cuDNN attention (named, or as one side of a by-length choice) has no deterministic
    backward; train.deterministic with it would resume differently from the straight run."""
    by_length = {"below": 8192, "short": "flash", "long": "cudnn"}
    edit_config(tiny, train={"deterministic": True}, student={"attention_kernel": by_length})
    with pytest.raises(SpdsError) as caught:
        load_config(tiny / "config.json")
    assert "student.attention_kernel: cuDNN attention has no deterministic backward" in str(caught.value)
    edit_config(tiny, train={"deterministic": True}, student={"attn_implementation": "flex_attention"})
    with pytest.raises(SpdsError, match="student.attn_implementation: 'flex_attention' has no deterministic"):
        load_config(tiny / "config.json")
    edit_config(
        tiny, train={"deterministic": True}, student={"attention_kernel": "auto", "attn_implementation": "sdpa"}
    )
    load_config(tiny / "config.json")  # auto resolves to a deterministic kernel
    edit_config(tiny, train={"deterministic": False}, student={"attention_kernel": by_length})
    load_config(tiny / "config.json")  # without the promise, cuDNN is the fast choice


def test_a_teacher_memo_is_refused_for_a_sharded_student(tiny):
    """A memo skips the teacher's forward on some ranks and not others; a sharded student's ranks
    gather weights collectively in every forward and would wait on each other forever."""
    edit_config(tiny, loss={"objective": "kl", "teacher_memo_gib": 1}, sharding="fsdp")
    with pytest.raises(SpdsError, match="loss.teacher_memo_gib: a sharded student"):
        load_config(tiny / "config.json")
    edit_config(tiny, sharding="deepspeed")  # ZeRO-0: the student replicated on every rank
    load_config(tiny / "config.json")


def test_fp8_linear_is_refused_for_a_sharded_student(tiny):
    """FP8 weights are buffers: ZeRO-3 and FSDP shard parameters only, so a sharded student in FP8
    would hold every layer on every rank."""
    edit_config(tiny, student={"fp8_linear": True}, sharding="fsdp")
    with pytest.raises(SpdsError, match="student.fp8_linear: the FP8 weights are buffers"):
        load_config(tiny / "config.json")
    edit_config(tiny, sharding="deepspeed")
    load_config(tiny / "config.json")


def test_packed_micro_batches_are_refused_for_a_student_spds_cannot_attend_for(tiny):
    """Packed records rely on spds's attention keeping each record to itself; an eager student's
    own attention would read the boundaries as one long sequence and mix the records."""
    edit_config(
        tiny, optim={"micro_batch": 4, "micro_batch_layout": "packed"}, student={"attn_implementation": "eager"}
    )
    with pytest.raises(SpdsError, match="optim.micro_batch_layout: packed records need spds's attention"):
        load_config(tiny / "config.json")
    edit_config(tiny, student={"attn_implementation": "sdpa"})
    assert load_config(tiny / "config.json").optim.micro_batch_layout == "packed"


def test_bad_on_policy_settings_are_refused_by_validate_naming_each_key(tiny):
    """loss.on_policy: a fraction outside [0, 1] (the schema); then, at once, every rule its use
    breaks: cross entropy on the student's own tokens, no online teacher, and a max_new_tokens
    that leaves no room for a question within data.context_limit."""
    from helpers import spds

    edit_config(tiny, loss={"objective": "kl", "teacher": "context", "on_policy": {"fraction": 1.5}})
    result = spds(["validate", "config.json"], tiny)
    assert result.returncode != 0 and "loss.on_policy.fraction" in result.stderr and "1.5" in result.stderr
    limit = json.loads((tiny / "config.json").read_text())["data"]["context_limit"]
    edit_config(
        tiny, loss={"objective": "ce", "teacher": "top_k", "on_policy": {"fraction": 0.5, "max_new_tokens": limit}}
    )
    result = spds(["validate", "config.json"], tiny)
    assert result.returncode != 0
    for expected in (
        "loss.on_policy.fraction: the student's own answers are scored by a divergence",
        "loss.on_policy.fraction: the student's own answers have no offline teacher",
        f"loss.on_policy.max_new_tokens: {limit} new tokens",
    ):
        assert expected in result.stderr, result.stderr
    edit_config(
        tiny,
        loss={"objective": "kl", "teacher": "context", "on_policy": {"fraction": 0.5, "max_new_tokens": 8}},
        context={"text": "You are terse."},
    )
    assert spds(["validate", "config.json"], tiny).returncode == 0
