"""Position windows: what a model can read, from its published config.json
(tests/fixtures/models/windows.json: the keys that decide it, verbatim, and the window each card
states), bounds every context spds feeds it, refused before any work with the numbers.

A position past the window is not an error in any model spds runs (RoPE gives numbers at any
position), so nothing downstream would catch it: the refusal is the whole protection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import edit_config, make_tiny
from helpers import spds
from test_families import FAMILIES

from spds.contract.gate import load_config
from spds.contract.model_config import declared_window, position_window
from spds.errors import SpdsError
from spds.generation.teacher_window import require_ready

WINDOWS = {
    k: v
    for k, v in json.loads((Path(__file__).parent / "fixtures" / "models" / "windows.json").read_text()).items()
    if not k.startswith("_")
}


def save_windowed(directory: Path, name: str) -> Path:
    """A tiny random student of the fixture's family with its published window keys, and a
    byte-level ChatML tokenizer, saved by transformers itself (which may rewrite rope_scaling as
    rope_parameters: the window must read the same from what it writes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = make_tiny.chatml_tokenizer()
    fields = {**FAMILIES[WINDOWS[name]["family"]]["config"], **WINDOWS[name]["keys"]}
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **fields,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", list(WINDOWS))
def test_the_window_is_the_one_the_card_states_as_published_and_as_transformers_saves_it(tmp_path, name):
    published = position_window(WINDOWS[name]["keys"])
    assert published.positions == WINDOWS[name]["window"], published
    saved = declared_window(save_windowed(tmp_path / name, name))
    assert saved.positions == WINDOWS[name]["window"], (
        saved,
        json.loads((tmp_path / name / "config.json").read_text()),
    )


def test_a_scaling_never_stretches_a_window_past_what_its_config_names():
    # linear and dynamic stretch only a length the config names as the original one; YaRN without it
    # stretches max_position_embeddings (vLLM's rule); a factor of 1 or a boolean is no stretch
    assert position_window({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}) == (
        position_window({"max_position_embeddings": 4096})
    )
    stretched = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096}
    assert position_window({"max_position_embeddings": 4096, "rope_scaling": stretched}).positions == 8192
    assert (
        position_window({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 2}}).positions
        == 8192
    )
    assert (
        position_window({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 1}}).positions
        == 4096
    )
    assert position_window({"n_positions": 1024, "max_position_embeddings": 2048}).positions == 1024  # the smaller
    assert position_window({"max_position_embeddings": True}) is None and position_window({}) is None


def lines(tokens: int) -> str:
    """A context of `tokens` byte-level tokens, in lines."""
    line = "The archive keeps one more ledger here.\n"
    text = line * (tokens // len(line) + 1)
    return text[:tokens]


@pytest.fixture
def smollm2(tiny, tmp_path_factory) -> Path:
    """The tiny run, its student with SmolLM2-135M-Instruct's window (8,192) and a context of
    8,300 tokens with questions for the teacher."""
    student = save_windowed(tmp_path_factory.mktemp("smollm2") / "student", "smollm2")
    (tiny / "context.md").write_text(lines(8300))
    (tiny / "questions.jsonl").write_text(json.dumps({"question_id": "q1", "question": "Which ledger?"}) + "\n")
    edit_config(
        tiny,
        student={"model_path": str(student)},
        context={"file": "context.md"},
        generate={"questions": "questions.jsonl", "output": "teacher.jsonl", "max_new_tokens": 16},
    )
    return tiny


def test_validate_generate_and_eval_refuse_a_context_past_the_teachers_window_with_the_numbers(smollm2):
    validate = spds(["validate", "config.json"], smollm2)
    assert validate.returncode == 1, validate.stderr
    message = validate.stderr
    for said in (
        "context.file",
        "the context is 8300 tokens",
        "answer (16: generate.max_new_tokens)",
        "reads 8358 positions",
        "window of 8192",
    ):
        assert said in message, message
    student = json.loads((smollm2 / "config.json").read_text())["student"]["model_path"]
    assert f"{student}/config.json: max_position_embeddings" in message, message
    generate = spds(["generate", "config.json"], smollm2)
    assert generate.returncode == 1 and "window of 8192" in generate.stderr, generate.stderr
    assert not (smollm2 / "teacher.jsonl").exists()  # nothing written, not even an empty file
    edit_config(smollm2, eval={"questions": "questions.jsonl"})
    evaluate = spds(["eval", "config.json"], smollm2)  # refused before it looks for a checkpoint
    assert evaluate.returncode == 1 and "window of 8192" in evaluate.stderr, evaluate.stderr
    assert "Traceback" not in validate.stderr + generate.stderr + evaluate.stderr


def test_a_context_limit_past_the_students_window_is_refused_and_null_is_the_window(smollm2):
    (smollm2 / "context.md").write_text(lines(200))
    edit_config(smollm2, data={"context_limit": 16384})
    prepare = spds(["prepare", "config.json"], smollm2)
    assert prepare.returncode == 1, prepare.stderr
    assert "data.context_limit: 16384 positions is past the student's window of 8192" in prepare.stderr
    assert not (smollm2 / "packed").exists()
    edit_config(smollm2, data={"context_limit": None})
    config = load_config(smollm2 / "config.json")
    assert config.context_limit == 8192 and config.raw["data"]["context_limit"] is None


def test_init_refuses_a_context_its_teacher_cannot_read(smollm2):
    student = str(json.loads((smollm2 / "config.json").read_text())["student"]["model_path"])
    result = spds(["init", student, "rows.jsonl", "--context", "context.md", "--out", "run.yaml"], smollm2)
    assert result.returncode == 1 and "window of 8192" in result.stderr, result.stderr
    assert not (smollm2 / "run.yaml").exists()


def test_a_declared_yarn_scaling_admits_the_long_context_and_its_absence_refuses_it(tiny, tmp_path_factory):
    """Qwen2.5-7B-Instruct reads 32,768 positions as published and 131,072 with its card's YaRN block."""
    (tiny / "context.md").write_text(lines(40_000))
    (tiny / "questions.jsonl").write_text(json.dumps({"question_id": "q1", "question": "Which ledger?"}) + "\n")
    root = tmp_path_factory.mktemp("qwen")
    for name, refused in (("qwen2.5", True), ("qwen2.5-yarn", False)):
        student = save_windowed(root / name, name)
        edit_config(
            tiny,
            student={"model_path": str(student)},
            context={"file": "context.md"},
            data={"context_limit": None},
            generate={"questions": "questions.jsonl", "output": "teacher.jsonl"},
        )
        config = load_config(tiny / "config.json", candidates="generate writes one")
        if refused:
            with pytest.raises(SpdsError) as error:
                require_ready(config)
            assert "window of 32768" in str(error.value.problems), error.value.problems
        else:
            require_ready(config)
            assert config.context_limit == 131072


def test_self_study_chunks_longer_than_the_context_are_refused_by_name(tiny):
    (tiny / "context.md").write_text(lines(300))
    edit_config(
        tiny,
        context={"file": "context.md"},
        generate={"self_study": {"conversations": 8, "chunk_tokens": 512}, "output": "teacher.jsonl"},
    )
    with pytest.raises(SpdsError) as error:
        require_ready(load_config(tiny / "config.json", candidates="generate writes one"))
    assert "generate.self_study.chunk_tokens: 512 is more than the context's 300 tokens" in str(error.value.problems)


def test_the_online_teacher_refuses_a_context_and_record_past_the_students_window(prepared):
    """The student reads the context in place of the prompt (loss.teacher context): the context
    fits alone, with the longest record it does not. Train refuses before update 1, and says so in
    terminal.json."""
    (prepared / "context.md").write_text(lines(8192 - 40))
    edit_config(prepared, context={"file": "context.md"}, loss={"objective": "kl", "teacher": "context"})
    assert load_config(prepared / "config.json").student_window.positions == 8192
    result = spds(["train", "config.json"], prepared)
    assert result.returncode == 1 and "past the student's window of 8192" in result.stderr, result.stderr
    terminal = json.loads((prepared / "run" / "terminal.json").read_text())
    assert terminal["status"] == "failed" and "window of 8192" in terminal["reason"], terminal


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"max_position_embeddings": "8192"}, "max_position_embeddings is '8192': a whole number of positions"),
        ({"max_position_embeddings": 0}, "max_position_embeddings is 0: a whole number of positions"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": "4"}}, "rope_scaling.factor is '4': a number above 0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0}}, "rope_scaling.factor is 0: a number above 0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 1e9}}, "rope_scaling.factor is 1000000000.0"),
        ({"rope_scaling": {"rope_type": "warp", "factor": 2}}, "rope_scaling.rope_type is 'warp': one of default"),
        ({"rope_scaling": "yarn"}, "rope_scaling is 'yarn': an object"),
    ],
)
def test_window_and_rope_settings_are_numbers_in_range_before_any_load(tiny, tiny_assets, edit, message):
    """A careless config.json (a number written as a string, a factor of 0 or 10^9, a rope type no
    library knows) is refused by validate, naming the file, the key and the rule, before transformers
    reads it (where it would pass, crash with a traceback or give a window of 10^12 positions)."""
    import shutil

    student = tiny / "student"
    shutil.copytree(tiny_assets / "student", student)
    config = json.loads((student / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(edit)
    (student / "config.json").write_text(json.dumps(config))
    edit_config(tiny, student={"model_path": str(student)})
    for verb in ("validate", "prepare"):
        result = spds([verb, "config.json"], tiny)
        assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
        assert f"{student / 'config.json'}" in result.stderr and "rule '" in result.stderr
        assert "Traceback" not in result.stderr
