"""The documents a corpus context names (context.documents): which files they are, and the
corpus's digest (`spds pin` pins it as context.sha256). Reading, checking and slicing them is
spds/data/corpus.py's; what the config names and how it is pinned is the contract's."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from spds.contract.digests import remembered_sha256
from spds.errors import SpdsError

MAGIC = set("*?[")  # a documents entry holding one of these, and naming no existing path, is a glob
# Skipped under a directory or a glob, by name: hidden files and folders, and what editors, version
# control and file browsers leave beside documents (the listing `spds validate` prints names them)
LITTER = ("*~", "#*#", "*.swp", "*.swo", "*.swx", "*.bak", "*.tmp", "*.pyc", "__pycache__", "Thumbs.db", "desktop.ini")


# Documents read as text through a library (spds/data/formats.py; pip install 'spds[documents]'):
# suffix -> (its distribution, the module imported)
CONVERTED = {
    ".html": ("html2text", "html2text"),
    ".htm": ("html2text", "html2text"),
    ".pdf": ("pypdf", "pypdf"),
    ".docx": ("python-docx", "docx"),
}


class CorpusError(SpdsError):
    """A corpus that breaks a rule: every problem found, each naming the file, line or byte and the rule."""


@dataclass
class Listing:
    """What context.documents holds: (file, document id) in order, and what was skipped and why."""

    found: list = field(default_factory=list)  # (path, document id, the entry's id prefix)
    skipped: list = field(default_factory=list)  # (path, why)


def files(config) -> list[tuple[Path, str, str]]:
    """(file, the id of the document it is, its entry's id prefix) for each file context.documents
    names, in order (a JSONL file's documents take their ids from its lines, the prefix before each)."""
    return listing(config).found


def listing(config) -> Listing:
    """The corpus's files, by rule. An entry naming an existing path is that path (a file, or a
    directory's files under it, each named by its path relative to the directory), whatever
    characters it holds; any other entry holding *, ? or [ is a glob (`**` any folders deep), its
    matches named by their path relative to its fixed part. A document is a regular file inside
    its entry's root: a symlink leaving the root, a symlinked folder, a loop, a dangling link, a
    FIFO, socket or device, an unreadable file or folder, a file reached twice, and a file the run
    itself writes or reads as its config or rows are refused, each by its path and rule (with
    context.skip_irregular, skipped and listed instead). Hidden names and editor litter (LITTER)
    under a folder or a glob are skipped and listed. A JSONL file's documents take their ids from
    its lines."""
    result, problems, seen = Listing(), [], {}
    own = own_paths(config)
    skip = config.context.skip_irregular

    def refuse(path: Path, rule: str) -> None:
        if skip:
            result.skipped.append((path, rule))
        else:
            problems.append(f"context.documents: {shown(path)}: {rule}")

    def take(path: Path, name: str, root: Path | None, prefix: str) -> None:
        try:
            real = path.resolve(strict=True)
            state = real.stat()
        except (OSError, RuntimeError) as error:  # dangling, a loop (ELOOP, or pathlib's RuntimeError)
            return refuse(path, f"rule 'a readable regular file': {error.strerror or error}")
        if root is not None and path.is_symlink() and not _inside(real, root.resolve()):
            return refuse(path, f"rule 'inside the corpus's root': a symlink to {shown(real)}, outside {shown(root)}")
        if not stat.S_ISREG(state.st_mode):
            return refuse(path, f"rule 'a regular file': it is {kind(state.st_mode)}")
        if not os.access(real, os.R_OK):
            return refuse(path, "rule 'a readable regular file': permission denied")
        if any(_inside(real, mine) for mine in own):
            return refuse(
                path, "rule 'not the run's own file': this run writes or reads it as its config, rows or outputs"
            )
        try:
            with open(real, "rb") as stream:  # a regular file: opening it cannot block
                binary = b"\0" in stream.read(8192)
        except OSError as error:
            return refuse(path, f"rule 'a readable regular file': {error.strerror or error}")
        if binary and real.suffix.lower() not in CONVERTED:  # git's test: a NUL byte in the first 8 KiB
            return refuse(path, "rule 'a text file': it holds binary data (an image, an archive, a PDF?)")
        if real.suffix.lower() == ".json":
            return refuse(
                path, "rule 'documents as text or JSONL': write a .json file's documents one a line as .jsonl"
            )
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a name from another system: its bytes are no text to name a document by
            return refuse(path, "rule 'a UTF-8 file name': rename it (its bytes are shown escaped)")
        key = (state.st_dev, state.st_ino)
        if key in seen:
            return refuse(path, f"rule 'one file, one document': the same file as {shown(seen[key])}")
        seen[key] = path
        result.found.append((path, prefix + name, prefix))

    def walk(folder: Path, root: Path, pattern: list[str] | None, prefix: str) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as error:
            return refuse(folder, f"rule 'a readable folder': {error.strerror or error}")
        for entry in entries:
            path = Path(entry.path)
            relative = path.relative_to(root).parts
            if entry.name.startswith(".") or any(fnmatch.fnmatchcase(entry.name, g) for g in LITTER):
                result.skipped.append((path, "hidden or editor litter"))
            elif entry.is_dir(follow_symlinks=False):
                walk(path, root, pattern, prefix)
            elif entry.is_symlink() and os.path.isdir(entry.path):
                refuse(path, f"rule 'no symlinked folder': a symlink to {shown(path.resolve())}")
            elif pattern is None or _matches(pattern, list(relative)):
                take(path, "/".join(relative), root, prefix)

    for entry, prefix in context_sources(config):
        path = config.resolve(entry)
        before = len(result.found)
        if path.is_dir():
            walk(path, path, None, prefix)
            if len(result.found) == before:
                problems.append(f"context.documents: {shown(path)} holds no document" + _skipped_note(result, path))
        elif path.exists() or path.is_symlink():
            take(path, path.name, None, prefix)
        elif MAGIC & set(entry):
            fixed = _fixed_parts(entry)
            root = config.resolve(str(Path(*Path(entry).parts[:fixed]))) if fixed else config.resolve(".")
            if root.is_dir():
                walk(root, root, list(Path(entry).parts[fixed:]), prefix)
            if len(result.found) == before:
                problems.append(f"context.documents: {entry!r} matches no file" + _skipped_note(result, root))
        else:
            problems.append(f"context.documents: {shown(path)} is not a file, a directory or a glob that matches")
    if problems:
        raise CorpusError("context.documents: the corpus cannot be read", problems)
    return result


def own_paths(config) -> list[Path]:
    """What the run itself reads or writes beside its documents: its config, its rows, its outputs."""
    paths = [config.path, config.output_dir, config.packed_dir, *config.candidate_paths]
    if config.generate.output:
        output = config.resolve(config.generate.output)
        paths += [output, output.with_name(output.name + ".provenance.json")]
    return [Path(os.path.realpath(p)) for p in paths if p is not None]


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def _matches(pattern: list[str], parts: list[str]) -> bool:
    """Whether the path parts match the glob's parts (`**`: any number of folders, none included)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(pattern[1:], parts[1:])


def _skipped_note(result: Listing, root: Path) -> str:
    skipped = [p for p, _ in result.skipped if _inside(p, root)]
    return f" (it holds only what is skipped: {', '.join(shown(p) for p in skipped[:3])})" if skipped else ""


def shown(path) -> str:
    """A path as a message shows it: its bytes escaped where they are not UTF-8 (a name from another
    system), never an error of its own."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _fixed_parts(entry: str) -> int:
    """How many of a glob's leading path parts hold no wildcard."""
    parts = Path(entry).parts
    return next((i for i, part in enumerate(parts) if MAGIC & set(part)), len(parts))


def extractor(suffix: str) -> str:
    """The library (and version) that reads a converted document's text, or that none is installed."""
    distribution = CONVERTED[suffix][0]
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} not installed"


def context_sources(config) -> list[tuple[str, str]]:
    """(path or glob, the id prefix of its documents) of each context.documents entry: a string,
    or {"path": ..., "prefix": ...} (two folders' README.md files as a/README.md and b/README.md)."""
    documents = config.context.documents
    entries = [documents] if isinstance(documents, str) else list(documents or [])
    return [(e["path"], e["prefix"]) if isinstance(e, dict) else (e, "") for e in entries]


def context_entries(config) -> list[str]:
    return [path for path, _ in context_sources(config)]


def sha256(config) -> str:
    """The corpus's digest: each file's name as read and its sha256, in order (what `spds pin` pins
    as context.sha256): a file added, removed, renamed or edited changes it."""
    digest = hashlib.sha256()
    for path, name, _ in files(config):
        digest.update(name.encode() + b"\0" + remembered_sha256(path).encode() + b"\n")
        if path.suffix.lower() in CONVERTED:  # the text is the library's: its version is part of the corpus
            digest.update(extractor(path.suffix.lower()).encode() + b"\n")
    digest.update((config.context.description or "").encode())
    return digest.hexdigest()
