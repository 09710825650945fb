"""A prompt is checked against its student before use, everywhere one is read: eval, sample and
export on a checkpoint, spds.trained.export's public functions, and the file spds export wrote. Another
student's shape, another form, a value that is not finite: refused naming the file (or the
argument), the expected and found shapes and the rule, with no traceback and nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import edit_config, make_tiny
from helpers import FAST, check, spds

from spds.errors import SpdsError


@pytest.fixture
def trained(tiny):
    """The tiny example trained (embeddings form, 4 positions) with FAST's updates."""
    edit_config(tiny, **FAST)
    edit_config(tiny, data={"eval_fraction": 0.25})
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    return tiny


def other_student(directory, **shape):
    return make_tiny.save_student(directory, make_tiny.chatml_tokenizer(), **shape)


@pytest.mark.parametrize("shape", [{"hidden": 32}, {"layers": 3, "hidden": 128}])
def test_eval_sample_and_export_refuse_a_checkpoint_of_another_student(trained, shape):
    other = other_student(trained / "other-student", **shape)
    edit_config(trained, student={"model_path": str(other)})
    for verb in ("eval", "sample", "export"):
        result = spds([verb, "config.json"], trained)
        assert result.returncode == 1, (verb, result.stderr[-2000:])
        assert "rule 'prompt fits its student'" in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert "[4, 64]" in result.stderr and f"[4, {shape['hidden']}]" in result.stderr, result.stderr
        assert "checkpoints/update-" in result.stderr, "the message names the checkpoint"
    assert not (trained / "run" / "eval.json").exists() and not (trained / "run" / "export").exists()


def test_the_public_loaders_check_the_file_and_the_student(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from spds.trained.export import load_soft_prompt, prompt_embeds

    check(spds(["export", "config.json"], trained))
    exported = next((trained / "run").rglob("soft_prompt.safetensors"))
    prompt, metadata = load_soft_prompt(exported)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = json.loads((trained / "config.json").read_text())["student"]["model_path"]
    student = AutoModelForCausalLM.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "user", "content": "Hi"}]
    assert prompt_embeds(student, tokenizer, prompt, metadata, messages).shape[-1] == 64
    with pytest.raises(SpdsError, match=r"takes \[4, 64\]: rule 'prompt fits its student'"):
        prompt_embeds(student, tokenizer, torch.zeros(4, 32), metadata, messages)
    nan = prompt.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(SpdsError, match="not finite"):
        prompt_embeds(student, tokenizer, nan, metadata, messages)
    # a file whose metadata and tensor disagree: named, with the rule
    tensors = load_file(exported)
    altered = tmp_path / "altered.safetensors"
    save_file({"prompt": tensors["prompt"][:, :32].contiguous()}, str(altered), metadata=metadata_of(exported))
    with pytest.raises(SpdsError, match=rf"{altered}.*rule 'exported prompt'"):
        load_soft_prompt(altered)
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpdsError, match="garbage.safetensors.*rule 'exported prompt'"):
        load_soft_prompt(tmp_path / "garbage.safetensors")


def metadata_of(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata())


def test_a_kv_prompt_of_another_layer_count_is_refused(tiny):
    """The kv form's shape names the student's layers: a 2-layer student's prompt on a 3-layer one
    of the same widths once gave figures and answers (only the number of dimensions was checked)."""
    edit_config(tiny, **FAST)
    edit_config(tiny, soft_prompt={**FAST["soft_prompt"], "form": "kv"}, data={"eval_fraction": 0.25})
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    edit_config(tiny, student={"model_path": str(other_student(tiny / "deeper", layers=3))})
    for verb in ("eval", "sample", "export"):
        result = spds([verb, "config.json"], tiny)
        assert result.returncode == 1 and "rule 'prompt fits its student'" in result.stderr, (verb, result.stderr)
        assert "[2, 2, 2, 4, 16]" in result.stderr and "[3, 2, 2, 4, 16]" in result.stderr, result.stderr


def test_eval_questions_without_rouge_score_is_refused_before_any_work(tiny, monkeypatch):
    """eval scores the answers' ROUGE-L only after the teacher has answered every question: a missing
    rouge-score is named by validate and every command's contract, before any of it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rouge_score" else real(name, *a))
    (tiny / "questions.jsonl").write_text(json.dumps({"question_id": "a", "question": "Why?"}) + "\n")
    edit_config(tiny, context={"text": "A context."}, eval={"questions": "questions.jsonl"})
    for verb in ("validate", "eval"):
        result = spds([verb, "config.json"], tiny)
        assert result.returncode == 1 and "pip install rouge-score" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
