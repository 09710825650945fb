"""The JSON Schemas (spds/schemas/, package data): loading them, a strict 2020-12 validator,
their defaults applied to a document, and every violation described as 'location: message'.
The field names, types and defaults themselves live in the schema files alone."""

from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema

from spds.errors import SpdsError

# The schemas and the shipped DeepSpeed configs are package data (pyproject's package-data): an
# installed wheel validates exactly as a checkout does. The checkout's top-level schemas/ and
# ds_configs/ are links to these folders.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # spds/, whose data folders sit beside its subpackages
SCHEMA_DIR = PACKAGE_ROOT / "schemas"
SHIPPED_DS_CONFIGS = PACKAGE_ROOT / "ds_configs"


def shipped_deepspeed_configs() -> list[str]:
    """The names `deepspeed_config` may give instead of a path: zero0, zero3."""
    return sorted(p.stem for p in SHIPPED_DS_CONFIGS.glob("*.json"))


@lru_cache(maxsize=None)
def load_schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


def _is_integer(checker, instance) -> bool:
    # JSON Schema counts 30.0 as an integer; Python code downstream (range, slicing) does not.
    return isinstance(instance, int) and not isinstance(instance, bool)


# Draft 2020-12 with one change: "integer" means a number written without a fraction or exponent.
StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


@lru_cache(maxsize=None)
def validator(name: str) -> jsonschema.protocols.Validator:
    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return StrictValidator(schema, format_checker=jsonschema.FormatChecker())


# ---------------------------------------------------------------- defaults and errors


def _resolve_ref(node: dict, root: dict) -> dict:
    while isinstance(node, dict) and "$ref" in node and node["$ref"].startswith("#/"):
        target = root
        for part in node["$ref"][2:].split("/"):
            target = target[part]
        node = target
    return node


def apply_defaults(instance: Any, schema: dict, root: dict | None = None) -> Any:
    """Fill absent object properties from the schema's `default`s, recursively (in place)."""
    root = root if root is not None else schema
    schema = _resolve_ref(schema, root)
    if isinstance(instance, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        for item in instance:
            apply_defaults(item, schema["items"], root)
    if not isinstance(instance, dict) or not isinstance(schema, dict):
        return instance
    for key, subschema in schema.get("properties", {}).items():
        subschema = _resolve_ref(subschema, root)
        if key not in instance and isinstance(subschema, dict) and "default" in subschema:
            instance[key] = copy.deepcopy(subschema["default"])
        if key in instance:
            apply_defaults(instance[key], subschema, root)
    return instance


def location(path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def describe_errors(instance: Any, schema_name: str) -> list[str]:
    """Every schema violation as 'location: message', unknown keys with the nearest valid key."""
    return describe_errors_with(validator(schema_name), instance)


def describe_errors_with(checker: jsonschema.protocols.Validator, instance: Any) -> list[str]:
    problems = []
    for error in sorted(checker.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path))):
        where = location(error.absolute_path)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = list(error.schema.get("properties", {}))
            for key in sorted(set(error.instance) - set(allowed)):
                near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
                hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(allowed)}"
                problems.append(f"{location([*error.absolute_path, key])}: unknown key{hint}")
        elif isinstance(error.schema, dict) and "x-error" in error.schema:
            key = f" key {error.instance!r}" if "propertyNames" in error.schema_path else ""
            problems.append(f"{where}{key}: {error.schema['x-error']}")
        elif error.validator in ("oneOf", "anyOf") and error.context:
            # "is not valid under any of the given schemas" names no rule: the branch of the
            # value's own shape (an object for an object) does
            problems += [f"{location(sub.absolute_path)}: {sub.message}" for sub in _branch_of_its_shape(error)]
        else:
            problems.append(f"{where}: {error.message}")
    return problems


def _branch_of_its_shape(error) -> list:
    """The errors of the one oneOf/anyOf branch whose type the value has, else the best match."""
    branches: dict = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    shaped = [
        subs
        for subs in branches.values()
        if not any(not sub.relative_path and sub.validator in ("type", "enum", "const") for sub in subs)
    ]
    return shaped[0] if len(shaped) == 1 else [jsonschema.exceptions.best_match(error.context)]


def require_valid(value: Any, schema_name: str, what: str) -> None:
    """For what spds itself writes: a mismatch with its schema is a bug in spds; refuse to write it."""
    problems = describe_errors(value, schema_name)
    if problems:
        raise SpdsError(f"internal error: {what} does not match schemas/{schema_name}.schema.json", problems)
