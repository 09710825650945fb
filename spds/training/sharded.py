"""Students larger than one GPU: the frozen student sharded over the ranks, the FP32 prompt whole.

Two ways to shard (the layouts: spds/model/layout.py), one engine around them (this module):
  * sharding "fsdp": each decoder layer is wrapped by PyTorch FSDP2 (fully_shard); its forward
    all-gathers the layer's weights and frees them after (the decoder stack is the root). The
    embeddings, final norm and lm_head (a few percent of a large model) stay replicated, because
    spds calls them directly (splicing the prompt, the fused loss), outside any layer's forward.
  * sharding "deepspeed" with zero_optimization.stage 3: DeepSpeed ZeRO-3 partitions every student
    parameter (DeepSpeedZeRoOffload, what deepspeed.initialize builds for stage 3 without an
    optimizer) and gathers each module's weights around its forward and again for its backward.
    spds calls the embedding module directly (its hooks gather it) and gathers the lm_head weight
    explicitly around the fused loss, which computes its input gradient in the forward pass.

The prompt is kept out of both: DeepSpeed's ZeRO-3 path averages gradients and rejects
gradient_allreduce_op "sum"; FSDP would reduce-scatter. Here the prompt is a plain replicated
parameter: its gradient accumulates locally over the micro-batches and allreduce_gradients()
sums it over ranks, the same exact SUM as ZeRO-0; a torch Adam steps it on every rank alike.

Every forward gathers weights collectively, and so does every layer recomputed in backward, so
the ranks must run the same passes and checkpoint alike: the layout says `lockstep`, and
Plan.passes (spds/training/train.py) gives every rank as many passes as the busiest, fillers that count
nothing, and one checkpointing decision per pass.

The engine offers the part of DeepSpeed's engine interface that spds uses (call, no_sync,
backward, allreduce_gradients, step, get_lr, save_checkpoint, module, optimizer, monitor),
so train.py and checkpoint.py run unchanged. Checkpoints use DeepSpeed's ZeRO-0 file name and keys
(module.prompt, optimizer, lr_scheduler), so a checkpoint of any layout continues under any
other with the same world size.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spds.fsio import atomic_writer
from spds.training.checkpoint import STATE_FILE


class _NoMonitor:
    enabled = False


class ShardedEngine:
    gradient_average = False

    def __init__(self, model, optimizer, scheduler):
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, scheduler
        layout = model.layout
        if dist.get_rank() == 0 and model.prompt.is_cuda:
            print(
                f"spds: student sharded ({layout.name}): {torch.cuda.memory_allocated() / 2**30:.1f} GiB "
                f"on {model.prompt.device} after sharding",
                file=sys.stderr,
                flush=True,
            )
        self.monitor = _NoMonitor()
        with torch.no_grad():  # every rank starts from rank 0's prompt, as DeepSpeed's engine does
            dist.broadcast(model.prompt.data, src=0)

    def __call__(self, segments, **kwargs):
        return self.module(segments, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield  # nothing is reduced during backward: the student has no trainable parameters

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def allreduce_gradients(self) -> None:
        dist.all_reduce(self.module.prompt.grad)  # SUM: each rank's loss is already divided globally

    def step(self) -> None:
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def save_checkpoint(self, save_dir: str, tag: str, **_) -> None:
        if dist.get_rank() == 0:
            state = {
                "module": {"prompt": self.module.prompt.detach().cpu()},
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "backend": self.module.layout.name,
            }
            with atomic_writer(Path(save_dir) / tag / STATE_FILE, "wb") as stream:
                torch.save(state, stream)
