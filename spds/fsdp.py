"""backend: fsdp — the frozen student's decoder layers sharded with PyTorch FSDP2 (fully_shard),
for students larger than one GPU; the FP32 prompt kept whole on every rank.

The engine offers the small part of DeepSpeed's engine interface that spds uses (call, no_sync,
backward, allreduce_gradients, step, get_lr, save/load_checkpoint, module, optimizer, monitor),
so train.py and checkpoint.py run unchanged:
  * only decoder layers are sharded: each layer's forward all-gathers its weights and frees them
    after; embeddings, final norm and lm_head (a few percent of a large model) stay replicated,
    because spds calls them directly (splicing the prompt, the fused loss), outside any forward;
  * no student parameter requires a gradient, so FSDP reduces nothing; the prompt's gradient
    accumulates locally and allreduce_gradients() sums it over ranks (exact SUM, like ZeRO-0);
  * checkpoints use DeepSpeed's file name and keys (module.prompt, optimizer, lr_scheduler), so a
    ZeRO-0 checkpoint continues under fsdp with the same world size.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import STATE_FILE
from .fsio import atomic_writer


def decoder_layers(student) -> torch.nn.ModuleList:
    layers = getattr(student.base_model, "layers", None)
    if layers is None:
        from .fsio import SpdsError

        raise SpdsError(f"backend fsdp: cannot find the decoder layers of {type(student).__name__} (base_model.layers)")
    return layers


class _NoMonitor:
    enabled = False


class FSDPEngine:
    gradient_average = False

    def __init__(self, model, optimizer, scheduler, device: torch.device):
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if device.type == "cuda":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        for layer in decoder_layers(model.student):
            fully_shard(layer, mesh=mesh)
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, scheduler
        self.monitor = _NoMonitor()
        with torch.no_grad():  # every rank starts from rank 0's prompt, as DeepSpeed's engine does
            dist.broadcast(model.prompt.data, src=0)

    def __call__(self, segments):
        return self.module(segments)

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
            state = {"module": {"prompt": self.module.prompt.detach().cpu()}, "optimizer": self.optimizer.state_dict(),
                     "lr_scheduler": self.lr_scheduler.state_dict(), "backend": "fsdp"}
            with atomic_writer(Path(save_dir) / tag / STATE_FILE, "wb") as stream:
                torch.save(state, stream)

    def load_checkpoint(self, load_dir: str, tag: str, **_) -> None:
        state = torch.load(Path(load_dir) / tag / STATE_FILE, map_location="cpu", weights_only=False)
        with torch.no_grad():
            self.module.prompt.copy_(state["module"]["prompt"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
