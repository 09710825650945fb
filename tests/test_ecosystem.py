"""Meeting users where they are: hub model ids from the local cache, a starter config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import edit_config
from helpers import check, spds

from spds.contract.gate import load_config
from spds.errors import SpdsError


def hub_cache(root, student, repo="tiny-org/tiny-student", revision="0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face cache in its real layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    folder = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(student, folder / "snapshots" / revision)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    return revision


def test_a_hub_id_loads_from_the_local_cache_and_is_pinned_like_a_directory(tiny, tiny_assets, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    revision = hub_cache(cache, tiny_assets / "student")
    # In a fresh process HF_HUB_CACHE is read at import (the spds commands below); this one
    # imported huggingface_hub already.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    for written in ("tiny-org/tiny-student", f"tiny-org/tiny-student@{revision}", "tiny-org/tiny-student@main"):
        edit_config(tiny, student={"model_path": written})
        config = load_config(tiny / "config.json")
        assert config.model_path == cache / "models--tiny-org--tiny-student" / "snapshots" / revision
    from spds.model.student import load_student

    student = load_student(config.model_path, "float32", "sdpa", torch.device("cpu"))
    assert student.config.num_hidden_layers >= 1  # the real from_pretrained, through the cache
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    check(spds(["pin", "config.json"], tiny, **env))
    check(spds(["validate", "config.json"], tiny, **env))
    # The cache changes under the pinned id: refused like any pinned input.
    weights = next((cache / "models--tiny-org--tiny-student" / "snapshots" / revision).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    result = spds(["validate", "config.json"], tiny, **env)
    assert (
        result.returncode != 0
        and "student.model_sha256" in result.stderr
        and "changed since it was pinned" in (result.stderr)
    )


def test_an_id_not_in_the_cache_says_how_to_fetch_it(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    edit_config(tiny, student={"model_path": "Qwen/Qwen3-8B@main"})
    with pytest.raises(SpdsError) as error:
        load_config(tiny / "config.json")
    assert "huggingface-cli download Qwen/Qwen3-8B --revision main" in str(error.value)
    assert "spds never downloads" in str(error.value)


def test_init_writes_a_commented_config_that_validates(tiny, tiny_assets):
    result = check(spds(["init", str(tiny_assets / "student"), "candidates.jsonl", "--out", "run.yaml"], tiny))
    text = (tiny / "run.yaml").read_text()
    assert "  # Number of virtual tokens" in text and "learning_rate: 0.001" in text
    assert 'placement: "system"' in text  # the tiny ChatML template has a system turn
    assert "run.yaml" in result.stdout
    check(spds(["validate", "run.yaml"], tiny))
    check(spds(["prepare", "run.yaml"], tiny))
    # Never overwrites, and a config that would not validate is not written at all.
    again = spds(["init", str(tiny_assets / "student"), "candidates.jsonl", "--out", "run.yaml"], tiny)
    assert again.returncode != 0 and "never overwrites" in again.stderr
    bad = spds(["init", str(tiny_assets / "student"), "missing.jsonl", "--out", "other.yaml"], tiny)
    assert bad.returncode != 0 and "missing.jsonl" in bad.stderr
    assert not (tiny / "other.yaml").exists() and not list(tiny.glob(".init-*"))
    assert json.loads(json.dumps(load_config(tiny / "run.yaml").raw))["soft_prompt"]["length"] == 256


def test_init_with_a_context_writes_a_self_study_config_that_validates_before_generate(tiny, tiny_assets):
    # The first two steps of a user with a document and no rows: DATA is what generate will write.
    (tiny / "context.md").write_text("Brightwater Robotics was founded in 2011 in Tromso. " * 8)
    student = str(tiny_assets / "student")
    check(spds(["init", student, "rows.jsonl", "--context", "context.md", "--out", "run.yaml"], tiny))
    assert "self_study" in (tiny / "run.yaml").read_text() and not (tiny / "rows.jsonl").exists()
    check(spds(["validate", "run.yaml"], tiny))
    prepare = spds(["prepare", "run.yaml"], tiny)  # prepare reads the rows: not written yet, and named
    assert prepare.returncode == 1 and "rows.jsonl" in prepare.stderr, prepare.stderr
    # Without --recipe, on a machine without a CUDA device: the CPU's measured recipe.
    cpu = load_config(tiny / "run.yaml", check_pins=False, candidates="generate writes one").raw
    assert "for a CPU (spds init --recipe cpu)" in (tiny / "run.yaml").read_text()
    assert (cpu["generate"]["self_study"]["conversations"], cpu["optim"]["effective_batch"]) == (256, 8)
    assert (cpu["loss"]["objective"], cpu["optim"]["learning_rate"], cpu["student"]["dtype"]) == ("kl", 0.01, "float32")
    # --recipe gpu: the GPU's (docs/config.md), which validates here too (it is trained elsewhere).
    written = check(
        spds(["init", student, "rows.jsonl", "--context", "context.md", "--recipe", "gpu", "--out", "gpu.yaml"], tiny)
    )
    assert "the GPU recipe" in written.stdout
    gpu = load_config(tiny / "gpu.yaml", check_pins=False, candidates="generate writes one").raw
    assert (gpu["generate"]["self_study"]["conversations"], gpu["generate"]["self_study"]["chunk_tokens"]) == (1280, 64)
    assert (gpu["optim"]["updates"], gpu["optim"]["effective_batch"], gpu["optim"]["learning_rate"]) == (128, 128, 0.1)
    assert (gpu["loss"]["objective"], gpu["loss"]["teacher"], gpu["student"]["dtype"]) == ("mix", "top_k", "bfloat16")
    check(spds(["validate", "gpu.yaml"], tiny))
    alone = spds(["init", student, "rows.jsonl", "--recipe", "gpu", "--out", "other.yaml"], tiny)
    assert alone.returncode != 0 and "--recipe" in alone.stderr and "--context" in alone.stderr
    assert not (tiny / "other.yaml").exists()


@pytest.mark.extended
def test_parquet_and_a_saved_dataset_pack_exactly_as_the_jsonl_of_the_same_rows(tiny):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as parquet

    rows = [json.loads(line) for line in (tiny / "candidates.jsonl").read_text().splitlines()]
    # Token and chat rows side by side: every column in every row (null where a row has none), as a
    # table holds them; both libraries would otherwise take the columns from the first row alone.
    columns = sorted({key for row in rows for key in row})
    rows = [{key: row.get(key) for key in columns} for row in rows]
    parquet.write_table(pa.Table.from_pylist(rows), tiny / "rows.parquet", row_group_size=7)  # several groups
    datasets.Dataset.from_list(rows).save_to_disk(str(tiny / "rows-dataset"))
    packed = {}
    for name, path in (("jsonl", "candidates.jsonl"), ("parquet", "rows.parquet"), ("dataset", "rows-dataset")):
        edit_config(tiny, data={"candidates": [{"path": path}], "packed_dir": f"packed-{name}"})
        check(spds(["prepare", "config.json"], tiny))
        index = [json.loads(line) for line in (tiny / f"packed-{name}" / "index.jsonl").read_text().splitlines()]
        for entry in index:
            entry["source"] = entry["source"].split(":")[1]  # the file's name differs; the row number does not
        packed[name] = ((tiny / f"packed-{name}" / "tokens.uint32").read_bytes(), index)
    assert packed["parquet"] == packed["jsonl"] and packed["dataset"] == packed["jsonl"]
    # A bad row is named by file, row, request_id and rule, as in JSONL.
    bad = [dict(row) for row in rows]
    bad[4]["sample_index"] = -1
    parquet.write_table(pa.Table.from_pylist(bad), tiny / "bad.parquet")
    edit_config(tiny, data={"candidates": [{"path": "bad.parquet"}], "packed_dir": "packed-bad"})
    result = spds(["prepare", "config.json"], tiny)
    assert result.returncode != 0
    assert f"bad.parquet: row 5: request_id {bad[4]['request_id']}: rule 'schema'" in result.stderr
    assert not (tiny / "packed-bad").exists()


@pytest.mark.slow
@pytest.mark.over_budget(
    "a hub model id through HF_HUB_CACHE (read at import: a process of its own) and parquet rows, end to end"
)
def test_a_model_id_and_a_parquet_of_rows_are_enough_to_train(tiny, tiny_assets, tmp_path):
    """Issue 17's user: only a model id in the HF cache and a parquet file of teacher rows.
    init -> pin -> prepare -> smoke -> train, no path edited (only the sizes, for a CPU test)."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    cache = tmp_path / "hub"
    hub_cache(cache, tiny_assets / "student")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    rows = [json.loads(line) for line in (tiny / "candidates.jsonl").read_text().splitlines()]
    columns = sorted({key for row in rows for key in row})
    parquet.write_table(
        pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows]), tiny / "teacher.parquet"
    )
    check(spds(["init", "tiny-org/tiny-student", "teacher.parquet", "--out", "run.yaml"], tiny, **env))
    text = (tiny / "run.yaml").read_text()
    for field, value in (("length", 4), ("updates", 2), ("effective_batch", 4)):  # CPU-sized, nothing else
        text = (
            "\n".join(f"  {field}: {value}" if line.startswith(f"  {field}:") else line for line in text.splitlines())
            + "\n"
        )
    (tiny / "run.yaml").write_text(text)
    for verb in ("pin", "prepare", "smoke", "train"):
        check(spds([verb, "run.yaml"], tiny, **env))
    assert json.loads((tiny / "run" / "terminal.json").read_text())["status"] == "complete"
