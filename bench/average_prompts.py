"""Tail averaging, measured before it is a setting: the mean of a run's committed checkpoints'
FP32 prompts, written in the form `spds export` writes (its metadata kept), for
bench/real_quality.py to measure beside the final prompt.

    python bench/average_prompts.py RUN_DIR OUT.safetensors

RUN_DIR is a trained and exported run (checkpoint.every / keep_last choose which updates are
averaged: keep_last of them, every `every` updates, up to the last)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spds.training.checkpoint import committed, prompt_of  # noqa: E402


def main() -> None:
    run, out = Path(sys.argv[1]), sys.argv[2]
    found = committed(run / "checkpoints")
    prompts = [prompt_of(directory)[0].double() for _, directory in found]
    with safe_open(str(run / "export" / "soft_prompt.safetensors"), "pt") as handle:
        metadata = handle.metadata()
    save_file({"prompt": torch.stack(prompts).mean(0).float().contiguous()}, out, metadata=metadata)
    print("averaged the prompts of updates", [update for update, _ in found])


if __name__ == "__main__":
    main()
