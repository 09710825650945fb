"""Where a long phase stands (eval's scoring and answers): a bar on a terminal, a line every few
seconds where the output is a log (a batch job's), each with the rows done, the positions per
second and the time left, estimated from the work done (positions where the phase counts them:
a phase's batches are longest first, so rows alone would overestimate what is left)."""

from __future__ import annotations

import os
import sys
import time


class Progress:
    def __init__(self, phase: str, rows: int, work: int | None = None, show: bool = True, every: float = 10.0):
        self.phase, self.rows, self.work = phase, rows, work or rows  # work: the phase's positions (or rows)
        self.done_rows = self.done_work = self.positions = 0
        self.began = self.shown = time.monotonic()
        self.every = every
        self.bar = None
        if show and os.isatty(2):
            from tqdm import tqdm

            self.bar = tqdm(total=rows, desc=phase, unit="row", leave=False)
        self.show = show

    def advance(self, rows: int, positions: int, work: int | None = None) -> None:
        """`rows` more done, having forwarded `positions` (the rate's numerator), `work` of the total."""
        self.done_rows += rows
        self.done_work += rows if work is None else work
        self.positions += positions
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix_str(self.rate())
        elif self.show and time.monotonic() - self.shown >= self.every and self.done_rows < self.rows:
            self.shown = time.monotonic()
            print(f"{self.phase}: {self.done_rows}/{self.rows} rows, {self.rate()}", file=sys.stderr, flush=True)

    def rate(self) -> str:
        seconds = time.monotonic() - self.began
        left = seconds * (self.work - self.done_work) / self.done_work if self.done_work else float("nan")
        return f"{self.positions / max(seconds, 1e-9):,.0f} positions/s, {left:.0f} s left"

    def close(self) -> float:
        """The phase's seconds."""
        seconds = time.monotonic() - self.began
        if self.bar is not None:
            self.bar.close()
        elif self.show:
            rate = self.positions / max(seconds, 1e-9)
            print(
                f"{self.phase}: {self.done_rows} rows in {seconds:.1f} s, {rate:,.0f} positions/s",
                file=sys.stderr,
                flush=True,
            )
        return seconds
