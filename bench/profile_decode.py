"""Where a decode step of spds generate goes, on one GPU: a random-weight student (a model
directory), ROWS prompts of a shared CONTEXT-token context and a 20-token question.

    python3 bench/profile_decode.py DIR [ROWS]

Prints the step's time with CUDA graphs (the difference of two runs, so the prefix, the
questions' forward and the capture drop out), then the kernels of a few eager steps by GPU time.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from spds.decode import Decoder
from spds.generate import load_teacher


def timed(decoder: Decoder, prompts, new: int) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    decoder.answer(prompts, new, temperature=1.0, top_p=1.0, seed=0)
    torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    directory, rows = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    model = load_teacher(directory, "bfloat16", torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 250, (4096,), generator=generator).tolist()
    prompts = [shared + torch.randint(2, 250, (20,), generator=generator).tolist() for _ in range(rows)]
    decoder = Decoder(model, [-1], pad_id=0)  # no end token: every row runs to the last step
    timed(decoder, prompts, 4)  # the prefix, once
    short, long = timed(decoder, prompts, 32), timed(decoder, prompts, 160)
    print(f"rows {rows}: {(long - short) / 128 * 1e3:.2f} ms a step with graphs; a 32-step batch {short:.2f} s")
    decoder.graphs = False
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        decoder.answer(prompts, 9, temperature=1.0, top_p=1.0, seed=0)
    print(trace.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))


if __name__ == "__main__":
    main()
