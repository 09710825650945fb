"""GPU: spds eval's forward (the student built by training's own builder, training=False) on long
records, against the training step on the same student.

    python bench/bench_eval.py --model 8b --lengths 65536,65536 --mix 16

Reports per case the positions per second of eval's NLL pass (no grad, chunked loss; what
`spds eval` runs per condition) and its peak memory. A random-weight Qwen3-shaped student built
on the GPU (no download); the training figure for the same student and length mix comes from
bench_gpu.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="8b", choices=sorted(bench_gpu.SHAPES))
    parser.add_argument("--lengths", default="65536,65536", help="fixed-length records, one pass each")
    parser.add_argument("--mix", type=int, default=16, help="records of the 512-32k length mix")
    parser.add_argument("--variant", default="liger", help="bench_gpu.py variant (student settings)")
    args = parser.parse_args()
    from spds.model.build import build_soft_prompt_model
    from spds.model.loss import make_loss
    from spds.model.soft_prompt import load_segments

    print(f"{time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    student = bench_gpu.build_student(args.model)
    rng = np.random.default_rng(0)
    mix = [int(x) for x in np.exp(rng.uniform(math.log(512), math.log(32768), args.mix))]
    fixed = [int(n) for n in args.lengths.split(",")]
    cases = {f"records of {', '.join(str(n) for n in fixed)} tokens": fixed, f"mix {args.mix} records 512-32k": mix}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        lengths = [n for group in cases.values() for n in group]
        store = bench_gpu.write_store(directory / "packed", lengths)
        config = bench_gpu.spds_config(directory, len(lengths), args.variant)
        if config.student.liger_kernels:
            from spds.model.student import apply_liger_kernels

            apply_liger_kernels(student)
        model = build_soft_prompt_model(config, torch.device("cuda"), training=False, student=student)
        nll = make_loss(dataclasses.replace(config.loss, objective="ce"))
        start = 0
        for label, group in cases.items():
            records = list(range(start, start + len(group)))
            start += len(group)
            segments = load_segments(store, records, torch.device("cuda"))
            model([segments[records[0]]], loss_fn=nll)  # warm-up: kernels, plans
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            began = time.perf_counter()
            for i in records:  # one record per pass, as spds eval runs them
                model([segments[i]], loss_fn=nll)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - began
            positions = sum(group) + len(group) * bench_gpu.PROMPT
            print(
                f"{args.model} eval {label}: {positions / seconds:,.0f} positions/s, {seconds:.2f} s, "
                f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
