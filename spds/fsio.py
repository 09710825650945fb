"""File-system primitives every other module relies on.

Nothing spds writes may be half-written after a crash: every file goes to a temporary name in
the same directory, is fsynced, then renamed over the target (rename is atomic on POSIX), and
the directory itself is fsynced so the rename survives a power loss.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

CHUNK = 1 << 20


class SpdsError(Exception):
    """An error the user can act on; the CLI prints it without a traceback and exits non-zero."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []

    def __str__(self) -> str:
        if not self.problems:
            return super().__str__()
        return super().__str__() + "\n" + "\n".join(f"  - {p}" for p in self.problems)


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


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path for a library that writes files itself; fsync and rename it over
    `path` only if the block succeeds."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield temporary
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
        fsync_dir(path.parent)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise write_failure(path, error) from None
        raise


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Yield a stream to a temporary file that replaces `path` only if the block succeeds."""
    with atomic_path(path) as temporary, open(temporary, mode) as stream:
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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"rule 'unique keys': key {key!r} appears twice in one object (which one was meant?)")
        for text in (key, value) if isinstance(value, str) else (key,):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"rule 'UTF-8 text': {('key' if text is key else 'the value of ' + repr(key))} "
                                 "holds a lone surrogate escape (\\ud800-\\udfff), which is no character") from None
        seen[key] = value
    return seen


def parse_json(data: str | bytes) -> Any:
    """JSON as RFC 8259 has it, strictly: UTF-8, no NaN or Infinity, no key twice in one object,
    no lone surrogates. Python's json accepts all four, silently (the last duplicate wins). A
    violation raises ValueError (json.JSONDecodeError for syntax) naming the rule."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            hint = " (UTF-16? save it as UTF-8)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
            raise ValueError(f"rule 'UTF-8 text': byte {error.start} is not UTF-8{hint}") from None
    return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float,
                      object_pairs_hook=_unique_keys)


def read_bytes(path: str | os.PathLike) -> bytes:
    """A file's bytes, or an SpdsError naming the path and what is wrong with it."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SpdsError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise SpdsError(f"{path}: is a directory, not a file") from None
    except OSError as error:
        raise SpdsError(f"{path}: cannot read: {error.strerror}") from None


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    data = read_bytes(path)
    try:
        return parse_json(data)
    except json.JSONDecodeError as error:
        raise SpdsError(f"{path}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") from None
    except ValueError as error:
        raise SpdsError(f"{path}: {error}") from None


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str = "", wait: bool = False) -> Iterator[None]:
    """Hold an exclusive flock (released by the kernel if the holder dies, so it never goes
    stale). Without `wait`, a second holder gets a clear error naming `what`, not a wait."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise SpdsError(f"{what} is already running (lock held on {path})") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
