"""The student's attention: which kernel runs it, chosen by spds, the same in forward and recompute.

When student.attn_implementation is sdpa, spds installs one attention function in the student
(transformers' AttentionInterface, "spds_causal"). Every sequence spds runs is causal and right
padded (a position never attends to a later one, so padding after a record's end changes
nothing, and no mask is needed), and its queries are the last positions of its keys: all of
them in a training pass, the record after a cached context in the teacher's (spds/teacher.py).
So the function is causal from the lower right, and takes no mask. Records packed end to end
(optim.micro_batch_layout packed) arrive as one row with their cumulative lengths
(`cu_seq_lens_q`, transformers' variable-length keywords), each attending only to itself.

The kernel is a per-forward choice (student.attention_kernel, by length): SoftPromptModel sets
`KernelChoice.kernel` before each forward. A checkpointed layer recomputes its forward during
backward, after any `with sdpa_kernel(...)` around the forward has ended; reading the choice
from the module makes the recompute run the forward's kernel (with a context manager it ran
PyTorch's default one).

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

import functools
import math
import os

import torch

from .errors import SpdsError

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
NAME = "spds_causal"

# Attention's own memory beyond a layer's activations. Kernels that materialise the scores
# (math SDPA, eager) keep a [heads, L, L] probability matrix per plain layer and hold about three
# such matrices while a layer runs forward or backward: (kept per plain layer, transient) bytes
# per head per position x sequence length. Flash, memory-efficient, cuDNN and flex keep O(L).
QUADRATIC_ATTENTION_BYTES = {"math": (2, 6), "eager": (6, 10)}


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


def import_fa4():
    """flash_attn.cute, with its compiled kernels kept on disk across processes.

    FA4 compiles each kernel (forward, backward, variable-length or not, deterministic or not) on
    its first call in a process, and `spds smoke`, `spds train` and every resume are processes of
    their own. Its persistent cache (off by default; read once, when flash_attn.cute is first
    imported) keeps them under a fingerprint of its sources, cutlass and tvm_ffi, writes each entry
    to a temporary name and renames it, recompiles an entry that does not load, and locks with
    flock, which the kernel releases when a process dies: no stale lock can hang a later start.
    A user's own FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED (and _DIR) stands."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    import flash_attn.cute

    return flash_attn.cute


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
        problem = fa4_unavailable(head_dim_of(config)) if device.type == "cuda" else "there is no CUDA device"
        if problem:
            raise SpdsError(f"student.attention_kernel names fa4 (FlashAttention-4), but {problem}; "
                            "choose another kernel")
    return setting


def kernels_in(setting) -> set[str]:
    """The kernel names a student.attention_kernel setting can choose."""
    return {setting["short"], setting["long"]} if isinstance(setting, dict) else {setting}


def packed_kernel(kernel: str, device: torch.device) -> str:
    """The kernel that runs records packed end to end when `kernel` is chosen (causal_attention):
    FlashAttention-4's own variable-length kernel, else FlashAttention-2's on CUDA (packed_causal),
    else `kernel` under a block-diagonal mask."""
    return "flash" if device.type == "cuda" and kernel != "fa4" else kernel


def kernel_for(setting, positions: int) -> str:
    """The kernel for a sequence of `positions` (padded) under a resolved setting."""
    if isinstance(setting, dict):  # {"below": N, "short": kernel, "long": kernel}, chosen by measurement
        return setting["short"] if positions < setting["below"] else setting["long"]
    return setting


class KernelChoice:
    """The kernel of the forward in flight, shared by the student's attention modules."""

    def __init__(self, kernel: str = "auto"):
        self.kernel = kernel


def install(student) -> KernelChoice | None:
    """spds's attention in `student` (an sdpa student; others keep their own), and its choice."""
    config = student.config
    if config._attn_implementation not in ("sdpa", NAME):
        return None
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, causal_attention)
    choice = KernelChoice()
    modules = [m for m in student.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]
    if len(modules) != config.num_hidden_layers:  # transformers' attention modules, one per layer
        raise SpdsError(f"cannot find the attention modules of {type(student).__name__} (found {len(modules)} "
                        f"for {config.num_hidden_layers} layers): set student.attn_implementation to eager")
    for module in modules:
        module.spds_kernel = choice
    config._attn_implementation = NAME  # unknown to transformers' mask builders: they build no mask
    return choice


def causal_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query [B, Hq, Lq, D], key and value [B, Hkv, Lk, D] with
    Lk >= Lq, each query at position Lk - Lq + i seeing keys up to its own. Returns [B, Lq, Hq, D]."""
    if kwargs.get("s_aux") is not None:  # never compute something else silently
        raise SpdsError("spds's attention has no attention sinks, which this model uses: set "
                        "student.attn_implementation to eager")
    choice = getattr(module, "spds_kernel", None)
    kernel = choice.kernel if choice is not None else "auto"
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window or softcap:  # Gemma 2 and 3, Mistral v0.1: the layer's own window and cap
        output = windowed_attention(kernel, query, key, value, scaling, window, softcap,
                                    kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"))
        return output, None
    if kwargs.get("cu_seq_lens_q") is not None:  # records packed end to end (optim.micro_batch_layout)
        starts, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
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


def repeated_heads(query, key, value):
    """key and value repeated to the query heads, for kernels that take no grouped-query heads."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def sdpa_causal(kernel: str, query, key, value, scaling):
    if kernel == "efficient":  # the memory-efficient kernel takes no grouped-query heads
        key, value = repeated_heads(query, key, value)
    call = functools.partial(torch.nn.functional.scaled_dot_product_attention, query, key, value, is_causal=True,
                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if kernel == "auto":
        return call()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[kernel])):
        return call()


def lower_right_causal(query, key, value, scaling):
    """Queries after cached keys (the teacher's record after its context), forward only."""
    from torch.nn.attention.bias import causal_lower_right

    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0:
        # FlashAttention-2 aligns a causal mask to the lower right when keys outnumber queries and
        # takes grouped-query keys as they are: the kernel torch's lower-right bias calls, without
        # repeating the keys to the query heads first (bench/check_cached_attention.py).
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False,
                                                                  scale=scaling)[0]
    key, value = repeated_heads(query, key, value)  # the bias path takes equal head counts
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(query.shape[2], key.shape[2]), scale=scaling)


def packed_causal(query, key, value, scaling, starts, longest: int):
    """Records packed end to end in one row (batch 1): each query sees the keys of its own record
    up to its own position, nothing of the records before it. `starts`: int32 [records + 1], the
    cumulative record lengths. Returns [positions, Hq, D].

    On CUDA this is FlashAttention-2's variable-length kernel (the op torch's varlen_attn and
    nested-tensor SDPA call; grouped-query keys as they are, its backward deterministic under
    train.deterministic's strict mode). Elsewhere (the CPU, an fp32 student): SDPA under the
    block-diagonal causal mask, O(positions^2) memory: the tests' tiny lengths."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0:
        rows = [t[0].transpose(0, 1) for t in (query, key, value)]  # [positions, heads, D], last dim contiguous
        return torch.ops.aten._flash_attention_forward(*rows, starts, starts, longest, longest, 0.0, True, False,
                                                       scale=scaling)[0]
    positions = query.shape[2]
    record = torch.repeat_interleave(torch.arange(len(starts) - 1, device=query.device), starts.diff().long())
    index = torch.arange(positions, device=query.device)
    allowed = (record[:, None] == record[None]) & (index[:, None] >= index[None])
    key, value = repeated_heads(query, key, value)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    return output[0].transpose(0, 1)


def fa4_causal(query, key, value, scaling, starts=None, longest: int | None = None):
    """FlashAttention-4, causal, grouped-query keys as they are. Returns [B, L, Hq, D], or with
    `starts` (records packed end to end in one row) [positions, Hq, D]. Its backward is the
    deterministic one whenever PyTorch's deterministic algorithms are on (train.deterministic)."""
    fa4 = import_fa4()
    flash_attn_func, flash_attn_varlen_func = fa4.flash_attn_func, fa4.flash_attn_varlen_func
    deterministic = torch.are_deterministic_algorithms_enabled()
    rows = [t.transpose(1, 2) for t in (query, key, value)]  # [B, L, heads, D], the layout it takes
    if starts is None:
        output = flash_attn_func(*rows, softmax_scale=scaling, causal=True, deterministic=deterministic)
    else:
        output = flash_attn_varlen_func(*(t[0] for t in rows), cu_seqlens_q=starts, cu_seqlens_k=starts,
                                        max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=scaling,
                                        causal=True, deterministic=deterministic)
    return output[0] if isinstance(output, tuple) else output  # (output, lse) in some versions


# ---------------------------------------------------------------- sliding windows and soft caps

def windowed_attention(kernel: str, query, key, value, scaling, window: int | None, softcap: float | None,
                       starts=None, longest: int | None = None):
    """A layer with a sliding window (each query sees the `window` keys up to its own, as
    transformers' masks have it: key > query - window) and/or a soft cap on the scores
    (c * tanh(s / c) before the softmax). Returns [B, Lq, Hq, D], or [1, positions, Hq, D] for
    records packed end to end (`starts`).

    On CUDA, a layer without a cap: packed records run FlashAttention-2's variable-length kernel
    with its left window, a row per record flex with a windowed block mask (whatever kernel the
    length chose). A soft-capped layer (Gemma 2), and every layer on the CPU, materialises its
    scores (O(L^2) memory, as transformers' eager attention does), with the window, the records'
    boundaries and the causal rule as one mask; flex's score modifier for the cap did not compile
    under its backward here (bench/RESULTS.md)."""
    window = window or None
    flash_dtype = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0
    if starts is not None:
        if flash_dtype and not softcap:
            rows = [t[0].transpose(0, 1) for t in (query, key, value)]
            left = window - 1 if window else -1  # -1: no window
            return torch.ops.aten._flash_attention_forward(*rows, starts, starts, longest, longest, 0.0, True, False,
                                                           scale=scaling, window_size_left=left,
                                                           window_size_right=0)[0][None]
        record = torch.repeat_interleave(torch.arange(len(starts) - 1, device=query.device), starts.diff().long())
        allowed = windowed_mask(query.shape[2], key.shape[2], window, query.device) & (record[:, None] == record[None])
        return explicit_attention(query, key, value, scaling, allowed, softcap)[0].transpose(0, 1)[None]
    if query.is_cuda and not softcap:
        return flex_windowed(query, key, value, scaling, window).transpose(1, 2).contiguous()
    allowed = windowed_mask(query.shape[2], key.shape[2], window, query.device)
    return explicit_attention(query, key, value, scaling, allowed, softcap).transpose(1, 2).contiguous()


def windowed_mask(queries: int, keys: int, window: int | None, device) -> torch.Tensor:
    """[queries, keys] bool: query i (at position keys - queries + i) sees key j when j <= its
    position and, with a window, j > its position - window."""
    position = torch.arange(queries, device=device)[:, None] + (keys - queries)
    column = torch.arange(keys, device=device)[None]
    allowed = column <= position
    return allowed & (column > position - window) if window else allowed


def explicit_attention(query, key, value, scaling, allowed, softcap: float | None):
    """softmax(cap(q k^T * scaling), masked) v with the scores materialised, as transformers'
    eager attention computes them (the scores in the inputs' dtype, the softmax in fp32)."""
    key, value = repeated_heads(query, key, value)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ value


def flex_windowed(query, key, value, scaling, window: int):
    mask = windowed_block_mask(query.shape[2], key.shape[2], window, query.device)
    return compiled_flex()(query, key, value, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


@functools.lru_cache(maxsize=256)
def windowed_block_mask(queries: int, keys: int, window: int | None, device: torch.device):
    """The causal block mask of `causal_block_mask`, limited to each query's window: a key block
    is visited when some query of the row tile sees some of its keys, and skips the mask when
    every query of the tile sees all of its keys."""
    from torch.nn.attention.flex_attention import BlockMask

    if not window:
        return causal_block_mask(queries, keys, device)
    offset = keys - queries
    query_blocks, key_blocks = math.ceil(queries / BLOCK), math.ceil(keys / BLOCK)
    partial, full = [], []
    for tile in range(query_blocks):
        first, last = tile * BLOCK + offset, min(queries, (tile + 1) * BLOCK) - 1 + offset  # the tile's positions
        seen_lo, seen_hi = max(0, first - window + 1), last  # keys some query of the tile sees
        full_lo, full_hi = max(0, last - window + 1), first  # keys every query of the tile sees
        own_full = [j for j in range(key_blocks) if j * BLOCK >= full_lo and min((j + 1) * BLOCK, keys) - 1 <= full_hi
                    and (j + 1) * BLOCK <= keys]
        own_partial = [j for j in range(seen_lo // BLOCK, min(key_blocks, seen_hi // BLOCK + 1)) if j not in own_full]
        partial.append(own_partial)
        full.append(own_full)

    def padded(lists):
        width = key_blocks  # flex's layout: a row of key-block indices per query tile
        counts = torch.tensor([len(x) for x in lists], dtype=torch.int32)
        indices = torch.tensor([x + [0] * (width - len(x)) for x in lists], dtype=torch.int32)
        return counts.to(device)[None, None].contiguous(), indices.to(device)[None, None].contiguous()

    def windowed(batch, head, q, k):
        return (k <= q + offset) & (k > q + offset - window)

    return BlockMask.from_kv_blocks(*padded(partial), *padded(full), BLOCK_SIZE=BLOCK, mask_mod=windowed,
                                    seq_lengths=(queries, keys))


# ---------------------------------------------------------------- flex

BLOCK = 128  # flex_attention's default sparse block


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.cuda.is_available():
        return flex_attention  # the CPU runs it eagerly (the tests: tiny lengths)
    return torch.compile(flex_attention, dynamic=True)  # one compilation for every length and batch


def flex_causal(query, key, value, scaling):
    mask = causal_block_mask(query.shape[2], key.shape[2], query.device)
    return compiled_flex()(query, key, value, block_mask=mask, scale=scaling,
                           enable_gqa=query.shape[1] != key.shape[1])


@functools.lru_cache(maxsize=256)
def causal_block_mask(queries: int, keys: int, device: torch.device):
    """flex_attention's BlockMask for queries at positions keys - queries + i, each seeing keys up
    to its own position, built from block indices (create_block_mask would evaluate the mask
    over every [query, key] pair: a gigabyte at 32k, or another compilation per length).

    Row tile i (queries qs..qe-1, key offset `o` = keys - queries) sees key block j fully when
    the block's last key (j+1)·B-1 <= qs + o, and partly up to j <= (qe-1+o) // B."""
    from torch.nn.attention.flex_attention import BlockMask

    offset = keys - queries
    query_blocks, key_blocks = math.ceil(queries / BLOCK), math.ceil(keys / BLOCK)
    first = torch.arange(query_blocks) * BLOCK  # each row tile's first query
    last = torch.clamp(first + BLOCK, max=queries) - 1
    # key blocks 0..full-1 are wholly visible to the tile's first query (so to all of it); a last
    # block cut short by the key count stays partial (the mask bounds it)
    full = torch.clamp((first + offset + 1) // BLOCK, 0, keys // BLOCK)
    seen = torch.clamp((last + offset) // BLOCK + 1, 0, key_blocks)  # key blocks 0..seen-1 at least partly
    columns = torch.arange(key_blocks)
    full_indices = torch.where(columns[None] < full[:, None], columns[None], 0)
    partial_count = seen - full
    partial_indices = torch.where(columns[None] < partial_count[:, None], full[:, None] + columns[None], 0)

    def causal(batch, head, q, k):
        return k <= q + offset

    def shaped(t):
        return t.to(device=device, dtype=torch.int32)[None, None].contiguous()

    return BlockMask.from_kv_blocks(shaped(partial_count), shaped(partial_indices), shaped(full), shaped(full_indices),
                                    BLOCK_SIZE=BLOCK, mask_mod=causal, seq_lengths=(queries, keys))
