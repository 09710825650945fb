"""Chat templates as published (tests/fixtures/templates): where the soft prompt lands in each,
written out by hand, and the refusals that name what works instead."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny

from spds.data.chat import clock_at, derive_scaffold, render
from spds.data.rows import RowRules, place
from spds.errors import SpdsError

FIXTURES = Path(__file__).parent / "fixtures" / "templates"
TEMPLATES = {k: v for k, v in json.loads((FIXTURES / "templates.json").read_text()).items() if not k.startswith("_")}
P = "⟨P⟩"  # where the soft prompt goes, in the expectations below


def fixture_tokenizer(name: str, template: str | None = None):
    """A byte-level tokenizer with the family's special tokens and its published chat template."""
    entry = TEMPLATES[name]
    text = template or (make_tiny.CHATML_TEMPLATE if entry["file"] is None else (FIXTURES / entry["file"]).read_text())
    roles = {f"{role}_token": entry[role] for role in ("bos", "eos", "pad") if entry.get(role)}
    return make_tiny.byte_level_tokenizer(entry["specials"], text, **roles)


def end_token(tokenizer, name: str) -> int:
    """What ends an assistant turn in the family's template."""
    turn_end = {"gemma-2": "<end_of_turn>", "gemma-3": "<end_of_turn>", "phi-3.5": "<|end|>", "phi-4-mini": "<|end|>"}
    return tokenizer.convert_tokens_to_ids(turn_end.get(name, tokenizer.eos_token))


QUESTION = [{"role": "user", "content": "Tell me about the comet."}]

# The whole student input, the soft prompt at P, for a conversation of one question and its answer
# "It glows." (a token row as a teacher writes it: the generation prompt, the answer, the turn end).
EXPECTED = {
    ("chatml", "system"): "<|im_start|>system\n⟨P⟩<|im_end|>\n<|im_start|>user\nTell me about the comet.<|im_end|>\n"
    "<|im_start|>assistant\nIt glows.<|im_end|>",
    ("chatml", "first_user"): "<|im_start|>user\n⟨P⟩Tell me about the comet.<|im_end|>\n<|im_start|>assistant\n"
    "It glows.<|im_end|>",
    ("qwen2.5", "system"): "<|im_start|>system\n⟨P⟩You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\nTell me about the comet.<|im_end|>\n"
    "<|im_start|>assistant\nIt glows.<|im_end|>",
    ("qwen2.5", "system", "empty"): "<|im_start|>system\n⟨P⟩<|im_end|>\n<|im_start|>user\nTell me about the comet."
    "<|im_end|>\n<|im_start|>assistant\nIt glows.<|im_end|>",
    ("qwen2.5", "first_user"): "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\n⟨P⟩Tell me about the comet.<|im_end|>\n"
    "<|im_start|>assistant\nIt glows.<|im_end|>",
    ("smollm2", "system"): "<|im_start|>system\n⟨P⟩You are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nTell me about the comet.<|im_end|>\n"
    "<|im_start|>assistant\nIt glows.<|im_end|>",
    ("smollm2", "system", "empty"): "<|im_start|>system\n⟨P⟩<|im_end|>\n<|im_start|>user\nTell me about the comet."
    "<|im_end|>\n<|im_start|>assistant\nIt glows.<|im_end|>",
    ("smollm2", "first_user"): "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\n⟨P⟩Tell me about the comet.<|im_end|>\n"
    "<|im_start|>assistant\nIt glows.<|im_end|>",
    ("qwen3", "system"): "<|im_start|>system\n⟨P⟩<|im_end|>\n<|im_start|>user\nTell me about the comet.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nIt glows.<|im_end|>",
    ("qwen3", "first_user"): "<|im_start|>user\n⟨P⟩Tell me about the comet.<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\nIt glows.<|im_end|>",
    ("llama-3.2", "system"): "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
    "December 2023\nToday Date: 26 Jul 2024\n\n⟨P⟩<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nTell me about the comet.<|eot_id|><|start_header_id|>assistant"
    "<|end_header_id|>\n\nIt glows.<|eot_id|>",
    ("llama-3.2", "first_user"): "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge "
    "Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\n⟨P⟩Tell me about the comet.<|eot_id|><|start_header_id|>"
    "assistant<|end_header_id|>\n\nIt glows.<|eot_id|>",
    ("gemma-2", "first_user"): "<bos><start_of_turn>user\n⟨P⟩Tell me about the comet.<end_of_turn>\n<start_of_turn>"
    "model\nIt glows.<end_of_turn>",
    ("gemma-3", "first_user"): "<bos><start_of_turn>user\n⟨P⟩Tell me about the comet.<end_of_turn>\n<start_of_turn>"
    "model\nIt glows.<end_of_turn>",
    ("mistral-v0.3", "first_user"): "<s>[INST] ⟨P⟩Tell me about the comet.[/INST]It glows.</s>",
    ("phi-3.5", "system"): "<|system|>\n⟨P⟩<|end|>\n<|user|>\nTell me about the comet.<|end|>\n<|assistant|>\n"
    "It glows.<|end|>",
    ("phi-3.5", "first_user"): "<|user|>\n⟨P⟩Tell me about the comet.<|end|>\n<|assistant|>\nIt glows.<|end|>",
    ("phi-4-mini", "system"): "<|system|>⟨P⟩<|end|><|user|>Tell me about the comet.<|end|><|assistant|>"
    "It glows.<|end|>",
    ("phi-4-mini", "first_user"): "<|user|>⟨P⟩Tell me about the comet.<|end|><|assistant|>It glows.<|end|>",
    ("deepseek-r1-distill", "system"): "<｜begin▁of▁sentence｜>⟨P⟩<｜User｜>Tell me about the comet.<｜Assistant｜>"
    "<think>\nIt glows.<｜end▁of▁sentence｜>",
    ("deepseek-r1-distill", "first_user"): "<｜begin▁of▁sentence｜><｜User｜>⟨P⟩Tell me about the comet.<｜Assistant｜>"
    "<think>\nIt glows.<｜end▁of▁sentence｜>",
}
CASES = [
    (name, placement) for name, entry in TEMPLATES.items() for placement in entry["placements"] if placement != "prefix"
]


def placed_text(name: str, placement: str, missing_system: str = "template") -> str:
    tokenizer = fixture_tokenizer(name)
    kwargs = TEMPLATES[name].get("kwargs", {})
    prompt = render(tokenizer, QUESTION, True, kwargs)
    ids = np.asarray(prompt + tokenizer.encode("It glows.", add_special_tokens=False) + [end_token(tokenizer, name)])
    scaffold = derive_scaffold(tokenizer, kwargs, missing_system, TEMPLATES[name]["model"])
    rules = RowRules(
        scaffold=scaffold,
        placement=placement,
        end_ids=frozenset(),
        vocab_size=len(tokenizer),
        prompt_length=4,
        context_limit=4096,
        template_kwargs=kwargs,
    )
    placed, prefix, at, _ = place(ids, len(prompt), rules)
    assert tokenizer.decode(placed[prefix:].tolist()) == "It glows." + tokenizer.decode([end_token(tokenizer, name)])
    return tokenizer.decode(placed[:at].tolist()) + P + tokenizer.decode(placed[at:].tolist())


def test_every_fixture_and_placement_has_a_hand_written_expectation():
    assert {case[:2] for case in EXPECTED} == set(CASES)


@pytest.mark.parametrize("name,placement", CASES)
def test_the_soft_prompt_lands_where_the_published_template_puts_it(name, placement):
    assert placed_text(name, placement) == EXPECTED[(name, placement)]


@pytest.mark.parametrize("name", ["qwen2.5", "smollm2"])
def test_missing_system_empty_replaces_the_templates_default_system_prompt(name):
    assert placed_text(name, "system", "empty") == EXPECTED[(name, "system", "empty")]


@pytest.mark.parametrize("name", [n for n, e in TEMPLATES.items() if "system" not in e["placements"]])
def test_placement_system_is_refused_for_a_template_without_a_system_message(name):
    tokenizer = fixture_tokenizer(name)
    scaffold = derive_scaffold(tokenizer, {}, model=TEMPLATES[name]["model"])
    assert scaffold.system_role == TEMPLATES[name]["system_role"]
    problem = scaffold.system_problem("system", TEMPLATES[name]["model"])
    assert TEMPLATES[name]["model"] in problem and "'first_user'" in problem and "'prefix'" in problem


def test_each_fixture_is_recognised_as_the_kind_of_template_it_is():
    for name, entry in TEMPLATES.items():
        scaffold = derive_scaffold(fixture_tokenizer(name), entry.get("kwargs", {}), model=entry["model"])
        assert scaffold.system_role == entry["system_role"], name


def test_a_template_that_writes_todays_date_is_refused_until_the_date_is_pinned():
    """Llama 3.x renders strftime_now("%d %b %Y") into every system block: rows rendered on two
    days differ. Pinned through date_string, two days give the same ids."""
    tokenizer = fixture_tokenizer("llama-3.2")
    with pytest.raises(SpdsError, match="today's date.*data.chat_template_kwargs.date_string"):
        derive_scaffold(tokenizer, {}, model="meta-llama/Llama-3.2-1B-Instruct")
    pinned = {"date_string": "26 Jul 2024"}
    renderings = []
    for day in (datetime.datetime(2025, 1, 1), datetime.datetime(2026, 12, 1)):
        with clock_at(day):
            renderings.append(render(tokenizer, QUESTION, True, pinned))
    assert renderings[0] == renderings[1]
    with clock_at(datetime.datetime(2026, 12, 1)):
        assert "01 Dec 2026" in tokenizer.decode(render(tokenizer, QUESTION, True, {}))  # the clock really moved


def test_a_template_that_renders_one_conversation_two_ways_is_refused():
    """A stand-in for a template with state between calls (Jinja's own state is per rendering): a
    tokenizer whose every rendering ends in one more token."""

    class Drifting:
        def __init__(self, tokenizer):
            self.tokenizer, self.calls, self.chat_template = tokenizer, 0, tokenizer.chat_template

        def apply_chat_template(self, *args, **kwargs):
            self.calls += 1
            return self.tokenizer.apply_chat_template(*args, **kwargs) + [self.tokenizer.eos_token_id] * self.calls

        def decode(self, ids):
            return self.tokenizer.decode(ids)

    with pytest.raises(SpdsError, match="renders one conversation two ways"):
        derive_scaffold(Drifting(fixture_tokenizer("chatml")), {})


# Every template with every placement it allows, each on its own decoder family (prefix is the same
# for all: twice, once on OLMo 2, which has no template here), split in two for the two workers.
LOOP_CASES = [f"{name}:{placement}" for name, placement in CASES] + ["chatml:prefix:olmo2", "gemma-2:prefix"]


@pytest.mark.slow
@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.over_budget("every published chat template through the whole loop")
def test_the_whole_loop_runs_for_every_template_and_placement(tmp_path, half):
    """prepare -> smoke -> train -> eval -> export -> an answer -> sample, on a tiny student with
    each family's tokenizer; the prompt in the packed rows sits where the expectations above say."""
    import math
    import subprocess
    import sys

    from helpers import environment

    cases = LOOP_CASES[half::2]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "template_runs.py"), str(tmp_path), *cases],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for case in cases:
        name, placement = case.split(":")[:2]
        result = results[case]
        assert "error" not in result, f"{case}:\n{result['error']}"
        expected = (
            ""
            if placement == "prefix"
            else EXPECTED[(name, placement)].split(P)[0].replace("Tell me about the comet.", "")
        )
        assert result["placed_prefix"] == expected, case
        assert result["smoke"] == "complete" and result["train"] == "complete", case
        assert all(math.isfinite(result["nll"][k]) for k in ("floor", "soft", "ceiling")), case
        assert isinstance(result["answer"], str), case
        assert len(result["samples"]) == 2 and all(row["context"] is not None for row in result["samples"]), case
        assert (
            result["counts"][
                {"system": "existing_system", "first_user": "first_user_placement", "prefix": "prefix_placement"}[
                    placement
                ]
            ]
            or result["counts"]["added_empty_system"]
        )


def save_fixture_student(directory: Path, name: str) -> Path:
    from test_families import save_family

    tokenizer = fixture_tokenizer(name)
    save_family(
        directory,
        TEMPLATES[name]["family"],
        len(tokenizer),
        end_token(tokenizer, name),
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_init_picks_what_the_template_allows_and_validate_refuses_what_prepare_would(tmp_path):
    """spds init on a dated template (Llama 3.2) pins today's date and keeps placement system; on
    Gemma 3 it chooses first_user. spds validate refuses placement system on Gemma 3, and an
    unpinned dated template, with what prepare would say, before any work."""
    import yaml
    from helpers import check, spds

    for name in ("llama-3.2", "gemma-3"):
        save_fixture_student(tmp_path / name, name)
    (tmp_path / "rows.jsonl").write_text("")
    check(spds(["init", "llama-3.2", "rows.jsonl", "--out", "llama.yaml"], tmp_path))
    written = yaml.safe_load((tmp_path / "llama.yaml").read_text())
    assert written["soft_prompt"]["placement"] == "system"
    assert written["data"]["chat_template_kwargs"] == {"date_string": datetime.date.today().strftime("%d %b %Y")}
    check(spds(["init", "gemma-3", "rows.jsonl", "--out", "gemma.yaml"], tmp_path))
    assert yaml.safe_load((tmp_path / "gemma.yaml").read_text())["soft_prompt"]["placement"] == "first_user"
    config = yaml.safe_load((tmp_path / "gemma.yaml").read_text())
    config["soft_prompt"]["placement"] = "system"
    (tmp_path / "gemma-system.yaml").write_text(yaml.safe_dump(config))
    refused = spds(["validate", "gemma-system.yaml"], tmp_path)
    # the model named as the config names it, the feature, and the placements that work
    assert refused.returncode == 1 and "the chat template of gemma-3 has no system message of its own" in refused.stderr
    assert "'first_user'" in refused.stderr and "'prefix'" in refused.stderr
    written["data"]["chat_template_kwargs"] = {}
    (tmp_path / "llama-unpinned.yaml").write_text(yaml.safe_dump(written))
    refused = spds(["validate", "llama-unpinned.yaml"], tmp_path)
    assert refused.returncode == 1 and "today's date" in refused.stderr and "date_string" in refused.stderr


def test_the_teacher_sees_the_context_where_the_prompt_goes():
    """spds generate: the context as the system message where the template has one; ahead of the
    first user turn's text for first_user and for a template that refuses a system message."""
    from spds.data.chat import with_context

    messages = [{"role": "user", "content": "Tell me about the comet."}]
    tokenizer = fixture_tokenizer("gemma-2")
    folded = tokenizer.decode(render(tokenizer, with_context(messages, "Be brief.", True), True, {}))
    assert folded == (
        "<bos><start_of_turn>user\nBe brief.\n\nTell me about the comet.<end_of_turn>\n<start_of_turn>model\n"
    )
    tokenizer = fixture_tokenizer("chatml")
    system = tokenizer.decode(render(tokenizer, with_context(messages, "Be brief.", False), True, {}))
    assert system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me")


@pytest.mark.parametrize("name", [n for n in TEMPLATES if not n.startswith("_")])
@pytest.mark.parametrize("in_user_turn", [False, True])
def test_the_shared_prefix_of_generates_prompts_ends_where_the_question_begins(name, in_user_turn):
    """spds generate shares the keys and values of one fixed prefix across all its batches (the
    same on every rank): everything before the question's own text, the context included, in
    every published template and in both places the context goes."""
    from spds.generation.generate import Asking

    tokenizer = fixture_tokenizer(name)
    kwargs = {"date_string": "26 Jul 2024"} if name.startswith("llama") else {}
    in_user_turn = in_user_turn or derive_scaffold(tokenizer, kwargs, model=name).system_role == "none"
    asking = Asking(None, tokenizer, "The archive opens at nine.", in_user_turn, None, kwargs)
    prompt = asking.prompt(QUESTION)
    assert "The archive opens at nine." in tokenizer.decode(prompt[: asking.context_end]), name
    assert tokenizer.decode(prompt[asking.context_end :]).lstrip().startswith("Tell me about the comet."), name


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "llama-3.2"])
def test_the_sample_question_line_shows_the_users_words_not_the_default_system_text(name):
    """spds sample / eval print a held-out record's question: from the packed prompt, the text of
    the last user turn alone, whatever default system text or header the published template
    renders before it."""
    from spds.trained.sample import asked_text

    tokenizer = fixture_tokenizer(name)
    kwargs = {"date_string": "26 Jul 2024"} if name.startswith("llama") else {}
    scaffold = derive_scaffold(tokenizer, kwargs, model=name)
    ids = render(tokenizer, QUESTION, True, kwargs)
    at = len(scaffold.lead) + len(scaffold.system_header)
    manifest = {"scaffold": scaffold.to_json(), "end_token_ids": [end_token(tokenizer, name)]}
    assert asked_text(tokenizer, ids, at, manifest) == "Tell me about the comet."
