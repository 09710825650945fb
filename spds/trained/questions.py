"""eval.questions: what the soft prompt carries on questions training never asked.

Held-out rows of the training set share their questions' kinds with the rows trained on, so they
flatter a prompt: one that learned a persona's style scores there whether or not it learned the
context's facts. A questions file written apart from training (one question per fact of a fact
sheet, say) measures the knowledge:

  * the teacher answers each question with the context, eval.question_samples times, by spds
    generate's own path (same sampling, same rows); the rows are packed by spds prepare's own path
    into a store of their own, every record held out, under
    OUTPUT_DIR/eval-questions/<digest of the file and the teacher's settings>/, so a second eval
    reuses them;
  * spds eval computes their NLL floor / ceiling / soft and gap recovered as for the held-out split;
  * the bare student, the student with the context and the student with the soft prompt answer
    each question greedily (spds sample's path): the share of answers holding the question's
    keyword, and the ROUGE-L F1 of the soft prompt's answers against the context's (and of every
    view against the reference answer where the file gives one), with Google's rouge-score.

A question is a JSON object on one line: question_id and question (strings), and optionally
keyword and answer (strings). Either every question has a keyword or none has: a share over some
of them would read as a share over all.
"""

from __future__ import annotations

import copy
from pathlib import Path

from spds.contract.config import Config
from spds.contract.digests import sha256_path
from spds.data.context import context_digest, share
from spds.fsio import sha256_json
from spds.generation.generate import BATCHING


def teacher_config(config: Config, questions: Path) -> Config:
    """The config that has the teacher answer the eval questions and packs the answers: the run's
    own, with generate reading the questions file and data packing the answers, all held out.
    Its directory is named by a digest of everything that decides the rows."""
    generate = config.raw["generate"]
    decides = dict(
        questions=sha256_path(questions),
        samples=config.eval.question_samples,
        teacher=str(config.teacher_path),
        context=context_digest(config),
        **{k: generate[k] for k in ("temperature", "top_p", "max_new_tokens", "seed", "top_k_logprobs")},
        batches=BATCHING,  # how the teacher's batches are cut decides their samples
    )
    directory = config.output_dir / "eval-questions" / sha256_json(decides)[:16]
    raw = copy.deepcopy(config.raw)
    raw["generate"].update(
        questions=str(questions),
        self_study=None,
        output=str(directory / "teacher.jsonl"),
        samples_per_question=config.eval.question_samples,
    )
    # every record held out (split_of: a hash below 1.0); prepare asks top-k of a row only when
    # training reads its teacher from the rows, which these never feed
    raw["data"].update(
        candidates=[{"path": str(directory / "teacher.jsonl"), "sha256": None}],
        packed_dir=str(directory / "packed"),
        eval_fraction=1.0,
        backup_dir=None,
    )
    raw["loss"] = dict(raw["loss"], objective="ce")
    derived = Config(path=config.path, raw=raw)
    share(derived, config)  # a corpus: the run's slices (cut for its self-study), not cut again without it
    return derived


def answer_scores(questions: list[dict], rows: list[dict]) -> dict:
    """Of the greedy answers (spds.trained.sample's rows, in the questions' order): the share holding the
    keyword per view, and ROUGE-L F1 of soft against context and of each view against the answer."""
    from rouge_score import rouge_scorer  # per use: only eval with eval.questions reads it

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    views = [view for view in ("bare", "context", "soft", "oracle") if rows and rows[0].get(view) is not None]

    def rouge(reference: str, candidate: str) -> float:
        return scorer.score(reference, candidate)["rougeL"].fmeasure

    scores: dict = dict(questions=len(questions))
    if all("keyword" in q for q in questions):
        scores["keyword_share"] = {
            view: sum(q["keyword"].lower() in row[view].lower() for q, row in zip(questions, rows)) / len(rows)
            for view in views
        }
    if "soft" in views and "context" in views:
        scores["rouge_l_soft_vs_context"] = sum(rouge(r["context"], r["soft"]) for r in rows) / len(rows)
    if all("answer" in q for q in questions):
        scores["rouge_l_vs_answer"] = {
            view: sum(rouge(q["answer"], row[view]) for q, row in zip(questions, rows)) / len(rows) for view in views
        }
    return scores
