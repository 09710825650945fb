"""The checks a config must pass beyond its schema, before any work: inputs that exist, outputs
that never overlap an input (compared as the file system resolves them), cross-field rules, the
DeepSpeed file's own schema and its agreement with the config, the kernels train.deterministic
allows. Each returns a list of problems, so that a refused config names all of them at once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from spds.contract.config import Config
from spds.contract.documents import context_entries
from spds.contract.kinds import BUILT_IN_KINDS, RECITE, UNINSTRUCTED
from spds.contract.model_config import model_window_problems
from spds.contract.pins import pins_path
from spds.contract.schema import describe_errors
from spds.errors import SpdsError
from spds.fsio import read_json


def model_directory_problems(key: str, path: Path, needs: tuple[str, ...]) -> list[str]:
    if not path.is_dir():
        return [f"{key}: {path} is not a directory"]
    names = {p.name for p in path.iterdir()}
    if not any(name in names for name in needs):
        return [f"{key}: {path} holds none of {', '.join(needs)} (an empty or unfinished download?)"]
    if needs[0] == "config.json" and not any(n.endswith((".safetensors", ".bin")) for n in names):
        return [f"{key}: {path} holds no weights (*.safetensors or *.bin)"]
    return []


CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")


def custom_code_problems(key: str, path: Path) -> list[str]:
    """A model directory whose config.json or tokenizer_config.json maps a class to Python code of
    its own (auto_map): transformers would run that file's code (after asking on the terminal,
    unless told). Unreadable files are the loaders' to report."""
    problems = []
    for name in CUSTOM_CODE_FILES:
        try:
            values = read_json(path / name) if (path / name).is_file() else {}
        except SpdsError:
            continue
        mapped = values.get("auto_map") if isinstance(values, dict) else None
        if mapped:
            code = sorted({str(v).split(".")[0] + ".py" for v in _flat(mapped) if "." in str(v)})
            problems.append(
                f"{key}: {path / name} names custom code in auto_map ({', '.join(code) or mapped}): spds runs "
                "no code from a model directory unless student.trust_remote_code is true (it then runs in "
                "every rank; run.json records the setting)"
            )
    return problems


def refuse_custom_code(key: str, path: Path) -> None:
    problems = custom_code_problems(key, path)
    if problems:
        raise SpdsError(problems[0])


def _flat(value) -> list:
    if isinstance(value, dict):
        return [item for v in value.values() for item in _flat(v)]
    if isinstance(value, (list, tuple)):
        return [item for v in value for item in _flat(v)]
    return [value]


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


# What a run writes directly in output_dir (spds/training/records.py, stop.py, evaluate.py): an input of
# that name there would be replaced.
RUN_FILES = (
    "run.json",
    "metrics.jsonl",
    "progress.json",
    "terminal.json",
    "evidence.json",
    "stop-request.json",
    "eval.json",
)


def written_paths(config: Config) -> list[tuple[str, Path]]:
    """(key, resolved path) of every directory or file a command of this config writes."""
    written = [
        ("output_dir", config.output_dir),
        ("data.packed_dir", config.packed_dir),
        ("generate.output", config.resolve(config.generate.output)),
    ]
    for key, value in (
        ("checkpoint.backup_dir", config.checkpoint.backup_dir),
        ("data.backup_dir", config.data.backup_dir),
    ):
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
    files = [
        ("the config", config.path),
        ("its pins file", pins_path(config.path)),
        ("deepspeed_config", config.deepspeed_config_path.resolve()),
    ]
    for key, value in (("context.file", config.context.file), ("generate.questions", config.generate.questions)):
        if value:
            files.append((key, config.resolve(value)))
    for entry in context_entries(config):  # a corpus's directories and files (a glob's matches: its own)
        path = config.resolve(entry)
        if path.is_dir():
            directories.append(("context.documents", path))
        elif path.is_file():
            files.append(("context.documents", path))
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
        problems.append(
            f"output_dir: {config.output_dir} is inside data.packed_dir {config.packed_dir}, which prepare replaces"
        )
    backup = config.resolve(config.checkpoint.backup_dir)
    if backup is not None and _inside(backup, config.output_dir / "checkpoints"):
        problems.append(
            f"checkpoint.backup_dir: {backup} is inside {config.output_dir / 'checkpoints'}, "
            "which checkpoint.keep_last prunes"
        )
    return problems


CANDIDATES = ("must exist", "generate writes one", "unread")


def input_problems(config: Config, candidates: str = "must exist") -> list[str]:
    """Every input the config names that does not hold. `candidates`: which candidate files must
    exist: all ("must exist": prepare, train, eval); all but the one spds generate writes
    (generate.output, when the config generates: validate and init, run before generating); none
    ("unread": generate itself, stop)."""
    problems = model_directory_problems("student.model_path", config.model_path, ("config.json",))
    if config.student.tokenizer_path is not None or not problems:
        problems += model_directory_problems(
            "student.tokenizer_path",
            config.tokenizer_path,
            ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"),
        )
    problems += model_window_problems("student.model_path", config.model_path)
    if config.generate.teacher_path:
        problems += model_window_problems("generate.teacher_path", config.teacher_path)
    if not config.student.trust_remote_code:
        directories = [("student.model_path", config.model_path), ("student.tokenizer_path", config.tokenizer_path)]
        if config.generate.teacher_path:
            directories.append(("generate.teacher_path", config.teacher_path))
        seen = set()  # the tokenizer is the student's own directory unless named apart
        for key, directory in directories:
            if directory not in seen and directory.is_dir():
                problems += custom_code_problems(key, directory)
            seen.add(directory)
    assert candidates in CANDIDATES, candidates
    generates = config.generate.questions is not None or config.generate.self_study is not None
    waived = set(config.candidate_paths) if candidates == "unread" else set()
    if candidates == "generate writes one" and generates:
        waived.add(config.resolve(config.generate.output))
    for i, path in enumerate(config.candidate_paths):
        saved_dataset = path.is_dir() and (path / "state.json").is_file()  # datasets' save_to_disk
        if not (path.is_file() or saved_dataset or path in waived):
            problems.append(
                f"data.candidates[{i}].path: {path} is not a file (jsonl, parquet) or a datasets save_to_disk directory"
            )
    named = (
        ("context.file", config.resolve(config.context.file), "file"),
        ("generate.questions", config.resolve(config.generate.questions), "file"),
        ("generate.teacher_path", config.teacher_path if config.generate.teacher_path else None, "directory"),
        ("eval.questions", config.resolve(config.eval.questions), "file"),
    )
    for key, path, kind in named:
        if path is not None and not (path.is_file() if kind == "file" else path.is_dir()):
            problems.append(f"{key}: {path} is not a {kind}")
    problems += output_problems(config) + determinism_problems(config) + sharded_student_problems(config)
    problems += context_problems(config) + on_policy_problems(config) + prompt_problems(config)
    optim = config.optim
    if optim.warmup_updates > optim.updates:
        problems.append(f"optim.warmup_updates: {optim.warmup_updates} exceeds optim.updates ({optim.updates})")
    if optim.micro_batch_layout == "packed" and config.student.attn_implementation != "sdpa":
        problems.append(
            f"optim.micro_batch_layout: packed records need spds's attention, which an sdpa student runs; "
            f"student.attn_implementation is {config.student.attn_implementation!r} (set it to sdpa, or "
            "the layout to padded)"
        )
    size = config.data_parallel_size
    if size != "any" and optim.effective_batch % size:
        problems.append(f"optim.effective_batch: {optim.effective_batch} does not divide by data_parallel_size {size}")
    return problems


def context_problems(config: Config) -> list[str]:
    """Settings that read the context, when there is none; self-study beside a questions file; a
    corpus past the window where something must read it whole."""
    has_context = config.has_context
    problems = corpus_problems(config)
    needs = [
        ("soft_prompt.init.method", config.soft_prompt.init.method == "context", "'context' starts the prompt from it"),
        ("generate.self_study", config.generate.self_study is not None, "self-study writes its questions from it"),
        ("eval.questions", config.eval.questions is not None, "the teacher answers them with it"),
    ]
    for key, used, why in needs:
        if used and not has_context:
            problems.append(
                f"{key}: {why}, and the config has none: set context.file, context.text or context.documents"
            )
    if config.eval.questions is not None and importlib.util.find_spec("rouge_score") is None:
        # eval scores the answers with it only after the teacher has answered every question
        problems.append(
            "eval.questions: eval scores the answers' overlap (ROUGE-L) with the rouge-score package, a dependency "
            "of spds that is not installed here: pip install rouge-score (or reinstall spds)"
        )
    study = config.generate.self_study
    for key, kinds in (("kinds", study.kinds), ("temperatures", study.temperatures)) if study else ():
        unknown = sorted(set(kinds) - set(BUILT_IN_KINDS) - set(study.seed_prompts))
        if unknown:
            problems.append(
                f"generate.self_study.{key}: {', '.join(unknown)}: no such seed kind; the built-in ones are "
                f"{', '.join(BUILT_IN_KINDS)}, and generate.self_study.seed_prompts adds your own"
            )
    if study is not None and RECITE in study.temperatures:
        problems.append(
            f"generate.self_study.temperatures.{RECITE}: a recital's answer is the context's own text: the "
            "teacher samples none; remove the key"
        )
    for kind, why in UNINSTRUCTED.items():
        if study is not None and kind in study.seed_prompts:
            problems.append(
                f"generate.self_study.seed_prompts.{kind}: {kind} has no instruction: {why}; name your own kind instead"
            )
    if study is not None and config.generate.questions is not None:
        problems.append(
            "generate.self_study: generate.questions is set too; self-study writes the questions itself: "
            "set one of them (questions: null for self-study)"
        )
    return problems


def corpus_problems(config: Config) -> list[str]:
    """One context; a description only for a corpus (what the corpus itself holds, and what it
    cannot do past the window, spds/data/preflight.py checks with the tokenizer)."""
    context = config.context
    given = [key for key in ("text", "file", "documents") if getattr(context, key)]
    problems = []
    if len(given) > 1:
        problems.append(f"context: {' and '.join('context.' + k for k in given)} are set: the context is one of them")
    if context.description and not context.documents:
        problems.append("context.description: describes a corpus (context.documents), and none is set")
    return problems


def prompt_problems(config: Config) -> list[str]:
    """The soft prompt's form and frozen positions against what they need."""
    prompt, problems = config.soft_prompt, []
    if prompt.form == "kv" and config.student.attn_implementation != "sdpa":
        problems.append(
            f"soft_prompt.form: kv puts its keys and values in spds's attention, which an sdpa student runs; "
            f"student.attn_implementation is {config.student.attn_implementation!r} (set it to sdpa, or the form "
            "to embeddings)"
        )
    if prompt.frozen_positions >= prompt.length:
        problems.append(
            f"soft_prompt.frozen_positions: {prompt.frozen_positions} of {prompt.length} positions frozen leaves "
            "nothing to train: lower it"
        )
    if prompt.frozen_positions and config.optim.weight_decay:
        problems.append(
            f"soft_prompt.frozen_positions: weight decay ({config.optim.weight_decay}) would move the frozen "
            "positions, which receive no gradient: set optim.weight_decay to 0"
        )
    return problems


def on_policy_problems(config: Config) -> list[str]:
    """loss.on_policy against what it needs: the online teacher scoring the student's own tokens
    with a divergence, and room in the context limit for a sampled answer."""
    loss, on_policy = config.loss, config.loss.on_policy
    if not on_policy.fraction:
        return []
    problems = []
    if loss.objective != "kl":
        problems.append(
            f"loss.on_policy.fraction: the student's own answers are scored by a divergence to the teacher, "
            f"and loss.objective is {loss.objective!r}: set it to kl (cross entropy on the student's own "
            "tokens would train it to repeat itself)"
        )
    if loss.teacher != "context" or not config.has_context:
        problems.append(
            "loss.on_policy.fraction: the student's own answers have no offline teacher's log-probabilities: "
            "set loss.teacher to context (the student with the context scores them online) and give the context"
        )
    limit = config.context_limit  # None: the student declares no window, which preflight reports
    if limit is not None and on_policy.max_new_tokens + config.soft_prompt.length >= limit:
        problems.append(
            f"loss.on_policy.max_new_tokens: {on_policy.max_new_tokens} new tokens and the soft prompt's "
            f"{config.soft_prompt.length} leave no room for a question within the context limit ({limit}): "
            "lower it"
        )
    if config.shards_student:
        problems.append(
            "loss.on_policy.fraction: sampling runs the whole student on each rank, and this one is sharded "
            "over the ranks (ZeRO-3, fsdp): replicate the student, or set the fraction to 0"
        )
    return problems


def sharded_student_problems(config: Config) -> list[str]:
    """What a student sharded over the ranks (ZeRO-3, fsdp) cannot do. Whether it is sharded is asked
    only when a setting needs it: the answer reads the DeepSpeed config, whose own problems are
    reported under its key by the checks that read it."""
    problems = []
    if config.loss.teacher_memo_gib:
        problems.append(
            "loss.teacher_memo_gib: a sharded student's ranks must make the same forward calls, and a memo "
            "skips the teacher's on some ranks and not others: set it to 0, or replicate the student"
        )
    if config.student.fp8_linear:
        problems.append(
            "student.fp8_linear: the FP8 weights are buffers, which ZeRO-3 and FSDP do not shard (every rank "
            "would hold all of them): set it to false, or replicate the student"
        )
    return problems if problems and config.shards_student else []


def determinism_problems(config: Config) -> list[str]:
    """train.deterministic against the attention kernels that have no deterministic backward."""
    if not config.train.deterministic:
        return []
    from spds.kernels.attention import determinism_problems  # deferred: it imports torch; validate does without

    return determinism_problems(config.student.attn_implementation, config.student.attention_kernel)


def deepspeed_config_problems(config: Config) -> list[str]:
    path = config.deepspeed_config_path
    try:
        ds_config = config.deepspeed_config
    except SpdsError as error:
        return [f"deepspeed_config: {error}"]
    problems = [f"deepspeed_config ({path}): {p}" for p in describe_errors(ds_config, "ds_config")]
    micro = ds_config.get("train_micro_batch_size_per_gpu") if isinstance(ds_config, dict) else None
    if micro is not None and micro != config.optim.micro_batch:
        problems.append(
            f"deepspeed_config ({path}): train_micro_batch_size_per_gpu {micro} differs from "
            f"optim.micro_batch {config.optim.micro_batch}"
        )
    for section, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):  # DeepSpeed imports them at build
        if (
            isinstance(ds_config, dict)
            and isinstance(ds_config.get(section), dict)
            and ds_config[section].get("enabled") is True
            and importlib.util.find_spec(package) is None
        ):
            problems.append(
                f"deepspeed_config ({path}): {section}: enabled, but the {package} package is not "
                f"installed (pip install {package}, or disable the section)"
            )
    if config.sharding == "fsdp" and config.zero_stage == 3:
        problems.append(
            f"sharding: 'fsdp' and deepspeed_config ({path}) zero_optimization.stage 3 both shard the "
            "student; "
            "choose one (sharding 'deepspeed' with stage 3, or fsdp with deepspeed_config zero0)"
        )
    return problems
