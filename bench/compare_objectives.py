"""ce vs kl vs mix at equal updates on the same teacher rows: held-out gap recovered and KL.

    python bench/compare_objectives.py [--tiny DIR] [--updates 30] [--out DIR]
        [--objectives ce,kl,mix] [--seeds 1] [--fp8]

Builds the tiny example (random 2-layer Qwen3 student, byte-level ChatML tokenizer) unless DIR
already holds it, lets the teacher (the student with the context) answer the questions once
(spds generate), packs the rows once, then trains one soft prompt per objective with everything
else equal (seed, initial prompt, batches, learning rate, updates) and evaluates each on the
held-out questions with `eval.kl`. Runs the real CLI, on CUDA when there is one. Writes
objectives.json and objectives.png (gap recovered and held-out KL per objective) to --out.

--seeds N trains each objective from N seeds (the prompt's initialisation and the batches'
order: optim.seed), which is the noise any other difference is read against. --fp8 trains each
objective again with student.fp8_linear (the frozen student's linear layers in FP8), evaluated on
the student as loaded, like every prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OBJECTIVES = {
    "ce": {"objective": "ce"},
    "kl": {"objective": "kl"},
    "mix": {"objective": "mix", "ce_weight": 1.0, "kl_weight": 1.0},
}


def spds(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "spds.cli", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
        cwd=REPO,
    )
    if result.returncode:
        raise SystemExit(f"spds {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", default=str(REPO / "examples" / "tiny" / "build-objectives"))
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--fp8", action="store_true")
    args = parser.parse_args()
    tiny = Path(args.tiny).resolve()
    out = Path(args.out or tiny)
    out.mkdir(parents=True, exist_ok=True)
    if not (tiny / "loop.json").exists():
        subprocess.run(
            [sys.executable, str(REPO / "examples" / "tiny" / "make_tiny.py"), str(tiny)],
            check=True,
            capture_output=True,
        )
    loop = json.loads((tiny / "loop.json").read_text())
    if not (tiny / loop["generate"]["output"]).exists():
        spds("generate", str(tiny / "loop.json"))
    results = {}
    runs = [
        (objective, fp8, seed)
        for objective in args.objectives.split(",")
        for fp8 in ((False, True) if args.fp8 else (False,))
        for seed in range(loop["optim"].get("seed", 0), loop["optim"].get("seed", 0) + args.seeds)
    ]
    for objective, fp8, seed in runs:
        name = objective + ("-fp8" if fp8 else "") + (f"-seed{seed}" if args.seeds > 1 else "")
        config = dict(
            loop,
            student=dict(loop["student"], fp8_linear=fp8),
            loss=dict(loop.get("loss", {}), **OBJECTIVES[objective]),
            output_dir=f"objective-{name}",
            optim=dict(loop["optim"], updates=args.updates, seed=seed),
            eval={"kl": True},
            train=dict(loop.get("train", {}), require_smoke=False),
        )
        path = tiny / f"objective-{name}.json"
        path.write_text(json.dumps(config, indent=2))
        spds("prepare", str(path))
        started = time.monotonic()
        spds("train", str(path))
        seconds = time.monotonic() - started
        spds("eval", str(path))
        report = json.loads((tiny / f"objective-{name}" / "eval.json").read_text())
        results[name] = dict(
            gap_recovered=report["gap_recovered"],
            kl_to_teacher=report["kl_to_teacher"],
            nll=report["nll"],
            train_seconds=seconds,
            updates=args.updates,
            records=report["records"],
            supervised_tokens=report["supervised_tokens"],
        )
        print(
            f"{name:8s}  gap recovered {report['gap_recovered']:.1%}  held-out KL {report['kl_to_teacher']:.4f}  "
            f"NLL soft {report['nll']['soft']:.4f} (floor {report['nll']['floor']:.4f}, ceiling "
            f"{report['nll']['ceiling']:.4f})  train {seconds:.0f} s",
            flush=True,
        )
    (out / "objectives.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "objectives.png")


def plot(results: dict, target: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results)
    figure, (gap, kl) = plt.subplots(1, 2, figsize=(9, 3.5))
    gap.bar(names, [100 * results[n]["gap_recovered"] for n in names], color="#3366cc")
    gap.set(title="held-out gap recovered (%)", ylabel="%")
    kl.bar(names, [results[n]["kl_to_teacher"] for n in names], color="#cc6633")
    kl.set(title="held-out KL(teacher || soft prompt) per token", ylabel="nats")
    for axis, key, scale, form in ((gap, "gap_recovered", 100, "{:.1f}"), (kl, "kl_to_teacher", 1, "{:.3f}")):
        for x, n in enumerate(names):
            axis.annotate(form.format(scale * results[n][key]), (x, scale * results[n][key]), ha="center", va="bottom")
    figure.suptitle(f"tiny example, {results[names[0]]['updates']} updates each, the same teacher rows")
    figure.tight_layout()
    figure.savefig(target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
