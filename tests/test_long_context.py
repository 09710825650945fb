"""Self-study at the users' shape on CPU: contexts of 4k, 32k and 64k tokens, every kind alone (at
4k) and all mixed (at each length), on a tiny student whose output layer has a published
vocabulary's 151,936 rows for the byte-level tokenizer's 259 ids (the shape at which recitals'
scoring once died with a traceback: a group of short recitals asked for more logits than it had).
Every conversation becomes a row that spds prepare accepts; the padded output rows are never
written."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny

from spds.contract.gate import load_config
from spds.contract.kinds import BUILT_IN_KINDS as KINDS
from spds.data.prepare import prepare
from spds.generation.generate import generate

pytestmark = pytest.mark.slow  # a 64k-token prefix through a causal forward on two CPU cores
PUBLISHED_ROWS = 151_936  # Qwen2.5's and Qwen3's output layer


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = make_tiny.chatml_tokenizer()
    config = Qwen3Config(
        vocab_size=PUBLISHED_ROWS,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=131072,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("long") / "student"
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sheet(tokens: int) -> str:
    lines, i = [], 0
    while sum(map(len, lines)) < tokens:  # byte-level: a character is a token
        lines.append(f"{i}. The ledger of wing {i} lies in drawer {i % 97}, catalogued {1900 + i % 120}.\n")
        i += 1
    return "".join(lines)[:tokens]


def run(directory, student, tokens: int, kinds: dict, conversations: int) -> list[dict]:
    (directory / "context.md").write_text(sheet(tokens))
    config = {
        "student": {"model_path": str(student), "dtype": "float32"},
        "soft_prompt": {"length": 4},
        "context": {"file": "context.md"},
        "data": {"candidates": [{"path": "rows.jsonl"}], "packed_dir": "packed", "eval_fraction": 0.0},
        "generate": {
            "self_study": {
                "conversations": conversations,
                "chunk_tokens": 512,
                "kinds": kinds,
                "question_max_tokens": 8,
            },
            "output": "rows.jsonl",
            "max_new_tokens": 8,
            "batch_size": 6,
            "top_k_logprobs": 4,
        },
        "loss": {"objective": "kl", "teacher": "top_k"},
        "output_dir": "run",
    }
    (directory / "config.json").write_text(json.dumps(config))
    generate(load_config(directory / "config.json", candidates="unread"), log=lambda *_: None)
    manifest = prepare(load_config(directory / "config.json"), log=lambda *_: None)
    rows = [json.loads(line) for line in (directory / "rows.jsonl").read_text().splitlines()]
    assert manifest["records"] == len(rows) == conversations
    assert all(max(row["input_ids"]) < 259 for row in rows)  # no padded output row written
    assert all(max(i for ids in row["top_logprobs"]["ids"] for i in ids) < 259 for row in rows)
    return rows


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_alone_at_4k(tmp_path, student, kind):
    rows = run(tmp_path, student, 4096, {kind: 1}, 6)
    assert {row["self_study"]["kind"] for row in rows} == {kind}


@pytest.mark.parametrize("tokens", [4096, 32768, 65536])
@pytest.mark.over_budget("self-study at 32k and 64k tokens of context: where it once died on its first long context")
def test_every_kind_mixed_at_4k_32k_and_64k(tmp_path, student, tokens):
    kinds = {kind: 1 for kind in KINDS}
    rows = run(tmp_path, student, tokens, kinds, 2 * len(kinds))
    drawn = {row["self_study"]["kind"] for row in rows}  # the plan meets every kind over rounds of the chunks
    assert {"recite", "fact"} <= drawn and len(drawn) >= len(kinds) // 2, drawn
    recited = [row for row in rows if row["self_study"]["kind"] == "recite"]
    assert all(row["supervised_tokens"] > 8 for row in recited)  # a recital is the chunk's own lines, not 8 new tokens
