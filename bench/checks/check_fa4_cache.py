"""FlashAttention-4's disk cache gives the kernels a fresh compile gives, bit for bit.

spds turns FA4's persistent compile cache on (spds/kernels/attention.py: import_fa4), so a resumed run
loads from disk the kernels that the straight run compiled. The bit-exact resume needs a loaded
kernel to compute exactly what a freshly compiled one computes. This script runs itself three
times, each in a fresh process, on the same inputs (forward and deterministic backward, padded
rows and packed records):

    compile   cache on, an empty cache directory: compiles and writes each kernel
    load      cache on, the same directory: loads each kernel from disk
    off       cache off: compiles in memory only

and compares the outputs and gradients of the three bit for bit.

    python bench/check.py fa4_cache
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from check_fa4 import HEAD_DIM, HEADS, KV_HEADS  # noqa: E402  (Qwen3-1.7B's attention shape, as check_fa4 times)

LENGTHS = [700, 2300]  # the packed case's records; the padded case is one row of their sum


def compute(out: Path) -> None:
    from spds.kernels.causal import fa4_causal

    torch.use_deterministic_algorithms(True)  # FA4's deterministic backward: repeatable bits
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)

    def tensor(heads):
        return torch.randn(
            1, heads, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator
        ).requires_grad_()

    results, started = {}, time.perf_counter()
    starts = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32, device="cuda")
    for layout in ("padded", "packed"):
        query, key, value = tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)
        if layout == "padded":
            output = fa4_causal(query, key, value, HEAD_DIM**-0.5)
        else:
            output = fa4_causal(query, key, value, HEAD_DIM**-0.5, starts, max(LENGTHS))
        output.backward(torch.randn(output.shape, device="cuda", dtype=output.dtype, generator=generator))
        results.update(
            {
                f"{layout}.output": output.detach(),
                f"{layout}.dq": query.grad,
                f"{layout}.dk": key.grad,
                f"{layout}.dv": value.grad,
            }
        )
    torch.cuda.synchronize()
    torch.save({k: v.cpu() for k, v in results.items()}, out)
    print(
        json.dumps(
            dict(
                run=out.stem,
                seconds=round(time.perf_counter() - started, 2),
                cache=os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"),
            )
        ),
        flush=True,
    )


def options(parser) -> None:
    parser.add_argument("--compute", type=Path, help="(the fresh process of one run) where its outputs go")


def main(args) -> int:
    if args.compute:
        return compute(args.compute)
    work = Path(tempfile.mkdtemp())
    runs = {"compile": "1", "load": "1", "off": "0"}
    for name, enabled in runs.items():
        env = dict(
            os.environ,
            FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=enabled,
            FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(work / "cache"),
        )
        one = [
            sys.executable,
            str(Path(__file__).parents[1] / "check.py"),
            "fa4_cache",
            "--compute",
            str(work / f"{name}.pt"),
        ]
        subprocess.run(one, env=env, check=True)
        print(f"after {name}: {sum(1 for _ in (work / 'cache').rglob('*.o'))} kernels in the disk cache", flush=True)
    outputs = {name: torch.load(work / f"{name}.pt") for name in runs}
    equal = True
    for key in outputs["compile"]:
        same = {name: torch.equal(outputs["compile"][key], outputs[name][key]) for name in ("load", "off")}
        equal &= all(same.values())
        print(f"{key:15s} loaded == compiled: {same['load']}, no cache == compiled: {same['off']}", flush=True)
    print("bit-identical" if equal else "DIFFERENT", flush=True)
    return 0 if equal else 1
