"""loss.on_policy: a share of each update's rows answered by the student itself.

Off-policy distillation trains the prompt on the teacher's answers; at use the student continues
its own tokens, and where those drift from anything the teacher wrote nothing trained it. Here,
at every update:

  * `chosen`: round(fraction x rows) of the global batch's records, picked by (optim.seed,
    update) alone, so every rank and every world size picks the same;
  * `Sampler.answers`: each chosen record's question side (its ids before the answer it trains)
    is answered by the student with the soft prompt as it stands, spliced where training splices
    it, on spds's decoder (spds/generation/decode.py: the chat template's header and the prompt computed once
    as a shared prefix, CUDA graphs on GPU). Every rank samples all the chosen records, in one
    batch with one seed: the same bits on every rank whatever the deal, at the cost of sampling
    the whole share on each (the decoder is fast where the student's forward and backward are not);
  * the record's answer is replaced by the sample (the end token closes it, as the teacher's did),
    and the step runs as for any row: the online teacher (the student with the context) scores
    those tokens and the loss is loss.kl's divergence; the normaliser is the global supervised
    token count with the sampled tokens in it.

The samples are a function of (optim.seed, update, the prompt at that update): a resumed run
restores the prompt bit-exactly and samples the same. Rank 0 appends them to on-policy.jsonl
(update, record, the sampled ids), which a resumed run cuts back like metrics.jsonl.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from spds.contract.settings import OnPolicySettings
from spds.fsio import sha256_json
from spds.generation.decode import Decoder
from spds.model.soft_prompt import Segment, SoftPromptModel, load_segments

SAMPLING_SEED = 0x0_5A3D  # kept apart from the seeds of the data order and of generate


def chosen(batch: list[int], fraction: float, seed: int, update: int) -> list[int]:
    """The records of a global batch whose answers the student writes at `update`: a seeded choice
    of round(fraction x len(batch)) of its distinct records, in ascending order."""
    records = sorted(set(int(i) for i in batch))
    count = min(len(records), round(fraction * len(batch)))
    generator = random.Random(f"spds on-policy {seed} {update}")  # str seeds: the same on every Python 3
    return sorted(generator.sample(records, count))


@dataclass
class Samples:
    segments: dict[int, Segment]  # record -> the record with its answer replaced
    ids: dict[int, list[int]]  # record -> the sampled answer's ids (its closing end token included)
    added_tokens: int  # supervised tokens over the global batch, sampled minus the answers replaced
    seconds: float

    def metric(self) -> dict:
        tokens = sum(len(ids) for ids in self.ids.values())
        return dict(
            rows=len(self.ids),
            sampled_tokens=tokens,
            mean_length=tokens / len(self.ids) if self.ids else 0.0,
            seconds=self.seconds,
            samples_sha256=sha256_json({str(r): ids for r, ids in self.ids.items()}),
        )


class Sampler:
    """The student's answers with the current soft prompt, on spds's decoder. The decoder runs the
    training model's own frozen weights under its attention for the length of `answers` (the
    attention implementation is switched and put back: transformers reads it at every forward)."""

    def __init__(
        self, settings: OnPolicySettings, model: SoftPromptModel, end_ids: list[int], seed: int, vocabulary: int
    ):
        self.settings, self.model, self.seed = settings, model, seed
        student = model.student
        own = student.config._attn_implementation
        self.decoder = Decoder(student, end_ids, end_ids[0], vocabulary=vocabulary)  # only ids the tokenizer has
        self.implementations = (own, student.config._attn_implementation)
        student.config._attn_implementation = own

    def for_step(self, store, step, device: torch.device) -> Samples:
        """The update's on-policy rows: the chosen records of its global batch, answered."""
        picked = chosen(step.batch.tolist(), self.settings.fraction, self.seed, step.update)
        segments = load_segments(store, picked, device)
        began = time.monotonic()
        answered = self.answers(segments, step.update)
        times = Counter(int(i) for i in step.batch)  # a record twice in a batch counts twice
        added = sum(times[r] * (len(answered[r]) - segments[r].supervised_tokens) for r in picked)
        replaced = {r: with_answer(segments[r], answered[r]) for r in picked}
        return Samples(replaced, answered, added, time.monotonic() - began)

    @torch.no_grad()
    def answers(self, segments: dict[int, Segment], update: int) -> dict[int, list[int]]:
        """The student's answer to each record of `segments` (all sharing the chat template's
        header before the prompt), in one batch with the update's seed."""
        groups: dict[bytes, list[int]] = {}  # by the ids before the prompt (token rows may differ)
        for record in sorted(segments):
            groups.setdefault(segments[record].header_key, []).append(record)
        embed = self.model.student.get_input_embeddings()
        config = self.model.student.config
        own, decoding = self.implementations
        answered = {}
        config._attn_implementation = decoding
        try:
            for number, records in enumerate(groups.values()):
                first = segments[records[0]]
                header = embed(first.ids[: first.insert_at])
                block, cached = self.model.block_of(None)  # a kv prompt: nothing there, read as a cache
                prefix = torch.cat([header, block.detach().to(header.dtype)])
                questions = [segments[r].ids[first.insert_at : answer_start(segments[r])].tolist() for r in records]
                sampled = self.decoder.answer_with_top_k(
                    questions,
                    self.settings.max_new_tokens,
                    self.settings.temperature,
                    1.0,
                    self.seed + SAMPLING_SEED + update * 1009 + number,
                    0,
                    prefix_embeds=prefix,
                    prefix_kv=self.model.prompt.detach() if cached else None,
                )[0]
                answered.update(zip(records, sampled))
        finally:
            config._attn_implementation = own
        return answered


def with_answer(segment: Segment, answer: list[int]) -> Segment:
    """`segment` with its last answer replaced by `answer`, the only supervised run. Index -1: not
    the stored record (the online teacher keeps no memo of it)."""
    start = answer_start(segment)
    new = torch.tensor(answer, dtype=segment.ids.dtype, device=segment.ids.device)
    return replace(segment, ids=torch.cat([segment.ids[:start], new]), prefix_tokens=start, index=-1, spans=None)


def answer_start(segment: Segment) -> int:
    """Where the record's last supervised answer starts: the student answers from there (earlier
    turns of a conversation stay as written, unsupervised)."""
    return segment.runs[-1][0]
