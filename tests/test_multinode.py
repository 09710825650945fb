"""Two hosts for real: launch/multi_node.sh over a real sshd and pdsh, and launch/slurm.sbatch
under real SLURM daemons (tests/cluster.py: two network namespaces on this machine).

Every run here is the same 2-rank job (one CPU rank per host, gloo); each is compared bit for bit
with one straight 2-rank run made on this machine by torchrun, and that run with the plain-PyTorch
reference update (tests/test_reference.py), so a launch path that changed a single number fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cluster import SLURM_TOOLS, SSH_TOOLS, Cluster, missing
from conftest import REPO, edit_config
from helpers import FAST, check, environment, final_state, metrics, read_json, spds, wait_for_lines
from test_reference import assert_same_state, reference_run

pytestmark = [
    pytest.mark.slow,  # in a process of its own, beside the other tests (tools/run-tests.sh)
    # a real two-host cluster (sshd, pdsh, SLURM) waits on SLURM's clock and paced updates, beside the rest
    pytest.mark.over_budget("the launchers and the scheduler in their real form, on two hosts"),
]
LAUNCH = REPO / "launch"
UPDATES = 30
LONG = dict(
    student={"dtype": "float32"},  # the reference's dtype
    optim={**FAST["optim"], "updates": UPDATES, "schedule": "constant", "warmup_updates": 0, "max_grad_norm": 20.0},
    checkpoint={"every": 1000, "keep_last": 2},
    data_parallel_size=2,
)
STATE = ("prompt", "exp_avg", "exp_avg_sq", "step")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing(SSH_TOOLS + SLURM_TOOLS)
    if why:  # CI installs everything (.ci/run): there, a missing piece is a failure
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no two-host cluster on this machine: {why}")
    with Cluster(tmp_path_factory.mktemp("cluster"), slurm=True) as made:
        yield made


@pytest.fixture(scope="module")
def run_dir(tiny_assets, tmp_path_factory):
    """The tiny example, packed, with one output directory per launch below."""
    directory = tmp_path_factory.mktemp("multinode")
    shutil.copy(tiny_assets / "candidates.jsonl", directory / "candidates.jsonl")
    config = json.loads((tiny_assets / "config.json").read_text())
    config["student"]["model_path"] = str(tiny_assets / "student")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    edit_config(directory, **FAST)
    edit_config(directory, **LONG, output_dir="straight")
    check(spds(["prepare", "config.json"], directory))
    return directory


@pytest.fixture(scope="module")
def straight(run_dir):
    """The straight 2-rank run every launch below must reproduce, checked against plain PyTorch."""
    check(spds(["train", "config.json"], run_dir, world=2, launcher="torchrun"))
    state, lines = final_state(run_dir / "straight"), metrics(run_dir / "straight")
    learning_rates = [line["learning_rate"] for line in lines]
    assert_same_state(state, reference_run(run_dir, learning_rates, max_grad_norm=20.0), learning_rates, "straight")
    return state


def as_straight(run_dir, output_dir: str, straight: dict) -> None:
    assert read_json(run_dir / output_dir / "terminal.json")["status"] == "complete"
    assert [m["update"] for m in metrics(run_dir / output_dir)] == list(range(1, UPDATES + 1))
    state = final_state(run_dir / output_dir)
    for key in STATE:
        assert torch.equal(state[key], straight[key]), (output_dir, key)


def stopped_at_a_boundary(run_dir, output_dir: str, log: str = "") -> int:
    """Both ranks stopped after the same update, with a committed checkpoint of it."""
    path = run_dir / output_dir / "terminal.json"
    assert path.exists(), f"no {path}: {log}"
    terminal = read_json(path)
    assert terminal["status"] == "stopped" and 1 <= terminal["update"] < UPDATES, (terminal, log)
    commit = read_json(run_dir / output_dir / "checkpoints" / f"update-{terminal['update']:06d}" / "commit.json")
    assert commit["world_size"] == 2 and commit["update"] == terminal["update"]
    assert metrics(run_dir / output_dir)[-1]["update"] == terminal["update"]
    return terminal["update"]


def ranks_left(cluster) -> list[str]:
    return cluster.processes("spds.cli")


def test_hostfile_launch_over_real_ssh_and_pdsh(cluster, run_dir, straight, tmp_path):
    """From h1, launch/multi_node.sh with a hostfile of h1 and h2: the deepspeed launcher's own
    pdsh/ssh path starts a rank on each host. A SIGTERM to the launch script on h1 stops both at the
    same update boundary; the rerun completes bit-identical to the straight run."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    edit_config(run_dir, output_dir="pdsh")
    marker = tmp_path / "marker"
    hostile = f'pa$$word"; touch {marker}; echo "$(touch {marker})`touch {marker}`'
    env = environment(NCCL_SPDS_PROBE=hostile, HF_TOKEN="hf_secret_0123")
    command = ["bash", str(LAUNCH / "multi_node.sh"), "config.json", str(hostfile)]
    process = cluster.h1.popen(
        command,
        cwd=run_dir,
        env={**env, "SPDS_TEST_PACE": "0.3"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_lines(run_dir / "pdsh" / "metrics.jsonl", 2, process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=180)[0]
    assert process.returncode == 0, output[-4000:]
    assert "pdsh -S -f 1024 -w h1,h2" in output  # the launcher's own remote command, through real pdsh
    stopped_at_a_boundary(run_dir, "pdsh")
    launch = read_json(run_dir / "pdsh" / "run.json")["launch"]
    assert launch["hosts"] == ["h1", "h2"] and launch["environment"]["MASTER_ADDR"] == cluster.h1.address
    # A value with quotes, $(...) and backquotes arrives as written on both hosts and runs nothing;
    # the token never appears on a command line (ps on every host would show it).
    assert launch["environment"]["NCCL_SPDS_PROBE"] == hostile and not marker.exists()
    assert "hf_secret_0123" not in output and "NCCL_SPDS_PROBE" not in output
    assert not ranks_left(cluster)
    check(cluster.h1.run(command, cwd=run_dir, env=env, timeout=300))
    as_straight(run_dir, "pdsh", straight)


def test_variables_the_launcher_sends_to_every_node_run_nothing_on_a_cuda_cluster(cluster, run_dir, tmp_path):
    """With DS_ACCELERATOR=cuda the deepspeed launcher also writes every NCCL_* variable into the
    remote command (inside double quotes, where a remote shell runs $(...)). They travel in
    .spds-env instead (NCCL_DEBUG among them). This machine has no GPU, so the ranks then fail,
    each saying so in a line that names DS_ACCELERATOR: the launch script records that in
    terminal.json, as it does for any launch that died without a word from rank 0."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    edit_config(run_dir, output_dir="cuda")
    marker = tmp_path / "marker"
    result = cluster.h1.run(
        ["bash", str(LAUNCH / "multi_node.sh"), "config.json", str(hostfile)],
        cwd=run_dir,
        env=environment(DS_ACCELERATOR="cuda", NCCL_SPDS_PROBE=f"$(touch {marker})", NCCL_DEBUG=f"$(touch {marker})"),
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "cmd = pdsh" in output, output[-3000:]
    assert not marker.exists() and "NCCL_SPDS_PROBE" not in output
    # each rank says why in one line naming the variable, not torch's traceback from the group's start
    assert output.count("DS_ACCELERATOR=cuda, and this process has") == 2 and "Traceback" not in output, output[-3000:]
    terminal = read_json(run_dir / "cuda" / "terminal.json")
    assert terminal["status"] == "failed" and "before rank 0 recorded" in terminal["reason"], terminal
    assert not ranks_left(cluster)


def test_no_ssh_one_launch_script_per_host(cluster, run_dir, straight, tmp_path):
    """Clusters without ssh: launch/multi_node.sh --no-ssh on each host. A SIGTERM to the launch
    script of the second host stops both hosts at the same boundary; the rerun is bit-identical."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    edit_config(run_dir, output_dir="no-ssh")

    def launch(**extra):
        return [
            host.popen(
                [
                    "bash",
                    str(LAUNCH / "multi_node.sh"),
                    "config.json",
                    str(hostfile),
                    "--no-ssh",
                    "--node-rank",
                    str(rank),
                    "--master-addr",
                    "h1",
                    "--port",
                    "29511",
                ],
                cwd=run_dir,
                env=environment(**extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank, host in enumerate(cluster.hosts)
        ]

    nodes = launch(SPDS_TEST_PACE="0.3", NCCL_DEBUG="WARN")
    wait_for_lines(run_dir / "no-ssh" / "metrics.jsonl", 2, nodes[0])
    nodes[1].send_signal(signal.SIGTERM)
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    stopped_at_a_boundary(run_dir, "no-ssh")
    assert read_json(run_dir / "no-ssh" / "run.json")["launch"]["hosts"] == ["h1", "h2"]
    assert not ranks_left(cluster)
    lines = (run_dir / ".deepspeed_env").read_text().splitlines()  # what the deepspeed launcher reads
    assert lines and all("=" in line and line.strip() and not line.startswith("#") for line in lines)
    assert lines[0] == f"SPDS_ENV_FILE={run_dir / '.spds-env'}" and "NCCL_DEBUG=WARN" not in lines
    variables = (run_dir / ".spds-env").read_bytes().split(b"\0")  # what the ranks load: user-only
    assert b"DS_ACCELERATOR=cpu" in variables and b"NCCL_DEBUG=WARN" in variables
    assert (run_dir / ".spds-env").stat().st_mode & 0o077 == 0
    outputs = [node.communicate(timeout=300)[0] for node in launch()]
    as_straight(run_dir, "no-ssh", straight)


# -- SLURM -------------------------------------------------------------------------------------


def sbatch(cluster, run_dir, *options: str, config: str = "config.json", verb: str = "train", **env) -> str:
    """Submitted from h1 in the spds checkout, as the README says; the job runs in run_dir."""
    result = check(
        cluster.h1.run(
            [
                "sbatch",
                "--parsable",
                "--nodes=2",
                f"--chdir={run_dir}",
                f"--output={run_dir}/slurm-%j.out",
                *options,
                str(LAUNCH / "slurm.sbatch"),
                config,
                verb,
            ],
            cwd=REPO,
            env=cluster.slurm_env(environment(**env)),
        )
    )
    return result.stdout.strip().split(";")[0]


def job_state(cluster, job: str) -> dict:
    fields = cluster.h1.run(["scontrol", "show", "job", "-o", job], env=cluster.slurm_env(environment())).stdout
    return dict(field.split("=", 1) for field in fields.split() if "=" in field)


# A job's end states. JobState also shows passing flags while the job runs (SIGNALING while the
# time limit's warning signal is delivered, COMPLETING, CONFIGURING, STAGE_OUT, ...), so the wait
# is for one of these, not for a state other than RUNNING.
ENDED = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def wait_job(cluster, job: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_state(cluster, job)
        if state.get("JobState") in ENDED:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {job_state(cluster, job).get('JobState')} after {timeout} s")


def wait_running(cluster, job: str, run_dir, output_dir: str, lines: int = 2) -> None:
    deadline = time.time() + 180
    path = run_dir / output_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= lines):
        state = job_state(cluster, job).get("JobState")
        assert state not in ENDED, (state, slurm_log(run_dir, job))
        assert time.time() < deadline, slurm_log(run_dir, job)
        time.sleep(0.2)


def slurm_log(run_dir, job: str) -> str:
    path = run_dir / f"slurm-{job}.out"
    return path.read_text()[-4000:] if path.exists() else "(no output)"


def hostile_config(run_dir, output_dir: str) -> Path:
    """config.json, its paths made absolute, in a directory whose name holds a quote, $(...) and
    backquotes (the batch script once spliced the config's path into a shell command on every node)."""
    weird = run_dir / "it's $(touch spds-marker) `touch spds-marker`"
    weird.mkdir(exist_ok=True)
    config = json.loads((run_dir / "config.json").read_text())
    config["output_dir"] = str(run_dir / output_dir)
    config["data"]["packed_dir"] = str(run_dir / config["data"]["packed_dir"])
    shutil.copy(run_dir / "candidates.jsonl", weird)  # as written, a path is part of the run's identity
    (weird / "config.json").write_text(json.dumps(config))
    return weird / "config.json"


# 28 updates left once the job trains, at 4 s each: 112 s, far past the signal's 60 s window.
TIME_LIMIT_PACE = "4"
STOPS = {  # name: (sbatch options, what the test runs once the job trains)
    "scancel-batch": ((), ["scancel", "--signal=TERM", "--batch"]),
    # slurmctld sends the time limit's signal on its own 30 s tick, once the time left is within
    # T + 30 s: the limit starts at 10 min (no signal during start-up) and is cut to 2 min past
    # the minute the job is in once it trains, so the time left is 2-3 min and the signal comes
    # within 60 s (30 s until it is within T + 30 s, one tick more), a minute or more before the
    # limit itself. The updates are paced (TIME_LIMIT_PACE) so the run outlasts that window.
    "time-limit": (("--time=10", "--signal=B:TERM@120"), ["scontrol", "update"]),
    "scancel": ((), ["scancel"]),
}


@pytest.mark.parametrize("name", STOPS)
def test_slurm_job_stops_at_an_update_boundary_and_the_next_job_resumes_bit_exactly(cluster, run_dir, straight, name):
    options, stop = STOPS[name]
    edit_config(run_dir, output_dir=f"slurm-{name}")
    job = sbatch(cluster, run_dir, *options, SPDS_TEST_PACE=TIME_LIMIT_PACE if name == "time-limit" else "0.3")
    wait_running(cluster, job, run_dir, f"slurm-{name}")
    if stop[0] == "scontrol":
        hours, minutes, seconds = map(int, job_state(cluster, job)["RunTime"].split(":"))
        command = [*stop, f"JobId={job}", f"TimeLimit={hours * 60 + minutes + (seconds > 0) + 2}"]
    else:
        command = [*stop, job]
    check(cluster.h1.run(command, env=cluster.slurm_env(environment())))
    state = wait_job(cluster, job)
    log = f"{state.get('JobState')} {state.get('ExitCode')} {state.get('RunTime')}: {slurm_log(run_dir, job)}"
    stopped_at_a_boundary(run_dir, f"slurm-{name}", log)
    if name == "scancel":  # cancelled it is, though every rank stopped cleanly within KillWait
        assert state["JobState"] == "CANCELLED", log
    else:
        assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert not ranks_left(cluster), log
    if name == "scancel-batch":
        # The next job with fake GRES GPUs (one rank per host from SLURM_GPUS_PER_NODE), and the
        # config in a directory whose name would run code if spliced into a command.
        job = sbatch(cluster, run_dir, "--gpus-per-node=1", config=str(hostile_config(run_dir, f"slurm-{name}")))
    else:
        job = sbatch(cluster, run_dir)
    state = wait_job(cluster, job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), slurm_log(run_dir, job)
    as_straight(run_dir, f"slurm-{name}", straight)
    if name == "scancel-batch":
        assert not list(run_dir.rglob("spds-marker"))
        launch = read_json(run_dir / f"slurm-{name}" / "run.json")["launch"]
        assert launch["hosts"] == ["h1", "h2"] and launch["environment"]["SLURM_JOB_ID"] == job
        assert launch["environment"]["CUDA_VISIBLE_DEVICES"] == "0"  # SLURM's GRES gave this rank a device


# -- generate and eval ---------------------------------------------------------------------------


def test_generate_over_ssh_and_eval_under_slurm_give_the_one_rank_bytes(cluster, run_dir, straight, tmp_path):
    """The teacher's rows written by a rank on each host (multi_node.sh --verb generate, over real
    pdsh and sshd) are the one-rank rows byte for byte; eval as a SLURM job on both hosts (the
    teacher answering eval.questions, the records scored and the questions answered, a share on
    each) reports what one rank reports, timings apart, with the same answers (without_timings:
    eval.json less its clock and world size)."""
    from test_eval_questions import QUESTIONS, without_timings

    original = (run_dir / "config.json").read_text()
    try:
        (run_dir / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
        edit_config(
            run_dir,
            output_dir="straight",
            data_parallel_size="any",
            context={"text": "You are the archivist of Lumen Bay."},
            generate={
                "questions": "questions.jsonl",
                "output": "asked.jsonl",
                "samples_per_question": 3,
                "batch_size": 2,
                "max_new_tokens": 6,
                "top_k_logprobs": 2,
            },
            eval={"questions": "questions.jsonl", "question_samples": 2, "max_new_tokens": 6, "samples": 2},
        )
        check(spds(["generate", "config.json"], run_dir))
        one = (run_dir / "asked.jsonl").read_bytes()
        (run_dir / "asked.jsonl").unlink()
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("h1 slots=1\nh2 slots=1\n")
        command = ["bash", str(LAUNCH / "multi_node.sh"), "config.json", str(hostfile), "--verb", "generate"]
        check(cluster.h1.run(command + ["--port", "29521"], cwd=run_dir, env=environment(), timeout=300))
        assert (run_dir / "asked.jsonl").read_bytes() == one
        check(spds(["eval", "config.json"], run_dir))
        alone = read_json(run_dir / "straight" / "eval.json")
        samples = (run_dir / "straight" / "samples.md").read_bytes()
        shutil.rmtree(run_dir / "straight" / "eval-questions")
        job = sbatch(cluster, run_dir, verb="eval")
        state = wait_job(cluster, job)
        assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), slurm_log(run_dir, job)
        both = read_json(run_dir / "straight" / "eval.json")
        assert both["world_size"] == 2 and without_timings(both) == without_timings(alone)
        assert (run_dir / "straight" / "samples.md").read_bytes() == samples
        assert not ranks_left(cluster)
    finally:
        (run_dir / "config.json").write_text(original)
