"""The system scaffold is derived from the chat template, never hard-coded."""

from __future__ import annotations

from conftest import make_tiny

from spds.data.chat import derive_scaffold, render, render_chat_row


def test_chatml_scaffold():
    tokenizer = make_tiny.chatml_tokenizer()
    scaffold = derive_scaffold(tokenizer)
    assert scaffold.lead == []
    assert tokenizer.decode(scaffold.system_header) == "<|im_start|>system\n"
    assert tokenizer.decode(scaffold.system_close) == "<|im_end|>\n"
    assert tokenizer.decode(scaffold.user_header) == "<|im_start|>user\n"


def test_llama3_scaffold_keeps_the_begin_of_text_lead():
    tokenizer = make_tiny.llama3_tokenizer()
    scaffold = derive_scaffold(tokenizer)
    assert tokenizer.decode(scaffold.lead) == "<|begin_of_text|>"
    assert tokenizer.decode(scaffold.system_header) == "<|start_header_id|>system<|end_header_id|>\n\n"
    assert tokenizer.decode(scaffold.system_close) == "<|eot_id|>"
    conversation = [{"role": "user", "content": "hi"}]
    plain = render(tokenizer, conversation, True, {})
    with_empty = render(tokenizer, [{"role": "system", "content": ""}, *conversation], True, {})
    assert with_empty == scaffold.lead + scaffold.system_header + scaffold.system_close + plain[len(scaffold.lead) :]


def test_a_template_with_a_default_system_prompt_keeps_it_for_the_soft_prompt_to_precede():
    tokenizer = make_tiny.chatml_tokenizer(make_tiny.DEFAULT_SYSTEM_TEMPLATE)
    scaffold = derive_scaffold(tokenizer)
    assert scaffold.system_role == "always" and tokenizer.decode(scaffold.default_system) == "You are helpful."
    assert tokenizer.decode(scaffold.system_header) == "<|im_start|>system\n"


def test_chat_form_renders_like_the_template():
    tokenizer = make_tiny.chatml_tokenizer()
    messages = [{"role": "user", "content": "Why?"}]
    ids, prefix, spans = render_chat_row(tokenizer, messages, "Because.", [tokenizer.eos_token_id], {})
    assert spans is None  # one assistant turn: one run, to the end
    assert ids[:prefix] == render(tokenizer, messages, True, {})
    assert tokenizer.decode(ids[prefix:]) == "Because.<|im_end|>"
