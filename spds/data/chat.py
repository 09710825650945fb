"""The system-message scaffold, derived from the tokenizer's own chat template.

No token id is hard-coded. Rendering a probe conversation with and without an empty system
message tells us, in token ids:

    lead            tokens every rendering starts with (Llama-3's <|begin_of_text|>; often none)
    system_header   the opening of a system message (ChatML: "<|im_start|>system\\n")
    system_close    what ends it                     (ChatML: "<|im_end|>\\n")
    user_header     the opening of a user turn

and we insist that  render([empty system] + conv) == lead + system_header + system_close +
render(conv)[len(lead):]. A template for which that does not hold (one that injects a default
system prompt, say) is refused: inserting a system message would then change the student's
input in ways the teacher never saw.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ..fsio import SpdsError

PROBE = "scaffold-check"
SENTINEL = "XYZZY sentinel"
KNOWN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


@dataclass(frozen=True)
class Scaffold:
    lead: list[int]
    system_header: list[int]
    system_close: list[int]
    user_header: list[int]

    def to_json(self) -> dict:
        return asdict(self)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> list[int]:
    # transformers 5 returns a BatchEncoding unless return_dict=False: compare plain lists.
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=False, **template_kwargs)
    return [int(i) for i in ids]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _show(tokenizer, ids: list[int]) -> str:
    return json.dumps(tokenizer.decode(ids))


def derive_scaffold(tokenizer, template_kwargs: dict | None = None) -> Scaffold:
    kwargs = template_kwargs or {}
    if not getattr(tokenizer, "chat_template", None):
        raise SpdsError("the tokenizer has no chat template: spds needs one to find the system message scaffold")
    user = [{"role": "user", "content": PROBE}]
    plain = render(tokenizer, user, True, kwargs)
    with_empty = render(tokenizer, [{"role": "system", "content": ""}, *user], True, kwargs)
    # The shortest lead such that with_empty = lead + S + plain[lead:] for some system message S.
    lead_length = next((k for k in range(len(plain) + 1)
                        if with_empty[:k] == plain[:k] and len(with_empty) > len(plain)
                        and with_empty[len(with_empty) - (len(plain) - k):] == plain[k:]), None)
    if lead_length is None:
        raise SpdsError("the chat template does not render an empty system message as a block inserted before the "
                        f"conversation: without it {_show(tokenizer, plain)}, with it {_show(tokenizer, with_empty)}")
    lead = plain[:lead_length]
    system_block = with_empty[lead_length:len(with_empty) - (len(plain) - lead_length)]

    with_text = render(tokenizer, [{"role": "system", "content": SENTINEL}, *user], True, kwargs)
    header_length = _common_prefix(system_block, with_text[lead_length:])
    header, close = system_block[:header_length], system_block[header_length:]
    tail = close + plain[lead_length:]
    content_ok = (with_text[:lead_length + header_length] == lead + header
                  and len(with_text) > len(lead + header + tail)
                  and with_text[len(with_text) - len(tail):] == tail)
    if not header or not close or not content_ok:
        raise SpdsError("cannot split the chat template's system message into header and closing tokens: empty "
                        f"system renders {_show(tokenizer, system_block)}, a system text renders "
                        f"{_show(tokenizer, with_text)}")

    other_user = render(tokenizer, [{"role": "user", "content": SENTINEL}], True, kwargs)
    user_header = plain[lead_length:lead_length + _common_prefix(plain[lead_length:], other_user[lead_length:])]
    if not user_header:
        raise SpdsError(f"cannot find the user-turn header in {_show(tokenizer, plain)}")
    return Scaffold(lead=lead, system_header=header, system_close=close, user_header=user_header)


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


def render_chat_row(tokenizer, messages: list[dict], response: str, end_ids: list[int],
                    template_kwargs: dict) -> tuple[list[int], int]:
    """Token ids and prefix length of a chat-form row, exactly as the chat template renders them.

    The response is rendered as the assistant turn that follows the generation prompt; the ids
    end at the first end-of-turn token after the prompt (what the teacher emitted last)."""
    prompt = render(tokenizer, messages, True, template_kwargs)
    full = render(tokenizer, [*messages, {"role": "assistant", "content": response}], False, template_kwargs)
    if full[:len(prompt)] != prompt:
        raise ValueError("chat template renders the assistant turn differently from the generation prompt "
                         f"(prompt {_show(tokenizer, prompt)}, conversation {_show(tokenizer, full)})")
    ends = set(end_ids)
    end = next((i for i in range(len(prompt), len(full)) if full[i] in ends), None)
    if end is None or end == len(prompt):
        raise ValueError("rendered response has no end-of-turn token or is empty")
    return full[:end + 1], len(prompt)
