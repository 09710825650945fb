"""Run spds as a user would (a subprocess, optionally under a launcher) and read what it left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from spds.training.engine import free_port  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]


# A small, quick run of the tiny example: 6 updates of 6 records, checkpoint every 2.
FAST = dict(
    soft_prompt={"length": 4, "placement": "system", "init": {"method": "random_normal", "std": 0.3}},
    optim={
        "updates": 6,
        "effective_batch": 6,
        "micro_batch": 1,
        "learning_rate": 0.05,
        "warmup_updates": 1,
        "schedule": "cosine",
        "min_lr_ratio": 0.2,
        "seed": 5,
    },
    checkpoint={"every": 2, "keep_last": 10},
    train={"require_smoke": False},
)


def environment(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["SPDS_PYTHON"] = sys.executable  # the launch scripts run this suite's venv (make test-latest's too)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch_command(args: list[str], world: int = 1, launcher: str = "plain") -> list[str]:
    if launcher == "plain":
        assert world == 1
        return [sys.executable, "-m", "spds.cli", *args]
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world}",
            f"--master_port={free_port()}",
            "-m",
            "spds.cli",
            *args,
        ]
    if launcher == "deepspeed":
        deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
        return [deepspeed, f"--num_gpus={world}", f"--master_port={free_port()}", "--module", "spds.cli", *args]
    raise ValueError(launcher)


def spds(
    args: list[str],
    cwd: Path,
    world: int = 1,
    launcher: str = "plain",
    timeout: int = 600,
    fresh: bool = False,
    **env,
) -> subprocess.CompletedProcess:
    """Run spds as a user would. One plain process runs in this test process (`in_process`), the
    imports paid once per worker; a launcher, several ranks, a fault injection (it signals its own
    process), a variable of another library's (read when it is imported: HF_HUB_CACHE) or
    `fresh=True` (a promise about a process's start, or code that changes process-wide tables)
    runs in a process of its own."""
    own_variables = all(key.startswith("SPDS_") and key != "SPDS_FAULT" for key in env)
    if world == 1 and launcher == "plain" and not fresh and own_variables:
        return in_process(args, cwd, **env)
    return subprocess.run(
        launch_command(args, world, launcher),
        cwd=cwd,
        env=environment(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_process(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    """`python -m spds.cli ARGS` in this process: the same environment, working directory and one
    CPU thread as the subprocess gets (bits depend on the thread count), stdout and stderr
    captured, an uncaught exception turned into exit 1 and its traceback, as Python would; and
    everything the run changes in the process put back (environment, directory, signal handlers,
    the stop handler, the process group, torch's thread count and deterministic mode)."""
    import contextlib
    import io
    import signal
    import time
    import traceback
    import warnings

    from spds import cli
    from spds.stop import StopRequest

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    out, err = io.StringIO(), io.StringIO()
    wanted = environment(**env)  # from this process's environment, before it is replaced
    os.environ.clear()
    os.environ.update(wanted)
    os.chdir(cwd)
    torch.set_num_threads(1)
    cli.STARTED = time.time()  # start-up is timed from the command, not from this worker's start
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")  # Python's own filters: each warning once, as in a fresh
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)  # process, those four not shown
            warnings.showwarning = lambda message, category, *rest, **kw: print(
                f"{category.__name__}: {message}", file=sys.stderr
            )
            try:
                code = cli.main(list(args))
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
            except Exception:  # what Python prints for an uncaught exception, and its exit status
                traceback.print_exc()
                code = 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # DeepSpeed keeps the groups it made of the last process group (its world group for the
        # model's broadcast); a fresh process starts without them
        groups = sys.modules.get("deepspeed.utils.groups")
        for name, value in vars(groups).items() if groups else ():
            if isinstance(value, torch.distributed.ProcessGroup):
                setattr(groups, name, None)
        StopRequest._installed = None
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["spds", *args], code, out.getvalue(), err.getvalue())


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-6000:]}"
    )
    return result


def newest_checkpoint(run_dir: Path) -> Path:
    committed = sorted(p for p in (run_dir / "checkpoints").glob("update-*") if (p / "commit.json").exists())
    assert committed, f"no committed checkpoint in {run_dir}"
    return committed[-1]


def final_state(run_dir: Path) -> dict:
    """Prompt and Adam moments of the newest committed checkpoint."""
    state = torch.load(newest_checkpoint(run_dir) / "mp_rank_00_model_states.pt", weights_only=True)
    adam = state["optimizer"]["state"][0]
    return dict(
        prompt=state["module"]["prompt"],
        exp_avg=adam["exp_avg"],
        exp_avg_sq=adam["exp_avg_sq"],
        step=adam["step"],
        lr=state["lr_scheduler"]["_last_lr"][0],
    )


# ---------------------------------------------------------------- floating-point comparisons

FP32_EPS = torch.finfo(torch.float32).eps  # 2**-23
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7
# Relative to its tensor's scale, how far two fp32 computations of the same quantity may differ
# when only the order and grouping of their sums differ (another kernel or vector unit, chunks,
# padding, a packed layout, another world size's all-reduce). A reordered sum of n terms moves
# by at most about n * eps * sum|terms| (Higham, Accuracy and Stability of Numerical Algorithms,
# section 4.2); the tiny students' longest reductions are a few hundred terms (positions x head
# widths, two layers, forward and backward), and the terms are bounded by the tensor's largest
# element, so 2**10 eps of that largest element (1.2e-4 of it) bounds rounding on any x86-64
# vector unit. A wrong result (a term missing, a token off by one, another mask, a mean for a
# sum) moves elements by a sizeable fraction of that scale, orders of magnitude outside.
ROUNDING = 2**10 * FP32_EPS


def assert_rounding_close(actual, expected, bound: float = ROUNDING, what: str = "") -> None:
    """|actual - expected| <= bound * max|expected|, element-wise: the same quantity computed two
    ways. The scale is the tensor's largest magnitude, not each element's own: an element near
    zero is a cancellation of terms as large as the rest, and rounds like them (a per-element
    absolute floor tuned on one CPU is a property of that CPU, not of the code)."""
    actual, expected = torch.as_tensor(actual).detach().double(), torch.as_tensor(expected).detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert error <= bound * scale, (
        f"{what}: max |difference| {error:.3g} exceeds {bound:.3g} of the largest "
        f"magnitude {scale:.3g} (allowed {bound * scale:.3g})"
    )


def assert_same_adam_path(
    actual, expected, learning_rates: list[float], bound: float = ROUNDING, what: str = ""
) -> None:
    """Two prompts after the same Adam updates from the same start, their gradients equal up to
    `bound` relative rounding. Adam's step lr * m/(sqrt(v) + eps) is invariant to the gradients'
    scale, and a relative perturbation d of them moves m/sqrt(v) by at most about 2d per element:
    so the prompts differ by at most 2 * bound * sum(lr) in any element, whatever the prompt's own
    scale. The one exception is an element whose gradient lies within rounding of zero, where
    m/(sqrt(v) + eps) is steep; the tiny example's gradients are of order 1 to 50 (test_reference's
    norms), far from it."""
    allowed = 2 * bound * sum(learning_rates)
    error = float((torch.as_tensor(actual).double() - torch.as_tensor(expected).double()).abs().max())
    assert error <= allowed, f"{what}: max |difference| {error:.3g} exceeds 2 x {bound:.3g} x sum(lr) = {allowed:.3g}"


def assert_matches_reference(model, segments, reference, prompt, what: str = "") -> torch.Tensor:
    """spds's loss and prompt gradient over `segments` against `reference(p)`, a plain forward's
    summed loss of a fresh copy p of `prompt` that autograd differentiates: both to rounding.
    Returns the reference's loss."""
    loss = model(segments)
    loss.backward()
    theirs = prompt.clone().requires_grad_()
    expected = reference(theirs)
    expected.backward()
    assert_rounding_close(loss, expected, what=f"{what} loss".strip())
    assert_rounding_close(model.prompt.grad, theirs.grad, what=f"{what} prompt gradient".strip())
    return expected


def spliced_reference_loss(student, prompt, segment) -> torch.Tensor:
    """The student's own forward over the record's embeddings with `prompt` spliced at its
    insertion point, logits materialised: the summed CE of its response tokens (no spds code)."""
    embeddings = student.get_input_embeddings()(segment.ids)
    a, length = segment.insert_at, prompt.shape[0]
    joined = torch.cat([embeddings[:a], prompt.to(embeddings.dtype), embeddings[a:]])[None]
    logits = student(inputs_embeds=joined).logits[0].float()
    rows = logits[segment.prefix_tokens + length - 1 : len(segment.ids) + length - 1]
    return torch.nn.functional.cross_entropy(rows, segment.ids[segment.prefix_tokens :], reduction="sum")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start(
    args: list[str], cwd: Path, world: int = 1, launcher: str = "plain", command: list[str] | None = None, **env
) -> subprocess.Popen:
    """A run in the background, output kept (stderr merged into stdout), for signals and faults."""
    return subprocess.Popen(
        command or launch_command(args, world, launcher),
        cwd=cwd,
        env=environment(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_lines(path: Path, count: int, process: subprocess.Popen, timeout: float = 180) -> None:
    """Until `path` (metrics.jsonl) holds `count` lines; the process must still be running."""
    import time

    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count("\n") >= count):
        assert process.poll() is None, f"the run ended early:\n{process.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {count} lines in {path} within {timeout} s"
        time.sleep(0.01)


def start_endless(run_dir: Path, output_dir: str = "run", every: int = 1000) -> subprocess.Popen:
    """A 400-update run (constant rate) in the background, returned once it has logged 2 updates:
    for what happens to a job in flight (signals, files changed under it)."""
    import json

    path = run_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(
        output_dir=output_dir,
        checkpoint={"every": every, "keep_last": 2},
        optim={**FAST["optim"], "updates": 400, "schedule": "constant", "warmup_updates": 0},
    )
    path.write_text(json.dumps(config, indent=2))
    process = start(["train", "config.json"], run_dir)
    wait_for_lines(run_dir / output_dir / "metrics.jsonl", 2, process)
    return process


def divergence(log_p, log_q, direction: str, beta: float):
    """Summed D(teacher p, student q) over rows: the textbook formulas over materialised
    probabilities, for references that autograd differentiates (no spds code)."""
    p, q = log_p.exp(), log_q.exp()
    if direction == "forward":
        return (p * (log_p - log_q)).sum()
    if direction == "reverse":
        return (q * (log_q - log_p)).sum()
    m = beta * p + (1 - beta) * q
    return beta * (p * (log_p - m.log())).sum() + (1 - beta) * (q * (log_q - m.log())).sum()
