"""The sha256 of spds's inputs (the student, candidate files, a tokenizer), each file's remembered.

Every launch hashed the student more than once: the launcher's `spds validate`, then every
rank's pin check (or rank 0's identity of an unpinned student). An 8B student is 15 GiB: its
hashes were most of a launch's start-up (bench/RESULTS.md, start-up), and on eight ranks eight
concurrent reads of it.

So a file's digest is remembered under its identity: device, inode, size, and modification and
status-change times in nanoseconds, the key git's index uses to skip unchanged files. Writing to
a file changes its mtime and ctime, and ctime cannot be set back from user space (utime sets it
to now), so a file changed in any way is hashed again. A file changed less than RACY_SECONDS
before it was hashed is not remembered: on a file system with a coarse clock, a second write in
the same tick would keep all five numbers.

SPDS_DIGEST_CACHE names the directory (default $XDG_CACHE_HOME/spds/digests, else
~/.cache/spds/digests); "off" hashes every time. A cache that cannot be read or written is
skipped, never an error: it only saves time. Whoever can write to it can also write to the
student, so it lowers no guard the pins had.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spds.errors import SpdsError
from spds.fsio import atomic_writer, sha256_file, sha256_json

RACY_SECONDS = 2.0
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def cache_directory() -> Path | None:
    setting = os.environ.get("SPDS_DIGEST_CACHE", "")
    if setting == "off":
        return None
    if setting:
        return Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spds" / "digests"


def remembered_sha256(path: Path) -> str:
    """sha256 of one file, from the cache when the file is unchanged since it was hashed."""
    directory = cache_directory()
    if directory is None:
        return sha256_file(path)
    status = os.stat(path)
    key = sha256_json([status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns])
    entry = directory / key[:2] / key
    try:
        remembered = entry.read_text()
        if HEX_DIGEST.fullmatch(remembered):
            return remembered
    except (OSError, UnicodeDecodeError):
        pass
    started = time.time_ns()
    digest = sha256_file(path)
    changed = max(status.st_mtime_ns, status.st_ctime_ns)
    if started - changed >= RACY_SECONDS * 1e9 and os.stat(path).st_ctime_ns == status.st_ctime_ns:
        try:
            with atomic_writer(entry) as stream:
                stream.write(digest)
        except (OSError, SpdsError):
            pass  # a read-only home, a full disk: the digest is right, only not remembered
    return digest


def sha256_path(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory: its sorted relative file names and their contents.

    A directory digest changes when any file is added, removed, renamed or edited, so a pinned
    model directory cannot drift silently. A sharded student's files are hashed in parallel
    (hashlib releases the GIL)."""
    path = Path(path)
    if path.is_file():
        return remembered_sha256(path)
    if not path.is_dir():
        raise SpdsError(f"{path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        digests = list(pool.map(remembered_sha256, files))
    digest = hashlib.sha256()
    for file, file_digest in zip(files, digests):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file_digest.encode() + b"\n")
    return digest.hexdigest()
