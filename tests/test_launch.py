"""Launching like DeepSpeed users do: the real deepspeed launcher, two 'nodes' with --no_ssh,
and contracts that stop a bad launch before any process starts."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from conftest import REPO, edit_config
from helpers import FAST, check, environment, final_state, free_port, launch_command, metrics, read_json, spds

LAUNCH = REPO / "launch"


@pytest.fixture
def run_dir(prepared):
    edit_config(prepared, output_dir="single")
    check(spds(["train", "config.json"], prepared))
    return prepared


def script(name: str, *args: str, cwd, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / name), *args], cwd=cwd, capture_output=True, text=True,
                          env=environment(**env), timeout=timeout)


@pytest.mark.slow
def test_deepspeed_launcher_two_processes_match_one(run_dir):
    edit_config(run_dir, output_dir="launcher", data_parallel_size=2)
    result = check(script("single_node.sh", "config.json", "--gpus", "2", "--port", str(free_port()), cwd=run_dir,
                          SPDS_FAULT="sigterm-before-update-rank1:3"))
    assert "--local_rank=1" in result.stdout + result.stderr  # really through the deepspeed launcher
    # A SIGTERM seen by rank 1 alone stops both ranks at the same boundary, committed.
    terminal = read_json(run_dir / "launcher" / "terminal.json")
    assert terminal["status"] == "stopped" and terminal["update"] == 3
    check(script("single_node.sh", "config.json", "--gpus", "2", "--port", str(free_port()), cwd=run_dir))
    assert read_json(run_dir / "launcher" / "run.json")["launch"]["launcher"] == "deepspeed"
    torch.testing.assert_close(final_state(run_dir / "launcher")["prompt"], final_state(run_dir / "single")["prompt"],
                               rtol=0, atol=2e-6)


@pytest.mark.slow
def test_two_nodes_without_ssh_match_one_process(run_dir, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    edit_config(run_dir, output_dir="two-nodes")
    port = str(free_port())
    nodes = [subprocess.Popen(["bash", str(LAUNCH / "multi_node.sh"), "config.json", str(hostfile), "--no-ssh",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--port", port],
                              cwd=run_dir, env=environment(NCCL_DEBUG="WARN"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert read_json(run_dir / "two-nodes" / "run.json")["world_size"] == 2
    torch.testing.assert_close(final_state(run_dir / "two-nodes")["prompt"], final_state(run_dir / "single")["prompt"],
                               rtol=0, atol=2e-6)
    env_file = (run_dir / ".deepspeed_env").read_text()
    lines = env_file.splitlines()
    assert lines and all("=" in line and line.strip() and not line.startswith("#") for line in lines)
    assert any(line.startswith("DS_ACCELERATOR=cpu") for line in lines) and "NCCL_DEBUG=WARN" in lines


def test_launch_refuses_an_invalid_config_before_starting_anything(tiny, tmp_path):
    edit_config(tiny, optim={"lerning_rate": 1.0})
    for name, args in [("single_node.sh", ["--gpus", "2"]),
                       ("multi_node.sh", [str(tmp_path / "hostfile"), "--no-ssh", "--node-rank", "0", "--master-addr", "127.0.0.1"])]:
        (tmp_path / "hostfile").write_text("node-a slots=1\n")
        result = script(name, "config.json", *args, cwd=tiny)
        assert result.returncode != 0
        assert "did you mean 'learning_rate'" in result.stderr and "nothing was launched" in result.stderr
        assert "launch.py" not in result.stdout + result.stderr


def test_world_size_contract_is_checked_at_launch(run_dir):
    edit_config(run_dir, output_dir="wrong-world", data_parallel_size=4, optim={**FAST["optim"], "effective_batch": 8})
    result = spds(["train", "config.json"], run_dir, world=2, launcher="torchrun")
    assert result.returncode != 0
    assert "data_parallel_size is 4 but this launch has world size 2" in result.stdout + result.stderr


def _wait_for_metrics(path, lines: int, process, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        assert process.poll() is None, f"the launch ended early: {process.communicate()[0][-3000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no {lines} metrics lines in {path} within {timeout} s")


LONG = dict(optim={**FAST["optim"], "updates": 30, "schedule": "constant", "warmup_updates": 0},
            checkpoint={"every": 1000, "keep_last": 2}, data_parallel_size=2)


@pytest.mark.slow
def test_sigterm_to_the_launcher_alone_stops_every_rank_at_a_boundary_and_resumes_bit_exactly(run_dir):
    """What a container runtime or `kill PID` does: SIGTERM to the launching process only, never to
    the ranks. Through spds's launch script (the deepspeed launcher, 2 processes) and torchrun."""
    edit_config(run_dir, output_dir="straight", **LONG)
    check(script("single_node.sh", "config.json", "--gpus", "2", "--port", str(free_port()), cwd=run_dir))
    straight = final_state(run_dir / "straight")
    launches = {
        "via-script": ["bash", str(LAUNCH / "single_node.sh"), "config.json", "--gpus", "2", "--port", str(free_port())],
        "via-torchrun": launch_command(["train", "config.json"], world=2, launcher="torchrun"),
    }
    for name, command in launches.items():
        edit_config(run_dir, output_dir=name, **LONG)
        process = subprocess.Popen(command, cwd=run_dir, env=environment(), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        _wait_for_metrics(run_dir / name / "metrics.jsonl", 2, process)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=180)[0]
        # torchrun forwards the signal to the ranks, waits for them, then exits 1 whatever they did
        # (its SignalException); spds's launch script exits with the launcher's status: 0.
        assert process.returncode == (1 if name == "via-torchrun" else 0), output[-4000:]
        terminal = read_json(run_dir / name / "terminal.json")
        assert terminal["status"] == "stopped" and 2 <= terminal["update"] < 30, (name, terminal)
        commit = read_json(run_dir / name / "checkpoints" / f"update-{terminal['update']:06d}" / "commit.json")
        assert commit["reason"] == "signal" and commit["world_size"] == 2
        assert not _spds_ranks_running(run_dir), f"{name}: ranks outlived their launcher"
        assert not (run_dir / name / "stop-request.json").exists()  # answered: it cannot stop the next launch
        check(subprocess.run(command, cwd=run_dir, env=environment(), capture_output=True, text=True, timeout=300))
        assert read_json(run_dir / name / "terminal.json")["status"] == "complete"
        assert [m["update"] for m in metrics(run_dir / name)] == list(range(1, 31))
        state = final_state(run_dir / name)
        for key in ("prompt", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], straight[key]), (name, key)


def _spds_ranks_running(run_dir) -> bool:
    import psutil

    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "spds.cli" in " ".join(process.info["cmdline"] or []) and process.info["cwd"] == str(run_dir):
                return True
        except psutil.Error:
            pass
    return False


STAND_IN_SSH = """#!/usr/bin/env bash
# ssh stand-in: the "remote" command runs on this machine, in a clean environment (as sshd gives
# one), so only what the deepspeed launcher exports in the command itself reaches the ranks.
while [ $# -gt 0 ]; do case "$1" in -o|-p|-l|-i) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
echo "$host" >> "$(dirname "$0")/ssh.log"
exec env -i HOME="$HOME" PATH="$PATH" bash -c "$*"
"""
STAND_IN_PDSH = """#!/usr/bin/env bash
# pdsh stand-in: -w host,host ... CMD: run CMD on every host through ssh, %n = the host's index.
hosts=""
while [ $# -gt 0 ]; do case "$1" in -w) hosts=$2; shift 2;; -f|-R|-l|-u) shift 2;; -*) shift;; *) break;; esac; done
command="$*"; index=0; pids=()
IFS=, read -ra list <<< "$hosts"
for host in "${list[@]}"; do
  ssh "$host" "${command//%n/$index}" & pids+=($!)
  index=$((index + 1))
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
def test_hostfile_launch_over_ssh_and_pdsh_stops_both_nodes_on_one_sigterm(run_dir, tmp_path):
    """The ssh/pdsh path of launch/multi_node.sh: the real deepspeed launcher builds its real remote
    command; stand-in ssh and pdsh executables run it on two "nodes" of this machine. A SIGTERM to
    the first node's launch script stops both nodes at the same update boundary."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("ssh", STAND_IN_SSH), ("pdsh", STAND_IN_PDSH)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    edit_config(run_dir, output_dir="torchrun", **LONG)
    check(spds(["train", "config.json"], run_dir, world=2, launcher="torchrun"))
    edit_config(run_dir, output_dir="pdsh", **LONG)
    env = environment(PATH=f"{bin_dir}:{environment()['PATH']}")
    command = ["bash", str(LAUNCH / "multi_node.sh"), "config.json", str(hostfile), "--master-addr", "127.0.0.1",
               "--port", str(free_port())]
    process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_metrics(run_dir / "pdsh" / "metrics.jsonl", 2, process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=180)[0]
    assert process.returncode == 0, output[-4000:]
    assert "pdsh -S -f 1024 -w node-a,node-b" in output  # the launcher's real remote command
    assert sorted(set((bin_dir / "ssh.log").read_text().split())) == ["node-a", "node-b"]
    terminal = read_json(run_dir / "pdsh" / "terminal.json")
    assert terminal["status"] == "stopped" and 2 <= terminal["update"] < 30
    assert read_json(run_dir / "pdsh" / "run.json")["world_size"] == 2
    assert not _spds_ranks_running(run_dir)
    check(subprocess.run(command[:-1] + [str(free_port())], cwd=run_dir, env=env, capture_output=True, text=True,
                         timeout=300))
    assert read_json(run_dir / "pdsh" / "terminal.json")["status"] == "complete"
    state, straight = final_state(run_dir / "pdsh"), final_state(run_dir / "torchrun")
    for key in ("prompt", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(state[key], straight[key]), key
