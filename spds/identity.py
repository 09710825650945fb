"""What a run is: the identities a checkpoint and the smoke evidence are bound to.

A run's identity is five digests: the code (spds and its schemas), the config fields that shape
the trained prompt (Config.identity), the packed data, the topology of the global batch, and
the student's weights. A checkpoint resumes only under the same five; `spds train` starts only
after a smoke passed under the same code, config, data and student.
"""
from __future__ import annotations

import importlib.metadata
import platform

import torch

from .contract import REPO_ROOT, Config
from .data.packed import PackedStore
from .digests import sha256_path
from .fsio import SpdsError, read_json, sha256_json


def code_digest() -> str:
    files = sorted([*(REPO_ROOT / "spds").rglob("*.py"), *(REPO_ROOT / "schemas").glob("*.json")])
    return sha256_json({str(p.relative_to(REPO_ROOT)): p.read_bytes().hex() for p in files})


def run_identities(config: Config, store: PackedStore, world: int) -> dict:
    optim = config.optim
    topology = dict(world_size=world, micro_batch=optim.micro_batch, micro_batch_tokens=optim.micro_batch_tokens,
                    micro_batch_layout=optim.micro_batch_layout, reduction="sum")
    # The student's content, pinned or not: weights changed under an unpinned path must not resume a
    # run trained on others. A pin was verified when the config was loaded; without one, rank 0
    # hashes the files (gigabytes: once per run, not once per rank) and tells the others.
    student = config.student.model_sha256
    if student is None:
        shared = [sha256_path(config.model_path) if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        student = shared[0]
    return dict(code=code_digest(), config=config.identity(), data=store.digest, topology=sha256_json(topology),
                student=student)


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("spds", "torch", "deepspeed", "transformers", "numpy", "liger-kernel"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def check_smoke_evidence(config: Config, identities: dict) -> bool:
    """Train refuses without smoke evidence for this code, config and data; returns True if waived."""
    if not config.train.require_smoke:
        return True
    path = config.output_dir / "smoke" / "evidence.json"
    if not path.exists():
        raise SpdsError(f"no smoke evidence at {path}: run `spds smoke {config.path}` first "
                        "(or set train.require_smoke to false; the waiver is recorded in run.json)")
    evidence = read_json(path)
    stale = [k for k in ("code", "config", "data", "student") if evidence.get("identities", {}).get(k) != identities[k]]
    if evidence.get("status") != "passed" or stale:
        raise SpdsError(f"smoke evidence {path} is for another {', '.join(stale) or 'result'}: run `spds smoke` again")
    return False
