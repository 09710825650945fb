"""spds export: the trained prompt as a portable file, and the code to use it exactly as trained.

    <out>/soft_prompt.safetensors   tensor "prompt" FP32, [length, hidden] (form embeddings) or
                                    [layers, 2, kv heads, length, head dim] (form kv: keys then
                                    values, the keys after RoPE at the positions the prompt took),
                                    with metadata: form, placement, the insertion rule (scaffold
                                    ids), length, the insertion offsets of the records it trained on,
                                    student identity, spds version, source checkpoint and update
    <out>/peft/                     for prefix placement only, written by PEFT itself from a
                                    PeftModel holding the prompt: a prompt-tuning adapter (form
                                    embeddings) or a CARTRIDGE adapter (form kv: its
                                    past_key_values, the first frozen_positions frozen)

`load_soft_prompt` reads the file back; `splice` builds the student's input exactly as training
did (form embeddings), `past_key_values` the cache and input ids (form kv); `generate` decodes
with either. A prompt trained for `system` placement has no PEFT equivalent (PEFT prepends
virtual tokens to everything), hence no adapter for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from spds import __version__
from spds.contract.config import Config
from spds.contract.digests import sha256_path
from spds.data.chat import Scaffold, render
from spds.data.packed import PackedStore
from spds.data.rows import RowRules, place
from spds.errors import SpdsError
from spds.fsio import atomic_path, read_json, sha256_file
from spds.model.kv_prompt import form_of, length_of, moved, require_fits
from spds.model.student import load_student, skeleton
from spds.training.checkpoint import checkpoint_to_read, prompt_of

FILE = "soft_prompt.safetensors"


def student_identity(config: Config) -> str:
    """What a prompt's student is, by its content: the pinned student.model_sha256, else the same
    digest of the model directory (its files' names and contents, each file's remembered while it
    is unchanged: spds/contract/digests.py). A byte-identical copy is the same student; a model
    replaced at the same path is not."""
    return config.student.model_sha256 or sha256_path(config.model_path)


def export(config: Config, checkpoint_path: str | None, out: Path) -> dict:
    from safetensors.torch import save_file

    directory = checkpoint_to_read(config.output_dir, checkpoint_path)
    prompt, commit = prompt_of(directory)
    require_fits(prompt, skeleton(config.model_path, config.student.trust_remote_code), str(directory))
    manifest = read_json(config.packed_dir / "manifest.json")
    kv = form_of(prompt) == "kv"
    metadata = {
        "format": "spds-soft-prompt-v1",
        "spds_version": __version__,
        "form": form_of(prompt),
        "placement": manifest["placement"],
        "prompt_length": str(length_of(prompt)),
        **(
            {"layers": str(prompt.shape[0]), "kv_heads": str(prompt.shape[2]), "head_dim": str(prompt.shape[4])}
            if kv
            else {"hidden_size": str(prompt.shape[1])}
        ),
        "insert_at": json.dumps(sorted({int(a) for a in PackedStore.open(config.packed_dir).insert_at})),
        "frozen_positions": str(config.soft_prompt.frozen_positions),
        "scaffold": json.dumps(manifest["scaffold"]),
        "chat_template_kwargs": json.dumps(manifest["inputs"]["chat_template_kwargs"]),
        "student_identity": student_identity(config),
        "student_path": str(config.model_path),
        "checkpoint": str(directory),
        "update": str(commit["update"]),
    }
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / FILE) as temporary:
        save_file({"prompt": prompt}, str(temporary), metadata=metadata)
    result = {"soft_prompt": str(out / FILE), "update": commit["update"], "placement": manifest["placement"]}
    if manifest["placement"] == "prefix":
        result["peft_adapter"] = str(export_peft(config, prompt, out / "peft"))
    return result


# What composed prompts must share: the student, where the prompt goes and how a record is laid out.
SAME_FOR_COMPOSITION = ("form", "student_identity", "placement", "scaffold", "insert_at", "chat_template_kwargs")


def compose(paths: list[Path], out: Path, force: bool = False) -> dict:
    """One prompt from prompts exported from separate runs on the same student, in the order given:
    the embeddings form's vectors concatenated; the kv form's keys and values concatenated along
    positions, each later prompt's keys turned by RoPE to the positions it now takes (after the
    ones before it), so each is read as it was trained. Refused, naming both files and the key,
    for prompts of another student, form, placement or layout. Its inputs are kept: OUT may not be
    or hold one of them, the same prompt twice is refused, and an OUT holding a prompt already is
    refused unless `force` (spds export --compose ... --force)."""
    from safetensors.torch import save_file

    require_inputs_kept(paths, out, force)
    loaded = [(Path(path), *load_soft_prompt(path)) for path in paths]
    first_path, first, first_meta = loaded[0]
    for path, prompt, metadata in loaded[1:]:
        for key in SAME_FOR_COMPOSITION:
            this, that = (str(m.get(key, "embeddings" if key == "form" else None)) for m in (first_meta, metadata))
            if this != that:
                raise SpdsError(
                    f"cannot compose {path} after {first_path}: their {key} differs ({this[:80]!r} and {that[:80]!r}): "
                    "prompts compose only for the same student, form and placement (rule 'composable prompts')"
                )
    kv = form_of(first) == "kv"
    parts, shift = [], 0
    if kv:
        if len(json.loads(first_meta["insert_at"])) != 1:
            raise SpdsError(f"{first_path}: its records put the prompt at several offsets ({first_meta['insert_at']})")
        student = skeleton(first_meta["student_path"])
        for path, prompt, _ in loaded:
            require_fits(prompt, student, str(path))
    for path, prompt, _ in loaded:
        parts.append(moved(student, prompt, shift) if kv else prompt)
        shift += length_of(prompt)
    prompt = torch.cat(parts, dim=3 if kv else 0).contiguous()
    metadata = {key: value for key, value in first_meta.items() if isinstance(value, str)}
    metadata.update(
        scaffold=json.dumps(first_meta["scaffold"]),
        chat_template_kwargs=json.dumps(first_meta["chat_template_kwargs"]),
        prompt_length=str(length_of(prompt)),
        composed_of=json.dumps([{"file": str(path), "prompt_length": length_of(p)} for path, p, _ in loaded]),
        spds_version=__version__,
    )
    for key in ("checkpoint", "update"):
        metadata[key] = json.dumps([m.get(key) for _, _, m in loaded])
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / FILE) as temporary:
        save_file({"prompt": prompt}, str(temporary), metadata=metadata)
    return {"soft_prompt": str(out / FILE), "composed": [str(path) for path, _, _ in loaded], "prompt_length": shift}


def require_inputs_kept(paths: list[Path], out: Path, force: bool) -> None:
    """Refuse, before anything is read or written, a composition that would overwrite or lose an
    input: OUT an input's own directory or above it, one file given twice (by its bytes, so a copy
    too), or an existing composed prompt in OUT without `force`."""
    target = Path(os.path.realpath(out))
    for path in paths:
        real = Path(os.path.realpath(path))
        if target == real.parent or target in real.parents or target == real:
            raise SpdsError(
                f"spds export --compose: OUT {out} holds the input {path}: rule 'composition keeps its inputs' "
                "(name a directory of its own)"
            )
    digests = {}
    for path in paths:
        digest = sha256_file(path) if Path(path).is_file() else None
        if digest is not None and digest in digests:
            raise SpdsError(
                f"spds export --compose: {path} is the same prompt as {digests[digest]} (sha256 {digest[:16]}): "
                "rule 'each prompt once' (a prompt composed with itself would carry its context twice)"
            )
        digests[digest] = path
    if (out / FILE).exists() and not force:
        raise SpdsError(
            f"spds export --compose: {out / FILE} exists: rule 'an output is not replaced unasked' "
            "(name another OUT, or pass --force to replace it)"
        )


def export_peft(config: Config, prompt: torch.Tensor, out: Path) -> Path:
    """A PEFT adapter built by PEFT, our prompt in it: prompt tuning's embedding (form embeddings),
    or a CARTRIDGE's prefix cache (form kv), flattened as PEFT's own initializer flattens a
    prefill's past_key_values: [length, layers x 2 x kv heads x head dim], keys and values of a
    layer in turn."""
    from peft import CartridgeConfig, PromptTuningConfig, TaskType, get_peft_model

    student = load_student(
        config.model_path, "float32", "eager", torch.device("cpu"), config.student.trust_remote_code
    )  # PEFT's own forward: transformers' attention, as a user of the adapter runs it
    common = dict(task_type=TaskType.CAUSAL_LM, base_model_name_or_path=str(config.model_path))
    if form_of(prompt) == "kv":
        frozen = config.soft_prompt.frozen_positions
        peft_model = get_peft_model(
            student, CartridgeConfig(num_virtual_tokens=prompt.shape[3], num_frozen_tokens=frozen, **common)
        )
        flat = prompt.permute(3, 0, 1, 2, 4).reshape(prompt.shape[3], -1)  # [p, layers x 2 x kv heads x D]
        peft_model.prompt_encoder["default"].load_prompt_embeddings(flat)
    else:
        peft_model = get_peft_model(student, PromptTuningConfig(num_virtual_tokens=prompt.shape[0], **common))
        with torch.no_grad():
            peft_model.prompt_encoder["default"].embedding.weight.copy_(prompt)
    peft_model.save_pretrained(str(out))
    return out


def load_soft_prompt(path: str | Path) -> tuple[torch.Tensor, dict]:
    """The prompt and metadata of a file `spds export` wrote, the tensor checked against what the
    metadata says it is (form, length, and hidden size or layers, heads and head size); refused
    with the file and the rule otherwise. prompt_embeds, past_key_values and generate check it
    against the student they are given."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            prompt = handle.get_tensor("prompt")
        metadata["scaffold"] = json.loads(metadata["scaffold"])
        metadata["chat_template_kwargs"] = json.loads(metadata.get("chat_template_kwargs", "{}"))  # as trained
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as error:
        problem = f"not a soft prompt spds export wrote ({error!r:.200})"
        raise SpdsError(f"{path}: {problem}: rule 'exported prompt'") from None
    form = metadata.get("form", "embeddings")
    keys = KV_KEYS if form == "kv" else ("prompt_length", "hidden_size")
    said = {key: metadata.get(key) for key in keys}
    dims = (0, 2, 3, 4) if prompt.dim() == 5 else range(prompt.dim())
    found = [str(prompt.shape[d]) for d in dims]
    if form != form_of(prompt) or list(said.values()) != found:
        raise SpdsError(
            f"{path}: its metadata says form {form} with {said}, and its tensor is form {form_of(prompt)} "
            f"{list(prompt.shape)}: rule 'exported prompt' (the file was altered, or mixes two exports)"
        )
    return prompt, metadata


def prompt_to_read(config: Config, path: str | None) -> tuple[torch.Tensor, str, int | None]:
    """(prompt, where it came from, its update) for eval and sample: a committed checkpoint's (the
    run's newest, or the directory `path` names), or the file `path` names (an export, a composed
    one too: its update is None), which must have been placed as this run's records are."""
    if path is None or not str(path).endswith(".safetensors"):
        directory = checkpoint_to_read(config.output_dir, path)
        prompt, commit = prompt_of(directory)
        return prompt, str(directory), commit["update"]
    prompt, metadata = load_soft_prompt(path)
    manifest = read_json(config.packed_dir / "manifest.json")
    said = dict(placement=metadata.get("placement"), scaffold=metadata.get("scaffold"), prompt_length=length_of(prompt))
    for key, value in said.items():
        if value != manifest.get(key):
            raise SpdsError(
                f"{path}: its {key} is {str(value)[:80]!r}, and {config.packed_dir}'s records were packed for "
                f"{str(manifest.get(key))[:80]!r}: pack a store for it (soft_prompt.length {length_of(prompt)}, the "
                "same placement and template, a new data.packed_dir) to measure it (rule 'prompt fits its records')"
            )
    update = metadata.get("update", "")
    return prompt, str(Path(path).resolve()), int(update) if update.isdigit() else None


KV_KEYS = ("layers", "kv_heads", "prompt_length", "head_dim")


def insertion_point(ids: list[int], metadata: dict) -> tuple[list[int], int]:
    """Apply the training-time insertion rule (spds.data.rows.place) to rendered conversation ids."""
    import numpy as np

    rules = RowRules(
        scaffold=Scaffold(**metadata["scaffold"]),
        placement=metadata["placement"],
        end_ids=frozenset(),
        vocab_size=0,
        prompt_length=0,
        context_limit=0,
        template_kwargs={},
    )
    try:
        placed, _, insert_at, _ = place(np.asarray(ids, dtype=np.int64), len(ids), rules)  # all of it is prompt
    except ValueError as error:
        raise SpdsError(f"cannot place the soft prompt: {error}") from None
    return placed.tolist(), insert_at


def splice(student, prompt: torch.Tensor, ids: list[int], insert_at: int) -> torch.Tensor:
    """inputs_embeds [1, L+P, H] exactly as in training: prompt cast to the student's dtype."""
    embed = student.get_input_embeddings()
    tokens = embed(torch.tensor(ids, device=embed.weight.device))
    block = prompt.to(device=tokens.device, dtype=tokens.dtype)
    return torch.cat([tokens[:insert_at], block, tokens[insert_at:]])[None]


@torch.no_grad()
def prompt_embeds(student, tokenizer, prompt: torch.Tensor, metadata: dict, messages: list[dict]) -> torch.Tensor:
    """The student's input for `messages` with the soft prompt in it, [positions, hidden] in the
    student's dtype: the embedding sequence training built (the chat template's rendering with
    the generation prompt, the prompt spliced by training's rule). It is what vLLM's
    `prompt_embeds` input and SGLang's `input_embeds` take:

        LLM(model=path, enable_prompt_embeds=True).generate({"prompt_embeds": prompt_embeds(...)})
    """
    require_fits(prompt, student, "the soft prompt")
    ids = render(tokenizer, messages, True, metadata.get("chat_template_kwargs", {}))  # their text stays text
    ids, insert_at = insertion_point(ids, metadata)
    return splice(student, prompt, ids, insert_at)[0]


@torch.no_grad()
def past_key_values(student, prompt: torch.Tensor, ids: list[int], insert_at: int):
    """A kv prompt as transformers takes it: (a DynamicCache holding the keys and values of
    ids[:insert_at], then the prompt's, the input ids with the prompt's p positions held by
    placeholders). Given both, transformers' forward and generate run the ids past the cache's
    length only, at positions insert_at + p on: the record as training read it."""
    from transformers import DynamicCache

    require_fits(prompt, student, "the soft prompt")
    if form_of(prompt) != "kv":
        raise SpdsError("past_key_values takes a kv prompt (form kv); an embeddings prompt goes through prompt_embeds")
    device = student.get_input_embeddings().weight.device
    cache = DynamicCache(config=student.config)
    if insert_at:
        student(
            input_ids=torch.tensor([ids[:insert_at]], device=device), use_cache=True, **{cache_keyword(student): cache}
        )
    dtype = student.get_input_embeddings().weight.dtype
    for layer in range(prompt.shape[0]):
        cache.update(prompt[layer, 0][None].to(device, dtype), prompt[layer, 1][None].to(device, dtype), layer)
    placeholders = [ids[insert_at - 1] if insert_at else ids[0]] * prompt.shape[3]  # never embedded
    return cache, torch.tensor([ids[:insert_at] + placeholders + ids[insert_at:]], device=device)


def cache_keyword(model) -> str:
    """transformers renamed past_key_values to cache (5.2x); both name the same object."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(student, tokenizer, prompt: torch.Tensor, metadata: dict, messages: list[dict], **generate_kwargs) -> str:
    """Answer `messages` with the soft prompt in it as in training (spliced embeddings, or a kv
    prompt's cache); return the decoded reply."""
    if metadata.get("form") == "kv":
        ids = render(tokenizer, messages, True, metadata.get("chat_template_kwargs", {}))
        ids, insert_at = insertion_point(ids, metadata)
        cache, input_ids = past_key_values(student, prompt, ids, insert_at)
        mask = torch.ones_like(input_ids)
        output = student.generate(
            input_ids=input_ids, attention_mask=mask, **{cache_keyword(student): cache}, **generate_kwargs
        )
        return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    inputs_embeds = prompt_embeds(student, tokenizer, prompt, metadata, messages)[None]
    mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
    output = student.generate(inputs_embeds=inputs_embeds, attention_mask=mask, **generate_kwargs)
    return tokenizer.decode(output[0], skip_special_tokens=True)
