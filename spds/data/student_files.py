"""What spds reads from the student's directory without loading its weights (and without torch):
its tokenizer and its config.json. Packing, preflight and validate need them; the weights are
spds/model/student.py's."""

from __future__ import annotations

from pathlib import Path

from spds.fsio import read_json


def load_tokenizer(config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(config.tokenizer_path), local_files_only=True, trust_remote_code=config.student.trust_remote_code
    )


def student_config(model_path) -> dict:
    """The student's config.json (a multimodal model's text part), read strictly; {} if not an object."""
    value = read_json(Path(model_path) / "config.json")
    value = value.get("text_config", value) if isinstance(value, dict) else {}
    return value if isinstance(value, dict) else {}
