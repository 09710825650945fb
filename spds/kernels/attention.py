"""The student's attention: which kernel runs it, chosen by spds, the same in forward and recompute.

When student.attn_implementation is sdpa, spds installs one attention function in the student
(transformers' AttentionInterface, "spds_causal"). Every sequence spds runs is causal and right
padded (a position never attends to a later one, so padding after a record's end changes
nothing, and no mask is needed), and its queries are the last positions of its keys: all of
them in a training pass, the record after a cached context in the teacher's (spds/model/teacher.py).
So the function is causal from the lower right, and takes no mask. Records packed end to end
(optim.micro_batch_layout packed) arrive as one row with their cumulative lengths
(`cu_seq_lens_q`, transformers' variable-length keywords), each attending only to itself, or
to itself and to cached keys before them all (the teacher's context).

The kernel is a per-forward choice: AttentionPlan resolves student.attention_kernel once and
answers, for a micro-batch's length and layout, which kernel runs it and what memory that kernel
needs beyond the layer's activations; the forward (SoftPromptModel sets `KernelChoice.kernel`
before each one) and the recompute planner (spds/model/recompute.py) both ask it, so they never
disagree. The kernels themselves are spds/kernels/causal.py's (spds/kernels/shared_keys.py's after cached
keys). A checkpointed layer recomputes its forward during backward, after any `with
sdpa_kernel(...)` around the forward has ended; reading the choice from the module makes the
recompute run the forward's kernel (with a context manager it ran PyTorch's default one).

Kernels:
  auto, flash, efficient, cudnn, math   PyTorch SDPA (grouped-query heads passed through where
                                        the kernel takes them, repeated where it does not)
  fa4                                   FlashAttention-4 (the flash-attn-4 package, CuTe DSL;
                                        Hopper and Blackwell), grouped-query heads as they are;
                                        packed records run its variable-length kernel. The fastest
                                        measured on Hopper, and its deterministic backward (taken
                                        under train.deterministic) costs little more and beats
                                        flex's (bench/RESULTS.md): train.deterministic's choice
                                        where it runs.
  flex                                  torch's flex_attention, compiled once for every length
                                        (dynamic shapes), on a causal block mask built from
                                        block indices. Deterministic by construction (dQ and
                                        dK/dV in separate passes, no atomics) and O(L) memory:
                                        train.deterministic's choice on CUDA without fa4
"""

from __future__ import annotations

import math
import os

import torch

from spds.errors import SpdsError
from spds.kernels.causal import (
    fa4_causal,
    flex_causal,
    import_fa4,
    packed_causal,
    sdpa_causal,
    windowed_attention,
)
from spds.kernels.shared_keys import fa4_after_cached, lower_right_causal, packed_after_cached

NAME = "spds_causal"
# The forward keyword that carries a kv soft prompt to every layer as a cache (spds/model/kv_prompt.py's
# PromptCache): `attention(layer, ...)` computes the layer's attention with the prompt's keys and values
PROMPT_CACHE_KEYWORD = "spds_prompt_cache"

# Attention's own memory beyond a layer's activations. Kernels that materialise the scores
# (math SDPA, eager) keep a [heads, L, L] probability matrix per plain layer and hold about three
# such matrices while a layer runs forward or backward: (kept per plain layer, transient) bytes
# per head per position x sequence length. Flash, memory-efficient, cuDNN and flex keep O(L).
QUADRATIC_ATTENTION_BYTES = {"math": (2, 6), "eager": (6, 10)}


def avoid_cpu_flash_without_avx512() -> None:
    """PyTorch's CPU flash attention kernel for bf16 and fp16 stops on a CPU without AVX-512
    ("pack_vnni2 is only supported when avx512 is supported"), and PyTorch picks it by default for
    a causal attention without a mask. On such a CPU, in a process with no CUDA device, PyTorch's
    other SDPA kernels (math, memory-efficient) run instead: the same function, for every attention
    of the process (spds's kernels, transformers' own, generate's). The switch is named for CUDA
    but PyTorch's CPU dispatch reads it too. Called where a model is loaded."""
    if not torch.cuda.is_available() and "AVX512" not in torch.backends.cpu.get_cpu_capability():
        torch.backends.cuda.enable_flash_sdp(False)


def use_deterministic_kernels() -> None:
    """train.deterministic: every kernel on its deterministic algorithm, for a bit-exact GPU resume.

    Strict mode, not warn_only: under warn_only PyTorch keeps the atomic (run-to-run varying)
    backward of flash and memory-efficient attention and only warns; strict mode switches them to
    their deterministic algorithms and leaves cuDNN attention out, and an op with no deterministic
    algorithm stops the run with PyTorch's error instead of drifting silently. transformers'
    enable_full_determinism sets the same switches."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"  # attn_implementation flash_attention_2 reads it
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def fa4_unavailable(head_dim: int) -> str | None:
    """Why FlashAttention-4 cannot run this student here, or None. Its kernels are Hopper's and
    Blackwell's (compute capability 9 to 11), for head dimensions 8 to 256 in multiples of 8."""
    try:
        import_fa4()
    except Exception as error:  # not installed, or its CUDA libraries do not load
        return f"flash_attn.cute does not import ({type(error).__name__}: {str(error)[:120]}): pip install 'spds[fa4]'"
    if not torch.cuda.is_available():
        return "there is no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10, 11):
        return f"the GPU's compute capability is {major}.{minor}; its kernels are for 9.x to 11.x (Hopper, Blackwell)"
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"the student's head dimension is {head_dim}; its kernels take 8 to 256 in multiples of 8"
    return None


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kernel_setting(setting, deterministic: bool, student, device: torch.device):
    """student.attention_kernel as `student` runs it on `device`.

    Under train.deterministic, "auto" is FlashAttention-4 where it can run (spds[fa4] installed,
    Hopper or Blackwell), else flex on CUDA, and math on the CPU. FA4's deterministic backward
    trains faster than flex's and about as fast as the default kernels, and both resume bit for
    bit through a 32k record (bench/RESULTS.md). On the CPU math's kernels reduce in a fixed order
    anyway, and math is what the tests compare with.

    A named kernel that cannot run here (fa4 without its package or GPU) stops the build with
    what to change."""
    config = student.config
    if deterministic and setting == "auto":
        if device.type != "cuda":
            return "math"
        return "fa4" if fa4_unavailable(head_dim_of(config)) is None else "flex"
    # FlashAttention-4 is asked about only where it is named: its import takes seconds of start-up
    if "fa4" in kernels_in(setting) and config._attn_implementation in ("sdpa", NAME):
        require_fa4(head_dim_of(config), device)
    return setting


def require_fa4(head_dim: int, device: torch.device) -> None:
    """Stop, saying what to change, where student.attention_kernel names fa4 and it cannot run."""
    problem = fa4_unavailable(head_dim) if device.type == "cuda" else "there is no CUDA device"
    if problem:
        raise SpdsError(f"student.attention_kernel names fa4 (FlashAttention-4), but {problem}; choose another kernel")


def windowed_layers(config) -> list[bool]:
    """Which layers attend within a sliding window: those transformers marks "sliding_attention"
    in a model of two kinds of layers (Gemma 2 and 3, Qwen with sliding layers), every layer of a
    model with a window and no kinds (Mistral v0.1), none without a window (transformers sets it
    to None where a config's use_sliding_window is false)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or []
    return [
        bool(window) and (kinds[layer] == "sliding_attention" if kinds else True)
        for layer in range(config.num_hidden_layers)
    ]


def kernels_in(setting) -> set[str]:
    """The kernel names a student.attention_kernel setting can choose."""
    return {setting["short"], setting["long"]} if isinstance(setting, dict) else {setting}


def kernel_for(setting, positions: int) -> str:
    """The kernel for a sequence of `positions` (padded) under a resolved setting."""
    if isinstance(setting, dict):  # {"below": N, "short": kernel, "long": kernel}, chosen by measurement
        return setting["short"] if positions < setting["below"] else setting["long"]
    return setting


def determinism_problems(attn_implementation: str, setting) -> list[str]:
    """The attention settings that have no deterministic backward (train.deterministic refuses them)."""
    if attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
        return [
            f"student.attn_implementation: {attn_implementation!r} has no deterministic backward that "
            "spds can switch on, and train.deterministic is true: use sdpa (its fa4, flex or flash kernel) "
            "or eager"
        ]
    if attn_implementation == "sdpa" and "cudnn" in kernels_in(setting):
        return [
            "student.attention_kernel: cuDNN attention has no deterministic backward, and train.deterministic is "
            "true: use auto (fa4 or flex on CUDA), fa4, flex, flash, efficient or math"
        ]
    return []


class AttentionPlan:
    """The student's attention as it runs here: which kernel computes a micro-batch (by its longest
    sequence, padded rows or records packed end to end) and the memory that kernel needs beyond
    the layer's activations. Built once per model from a resolved setting (kernel_setting); the
    forward's dispatch and the recompute planner both read it."""

    def __init__(self, setting, student, device: torch.device, deterministic: bool = False):
        config = student.config
        self.setting = setting  # a kernel name, or {"below": N, "short": kernel, "long": kernel}
        self.device = device
        # spds's attention runs an sdpa student (install); any other keeps its own (eager, ...)
        self.implementation = config._attn_implementation
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = head_dim_of(config)
        # a soft-capped layer (Gemma 2) materialises its scores whatever the kernel (windowed_attention)
        self.materialised = bool(getattr(config, "attn_logit_softcapping", None))
        # flash's deterministic backward keeps one fp32 dQ per split of the SMs over the heads
        self.dq_splits = 0
        if deterministic and device.type == "cuda":
            self.dq_splits = math.ceil(torch.cuda.get_device_properties(device).multi_processor_count / self.heads)

    def kernel(self, longest: int, packed: bool = False) -> str:
        """The kernel that runs a micro-batch whose longest sequence has `longest` positions (padded).
        Records packed end to end run FlashAttention-4's own variable-length kernel, else
        FlashAttention-2's on CUDA (packed_causal), else the chosen kernel under a block-diagonal mask."""
        if self.implementation not in ("sdpa", NAME):
            return self.implementation  # the student's own attention
        kernel = kernel_for(self.setting, longest)
        if packed and self.device.type == "cuda" and kernel != "fa4":
            return "flash"
        return kernel

    def memory(self, positions: int, longest: int, packed: bool = False) -> tuple[float, float]:
        """(bytes each plain layer keeps, bytes one running layer needs at most) for attention over a
        micro-batch of `positions` whose longest sequence is `longest`. fa4 keeps O(L), like flash;
        its backward allocates fp32 accumulators for dQ and, with grouped-query heads, for dK and dV
        (flash_attn.cute's _flash_attn_bwd), one layer at a time."""
        kernel = "eager" if self.materialised else self.kernel(longest, packed)  # capped: scores kept, as eager
        kept, transient = QUADRATIC_ATTENTION_BYTES.get(kernel, (0, 0))
        square = positions * longest * self.heads  # batch x L^2 x heads: every sequence padded to `longest`
        workspace = 0
        if kernel == "flash":
            workspace = positions * self.dq_splits * self.heads * self.head_dim * 4
        elif kernel == "fa4":
            accumulated_heads = self.heads + (2 * self.kv_heads if self.kv_heads != self.heads else 0)
            workspace = positions * accumulated_heads * self.head_dim * 4
        return kept * square, transient * square + workspace


class KernelChoice:
    """The kernel of the forward in flight, shared by the student's attention modules."""

    def __init__(self, kernel: str = "auto"):
        self.kernel = kernel


def install(student) -> KernelChoice | None:
    """spds's attention in `student` (an sdpa student; others keep their own), and its choice."""
    config = student.config
    if config._attn_implementation not in ("sdpa", NAME):
        return None
    choice = KernelChoice()
    remedy = "set student.attn_implementation to eager"
    install_attention(student, NAME, causal_attention, "spds_kernel", choice, remedy)
    return choice


def install_attention(model, name: str, function, attribute: str, value, remedy: str) -> None:
    """Make `function` the attention of every layer of `model`: registered with transformers as
    `name`, the model's attention implementation (a name transformers' mask builders do not know,
    so they build no mask: a mask given goes in as given), and `value` set as `attribute` on each
    layer's attention module, where the function finds its settings. `remedy`: what to do when the
    modules are not found."""
    from transformers import AttentionInterface

    modules = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]
    layers = model.config.num_hidden_layers
    if len(modules) != layers:  # transformers' attention modules, one per layer
        raise SpdsError(
            f"cannot find the attention modules of {type(model).__name__} (found {len(modules)} for {layers} "
            f"layers): {remedy}"
        )
    for module in modules:
        setattr(module, attribute, value)
    AttentionInterface.register(name, function)
    model.config._attn_implementation = name


def causal_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query [B, Hq, Lq, D], key and value [B, Hkv, Lk, D] with
    Lk >= Lq, each query at position Lk - Lq + i seeing keys up to its own. Returns [B, Lq, Hq, D]."""
    if kwargs.get("s_aux") is not None:  # never compute something else silently
        raise SpdsError(
            "spds's attention has no attention sinks, which this model uses: set student.attn_implementation to eager"
        )
    choice = getattr(module, "spds_kernel", None)
    kernel = choice.kernel if choice is not None else "auto"
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    cache = kwargs.get(PROMPT_CACHE_KEYWORD)
    if cache is not None:  # a kv soft prompt: every record reads its keys and values as a cache
        return cache.attention(module.layer_idx, query, key, value, scaling, kernel, window, softcap), None
    if window or softcap:  # Gemma 2 and 3, Mistral v0.1: the layer's own window and cap
        output = windowed_attention(
            kernel, query, key, value, scaling, window, softcap, kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        )
        return output, None
    if kwargs.get("cu_seq_lens_q") is not None:  # records packed end to end (optim.micro_batch_layout)
        starts, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        if key.shape[2] > query.shape[2]:  # after keys all of them see (the teacher's cached context)
            after_cached = fa4_after_cached if kernel == "fa4" else packed_after_cached
            return after_cached(query, key, value, scaling, starts, longest)[None], None
        if kernel == "fa4":
            return fa4_causal(query, key, value, scaling, starts, longest)[None], None
        return packed_causal(query, key, value, scaling, starts, longest)[None], None
    if kernel == "fa4" and query.shape[2] == key.shape[2]:
        return fa4_causal(query, key, value, scaling), None
    if kernel == "flex":
        output = flex_causal(query, key, value, scaling)
    elif query.shape[2] == key.shape[2]:
        output = sdpa_causal(kernel, query, key, value, scaling)
    else:
        output = lower_right_causal(query, key, value, scaling)
    return output.transpose(1, 2).contiguous(), None
