"""spds generate: the teacher answers each question with the context; rows for spds prepare.
The questions come from generate.questions, or, with generate.self_study, the teacher writes them
itself from chunks of the context (spds/generation/self_study.py; `SelfStudy` below runs that here).

The teacher (a local model, by default the student) sees the context where the soft prompt will
go: as the system message ([system: context] + the question's messages), or, for placement
first_user and templates without a system role (Gemma 2), at the start of the first user turn
("context\n\nquestion", as Gemma 3's and Mistral's templates fold a system text). The row
records what the *student* will see: the question rendered by the student's chat template
WITHOUT the context, then the teacher's response ids, ending in an end-of-turn token; a question of
several user turns is answered turn by turn and its row supervises every answer. Requests
are batched in a fixed order with a seed per batch and decoded by spds/generation/decode.py (the context's
keys and values computed once for every batch), so a run is deterministic, and resuming
(request_ids already in the output are skipped; a half-written last line is cut) regenerates
only what is missing, with the same result.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pickle
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spds.contract.config import Config
from spds.contract.kinds import FACT, RECITE
from spds.contract.settings import GenerateSettings, SelfStudySettings
from spds.data.chat import encode_text, end_token_ids, render, render_chat_row, tokenizer_identity, with_context
from spds.data.context import context_digest, context_text, corpus_of
from spds.data.sources import read_questions
from spds.data.student_files import decodable_ids, load_tokenizer
from spds.errors import SpdsError
from spds.fsio import sha256_file
from spds.generation.batches import Output, Ranks
from spds.generation.decode import Decoder, common_prefix
from spds.generation.self_study import (
    EXCERPT,
    Chunk,
    FactLine,
    Lines,
    Recital,
    Seed,
    Slices,
    coverage,
    fact_line,
    fact_messages,
    kinds_of,
    lines_asked,
    plan,
    recital,
    written_question,
)
from spds.generation.teacher_window import require_ready
from spds.kernels.attention import head_dim_of, kernels_in, require_fa4
from spds.model.student import apply_liger_kernels, unsafe_weights
from spds.stop import StopRequest, fault_point, pace_point, peer_lost


def load_teacher(path: Path, dtype: str, device: torch.device, trust_remote_code: bool = False):
    """The teacher for decoding, loaded with transformers' eager attention, which every model
    has: spds.generation.decode.Decoder replaces it with its own in every layer before the first forward."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            local_files_only=True,
            dtype=getattr(torch, dtype),
            attn_implementation="eager",
            trust_remote_code=trust_remote_code,  # explicit: unset, transformers asks on the terminal
        )
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        raise unsafe_weights(error, path) or error
    return model.to(device).eval()


def fa4_named(setting, teacher, device: torch.device) -> bool:
    """Whether the decode step's shared part runs on FlashAttention-4: where student.attention_kernel
    names it, as training would, and refused as training refuses it where it cannot run."""
    if "fa4" not in kernels_in(setting):
        return False
    require_fa4(head_dim_of(teacher.config), device)
    return True


def generate(config: Config, log=print, started: float | None = None, adopt: bool = False) -> dict:
    """Write the teacher's rows for generate.questions (appending to generate.output, skipping the
    rows it already holds), on every rank a launcher started (spds/generation/batches.py).
    `started`: the process's start (time.time()), for the start-up split. `adopt`: an output with
    rows and no provenance record is taken as written under these settings (Output.own)."""
    entered = time.time()
    settings = config.generate
    if not settings.questions and not settings.self_study:
        raise SpdsError("generate.questions is not set: name a questions file, or set generate.self_study")
    context = context_text(config)
    if not context or not context.strip():
        raise SpdsError("context.text or context.file must hold the system prompt to distill (it is empty)")
    tokenizer = load_tokenizer(config)
    scaffold = require_ready(config, tokenizer)  # before the first batch: refused rows cost no hour
    end_ids = end_token_ids(tokenizer, config.data.end_tokens)
    study = SelfStudy.of(settings, tokenizer, config) if not settings.questions else None
    questions = study.questions() if study else read_questions(config.resolve(settings.questions))
    requests = [
        dict(q, request_id=f"{q['question_id']}-s{s}", sample_index=s)
        for q in questions
        for s in range(settings.samples_per_question)
    ]
    key = slice_key(config, study)  # a corpus past the window: the slice each request's teacher reads
    if key and not study:  # a question's row records its slice, as a conversation's does (SelfStudy.asked)
        requests = [dict(r, slice=corpus_of(config).record(key(r))) for r in requests]
    batches = batched(requests, settings.batch_size)
    texts = functools.lru_cache(maxsize=64)(lambda index: corpus_of(config).text(index))  # read once a slice
    context_of = (lambda request: texts(key(request))) if key else None
    ranks = Ranks.join(config.distributed.timeout_minutes)
    ids = [[r["request_id"] for r in batch] for batch in batches]
    provenance = output_provenance(config, tokenizer)
    with Output(config.resolve(settings.output), ids, ranks, provenance, adopt) as output:
        left = output.start()  # batch -> its rows already in the output
        checked = time.time()
        asking = load_asking(config, tokenizer, scaffold, end_ids, ranks.device, context_of)
        loaded = time.time()
        splits = [("imports and config", entered - started)] if started else []
        splits += [("tokenizer and checks", checked - entered), ("loading the teacher", loaded - checked)]
        if ranks.rank == 0:
            log("start-up " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in splits))
            if corpus_of(config) is not None:
                log(corpus_of(config).summary())
        began = time.perf_counter()
        mine = {number: left[number] for number in sorted(left)[ranks.rank :: ranks.world]}
        try:
            answered = answer_batches(mine, batches, asking, study, end_ids, output, config.output_dir)
            counts = output.finish()
        except BaseException as error:  # another rank killed: one line, not the backend's traceback
            then = "The batches written are whole: the same command completes the same rows on any number of ranks."
            lost = peer_lost(error, config.output_dir, ranks.rank, then)
            if lost:
                raise lost from None
            raise
    ranks.leave()
    if ranks.rank == 0:
        StopRequest.current().answered()  # the run stopped or ended: the request must not stop the next launch
        report(output, asking, study, dict(counts, answered=answered), log, began)
    return dict(counts, output=str(output.path))


def slice_key(config: Config, study):
    """Which of a corpus's slices a request's teacher reads, where the corpus is past the window:
    a self-study conversation's chunk's, or the slice holding a question's `doc` (the first slice,
    the corpus truncated to the window, for a question that names none). None: one context."""
    corpus = corpus_of(config)
    if corpus is None or corpus.whole:
        return None
    if study:
        return lambda request: study.slice_of(request["conversation"])

    def holding(request: dict) -> int:
        if "doc" not in request:
            return 0
        index = corpus.holding(request["doc"])
        if index is None:
            raise SpdsError(
                f"question {request['question_id']!r}: doc {request['doc']!r}: rule 'a document of the corpus': "
                "context.documents holds no document of that id"
            )
        return index

    return holding


def batched(requests: list[dict], size: int) -> list[list[dict]]:
    """The requests in batches of `size`, in order. Over a corpus's slices the requests come slice
    by slice, and a batch may hold rows of several: each row reads its own slice's keys and values,
    computed once per slice (Decoder.answer_with_top_k's prefixes), so a slice with fewer
    requests than a batch leaves no batch short."""
    return [requests[i : i + size] for i in range(0, len(requests), size)]


def output_provenance(config: Config, tokenizer) -> dict:
    """What decides the bytes of generate.output's rows, recorded beside it (spds/generation/
    batches.py's Output): every generate setting but the output's own name (batch_size among them:
    batch k samples with seed + k, so another batch size gives other rows), the context, the
    questions file, the teacher, its tokenizer and template, and the dtype and kernels it decodes
    in. The number of ranks is not in it: any number writes the same bytes."""
    settings = dataclasses.asdict(config.generate)
    settings.pop("output")
    settings.pop("teacher_path")
    questions = config.resolve(config.generate.questions) if config.generate.questions else None
    teacher = config.teacher_path
    return {
        **{f"generate.{key}": value for key, value in settings.items()},
        "context_sha256": context_digest(config),
        "questions_sha256": sha256_file(questions) if questions else None,
        "teacher": str(teacher),
        "teacher_config_sha256": sha256_file(teacher / "config.json") if (teacher / "config.json").is_file() else None,
        "tokenizer": tokenizer_identity(tokenizer),
        "chat_template_kwargs": config.data.chat_template_kwargs,
        "end_tokens": config.data.end_tokens,
        "student.dtype": config.student.dtype,
        "student.liger_kernels": config.student.liger_kernels,
        "cpu_threads": torch.get_num_threads(),  # recorded, not compared (batches.py's NOT_COMPARED)
        # batch k's rows (and so their samples) since a batch may hold several of a corpus's slices
        "batches": BATCHING,
    }


BATCHING = "batch_size rows in order, a corpus's slices shared within a batch"


def answer_batches(
    mine: dict[int, list[str]],
    batches: list[list[dict]],
    asking: Asking,
    study,
    end_ids: list[int],
    output: Output,
    stop_requests: Path,
) -> int:
    """This rank's batches (number -> its rows already in the output), each answered and written
    whole (`Output.write`); batch k samples with seed + k whatever was done before, so a resumed
    or shared run writes what a straight one would. Stops after the batch in flight when asked
    (spds stop, a signal: spds/stop.py). Returns the batches answered."""
    from tqdm import tqdm

    stop = StopRequest.current()
    stop.requests = stop_requests  # where spds stop and the launch scripts ask; a stale request is ignored
    settings, tokenizer, answered = asking.settings, asking.tokenizer, 0
    for number in tqdm(mine, desc="generate", disable=output.ranks.rank != 0 or not os.isatty(2)):
        pace_point()
        batch = batches[number]
        if study:  # the teacher writes the batch's user messages first
            batch = study.asked(batch, asking, end_ids)
        turns = asking.answer_turns(batch, seed=settings.seed + number)
        output.write(
            number,
            [
                json.dumps(teacher_row(tokenizer, request, asked, end_ids, asking.template_kwargs)) + "\n"
                for request, asked in zip(batch, turns)
                if request["request_id"] not in mine[number]
            ],
        )
        answered += 1
        fault_point("kill-after-batch", number)
        if stop.vote():
            break
    return answered


def report(output: Output, asking: Asking, study, counts: dict, log, began: float) -> None:
    """Rank 0's word when the ranks are done: the rows written, the batches left (a stopped run),
    and where its time went."""
    decoder, ranks = asking.decoder, output.ranks
    graphs = f"; the decode step ran as a CUDA graph in {decoder.captured} batches" if decoder.graphs else ""
    by = f" by {ranks.world} ranks" if ranks.world > 1 else ""
    log(f"wrote {counts['written']} rows{by} ({counts['skipped']} were already there) to {output.path}{graphs}")
    if counts["left"]:
        log(
            f"stopped with {counts['left']} of {len(output.batches)} batches left (answered ones wait in "
            f"{output.directory}): run the same command again to complete the same rows"
        )
    if study:
        log(study.coverage())
    seconds = time.perf_counter() - began
    if counts["answered"]:  # where the time went: decoding (the decoder's own clock) or the rows around it
        log(
            f"{seconds:.1f} s for rank 0's {counts['answered']} batches: {decoder.seconds:.1f} s decoding "
            f"{decoder.new_tokens} new tokens ({decoder.new_tokens / max(decoder.seconds, 1e-9):.0f} tokens/s), "
            f"{counts['output_seconds']:.2f} s writing and appending batch files, {counts['waited_seconds']:.2f} s "
            "waiting for the other ranks"
        )


def load_asking(
    config: Config, tokenizer, scaffold, end_ids: list[int], device: torch.device, context_of=None
) -> Asking:
    """The teacher loaded on spds's decoder, asked as generate asks it: the context where the
    student's template puts a system message, or in the first user turn where it has none.
    `context_of`: a request's slice of a corpus past the window, which its teacher reads instead."""
    teacher = load_teacher(config.teacher_path, config.student.dtype, device, config.student.trust_remote_code)
    if config.student.liger_kernels:  # the model's own RMSNorm, RoPE and MLP: a dozen small kernels each a step
        apply_liger_kernels(teacher)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    fa4 = fa4_named(config.student.attention_kernel, teacher, device)
    decoder = Decoder(
        teacher, end_ids, pad, fa4=fa4, vocabulary=decodable_ids(tokenizer, teacher.config.get_text_config().vocab_size)
    )
    in_user_turn = config.soft_prompt.placement == "first_user" or scaffold.system_role == "none"
    return Asking(
        decoder,
        tokenizer,
        context_text(config),
        in_user_turn,
        config.generate,
        config.data.chat_template_kwargs,
        context_of,
    )


def teacher_row(tokenizer, request: dict, asked: list[Turn], end_ids: list[int], kwargs: dict) -> dict:
    """One candidate row from the teacher's turns: the token form, with each turn's top-k
    log-probabilities (generate.top_k_logprobs) in the order of the row's supervised tokens, and
    what self-study asked (chunk, kind) when it wrote the question."""
    responses = [turn.response for turn in asked]
    row = (
        candidate_row(tokenizer, request, responses[0], end_ids, kwargs)
        if len(asked) == 1
        else multi_turn_row(tokenizer, request, responses, end_ids, kwargs)
    )
    if asked[0].top is not None:
        row["top_logprobs"] = {k: [v for turn in asked for v in turn.top[k]] for k in ("ids", "logprobs")}
    if "self_study" in request:
        row["self_study"] = request["self_study"]
    if "slice" in request:
        row["slice"] = request["slice"]
    return row


TURN_SEED_STRIDE = 1_000_003  # turn t of a batch samples with seed + t * stride: its own stream, reproducible


def user_turns(messages: list[dict]) -> list[int]:
    return [i for i, message in enumerate(messages) if message["role"] == "user"]


@dataclass
class Turn:
    """The teacher's answer to one user turn: its ids (ending with an end token) and, with
    generate.top_k_logprobs, its top-k at each of them (Decoder.answer_with_top_k)."""

    response: list[int]
    top: dict | None = None


@dataclass
class Asking:
    """How every batch of a run is asked: the teacher's decoder and tokenizer, the context and
    where it goes (the system message, or ahead of the first user turn), the sampling settings,
    and the chat template's keyword arguments."""

    decoder: Decoder
    tokenizer: Any
    context: str
    context_in_user_turn: bool
    settings: GenerateSettings
    template_kwargs: dict
    # a request -> the context its teacher reads (a corpus's slice), None: the one context
    context_of: Any = None
    readings: dict = dataclasses.field(default_factory=dict, repr=False)  # context -> its Asking

    def __post_init__(self):
        # The tokens every asked prompt opens with, through the context: where two questions'
        # renders part. The decoder shares at most these, so that every batch reads the same
        # prefix's keys and values, computed once and the same way on every rank
        # (spds/generation/batches.py), not a prefix that reaches into some batch's questions.
        probes = [self.prompt([{"role": "user", "content": text}]) for text in ("A", "Z?")]
        self.context_end = common_prefix(probes)

    def reading(self, context: str) -> Asking:
        """Asked with another context (a corpus's slice): the same decoder, its shared prefix kept
        per context (Decoder.shared_states), its bound computed once per context."""
        if context == self.context:
            return self
        if context not in self.readings:
            self.readings[context] = dataclasses.replace(self, context=context, context_of=None, readings={})
        return self.readings[context]

    def of(self, request: dict) -> Asking:
        """How `request` is asked: with its own slice where the context is a corpus's."""
        return self.reading(self.context_of(request)) if self.context_of else self

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids the teacher reads to answer `messages`: the context placed, the template rendered."""
        asked = with_context(messages, self.context, self.context_in_user_turn)
        return render(self.tokenizer, asked, True, self.template_kwargs)

    def answer(self, batch: list[dict], seed: int) -> list[Turn]:
        """The teacher's answer to each request, at the request's own `temperature` where it has
        one (a self-study kind's), else generate.temperature; a response ends at the first end
        token, which is kept (spds/generation/decode.py)."""
        asked = [self.of(r) for r in batch]  # rows of several slices: each shares its own slice's prefix
        prompts = [a.prompt(r["messages"]) for a, r in zip(asked, batch)]
        sampling = self.settings
        temperatures = [r.get("temperature", sampling.temperature) for r in batch]
        answers, tops = self.decoder.answer_with_top_k(
            prompts,
            sampling.max_new_tokens,
            temperatures,
            sampling.top_p,
            seed,
            sampling.top_k_logprobs,
            shared_within=[a.context_end for a in asked] if self.context_of else self.context_end,
        )
        return [Turn(answer, tops[i] if tops else None) for i, answer in enumerate(answers)]

    def write(self, conversations: list[tuple[list[dict], str]], max_new_tokens: int, seed: int) -> list[str]:
        """Self-study's user messages: for each (messages, opening), the teacher reads the messages
        and writes one message after the opening (spds/generation/self_study.py)."""
        prompts = [
            render(self.tokenizer, messages, True, self.template_kwargs) + encode_text(self.tokenizer, opening)
            for messages, opening in conversations
        ]
        sampling = self.settings
        answers = self.decoder.answer(prompts, max_new_tokens, sampling.temperature, sampling.top_p, seed)
        return [written_question(self.tokenizer.decode(answer[:-1], skip_special_tokens=True)) for answer in answers]

    def scored(self, batch: list[dict]) -> list[Turn]:
        """Requests whose answer is given (`response`: a recital's ids), not sampled: with
        generate.top_k_logprobs, the teacher's top-k at each of its tokens, read with the context
        as a sampled answer's are (Decoder.score)."""
        responses = [r["response"] for r in batch]
        k = self.settings.top_k_logprobs
        if not k or not batch:
            return [Turn(response) for response in responses]
        turns = {}
        by_context: dict[int, list[int]] = {}  # a slice's recitals scored together, after its prefix
        for i, request in enumerate(batch):
            by_context.setdefault(id(self.of(request)), []).append(i)
        for rows in by_context.values():
            asking = self.of(batch[rows[0]])
            prompts = [asking.prompt(batch[i]["messages"]) for i in rows]
            tops = self.decoder.score(prompts, [responses[i] for i in rows], k, shared_within=asking.context_end)
            turns.update({i: Turn(responses[i], top) for i, top in zip(rows, tops)})
        return [turns[i] for i in range(len(batch))]

    def answer_turns(self, batch: list[dict], seed: int) -> list[list[Turn]]:
        """For each request, the teacher's answer to each of its user turns, in order: a question
        of several user turns is answered turn by turn, each turn asked with the teacher's earlier
        answers in the conversation (as text). A request with its answer given is only scored."""
        asked = [[] for _ in batch]
        given = [i for i, r in enumerate(batch) if "response" in r]
        for i, turn in zip(given, self.scored([batch[i] for i in given])):
            asked[i].append(turn)
        sampled = [r for r in batch if "response" not in r]
        for turn in range(max((len(user_turns(r["messages"])) for r in sampled), default=0)):
            active = [i for i, r in enumerate(batch) if "response" not in r and len(user_turns(r["messages"])) > turn]
            conversations = [
                conversation_through(batch[i]["messages"], turn, [t.response for t in asked[i]], self.tokenizer)
                for i in active
            ]
            answered = self.answer(
                [dict(batch[i], messages=c) for i, c in zip(active, conversations)], seed + turn * TURN_SEED_STRIDE
            )
            for i, answer in zip(active, answered):
                asked[i].append(answer)
        return asked


def conversation_through(messages: list[dict], turn: int, answers: list[list[int]], tokenizer) -> list[dict]:
    """The question's messages through its `turn`-th user message, each earlier user turn followed
    by the teacher's answer to it."""
    through = user_turns(messages)[turn]
    conversation, answered = [], 0
    for index, message in enumerate(messages[: through + 1]):
        conversation.append(message)
        if message["role"] == "user" and index < through:
            conversation.append({"role": "assistant", "content": tokenizer.decode(answers[answered][:-1])})
            answered += 1
    return conversation


def multi_turn_row(tokenizer, request: dict, responses: list[list[int]], end_ids: list[int], kwargs: dict) -> dict:
    """A token row of a conversation answered turn by turn: the student's view of each turn's
    opening (the template's tokens, without the context) and the teacher's exact answer ids,
    labels on the answers only."""
    ends = set(end_ids)
    ids, labels, before = [], [], []
    for turn, response in enumerate(responses):
        conversation = conversation_through(request["messages"], turn, responses, tokenizer)
        opening = render(tokenizer, conversation, True, kwargs)
        if opening[: len(before)] != before:
            raise SpdsError(
                f"request {request['request_id']}: the chat template renders the conversation's earlier "
                f"turns differently once turn {turn + 1} follows them; ask these questions one turn each"
            )
        new = opening[len(before) :]
        if turn:  # the template's tokens of the previous answer, up to its end token, are the teacher's instead
            end = next((i for i, t in enumerate(new) if t in ends), None)
            if end is None:
                raise SpdsError(
                    f"request {request['request_id']}: the chat template renders the teacher's answer to "
                    f"turn {turn} with no end-of-turn token"
                )
            new = new[end + 1 :]
        if not turn:
            prefix = len(opening)
        ids += new + response
        labels += [-100] * len(new) + response
        before = opening
    text = tokenizer.decode(responses[-1][:-1])
    return dict(
        request_id=request["request_id"],
        question_id=request["question_id"],
        sample_index=request["sample_index"],
        input_ids=ids,
        prefix_tokens=prefix,
        labels=labels,
        supervised_tokens=sum(len(r) for r in responses),
        response_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


def candidate_row(tokenizer, request: dict, response: list[int], end_ids: list[int], kwargs: dict) -> dict:
    """A token-form row: the student's view of the question (no context) + the teacher's response."""
    prompt = render(tokenizer, request["messages"], True, kwargs)
    text = tokenizer.decode(response[:-1])
    return dict(
        request_id=request["request_id"],
        question_id=request["question_id"],
        sample_index=request["sample_index"],
        input_ids=prompt + response,
        prefix_tokens=len(prompt),
        labels=[-100] * len(prompt) + response,
        supervised_tokens=len(response),
        response_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


WRITING_SEED = 1 << 32  # the question-writing batches sample from seeds of their own, past every answer seed


@dataclass
class SelfStudy:
    """generate.self_study's conversations: each one's chunk and seed kind (spds/generation/self_study.py),
    and the user messages the teacher wrote, written in fixed batches of conversations on first
    need, each with its own seed, so a resumed run writes the same ones. With a corpus past the
    window the conversations are numbered slice by slice (a stable order of the plan), so that a
    slice's rows come together and its keys and values are computed once for them."""

    settings: SelfStudySettings
    batch_size: int
    seed: int
    slices: Slices
    corpus: Any  # spds/data/corpus.py's Corpus where the context is one past the window, else None
    seeds: dict[str, Seed]  # seed kind -> instruction and opening
    planned: list[tuple[int, str]]  # (chunk, kind) per conversation, chunks numbered across the slices
    written: dict[int, str]  # conversation -> its user message
    tokenizer: Any
    ordinals: list[int]  # per conversation: how many of its chunk's conversations of its kind come before it

    @classmethod
    def of(cls, settings: GenerateSettings, tokenizer, config: Config) -> SelfStudy:
        study, corpus = settings.self_study, corpus_of(config)
        if corpus is not None and not corpus.whole:
            slices = Slices(tokenizer, corpus.text, len(corpus.slices), study.chunk_tokens)
        else:
            corpus, context = None, context_text(config)
            slices = Slices(tokenizer, lambda _: context, 1, study.chunk_tokens)
        drawn = plan(study.conversations, slices.chunks, study.kinds, settings.seed)
        planned = sorted(drawn, key=lambda pair: slices.holding(pair[0])[0])  # stable: the plan's order within a slice
        ordinals, seen = [], Counter()
        for pair in planned:
            ordinals.append(seen[pair])
            seen[pair] += 1
        return cls(
            study, settings.batch_size, settings.seed, slices, corpus, kinds_of(study), planned, {}, tokenizer, ordinals
        )

    def questions(self) -> list[dict]:
        """The conversations as generate's questions, their messages written later (`asked`)."""
        return [dict(question_id=f"self-study-{i:06d}", conversation=i) for i in range(len(self.planned))]

    def slice_of(self, conversation: int) -> int:
        return self.slices.holding(self.planned[conversation][0])[0]

    def chunk(self, conversation: int) -> tuple[Lines, Chunk]:
        """The lines of the conversation's slice, and its chunk."""
        index, own = self.slices.holding(self.planned[conversation][0])
        lines, chunks = self.slices.read(index)
        return lines, chunks[own]

    def asked(self, batch: list[dict], asking: Asking, end_ids: list[int]) -> list[dict]:
        """The batch's requests with their user message (and what the row records of it); a
        recital's with its answer too (`response`: the recited text as the student's chat template
        renders an answer, through its end-of-turn token), a kind's of
        generate.self_study.temperatures with its `temperature`."""
        for number in sorted({r["conversation"] // self.batch_size for r in batch}):
            if number * self.batch_size not in self.written:
                self.write(number, asking)
        requests = []
        for request in batch:
            i = request["conversation"]
            kind = self.planned[i][1]
            span = self.chunk(i)[1]
            # how the request is answered (its given answer, its own temperature), and what its row records
            answering, recorded = {}, dict(chunk=[span.start, span.end], kind=kind, question=self.written[i])
            if self.corpus is not None:  # the chunk's token offsets are its slice's
                recorded["slice"] = self.corpus.record(self.slice_of(i))
            message = [{"role": "user", "content": self.written[i]}]
            if kind == RECITE:  # the answer as the chat template renders it, to its end-of-turn token
                recited = self.recital(i)
                try:
                    ids, prefix, _ = render_chat_row(
                        self.tokenizer, message, recited.text, end_ids, asking.template_kwargs
                    )
                except ValueError as error:
                    raise SpdsError(f"generate.self_study.kinds.{RECITE}: {error}") from None
                answering["response"] = ids[prefix:]
                recorded["recited"] = [recited.start, recited.end]
            if kind == FACT:
                line = self.fact_line(i)
                recorded["line"] = [line.start, line.end]
            if kind in self.settings.temperatures:
                answering["temperature"] = self.settings.temperatures[kind]
            requests.append(dict(request, messages=message, self_study=recorded, **answering))
        return requests

    def recital(self, conversation: int) -> Recital:
        """Conversation `conversation`'s recital: its chunk's how-many-th recital it is decides
        the line and the phrasing."""
        lines, chunk = self.chunk(conversation)
        return recital(self.tokenizer, lines, chunk, self.ordinals[conversation], self.settings.chunk_tokens)

    def fact_line(self, conversation: int) -> FactLine:
        """Conversation `conversation`'s fact line: its chunk's how-many-th fact question it is
        decides the line."""
        lines, chunk = self.chunk(conversation)
        return fact_line(self.tokenizer, lines, chunk, self.ordinals[conversation], self.settings.chunk_tokens)

    def write(self, number: int, asking: Asking) -> None:
        """The user messages of conversation batch `number`: the teacher reads a chunk and its
        kind's instruction, and writes one (a recital's is its own)."""
        first = number * self.batch_size
        batch = range(first, min(first + self.batch_size, len(self.planned)))
        for i in batch:
            if self.planned[i][1] == RECITE:
                self.written[i] = self.recital(i).question
        conversations = [i for i in batch if self.planned[i][1] != RECITE]
        texts = (
            asking.write(
                [self.writing(i, asking.context_in_user_turn) for i in conversations],
                self.settings.question_max_tokens,
                seed=self.seed + WRITING_SEED + number,
            )
            if conversations
            else []
        )
        for i, text in zip(conversations, texts):
            chunk = self.chunk(i)[1]
            # an empty message cannot be asked: the chunk's first line stands in for it
            self.written[i] = text or f"What does the document say about this: {chunk.text.strip().splitlines()[0]}"

    def writing(self, conversation: int, context_in_user_turn: bool) -> tuple[list[dict], str]:
        """What the teacher reads to write conversation `conversation`'s user message, and what its
        reply opens with: a fact line after the worked examples, or the chunk where the context
        goes and the kind's instruction as the user turn."""
        kind = self.planned[conversation][1]
        if kind == FACT:
            return fact_messages(self.fact_line(conversation).text), ""
        seed = self.seeds[kind]
        excerpt = EXCERPT.format(chunk=self.chunk(conversation)[1].text)
        asked = [{"role": "user", "content": seed.instruction}]
        return with_context(asked, excerpt, context_in_user_turn), seed.opening

    def coverage(self) -> str:
        """How often each chunk and kind was drawn, and how many of the context's lines a fact
        question asks (which slices least), on two lines."""
        names = ["the context"]
        if self.corpus is not None:
            documents = self.corpus.documents
            names = [
                ", ".join(dict.fromkeys(documents[part.document].id for part in piece.parts))
                for piece in self.corpus.slices
            ]
            names = [n if len(n) <= 60 else n[:57] + "..." for n in names]
        drawn = coverage(self.planned, self.slices.chunks, self.slices.count)
        return drawn + "\n" + lines_asked(self.planned, self.slices, names)
