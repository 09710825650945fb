"""Checkpoints that resume bit-exactly, and that exist only once committed. This module owns the
whole concern: when to save (Checkpointer), the files and their commit, verification, restore,
the smoke's proof that a restore is exact, retention, backup, and the read side that eval and
export use (checkpoint_to_read, prompt_of). It is longer than most modules on purpose: the write
side and the read side of the commit protocol are one contract, and are checked against each
other by reading them together.

A checkpoint directory  <output>/checkpoints/update-NNNNNN/  holds
    mp_rank_00_model_states.pt   DeepSpeed's save_checkpoint(exclude_frozen_parameters=True):
                                 the prompt, Adam moments and step, the LR scheduler (no backbone)
    rank-RRRRR.pt                each rank's RNG states (python, numpy, torch CPU, CUDA) and
                                 data cursor, written by that rank (temp file, fsync, rename)
    commit.json                  written last by rank 0 after every other file is fsynced:
                                 identities, versions, cursor, and the sha256 of every file

DeepSpeed writes without fsync or rename, so a directory without a valid commit.json (a save
killed half-way) does not exist for resume; the previous committed one is used.

Nothing spds reads from a checkpoint can run code. Checkpoint directories are shared across
nodes and users, and the sha256 list in commit.json lives in the same directory, so it cannot
vouch for a planted file. Every .pt file is loaded with torch.load(weights_only=True) (tensors
and plain Python values only; a pickle that would call anything is refused), and spds applies
DeepSpeed's saved state to the engine itself instead of calling engine.load_checkpoint, which
unpickles freely.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from spds.contract.config import Config
from spds.contract.schema import describe_errors, require_valid
from spds.errors import SpdsError
from spds.fsio import atomic_write_json, atomic_writer, read_json, sha256_file, verified_copy
from spds.stop import fault_point
from spds.training.identity import code_change, library_versions, refusing_keys

PATTERN = re.compile(r"^update-(\d{6,})$")
COMMIT = "commit.json"
STATE_FILE = "mp_rank_00_model_states.pt"  # DeepSpeed's name; the fsdp backend writes the same file and keys


def tag_for(update: int) -> str:
    return f"update-{update:06d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ---------------------------------------------------------------- per-rank state


def capture_rng() -> dict:
    numpy_state = np.random.get_state()
    state = dict(
        python=random.getstate(),
        numpy=[numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        torch=torch.get_rng_state(),
    )
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fsync_file(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def prompt_digest(prompt: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(prompt.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- save and commit


def save(
    engine, root: Path, update: int, cursor: dict, identities: dict, versions: dict, reason: str, rank: int, world: int
) -> Path:
    """Collective: every rank calls it. Returns the committed directory."""
    tag = tag_for(update)
    directory = root / tag
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)  # a stale, uncommitted save of the same update
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    try:
        engine.save_checkpoint(str(root), tag=tag, exclude_frozen_parameters=True, save_latest=False)
        fault_point("kill-after-deepspeed-save", update)
        with atomic_writer(directory / rank_file(rank), "wb") as stream:
            torch.save(dict(rank=rank, world_size=world, rng=capture_rng(), cursor=cursor), stream)
    except SpdsError as error:  # fsio's atomic writer names a failed write of the rank file
        raise save_failure(root, directory, error) from None
    except (OSError, RuntimeError) as error:
        # torch.save reports a failed write as a RuntimeError ("file write failed", or its zip
        # writer's "unexpected pos" when the disk filled mid-file)
        if isinstance(error, RuntimeError) and not any(s in str(error) for s in ("write", "unexpected pos")):
            raise
        raise save_failure(root, directory, error) from None
    dist.barrier()  # every rank's writes are complete; only now is the directory's content final
    if rank == 0:
        paths = sorted(p for p in directory.iterdir() if p.is_file() and p.name != COMMIT)
        for path in paths:
            fsync_file(path)  # DeepSpeed's own files reach the disk before the commit says so
        files = {p.name: sha256_file(p) for p in paths}
        missing = [rank_file(r) for r in range(world) if rank_file(r) not in files]
        if missing:
            raise SpdsError(
                f"{directory}: rank files {missing} are not visible to rank 0; checkpoints need a "
                "file system shared by all nodes"
            )
        commit = dict(
            format="spds-checkpoint-v1",
            update=update,
            tag=tag,
            reason=reason,
            saved_at=time.time(),
            world_size=world,
            identities=identities,
            versions=versions,
            cursor=cursor,
            prompt_sha256=prompt_digest(engine.module.prompt),
            files=files,
        )
        require_valid(commit, "commit", "the commit record")
        atomic_write_json(directory / COMMIT, commit)
    dist.barrier()
    return directory


def save_failure(root: Path, directory: Path, error: Exception) -> SpdsError:
    """A checkpoint that could not be written: which, why, the room it needed (the newest
    committed checkpoint's size) against the room there is, and that the previous one stands.
    The partial directory has no commit.json, so no resume ever reads it; it is removed."""
    shutil.rmtree(directory, ignore_errors=True)
    previous = committed(root)
    free = shutil.disk_usage(root).free if root.exists() else 0
    needed = sum(p.stat().st_size for p in previous[-1][1].iterdir() if p.is_file()) if previous else None
    full = (
        getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        or "No space left" in str(error)
        or (needed is not None and free < needed)
    )
    said = getattr(error, "strerror", None) or str(error).splitlines()[0]
    why = "the file system is full (No space left on device)" if full else said
    room = f"{free / 2**20:.2f} MiB free there" + (f", about {needed / 2**20:.2f} MiB needed" if needed else "")
    stands = (
        f"the previous checkpoint {previous[-1][1].name} stands and the same command resumes from it"
        if previous
        else "no earlier checkpoint exists"
    )
    return SpdsError(f"cannot write {directory} (a checkpoint): {why} ({room}); {stands}")


# ---------------------------------------------------------------- find, verify, restore


def committed(root: Path) -> list[tuple[int, Path]]:
    """(update, directory) of every directory that holds a commit record, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = PATTERN.match(path.name)
        if match and (path / COMMIT).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def verify(directory: Path) -> dict:
    """The commit record, after checking that every file it names has its recorded sha256."""
    commit = read_json(directory / COMMIT)
    problems = describe_errors(commit, "commit")
    if problems:
        raise SpdsError(f"{directory / COMMIT}: not a valid commit record", problems)
    for name, expected in commit["files"].items():
        path = directory / name
        actual = sha256_file(path) if path.exists() else "missing"
        if actual != expected:
            raise SpdsError(
                f"checkpoint file {path} is corrupted (expected sha256 {expected}, actual {actual}); "
                f"remove {directory} to resume from the previous checkpoint"
            )
    return commit


def load_state(path: Path) -> dict:
    """A checkpoint file's contents: tensors and plain values only, never code."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise SpdsError(
            f"{path}: refused: it holds objects other than tensors and plain values, and spds never runs "
            f"code from a checkpoint (a planted or foreign file?): {str(error).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise SpdsError(f"{path}: not a readable checkpoint file: {error}") from None
    if not isinstance(state, dict):
        raise SpdsError(f"{path}: not a checkpoint file (no state dictionary)")
    return state


def load_engine_state(engine, directory: Path) -> None:
    """The prompt, optimizer and LR schedule DeepSpeed saved (ZeRO-0; the sharded engine writes the
    same file and keys), applied as DeepSpeed's own load would, without unpickling code."""
    path = directory / STATE_FILE
    state = load_state(path)
    try:
        prompt = state["module"]["prompt"]
        if tuple(prompt.shape) != tuple(engine.module.prompt.shape):
            raise SpdsError(
                f"{path}: holds a soft prompt of shape {tuple(prompt.shape)}, this run's is "
                f"{tuple(engine.module.prompt.shape)} (soft_prompt.length or form, or another student)"
            )
        with torch.no_grad():
            engine.module.prompt.copy_(prompt)
        engine.optimizer.load_state_dict(state["optimizer"])
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise SpdsError(f"{path}: does not hold this run's prompt, optimizer and schedule state: {error!r}") from None
    for counter in ("global_steps", "global_samples", "skipped_steps"):  # DeepSpeed's own step counters
        if counter in state and hasattr(engine, counter):
            setattr(engine, counter, state[counter])


def restore(engine, directory: Path, identities: dict, rank: int, world: int, require_same_code: bool = True) -> dict:
    """Load a verified checkpoint into the engine and this rank's RNG; return the cursor."""
    commit = verify(directory)
    saved = commit["identities"]
    changed = refusing_keys(saved, identities, require_same_code)
    if changed:
        raise SpdsError(
            f"cannot resume from {directory}: the run's identity changed",
            [f"{key}: checkpoint {saved.get(key)!r:.80} != now {identities.get(key)!r:.80}" for key in changed],
        )
    load_engine_state(engine, directory)
    if prompt_digest(engine.module.prompt) != commit["prompt_sha256"]:
        raise SpdsError(f"{directory}: the restored soft prompt does not match the one its commit record names")
    path = directory / rank_file(rank)
    state = load_state(path)
    if state.get("rank") != rank or state.get("world_size") != world:
        raise SpdsError(f"{path} belongs to rank {state.get('rank')} of {state.get('world_size')}")
    if not isinstance(state.get("rng"), dict) or not isinstance(state.get("cursor"), dict):
        raise SpdsError(f"{path}: holds no RNG state and data cursor: not a rank file spds wrote")
    try:
        restore_rng(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise SpdsError(f"{path}: its RNG state does not restore: {error!r}") from None
    return state["cursor"]


def prove_restore(engine, directory: Path, identities: dict, rank: int, world: int) -> None:
    """The smoke's proof: poison the prompt and Adam moments, restore, demand bit-equality."""
    prompt = engine.module.prompt
    state = engine.optimizer.state[prompt]
    before = {"prompt": prompt.detach().clone(), **{k: v.clone() for k, v in state.items() if torch.is_tensor(v)}}
    with torch.no_grad():
        prompt.fill_(float("nan"))
        for value in state.values():
            if torch.is_tensor(value):
                value.fill_(float("nan") if value.is_floating_point() else 0)
    restore(engine, directory, identities, rank, world)
    restored = engine.optimizer.state[prompt]
    after = {"prompt": prompt.detach(), **{k: v for k, v in restored.items() if torch.is_tensor(v)}}
    for key, value in before.items():
        if not torch.equal(value, after[key]):
            raise SpdsError(f"smoke: restoring {directory} did not reproduce {key} bit for bit")


# ---------------------------------------------------------------- the read side (eval, export)


def checkpoint_to_read(output_dir: Path, path: str | None) -> Path:
    """The checkpoint a command names, or the run's newest committed one."""
    if path:
        return Path(path).resolve()
    found = committed(output_dir / "checkpoints")
    if not found:
        raise SpdsError(f"no committed checkpoint in {output_dir / 'checkpoints'}: train first or pass --checkpoint")
    return found[-1][1]


def prompt_of(directory: Path) -> tuple[torch.Tensor, dict]:
    """The FP32 prompt of a verified, committed checkpoint (its digest the one its commit record
    names), and that record."""
    commit = verify(directory)
    path = directory / STATE_FILE
    state = load_state(path)
    prompt = state.get("module", {}).get("prompt") if isinstance(state.get("module"), dict) else None
    if not torch.is_tensor(prompt) or prompt.dim() not in (2, 5):  # embeddings, or kv (spds/model/kv_prompt.py)
        raise SpdsError(
            f"{path}: holds no soft prompt (module.prompt, a 2-d or 5-d tensor): not a checkpoint spds wrote"
        )
    if prompt_digest(prompt) != commit["prompt_sha256"]:
        raise SpdsError(
            f"{directory}: its soft prompt does not match the one its commit record names "
            "(prompt_sha256): the checkpoint was altered"
        )
    return prompt.float().contiguous(), commit


# ---------------------------------------------------------------- when to save


class Checkpointer:
    """checkpoint.every / keep_last / backup_dir, read here and nowhere else: where a run resumes,
    when an update is saved, and what is kept and copied after each save. One per run, bound to
    the run's identities and this rank."""

    def __init__(self, config: Config, out: Path, smoke: bool, identities: dict, rank: int, world: int):
        settings = config.checkpoint
        self.every, self.keep_last = settings.every, settings.keep_last
        self.root, self.backup_root = out / "checkpoints", config.resolve(settings.backup_dir)
        self.smoke, self.versions = smoke, library_versions()
        self.identities, self.rank, self.world = identities, rank, world
        self.require_same_code = config.train.require_same_code
        self.code_change = None  # set by restore when the checkpoint was written by other spds code

    def newest(self) -> tuple[int, Path | None]:
        """The resume point: the newest committed checkpoint's (update, directory), or (0, None).
        A smoke is isolated: never resumed, and what a previous smoke left is removed."""
        if self.smoke and self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
        dist.barrier()  # every rank reads the directory as rank 0 left it
        found = [] if self.smoke else committed(self.root)
        damaged = []
        for update, directory in reversed(found):  # the newest intact one; each rank reads the same files
            try:
                verify(directory)
            except SpdsError as error:
                damaged.append(f"{directory}: {error}")
                continue
            if damaged and self.rank == 0:
                print(
                    f"spds: resuming from {directory}, the newest intact checkpoint; damaged, and skipped:\n  "
                    + "\n  ".join(damaged),
                    file=sys.stderr,
                )
            return update, directory
        if damaged:  # starting over would prune them: the user decides
            raise SpdsError(
                f"every committed checkpoint in {self.root} is damaged; remove them to start over, or "
                "restore them from checkpoint.backup_dir",
                damaged,
            )
        return 0, None

    def restore(self, engine, directory: Path | None) -> int:
        """The first update to run: 1, or the update after `directory` once its state is restored
        (with no engine, a run stopped during start-up, only its record is verified)."""
        if directory is None:
            return 1
        if engine is None:
            return verify(directory)["cursor"]["next_update"]
        cursor = restore(engine, directory, self.identities, self.rank, self.world, self.require_same_code)
        commit = read_json(directory / COMMIT)  # verified by restore
        self.code_change = code_change(
            "checkpoint", directory, commit["identities"], commit["versions"], self.identities
        )
        return cursor["next_update"]

    def reason(self, update: int, last: int, stopping: bool) -> str | None:
        """Why `update` is saved, or None: every N, the last update, a stop; the smoke's one update."""
        if self.smoke:
            return "smoke"
        if stopping:  # a signal, or a stop request by file: at this update boundary either way
            return "stop"
        if update == last:
            return "final"
        return "scheduled" if update % self.every == 0 else None

    def save(self, engine, cursor: dict, update: int, reason: str) -> Path:
        directory = save(
            engine, self.root, update, cursor, self.identities, self.versions, reason, self.rank, self.world
        )
        if self.rank == 0:
            if self.backup_root is not None and not self.smoke:
                backup(directory, self.backup_root)
            prune(self.root, self.keep_last)
        return directory

    def prove_restore(self, engine, directory: Path) -> None:
        prove_restore(engine, directory, self.identities, self.rank, self.world)


# ---------------------------------------------------------------- retention and backup


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last` and uncommitted leftovers older
    than the newest commit. The newest committed checkpoint is never deleted."""
    kept = committed(root)
    if not kept:
        return []
    newest = kept[-1][0]
    doomed = [path for _, path in kept[: -max(1, keep_last)]]
    for path in root.iterdir():
        match = PATTERN.match(path.name)
        if match and not (path / COMMIT).exists() and int(match.group(1)) < newest:
            doomed.append(path)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def backup(directory: Path, backup_root: Path) -> dict:
    commit = read_json(directory / COMMIT)
    return verified_copy(directory, [*commit["files"], COMMIT], backup_root / directory.name, "backup-receipt.json")
