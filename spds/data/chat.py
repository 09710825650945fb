"""Where the soft prompt goes, derived from the tokenizer's own chat template as published.

No token id and no template is hard-coded. spds renders probe conversations and compares them
in token ids: two renderings that differ only in one message's content show exactly where that
content goes. From the system message's and the user message's, and a conversation without a
system message, it learns

    lead            what every rendering starts with before any turn (Llama-3's
                    <|begin_of_text|>, Gemma's <bos>; often nothing)
    system_header   what precedes a system message's content (ChatML "<|im_start|>system\\n";
                    Llama-3.x's header and its "Cutting Knowledge Date ... Today Date ..." preamble)
    system_close    what follows it, up to the first user turn
    user_header     what precedes a user turn's content
    default_system  the content a conversation *without* a system message is rendered with
                    (Qwen2.5's "You are Qwen, created by Alibaba Cloud. ...", SmolLM2's; empty for
                    Llama-3.x, whose block is always there)

and what kind of system message the template has (`system_role`):

    optional      rendered only when given (ChatML, Qwen3, Phi, DeepSeek-R1): where a row has
                  none, an empty one is inserted for the soft prompt to stand in
    always        rendered whether given or not, with default_system when not (Qwen2.5,
                  SmolLM2, Llama-3.x)
    in_user_turn  no block of its own: the text is folded into a user turn (Gemma 3, Mistral
                  v0.3), so placement "system" would not be a system message at all
    none          a system message is an error (Gemma 2)

A template whose rendering depends on the day (Llama-3.x's strftime_now) or that renders one
conversation two ways is refused, naming the setting that pins it: the same rows must give the
same ids whenever they are prepared. (Over 300 lines: the probes, the scaffold they derive and its
refusals are one derivation, read in one place.)
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

from spds.errors import SpdsError

PROBE = "scaffold-check"
SENTINELS = ("XYZZY sentinel", "PLUGH marker")  # two contents: where renderings differ is where content goes
ASSISTANT = "noted"
# Turn ends of the mainstream templates (ChatML, Llama-3, Gemma, Phi, DeepSeek, Mistral's </s> is eos).
KNOWN_END_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<｜end▁of▁sentence｜>",
)
SYSTEM_ROLES = ("optional", "always", "in_user_turn", "none")
MISSING_SYSTEM = ("template", "empty")


@dataclass(frozen=True)
class Scaffold:
    lead: list[int]
    system_header: list[int]
    system_close: list[int]
    user_header: list[int]
    default_system: list[int] = field(default_factory=list)
    system_role: str = "optional"
    missing_system: str = "template"  # what the student sees for a row without a system message

    def to_json(self) -> dict:
        return asdict(self)

    def system_problem(self, placement: str, model: str) -> str | None:
        """Why `placement` cannot work with this template, naming what does; None if it can."""
        if placement != "system" or self.system_role in ("optional", "always"):
            return None
        what = (
            "has no system role (a system message raises an error)"
            if self.system_role == "none"
            else "has no system message of its own: it folds the system text into a user turn"
        )
        return (
            f"soft_prompt.placement: 'system' needs a system message, and the chat template of {model} {what}; "
            "use placement 'first_user' (the start of the first user turn's content) or 'prefix' (before the "
            "first token)"
        )


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> list[int]:
    """The conversation's token ids as the chat template renders them, the messages' text always
    tokenized as text: a control token's string inside a message (a document that quotes
    "<|im_start|>system") stays those characters, never the template's role boundary. Where no
    message holds one, this is exactly apply_chat_template's tokenization."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    if not any(holds_added_token(tokenizer, text) for text in texts):
        ids = _apply(tokenizer, messages, add_generation_prompt, template_kwargs, tokenize=True)
        return [int(i) for i in ids]
    return _render_protected(tokenizer, messages, add_generation_prompt, template_kwargs)


def _apply(tokenizer, messages, add_generation_prompt, kwargs, tokenize: bool):
    from jinja2.exceptions import SecurityError  # transformers renders in jinja's sandbox

    try:
        # transformers 5 returns a BatchEncoding unless return_dict=False: compare plain lists.
        return tokenizer.apply_chat_template(
            messages,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **kwargs,
        )
    except SecurityError as error:
        raise SpdsError(
            f"the chat template of {tokenizer.name_or_path} (chat_template.jinja or tokenizer_config.json) "
            f"reaches outside jinja's sandbox ({error}): rule 'sandboxed template': a template renders "
            "messages and nothing else; fix or replace it"
        ) from None


def added_token_strings(tokenizer) -> list[str]:
    """The strings the tokenizer turns into added ids (its special and control tokens), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    known = getattr(tokenizer, "_spds_added_strings", None)
    if known is None or known[0] != len(added):  # read once per tokenizer, again if tokens were added
        known = (len(added), sorted({t.content for t in added.values() if t.content}, key=len, reverse=True))
        tokenizer._spds_added_strings = known
    return known[1]


def holds_added_token(tokenizer, text: str) -> bool:
    return any(token in text for token in added_token_strings(tokenizer))


def encode_text(tokenizer, text: str) -> list[int]:
    """User text (a context, a question, a response) as text: the ids its characters get, with no
    control token made of a string it happens to hold. Exactly tokenizer.encode where it holds
    none; where it does, the ordinary stretches are encoded as usual and each such string by the
    tokenizer's model alone (its added vocabulary left out), so it is read as the characters it is."""
    if not holds_added_token(tokenizer, text):
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    ids, rest = [], text
    while rest:
        at, token = min(((rest.find(t), t) for t in added_token_strings(tokenizer) if t in rest), default=(-1, ""))
        if at < 0:
            ids += tokenizer.encode(rest, add_special_tokens=False, split_special_tokens=True)
            break
        if at:
            ids += tokenizer.encode(rest[:at], add_special_tokens=False, split_special_tokens=True)
        ids += _model_ids(tokenizer, token)
        rest = rest[at + len(token) :]
    return [int(i) for i in ids]


def _model_ids(tokenizer, text: str) -> list[int]:
    """`text` through the fast tokenizer's normalizer, pre-tokenizer and model: no added vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise SpdsError(
            f"the tokenizer of {tokenizer.name_or_path} is not a fast tokenizer: spds cannot read {text!r} in user "
            "text as ordinary characters (rule 'user text stays text'); use the model's tokenizer.json"
        )
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
    pieces = backend.pre_tokenizer.pre_tokenize_str(normalized) if backend.pre_tokenizer else [(normalized, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


PLACEHOLDER = "\ue000spds-content-{}\ue001"  # private-use characters: no template writes them
PLACEHOLDERS = re.compile(re.escape(PLACEHOLDER).replace(re.escape("{}"), "(\\d+)"))  # k in group 1


def _render_protected(tokenizer, messages, add_generation_prompt, template_kwargs) -> list[int]:
    """Render with each message's text replaced by a placeholder, to learn which characters of the
    real rendering are the template's; those are tokenized as the template wrote them, the
    messages' text by encode_text."""
    stand_ins = [
        dict(m, content=PLACEHOLDER.format(k)) if isinstance(m.get("content"), str) else m
        for k, m in enumerate(messages)
    ]
    shape = _apply(tokenizer, stand_ins, add_generation_prompt, template_kwargs, tokenize=False)
    real = _apply(tokenizer, messages, add_generation_prompt, template_kwargs, tokenize=False)
    parts = PLACEHOLDERS.split(shape)  # template, k, template, k, ..., template
    ids, at = [], 0
    for n in range(0, len(parts), 2):
        template = parts[n]
        if not real.startswith(template, at):
            raise _transformed(tokenizer)
        ids += tokenizer.encode(template, add_special_tokens=False) if template else []
        at += len(template)
        if n + 1 == len(parts):
            break
        content, following = messages[int(parts[n + 1])]["content"], parts[n + 2]
        for text in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if real.startswith(text + following, at):
                ids += encode_text(tokenizer, text)
                at += len(text)
                break
        else:
            raise _transformed(tokenizer)
    if at != len(real):
        raise _transformed(tokenizer)
    return [int(i) for i in ids]


def _transformed(tokenizer) -> SpdsError:
    return SpdsError(
        f"a message holds a control token's string ({', '.join(added_token_strings(tokenizer)[:3])}, ...) and the "
        f"chat template of {tokenizer.name_or_path} changes message text beyond trimming it, so spds cannot tell "
        "the message's characters from the template's: rule 'user text stays text'"
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    while n < min(len(a), len(b), limit) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def _show(tokenizer, ids: list[int]) -> str:
    return json.dumps(tokenizer.decode(ids))


def content_span(tokenizer, conversation, kwargs: dict) -> tuple[list[int], int, int]:
    """(a rendering, tokens before, tokens after) the content that `conversation(text)` varies."""
    a, b = (render(tokenizer, conversation(text), True, kwargs) for text in SENTINELS)
    before = _common_prefix(a, b)
    after = _common_suffix(a, b, min(len(a), len(b)) - before)
    if before + after >= len(a):
        raise SpdsError(f"the chat template renders two different message contents identically: {_show(tokenizer, a)}")
    return a, before, after


@contextlib.contextmanager
def clock_at(day: datetime.datetime):
    """transformers' strftime_now (the template global that reads today's date) as of `day`: to see
    whether a template's rendering depends on the day it is rendered."""
    from transformers.utils import chat_template_utils

    real = chat_template_utils.datetime

    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return day

    chat_template_utils.datetime = Fixed
    try:
        yield
    finally:
        chat_template_utils.datetime = real


def stability_problem(tokenizer, kwargs: dict, model: str) -> str | None:
    """Renders one conversation on two days, and twice on one: the same ids each time, or why not."""
    conversation = [{"role": "user", "content": PROBE}]
    with clock_at(datetime.datetime(2001, 2, 3)):
        first, again = (render(tokenizer, conversation, True, kwargs) for _ in range(2))
    with clock_at(datetime.datetime(2002, 11, 12)):
        other_day = render(tokenizer, conversation, True, kwargs)
    if first != again:
        return (
            f"the chat template of {model} renders one conversation two ways ({_show(tokenizer, first)}, then "
            f"{_show(tokenizer, again)}): rows would not give the same ids twice"
        )
    if first != other_day:
        source = tokenizer.chat_template or ""
        pin = (
            'set data.chat_template_kwargs.date_string (for example "26 Jul 2024", the day your rows were '
            "rendered with)"
            if "date_string" in source
            else "pin it through data.chat_template_kwargs (the variable the template reads instead of today's date)"
        )
        return (
            f"the chat template of {model} writes today's date into every conversation (strftime_now), so rows "
            f"rendered on another day get other token ids ({_show(tokenizer, first)} on one day, "
            f"{_show(tokenizer, other_day)} on another): {pin}"
        )
    return None


def derive_scaffold(
    tokenizer, template_kwargs: dict | None = None, missing_system: str = "template", model: str = "the student"
) -> Scaffold:
    kwargs = template_kwargs or {}
    if not getattr(tokenizer, "chat_template", None):
        raise SpdsError(
            f"the tokenizer of {model} has no chat template: spds needs one to find where the soft "
            "prompt goes (placement 'prefix' needs none; set it, or give the tokenizer a template)"
        )
    problem = stability_problem(tokenizer, kwargs, model)
    if problem:
        raise SpdsError(problem)
    turns = UserTurns.rendered(tokenizer, kwargs)
    try:
        system, before, after = content_span(
            tokenizer, lambda text: [{"role": "system", "content": text}, {"role": "user", "content": PROBE}], kwargs
        )
    except SpdsError:
        raise
    except Exception as error:  # the template refuses a system message (Gemma 2 raises)
        lead, user_header = turns.first_user_turn()
        if not user_header:
            raise SpdsError(
                f"the chat template of {model} refuses a system message ({type(error).__name__}: "
                f"{error}) and its user turns cannot be told apart: {_show(tokenizer, turns.user)}; use "
                "placement 'prefix'"
            ) from None
        return Scaffold(lead, [], [], user_header, system_role="none", missing_system=missing_system)
    prefix, tail, plain = system[:before], system[len(system) - after :], turns.plain
    if before == turns.user_before and prefix == turns.user[:before]:  # the system text goes where the user's does
        lead, user_header = turns.first_user_turn()
        return Scaffold(lead, [], [], user_header, system_role="in_user_turn", missing_system=missing_system)
    if plain[:before] == prefix and plain[len(plain) - after :] == tail and len(plain) >= before + after:
        return _always_a_system_block(turns, prefix, after, missing_system)
    return _a_system_block_when_given(tokenizer, turns, system, before, after, missing_system, model)


@dataclass(frozen=True)
class UserTurns:
    """The probe renderings derive_scaffold compares, without a system message: one user turn with
    the generation prompt (plain); a user turn and where its content starts (user, user_before);
    a second user turn after an assistant turn (second, second_before), whose header is what opens
    a user turn whatever precedes it."""

    plain: list[int]
    user: list[int]
    user_before: int
    second: list[int]
    second_before: int

    @classmethod
    def rendered(cls, tokenizer, kwargs: dict) -> UserTurns:
        plain = render(tokenizer, [{"role": "user", "content": PROBE}], True, kwargs)
        user, user_before, _ = content_span(tokenizer, lambda text: [{"role": "user", "content": text}], kwargs)
        second, second_before, _ = content_span(
            tokenizer,
            lambda text: [
                {"role": "user", "content": PROBE},
                {"role": "assistant", "content": ASSISTANT},
                {"role": "user", "content": text},
            ],
            kwargs,
        )
        return cls(plain, user, user_before, second, second_before)

    def first_user_turn(self) -> tuple[list[int], list[int]]:
        """(lead, user header) of a template without a system block: the header is what opens a
        user turn after an assistant turn too; what precedes it in the first turn is the lead."""
        opening, second_opening = self.user[: self.user_before], self.second[: self.second_before]
        start = self.user_before - _common_suffix(opening, second_opening, self.user_before)
        return opening[:start], opening[start:]


def _always_a_system_block(turns: UserTurns, prefix: list[int], after: int, missing_system: str) -> Scaffold:
    """A system block whether given or not: a conversation without one gets the template's default."""
    before, plain = len(prefix), turns.plain
    default = plain[before : len(plain) - after]
    opening = turns.user[before + len(default) : turns.user_before]  # the system block's close, then the user header
    header_length = _common_suffix(opening, turns.second[: turns.second_before], len(opening))
    return Scaffold(
        lead=[],
        system_header=prefix,
        system_close=opening[: len(opening) - header_length],
        user_header=opening[len(opening) - header_length :],
        default_system=default,
        system_role="always",
        missing_system=missing_system,
    )


def _a_system_block_when_given(
    tokenizer, turns: UserTurns, system: list[int], before: int, after: int, missing_system: str, model: str
) -> Scaffold:
    """A block only when given: with it = lead + block + the rest, the shortest such lead."""
    plain = turns.plain
    lead_length = next(
        (
            k
            for k in range(min(before, len(plain)) + 1)
            if system[:k] == plain[:k] and system[len(system) - (len(plain) - k) :] == plain[k:]
        ),
        None,
    )
    if lead_length is None:
        raise SpdsError(
            f"the chat template of {model} renders a system message neither as a block of its own nor in "
            f"a user turn: without one {_show(tokenizer, plain)}, with one {_show(tokenizer, system)}; "
            "use placement 'prefix'"
        )
    block_end = len(system) - (len(plain) - lead_length)
    user_header = plain[lead_length : turns.user_before]
    if not user_header:
        raise SpdsError(f"cannot find the user-turn header in {_show(tokenizer, plain)}")
    return Scaffold(
        lead=plain[:lead_length],
        system_header=system[lead_length:before],
        system_close=system[len(system) - after : block_end],
        user_header=user_header,
        system_role="optional",
        missing_system=missing_system,
    )


def end_token_ids(tokenizer, configured: list[str] | None) -> list[int]:
    """Ids a response may end with: the configured tokens, or the tokenizer's eos plus known ones."""
    vocab = tokenizer.get_vocab()
    if configured is not None:
        missing = [t for t in configured if t not in vocab]
        if missing:
            raise SpdsError(f"data.end_tokens: {missing} not in the tokenizer's vocabulary")
        return sorted({vocab[t] for t in configured})
    ids = {vocab[t] for t in KNOWN_END_TOKENS if t in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise SpdsError("the tokenizer has no eos token: set data.end_tokens")
    return sorted(ids)


def tokenizer_identity(tokenizer) -> str:
    """Digest of what decides token ids: the tokenizer's full definition and its chat template."""
    fast = getattr(tokenizer, "backend_tokenizer", None)
    backend = fast.to_str() if fast else repr(tokenizer.get_vocab())
    payload = json.dumps([backend, tokenizer.chat_template, tokenizer.eos_token], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def render_chat_row(
    tokenizer, messages: list[dict], response: str, end_ids: list[int], template_kwargs: dict
) -> tuple[list[int], int, tuple | None]:
    """Token ids, prefix length and supervised runs of a chat-form row, exactly as the chat
    template renders them: every assistant turn (those in `messages` and the final `response`)
    is supervised, from the end of its generation prompt to its first end-of-turn token; the runs
    are None for one turn. A reasoning template (DeepSeek-R1's) opens its generation prompt with
    a thought ("<think>\n") that its rendering of a finished assistant turn drops: there a
    one-turn row is the generation prompt, the response's tokens as the teacher emitted them
    after it, and the template's turn end."""
    opening = next((m.get("role") for m in messages if m.get("role") != "system"), None)
    if opening == "assistant":
        raise ValueError(
            "rule 'conversation start': the conversation opens with an assistant turn; it starts with a "
            "system or user turn (the assistant answers a user)"
        )
    conversation = [*messages, {"role": "assistant", "content": response}]
    turns = [k for k, message in enumerate(conversation) if message.get("role") == "assistant"]
    full = render(tokenizer, conversation, False, template_kwargs)
    ends = set(end_ids)
    spans = []
    for k in turns:
        opening = render(tokenizer, conversation[:k], True, template_kwargs)
        if full[: len(opening)] != opening:
            if len(turns) == 1:
                return _reasoning_row(tokenizer, messages, response, opening, full, ends, template_kwargs)
            raise ValueError(
                f"chat template renders assistant turn {len(spans) + 1} differently from its generation "
                f"prompt (prompt {_show(tokenizer, opening)}, conversation {_show(tokenizer, full)}): "
                "give this conversation as a token row"
            )
        end = next((i for i in range(len(opening), len(full)) if full[i] in ends), None)
        if end is None or end == len(opening):
            raise ValueError(f"rendered assistant turn {len(spans) + 1} has no end-of-turn token or is empty")
        spans.append((len(opening), end + 1))
    return full[: spans[-1][1]], spans[0][0], (tuple(spans) if len(spans) > 1 else None)


def _reasoning_row(tokenizer, messages, response, prompt, full, ends, template_kwargs):
    before = render(tokenizer, messages, False, template_kwargs)  # the conversation so far, no opening
    end = next((t for t in full[len(before) :] if t in ends), None)
    if full[: len(before)] != before or prompt[: len(before)] != before or end is None:
        raise ValueError(
            "chat template renders the assistant turn differently from the generation prompt "
            f"(prompt {_show(tokenizer, prompt)}, conversation {_show(tokenizer, full)})"
        )
    return prompt + encode_text(tokenizer, response) + [end], len(prompt), None


def with_context(messages: list[dict], context: str, in_user_turn: bool) -> list[dict]:
    """The teacher's conversation: the context as its system message, or ahead of the first user
    turn's text."""
    if not in_user_turn:
        return [{"role": "system", "content": context}, *messages]
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise SpdsError("a question's messages hold no user turn for the context to precede")
    return [
        *messages[:first],
        dict(messages[first], content=f"{context}\n\n{messages[first]['content']}"),
        *messages[first + 1 :],
    ]


def prompt_header(scaffold: Scaffold, placement: str, tokenizer, template_kwargs: dict) -> list[int]:
    """The chat template's tokens before the soft prompt in a record that opens with the user's
    turn (spds/data/rows.py's `place`): none for prefix, the lead and the system header for system,
    up to the first user turn's content for first_user. Where a kv prompt's starting keys and values
    are computed (their positions follow it)."""
    if placement == "prefix":
        return []
    if placement == "system":
        return scaffold.lead + scaffold.system_header
    ids = render(tokenizer, [{"role": "user", "content": "Q"}], True, template_kwargs)
    user = scaffold.user_header
    at = next((i for i in range(len(scaffold.lead), len(ids) - len(user) + 1) if ids[i : i + len(user)] == user), None)
    if at is None:
        raise SpdsError("the chat template renders no user turn header where the soft prompt goes (first_user)")
    return ids[: at + len(user)]


def scaffold_for(config, tokenizer) -> Scaffold:
    """Where the soft prompt goes for this config's placement and the student's chat template, or
    an SpdsError naming what cannot work and the setting that does (spds/data/chat.py)."""
    data, placement = config.data, config.soft_prompt.placement
    model = config.student.tokenizer_path or config.student.model_path
    if placement == "prefix":  # before the first token: no system message, no template needed
        problem = tokenizer.chat_template and stability_problem(tokenizer, data.chat_template_kwargs, model)
        if problem:
            raise SpdsError(problem)
        try:
            return derive_scaffold(tokenizer, data.chat_template_kwargs, data.missing_system, model)
        except SpdsError:
            return Scaffold(lead=[], system_header=[], system_close=[], user_header=[], system_role="none")
    scaffold = derive_scaffold(tokenizer, data.chat_template_kwargs, data.missing_system, model)
    problem = scaffold.system_problem(placement, model)
    if problem:
        raise SpdsError(problem)
    return scaffold
