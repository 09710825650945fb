"""The packed store: every record's exact token ids in one file, plus an index and a manifest.

    tokens.uint32   little-endian uint32 ids of all records, back to back
    index.jsonl     one line per record: identity, offset, length, prefix, insert_at, source
    manifest.json   counts, digests of the two files above, the scaffold, the inputs it came from

The writer builds everything in a hidden sibling directory, fsyncs each file, writes the
manifest last and renames the directory into place: at any instant the store either does not
exist or is complete. The reader keeps the numeric columns of the index in numpy arrays (a
million records cost tens of megabytes, not a million objects) and reads each record's tokens
with pread: a tokens file truncated under a running job is then a clear error naming the file,
where a memory mapping would kill the process with SIGBUS and leave no terminal status. Each
index line carries the CRC-32 of its record's bytes, checked at every read: a tokens file
rewritten in place under a running job (the whole-file sha256 is checked only when the store is
opened) stops the run instead of training on other tokens. Measured on this CPU (zlib): 2.3 GB/s,
0.12 ms for a 64k-token record, against a forward pass of seconds.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fsio import SpdsError, fsync_dir, read_json, sha256_file
from .rows import Record

TOKENS = "tokens.uint32"
INDEX = "index.jsonl"
MANIFEST = "manifest.json"
FORMAT = "spds-packed-v1"


class PackedWriter:
    """Streams records into a hidden directory; `commit(manifest)` makes the store appear whole."""

    def __init__(self, target: Path):
        self.target = target
        self.partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        # Under prepare's lock every partial directory is a leftover of a killed prepare.
        for stale in target.parent.glob(f".{target.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.partial.mkdir(parents=True)
        self.tokens = open(self.partial / TOKENS, "wb")
        self.index = open(self.partial / INDEX, "w")
        self.offset = 0
        self.records = 0
        self.max_length = 0

    def add(self, record: Record, split: str) -> None:
        data = record.ids.astype("<u4", copy=False).tobytes()
        self.tokens.write(data)
        entry = dict(request_id=record.request_id, question_id=record.question_id, sample_index=record.sample_index,
                     offset=self.offset, length=len(record.ids), prefix_tokens=record.prefix_tokens,
                     supervised_tokens=record.supervised_tokens, insert_at=record.insert_at,
                     response_sha256=record.response_sha256, crc32=zlib.crc32(data), added_system=record.added_system,
                     split=split, source=record.source)
        self.index.write(json.dumps(entry) + "\n")
        self.offset += len(record.ids)
        self.records += 1
        self.max_length = max(self.max_length, len(record.ids))

    def close_files(self) -> dict[str, str]:
        for stream in (self.tokens, self.index):
            stream.flush()
            os.fsync(stream.fileno())
            stream.close()
        return {name: sha256_file(self.partial / name) for name in (TOKENS, INDEX)}

    def commit(self, manifest: dict) -> None:
        with open(self.partial / MANIFEST, "w") as stream:
            json.dump(manifest, stream, indent=2)
            stream.flush()
            os.fsync(stream.fileno())
        fsync_dir(self.partial)
        os.replace(self.partial, self.target)
        fsync_dir(self.target.parent)

    def abort(self) -> None:
        for stream in (self.tokens, self.index):
            if not stream.closed:
                stream.close()
        shutil.rmtree(self.partial, ignore_errors=True)


def verify_store(directory: Path) -> dict:
    """Return the manifest after checking both data files against its digests."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise SpdsError(f"{directory}: no packed data (run spds prepare first)")
    manifest = read_json(manifest_path)
    for name, expected in manifest["files"].items():
        actual = sha256_file(directory / name) if (directory / name).exists() else "missing"
        if actual != expected:
            raise SpdsError(f"{directory / name}: packed data changed since prepare "
                            f"(expected sha256 {expected}, actual {actual})")
    return manifest


@dataclass
class PackedStore:
    """Read side: numpy index columns; tokens read per record from an open file."""
    directory: Path
    manifest: dict
    tokens_file: object  # an open binary file (its descriptor is read with os.pread)
    offset: np.ndarray
    length: np.ndarray
    prefix_tokens: np.ndarray
    supervised_tokens: np.ndarray
    insert_at: np.ndarray
    crc32: np.ndarray
    is_train: np.ndarray

    @classmethod
    def open(cls, directory: Path, verify: bool = True) -> "PackedStore":
        directory = Path(directory)
        manifest = verify_store(directory) if verify else read_json(directory / MANIFEST)
        n = manifest["records"]
        columns = {k: np.empty(n, dtype=np.int64)
                   for k in ("offset", "length", "prefix_tokens", "supervised_tokens", "insert_at", "crc32")}
        is_train = np.empty(n, dtype=bool)
        with open(directory / INDEX) as stream:
            for i, line in enumerate(stream):
                entry = json.loads(line)
                if "crc32" not in entry:
                    raise SpdsError(f"{directory}: packed by an older spds (no per-record checksums); run spds prepare "
                                    "again with another data.packed_dir")
                for key, column in columns.items():
                    column[i] = entry[key]
                is_train[i] = entry["split"] == "train"
        tokens_file = open(directory / TOKENS, "rb")
        return cls(directory=directory, manifest=manifest, tokens_file=tokens_file, is_train=is_train, **columns)

    def __len__(self) -> int:
        return len(self.offset)

    def ids(self, i: int) -> np.ndarray:
        size = 4 * int(self.length[i])
        data = os.pread(self.tokens_file.fileno(), size, 4 * int(self.offset[i]))
        if len(data) != size:
            raise SpdsError(f"{self.directory / TOKENS}: record {i} ends past the end of the file (the file was "
                            "truncated or replaced after spds prepare wrote it); run spds prepare again")
        if zlib.crc32(data) != int(self.crc32[i]):
            raise SpdsError(f"{self.directory / TOKENS}: record {i} no longer holds the tokens spds prepare wrote "
                            "(its CRC-32 differs: the file was rewritten after it was packed); run spds prepare again")
        return np.frombuffer(data, dtype="<u4").astype(np.int64)

    def entries(self):
        """Stream the full index lines (identity fields included)."""
        with open(self.directory / INDEX) as stream:
            for line in stream:
                yield json.loads(line)

    @property
    def digest(self) -> str:
        return sha256_file(self.directory / MANIFEST)
