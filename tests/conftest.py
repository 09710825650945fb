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
