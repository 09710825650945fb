"""What spds reads from a model's config.json without loading the model: its text part, and the
positions it can read (its window).

A position past the window gives numbers, not an error, in every model spds runs (RoPE extends
past any length), so the window is read here and every command that feeds a model a long context
checks against it before any work (spds/data/preflight.py for the student,
spds/generation/teacher_window.py for the teacher). The window is the smallest position key a
config states, stretched where a declared rope scaling names the length it stretches: YaRN from
original_max_position_embeddings (or max_position_embeddings) x factor, as vLLM derives a model's
length (Qwen2.5's 32,768 x 4); linear and dynamic scaling only where the config names
original_max_position_embeddings, because a published config may state the stretched length
already (Gemma 3: 131,072 with linear factor 8). Llama 3.x's `llama3` and Phi-3's `longrope` (`su`)
state it in max_position_embeddings. Never more than the config says: a wrong guess upward would
let the positions past the window through."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spds.errors import SpdsError
from spds.fsio import read_json

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
STRETCHED_FROM_ORIGINAL = ("linear", "dynamic")  # yarn always stretches; llama3, longrope, su state it


def model_config(model_path) -> dict:
    """A model's config.json (a multimodal model's text part), read strictly; {} if not an object."""
    value = read_json(Path(model_path) / "config.json")
    value = value.get("text_config", value) if isinstance(value, dict) else {}
    return value if isinstance(value, dict) else {}


MOST_POSITIONS = 1 << 24  # 16.7M: past any published window; a larger one is a typo or an overflow
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "su", "llama3", "mrope", "proportional")
MOST_FACTOR = 1024.0


def window_problems(config: dict, where: str) -> list[str]:
    """The position and rope settings of a config.json (parsed) that a load would trip on, or read
    as a window of trillions of positions: each a number of the right kind in a sane range, the
    rope type one transformers knows. Checked before any load (validate and every command)."""
    problems = []

    def count(key, value, context=""):
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MOST_POSITIONS:
            problems.append(
                f"{where}: {context}{key} is {value!r}: a whole number of positions from 1 to {MOST_POSITIONS} "
                "(rule 'window')"
            )

    for key in POSITION_KEYS:
        count(key, config.get(key))
    for key in ("rope_parameters", "rope_scaling"):
        scaling = config.get(key)
        if scaling is None:
            continue
        if not isinstance(scaling, dict):
            problems.append(f"{where}: {key} is {scaling!r:.80}: an object (rule 'rope scaling')")
            continue
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind is not None and kind not in ROPE_TYPES:
            problems.append(
                f"{where}: {key}.rope_type is {kind!r:.80}: one of {', '.join(ROPE_TYPES)} (rule 'rope scaling')"
            )
        factor = scaling.get("factor")
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= MOST_FACTOR
        ):
            problems.append(
                f"{where}: {key}.factor is {factor!r:.80}: a number above 0 and at most {MOST_FACTOR:g} "
                "(rule 'rope scaling')"
            )
        count("original_max_position_embeddings", scaling.get("original_max_position_embeddings"), f"{key}.")
        theta = scaling.get("rope_theta", config.get("rope_theta"))
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0):
            problems.append(f"{where}: rope_theta is {theta!r:.80}: a number above 0 (rule 'rope scaling')")
    if not problems:
        window = position_window(config, where)
        if window is not None and window.positions > MOST_POSITIONS:
            problems.append(
                f"{where}: the window comes to {window.positions} positions ({window.source}), past "
                f"{MOST_POSITIONS}: rule 'window'"
            )
    return problems


def model_window_problems(key: str, model_path: Path) -> list[str]:
    """window_problems of the model directory's config.json; a config that does not read is the
    input checks' to name."""
    try:
        values = read_json(Path(model_path) / "config.json")
    except (SpdsError, OSError):
        return []
    if not isinstance(values, dict):
        return []
    text = values.get("text_config", values)
    return window_problems(text if isinstance(text, dict) else {}, f"{key}: {Path(model_path) / 'config.json'}")


@dataclass(frozen=True)
class Window:
    """The positions a model reads, and where its config.json says so (for a message)."""

    positions: int
    source: str  # "<dir>/config.json: max_position_embeddings", or the rope scaling's arithmetic


def position_window(config: dict, where: str = "config.json") -> Window | None:
    """The window a config.json (parsed) declares; None where it states no position key."""
    stated = [
        (config[key], key)
        for key in POSITION_KEYS
        if isinstance(config.get(key), int) and not isinstance(config.get(key), bool) and config[key] > 0
    ]
    if not stated:
        return None
    window, key = min(stated)
    # transformers 5 writes rope_parameters where 4.x wrote rope_scaling, and reads the former
    # first where a config has both: so does this
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaling = scaling if isinstance(scaling, dict) else {}
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    base = scaling.get("original_max_position_embeddings")
    base = base if isinstance(base, int) and not isinstance(base, bool) and base > 0 else None
    stretched = kind == "yarn" or (kind in STRETCHED_FROM_ORIGINAL and base is not None)
    if not stretched or not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
        return Window(window, f"{where}: {key}")
    base = base or window
    return Window(int(base * factor), f"{where}: {kind} rope scaling, {base} x factor {factor:g}")


def declared_window(model_path: Path) -> Window | None:
    """The window of the model in `model_path`; None where its config.json states none or does not
    read (the input checks name that)."""
    try:
        return position_window(model_config(model_path), str(Path(model_path) / "config.json"))
    except (SpdsError, OSError):
        return None
