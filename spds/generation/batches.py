"""A generate run's batches, shared by its ranks: the same output bytes on any number of them.

Batch k of a run (its requests, and the seed + k it samples with) is a function of the config
alone, and so is every number the teacher computes for it: the context's keys and values are
those of one fixed prefix (spds/generation/generate.py's `Asking`), computed the same way on
every rank, and a batch's own rows go through the decoder together whatever ran before them. So
the ranks may take the batches in any order. Each rank takes every world-th batch left to do,
and writes each one it answers to a file of its own (`Output.write`: a temporary file,
fsynced, renamed), so that a kill at any moment leaves only whole batches behind. Rank 0 appends
them to generate.output in batch order as they come (`merge`), skipping a row already there;
the output is only ever appended to, by rank 0, in batch order: byte for byte what one rank
writes, and what a resumed run completes (tests/test_generate_ranks.py, on 1, 2 and 3 ranks).

The ranks meet twice: at the start (rank 0 has repaired the output and says which batches are
left) and at the end (every rank has written its last batch, or stopped). They coordinate over a
gloo group of their own, also when eval has already joined an NCCL one.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spds.errors import SpdsError
from spds.fsio import (
    MAX_LINE_BYTES,
    atomic_write_json,
    exclusive_lock,
    fsync_dir,
    open_regular,
    parse_json,
    read_json,
    write_failure,
)


@dataclass
class Ranks:
    """This process's place among the ranks a launcher started (RANK, WORLD_SIZE, LOCAL_RANK),
    and the group they coordinate over (None: one rank)."""

    rank: int
    world: int
    device: torch.device
    group: object | None = None
    owned: bool = False  # this run made the process group (eval's is eval's)

    @classmethod
    def join(cls, timeout_minutes: float) -> Ranks:
        world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world == 1:
            return cls(0, 1, device)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        owned = not torch.distributed.is_initialized()  # spds generate under a launcher; eval has joined one
        if owned:
            torch.distributed.init_process_group("gloo", timeout=timeout)
        group = torch.distributed.new_group(backend="gloo", timeout=timeout)
        return cls(torch.distributed.get_rank(), torch.distributed.get_world_size(), device, group, owned)

    def leave(self) -> None:
        """The process group this run made, torn down (a launcher's ranks then exit cleanly)."""
        if self.owned:
            torch.distributed.destroy_process_group()

    def from_rank_0(self, value):
        """Rank 0's `value`, on every rank."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(group=self.group)


# Recorded, not compared: on CPU a row's top-k log-probabilities can differ in their last bits
# between thread counts (torchrun gives each rank one thread; a lone process takes every core), so
# the record says how the output's first writer ran; the rows' settings are the same whatever it was.
NOT_COMPARED = ("cpu_threads",)


class Output:
    """generate.output, written by a run's ranks together: the batches each answers wait in files
    of their own (<output's folder>/.<output's name>.batches/, one per batch, named by its number
    and the sha256 of its bytes) until rank 0 appends them to the output in batch order, each
    checked first: its bytes the ones written, its rows the batch's request_ids in order.

    The output is owned. Rank 0 holds a lock on it from start to finish (a second generate into
    it is refused), and a provenance record beside it (<output>.provenance.json) names what
    decides its rows' bytes (`provenance`: the generate settings, the context, questions, teacher
    and tokenizer): a rerun whose settings would write other bytes is refused, each setting's two
    values named, instead of appending rows of another kind after the old ones."""

    def __init__(
        self, path: Path, batches: list[list[str]], ranks: Ranks, provenance: dict | None = None, adopt: bool = False
    ):
        self.path = path
        self.provenance = provenance
        self.adopt = adopt  # rows without a record taken as this run's settings' (spds generate --adopt)
        self.record = path.with_name(path.name + ".provenance.json")
        self.lock = None  # rank 0: held from start to finish
        self.directory = path.parent / f".{path.name}.batches"
        self.batches = batches  # the request_ids of each batch, in order
        self.ranks = ranks
        self.cursor = 0  # rank 0: the batches before it are in the output whole
        self.present: set[str] = set()  # rank 0: the output's request_ids
        self.appended = 0  # rank 0: rows this run appended
        self.found = 0  # rank 0: rows an earlier run wrote
        self.seconds = 0.0  # in write and merge: what sharing the output costs this rank

    def start(self) -> dict[int, list[str]]:
        """The batches left to answer, each with its rows already in the output, on every rank:
        rank 0 repairs the output and appends the batches waiting in files first."""
        left = {}
        if self.ranks.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.lock = exclusive_lock(
                self.path.parent / f".{self.path.name}.lock", f"another spds generate writing {self.path}"
            )
            self.lock.__enter__()
            ours = self.own()
            self.present = repair_and_read(self.path, torn_is_ours=ours)
            self.merge()  # an earlier run's answered batches
            self.found, self.appended = len(self.present), 0
            waiting = self.waiting()
            for number, batch in enumerate(self.batches):
                if number not in waiting and not all(request in self.present for request in batch):
                    left[number] = [request for request in batch if request in self.present]
        return self.ranks.from_rank_0(left)

    def own(self) -> bool:
        """Check the provenance record against this run's, or write it: True where spds wrote the
        output (the record was there), so a torn last line is its own half-written row."""
        if self.provenance is None:  # a library caller that records nothing (tests of the merge)
            return True
        if self.record.exists():
            then = read_json(self.record)
            keys = (set(then) | set(self.provenance)) - set(NOT_COMPARED)
            changed = sorted(key for key in keys if then.get(key) != self.provenance.get(key))
            if changed:
                raise SpdsError(
                    f"{self.path} was written under other settings, and its rows would mix with rows of "
                    f"another kind (its record: {self.record})",
                    [f"{key}: then {then.get(key)!r:.120}, now {self.provenance.get(key)!r:.120}" for key in changed]
                    + [
                        "name a new generate.output for these settings, or remove the output and its record "
                        "to write it again from the start"
                    ],
                )
            return True
        if self.path.exists() and self.path.stat().st_size and not self.adopt:
            raise SpdsError(
                f"{self.path} holds rows and no provenance record ({self.record.name}): spds cannot tell the "
                "settings they were written under, and would append rows of these settings after them "
                "(rule 'an output holds rows of one kind')",
                [
                    "name a new generate.output, or pass spds generate --adopt to take its rows as written under "
                    "these settings (the record is then written beside it)"
                ],
            )
        atomic_write_json(self.record, self.provenance)
        return False

    def release(self) -> None:
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc) -> None:
        self.release()  # also when the run fails: a library caller's next generate may write it

    def write(self, number: int, lines: list[str]) -> None:
        """Batch `number`'s rows, durably and whole or not at all; rank 0 then appends what comes
        next in order."""
        began = time.perf_counter()
        data = "".join(lines).encode("utf-8")
        target, temporary = self.directory / f"{number:08d}.{hashlib.sha256(data).hexdigest()[:16]}.jsonl", None
        try:
            self.directory.mkdir(exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(prefix=f".{number:08d}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(descriptor, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
            fsync_dir(self.directory)
        except OSError as error:
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            raise write_failure(target, error) from None
        if self.ranks.rank == 0:
            self.merge()
        self.seconds += time.perf_counter() - began

    def finish(self) -> dict:
        """After every rank's last batch (or its stop), on every rank: the rows this run appended,
        those an earlier run wrote, and the batches left (a stopped run)."""
        began = time.perf_counter()
        self.ranks.barrier()
        waited = time.perf_counter() - began
        if self.ranks.rank == 0:
            self.merge()
            self.release()
        self.seconds += time.perf_counter() - began - waited
        counts = dict(written=self.appended, skipped=self.found, left=len(self.batches) - self.cursor)
        counts.update(output_seconds=self.seconds, waited_seconds=waited)
        return self.ranks.from_rank_0(counts)

    def batch_path(self, number: int) -> Path | None:
        """Batch `number`'s file, if one waits (whole: it appears by rename)."""
        found = sorted(self.directory.glob(f"{number:08d}.*jsonl")) if self.directory.is_dir() else []
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise SpdsError(f"{self.directory}: holds batch {number} twice ({names}): remove the one not spds's")
        return found[0] if found else None

    def waiting(self) -> set[int]:
        """The batches waiting in files."""
        if not self.directory.is_dir():
            return set()
        return {int(p.name[:8]) for p in self.directory.glob("*.jsonl") if p.name[:8].isdigit()}

    def merge(self) -> None:
        """Rank 0: append the batch files that come next in order to the output (each row not
        already there), fsynced, then remove them. A kill between the append and the removal
        leaves a file whose rows are all present: the next merge removes it."""
        while self.cursor < len(self.batches):
            number, path = self.cursor, self.batch_path(self.cursor)
            if path is None:
                if all(request in self.present for request in self.batches[number]):
                    self.cursor += 1
                    continue
                break  # the next batch in order is not answered yet
            batch = self.batches[number]
            whole = checked_batch(path, batch)
            if not any(request in self.present for request in batch) and whole.count(b"\n") == len(batch):
                # the usual case, none of its rows there yet: the file holds them all, appended as
                # bytes (at 8 ranks rank 0 appends every rank's rows; reading each again was its
                # largest cost)
                rows, text = batch, whole
            else:  # a merge killed half-way, or rows an earlier run left: each row not there yet
                kept = [(request, line) for request, line in batch_rows(path) if request not in self.present]
                rows, text = [request for request, _ in kept], "".join(line for _, line in kept).encode("utf-8")
            if rows:
                try:
                    with open(self.path, "ab") as stream:
                        stream.write(text)
                        stream.flush()
                        os.fsync(stream.fileno())
                except OSError as error:  # a full disk: the torn append is cut by the next run
                    raise write_failure(self.path, error) from None
                self.present.update(rows)
                self.appended += len(rows)
            path.unlink()
            self.cursor += 1
        if self.cursor == len(self.batches) and self.directory.is_dir() and not any(self.directory.iterdir()):
            self.directory.rmdir()


def checked_batch(path: Path, batch: list[str]) -> bytes:
    """A batch file's bytes, refused by name (the output untouched) unless they are the bytes its
    writer named (sha256 in the file name) and hold the batch's rows in order, each its own line."""
    whole = path.read_bytes()
    named = path.name.split(".")[1] if path.name.count(".") == 2 else ""
    if hashlib.sha256(whole).hexdigest()[:16] != named:
        raise SpdsError(
            f"{path}: its bytes are not those spds generate wrote (sha256 {named or 'missing'} in its name): "
            "the output was not changed; remove the file and run generate again (its batch is answered again)"
        )
    order = {request: i for i, request in enumerate(batch)}
    last, decoder, head = -1, json.JSONDecoder(), b'{"request_id": '
    lines = whole.split(b"\n")
    for line in lines[:-1]:  # each a row of this batch (the rows the writer had not found written), in order
        try:
            request, _ = decoder.raw_decode(line[len(head) :].decode("utf-8")) if line.startswith(head) else (None, 0)
        except ValueError:
            request = None
        if order.get(request, -1) <= last:
            raise SpdsError(
                f"{path}: does not hold batch {path.name[:8]}'s rows ({', '.join(batch[:3])}, ...) in order: the "
                "output was not changed; remove the file and run generate again (its batch is answered again)"
            )
        last = order[request]
    if lines[-1]:
        raise SpdsError(f"{path}: its last row has no newline: not a batch file spds generate wrote")
    return whole


def batch_rows(path: Path) -> list[tuple[str, str]]:
    """(request_id, line) of a batch file's rows; a line that is not a row stops the merge, naming
    it, with the output untouched."""
    rows = []
    with open_regular(path) as stream:
        for number, line in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), start=1):
            try:  # json's C parser: a row is its request_id here (prepare reads every row strictly)
                rows.append((json.loads(line)["request_id"], line.decode("utf-8")))
            except (ValueError, KeyError, TypeError) as error:
                raise SpdsError(
                    f"{path}:{number}: not a row spds generate wrote ({error}); the output was not changed: "
                    "remove the file and run generate again (its batch is answered again)"
                ) from None
    return rows


def repair_and_read(output: Path, torn_is_ours: bool = True) -> set[str]:
    """request_ids already written. A last line without its newline that is a whole row (one a
    user appended by hand) is kept, its newline added; one that is not is a crash mid-append and
    is cut, only where spds wrote the output (`torn_is_ours`: its provenance record was there),
    and refused otherwise. Any other line that is not a row stops generate, naming it, with the
    file untouched: the rows a teacher wrote are the most expensive data a user has."""
    if not output.exists():
        return set()
    done, complete = set(), 0  # complete: the bytes up to the last newline
    with open_regular(output) as stream:
        for number, line in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if not line.endswith(b"\n"):
                if len(line) > MAX_LINE_BYTES:
                    raise SpdsError(
                        f"{output}:{number}: longer than {MAX_LINE_BYTES >> 20} MiB: not a row spds "
                        "wrote; nothing was changed"
                    )
                try:
                    done.add(parse_json(line)["request_id"])  # a whole row, written without its newline
                    with open(output, "ab") as appended:
                        appended.write(b"\n")
                        os.fsync(appended.fileno())
                    return done
                except (ValueError, KeyError, TypeError):
                    if not torn_is_ours:
                        raise SpdsError(
                            f"{output}:{number}: the last line is not a whole row, and spds did not write this "
                            "file (no provenance record beside it): nothing was changed; fix or remove that line"
                        ) from None
                break  # the torn last line of spds's own append
            try:
                row = parse_json(line)
                done.add(row["request_id"])
            except (ValueError, KeyError, TypeError) as error:
                raise SpdsError(
                    f"{output}:{number}: not a row spds generate wrote ({error or 'blank line'}); "
                    "nothing was changed: fix or remove that line, then run generate again"
                ) from None
            complete += len(line)
    if complete != output.stat().st_size:
        with open(output, "r+b") as stream:
            stream.truncate(complete)
            os.fsync(stream.fileno())
    return done
