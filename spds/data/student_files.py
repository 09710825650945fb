"""What spds reads from the student's directory without loading its weights (and without torch):
its tokenizer, and how many of its ids a model may write. Packing, preflight and validate need
them; its config.json is spds/contract/model_config.py's, the weights spds/model/student.py's."""

from __future__ import annotations


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
