"""A corpus as the context (context.documents, spds/data/corpus.py): read by rule, pinned, cut
into slices of the teacher's window; self-study asks each conversation with its chunk's slice;
eval reports the soft prompt against the corpus truncated to the window and the oracle slice.

The student is the tiny example's with its window cut to 1,024 positions (its config.json as
a user's model declares one), so that a corpus of three windows is a few thousand characters.
What the teacher read is recomputed with plain transformers from the rows alone."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc

import pytest
import torch
from conftest import edit_config, make_tiny
from helpers import assert_same_adam_path, check, spds
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

WINDOW = 1024
DESCRIPTION = "The drawer sheets of the Lumen Bay archive."


def sheet(i: int) -> str:
    return "".join(f"{j}. Ledger {i}-{j} lies in drawer {7 * i + j}.\n" for j in range(9))


def rendered(documents: list[tuple[str, str]], description: str | None = None) -> str:
    """The corpus as docs/config.md renders it: the description, then each document as "## id"
    (or its title), a line break and its text, a blank line between them."""
    blocks = [f"## {name}\n{text.rstrip()}" for name, text in documents]
    return "\n\n".join([description, *blocks] if description else blocks)


@pytest.fixture
def corpus(tiny_assets, tmp_path):
    """A run directory: the tiny student with a 1,024-position window, twelve sheets (about three
    windows of its tokens), and a self-study config reading them."""
    student = tmp_path / "student"
    shutil.copytree(tiny_assets / "student", student)
    declared = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps(dict(declared, max_position_embeddings=WINDOW)))
    (tmp_path / "sheets").mkdir()
    for i in range(12):
        (tmp_path / "sheets" / f"sheet{i:02d}.md").write_text(sheet(i))
    config = json.loads((tiny_assets / "loop.json").read_text())
    config["student"].update(model_path=str(student), dtype="float32")
    config["context"] = {"documents": "sheets", "description": DESCRIPTION}
    config["data"].update(candidates=[{"path": "rows.jsonl"}], context_limit=None)
    config["generate"] = dict(
        config["generate"],
        questions=None,
        output="rows.jsonl",
        self_study={"conversations": 24, "chunk_tokens": 64, "question_max_tokens": 12, "slice_tokens": 400},
        samples_per_question=1,
        max_new_tokens=12,
        batch_size=8,
        top_k_logprobs=3,
    )
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    return tmp_path


def corpus_tokens(directory) -> int:
    tokenizer = make_tiny.chatml_tokenizer()
    texts = [(p.name, p.read_text()) for p in sorted((directory / "sheets").iterdir())]
    return len(tokenizer.encode(rendered(texts, DESCRIPTION), add_special_tokens=False))


def test_every_broken_document_is_named_by_file_and_rule_in_one_refusal(corpus):
    (corpus / "sheets" / "blank.md").write_text("  \n\n")
    (corpus / "sheets" / "latin1.md").write_bytes("Caf\xe9 opens at 9.\n".encode("latin-1"))
    (corpus / "more.jsonl").write_text(
        json.dumps({"id": "manual", "text": "Page one.\n"})
        + "\n"
        + json.dumps({"id": "manual", "title": "Again", "text": "Page two.\n"})
        + "\n"
        + '{"id": "odd", "text": "A lone \\ud800 surrogate."}\n'
        + json.dumps({"id": "bare"})
        + "\n"
    )
    edit_config(corpus, context={"documents": ["sheets", "more.jsonl"]})
    result = spds(["validate", "config.json"], corpus)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    for named in (
        "blank.md: document 'blank.md': rule 'not empty'",
        "latin1.md: byte 3 (line 1): rule 'UTF-8 text'",
        "more.jsonl:2: document 'manual': rule 'unique id': already the id of the document at",
        "more.jsonl:3: rule 'one JSON object per line': rule 'UTF-8 text'",
        "more.jsonl:4: document 'bare': rule 'document fields': text must be a non-empty string",
    ):
        assert named in out, out
    assert "Traceback" not in out and "latin1.md: document 'latin1.md': rule 'not empty'" not in out


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        (dict(context={"text": "A context."}), "context: context.text and context.documents are set"),
        (
            dict(generate={"self_study": {"conversations": 4, "slice_tokens": 4 * WINDOW}}),
            "generate.self_study.slice_tokens: 4096 tokens of the corpus",
        ),
        (dict(eval={"questions": "eval.jsonl"}), "doc 'nowhere.md': rule 'a document of the corpus'"),
        (dict(loss={"objective": "kl", "teacher": "context"}), "loss.teacher: context: the online teacher reads"),
        (dict(generate={"self_study": None, "questions": "asked.jsonl"}), "question_id 'q1' names no doc"),
        (dict(context={"documents": "sheets/*.txt"}), "context.documents: 'sheets/*.txt' matches no file"),
        (dict(context={"documents": None, "file": "sheets/sheet00.md"}), "context.description: describes a corpus"),
    ],
)
def test_validate_refuses_what_a_corpus_cannot_do_naming_the_key(corpus, sections, named):
    (corpus / "eval.jsonl").write_text(json.dumps({"question_id": "e1", "question": "Where?", "doc": "nowhere.md"}))
    (corpus / "asked.jsonl").write_text(
        json.dumps({"question_id": "q0", "question": "Where is ledger 3-1?", "doc": "sheet03.md"})
        + "\n"
        + json.dumps({"question_id": "q1", "question": "Where is ledger 4-1?"})
        + "\n"
    )
    edit_config(corpus, **sections)
    result = spds(["validate", "config.json"], corpus)
    assert result.returncode != 0 and named in result.stdout + result.stderr, result.stdout + result.stderr


def test_a_corpus_reads_regular_files_inside_its_root_and_lists_what_it_skipped(corpus, tmp_path_factory):
    """What a directory copied from a shared drive may hold: a link to a credentials file outside
    it, a link back to itself, a dangling link, a FIFO, a link to one of its own sheets, hidden
    files and editor litter. Each of the first five is refused by path and rule in one refusal
    (none read: the secret is in no message, the FIFO never opened), or with context.skip_irregular
    skipped and listed; validate lists what it skipped either way."""
    secret = tmp_path_factory.mktemp("elsewhere") / "credentials"
    secret.write_text("token-7f3a9\n")
    sheets = corpus / "sheets"
    (sheets / "secret.md").symlink_to(secret)
    (sheets / "again").symlink_to(".")
    (sheets / "gone.md").symlink_to(sheets / "missing.md")
    os.mkfifo(sheets / "pipe.md")
    (sheets / "twice.md").symlink_to(sheets / "sheet00.md")
    (sheets / ".notes.md").write_text("hidden")
    (sheets / "sheet01.md~").write_text("an editor's backup")
    refused = spds(["validate", "config.json"], corpus)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "token-7f3a9" not in said
    for name, rule in (
        ("secret.md", "rule 'inside the corpus's root': a symlink to"),
        ("again", "rule 'no symlinked folder'"),
        ("gone.md", "rule 'a readable regular file'"),
        ("pipe.md", "rule 'a regular file': it is a FIFO"),
        ("twice.md", "rule 'one file, one document': the same file as"),
    ):
        assert f"sheets/{name}: {rule}" in said, (name, said)
    edit_config(corpus, context={"skip_irregular": True})
    listed = check(spds(["validate", "config.json"], corpus)).stdout
    assert "corpus: 12 files read, 7 skipped" in listed
    assert "sheets/.notes.md: hidden or editor litter" in listed and "sheets/sheet01.md~: hidden" in listed
    assert "sheets/secret.md: rule 'inside the corpus's root'" in listed
    # a glob over the run's own directory would read its config and rows: refused by name
    edit_config(corpus, context={"documents": "**/*", "skip_irregular": False})
    (corpus / "rows.jsonl").write_text("")
    said = spds(["validate", "config.json"], corpus)
    assert "config.json: rule 'not the run's own file'" in said.stdout + said.stderr
    assert "rows.jsonl: rule 'not the run's own file'" in said.stdout + said.stderr
    # a file whose name holds glob characters is that file, not a pattern
    (corpus / "notes [draft].md").write_text(sheet(0))
    edit_config(corpus, context={"documents": ["notes [draft].md"], "description": None})
    check(spds(["validate", "config.json"], corpus))


def test_a_byte_order_mark_is_removed_and_said_and_crlf_is_read_as_lf(corpus):
    """Files saved by another system's editor: a UTF-8 byte-order mark never reaches the teacher's
    text (generate's corpus line says it was removed) and CRLF line ends read as LF, in a file and
    in a JSONL document alike; the slices' text is what renders the same documents written plainly."""
    from spds.contract.gate import load_config
    from spds.data.corpus import Corpus

    plain = (corpus / "sheets" / "sheet00.md").read_text()
    (corpus / "sheets" / "sheet00.md").write_bytes(b"\xef\xbb\xbf" + plain.replace("\n", "\r\n").encode())
    (corpus / "sheets" / "zz-one-line.md").write_bytes(b"\xef\xbb\xbfThe last ferry leaves at nine.\r\n")
    row = json.dumps({"id": "extra", "text": "Line one.\r\nLine two.\r\n"})
    (corpus / "more.jsonl").write_bytes(b"\xef\xbb\xbf" + row.encode() + b"\n")
    edit_config(corpus, context={"documents": ["sheets", "more.jsonl"]})
    config = load_config(corpus / "config.json", candidates="generate writes one")
    built = Corpus.build(config, make_tiny.chatml_tokenizer(), None)
    text = built.text(0)
    assert "\ufeff" not in text and "\r" not in text
    assert f"## sheet00.md\n{plain.rstrip()}" in text and "## extra\nLine one.\nLine two." in text
    assert "## zz-one-line.md\nThe last ferry leaves at nine.\n" in text  # read to its end, not to its length as read
    assert "a byte-order mark removed from 3 files" in built.summary()


def test_an_unreadable_file_or_folder_is_named_not_skipped(corpus, monkeypatch):
    """A folder or file the user cannot read (as root every permission passes, so the refusals
    are raised here as the OS raises them): each named by path and rule, and
    the corpus is not pinned without it."""
    import spds.contract.documents as documents

    (corpus / "sheets" / "private").mkdir()
    (corpus / "sheets" / "private" / "inner.md").write_text(sheet(1))
    scandir, access = os.scandir, os.access

    def guarded(path):
        if str(path).endswith("private"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(documents.os, "scandir", guarded)
    monkeypatch.setattr(documents.os, "access", lambda path, mode: not str(path).endswith("sheet05.md"))
    refused = spds(["validate", "config.json"], corpus)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "sheets/private: rule 'a readable folder': Permission denied" in said
    assert "sheets/sheet05.md: rule 'a readable regular file': permission denied" in said
    pinned = spds(["pin", "config.json"], corpus)
    assert pinned.returncode != 0 and not (corpus / "config.json.pins.json").exists()
    monkeypatch.setattr(documents.os, "scandir", scandir)
    monkeypatch.setattr(documents.os, "access", access)


def test_sizes_and_names_are_refused_where_they_are_known(corpus):
    """validate refuses what generate would: a corpus smaller than a chunk (of several slices, a
    short one is one chunk: the sheets' config, whose last slice is short, passes), a description
    that leaves a slice no room, and a file name that is not UTF-8 (shown escaped, not a traceback)."""
    from spds.contract.gate import load_config
    from spds.data.corpus import Corpus

    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    sizes = [s.tokens for s in Corpus.build(config, make_tiny.chatml_tokenizer(), 400).slices]
    study = json.loads((corpus / "config.json").read_text())["generate"]["self_study"]
    edit_config(corpus, generate={"self_study": dict(study, chunk_tokens=min(sizes) + 1)})
    assert len(sizes) > 1 and min(sizes) + 1 < max(sizes)
    check(spds(["validate", "config.json"], corpus))  # several slices: the short one is one chunk
    edit_config(corpus, generate={"self_study": study})
    (corpus / "tiny").mkdir()
    (corpus / "tiny" / "note.md").write_text("The ferry leaves at dawn.\n")
    edit_config(corpus, context={"documents": "tiny", "description": None})
    said = spds(["validate", "config.json"], corpus)
    assert said.returncode != 0 and "generate.self_study.chunk_tokens: 64 is more than the corpus's" in said.stderr
    edit_config(corpus, context={"documents": "sheets", "description": "A description. " * 200})
    said = spds(["validate", "config.json"], corpus)
    assert said.returncode != 0 and "context.description: " in said.stderr and "shorten it" in said.stderr
    edit_config(corpus, context={"description": DESCRIPTION})
    (corpus / "sheets" / os.fsdecode(b"caf\xe9.md")).write_text(sheet(0))
    said = spds(["validate", "config.json"], corpus)
    assert said.returncode != 0 and "sheets/caf\\xe9.md: rule 'a UTF-8 file name'" in said.stderr, said.stderr


def test_init_reads_a_corpus_from_the_configs_folder_and_names_the_config_it_refuses(corpus):
    """spds init --context DIR --out sub/run.yaml: DIR means sub/DIR, as the config it writes reads
    it; a refusal names sub/run.yaml, never the temporary file it checked."""
    (corpus / "sub").mkdir()
    shutil.copytree(corpus / "sheets", corpus / "sub" / "sheets")
    made = check(
        spds(["init", str(corpus / "student"), "rows.jsonl", "--context", "sheets", "--out", "sub/run.json"], corpus)
    )
    written = json.loads((corpus / "sub" / "run.json").read_text())
    assert written["context"]["documents"] == "sheets"
    # sized from the corpus: a kv prompt at about 30x fewer positions than its tokens (multiples of
    # 64, at least 64), started from its first tokens; every 64-token chunk read twice on the CPU.
    # (init writes no description: the corpus is its documents alone)
    texts = [(p.name, p.read_text()) for p in sorted((corpus / "sheets").iterdir())]
    tokens = len(make_tiny.chatml_tokenizer().encode(rendered(texts), add_special_tokens=False))
    assert f"sized for a corpus of {tokens:,} tokens" in made.stdout, made.stdout
    assert written["soft_prompt"]["form"] == "kv" and written["soft_prompt"]["init"]["method"] == "context"
    assert written["soft_prompt"]["length"] == max(64, round(tokens / 30 / 64) * 64)
    assert written["generate"]["self_study"]["conversations"] == max(256, -(-tokens // 64) * 2)
    assert written["optim"]["learning_rate"] == 0.1  # the kv form's (docs/config.md)
    check(spds(["validate", "sub/run.json"], corpus))
    refused = spds(
        ["init", str(corpus / "student"), "rows.jsonl", "--context", "nowhere", "--out", "sub/b.json"], corpus
    )
    assert refused.returncode != 0 and "sub/b.json" in refused.stderr and ".init-" not in refused.stderr, refused.stderr
    assert not (corpus / "sub" / "b.json").exists()


@pytest.mark.parametrize("spread", [False, True])
def test_a_prompt_started_from_a_corpus_reads_its_first_tokens_or_every_slices_first_tokens(corpus, spread):
    """init.method context over a corpus of several slices: its first p tokens (Cartridges'), or
    with init.spread p / slices from the start of each slice in turn (not its description again);
    the tokens recomputed here from the rendered text and each slice's documents."""
    from spds.contract.gate import load_config
    from spds.data.context import corpus_of, init_ids
    from spds.errors import SpdsError
    from spds.generation.teacher_window import require_ready

    tokenizer = make_tiny.chatml_tokenizer()
    count = len(corpus_of(load_config(corpus / "config.json", candidates="generate writes one"), tokenizer).slices)
    assert count >= 3
    length = 8 * count  # an equal share of every slice
    edit_config(corpus, soft_prompt={"length": length, "form": "kv", "init": {"method": "context", "spread": spread}})
    config = load_config(corpus / "config.json", candidates="generate writes one")
    ids = init_ids(config, tokenizer, length)
    texts = [(p.name, p.read_text()) for p in sorted((corpus / "sheets").iterdir())]
    edit_config(corpus, soft_prompt={"length": 4000})  # more than the corpus holds: validate refuses it
    with pytest.raises(SpdsError, match="rule 'enough context to start from'"):
        require_ready(load_config(corpus / "config.json", candidates="generate writes one"))
    if not spread:
        assert ids == tokenizer.encode(rendered(texts, DESCRIPTION), add_special_tokens=False)[:length]
        return
    expected = []
    for k, piece in enumerate(corpus_of(config).slices):
        names = {corpus_of(config).documents[part.document].id for part in piece.parts}
        own = rendered([(name, text) for name, text in texts if name in names], DESCRIPTION if k == 0 else None)
        expected += tokenizer.encode(own, add_special_tokens=False)[:8]
    assert ids == expected


def test_a_corpus_changed_since_pin_stops_the_run_before_any_work(corpus):
    (corpus / "rows.jsonl").write_text("")  # pinned too (spds pin pins every input)
    check(spds(["pin", "config.json"], corpus))
    pins = json.loads((corpus / "config.json.pins.json").read_text())["pins"]
    assert "context.sha256" in pins
    check(spds(["validate", "config.json"], corpus))
    (corpus / "sheets" / "sheet05.md").write_text(sheet(5).replace("drawer 38", "drawer 83"))
    edited = spds(["generate", "config.json"], corpus)
    assert edited.returncode != 0
    assert "context.sha256: the corpus (context.documents) changed since it was pinned" in edited.stderr
    assert (corpus / "rows.jsonl").read_text() == ""  # nothing written
    (corpus / "sheets" / "sheet05.md").write_text(sheet(5))
    check(spds(["validate", "config.json"], corpus))
    (corpus / "sheets" / "sheet12.md").write_text(sheet(12))  # a document added
    assert "changed since it was pinned" in spds(["validate", "config.json"], corpus).stderr


def test_a_corpus_within_the_window_writes_the_bytes_of_the_same_text_as_one_context_file(corpus):
    """Two sheets fit the window: the teacher reads them whole, as it reads context.file."""
    for extra in sorted((corpus / "sheets").iterdir())[2:]:
        extra.unlink()
    edit_config(corpus, generate={"self_study": {"conversations": 12, "chunk_tokens": 64, "question_max_tokens": 12}})
    check(spds(["generate", "config.json"], corpus))
    rows = (corpus / "rows.jsonl").read_bytes()
    assert b'"slice"' not in rows  # the whole corpus is the slice: nothing to record beyond today's row
    texts = [(p.name, p.read_text()) for p in sorted((corpus / "sheets").iterdir())]
    (corpus / "context.md").write_text(rendered(texts, DESCRIPTION))
    edit_config(corpus, context={"file": "context.md", "documents": None, "description": None})
    (corpus / "rows.jsonl").unlink()
    (corpus / "rows.jsonl.provenance.json").unlink()  # its record names the corpus: another context's digest
    check(spds(["generate", "config.json"], corpus))
    assert (corpus / "rows.jsonl").read_bytes() == rows


def test_self_study_over_three_windows_reads_each_chunks_slice_within_the_window(corpus):
    """Each row's teacher read one slice: the description and whole sheets holding the row's chunk,
    within the teacher's window with the question and answer; recomputed from the row alone with
    plain transformers (the slice rendered from the documents it names, the published template's
    rendering, a plain forward), the teacher's recorded top-k at the answer's first token is that
    forward's."""
    assert corpus_tokens(corpus) >= 3 * WINDOW
    result = check(spds(["generate", "config.json"], corpus))
    assert "slices" in result.stdout
    rows = [json.loads(line) for line in (corpus / "rows.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(corpus / "student")
    sheets = {p.name: p.read_text() for p in (corpus / "sheets").iterdir()}
    named, indices = set(), set()
    for row in rows:
        study = row["self_study"]
        documents = study["slice"]["documents"]
        named.update(documents)
        indices.add(study["slice"]["index"])
        text = rendered([(name, sheets[name]) for name in documents], DESCRIPTION)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == study["slice"]["tokens"] <= 400
        start, end = study["chunk"]  # the chunk's offsets are the slice's tokens
        assert 0 <= start < end <= len(ids)
        if study["kind"] == "recite":  # its answer is the slice's own text there
            recited = tokenizer.decode(ids[slice(*study["recited"])]).strip()
            assert tokenizer.decode(row["labels"][row["prefix_tokens"] : -1]).strip() == recited
        asked = [{"role": "system", "content": text}, {"role": "user", "content": study["question"]}]
        prompt = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert len(prompt) + row["supervised_tokens"] <= WINDOW
    assert named == set(sheets) and len(indices) > 3  # every sheet read, in many slices
    # a run cut short (a torn last line) completes to the same bytes
    written = (corpus / "rows.jsonl").read_bytes()
    (corpus / "rows.jsonl").write_bytes(written[: len(written) // 2])
    check(spds(["generate", "config.json"], corpus))
    assert (corpus / "rows.jsonl").read_bytes() == written
    # a sheet edited since: prepare refuses the rows whose teacher read another slice
    (corpus / "sheets" / "sheet04.md").write_text(sheet(4) + "9. One more ledger.\n")
    refused = spds(["prepare", "config.json"], corpus)
    assert refused.returncode != 0 and "rule 'the corpus's slice'" in refused.stderr, refused.stderr[-2000:]
    row = rows[0]
    text = rendered([(n, sheets[n]) for n in row["self_study"]["slice"]["documents"]], DESCRIPTION)
    expected = first_top_k(corpus, text, row["self_study"]["question"])
    assert row["top_logprobs"]["ids"][0] == expected.indices.tolist()
    # fp32 on both sides: the decoder's two-part softmax sums in another order (~1e-6)
    assert (torch.tensor(row["top_logprobs"]["logprobs"][0]) - expected.values).abs().max() < 1e-4


def first_top_k(directory, text: str, question: str):
    """A plain forward's top-3 log-probabilities at the answer's first token, the teacher reading
    `text` as its system message (the published template's rendering)."""
    tokenizer = AutoTokenizer.from_pretrained(directory / "student")
    student = directory / "student"
    plain = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32, attn_implementation="eager")
    asked = [{"role": "system", "content": text}, {"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        return torch.log_softmax(plain(torch.tensor([prompt])).logits[0, -1].float(), -1).topk(3)


def test_a_question_naming_its_document_is_answered_with_that_documents_slice(corpus):
    asked = {"q3": ("Where is ledger 3-4?", "sheet03.md"), "q10": ("Where is ledger 10-1?", "sheet10.md")}
    (corpus / "asked.jsonl").write_text(
        "".join(json.dumps({"question_id": q, "question": text, "doc": doc}) + "\n" for q, (text, doc) in asked.items())
    )
    edit_config(corpus, generate={"self_study": None, "questions": "asked.jsonl"})
    check(spds(["generate", "config.json"], corpus))
    rows = [json.loads(line) for line in (corpus / "rows.jsonl").read_text().splitlines()]
    sheets = {p.name: p.read_text() for p in (corpus / "sheets").iterdir()}
    assert len({row["slice"]["index"] for row in rows}) == 2
    for row in rows:
        question, doc = asked[row["question_id"]]
        assert doc in row["slice"]["documents"]
        text = rendered([(name, sheets[name]) for name in row["slice"]["documents"]], DESCRIPTION)
        expected = first_top_k(corpus, text, question)
        assert row["top_logprobs"]["ids"][0] == expected.indices.tolist()
        # fp32 on both sides: the decoder's two-part softmax sums in another order (~1e-6)
        assert (torch.tensor(row["top_logprobs"]["logprobs"][0]) - expected.values).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.over_budget("a corpus directory through every verb, and two ranks writing the one-rank bytes")
def test_spds_init_on_a_directory_runs_every_verb_and_two_ranks_write_the_one_rank_bytes(corpus):
    """The corpus through `spds init --context DIR` and every verb; generate on two ranks writes
    the one-rank bytes, and train on two ranks the one-rank prompt; eval reports the soft prompt
    against the corpus truncated to the window and the oracle slice of each question's document."""
    (corpus / "eval.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "question_id": f"e{i}",
                    "question": f"Where is ledger {i}-2?",
                    "keyword": str(7 * i + 2),
                    "doc": f"sheet{i:02d}.md",
                }
            )
            + "\n"  # fmt: skip
            for i in (0, 6, 11)
        )
    )
    check(spds(["init", str(corpus / "student"), "rows.jsonl", "--context", "sheets", "--out", "run.json"], corpus))
    written = (corpus / "run.json").read_text()
    assert '"documents": "sheets"' in written
    run = json.loads(written)
    run["generate"]["self_study"].update(conversations=16, question_max_tokens=12)
    run["generate"].update(max_new_tokens=12, batch_size=4)
    run["optim"].update(updates=2, warmup_updates=1, effective_batch=4, micro_batch=4)
    run["soft_prompt"]["length"] = 8
    run["eval"] = {"questions": "eval.jsonl", "samples": 0}
    (corpus / "run.json").write_text(json.dumps(run))
    check(spds(["generate", "run.json"], corpus))
    one = (corpus / "rows.jsonl").read_bytes()
    (corpus / "rows.jsonl").unlink()
    check(spds(["generate", "run.json"], corpus, world=2, launcher="torchrun"))
    assert (corpus / "rows.jsonl").read_bytes() == one
    for verb in ("pin", "prepare", "smoke", "train"):
        check(spds([verb, "run.json"], corpus))
    shown = check(spds(["eval", "run.json"], corpus)).stdout
    assert "truncated" in shown and "oracle" in shown
    report = json.loads((corpus / "run" / "eval.json").read_text())
    assert report["corpus"]["context"] == "truncated" and report["corpus"]["documents"] == 12
    assert set(report["questions"]["keyword_share"]) == {"bare", "context", "soft", "oracle"}
    assert all(answer["oracle"] is not None and answer["doc"] for answer in report["questions"]["answers"])
    check(spds(["sample", "run.json", "--questions", "eval.jsonl"], corpus))
    check(spds(["export", "run.json"], corpus))
    # the same training on two ranks: the same Adam path, to the rounding of the sums' grouping
    (corpus / "ranks.json").write_text(json.dumps(dict(run, output_dir="run-2", train={"require_smoke": False})))
    check(spds(["train", "ranks.json"], corpus, world=2, launcher="torchrun"))
    check(spds(["export", "ranks.json"], corpus))
    one, two = (load_file(corpus / d / "export" / "soft_prompt.safetensors")["prompt"] for d in ("run", "run-2"))
    assert_same_adam_path(two, one, [run["optim"]["learning_rate"]] * 2, what="the prompt on 2 ranks")


def test_the_formats_documents_come_in(corpus):
    """An export from another tool: .ndjson read as JSONL, extra fields (url, meta) never read,
    integer ids, an empty title (the id heads the document). A binary file (an image) and a .json
    file are refused by path and rule, or with context.skip_irregular skipped and listed."""
    from spds.contract.gate import load_config
    from spds.data.corpus import Corpus

    rows = [
        {"id": 7, "text": "The mill grinds on Tuesdays.\n", "url": "https://example.org/7", "meta": {"n": 1}},
        {"id": "harbour", "title": "", "text": "The harbour closes at dusk.\n"},
    ]
    (corpus / "sheets" / "export.ndjson").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (corpus / "sheets" / "map.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(64))
    (corpus / "sheets" / "notes.json").write_text(json.dumps([{"id": "a", "text": "b"}]))
    refused = spds(["validate", "config.json"], corpus)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "sheets/map.png: rule 'a text file': it holds binary data" in said
    assert "sheets/notes.json: rule 'documents as text or JSONL'" in said
    edit_config(corpus, context={"skip_irregular": True})
    listed = check(spds(["validate", "config.json"], corpus)).stdout
    assert "corpus: 13 files read, 2 skipped" in listed
    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    text = Corpus.build(config, make_tiny.chatml_tokenizer(), None).text(0)
    assert "## 7\nThe mill grinds on Tuesdays." in text and "## harbour\nThe harbour closes at dusk." in text
    assert "example.org" not in text


def test_entries_may_give_their_documents_an_id_prefix(corpus):
    """Two projects' folders each holding a README.md: the same id twice is refused (both places
    named); {"path": ..., "prefix": ...} entries read them as a/README.md and b/README.md, a JSONL
    file's ids prefixed the same way."""
    from spds.contract.gate import load_config
    from spds.data.corpus import Corpus

    for name in ("a", "b"):
        (corpus / name).mkdir()
        (corpus / name / "README.md").write_text(sheet(ord(name)))
    (corpus / "more.jsonl").write_text(json.dumps({"id": "notes", "text": sheet(3)}) + "\n")
    edit_config(corpus, context={"documents": ["a", "b"]})
    refused = spds(["validate", "config.json"], corpus)
    assert refused.returncode != 0 and "document 'README.md': rule 'unique id'" in refused.stderr
    prefixed = [{"path": "a", "prefix": "a/"}, {"path": "b", "prefix": "b/"}, {"path": "more.jsonl", "prefix": "x:"}]
    edit_config(corpus, context={"documents": prefixed})
    check(spds(["validate", "config.json"], corpus))
    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    built = Corpus.build(config, make_tiny.chatml_tokenizer(), None)
    assert [d.id for d in built.documents] == ["a/README.md", "b/README.md", "x:notes"]


def test_a_corpus_of_exactly_the_slice_budget_is_one_slice(corpus):
    """The slices' estimates count what rendering writes (a part's last line without the line break
    rendering strips): a corpus whose rendered text is exactly the budget is one slice, and one
    token less cuts it in two."""
    from spds.contract.gate import load_config
    from spds.data.chat import encode_text
    from spds.data.corpus import Corpus

    tokenizer = make_tiny.chatml_tokenizer()
    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    exact = len(encode_text(tokenizer, Corpus.build(config, tokenizer, None).text(0)))
    assert len(Corpus.build(config, tokenizer, exact).slices) == 1
    assert len(Corpus.build(config, tokenizer, exact - 1).slices) == 2


def minimal_pdf(lines: list[str]) -> bytes:
    """A one-page PDF drawing `lines` in Helvetica: the objects and cross-reference table as the PDF
    1.4 specification lays them out (what any PDF writer emits for plain text)."""
    stream = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({line}) '" for line in lines) + " ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        "/Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n", []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    return out + f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()


def test_html_pdf_and_docx_documents_are_read_as_text_through_the_documents_extra(corpus, monkeypatch):
    """Real files of each kind (an HTML page, a PDF written as the specification lays it out, a
    .docx written by python-docx): each read as its text (the page's links and markup left out);
    without the extra, each refused with the command that installs it; the corpus's digest names
    the library that read them, so an upgrade stops a pinned run."""
    import sys

    import docx

    import spds.contract.documents as documents
    from spds.contract.gate import load_config
    from spds.data.corpus import Corpus

    folder = corpus / "formats"
    folder.mkdir()
    (folder / "page.html").write_text(
        "<html><body><h1>Harbour</h1><p>The harbour closes at <b>dusk</b>. "
        '<a href="https://example.org/tides">Tides</a> vary.</p></body></html>'
    )
    (folder / "manual.pdf").write_bytes(minimal_pdf(["The lighthouse keeper is Ada Berg.", "The lamp turns twice."]))
    written = docx.Document()
    written.add_paragraph("The mill grinds on Tuesdays.")
    written.add_paragraph("Its wheel has twelve paddles.")
    written.save(str(folder / "guide.docx"))
    edit_config(corpus, context={"documents": ["formats", "sheets"]})
    check(spds(["validate", "config.json"], corpus))
    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    text = Corpus.build(config, make_tiny.chatml_tokenizer(), None).text(0)
    assert "## guide.docx\nThe mill grinds on Tuesdays.\nIts wheel has twelve paddles." in text
    assert "## manual.pdf\nThe lighthouse keeper is Ada Berg.\nThe lamp turns twice." in text
    assert "The harbour closes at **dusk**. Tides vary." in text and "example.org" not in text
    pinned = documents.sha256(config)
    monkeypatch.setattr(documents, "extractor", lambda suffix: "pypdf 99")
    assert documents.sha256(config) != pinned
    monkeypatch.undo()
    for module in ("pypdf", "docx", "html2text"):  # the extra not installed: import fails
        monkeypatch.setitem(sys.modules, module, None)
    refused = spds(["validate", "config.json"], corpus)
    for name in ("page.html", "manual.pdf", "guide.docx"):
        assert f"formats/{name}: rule 'a format spds reads'" in refused.stderr, refused.stderr
    assert "pip install 'spds[documents]'" in refused.stderr


def test_a_long_jsonl_document_is_parsed_once_however_many_parts_it_is_cut_into(corpus, monkeypatch):
    """A JSONL document cut into many parts: its line is parsed when read and once more for all
    its parts' texts, not once per part (linear in its size, as a file document is)."""
    import spds.data.corpus as corpus_module
    from spds.contract.gate import load_config

    text = "".join(sheet(j) for j in range(60))
    (corpus / "books.jsonl").write_text(json.dumps({"id": "book", "text": text}) + "\n")
    edit_config(corpus, context={"documents": "books.jsonl"})
    parsed = []
    monkeypatch.setattr(corpus_module, "parse_json", lambda raw: parsed.append(1) or json.loads(raw))
    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    built = corpus_module.Corpus.build(config, make_tiny.chatml_tokenizer(), 400)
    parts = sum(len(s.parts) for s in built.slices)
    assert parts > 10 and len(parsed) == 2, (parts, len(parsed))
    assert "".join(built.part_text(p) for s in built.slices for p in s.parts) == text


def test_indexing_a_corpus_grows_by_its_index_not_by_its_text(corpus):
    """Indexing holds one batch of lines and one slice's text at a time, and a few small objects
    per slice: four times the text (long documents, cut into parts of whole lines) raises its
    peak (Python's own allocations, tracemalloc) by a small share of the text added."""
    from spds.contract.gate import load_config
    from spds.data.corpus import Corpus

    config = load_config(corpus / "config.json", check_pins=False, candidates="unread")
    tokenizer = make_tiny.chatml_tokenizer()
    peaks, sizes = [], []
    for books in (4, 16):
        for extra in (corpus / "sheets").iterdir():
            extra.unlink()
        for i in range(books):
            (corpus / "sheets" / f"book{i:02d}.md").write_text("".join(sheet(1000 * i + j) for j in range(220)))
        sizes.append(sum(p.stat().st_size for p in (corpus / "sheets").iterdir()))
        tracemalloc.start()
        built = Corpus.build(config, tokenizer, 4000)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(built.documents) == books and all(not p.whole for s in built.slices for p in s.parts)
    # a slice of 4,000 tokens is about 4 kB of this text; its index entry a few hundred bytes
    assert peaks[1] - peaks[0] < (sizes[1] - sizes[0]) / 4, (peaks, sizes)
