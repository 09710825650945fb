"""The teacher's window, checked before any work: what the teacher reads to answer a question
(the chat template holding the context, the question, the answer it may write) must lie within
the positions its config.json declares (spds/contract/model_config.py). Past them every model spds
runs gives numbers, not an error: a 32k-token context on an 8k-window teacher would write rows
from positions it was never trained on. spds validate, init, generate and eval (with
eval.questions, which the teacher answers) run `require_ready`: everything prepare would refuse
(spds/data/preflight.py) and this.
"""

from __future__ import annotations

from spds.contract.config import Config
from spds.contract.documents import CorpusError
from spds.data.chat import encode_text
from spds.data.context import context_prompt_tokens, context_text, corpus_of, longest_question
from spds.data.preflight import context_source, preflight_problems
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError


def slice_problems(config: Config, tokenizer, scaffold) -> list[str]:
    """A slice setting past the window; a corpus that does not read (each of its problems)."""
    study, window = config.generate.self_study, config.teacher_window
    try:
        asked = longest_question(config, tokenizer)
    except SpdsError:
        asked = None  # teacher_window_problems names the file
    if study is not None and study.slice_tokens is not None and window is not None and asked is not None:
        question, answer, bound = asked
        need = context_prompt_tokens(config, tokenizer, scaffold, text="") + study.slice_tokens + question + answer
        if need > window.positions:
            return [
                f"generate.self_study.slice_tokens: {study.slice_tokens} tokens of the corpus with the chat template, "
                f"the longest question ({question} tokens) and the longest answer ({answer}: {bound}) are {need} "
                f"positions, past the teacher's window of {window.positions} ({window.source}): lower it, or leave it "
                "null for what the window leaves"
            ]
    try:
        corpus = corpus_of(config)
    except CorpusError as error:
        return error.problems or [str(error)]
    if corpus.budget is not None and corpus.budget < 16:
        return [
            f"context.documents: the teacher's window leaves {corpus.budget} tokens for the corpus after the chat "
            "template, the longest question and the longest answer: shorten them"
        ]
    # self-study cuts the corpus into chunks; several slices take a short one as one chunk
    # (spds/generation/self_study.py Slices.read), a corpus of one slice is the context
    if study is not None and len(corpus.slices) == 1 and study.chunk_tokens > corpus.slices[0].tokens:
        return [
            f"generate.self_study.chunk_tokens: {study.chunk_tokens} is more than the corpus's "
            f"{corpus.slices[0].tokens} tokens: a chunk is a part of the corpus; lower it"
        ]
    return []


def teacher_window_problems(config: Config, tokenizer, scaffold) -> list[str]:
    """A context whose template, longest question and longest answer pass the teacher's window; a
    self-study chunk longer than the context. A corpus: its slices are cut to fit (`slice_problems`)."""
    if config.context.documents:
        return slice_problems(config, tokenizer, scaffold)
    text = context_text(config)
    if not text or not (config.generate.questions or config.generate.self_study or config.eval.questions):
        return []
    problems = []
    context_tokens = len(encode_text(tokenizer, text))
    study = config.generate.self_study
    if study is not None and study.chunk_tokens > context_tokens:
        problems.append(
            f"generate.self_study.chunk_tokens: {study.chunk_tokens} is more than the context's "
            f"{context_tokens} tokens ({context_source(config)}): a chunk is a part of the context; lower it"
        )
    try:  # the questions files, read as generate and eval read them: what validate passes, they take
        window, asked = config.teacher_window, longest_question(config, tokenizer)
    except SpdsError as error:
        return problems + [str(error)]
    if window is None or asked is None:
        return problems  # no window declared: the student's rule names it
    question, answer, bound = asked
    need = context_prompt_tokens(config, tokenizer, scaffold) + question + answer
    if need > window.positions:
        problems.append(
            f"{context_source(config)}: the context is {context_tokens} tokens; with the chat template, the "
            f"longest question ({question} tokens) and the longest answer ({answer}: {bound}) the teacher reads "
            f"{need} positions, past its window of {window.positions} ({window.source}): shorten the context or "
            "the answers, or use a teacher with a longer window (generate.teacher_path)"
        )
    return problems


def require_ready(config: Config, tokenizer=None):
    """The scaffold prepare will use, or an SpdsError listing every problem prepare would find and
    every position past the teacher's window."""
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(config)
        except (OSError, ValueError):
            pass  # preflight names it
    problems, scaffold = preflight_problems(config, tokenizer)
    if scaffold is not None:
        problems += teacher_window_problems(config, tokenizer, scaffold)
    if problems:
        raise SpdsError(f"{config.path}: this config would be refused before any work", problems)
    return scaffold
