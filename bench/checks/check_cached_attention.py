"""The online teacher's attention against a cached context (loss.reuse_context_kv), CUDA.

    python bench/check.py cached_attention

A record's L queries attend to C cached context keys plus its own L keys, causal from the lower
right, grouped-query heads (Qwen3 1.7B: 16 query, 8 key heads; 8B: 32, 8). Four ways, forward
only (the teacher has no backward):
  bias     SDPA with torch's causal_lower_right bias, keys repeated to the query heads
  one      one FlashAttention-2 call, causal from the lower right over context + record
  spds     spds.kernels.shared_keys.lower_right_causal as it stands (two calls merged by log-sum-exp)
  batched  what the batched teacher pays instead: causal SDPA over all C + L positions
Each is checked against an fp32 reference with an explicit mask where that fits, and timed; the
kernels the bias path launched are listed. Then a pass of short records packed end to end after
the context (spds.kernels.shared_keys.packed_after_cached, and fa4_after_cached where flash-attn-4 imports),
against each record alone and the reference; and one 32k record packed alone.

    python bench/check.py cached_attention [--packed-only]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from spds.kernels.shared_keys import fa4_after_cached, lower_right_causal, packed_after_cached  # noqa: E402

CONTEXT, HEAD_DIM = 4096, 128


def bias_path(q, k, v):
    from torch.nn.attention.bias import causal_lower_right

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def spds_path(q, k, v):
    return lower_right_causal(q, k, v, None)


def one_call_path(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]


def batched_path(q_all, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True)


def reference(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, dim=1), v.float().repeat_interleave(groups, dim=1)
    L, S = q.shape[2], k.shape[2]
    allowed = torch.arange(S, device=q.device)[None] <= torch.arange(L, device=q.device)[:, None] + (S - L)
    scores = (q.float() @ k.transpose(-1, -2)) / HEAD_DIM**0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def timed(fn, *args, repeats: int = 5) -> float:
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


@torch.no_grad()
def main(args) -> None:
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    if "--packed-only" in sys.argv:
        packed_records()
        packed_records((32768,))
        return
    for name, heads, kv_heads in (("1.7b", 16, 8), ("8b", 32, 8)):
        for length in (1024, 8192, 32768):
            g = torch.Generator(device="cuda").manual_seed(length)

            def draw(h, n):
                return torch.randn(1, h, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)

            k, v = draw(kv_heads, CONTEXT + length), draw(kv_heads, CONTEXT + length)
            q_all = draw(heads, CONTEXT + length)
            q = q_all[:, :, CONTEXT:].contiguous()
            row = {}
            outputs = {"bias": bias_path(q, k, v), "one": one_call_path(q, k, v), "spds": spds_path(q, k, v)}
            if length <= 8192:
                expected = reference(q, k, v)
                for key, out in outputs.items():
                    row[f"{key} max|err| vs fp32"] = f"{float((out.float() - expected).abs().max()):.2e}"
                del expected
            row["bias ms"] = round(timed(bias_path, q, k, v), 2)
            row["one ms"] = round(timed(one_call_path, q, k, v), 2)
            row["spds ms"] = round(timed(spds_path, q, k, v), 2)
            row["batched ms"] = round(timed(batched_path, q_all, k, v), 2)
            print(f"{name} C={CONTEXT} L={length}: {row}", flush=True)
            if name == "1.7b" and length == 8192:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    bias_path(q, k, v)
                    torch.cuda.synchronize()
                names = [e.key[:90] for e in prof.key_averages() if e.self_device_time_total > 0]
                print(f"  kernels of the bias path: {names}", flush=True)

    packed_records()


@torch.no_grad()
def packed_records(lengths=(512, 1024, 3000, 700, 2048, 900, 1500, 4000)) -> None:
    for name, heads, kv_heads in (("1.7b", 16, 8), ("8b", 32, 8)):
        g = torch.Generator(device="cuda").manual_seed(7)
        total = sum(lengths)
        q = torch.randn(1, heads, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (
            torch.randn(1, kv_heads, CONTEXT + total, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)
        )
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        starts = torch.tensor(offsets, dtype=torch.int32, device="cuda")

        def alone(i):  # record i with the context's keys and its own
            s, e = offsets[i], offsets[i + 1]
            keys = torch.cat([k[:, :, :CONTEXT], k[:, :, CONTEXT + s : CONTEXT + e]], dim=2)
            values = torch.cat([v[:, :, :CONTEXT], v[:, :, CONTEXT + s : CONTEXT + e]], dim=2)
            return q[:, :, s:e], keys, values

        def worst(packed) -> float:  # [total, Hq, D] against each record's fp32 reference
            if max(lengths) > 8192:  # the fp32 reference holds [heads, L, C + L] scores
                return float("nan")
            return max(
                float(
                    (packed[offsets[i] : offsets[i + 1]].transpose(0, 1)[None].float() - reference(*alone(i)))
                    .abs()
                    .max()
                )
                for i in range(len(lengths))
            )

        error = worst(packed_after_cached(q, k, v, HEAD_DIM**-0.5, starts, max(lengths)))
        records = [alone(i) for i in range(len(lengths))]
        packed_ms = timed(lambda: packed_after_cached(q, k, v, HEAD_DIM**-0.5, starts, max(lengths)))
        alone_ms = timed(lambda: [lower_right_causal(*r, None) for r in records])
        fa4 = ""
        try:
            import flash_attn.cute  # noqa: F401
        except ImportError:
            fa4 = "; fa4: not installed"
        if not fa4:
            fa4_error = worst(fa4_after_cached(q, k, v, HEAD_DIM**-0.5, starts, max(lengths)))
            fa4_ms = timed(lambda: fa4_after_cached(q, k, v, HEAD_DIM**-0.5, starts, max(lengths)))
            fa4 = f"; fa4_after_cached {fa4_ms:.2f} ms, max|err| vs fp32 {fa4_error:.2e}"
        print(
            f"{name} C={CONTEXT}, {len(lengths)} records packed ({total} positions): max|err| vs fp32 {error:.2e}; "
            f"packed {packed_ms:.2f} ms, each alone {alone_ms:.2f} ms{fa4}",
            flush=True,
        )
