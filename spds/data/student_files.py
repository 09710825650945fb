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


def decodable_ids(tokenizer, output_rows: int | None) -> int:
    """How many ids a model may write and a row may hold: the tokenizer's ids that the model's
    output layer has. Published checkpoints pad the output layer past the tokenizer (Qwen2.5 and
    Qwen3: 151,936 or 152,064 rows for about 151,665 ids) for faster matmuls; the padded rows
    decode to nothing, so the decoder drops their logits, as vLLM does."""
    return min(len(tokenizer), output_rows or len(tokenizer))


def student_config(model_path) -> dict:
    """The student's config.json (a multimodal model's text part), read strictly; {} if not an object."""
    value = read_json(Path(model_path) / "config.json")
    value = value.get("text_config", value) if isinstance(value, dict) else {}
    return value if isinstance(value, dict) else {}
