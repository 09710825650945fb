"""The trainer's guarantees, each by running spds the way a user does."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, edit_config, make_tiny
from helpers import (
    FAST,
    ROUNDING,
    assert_same_adam_path,
    check,
    final_state,
    metrics,
    newest_checkpoint,
    read_json,
    spds,
    start,
    start_endless,
)

from spds.contract.gate import load_config
from spds.contract.schema import describe_errors
from spds.data.packed import PackedStore
from spds.training.schedule import Plan


@pytest.fixture
def run_dir(prepared):
    return prepared


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.over_budget("bit-identical updates on 1, 2 and 3 ranks under the real launchers")
def test_same_update_whatever_the_world_size(run_dir, tmp_path):
    runs = {  # name: (world, launcher, micro_batch, micro_batch_tokens, student dtype)
        "w1": (1, "plain", 1, None, "bfloat16"),
        "w3": (3, "torchrun", 1, None, "bfloat16"),
        # Padded micro-batches (up to 4 records / 600 positions) against single records, in fp32:
        # in bf16 a batched matmul rounds differently from a single one, which Adam then amplifies.
        "fp32": (1, "plain", 1, None, "float32"),
        "fp32-packed": (2, "torchrun", 4, 600, "float32"),
    }
    prompts, lines = {}, {}
    for name, (world, launcher, micro, tokens, dtype) in runs.items():
        edit_config(
            run_dir,
            output_dir=name,
            optim={**FAST["optim"], "micro_batch": micro, "micro_batch_tokens": tokens},
            student={"dtype": dtype},
        )
        check(spds(["train", "config.json"], run_dir, world=world, launcher=launcher))
        out = run_dir / name
        prompts[name], lines[name] = final_state(out)["prompt"], metrics(out)
        assert read_json(out / "run.json")["world_size"] == world
        assert read_json(out / "terminal.json")["status"] == "complete"
    # The update itself is checked against an independent plain-PyTorch recomputation in
    # test_reference.py (fp32 student); here a bf16 student gives the same update on 1, 2 and 3
    # ranks: fp32 summation order differs between world sizes; nothing else may.
    assert (prompts["w1"] - prompts["fp32"]).abs().max() > 1e-4  # bf16 and fp32 students really differ
    rates = [m["learning_rate"] for m in lines["w1"]]
    assert_same_adam_path(prompts["w3"], prompts["w1"], rates, what="w3 vs w1")
    assert_same_adam_path(prompts["fp32-packed"], prompts["fp32"], rates, what="fp32-packed vs fp32")
    # The same records, losses, token counts and reduced gradient per update, whatever the world
    # size. (Adam is nearly blind to a uniform gradient scale, such as an averaged instead of a
    # summed all-reduce: the logged norm of the reduced gradient shows it.)
    for name in ("w3",):
        for a, b in zip(lines["w1"], lines[name]):
            assert a["global_batch_sha256"] == b["global_batch_sha256"]
            assert a["supervised_tokens"] == b["supervised_tokens"]
            # sums of non-negative terms (CE, squares), reordered: rounding relative to the sum
            assert b["loss"] == pytest.approx(a["loss"], rel=ROUNDING)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=ROUNDING)
    for a, b in zip(lines["fp32"], lines["fp32-packed"]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=ROUNDING)
        assert b["loss"] == pytest.approx(a["loss"], rel=ROUNDING)


def _straight_and(run_dir, name: str, **env):
    edit_config(run_dir, output_dir="straight")
    check(spds(["train", "config.json"], run_dir))
    edit_config(run_dir, output_dir=name)
    first = spds(["train", "config.json"], run_dir, **env)
    return first


def _assert_bit_identical(a: dict, b: dict) -> None:
    for key in ("prompt", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(a[key], b[key]), key
    assert a["lr"] == b["lr"]


# ce and on-policy alone: what mix-jsd-online and kv-on-policy run too (make test-all runs them)
EXTENDED = pytest.mark.extended


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective",
    [pytest.param("ce", marks=EXTENDED), "mix-jsd-online", pytest.param("on-policy", marks=EXTENDED), "kv-on-policy"],
)
def test_sigterm_then_resume_is_bit_identical(run_dir, objective):
    if objective == "kv-on-policy":  # a kv prompt started from the context, its samples decoded with it
        edit_config(
            run_dir,
            soft_prompt={"form": "kv", "init": {"method": "context"}, "frozen_positions": 1},
            context={"text": make_tiny.CONTEXT},
            loss={"objective": "kl", "teacher": "context", "on_policy": {"fraction": 0.5, "max_new_tokens": 8}},
        )
    elif objective == "on-policy":
        # Half of each batch answered by the student at temperature 1: the samples depend on the
        # prompt at each update and on (seed, update), both restored by the resume.
        edit_config(
            run_dir,
            loss={"objective": "kl", "teacher": "context", "on_policy": {"fraction": 0.5, "max_new_tokens": 8}},
            context={"text": make_tiny.CONTEXT},
        )
    elif objective != "ce":
        # The teacher's keys and values, and its memo, are rebuilt after the resume. Batches of 16
        # over 64 records make updates 5-6 a second epoch: the straight run reads those records'
        # teacher states from its memo, the resumed one (memo empty at update 4) recomputes most of
        # them, and the two must agree bit for bit. train.deterministic: strict mode must not stop
        # any op of the loop (an op without a deterministic algorithm raises under it).
        edit_config(
            run_dir,
            loss={
                "objective": "mix",
                "reuse_context_kv": True,
                "teacher_memo_gib": 0.01,
                "kl": {"direction": "jsd", "temperature": 2.0},
            },
            context={"text": make_tiny.CONTEXT},
            optim={"effective_batch": 16},
            train={"deterministic": True},
        )
    first = _straight_and(run_dir, "stopped", SPDS_FAULT="sigterm-before-update-rank0:3")
    check(first)
    terminal = read_json(run_dir / "stopped" / "terminal.json")
    assert terminal["status"] == "stopped" and terminal["update"] == 3
    assert newest_checkpoint(run_dir / "stopped").name == "update-000003"
    assert read_json(newest_checkpoint(run_dir / "stopped") / "commit.json")["reason"] == "stop"
    check(spds(["train", "config.json"], run_dir))
    assert read_json(run_dir / "stopped" / "run.json")["start_update"] == 4
    assert read_json(run_dir / "stopped" / "terminal.json")["status"] == "complete"
    _assert_bit_identical(final_state(run_dir / "straight"), final_state(run_dir / "stopped"))
    assert [m["loss"] for m in metrics(run_dir / "straight")] == [m["loss"] for m in metrics(run_dir / "stopped")]
    if objective.endswith("on-policy"):  # the same samples, each update's once (the stopped run's cut back)
        samples = (run_dir / "straight" / "on-policy.jsonl").read_text()
        assert samples == (run_dir / "stopped" / "on-policy.jsonl").read_text()
        assert [json.loads(line)["update"] for line in samples.splitlines()] == [1, 2, 3, 4, 5, 6]
        assert all(m["on_policy"]["rows"] == 3 for m in metrics(run_dir / "stopped"))


def upgraded_spds(directory: Path) -> str:
    """A copy of spds whose code digest differs from the checkout's (one comment added), as an
    upgrade between a preemption and its resume leaves it: the PYTHONPATH that runs it."""
    shutil.copytree(REPO / "spds", directory / "spds", ignore=shutil.ignore_patterns("__pycache__"))
    with open(directory / "spds" / "train.py", "a") as stream:
        stream.write("# an upgrade\n")
    return str(directory)


@pytest.mark.extended
@pytest.mark.slow
def test_a_job_resumes_across_an_spds_upgrade_and_says_so(run_dir, tmp_path):
    """Smoke and the first updates under one spds, the resume under another: it goes on from the
    checkpoint and the smoke evidence, announces both, and records both code digests in run.json;
    train.require_same_code restores the refusal."""
    edit_config(run_dir, train={"require_smoke": True})
    check(spds(["smoke", "config.json"], run_dir))
    check(spds(["train", "config.json"], run_dir, SPDS_FAULT="sigterm-before-update-rank0:3"))
    assert read_json(run_dir / "run" / "terminal.json")["status"] == "stopped"
    before = read_json(run_dir / "run" / "run.json")
    assert before["code_changes"] == []
    upgraded = upgraded_spds(tmp_path)
    edit_config(run_dir, train={"require_smoke": True, "require_same_code": True})
    refused = spds(["train", "config.json"], run_dir, PYTHONPATH=upgraded)
    assert refused.returncode == 1 and "smoke evidence" in refused.stderr and "code" in refused.stderr, refused.stderr
    edit_config(run_dir, train={"require_smoke": False, "require_same_code": True})
    refused = spds(["train", "config.json"], run_dir, PYTHONPATH=upgraded)
    assert refused.returncode == 1 and "identity changed" in refused.stderr and "code:" in refused.stderr
    edit_config(run_dir, train={"require_smoke": True, "require_same_code": False})
    resumed = check(spds(["train", "config.json"], run_dir, PYTHONPATH=upgraded))
    run = read_json(run_dir / "run" / "run.json")
    assert run["start_update"] == 4 and read_json(run_dir / "run" / "terminal.json")["status"] == "complete"
    changes = {change["what"]: change for change in run["code_changes"]}
    assert set(changes) == {"checkpoint", "smoke evidence"}
    assert changes["checkpoint"]["path"].endswith("update-000003")
    for change in changes.values():
        assert change["saved_code"] == before["identities"]["code"] != change["code"] == run["identities"]["code"]
    assert resumed.stderr.count("written by other spds code") == 2, resumed.stderr


@pytest.mark.slow
def test_kill_during_save_leaves_previous_checkpoint_usable(run_dir):
    first = _straight_and(run_dir, "killed", SPDS_FAULT="kill-after-deepspeed-save:4")
    assert first.returncode == -signal.SIGKILL
    killed = run_dir / "killed"
    assert (killed / "checkpoints" / "update-000004" / "mp_rank_00_model_states.pt").exists()
    assert not (killed / "checkpoints" / "update-000004" / "commit.json").exists()
    assert newest_checkpoint(killed).name == "update-000002"
    assert [m["update"] for m in metrics(killed)] == [1, 2, 3, 4]  # 3 and 4 are redone after the resume
    check(spds(["train", "config.json"], run_dir))
    assert read_json(killed / "run.json")["start_update"] == 3
    _assert_bit_identical(final_state(run_dir / "straight"), final_state(killed))
    # every update once, with the numbers of the run that produced the final prompt
    assert [m["update"] for m in metrics(killed)] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in metrics(killed)] == [m["loss"] for m in metrics(run_dir / "straight")]
    assert read_json(killed / "terminal.json")["status"] == "complete"


@pytest.mark.slow
def test_sigterm_during_start_up_and_mid_run_to_a_plain_process(run_dir):
    """`kill PID` on a plain `spds train`: while Python still imports torch and DeepSpeed (the
    handler is installed before them, so the process stops cleanly instead of dying, and says so),
    then mid-run (it stops at an update boundary with a committed checkpoint)."""
    edit_config(run_dir, output_dir="early")
    process = start(["train", "config.json"], run_dir)
    wait_for_handler(process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-3000:]
    terminal = read_json(run_dir / "early" / "terminal.json")
    assert terminal["status"] == "stopped" and terminal["update"] == 0 and terminal["checkpoint"] is None
    assert "SIGTERM" in terminal["reason"] and not (run_dir / "early" / "metrics.jsonl").exists()
    process = start_endless(run_dir, "early")  # nothing to resume: a fresh start, signalled mid-run
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-3000:]
    terminal = read_json(run_dir / "early" / "terminal.json")
    assert terminal["status"] == "stopped" and 2 <= terminal["update"] < 400
    commit = read_json(newest_checkpoint(run_dir / "early") / "commit.json")
    assert commit["update"] == terminal["update"] and commit["reason"] == "stop"
    assert [m["update"] for m in metrics(run_dir / "early")] == list(range(1, terminal["update"] + 1))


def wait_for_handler(process, timeout: float = 60) -> None:
    """Until the process has installed its SIGTERM handler (Linux: SigCgt in /proc), and no longer:
    the signal must land during start-up, never before Python runs spds at all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{process.pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError("the process never installed a SIGTERM handler")


@pytest.mark.extended
@pytest.mark.slow
def test_a_build_lock_left_by_a_killed_start_does_not_hang_the_next(run_dir, tmp_path):
    """SIGKILL during DeepSpeed's JIT build of its CPU comm op leaves torch's FileBaton `lock`
    behind; before spds took the build under an flock, every later start waited on it forever.
    The test works on a private copy of the built op (a fresh build costs a minute of compiling,
    and the machine's own cache is shared with every other run)."""
    import os
    import shutil

    from torch.utils.cpp_extension import _get_build_directory

    edit_config(run_dir, output_dir="first", optim={**FAST["optim"], "updates": 1})
    check(spds(["train", "config.json"], run_dir))  # the op is built (or was already)
    built = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    private = tmp_path / "extensions"
    shutil.copytree(built, private / built.name, ignore=shutil.ignore_patterns("lock"))  # mtimes and ninja log too
    baton = private / built.name / "lock"
    baton.write_text("")  # what a start killed mid-build leaves
    edit_config(run_dir, output_dir="second")
    env = dict(TORCH_EXTENSIONS_DIR=str(private))
    result = check(spds(["train", "config.json"], run_dir, timeout=300, **env))
    assert f"removing {baton}" in result.stderr and not baton.exists()
    assert read_json(run_dir / "second" / "terminal.json")["status"] == "complete"
    assert os.environ.get("TORCH_EXTENSIONS_DIR") != str(private)


@pytest.mark.slow
def test_packed_tokens_truncated_under_a_running_job_fail_it_truthfully(run_dir):
    process = start_endless(run_dir, "truncated", every=1)
    tokens = run_dir / "packed" / "tokens.uint32"
    with open(tokens, "r+b") as stream:  # in place, as a full disk or a careless rsync would
        stream.truncate(tokens.stat().st_size // 3)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 1 and "tokens.uint32: record" in output, output[-3000:]
    terminal = read_json(run_dir / "truncated" / "terminal.json")
    assert terminal["status"] == "failed" and "truncated" in terminal["reason"]
    assert terminal["checkpoint"] == str(newest_checkpoint(run_dir / "truncated"))
    assert (
        terminal["update"]
        == len(metrics(run_dir / "truncated"))
        == read_json(newest_checkpoint(run_dir / "truncated") / "commit.json")["update"]
    )


@pytest.mark.extended
@pytest.mark.slow
def test_a_changed_identity_and_settings_this_machine_cannot_run_are_refused(run_dir):
    edit_config(run_dir, optim={**FAST["optim"], "updates": 4})
    check(spds(["train", "config.json"], run_dir))
    assert sorted(p.name for p in (run_dir / "run" / "checkpoints").iterdir()) == ["update-000002", "update-000004"]
    # An identity change: a different learning rate cannot continue this run.
    edit_config(run_dir, optim={**FAST["optim"], "updates": 4, "learning_rate": 0.01})
    result = spds(["train", "config.json"], run_dir)
    assert result.returncode == 1 and "identity changed" in result.stderr and "config" in result.stderr
    terminal = read_json(run_dir / "run" / "terminal.json")  # no longer the previous run's "complete"
    assert terminal["status"] == "failed" and "identity changed" in terminal["reason"] and terminal["update"] == 4
    edit_config(run_dir, optim={**FAST["optim"], "updates": 4})
    # A GPU-only setting on a machine without one says so, before any work.
    edit_config(run_dir, student={"liger_kernels": True})
    result = spds(["train", "config.json"], run_dir)
    assert result.returncode == 1 and "student.liger_kernels is true but" in result.stderr
    fa4_for_long = {"below": 64, "short": "auto", "long": "fa4"}
    edit_config(run_dir, student={"liger_kernels": False, "attention_kernel": fa4_for_long})
    result = spds(["train", "config.json"], run_dir)
    assert result.returncode == 1 and "student.attention_kernel names fa4 (FlashAttention-4), but" in result.stderr


@pytest.mark.slow
def test_smoke_gates_train_and_outputs_match_their_schemas(run_dir):
    edit_config(
        run_dir,
        train={"require_smoke": True},
        checkpoint={"every": 2, "keep_last": 1},
        optim={**FAST["optim"], "updates": 4},
    )
    result = spds(["train", "config.json"], run_dir)
    assert result.returncode == 1 and "no smoke evidence" in result.stderr
    check(spds(["smoke", "config.json"], run_dir))
    evidence = read_json(run_dir / "run" / "smoke" / "evidence.json")
    store = PackedStore.open(run_dir / "packed")
    assert evidence["status"] == "passed" and evidence["longest_record_tokens"] == int(store.length.max())
    assert describe_errors(evidence, "smoke") == []
    # the smoke's one update holds the longest record: its positions, with the soft prompt's
    prompt_length = read_json(run_dir / "config.json")["soft_prompt"]["length"]
    assert metrics(run_dir / "run" / "smoke")[0]["longest_record_positions"] == int(store.length.max()) + prompt_length
    check(spds(["train", "config.json"], run_dir))
    out = run_dir / "run"
    assert not read_json(out / "run.json")["smoke_waived"]
    startup = read_json(out / "run.json")["startup_seconds"]  # where the time to update 1 goes, in order
    phases = ["config", "process_group", "data", "identities", "student", "engine", "resume"]
    assert list(startup) == phases and all(startup[a] <= startup[b] for a, b in zip(phases, phases[1:]))
    for name, schema in [("run.json", "run"), ("progress.json", "progress"), ("terminal.json", "terminal")]:
        assert describe_errors(read_json(out / name), schema) == [], name
    lines = metrics(out)
    assert [m["update"] for m in lines] == [1, 2, 3, 4]
    assert all(describe_errors(m, "metrics") == [] for m in lines)
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in lines)
    # keep_last 1: only the newest committed checkpoint remains, and it is never the one deleted.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["update-000004"]
    commit = read_json(out / "checkpoints" / "update-000004" / "commit.json")
    assert describe_errors(commit, "commit") == [] and commit["cursor"]["next_update"] == 5
    # A config change after the smoke makes its evidence stale.
    edit_config(run_dir, optim={**FAST["optim"], "updates": 4, "learning_rate": 0.02})
    result = spds(["train", "config.json"], run_dir)
    assert result.returncode == 1 and "is for another config" in result.stderr


@pytest.mark.slow
def test_deepspeed_monitor_receives_spds_metrics(run_dir, tmp_path):
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 0},
                "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"},
            }
        )
    )
    edit_config(run_dir, deepspeed_config=str(ds_config), optim={**FAST["optim"], "updates": 3})
    check(spds(["train", "config.json"], run_dir))
    loss_csv = next((tmp_path / "csv").rglob("spds_loss.csv"))
    values = [float(line.split(",")[1]) for line in loss_csv.read_text().splitlines()[1:]]
    # the same floats, written as text by DeepSpeed's CSV monitor (which may drop digits)
    assert values == pytest.approx([m["loss"] for m in metrics(run_dir / "run")])


SHARDED = {"fsdp": dict(sharding="fsdp"), "zero3": dict(sharding="deepspeed", deepspeed_config="ds_configs/zero3.json")}
ZERO0 = dict(sharding="deepspeed", deepspeed_config="ds_configs/zero0.json")
# Uneven ranks: they pack different numbers of forward passes, and a small activation budget makes
# some passes recompute their layers in backward and others not. A sharded student gathers weights
# collectively in every forward and recomputation, so its ranks must stay in lockstep through both.
UNEVEN = dict(
    optim={**FAST["optim"], "micro_batch": 3, "micro_batch_tokens": 525},
    student={"activation_checkpointing": "auto", "activation_memory_gib": 0.0015},
    distributed={"timeout_minutes": 2},
)  # a rank waiting on a collective the other never joins fails soon


@pytest.mark.slow
@pytest.mark.over_budget(
    "the only ZeRO-3 and FSDP trainings: their updates against ZeRO-0's and their resume, on 2 ranks"
)
def test_sharded_backends_match_zero0_and_resume(run_dir):
    edit_config(run_dir, **UNEVEN)
    config = load_config(run_dir / "config.json")
    plan = Plan(PackedStore.open(config.packed_dir), config.optim, config.soft_prompt.length, 2)
    passes = [[plan.passes(plan.step(u), rank, lockstep=False) for rank in (0, 1)] for u in range(1, 7)]
    assert any(len(a) != len(b) for a, b in passes), "the data no longer gives ranks uneven passes"
    # ZeRO-0 on 2 ranks, straight; and again stopped by a SIGTERM, to be resumed under each backend.
    edit_config(run_dir, output_dir="zero0", **ZERO0)
    check(spds(["train", "config.json"], run_dir, world=2, launcher="torchrun"))
    zero0, zero0_lines = final_state(run_dir / "zero0"), metrics(run_dir / "zero0")
    edit_config(run_dir, output_dir="zero0-stopped", **ZERO0)
    check(
        spds(
            ["train", "config.json"], run_dir, world=2, launcher="torchrun", SPDS_FAULT="sigterm-before-update-rank0:3"
        )
    )
    for backend, sharded in SHARDED.items():
        # The student sharded (FSDP2 or ZeRO-3), stopped by a SIGTERM and resumed: the ZeRO-0
        # update bit for bit. Sharding moves the frozen weights, not the arithmetic (each rank
        # computes its records with the whole gathered layer; the prompt gradient is the same
        # exact SUM), and a resume changes nothing. On GPUs, kernels may differ: bench/RESULTS.md
        # records the difference there.
        edit_config(run_dir, output_dir=backend, **sharded)
        check(
            spds(
                ["train", "config.json"],
                run_dir,
                world=2,
                launcher="torchrun",
                SPDS_FAULT="sigterm-before-update-rank1:3",
            )
        )
        assert read_json(run_dir / backend / "terminal.json")["status"] == "stopped"
        assert (
            torch.load(newest_checkpoint(run_dir / backend) / "mp_rank_00_model_states.pt", weights_only=True)[
                "backend"
            ]
            == backend
        )
        check(spds(["train", "config.json"], run_dir, world=2, launcher="torchrun"))
        assert read_json(run_dir / backend / "run.json")["config"]["sharding"] == sharded["sharding"]
        state = final_state(run_dir / backend)
        for key in ("prompt", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], zero0[key]), (backend, key)
        assert [m["grad_norm"] for m in metrics(run_dir / backend)] == [m["grad_norm"] for m in zero0_lines]
        if backend != "fsdp":
            continue
        # A ZeRO-0 checkpoint continues under a sharded backend (the checkpoint's format is the
        # same for every backend: one is enough).
        shutil.copytree(run_dir / "zero0-stopped", run_dir / f"cross-{backend}")
        edit_config(run_dir, output_dir=f"cross-{backend}", **sharded)
        check(spds(["train", "config.json"], run_dir, world=2, launcher="torchrun"))
        assert read_json(run_dir / f"cross-{backend}" / "run.json")["start_update"] == 4
        assert torch.equal(final_state(run_dir / f"cross-{backend}")["prompt"], zero0["prompt"]), backend
