"""Decoding for spds generate: a batch of prompts that share the context, answered token by token.

Every prompt of a generate run is the chat template's opening, the context, then a question:
the same first tokens, thousands of them, in every row. transformers' `generate` computes them
again for every batch and grows its cache by concatenation at every step (each step copies the
whole cache). Here:

  * the prompts' longest common prefix (at most `shared_within` tokens: generate bounds it at the
    context's end, so that every batch shares the same one) is run once and its keys and values
    kept (keyed by the prefix's exact ids, never cut from a longer one: the numbers of a prefix are
    then those of its own forward, whatever ran before, which the byte-identical multi-rank
    generate relies on), and every batch that shares it reads them where they are: they are never
    copied to the rows: a row's cache holds only its question and answer, so how many rows a
    batch holds depends on their own lengths, not on the context's;
  * attention runs in two parts merged by their log-sum-exps (`decode_attention`): over the
    shared prefix, with every row's queries folded into one batch, so its keys are read once per
    step, not once per row; and over each row's own keys. The query heads that share a key/value
    head are folded into its query rows, so grouped-query keys are read as they are. On CUDA the
    shared part runs on cuDNN (or FlashAttention-4, where student.attention_kernel names it), a
    row's own part on a Triton kernel that reads each row's written keys once
    (shared_keys.own_keys_step), and another Triton kernel merges them;
    soft-capped scores (Gemma 2) and the CPU run the same sums in plain PyTorch;
  * a batch may hold rows of several prefixes (eval's views, a corpus's slices: `prefix_of`, or
    `shared_within` one bound a row): its rows are grouped by prefix, each prefix computed once,
    and the shared part runs once per group over that group's rows (`shared_part`);
  * each batch gets one cache allocated once for its whole length ([rows, kv heads, longest
    question + max_new_tokens, head dim] per layer), written in place (`BatchCache`);
  * the questions, of different lengths, are right-aligned, so that every row writes its next
    token at the same index; the holes before a short question are masked; positions (RoPE) count
    only a row's own tokens, as if it had never been padded. The masks go in as 4D tensors (or a
    dict of them per layer kind), which transformers uses as given;
  * a decode step reads and writes only buffers that live as long as the batch (`Step`), so on
    CUDA it is captured once per batch as a CUDA graph and replayed: the model's Python (tens of
    milliseconds a step, more than the GPU's work at these sizes) runs once, not once per token.
    A model whose forward cannot be captured (a host sync inside) decodes eagerly, the same
    numbers, and says so once.
  * with generate.top_k_logprobs, each step's top-k log-probabilities are kept from the logits it
    samples from (`TopK`): an offline teacher's targets at no second pass over the answers.

Deterministic for a given seed: the same batch, on the same device and versions, samples the same
tokens (one torch.Generator per batch, sampling outside the graph; no kernel here accumulates
with atomics in a forward). Over 300 lines with this account of it: the cache, the step and its
graph, and the attention they need are one mechanism, each part shaped by the others.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time

import torch

from spds.errors import SpdsError
from spds.kernels.attention import head_dim_of, install_attention, windowed_layers
from spds.kernels.causal import triton_available
from spds.kernels.shared_keys import (
    attend,
    attend_split,
    fa4_shared_step,
    flash_fits,
    key_splits,
    merge_parts,
    own_keys_step,
)

NAME = "spds_decode"
SCORE_LOGITS_BYTES = 1 << 30  # Decoder.score's fp32 logits of one group of answers


def common_prefix(prompts: list[list[int]]) -> int:
    """The length of the prompts' longest common prefix, leaving every prompt at least its last
    token to run with the batch (the logits of the first answer token come from it)."""
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


@dataclasses.dataclass
class Prefixed:
    """One prefix of a batch: its rows, its length in positions, its keys and values per layer
    ([1, kv heads, length, head dim] each; empty for no prefix), and how many of each of its
    prompts' ids it is (0: it came as embeddings, before the ids)."""

    rows: list[int]
    length: int
    states: list
    covers: int = 0


def regrouped(groups: list[Prefixed], order: list[int]) -> list[Prefixed]:
    """`groups` for the rows in `order` (each row's new index its place there)."""
    at = {row: i for i, row in enumerate(order)}
    return [dataclasses.replace(group, rows=[at[row] for row in group.rows]) for group in groups]


class BatchCache:
    """The keys and values of one batch. The shared prefixes' (`groups`: each prefix's rows and
    its keys and values, per layer [1, kv heads, prefix, head dim]) are computed once for every
    batch that shares them and read in place, never copied to the rows. Each row's own (its
    question, then its answer) live in buffers allocated once and written in place at the cache
    indices `index` (a tensor, so that a captured step writes where the replay says). Offers what
    transformers' decoder layers call on a cache (`update`, `get_seq_length`)."""

    def __init__(self, layers: int, rows: int, capacity: int, device: torch.device, groups=None):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.rows = rows
        self.capacity = -(-capacity // 16) * 16  # the efficient kernel's alignment for the mask's rows
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        # the rows [first, end) that read each prefix's states: one prefix for every row, or several
        # (Decoder.answer_with_top_k's `prefix_of`), their rows consecutive; a row of an empty
        # prefix reads nothing shared. None: no prefix (a prefix's own forward)
        self.groups: list[tuple[int, int, list]] = groups or [(0, rows, [])]
        # a row's own keys start after its holes (own_from, the number of holes), and the decode
        # step reads the `written` (int32 [rows]) it has
        self.skip_holes([0] * rows)
        self.written = torch.zeros(rows, dtype=torch.int32, device=device)
        # windowed layers: the shared keys before window_from are outside every query's window; the
        # later ones' logical positions (window_keys, None when every query sees them all) and, for
        # the queries of the forward running now, which of them each sees (shared_mask [rows, n, keys])
        self.window_from = 0
        self.window_keys: torch.Tensor | None = None
        self.shared_mask: torch.Tensor | None = None

    @property
    def shared(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first prefix's keys and values per layer (a batch of one prefix: its only one)."""
        return self.groups[0][2]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *_, **__):  # the rest: per version
        if self.keys[layer] is None:  # the first write of a layer: its buffers, now that its shapes are known
            # [rows, positions, kv heads, head dim]: a row's keys one run of memory, as the decode
            # step reads them; attention elsewhere takes the transposed view
            shape = (self.rows, self.capacity, key.shape[1], key.shape[3])
            # zeros, not garbage: a masked key's weight is 0, and 0 x NaN would still be NaN
            self.keys[layer] = key.new_zeros(shape)
            self.values[layer] = value.new_zeros(shape)
        self.keys[layer].index_copy_(1, self.index, key.transpose(1, 2))
        self.values[layer].index_copy_(1, self.index, value.transpose(1, 2))
        return self.keys[layer].transpose(1, 2), self.values[layer].transpose(1, 2)

    def skip_holes(self, holes: list[int]) -> None:
        """Each row's number of holes (left padding), which its own keys start after."""
        self.own_from = torch.tensor(holes, device=self.index.device)

    def get_seq_length(self, layer: int = 0) -> int:
        return 0  # never asked: every forward passes its cache_position


class Decoder:
    """Answers batches of prompts with one model. Keeps the keys and values of the last common
    prefix it ran (a generate run's context, shared by all its batches). It sets the model's
    attention to `decode_attention` (the model is its own from then on)."""

    def __init__(
        self,
        model,
        end_ids: list[int],
        pad_id: int,
        graphs: bool = True,
        fa4: bool = False,
        vocabulary: int | None = None,
    ):
        self.model, self.end_ids, self.pad_id = model, end_ids, pad_id
        # the ids the tokenizer decodes (student_files.decodable_ids): the output layer's rows past
        # them are padding, and their logits are dropped before any pick or top-k, so that the
        # probabilities are a softmax over the real ids alone (vLLM's rule). None: every row
        self.vocabulary = vocabulary
        self.fa4 = fa4  # a decode step's shared part on FlashAttention-4 (student.attention_kernel names it)
        config = model.config
        self.layers = config.num_hidden_layers
        # layers of two kinds (Gemma 2 and 3, Qwen with sliding layers) take a mask per kind; a model
        # without layer kinds but with a window (Mistral v0.1) windows every layer
        kinds = getattr(config, "layer_types", None) or []
        self.layer_types = set(kinds)
        self.window = getattr(config, "sliding_window", None)
        self.window_everywhere = bool(self.window) and not self.layer_types
        self.windowed = windowed_layers(config)
        # decode_attention finds the decoder, and through it the cache of the forward running now
        install_attention(model, NAME, decode_attention, "spds_decoder", self, "spds generate cannot decode it")
        self.active: BatchCache | None = None  # the cache of the forward running now
        self.graphs = graphs and model.device.type == "cuda"  # False: every step eagerly (the same numbers)
        # the prefixes whose keys and values are kept, by their ids, the newest last: generate's
        # context and the question-writing batches' own alternate
        self.kept: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.prefix_forwards = 0  # how many times a prefix was run (the tests read it)
        self.captured = 0  # batches whose decode step ran as a CUDA graph (the benchmark reads it)
        self.seconds, self.new_tokens = 0.0, 0  # time in answer() and the tokens it picked (generate logs them)
        # transformers renamed past_key_values to cache (5.2x); both name the same object
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def answer(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float | list[float],
        top_p: float,
        seed: int,
        shared_within: int | None = None,
    ) -> list[list[int]]:
        """Each prompt's answer ids: up to and including its first end token, or max_new_tokens
        ids with an end token appended (a cut answer is closed, as spds's rows must end)."""
        return self.answer_with_top_k(prompts, max_new_tokens, temperature, top_p, seed, 0, None, shared_within)[0]

    @torch.no_grad()
    def answer_with_top_k(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float | list[float],
        top_p: float,
        seed: int,
        k: int,
        prefix_embeds: torch.Tensor | list[torch.Tensor] | None = None,
        shared_within: int | list[int] | None = None,
        prefix_kv: torch.Tensor | list | None = None,
        prefix_of: list[int] | None = None,
        groups: list[Prefixed] | None = None,
    ) -> tuple[list[list[int]], list[dict] | None]:
        """`answer`'s ids and, with k > 0, each answer's top-k: at every answer token, the k most
        likely next tokens of the logits it was picked from and their log-probabilities at
        temperature 1 (dict(ids=[[k ids] per token], logprobs=[[k floats] per token])).
        `temperature`: one for every prompt, or a list of one per prompt (`pick`). A cut
        answer's closing end token was never picked: one more step gives its logits. Taken from
        the decode step's own logits, so an offline teacher's targets cost no second pass.
        `prefix_embeds` ([n, hidden], the model's dtype): a shared prefix given as input embeddings
        (the chat template's header and a soft prompt, loss.on_policy), before every prompt's ids.
        `shared_within`: the most tokens of the prompts' common prefix to share (`prefill`).
        `prefix_kv` (a kv soft prompt [layers, 2, kv heads, p, D], spds/model/kv_prompt.py): its
        keys and values after the prefix's embeddings, read as a cache.

        Several prefixes in one batch: `prefix_embeds` a list of them (and `prefix_kv` one entry
        per prefix, None where it has none), `prefix_of` each prompt's index into it; or
        `shared_within` a list, one bound per prompt: each prompt shares its own first
        shared_within[i] ids with the prompts that open the same way (a corpus's slices). Each
        row then attends to its own prefix's keys and values (computed once per prefix) and to its
        own; its numbers are those of the same row among its own prefix's rows alone, to the
        rounding of the batch's other shapes (tests/test_decode.py)."""
        groups = groups or self.prefix_groups(prompts, prefix_embeds, shared_within, prefix_kv, prefix_of)
        if len(groups) > 1 and any(self.windowed):  # the windowed keys' plan is one prefix's: each alone
            return self.each_alone(groups, prompts, max_new_tokens, temperature, top_p, seed, k)
        order = [row for group in groups for row in group.rows]  # the rows of a prefix consecutive
        if order != list(range(len(prompts))):
            answers, tops = self.answer_with_top_k(
                [prompts[row] for row in order],
                max_new_tokens,
                temperature if isinstance(temperature, (int, float)) else [temperature[row] for row in order],
                top_p,
                seed,
                k,
                groups=regrouped(groups, order),
            )
            back = {row: i for i, row in enumerate(order)}
            return [answers[back[row]] for row in range(len(prompts))], (
                [tops[back[row]] for row in range(len(prompts))] if tops else None
            )
        began = time.perf_counter()
        device = self.model.device
        kept = TopK.bytes_per_row(max_new_tokens + 1, k)
        cache, positions, longest, logits = self.prefill(prompts, max_new_tokens, kept, groups=groups)
        logits, rows = logits[:, -1], len(prompts)
        generator = torch.Generator(device=device).manual_seed(seed)
        step = Step(self, cache, positions, next_position=positions[:, longest - 1] + 1, write_at=longest)
        answers = torch.full((rows, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        top = TopK(rows, max_new_tokens + 1, k, device) if k else None
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        finite = torch.ones(rows, dtype=torch.bool, device=device)  # every pick was made from finite numbers
        ends = torch.tensor(self.end_ids, device=device)
        if not isinstance(temperature, (int, float)):  # one per prompt: a tensor only where they differ
            one = len(set(temperature)) == 1
            temperature = temperature[0] if one else torch.tensor(temperature, dtype=torch.float32, device=device)
        for number in range(max_new_tokens):
            if top:
                top.keep(number, logits)
            picked, picked_finite = pick(logits, temperature, top_p, generator)
            finite &= ended | picked_finite
            token = torch.where(ended, self.pad_id, picked)
            answers[:, number] = token
            ended |= torch.isin(token, ends)
            if number + 1 == max_new_tokens or (number % 8 == 7 and bool(ended.all())):  # a host sync every 8 steps
                break
            logits = step(token)
        if top and number + 1 == max_new_tokens and not bool(ended.all()):  # the cut answers' closing end token
            top.keep(number + 1, step(token))
        if not bool(finite.all()):  # read once a batch: a check at every step would stall the queue
            raise SpdsError(
                "the model's logits are not finite (inf or NaN) where the decoder picked a token: its weights "
                "or its dtype cannot run this model (try student.dtype float32)"
            )
        result = []
        for row in answers.tolist():
            end = next((i for i, t in enumerate(row) if t in self.end_ids), None)
            result.append(row[: end + 1] if end is not None else row + [self.end_ids[0]])
        tops = top.per_answer([len(r) for r in result]) if top else None
        self.seconds += time.perf_counter() - began  # answers.tolist() waited for the device
        self.new_tokens += sum(len(r) for r in result)
        return result, tops

    def prefill(
        self,
        prompts: list[list[int]],
        room: int,
        kept_per_row: int = 0,
        keep: int = 1,
        shared_within: int | None = None,
        groups: list[Prefixed] | None = None,
    ) -> tuple[BatchCache, torch.Tensor, int, torch.Tensor]:
        """The prompts run into a new batch cache with `room` positions after the longest: their
        prefixes (`groups`, else their common prefix) from the kept shared states, each prompt's own ids
        right-aligned after it. Returns the cache, each row's logical position at each of its cache
        indices (-1: a hole, or not written yet), the longest prompt's own length (the index the
        next token goes in at) and the fp32 logits of every row's last `keep` positions, which must
        lie past the shared prefix: `shared_within` bounds its length. `groups` (prefix_groups',
        their rows consecutive): the prefixes already resolved."""
        device = self.model.device
        if groups is None:
            groups = self.prefix_groups(prompts, None, shared_within, None, None)
        group_of = {row: group for group in groups for row in group.rows}
        prompts = [p[group_of[row].covers :] for row, p in enumerate(prompts)]  # each prompt's own ids
        rows, longest = len(prompts), max(len(p) for p in prompts)
        self.check_fits(rows, longest + room, kept_per_row, prefilled=longest)
        spans = [(group.rows[0], group.rows[-1] + 1, group.states) for group in groups]
        cache = BatchCache(self.layers, rows, longest + room, device, spans)
        cache.skip_holes([longest - len(p) for p in prompts])
        if len(groups) == 1:
            self.plan_window(cache, groups[0].length, groups[0].length + longest + room - 1)
        # the questions right-aligned: every row's last prompt token at one index. Built on the
        # host and copied once.
        positions = torch.full((rows, cache.capacity), -1, dtype=torch.long)
        ids = torch.full((rows, longest), self.pad_id, dtype=torch.long)
        for row, own in enumerate(prompts):  # each prompt's own ids, after its shared prefix
            prefix = group_of[row].length
            ids[row, longest - len(own) :] = torch.tensor(own)
            positions[row, longest - len(own) : longest] = torch.arange(prefix, prefix + len(own))
        positions, ids = positions.to(device), ids.to(device)
        return cache, positions, longest, self.forward(ids, positions, cache, start=0, keep=keep)

    def prefix_groups(self, prompts, prefix_embeds, shared_within, prefix_kv, prefix_of) -> list[Prefixed]:
        """The batch's prefixes and the rows of each, in first-seen order. Given as embeddings, a
        prefix comes before the whole of each of its prompts' ids; otherwise a prompt's prefix is
        its first ids: the prompts' common prefix (within `shared_within`), or with
        `shared_within` a list, each prompt's own first shared_within[i] ids, shared with the
        prompts that open with the same ones."""
        device = self.model.device
        if prefix_embeds is not None:
            embeds = prefix_embeds if isinstance(prefix_embeds, list) else [prefix_embeds]
            kvs = prefix_kv if isinstance(prefix_kv, list) else [prefix_kv] * len(embeds)
            rows_of: dict = {}
            for row, index in enumerate(prefix_of if prefix_of is not None else [0] * len(prompts)):
                rows_of.setdefault(index, []).append(row)
            lengths = {i: len(embeds[i]) + (kvs[i].shape[3] if kvs[i] is not None else 0) for i in rows_of}
            return [
                Prefixed(rows, lengths[i], self.embedded_states(embeds[i], kvs[i]) if lengths[i] else [])
                for i, rows in rows_of.items()
            ]
        if not isinstance(shared_within, list):
            prefix = min(common_prefix(prompts), shared_within if shared_within is not None else len(prompts[0]))
            shared = self.shared_states(prompts[0][:prefix], device) if prefix else []
            return [Prefixed(list(range(len(prompts))), prefix, shared, covers=prefix)]
        rows_of = {}
        for row, (prompt, within) in enumerate(zip(prompts, shared_within)):
            rows_of.setdefault(tuple(prompt[: min(within, len(prompt) - 1)]), []).append(row)
        keep = max(self.KEPT_PREFIXES, len(rows_of))  # every prefix of the batch stays while it runs
        return [
            Prefixed(rows, len(key), self.shared_states(list(key), device, keep) if key else [], covers=len(key))
            for key, rows in rows_of.items()
        ]

    def each_alone(self, groups, prompts, max_new_tokens, temperature, top_p, seed, k):
        """A batch of several prefixes on a model with windowed layers: each prefix's rows decoded
        alone (the shared keys' window plan is one prefix's)."""
        answers, tops = [None] * len(prompts), [None] * len(prompts)
        for group in groups:
            rows = group.rows
            temperatures = temperature if isinstance(temperature, (int, float)) else [temperature[r] for r in rows]
            mine, mine_tops = self.answer_with_top_k(
                [prompts[r] for r in rows],
                max_new_tokens,
                temperatures,
                top_p,
                seed,
                k,
                groups=[dataclasses.replace(group, rows=list(range(len(rows))))],
            )
            for i, row in enumerate(rows):
                answers[row], tops[row] = mine[i], mine_tops[i] if mine_tops else None
        return answers, (tops if k else None)

    @torch.no_grad()
    def score(
        self, prompts: list[list[int]], answers: list[list[int]], k: int, shared_within: int | None = None
    ) -> list[dict]:
        """Each given answer's top-k under the model, as `answer_with_top_k` keeps a sampled
        one's: at each answer token, the k most likely tokens after the prompt and the answer before
        it, and their log-probabilities at temperature 1. One teacher-forced forward over each
        prompt and its answer (the common prefix from the kept states), in groups whose logits
        stay within SCORE_LOGITS_BYTES."""
        began = time.perf_counter()
        sequences = [p + a[:-1] for p, a in zip(prompts, answers)]  # the last answer token is never input
        per_row = max(len(a) for a in answers) * self.model.config.vocab_size * 4  # a bound for every group
        group = max(1, SCORE_LOGITS_BYTES // per_row)
        tops = []
        for first in range(0, len(sequences), group):
            chunk = slice(first, first + group)
            # the group's own longest answer: a group of shorter ones has fewer positions than the call's longest
            keep = max(len(a) for a in answers[chunk])
            # the prefix shared stops before the prompts end: copies of one request share their answer too
            within = min(len(p) for p in prompts[chunk]) - 1
            within = within if shared_within is None else min(within, shared_within)
            logits = self.prefill(sequences[chunk], 0, 2 * per_row, keep=keep, shared_within=within)[3]
            for row, answer in enumerate(answers[chunk]):
                top = TopK(1, len(answer), k, logits.device)
                top.keep(slice(None), logits[row, keep - len(answer) :][None])
                tops += top.per_answer([len(answer)])
        self.seconds += time.perf_counter() - began
        return tops

    def check_fits(self, rows: int, positions: int, kept_per_row: int = 0, prefilled: int = 0) -> None:
        """Refuse, before anything is allocated, a batch whose own keys and values and logits (and
        `kept_per_row` bytes more a row: the top-k kept), with the activations of the prefill's
        forward over its `prefilled` own positions a row (its MLP's, a few of [positions,
        intermediate]: self-study's question writing reads a chunk of hundreds), would not fit the
        device's free memory: a message that says what fits, not an out-of-memory error halfway."""
        free = free_bytes(self.model.device)
        if free is None:
            return
        config = self.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        cache = -(-positions // 16) * 16 * self.layers * 2 * kv_heads * head_dim_of(config)
        logits = 3 * 4 * config.vocab_size  # fp32 logits, probabilities, copy
        width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
        activations = 4 * prefilled * width * self.model.dtype.itemsize
        per_row = cache * self.model.dtype.itemsize + logits + kept_per_row + activations
        if rows * per_row > 0.9 * free:  # a tenth for what is not counted here
            raise SpdsError(
                f"generate.batch_size: {rows} rows of up to {positions} positions of their own need about "
                f"{rows * per_row / 2**30:.1f} GiB for their keys, values, logits and prefill ({per_row / 2**20:.1f} "
                f"MiB a row), and the {self.model.device.type.upper()} has {free / 2**30:.1f} GiB free: set "
                f"generate.batch_size to at most {max(1, int(0.9 * free // per_row))} (in a new generate.output: "
                "batch k samples with seed + k, so the batch size is one of the rows' settings)"
            )

    KEPT_PREFIXES = 2  # generate's context and a question-writing batch's prefix, alternating

    def check_prefix_fits(self, positions: int) -> None:
        """Refuse, before its forward, a shared prefix (the context) whose keys and values and the
        forward's largest activations (its MLP's, a few of [positions, intermediate]) would not fit
        the device's free memory, saying what it needs."""
        free = free_bytes(self.model.device)
        if free is None:
            return
        config = self.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        states = positions * self.layers * 2 * kv_heads * head_dim_of(config) * self.model.dtype.itemsize
        width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
        activations = 4 * positions * width * self.model.dtype.itemsize
        if states + activations > 0.9 * free:
            raise SpdsError(
                f"the context's {positions} positions need about {(states + activations) / 2**30:.1f} GiB on the GPU "
                f"({states / 2**30:.1f} GiB of keys and values kept for every batch, the rest its forward's), and the "
                f"GPU has {free / 2**30:.1f} GiB free: shorten the context, or use a GPU with more memory"
            )

    def shared_states(
        self, ids: list[int], device: torch.device, keep: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The keys and values of the prefix `ids`, per layer [1, kv heads, len(ids), head dim]:
        computed once per distinct prefix (the last `keep` kept, KEPT_PREFIXES by default: a batch
        of several prefixes keeps all of its own), by a forward over exactly these ids."""
        key = tuple(ids)
        if key in self.kept:
            self.kept[key] = self.kept.pop(key)  # the newest now
            return self.kept[key]
        while len(self.kept) >= (keep or self.KEPT_PREFIXES):
            del self.kept[next(iter(self.kept))]  # the oldest goes before the new one is made
        self.check_prefix_fits(len(ids))
        single = BatchCache(self.layers, 1, len(ids), device)
        positions = torch.full((1, single.capacity), -1, dtype=torch.long, device=device)
        positions[0, : len(ids)] = torch.arange(len(ids), device=device)
        self.forward(torch.tensor([ids], device=device), positions, single, start=0, keep=0, causal=True)
        self.kept[key] = [
            (k[:, : len(ids)].transpose(1, 2), v[:, : len(ids)].transpose(1, 2))
            for k, v in zip(single.keys, single.values)
        ]
        self.prefix_forwards += 1
        return self.kept[key]

    def embedded_states(
        self, embeds: torch.Tensor, prompt: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`shared_states` of a prefix given as input embeddings [n, hidden]: computed every time
        (a soft prompt changes at every update) and not kept. `prompt`: a kv soft prompt
        [layers, 2, kv heads, p, D] after them, its keys and values appended as they are (a cache:
        no forward over its positions)."""
        self.kept = {}  # on-policy sampling keeps none: its prefix changes at every update
        states = []
        if len(embeds):
            single = BatchCache(self.layers, 1, len(embeds), embeds.device)
            positions = torch.full((1, single.capacity), -1, dtype=torch.long, device=embeds.device)
            positions[0, : len(embeds)] = torch.arange(len(embeds), device=embeds.device)
            self.forward(embeds[None], positions, single, start=0, keep=0, causal=True)
            self.prefix_forwards += 1
            states = [
                (k[:, : len(embeds)].transpose(1, 2), v[:, : len(embeds)].transpose(1, 2))
                for k, v in zip(single.keys, single.values)
            ]
        if prompt is None:
            return states
        learned = [
            tuple(prompt[layer, index][None].to(device=embeds.device, dtype=embeds.dtype) for index in (0, 1))
            for layer in range(prompt.shape[0])
        ]
        if not states:
            return learned
        return [(torch.cat([k, pk], dim=2), torch.cat([v, pv], dim=2)) for (k, v), (pk, pv) in zip(states, learned)]

    def plan_window(self, cache: BatchCache, prefix: int, last_position: int) -> None:
        """Which shared keys the windowed layers read: none older than the window of the batch's
        first own token (at logical position `prefix`), and a mask only when a later query
        (`last_position` the latest) outlives the oldest of them."""
        if not (prefix and any(self.windowed)):
            return
        cache.window_from = max(0, prefix - self.window + 1)  # transformers: seen while query - key < window
        if last_position - cache.window_from >= self.window:
            cache.window_keys = torch.arange(cache.window_from, prefix, device=cache.index.device)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: BatchCache,
        start: int,
        keep: int = 1,
        causal: bool = False,
    ):
        """Run `ids` ([rows, n], or input embeddings [rows, n, hidden]; written at the rows' own
        cache indices start..start+n-1) against
        the shared prefix and everything the rows' cache holds; the next-token logits (fp32) of each
        row's last `keep` columns, [rows, keep, vocabulary] (keep 0: none). `causal`: one row with no
        holes from index 0 and nothing shared (the prefix), where the kernel's own causal rule needs
        no mask."""
        count = ids.shape[1]
        cache.index = torch.arange(start, start + count, device=ids.device)
        cache.written = (start + count - cache.own_from).to(torch.int32)
        queries = positions[:, start : start + count]
        if causal and not self.window:  # no [n, n] mask: a 64k-token context fits
            return self.run(ids, queries, None, cache, keep)
        # a query sees its row's keys at or before its own position; a hole sees only itself (its
        # outputs are never read, but must stay finite: they become keys the mask then hides)
        visible = (positions[:, None, :] >= 0) & (positions[:, None, :] <= queries[:, :, None])
        visible[:, torch.arange(count, device=ids.device), cache.index] = True
        return self.run(ids, queries, self.masks(visible, queries, positions, cache), cache, keep)

    def masks(self, visible: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor, cache: BatchCache):
        """The attention mask(s) over the rows' own keys for queries at logical positions `queries`
        ([rows, n]) that may see the keys `visible` marks ([rows, n, cache capacity]; `positions`:
        each key's logical position), windowed where the model's layers are; and, on the cache,
        which shared keys the windowed layers' queries see."""
        if cache.window_keys is not None:
            cache.shared_mask = queries[:, :, None] - cache.window_keys < self.window
        windowed = None
        if self.window:  # transformers' window: a key is seen while query - key < window
            windowed = visible & (queries[:, :, None] - positions[:, None, :] < self.window)
        if "sliding_attention" in self.layer_types:
            return {"full_attention": visible[:, None], "sliding_attention": windowed[:, None]}
        return (windowed if self.window_everywhere else visible)[:, None]  # a 4D mask is used as given

    def run(self, ids: torch.Tensor, queries: torch.Tensor, masks, cache: BatchCache, keep: int = 1):
        """The model over `ids` at logical positions `queries` under `masks` (None: causal),
        writing its keys and values at cache.index; the fp32 logits of the last `keep` columns."""
        arguments = dict(
            **{"inputs_embeds" if ids.is_floating_point() else "input_ids": ids},
            position_ids=queries.clamp(min=0),
            attention_mask=masks,
            use_cache=True,
            cache_position=cache.index,
            **{self.cache_argument: cache},
        )
        self.active = cache
        try:
            if not keep:  # the prefix: its keys and values only, no vocabulary-sized work
                self.model.base_model(**arguments)
                return None
            return self.model(**arguments, logits_to_keep=keep).logits[..., : self.vocabulary].float()
        finally:
            self.active = None


class Step:
    """One decode step of a batch: the last tokens in, the next logits out, through buffers that
    live as long as the batch (the token, each row's next position, the cache index, the cache),
    so that the same work can be captured once as a CUDA graph and replayed for every token."""

    def __init__(
        self, decoder: Decoder, cache: BatchCache, positions: torch.Tensor, next_position: torch.Tensor, write_at: int
    ):
        self.decoder, self.cache, self.positions = decoder, cache, positions
        self.token = torch.zeros(cache.rows, dtype=torch.long, device=positions.device)
        self.next_position = next_position.clone()  # each row's logical position of the token going in
        cache.index = torch.full((1,), write_at, dtype=torch.long, device=positions.device)
        self.logits = None
        self.graph = None
        self.capture = decoder.graphs

    def compute(self) -> torch.Tensor:
        """The step on the buffers alone (what a graph captures): the token's position goes in at
        the cache index; being the newest, it sees every key written so far."""
        index, positions = self.cache.index, self.positions
        positions.index_copy_(1, index, self.next_position[:, None])
        self.cache.written.copy_(index + 1 - self.cache.own_from)
        queries = self.next_position[:, None]
        masks = self.decoder.masks((positions >= 0)[:, None, :], queries, positions, self.cache)
        return self.decoder.run(self.token[:, None], queries, masks, self.cache)[:, -1]

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """The next logits after `token`: read them before the next call, which overwrites a
        graph's output buffer in place (no copy of [rows, vocabulary] floats a step)."""
        self.token.copy_(token)
        if self.capture:
            self.capture = False
            self.graph = captured(self)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self.compute()
        self.next_position += 1
        self.cache.index += 1
        return logits


class TopK:
    """Each decode step's top-k of its rows' logits at temperature 1, kept on the device until the
    batch ends ([rows, steps, k] ids and log-probabilities: log-softmax's values at the top k,
    without writing the whole log-softmax)."""

    def __init__(self, rows: int, steps: int, k: int, device: torch.device):
        # int32 ids and fp32 log-probabilities: bytes_per_row
        self.ids = torch.zeros((rows, steps, k), dtype=torch.int32, device=device)
        self.logprobs = torch.zeros((rows, steps, k), dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_row(steps: int, k: int) -> int:
        return steps * k * (4 + 4)

    def keep(self, number: int | slice, logits: torch.Tensor) -> None:
        """The top-k of `logits` ([rows, vocabulary], or [rows, steps, vocabulary] for a slice of
        steps) as step(s) `number`."""
        values, ids = logits.topk(self.ids.shape[2], dim=-1)
        self.ids[:, number] = ids.to(torch.int32)
        self.logprobs[:, number] = values - torch.logsumexp(logits, dim=-1, keepdim=True)

    def per_answer(self, lengths: list[int]) -> list[dict]:
        ids, logprobs = self.ids.tolist(), self.logprobs.tolist()
        return [dict(ids=i[:n], logprobs=p[:n]) for i, p, n in zip(ids, logprobs, lengths)]


def captured(step: Step):
    """`step.compute` as a CUDA graph (its output in step.logits), or None when the model's forward
    cannot be captured (it syncs with the host, say): the step then runs eagerly."""
    decoder = step.decoder
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one eager run first, off the default stream, as capture needs;
            step.compute()  # its writes are the ones the first replay makes again
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.logits = step.compute()
        decoder.captured += 1
        return graph
    except Exception as error:  # noqa: BLE001 (any failure to capture means: decode eagerly)
        torch.cuda.synchronize()
        if decoder.graphs:
            print(
                f"spds generate: the decode step could not be captured as a CUDA graph ({type(error).__name__}: "
                f"{str(error)[:160]}); decoding eagerly",
                file=sys.stderr,
            )
        decoder.graphs = False
        return None


def free_bytes(device: torch.device) -> int | None:
    """The device's free memory in bytes; None off CUDA (host memory is not budgeted here).
    SPDS_TEST_FREE_BYTES stands in for it on any device: the tests' memory budget on CPU."""
    budget = os.environ.get("SPDS_TEST_FREE_BYTES")
    if budget:
        return int(budget)
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def pick(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row: the most likely (temperature 0), or sampled at `temperature`
    from the smallest set of tokens whose probability reaches `top_p` (nucleus sampling); and
    whether each row's pick was made from finite numbers (NaN or inf logits make none).
    `temperature` a tensor [rows]: each row's own, a row at 0 taking its most likely token; the
    random numbers are drawn for every row alike, so a row samples what it would beside any others."""
    per_row = isinstance(temperature, torch.Tensor)
    if not per_row and temperature <= 0:
        greedy = logits.argmax(dim=-1)
        return greedy, picked_value(logits, greedy).isfinite()
    if per_row:
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    else:
        scaled = logits if temperature == 1 else logits / temperature  # x / 1 is x: no copy
    probabilities = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ordered, order = probabilities.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p, 0.0)  # the first token always stays
        probabilities = torch.zeros_like(probabilities).scatter_(-1, order, ordered)
    # torch.multinomial(probabilities, 1)'s own draw (an exponential race: the same generator
    # consumed the same way, the same tokens), without its checks: two more passes over the
    # [rows, vocabulary] floats at every step (their min and max, their row sums) and the
    # asserts after them. The winner's value stands in for them (a row with a NaN or inf logit
    # is NaN throughout after softmax), read by the caller once a batch.
    race = probabilities.div_(torch.empty_like(probabilities).exponential_(generator=generator))
    sampled = race.argmax(dim=-1)
    finite = picked_value(race, sampled).isfinite()
    if not per_row:
        return sampled, finite
    greedy = logits.argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy), finite & picked_value(logits, greedy).isfinite()


def picked_value(values: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    return values.gather(1, picked[:, None])[:, 0]


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers' attention signature: query [B, Hq, Lq, D], the rows' own key and value
    [B, Hkv, Lk, D] (the whole cache), attention_mask bool [B, 1, Lq, Lk] (None: a causal forward
    over its own Lq keys). Attention over the shared prefix and over the rows' own keys runs as two
    parts, merged by their log-sum-exps (the softmax over all keys, regrouped): the shared part
    folds every row's queries into one batch, so the shared keys are read once per step, not once
    per row. The G = Hq / Hkv query heads of each key/value head become G x Lq query rows of that
    head (query head h reads key/value head h // G, as transformers' repeat_kv has it), so grouped
    keys are never copied. Returns [B, Lq, Hq, D]."""
    batch, heads, count, dim = query.shape
    kv = key.shape[1]
    groups = heads // kv
    scale = scaling if scaling is not None else dim**-0.5
    if attention_mask is None:  # the prefix from cache index 0: its keys are its own first `count`
        return causal_attention(query, key[:, :, :count], value[:, :, :count], scale, softcap), None
    decoder = getattr(module, "spds_decoder", None)
    cache = decoder.active if decoder is not None else None
    layer = module.layer_idx
    # the G query heads of a key/value head as its G x Lq rows: every part below is [B, Hkv, G x Lq, ...]
    own = query.reshape(batch, kv, groups * count, dim)
    if count == 1 and cache is not None and flash_fits(query, softcap) and triton_available():  # a decode step
        # each row reads only the keys it has written, from after its holes: no mask, nothing unwritten
        window = decoder.window if decoder.windowed[layer] else None
        keys, values = cache.keys[layer], cache.values[layer]
        output, lse = own_keys_step(query, keys, values, cache.own_from, cache.written, scale, window)
    else:
        mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * count, -1)
        output, lse = attend(own, key, value, mask, scale, softcap)
    if cache is not None and any(states for _, _, states in cache.groups):
        parts = [
            shared_part(decoder, cache, layer, query[first:end], own[first:end], states, softcap, scale, (first, end))
            for first, end, states in cache.groups
        ]
        shared = torch.cat([part for part, _ in parts]) if len(parts) > 1 else parts[0][0]
        shared_lse = torch.cat([lse for _, lse in parts]) if len(parts) > 1 else parts[0][1]
        output = merge_parts(output, lse, shared, shared_lse, query.dtype)
    output = output.reshape(batch, heads, count, dim)
    return output.transpose(1, 2).contiguous().to(query.dtype), None


def shared_part(decoder, cache, layer: int, query, own, states, softcap, scale, rows: tuple[int, int]):
    """The rows [first, end)'s attention to their prefix's keys ([B, Hkv, G x Lq, D] and its
    log-sum-exps): every row's queries folded into one batch, so the prefix's keys are read once
    per step, not once per row. A row of no prefix (`states` empty) reads nothing: weight 0."""
    batch, heads, count, dim = query.shape
    kv, groups = own.shape[1], own.shape[2] // count
    if not states:
        empty = own.new_zeros(own.shape, dtype=torch.float32)
        return empty, torch.full(own.shape[:3], float("-inf"), device=own.device)
    keys, values = states[layer]
    shared_mask = None
    if decoder.windowed[layer]:
        keys, values = keys[:, :, cache.window_from :], values[:, :, cache.window_from :]
        if cache.shared_mask is not None:  # [B, Lq, keys] -> the folded rows' [1, 1, B x G x Lq, keys]
            mask = cache.shared_mask[rows[0] : rows[1]]
            shared_mask = mask[:, None].expand(-1, groups, -1, -1).reshape(1, 1, -1, keys.shape[2])
    if count == 1 and decoder.fa4 and shared_mask is None and flash_fits(query, softcap):
        return fa4_shared_step(query, keys, values, scale)
    folded = own.transpose(0, 1).reshape(1, kv, batch * groups * count, dim)  # rows in (b, g, q) order
    splits = key_splits(folded, keys) if shared_mask is None and softcap is None else 1
    if splits > 1:
        shared, shared_lse = attend_split(folded, keys, values, scale, splits)
    else:
        shared, shared_lse = attend(folded, keys, values, shared_mask, scale, softcap)
    shared = shared[0].reshape(kv, batch, groups * count, dim).transpose(0, 1)  # views, merged where they lie
    return shared, shared_lse[0].reshape(kv, batch, groups * count).transpose(0, 1)


def causal_attention(query, key, value, scale: float, softcap: float | None) -> torch.Tensor:
    """The prefix's own attention, query row i seeing keys 0..i: [B, Lq, Hq, D]. Equal lengths leave
    no doubt about where a kernel aligns the causal rule (top left in PyTorch's math, lower right in
    flash)."""
    output = attend(query, key, value, None, scale, softcap, causal=True)[0]
    return output.transpose(1, 2).contiguous().to(query.dtype)
