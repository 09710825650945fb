"""Where candidate rows come from: a JSONL file, a parquet file or a datasets save_to_disk
directory, streamed a row (or a small batch) at a time, each row with its line or row number so
that every refusal can name the place (RowError). And the two question files a teacher answers:
generate.questions (`read_questions`) and eval.questions (`read_eval_questions`)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from spds.errors import SpdsError
from spds.fsio import MAX_LINE_BYTES, document_lines, open_regular, parse_json, read_json


class RowError(SpdsError):
    """A candidate row that breaks a rule: the message names the file, the line or row, and the rule."""


def json_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row or the error parsing it) of a JSONL file, one line in memory (at
    most MAX_LINE_BYTES: a file with no line breaks is refused, not read whole)."""
    with open_regular(path) as stream:
        number = 0
        while line := stream.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise RowError(f"{path}:{number}: rule 'row size': the line is longer than {MAX_LINE_BYTES >> 20} MiB")
            if not line.strip():
                raise RowError(f"{path}:{number}: rule 'one JSON object per line': blank line")
            try:
                yield number, parse_json(line)
            except ValueError as error:  # JSONDecodeError included: read_records names the line
                error.line = line  # the bytes, for what can still be read of them (the request_id)
                yield number, error


def is_table(path: Path) -> bool:
    return path.is_dir() or path.suffix == ".parquet"


def table_rows(path: Path, batch_rows: int = 256) -> Iterator[tuple[int, dict]]:
    """(row number from 1, row) of a parquet file or a save_to_disk directory, streamed in
    batches of `batch_rows` (memory flat, as for JSONL). Columns a row leaves empty (null) are
    absent from it, as they would be from a JSON line; the schema then judges the row alike."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise SpdsError(
            f"{path}: reading parquet or datasets directories needs pyarrow and datasets (pip install 'spds[datasets]')"
        ) from None
    try:
        if path.is_dir():
            from datasets import load_from_disk

            listed = _listed_data_files(path)
            missing = [name for name in listed if not (path / name).is_file()]
            if missing:
                raise SpdsError(
                    f"{path}: rule 'data files present': state.json lists {', '.join(missing)}, which is missing "
                    "(a partial copy of a datasets save_to_disk directory?)"
                )
            if not any(path.glob("*.arrow")):  # datasets writes no arrow file for a dataset of no rows
                return  # prepare's rule 'rows present' names it
            table = load_from_disk(str(path)).data
            batches = (batch.to_pylist() for batch in table.to_batches(max_chunksize=batch_rows))
        else:
            open_regular(path).close()
            batches = (batch.to_pylist() for batch in parquet.ParquetFile(path).iter_batches(batch_size=batch_rows))
        yield from _numbered(batches)
    except (RowError, SpdsError):
        raise
    except Exception as error:  # pyarrow's and datasets' own errors: a damaged or foreign file
        kind = "a datasets save_to_disk directory" if path.is_dir() else "a parquet file"
        raise RowError(
            f"{path}: rule 'readable table': not readable as {kind}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from None


def _listed_data_files(path: Path) -> list[str]:
    """The arrow files a datasets directory's state.json lists (none when it lists none readably:
    load_from_disk names what else is wrong)."""
    try:
        state = read_json(path / "state.json")
    except SpdsError:
        return []
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list):
        return []
    return [f["filename"] for f in files if isinstance(f, dict) and isinstance(f.get("filename"), str)]


def _numbered(batches) -> Iterator[tuple[int, dict]]:
    number = 0
    for batch in batches:
        for row in batch:
            number += 1
            yield number, {key: value for key, value in row.items() if value is not None}


def read_questions(path: Path) -> list[dict]:
    """generate.questions: each line a question_id and messages (or one question's text)."""
    questions, seen = [], {}
    for number, line in document_lines(path):
        if not line.strip():
            continue
        try:
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"rule 'row size': the line is longer than {MAX_LINE_BYTES >> 20} MiB")
            row = parse_json(line)  # strictly, as every file spds reads
            messages = row.get("messages") or [{"role": "user", "content": row["question"]}]
            question_id = str(row["question_id"])
            if "doc" in row and (not isinstance(row["doc"], str) or not row["doc"]):
                raise ValueError("doc must be a non-empty string")
            users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            if not users or any(not isinstance(u, str) or not u.strip() for u in users):
                raise ValueError("rule 'a question is asked': its user message is empty")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise SpdsError(
                f"{path}:{number}: a question needs question_id and messages or question ({error})"
            ) from None
        if question_id in seen:  # its rows' request_ids would repeat
            raise SpdsError(
                f"{path}:{number}: question_id {question_id!r}: rule 'unique question_id': already used at line "
                f"{seen[question_id]}"
            )
        seen[question_id] = number
        question = dict(question_id=question_id, messages=messages)
        if "doc" in row:  # the corpus document that holds its answer (spds/data/corpus.py)
            question["doc"] = row["doc"]
        questions.append(question)
    return questions


EVAL_OPTIONAL = ("keyword", "answer", "doc")


def read_eval_questions(path: Path) -> list[dict]:
    """The questions of an eval.questions file (spds/trained/questions.py), each checked; an SpdsError
    names the line and rule."""
    questions, seen, first_with = [], {}, {}
    for number, line in document_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = parse_json(line)
        except ValueError as error:
            raise SpdsError(f"{where}: not a JSON object ({error})") from None
        if not isinstance(row, dict):
            raise SpdsError(f"{where}: a question is a JSON object with question_id and question")
        for key in ("question_id", "question", *EVAL_OPTIONAL):
            if key in row and (not isinstance(row[key], str) or not row[key].strip()):
                raise SpdsError(f"{where}: {key} must be a non-empty string")
        for key in ("question_id", "question"):
            if key not in row:
                raise SpdsError(f"{where}: rule 'fields': a question needs {key}")
        if row["question_id"] in seen:
            raise SpdsError(
                f"{where}: question_id {row['question_id']!r}: rule 'unique question_id': "
                f"already used at line {seen[row['question_id']]}"
            )
        seen[row["question_id"]] = number
        for key in EVAL_OPTIONAL:
            if key in row:
                first_with.setdefault(key, number)
        questions.append(dict(row, line=number))
    if not questions:
        raise SpdsError(f"{path}: holds no questions")
    for key, number in first_with.items():
        missing = next((q for q in questions if key not in q), None)
        if missing is not None:
            raise SpdsError(
                f"{path}:{missing['line']}: question_id {missing['question_id']!r} has no {key}, and line "
                f"{number} has one: rule 'every question or none': give every question a {key}, or none"
            )
    return questions
