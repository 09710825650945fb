"""Conversations with several assistant turns: every assistant turn is trained, and the loss
counts exactly the supervised tokens. References: the labels themselves (-100 elsewhere) and a
plain transformers forward, no spds code."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import edit_config, make_tiny
from helpers import FAST, assert_matches_reference, check, spds

from spds.contract.gate import load_config, section
from spds.data.chat import render
from spds.data.packed import PackedStore
from spds.model.loss import make_loss
from spds.model.soft_prompt import Segment, SoftPromptModel
from spds.model.student import load_student

CONVERSATION = [
    {"role": "user", "content": "Where is the comet?"},
    {"role": "assistant", "content": "Far away."},
    {"role": "user", "content": "And the harbor?"},
]
FINAL = "By the sea. Archived."


def two_turn_token_row(tokenizer, request_id: str) -> dict:
    """A token row as a trainer of multi-turn data writes it: labels -100 but on the assistant turns."""
    first = render(tokenizer, CONVERSATION[:1], True, {})
    answer = tokenizer.encode("Far away.", add_special_tokens=False) + [tokenizer.eos_token_id]
    second = render(tokenizer, CONVERSATION, True, {})[len(first) + len(answer) :]  # "\n<|im_start|>user..."
    final = tokenizer.encode(FINAL, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = first + answer + second + final
    labels = [-100] * len(first) + answer + [-100] * len(second) + final
    return dict(
        request_id=request_id,
        question_id=request_id,
        sample_index=0,
        input_ids=ids,
        prefix_tokens=len(first),
        labels=labels,
        supervised_tokens=len(answer) + len(final),
        response_sha256=hashlib.sha256(FINAL.encode()).hexdigest(),
    )


def test_every_assistant_turn_is_packed_as_a_supervised_run(tiny):
    tokenizer = make_tiny.chatml_tokenizer()
    rows = [
        two_turn_token_row(tokenizer, "t0"),
        dict(request_id="c0", question_id="c0", sample_index=0, messages=CONVERSATION, response=FINAL),
    ]
    (tiny / "turns.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    edit_config(tiny, **FAST, data={"candidates": [{"path": "turns.jsonl"}], "packed_dir": "packed-turns"})
    check(spds(["prepare", "config.json"], tiny))
    store = PackedStore.open(tiny / "packed-turns")
    for i, row in enumerate(rows):
        ids = store.ids(i)
        supervised = "".join(tokenizer.decode(ids[s:e].tolist()) for s, e in store.spans[i])
        assert supervised == "Far away.<|im_end|>By the sea. Archived.<|im_end|>", row["request_id"]
        assert int(store.supervised_tokens[i]) == sum(e - s for s, e in store.spans[i])
        assert tokenizer.decode(ids[: int(store.insert_at[i])].tolist()) == "<|im_start|>system\n"
    # the chat row renders to the token row's ids, once the empty system message is in both
    assert store.ids(0).tolist() == store.ids(1).tolist() and store.spans[0] == store.spans[1]


@pytest.mark.parametrize(
    "labels,rule",
    [
        (lambda r: r["labels"].__setitem__(len(r["labels"]) - 3, 7), "labels must be -100 or the input_id"),
        (lambda r: r.__setitem__("supervised_tokens", r["supervised_tokens"] + 1), "supervised_tokens consistent"),
    ],
)
def test_a_multi_turn_row_whose_labels_do_not_hold_is_refused(tiny, labels, rule):
    row = two_turn_token_row(make_tiny.chatml_tokenizer(), "t0")
    labels(row)
    (tiny / "turns.jsonl").write_text(json.dumps(row) + "\n")
    edit_config(tiny, data={"candidates": [{"path": "turns.jsonl"}], "packed_dir": "packed-turns"})
    result = spds(["prepare", "config.json"], tiny)
    assert result.returncode == 1 and "turns.jsonl:1: request_id t0" in result.stderr and rule in result.stderr


def test_an_assistant_turn_that_does_not_end_its_turn_is_refused(tiny):
    tokenizer = make_tiny.chatml_tokenizer()
    row = two_turn_token_row(tokenizer, "t0")
    first_end = row["labels"].index(tokenizer.eos_token_id)
    row["labels"][first_end] = -100  # the first run now stops before its <|im_end|>
    row["supervised_tokens"] -= 1
    (tiny / "turns.jsonl").write_text(json.dumps(row) + "\n")
    edit_config(tiny, data={"candidates": [{"path": "turns.jsonl"}], "packed_dir": "packed-turns"})
    result = spds(["prepare", "config.json"], tiny)
    assert result.returncode == 1 and "rule 'ends with end-of-turn'" in result.stderr
    assert "the supervised run at" in result.stderr


@pytest.mark.numeric
@pytest.mark.parametrize("packed", [False, True])
def test_the_loss_counts_exactly_the_supervised_tokens_of_every_turn(tiny_assets, packed):
    """spds's loss and prompt gradient over two multi-turn records and one single-turn record
    equal CE over the positions whose labels are not -100, from a plain transformers forward."""
    from transformers import AutoModelForCausalLM

    tokenizer = make_tiny.chatml_tokenizer()
    row = two_turn_token_row(tokenizer, "t0")
    ids = torch.tensor(row["input_ids"])
    labels = torch.tensor(row["labels"])
    supervised = (labels != -100).numpy()
    edges = np.flatnonzero(np.diff(np.concatenate([[0], supervised.astype(np.int8), [0]])))
    spans = tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))
    segments = [
        Segment(ids=ids, prefix_tokens=row["prefix_tokens"], insert_at=0, spans=spans),
        Segment(ids=ids, prefix_tokens=row["prefix_tokens"], insert_at=3, spans=spans),
        Segment(ids=ids[: spans[0][1]], prefix_tokens=row["prefix_tokens"], insert_at=3),
    ]
    student = load_student(tiny_assets / "student", "float32", "sdpa", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(tiny_assets / "student", dtype=torch.float32).requires_grad_(False)
    prompt = torch.randn(4, student.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.3
    model = SoftPromptModel(
        student, prompt.clone(), make_loss(section("loss", kernel="chunked")), attention_kernel="math", packed=packed
    )

    def labelled_loss(reference):
        """CE over the positions whose labels are not -100, the prompt's positions unsupervised."""
        total = 0
        for segment in segments:
            embeddings = plain.get_input_embeddings()(segment.ids)
            a = segment.insert_at
            logits = plain(inputs_embeds=torch.cat([embeddings[:a], reference, embeddings[a:]])[None]).logits[0]
            own = (
                labels[: len(segment.ids)].clone()
                if segment.spans
                else torch.cat([torch.full((segment.prefix_tokens,), -100), segment.ids[segment.prefix_tokens :]])
            )
            spliced = torch.cat([own[:a], torch.full((4,), -100), own[a:]])
            total = total + torch.nn.functional.cross_entropy(logits[:-1], spliced[1:], reduction="sum")
        return total

    assert sum(s.supervised_tokens for s in segments) == 2 * int(supervised.sum()) + spans[0][1] - spans[0][0]
    assert_matches_reference(model, segments, labelled_loss, prompt)


@pytest.mark.slow
def test_a_multi_turn_run_trains_and_resumes_from_what_it_packed(tiny):
    """smoke and train over conversations with two assistant turns each, with the context teacher
    (kl): the packed runs reach the loss, the token counts of every update add up."""
    tokenizer = make_tiny.chatml_tokenizer()
    rows = [two_turn_token_row(tokenizer, f"t{i}") for i in range(8)]
    (tiny / "turns.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    edit_config(
        tiny,
        **{**FAST, "optim": {**FAST["optim"], "updates": 2, "effective_batch": 4}},
        data={"candidates": [{"path": "turns.jsonl"}], "packed_dir": "packed-turns"},
        loss={"objective": "mix", "reuse_context_kv": True},
        context={"text": make_tiny.CONTEXT},
    )
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    lines = [json.loads(line) for line in (tiny / "run" / "metrics.jsonl").read_text().splitlines()]
    store = PackedStore.open(load_config(tiny / "config.json").packed_dir)
    assert [m["supervised_tokens"] for m in lines] == [4 * int(store.supervised_tokens[0])] * 2


@pytest.mark.slow
def test_generate_answers_a_conversation_turn_by_turn(tiny_assets, tmp_path):
    """A question of two user turns: the teacher answers the first, then the second with its first
    answer in the conversation. Greedy, so plain transformers decoding the teacher's own prompt
    (the context as system message, the first answer as text) gives the same second answer; the
    row supervises both answers and prepare packs it as two runs."""
    import shutil

    from transformers import AutoModelForCausalLM

    for name in ("student", "loop.json", "questions.jsonl"):
        source = tiny_assets / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    (tmp_path / "questions.jsonl").write_text(
        json.dumps(
            {
                "question_id": "two",
                "messages": [
                    {"role": "user", "content": "Where is the comet?"},
                    {"role": "user", "content": "And the harbor?"},
                ],
            }
        )
        + "\n"
    )
    config = json.loads((tmp_path / "loop.json").read_text())
    config["generate"].update(samples_per_question=1, temperature=0.0, max_new_tokens=12)
    config["data"]["eval_fraction"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    check(spds(["generate", "config.json"], tmp_path))
    (row,) = [json.loads(line) for line in (tmp_path / "generated.jsonl").read_text().splitlines()]
    tokenizer = make_tiny.chatml_tokenizer()
    labels = np.array(row["labels"])
    runs = np.flatnonzero(np.diff(np.concatenate([[0], (labels != -100).astype(np.int8), [0]])))
    assert len(runs) == 4, "two supervised runs: the two answers"
    first, second = (row["input_ids"][s:e] for s, e in zip(runs[0::2], runs[1::2]))
    text = tokenizer.decode(row["input_ids"])
    assert text.startswith("<|im_start|>user\nWhere is the comet?<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\nAnd the harbor?<|im_end|>\n<|im_start|>assistant\n" in text
    assert "Lumen Bay" not in text  # the student's view has no context
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "student", dtype=torch.bfloat16)
    prompt = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": make_tiny.CONTEXT},
            {"role": "user", "content": "Where is the comet?"},
            {"role": "assistant", "content": tokenizer.decode(first[:-1])},
            {"role": "user", "content": "And the harbor?"},
        ],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    with torch.no_grad():
        output = teacher.generate(
            input_ids=torch.tensor([list(prompt)]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    expected = output[0, len(prompt) :].tolist()
    if tokenizer.eos_token_id in expected:
        assert second == expected[: expected.index(tokenizer.eos_token_id) + 1]
    else:  # cut at max_new_tokens: spds closes the turn with an end token of its own
        assert second[:-1] == expected and second[-1] in tokenizer.convert_tokens_to_ids(make_tiny.CHATML_SPECIALS)
    check(spds(["prepare", "config.json"], tmp_path))
    store = PackedStore.open(tmp_path / "loop-packed")
    assert len(store.spans[0]) == 2 and int(store.supervised_tokens[0]) == len(first) + len(second)
