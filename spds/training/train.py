"""spds smoke / spds train: the training loop, top-down.

    contract -> process group -> packed data -> frozen student + FP32 prompt (+ its teacher)
    -> DeepSpeed engine -> resume from the newest committed checkpoint -> for each update:
         global batch (seed, u) -> this rank's records -> micro-batches under no_sync
         (each: the teacher's targets -> the student's summed loss -> backward)
         -> exact SUM all-reduce -> clip -> step -> metrics -> checkpoint / stop at the boundary

Every rank runs this file. What the run writes (rank 0) is records.RunRecords's; what it is
bound to, identity's; when it saves and where it resumes, checkpoint.Checkpointer's.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spds.contract.config import Config
from spds.contract.gate import load_config, validate_run_world
from spds.data.packed import PackedStore
from spds.data.student_files import decodable_ids, load_tokenizer
from spds.errors import SpdsError
from spds.fsio import exclusive_lock
from spds.kernels.attention import use_deterministic_kernels
from spds.model.build import build_soft_prompt_model
from spds.model.kv_prompt import inserted_positions
from spds.model.soft_prompt import load_segments
from spds.model.student import quadratic_length
from spds.model.teacher import Teacher, build_teacher
from spds.stop import StopRequest, fault_point, pace_point, peer_lost
from spds.training.checkpoint import Checkpointer
from spds.training.engine import Engine, all_reduce_sum, build_engine, check_precision, init_distributed
from spds.training.identity import check_smoke_evidence, run_identities
from spds.training.on_policy import Sampler, Samples
from spds.training.records import RunRecords, StartupClock, rank_hosts
from spds.training.schedule import Plan, Step

# ---------------------------------------------------------------- the loop


def run(config: Config, smoke: bool, clock: StartupClock | None = None) -> dict:
    stop = StopRequest.install()  # spds.cli installed it first thing; a library caller gets it here
    clock = clock or StartupClock()  # from `spds train` (or this call) to each start-up phase's end
    if config.train.deterministic:
        use_deterministic_kernels()
    rank, world, device = init_distributed(config.distributed)
    clock.mark("process_group")
    out = config.output_dir / "smoke" if smoke else config.output_dir
    with rank_zero_lock(out, rank):  # before anything touches the run directory
        run_files = RunRecords(
            out, rank, last=1 if smoke else config.optim.updates, progress_bar=config.train.progress_bar
        )
        if rank == 0:
            stop.watch(config.output_dir)  # rank 0 reads stop requests for everyone
        try:
            run = start_up(config, smoke, out, run_files, stop, clock, rank, world, device)
            stopping, began, metric = run.stopping, time.monotonic(), None
            for update in range(run.start, run_files.last + 1):
                if stopping:
                    break
                step = run.plan.step(update, force_longest=smoke)
                fault_point(f"sigterm-before-update-rank{rank}", update)
                pace_point()
                samples = run.sampler.for_step(run.store, step, device) if run.sampler else None
                metric, stopping = train_step(
                    run.engine,
                    run.teacher,
                    run.store,
                    run.plan,
                    step,
                    rank,
                    device,
                    stop,
                    config.optim.max_grad_norm,
                    samples,
                )
                metric.update(update=update, elapsed_seconds=time.monotonic() - began)
                run_files.update_done(metric, run.engine, samples.ids if samples else None)
                reason = run.saver.reason(update, run_files.last, stopping)
                if reason:
                    run_files.checkpoint = run.saver.save(run.engine, run.plan.cursor(step, rank), update, reason)
            if smoke and metric is not None:  # not when a stop came during start-up: nothing ran to prove
                run.saver.prove_restore(run.engine, run_files.checkpoint)
                run_files.smoke_passed(run.identities, world, run.plan.longest_record_tokens, metric)
        except BaseException as error:
            lost = peer_lost(
                error, config.output_dir, rank, "The same command resumes from the newest committed checkpoint."
            )
            run_files.failed(lost or error)
            if lost:
                raise lost from None
            raise
        status = run_files.finish(stop.reason)
        if rank == 0:
            stop.answered()
    torch.distributed.barrier()
    return run_files.result(status)


@dataclass
class Started:
    """What start-up built for the loop. With a stop asked for during start-up (`stopping`), no
    student and no engine: the run records its stop and loads nothing."""

    store: PackedStore
    plan: Plan
    identities: dict
    teacher: Teacher | None
    sampler: Sampler | None
    engine: Engine | None
    saver: Checkpointer
    start: int  # the first update to run: 1, or the one after the restored checkpoint
    stopping: bool


def start_up(
    config: Config,
    smoke: bool,
    out: Path,
    run_files: RunRecords,
    stop: StopRequest,
    clock: StartupClock,
    rank: int,
    world: int,
    device: torch.device,
) -> Started:
    """Data, identities, the student and its teacher, the engine, the resume point, then run.json."""
    validate_run_world(config, world)
    stopping = stop_agreed(stop, device)  # asked during start-up: load nothing
    store = open_store(config)
    quadratic = config.optim.quadratic_length or quadratic_length(config.model_path)
    plan = Plan(
        store, config.optim, inserted_positions(config.soft_prompt.form, config.soft_prompt.length), world, quadratic
    )
    clock.mark("data")
    identities = run_identities(config, store, world)
    smoke_waived, smoke_code_change = (False, None) if smoke else check_smoke_evidence(config, identities)
    seed_everything(config.optim.seed)
    clock.mark("identities")
    model = None if stopping else build_soft_prompt_model(config, device)
    teacher = build_teacher(config, model, store, memo=True) if model and model.loss_fn.needs_teacher else None
    sampler = on_policy_sampler(config, model, store)
    clock.mark("student")
    engine = None if stopping else build_engine(config, model, world)
    clock.mark("engine")
    saver = Checkpointer(config, out, smoke, identities, rank, world)
    run_files.resume_point(*saver.newest())  # what terminal.json names, should the restore be refused
    start = saver.restore(engine, run_files.checkpoint)
    run_files.resume_point(start - 1, run_files.checkpoint)
    clock.mark("resume")
    code_changes = [c for c in (smoke_code_change, saver.code_change) if c]
    run_files.begin(
        config, smoke, start, world, identities, smoke_waived, code_changes, model, clock.seconds, rank_hosts()
    )
    stopping = stopping or stop_agreed(stop, device)
    return Started(store, plan, identities, teacher, sampler, engine, saver, start, stopping)


def open_store(config: Config) -> PackedStore:
    store = PackedStore.open(config.packed_dir)
    if store.manifest["prompt_length"] != config.soft_prompt.length:  # its context_limit check used it
        raise SpdsError(
            f"soft_prompt.length is {config.soft_prompt.length} but {config.packed_dir} was packed for "
            f"{store.manifest['prompt_length']}: run spds prepare into another packed_dir"
        )
    return store


def train_step(
    engine: Engine,
    teacher: Teacher | None,
    store: PackedStore,
    plan: Plan,
    step: Step,
    rank: int,
    device: torch.device,
    stop: StopRequest,
    max_grad_norm: float | None,
    samples: Samples | None = None,
) -> tuple[dict, bool]:
    """One update: d/dprompt of (the loss summed over the global batch's supervised tokens: CE,
    a divergence to the teacher, or both) / (their count). `samples`: the rows whose answers the
    student wrote (loss.on_policy), in place of the stored ones.

    Every backward is of a plain sum (no scale enters the bf16 student); the one normalisation is
    the fp32 division of the summed prompt gradient by the global supervised-token count."""
    started = time.monotonic() - (samples.seconds if samples else 0.0)  # the update's time includes sampling
    segments = load_segments(store, step.dealt[rank], device)  # one copy: no host sync in the loop below
    denominator = step.supervised_tokens
    if samples:
        segments.update({r: s for r, s in samples.segments.items() if r in segments})
        denominator += samples.added_tokens
    local_loss = accumulate(engine, teacher, segments, plan, step, rank)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # this rank's passes done: how long it computed, before waiting
    busy = [0.0] * plan.world
    busy[rank] = time.monotonic() - started
    engine.allreduce_gradients()  # exact SUM over ranks (gradient_allreduce_op "sum")
    loss_sum, stop_votes, *busy = all_reduce_sum([local_loss, stop.vote(), *busy], device)
    learning_rate = engine.get_lr()[0]
    grad_norm = apply_update(engine, step.update, loss_sum, denominator, max_grad_norm)
    seconds = time.monotonic() - started
    metric = dict(
        loss=loss_sum / denominator,
        supervised_tokens=denominator,
        tokens=step.positions,
        records=len(step.batch),
        longest_record_positions=step.longest_record_positions,
        grad_norm=grad_norm,
        learning_rate=learning_rate,
        seconds=seconds,
        tokens_per_second=step.positions / seconds,
        rank_busy_seconds=[round(b, 4) for b in busy],  # each rank's compute before the reduce
        peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0,
        global_batch_sha256=step.digest,
    )
    if samples:
        metric["on_policy"] = samples.metric()
    return metric, stop_votes > 0


def accumulate(engine: Engine, teacher: Teacher | None, segments: dict, plan: Plan, step: Step, rank: int):
    """This rank's passes of the update, each backward of a plain loss sum accumulated locally (no
    averaging, no 1/GAS); returns the summed loss of the passes that count."""
    local_loss = torch.zeros((), dtype=torch.float32, device=engine.module.prompt.device)
    with engine.no_sync():
        for records, recompute_positions, counted in plan.passes(step, rank, engine.module.layout.lockstep):
            batch = [segments[i] for i in records]
            agreed = {"recompute_positions": recompute_positions} if recompute_positions else {}
            # the teacher first: its activations are freed before the student's are stored
            targets = teacher.targets(batch) if teacher else None
            loss_sum = engine(batch, teacher=targets, **agreed)
            if counted:
                engine.backward(loss_sum)
                local_loss += loss_sum.detach()
            else:  # a lockstep filler: the other ranks' collectives, an exactly zero gradient
                engine.backward(loss_sum * 0.0)
    return local_loss


def apply_update(engine: Engine, update: int, loss_sum: float, denominator: int, max_grad_norm: float | None) -> float:
    """The summed prompt gradient divided by the global supervised-token count (fp32, once,
    identical on every rank), clipped if asked, checked finite, then the optimizer's step. Returns
    the gradient norm before clipping."""
    prompt = engine.module.prompt
    prompt.grad.div_(denominator)
    grad_norm = float(torch.nn.utils.clip_grad_norm_([prompt], max_grad_norm or float("inf")))
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
        raise SpdsError(
            f"update {update}: the loss ({loss_sum / denominator}) or the prompt gradient norm "
            f"({grad_norm}) is not finite; nothing was applied, and the last committed checkpoint is "
            "the resume point (lower optim.learning_rate or set optim.max_grad_norm)"
        )
    check_precision(engine)
    engine.step()
    check_precision(engine, student=False)  # the moments the step just wrote
    return grad_norm


def on_policy_sampler(config: Config, model, store: PackedStore) -> Sampler | None:
    """loss.on_policy's sampler (None when off, or when start-up stopped before a model)."""
    if model is None or not config.loss.on_policy.fraction:
        return None
    vocabulary = decodable_ids(load_tokenizer(config), model.student.config.get_text_config().vocab_size)
    return Sampler(config.loss.on_policy, model, list(store.manifest["end_token_ids"]), config.optim.seed, vocabulary)


def stop_agreed(stop: StopRequest, device) -> bool:
    """Collective: has any rank been asked to stop? (Between updates, train_step's sum says it.)"""
    (votes,) = all_reduce_sum([stop.vote()], device)
    return votes > 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class rank_zero_lock:
    """Rank 0 holds an exclusive lock on the output directory: two trainers never share one."""

    def __init__(self, out: Path, rank: int):
        self.out, self.rank, self.lock = out, rank, None

    def __enter__(self):
        self.out.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            # the directory itself: deleting a file in it cannot free the lock under a running trainer
            self.lock = exclusive_lock(self.out, f"another spds trainer on {self.out}")
            self.lock.__enter__()
        return self

    def __exit__(self, *exc):
        if self.lock is not None:
            self.lock.__exit__(*exc)


def main(config_path: str, smoke: bool = False, started: float | None = None) -> int:
    clock = StartupClock(started)
    config = load_config(config_path)  # the schema, and every pinned input's sha256
    clock.mark("config")
    result = run(config, smoke, clock)
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            f"spds {'smoke' if smoke else 'train'}: {result['status']} at update {result['update']}; "
            f"outputs in {result['output']}" + (f", checkpoint {result['checkpoint']}" if result["checkpoint"] else "")
        )
    torch.distributed.destroy_process_group()
    return 0
