"""The run contract: load a config, apply the schema's defaults (spds/schema.py), validate, check pins.

schemas/config.schema.json is the single source of field names, types and defaults: this module
knows no field's default itself. Every command starts here, and a config that fails its schema
or an input whose pinned sha256 changed stops the command before any work, with every problem
listed at once.
"""
from __future__ import annotations

import copy
import importlib.util
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import jsonschema

from .digests import sha256_path
from .errors import SpdsError
from .fsio import MAX_DEPTH, atomic_write_json, read_json, read_text, sha256_json, value_depth
from .hub import model_directory
from .schema import (
    SHIPPED_DS_CONFIGS,
    StrictValidator,
    apply_defaults,
    describe_errors,
    describe_errors_with,
    load_schema,
    location,
    shipped_deepspeed_configs,
)
from .settings import (
    SECTIONS,
    CheckpointSettings,
    ContextSettings,
    DataSettings,
    DistributedSettings,
    EvalSettings,
    GenerateSettings,
    LossSettings,
    OptimSettings,
    SoftPromptSettings,
    StudentSettings,
    TrainSettings,
    build,
)

# ---------------------------------------------------------------- the config

@dataclass
class Config:
    """A validated config: its typed sections (`config.optim.learning_rate`), the top-level
    choices, and the paths resolved against the config file's directory."""
    path: Path
    raw: dict  # validated, defaults applied, paths as written: what run.json records
    student: StudentSettings = field(init=False)
    soft_prompt: SoftPromptSettings = field(init=False)
    data: DataSettings = field(init=False)
    optim: OptimSettings = field(init=False)
    loss: LossSettings = field(init=False)
    checkpoint: CheckpointSettings = field(init=False)
    train: TrainSettings = field(init=False)
    distributed: DistributedSettings = field(init=False)
    context: ContextSettings = field(init=False)
    generate: GenerateSettings = field(init=False)
    eval: EvalSettings = field(init=False)
    sharding: str = field(init=False)  # deepspeed | fsdp
    data_parallel_size: int | str = field(init=False)  # an int, or "any"

    def __post_init__(self):
        for key, cls in SECTIONS.items():
            setattr(self, key, build(cls, self.raw[key]))
        self.sharding = self.raw["sharding"]
        self.data_parallel_size = self.raw["data_parallel_size"]

    def resolve(self, value: str | None) -> Path | None:
        """A path of the config, relative to its directory, as the file system resolves it
        (symlinks and '..' followed): what every overlap rule compares."""
        if value is None:
            return None
        return (self.path.parent / Path(value).expanduser()).resolve()

    def resolve_model(self, value: str | None, key: str) -> Path | None:
        """A model directory: a path, or a hub id found in the local Hugging Face cache (spds/hub.py)."""
        return None if value is None else model_directory(value, self.resolve(value), key)

    @cached_property
    def model_path(self) -> Path:
        return self.resolve_model(self.student.model_path, "student.model_path")

    @cached_property
    def tokenizer_path(self) -> Path:
        if self.student.tokenizer_path is None:
            return self.model_path
        return self.resolve_model(self.student.tokenizer_path, "student.tokenizer_path")

    @cached_property
    def teacher_path(self) -> Path:
        """generate.teacher_path, default the student."""
        if self.generate.teacher_path is None:
            return self.model_path
        return self.resolve_model(self.generate.teacher_path, "generate.teacher_path")

    @property
    def packed_dir(self) -> Path:
        return self.resolve(self.data.packed_dir)

    @property
    def output_dir(self) -> Path:
        return self.resolve(self.raw["output_dir"])

    @property
    def candidate_paths(self) -> list[Path]:
        return [self.resolve(c.path) for c in self.data.candidates]

    @property
    def deepspeed_config_path(self) -> Path:
        """A shipped config by name (zero0, zero3), else a path resolved against the config's
        directory. "ds_configs/zero0.json", as configs written for a checkout name it, is the
        shipped file when nothing of that name stands beside the config."""
        written = self.raw["deepspeed_config"]
        if written in shipped_deepspeed_configs():
            return SHIPPED_DS_CONFIGS / f"{written}.json"
        beside_config = self.resolve(written)
        shipped = SHIPPED_DS_CONFIGS / Path(written).name
        if not beside_config.exists() and Path(written).parent == Path("ds_configs") and shipped.is_file():
            return shipped
        return beside_config

    @cached_property
    def deepspeed_config(self) -> Any:
        """The DeepSpeed file as parsed (read once; an unreadable one raises SpdsError)."""
        return read_json(self.deepspeed_config_path)

    @cached_property
    def zero_stage(self) -> int:
        return zero_stage(self.deepspeed_config)

    @property
    def shards_student(self) -> bool:
        """fsdp, or DeepSpeed ZeRO-3 (engine.LAYOUTS builds the layout): the student is loaded on the
        host and sharded onto the GPUs."""
        return self.sharding == "fsdp" or self.zero_stage == 3

    @cached_property
    def context_text(self) -> str | None:  # read once: every user of it sees the same text
        """The system prompt being distilled (context.file wins over context.text)."""
        return read_text(self.resolve(self.context.file)) if self.context.file else self.context.text

    def identity(self) -> str:
        """Digest of everything that shapes the trained prompt (paths included, as written)."""
        return sha256_json(self.identity_fields())

    def identity_fields(self) -> dict:
        fields = copy.deepcopy(self.raw)
        # Where things are written is not what is trained: a run directory may move. The packed
        # data's identity is its own digest, checked separately.
        # The backend and the DeepSpeed file (its ZeRO stage, monitors) change how the student is
        # laid out, not the update: a ZeRO-0 checkpoint may continue under ZeRO-3 or fsdp
        # (the topology still must match).
        for key in ("$schema", "output_dir", "sharding", "deepspeed_config"):
            fields.pop(key, None)
        fields["data"].pop("packed_dir", None)
        # Operational settings that never change the numbers of a run.
        for section, key in [("checkpoint", "keep_last"), ("checkpoint", "backup_dir"), ("checkpoint", "every"),
                             ("train", "progress_bar"), ("train", "require_smoke"),
                             ("train", "require_same_code"), ("distributed", "timeout_minutes"),
                             ("distributed", "master_addr"), ("distributed", "master_port"), ("data", "backup_dir"),
                             # recomputing a layer reproduces its activations exactly
                             ("student", "activation_checkpointing"), ("student", "activation_memory_gib")]:
            fields.get(section, {}).pop(key, None)
        if fields["optim"]["schedule"] == "constant" and not fields["optim"]["warmup_updates"]:
            fields["optim"].pop("updates")  # a constant-rate run may be extended and resumed
        return fields


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
                raise SpdsError(f"{path}:{mark.line + 1}: rule 'no aliases': YAML aliases (*name) are not read "
                                "in spds configs; write the value out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for index, key in enumerate(keys):
                line = node.value[index][0].start_mark.line + 1
                if not isinstance(key, str):
                    hint = " (YAML 1.1 reads on/off/yes/no as booleans: quote it)" if isinstance(key, bool) else ""
                    raise SpdsError(f"{path}:{line}: rule 'string keys': key {key!r} is not a string but "
                                    f"{type(key).__name__}{hint}")
                if key in keys[:index]:
                    raise SpdsError(f"{path}:{line}: rule 'unique keys': key {key!r} "
                                    "appears twice in one mapping (which one was meant?)")
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
            problems.append(f"{lock}: pin {key}: {digest!r} is not a sha256 (64 lower-case hex digits); "
                            "run spds pin again")
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


def load_config(path: str | Path, check_pins: bool = True, require_candidates: bool = True,
                use_pins: bool = True) -> Config:
    """Load, apply defaults, validate; raise SpdsError listing every problem, or return Config.
    use_pins False: the pins file beside the config is not read (spds pin, which replaces it)."""
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
    problems = input_problems(config, require_candidates) + deepspeed_config_problems(config)
    if check_pins:
        problems += pin_problems(config)
    if problems:
        raise SpdsError(f"{path}: config refers to inputs that do not hold", problems)
    return config


# ---------------------------------------------------------------- inputs and pins

def pinned_inputs(config: Config) -> list[tuple[str, Path, str | None]]:
    """(config key, resolved path, pinned sha256 or None) of every pinnable input."""
    student = config.student
    inputs = [("student.model_sha256", config.model_path, student.model_sha256)]
    if student.tokenizer_path is not None:
        inputs.append(("student.tokenizer_sha256", config.tokenizer_path, student.tokenizer_sha256))
    for i, candidate in enumerate(config.data.candidates):
        inputs.append((f"data.candidates[{i}].sha256", config.resolve(candidate.path), candidate.sha256))
    return inputs


def model_directory_problems(key: str, path: Path, needs: tuple[str, ...]) -> list[str]:
    if not path.is_dir():
        return [f"{key}: {path} is not a directory"]
    names = {p.name for p in path.iterdir()}
    if not any(name in names for name in needs):
        return [f"{key}: {path} holds none of {', '.join(needs)} (an empty or unfinished download?)"]
    if needs[0] == "config.json" and not any(n.endswith((".safetensors", ".bin")) for n in names):
        return [f"{key}: {path} holds no weights (*.safetensors or *.bin)"]
    return []


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


# What a run writes directly in output_dir (spds/records.py, stop.py, evaluate.py): an input of
# that name there would be replaced.
RUN_FILES = ("run.json", "metrics.jsonl", "progress.json", "terminal.json", "evidence.json", "stop-request.json",
             "eval.json")


def written_paths(config: Config) -> list[tuple[str, Path]]:
    """(key, resolved path) of every directory or file a command of this config writes."""
    written = [("output_dir", config.output_dir), ("data.packed_dir", config.packed_dir),
               ("generate.output", config.resolve(config.generate.output))]
    for key, value in (("checkpoint.backup_dir", config.checkpoint.backup_dir),
                       ("data.backup_dir", config.data.backup_dir)):
        if value:
            written.append((key, config.resolve(value)))
    return written + monitor_paths(config)


def monitor_paths(config: Config) -> list[tuple[str, Path]]:
    """The DeepSpeed monitors' output directories (relative to the working directory, as DeepSpeed
    opens them)."""
    try:
        ds_config = config.deepspeed_config
    except SpdsError:
        return []  # deepspeed_config_problems reports it
    found = []
    for name in ("tensorboard", "csv_monitor"):
        section = ds_config.get(name) if isinstance(ds_config, dict) else None
        if isinstance(section, dict) and isinstance(section.get("output_path"), str) and section["output_path"]:
            found.append((f"deepspeed_config {name}.output_path", Path(section["output_path"]).expanduser().resolve()))
    return found


def read_paths(config: Config) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(directories, files) a command of this config reads, resolved: nothing may write into them."""
    directories = [("student.model_path", config.model_path), ("student.tokenizer_path", config.tokenizer_path)]
    if config.generate.teacher_path:
        directories.append(("generate.teacher_path", config.teacher_path))
    files = [("the config", config.path), ("its pins file", pins_path(config.path)),
             ("deepspeed_config", config.deepspeed_config_path.resolve())]
    for key, value in (("context.file", config.context.file), ("generate.questions", config.generate.questions)):
        if value:
            files.append((key, config.resolve(value)))
    return directories, files


def output_problems(config: Config) -> list[str]:
    """Where spds writes must not be where it reads from, compared as the file system resolves
    them: a run directory equal to (or inside, or a symlink to) the model would write checkpoints
    into the pinned model, generate.output equal to its questions would overwrite them, and "/"
    would be swept by prepare."""
    problems = []
    directories, files = read_paths(config)
    candidates = [(f"data.candidates[{i}].path", path) for i, path in enumerate(config.candidate_paths)]
    for key, path in written_paths(config):
        if path == Path(path.anchor):
            problems.append(f"{key}: {path} is a file-system root; name a directory of its own")
            continue
        for input_key, input_path in directories:
            if _inside(path, input_path) or _inside(input_path, path):
                problems.append(f"{key}: {path} overlaps {input_key} {input_path}; spds would write into its own input")
        for input_key, input_path in files + (candidates if key == "data.packed_dir" else []):
            if _inside(input_path, path) and (key != "output_dir" or input_path.name in RUN_FILES):
                problems.append(f"{key}: {path} would replace {input_key} {input_path}")
        if key not in ("output_dir", "data.packed_dir") and _inside(path, config.packed_dir):
            problems.append(f"{key}: {path} is inside data.packed_dir {config.packed_dir}, which prepare replaces")
    if _inside(config.output_dir, config.packed_dir):
        problems.append(f"output_dir: {config.output_dir} is inside data.packed_dir {config.packed_dir}, "
                        "which prepare replaces")
    backup = config.resolve(config.checkpoint.backup_dir)
    if backup is not None and _inside(backup, config.output_dir / "checkpoints"):
        problems.append(f"checkpoint.backup_dir: {backup} is inside {config.output_dir / 'checkpoints'}, "
                        "which checkpoint.keep_last prunes")
    return problems


def input_problems(config: Config, require_candidates: bool = True) -> list[str]:
    problems = model_directory_problems("student.model_path", config.model_path, ("config.json",))
    if config.student.tokenizer_path is not None or not problems:
        problems += model_directory_problems("student.tokenizer_path", config.tokenizer_path,
                                             ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    for i, path in enumerate(config.candidate_paths):
        saved_dataset = path.is_dir() and (path / "state.json").is_file()  # datasets' save_to_disk
        if not (path.is_file() or saved_dataset) and require_candidates:  # spds generate writes them
            problems.append(f"data.candidates[{i}].path: {path} is not a file (jsonl, parquet) or a datasets "
                            "save_to_disk directory")
    named = (("context.file", config.resolve(config.context.file), "file"),
             ("generate.questions", config.resolve(config.generate.questions), "file"),
             ("generate.teacher_path", config.teacher_path if config.generate.teacher_path else None, "directory"))
    for key, path, kind in named:
        if path is not None and not (path.is_file() if kind == "file" else path.is_dir()):
            problems.append(f"{key}: {path} is not a {kind}")
    problems += output_problems(config) + determinism_problems(config) + teacher_memo_problems(config)
    optim = config.optim
    if optim.warmup_updates > optim.updates:
        problems.append(f"optim.warmup_updates: {optim.warmup_updates} exceeds optim.updates ({optim.updates})")
    if optim.micro_batch_layout == "packed" and config.student.attn_implementation != "sdpa":
        problems.append(f"optim.micro_batch_layout: packed records need spds's attention, which an sdpa student runs; "
                        f"student.attn_implementation is {config.student.attn_implementation!r} (set it to sdpa, or "
                        "the layout to padded)")
    size = config.data_parallel_size
    if size != "any" and optim.effective_batch % size:
        problems.append(f"optim.effective_batch: {optim.effective_batch} does not divide by "
                        f"data_parallel_size {size}")
    return problems


def teacher_memo_problems(config: Config) -> list[str]:
    if config.loss.teacher_memo_gib and config.shards_student:
        return ["loss.teacher_memo_gib: a sharded student's ranks must make the same forward calls, and a memo "
                "skips the teacher's on some ranks and not others: set it to 0, or replicate the student"]
    return []


def determinism_problems(config: Config) -> list[str]:
    """train.deterministic against the attention kernels that have no deterministic backward."""
    if not config.train.deterministic:
        return []
    from .attention import kernels_in  # deferred: spds.attention imports torch, which validating a config does without

    student = config.student
    if student.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
        return [f"student.attn_implementation: {student.attn_implementation!r} has no deterministic backward that "
                "spds can switch on, and train.deterministic is true: use sdpa (its fa4, flex or flash kernel) "
                "or eager"]
    if student.attn_implementation == "sdpa" and "cudnn" in kernels_in(student.attention_kernel):
        return ["student.attention_kernel: cuDNN attention has no deterministic backward, and train.deterministic is "
                "true: use auto (fa4 or flex on CUDA), fa4, flex, flash, efficient or math"]
    return []


def pin_problems(config: Config) -> list[str]:
    problems = []
    for key, path, pinned in pinned_inputs(config):
        if pinned is None or not path.exists():
            continue
        actual = sha256_path(path)
        if actual != pinned:
            problems.append(f"{key}: {path} changed since it was pinned (expected sha256 {pinned}, actual {actual})")
    return problems


def zero_stage(ds_config) -> int:
    return ds_config.get("zero_optimization", {}).get("stage", 0) if isinstance(ds_config, dict) else 0


def deepspeed_config_problems(config: Config) -> list[str]:
    path = config.deepspeed_config_path
    try:
        ds_config = config.deepspeed_config
    except SpdsError as error:
        return [f"deepspeed_config: {error}"]
    problems = [f"deepspeed_config ({path}): {p}" for p in describe_errors(ds_config, "ds_config")]
    micro = ds_config.get("train_micro_batch_size_per_gpu") if isinstance(ds_config, dict) else None
    if micro is not None and micro != config.optim.micro_batch:
        problems.append(f"deepspeed_config ({path}): train_micro_batch_size_per_gpu {micro} differs from "
                        f"optim.micro_batch {config.optim.micro_batch}")
    for section, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):  # DeepSpeed imports them at build
        if isinstance(ds_config, dict) and isinstance(ds_config.get(section), dict) and \
                ds_config[section].get("enabled") is True and importlib.util.find_spec(package) is None:
            problems.append(f"deepspeed_config ({path}): {section}: enabled, but the {package} package is not "
                            f"installed (pip install {package}, or disable the section)")
    if config.sharding == "fsdp" and zero_stage(ds_config) == 3:
        problems.append(f"sharding: 'fsdp' and deepspeed_config ({path}) zero_optimization.stage 3 both shard the "
                        "student; "
                        "choose one (sharding 'deepspeed' with stage 3, or fsdp with deepspeed_config zero0)")
    return problems


def pin_config(path: str | Path) -> dict[str, str]:
    """Write the sha256 of every input to the pins file beside the config (atomically); return them.
    The config itself is never rewritten: its comments, order and formatting stay the user's."""
    path = Path(path).resolve()
    lock = pins_path(path)
    # Re-pinning starts from the inputs as they are now; the old pins file stays until the new one
    # replaces it (atomically), so a refused or killed pin leaves it as it was.
    config = load_config(path, check_pins=False, use_pins=False)
    pins = {key: sha256_path(input_path) for key, input_path, _ in pinned_inputs(config)}
    atomic_write_json(lock, {"format": PINS_FORMAT, "config": path.name, "pins": pins})
    return pins


def validate_run_world(config: Config, world_size: int) -> None:
    expected = config.data_parallel_size
    if expected != "any" and expected != world_size:
        raise SpdsError(f"{config.path}: data_parallel_size is {expected} but this launch has world size {world_size}; "
                        "launch with that many processes or set data_parallel_size to \"any\"")
    batch = config.optim.effective_batch
    if batch % world_size:
        raise SpdsError(f"{config.path}: optim.effective_batch {batch} does not divide by the world size {world_size}; "
                        "every rank must hold the same number of records per update")
