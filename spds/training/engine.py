"""DeepSpeed set-up and the exact update.

What DeepSpeed is asked to do, and why (each verified on deepspeed 0.19.8, CPU/gloo and H200/NCCL):
  * fp32 engine: a bf16/fp16 section would cast every floating parameter, the prompt too, so the
    engine runs in fp32 and spds casts only the frozen student (student.dtype) itself.
  * gradient_accumulation_steps 1 and every micro-batch's backward under engine.no_sync(): the
    prompt gradient accumulates locally, untouched by DeepSpeed's 1/GAS scaling.
  * one engine.allreduce_gradients() per update with gradient_allreduce_op "sum" (averaging off):
    the reduced gradient is the exact SUM over ranks. Each rank's loss is already divided by the
    global supervised-token count, so the sum is the gradient of the global mean. (Multiplying the
    loss by the world size instead is not exact with a bf16 backbone.)
  * a torch Adam/AdamW over the prompt only, handed to deepspeed.initialize: no op builds.
  * every key that changes the numbers is set here, never left to a default: DeepSpeed 0.19.8
    defaults gradient_clipping to 1.0 and would clip every prompt gradient after spds's own
    clipping. After initialize, `check_engine_numerics` asks the engine what it will do and
    refuses to train if any answer differs, so a future default cannot change the update silently.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path
from typing import ContextManager, Protocol

import torch

from spds.contract.config import Config
from spds.contract.settings import DistributedSettings
from spds.errors import SpdsError
from spds.fsio import exclusive_lock, read_json
from spds.model.layout import FSDP2Layout, ZeRO3Layout
from spds.training.schedule import lr_factor
from spds.training.sharded import ShardedEngine


def ensure_accelerator_env() -> None:
    """DeepSpeed picks its accelerator at import: make a machine without CUDA choose the CPU, and
    refuse, naming the variable, a DS_ACCELERATOR that names CUDA where this process sees none (a
    variable sent to every node of a cluster with no GPU on this one): torch's own error comes as a
    traceback from inside the process group's start on every rank."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if os.environ.get("DS_ACCELERATOR") == "cuda" and not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else "no CUDA device visible"
        raise SpdsError(
            f"DS_ACCELERATOR=cuda, and this process has {build} (torch {torch.__version__}): set DS_ACCELERATOR=cpu "
            "(or leave it unset) for a CPU run, or run where a GPU is visible"
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def load_cpu_comm_op() -> None:
    """Build or load DeepSpeed's CPU shared-memory comm op so that an interrupted build cannot
    hang a later start.

    DeepSpeed JIT-builds this op in deepspeed.init_distributed under torch's FileBaton: a `lock`
    file in the extensions directory, created on entry and removed on exit. A process killed in
    between leaves the file, and every later build of the op waits on it forever, silently. spds
    loads the op first, itself, under an flock that the kernel releases when its holder dies: a
    `lock` found while holding the flock was left by a dead build (no spds process is building),
    so it is removed, with a message. DeepSpeed then finds the op already loaded."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    from torch.utils.cpp_extension import _get_build_directory

    build_directory = Path(_get_build_directory(builder.name, verbose=False))
    with exclusive_lock(build_directory.parent / f".{builder.name}.spds-build.lock", wait=True):
        baton = build_directory / "lock"
        if baton.exists():
            print(
                f"spds: removing {baton}, left by an interrupted build of DeepSpeed's {builder.name} op "
                "(it would make every later start wait forever)",
                file=sys.stderr,
                flush=True,
            )
            baton.unlink(missing_ok=True)
        builder.load(verbose=False)


def init_distributed(settings: DistributedSettings) -> tuple[int, int, torch.device]:
    """Join (or, without a launcher, create) the process group; return (rank, world, device)."""
    ensure_accelerator_env()
    import deepspeed

    load_cpu_comm_op()

    if "RANK" not in os.environ:  # one plain process: a one-rank group of its own
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", settings.master_addr)
        os.environ.setdefault("MASTER_PORT", str(settings.master_port or free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = settings.communication
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, timeout=datetime.timedelta(minutes=settings.timeout_minutes)
    )
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


class Engine(Protocol):
    """What train.py and checkpoint.py use of an engine. DeepSpeed's ZeRO-0 engine has it; spds's
    ShardedEngine (ZeRO-3 or FSDP2 student, spds/training/sharded.py) implements the same."""

    module: torch.nn.Module  # the SoftPromptModel: .prompt, .student, .layout
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler

    def __call__(self, segments, **kwargs) -> torch.Tensor: ...
    def no_sync(self) -> ContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def allreduce_gradients(self) -> None: ...  # the exact SUM of the prompt gradient over ranks
    def step(self) -> None: ...
    def get_lr(self) -> list[float]: ...
    def save_checkpoint(self, save_dir: str, tag: str, **kwargs) -> None: ...


def zero3_layout(config: Config, model, world: int):
    return ZeRO3Layout(model.student, model.prompt.device, deepspeed_config(config, world))


def fsdp2_layout(config: Config, model, world: int):
    return FSDP2Layout(model.student, model.prompt.device)


# Every way to lay the student out: (sharding, ZeRO stage of deepspeed_config) -> the layout
# builder, None for a replicated student under DeepSpeed's own ZeRO-0 engine. The contract
# refuses other pairs (fsdp with stage 3); a new layout is one row here and its class.
LAYOUTS = {("deepspeed", 0): None, ("deepspeed", 3): zero3_layout, ("fsdp", 0): fsdp2_layout}


def shard_student(config: Config, model, world: int) -> None:
    """Lay the student of `model` out over the ranks as the config says (config.shards_student)."""
    model.layout = LAYOUTS[(config.sharding, config.zero_stage)](config, model, world)


# The keys of a DeepSpeed config that change the update, as spds sets them (the ds_config schema
# forbids them in the user's file). Clipping is optim.max_grad_norm, applied by spds after the
# exact SUM; DeepSpeed must not clip again.
NUMERIC_KEYS = dict(
    gradient_accumulation_steps=1,
    gradient_clipping=0.0,
    prescale_gradients=False,
    gradient_predivide_factor=1.0,
    communication_data_type="fp32",
)


def deepspeed_config(config: Config, world: int) -> dict:
    """The user's DeepSpeed file plus the keys spds owns (the schema forbids setting them there)."""
    ds = read_json(config.deepspeed_config_path)
    micro = config.optim.micro_batch
    ds.update(NUMERIC_KEYS, train_micro_batch_size_per_gpu=micro, train_batch_size=micro * world)
    ds.setdefault("zero_optimization", {"stage": 0})
    if ds["zero_optimization"]["stage"] == 0:  # under ZeRO-3 the prompt never enters DeepSpeed's reduction
        ds["gradient_allreduce_op"] = "sum"
    return ds


def check_engine_numerics(engine) -> None:
    """Ask the built engine what it will do to the prompt gradient; refuse anything but the exact SUM."""
    answers = {
        "gradient_clipping()": (engine.gradient_clipping(), 0.0),
        "gradient_accumulation_steps()": (engine.gradient_accumulation_steps(), 1),
        "gradient_average": (engine.gradient_average, False),
        "postscale_gradients()": (engine.postscale_gradients(), True),
        "gradient_predivide_factor()": (engine.gradient_predivide_factor(), 1.0),
        "communication_data_type": (engine.communication_data_type, torch.float32),
        "bfloat16_enabled()": (engine.bfloat16_enabled(), False),
        "fp16_enabled()": (engine.fp16_enabled(), False),
    }
    wrong = [
        f"engine.{name} is {actual!r}, spds needs {expected!r}"
        for name, (actual, expected) in answers.items()
        if actual != expected
    ]
    if wrong:
        import deepspeed

        raise SpdsError(
            "DeepSpeed would not apply the exact update spds defines (a changed default in "
            f"deepspeed {deepspeed.__version__}?)",
            wrong,
        )


def build_engine(config: Config, model: torch.nn.Module, world: int) -> Engine:
    """DeepSpeed's ZeRO-0 engine, or (student sharded by FSDP2 or ZeRO-3) spds's ShardedEngine,
    which offers the same interface and the same exact SUM (spds/training/sharded.py)."""
    import deepspeed

    optim = config.optim
    optimizer_class = torch.optim.AdamW if optim.optimizer == "adamw" else torch.optim.Adam
    optimizer = optimizer_class(
        [model.prompt],
        lr=optim.learning_rate,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        foreach=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim))
    if config.shards_student:
        shard_student(config, model, world)
        return ShardedEngine(model, optimizer, scheduler)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(config, world),
        dist_init_required=False,
    )
    check_engine_numerics(engine)
    return engine


def check_precision(engine, student: bool = True) -> None:
    """Asserted every update: FP32 prompt, gradient and Adam moments; a gradient-free student."""
    prompt = engine.module.prompt
    if prompt.dtype != torch.float32 or (prompt.grad is not None and prompt.grad.dtype != torch.float32):
        raise SpdsError(
            f"soft prompt precision changed: parameter {prompt.dtype}, gradient {getattr(prompt.grad, 'dtype', None)}"
        )
    for name, moment in engine.optimizer.state.get(prompt, {}).items():
        if torch.is_tensor(moment) and moment.is_floating_point() and moment.dtype != torch.float32:
            raise SpdsError(f"optimizer state {name} is {moment.dtype}, not float32")
    for name, parameter in engine.module.student.named_parameters() if student else ():
        if parameter.requires_grad or parameter.grad is not None:
            raise SpdsError(f"frozen student parameter {name} requires or received a gradient")


def all_reduce_sum(values: list[float | torch.Tensor], device: torch.device) -> list[float]:
    """Sum small host/device scalars over ranks in one collective (one host sync per update)."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()
