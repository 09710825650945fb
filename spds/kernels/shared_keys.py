"""Attention over keys that many queries share: the online teacher's records after the cached
context (and system header), and spds generate's rows after the shared prefix. Computed in two
parts merged by their log-sum-exps (softmax over all keys, regrouped): every query against the
shared keys at once, so they are read once per block of queries rather than once per record or
row, and each record or row against its own keys. Forward only (the teacher and decoding have no
backward).

  lower_right_causal   queries after cached keys (a record after its context)
  packed_after_cached  records packed end to end after keys all of them see (cuDNN, FA2 varlen)
  fa4_after_cached     the same on FlashAttention-4
  attend, merge        one attention with its log-sum-exps; two over disjoint keys merged into one
  merge_parts          merge, as one Triton kernel on CUDA
  attend_split         a decode step's queries against the shared prefix, its keys in runs (split-KV)
  fa4_shared_step      a decode step's queries against the shared prefix, on FlashAttention-4
  own_keys_step        a decode step's queries against each row's own keys (Triton)

Over 300 lines because the two Triton kernels are written out here: no library spds depends on
merges attention parts in place or runs a decode step's few queries per row without tiling them
to 64-128 (bench/RESULTS.md measures both).
"""

from __future__ import annotations

import functools
import sys

import torch

from spds.kernels.causal import fa4_causal, import_fa4, repeated_heads, triton_available


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
# The dtypes PyTorch's fused CPU attention kernel takes (`attend` off CUDA, without a mask)
CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def packed_after_cached(query, key, value, scaling, starts, longest: int):
    """Records packed end to end in one row (batch 1) after keys every one of them sees: the
    teacher's records after the cached system header and context. key and value hold the shared
    keys first, then the records' own; `starts` (int32 [records + 1]) delimits the records among
    the queries. Forward only. Returns [positions, Hq, D].

    Two parts merged by their log-sum-exps: every query against the shared keys at once (no mask,
    one call for all the records: the shared keys are read once per block of queries rather than
    once per record), and each record causally against its own keys. On CUDA in half precision
    the shared part and a lone long record's own part run on cuDNN, 1.6-1.7x faster than on
    FlashAttention-2 on H200 (bench/check.py cached_attention), and several
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
    cached = key.shape[2] - query.shape[2]
    own, own_lse = fa4_causal(
        query, key[:, :, cached:], value[:, :, cached:], scaling, starts, longest, with_lse=True
    )  # [positions, Hq, D], [Hq, positions]
    if not cached:
        return own
    rows = [t.transpose(1, 2) for t in (query, key[:, :, :cached], value[:, :, :cached])]  # [1, L, heads, D]
    shared, shared_lse = import_fa4().flash_attn_func(
        *rows, softmax_scale=scaling, return_lse=True
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
    merged from (`merge`). On CUDA without a mask or a soft cap cuDNN (Hopper's kernel: 1.6-3.8x
    FlashAttention-2's rate on H200 for the shapes spds gives it, bench/RESULTS.md), else flash
    attention, else the memory-efficient kernel; on the CPU without a mask PyTorch's fused CPU
    kernel; elsewhere plain PyTorch."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    if mask is None and cudnn_fits(query, key, causal, softcap):
        return cudnn_attention(query, key, value, scale, causal)
    if mask is None and flash_fits(query, softcap):
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        return flash(query, key, value, 0.0, causal, False, scale=scale)[:2]  # the output and log-sum-exps
    if key.shape[1] != query.shape[1]:  # the other kernels take equal head counts
        key, value = repeated_heads(query, key, value)
    if not query.is_cuda and mask is None and softcap is None and query.dtype in CPU_FLASH_DTYPES:
        # PyTorch's fused CPU kernel (flash attention's loop: no [m, n] scores in memory): a 32k-token
        # prefix in under a second on two cores, where the scores' passes took tens of seconds
        fused = cpu_flash(query, key, value, causal, scale)
        if fused is not None:
            return fused
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


CPU_FLASH_REFUSED: set = set()  # the dtypes PyTorch's CPU flash kernel refused in this process
cpu_flash_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def cpu_flash(query, key, value, causal: bool, scale: float):
    """PyTorch's fused CPU attention, or None where it refuses the dtype on this CPU: its bf16 and
    fp16 kernels pack their operands with AVX-512 instructions and stop ("pack_vnni2 is only
    supported when avx512 is supported") where the CPU, or ATEN_CPU_CAPABILITY, offers less while
    the hardware check that picks the packed path says otherwise (seen on an Intel Xeon with AMX
    under ATEN_CPU_CAPABILITY=avx2). Its first refusal is the probe: the dtype then runs as plain
    sums for the rest of the process (the same function, fp32 accumulation), said once."""
    if query.dtype in CPU_FLASH_REFUSED or not torch.backends.cuda.flash_sdp_enabled():  # (the switch: student.py)
        return None
    try:
        return cpu_flash_kernel(query, key, value, 0.0, causal, attn_mask=None, scale=scale)[:2]
    except RuntimeError as error:
        CPU_FLASH_REFUSED.add(query.dtype)
        print(
            f"spds: PyTorch's CPU flash attention refuses {str(query.dtype).removeprefix('torch.')} on this CPU "
            f"({str(error).splitlines()[0][:120]}); its attention runs as plain sums instead (slower, the same sums)",
            file=sys.stderr,
        )
        return None


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


SPLIT_KEYS_AT_LEAST = 2048  # keys per run: below it a run's fixed cost outweighs the programs it adds


def key_splits(query: torch.Tensor, key: torch.Tensor) -> int:
    """How many runs `attend_split` cuts the keys into: enough that (runs x heads x 128-query
    blocks) gives two programs per SM, each run at least SPLIT_KEYS_AT_LEAST keys; 1 off CUDA."""
    if not query.is_cuda:
        return 1
    blocks = query.shape[0] * query.shape[1] * -(-query.shape[2] // 128)
    processors = torch.cuda.get_device_properties(query.device).multi_processor_count
    return max(1, min(-(-2 * processors // blocks), key.shape[2] // SPLIT_KEYS_AT_LEAST))


def attend_split(query, key, value, scale: float, splits: int):
    """`attend` (no mask) with the keys cut into `splits` runs of equal length, run as one batch of
    `splits` (the keys' views, not copies) and merged by their log-sum-exps; the last
    keys % splits keys as one run more. A decode step's queries against the shared context,
    every row folded into one batch ([1, Hkv, rows x G, D]), make only heads x query blocks
    programs (8 x 8 at 8B and 256 rows): 64 for 132 SMs, however long the context; split, the
    runs fill the GPU (flash-decoding's split-KV). Returns [1, h, m, D] (fp32) and [1, h, m]."""
    _, heads, m, dim = query.shape
    n = key.shape[2]
    size = n // splits
    runs = [
        attend(
            query.expand(splits, -1, -1, -1).contiguous(),
            *(t[0, :, : splits * size].view(heads, splits, size, dim).transpose(0, 1) for t in (key, value)),
            scale=scale,
        )
    ]
    if splits * size < n:
        runs.append(attend(query, key[:, :, splits * size :], value[:, :, splits * size :], scale=scale))
    outputs = torch.cat([output.float() for output, _ in runs])  # [runs, h, m, D]
    lses = torch.cat([lse for _, lse in runs])  # [runs, h, m]
    total = torch.logsumexp(lses, dim=0, keepdim=True)
    weights = torch.exp(lses - total)[..., None]
    return (outputs * weights).sum(dim=0, keepdim=True), total


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
    strides but a unit one along D), written as one contiguous [b, h, m, D] tensor in `dtype`. On
    CUDA one Triton kernel reads each part once where it lies: a decode step merges in every layer,
    and as a dozen PyTorch operations (casts, exps, the layout copies) that was hundreds of small
    kernels a step. Elsewhere `merge` itself."""
    if not (output.is_cuda and triton_available()):
        return merge(output, lse, other, other_lse).to(dtype).contiguous()
    import triton

    output, other = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (output, other)
    )  # the kernel's D is unit-strided
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
