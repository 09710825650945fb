"""What every bench tool shares: the record each figure is printed as, where raw output goes, and
the random-weight Qwen3-shaped students the GPU tools build from a config (nothing downloaded).

A figure is one JSON line on stdout: the tool's own keys plus date, device, versions, commit and
the command that produced it, so that a line pasted into bench/RESULTS.md carries its provenance.
Raw output (logs, rows, runs) goes outside the checkout: --out, else $SPDS_BENCH_OUT, else
~/.cache/spds-bench/<date>/<tool>. The tree holds tools and tables only (tests/test_structure.py).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151936
HEAD_DIM = 128
SHAPES = {  # Qwen3 dense shapes (hidden, layers, heads, kv heads, intermediate, tied embeddings)
    "0.6b": (1024, 28, 16, 8, 3072, True),
    "1.7b": (2048, 28, 16, 8, 6144, True),
    "4b": (2560, 36, 32, 8, 9728, True),
    "8b": (4096, 36, 32, 8, 12288, False),
    "14b": (5120, 40, 40, 8, 17408, False),
    "32b": (5120, 64, 64, 8, 25600, False),
    "cpu-test": (128, 2, 4, 2, 256, True),  # a dry run of a GPU tool on a machine without one
}
PACKAGES = ("torch", "transformers", "deepspeed", "liger-kernel", "flash-attn-4", "peft")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}"
    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "spds"], capture_output=True, text=True
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


_PROVENANCE: dict = {}


def record(**figure) -> dict:
    """Print one figure as a JSON line with its provenance (computed once per process)."""
    if not _PROVENANCE:
        _PROVENANCE.update(
            date=time.strftime("%Y-%m-%d"),
            device=device_name(),
            versions=versions(),
            commit=commit(),
            command=" ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        )
    line = {**figure, **_PROVENANCE}
    print(json.dumps(line), flush=True)
    return line


def out_dir(given: str | None, tool: str) -> Path:
    """Where a tool writes its raw output: outside the checkout unless the user says otherwise."""
    base = given or os.environ.get("SPDS_BENCH_OUT")
    path = Path(base) if base else Path.home() / ".cache" / "spds-bench" / time.strftime("%Y-%m-%d") / tool
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def qwen3_config(name: str, attn: str = "sdpa"):
    from transformers import Qwen3Config

    hidden, layers, heads, kv, inter, tied = SHAPES[name]
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=HEAD_DIM,
        max_position_embeddings=131072,
        tie_word_embeddings=tied,
        rope_theta=1_000_000,
        attn_implementation=attn,
    )


def build_student(name: str, device: str, layers: int | None = None):
    """The random-weight bf16 student of shape `name` (its first `layers` decoder layers, if given)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    config = qwen3_config(name)
    config.num_hidden_layers = layers or config.num_hidden_layers
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    torch.set_default_dtype(previous)
    return model.requires_grad_(False).eval()


def synthetic_run(directory: Path, model: str, **config) -> Path:
    """A run directory: the random-weight student saved with save_pretrained and the tiny
    example's byte-level ChatML tokenizer (the model's 151,936 output rows against the tokenizer's
    259 ids: the decoder's mask of the padded rows), and a config.json with `config`'s sections."""
    import torch

    sys.path.insert(0, str(REPO / "examples" / "tiny"))
    import make_tiny

    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "student" / "config.json").exists():
        student = build_student(model, "cuda" if torch.cuda.is_available() else "cpu")
        student.save_pretrained(directory / "student")
        make_tiny.chatml_tokenizer().save_pretrained(directory / "student")
        del student
    make_tiny.tiny_config(directory, **config)
    return directory / "config.json"


def timed(command: list[str], log: Path, cwd: Path | None = None) -> tuple[int, float]:
    """Run a command to `log`; return its exit status and wall seconds."""
    began = time.perf_counter()
    with open(log, "w") as stream:
        status = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=cwd).returncode
    return status, round(time.perf_counter() - began, 1)


def eval_against_step(run: Path, **labels) -> dict:
    """eval's scoring positions/s beside the training step's tok/s on the same student and rows
    (the step's median over the updates after the first, which compiles), and eval's phases."""
    steps = [json.loads(line) for line in open(run / "metrics.jsonl")]
    rates = sorted([m["tokens_per_second"] for m in steps if "tokens_per_second" in m][1:]) or [0]
    step = rates[len(rates) // 2]
    report = json.loads((run / "eval.json").read_text())
    asked = report.get("questions") or {}
    scoring = {"held_out": report.get("tokens_per_second"), "questions": asked.get("tokens_per_second")}
    return record(figure="eval against the step", **labels, step_tok_s=round(step),
                  scoring_positions_s={k: v and round(v) for k, v in scoring.items()},
                  ratio={k: v and step and round(v / step, 2) for k, v in scoring.items()}, records=report["records"],
                  questions=asked.get("records"), phases=report.get("phases"))  # fmt: skip
