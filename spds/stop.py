"""Stopping cleanly: every way a stop is asked for, honoured at a boundary (train: an update,
agreed by the ranks; generate: a batch, each rank on its own). A primitive of the process, not of
one verb: spds.cli installs the handler before torch is imported.

A stop is asked for in one of two ways:
  * SIGTERM or SIGINT to a rank (a preemption, SLURM, Ctrl-C, torchrun or DeepSpeed's launch.py
    forwarding one). The handler only raises a flag. It is installed first thing in the process
    (spds.cli, before torch is imported), so a signal during start-up is a stop, not a death.
  * a stop request file, <output_dir>/stop-request.json, written by `spds stop CONFIG` or by
    spds's launch scripts when they are signalled. It reaches ranks that no signal can reach
    (other nodes of an ssh/pdsh launch) and asks nothing of the launchers in between, which would
    otherwise kill ranks that do not exit within their own grace time (30 s for DeepSpeed's
    launch.py and torchrun). Rank 0 reads it; a request older than this launch is stale and is
    removed when the run starts.

Either way the ranks agree by summing their votes in the collective they already make at each
boundary, so all stop after the same update, with a committed checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

from spds.errors import SpdsError
from spds.fsio import atomic_write_json, parse_json, read_bytes

REQUEST_FILE = "stop-request.json"


class StopRequest:
    """Process-wide: `StopRequest.install()` once, as early as possible; later calls return it."""

    _installed: "StopRequest | None" = None

    def __init__(self):
        self.signal: int | None = None
        self.requests: Path | None = None  # the directory whose stop-request.json this process reads
        # A request written before this launch began is stale. The launch scripts export the
        # moment they started; without them, this process's start counts.
        self.launch_started = launch_started()

    @classmethod
    def install(cls) -> "StopRequest":
        if cls._installed is None:
            cls._installed = cls()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, cls._installed._handle)
        return cls._installed

    @classmethod
    def current(cls) -> "StopRequest":
        """The installed one, or, where no verb installed it (a library call: eval's generate), one
        that reads request files only and leaves the process's signals alone."""
        return cls._installed or cls()

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def watch(self, output_dir: Path) -> None:
        """Read stop requests in `output_dir` from now on (rank 0 does, for every rank); one left
        from before this launch is stale and goes."""
        self.requests = output_dir
        request = read_request(output_dir)
        if request is not None and request["requested_at"] < self.launch_started:
            clear(output_dir)

    def vote(self) -> bool:
        """This rank's vote: signalled, or a live request file where it watches."""
        if self.signal is not None:
            return True
        request = read_request(self.requests) if self.requests is not None else None
        return request is not None and request["requested_at"] >= self.launch_started

    def reason(self) -> str:
        if self.signal is not None:
            return f"stopped by {signal.Signals(self.signal).name} at an update boundary"
        if self.vote():
            return f"stopped at an update boundary by {self.requests / REQUEST_FILE}"
        return "stopped at an update boundary: another rank was signalled"

    def answered(self) -> None:
        """The run stopped or ended: the request must not stop the next launch."""
        if self.requests is not None:
            clear(self.requests)


def launch_started() -> float:
    """SPDS_LAUNCH_STARTED (the launch scripts export the moment they started, to every node), or
    this process's start when it is absent or not a time."""
    value = os.environ.get("SPDS_LAUNCH_STARTED")
    try:
        started = float(value) if value else None
    except ValueError:
        started = None
    if value and (started is None or not math.isfinite(started)):
        print(
            f"spds: SPDS_LAUNCH_STARTED={value!r} is not a time (seconds since the epoch); this process's "
            "start is taken instead",
            file=sys.stderr,
        )
        started = None
    return started if started is not None else time.time()


def read_request(output_dir: Path) -> dict | None:
    """The stop request in output_dir, its requested_at a finite time: the file's own, or, for a
    garbled or half-visible file, the moment it was last written (so a garbled request left from
    an earlier launch is as stale as a valid one)."""
    path = output_dir / REQUEST_FILE
    try:
        written = path.stat().st_mtime
    except OSError:
        return None
    try:
        value = parse_json(read_bytes(path, limit=1 << 16))
    except (ValueError, SpdsError):
        return {"requested_at": written}
    if not isinstance(value, dict):
        return {"requested_at": written}
    requested = value.get("requested_at")
    if isinstance(requested, bool) or not isinstance(requested, (int, float)) or not math.isfinite(requested):
        value["requested_at"] = written
    return value


def request(output_dir: Path, why: str) -> Path:
    """Write the stop request (atomically): the ranks stop after the update in flight."""
    path = output_dir / REQUEST_FILE
    atomic_write_json(path, dict(requested_at=time.time(), host=socket.gethostname(), pid=os.getpid(), why=why))
    return path


def clear(output_dir: Path) -> None:
    (output_dir / REQUEST_FILE).unlink(missing_ok=True)


def fault_point(name: str, update: int) -> None:
    """Crash-test hook: SPDS_FAULT=NAME:UPDATE sends this process a signal right here: SIGKILL for
    "kill-*" points (a power cut, the OOM killer), SIGTERM for "sigterm-*" (a preemption). Tests
    use it to prove that a half-written save is harmless and that a stop resumes bit-exactly."""
    if os.environ.get("SPDS_FAULT") == f"{name}:{update}":
        os.kill(os.getpid(), signal.SIGTERM if name.startswith("sigterm") else signal.SIGKILL)


def pace_point() -> None:
    """Timing hook for tests: SPDS_TEST_PACE=SECONDS sleeps that long before every update (generate: every batch), so
    a signal sent once update N is logged lands mid-run however fast the machine (tiny updates take
    milliseconds; a scheduler's signal comes on its own clock). Changes no number."""
    pace = os.environ.get("SPDS_TEST_PACE")
    if pace:
        time.sleep(float(pace))


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def peer_lost(error: BaseException, log_dir: Path, rank: int, then: str) -> SpdsError | None:
    """When another rank's process ended mid-collective (killed, out of memory), what this rank
    says in one line, ending with `then` (what the same command does next); the backend's
    traceback goes to a file in `log_dir`, not the terminal. None for any other error."""
    import traceback

    import torch.distributed  # only ever called with torch loaded: an error of a collective

    text = str(error)
    if not (isinstance(error, torch.distributed.DistError) or any(s in text for s in PEER_GONE)):
        return None
    log = Path(log_dir) / f"rank-{rank}-traceback.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(error)))
    except OSError:
        log = None
    first = text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
    return SpdsError(
        f"rank {rank}: another rank's process ended during a collective ({first}); this rank stopped too. "
        + (f"The backend's traceback is in {log}. " if log else "")
        + then
    )
