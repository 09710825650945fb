"""How the frozen student's weights lie over the ranks: whole on every rank (Replicated), or
sharded by PyTorch FSDP2 or DeepSpeed ZeRO-3. A layout says whether its forward gathers weights
collectively (`lockstep`: then every rank runs the same passes) and gathers parameters read
outside their module's forward (the lm_head weight around the fused loss). The engine that
trains the prompt around a sharded student is spds/training/sharded.py's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from spds.model.student import decoder_layers


class Replicated:
    """The student's layout when every rank holds it whole: nothing to gather or mark. Sharded
    layouts (below) offer the same two methods."""

    name = "replicated"
    lockstep = False  # no collective inside a forward: ranks may run different passes

    def before_forward(self) -> None:
        pass

    def gathered(self, parameters):
        """A context in which `parameters` are whole (read outside their module's forward)."""
        return contextlib.nullcontext()


def move_unsharded(module: torch.nn.Module, device: torch.device) -> None:
    """Move what the sharding left on the host (replicated parameters, buffers such as RoPE's
    inverse frequencies) to the device, leaving sharded parameters alone."""
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            sub._buffers[name] = buffer.to(device)
        for name, parameter in sub.named_parameters(recurse=False):
            if not hasattr(parameter, "ds_id") and parameter.device != device and not hasattr(parameter, "device_mesh"):
                parameter.data = parameter.data.to(device)


class FSDP2Layout(Replicated):
    """Decoder layers sharded by FSDP2; nothing to do around a forward (FSDP's hooks gather)."""

    name = "fsdp"
    lockstep = True

    def __init__(self, student, device: torch.device):
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if device.type == "cuda":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        for layer in decoder_layers(student):
            fully_shard(layer, mesh=mesh)  # moves the layer's shard to the mesh's device
        # The decoder stack is FSDP's root: its forward, which spds calls once per pass, begins and
        # ends each pass. Without a root above them every layer would be a root, and FSDP keeps a
        # root's weights gathered from forward to backward: the whole student on every GPU. The
        # root holds no weights itself: embeddings and final norm (also called outside its forward)
        # are left out, replicated.
        base = student.base_model
        fully_shard(base, mesh=mesh, ignored_params={p for p in base.parameters() if not hasattr(p, "device_mesh")})
        move_unsharded(student, device)


class ZeRO3Layout(Replicated):
    """Every student parameter partitioned by DeepSpeed ZeRO-3."""

    name = "zero3"
    lockstep = True

    def __init__(self, student, device: torch.device, ds_config: dict):
        import deepspeed

        # zero.Init moves each parameter to the device and partitions it at once, so the whole
        # student never sits on one GPU (deepspeed.initialize alone would first move the whole
        # module to the device). No optimizer: DeepSpeed then builds only its gather hooks for
        # the student; the prompt is not part of this module.
        deepspeed.zero.Init(module=student, config_dict_or_path=ds_config)
        self.engine, *_ = deepspeed.initialize(model=student, config=ds_config, dist_init_required=False)
        move_unsharded(student, device)
        self.coordinator = self.engine.optimizer.get_param_coordinator()

    def before_forward(self) -> None:
        # DeepSpeed resets its fetch trace when the wrapped module's forward starts; spds runs the
        # student's parts (embeddings, decoder, loss) itself, so it marks each micro-batch here.
        self.coordinator.reset_step()

    def gathered(self, parameters):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(parameters), modifier_rank=None)
