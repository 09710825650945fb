"""Activation recomputation (activation checkpointing, in transformers' and DeepSpeed's words):
how many decoder layers recompute their activations in backward for a micro-batch, from the
memory its activations and its attention kernel need."""

from __future__ import annotations

import math

import torch
from torch import nn

from spds.errors import SpdsError
from spds.kernels.attention import AttentionPlan, head_dim_of
from spds.model.student import decoder_layers

# Stored activations of a bf16 decoder layer, in bytes per position per hidden unit, without
# recomputation, by the kernels the layer runs: the model's own, or Liger's RMSNorm, SwiGLU and
# RoPE, which keep less (measured by bench/check.py activation_bytes, bench/RESULTS.md, and
# rounded up). A recomputed layer keeps only its bf16 input (2 bytes) and, while it is
# recomputed in backward, one layer's full activations.
ACTIVATION_BYTES_PER_HIDDEN = {"own": 40, "liger": 26}
CHECKPOINTED_BYTES_PER_HIDDEN = 2


class RecomputePolicy:
    """Decides per micro-batch how many decoder layers recompute their activations in backward.

    A recomputed layer costs another forward (about half again its forward plus input-gradient
    backward), so spds recomputes only as many layers as memory needs: for "auto", the fewest k
    that bring the micro-batch's activations under the budget, counted as

        positions x hidden x (40 bytes per plain layer (26 with Liger's kernels), 2 per checkpointed
                              one, + one layer's recompute)
      + a kv prompt's keys and values in every record's key buffer, kept by each plain layer
      + the attention kernel's memory (AttentionPlan.memory: a quadratic kernel's score matrices,
        kept by each plain layer, and one layer's transient; FlashAttention's fp32 accumulators
        during one layer's backward).

    When even k = all layers cannot fit, it stops the run with the sizes and what to change,
    rather than run out of memory mid-update (the smoke meets the longest micro-batch first).
    True and False: all layers, none."""

    def __init__(
        self,
        setting,
        student: nn.Module,
        budget_gib: float | None,
        device: torch.device,
        attention: AttentionPlan | None = None,
        liger_kernels: bool = False,
    ):
        self.setting = setting
        self.activation_bytes = ACTIVATION_BYTES_PER_HIDDEN["liger" if liger_kernels else "own"]
        config = student.config
        self.layers, self.hidden = config.num_hidden_layers, config.hidden_size
        # a kv prompt read as a cache: each layer keeps its keys and values in every record's key
        # buffer for backward (spds/model/kv_prompt.py), [p, kv heads, head dim] twice a record
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dtype = next(student.parameters()).dtype
        self.prompt_key_bytes = 2 * kv_heads * head_dim_of(config) * dtype.itemsize
        self.attention = attention or AttentionPlan("auto", student, device)  # its kernels' memory
        self.budget = budget_gib * 2**30 if budget_gib else None
        self.device = device

    def __call__(self, positions: int, longest: int | None = None, packed: bool = False, prompt_keys: int = 0) -> int:
        """The layers to recompute for a micro-batch of `positions` (longest sequence `longest`)
        whose records read `prompt_keys` kv prompt keys in all (records x p)."""
        if self.setting in (True, False):
            return self.layers if self.setting else 0
        if self.device.type != "cuda" and self.budget is None:  # CPU: only with a budget given
            return 0
        if self.budget is None:  # measured once, after the student and engine are in memory
            self.budget = 0.9 * free_device_memory(self.device)
        plain, kept = self.activation_bytes, CHECKPOINTED_BYTES_PER_HIDDEN
        attention_kept, attention_transient = self.attention.memory(positions, longest or positions, packed)
        per_plain_layer = positions * self.hidden * plain + attention_kept + prompt_keys * self.prompt_key_bytes
        per_kept_layer = positions * self.hidden * kept
        running = positions * self.hidden * plain + attention_transient

        def need(k: int) -> float:  # bytes with the first k layers recomputed
            held = (self.layers - k) * per_plain_layer + k * per_kept_layer
            return held + (running if k else attention_transient)

        if need(0) <= self.budget:
            return 0
        if need(self.layers) > self.budget:
            raise SpdsError(
                f"a micro-batch of {positions} positions (longest sequence {longest or positions}) needs about "
                f"{need(self.layers) / 2**30:.1f} GiB of activations with every layer recomputed, over the "
                f"{self.budget / 2**30:.1f} GiB budget (student.activation_memory_gib, or 90% of the free GPU memory); "
                f"attention kernel {self.attention.kernel(longest or positions, packed)!r}"
                f"{' (memory quadratic in length)' if attention_kept else ''}: shorten the longest records, lower "
                "optim.micro_batch or optim.micro_batch_tokens, or choose an O(L) kernel (student.attention_kernel "
                "flex, flash)"
            )
        # need(k) falls linearly in k from k = 1: the fewest layers that fit
        needed = math.ceil((self.layers * per_plain_layer + running - self.budget) / (per_plain_layer - per_kept_layer))
        return int(min(self.layers, max(1, needed)))


def free_device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate: the device's free memory plus what PyTorch's caching
    allocator holds but no tensor uses (blocks freed by earlier work in this process, which
    mem_get_info counts as taken: a budget from it alone, after other work in the same process,
    recomputes many more layers than memory needs)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def enable_recompute(student: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(student, "activation_checkpointing_enable"):  # transformers >= 5.2x
        student.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def recompute_first(student: nn.Module, count: int) -> None:
    """Recompute the first `count` decoder layers in backward, keep the others' activations.

    transformers checkpoints a layer only in train mode; the frozen student has no dropout, so
    each layer's mode is its checkpointing switch and nothing else."""
    for index, layer in enumerate(decoder_layers(student)):
        if layer.training != (index < count):
            layer.train(index < count)
