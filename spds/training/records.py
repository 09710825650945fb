"""What a run tells the world, written by rank 0 alone (every file atomically, each validated
against its schema first):

    run.json        when the run begins: mode, identities, versions, config, launch, resume point
    metrics.jsonl   one line per update, appended durably; a resumed run keeps the lines before it
    progress.json   after every update: where the run is and its ETA
    terminal.json   removed when a run starts, written when it ends: complete, stopped or failed,
                    with the last completed update and the checkpoint to resume from
    evidence.json   after a smoke passed (train refuses without it)

RunRecords tracks the last completed update and checkpoint as the run goes, so terminal.json
tells the truth whatever ends the run.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from spds.contract.config import Config
from spds.contract.schema import require_valid
from spds.fsio import (
    SpdsError,
    append_line_durably,
    atomic_write_json,
    atomic_writer,
    canonical_json,
    parse_json,
    read_bytes,
)
from spds.training.identity import library_versions


class StartupClock:
    """Seconds from the start (`spds train`, or the call) to the end of each start-up phase:
    config (imports, schema, pinned digests), process_group, data (store, plan), identities (the
    student's digest when unpinned), student (load, kernels), engine (DeepSpeed), resume. With
    metrics update 1's elapsed_seconds, where the time to the first update goes."""

    def __init__(self, started: float | None = None):
        self.started, self.seconds = started or time.time(), {}

    def mark(self, phase: str) -> None:
        self.seconds[phase] = round(time.time() - self.started, 3)


class RunRecords:
    def __init__(self, out: Path, rank: int, last: int, progress_bar: bool):
        self.out, self.writes, self.last = out, rank == 0, last
        self.completed, self.checkpoint = 0, None  # what terminal.json reports, whatever happens
        self.bar = None
        self.show_bar = progress_bar and self.writes and sys.stderr.isatty()
        if self.writes:
            (out / "terminal.json").unlink(missing_ok=True)  # a previous run's status would lie from now on

    def resume_point(self, update: int, checkpoint: Path | None) -> None:
        self.completed, self.checkpoint = update, checkpoint

    def begin(
        self,
        config: Config,
        smoke: bool,
        start: int,
        world: int,
        identities: dict,
        smoke_waived: bool,
        code_changes: list[dict],
        model,
        startup_seconds: dict,
        hosts: list[str],
    ) -> None:
        """run.json, and metrics.jsonl cut back to the updates before `start` (after a crash the
        updates after the checkpoint are redone, and each must appear once)."""
        if not self.writes:
            return
        keep_metrics_before(self.out / "metrics.jsonl", start)
        keep_metrics_before(self.out / "on-policy.jsonl", start)  # loss.on_policy's samples, likewise
        if model is None:  # stopped during start-up: nothing was built, nothing runs
            return
        write_validated(
            self.out / "run.json",
            dict(
                mode="smoke" if smoke else "train",
                started_at=time.time(),
                start_update=start,
                updates=self.last,
                world_size=world,
                identities=identities,
                versions=library_versions(),
                config=config.raw,
                config_path=str(config.path),
                launch=dict(launch_environment(), hosts=hosts),
                smoke_waived=smoke_waived,
                code_changes=code_changes,
                resumed_from=str(self.checkpoint) if self.checkpoint else None,
                trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
                loss_kernel=model.loss_fn.kernel,
                startup_seconds=startup_seconds,
            ),
            "run",
        )
        if self.show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.last, initial=start - 1, unit="update", dynamic_ncols=True)

    def update_done(self, metric: dict, engine, samples: dict[int, list[int]] | None = None) -> None:
        """The update's metrics line, and (loss.on_policy) the student's sampled answers by record,
        on-policy.jsonl's line, before it."""
        self.completed = metric["update"]
        if self.writes:
            if samples is not None:
                line = dict(update=metric["update"], samples=[dict(record=r, ids=ids) for r, ids in samples.items()])
                append_line_durably(self.out / "on-policy.jsonl", canonical_json(line))
            record_metric(self.out, metric, self.last, self.checkpoint, self.bar, engine)

    def failed(self, error: BaseException) -> None:
        if self.writes:
            try:
                self.write_terminal("failed", f"{type(error).__name__}: {error}")
            except SpdsError as also:  # the disk that failed the run may refuse this too
                print(f"spds: could not record the failure in terminal.json: {also}", file=sys.stderr)

    def finish(self, stop_reason) -> str:
        if self.bar is not None:
            self.bar.close()
        status = "stopped" if self.completed < self.last else "complete"
        if self.writes:
            self.write_terminal(status, stop_reason() if status == "stopped" else None)
        return status

    def write_terminal(self, status: str, reason: str | None) -> None:
        write_validated(
            self.out / "terminal.json",
            dict(
                status=status,
                update=max(0, self.completed),
                finished_at=time.time(),
                checkpoint=str(self.checkpoint) if self.checkpoint else None,
                reason=reason,
            ),
            "terminal",
        )

    def smoke_passed(self, identities: dict, world: int, longest_record_tokens: int, metric: dict) -> None:
        if self.writes:
            write_validated(
                self.out / "evidence.json",
                dict(
                    status="passed",
                    identities=identities,
                    world_size=world,
                    longest_record_tokens=longest_record_tokens,
                    metric=metric,
                    checkpoint=str(self.checkpoint),
                    versions=library_versions(),
                ),
                "smoke",
            )

    def result(self, status: str) -> dict:
        return dict(
            status=status,
            update=self.completed,
            output=str(self.out),
            checkpoint=str(self.checkpoint) if self.checkpoint else None,
        )


def write_validated(path: Path, value: dict, schema: str) -> None:
    require_valid(value, schema, path.name)
    atomic_write_json(path, value)


def record_launch_end(out: Path, exit_status: int, launch_started: float) -> Path | None:
    """The launch script's word, when its launcher failed and rank 0 recorded no end (it was
    killed, by SIGKILL or the OOM killer, or died before it could write): terminal.json says
    failed, with the last update metrics.jsonl holds and the newest committed checkpoint, the
    resume point. A terminal.json written since the launch began is rank 0's, and stands."""
    from spds.training.checkpoint import committed  # deferred: it imports torch; launch-ended starts fast

    path = out / "terminal.json"
    out.mkdir(parents=True, exist_ok=True)  # the ranks may have died before they made it
    try:
        if path.stat().st_mtime >= launch_started:
            return None
    except FileNotFoundError:
        pass
    update = max((line["update"] for _, line in read_metrics(out / "metrics.jsonl")), default=0)
    checkpoints = committed(out / "checkpoints")
    how = f"signal {exit_status - 128}" if exit_status > 128 else f"exit status {exit_status}"
    if exit_status > 128:
        try:
            how = signal.Signals(exit_status - 128).name
        except ValueError:
            pass
    write_validated(
        path,
        dict(
            status="failed",
            update=update,
            finished_at=time.time(),
            checkpoint=str(checkpoints[-1][1]) if checkpoints else None,
            reason=f"the launch ended by {how} before rank 0 recorded how the run ended (a rank was killed or "
            "died early: see the launcher's output); the checkpoint named here is the resume point",
        ),
        "terminal",
    )
    return path


def rank_hosts() -> list[str]:
    """Every rank's hostname, in rank order: where the run ran (a collective, on every rank)."""
    import torch.distributed

    hosts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    return hosts


def launch_environment() -> dict:
    keys = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "DS_ACCELERATOR",
        "TORCHELASTIC_RUN_ID",
    )
    environment = {k: os.environ[k] for k in keys if k in os.environ}
    environment.update(
        {k: v for k, v in os.environ.items() if k.startswith(("SLURM_JOB", "SLURM_NODE", "SLURM_PROCID", "NCCL_"))}
    )
    by_deepspeed = any(a.startswith("--local") for a in sys.argv)
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "deepspeed" if by_deepspeed else "none"
    return dict(hostname=socket.gethostname(), launcher=launcher, argv=sys.argv, environment=environment)


def read_metrics(path: Path) -> list[tuple[bytes, dict]]:
    """(raw line, metric) of every whole line of metrics.jsonl; a torn, garbled or non-UTF-8 line
    (a crash mid-append, a stray edit) is no metric and is skipped."""
    try:
        return parse_metrics(read_bytes(path, limit=1 << 30))
    except SpdsError:
        return []


def parse_metrics(data: bytes) -> list[tuple[bytes, dict]]:
    found = []
    for raw in data.splitlines():
        try:
            metric = parse_json(raw)
        except ValueError:
            continue
        if isinstance(metric, dict) and isinstance(metric.get("update"), int):
            found.append((raw, metric))
    return found


def keep_metrics_before(path: Path, start: int) -> None:
    """Keep the metrics of updates before `start` (atomically). A torn last line goes too."""
    if not path.exists():
        return
    data = read_bytes(path, limit=1 << 30)
    kept = b"".join(raw + b"\n" for raw, metric in parse_metrics(data) if metric["update"] < start)
    if kept != data:
        with atomic_writer(path, "wb") as stream:
            stream.write(kept)


def record_metric(out: Path, metric: dict, last: int, saved, bar, engine) -> None:
    require_valid(metric, "metrics", "a metrics line")
    append_line_durably(out / "metrics.jsonl", canonical_json(metric))
    done = metric["update"]
    atomic_write_json(
        out / "progress.json",
        dict(
            status="running",
            update=done,
            updates=last,
            loss=metric["loss"],
            elapsed_seconds=metric["elapsed_seconds"],
            eta_seconds=metric["seconds"] * (last - done),
            last_checkpoint=str(saved) if saved else None,
        ),
    )
    if engine.monitor.enabled:  # TensorBoard / CSV through DeepSpeed's monitor settings
        engine.monitor.write_events(
            [(f"spds/{k}", metric[k], done) for k in ("loss", "grad_norm", "learning_rate", "tokens_per_second")]
        )
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{metric['loss']:.4f}", tok_s=f"{metric['tokens_per_second']:.0f}")
    else:
        print(
            f"update {done}/{last}  loss {metric['loss']:.4f}  grad_norm {metric['grad_norm']:.3g}  "
            f"lr {metric['learning_rate']:.3g}  {metric['tokens_per_second']:.0f} tok/s",
            flush=True,
        )
