"""Self-study (generate.self_study): questions the teacher writes from the context itself."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import pytest
from conftest import edit_config, make_tiny
from helpers import check, spds
from test_templates import TEMPLATES, fixture_tokenizer

from spds.data.chat import render
from spds.errors import SpdsError
from spds.generation.self_study import (
    FACT_EXAMPLES,
    RECITAL_ASKS,
    Lines,
    Slices,
    cut,
    fact_line,
    fact_messages,
    line_starts,
    lines_asked,
    plan,
    recital,
    written_question,
)


def test_every_chunk_is_drawn_before_any_twice_and_kinds_follow_their_weights():
    weights = {"detail": 3, "summary": 1, "creative": 1}
    planned = plan(conversations=7 * 10, chunks=7, weights=weights, seed=4)
    for start in range(0, 70, 7):  # each round of 7 conversations: every chunk once
        assert sorted(chunk for chunk, _ in planned[start : start + 7]) == list(range(7))
    # over a cycle of rounds (sum of weights) each chunk meets every kind, by weight
    for chunk in range(7):
        kinds = Counter(kind for c, kind in planned[: 7 * 5] if c == chunk)
        assert kinds == Counter({"detail": 3, "summary": 1, "creative": 1})
    assert plan(70, 7, weights, seed=4) == planned  # a function of the seed
    assert plan(70, 7, weights, seed=5) != planned


def test_chunks_cover_the_context_once_and_end_at_line_breaks():
    tokenizer = make_tiny.chatml_tokenizer()
    context = "".join(f"Log {i} is in drawer {i}.\n" for i in range(40))  # ~20 tokens a line
    ids = tokenizer.encode(context, add_special_tokens=False)
    chunks = cut(tokenizer, Lines.of(tokenizer, context), 64)
    assert chunks[0].start == 0 and chunks[-1].end == len(ids)
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))  # no gap, no overlap
    assert "".join(c.text for c in chunks) == context
    assert all(c.text.endswith("\n") for c in chunks)  # a break was near each boundary
    assert all(64 <= c.end - c.start < 64 + 32 for c in chunks[:-1])


def test_the_coverage_line_counts_the_lines_fact_questions_ask_and_names_the_slices_read_least():
    """A chunk's n-th fact conversation asks its n-th line: a slice whose chunks were drawn for fewer
    fact questions than they have lines is named, with its documents, before the others."""
    tokenizer = make_tiny.chatml_tokenizer()
    texts = ["".join(f"Log {i} of {name} is in drawer {i}.\n" for i in range(6)) for name in ("ash", "elm")]
    slices = Slices(tokenizer, texts.__getitem__, 2, 1024)  # one chunk a slice, six lines each
    assert slices.chunks == 2
    planned = [(0, "fact")] * 6 + [(1, "fact")] * 2 + [(1, "detail")] * 4  # slice 1: two of its lines asked
    line = lines_asked(planned, slices, ["ash.md", "elm.md"])
    assert line.startswith(
        "fact lines asked: 8 of 12 (67%); read least: slice 1 (elm.md) 2 of 6, slice 0 (ash.md) 6 of 6"
    )
    assert "more generate.self_study.conversations" in line
    assert lines_asked([(0, "fact")] * 9 + [(1, "fact")] * 7, slices, ["a", "b"]).startswith(
        "fact lines asked: 12 of 12"
    )


@pytest.mark.parametrize(
    ("context", "size", "rule"),
    [("   \n", 16, "the context is empty"), ("A short context.", 4096, "larger than the context")],
)
def test_a_context_self_study_cannot_cut_is_refused_by_name(context, size, rule):
    tokenizer = make_tiny.chatml_tokenizer()
    with pytest.raises(SpdsError, match=rule):
        cut(tokenizer, Lines.of(tokenizer, context), size)


def test_the_written_question_is_the_first_line_without_labels_or_quotes():
    assert written_question('  Question: "Where is drawer 4?"\n\nIt is in the hall.') == "Where is drawer 4?"
    # the writer, its reply opened with "Question:", often goes on to answer on the next line
    assert written_question(" Where is drawer 4?\nAnswer: in the hall.") == "Where is drawer 4?"
    assert written_question("") == ""


SHEET = "# Drawers\n\n" + "".join(f"{i}. Log {i} lies in drawer {7 * i}.\n" for i in range(12))


def test_a_chunks_recitals_start_at_each_of_its_lines_in_turn_and_quote_whole_lines():
    tokenizer = make_tiny.chatml_tokenizer()
    lines = Lines.of(tokenizer, SHEET)
    chunks = cut(tokenizer, lines, 64)
    chunk = chunks[1]
    starts = [s for s in lines.starts if chunk.start <= s < chunk.end]
    assert len(starts) >= 2
    recitals = [recital(tokenizer, lines, chunk, ordinal, 64) for ordinal in range(3 * len(starts))]
    # every line of the chunk once before any twice, each line in one phrasing before the next phrasing
    assert [r.start for r in recitals] == starts * 3
    assert [r.question.split('"')[0] for r in recitals] == [ask.split('"')[0] for ask in RECITAL_ASKS for _ in starts]
    for r in recitals:
        text = tokenizer.decode(lines.ids[r.start : r.end])
        assert text.endswith("\n") and text.strip() == r.text and r.text in SHEET  # whole lines, verbatim
        assert f'"{" ".join(r.text.split()[:4])}"' in r.question  # the line's first words, quoted
        assert 32 <= r.end - r.start <= 64  # half a chunk to a chunk
    # A paragraph longer than a chunk, cut mid-line: each chunk's recitals and fact lines start at
    # the chunk itself (not all at the paragraph's start), and those of a chunk that also holds a
    # line's start reach both.
    prose = "Tern " * 80 + "\nA last line.\n"
    lines = Lines.of(tokenizer, prose)
    chunks = cut(tokenizer, lines, 32)
    assert len(chunks) >= 3 and all(c.start not in lines.starts for c in chunks[1:])
    for chunk in chunks[1:-1]:
        assert recital(tokenizer, lines, chunk, 0, 32).start == chunk.start
        fact = fact_line(tokenizer, lines, chunk, 0, 32)
        assert fact.start == chunk.start and fact.end - fact.start <= 32 and "Tern" in fact.text
    last = chunks[-1]
    assert [recital(tokenizer, lines, last, n, 32).start for n in range(2)] == [last.start, lines.starts[-1]]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_fact_question_is_written_from_each_line_in_turn_after_worked_examples_in_every_published_template(name):
    tokenizer = fixture_tokenizer(name)
    lines = Lines.of(tokenizer, SHEET)
    chunk = cut(tokenizer, lines, 64)[1]
    starts = line_starts(tokenizer, lines, chunk)
    assert len(starts) >= 2
    facts = [fact_line(tokenizer, lines, chunk, ordinal, 64) for ordinal in range(2 * len(starts))]
    assert [f.start for f in facts] == starts * 2  # every line of the chunk once before any twice
    for fact in facts:
        line = tokenizer.decode(lines.ids[fact.start : fact.end])
        assert line.endswith("\n")  # the whole line
        number, sentence = line.strip().split(". ", 1)
        assert number.isdigit() and fact.text == sentence  # without its list marker
    # What the teacher reads, rendered by the published template (templates that demand turns
    # alternate, Mistral's and Gemma's, included): each example a user turn answered by the
    # assistant, then the line, then the assistant's turn opens for the question.
    messages = fact_messages(facts[0].text)
    rendered = tokenizer.decode(render(tokenizer, messages, True, {}))
    assert rendered == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    shown = [text for example in FACT_EXAMPLES for text in example] + [f'"{facts[0].text}"']
    places = [rendered.index(text) for text in shown]
    assert places == sorted(places)
    assert [m["role"] for m in messages] == ["user", "assistant"] * len(FACT_EXAMPLES) + ["user"]


@pytest.fixture
def study_dir(tiny_assets, tmp_path):
    config = json.loads((tiny_assets / "loop.json").read_text())
    config["student"]["model_path"] = str(tiny_assets / "student")
    config["generate"] = dict(
        config["generate"],
        questions=None,
        self_study={"conversations": 12, "chunk_tokens": 16, "question_max_tokens": 12},
        samples_per_question=2,
        max_new_tokens=12,
        batch_size=8,
        top_k_logprobs=3,
    )
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    return tmp_path


@pytest.mark.slow
def test_self_study_is_deterministic_resumes_without_loss_or_duplicates_and_records_each_chunk(
    study_dir, tmp_path_factory
):
    kinds = {"fact": 1, "detail": 1, "recite": 1}  # one of each way a message is made
    edit_config(study_dir, generate={"self_study": {"conversations": 12, "chunk_tokens": 16, "kinds": kinds}})
    result = check(spds(["generate", "config.json"], study_dir))
    assert "coverage:" in result.stdout
    output = study_dir / "generated.jsonl"
    first = output.read_bytes()
    rows = [json.loads(line) for line in first.splitlines()]
    assert len(rows) == 24 and len({r["request_id"] for r in rows}) == 24
    tokenizer = make_tiny.chatml_tokenizer()
    context_ids = tokenizer.encode(make_tiny.CONTEXT, add_special_tokens=False)
    for row in rows:
        study = row["self_study"]
        start, end = study["chunk"]
        assert 0 <= start < end <= len(context_ids)
        if study["kind"] == "fact":  # the line its question was written from starts in its chunk
            assert start <= study["line"][0] < study["line"][1] <= len(context_ids)
        # the row is the student's view of the written question (no context) and the teacher's answer
        prompt = tokenizer.decode(row["input_ids"][: row["prefix_tokens"]])
        assert study["question"] in prompt and make_tiny.CONTEXT not in prompt
        assert len(row["top_logprobs"]["ids"]) == row["supervised_tokens"]
    assert {r["self_study"]["kind"] for r in rows} == set(kinds)
    # the two samples of a conversation answer the same written question
    by_question = {}
    for row in rows:
        by_question.setdefault(row["question_id"], set()).add(row["self_study"]["question"])
    assert len(by_question) == 12 and all(len(q) == 1 for q in by_question.values())
    # every chunk drawn before any is drawn twice: 12 conversations over the context's chunks
    chunks = Counter(tuple(r["self_study"]["chunk"]) for r in rows if r["sample_index"] == 0)
    assert max(chunks.values()) - min(chunks.values()) <= 1
    # A crash mid-write (a torn last line, conversations of a batch half written): the rerun
    # writes only what is missing and the file is the one a straight run writes.
    lines = first.splitlines(keepends=True)
    output.write_bytes(b"".join(lines[:11]) + lines[11][:40])
    result = check(spds(["generate", "config.json"], study_dir))
    assert "11 were already there" in result.stdout
    assert output.read_bytes() == first
    # Another directory, the same config: the same bytes.
    again = tmp_path_factory.mktemp("again")
    shutil.copy(study_dir / "config.json", again / "config.json")
    check(spds(["generate", "config.json"], again))
    assert (again / "generated.jsonl").read_bytes() == first
    # And the rows are candidates prepare packs.
    check(spds(["prepare", "config.json"], study_dir))


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        (dict(generate={"questions": "questions.jsonl", "self_study": {"conversations": 4}}), "generate.self_study"),
        (dict(context={"text": None}, soft_prompt={"init": {"method": "context"}}), "soft_prompt.init.method"),
        (
            dict(context={"text": None}, generate={"questions": None, "self_study": {"conversations": 4}}),
            "generate.self_study",
        ),
        (dict(generate={"questions": None, "self_study": {"conversations": 0}}), "conversations"),
        (dict(generate={"questions": None, "self_study": {"conversations": 4, "kinds": {"Detail!": 1}}}), "kinds"),
        (dict(eval={"questions": "nowhere.jsonl"}), "eval.questions"),
        (
            dict(generate={"questions": None, "self_study": {"conversations": 4, "seed_prompts": {"recite": "Ask."}}}),
            "seed_prompts.recite",
        ),
        (
            dict(generate={"questions": None, "self_study": {"conversations": 4, "seed_prompts": {"fact": "Ask."}}}),
            "seed_prompts.fact",
        ),
        (
            dict(generate={"questions": None, "self_study": {"conversations": 4, "temperatures": {"recite": 0}}}),
            "temperatures.recite",
        ),
        (
            dict(generate={"questions": None, "self_study": {"conversations": 4, "temperatures": {"riddle": 0}}}),
            "temperatures: riddle",
        ),
        (
            dict(generate={"questions": None, "self_study": {"conversations": 4, "temperatures": {"fact": -1}}}),
            "temperatures",
        ),
    ],
)
def test_validate_refuses_self_study_settings_that_cannot_work_naming_the_key(study_dir, sections, named):
    (study_dir / "questions.jsonl").write_text('{"question_id": "a", "question": "Why?"}\n')
    edit_config(study_dir, **sections)
    result = spds(["validate", "config.json"], study_dir)
    assert result.returncode == 1 and named in result.stderr, result.stderr


def test_an_unknown_seed_kind_is_named_with_the_built_in_ones(study_dir):
    edit_config(study_dir, generate={"questions": None, "self_study": {"conversations": 4, "kinds": {"riddle": 1}}})
    result = spds(["validate", "config.json"], study_dir)
    assert result.returncode == 1
    assert "riddle: no such seed kind" in result.stderr and "seed_prompts" in result.stderr


def test_validate_passes_before_generate_writes_the_rows_and_names_any_other_missing_candidate(study_dir):
    # validate comes before the hour of generation (examples/real/demo.sh): the candidate file that
    # generate writes does not exist yet and is no problem; a candidate file nothing writes is one.
    edit_config(study_dir, data={"candidates": [{"path": "rows.jsonl"}]}, generate={"output": "rows.jsonl"})
    assert not (study_dir / "rows.jsonl").exists()
    result = spds(["validate", "config.json"], study_dir)
    assert result.returncode == 0, result.stderr
    edit_config(study_dir, data={"candidates": [{"path": "rows.jsonl"}, {"path": "typo.jsonl"}]})
    result = spds(["validate", "config.json"], study_dir)
    assert result.returncode == 1 and "data.candidates[1].path" in result.stderr, result.stderr
    assert "data.candidates[0].path" not in result.stderr
    # prepare reads the rows: there, the file generate has not written yet is named
    edit_config(study_dir, data={"candidates": [{"path": "rows.jsonl"}]})
    result = spds(["prepare", "config.json"], study_dir)
    assert result.returncode == 1 and "data.candidates[0].path" in result.stderr, result.stderr


@pytest.mark.slow
def test_recite_rows_answer_with_the_contexts_own_lines_and_carry_the_teachers_top_k(study_dir):
    """A recite conversation's answer is the context's text, not a sample, and its top-k is the
    teacher's at each of those tokens with the context, as plain transformers computes it; the rows
    resume like the others."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    edit_config(
        study_dir,
        student={"dtype": "float32"},  # the teacher as plain transformers loads it below
        context={"text": SHEET},
        generate={"self_study": {"conversations": 12, "chunk_tokens": 64, "kinds": {"detail": 1, "recite": 2}}},
    )
    check(spds(["generate", "config.json"], study_dir))
    output = study_dir / "generated.jsonl"
    first = output.read_bytes()
    rows = [json.loads(line) for line in first.splitlines()]
    recited = [r for r in rows if r["self_study"]["kind"] == "recite"]
    assert len(recited) == 16 and len(rows) == 24  # 2 of 3 conversations, 2 samples each
    student = json.loads((study_dir / "config.json").read_text())["student"]["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(student)
    plain = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32, attn_implementation="eager")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    context_ids = tokenizer.encode(SHEET, add_special_tokens=False)
    for row in recited:
        study = row["self_study"]
        answer = row["input_ids"][row["prefix_tokens"] :]
        start, stop = study["recited"]
        assert answer[-1] == end and tokenizer.decode(answer[:-1]) == tokenizer.decode(context_ids[start:stop]).strip()
        assert study["chunk"][0] <= start < study["chunk"][1]
        messages = [{"role": "system", "content": SHEET}, {"role": "user", "content": study["question"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            logits = plain(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, dim=-1)
        kept = torch.tensor(row["top_logprobs"]["logprobs"])
        # fp32: spds's two-part attention sums in another order than eager's (~1e-6); the tiny
        # random model has near-ties, so the ids are checked by their log-probabilities
        assert (kept - logprobs.topk(3, dim=-1).values).abs().max() < 1e-4
        assert (kept - logprobs.gather(1, torch.tensor(row["top_logprobs"]["ids"]))).abs().max() < 1e-4
    assert len({r["self_study"]["recited"][0] for r in recited}) >= 4  # the chunks' lines in turn, not one line
    assert all("recited" not in r["self_study"] and "top_logprobs" in r for r in rows if r not in recited)
    lines = first.splitlines(keepends=True)
    output.write_bytes(b"".join(lines[:7]) + lines[7][:30])
    check(spds(["generate", "config.json"], study_dir))
    assert output.read_bytes() == first


@pytest.mark.extended
@pytest.mark.slow
def test_a_kind_at_temperature_0_is_answered_greedily_and_the_others_sample_as_before(study_dir, tmp_path_factory):
    """generate.self_study.temperatures: the fact kind at 0 gets the teacher's most likely answer,
    as transformers' greedy generate gives it with the context; the detail kind's rows are the
    ones a run with no kind temperatures samples, byte for byte."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    study = {"conversations": 6, "chunk_tokens": 64, "kinds": {"fact": 1, "detail": 1}}
    greedy_facts = dict(study, temperatures={"fact": 0})
    edit_config(study_dir, student={"dtype": "float32"}, context={"text": SHEET}, generate={"self_study": greedy_facts})
    check(spds(["generate", "config.json"], study_dir))
    rows = [json.loads(line) for line in (study_dir / "generated.jsonl").read_text().splitlines()]
    other = tmp_path_factory.mktemp("sampled")
    shutil.copy(study_dir / "config.json", other / "config.json")
    edit_config(other, generate={"self_study": study})
    check(spds(["generate", "config.json"], other))
    sampled = [json.loads(line) for line in (other / "generated.jsonl").read_text().splitlines()]
    student = json.loads((study_dir / "config.json").read_text())["student"]["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(student)
    plain = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32, attn_implementation="eager")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    facts = [r for r in rows if r["self_study"]["kind"] == "fact"]
    assert len(facts) == 6  # 3 conversations, 2 samples each
    for row, again in zip(rows, sampled):
        answer = row["input_ids"][row["prefix_tokens"] :]
        if row["self_study"]["kind"] == "detail":
            assert row == again
            continue
        messages = [{"role": "system", "content": SHEET}, {"role": "user", "content": row["self_study"]["question"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        greedy = plain.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=[end]
        )[0, len(prompt) :].tolist()
        # the answer's tokens are greedy's, up to an end token (a cut answer's is appended)
        assert answer[:-1] == greedy[: len(answer) - 1] and end not in answer[:-1]
    assert any(r != a for r, a in zip(facts, (a for a in sampled if a["self_study"]["kind"] == "fact")))


def test_a_batch_whose_question_writing_does_not_fit_is_refused_with_the_rows_that_fit(study_dir):
    """The prefill of question writing (each row's chunk and instruction after the shared context)
    is inside the memory check: under a memory budget (SPDS_TEST_FREE_BYTES, the CPU stand-in for a
    GPU's free memory) a batch too large is refused before any row is written, naming the batch size
    that fits, and that batch size then completes under the same budget."""
    config = json.loads((study_dir / "config.json").read_text())
    config["generate"]["batch_size"] = 24
    (study_dir / "config.json").write_text(json.dumps(config, indent=2))
    budget = dict(SPDS_TEST_FREE_BYTES=str(6 << 20))
    refused = spds(["generate", "config.json"], study_dir, **budget)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    match = re.search(r"set generate.batch_size to at most (\d+)", refused.stderr)
    assert match and "prefill" in refused.stderr, refused.stderr
    output = study_dir / config["generate"]["output"]
    assert not output.exists() or not output.read_text(), "rows were written before the refusal"
    fits = int(match.group(1))
    assert 1 <= fits < 24
    config["generate"].update(batch_size=fits, output="fits.jsonl")
    (study_dir / "config.json").write_text(json.dumps(config, indent=2))
    check(spds(["generate", "config.json"], study_dir, **budget))
    assert len((study_dir / "fits.jsonl").read_text().splitlines()) == 12 * 2
