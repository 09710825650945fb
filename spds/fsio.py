"""File-system primitives every other module relies on.

Writing: nothing spds writes may be half-written after a crash. Every file goes to a temporary
file of its own (mkstemp, in the same directory: it can clobber nothing), is fsynced, then
renamed over the target (rename is atomic on POSIX), and the directory itself is fsynced so the
rename survives a power loss.

Reading: every file spds reads goes through `open_regular` (a regular file, or a refusal naming
it: a FIFO nobody writes would hang the read, a device would never end) and a size limit, and
every JSON document through `parse_json` (strict RFC 8259, nesting at most MAX_DEPTH deep).

Both halves stay in one module (over 300 lines): they are the one place where spds meets the
file system, and a reviewer of its crash and hostile-input guarantees reads them here alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from spds.errors import SpdsError

CHUNK = 1 << 20
MAX_DOCUMENT_BYTES = 64 << 20  # a config, pins, checkpoint record, context or questions file
MAX_LINE_BYTES = 64 << 20  # one JSONL row: a 64k-token context with top-k log-probs is ~10 MiB
MAX_DEPTH = 64  # nesting of any JSON or YAML value spds reads (its own documents need 6)


def write_failure(path: str | os.PathLike, error: OSError) -> SpdsError:
    """An OSError while writing `path`, as a message a user can act on (what, where, how much room)."""
    path = Path(path)
    message = f"cannot write {path}: {error.strerror or error}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        existing = next((p for p in [path, *path.parents] if p.exists()), None)
        if existing is not None:
            free = shutil.disk_usage(existing).free
            message += f" ({free / 2**20:.1f} MiB free on that file system; free some, or point output_dir elsewhere)"
    elif error.errno == errno.EROFS:
        message += " (a read-only file system: point output_dir at a writable one)"
    return SpdsError(message)


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(value: Any) -> str:
    """Digest of a JSON value in canonical form (sorted keys, no whitespace)."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)  # NaN is not JSON


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; done once, at import, before any thread
    os.umask(mask)
    return mask


UMASK = _read_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path for a library that writes files itself; fsync and rename it over
    `path` only if the block succeeds. The temporary file is new (mkstemp): no file of the user's
    can be replaced by it."""
    path = Path(path)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(descriptor, 0o666 & ~UMASK)  # as open() would have made it, not mkstemp's 0600
        os.close(descriptor)
        temporary = Path(name)
        yield temporary
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
        fsync_dir(path.parent)
    except BaseException as error:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if isinstance(error, OSError):
            raise write_failure(path, error) from None
        raise


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Yield a stream to a temporary file that replaces `path` only if the block succeeds."""
    encoding = None if "b" in mode else "utf-8"  # not the locale's: a C locale cannot write a non-ASCII path
    with atomic_path(path) as temporary, open(temporary, mode, encoding=encoding) as stream:
        yield stream


def atomic_write_json(path: str | os.PathLike, value: Any) -> None:
    with atomic_writer(path) as stream:
        json.dump(value, stream, indent=2, allow_nan=False)
        stream.write("\n")


def append_line_durably(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync it: a metrics line that was printed is also on disk."""
    try:
        with open(path, "a") as stream:
            stream.write(line.rstrip("\n") + "\n")
            stream.flush()
            os.fsync(stream.fileno())
    except OSError as error:
        raise write_failure(path, error) from None


def _refuse_constant(name: str):
    raise ValueError(f"rule 'JSON number': {name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"rule 'JSON number': {text} overflows a 64-bit float")
    return value


def _bounded_int(text: str) -> int:
    """An integer of at most 30 digits: an id or count far beyond any vocabulary is still named by
    the row checks; one of hundreds of digits (which no consumer could convert) is a rule here."""
    digits = len(text.lstrip("-"))
    if digits > 30:
        raise ValueError(f"rule 'JSON number': an integer of {digits} digits; no number spds reads has more than 30")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"rule 'unique keys': key {key!r} appears twice in one object (which one was meant?)")
        for text in (key, value) if isinstance(value, str) else (key,):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"rule 'UTF-8 text': {('key' if text is key else 'the value of ' + repr(key))} "
                    "holds a lone surrogate escape (\\ud800-\\udfff), which is no character"
                ) from None
        seen[key] = value
    return seen


def parse_json(data: str | bytes) -> Any:
    """JSON as RFC 8259 has it, strictly: UTF-8, no NaN or Infinity, no key twice in one object,
    no lone surrogates, nesting at most MAX_DEPTH deep. Python's json accepts the first four
    silently (the last duplicate wins) and overflows its stack on deep nesting (documents are held
    to MAX_DEPTH by read_json; a row's depth is the schema's to judge). A violation raises
    ValueError (json.JSONDecodeError for syntax) naming the rule."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            hint = " (UTF-16? save it as UTF-8)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
            raise ValueError(f"rule 'UTF-8 text': byte {error.start} is not UTF-8{hint}") from None
    try:
        return json.loads(
            data,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise ValueError("rule 'nesting depth': arrays and objects nest deeper than the parser can follow") from None


def value_depth(value: Any) -> int:
    """How deep lists and dicts nest in a parsed value (iteratively: no recursion to overflow)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def open_regular(path: str | os.PathLike):
    """A binary stream on `path` if it is a regular file (symlinks followed); an SpdsError naming
    the path otherwise. Opened without blocking, so a FIFO with no writer is refused, not waited on."""
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SpdsError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise SpdsError(f"{path}: is a directory, not a file") from None
    except OSError as error:
        raise SpdsError(f"{path}: cannot read: {error.strerror}") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        if stat.S_ISDIR(mode):
            raise SpdsError(f"{path}: is a directory, not a file")
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise SpdsError(f"{path}: is {kind}, not a regular file; spds reads regular files only")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def read_bytes(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES) -> bytes:
    """A regular file's bytes (at most `limit`), or an SpdsError naming the path and what is wrong."""
    path = Path(path)
    with open_regular(path) as stream:
        try:
            data = stream.read(limit + 1)
        except OSError as error:
            raise SpdsError(f"{path}: cannot read: {error.strerror}") from None
    if len(data) > limit:
        raise SpdsError(f"{path}: larger than {limit >> 20} MiB, the limit for a file of this kind")
    return data


def document_lines(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a JSONL document spds reads whole (a questions file): every line and
    the whole file bounded, refused by name past `limit` before the lines are kept."""
    path = Path(path)
    with open_regular(path) as stream:
        if os.fstat(stream.fileno()).st_size > limit:
            raise SpdsError(f"{path}: larger than {limit >> 20} MiB, the limit for a file of this kind")
        read = 0
        for number, line in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), start=1):
            read += len(line)
            if read > limit:  # it grew while read
                raise SpdsError(f"{path}: larger than {limit >> 20} MiB, the limit for a file of this kind")
            yield number, line


def read_text(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES) -> str:
    """A regular file's UTF-8 text, or an SpdsError naming the path and the first bad byte."""
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpdsError(f"{path}: rule 'UTF-8 text': byte {error.start} is not UTF-8") from None


def read_json(path: str | os.PathLike) -> Any:
    """A JSON document (a config, pins, a record spds wrote): bounded in size and depth."""
    path = Path(path)
    data = read_bytes(path)
    try:
        value = parse_json(data)
    except json.JSONDecodeError as error:
        raise SpdsError(f"{path}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") from None
    except ValueError as error:
        raise SpdsError(f"{path}: {error}") from None
    if value_depth(value) > MAX_DEPTH:
        raise SpdsError(f"{path}: rule 'nesting depth': arrays and objects nest deeper than {MAX_DEPTH} levels")
    return value


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str = "", wait: bool = False, remove: bool = False) -> Iterator[None]:
    """Hold an exclusive flock on `path`, released by the kernel if the holder dies (it never goes
    stale). A directory is locked itself: a user deleting files under a running job cannot free
    it. A lock file is created if missing; with `remove`, its holder (and only its holder, still
    holding it) removes it at the end: a refused process that unlinked it would let a third
    start beside the holder. Without `wait`, a second holder gets a clear error naming `what`."""
    path = Path(path)
    while True:
        if path.is_dir():
            descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(descriptor)
            raise SpdsError(f"{what} is already running (lock held on {path})") from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(descriptor).st_ino:
            break
        os.close(descriptor)  # a holder removed the file we locked as it finished: lock the new one
    try:
        yield
    finally:
        if remove and not path.is_dir():
            path.unlink(missing_ok=True)
        os.close(descriptor)  # releases the flock


def verified_copy(source_dir: Path, files: list[str], target_dir: Path, receipt_name: str = "receipt.json") -> dict:
    """Copy `files` from source_dir to target_dir through a temporary directory, compare every
    sha256, then rename into place and write a receipt. A target that already exists must hold
    identical files (a backup never silently overwrites a different one)."""
    digests = {name: sha256_file(source_dir / name) for name in files}
    if target_dir.exists():
        for name, expected in digests.items():
            if not (target_dir / name).exists() or sha256_file(target_dir / name) != expected:
                raise SpdsError(f"backup {target_dir} exists but {name} differs from {source_dir / name}")
    else:
        temporary = target_dir.with_name(f".{target_dir.name}.partial")
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        for name in files:
            (temporary / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_dir / name, temporary / name)
            if sha256_file(temporary / name) != digests[name]:
                raise SpdsError(f"backup copy of {source_dir / name} does not match its source")
        os.replace(temporary, target_dir)
        fsync_dir(target_dir.parent)
    receipt = {"status": "verified", "source": str(source_dir), "target": str(target_dir), "files": digests}
    atomic_write_json(target_dir / receipt_name, receipt)
    return receipt
