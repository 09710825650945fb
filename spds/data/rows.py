"""Candidate rows: stream a candidate file (spds/data/sources.py reads it), check every row rule,
yield records ready to pack.

One row is in memory at a time. Every refusal names the file, the line, the request_id and
the rule, so a bad teacher sample is found in seconds in a file of a million. Every row rule
stands in this one module (over 300 lines): a reviewer checks them against
schemas/candidate.schema.json side by side.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from spds.contract.schema import StrictValidator, describe_errors_with, load_schema
from spds.data.chat import Scaffold, render_chat_row
from spds.data.sources import RowError, is_table, json_lines, table_rows


@dataclass
class Record:
    request_id: str
    question_id: str
    sample_index: int
    ids: np.ndarray  # uint32, the whole sequence after scaffold insertion
    prefix_tokens: int
    insert_at: int
    response_sha256: str
    added_system: bool
    source: str  # "file:line"
    top_ids: np.ndarray | None = None  # int32 [supervised tokens, k]: an offline teacher's top-k
    top_logprobs: np.ndarray | None = None  # float32, the same shape
    spans: tuple[tuple[int, int], ...] | None = None  # several supervised runs (assistant turns); None: one

    @property
    def supervised_tokens(self) -> int:
        return supervised_count(self.spans, len(self.ids), self.prefix_tokens)


def supervised_count(spans: tuple | None, length: int, prefix: int) -> int:
    """Tokens the loss counts: every run's, or the one run from the prefix to the end."""
    return sum(end - start for start, end in spans) if spans else length - prefix


@dataclass(frozen=True)
class RowRules:
    """What prepare needs to know to accept, normalise and place a row."""

    scaffold: Scaffold
    placement: str  # "system" | "first_user" | "prefix"
    end_ids: frozenset[int]
    vocab_size: int
    prompt_length: int
    context_limit: int
    template_kwargs: dict
    require_top_k: bool = False  # loss.objective kl or mix with an offline teacher: every row carries top_logprobs
    corpus: object = None  # the config's corpus cut into slices (spds/data/corpus.py): a row's slice is checked


class RowSchema:
    """schemas/candidate.schema.json, applied fast: jsonschema checks the row's shape, numpy checks
    the items of the two long id arrays against the item rules read from the same schema (one
    jsonschema call per id costs ~100x the JSON parse of a 2k-token row)."""

    ARRAYS = ("input_ids", "labels")

    def __init__(self):
        schema = copy.deepcopy(load_schema("candidate"))
        self.item_minimum = {}
        for name in self.ARRAYS:
            items = schema["properties"][name].pop("items")
            assert items.get("type") == "integer" and set(items) <= {"type", "minimum"}, items
            self.item_minimum[name] = items.get("minimum")
        self.shape = StrictValidator(schema)

    def problems(self, row) -> list[str]:
        problems = describe_errors_with(self.shape, row)
        for name in self.ARRAYS:
            values = row.get(name) if isinstance(row, dict) else None
            if not isinstance(values, list) or not values:
                continue
            if set(map(type, values)) != {int}:  # true/false or 2.0 among the ids: numpy would make them 1 or 2
                bad = next(i for i, v in enumerate(values) if type(v) is not int)
                problems.append(f"{name}[{bad}]: {values[bad]!r} is not of type 'integer'")
                continue
            try:
                array = np.asarray(values, dtype=np.int64)
            except OverflowError:
                bad = next(i for i, v in enumerate(values) if not -(2**63) <= v < 2**63)
                problems.append(f"{name}[{bad}]: {values[bad]} is far beyond any vocabulary")
                continue
            if self.item_minimum[name] is not None and array.min() < self.item_minimum[name]:
                bad = int(np.argmax(array < self.item_minimum[name]))
                problems.append(f"{name}[{bad}]: {values[bad]} is less than the minimum of {self.item_minimum[name]}")
        return problems


def _check(condition: bool, rule: str, detail: str) -> None:
    if not condition:
        raise ValueError(f"rule '{rule}': {detail}")


def token_row(row: dict) -> tuple[np.ndarray, int, tuple | None]:
    """(ids, prefix_tokens, spans): the supervised runs are where labels are the ids (every
    assistant turn of a conversation), -100 elsewhere; spans None for the one run to the end."""
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    prefix = row["prefix_tokens"]
    labels = np.asarray(row["labels"], dtype=np.int64)
    _check(prefix < len(ids), "non-empty supervision", f"prefix_tokens {prefix} leaves no response in {len(ids)} ids")
    _check(len(labels) == len(ids), "labels mask", f"labels hold {len(labels)} entries for {len(ids)} input_ids")
    supervised = labels != -100
    wrong = np.flatnonzero(supervised & (labels != ids))
    _check(
        not len(wrong),
        "labels mask",
        f"labels must be -100 or the input_id at each position (first difference "
        f"at position {int(wrong[0]) if len(wrong) else 0})",
    )
    first = int(np.argmax(supervised)) if supervised.any() else len(ids)
    _check(
        first == prefix and not supervised[:prefix].any(),
        "labels mask",
        f"prefix_tokens {prefix} must be the first supervised position (labels first differ from -100 at {first})",
    )
    _check(
        row["supervised_tokens"] == int(supervised.sum()),
        "supervised_tokens consistent",
        f"supervised_tokens {row['supervised_tokens']} != the {int(supervised.sum())} positions labels supervise",
    )
    edges = np.flatnonzero(np.diff(np.concatenate([[False], supervised, [False]]).astype(np.int8)))
    spans = tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))
    return ids, prefix, (spans if len(spans) > 1 or spans[0][1] != len(ids) else None)


def shifted(spans: tuple | None, by: int) -> tuple | None:
    """Supervised runs after `by` tokens were inserted before them (removed, if negative)."""
    return None if spans is None else tuple((start + by, end + by) for start, end in spans)


def place(ids: np.ndarray, prefix: int, rules: RowRules) -> tuple[np.ndarray, int, int, bool]:
    """Where the soft prompt goes in a row: (ids, prefix, insert_at, whether a system message was
    added). The rule for each placement and template kind is spds/data/chat.py's; the same function
    places the prompt at inference (spds.trained.export.insertion_point)."""
    if rules.placement == "prefix":
        return ids, prefix, 0, False
    s = rules.scaffold
    lead = len(s.lead)
    _check(
        ids[:lead].tolist() == s.lead,
        "conversation start",
        f"row does not begin with the template's lead tokens {s.lead}",
    )
    if rules.placement == "first_user":
        at = _find(ids, s.user_header, lead, prefix)
        _check(
            at is not None,
            "conversation start",
            f"no user turn ({s.user_header}) in the row's prompt (its first {prefix} ids)",
        )
        return ids, prefix, at + len(s.user_header), False
    head, close, user = s.system_header, s.system_close, s.user_header
    if ids[lead : lead + len(head)].tolist() == head:
        at = lead + len(head)
        default = s.default_system
        if (
            s.missing_system == "empty"
            and default
            and ids[at : at + len(default) + len(close) + len(user)].tolist() == default + close + user
        ):
            # the template's default system prompt is what a row without a system message holds: the
            # student sees an empty system message instead, the soft prompt alone in it
            ids = np.concatenate([ids[:at], ids[at + len(default) :]])
            return ids, prefix - len(default), at, True
        return ids, prefix, at, False
    # Refuse anything but a user turn rather than insert a system message at a guessed boundary.
    _check(
        ids[lead : lead + len(user)].tolist() == user,
        "conversation start",
        f"after the lead the row must open a system or user turn ({head} or {user}), "
        f"found {ids[lead : lead + len(user)].tolist()}",
    )
    inserted = np.concatenate([ids[:lead], np.asarray(head + close, dtype=np.int64), ids[lead:]])
    return inserted, prefix + len(head) + len(close), lead + len(head), True


def _find(ids: np.ndarray, needle: list[int], start: int, stop: int) -> int | None:
    """The first index >= start where `needle` begins and ends by `stop`, or None."""
    if not needle:
        return start
    first = np.flatnonzero(ids[start : stop - len(needle) + 1] == needle[0]) + start
    return next((int(i) for i in first if ids[i : i + len(needle)].tolist() == needle), None)


def build_record(row: dict, tokenizer, rules: RowRules, source: str) -> Record:
    if "messages" in row:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "rule 'chat template': a chat-form row (messages) is rendered with the student's chat "
                "template, and its tokenizer has none: give rows in token form (input_ids, labels), or "
                "a tokenizer with a template (student.tokenizer_path)"
            )
        ids_list, prefix, spans = render_chat_row(
            tokenizer, row["messages"], row["response"], sorted(rules.end_ids), rules.template_kwargs
        )
        ids = np.asarray(ids_list, dtype=np.int64)
        response_sha256 = hashlib.sha256(row["response"].encode()).hexdigest()
    else:
        ids, prefix, spans = token_row(row)
        response_sha256 = row["response_sha256"]
    _check(
        int(ids.max()) < rules.vocab_size,
        "token ids in vocabulary",
        f"id {int(ids.max())} >= vocabulary size {rules.vocab_size}",
    )
    _check(
        int(ids[-1]) in rules.end_ids,
        "ends with end-of-turn",
        f"last id {int(ids[-1])} is not an end token {sorted(rules.end_ids)}",
    )
    for start, end in spans or ():  # every assistant turn ends its own turn
        _check(
            int(ids[end - 1]) in rules.end_ids,
            "ends with end-of-turn",
            f"the supervised run at {start}..{end - 1} ends with id {int(ids[end - 1])}, not an end token "
            f"{sorted(rules.end_ids)}",
        )
    check_slice(row, rules.corpus)
    supervised = supervised_count(spans, len(ids), prefix)
    _check(
        "top_logprobs" in row or not rules.require_top_k,
        "top-k for an offline teacher",
        "loss.objective is kl or mix with an offline teacher (loss.teacher top_k, or auto without a context), "
        "and this row carries no top_logprobs",
    )
    top_ids, top_logprobs = top_k_of(row["top_logprobs"], supervised, rules) if "top_logprobs" in row else (None, None)
    placed, placed_prefix, insert_at, added = place(ids, prefix, rules)
    ids, prefix, spans = placed, placed_prefix, shifted(spans, placed_prefix - prefix)
    total = len(ids) + rules.prompt_length
    _check(
        total <= rules.context_limit,
        "context limit",
        f"{len(ids)} tokens + {rules.prompt_length} soft-prompt tokens = {total} > "
        f"data.context_limit {rules.context_limit}",
    )
    return Record(
        request_id=row["request_id"],
        question_id=row["question_id"],
        sample_index=row["sample_index"],
        ids=ids.astype(np.uint32),
        prefix_tokens=prefix,
        insert_at=insert_at,
        response_sha256=response_sha256,
        added_system=added,
        source=source,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        spans=spans,
    )


MAX_TOP_K = 64


def check_slice(row: dict, corpus) -> None:
    """A row spds generate wrote over a corpus past the window names the slice its teacher read
    (self_study.slice, or slice for a question's): under a corpus, those documents must still
    render to that text (its sha256): a document edited, cut otherwise or gone since is refused."""
    study = row.get("self_study")
    recorded = row.get("slice", study.get("slice") if isinstance(study, dict) else None)
    if recorded is None or corpus is None:
        return
    documents = recorded.get("documents") if isinstance(recorded, dict) else None
    text = corpus.recorded_text(documents) if isinstance(documents, list) else None
    _check(
        text is not None and hashlib.sha256(text.encode()).hexdigest() == recorded.get("sha256"),
        "the corpus's slice",
        f"the row's teacher read a slice of {documents}, and context.documents "
        + ("holds other text there now" if text is not None else "no longer holds those documents or parts")
        + " (changed since spds generate wrote the row): generate the rows again",
    )


def top_k_of(value: dict, supervised: int, rules: RowRules) -> tuple[np.ndarray, np.ndarray]:
    """The row's top-k teacher log-probabilities as arrays [supervised, k], every rule checked."""
    ids, logprobs = value["ids"], value["logprobs"]
    _check(
        len(ids) == len(logprobs) == supervised,
        "top-k per supervised token",
        f"top_logprobs holds {len(ids)} ids and {len(logprobs)} logprobs lists for {supervised} supervised tokens",
    )
    k = len(ids[0])
    _check(1 <= k <= MAX_TOP_K, "top-k size", f"k = {k}; it must be 1 to {MAX_TOP_K}")
    for name, rows in (("ids", ids), ("logprobs", logprobs)):
        bad = next((t for t, r in enumerate(rows) if len(r) != k), None)
        _check(
            bad is None,
            "top-k rectangular",
            f"top_logprobs.{name}[{bad}] holds {len(rows[bad])} entries, not k = {k}" if bad is not None else "",
        )
    flat_ids = [v for r in ids for v in r]
    bad = next((i for i, v in enumerate(flat_ids) if type(v) is not int), None)
    _check(bad is None, "top-k ids", f"top_logprobs.ids[{bad // k if bad is not None else 0}] holds a non-integer")
    try:
        id_array = np.asarray(flat_ids, dtype=np.int64).reshape(supervised, k)
    except OverflowError:  # beyond int64: beyond any vocabulary
        id_array = np.full((supervised, k), -1, dtype=np.int64)
    _check(
        id_array.min() >= 0 and id_array.max() < rules.vocab_size,
        "top-k ids",
        f"every id must lie in 0 .. {rules.vocab_size - 1}",
    )
    repeated = np.flatnonzero((np.diff(np.sort(id_array, axis=1), axis=1) == 0).any(axis=1))
    _check(not len(repeated), "top-k ids", f"top_logprobs.ids[{repeated[0] if len(repeated) else 0}] repeats an id")
    flat = [v for r in logprobs for v in r]
    bad = next((i for i, v in enumerate(flat) if type(v) not in (int, float)), None)
    _check(
        bad is None, "top-k logprobs", f"top_logprobs.logprobs[{bad // k if bad is not None else 0}] holds a non-number"
    )
    logprob_array = np.asarray(flat, dtype=np.float64).reshape(supervised, k)
    _check(
        bool(np.isfinite(logprob_array).all()),
        "top-k logprobs",
        f"top_logprobs.logprobs[{int(np.argmin(np.isfinite(logprob_array).all(axis=1)))}] holds NaN or infinity",
    )
    _check(
        logprob_array.max() <= 0.0,
        "top-k logprobs",
        f"top_logprobs.logprobs[{int(np.argmax(logprob_array.max(axis=1)))}] holds a log-probability above 0",
    )
    mass = np.exp(logprob_array).sum(axis=1)
    _check(
        mass.max() <= 1.0 + 1e-3,
        "top-k logprobs",
        f"top_logprobs.logprobs[{int(np.argmax(mass))}]: the probabilities sum to {mass.max():.4f} > 1",
    )
    return id_array.astype(np.int32), logprob_array.astype(np.float32)


def readable_request_id(line: bytes) -> str:
    """A line's request_id where the bytes around it decode, else a note that it could not be read."""
    found = re.search(rb'"request_id"\s*:\s*"([^"\\]{1,200})"', line)
    if found:
        try:
            return found.group(1).decode("utf-8")
        except UnicodeDecodeError:
            pass
    return "(could not be read)"


def read_records(path: Path, tokenizer, rules: RowRules) -> Iterator[Record]:
    """Yield one checked Record per row; raise RowError naming file, line (or row), request_id and
    rule. A .jsonl file, a .parquet file, or a directory written by datasets' save_to_disk."""
    schema = RowSchema()
    rows, where = (
        (json_lines(path), "{path}:{number}") if not is_table(path) else (table_rows(path), "{path}: row {number}")
    )
    for number, row in rows:
        request_id = "?"
        try:
            if isinstance(row, Exception):
                if "UTF-8" in str(row):  # the id, where the bytes around it decode
                    request_id = readable_request_id(getattr(row, "line", b""))
                raise row
            if isinstance(row, dict) and isinstance(row.get("request_id"), str):
                request_id = row["request_id"]
            problems = schema.problems(row)
            if problems:
                raise ValueError("rule 'schema' (schemas/candidate.schema.json): " + "; ".join(problems))
            yield build_record(row, tokenizer, rules, f"{path.name}:{number}")
        except json.JSONDecodeError as error:
            raise RowError(
                f"{path}:{number}: rule 'one JSON object per line': {error.msg} at column {error.colno}"
            ) from None
        except ValueError as error:
            raise RowError(f"{where.format(path=path, number=number)}: request_id {request_id}: {error}") from None
