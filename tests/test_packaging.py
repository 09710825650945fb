"""spds as a user installs it: a wheel that works outside the checkout, every import declared,
the tested versions pinned, and a word at start-up when an installed one is not among them."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
from conftest import REPO, make_tiny
from helpers import FAST
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import spds
from spds.contract.versions import TESTED

# Imported under an optional feature and not installed on a CPU machine: packages_distributions()
# cannot name them, so their distributions are written here.
NOT_INSTALLED_HERE = {"flash_attn": "flash-attn-4", "liger_kernel": "liger-kernel", "triton": "triton"}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def declared() -> dict[str, set[str]]:
    """Distribution name -> the groups that declare it ("" for the core dependencies)."""
    project = pyproject()["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    names: dict[str, set[str]] = {}
    for group, requirements in groups.items():
        for text in requirements:
            names.setdefault(canonicalize_name(Requirement(text).name), set()).add(group)
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the spds files importing it (function-level imports included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "spds").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top != "spds":
                    found.setdefault(top, set()).add(path.relative_to(REPO).as_posix())
    return found


def lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, _, version = line.partition("==")
            assert version, f"requirements/{name}: {line!r} is not an exact pin"
            pins[canonicalize_name(package)] = version
    return pins


def test_every_imported_third_party_module_is_a_declared_dependency():
    distributions = importlib.metadata.packages_distributions()
    names = declared()
    undeclared = []
    for module, files in third_party_imports().items():
        owners = distributions.get(module) or [NOT_INSTALLED_HERE.get(module, f"<unknown: {module}>")]
        groups = [names.get(canonicalize_name(owner), set()) - {"test"} for owner in owners]  # test: not for users
        if not any(groups):
            undeclared.append(f"{module} ({', '.join(owners)}), imported by {', '.join(sorted(files))}")
    assert not undeclared, "imported but not declared in pyproject.toml: " + "; ".join(undeclared)


def test_the_locks_pin_every_dependency_and_lie_within_the_tested_ranges():
    cpu, gpu = lock("cpu.txt"), lock("gpu.txt")
    for name, groups in declared().items():
        if groups & {"", "test", "datasets"}:  # what `pip install -e ".[test]"` brings, CI's set
            assert name in cpu, f"requirements/cpu.txt pins no {name}"
    for name, tested in TESTED.items():  # the versions spds warns about are the ones tested
        for file, pins in (("cpu.txt", cpu), ("gpu.txt", gpu)):
            if canonicalize_name(name) in pins:
                assert tested.contains(pins[canonicalize_name(name)], prereleases=True), (file, name, str(tested))
    for name in ("torch", "deepspeed", "transformers", "liger-kernel", "flash-attn-4", "nvidia-cutlass-dsl", "peft"):
        assert canonicalize_name(name) in gpu, f"requirements/gpu.txt pins no {name}"
    # this very suite runs on the CPU set (make test installs it)
    if os.environ.get("SPDS_UNPINNED") != "1":
        for name in ("torch", "deepspeed", "transformers", "numpy", "jsonschema"):
            installed = importlib.metadata.version(name).split("+")[0]
            assert installed == cpu[canonicalize_name(name)], f"{name} {installed} is not requirements/cpu.txt's"


def validate(config, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spds.cli", "validate", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_package_outside_the_tested_range_is_named_once_at_start_up(tmp_path):
    """A stand-in distribution record (as pip leaves it) says transformers 99.0 is installed."""
    record = tmp_path / "site" / "transformers-99.0.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    result = validate(tmp_path / "absent.json", env)
    lines = [line for line in result.stderr.splitlines() if "outside the versions spds is tested with" in line]
    assert len(lines) == 1, result.stderr
    assert "transformers 99.0" in lines[0] and str(TESTED["transformers"]) in lines[0]
    env["RANK"] = "1"  # a launcher's other ranks say nothing
    result = validate(tmp_path / "absent.json", env)
    assert "outside the versions" not in result.stderr


def build_wheel(directory: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(directory),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = directory.glob("spds-*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.over_budget("the built wheel in a fresh venv: what a user installs runs the loop")
def test_the_wheel_runs_the_whole_loop_outside_the_checkout(tmp_path):
    """The wheel, installed into a fresh virtual environment in a temporary directory, from a
    working directory outside the checkout: the schemas and DeepSpeed configs it validates with
    are its own package data. Its dependencies are this environment's (a .pth file), so nothing
    is downloaded."""
    wheel = build_wheel(tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    here = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "dependencies.pth").write_text("\n".join(sorted(here)) + "\n")  # after the venv's own site
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    work = tmp_path / "work"
    make_tiny.build(work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")

    def run(*args: str) -> str:
        result = subprocess.run(
            [str(venv / "bin" / "spds"), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"spds {' '.join(args)}: exit {result.returncode}\n{result.stderr[-4000:]}"
        return result.stdout

    where = subprocess.run(
        [str(python), "-c", "import spds.contract.schema as c; print(c.__file__, c.SCHEMA_DIR)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(REPO) not in where and str(venv) in where, where
    run("init", "student", "candidates.jsonl", "--out", "run.yaml")
    assert "ok" in run("validate", "run.yaml")
    config = json.loads((work / "config.json").read_text())
    config.update({**FAST, "deepspeed_config": "zero0"})
    config["optim"] = {**FAST["optim"], "updates": 2}
    config["train"] = {"require_smoke": True, "progress_bar": False}
    config["data"]["eval_fraction"] = 0.25
    (work / "config.json").write_text(json.dumps(config))
    assert "zero0.json" in run("validate", "config.json")
    run("prepare", "config.json")
    run("smoke", "config.json")
    assert "complete at update 2" in run("train", "config.json")
    run("eval", "config.json")
    exported = json.loads(run("export", "config.json").strip().splitlines()[-1])
    assert Path(exported["soft_prompt"]).is_file()
    assert json.loads((work / "run" / "run.json").read_text())["versions"]["spds"] == spds.__version__
