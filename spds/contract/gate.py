"""The run contract: load a config, apply the schema's defaults (spds/contract/schema.py), validate, check pins.

schemas/config.schema.json is the single source of field names, types and defaults: this module
knows no field's default itself. Every command starts here, and a config that fails its schema
or an input whose pinned sha256 changed stops the command before any work, with every problem
listed at once. The schema machinery is spds/contract/schema.py's, the pins spds/contract/pins.py's, the checks
beyond the schema spds/contract/checks.py's, `Config` spds/contract/config.py's; this module is the gate that runs
them, and the config file's strict parsing.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import jsonschema

from spds.contract.checks import deepspeed_config_problems, input_problems
from spds.contract.config import Config
from spds.contract.pins import PINS_FORMAT, digest, merge_pins, pin_problems, pinned_inputs, pins_path
from spds.contract.schema import (
    StrictValidator,
    apply_defaults,
    describe_errors,
    describe_errors_with,
    load_schema,
    location,
)
from spds.contract.settings import SECTIONS, build
from spds.errors import SpdsError
from spds.fsio import MAX_DEPTH, atomic_write_json, read_json, read_text, value_depth


def section(key: str, **values) -> Any:
    """One typed section from the given fields and the schema's defaults for the rest, validated:
    `make_loss(section("loss", objective="kl"))` for library callers and tests."""
    schema = load_schema("config")
    raw = apply_defaults(copy.deepcopy(values), schema["properties"][key], schema)
    part = {**schema["properties"][key], "$defs": schema["$defs"]}  # its $refs resolve as in the whole
    problems = describe_errors_with(StrictValidator(part, format_checker=jsonschema.FormatChecker()), raw)
    if problems:
        raise SpdsError(f"{key}: not a valid section", problems)
    return build(SECTIONS[key], raw)


def parse_config_file(path: Path) -> dict:
    """JSON, or YAML by suffix (.yaml/.yml, any case), strictly: UTF-8, no key twice, keys that
    are strings, no NaN or infinity, no anchors or aliases (nine levels of nine aliases expand to
    387 million nodes: "billion laughs"), nesting at most MAX_DEPTH deep."""
    if path.suffix.lower() not in (".yaml", ".yml"):
        return read_json(path)
    import yaml  # a transformers dependency

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise SpdsError(
                    f"{path}:{mark.line + 1}: rule 'no aliases': YAML aliases (*name) are not read "
                    "in spds configs; write the value out"
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for index, key in enumerate(keys):
                line = node.value[index][0].start_mark.line + 1
                if not isinstance(key, str):
                    hint = " (YAML 1.1 reads on/off/yes/no as booleans: quote it)" if isinstance(key, bool) else ""
                    raise SpdsError(
                        f"{path}:{line}: rule 'string keys': key {key!r} is not a string but {type(key).__name__}{hint}"
                    )
                if key in keys[:index]:
                    raise SpdsError(
                        f"{path}:{line}: rule 'unique keys': key {key!r} "
                        "appears twice in one mapping (which one was meant?)"
                    )
            return super().construct_mapping(node, deep=deep)

    text = read_text(path)
    try:
        value = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as error:
        raise SpdsError(f"{path}: invalid YAML: {error}") from None
    except RecursionError:
        raise SpdsError(f"{path}: rule 'nesting depth': nested deeper than the YAML parser can follow") from None
    if value_depth(value) > MAX_DEPTH:
        raise SpdsError(f"{path}: rule 'nesting depth': mappings and sequences nest deeper than {MAX_DEPTH} levels")
    for where, number in _floats(value):
        if not math.isfinite(number):
            raise SpdsError(f"{path}: {location(where)}: rule 'finite number': {number} is not a finite number")
    return value


def _floats(value, where: tuple = ()):
    """(path, value) of every float in a parsed document (YAML's .inf and .nan are floats)."""
    if isinstance(value, float):
        yield where, value
    elif isinstance(value, (dict, list)):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            yield from _floats(item, (*where, key))


def load_config(
    path: str | Path, check_pins: bool = True, candidates: str = "must exist", use_pins: bool = True
) -> Config:
    """Load, apply defaults, validate; raise SpdsError listing every problem, or return Config.
    use_pins False: the pins file beside the config is not read (spds pin, which replaces it).
    candidates: which candidate files must exist yet (checks.input_problems)."""
    path = Path(path).resolve()
    raw = parse_config_file(path)
    if not isinstance(raw, dict):
        raise SpdsError(f"{path}: a config must be a JSON object")
    pin_conflicts = merge_pins(path, raw) if use_pins else []
    if pin_conflicts:
        raise SpdsError(f"{path}: its pins do not hold together", pin_conflicts)
    apply_defaults(raw, load_schema("config"))
    problems = describe_errors(raw, "config")
    if problems:
        raise SpdsError(f"{path}: config does not match schemas/config.schema.json", problems)
    config = Config(path=path, raw=raw)
    problems = input_problems(config, candidates) + deepspeed_config_problems(config)
    if check_pins:
        problems += pin_problems(config)
    if problems:
        raise SpdsError(f"{path}: config refers to inputs that do not hold", problems)
    return config


def pin_config(path: str | Path) -> dict[str, str]:
    """Write the sha256 of every input to the pins file beside the config (atomically); return them.
    The config itself is never rewritten: its comments, order and formatting stay the user's."""
    path = Path(path).resolve()
    lock = pins_path(path)
    # Re-pinning starts from the inputs as they are now; the old pins file stays until the new one
    # replaces it (atomically), so a refused or killed pin leaves it as it was.
    config = load_config(path, check_pins=False, use_pins=False)
    pins = {key: digest(config, key, input_path) for key, input_path, _ in pinned_inputs(config)}
    atomic_write_json(lock, {"format": PINS_FORMAT, "config": path.name, "pins": pins})
    return pins


def validate_run_world(config: Config, world_size: int) -> None:
    expected = config.data_parallel_size
    if expected != "any" and expected != world_size:
        raise SpdsError(
            f"{config.path}: data_parallel_size is {expected} but this launch has world size {world_size}; "
            'launch with that many processes or set data_parallel_size to "any"'
        )
    batch = config.optim.effective_batch
    if batch % world_size:
        raise SpdsError(
            f"{config.path}: optim.effective_batch {batch} does not divide by the world size {world_size}; "
            "every rank must hold the same number of records per update"
        )
