"""The attention kernels spds runs: each takes transformers' layout (query [B, Hq, Lq, D], key and
value [B, Hkv, Lk, D], Lk >= Lq), is causal from the lower right and takes no mask. Which one
runs a forward is spds/attention.py's decision (AttentionPlan); this module only computes.

  sdpa_causal          PyTorch SDPA on a named backend (flash, efficient, cudnn, math) or its own choice
  lower_right_causal   queries after cached keys (the teacher's record after its context), forward only
  packed_after_cached  records packed end to end after keys all of them see (the teacher's), forward only
  fa4_after_cached     the same on FlashAttention-4
  fa4_shared_step      a decode step's queries against the shared context, on FlashAttention-4
  attend, merge        one attention with its log-sum-exps, and two over disjoint keys merged into one
  merge_parts          merge, as one Triton kernel on CUDA
  own_keys_step        a decode step's queries against each row's own keys (Triton, CUDA)
  packed_causal        records packed end to end in one row: FlashAttention-2's variable-length kernel
  fa4_causal           FlashAttention-4 (the flash-attn-4 package, CuTe DSL), padded rows or packed
  flex_causal          torch's flex_attention on a causal block mask built from block indices
  windowed_attention   a layer's sliding window and/or soft cap (Gemma 2 and 3, Mistral v0.1)
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


def lower_right_causal(query, key, value, scaling):
    """Queries after cached keys (the teacher's record after its context), forward only: as one
    record packed alone after keys all its queries see (packed_after_cached). Returns [B, Hq, Lq, D]."""
    if query.shape[0] != 1:  # records of a padded batch, each after the same cached keys
        return torch.cat(
            [lower_right_causal(query[i : i + 1], key[i : i + 1], value[i : i + 1], scaling) for i in range(len(query))]
        )
    length = query.shape[2]
    starts = torch.tensor([0, length], dtype=torch.int32, device=query.device)
    return packed_after_cached(query, key, value, scaling, starts, length).transpose(0, 1)[None]


# cuDNN builds an execution plan per shape: query and key lengths go in rounded up to this
CUDNN_LENGTH_MULTIPLE = 256
# A record this long runs its own (square, causal) part on cuDNN alone; shorter records of a pass
# run theirs together in FlashAttention-2's variable-length kernel, which cuDNN's is not trusted
# for in PyTorch yet (torch.nn.attention.varlen keeps it off).
CUDNN_OWN_FROM = 4096


def packed_after_cached(query, key, value, scaling, starts, longest: int):
    """Records packed end to end in one row (batch 1) after keys every one of them sees: the
    teacher's records after the cached system header and context. key and value hold the shared
    keys first, then the records' own; `starts` (int32 [records + 1]) delimits the records among
    the queries. Forward only. Returns [positions, Hq, D].

    Two parts merged by their log-sum-exps: every query against the shared keys at once (no mask,
    one call for all the records: the shared keys are read once per block of queries rather than
    once per record), and each record causally against its own keys. On CUDA in half precision
    the shared part and a lone long record's own part run on cuDNN, 1.6-1.7x faster than on
    FlashAttention-2 on H200 (bench/check_cached_attention.py), and several
    records' own parts on FlashAttention-2's variable-length kernel; elsewhere plain PyTorch
    under a block-diagonal mask."""
    cached, positions = key.shape[2] - query.shape[2], query.shape[2]
    own_key, own_value = key[:, :, cached:], value[:, :, cached:]
    on_gpu = flash_fits(query) and query.shape[-1] % 8 == 0
    if on_gpu and len(starts) == 2 and positions >= CUDNN_OWN_FROM:
        own, own_lse = cudnn_attention(query, own_key, own_value, scaling, causal=True)
    elif on_gpu:
        rows = [t[0].transpose(0, 1) for t in (query, own_key, own_value)]  # [positions, heads, D]
        own, own_lse = torch.ops.aten._flash_attention_forward(
            *rows, starts, starts, longest, longest, 0.0, True, False, scale=scaling
        )[:2]
        own, own_lse = own.transpose(0, 1)[None], own_lse[None]  # [1, Hq, positions, D], [1, Hq, positions]
    else:
        record = torch.repeat_interleave(torch.arange(len(starts) - 1, device=query.device), starts.diff().long())
        index = torch.arange(positions, device=query.device)
        allowed = (record[:, None] == record[None]) & (index[:, None] >= index[None])
        own, own_lse = attend(query, own_key, own_value, allowed[None, None], scale=scaling)
    if cached:
        shared, shared_lse = attend(query, key[:, :, :cached], value[:, :, :cached], scale=scaling)
        own = merge_parts(own, own_lse, shared, shared_lse, query.dtype)
    return own[0].transpose(0, 1).to(query.dtype)


def fa4_after_cached(query, key, value, scaling, starts, longest: int):
    """packed_after_cached on FlashAttention-4 (a student whose attention_kernel is fa4): both
    parts on its Hopper and Blackwell kernels, which return their log-sum-exps and take
    grouped-query keys as they are (no repeated heads, no padded lengths, no per-shape plans to
    build on the host). Forward only. Returns [positions, Hq, D]."""
    fa4 = import_fa4()
    cached = key.shape[2] - query.shape[2]
    rows = [t[0].transpose(0, 1) for t in (query, key, value)]  # [positions, heads, D], as FA4 takes them
    own, own_lse = fa4.flash_attn_varlen_func(
        rows[0],
        rows[1][cached:],
        rows[2][cached:],
        cu_seqlens_q=starts,
        cu_seqlens_k=starts,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        softmax_scale=scaling,
        causal=True,
        return_lse=True,
    )  # [positions, Hq, D], [Hq, positions]
    if not cached:
        return own
    shared, shared_lse = fa4.flash_attn_func(
        rows[0][None], rows[1][None, :cached], rows[2][None, :cached], softmax_scale=scaling, return_lse=True
    )  # [1, positions, Hq, D], [1, Hq, positions]
    merged = merge_parts(own.transpose(0, 1)[None], own_lse[None], shared.transpose(1, 2), shared_lse, query.dtype)
    return merged[0].transpose(0, 1)


def cudnn_attention(query, key, value, scale: float, causal: bool = False):
    """`attend` on cuDNN (CUDA, half precision, no mask): [B, Hq, m, D] against [B, Hkv, n, D] (with
    `causal`, m == n) -> the output [B, Hq, m, D] and the log-sum-exps [B, Hq, m]. Lengths go in
    padded to CUDNN_LENGTH_MULTIPLE (padded queries are dropped; padded keys come after every real
    query under the causal rule, and are never padded without it), and grouped keys repeated to
    the query heads."""
    m, n = query.shape[2], key.shape[2]
    key, value = repeated_heads(query, key, value)
    padded_m = -(-m // CUDNN_LENGTH_MULTIPLE) * CUDNN_LENGTH_MULTIPLE
    if padded_m != m:
        query = torch.nn.functional.pad(query, (0, 0, 0, padded_m - m))
        if causal:
            key, value = (torch.nn.functional.pad(t, (0, 0, 0, padded_m - n)) for t in (key, value))
    output, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return output[:, :, :m], lse.reshape(*output.shape[:3])[:, :, :m]


def cudnn_fits(query: torch.Tensor, key: torch.Tensor, causal: bool, softcap: float | None = None) -> bool:
    """Whether `attend` runs on cuDNN: where flash fits, with a head size a multiple of 8 up to 128
    (the sizes measured here; Gemma 3's 256 stays on flash) and, when causal, as many queries as
    keys (cudnn_attention pads both alike)."""
    dim = query.shape[-1]
    square = not causal or query.shape[2] == key.shape[2]
    return flash_fits(query, softcap) and dim % 8 == 0 and dim <= 128 and square


def flash_fits(query: torch.Tensor, softcap: float | None = None) -> bool:
    """Whether PyTorch's flash kernel computes this attention: on CUDA, in half precision, scores
    not soft-capped."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and softcap is None


def attend(query, key, value, mask=None, scale: float | None = None, softcap: float | None = None, causal=False):
    """query [b, hq, m, D] against key and value [b, hkv, n, D], each query row seeing the keys
    `mask` marks (bool [b or 1, 1, m, n]; None: all of them), or with `causal` row i keys 0..i
    (m == n): the output [b, hq, m, D] and the log-sum-exp of each row's scaled scores [b, hq, m]
    (fp32; -inf for a row that sees no key), the pieces two attentions over disjoint keys are
    merged from (`merge`). On CUDA without a mask or a soft cap cuDNN (Hopper's kernel: 2-4x
    FlashAttention-2's rate on H200 for the shapes spds gives it, bench/RESULTS.md), else flash
    attention, else the memory-efficient kernel; elsewhere plain PyTorch."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    if mask is None and cudnn_fits(query, key, causal, softcap):
        return cudnn_attention(query, key, value, scale, causal)
    if mask is None and flash_fits(query, softcap):
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale
        )[:2]
        return output, lse
    if key.shape[1] != query.shape[1]:  # the other kernels take equal head counts
        key, value = repeated_heads(query, key, value)
    if not query.is_cuda or softcap is not None:  # scores soft-capped before the softmax: no fused kernel
        return math_attention(query, key, value, mask, scale, softcap, causal)
    bias = None
    if mask is not None:  # additive, in rows padded to the kernel's alignment of 16 keys
        b, _, m, n = mask.shape
        bias = query.new_zeros(b, 1, m, -(-n // 16) * 16)[..., :n].masked_fill_(~mask, float("-inf"))
        bias = bias.expand(-1, query.shape[1], -1, -1)
    output, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, 0.0, causal, scale=scale
    )[:2]
    lse = lse[..., : query.shape[2]]  # the kernel pads its rows of log-sum-exps
    if mask is not None:  # a row that sees no key (a window past the shared keys): the kernel's lse is not -inf
        lse = lse.masked_fill(~mask.any(dim=-1), float("-inf"))
    return output, lse


def math_attention(query, key, value, mask, scale: float, softcap: float | None, causal: bool = False):
    """`attend` in plain PyTorch (fp32, equal head counts), in chunks of query rows so that no chunk's scores pass
    ~1 GiB. `causal`: query row i sees keys 0..i (and `mask` is None)."""
    keys, values = key.float().transpose(-1, -2), value.float()
    b, h, m, _ = query.shape
    n = key.shape[2]
    chunk = max(1, (1 << 28) // (b * h * n))
    outputs, lses = [], []
    for start in range(0, m, chunk):
        scores = (query[:, :, start : start + chunk].float() @ keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if causal:
            rows = torch.arange(start, start + scores.shape[2], device=query.device)
            scores = scores.masked_fill(torch.arange(n, device=query.device) > rows[:, None], float("-inf"))
        elif mask is not None:
            scores = scores.masked_fill(~mask[:, :, start : start + chunk], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # no key seen: 0
        outputs.append(weights @ values)
        lses.append(lse)
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=2)


def merge(output, lse, other, other_lse) -> torch.Tensor:
    """Two attentions of the same queries over two disjoint sets of keys, as one over both: each
    weighted by its share of the total softmax mass (exp(lse - total)). A part whose rows saw no
    key has weight 0 (its output, perhaps NaN, is not read)."""
    total = torch.logaddexp(lse, other_lse)
    mine, theirs = torch.exp(lse - total)[..., None], torch.exp(other_lse - total)[..., None]
    return output.float() * mine + torch.where(theirs > 0, other.float() * theirs, 0.0)


def fa4_shared_step(query, key, value, scale: float):
    """A decode step's attention over keys every row sees (the shared context) on FlashAttention-4:
    one query per row ([B, Hq, 1, D]) against [1, Hkv, n, D], the B rows going in as one sequence
    of B queries (FA4 packs a key/value head's query heads itself: nothing is copied). Returns the
    output [B, Hkv, G, D] and log-sum-exps [B, Hkv, G], views for merge_parts."""
    fa4 = import_fa4()
    rows, heads, _, dim = query.shape
    kv = key.shape[1]
    output, lse = fa4.flash_attn_func(
        query.reshape(1, rows, heads, dim),
        key.transpose(1, 2),
        value.transpose(1, 2),
        softmax_scale=scale,
        return_lse=True,
    )  # [1, B, Hq, D], [1, Hq, B]
    return output.view(rows, kv, heads // kv, dim), lse[0].view(kv, heads // kv, rows).permute(2, 0, 1)


def merge_parts(output, lse, other, other_lse, dtype: torch.dtype) -> torch.Tensor:
    """`merge` of two parts given as [b, h, m, D] outputs and [b, h, m] log-sum-exps (views, any
    strides), written as one contiguous [b, h, m, D] tensor in `dtype`. On CUDA one Triton kernel
    reads each part once where it lies: a decode step merges in every layer, and as a dozen
    PyTorch operations (casts, exps, the layout copies) that was hundreds of small kernels a step.
    Elsewhere `merge` itself."""
    if not (output.is_cuda and triton_available()):
        return merge(output, lse, other, other_lse).to(dtype).contiguous()
    import triton

    b, h, m, dim = output.shape
    merged = torch.empty(b, h, m, dim, dtype=dtype, device=output.device)
    merge_kernel()[(b * h * m,)](
        output, lse, other, other_lse, merged, h, m, *output.stride()[:3], *lse.stride(),
        *other.stride()[:3], *other_lse.stride(), dim, BLOCK=triton.next_power_of_2(dim), num_warps=1,
    )  # fmt: skip
    return merged


@functools.cache
def merge_kernel():
    """The Triton kernel of merge_parts: one program per query row, `merge`'s arithmetic in fp32."""
    import triton
    import triton.language as tl

    @triton.jit
    def merge_rows(
        o1, l1, o2, l2, out, heads, m,
        o1_b, o1_h, o1_m, l1_b, l1_h, l1_m, o2_b, o2_h, o2_m, l2_b, l2_h, l2_m,
        dim, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        i, j, b = row % m, (row // m) % heads, row // (m * heads)
        a = tl.load(l1 + b * l1_b + j * l1_h + i * l1_m)
        c = tl.load(l2 + b * l2_b + j * l2_h + i * l2_m)
        total = tl.maximum(a, c)
        total = total + tl.log(tl.exp(a - total) + tl.exp(c - total))  # logaddexp; NaN only when both saw nothing
        mine, theirs = tl.exp(a - total), tl.exp(c - total)
        d = tl.arange(0, BLOCK)
        inside = d < dim
        x = tl.load(o1 + b * o1_b + j * o1_h + i * o1_m + d, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(o2 + b * o2_b + j * o2_h + i * o2_m + d, mask=inside, other=0.0).to(tl.float32)
        merged = x * mine + tl.where(theirs > 0, y * theirs, 0.0)
        tl.store(out + row * dim + d, merged.to(out.dtype.element_ty), mask=inside)

    return merge_rows


def own_keys_step(query, keys, values, first, counts, scale: float, window: int | None):
    """A decode step's attention of each row's query heads over the row's own keys, on CUDA: row r
    (query [B, Hq, 1, D]) reads keys[r, first[r] : first[r] + counts[r]] of its kv head (keys and
    values [B, capacity, Hkv, D]; first and counts int tensors [B], read on the device, so a CUDA
    graph replays with each step's counts), only the last `window` of them in a windowed layer.
    Returns the output [B, Hkv, G, D] in the query's dtype and the log-sum-exps [B, Hkv, G] (fp32).

    One Triton program per (row, kv head) streams the row's keys once, its G query heads together
    (the flash-decoding loop: running max, sum and output). Flash attention's kernels tile 64-128
    queries, so with G = 2-4 queries per row they compute tens of times the products a step needs,
    and were the larger part of a decode step (bench/RESULTS.md)."""
    import triton

    rows, heads, _, dim = query.shape
    kv = keys.shape[2]
    groups = heads // kv
    if query.stride(-1) != 1:
        query = query.contiguous()
    output = torch.empty(rows, kv, groups, dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(rows, kv, groups, dtype=torch.float32, device=query.device)
    own_keys_kernel()[(rows, kv)](
        query, keys, values, output, lse, first, counts, scale, window or 0,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), dim,
        GROUPS=groups, GROUPS_PADDED=max(16, triton.next_power_of_2(groups)),
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=64, num_warps=4, num_stages=2,
    )  # fmt: skip
    return output, lse


@functools.cache
def own_keys_kernel():
    """The Triton kernel of own_keys_step. tl.dot takes at least 16 rows: the G query heads are
    padded to 16 (the padding's products are a few percent of the bytes' time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def own_keys(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, first_ptr, counts_ptr, scale, window,
        q_row, q_head, k_row, k_position, k_head, dim,
        GROUPS: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        row, head = tl.program_id(0), tl.program_id(1)
        start = tl.load(first_ptr + row).to(tl.int32)
        end = start + tl.load(counts_ptr + row).to(tl.int32)
        if window > 0:
            start = tl.maximum(start, end - window)
        g = tl.arange(0, GROUPS_PADDED)
        d = tl.arange(0, BLOCK_D)
        in_d = d < dim
        q = tl.load(
            q_ptr + row * q_row + (head * GROUPS + g)[:, None] * q_head + d[None, :],
            mask=(g[:, None] < GROUPS) & in_d[None, :],
            other=0.0,
        )
        running_max = tl.full([GROUPS_PADDED], float("-inf"), dtype=tl.float32)
        total = tl.zeros([GROUPS_PADDED], dtype=tl.float32)
        accumulated = tl.zeros([GROUPS_PADDED, BLOCK_D], dtype=tl.float32)
        base = row * k_row + head * k_head
        for block in range(start, end, BLOCK_N):
            n = block + tl.arange(0, BLOCK_N)
            in_n = n < end
            offsets = base + n[:, None] * k_position + d[None, :]
            k = tl.load(k_ptr + offsets, mask=in_n[:, None] & in_d[None, :], other=0.0)
            v = tl.load(v_ptr + offsets, mask=in_n[:, None] & in_d[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(in_n[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            total = total * correction + tl.sum(weights, axis=1)
            accumulated = accumulated * correction[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max
        output = accumulated / total[:, None]
        at = (row * tl.num_programs(1) + head) * GROUPS + g
        tl.store(
            out_ptr + at[:, None] * dim + d[None, :],
            output.to(out_ptr.dtype.element_ty),
            mask=(g[:, None] < GROUPS) & in_d[None, :],
        )
        tl.store(lse_ptr + at, running_max + tl.log(total), mask=g < GROUPS)

    return own_keys


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
        output = flash_attn_varlen_func(
            *(t[0] for t in rows),
            cu_seqlens_q=starts,
            cu_seqlens_k=starts,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scaling,
            causal=True,
            deterministic=deterministic,
        )
    return output[0] if isinstance(output, tuple) else output  # (output, lse) in some versions


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
