"""spds init MODEL DATA: a commented starter config, validated before it is written.

Every field a user is likely to change, with the schema's default and the schema's own
description as its comment (schemas/config.schema.json stays the one source), the placement the
student's chat template allows (`system` where it has a system message, `first_user` where it
folds or refuses one, `prefix` without a template) and the date a dated template needs pinned,
written atomically as YAML and checked with the contract and the checks prepare makes.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path

from spds.contract.checks import refuse_custom_code
from spds.contract.gate import load_config
from spds.contract.hub import model_directory
from spds.contract.schema import apply_defaults, load_schema
from spds.data.chat import derive_scaffold, stability_problem
from spds.data.context import corpus_of, share
from spds.data.sources import json_lines
from spds.errors import SpdsError
from spds.fsio import atomic_writer
from spds.generation.teacher_window import require_ready

# (section, field) in the order a user reads them; the values come from the schema's defaults.
FIELDS = [
    ("student", "model_path"),
    ("student", "dtype"),
    ("student", "liger_kernels"),
    ("soft_prompt", "length"),
    ("soft_prompt", "placement"),
    ("data", "candidates"),
    ("data", "packed_dir"),
    ("data", "context_limit"),
    ("data", "eval_fraction"),
    ("data", "chat_template_kwargs"),
    ("context", "file"),
    ("optim", "updates"),
    ("optim", "effective_batch"),
    ("optim", "micro_batch"),
    ("optim", "micro_batch_tokens"),
    ("optim", "micro_batch_layout"),
    ("optim", "learning_rate"),
    ("optim", "warmup_updates"),
    ("optim", "schedule"),
    ("optim", "max_grad_norm"),
    ("optim", "seed"),
    ("loss", "objective"),
    ("loss", "teacher_memo_gib"),
    ("checkpoint", "every"),
    ("checkpoint", "keep_last"),
    ("train", "deterministic"),
    (None, "deepspeed_config"),
    (None, "output_dir"),
]


# What `spds init MODEL DATA --context FILE` writes: the best recipe measured on the real example
# for the device it will train on (docs/config.md: self-study; bench/RESULTS.md has what each
# carries and what it does not, and what it costs). The GPU's has five times the conversations and
# sixteen times the rows an update: there they cost minutes, on two CPU cores hours.
SELF_STUDY_RECIPES = {  # device -> what differs between the two
    "cpu": dict(dtype="float32", conversations=256, objective="kl", updates=64, rows=8, micro_batch=8, lr=0.01),
    "gpu": dict(dtype="bfloat16", conversations=1280, objective="mix", updates=128, rows=128, micro_batch=32, lr=0.1),
}


def self_study_recipe(device: str) -> dict:
    """The config sections of the recipe for `device` (cpu or gpu)."""
    r = SELF_STUDY_RECIPES[device]
    return {
        "student": {"dtype": r["dtype"]},  # the CPU's fp32 as measured (a CPU without bf16 units runs it faster too)
        "soft_prompt": {"length": 128, "init": {"method": "context"}},
        "generate": {
            "questions": None,
            "self_study": {"conversations": r["conversations"], "chunk_tokens": 64},
            "samples_per_question": 1,
            "max_new_tokens": 96,
            "top_k_logprobs": 20,
        },
        "loss": {"objective": r["objective"], "teacher": "top_k"},
        "optim": {
            "updates": r["updates"],
            "effective_batch": r["rows"],
            "micro_batch": r["micro_batch"],
            "learning_rate": r["lr"],
            "warmup_updates": 4,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
        },
        "data": {"eval_fraction": 0.05},
    }


def default_recipe() -> str:
    """gpu where this machine has a CUDA device, else cpu: where `spds init` runs is most often
    where the run will."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


SELF_STUDY_FIELDS = [
    ("soft_prompt", "init"),
    ("generate", "self_study"),
    ("generate", "output"),
    ("generate", "samples_per_question"),
    ("generate", "max_new_tokens"),
    ("generate", "top_k_logprobs"),
    ("loss", "teacher"),
    ("optim", "min_lr_ratio"),
]


SECTION_ORDER = ["student", "soft_prompt", "data", "context", "generate", "optim", "loss", "checkpoint", "train", None]


def template_choices(model: str, config_dir: Path) -> tuple[str, dict, object]:
    """(the placement the student's chat template allows, the chat_template_kwargs it needs, the
    tokenizer, for the checks that follow):
    system where the template has a system message, first_user where it folds or refuses one,
    prefix without a template; a template that writes today's date gets today pinned as
    date_string (Llama 3.x's variable), so that rows rendered tomorrow have the same ids."""
    from transformers import AutoTokenizer  # seconds of import, for init only

    path = model_directory(model, (config_dir / Path(model).expanduser()).resolve(), "MODEL")
    if not path.is_dir():
        raise SpdsError(
            f"MODEL {model}: no such directory, and not a model id (org/name) in the local Hugging Face cache"
        )
    try:
        refuse_custom_code("MODEL", path)  # init writes trust_remote_code false; the user opts in by hand
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise SpdsError(f"MODEL {path}: its tokenizer does not load: {error}") from None
    if not getattr(tokenizer, "chat_template", None):
        return "prefix", {}, tokenizer  # before everything, as PEFT does
    kwargs = {}
    if "date_string" in tokenizer.chat_template and stability_problem(tokenizer, {}, model):
        kwargs["date_string"] = datetime.date.today().strftime("%d %b %Y")
    try:
        role = derive_scaffold(tokenizer, kwargs, model=model).system_role
    except SpdsError:
        return "prefix", kwargs, tokenizer
    return ("system" if role in ("optional", "always") else "first_user"), kwargs, tokenizer


def comment(schema_field: dict) -> str:
    text = " ".join(schema_field.get("description", "").split())
    first = text.split(". ")[0].rstrip(".")
    return f"  # {first}" if first else ""


def render(values: dict, schema: dict, fields: list = FIELDS, note: str | None = None) -> str:
    lines = [
        "# spds config written by `spds init`: every field, type and default is in schemas/config.schema.json.",
        "# Relative paths resolve against this file's directory. Check it with `spds validate`.",
        *([note] if note else []),
    ]
    current = None
    for section, name in sorted(fields, key=lambda field: SECTION_ORDER.index(field[0])):
        node = schema["properties"][section]["properties"][name] if section else schema["properties"][name]
        value = values[section][name] if section else values[name]
        if section == "context" and values["context"].get("file"):
            lines += ["context:  # the context being distilled", f"  file: {json.dumps(values['context']['file'])}"]
            continue
        if section == "context" and values["context"].get("documents"):
            lines += [
                "context:  # the corpus being distilled: each file a document (docs/config.md: a corpus)",
                f"  documents: {json.dumps(values['context']['documents'])}",
                "  # description: one paragraph the teacher reads first: what this corpus is",
            ]
            continue
        if section == "context":  # nothing to set unless there is one: a commented example
            lines += [
                "# context:  # the system prompt being distilled (the kl objective's teacher, eval's ceiling)",
                "#   file: system_prompt.txt",
            ]
            continue
        if section != current and section is not None:
            lines.append(f"{section}:")
        current = section
        indent = "  " if section else ""
        if name == "chat_template_kwargs" and not value:
            continue  # nothing the template needs
        if name == "candidates":
            lines.append(f"{indent}candidates:  # candidate rows (jsonl); spds pin records their sha256")
            lines.extend(f"{indent}  - path: {json.dumps(c['path'], ensure_ascii=False)}" for c in value)
        else:
            lines.append(f"{indent}{name}: {json.dumps(value, ensure_ascii=False)}{comment(node)}")
    return "\n".join(lines) + "\n"


def init(model: str, data: str, out: Path, context: str | None = None, recipe: str = "cpu") -> Path:
    """A starter config for MODEL and DATA; with `context`, for self-study: generate writes DATA
    from the context alone, with the measured recipe for `recipe` (cpu or gpu)."""
    out = Path(out).resolve()
    if out.exists():
        raise SpdsError(f"{out} exists: spds init never overwrites a config (choose another --out)")
    schema = load_schema("config")
    values = {key: {} for key in schema["properties"] if schema["properties"][key].get("type") == "object"}
    values.update(student={"model_path": model}, data={"candidates": [{"path": data}]}, output_dir="run")
    fields, note = FIELDS, None
    if context is not None:
        for section, chosen in self_study_recipe(recipe).items():
            values[section].update(chosen)
        # a directory or a JSONL of documents: a corpus. Read, as every path init writes, from the
        # config's folder (where the config's relative paths resolve), not the working directory
        given = out.parent / Path(context).expanduser()
        as_corpus = given.is_dir() or given.suffix.lower() in (".jsonl", ".ndjson")
        values["context"] = {"documents" if as_corpus else "file": context}
        values["generate"]["output"] = data
        note = (
            f"# The self-study recipe for a {recipe.upper()} (spds init --recipe {recipe}), measured on a real "
            "small model: docs/config.md, bench/RESULTS.md."
        )
        fields = FIELDS + [field for field in SELF_STUDY_FIELDS if field not in FIELDS]
    apply_defaults(values, schema)
    placement, kwargs, tokenizer = template_choices(model, out.parent)
    if not getattr(tokenizer, "chat_template", None):
        chat_rows_need_a_template(out.parent / Path(data).expanduser())
    values["soft_prompt"]["placement"], values["data"]["chat_template_kwargs"] = placement, kwargs
    as_json = out.suffix.lower() == ".json"
    text, config = checked(values, schema, fields, note, out, as_json, tokenizer, bool(context))
    if context is not None and config.context.documents:  # a corpus: the run sized from it, checked again
        sized, said = corpus_sizing(config, recipe)
        values["soft_prompt"].update(sized["soft_prompt"])
        values["optim"].update(sized["optim"])
        values["generate"]["self_study"] = {**values["generate"]["self_study"], **sized["generate"]["self_study"]}
        note += "\n" + "\n".join(f"# {line}" for line in said)
        fields = fields + [("soft_prompt", "form")]
        text, config = checked(values, schema, fields, note, out, as_json, tokenizer, True, corpus_from=config)
        print("\n".join(said))
    if out.exists():  # written meanwhile by someone else: still never overwritten
        raise SpdsError(f"{out} exists: spds init never overwrites a config (choose another --out)")
    with atomic_writer(out) as stream:
        stream.write(text)
    return out


def checked(
    values: dict, schema: dict, fields, note, out: Path, as_json: bool, tokenizer, self_study: bool, corpus_from=None
):
    """(the config's text, its Config) after the whole contract and what prepare checks (the config
    names MODEL's own tokenizer), checked as written from a new file beside `out` (relative paths
    resolve alike; mkstemp: no file of the user's is replaced or removed); refusals name `out`.
    `corpus_from`: the config it was sized from, whose corpus it reads (sizing changes no slice)."""
    text = render_json(values, fields) if as_json else render(values, schema, fields, note)
    descriptor, name = tempfile.mkstemp(prefix=".init-", suffix=".json" if as_json else ".yaml", dir=out.parent)
    candidate = Path(name)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text)
        written_later = "generate writes one" if self_study else "must exist"  # self-study: generate writes DATA
        config = load_config(candidate, check_pins=False, candidates=written_later)
        if corpus_from is not None:
            share(config, corpus_from)
        require_ready(config, tokenizer)
    except SpdsError as error:  # named as the file the user asked for, not the check's temporary one
        named = [problem.replace(str(candidate), str(out)) for problem in error.problems]
        raise SpdsError(str(error.args[0]).replace(str(candidate), str(out)), named) from None
    finally:
        candidate.unlink(missing_ok=True)
    return text, config


# How `spds init --context DIR` sizes a corpus run (a corpus past the window, issue 66's measures in
# bench/RESULTS.md): a kv prompt at COMPRESSION x fewer positions than the corpus has tokens
# (Cartridges matched in-context quality at about 38.6x less memory than the corpus's KV cache);
# every chunk read READS times by self-study (fact lines are asked a line per fact conversation of
# a chunk: 2,048 conversations over 386 chunks stated 31 of 47 asked facts, 8,192 all 47); the
# updates as many epochs over the rows as the recipe's, at most EPOCHS; the kv form's learning rate
# (docs/config.md: ten times the embeddings', measured on the real example).
COMPRESSION = 30
PROMPT_BOUNDS = (64, 4096)
READS = {"cpu": 2, "gpu": 16}
EPOCHS = 4
KV_LEARNING_RATE = 0.1


def corpus_sizing(config, recipe: str) -> tuple[dict, list[str]]:
    """The config sections that size a self-study run to its corpus, and what was chosen, in words."""
    corpus = corpus_of(config)
    tokens = corpus.tokens
    low, high = PROMPT_BOUNDS
    high = min(high, (config.context_limit or high) // 2 // 64 * 64)  # half the window at most: records need room
    length = int(min(high, max(low, round(tokens / COMPRESSION / 64) * 64)))
    chunk = config.generate.self_study.chunk_tokens
    chunks = -(-tokens // chunk)
    r = SELF_STUDY_RECIPES[recipe]
    conversations = max(r["conversations"], chunks * READS[recipe])
    epochs = min(EPOCHS, r["updates"] * r["rows"] / r["conversations"])
    updates = max(r["updates"], round(epochs * conversations / r["rows"]))
    sized = {
        "soft_prompt": {"length": length, "form": "kv"},  # started from the context: the recipe's init
        "generate": {"self_study": {"conversations": conversations}},
        "optim": {"updates": updates, "learning_rate": KV_LEARNING_RATE},
    }
    said = [
        f"sized for a corpus of {tokens:,} tokens in {len(corpus.slices)} slices of the teacher's window: "
        f"a kv prompt of {length} positions ({tokens / length:.0f}x fewer than the corpus's tokens, its KV cache "
        f"as much smaller), started from the corpus's first tokens;",
        f"{conversations:,} self-study conversations (each of its ~{chunks:,} chunks of {chunk} tokens read "
        f"~{conversations // max(chunks, 1)} times); {updates} updates of {r['rows']} rows (~{epochs:g} epochs) "
        f"at the kv form's learning rate {KV_LEARNING_RATE}",
    ]
    return sized, said


def chat_rows_need_a_template(path: Path) -> None:
    """Without a chat template spds can pack token-form rows only: refuse a DATA file holding a
    chat-form row now, not at prepare (a JSONL file is scanned; other forms are prepare's)."""
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return
    for number, row in json_lines(path):
        if isinstance(row, dict) and "messages" in row:
            raise SpdsError(
                f"{path}:{number}: rule 'chat template': a chat-form row (messages), and MODEL's "
                "tokenizer has no chat template to render it: give rows in token form (input_ids, "
                "labels), or a model whose tokenizer has one"
            )


def render_json(values: dict, fields: list = FIELDS) -> str:
    """The fields render writes, as JSON (no comments: JSON has none) for an --out named *.json."""
    chosen = {}
    for key in ("file", "documents"):
        if values["context"].get(key):
            chosen["context"] = {key: values["context"][key]}
    for section, name in fields:
        if section == "context" or (name == "chat_template_kwargs" and not values[section][name]):
            continue
        if section:
            chosen.setdefault(section, {})[name] = values[section][name]
        else:
            chosen[name] = values[name]
    return json.dumps(chosen, indent=2, ensure_ascii=False) + "\n"
