"""What a run is: the identities a checkpoint and the smoke evidence are bound to.

A run's identity is five digests: the code (spds and its schemas), the config fields that shape
the trained prompt (Config.identity), the packed data, the topology of the global batch, and
the student's weights. A checkpoint resumes only under the same config, data, topology and
student; `spds train` starts only after a smoke passed under the same config, data and student.
Other code (spds upgraded between a preemption and its resume) is accepted, announced and
recorded, unless train.require_same_code: bit-exactness is promised for identical code only.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from spds import __version__
from spds.contract.config import Config
from spds.contract.digests import sha256_path
from spds.contract.schema import PACKAGE_ROOT, SCHEMA_DIR, describe_errors
from spds.data.packed import PackedStore
from spds.errors import SpdsError
from spds.fsio import read_json, sha256_json


def code_digest() -> str:
    """spds's sources and schemas, byte for byte: what "identical code" means, wherever installed."""
    files = sorted([*PACKAGE_ROOT.rglob("*.py"), *SCHEMA_DIR.glob("*.json")])
    return sha256_json({p.relative_to(PACKAGE_ROOT).as_posix(): p.read_bytes().hex() for p in files})


def refusing_keys(saved: dict, current: dict, require_same_code: bool) -> list[str]:
    """The identities that refuse a resume (or smoke evidence): every one that differs, the code
    only under require_same_code."""
    return [
        key
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key) and (key != "code" or require_same_code)
    ]


def code_change(what: str, path, saved_identities: dict, saved_versions: dict, identities: dict) -> dict | None:
    """The record of continuing from `what` (a checkpoint, smoke evidence) written by other spds
    code, announced on stderr; None when the code is the same."""
    if saved_identities.get("code") == identities["code"]:
        return None
    change = dict(
        what=what,
        path=str(path),
        saved_code=saved_identities.get("code"),
        code=identities["code"],
        saved_spds=(saved_versions or {}).get("spds"),
        spds=__version__,
    )
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        print(
            f"spds: continuing from {what} {path}, written by other spds code (spds {change['saved_spds']}, code "
            f"{str(change['saved_code'])[:12]}; now spds {__version__}, code {identities['code'][:12]}): the run "
            "goes on, but is bit-exact only under identical code (train.require_same_code: true refuses this)",
            file=sys.stderr,
        )
    return change


def run_identities(config: Config, store: PackedStore, world: int) -> dict:
    optim = config.optim
    topology = dict(
        world_size=world,
        micro_batch=optim.micro_batch,
        micro_batch_tokens=optim.micro_batch_tokens,
        micro_batch_layout=optim.micro_batch_layout,
        reduction="sum",
    )
    # The student's content, pinned or not: weights changed under an unpinned path must not resume a
    # run trained on others. A pin was verified when the config was loaded; without one, rank 0
    # hashes the files (gigabytes: once per run, not once per rank) and tells the others.
    student = config.student.model_sha256
    if student is None:
        shared = [sha256_path(config.model_path) if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        student = shared[0]
    return dict(
        code=code_digest(), config=config.identity(), data=store.digest, topology=sha256_json(topology), student=student
    )


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("torch", "deepspeed", "transformers", "numpy", "liger-kernel"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["spds"] = __version__  # the code that runs, wherever it was imported from
    return versions


def check_smoke_evidence(config: Config, identities: dict) -> tuple[bool, dict | None]:
    """Train refuses without smoke evidence for this config, data and student (and code, under
    train.require_same_code); returns (waived, the code change accepted or None)."""
    if not config.train.require_smoke:
        return True, None
    path = config.output_dir / "smoke" / "evidence.json"
    if not path.exists():
        raise SpdsError(
            f"no smoke evidence at {path}: run `spds smoke {config.path}` first "
            "(or set train.require_smoke to false; the waiver is recorded in run.json)"
        )
    evidence = read_json(path)
    if describe_errors(evidence, "smoke"):
        raise SpdsError(f"{path}: not smoke evidence spds wrote (schemas/smoke.schema.json): run `spds smoke` again")
    saved = evidence["identities"]
    checked = {k: identities[k] for k in ("code", "config", "data", "student")}  # not the topology
    stale = refusing_keys({k: saved.get(k) for k in checked}, checked, config.train.require_same_code)
    if evidence.get("status") != "passed" or stale:
        raise SpdsError(f"smoke evidence {path} is for another {', '.join(stale) or 'result'}: run `spds smoke` again")
    return False, code_change("smoke evidence", path, saved, evidence.get("versions"), identities)
