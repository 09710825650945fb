"""The attention kernels spds runs: each takes transformers' layout (query [B, Hq, Lq, D], key and
value [B, Hkv, Lk, D], Lk >= Lq), is causal from the lower right and takes no mask. Which one
runs a forward is spds/kernels/attention.py's decision (AttentionPlan); this module only computes.

  sdpa_causal          PyTorch SDPA on a named backend (flash, efficient, cudnn, math) or its own choice
  packed_causal        records packed end to end in one row: FlashAttention-2's variable-length kernel
  fa4_causal           FlashAttention-4 (the flash-attn-4 package, CuTe DSL), padded rows or packed
  flex_causal          torch's flex_attention on a causal block mask built from block indices
  windowed_attention   a layer's sliding window and/or soft cap (Gemma 2 and 3, Mistral v0.1)
  varlen_lower_right   sequences whose queries are the last of their keys (a kv prompt read as a cache)

Queries against keys that others share (a cached context, generate's shared prefix) are
spds/kernels/shared_keys.py's.
"""

from __future__ import annotations

import functools
import math
import os

import torch

SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


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


def repeated_heads(query, key, value):
    """key and value repeated to the query heads, for kernels that take no grouped-query heads."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def sdpa_causal(kernel: str, query, key, value, scaling):
    if kernel == "efficient":  # the memory-efficient kernel takes no grouped-query heads
        key, value = repeated_heads(query, key, value)
    call = functools.partial(
        torch.nn.functional.scaled_dot_product_attention,
        query,
        key,
        value,
        is_causal=True,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    if kernel == "auto":
        return call()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[kernel])):
        return call()


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


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
        return torch.ops.aten._flash_attention_forward(
            *rows, starts, starts, longest, longest, 0.0, True, False, scale=scaling
        )[0]
    positions = query.shape[2]
    record = torch.repeat_interleave(torch.arange(len(starts) - 1, device=query.device), starts.diff().long())
    index = torch.arange(positions, device=query.device)
    allowed = (record[:, None] == record[None]) & (index[:, None] >= index[None])
    key, value = repeated_heads(query, key, value)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    return output[0].transpose(0, 1)


def fa4_causal(query, key, value, scaling, starts=None, longest: int | None = None, with_lse: bool = False):
    """FlashAttention-4, causal, grouped-query keys as they are. Returns [B, L, Hq, D], or with
    `starts` (records packed end to end in one row) [positions, Hq, D]; `with_lse`: and the
    log-sum-exps ([B, Hq, L], or [Hq, positions]). Its backward is the deterministic one whenever
    PyTorch's deterministic algorithms are on (train.deterministic)."""
    fa4 = import_fa4()
    flash_attn_func, flash_attn_varlen_func = fa4.flash_attn_func, fa4.flash_attn_varlen_func
    deterministic = torch.are_deterministic_algorithms_enabled()
    rows = [t.transpose(1, 2) for t in (query, key, value)]  # [B, L, heads, D], the layout it takes
    if starts is None:
        output = flash_attn_func(
            *rows, softmax_scale=scaling, causal=True, deterministic=deterministic, return_lse=with_lse
        )
    else:
        output = flash_attn_varlen_func(
            *(t[0] for t in rows),
            cu_seqlens_q=starts,
            cu_seqlens_k=starts,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scaling,
            causal=True,
            deterministic=deterministic,
            return_lse=with_lse,
        )
    if with_lse:
        return output
    return output[0] if isinstance(output, tuple) else output  # (output, lse) in some versions


def varlen_lower_right(query, key, value, plan, scaling, kernel: str, window=None, softcap=None):
    """Sequences of queries each attending causally from the lower right to its own run of keys:
    query i of a sequence of m queries and n keys sees keys up to n - m + i (and, with a window,
    those after n - m + i - window), with a backward. query [queries, Hq, D], key and value [keys,
    Hkv, D]; `plan` gives each sequence's (first query, queries, first key, keys) and their
    cumulative counts (`starts_q`, `starts_k`, int32). Returns [queries, Hq, D]. A kv prompt read as a
    cache (spds/model/kv_prompt.py) is such sequences: a record's rest after its header and the prompt.

    On CUDA in half precision without a soft cap: FlashAttention-4's variable-length kernel where
    it is the student's kernel and no window is set, else FlashAttention-2's (aten's, the packed
    layout's kernel), one call for every sequence of the micro-batch. Elsewhere (the CPU, fp32, a
    soft-capped layer) each sequence through SDPA under its mask, or with a soft cap as
    transformers' eager attention computes it."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0 and not softcap:
        lengths = (plan.starts_q, plan.starts_k, plan.longest_q, plan.longest_k)
        if kernel == "fa4" and not window:
            output = import_fa4().flash_attn_varlen_func(
                query,
                key,
                value,
                cu_seqlens_q=plan.starts_q,
                cu_seqlens_k=plan.starts_k,
                max_seqlen_q=plan.longest_q,
                max_seqlen_k=plan.longest_k,
                softmax_scale=scaling,
                causal=True,
                deterministic=torch.are_deterministic_algorithms_enabled(),
            )
            return output[0] if isinstance(output, tuple) else output
        left = window - 1 if window else -1  # -1: no window
        return torch.ops.aten._flash_attention_forward(
            query, key, value, *lengths, 0.0, True, False, scale=scaling, window_size_left=left, window_size_right=0
        )[0]
    outputs = []
    for first_q, queries, first_k, keys in plan.sequences:
        q = query[first_q : first_q + queries].transpose(0, 1)[None]  # [1, Hq, m, D]
        k, v = (t[first_k : first_k + keys].transpose(0, 1)[None] for t in (key, value))
        allowed = windowed_mask(queries, keys, window or None, query.device)
        if softcap:
            output = explicit_attention(q, k, v, scaling, allowed, softcap)
        else:
            k, v = repeated_heads(q, k, v)
            output = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
        outputs.append(output[0].transpose(0, 1))
    return torch.cat(outputs)


# ---------------------------------------------------------------- sliding windows and soft caps


def windowed_attention(
    kernel: str,
    query,
    key,
    value,
    scaling,
    window: int | None,
    softcap: float | None,
    starts=None,
    longest: int | None = None,
):
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
            return torch.ops.aten._flash_attention_forward(
                *rows,
                starts,
                starts,
                longest,
                longest,
                0.0,
                True,
                False,
                scale=scaling,
                window_size_left=left,
                window_size_right=0,
            )[0][None]
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
        own_full = [
            j
            for j in range(key_blocks)
            if j * BLOCK >= full_lo and min((j + 1) * BLOCK, keys) - 1 <= full_hi and (j + 1) * BLOCK <= keys
        ]
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

    return BlockMask.from_kv_blocks(
        *padded(partial), *padded(full), BLOCK_SIZE=BLOCK, mask_mod=windowed, seq_lengths=(queries, keys)
    )


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
    return compiled_flex()(query, key, value, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


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

    return BlockMask.from_kv_blocks(
        shaped(partial_count),
        shaped(partial_indices),
        shaped(full),
        shaped(full_indices),
        BLOCK_SIZE=BLOCK,
        mask_mod=causal,
        seq_lengths=(queries, keys),
    )
