"""The teacher a distillation objective matches (loss.objective kl or mix), at every supervised token.

context (online)  The frozen student itself, with the context's tokens where the soft prompt
                  goes: what the soft prompt is trained to stand in for. Its hidden states at
                  the response positions reach the loss, which computes their logits chunk by
                  chunk (never [T, V] at once).
top_k (offline)   The top-k log-probabilities the candidate rows carry (written by spds generate,
                  or by another model), packed beside the tokens; the rest of the teacher's mass
                  is one bucket.

Two ways to run the online teacher, the same numbers (tested against a plain forward):

batched            (loss.reuse_context_kv false) The whole sequence x[:a] ++ context ++ x[a:],
                   the records of a pass laid out like the student's (padded rows or packed), on
                   the student's attention kernels.
reuse_context_kv   (the default) The context's keys and values computed once. The tokens before
                   the insertion point are the chat template's system header (the same for every
                   record), the context is the same, and the student is frozen: the keys and
                   values of x[:a] ++ context[:-1] are computed on first use of that prefix and
                   kept, and the pass's records of one prefix run end to end in one forward, each
                   as context[-1:] ++ x[a:] (its first row predicts x[a], so every response
                   position is a row of its own output) attending to the cached keys and to itself
                   (shared_keys.packed_after_cached; one forward per record for a student on its
                   own attention, or with sliding windows or soft caps). The prefix's own keys and
                   values are put back after each forward. It computes about a quarter fewer
                   positions on the length mix (4k context); its KL step runs 1.00-1.05x the
                   batched teacher's speed on H200 (bench/RESULTS.md).

Across epochs (loss.teacher_memo_gib > 0) each record's teacher states are kept on the host after
its first visit: the frozen student and the fixed context make them a pure function of the record,
so a later visit costs a host-to-device copy instead of a forward. With a memo each record's
teacher pass runs alone, so its bits do not depend on the batch it arrives in and a resumed run
(whose memo starts empty) recomputes exactly what the straight run kept.

A student sharded over the ranks (ZeRO-3, fsdp) gathers its weights collectively in every
forward, and its ranks must make the same calls: there the teacher always runs batched, and
keeps no memo (the config check refuses one).
"""

from __future__ import annotations

import inspect
from typing import Protocol

import torch

from spds.contract.config import Config
from spds.data.chat import encode_text
from spds.data.context import context_text
from spds.data.packed import PackedStore
from spds.data.preflight import require_context_fits
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError
from spds.kernels.attention import windowed_layers
from spds.model.loss import TeacherTargets
from spds.model.recompute import recompute_first
from spds.model.soft_prompt import Segment, SoftPromptModel, packed_keywords


class Teacher(Protocol):
    """What the training step and eval ask of a teacher: its targets for the segments of a pass."""

    def targets(self, segments: list[Segment]) -> TeacherTargets: ...


class ContextTeacher:
    def __init__(
        self,
        model: SoftPromptModel,
        context_ids: torch.Tensor,
        max_prefixes: int = 4,
        reuse_context: bool = True,
        memo_gib: float = 0.0,
    ):
        if len(context_ids) < 1:
            raise SpdsError("loss.teacher 'context' needs a non-empty context (context.text or context.file)")
        self.model, self.context_ids = model, context_ids
        self.caches: dict[bytes, tuple] = {}  # prefix ids -> (the cache, its length, its own keys and values)
        self.max_prefixes = max_prefixes
        self.reuse_context = reuse_context  # loss.reuse_context_kv; False: the whole sequence, batched
        self.prefix_forwards = 0  # how many times a prefix was computed (the benchmark and tests read it)
        self.embedded = None
        # loss.teacher_memo_gib: record index -> its teacher states on the host, kept after the
        # first visit (the teacher is a pure function of the record: frozen student, fixed context)
        self.memo: dict[int, torch.Tensor] = {}
        self.memo_budget, self.memo_bytes = memo_gib * 2**30, 0
        self.record_forwards = 0  # records the teacher ran over (the tests and the benchmark read it)
        # transformers renamed past_key_values to cache (5.2x); both name the same object.
        parameters = inspect.signature(model.student.base_model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @torch.no_grad()
    def context_embeddings(self) -> torch.Tensor:
        """The context's token embeddings: the student is frozen, so once (on first use, when every
        rank of a sharded student asks alike)."""
        if self.embedded is None:
            self.embedded = self.model.student.get_input_embeddings()(self.context_ids)
        return self.embedded

    @torch.no_grad()
    def targets(self, segments: list[Segment]) -> TeacherTargets:
        recompute_first(self.model.student, 0)  # nothing to recompute without a backward
        if self.memo_budget:
            return TeacherTargets(hidden=torch.cat([self.remembered(segment) for segment in segments]))
        return TeacherTargets(hidden=self.computed(segments))

    def computed(self, segments) -> torch.Tensor:
        """The teacher's rows for `segments`, run now: batched, or each against the cached context."""
        self.record_forwards += len(segments)
        if self.model.layout.lockstep or not self.reuse_context:
            return self.model.response_states(segments, inserted=self.context_embeddings())[0]
        return self.cached_rows(segments)

    def remembered(self, segment) -> torch.Tensor:
        """One record's teacher states: from the memo, or computed alone (so that its bits do not
        depend on the batch it arrives in) and kept while the budget lasts."""
        held = self.memo.get(segment.index)
        if held is not None:
            return held.to(segment.ids.device, non_blocking=True)
        rows = self.computed([segment])
        if segment.index >= 0 and self.memo_bytes + rows.nbytes <= self.memo_budget:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            host.copy_(rows)  # synchronous: the host copy is complete before anyone reads it
            self.memo[segment.index], self.memo_bytes = host, self.memo_bytes + rows.nbytes
        return rows

    def cached_rows(self, segments) -> torch.Tensor:
        """The teacher's rows of `segments`, each record run after its prefix's cached keys and
        values: the records of one prefix packed end to end in one forward where spds's attention
        runs the student (shared_keys.packed_after_cached), else one forward per record."""
        rows = {}
        for group in self.by_prefix(segments):
            if self.packs():
                outputs = self.packed_forward(group)
            else:
                outputs = [self.forward_after_prefix(segment) for segment in group]
            for segment, hidden in zip(group, outputs):
                # Row r predicts x[a + r] (row 0 is the context's last token): token x[t] is row t - a.
                rows[id(segment)] = segment.supervised_rows(hidden, 1 - segment.insert_at)
        return torch.cat([rows[id(segment)] for segment in segments])

    @staticmethod
    def by_prefix(segments) -> list[list[Segment]]:
        """`segments` grouped by the ids before their insertion point (the chat template's system
        header: one group, unless token rows place the prompt elsewhere), in first-seen order."""
        groups: dict[bytes, list[Segment]] = {}
        for segment in segments:
            groups.setdefault(segment.header_key, []).append(segment)
        return list(groups.values())

    def prefix(self, segment):
        """(the cache of x[:a] ++ context[:-1], its length, each layer's own keys and values) for
        `segment`'s prefix, computed on first use and kept."""
        key = segment.header_key
        if key not in self.caches:
            if len(self.caches) >= self.max_prefixes:  # token rows may place the prompt anywhere: stay bounded
                self.caches.pop(next(iter(self.caches)))
            embed = self.model.student.get_input_embeddings()
            prefix = torch.cat([embed(segment.ids[: segment.insert_at]), self.context_embeddings()[:-1]])
            cache = self.forward(prefix, start=0, cache=None)[1]
            prefix_states = [(layer.keys, layer.values) for layer in cache.layers]
            self.caches[key] = (cache, len(prefix), prefix_states)
            self.prefix_forwards += 1
        return self.caches[key]

    def record_embeddings(self, segment) -> torch.Tensor:
        """context[-1:] ++ embed(x[a:]): what runs after the cached prefix for one record."""
        own = self.model.student.get_input_embeddings()(segment.ids[segment.insert_at :])
        return torch.cat([self.context_embeddings()[-1:], own])

    def packs(self) -> bool:
        """Whether a prefix's records run packed in one forward: spds's attention runs the student
        (an sdpa student) and no layer has a sliding window or a soft cap (their kernels take no
        shared keys)."""
        model = self.model
        return (
            model.kernel_choice is not None
            and not any(windowed_layers(model.student.config))
            and not model.attention.materialised
        )

    def forward_after_prefix(self, segment) -> torch.Tensor:
        """The final hidden states of one record after its cached prefix."""
        cache, cached, prefix_states = self.prefix(segment)
        hidden = self.forward(self.record_embeddings(segment), start=cached, cache=cache)[0]
        self.crop(cache, prefix_states)
        return hidden

    def packed_forward(self, group: list[Segment]) -> list[torch.Tensor]:
        """The final hidden states of each record of `group` (one prefix) after the cached prefix, in
        one forward: the records end to end in one row, each at positions cached.. and attending to
        the prefix and to itself (causal), nothing of the others."""
        cache, cached, prefix_states = self.prefix(group[0])
        joined = [self.record_embeddings(segment) for segment in group]
        lengths = [len(j) for j in joined]
        self.model.use_kernel(cached + max(lengths), packed=True)
        output = self.model.student.base_model(
            inputs_embeds=torch.cat(joined)[None],
            use_cache=True,
            **packed_keywords(lengths, joined[0].device, first_position=cached),
            **{self.cache_argument: cache},
        )
        self.crop(cache, prefix_states)
        return list(output.last_hidden_state[0].split(lengths))

    @staticmethod
    def crop(cache, prefix_states) -> None:
        """Back to the prefix alone for the next forward. A layer's update concatenates into a new
        tensor, so the prefix's own keys and values were never written to: put them back."""
        for layer, (keys, values) in zip(cache.layers, prefix_states):
            layer.keys, layer.values = keys, values

    def forward(self, embeddings: torch.Tensor, start: int, cache):
        """(final hidden states, the cache) of `embeddings` at positions start.., after `cache`."""
        base = self.model.student.base_model
        positions = torch.arange(start, start + len(embeddings), device=embeddings.device)[None]
        # Against cached keys, transformers would build the causal mask as a [queries, keys] tensor
        # (1.2 GB for a 32k record after a 4k context), which no flash kernel takes. spds's attention
        # (spds/kernels/attention.py) needs none: its queries are causal from the lower right. A forward
        # alone is deterministic on any kernel (no backward, no atomics).
        self.model.use_kernel(start + len(embeddings))
        output = base(
            inputs_embeds=embeddings[None], position_ids=positions, use_cache=True, **{self.cache_argument: cache}
        )
        returned = getattr(output, "cache", None)
        return output.last_hidden_state[0], returned if returned is not None else output.past_key_values


class TopKTeacher:
    """The packed top-k log-probabilities of each segment's supervised tokens."""

    def targets(self, segments: list[Segment]) -> TeacherTargets:
        return TeacherTargets(
            top_ids=torch.cat([s.top_ids for s in segments]), top_logprobs=torch.cat([s.top_logprobs for s in segments])
        )


def teacher_kind(config: Config, store: PackedStore) -> str:
    """loss.teacher resolved against the packed data: auto is top_k when the store holds them."""
    loss_settings, has_top_k = config.loss, store.top_k > 0
    kind = loss_settings.teacher_for_store(has_top_k)
    if kind == "top_k" and not has_top_k:
        raise SpdsError(
            f"loss.teacher is 'top_k' but {store.directory} holds no top-k log-probabilities (the "
            "candidate rows carry none: spds generate writes them with generate.top_k_logprobs > 0)"
        )
    if kind == "top_k" and loss_settings.kl.temperature != 1.0:
        raise SpdsError(
            "loss.kl.temperature must be 1 with a top_k teacher: its log-probabilities were written at "
            "the teacher's own temperature, and the mass outside the top k cannot be re-tempered"
        )
    return kind


def build_teacher(config: Config, model: SoftPromptModel, store: PackedStore, memo: bool = False) -> Teacher:
    """The teacher whose targets `model`'s loss matches (loss.teacher against the packed data);
    `memo`: keep the online teacher's states per record within loss.teacher_memo_gib (training,
    where records come back). The step asks it for each pass's targets and hands them to the model."""
    kind = teacher_kind(config, store)
    if kind == "top_k":
        return TopKTeacher()
    text = context_text(config)
    if not text:
        raise SpdsError(
            "loss.teacher 'context' needs the context: set context.text or context.file "
            "(or give the candidate rows top-k log-probabilities for an offline teacher)"
        )
    ids = encode_text(load_tokenizer(config), text)
    require_context_fits(
        config, len(ids), int(store.length.max(initial=0)), "the online teacher (loss.teacher context)"
    )
    return ContextTeacher(
        model,
        torch.tensor(ids, device=model.prompt.device),
        reuse_context=config.loss.reuse_context_kv,
        memo_gib=config.loss.teacher_memo_gib if memo else 0.0,
    )
