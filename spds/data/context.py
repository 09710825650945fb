"""The context a config names, as every verb reads it: context.text, context.file's text, or a
corpus (context.documents, spds/data/corpus.py) indexed and cut into slices for the teacher's
window. Where something reads the context whole (eval's context view and ceiling, the online
teacher, soft_prompt.init context, sample), a corpus past the window is read truncated to it
(`context_text`). The slices' budget is the window's arithmetic: the chat template's tokens, the
longest question, the longest answer (`slice_budget`), which spds/generation/teacher_window.py
checks too.
"""

from __future__ import annotations

import hashlib

from spds.contract import documents
from spds.contract.config import Config
from spds.contract.kinds import RECITE  # a recital's answer: up to a chunk (the longest answer)
from spds.data.chat import encode_text, render, scaffold_for, with_context
from spds.data.corpus import SEPARATOR, Corpus, as_written
from spds.data.sources import read_eval_questions, read_questions
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError
from spds.fsio import read_text

CACHED = "_spds_corpus"  # where a config keeps its corpus once read: every user of it reads the same slices


def corpus_of(config: Config, tokenizer=None) -> Corpus | None:
    """context.documents indexed and sliced for the teacher's window, read once per config; None
    without one."""
    if not config.context.documents:
        return None
    if CACHED not in config.__dict__:
        tokenizer = tokenizer or load_tokenizer(config)
        scaffold = scaffold_for(config, tokenizer)
        window = slice_budget(config, tokenizer, scaffold, chosen=False)
        config.__dict__[CACHED] = Corpus.build(config, tokenizer, slice_budget(config, tokenizer, scaffold), window)
    return config.__dict__[CACHED]


def share(derived: Config, config: Config) -> None:
    """A config derived from another (eval's teacher config) reads the other's slices, not its own cut."""
    if config.context.documents:
        derived.__dict__[CACHED] = corpus_of(config)


def context_text(config: Config) -> str | None:
    """The system prompt being distilled: context.text, context.file's text, or a corpus (whole
    where it fits the teacher's window, else truncated to it), read once per config."""
    if "_spds_context" not in config.__dict__:
        if config.context.documents:
            text = corpus_of(config).truncated
        else:
            # a file's text as a corpus's is read: no byte-order mark, LF line ends
            text = (
                as_written(read_text(config.resolve(config.context.file)), 0)
                if config.context.file
                else config.context.text
            )
        config.__dict__["_spds_context"] = text
    return config.__dict__["_spds_context"]


def init_ids(config: Config, tokenizer, length: int) -> list[int]:
    """The `length` tokens a prompt started from the context (soft_prompt.init.method context)
    is computed from: the context's first tokens, repeated where a context.text or file is
    shorter; a corpus's first tokens (Cartridges' choice), or with init.spread the first tokens of
    every slice in turn, about length / slices each (a short slice's share taken by the others).
    A corpus of fewer tokens is refused (validate refuses it first: `corpus_problems`)."""
    corpus = corpus_of(config, tokenizer)
    if corpus is None or corpus.whole:
        ids = encode_text(tokenizer, context_text(config) or "")
        if not ids:
            raise SpdsError("soft_prompt.init.method 'context' needs context.text, context.file or context.documents")
        return (ids * -(-length // len(ids)))[:length]
    if not config.soft_prompt.init.spread:
        ids: list[int] = []
        for text in corpus.slice_texts():  # the corpus in order, a slice at a time, until the prompt is full
            ids += encode_text(tokenizer, text if not ids else SEPARATOR + text)
            if len(ids) >= length:
                return ids[:length]
        raise corpus_too_short(len(ids), length)
    per_slice = [encode_text(tokenizer, text) for text in corpus.slice_texts()]
    shares = [0] * len(per_slice)
    left = length
    for rank, index in enumerate(sorted(range(len(per_slice)), key=lambda i: len(per_slice[i]))):  # water-filling
        shares[index] = min(len(per_slice[index]), -(-left // (len(per_slice) - rank)))
        left -= shares[index]
    if left > 0:
        raise corpus_too_short(length - left, length)
    return [token for ids, share in zip(per_slice, shares) for token in ids[:share]]


def corpus_too_short(tokens: int, length: int) -> SpdsError:
    return SpdsError(
        f"soft_prompt.init: method context computes the prompt's {length} positions from the corpus's tokens, "
        f"and the corpus (context.documents) holds {tokens}: rule 'enough context to start from': lower "
        "soft_prompt.length, or choose init.method random_normal"
    )


def context_digest(config: Config) -> str:
    """The context's sha256: of its text, or a corpus's (its files and description, and the
    budget its slices were cut to)."""
    if not config.context.documents:
        return hashlib.sha256((context_text(config) or "").encode()).hexdigest()
    return hashlib.sha256(f"{documents.sha256(config)} {corpus_of(config).budget}".encode()).hexdigest()


def slice_budget(config: Config, tokenizer, scaffold, chosen: bool = True) -> int | None:
    """The most tokens of a corpus one teacher reads: generate.self_study.slice_tokens (`chosen`),
    else what the teacher's window leaves after the chat template, the longest question and the
    longest answer (None where no window is declared: the corpus is read whole, and validate
    names the missing window)."""
    study = config.generate.self_study
    if chosen and study is not None and study.slice_tokens is not None:
        return study.slice_tokens
    window, asked = config.teacher_window, longest_question(config, tokenizer)
    if window is None:
        return None
    question, answer, _ = asked or (0, config.generate.max_new_tokens, "")
    return window.positions - context_prompt_tokens(config, tokenizer, scaffold, text="") - question - answer


def context_prompt_tokens(config: Config, tokenizer, scaffold, text: str | None = None) -> int:
    """The tokens of the chat template holding the context (or `text`) where the prompt goes and
    an empty user turn: what a model reads with the context before any question's own tokens."""
    in_user_turn = config.soft_prompt.placement == "first_user" or scaffold.system_role == "none"
    context = context_text(config) if text is None else text
    asked = with_context([{"role": "user", "content": ""}], context, in_user_turn)
    return len(render(tokenizer, asked, True, config.data.chat_template_kwargs))


def longest_question(config: Config, tokenizer) -> tuple[int, int, str] | None:
    """The teacher's longest question (its tokens past an empty user turn's), the longest answer
    it may write and the setting that bounds it; None where it answers nothing. A questions file
    that does not read raises the SpdsError generate and eval would, naming the line."""
    settings, kwargs = config.generate, config.data.chat_template_kwargs
    empty = len(render(tokenizer, [{"role": "user", "content": ""}], True, kwargs))
    answer, bound = settings.max_new_tokens, "generate.max_new_tokens"
    lengths = []
    study = settings.self_study
    if study is not None:
        lengths.append(study.question_max_tokens)
        if RECITE in study.kinds and study.chunk_tokens + 1 > answer:  # a recital: up to a chunk, then its end
            answer, bound = study.chunk_tokens + 1, "generate.self_study.chunk_tokens and its end token"
    if settings.questions is not None:
        questions = read_questions(config.resolve(settings.questions))
        lengths += [len(render(tokenizer, q["messages"], True, kwargs)) - empty for q in questions]
        turns = max((sum(m["role"] == "user" for m in q["messages"]) for q in questions), default=1)
        if turns > 1:  # every earlier answer stands in the conversation of the last turn
            answer, bound = answer * turns, f"{turns} user turns x {bound}"
    if config.eval.questions is not None:
        asked = read_eval_questions(config.resolve(config.eval.questions))
        user = [[{"role": "user", "content": q["question"]}] for q in asked]
        lengths += [len(render(tokenizer, messages, True, kwargs)) - empty for messages in user]
    return (max(lengths), answer, bound) if lengths else None
