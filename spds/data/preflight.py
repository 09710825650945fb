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
from spds.data.chat import end_token_ids
from spds.data.prepare import model_vocabulary_rows, scaffold_for
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
        if fixed + config.soft_prompt.length + 1 >= config.data.context_limit:
            problems.append(
                f"data.context_limit: {config.data.context_limit} positions cannot hold the soft prompt "
                f"({config.soft_prompt.length}) and the template's own {fixed} tokens with any answer"
            )
    return problems, scaffold


def require_preflight(config: Config, tokenizer=None):
    """The scaffold prepare will use, or an SpdsError listing every problem prepare would find."""
    problems, scaffold = preflight_problems(config, tokenizer)
    if problems:
        raise SpdsError(f"{config.path}: prepare would refuse this config", problems)
    return scaffold
