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

import json
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .contract import Config, describe_errors
from .data.packed import PackedStore
from .export import checkpoint_prompt, resolve_checkpoint
from .fsio import SpdsError, atomic_path, atomic_write_json
from .loss import make_loss
from .model import Segment, SoftPromptModel, load_student


def context_text(config: Config) -> str | None:
    context = config["context"]
    if context["file"]:
        return config.resolve(context["file"]).read_text()
    return context["text"]


@torch.no_grad()
def evaluate(config: Config, checkpoint_path: str | None = None, log=print) -> dict:
    directory = resolve_checkpoint(config, checkpoint_path)
    prompt, commit = checkpoint_prompt(directory)
    store = PackedStore.open(config.packed_dir)
    held_out = np.flatnonzero(~store.is_train)
    if not len(held_out):
        raise SpdsError("no held-out records: set data.eval_fraction > 0 and run spds prepare on a fresh packed_dir")
    limit = config["eval"]["max_records"]
    held_out = held_out[:limit] if limit else held_out
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    student = load_student(config.model_path, config["student"]["dtype"], config["student"]["attn_implementation"], device)
    model = SoftPromptModel(student, prompt, make_loss("chunked", config["loss"]["chunk_tokens"]), False,
                            config["student"]["sdpa_backend"])
    text = context_text(config)
    blocks = {"floor": prompt.new_zeros((0, prompt.shape[1])).to(device), "soft": None}
    if text:
        from .data.prepare import load_tokenizer

        ids = load_tokenizer(config).encode(text, add_special_tokens=False)
        blocks["ceiling"] = student.get_input_embeddings()(torch.tensor(ids, device=device))
    sums = {name: 0.0 for name in blocks}
    for i in held_out:
        segment = Segment(torch.from_numpy(store.ids(int(i))).to(device), int(store.prefix_tokens[i]), int(store.insert_at[i]))
        for name, block in blocks.items():
            sums[name] += float(model([segment], inserted=block))
    tokens = int(store.supervised_tokens[held_out].sum())
    nll = {name: sums[name] / tokens for name in sums}
    nll.setdefault("ceiling", None)
    gap = None
    if nll["ceiling"] is not None and nll["floor"] != nll["ceiling"]:
        gap = (nll["floor"] - nll["soft"]) / (nll["floor"] - nll["ceiling"])
    result = dict(checkpoint=str(directory), update=commit["update"], records=len(held_out), supervised_tokens=tokens,
                  context_tokens=len(blocks["ceiling"]) if "ceiling" in blocks else 0, nll=nll, gap_recovered=gap,
                  spds_version=__version__, plot=None)
    out = config.output_dir
    result["plot"] = plot(out / "metrics.jsonl", nll, out / "eval.png")
    problems = describe_errors(result, "eval")
    if problems:
        raise SpdsError("internal error: eval.json does not match schemas/eval.schema.json", problems)
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
        lines = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        curve.plot([m["update"] for m in lines], [m["loss"] for m in lines])
    curve.set(title="training loss (mean CE per supervised token)", xlabel="update", ylabel="loss")
    names = [n for n in ("floor", "soft", "ceiling") if nll.get(n) is not None]
    values = [nll[n] for n in names]
    bars.bar(names, values, color=["#999999", "#3366cc", "#33aa55"][:len(names)])
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
