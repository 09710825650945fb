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
