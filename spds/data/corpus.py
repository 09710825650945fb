"""A corpus as the context (context.documents): many documents, possibly far more than a window.

What a user most wants a prompt to carry is often larger than any window (a manual, a body of
policies, a codebase). So the context may be a corpus: files (a list, a directory, a glob), each
one document named by its path, or JSONL files of documents (`id`, optional `title`, `text`), and
an optional context.description, one paragraph a teacher reads first.

  * Reading streams: a document is read a line at a time and never kept; what is kept per
    document is where it lies (`Source`) and, per part, its line and byte range and its token
    count. A corpus of 10^8 characters costs its index, not its text. Every document is checked
    as it streams (UTF-8, with the file and byte offset; not empty; a unique id), and every
    problem is listed at once (`CorpusError`).
  * A document is rendered as a block: "## " + its title (else its id), a line break, its text;
    blocks are joined by a blank line after the description. The corpus in one window is exactly
    that text: spds reads it as it reads context.file, so a corpus that fits behaves as one file.
  * A corpus past the window is cut into **slices**: the description, then whole documents in
    order, as many as fit `budget` tokens (generate.self_study.slice_tokens, by default what the
    teacher's window leaves after the longest question and answer: spds/data/context.py). A
    document larger than a slice is cut into parts of whole lines; a single line larger than a
    slice is refused. Each slice's token count is then measured exactly on its rendered text (a
    part that tipped it over moves to the next slice), so no slice passes the budget by a token.
    Self-study asks each conversation with the slice that holds its chunk, and eval's oracle view
    reads the slice holding a question's document.
  * The corpus truncated to the window (`truncated`): the description and the documents from the
    first, as many as the window holds; what reads the context whole reads this.
Slices are a fixed partition, not a window re-centred on each chunk: every conversation of a slice
then shares the slice's keys and values in decoding, computed once (spds/generation/decode.py),
where per-chunk windows would prefill a window's positions for every row.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from spds.contract.documents import CONVERTED, CorpusError, files
from spds.data.chat import encode_text, holds_added_token
from spds.data.formats import converted_text
from spds.errors import SpdsError
from spds.fsio import MAX_LINE_BYTES, open_regular, parse_json

SEPARATOR = "\n\n"  # between the description and each block
COUNTED_LINES = 1024  # lines tokenized together (the fast tokenizer's batch; what indexing holds at a time)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a document's text lies, to be read again when a slice needs it."""

    path: Path
    # a JSONL document's line (from 1); None: the whole file is the document; 0: the whole file,
    # converted to text (HTML, PDF, .docx: spds/data/formats.py)
    line: int | None
    offset: int  # that line's byte offset (0 for a file document)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" if self.line else str(self.path)


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    title: str | None
    source: Source

    @property
    def heading(self) -> str:
        return f"## {self.title or self.id}\n"


@dataclass(frozen=True, slots=True)
class Part:
    """A document whole, or whole lines of one too large for a slice."""

    document: int  # its index in Corpus.documents
    lines: tuple[int, int]  # [first, end) of the document's lines (from 0)
    bytes: tuple[int, int] | None  # [start, end) in the file, for a file document (read without the rest)
    tokens: int  # its block's tokens, counted a line at a time: the slicing's estimate
    whole: bool


@dataclass(frozen=True, slots=True)
class Slice:
    parts: tuple[Part, ...]
    tokens: int  # of its rendered text, exactly


JSONL = (".jsonl", ".ndjson")  # a file of documents, one JSON object a line
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: removed where a file starts with one (and said)


def read(config, marked: list | None = None) -> Iterator[tuple[Document, Iterator[tuple[str, int | None]]]]:
    """Each document and its lines (text with its line break, and its byte offset in a file
    document, None in a JSONL one), streamed: a document's lines must be consumed before the next
    document is asked for. A broken rule raises CorpusError after the whole corpus is read, with
    every problem; a document that breaks one is skipped meanwhile. Text is read as written, but
    for a file's leading byte-order mark (removed: `marked` gets the file) and CRLF line ends (LF).
    """
    problems, seen, marked = [], {}, [] if marked is None else marked
    for path, name, prefix in files(config):
        if path.suffix.lower() in JSONL:
            documents = _jsonl_documents(path, problems, marked, prefix)
        elif path.suffix.lower() in CONVERTED:
            try:
                documents = [(Document(name, None, Source(path, 0, 0)), as_written(converted_text(path)))]
            except SpdsError as error:
                problems.append(str(error))
                continue
        else:
            documents = [(Document(name, None, Source(path, None, 0)), None)]
        for document, text in documents:
            if document.id in seen:
                problems.append(
                    f"{document.source}: document {document.id!r}: rule 'unique id': already the id of the document "
                    f"at {seen[document.id]}"
                )
                continue
            seen[document.id] = document.source
            lines = (
                _file_lines(path, problems, marked)
                if text is None
                else ((line, None) for line in text.splitlines(True))
            )
            checked = _not_empty(document, lines, problems)
            yield document, checked
            for _ in checked:  # what the caller left unread, read for its checks
                pass
    if not seen and not problems:
        problems.append("context.documents: the corpus holds no document")
    if problems:
        raise CorpusError("context.documents: the corpus breaks its rules", problems)


def _not_empty(document: Document, lines, problems: list[str]):
    blank, known = True, len(problems)
    for line, offset in lines:
        blank = blank and not line.strip()
        yield line, offset
    if blank and len(problems) == known:  # (a document cut short by a bad byte is named for it)
        problems.append(f"{document.source}: document {document.id!r}: rule 'not empty': it holds no text")


def _file_lines(path: Path, problems: list[str], marked: list) -> Iterator[tuple[str, int]]:
    """A file document's lines, decoded as UTF-8 a line at a time (a line longer than
    MAX_LINE_BYTES is read in pieces of that size), as `as_written` reads them."""
    offset = 0
    with open_regular(path) as stream:
        for number, raw in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES), b""), start=1):
            if offset == 0 and raw.startswith(BOM):
                marked.append(path)
            try:
                line = as_written(raw.decode("utf-8"), offset)
            except UnicodeDecodeError as error:
                problems.append(
                    f"{path}: byte {offset + error.start} (line {number}): rule 'UTF-8 text': not UTF-8 "
                    f"({raw[error.start : error.start + 4]!r})"
                )
                return
            yield line, offset
            offset += len(raw)


def _jsonl_documents(path: Path, problems: list[str], marked: list, prefix: str) -> Iterator[tuple[Document, str]]:
    """The documents of a JSONL file, one a line: an object with id, text and optionally title."""
    offset = 0
    with open_regular(path) as stream:
        for number, raw in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), start=1):
            where, start = f"{path}:{number}", offset
            offset += len(raw)
            if start == 0 and raw.startswith(BOM):  # the mark is no part of the first object
                marked.append(path)
                raw, start = raw[len(BOM) :], len(BOM)
            if len(raw) > MAX_LINE_BYTES:
                problems.append(f"{where}: rule 'row size': the line is longer than {MAX_LINE_BYTES >> 20} MiB")
                return
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                problems.append(f"{where}: byte {start + error.start}: rule 'UTF-8 text': not UTF-8")
                continue
            if not raw.strip():
                continue
            row = _document_row(raw, where, problems)
            if row is not None:
                document = Document(prefix + row["id"], row.get("title"), Source(path, number, start))
                yield document, as_written(row["text"])


def as_written(text: str, offset: int = 1) -> str:
    """Document text as spds reads it: CRLF line ends as LF, and a byte-order mark at the start of
    a file (`offset` 0) removed."""
    return (text[1:] if offset == 0 and text.startswith("\ufeff") else text).replace("\r\n", "\n")


def _document_row(raw: bytes, where: str, problems: list[str]) -> dict | None:
    """A JSONL line as a document: `id` (a string, or an integer, read as its digits), `text` (a
    non-empty string) and optionally `title` (a string; empty: none). Other fields (an export's
    `url`, `meta`) are allowed and never read."""
    try:
        row = parse_json(raw)  # strictly: a lone surrogate escape (no character) is refused here too
    except ValueError as error:
        problems.append(f"{where}: rule 'one JSON object per line': {error}")
        return None
    if not isinstance(row, dict):
        problems.append(f"{where}: rule 'document fields': a document is an object with id, text and optionally title")
        return None
    wrong = []
    if isinstance(row.get("id"), int) and not isinstance(row.get("id"), bool):
        row["id"] = str(row["id"])
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        wrong.append("id must be a non-empty string or an integer")
    if not isinstance(row.get("text"), str) or not row["text"].strip():
        wrong.append("text must be a non-empty string")
    if "title" in row and row["title"] is not None and not isinstance(row["title"], str):
        wrong.append("title must be a string")
    if wrong:
        name = f"document {row['id']!r}: " if isinstance(row.get("id"), str) else ""
        problems.append(f"{where}: {name}rule 'document fields': " + "; ".join(wrong))
        return None
    if not (row.get("title") or "").strip():
        row.pop("title", None)  # an empty title: the id heads the document
    return row


def count_lines(tokenizer, lines: list[str]) -> list[int]:
    """Each line's tokens as user text (chat.encode_text), the ordinary lines in one batch."""
    plain = [i for i, line in enumerate(lines) if not holds_added_token(tokenizer, line)]
    counts = [0] * len(lines)
    if plain:
        encoded = tokenizer([lines[i] for i in plain], add_special_tokens=False)["input_ids"]
        for i, ids in zip(plain, encoded):
            counts[i] = len(ids)
    for i in set(range(len(lines))) - set(plain):
        counts[i] = len(encode_text(tokenizer, lines[i]))
    return counts


@dataclass
class Corpus:
    """The corpus's documents, cut into slices of at most `budget` tokens (None: one slice, the
    whole corpus, for a teacher with no declared window, which validate refuses anyway)."""

    description: str | None
    documents: list[Document]
    slices: list[Slice]
    budget: int | None
    tokenizer: object = field(repr=False)
    overhead: int = 0  # the description's tokens and its separator
    window: Slice | None = None  # the corpus truncated to the teacher's window (`truncated`)
    _first_slice: dict | None = field(default=None, repr=False)  # document id -> the first slice holding it
    _records: dict = field(default_factory=dict, repr=False)  # slice index -> its record
    _parts: dict | None = field(default=None, repr=False)  # a part's name in a record -> the part
    marked: list = field(default_factory=list)  # the files whose byte-order mark was removed
    # the last JSONL or converted document read, in lines: (its source, its lines)
    _document_lines: tuple | None = field(default=None, repr=False)

    @classmethod
    def build(cls, config, tokenizer, budget: int | None, window: int | None = None) -> Corpus:
        """Slices of at most `budget` tokens; `window`: the most the teacher's window holds (the
        truncated view; `budget` where None)."""
        description = (config.context.description or "").strip() or None
        overhead = len(encode_text(tokenizer, description + SEPARATOR)) if description else 0
        cap = None if budget is None else budget - overhead
        if cap is not None and cap < 16:  # every slice opens with the description
            raise CorpusError(
                "context.description: the corpus cannot be sliced",
                [
                    f"context.description: {overhead} tokens, and a slice holds {budget} "
                    "(generate.self_study.slice_tokens, or what the teacher's window leaves): the description "
                    "opens every slice and must leave room for documents; shorten it"
                ],
            )
        documents, parts, marked = [], [], []
        for document, lines in read(config, marked):
            documents.append(document)
            parts += _parts(len(documents) - 1, document, lines, tokenizer, cap)
        corpus = cls(description, documents, [], budget, tokenizer, overhead, marked=marked)
        corpus.slices = corpus._sliced(parts, budget)
        window = budget if window is None or budget is None else max(window, budget)
        corpus.window = corpus.slices[0] if window == budget else corpus._sliced(parts, window, first=True)[0]
        return corpus

    def _sliced(self, parts: list[Part], budget: int | None, first: bool = False) -> list[Slice]:
        """Greedy in order by the parts' estimates, then each slice measured exactly; a slice over
        the budget gives its last part to the next one. `first`: the first slice alone."""
        groups, current, tokens = [], [], self.overhead
        join = len(encode_text(self.tokenizer, SEPARATOR))
        for part in parts:
            if current and budget is not None and tokens + join + part.tokens > budget:
                groups.append(current)
                if first:
                    break
                current, tokens = [], self.overhead
            tokens += (join if current else 0) + part.tokens
            current.append(part)
        else:
            groups.append(current)
        slices, i = [], 0
        while i < len(groups) and not (first and slices):
            group = groups[i]
            exact = len(encode_text(self.tokenizer, self.text_of(group)))
            if budget is not None and exact > budget:
                if len(group) == 1:
                    part = group[0]
                    raise CorpusError(
                        f"{self.documents[part.document].source}: document {self.documents[part.document].id!r}, "
                        f"lines {part.lines[0] + 1}-{part.lines[1]}: {exact} tokens alone, past a slice's "
                        f"{budget}: rule 'a part fits a slice': raise generate.self_study.slice_tokens"
                    )
                if i + 1 == len(groups):
                    groups.append([])
                groups[i], groups[i + 1] = group[:-1], [group[-1], *groups[i + 1]]  # measured again in turn
                continue
            slices.append(Slice(tuple(group), exact))
            i += 1
        return slices

    @property
    def whole(self) -> bool:
        """The corpus in one slice: read whole, as one context file is."""
        return len(self.slices) == 1

    @property
    def truncates(self) -> bool:
        """Whether the teacher's window holds less than the whole corpus."""
        return len(self.window.parts) < sum(len(s.parts) for s in self.slices)

    @property
    def truncated(self) -> str:
        """The corpus truncated to the teacher's window: the description and the documents from
        the first, as many as the window holds after the longest question and answer (what a
        model reading the corpus in context can read)."""
        return self.text_of(self.window.parts)

    def text(self, index: int) -> str:
        """Slice `index`'s rendered text (the whole corpus's for one slice)."""
        return self.text_of(self.slices[index].parts)

    @functools.cached_property
    def tokens(self) -> int:
        """The whole corpus's tokens, rendered as one text (the description once): what its KV cache
        holds, and what a prompt started from it can read. Counted when asked (init's sizing, a
        prompt started from it), a slice at a time; the separators between slices are counted too."""
        join = len(encode_text(self.tokenizer, SEPARATOR)) * (len(self.slices) - 1)
        return sum(len(encode_text(self.tokenizer, text)) for text in self.slice_texts()) + join

    def slice_texts(self) -> Iterator[str]:
        """Each slice's text in turn, the description only in the first's (every slice's text opens
        with it): joined by SEPARATOR, the whole corpus as one text. One slice's text at a time."""
        opening = self.description + SEPARATOR if self.description else ""
        for index in range(len(self.slices)):
            yield self.text(index) if index == 0 else self.text(index).removeprefix(opening)

    def text_of(self, parts) -> str:
        blocks = [self.documents[p.document].heading + self.part_text(p).rstrip() for p in parts]
        return SEPARATOR.join([self.description, *blocks] if self.description else blocks)

    def part_text(self, part: Part) -> str:
        source = self.documents[part.document].source
        if source.line is None:  # a file's part: its byte range
            with open_regular(source.path) as stream:
                stream.seek(part.bytes[0])
                return as_written(stream.read(part.bytes[1] - part.bytes[0]).decode("utf-8"), part.bytes[0])
        # a JSONL or converted document's part: its lines, the document parsed once for all its
        # parts in a row (parsed again per part, a 6 MiB document cut in hundreds of parts took minutes)
        if self._document_lines is None or self._document_lines[0] != (source.path, source.offset):
            if source.line == 0:
                text = as_written(converted_text(source.path))
            else:
                with open_regular(source.path) as stream:
                    stream.seek(source.offset)
                    text = as_written(parse_json(stream.readline(MAX_LINE_BYTES + 1))["text"])
            self._document_lines = ((source.path, source.offset), text.splitlines(True))
        return "".join(self._document_lines[1][part.lines[0] : part.lines[1]])

    def holding(self, document_id: str) -> int | None:
        """The first slice that holds the document (its first part), None for no such document."""
        if self._first_slice is None:
            self._first_slice = {}
            for index, piece in enumerate(self.slices):
                for part in piece.parts:
                    self._first_slice.setdefault(self.documents[part.document].id, index)
        return self._first_slice.get(document_id)

    def ids(self) -> set[str]:
        return {d.id for d in self.documents}

    def record(self, index: int) -> dict:
        """What a row records of the slice its teacher read: its index, each part's document id
        (with its line range where the part is not the whole document), its tokens and the sha256
        of its text (`recorded_text` renders it again from the ids)."""
        if index not in self._records:
            parts = self.slices[index].parts
            self._records[index] = dict(
                index=index,
                documents=[
                    self.documents[p.document].id if p.whole else [self.documents[p.document].id, *p.lines]
                    for p in parts
                ],  # fmt: skip
                tokens=self.slices[index].tokens,
                sha256=hashlib.sha256(self.text_of(parts).encode()).hexdigest(),
            )
        return self._records[index]

    def recorded_text(self, documents: list) -> str | None:
        """The text of a slice a row names by its parts (`record`'s documents), rendered from this
        corpus; None where it holds no such document or part."""
        if self._parts is None:
            self._parts = {}
            for piece in self.slices:
                for p in piece.parts:
                    name = self.documents[p.document].id
                    self._parts[name if p.whole else (name, *p.lines)] = p
        keys = [name if isinstance(name, str) else tuple(name) for name in documents]
        if not all(isinstance(key, (str, tuple)) and key in self._parts for key in keys):
            return None
        return self.text_of([self._parts[key] for key in keys])

    def summary(self) -> str:
        """One line: the documents, the slices and their sizes, and what the window's view holds."""
        sizes = [s.tokens for s in self.slices]
        held = sum(len(s.parts) for s in self.slices)
        window = f"; the window's view holds {len(self.window.parts)} of its {held} parts" if self.truncates else ""
        marks = (
            f"; a byte-order mark removed from {len(self.marked)} files ({self.marked[0]}, ...)" if self.marked else ""
        )
        return (
            f"corpus: {len(self.documents)} documents in {len(self.slices)} slices of {min(sizes)}-{max(sizes)} "
            f"tokens (at most {self.budget}){window}{marks}"
        )


def _parts(index: int, document: Document, lines, tokenizer, cap: int | None) -> list[Part]:
    """A document's parts: whole, or groups of whole lines each within `cap` tokens with its heading."""
    heading = len(encode_text(tokenizer, document.heading))
    parts, first, tokens, start, number, last = [], 0, heading, 0, 0, ("", 0)
    pending: list[tuple[str, int | None]] = []

    def trailing(line: str, count: int) -> int:
        """The tokens of a line's trailing whitespace: rendering strips a part's last line's (its
        line break), so a part's tokens count its last line without them."""
        return count - count_lines(tokenizer, [line.rstrip()])[0] if line != line.rstrip() else 0

    def flush(batch):
        nonlocal first, tokens, start, number, last
        for (line, offset), count in zip(batch, count_lines(tokenizer, [line for line, _ in batch])):
            if cap is not None and heading + count > cap:
                raise CorpusError(
                    f"{document.source}: document {document.id!r}, line {number + 1}: {count} tokens, more than a "
                    f"slice holds ({cap} after the description and heading): rule 'a line fits a slice': break the "
                    "line, or raise generate.self_study.slice_tokens"
                )
            # the line fits as the part's last (its line break stripped), or the part ends before it
            if (
                cap is not None
                and number > first
                and tokens + count > cap
                and tokens + count - trailing(line, count) > cap
            ):
                held = tokens - trailing(*last)
                parts.append(Part(index, (first, number), None if offset is None else (start, offset), held, False))
                first, tokens, start = number, heading, offset if offset is not None else 0
            tokens += count
            number += 1
            last = (line, count)

    for line in lines:
        pending.append(line)
        if len(pending) == COUNTED_LINES:
            flush(pending)
            pending = []
    flush(pending)
    # a file document's last part runs to the file's end (its lines' bytes as written, not as read:
    # a byte-order mark and CRLF ends are longer on disk than in the text)
    end = document.source.path.stat().st_size if document.source.line is None else None
    held = tokens - trailing(*last)
    parts.append(Part(index, (first, number), None if end is None else (start, end), held, not parts))
    return parts
