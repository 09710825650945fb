"""Config: a validated config as every command reads it. Its typed sections
(`config.optim.learning_rate`, from spds/contract/settings.py), the top-level choices, the paths resolved
against the config file's directory, and its identity (what shapes the trained prompt).
spds.contract.gate builds one, after the schema and the checks have passed."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from spds.contract.hub import model_directory
from spds.contract.model_config import Window, declared_window
from spds.contract.schema import SHIPPED_DS_CONFIGS, shipped_deepspeed_configs
from spds.contract.settings import (
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
from spds.errors import SpdsError
from spds.fsio import read_json, sha256_json


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
        """A model directory: a path, or a hub id found in the local Hugging Face cache (spds/contract/hub.py)."""
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

    @cached_property
    def student_window(self) -> Window | None:
        """The positions the student reads (spds/contract/model_config.py); None where its
        config.json states none, or the directory does not resolve (the input checks name that)."""
        return self.window_in(lambda: self.model_path)

    @cached_property
    def teacher_window(self) -> Window | None:
        return self.window_in(lambda: self.teacher_path)

    @staticmethod
    def window_in(directory) -> Window | None:
        try:
            return declared_window(directory())
        except SpdsError:
            return None

    @cached_property
    def context_limit(self) -> int | None:
        """data.context_limit, or where it is null the student's window (None: neither states one,
        which spds/data/preflight.py refuses)."""
        if self.data.context_limit is not None:
            return self.data.context_limit
        return self.student_window.positions if self.student_window else None

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
        ds_config = self.deepspeed_config
        return ds_config.get("zero_optimization", {}).get("stage", 0) if isinstance(ds_config, dict) else 0

    @property
    def shards_student(self) -> bool:
        """fsdp, or DeepSpeed ZeRO-3 (engine.LAYOUTS builds the layout): the student is loaded on the
        host and sharded onto the GPUs."""
        return self.sharding == "fsdp" or self.zero_stage == 3

    @property
    def has_context(self) -> bool:
        return bool(self.context.text or self.context.file or self.context.documents)

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
        for section, key in [
            ("checkpoint", "keep_last"),
            ("checkpoint", "backup_dir"),
            ("checkpoint", "every"),
            ("train", "progress_bar"),
            ("train", "require_smoke"),
            ("train", "require_same_code"),
            ("distributed", "timeout_minutes"),
            ("distributed", "master_addr"),
            ("distributed", "master_port"),
            ("data", "backup_dir"),
            # recomputing a layer reproduces its activations exactly
            ("student", "activation_checkpointing"),
            ("student", "activation_memory_gib"),
        ]:
            fields.get(section, {}).pop(key, None)
        if fields["optim"]["schedule"] == "constant" and not fields["optim"]["warmup_updates"]:
            fields["optim"].pop("updates")  # a constant-rate run may be extended and resumed
        return fields
