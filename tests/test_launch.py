"""Launching like DeepSpeed users do: the real deepspeed launcher, two 'nodes' with --no_ssh on
this machine, and contracts that stop a bad launch before any process starts. Two real hosts
(sshd, pdsh, SLURM) are tests/test_multinode.py's."""

from __future__ import annotations

import signal
import subprocess

import pytest
from conftest import REPO, edit_config
from helpers import (
    FAST,
    environment,
    free_port,
    launch_command,
    read_json,
    spds,
    start,
    wait_for_lines,
)

LAUNCH = REPO / "launch"


def script(name: str, *args: str, cwd, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=environment(**env),
        timeout=timeout,
    )


def test_launch_refuses_an_invalid_config_before_starting_anything(tiny, tmp_path):
    edit_config(tiny, optim={"lerning_rate": 1.0})
    for name, args in [
        ("single_node.sh", ["--gpus", "2"]),
        ("multi_node.sh", [str(tmp_path / "hostfile"), "--no-ssh", "--node-rank", "0", "--master-addr", "127.0.0.1"]),
    ]:
        (tmp_path / "hostfile").write_text("node-a slots=1\n")
        result = script(name, "config.json", *args, cwd=tiny)
        assert result.returncode != 0
        assert "did you mean 'learning_rate'" in result.stderr and "nothing was launched" in result.stderr
        assert "launch.py" not in result.stdout + result.stderr


def test_world_size_contract_is_checked_at_launch(prepared):
    run_dir = prepared
    edit_config(run_dir, output_dir="wrong-world", data_parallel_size=4, optim={**FAST["optim"], "effective_batch": 8})
    result = spds(["train", "config.json"], run_dir, world=2, launcher="torchrun")
    assert result.returncode != 0
    assert "data_parallel_size is 4 but this launch has world size 2" in result.stdout + result.stderr


LONG = dict(
    optim={**FAST["optim"], "updates": 30, "schedule": "constant", "warmup_updates": 0},
    checkpoint={"every": 1000, "keep_last": 2},
    data_parallel_size=2,
)


@pytest.mark.slow
@pytest.mark.over_budget(
    "a SIGTERM sent to the real launcher as a scheduler sends it: every rank stops at an update boundary"
)
def test_sigterm_to_the_launcher_alone_stops_every_rank_at_a_boundary(prepared):
    """What a container runtime or `kill PID` does: SIGTERM to the launching process only, never to
    the ranks. Through spds's launch script (the deepspeed launcher, 2 processes) and torchrun. The
    stopped state is a checkpoint like any other: that it resumes bit for bit is
    tests/test_train.py's (after every kind of stop) and tests/test_multinode.py's (a SLURM job)."""
    run_dir = prepared
    launches = {
        "via-script": [
            "bash",
            str(LAUNCH / "single_node.sh"),
            "config.json",
            "--gpus",
            "2",
            "--port",
            str(free_port()),
        ],
        "via-torchrun": launch_command(["train", "config.json"], world=2, launcher="torchrun"),
    }
    for name, command in launches.items():
        edit_config(run_dir, output_dir=name, **LONG)
        process = start([], run_dir, command=command)
        wait_for_lines(run_dir / name / "metrics.jsonl", 2, process)
        if name == "via-script":
            # The launch script fixed at launch where its stop requests go: a config edited or
            # moved while the run goes on once left the SIGTERM with nowhere to go.
            (run_dir / "config.json").rename(run_dir / "elsewhere.json")
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=180)[0]
        if name == "via-script":
            (run_dir / "elsewhere.json").rename(run_dir / "config.json")
            assert "--local_rank=1" in output  # really through the deepspeed launcher
            assert read_json(run_dir / name / "run.json")["launch"]["launcher"] == "deepspeed"
        # torchrun forwards the signal to the ranks, waits for them, then exits 1 whatever they did
        # (its SignalException); spds's launch script exits with the launcher's status: 0.
        assert process.returncode == (1 if name == "via-torchrun" else 0), output[-4000:]
        terminal = read_json(run_dir / name / "terminal.json")
        assert terminal["status"] == "stopped" and 2 <= terminal["update"] < 30, (name, terminal)
        commit = read_json(run_dir / name / "checkpoints" / f"update-{terminal['update']:06d}" / "commit.json")
        assert commit["reason"] == "stop" and commit["world_size"] == 2
        assert not _spds_ranks_running(run_dir), f"{name}: ranks outlived their launcher"
        assert not (run_dir / name / "stop-request.json").exists()  # answered: it cannot stop the next launch


def _spds_ranks_running(run_dir) -> bool:
    import psutil

    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "spds.cli" in " ".join(process.info["cmdline"] or []) and process.info["cwd"] == str(run_dir):
                return True
        except psutil.Error:
            pass
    return False


def test_hostile_launch_arguments_are_refused_before_anything_starts(tiny, tmp_path):
    marker = tmp_path / "marker"
    bad_hostfiles = [f"-oProxyCommand=touch {marker} slots=1\n", f"node-a slots=1\nnode-b;touch {marker} slots=1\n"]
    for index, text in enumerate(bad_hostfiles):
        hostfile = tmp_path / f"hostfile{index}"
        hostfile.write_text(text)
        result = script("multi_node.sh", "config.json", str(hostfile), "--master-addr", "127.0.0.1", cwd=tiny)
        assert result.returncode != 0 and f"{hostfile}:{index + 1}: not" in result.stderr, result.stderr
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\n")
    for args, complaint in [
        (["--master-addr", f"$(touch {marker})"], "--master-addr must be"),
        (["--port", "1;touch x"], "--port must be a whole number"),
    ]:
        result = script("multi_node.sh", "config.json", str(hostfile), *args, cwd=tiny)
        assert result.returncode != 0 and complaint in result.stderr, result.stderr
    # ssh/pdsh: the deepspeed launcher sends PYTHON* variables on its command line itself
    result = script(
        "multi_node.sh",
        "config.json",
        str(hostfile),
        "--master-addr",
        "127.0.0.1",
        cwd=tiny,
        PYTHONSTARTUP=f"$(touch {marker})",
    )
    assert result.returncode != 0 and "PYTHONSTARTUP" in result.stderr and "remote shell" in result.stderr
    assert not marker.exists() and "launch.py" not in result.stdout + result.stderr


def test_hostile_scheduler_values_are_refused_before_any_arithmetic_or_command_sees_them(tiny, tmp_path):
    """bash arithmetic evaluates an array subscript's $(...) (SLURM_JOB_ID), and a value spliced
    into a sed script runs through its `e` command (SLURM_GPUS_PER_NODE)."""
    marker = tmp_path / "marker"
    cases = [
        (dict(SLURM_JOB_ID=f"BASH_VERSINFO[$(touch {marker})]", SLURM_JOB_NODELIST="h1"), "SLURM_JOB_ID must be"),
        (
            dict(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="h1", SLURM_GPUS_PER_NODE=f"1/;e touch {marker};#"),
            "SLURM_GPUS_PER_NODE must be [type:]count",
        ),
        (dict(SLURM_JOB_ID="7"), "SLURM_JOB_NODELIST is not set"),
    ]
    for variables, complaint in cases:
        result = script("slurm.sbatch", "config.json", cwd=tiny, SLURM_SUBMIT_DIR=str(REPO), **variables)
        assert result.returncode != 0 and complaint in result.stderr, result.stderr
        assert not marker.exists()
