"""Pins: the sha256 of every input a config names (the model, the tokenizer, each candidate
file), kept in a pins file beside the config (`spds pin` writes it; the user's config is never
rewritten) or written in the config itself, and checked before any work."""

from __future__ import annotations

import re
from pathlib import Path

from spds.contract import documents
from spds.contract.config import Config
from spds.contract.digests import sha256_path
from spds.fsio import read_json


def pins_path(config_path: Path) -> Path:
    """`spds pin` writes its digests here, beside the config, and leaves the user's file alone."""
    return config_path.with_name(config_path.name + ".pins.json")


PINS_FORMAT = "spds-pins-v1"


def _pin_slot(raw: dict, key: str) -> tuple[dict, str] | None:
    """The (object, field) a pin key names in a config: student.model_sha256, student.tokenizer_sha256
    or data.candidates[I].sha256 (the keys pinned_inputs makes), None if the config has no such place."""
    candidate = re.fullmatch(r"data\.candidates\[(\d+)\]\.sha256", key)
    if candidate:
        index = int(candidate.group(1))
        candidates = raw.get("data", {}).get("candidates") if isinstance(raw.get("data"), dict) else None
        if isinstance(candidates, list) and index < len(candidates) and isinstance(candidates[index], dict):
            return candidates[index], "sha256"
        return None
    if key in ("student.model_sha256", "student.tokenizer_sha256") and isinstance(raw.get("student"), dict):
        return raw["student"], key.split(".")[1]
    if key == "context.sha256" and isinstance(raw.get("context"), dict):
        return raw["context"], "sha256"
    return None


def merge_pins(path: Path, raw: dict) -> list[str]:
    """Fold the pins file into the config; a digest pinned twice, differently, is a problem."""
    lock = pins_path(path)
    if not lock.exists():
        return []
    pins = read_json(lock)
    if not isinstance(pins, dict) or pins.get("format") != PINS_FORMAT or not isinstance(pins.get("pins"), dict):
        return [f"{lock}: not an spds pins file (format {PINS_FORMAT}); remove it and run spds pin again"]
    problems = []
    for key, digest in pins["pins"].items():
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            problems.append(
                f"{lock}: pin {key}: {digest!r} is not a sha256 (64 lower-case hex digits); run spds pin again"
            )
            continue
        slot = _pin_slot(raw, key)
        if slot is None:
            problems.append(f"{lock}: pin {key} names nothing in {path.name}; run spds pin again")
            continue
        target, field = slot
        if target.get(field) not in (None, digest):
            problems.append(f"{key}: pinned as {target[field]} in {path.name} but as {digest} in {lock.name}")
        target[field] = digest
    return problems


def pinned_inputs(config: Config) -> list[tuple[str, Path, str | None]]:
    """(config key, resolved path, pinned sha256 or None) of every pinnable input (`digest` hashes
    one: a corpus's path is its config's directory, its digest that of its files)."""
    student = config.student
    inputs = [("student.model_sha256", config.model_path, student.model_sha256)]
    if student.tokenizer_path is not None:
        inputs.append(("student.tokenizer_sha256", config.tokenizer_path, student.tokenizer_sha256))
    for i, candidate in enumerate(config.data.candidates):
        inputs.append((f"data.candidates[{i}].sha256", config.resolve(candidate.path), candidate.sha256))
    if config.context.file:
        inputs.append(("context.sha256", config.resolve(config.context.file), config.context.sha256))
    elif config.context.documents:
        inputs.append(("context.sha256", config.path.parent, config.context.sha256))
    return inputs


def digest(config: Config, key: str, path: Path) -> str:
    """The sha256 an input is pinned by."""
    if key == "context.sha256" and config.context.documents:
        return documents.sha256(config)
    return sha256_path(path)


def pin_problems(config: Config) -> list[str]:
    problems = []
    for key, path, pinned in pinned_inputs(config):
        if pinned is None or not path.exists():
            continue
        actual = digest(config, key, path)
        if actual != pinned:
            what = "the corpus (context.documents)" if key == "context.sha256" and config.context.documents else path
            problems.append(f"{key}: {what} changed since it was pinned (expected sha256 {pinned}, actual {actual})")
    return problems
