"""spds eval: on held-out records, how much of the context's effect does the soft prompt recover?

For every held-out record (data.eval_fraction splits by question_id, so none was trained on),
the mean NLL per teacher response token under the student
    floor    with nothing inserted (the student without the context),
    ceiling  with the context's tokens inserted where the prompt goes (right after the system
             header, or first for prefix placement),
    soft     with the trained soft prompt,
and gap recovered = (floor - soft) / (floor - ceiling): 0 is no better than no context, 1 is as
good as the context itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spds import __version__
from spds.contract.config import Config
from spds.contract.schema import require_valid
from spds.contract.settings import KLSettings
from spds.data.chat import encode_text
from spds.data.context import context_text, corpus_of
from spds.data.packed import PackedStore
from spds.data.preflight import require_context_fits
from spds.data.sources import read_eval_questions
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError
from spds.fsio import atomic_path, atomic_write_json
from spds.generation.decode import free_bytes
from spds.model.build import build_soft_prompt_model
from spds.model.loss import final_logit_softcap, make_loss
from spds.model.recompute import ACTIVATION_BYTES_PER_HIDDEN
from spds.model.soft_prompt import load_segments
from spds.model.teacher import ContextTeacher, build_teacher, teacher_kind
from spds.trained.export import prompt_to_read
from spds.trained.progress import Progress
from spds.trained.questions import answer_scores, teacher_config
from spds.trained.sample import answers, write
from spds.training.engine import init_distributed, shard_student
from spds.training.records import read_metrics
from spds.training.schedule import lockstep_passes


@torch.no_grad()
def evaluate(config: Config, checkpoint_path: str | None = None, log=print) -> dict:
    prompt, directory, update = prompt_to_read(config, checkpoint_path)  # a checkpoint's, or an exported file's
    store = PackedStore.open(config.packed_dir)
    held_out = held_out_records(config, store)
    rank, world, device = eval_ranks(config)
    phases = Phases()
    questions = None
    if config.eval.questions:  # the teacher's answers to them, packed, before the student takes the memory
        with phases("teacher answers eval.questions"):
            questions = QuestionStore.made(config, rank, world, log)
    context_ids = encode_text(load_tokenizer(config), context_text(config)) if context_text(config) else []
    ceiling_fits(
        config, len(context_ids), [(store, held_out)] + ([(questions.store, questions.records)] if questions else [])
    )
    model = build_soft_prompt_model(config, device, prompt=prompt, training=False, prompt_source=directory)
    # records packed end to end on a GPU (varlen kernels, no padding); right-padded rows of similar
    # length on the CPU, whose packed attention computes every pair of positions of the batch
    model.packed = device.type == "cuda" and model.kernel_choice is not None
    if config.shards_student:
        shard_student(config, model, world)
    scoring = Scoring.of(config, model, prompt, device, rank, world, context_ids=context_ids)
    require_batch_fits(model, scoring.batch_tokens, device)
    result = dict(checkpoint=directory, update=update)
    with phases("scoring held-out records"):
        result.update(held_out_figures(config, scoring, store, held_out))
    result.update(context_tokens=scoring.context_tokens, world_size=world, spds_version=__version__, plot=None)
    corpus = corpus_of(config)
    if corpus is not None:  # the context view is the corpus truncated to the window where it passes it
        whole = "truncated" if corpus.truncates else "whole"
        result["corpus"] = dict(
            documents=len(corpus.documents), slices=len(corpus.slices), slice_tokens=corpus.budget, context=whole
        )
    if questions is not None:
        with phases("scoring eval.questions"):
            result["questions"] = scoring.figures(questions.store, questions.records, None, "scoring eval.questions")
    with phases("greedy answers"):
        answered = answer_views(config, result, directory, model.student, questions, (rank, world))
    if "samples" in answered:
        result["samples"] = answered["samples"]
    if "questions" in answered:
        result["questions"].update(answered["questions"])
    result["phases"] = phases.seconds
    if rank == 0:
        write_report(config, result)
    return result


class Phases:
    """Each phase's seconds on this rank (eval.json's `phases`): `with phases(name): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        began = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - began, 3)


def held_out_records(config: Config, store: PackedStore) -> np.ndarray:
    """The records data.eval_fraction held out (at most eval.max_records of them)."""
    held_out = np.flatnonzero(~store.is_train)
    if not len(held_out) and not config.eval.questions:
        raise SpdsError(
            "no held-out records: set data.eval_fraction > 0 and run spds prepare on a fresh packed_dir, "
            "or name questions training never asked in eval.questions"
        )
    limit = config.eval.max_records
    return held_out[:limit] if limit else held_out


def ceiling_fits(config: Config, context: int, scored: list[tuple[PackedStore, np.ndarray]]) -> None:
    """The ceiling reads the context (`context` tokens) in place of the prompt: refused, before the
    student loads, where the context and the longest record scored pass the student's window."""
    if not context:
        return
    longest = max((int(store.length[records].max()) for store, records in scored if len(records)), default=0)
    require_context_fits(config, context, longest, "eval's ceiling (the student with the context)")


def eval_ranks(config: Config) -> tuple[int, int, torch.device]:
    """Launched with torchrun or deepspeed, the ranks share the records; a student sharded as in
    training (ZeRO-3 or fsdp) needs its process group even on one rank."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or config.shards_student:
        return init_distributed(config.distributed)
    return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def held_out_figures(config: Config, scoring: Scoring, store: PackedStore, held_out: np.ndarray) -> dict:
    """The held-out records' figures, with the KL to the training teacher, or to the one
    loss.teacher names (auto: the packed top-k, else the context); none when neither exists (no
    context, no top-k): then eval reports no KL."""
    if not len(held_out):
        return dict(records=0, supervised_tokens=0, nll=None, gap_recovered=None, kl_to_teacher=None, teacher=None)
    has_teacher = config.eval.kl and (store.top_k or context_text(config))
    teacher = build_teacher(config, scoring.model, store) if has_teacher else None
    figures = scoring.figures(store, held_out, teacher, "scoring held-out records")
    figures["teacher"] = teacher_kind(config, store) if teacher is not None else None
    return figures


def answer_views(config: Config, result: dict, directory: str, student, questions, ranks: tuple[int, int]) -> dict:
    """Greedy answers bare / with the context / with the soft prompt, every rank answering its
    share (spds/trained/sample.py): a few held-out records' (eval.samples) and every eval.questions
    question's; none for a student sharded over the ranks (its forward is collective)."""
    answered, settings = {}, dict(checkpoint=str(directory), max_new_tokens=config.eval.max_new_tokens, student=student)
    if config.shards_student:
        return answered
    if config.eval.samples and result["records"]:
        answered["samples"] = answers(config, config.eval.samples, ranks=ranks, **settings)
    if questions is not None:
        answered["questions"] = questions.answered(
            config, answers(config, len(questions.questions), questions.path, ranks=ranks, **settings)
        )
    return answered


def write_report(config: Config, result: dict) -> None:
    """Rank 0: the questions' answers side by side (samples.md), the plot, then eval.json,
    validated first."""
    out = config.output_dir
    if result.get("questions", {}).get("answers"):
        write(out, result["questions"]["answers"])
    result["plot"] = plot(out / "metrics.jsonl", result["nll"] or result["questions"]["nll"], out / "eval.png")
    require_valid(result, "eval", "eval.json")
    atomic_write_json(out / "eval.json", result)


@dataclass
class QuestionStore:
    """eval.questions' teacher answers as a packed store of held-out records
    (spds/trained/questions.py), and the questions themselves."""

    path: Path
    questions: list[dict]
    store: PackedStore

    @property
    def records(self) -> np.ndarray:
        return np.arange(len(self.store.is_train))

    @classmethod
    def made(cls, config: Config, rank: int, world: int, log) -> QuestionStore:
        """The ranks have the teacher answer the questions, each a share of the batches
        (spds/generation/batches.py), and rank 0 packs the answers (or finds them made)."""
        from spds.data.prepare import prepare  # per use: a plain eval packs nothing
        from spds.generation.generate import generate  # per use: a plain eval loads no teacher for decoding

        path = config.resolve(config.eval.questions)
        questions = read_eval_questions(path)
        derived = teacher_config(config, path)
        if generate(derived, log=log if rank == 0 else lambda *_: None)["left"]:  # every rank answers a share
            raise SpdsError(
                "stopped while the teacher answered eval.questions (spds stop, a signal): its answers so far are "
                "kept; run spds eval again to complete them"
            )
        if rank == 0:
            prepare(derived, log=log)
        if world > 1:
            torch.distributed.barrier()
        return cls(path, questions, PackedStore.open(derived.packed_dir))

    def answered(self, config: Config, rows: list[dict]) -> dict:
        """The greedy answers (spds.trained.sample's rows, in the questions' order), with their scores."""
        for question, row in zip(self.questions, rows):
            row.update(question_id=question["question_id"], keyword=question.get("keyword"), doc=question.get("doc"))
        return dict(answer_scores(self.questions, rows), answers=rows)


@dataclass
class Scoring:
    """The three students eval compares (nothing where the prompt goes, the context's tokens, the
    soft prompt) and the loss functions it reads them with: the figures are the same whatever the
    training objective: NLL of the teacher's tokens, and forward KL(teacher || student) at
    temperature 1, through the training loss's own kernels."""

    model: object
    blocks: dict  # condition -> what is inserted where the prompt goes (None: the soft prompt)
    nll_fn: object
    kl_fn: object
    rank: int
    world: int
    device: torch.device
    batch_tokens: int  # eval.batch_tokens, resolved for the device
    show: bool  # progress on rank 0's standard error
    # the ceiling's rows computed after the context's cached keys and values (the online teacher's
    # way, spds/model/teacher.py): a record's forward over its own tokens, not over the context too
    # (at 32k tokens of context and records of hundreds, a hundredth of the positions); None: a
    # sharded student, whose forwards go batched
    cached_context: object | None = None

    @classmethod
    def of(
        cls,
        config: Config,
        model,
        prompt: torch.Tensor,
        device: torch.device,
        rank: int,
        world: int,
        show: bool = True,
        context_ids: list[int] | None = None,
    ) -> Scoring:
        """`context_ids`: the context as the teacher reads it (encode_text), when the caller has them."""
        student = model.student
        cap = final_logit_softcap(student)
        nll_fn = make_loss(dataclasses.replace(config.loss, objective="ce"), cap)
        # the plain forward KL to the teacher itself, whatever divergence the prompt was trained by
        plain = KLSettings(direction="forward", temperature=1.0, teacher_temperature=1.0, jsd_beta=0.5)
        kl_fn = make_loss(dataclasses.replace(config.loss, objective="kl", kl=plain), cap)
        hidden = student.get_input_embeddings().embedding_dim  # not the weight: ZeRO-3 partitions it
        blocks = {"floor": prompt.new_zeros((0, hidden)).to(device), "soft": None}  # soft: the prompt, either form
        cached = None
        if context_ids is None and context_text(config):
            context_ids = encode_text(load_tokenizer(config), context_text(config))
        if context_ids:
            ids = torch.tensor(context_ids, device=device)
            blocks["ceiling"] = student.get_input_embeddings()(ids)
            cached = None if model.layout.lockstep else ContextTeacher(model, ids, reuse_context=True)
        return cls(model, blocks, nll_fn, kl_fn, rank, world, device, batch_tokens(config, device), show, cached)

    @property
    def context_tokens(self) -> int:
        return len(self.blocks["ceiling"]) if "ceiling" in self.blocks else 0

    def figures(self, store: PackedStore, records: np.ndarray, teacher, phase: str = "scoring") -> dict:
        """NLL per response token of `records` under each condition, gap recovered, and with a
        teacher the soft prompt's KL to it, over batches of records (`scoring_batches`: fixed by
        the records alone), every condition over the same batches. Rank r scores every world-th
        batch. A sharded student gathers weights collectively in every forward: there every rank
        makes as many passes as the busiest, a rank out of batches repeating one without counting
        it (the training step's lockstep rule)."""
        model, world, names = self.model, self.world, list(self.blocks)
        batches = self.batches(store, records)
        # each batch's summed NLL per condition, then its KL, on the rank that scored it (zeros
        # elsewhere): summed over the ranks (x + 0 is x) and then over the batches in their order,
        # the figures are the same bits on any number of ranks (a batch's records are the data's)
        per_batch = torch.zeros(len(batches), len(names) + 1, dtype=torch.float64, device=self.device)
        kl = teacher is not None
        every = [[[b] for b in range(r, len(batches), world)] for r in range(world)]
        passes = [(group, None, True) for group in every[self.rank]]
        if model.layout.lockstep and batches:
            passes = lockstep_passes(every, self.rank, footprint=len, filler=[0])
        weight = model.student.get_output_embeddings().weight
        lengths = store.length[records]
        progress = Progress(phase, len(records), int(lengths.sum()), show=self.rank == 0 and self.show)
        positions = 0  # positions forwarded on this rank, every condition
        cached = self.cached_context
        prefixes = cached.prefix_forwards if cached is not None else 0
        for (b,), _, counted in passes:
            loaded = load_segments(store, batches[b], self.device)
            segments = [loaded[i] for i in batches[b]]
            own = sum(len(segment.ids) for segment in segments)
            before = positions
            targets = teacher.targets(segments) if kl else None
            for k, name in enumerate(names):
                if name == "ceiling" and cached is not None:
                    # the online KL teacher's rows are the ceiling's rows: read, not run again
                    online = kl and targets.hidden is not None
                    rows = targets.hidden if online else cached.targets(segments).hidden
                    supervised = torch.cat([segment.supervised_ids() for segment in segments])
                    values = [self.nll_fn(rows, weight, supervised, None)]
                    positions += 0 if online else own + len(segments)
                else:
                    # the soft prompt's one forward gives the KL too (the student's rows are the same)
                    fns = [self.nll_fn, self.kl_fn] if kl and name == "soft" else [self.nll_fn]
                    values = model.losses(segments, fns, targets, inserted=self.blocks[name])
                    positions += own + len(segments) * self.block_length(name)
                if counted:
                    per_batch[b, k] = values[0].double()
                    if len(values) > 1:
                        per_batch[b, -1] = values[1].double()
            if kl:
                positions += own  # the teacher's records
            if counted:
                progress.advance(len(segments), positions - before, own)
        if cached is not None:  # the ceiling's context, forwarded once (its header's few tokens aside)
            prefilled = (cached.prefix_forwards - prefixes) * len(cached.context_ids)
            positions += prefilled
            progress.advance(0, prefilled, 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = progress.close()
        if world > 1:
            torch.distributed.all_reduce(per_batch)
        sums = per_batch.sum(dim=0)
        tokens = int(store.supervised_tokens[records].sum())
        nll = {name: float(sums[k]) / tokens for k, name in enumerate(names)}
        nll.setdefault("ceiling", None)
        gap = None
        if nll["ceiling"] is not None and nll["floor"] != nll["ceiling"]:
            gap = (nll["floor"] - nll["soft"]) / (nll["floor"] - nll["ceiling"])
        return dict(
            records=len(records),
            supervised_tokens=tokens,
            nll=nll,
            gap_recovered=gap,
            kl_to_teacher=float(sums[-1]) / tokens if kl else None,
            seconds=seconds,
            tokens_per_second=positions * world / seconds if seconds else None,
            batches=len(batches),
        )

    def block_length(self, name: str) -> int:
        """Positions what condition `name` puts where the prompt goes takes in each record (the
        ceiling's context where it is not read after its cached keys)."""
        block = self.blocks[name]
        return len(block) if block is not None else self.model.inserted_positions

    def batches(self, store: PackedStore, records: np.ndarray) -> list[list[int]]:
        """`records` in the batches every condition is scored over: the widest condition's
        positions per record (read after the cached context, the ceiling adds none), within
        eval.batch_tokens, padding counted where the rows are padded."""
        widest = max(
            (self.block_length(name) for name in self.blocks if name != "ceiling" or self.cached_context is None),
            default=0,
        )
        return scoring_batches(store.length + widest, records, self.batch_tokens, padded=not self.model.packed)


def scoring_batches(positions: np.ndarray, records: np.ndarray, budget: int, padded: bool) -> list[list[int]]:
    """`records` (store indices), longest first, in consecutive batches of at most `budget` of
    `positions` (per record; `padded`: every record of a batch counted at the first's, the
    longest), a record longer than the budget alone. A function of the records alone: the same
    batches on any number of ranks."""
    batches: list[list[int]] = []
    used = 0
    for record in sorted((int(r) for r in records), key=lambda r: (-int(positions[r]), r)):
        size = int(positions[batches[-1][0]]) if padded and batches else int(positions[record])
        if batches and used + size <= budget:
            batches[-1].append(record)
            used += size
        else:
            batches.append([record])
            used = int(positions[record])
    return batches


def batch_tokens(config: Config, device: torch.device) -> int:
    """eval.batch_tokens, or its default for `device` (the schema says why they differ)."""
    if config.eval.batch_tokens is not None:
        return config.eval.batch_tokens
    return 16384 if device.type == "cuda" else 2048


def require_batch_fits(model, budget: int, device: torch.device) -> None:
    """Refuse, before any record is scored, an eval.batch_tokens whose forward would not fit the
    device's free memory: one layer's activations over the batch's positions (the stored-activation
    bytes per hidden unit of training's recompute policy, more than a forward alone holds) and its
    attention kernel's transient memory. Off CUDA nothing is budgeted (free_bytes: None), but where
    SPDS_TEST_FREE_BYTES stands in for it."""
    free = free_bytes(device)
    if free is None:
        return
    hidden = model.student.config.hidden_size
    per_position = hidden * ACTIVATION_BYTES_PER_HIDDEN["own"]

    def need(positions: int) -> float:
        return positions * per_position + model.attention.memory(positions, positions, model.packed)[1]

    if need(budget) > 0.9 * free:
        fits = budget
        while fits > 1 and need(fits) > 0.9 * free:
            fits //= 2
        raise SpdsError(
            f"eval.batch_tokens: a forward over {budget} positions needs about {need(budget) / 2**30:.1f} GiB, and "
            f"the {device.type.upper()} has {free / 2**30:.1f} GiB free: set eval.batch_tokens to at most {fits}"
        )


def plot(metrics_path: Path, nll: dict, target: Path) -> str | None:
    """Training loss per update beside the three NLLs; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (curve, bars) = plt.subplots(1, 2, figsize=(10, 4))
    if metrics_path.exists():
        lines = [metric for _, metric in read_metrics(metrics_path)]
        curve.plot([m["update"] for m in lines if "loss" in m], [m["loss"] for m in lines if "loss" in m])
    curve.set(title="training loss (loss.objective per supervised token)", xlabel="update", ylabel="loss")
    names = [n for n in ("floor", "soft", "ceiling") if nll.get(n) is not None]
    values = [nll[n] for n in names]
    bars.bar(names, values, color=["#999999", "#3366cc", "#33aa55"][: len(names)])
    spread = max(values) - min(values) or 1.0
    bars.set_ylim(min(values) - spread, max(values) + spread / 2)  # the differences are the point
    for x, value in enumerate(values):
        bars.annotate(f"{value:.4f}", (x, value), ha="center", va="bottom")
    bars.set(title="held-out NLL per response token", ylabel="NLL")
    figure.tight_layout()
    with atomic_path(target) as temporary:
        figure.savefig(temporary, format="png")
    plt.close(figure)
    return str(target)
