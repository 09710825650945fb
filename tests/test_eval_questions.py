"""eval.questions: the soft prompt measured on questions training never asked."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import edit_config, make_tiny
from helpers import FAST, ROUNDING, check, final_state, read_json, spds

from spds.data.packed import PackedStore
from spds.data.sources import read_eval_questions
from spds.errors import SpdsError

QUESTIONS = [
    {"question_id": "keeper", "question": "Who keeps the lighthouse?", "keyword": "keeper"},
    {"question_id": "comet", "question": "When does the comet return?", "keyword": "comet"},
    {"question_id": "bay", "question": "What is Lumen Bay?", "keyword": "a"},
]


@pytest.mark.slow
def test_question_figures_equal_a_plain_transformers_recomputation(tiny):
    """The teacher's answers to the questions (generate's rows, packed all held out) scored under
    the three students by plain transformers forwards over the packed ids, the prompt or the
    context spliced at the record's insertion point; the keyword share and ROUGE-L recomputed from
    the answers eval.json reports."""
    from rouge_score import rouge_scorer
    from transformers import AutoModelForCausalLM

    (tiny / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    edit_config(
        tiny,
        **{**FAST, "optim": {**FAST["optim"], "updates": 2}},
        student={"dtype": "float32"},
        context={"text": make_tiny.CONTEXT},
        generate={"max_new_tokens": 8, "temperature": 0.8},
        eval={"questions": "questions.jsonl", "question_samples": 2, "max_new_tokens": 6, "samples": 0},
    )
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    shown = check(spds(["eval", "config.json"], tiny)).stdout
    assert "eval.questions: 3 questions training never asked" in shown and "Q: Who keeps the lighthouse?" in shown
    report = read_json(tiny / "run" / "eval.json")
    asked = report["questions"]
    (store_dir,) = (tiny / "run" / "eval-questions").iterdir()
    store = PackedStore.open(store_dir / "packed")
    assert asked["records"] == 6 and not store.is_train.any()  # 3 questions x 2 samples, all held out
    student = json.loads((tiny / "config.json").read_text())["student"]["model_path"]
    plain = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    embed = plain.get_input_embeddings()
    context = torch.tensor(make_tiny.chatml_tokenizer().encode(make_tiny.CONTEXT, add_special_tokens=False))
    blocks = {"floor": torch.zeros(0, plain.config.hidden_size), "soft": final_state(tiny / "run")["prompt"]}
    blocks["ceiling"] = embed(context)
    sums, tokens = dict.fromkeys(blocks, 0.0), 0
    with torch.no_grad():
        for i in range(len(store.is_train)):
            ids = torch.from_numpy(store.ids(i))
            prefix, at = int(store.prefix_tokens[i]), int(store.insert_at[i])
            tokens += len(ids) - prefix
            for name, block in blocks.items():
                joined = torch.cat([embed(ids[:at]), block, embed(ids[at:])])[None]
                logits = plain(inputs_embeds=joined).logits[0, len(block) + prefix - 1 : -1]
                sums[name] += float(torch.nn.functional.cross_entropy(logits, ids[prefix:], reduction="sum"))
    assert asked["supervised_tokens"] == tokens
    for name in blocks:  # sums of non-negative terms: rounding relative to the sum
        assert asked["nll"][name] == pytest.approx(sums[name] / tokens, rel=ROUNDING), name
    floor, soft, ceiling = (asked["nll"][k] for k in ("floor", "soft", "ceiling"))
    assert asked["gap_recovered"] == pytest.approx((floor - soft) / (floor - ceiling))
    answers = asked["answers"]
    assert [a["question_id"] for a in answers] == [q["question_id"] for q in QUESTIONS]
    for view in ("bare", "context", "soft"):
        held = np.mean([q["keyword"].lower() in a[view].lower() for q, a in zip(QUESTIONS, answers)])
        assert asked["keyword_share"][view] == pytest.approx(held)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rouge = np.mean([scorer.score(a["context"], a["soft"])["rougeL"].fmeasure for a in answers])
    assert asked["rouge_l_soft_vs_context"] == pytest.approx(rouge)
    assert "Who keeps the lighthouse?" in (tiny / "run" / "samples.md").read_text()
    # A second eval reuses the teacher's answers (nothing regenerated) and reports the same.
    again = check(spds(["eval", "config.json"], tiny))
    assert "wrote 0 rows (6 were already there)" in again.stdout
    assert read_json(tiny / "run" / "eval.json")["questions"]["nll"] == asked["nll"]


def without_timings(report: dict) -> dict:
    """eval.json less what depends on the clock or the number of ranks, not on the numbers."""
    timings = ("seconds", "tokens_per_second", "world_size", "phases")
    report = {k: v for k, v in report.items() if k not in timings}
    if report.get("questions"):
        report["questions"] = {k: v for k, v in report["questions"].items() if k not in timings}
    return report


@pytest.mark.parametrize(
    ("lines", "rule"),
    [
        (
            ['{"question_id": "a", "question": "Why?", "keyword": "x"}', '{"question_id": "b", "question": "How?"}'],
            r"questions.jsonl:2: question_id 'b' has no keyword, and line 1 has one",
        ),
        (['{"question_id": "a", "question": "Why?"}', '{"question_id": "a", "question": "How?"}'], "unique"),
        (['{"question_id": "a"}'], r"questions.jsonl:1: rule 'fields': a question needs question"),
        (['{"question_id": "a", "question": "Why?", "keyword": ""}'], "keyword must be a non-empty string"),
        (["[1, 2]"], "a question is a JSON object"),
        (["{nope"], r"questions.jsonl:1: not a JSON object"),
        ([], "holds no questions"),
    ],
)
def test_a_bad_questions_file_is_refused_naming_line_and_rule(tmp_path, lines, rule):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(SpdsError, match=rule):
        read_eval_questions(path)
