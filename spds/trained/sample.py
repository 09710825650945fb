"""spds sample: see the effect, not only the NLL.

Answers by the student three ways, side by side: bare (nothing where the prompt goes, eval's
floor), with the context's tokens there (eval's ceiling, what the teacher saw), and with the
trained soft prompt, for held-out records (their prompts as packed) or the questions of a file
(rendered by the chat template and placed by training's rule, spds.trained.export.insertion_point).
Greedy decoding, so a rerun gives the same answers. Written to OUTPUT_DIR/samples.jsonl and
samples.md beside eval.json, and printed; `spds eval` includes a few (eval.samples).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from spds.contract.config import Config
from spds.data.chat import encode_text, end_token_ids, render
from spds.data.context import context_text, corpus_of
from spds.data.packed import PackedStore
from spds.data.sources import read_questions
from spds.data.student_files import decodable_ids, load_tokenizer
from spds.errors import SpdsError
from spds.fsio import atomic_writer
from spds.model.kv_prompt import form_of, require_fits
from spds.model.student import load_student
from spds.trained.export import insertion_point, prompt_to_read

VIEWS = ("bare", "context", "soft", "oracle")
TITLES = {
    "bare": "bare student",
    "context": "with the context",  # a corpus past the window: its first slice, the corpus truncated to it
    "soft": "with the soft prompt",
    "oracle": "with the corpus's slice holding the question's document",
}


def prompts_to_answer(config: Config, store: PackedStore, tokenizer, count: int, questions: Path | None):
    """(what is asked, the prompt ids, where the prompt goes) for each question to answer."""
    if questions is not None:
        metadata = {"placement": store.manifest["placement"], "scaffold": store.manifest["scaffold"]}
        kwargs = config.data.chat_template_kwargs
        for question in read_questions(questions)[:count]:
            ids = render(tokenizer, question["messages"], True, kwargs)  # the question's text stays text
            ids, at = insertion_point(ids, metadata)
            yield question["messages"][-1]["content"], ids, at, question.get("doc")
        return
    held_out = np.flatnonzero(~store.is_train)
    if not len(held_out):
        raise SpdsError(
            "no held-out records to answer: set data.eval_fraction > 0 (and prepare a fresh packed_dir) "
            "or pass --questions FILE"
        )
    seen = set()  # a question's samples share its prompt: answer each prompt once
    for i in held_out:
        ids = store.ids(int(i))[: int(store.prefix_tokens[i])].tolist()
        if tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        at = int(store.insert_at[i])
        yield asked_text(tokenizer, ids, at, store.manifest), ids, at, None
        if len(seen) == count:
            return


def asked_text(tokenizer, ids: list[int], at: int, manifest: dict) -> str:
    """The user's question in a packed prompt: the text after its last user header up to that
    turn's end token (not the template's default system text, nor the headers)."""
    header, ends = manifest["scaffold"]["user_header"], set(manifest["end_token_ids"])
    start = at
    for i in range(len(ids) - len(header), at - 1, -1):
        if header and ids[i : i + len(header)] == header:
            start = i + len(header)
            break
    stop = next((i for i in range(start, len(ids)) if ids[i] in ends), len(ids))
    return tokenizer.decode(ids[start:stop], skip_special_tokens=True).strip()


ANSWER_BATCH = 64  # questions decoded together; fixed, so a question's batch is the same on any number of ranks


@torch.no_grad()
def answers(
    config: Config,
    count: int,
    questions: Path | None = None,
    checkpoint: str | None = None,
    max_new_tokens: int = 64,
    student=None,
    ranks: tuple[int, int] = (0, 1),
) -> list[dict]:
    """Each question's greedy answer by each view, in the questions' order, on spds's decoder
    (spds/generation/decode.py: the chat template's header and the view's block computed once as
    a prefix shared by a batch of questions). `ranks` (rank, world): each rank answers every
    world-th batch of ANSWER_BATCH and every rank gets all the rows: the same answers on any
    number of ranks, as a question's batch is."""
    prompt, directory, update = prompt_to_read(config, checkpoint)  # a checkpoint's, or an exported file's
    store = PackedStore.open(config.packed_dir)
    tokenizer = load_tokenizer(config)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    student = student or load_student(
        config.model_path, config.student.dtype, "sdpa", device, config.student.trust_remote_code
    )
    require_fits(prompt, student, directory)
    embed = student.get_input_embeddings()
    hidden = embed.embedding_dim
    # each view: what goes where the prompt goes, and a kv prompt's keys and values (None: none)
    blocks = {"bare": (prompt.new_zeros(0, hidden), None)}
    blocks["soft"] = (prompt.new_zeros(0, hidden), prompt) if form_of(prompt) == "kv" else (prompt, None)
    if context_text(config):
        ids = torch.tensor(encode_text(tokenizer, context_text(config)), device=embed.weight.device)
        blocks["context"] = (embed(ids), None)
    asked = list(prompts_to_answer(config, store, tokenizer, count, questions))
    corpus = corpus_of(config)
    oracle = None
    if corpus is not None and not corpus.whole and any(doc for *_, doc in asked):
        slices = {doc: corpus.holding(doc) for *_, doc in asked if doc}
        missing = sorted(doc for doc, index in slices.items() if index is None)
        if missing:
            raise SpdsError(
                f"{questions}: doc {missing[0]!r}: rule 'a document of the corpus': context.documents holds none"
            )

        def oracle(doc: str):  # the slice holding the document, and its block where the prompt goes, made on call
            ids = lambda: encode_text(tokenizer, corpus.text(slices[doc]))  # noqa: E731 (read once per group)
            return slices[doc], lambda: embed(torch.tensor(ids(), device=embed.weight.device))

    views = Views(student, blocks, tokenizer, config.data.end_tokens, oracle)
    rank, world = ranks
    rows = {}
    for first in range(rank * ANSWER_BATCH, len(asked), world * ANSWER_BATCH):
        batch = asked[first : first + ANSWER_BATCH]
        for offset, answered in enumerate(views.answer(batch, max_new_tokens)):
            rows[first + offset] = dict(question=batch[offset][0], checkpoint=directory, update=update)
            rows[first + offset].update(answered)
    if world > 1:
        shares = [None] * world
        torch.distributed.all_gather_object(shares, rows)
        rows = {number: row for share in shares for number, row in share.items()}
    return [rows[number] for number in range(len(asked))]


class Views:
    """The student answering greedily with each view's block where the prompt goes (and a kv
    prompt's keys and values, spds/model/kv_prompt.py), on spds's
    decoder. The decoder runs the student's own weights under its attention for the length of
    `answer` (transformers reads the attention implementation at every forward: switched and put
    back, as the on-policy sampler does)."""

    def __init__(self, student, blocks: dict, tokenizer, end_tokens, oracle=None):
        from spds.generation.decode import Decoder  # per use: spds sample alone needs no decoder before

        self.student, self.blocks, self.tokenizer = student, blocks, tokenizer
        self.oracle = oracle  # a question's doc -> (its corpus slice, that slice's block made on call); None: no oracle
        self.end_ids = end_token_ids(tokenizer, end_tokens)
        own = student.config._attn_implementation
        rows = student.get_output_embeddings().weight.shape[0]
        self.decoder = Decoder(student, self.end_ids, self.end_ids[0], vocabulary=decodable_ids(tokenizer, rows))
        self.implementations = (own, student.config._attn_implementation)
        student.config._attn_implementation = own

    def answer(self, batch: list[tuple[str, list[int], int, str | None]], max_new_tokens: int) -> list[dict]:
        """For each (question, prompt ids, where the prompt goes, its corpus document): each view's
        answer text (None: a view the config cannot give, the context without one, the oracle for
        a question naming no document). Every view of every question in one decoder batch, each
        row after its own prefix (the ids before the prompt, then the view's block), each prefix
        computed once: the oracle's slices too."""
        answered = [{view: None for view in VIEWS} for _ in batch]
        prefixes, kvs, index = [], [], {}

        def prefix_of(key: tuple, blocked) -> int:  # the prefix's index, made on first use
            if key not in index:
                header = key[0]
                block, kv = blocked() if callable(blocked) else blocked
                embed = self.student.get_input_embeddings()
                head = embed(torch.tensor(header, dtype=torch.long, device=embed.weight.device))
                index[key] = len(prefixes)
                prefixes.append(torch.cat([head, block.to(device=head.device, dtype=head.dtype)]))
                kvs.append(kv.to(head.device) if kv is not None else None)
            return index[key]

        rows, of, where = [], [], []
        for number, (_, ids, at, doc) in enumerate(batch):
            header = tuple(ids[:at])  # a question may bring its own system turn
            views = [(view, (header, view), blocked) for view, blocked in self.blocks.items()]
            if self.oracle is not None and doc:  # each question with its own document's slice
                views.append(
                    ("oracle", (header, "oracle", self.oracle(doc)[0]), lambda d=doc: (self.oracle(d)[1](), None))
                )
            for view, key, blocked in views:
                rows.append(ids[at:])
                of.append(prefix_of(key, blocked))
                where.append((number, view))
        own, decoding = self.implementations
        self.student.config._attn_implementation = decoding
        try:
            ids = self.decoder.answer_with_top_k(
                rows, max_new_tokens, 0.0, 1.0, 0, 0, prefix_embeds=prefixes, prefix_kv=kvs, prefix_of=of
            )[0]
        finally:
            self.student.config._attn_implementation = own
        ends = set(self.end_ids)
        for (number, view), row in zip(where, ids):
            text = self.tokenizer.decode([t for t in row if t not in ends], skip_special_tokens=True).strip()
            answered[number][view] = text
        return answered


def write(out: Path, rows: list[dict]) -> tuple[Path, Path]:
    with atomic_writer(out / "samples.jsonl") as stream:
        stream.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    with atomic_writer(out / "samples.md") as stream:
        stream.write(render_markdown(rows))
    return out / "samples.jsonl", out / "samples.md"


def render_markdown(rows: list[dict]) -> str:
    lines = [f"# Answers at update {rows[0]['update']}" if rows else "# Answers", ""]
    for number, row in enumerate(rows, start=1):
        lines += [f"## {number}. {one_line(row['question'], 200)}", ""]
        lines += [f"**{TITLES[view]}:** {row[view]}\n" for view in VIEWS if row[view] is not None]
    return "\n".join(lines)


def one_line(text: str, width: int) -> str:
    """For the terminal: whitespace collapsed, what cannot be shown as a dot (a random tiny
    student answers in arbitrary bytes), cut to `width`."""
    text = " ".join(text.split())
    text = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def show(rows: list[dict], width: int = 100) -> str:
    """Side by side in the terminal: one block per question."""
    text = []
    for row in rows:
        text += ["─" * width, f"Q: {one_line(row['question'], width - 3)}"]
        text += [f"  {view:8s}│ {one_line(row[view], width - 12)}" for view in VIEWS if row[view] is not None]
    return "\n".join(text)
