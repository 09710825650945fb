"""spds prepare: candidate files -> verified rows -> packed store (exact tokens, scaffold inserted).

Refuses rather than guesses: a pinned file that changed, a bad row, a duplicate request_id, or
packed output built from other inputs all stop it with nothing written.
"""

from __future__ import annotations

import array
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np

from spds import __version__
from spds.contract.config import Config
from spds.contract.digests import sha256_path
from spds.contract.model_config import model_config
from spds.contract.schema import require_valid
from spds.data.chat import end_token_ids, scaffold_for, tokenizer_identity
from spds.data.context import corpus_of
from spds.data.packed import FORMAT, INDEX, MANIFEST, PackedWriter, verify_store
from spds.data.rows import RowRules, read_records
from spds.data.student_files import decodable_ids, load_tokenizer
from spds.errors import SpdsError
from spds.fsio import exclusive_lock, verified_copy


def split_of(question_id: str, eval_fraction: float) -> str:
    """Held-out questions by a hash of question_id: stable across runs, files and orderings."""
    if eval_fraction <= 0:
        return "train"
    u = int.from_bytes(hashlib.sha256(question_id.encode()).digest()[:8], "big") / 2**64
    return "eval" if u < eval_fraction else "train"


def packing_inputs(config: Config, tokenizer, sources: list[dict], end_ids: list[int]) -> dict:
    """Everything that decides the packed bytes; a rerun must see the same, or refuses."""
    data = config.data
    return dict(
        sources=sources,
        tokenizer=tokenizer_identity(tokenizer),
        placement=config.soft_prompt.placement,
        prompt_length=config.soft_prompt.length,
        context_limit=config.context_limit,
        end_token_ids=end_ids,
        chat_template_kwargs=data.chat_template_kwargs,
        eval_fraction=data.eval_fraction,
        # the default's packed bytes are those of stores packed before the setting existed
        **({"missing_system": data.missing_system} if data.missing_system != "template" else {}),
    )


def prepare(config: Config, log=print) -> dict:
    if config.context_limit is None:  # preflight names it; a library caller may come without it
        raise SpdsError("data.context_limit: the student's config.json declares no position window: set it")
    target = config.packed_dir
    return prepare_locked(config, target, target.with_name(f".{target.name}.lock"), log)


def model_vocabulary_rows(config: Config) -> int | None:
    """The student's embedding rows (config.json vocab_size): an id past them crashes training."""

    rows = model_config(config.model_path).get("vocab_size")
    return rows if isinstance(rows, int) else None


def prepare_locked(config: Config, target: Path, lock: Path, log) -> dict:
    with exclusive_lock(lock, f"spds prepare of {target}", remove=True):
        tokenizer = load_tokenizer(config)
        data = config.data
        end_ids = end_token_ids(tokenizer, data.end_tokens)
        sources, read_from = [], {}
        for i, (candidate, path) in enumerate(zip(data.candidates, config.candidate_paths)):
            read_from[path] = file_state(path)  # before the hash: a change from here on is seen
            actual = sha256_path(path)  # a file, or a save_to_disk directory
            if candidate.sha256 and candidate.sha256 != actual:
                raise SpdsError(
                    f"data.candidates[{i}]: {path} changed since it was pinned "
                    f"(expected sha256 {candidate.sha256}, actual {actual})"
                )
            sources.append(dict(path=str(path), sha256=actual))
        inputs = packing_inputs(config, tokenizer, sources, end_ids)
        if (target / MANIFEST).exists():
            return reuse_existing(target, inputs, log)
        if target.exists():
            raise SpdsError(f"{target} exists but holds no manifest.json: not a packed store spds wrote; move it away")
        manifest = write_store(config, tokenizer, inputs, log, read_from)
    if data.backup_dir:
        backup = config.resolve(data.backup_dir)
        verified_copy(target, [*manifest["files"], MANIFEST], backup)
        log(f"verified backup: {backup}")
    return manifest


def reuse_existing(target: Path, inputs: dict, log) -> dict:
    manifest = verify_store(target)
    if manifest["inputs"] != inputs:
        differs = sorted(k for k in inputs if manifest["inputs"].get(k) != inputs[k])
        raise SpdsError(
            f"{target} was packed from other inputs (differs: {', '.join(differs)}); "
            "spds never overwrites packed data: remove it or set data.packed_dir elsewhere"
        )
    log(f"{target}: packed data already complete and verified; unchanged")
    return manifest


def offline_teacher(config: Config) -> bool:
    """Will training read the teacher from the rows (so every row must carry top_logprobs)?"""
    return config.loss.objective != "ce" and config.loss.teacher_before_packing(config.has_context) == "top_k"


def file_state(path: Path) -> tuple | None:
    """What changes when a file is written (size, modification and status-change times); None
    for a directory (a datasets save_to_disk directory: its files are written once)."""
    if not path.is_file():
        return None
    info = path.stat()
    return info.st_size, info.st_mtime_ns, info.st_ctime_ns


def write_store(config: Config, tokenizer, inputs: dict, log, read_from: dict[Path, tuple | None]) -> dict:
    data = config.data
    scaffold = scaffold_for(config, tokenizer)
    rules = RowRules(
        scaffold=scaffold,
        placement=config.soft_prompt.placement,
        end_ids=frozenset(inputs["end_token_ids"]),
        vocab_size=decodable_ids(tokenizer, model_vocabulary_rows(config)),
        prompt_length=config.soft_prompt.length,
        context_limit=config.context_limit,
        template_kwargs=data.chat_template_kwargs,
        require_top_k=offline_teacher(config),
        corpus=corpus_of(config),
    )
    writer = PackedWriter(config.packed_dir)
    # 8-byte request_id hashes in a compact array: uniqueness without a set of a million strings.
    id_hashes = array.array("Q")
    counts = dict(existing_system=0, added_empty_system=0, prefix_placement=0, first_user_placement=0, train=0, eval=0)
    source_rows = []
    started = time.monotonic()
    try:
        for source, path in zip(inputs["sources"], config.candidate_paths):
            rows = 0
            for record in read_records(path, tokenizer, rules):
                digest = hashlib.blake2b(record.request_id.encode(), digest_size=8).digest()
                id_hashes.append(int.from_bytes(digest, "little"))
                split = split_of(record.question_id, data.eval_fraction)
                writer.add(record, split)
                counts[split] += 1
                counts[
                    f"{rules.placement}_placement"
                    if rules.placement != "system"
                    else "added_empty_system"
                    if record.added_system
                    else "existing_system"
                ] += 1
                rows += 1
            if rows == 0:  # a truncated export or a wrong path: never silently train on less
                raise SpdsError(f"{path}: rule 'rows present': the candidate file holds no rows")
            source_rows.append(dict(source, rows=rows))
        files = writer.close_files()
        check_unique_request_ids(writer.partial / INDEX, np.frombuffer(id_hashes, dtype=np.uint64))
        manifest = dict(
            format=FORMAT,
            spds_version=__version__,
            records=writer.records,
            tokens=writer.offset,
            max_length=writer.max_length,
            top_k=writer.top_k or 0,
            prompt_length=rules.prompt_length,
            placement=rules.placement,
            scaffold=scaffold.to_json(),
            end_token_ids=inputs["end_token_ids"],
            counts=counts,
            files=files,
            sources=source_rows,
            inputs=inputs,
        )
        require_valid(manifest, "manifest", "the manifest")
        for path, state in read_from.items():  # the manifest's sha256 must be of the rows packed
            if file_state(path) != state:
                raise SpdsError(
                    f"{path}: changed while spds prepare read it (appended to, or rewritten); nothing "
                    "was written: run prepare again once the file is complete"
                )
        writer.commit(manifest)
    except OSError as error:  # a full disk, a quota: named, and nothing of the user's touched
        writer.abort()
        raise store_write_failure(config, error) from None
    except BaseException:
        writer.abort()
        raise
    seconds = time.monotonic() - started
    log(f"packed {writer.records} records, {writer.offset} tokens in {seconds:.1f}s -> {config.packed_dir}")
    return manifest


def store_write_failure(config: Config, error: OSError) -> SpdsError:
    """What a user needs when the packed store cannot be written: which file, the room there is
    against the room the rows need (their candidate files' size bounds the store's tokens), and
    that nothing they had changed (the partial store is removed; a finished store is never written
    over; the candidates are only read)."""
    target = config.packed_dir
    where = next((p for p in [target, *target.parents] if p.exists()), target)
    free = shutil.disk_usage(where).free
    rows = sum(path.stat().st_size for path in config.candidate_paths if path.is_file())
    return SpdsError(
        f"spds prepare: cannot write {error.filename or target}: {error.strerror or error} "
        f"({free / 2**20:.2f} MiB free there; the candidate files hold {rows / 2**20:.2f} MiB of rows, and the "
        f"store needs up to about that much); the partial store was removed, and nothing you had changed "
        f"(the candidates, and any packed store already complete): free room or set data.packed_dir elsewhere"
    )


def check_unique_request_ids(index_path: Path, hashes: np.ndarray) -> None:
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    if not len(same):
        return
    suspects = {int(order[i]) for i in same} | {int(order[i + 1]) for i in same}
    seen: dict[str, str] = {}

    with open(index_path) as stream:
        for number, line in enumerate(stream):
            if number in suspects:
                entry = json.loads(line)
                if entry["request_id"] in seen:  # equal hashes may collide; compare the real strings
                    raise SpdsError(
                        f"{entry['source']}: request_id {entry['request_id']}: rule 'unique request_id': "
                        f"already used at {seen[entry['request_id']]}"
                    )
                seen[entry["request_id"]] = entry["source"]
