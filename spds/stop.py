"""Stopping cleanly: every way a stop is asked for, agreed by the ranks at an update boundary.

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

import json
import os
import signal
import socket
import time
from pathlib import Path

REQUEST_FILE = "stop-request.json"


class StopRequest:
    """Process-wide: `StopRequest.install()` once, as early as possible; later calls return it."""

    _installed: "StopRequest | None" = None

    def __init__(self):
        self.signal: int | None = None
        self.requests: Path | None = None  # the directory whose stop-request.json this process reads
        # A request written before this launch began is stale. The launch scripts export the
        # moment they started; without them, this process's start counts.
        self.launch_started = float(os.environ.get("SPDS_LAUNCH_STARTED") or time.time())

    @classmethod
    def install(cls) -> "StopRequest":
        if cls._installed is None:
            cls._installed = cls()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, cls._installed._handle)
        return cls._installed

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def watch(self, output_dir: Path) -> None:
        """Read stop requests in `output_dir` from now on (rank 0 does, for every rank); one left
        from before this launch is stale and goes."""
        self.requests = output_dir
        request = read_request(output_dir)
        if request is not None and request.get("requested_at", 0.0) < self.launch_started:
            clear(output_dir)

    def vote(self) -> bool:
        """This rank's vote: signalled, or a live request file where it watches."""
        if self.signal is not None:
            return True
        request = read_request(self.requests) if self.requests is not None else None
        return request is not None and request.get("requested_at", 0.0) >= self.launch_started

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


def read_request(output_dir: Path) -> dict | None:
    try:
        value = json.loads((output_dir / REQUEST_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # half-visible or garbled: still a request, made now
        return {"requested_at": time.time()}
    return value if isinstance(value, dict) else {"requested_at": time.time()}


def request(output_dir: Path, why: str) -> Path:
    """Write the stop request (atomically): the ranks stop after the update in flight."""
    from .fsio import atomic_write_json

    path = output_dir / REQUEST_FILE
    atomic_write_json(path, dict(requested_at=time.time(), host=socket.gethostname(), pid=os.getpid(), why=why))
    return path


def clear(output_dir: Path) -> None:
    (output_dir / REQUEST_FILE).unlink(missing_ok=True)
