"""Where `spds train`'s start-up goes, phase by phase, and what the alternatives cost (issue 16,
goal 5). Times each thing spds does before update 1 on its own, in one fresh process:

    python bench/startup_phases.py MODEL_DIR          (a save_pretrained directory, bf16)

imports; the student's digest (sha256 of every file: what a pin check or an unpinned run's
identity costs), hashed and remembered (spds/contract/digests.py); the student's load onto the GPU
(from_pretrained on the host then .to(device), against from_pretrained straight onto the
device); Liger's patch; DeepSpeed's engine. Prints one JSON line per phase.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

started = time.perf_counter()


def report(phase: str, seconds: float, **extra) -> None:
    print(json.dumps(dict(phase=phase, seconds=round(seconds, 3), **extra)), flush=True)


def timed(phase: str, fn, **extra):
    began = time.perf_counter()
    value = fn()
    report(phase, time.perf_counter() - began, **extra)
    return value


def main() -> None:
    model_dir = Path(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib
    import os

    for module in ("torch", "transformers", "deepspeed", "liger_kernel.transformers", "spds.training.train"):
        timed(f"import {module}", lambda: importlib.import_module(module))
    import torch

    from spds.contract import digests

    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    remembered = os.environ.get("SPDS_DIGEST_CACHE")
    os.environ["SPDS_DIGEST_CACHE"] = "off"
    digest = timed("sha256 of the student, hashed", lambda: digests.sha256_path(model_dir), gib=round(size / 2**30, 2))
    os.environ.pop("SPDS_DIGEST_CACHE")
    if remembered is not None:
        os.environ["SPDS_DIGEST_CACHE"] = remembered
    digests.sha256_path(model_dir)  # remembered now (spds pin or validate did the same)
    again = timed("sha256 of the student, remembered", lambda: digests.sha256_path(model_dir))
    assert again == digest
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", 0)
    torch.cuda.init()
    timed("cuda context", lambda: torch.zeros(1, device=device))

    def host_then_device():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
        return model.to(device)

    model = timed("from_pretrained on the host, then .to(cuda)", host_then_device)
    del model
    torch.cuda.empty_cache()
    model = timed(
        "from_pretrained(device_map=cuda)",
        lambda: AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa", device_map=device
        ),
    )
    from spds.model.student import apply_liger_kernels

    timed("Liger patch", lambda: apply_liger_kernels(model))
    report("total", time.perf_counter() - started)


if __name__ == "__main__":
    main()
