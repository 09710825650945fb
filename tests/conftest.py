"""Shared fixtures: the tiny example built once per session, copied per test."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Remembered input digests (spds/contract/digests.py) go to a directory of this session's, not ~/.cache.
if "SPDS_DIGEST_CACHE" not in os.environ:
    os.environ["SPDS_DIGEST_CACHE"] = tempfile.mkdtemp(prefix="spds-digests-")
    atexit.register(shutil.rmtree, os.environ["SPDS_DIGEST_CACHE"], ignore_errors=True)  # the process that made it


def _load_make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny", REPO / "examples" / "tiny" / "make_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tiny = _load_make_tiny()


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-assets")
    make_tiny.build(directory)
    return directory


@pytest.fixture
def tiny(tiny_assets, tmp_path) -> Path:
    """A fresh run directory: the shared student (by absolute path), its own candidates and config."""
    shutil.copy(tiny_assets / "candidates.jsonl", tmp_path / "candidates.jsonl")
    config = json.loads((tiny_assets / "config.json").read_text())
    config["student"]["model_path"] = str(tiny_assets / "student")
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    return tmp_path


def edit_config(directory: Path, **sections) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def prepared(tiny) -> Path:
    """The tiny example with the quick FAST settings, packed."""
    from helpers import FAST, check, spds

    edit_config(tiny, **FAST)
    check(spds(["prepare", "config.json"], tiny))
    return tiny


# The suite's time budget, kept test by test (docs/testing.md): a test of `make test` that takes
# longer than TEST_BUDGET_SECONDS (setup, call and teardown) fails the run unless it is marked
# `extended` (make test-all runs it) or `over_budget("why every CI run needs it at this cost")`.
# 30 s: on this project's 2-core machine the unmarked tests end under 16 s (docs/testing.md has
# the measured tail), and the slower x86 CPU the suite was also timed on takes 1.4x as long; an
# unmarked test past 30 s is new cost, to be marked or made cheaper.
TEST_BUDGET_SECONDS = float(os.environ.get("SPDS_TEST_BUDGET_SECONDS", 30))
_seconds: dict[str, float] = {}
_marked: set[str] = set()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "over_budget(reason): a test past the suite's per-test budget that must run on every CI run"
    )


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if "extended" in report.keywords or "over_budget" in report.keywords:
        _marked.add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = sorted(((s, n) for n, s in _seconds.items() if s > TEST_BUDGET_SECONDS and n not in _marked), reverse=True)
    if over and TEST_BUDGET_SECONDS > 0:
        terminalreporter.section(f"tests over the {TEST_BUDGET_SECONDS:.0f} s budget, not marked")
        for seconds, name in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {name}")
        terminalreporter.write_line(
            "mark each @pytest.mark.extended (a promise another test holds) or "
            '@pytest.mark.over_budget("why every CI run needs it"), or make it cheaper'
        )
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED
