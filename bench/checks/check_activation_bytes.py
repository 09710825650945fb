"""What one decoder layer keeps for backward, in bytes per position per hidden unit: the figure
RecomputePolicy plans with (ACTIVATION_BYTES_PER_HIDDEN). Measured through spds's own forward
(SoftPromptModel.hidden_states, no layer recomputed) as the memory still allocated after the
forward, over positions x layers x hidden, with the student's own kernels and with Liger's.

    python bench/check.py activation_bytes --model 1.7b --positions 8192
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import step  # noqa: E402
import torch


def measure(student, name: str, variant: str, positions: int) -> dict:
    from spds.model.build import build_soft_prompt_model
    from spds.model.soft_prompt import Segment
    from spds.model.student import apply_liger_kernels
    from spds.training.engine import init_distributed

    with tempfile.TemporaryDirectory() as scratch:
        config = step.spds_config(Path(scratch), 1, variant)
        if not torch.distributed.is_initialized():
            init_distributed(config.distributed)
        if config.student.liger_kernels:
            apply_liger_kernels(student)
        model = build_soft_prompt_model(config, torch.device("cuda"), student=student)
        model.recompute = lambda *args, **kwargs: 0  # every layer keeps its activations
        ids = torch.randint(0, step.VOCAB - 1000, (positions - step.PROMPT,), device="cuda")
        segment = Segment(ids=ids, prefix_tokens=128, insert_at=3)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        (hidden,) = model.hidden_states([segment], model.prompt)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        peak = torch.cuda.max_memory_allocated() - before
        config_ = student.config
        per = positions * config_.num_hidden_layers * config_.hidden_size
        hidden.sum().backward()
        del hidden, model
        torch.cuda.empty_cache()
        return dict(
            model=name,
            variant=variant,
            positions=positions,
            kept_gib=round(kept / 2**30, 2),
            bytes_per_position_per_hidden_per_layer=round(kept / per, 2),
            forward_peak_over_kept_gib=round((peak - kept) / 2**30, 2),
        )


def options(parser) -> None:
    parser.add_argument("--model", default="1.7b", choices=sorted(step.SHAPES))
    parser.add_argument("--positions", type=int, default=8192)


def main(args) -> None:
    student = step.build_student(args.model)
    for variant in ("packed", "liger"):  # Liger patches in place: the student's own kernels first
        print(json.dumps(measure(student, args.model, variant, args.positions)), flush=True)
