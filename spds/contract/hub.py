"""Hugging Face model ids, resolved offline from the local cache; spds never downloads.

`student.model_path`, `student.tokenizer_path` and `generate.teacher_path` may name a hub model
(`Qwen/Qwen3-8B`, or `Qwen/Qwen3-8B@<revision>`: a branch, tag or commit) instead of a directory.
A value that exists as a path (relative to the config's directory) is a path; otherwise one that
looks like an id is looked up with huggingface_hub's own resolution (HF_HOME / HF_HUB_CACHE,
refs, snapshots) with local files only. An id that is not in the cache is refused with the
command that fetches it. `spds pin` then pins the snapshot's content like any directory, so a
cache that changed under a pinned id is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

from spds.errors import SpdsError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def is_hub_id(value: str) -> bool:
    return bool(HUB_ID.match(value)) and not value.startswith(("./", "../", "/", "~"))


def model_directory(value: str, path: Path, key: str) -> Path:
    """`value` as written at config key `key`, `path` its resolution as a path: that path if it
    exists or `value` is no hub id, else the id's cached snapshot."""
    if path.exists() or not is_hub_id(value):
        return path
    return snapshot(value, key)


def snapshot(value: str, key: str) -> Path:
    """The cached snapshot directory of hub id `value` (config key `key`, for messages)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    match = HUB_ID.match(value)
    repo, revision = match.group("repo"), match.group("revision")
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        fetch = f"huggingface-cli download {repo}" + (f" --revision {revision}" if revision else "")
        raise SpdsError(
            f"{key}: {value} is neither a directory nor a model in the local Hugging Face cache "
            f"(HF_HOME / HF_HUB_CACHE); spds never downloads: run `{fetch}` first, or name a "
            "directory"
        ) from None
