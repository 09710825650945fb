"""Launching like DeepSpeed users do: the real deepspeed launcher, two 'nodes' with --no_ssh,
and contracts that stop a bad launch before any process starts."""
from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import REPO, edit_config
from helpers import FAST, check, environment, final_state, free_port, read_json, spds

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
