"""Where a decode step of spds generate goes, on one GPU, and what each of its kernels buys: a
random-weight student (a model directory), ROWS prompts of a shared CONTEXT-token context
(default 4,096) and a 20-token question, every row decoding to the last step (no end token).

    [CONTEXT=32700] python3 bench/profile_decode.py DIR [ROWS] [STEPS] [SETS]

For each kernel set of SETS (a comma list, default flash+torch,cudnn,merge-kernel,liger,triton-own),
each on top of the ones before it (one process, the same prompts):
  flash+torch   the shared part on FlashAttention-2, the two parts merged in PyTorch, each row's own
                part on FlashAttention-2's variable-length kernel (spds before)
  cudnn         the shared part on cuDNN
  merge-kernel  the parts merged by one Triton kernel (spds.kernels.shared_keys.merge_parts)
  liger         Liger's RMSNorm, RoPE and SwiGLU in the teacher (student.liger_kernels)
  triton-own    each row's own part on spds.kernels.shared_keys.own_keys_step
  fa4           the shared part on FlashAttention-4 (student.attention_kernel fa4)
  split         the shared part's keys in runs (spds.kernels.shared_keys.attend_split; before it,
                where SETS names it, one run)
it prints the step's time with CUDA graphs over steps 32..STEPS (the difference of a 32-step and
a STEPS-step batch, so the prefix, the questions' forward and the capture drop out), then checks
that two batches with one seed sample the same tokens, then profiles 32 eager steps of the last
set by kernel class.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import spds.generation.decode
import spds.kernels.shared_keys
from spds.generation.decode import Decoder
from spds.generation.generate import load_teacher
from spds.model.student import apply_liger_kernels


def timed(decoder: Decoder, prompts, new: int, seed: int = 0) -> tuple[float, list]:
    torch.cuda.synchronize()
    began = time.perf_counter()
    answers = decoder.answer(prompts, new, temperature=1.0, top_p=1.0, seed=seed)
    torch.cuda.synchronize()
    return time.perf_counter() - began, answers


def torch_merge(output, lse, other, other_lse, dtype):
    return spds.kernels.shared_keys.merge(output, lse, other, other_lse).to(dtype).contiguous()


def flash_own(query, keys, values, first, counts, scale, window):
    """The own part as spds ran it before own_keys_step: FlashAttention-2's variable-length kernel
    over the flat cache, the G query heads of a key/value head as G queries of a row."""
    rows, capacity, kv, dim = keys.shape
    heads = query.shape[1]
    groups = heads // kv
    folded = query.reshape(rows, kv, groups, dim).transpose(1, 2).reshape(rows * groups, kv, dim)
    queries_at = torch.arange(rows + 1, dtype=torch.int32, device=query.device) * groups
    key_starts = torch.arange(rows + 1, device=query.device) * capacity + torch.cat([first, first[:1] * 0])
    output, lse = torch.ops.aten._flash_attention_forward(
        folded, keys.view(rows * capacity, kv, dim), values.view(rows * capacity, kv, dim), queries_at,
        key_starts.to(torch.int32), groups, 2 * capacity, 0.0, False, False, scale=scale, seqused_k=counts,
    )[:2]  # fmt: skip
    return output.view(rows, groups, kv, dim).transpose(1, 2), lse.reshape(kv, rows, groups).permute(1, 0, 2)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for key, label in (
        ("cudnn", "cuDNN attention (shared part)"),
        ("flash_fwd", "flash attention"),
        ("fmha", "memory-efficient attention"),
        ("merge_rows", "merge kernel"),
        ("own_keys", "own part (Triton)"),
        ("liger", "Liger kernels"),
        ("_rms_norm", "Liger kernels"),
        ("_rope", "Liger kernels"),
        ("swiglu", "Liger kernels"),
        ("nvjet", "GEMMs"),
        ("gemm", "GEMMs"),
        ("softmax", "sampling (softmax, multinomial)"),
        ("multinomial", "sampling (softmax, multinomial)"),
        ("distribution", "sampling (softmax, multinomial)"),
    ):
        if key in lowered:
            return label
    return "other (elementwise, copies, reductions)"


def main() -> None:
    directory = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    sets = (sys.argv[4] if len(sys.argv) > 4 else "flash+torch,cudnn,merge-kernel,liger,triton-own").split(",")
    model = load_teacher(directory, "bfloat16", torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 250, (int(os.environ.get("CONTEXT", 4096)),), generator=generator).tolist()
    prompts = [shared + torch.randint(2, 250, (20,), generator=generator).tolist() for _ in range(rows)]
    decoder = Decoder(model, [-1], pad_id=0)  # no end token: every row runs to the last step
    cudnn_fits, merge_parts, own_keys_step = (
        spds.kernels.shared_keys.cudnn_fits,
        spds.generation.decode.merge_parts,
        spds.generation.decode.own_keys_step,
    )
    key_splits = spds.generation.decode.key_splits
    if "split" in sets:
        spds.generation.decode.key_splits = lambda *args: 1
    if "flash+torch" in sets:
        spds.kernels.shared_keys.cudnn_fits = lambda *args, **kwargs: False
        spds.generation.decode.merge_parts = torch_merge
        spds.generation.decode.own_keys_step = flash_own
    timed(decoder, prompts, 4)  # the prefix, once
    for label in sets:
        if label == "cudnn":
            spds.kernels.shared_keys.cudnn_fits = cudnn_fits
        elif label == "merge-kernel":
            spds.generation.decode.merge_parts = merge_parts
        elif label == "liger":
            apply_liger_kernels(model)
        elif label == "triton-own":
            spds.generation.decode.own_keys_step = own_keys_step
        elif label == "fa4":
            decoder.fa4 = True
        elif label == "split":
            spds.generation.decode.key_splits = key_splits
        timed(decoder, prompts, 8)  # this set's kernels compiled and its plans built before the clock
        short, _ = timed(decoder, prompts, 32)
        long, _ = timed(decoder, prompts, steps)
        print(
            f"{label:13s} rows {rows}: {(long - short) / (steps - 32) * 1e3:.2f} ms a step over steps 32..{steps} "
            f"(graphs in {decoder.captured} batches); a {steps}-step batch {long:.2f} s",
            flush=True,
        )
    _, first = timed(decoder, prompts, 64, seed=7)
    _, again = timed(decoder, prompts, 64, seed=7)
    print(f"two 64-step batches with one seed sampled the same tokens: {first == again}", flush=True)
    decoder.graphs = False
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        decoder.answer(prompts, 33, temperature=1.0, top_p=1.0, seed=0)
    by_class, calls = defaultdict(float), defaultdict(int)
    for event in trace.key_averages():
        time_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        by_class[kernel_class(event.key)] += time_us
        calls[kernel_class(event.key)] += event.count
    total = sum(by_class.values())
    print(f"# eager: the questions' forward and 32 decode steps, GPU time by kernel class ({total / 1e3:.1f} ms)")
    for name, value in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"  {value / 1e3:8.1f} ms {100 * value / total:5.1f}%  {calls[name]:6d} calls  {name}")
    print(trace.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
