"""spds eval: on held-out records, how much of the context's effect does the soft prompt recover?

For every held-out record (data.eval_fraction splits by question_id, so none was trained on),
the mean NLL per teacher response token under the student
    floor    with nothing inserted (the student without the context),
    ceiling  with the context's tokens inserted where the prompt goes (right after the system
             header, or first for prefix placement),
    soft     with the trained soft prompt,
and gap recovered = (floor - soft) / (floor - ceiling): 0 is no better than no context, 1 is as
good as the context itself.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .build import build_soft_prompt_model
from .checkpoint import checkpoint_to_read, prompt_of
from .config import Config
from .data.packed import PackedStore
from .engine import init_distributed, shard_student
from .errors import SpdsError
from .fsio import atomic_path, atomic_write_json
from .loss import final_logit_softcap, make_loss
from .model import load_segments
from .records import read_metrics
from .schedule import lockstep_passes
from .schema import require_valid
from .settings import KLSettings
from .student import load_tokenizer
from .teacher import build_teacher, teacher_kind


@torch.no_grad()
def evaluate(config: Config, checkpoint_path: str | None = None, log=print) -> dict:
    directory = checkpoint_to_read(config.output_dir, checkpoint_path)
    prompt, commit = prompt_of(directory)
    store = PackedStore.open(config.packed_dir)
    held_out = np.flatnonzero(~store.is_train)
    if not len(held_out):
        raise SpdsError("no held-out records: set data.eval_fraction > 0 and run spds prepare on a fresh packed_dir")
    limit = config.eval.max_records
    held_out = held_out[:limit] if limit else held_out
    sharded = config.shards_student  # as in training: ZeRO-3 or fsdp lays the student out over the ranks
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or sharded:  # launched with torchrun / deepspeed: share the records
        rank, world, device = init_distributed(config.distributed)
    else:
        rank, world, device = 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_soft_prompt_model(config, device, prompt=prompt, training=False)  # as training runs it
    student = model.student
    if sharded:
        shard_student(config, model, world)
    # The figures are the same whatever the training objective: NLL of the teacher's tokens, and
    # forward KL(teacher || student) at temperature 1, through the training loss's own kernels.
    cap = final_logit_softcap(student)
    nll_fn = make_loss(dataclasses.replace(config.loss, objective="ce"), cap)
    kl_fn = make_loss(dataclasses.replace(config.loss, objective="kl", kl=KLSettings("forward", 1.0, 0.5)), cap)
    # the training teacher, or the one loss.teacher names (auto: the packed top-k, else the
    # context); none when neither exists (no context, no top-k): then eval reports no KL
    has_teacher = config.eval.kl and (store.top_k or config.context_text)
    teacher = build_teacher(config, model, store) if has_teacher else None
    text = config.context_text
    blocks = {"floor": prompt.new_zeros((0, prompt.shape[1])).to(device), "soft": None}
    if text:
        ids = load_tokenizer(config).encode(text, add_special_tokens=False)
        blocks["ceiling"] = student.get_input_embeddings()(torch.tensor(ids, device=device))
    names = list(blocks)
    sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)  # NLL per condition, then KL
    kl = teacher is not None
    # Each rank takes every world-th record. A sharded student gathers weights collectively in
    # every forward: there every rank makes as many passes as the busiest, a rank out of records
    # repeating one without counting it (the training step's lockstep rule).
    every = [[[int(i)] for i in held_out[r::world]] for r in range(world)]
    passes = [(group, None, True) for group in every[rank]]
    if model.layout.lockstep:
        passes = lockstep_passes(every, rank, footprint=len, filler=[int(held_out[0])])
    started, positions = time.monotonic(), 0  # positions forwarded on this rank, every condition
    for (i,), _, counted in passes:
        segment = load_segments(store, [i], device)[i]
        targets = teacher.targets([segment]) if kl else None
        for k, name in enumerate(names):
            # the soft prompt's one forward gives the KL too (the student's rows are the same)
            fns = [nll_fn, kl_fn] if kl and name == "soft" else [nll_fn]
            values = model.losses([segment], fns, targets, inserted=blocks[name])
            sums[k] += float(counted) * values[0].double()
            if len(values) > 1:
                sums[-1] += float(counted) * values[1].double()
            positions += len(segment.ids) + len(blocks[name] if blocks[name] is not None else prompt)
        if kl:
            positions += len(segment.ids)  # the teacher's record
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.monotonic() - started
    if world > 1:
        torch.distributed.all_reduce(sums)
    tokens = int(store.supervised_tokens[held_out].sum())
    nll = {name: float(sums[k]) / tokens for k, name in enumerate(names)}
    nll.setdefault("ceiling", None)
    gap = None
    if nll["ceiling"] is not None and nll["floor"] != nll["ceiling"]:
        gap = (nll["floor"] - nll["soft"]) / (nll["floor"] - nll["ceiling"])
    result = dict(
        checkpoint=str(directory),
        update=commit["update"],
        records=len(held_out),
        supervised_tokens=tokens,
        context_tokens=len(blocks["ceiling"]) if "ceiling" in blocks else 0,
        nll=nll,
        gap_recovered=gap,
        kl_to_teacher=float(sums[-1]) / tokens if kl else None,
        teacher=teacher_kind(config, store) if kl else None,
        world_size=world,
        seconds=seconds,
        tokens_per_second=positions * world / seconds if seconds else None,
        spds_version=__version__,
        plot=None,
    )
    out = config.output_dir
    if rank != 0:
        return result
    if config.eval.samples and not sharded:  # a few answers beside the figures, by the student already loaded
        from .sample import answers  # spds.sample imports this module's neighbours, not this one's callers

        result["samples"] = answers(
            config,
            config.eval.samples,
            checkpoint=str(directory),
            max_new_tokens=config.eval.max_new_tokens,
            student=student,
        )
    result["plot"] = plot(out / "metrics.jsonl", nll, out / "eval.png")
    require_valid(result, "eval", "eval.json")
    atomic_write_json(out / "eval.json", result)
    return result


def plot(metrics_path: Path, nll: dict, target: Path) -> str | None:
    """Training loss per update beside the three NLLs; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (curve, bars) = plt.subplots(1, 2, figsize=(10, 4))
    if metrics_path.exists():
        lines = [metric for _, metric in read_metrics(metrics_path)]
        curve.plot([m["update"] for m in lines if "loss" in m], [m["loss"] for m in lines if "loss" in m])
    curve.set(title="training loss (loss.objective per supervised token)", xlabel="update", ylabel="loss")
    names = [n for n in ("floor", "soft", "ceiling") if nll.get(n) is not None]
    values = [nll[n] for n in names]
    bars.bar(names, values, color=["#999999", "#3366cc", "#33aa55"][: len(names)])
    spread = max(values) - min(values) or 1.0
    bars.set_ylim(min(values) - spread, max(values) + spread / 2)  # the differences are the point
    for x, value in enumerate(values):
        bars.annotate(f"{value:.4f}", (x, value), ha="center", va="bottom")
    bars.set(title="held-out NLL per response token", ylabel="NLL")
    figure.tight_layout()
    with atomic_path(target) as temporary:
        figure.savefig(temporary, format="png")
    plt.close(figure)
    return str(target)
