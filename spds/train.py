"""spds smoke / spds train: the training loop, top-down.

    contract -> process group -> packed data -> frozen student + FP32 prompt -> DeepSpeed engine
    -> resume from the newest committed checkpoint -> for each update:
         global batch (seed, u) -> this rank's records -> micro-batches under no_sync
         -> exact SUM all-reduce -> clip -> step -> metrics -> checkpoint / stop at the boundary

Every rank runs this file; rank 0 alone writes run.json, metrics.jsonl, progress.json,
terminal.json and commit records.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .contract import REPO_ROOT, Config, load_config, require_valid, validate_run_world
from .data.packed import PackedStore
from .engine import all_reduce_sum, build_engine, check_precision, init_distributed
from .fsio import (
    SpdsError,
    append_line_durably,
    atomic_write_json,
    atomic_writer,
    canonical_json,
    exclusive_lock,
    read_json,
    sha256_json,
    sha256_path,
)
from .model import build_soft_prompt_model, load_segments
from .schedule import Plan, Step
from .stop import StopRequest

# ---------------------------------------------------------------- the loop

def run(config: Config, smoke: bool) -> dict:
    stop = StopRequest.install()  # spds.cli installed it first thing; a library caller gets it here
    if config["train"]["deterministic"]:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        torch.use_deterministic_algorithms(True, warn_only=True)
    rank, world, device = init_distributed(config)
    out = config.output_dir / "smoke" if smoke else config.output_dir
    with rank_zero_lock(out, rank):  # before anything touches the run directory
        if rank == 0:
            (out / "terminal.json").unlink(missing_ok=True)  # a previous run's status would lie from now on
            stop.watch(config.output_dir)  # rank 0 reads stop requests for everyone
        optim = config["optim"]
        completed, checkpoint_dir = 0, None  # what terminal.json reports, whatever happens below
        try:
            validate_run_world(config, world)
            stopping = stop_agreed(stop, device)  # asked during start-up: load nothing
            store = PackedStore.open(config.packed_dir)
            if store.manifest["prompt_length"] != config["soft_prompt"]["length"]:  # its context_limit check used it
                raise SpdsError(f"soft_prompt.length is {config['soft_prompt']['length']} but {config.packed_dir} was "
                                f"packed for {store.manifest['prompt_length']}: "
                                "run spds prepare into another packed_dir")
            plan = Plan(store, optim, config["soft_prompt"]["length"], world)
            identities = run_identities(config, store, world)
            smoke_waived = False if smoke else check_smoke_evidence(config, identities)
            seed_everything(optim["seed"])
            model = None if stopping else build_soft_prompt_model(config, device)
            engine = None if stopping else build_engine(config, model, world)
            root = out / "checkpoints"
            backup_dir = config["checkpoint"]["backup_dir"]
            saver = checkpoint.Checkpointer(config["checkpoint"], root,
                                            config.resolve(backup_dir) if backup_dir else None,
                                            smoke, library_versions())
            if smoke and rank == 0:
                shutil.rmtree(root, ignore_errors=True)  # a smoke is isolated: never resumed, never reused
            torch.distributed.barrier()
            found = [] if smoke else checkpoint.committed(root)
            start, checkpoint_dir = 1, found[-1][1] if found else None
            completed = found[-1][0] if found else 0  # the resume point, should the restore be refused
            if checkpoint_dir and engine is not None:
                start = checkpoint.restore(engine, checkpoint_dir, identities, rank, world)["next_update"]
            elif checkpoint_dir:
                start = checkpoint.verify(checkpoint_dir)["cursor"]["next_update"]
            completed, last = start - 1, 1 if smoke else optim["updates"]
            if rank == 0:
                keep_metrics_before(out / "metrics.jsonl", start)  # updates redone after a crash appear once
                if not stopping:
                    write_run_record(out, config, smoke, start, last, world, identities, smoke_waived, checkpoint_dir,
                                     model)
            stopping = stopping or stop_agreed(stop, device)
            began, metric, bar = time.monotonic(), None, progress_bar(config, rank, start, last)
            for update in range(start, last + 1):
                if stopping:
                    break
                step = plan.step(update, force_longest=smoke)
                checkpoint.fault_point(f"sigterm-before-update-rank{rank}", update)
                metric, stopping = train_step(engine, store, plan, step, rank, device, stop, optim["max_grad_norm"])
                metric.update(update=update, elapsed_seconds=time.monotonic() - began)
                if rank == 0:
                    record_metric(out, metric, last, checkpoint_dir, bar, engine)
                completed = update
                reason = saver.reason(update, last, stopping)
                if reason:
                    checkpoint_dir = saver.save(engine, plan.cursor(step, rank), update, identities, reason, rank,
                                                world)
            if bar is not None:
                bar.close()
            if smoke:
                checkpoint.prove_restore(engine, checkpoint_dir, identities, rank, world)
                if rank == 0:
                    write_smoke_evidence(out, identities, world, plan, metric, checkpoint_dir)
        except BaseException as error:
            if rank == 0:
                try:
                    write_terminal(out, "failed", completed, checkpoint_dir, f"{type(error).__name__}: {error}")
                except SpdsError as also:  # the disk that failed the run may refuse this too
                    print(f"spds: could not record the failure in terminal.json: {also}", file=sys.stderr)
            raise
        status = "stopped" if completed < last else "complete"
        if rank == 0:
            write_terminal(out, status, completed, checkpoint_dir, stop.reason() if status == "stopped" else None)
            stop.answered()
    torch.distributed.barrier()
    return dict(status=status, update=completed, output=str(out),
                checkpoint=str(checkpoint_dir) if checkpoint_dir else None)


def train_step(engine, store: PackedStore, plan: Plan, step: Step, rank: int, device, stop: StopRequest,
               max_grad_norm: float | None):
    """One update: d/dprompt of (sum CE over the global batch) / (its supervised tokens).

    Every backward is of a plain sum (no scale enters the bf16 student); the one normalisation is
    the fp32 division of the summed prompt gradient by the global supervised-token count."""
    started = time.monotonic()
    denominator = step.supervised_tokens
    segments = load_segments(store, step.dealt[rank], device)  # one copy: no host sync in the loop below
    local_loss = torch.zeros((), dtype=torch.float32, device=device)
    with engine.no_sync():  # accumulate locally; no averaging, no 1/GAS
        for records, checkpoint_positions, counted in plan.passes(step, rank, engine.module.layout.lockstep):
            agreed = {"checkpoint_positions": checkpoint_positions} if checkpoint_positions else {}
            loss_sum = engine([segments[i] for i in records], **agreed)
            if counted:
                engine.backward(loss_sum)
                local_loss += loss_sum.detach()
            else:  # a lockstep filler: the other ranks' collectives, an exactly zero gradient
                engine.backward(loss_sum * 0.0)
    engine.allreduce_gradients()  # exact SUM over ranks (gradient_allreduce_op "sum")
    loss_sum, stop_votes = all_reduce_sum([local_loss, stop.vote()], device)
    prompt = engine.module.prompt
    prompt.grad.div_(denominator)  # fp32, once, identical on every rank
    grad_norm = float(torch.nn.utils.clip_grad_norm_([prompt], max_grad_norm or float("inf")))
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
        raise SpdsError(f"update {step.update}: the loss ({loss_sum / denominator}) or the prompt gradient norm "
                        f"({grad_norm}) is not finite; nothing was applied, and the last committed checkpoint is "
                        "the resume point (lower optim.learning_rate or set optim.max_grad_norm)")
    check_precision(engine)
    learning_rate = engine.get_lr()[0]
    engine.step()
    check_precision(engine, student=False)  # the moments the step just wrote
    seconds = time.monotonic() - started
    metric = dict(loss=loss_sum / denominator, supervised_tokens=denominator, tokens=step.positions,
                  records=len(step.batch), grad_norm=grad_norm, learning_rate=learning_rate, seconds=seconds,
                  tokens_per_second=step.positions / seconds,
                  peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0,
                  global_batch_sha256=step.digest)
    return metric, stop_votes > 0


def stop_agreed(stop: StopRequest, device) -> bool:
    """Collective: has any rank been asked to stop? (Between updates, train_step's sum says it.)"""
    (votes,) = all_reduce_sum([stop.vote()], device)
    return votes > 0


# ---------------------------------------------------------------- identities and records

def code_digest() -> str:
    files = sorted([*(REPO_ROOT / "spds").rglob("*.py"), *(REPO_ROOT / "schemas").glob("*.json")])
    return sha256_json({str(p.relative_to(REPO_ROOT)): p.read_bytes().hex() for p in files})


def run_identities(config: Config, store: PackedStore, world: int) -> dict:
    optim = config["optim"]
    topology = dict(world_size=world, micro_batch=optim["micro_batch"], micro_batch_tokens=optim["micro_batch_tokens"],
                    reduction="sum")
    # The student's content, pinned or not: weights changed under an unpinned path must not resume a
    # run trained on others. A pin was verified when the config was loaded; without one, rank 0
    # hashes the files (gigabytes: once per run, not once per rank) and tells the others.
    student = config["student"]["model_sha256"]
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
    if not config["train"]["require_smoke"]:
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def launch_environment() -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES",
            "DS_ACCELERATOR", "TORCHELASTIC_RUN_ID")
    environment = {k: os.environ[k] for k in keys if k in os.environ}
    environment.update({k: v for k, v in os.environ.items() if k.startswith(("SLURM_JOB", "SLURM_NODE", "SLURM_PROCID",
                                                                             "NCCL_"))})
    by_deepspeed = any(a.startswith("--local") for a in sys.argv)
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "deepspeed" if by_deepspeed else "none"
    return dict(hostname=socket.gethostname(), launcher=launcher, argv=sys.argv, environment=environment)


def write_validated(path: Path, value: dict, schema: str) -> None:
    require_valid(value, schema, path.name)
    atomic_write_json(path, value)


def write_run_record(out, config, smoke, start, last, world, identities, smoke_waived, resumed_from, model) -> None:
    write_validated(out / "run.json", dict(
        mode="smoke" if smoke else "train", started_at=time.time(), start_update=start, updates=last, world_size=world,
        identities=identities, versions=library_versions(), config=config.raw, config_path=str(config.path),
        launch=launch_environment(), smoke_waived=smoke_waived,
        resumed_from=str(resumed_from) if resumed_from else None,
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        loss_kernel=model.loss_fn.kernel), "run")


def keep_metrics_before(path: Path, start: int) -> None:
    """Keep the metrics of updates before `start` (atomically): a run that resumes redoes the
    updates after its checkpoint, and each must appear once. A torn last line goes too."""
    if not path.exists():
        return
    kept, lines = [], path.read_text().splitlines()
    for line in lines:
        try:
            if json.loads(line)["update"] < start:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if kept != lines:
        with atomic_writer(path) as stream:
            stream.write("".join(line + "\n" for line in kept))


def record_metric(out: Path, metric: dict, last: int, saved, bar, engine) -> None:
    require_valid(metric, "metrics", "a metrics line")
    append_line_durably(out / "metrics.jsonl", canonical_json(metric))
    done = metric["update"]
    atomic_write_json(out / "progress.json", dict(status="running", update=done, updates=last, loss=metric["loss"],
                                                  elapsed_seconds=metric["elapsed_seconds"],
                                                  eta_seconds=metric["seconds"] * (last - done),
                                                  last_checkpoint=str(saved) if saved else None))
    if engine.monitor.enabled:  # TensorBoard / CSV through DeepSpeed's monitor settings
        engine.monitor.write_events([(f"spds/{k}", metric[k], done) for k in ("loss", "grad_norm", "learning_rate",
                                                                              "tokens_per_second")])
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{metric['loss']:.4f}", tok_s=f"{metric['tokens_per_second']:.0f}")
    else:
        print(f"update {done}/{last}  loss {metric['loss']:.4f}  grad_norm {metric['grad_norm']:.3g}  "
              f"lr {metric['learning_rate']:.3g}  {metric['tokens_per_second']:.0f} tok/s", flush=True)


def write_terminal(out: Path, status: str, update: int, saved, reason) -> None:
    write_validated(out / "terminal.json", dict(status=status, update=max(0, update), finished_at=time.time(),
                                                checkpoint=str(saved) if saved else None, reason=reason), "terminal")


def write_smoke_evidence(out: Path, identities: dict, world: int, plan: Plan, metric: dict, saved: Path) -> None:
    write_validated(out / "evidence.json", dict(
        status="passed", identities=identities, world_size=world,
        longest_record_tokens=int(plan.store.length[plan.train_records].max()), metric=metric,
        checkpoint=str(saved), versions=library_versions()), "smoke")


def progress_bar(config: Config, rank: int, start: int, last: int):
    if rank != 0 or not config["train"]["progress_bar"] or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=last, initial=start - 1, unit="update", dynamic_ncols=True)


class rank_zero_lock:
    """Rank 0 holds an exclusive lock on the output directory: two trainers never share one."""

    def __init__(self, out: Path, rank: int):
        self.out, self.rank, self.lock = out, rank, None

    def __enter__(self):
        self.out.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.lock = exclusive_lock(self.out / ".train.lock", f"another spds trainer on {self.out}")
            self.lock.__enter__()
        return self

    def __exit__(self, *exc):
        if self.lock is not None:
            self.lock.__exit__(*exc)


def main(config_path: str, smoke: bool = False) -> int:
    config = load_config(config_path)
    result = run(config, smoke)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"spds {'smoke' if smoke else 'train'}: {result['status']} at update {result['update']}; "
              f"outputs in {result['output']}"
              + (f", checkpoint {result['checkpoint']}" if result["checkpoint"] else ""))
    torch.distributed.destroy_process_group()
    return 0
