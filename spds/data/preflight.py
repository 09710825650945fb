"""Check before spending: every check `spds prepare` makes from the config and the tokenizer alone,
made by `spds validate`, `spds init` and `spds generate` (before its first batch), so that no hour
of generation produces rows that prepare then refuses.

What prepare checks per row (each row's ids, its end token, its length) stays prepare's; what
holds for every row is checked here: the chat template's scaffold for the placement (and that it
renders one conversation the same way on any day), the end tokens, that the tokenizer's ids fit
the student's embedding, and that the soft prompt and the template's own tokens fit the context.
"""

from __future__ import annotations

from spds.contract.config import Config
from spds.contract.model_config import POSITION_KEYS
from spds.data.chat import encode_text, end_token_ids, scaffold_for
from spds.data.context import context_prompt_tokens, context_text, corpus_of, corpus_too_short
from spds.data.prepare import model_vocabulary_rows
from spds.data.sources import read_eval_questions, read_questions
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError


def preflight_problems(config: Config, tokenizer=None) -> tuple[list[str], object]:
    """Every problem prepare would find from the config and tokenizer alone, each naming its
    setting; and the scaffold it derived (None when it could not)."""
    try:
        tokenizer = tokenizer or load_tokenizer(config)
    except (OSError, ValueError) as error:
        return [f"student.tokenizer_path: the tokenizer of {config.tokenizer_path} does not load: {error}"], None
    problems = []
    end_ids = []
    try:
        end_ids = end_token_ids(tokenizer, config.data.end_tokens)
    except SpdsError as error:
        problems.append(str(error))
    try:
        scaffold = scaffold_for(config, tokenizer)
    except SpdsError as error:
        problems.append(str(error))
        scaffold = None
    rows = model_vocabulary_rows(config)
    if rows is not None and end_ids and max(end_ids) >= rows:
        problems.append(
            f"data.end_tokens: end token id {max(end_ids)} is beyond the student's {rows} embedding rows "
            "(config.json vocab_size): the tokenizer does not belong to this student"
        )
    if scaffold is not None:
        fixed = (
            len(scaffold.lead) + len(scaffold.system_header) + len(scaffold.system_close) + len(scaffold.user_header)
        )
        limit = config.context_limit
        if limit is not None and fixed + config.soft_prompt.length + 1 >= limit:
            problems.append(
                f"data.context_limit: {limit} positions cannot hold the soft prompt "
                f"({config.soft_prompt.length}) and the template's own {fixed} tokens with any answer"
            )
        problems += window_problems(config, tokenizer, scaffold) + corpus_problems(config)
    return problems, scaffold


def window_problems(config: Config, tokenizer, scaffold) -> list[str]:
    """What the student's position window refuses before any work: a context limit past it, none
    declared at all, and a context it cannot read where it must (the online teacher loss.teacher
    context, and the context view of eval.questions). Each record's own length against the limit
    is prepare's (rows.py); the longest record beside the context, where the student reads them
    together, is checked where the store is known (`require_context_fits`)."""
    window, limit = config.student_window, config.data.context_limit
    if window is None and limit is None:
        return [
            f"data.context_limit: {config.model_path / 'config.json'} declares no position window "
            f"({', '.join(POSITION_KEYS)}): set data.context_limit to the positions the student reads"
        ]
    if window is None:
        return []
    if limit is not None and limit > window.positions:
        return [
            f"data.context_limit: {limit} positions is past the student's window of {window.positions} "
            f"({window.source}): lower it, or leave it null for the window"
        ]
    text = context_text(config)
    online = config.loss.objective != "ce" and config.loss.teacher == "context"
    if not text or not (online or config.eval.questions):
        return []
    prompt = context_prompt_tokens(config, tokenizer, scaffold)
    if prompt < window.positions:
        return []
    return [
        f"{context_source(config)}: the context is {len(encode_text(tokenizer, text))} "
        f"tokens; with the chat template the student reads {prompt} positions before any question, at or past "
        f"its window of {window.positions} ({window.source}), and it reads the context as "
        + ("the online teacher (loss.teacher context)" if online else "eval.questions' context view")
        + ": shorten the context, or use a student with a longer window"
    ]


def context_source(config: Config) -> str:
    if config.context.documents:
        return "context.documents (truncated to the window)" if corpus_of(config).truncates else "context.documents"
    return "context.file" if config.context.file else "context.text"


def require_context_fits(config: Config, context_tokens: int, record_tokens: int, reader: str) -> None:
    """The student reading the context in place of the soft prompt (`reader`: the online teacher,
    eval's ceiling) must hold it and the longest record within its window: past it RoPE gives
    numbers, not an error."""
    window = config.student_window
    if window is not None and context_tokens + record_tokens > window.positions:
        raise SpdsError(
            f"{context_source(config)}: the context is {context_tokens} tokens and the longest record "
            f"{record_tokens}: {reader} reads {context_tokens + record_tokens} positions, past the student's "
            f"window of {window.positions} ({window.source}); shorten the context, or train from an offline "
            "teacher's top-k (loss.teacher top_k, generate.top_k_logprobs)"
        )


def require_preflight(config: Config, tokenizer=None):
    """The scaffold prepare will use, or an SpdsError listing every problem prepare would find."""
    problems, scaffold = preflight_problems(config, tokenizer)
    if problems:
        raise SpdsError(f"{config.path}: prepare would refuse this config", problems)
    return scaffold


def corpus_problems(config: Config) -> list[str]:
    """A corpus's questions naming documents it lacks, and what a corpus past the window cannot
    do (the online teacher reads one context whole). The corpus's own problems (a document that
    breaks a rule, a slice past the window) are the teacher window's (spds/generation/teacher_window.py)."""
    context, problems = config.context, []
    if not context.documents or context.text or context.file:  # two contexts: the contract names them
        return problems
    try:
        corpus = corpus_of(config)
    except (SpdsError, OSError, ValueError):
        return problems  # the corpus's own problems, and a tokenizer that does not load: require_ready names them
    problems += document_problems(config, corpus.ids())
    if config.soft_prompt.init.method == "context" and corpus.tokens < config.soft_prompt.length:
        problems.append(str(corpus_too_short(corpus.tokens, config.soft_prompt.length)))
    if not corpus.truncates:
        return problems
    past = "the corpus passes the teacher's window (context.documents)"
    online = config.loss.teacher == "context" or (config.loss.teacher == "auto" and not config.generate.top_k_logprobs)
    if config.loss.objective != "ce" and online:
        problems.append(
            f"loss.teacher: {config.loss.teacher}: the online teacher reads the context whole, and {past}: train "
            "from the top-k generate writes with each slice (loss.teacher top_k, generate.top_k_logprobs > 0)"
        )
    return problems


def document_problems(config: Config, ids: set[str]) -> list[str]:
    """Questions naming a document (`doc`) the corpus lacks; generate.questions, where the corpus
    passes the window, naming none (its teacher reads the slice holding the question's document)."""

    problems, whole = [], corpus_of(config).whole
    files = [("generate.questions", config.generate.questions, read_questions)]
    files.append(("eval.questions", config.eval.questions, read_eval_questions))
    for key, name, reader in files:
        path = config.resolve(name) if name else None
        if path is None or not path.is_file():
            continue
        try:
            questions = reader(path)
        except SpdsError:
            continue  # the teacher window's checks name the line
        for question in questions:
            doc = question.get("doc")
            if doc is not None and doc not in ids:
                problems.append(
                    f"{key}: {path}: question_id {question['question_id']!r}: doc {doc!r}: rule 'a document of the "
                    "corpus': context.documents holds no document of that id"
                )
            elif doc is None and key == "generate.questions" and not whole:
                problems.append(
                    f"{key}: {path}: question_id {question['question_id']!r} names no doc, and the corpus passes the "
                    "teacher's window: give each question the doc holding its answer (its teacher reads that "
                    "document's slice), or let self-study ask (generate.self_study)"
                )
    return problems
