"""Self-study: the questions written from the context itself (generate.self_study).

A user with a long document and no question log still needs questions that reach every part of
it: a soft prompt carries only what its training rows make the teacher say. Self-study (as in
Cartridges) has the teacher write them:

  * the context is cut into chunks of about generate.self_study.chunk_tokens of the teacher's
    tokens, a boundary moved to the next line break when one is near, so that a chunk holds whole
    lines (a fact sheet's facts) where the text has them;
  * conversation i gets a chunk and a seed kind (`plan`): the chunks in a seeded order, every
    chunk drawn once before any is drawn twice, and each chunk asked with the kinds in turn (a
    kind of weight w, w times a cycle), so detail questions reach every chunk;
  * the teacher reads the chunk and the kind's instruction and writes one user message
    (`written_question`), its reply already opened with the kind's label ("Question:" or
    "Request:", `OPENINGS`): a small instruct model asked for a question otherwise answers the
    instruction, chats or retells the excerpt more often than it asks; generate then answers
    the message with the whole context, as it answers a questions file;
  * the kind `recite` asks no teacher to write: its user message asks for the document word for
    word from a line's first words, and its answer is the document's own text from that line on
    (`Recital`). A small teacher states a later fact in a few of a thousand answers, and a prompt
    cannot learn a fact its rows never say; a recital states every line of the context, exactly,
    as often as its chunk is drawn. generate scores the given answer with the teacher (its top-k
    at each token, as a sampled answer has) and samples nothing;
  * the kind `fact` has the teacher write the question that one line of the chunk answers (the
    chunk's lines in turn), after worked examples given as earlier turns of the chat
    (`fact_messages`): a small instruct model asked for a question about an excerpt writes an
    unanswerable or unrelated one most of the time, and a prompt trained on no question that a
    fact answers does not state that fact when asked, even where it recites it word for word.

Everything is a function of (context, settings, seed): a rerun writes the same rows, and a
resumed one skips those written.
"""

from __future__ import annotations

import random
import re
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass

from spds.contract.kinds import FACT, OPENINGS, SEED_PROMPTS, UNINSTRUCTED
from spds.contract.settings import SelfStudySettings
from spds.data.chat import encode_text
from spds.errors import SpdsError

EXCERPT = "Here is an excerpt of a document.\n\n{chunk}"
FACT_ASK = 'Write the question that this sentence answers: "{line}"'
# (sentence, question): about nothing in any context, so that no example's answer is mistaken
# for the context's
FACT_EXAMPLES = [
    ("The Vasa bridge is 40 metres long.", "How long is the Vasa bridge?"),
    ("Its designer is Ada Berg.", "Who designed the Vasa bridge?"),
    ("The museum opened in 1961 in Stockholm.", "When did the museum open?"),
]
LIST_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*+\u2022])\s+")  # "8. ", "- ": not part of the sentence
RECITAL_ASKS = [
    'Quote the document word for word from "{start}" on.',
    'What does the document say, word for word, starting at "{start}"?',
    'Repeat the part of the document that begins "{start}".',
]
RECITAL_START_WORDS = 4  # the words of a line's start that a recital's question quotes


@dataclass(frozen=True)
class Chunk:
    start: int  # the teacher's token range of the context, [start, end)
    end: int
    text: str


@dataclass(frozen=True)
class Lines:
    """The context in the teacher's tokens, and where its lines start and end (both sorted, looked
    up by bisection: a long context has thousands of lines, and each recital looks up a few)."""

    ids: list[int]
    starts: list[int]  # the token indices a line starts at: 0 and each one after a line break
    ends: list[int]  # the index after each line: the next line's start, or the context's end

    @classmethod
    def of(cls, tokenizer, context: str) -> Lines:
        ids = encode_text(tokenizer, context)
        if not ids or not context.strip():
            raise SpdsError("context: the context is empty: self-study writes its questions from it")
        breaking = {t: "\n" in tokenizer.decode([t]) for t in set(ids)}  # each distinct token decoded once
        starts = [0, *(i + 1 for i, t in enumerate(ids[:-1]) if breaking[t])]  # a line ends after token i
        return cls(ids, starts, [*starts[1:], len(ids)])

    def end_of(self, index: int) -> int:
        """Where the line holding token `index` ends."""
        return self.ends[bisect_right(self.starts, index) - 1]

    def end_near(self, start: int, size: int) -> int:
        """Where a span of about `size` tokens from `start` ends: just after the first line break
        at or past start + size within half of `size` more, else at start + size; the context's end
        when less than half of `size` would be left after it."""
        end = start + size
        if len(self.ids) - end < size // 2:
            return len(self.ids)
        after = bisect_left(self.starts, end)
        return self.starts[after] if after < len(self.starts) and self.starts[after] < end + size // 2 else end


def cut(tokenizer, lines: Lines, size: int) -> list[Chunk]:
    """The context in consecutive chunks of about `size` tokens, each ending at a line break where
    one is near (Lines.end_near)."""
    if size > len(lines.ids):
        raise SpdsError(
            f"generate.self_study.chunk_tokens: {size} is larger than the context ({len(lines.ids)} tokens "
            "of the teacher's): set it at most the context's length, so that the chunks differ"
        )
    chunks, start = [], 0
    while start < len(lines.ids):
        end = lines.end_near(start, size)
        chunks.append(Chunk(start, end, tokenizer.decode(lines.ids[start:end])))
        start = end
    return chunks


class Slices:
    """The context as self-study reads it, in slices: one (a context, or a corpus within the
    window) or a corpus's (spds/data/corpus.py), each cut into its own chunks, numbered across
    the slices in order. A slice's lines and chunks are computed again when asked after another's
    (one slice is kept): a corpus costs one slice's tokens at a time, not all of its text."""

    def __init__(self, tokenizer, text, count: int, size: int):
        self.tokenizer, self.text, self.count, self.size = tokenizer, text, count, size
        self.kept: tuple[int, Lines, list[Chunk]] | None = None
        self.first = [0]  # slice s's chunks are [first[s], first[s + 1])
        for index in range(count):
            self.first.append(self.first[-1] + len(self.read(index)[1]))

    def read(self, index: int) -> tuple[Lines, list[Chunk]]:
        if self.kept is None or self.kept[0] != index:
            lines = Lines.of(self.tokenizer, self.text(index))
            # a corpus's last slice may be shorter than a chunk: it is then one chunk
            size = self.size if self.count == 1 else min(self.size, len(lines.ids))
            self.kept = (index, lines, cut(self.tokenizer, lines, size))
        return self.kept[1], self.kept[2]

    @property
    def chunks(self) -> int:
        return self.first[-1]

    def holding(self, chunk: int) -> tuple[int, int]:
        """(slice, its own chunk number) of chunk number `chunk`."""
        index = bisect_right(self.first, chunk) - 1
        return index, chunk - self.first[index]


@dataclass(frozen=True)
class Recital:
    """A recite conversation: the user message quoting a line's first words, and the answer, the
    context's own text from that line on: whole lines, from half a chunk to a chunk of them (fewer
    where the next line would pass a chunk; a line longer than a chunk is cut there)."""

    start: int  # the teacher's token range of the context recited, [start, end)
    end: int
    question: str
    text: str


def line_starts(tokenizer, lines: Lines, chunk: Chunk) -> list[int]:
    """Where the chunk's lines start (a line with no words skipped), after the chunk's own start
    where it begins inside a line: every part of the chunk is reached, a long paragraph cut into
    chunks included."""
    first, after = bisect_left(lines.starts, chunk.start), bisect_left(lines.starts, chunk.end)
    inside = [] if first < len(lines.starts) and lines.starts[first] == chunk.start else [chunk.start]
    return [
        start
        for start in [*inside, *lines.starts[first:after]]
        if tokenizer.decode(lines.ids[start : min(lines.end_of(start), chunk.end)]).split()
    ] or [chunk.start]


def recital(tokenizer, lines: Lines, chunk: Chunk, ordinal: int, size: int) -> Recital:
    """The `ordinal`-th recital of `chunk` (counting from 0): it starts at the chunk's lines in
    turn (line_starts), every line asked in one phrasing of RECITAL_ASKS before any in the next."""
    starts = line_starts(tokenizer, lines, chunk)
    round_, line = divmod(ordinal, len(starts))
    start = starts[line]
    # the line ends in (start, start + size]: the first past half a chunk, else the last of them
    low, high = bisect_right(lines.ends, start), bisect_right(lines.ends, start + size)
    past_half = bisect_left(lines.ends, start + size // 2, low, high)
    end = lines.ends[past_half] if past_half < high else lines.ends[high - 1] if high > low else start + size
    text = tokenizer.decode(lines.ids[start:end]).strip()
    words = " ".join(text.split()[:RECITAL_START_WORDS])
    return Recital(start, end, RECITAL_ASKS[round_ % len(RECITAL_ASKS)].format(start=words), text)


@dataclass(frozen=True)
class FactLine:
    """The line a fact conversation's question is written from."""

    start: int  # the teacher's token range of the context, [start, end)
    end: int
    text: str  # the line without its list marker


def fact_line(tokenizer, lines: Lines, chunk: Chunk, ordinal: int, size: int) -> FactLine:
    """The `ordinal`-th fact line of `chunk` (counting from 0): the chunk's lines in turn
    (line_starts), each whole, or its first `size` tokens where it is longer."""
    starts = line_starts(tokenizer, lines, chunk)
    start = starts[ordinal % len(starts)]
    end = min(lines.end_of(start), start + size)
    return FactLine(start, end, LIST_MARKER.sub("", tokenizer.decode(lines.ids[start:end]).strip()))


def fact_messages(line: str) -> list[dict]:
    """What the teacher reads to write a fact question: each worked example as a user turn and
    the assistant's question, then the line in the same words."""
    messages = []
    for sentence, question in FACT_EXAMPLES:
        messages += [
            {"role": "user", "content": FACT_ASK.format(line=sentence)},
            {"role": "assistant", "content": question},
        ]
    return [*messages, {"role": "user", "content": FACT_ASK.format(line=line)}]


@dataclass(frozen=True)
class Seed:
    instruction: str  # what the teacher reads after the chunk
    opening: str  # what its reply starts with ("" for none)


def kinds_of(settings: SelfStudySettings) -> dict[str, Seed]:
    """Each kind the teacher writes for after an instruction, with it (seed_prompts overrides a
    built-in; an unknown kind is refused by validate, spds/contract/checks.py) and its opening;
    fact and recite, which have no instruction, are not among them."""
    prompts = {**SEED_PROMPTS, **settings.seed_prompts}
    return {kind: Seed(prompts[kind], OPENINGS.get(kind, "")) for kind in settings.kinds if kind not in UNINSTRUCTED}


def plan(conversations: int, chunks: int, weights: dict[str, int], seed: int) -> list[tuple[int, str]]:
    """(chunk, kind) of each conversation: the chunks in a new seeded order each round, every chunk
    once a round; chunk c's kind in round r is the cycle's (c + r)-th, so over a cycle's length
    of rounds every chunk is asked with every kind, by weight."""
    cycle = [kind for kind, weight in weights.items() for _ in range(weight)]
    generator = random.Random(seed)  # random.Random's shuffle is the same on every Python 3
    order: list[int] = []
    planned = []
    for i in range(conversations):
        rounds, place = divmod(i, chunks)
        if place == 0:
            order = list(range(chunks))
            generator.shuffle(order)
        chunk = order[place]
        planned.append((chunk, cycle[(chunk + rounds) % len(cycle)]))
    return planned


def written_question(text: str) -> str:
    """The user message from what the teacher wrote: its first line (what follows is most often
    an answer the writer went on to give), outer quotes and a leading "Question:" removed."""
    text = (text.strip().splitlines() or [""])[0].strip()
    for label in ("Question:", "Request:", "Q:"):
        if text.startswith(label):
            text = text[len(label) :].strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text


def coverage(planned: list[tuple[int, str]], chunks: int, slices: int = 1) -> str:
    """One line: how often each chunk and each kind was drawn."""
    per_chunk = Counter(chunk for chunk, _ in planned)
    counts = [per_chunk.get(c, 0) for c in range(chunks)]
    kinds = Counter(kind for _, kind in planned)
    of = f"the context's {slices} slices" if slices > 1 else "the context"
    return f"coverage: {chunks} chunks of {of}, each drawn {min(counts)}-{max(counts)} times; " + ", ".join(
        f"{kind} {count}" for kind, count in kinds.items()
    )


def lines_asked(planned: list[tuple[int, str]], slices: Slices, names: list[str], shown: int = 3) -> str:
    """One line: of the context's lines, how many a fact question is written from (a chunk's n-th
    fact conversation asks its n-th line, fact_line), and the slices read least by that measure,
    each named by `names` (its documents): where a prompt cannot learn what no row states."""
    facts = Counter(chunk for chunk, kind in planned if kind == FACT)
    if not facts:
        return "fact lines asked: none (generate.self_study.kinds has no fact conversations)"
    per_slice = []  # (asked, lines) of each slice
    for index in range(slices.count):
        lines, own = slices.read(index)
        sizes = [len(line_starts(slices.tokenizer, lines, chunk)) for chunk in own]
        first = slices.first[index]
        per_slice.append((sum(min(n, facts.get(first + c, 0)) for c, n in enumerate(sizes)), sum(sizes)))
    asked, total = sum(a for a, _ in per_slice), sum(n for _, n in per_slice)
    line = f"fact lines asked: {asked} of {total} ({asked / max(total, 1):.0%})"
    if slices.count > 1:
        least = sorted(range(slices.count), key=lambda i: (per_slice[i][0] / max(per_slice[i][1], 1), i))[:shown]
        line += "; read least: " + ", ".join(
            f"slice {i} ({names[i]}) {per_slice[i][0]} of {per_slice[i][1]}" for i in least
        )
    if asked < total:
        line += " (more generate.self_study.conversations ask more of them)"
    return line
