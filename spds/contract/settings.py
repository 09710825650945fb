"""Typed, frozen views of a validated config: one dataclass per section.

schemas/config.schema.json stays the single source of field names, constraints and defaults:
these classes declare the fields' Python types and nothing else (no defaults). `build` fills
them from the validated, defaulted dict, so a field the schema has and a class lacks (or the
reverse) fails the first config ever loaded, and tests/test_settings.py compares the two.
Modules receive their section (`Plan(store, config.optim, ...)`), never the whole config.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class StudentSettings:
    model_path: str
    model_sha256: str | None
    tokenizer_path: str | None
    tokenizer_sha256: str | None
    trust_remote_code: bool
    dtype: Literal["bfloat16", "float16", "float32"]
    attn_implementation: str
    attention_kernel: Any  # a kernel name, or {"below": n, "short": name, "long": name}
    pad_to_multiple_of: int | None
    activation_checkpointing: bool | Literal["auto"]
    liger_kernels: bool
    fp8_linear: bool
    activation_memory_gib: float | None


@dataclass(frozen=True)
class PromptInitSettings:
    method: Literal["random_normal", "text", "vocab_sample", "context"]
    std: float
    text: str | None
    spread: bool


@dataclass(frozen=True)
class SoftPromptSettings:
    length: int
    placement: Literal["system", "first_user", "prefix"]
    form: Literal["embeddings", "kv"]
    init: PromptInitSettings
    frozen_positions: int


@dataclass(frozen=True)
class CandidateSettings:
    path: str
    sha256: str | None


@dataclass(frozen=True)
class DataSettings:
    candidates: tuple[CandidateSettings, ...]
    packed_dir: str
    context_limit: int | None
    end_tokens: tuple | None
    chat_template_kwargs: dict
    missing_system: Literal["template", "empty"]
    backup_dir: str | None
    eval_fraction: float


@dataclass(frozen=True)
class OptimSettings:
    updates: int
    effective_batch: int
    micro_batch: int
    micro_batch_tokens: int | None
    micro_batch_layout: Literal["padded", "packed"]
    quadratic_length: float | None
    optimizer: Literal["adamw", "adam"]
    learning_rate: float
    betas: tuple
    eps: float
    weight_decay: float
    warmup_updates: int
    schedule: Literal["constant", "linear", "cosine"]
    min_lr_ratio: float
    max_grad_norm: float | None
    seed: int


@dataclass(frozen=True)
class KLSettings:
    direction: Literal["forward", "reverse", "jsd"]
    temperature: float
    teacher_temperature: float
    jsd_beta: float


@dataclass(frozen=True)
class OnPolicySettings:
    fraction: float
    temperature: float
    max_new_tokens: int


@dataclass(frozen=True)
class LossSettings:
    objective: Literal["ce", "kl", "mix"]
    ce_weight: float
    kl_weight: float
    teacher: Literal["auto", "context", "top_k"]
    reuse_context_kv: bool
    teacher_memo_gib: float
    kl: KLSettings
    on_policy: OnPolicySettings
    kernel: Literal["auto", "liger", "chunked"]
    chunk_tokens: int

    def teacher_before_packing(self, has_context: bool) -> str:
        """The teacher loss.teacher names, asked before the rows are packed (prepare: must every
        row carry top-k log-probabilities?): auto is top_k exactly when there is no context."""
        if self.teacher != "auto":
            return self.teacher
        return "context" if has_context else "top_k"

    def teacher_for_store(self, store_has_top_k: bool) -> str:
        """The teacher loss.teacher names for packed data (train, eval): "top_k" (an offline
        teacher's log-probabilities, packed with the rows) or "context" (the student with the
        context); auto is top_k when the store holds them."""
        if self.teacher != "auto":
            return self.teacher
        return "top_k" if store_has_top_k else "context"


@dataclass(frozen=True)
class CheckpointSettings:
    every: int
    keep_last: int
    backup_dir: str | None


@dataclass(frozen=True)
class TrainSettings:
    require_smoke: bool
    progress_bar: bool
    require_same_code: bool
    deterministic: bool


@dataclass(frozen=True)
class DistributedSettings:
    timeout_minutes: float
    master_addr: str
    master_port: int
    communication: Literal["auto", "nccl", "gloo"]


@dataclass(frozen=True)
class ContextSettings:
    text: str | None
    file: str | None
    documents: str | tuple | None  # a corpus: spds/data/corpus.py
    description: str | None
    skip_irregular: bool
    sha256: str | None


@dataclass(frozen=True)
class SelfStudySettings:
    conversations: int
    chunk_tokens: int
    slice_tokens: int | None
    kinds: dict  # seed kind -> weight
    seed_prompts: dict  # seed kind -> the instruction the teacher reads
    temperatures: dict  # seed kind -> the teacher's temperature for its answers
    question_max_tokens: int


@dataclass(frozen=True)
class GenerateSettings:
    questions: str | None
    self_study: SelfStudySettings | None
    output: str
    teacher_path: str | None
    samples_per_question: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    seed: int
    top_k_logprobs: int


@dataclass(frozen=True)
class EvalSettings:
    max_records: int | None
    kl: bool
    samples: int
    max_new_tokens: int
    questions: str | None
    question_samples: int
    batch_tokens: int | None


# The config's sections, by key, in schema order.
SECTIONS = dict(
    student=StudentSettings,
    soft_prompt=SoftPromptSettings,
    data=DataSettings,
    optim=OptimSettings,
    loss=LossSettings,
    checkpoint=CheckpointSettings,
    train=TrainSettings,
    distributed=DistributedSettings,
    context=ContextSettings,
    generate=GenerateSettings,
    eval=EvalSettings,
)


def build(cls: type, values: dict) -> Any:
    """cls filled from a validated section: nested sections become their dataclass, lists tuples.
    Fields the schema leaves without a default and the config leaves out (pins) are None."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for field in dataclasses.fields(cls):
        value, kind = values.get(field.name), hints[field.name]
        optional = [a for a in typing.get_args(kind) if a is not type(None)]
        if value is not None and len(optional) == 1 and dataclasses.is_dataclass(optional[0]):
            kind = optional[0]  # an optional section that is set
        if dataclasses.is_dataclass(kind):
            value = build(kind, value)
        elif typing.get_origin(kind) is tuple and dataclasses.is_dataclass(typing.get_args(kind)[0]):
            value = tuple(build(typing.get_args(kind)[0], item) for item in value)
        elif isinstance(value, list):
            value = tuple(value)
        fields[field.name] = value
    unknown = set(values) - set(fields)
    if unknown:  # the schema gained a field this class lacks: fail loudly, never drop a setting
        raise TypeError(f"{cls.__name__} has no field for {sorted(unknown)}: add it to spds/contract/settings.py")
    return cls(**fields)
