"""The documents a corpus context names (context.documents): which files they are, and the
corpus's digest (`spds pin` pins it as context.sha256). Reading, checking and slicing them is
spds/data/corpus.py's; what the config names and how it is pinned is the contract's."""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

from spds.contract.digests import remembered_sha256
from spds.errors import SpdsError

MAGIC = set("*?[")  # a documents entry holding one of these is a glob


class CorpusError(SpdsError):
    """A corpus that breaks a rule: every problem found, each naming the file, line or byte and the rule."""


def files(config) -> list[tuple[Path, str]]:
    """(file, the id of the document it is) for each file context.documents names, in order: a file
    is its name; a directory its files under it (sorted, hidden ones skipped), each its path
    relative to the directory; a glob its matches (sorted), each its path relative to the glob's
    fixed part. A JSONL file's documents take their ids from its lines."""
    entries = context_entries(config)
    found, problems = [], []
    for entry in entries:
        path = config.resolve(entry)
        if MAGIC & set(entry):
            root = config.resolve(str(Path(*Path(entry).parts[: _fixed_parts(entry)])))
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                problems.append(f"context.documents: {entry!r} matches no file")
            found += [(match, match.relative_to(root).as_posix()) for match in matches]
        elif path.is_dir():
            under = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
            )
            if not under:
                problems.append(f"context.documents: {path} holds no file")
            found += [(p, p.relative_to(path).as_posix()) for p in under]
        elif path.is_file():
            found.append((path, path.name))
        else:
            problems.append(f"context.documents: {path} is not a file, a directory or a glob that matches")
    if problems:
        raise CorpusError("context.documents: the corpus cannot be read", problems)
    return found


def _fixed_parts(entry: str) -> int:
    """How many of a glob's leading path parts hold no wildcard."""
    parts = Path(entry).parts
    return next((i for i, part in enumerate(parts) if MAGIC & set(part)), len(parts))


def context_entries(config) -> list[str]:
    documents = config.context.documents
    return [documents] if isinstance(documents, str) else list(documents or [])


def sha256(config) -> str:
    """The corpus's digest: each file's name as read and its sha256, in order (what `spds pin` pins
    as context.sha256): a file added, removed, renamed or edited changes it."""
    digest = hashlib.sha256()
    for path, name in files(config):
        digest.update(name.encode() + b"\0" + remembered_sha256(path).encode() + b"\n")
    digest.update((config.context.description or "").encode())
    return digest.hexdigest()
