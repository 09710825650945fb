"""Decoding for spds generate: a batch of prompts that share the context, answered token by token.

Every prompt of a generate run is the chat template's opening, the context, then a question:
the same first tokens, thousands of them, in every row. transformers' `generate` computes them
again for every batch and grows its cache by concatenation at every step (each step copies the
whole cache). Here:

  * the prompts' longest common prefix is run once and its keys and values kept (`PrefixCache`,
    keyed by the prefix's ids): every batch that shares it copies them instead of computing them;
  * each batch gets one cache allocated once for its whole length ([rows, kv heads, prefix +
    longest question + max_new_tokens, head dim] per layer), written in place (`BatchCache`);
  * the questions, of different lengths, are right-aligned after the prefix, so that every row
    writes its next token at the same index; the holes before a short question are masked;
    positions (RoPE) count only a row's own tokens, as if it had never been padded;
  * the keys are the whole cache at every step (one shape per batch, unwritten positions masked),
    and attention is spds's `grouped_attention`: the query heads that share a key/value head are
    folded into its query rows, so grouped-query keys are read as they are (transformers' sdpa
    path repeats the whole cache to every query head when a mask is given) and PyTorch's
    memory-efficient kernel takes the mask; a soft-capped Gemma 2 runs transformers' eager
    attention. The mask goes in as a 4D tensor (or a dict of them per layer kind), which
    transformers uses as given.

Deterministic for a given seed: the same batch, on the same device and versions, samples the same
tokens (one torch.Generator per batch; no kernel here accumulates with atomics in a forward).
"""
from __future__ import annotations

import functools
import inspect

import torch

NAME = "spds_decode"


def common_prefix(prompts: list[list[int]]) -> int:
    """The length of the prompts' longest common prefix, leaving every prompt at least its last
    token to run with the batch (the logits of the first answer token come from it)."""
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


class BatchCache:
    """The keys and values of one batch, in buffers allocated once, written in place at `write_at`.
    Offers what transformers' decoder layers call on a cache (`update`, `get_seq_length`)."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.write_at, self.capacity, self.rows = 0, 0, 0
        self.is_compileable = False

    def allocate(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity = rows, -(-capacity // 16) * 16  # the efficient kernel's mask alignment

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *_, **__):  # the rest: per version
        if self.keys[layer] is None:  # the first write of a layer: its buffers, now that its shapes are known
            shape = (self.rows, key.shape[1], self.capacity, key.shape[3])
            # zeros, not garbage: a masked key's weight is 0, and 0 x NaN would still be NaN
            self.keys[layer] = key.new_zeros(shape)
            self.values[layer] = value.new_zeros(shape)
        end = self.write_at + key.shape[2]
        self.keys[layer][:, :, self.write_at:end] = key
        self.values[layer][:, :, self.write_at:end] = value
        return self.keys[layer], self.values[layer]

    def get_seq_length(self, layer: int = 0) -> int:
        return self.write_at

    def __len__(self) -> int:
        return len(self.keys)


class Decoder:
    """Answers batches of prompts with one model. Keeps the keys and values of the last common
    prefix it ran (a generate run's context, shared by all its batches)."""

    def __init__(self, model, end_ids: list[int], pad_id: int):
        self.model, self.end_ids, self.pad_id = model, end_ids, pad_id
        config = model.config
        self.layers = config.num_hidden_layers
        # layers of two kinds (Gemma 2 and 3, Qwen with sliding layers) take a mask per kind; a model
        # without layer kinds but with a window (Mistral v0.1) windows every layer
        self.layer_types = set(getattr(config, "layer_types", None) or [])
        self.window = getattr(config, "sliding_window", None)
        self.window_everywhere = bool(self.window) and not self.layer_types
        self.eager = config._attn_implementation == "eager"
        if not self.eager:
            from transformers import AttentionInterface

            AttentionInterface.register(NAME, grouped_attention)
            config._attn_implementation = NAME
        self.prefix_ids: list[int] | None = None  # the prefix whose keys and values are kept
        self.prefix_states: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prefix_forwards = 0  # how many times a prefix was run (the tests read it)
        # transformers renamed past_key_values to cache (5.2x); both name the same object
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @torch.no_grad()
    def answer(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> list[list[int]]:
        """Each prompt's answer ids: up to and including its first end token, or max_new_tokens
        ids with an end token appended (a cut answer is closed, as spds's rows must end)."""
        device = self.model.device
        prefix = common_prefix(prompts)
        rows, longest = len(prompts), max(len(p) - prefix for p in prompts)
        cache = BatchCache(self.layers)
        cache.allocate(rows, prefix + longest + max_new_tokens)
        # a row's logical position at each cache index (-1: a hole before a short question)
        positions = torch.full((rows, cache.capacity), -1, dtype=torch.long, device=device)
        if prefix:
            self.load_prefix(prompts[0][:prefix], cache)
            positions[:, :prefix] = torch.arange(prefix, device=device)
        # the questions, right-aligned after the prefix: every row's last prompt token at one index
        ids = torch.full((rows, longest), self.pad_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            own = prompt[prefix:]
            ids[row, longest - len(own):] = torch.tensor(own, device=device)
            positions[row, prefix + longest - len(own):prefix + longest] = torch.arange(prefix, len(prompt),
                                                                                       device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        logits = self.forward(ids, positions, cache)
        answers = torch.full((rows, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        ends = torch.tensor(self.end_ids, device=device)
        next_position = positions[:, prefix + longest - 1] + 1
        for step in range(max_new_tokens):
            token = pick(logits, temperature, top_p, generator)
            token = torch.where(ended, self.pad_id, token)
            answers[:, step] = token
            ended |= torch.isin(token, ends)
            if step + 1 == max_new_tokens or (step % 8 == 7 and bool(ended.all())):  # a host sync every 8 steps
                break
            positions[:, cache.write_at] = next_position
            next_position = next_position + 1
            logits = self.forward(token[:, None], positions, cache)
        result = []
        for row in answers.tolist():
            end = next((i for i, t in enumerate(row) if t in self.end_ids), None)
            result.append(row[:end + 1] if end is not None else row + [self.end_ids[0]])
        return result

    def load_prefix(self, ids: list[int], cache: BatchCache) -> None:
        """The prefix's keys and values into `cache` (rows 0..n-1, indices 0..len-1): computed once
        per distinct prefix, then copied."""
        if ids != self.prefix_ids:
            self.prefix_ids, self.prefix_states = None, []  # never keep a half-made prefix
            single = BatchCache(self.layers)
            single.allocate(1, len(ids))
            tokens = torch.tensor([ids], device=self.model.device)
            positions = torch.full((1, single.capacity), -1, dtype=torch.long, device=tokens.device)
            positions[0, :len(ids)] = torch.arange(len(ids), device=tokens.device)
            self.forward(tokens, positions, single, logits=False)
            self.prefix_states = [(k[:, :, :len(ids)], v[:, :, :len(ids)]) for k, v in zip(single.keys, single.values)]
            self.prefix_ids = list(ids)
            self.prefix_forwards += 1
        for layer, (keys, values) in enumerate(self.prefix_states):
            cache.update(keys.expand(cache.rows, -1, -1, -1), values.expand(cache.rows, -1, -1, -1), layer)
        cache.write_at = len(ids)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: BatchCache, logits: bool = True):
        """Run `ids` ([rows, n], written at cache.write_at..+n) against everything the cache holds;
        the next-token logits (fp32) of each row's last column."""
        start, count = cache.write_at, ids.shape[1]
        end = start + count
        keys = positions  # each key's logical position (-1: a hole, or not written yet)
        queries = positions[:, start:end]
        # a query sees its row's keys at or before its own position; a hole sees only itself (its
        # outputs are never read, but must stay finite: they become keys the mask then hides)
        visible = (keys[:, None, :] >= 0) & (keys[:, None, :] <= queries[:, :, None])
        visible[:, torch.arange(count), torch.arange(start, end)] = True
        windowed = visible & (queries[:, :, None] - keys[:, None, :] < self.window) if self.window else None
        if "sliding_attention" in self.layer_types:
            masks = {"full_attention": self.as_mask(visible), "sliding_attention": self.as_mask(windowed)}
        else:  # a 4D mask is used as given
            masks = self.as_mask(windowed if self.window_everywhere else visible)
        arguments = dict(input_ids=ids, position_ids=queries.clamp(min=0), attention_mask=masks, use_cache=True,
                         **{self.cache_argument: cache})
        if not logits:  # the prefix: its keys and values only, no vocabulary-sized work
            self.model.base_model(**arguments)
            cache.write_at = end
            return None
        output = self.model(**arguments, logits_to_keep=1)
        cache.write_at = end
        return output.logits[:, -1].float()

    def as_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[rows, 1, queries, keys]: boolean for sdpa, additive for eager attention."""
        visible = visible[:, None]
        if not self.eager:
            return visible
        dtype = self.model.dtype
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible,
                                                                                          torch.finfo(dtype).min)


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row: the most likely (temperature 0), or sampled at `temperature`
    from the smallest set of tokens whose probability reaches `top_p` (nucleus sampling)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probabilities = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        ordered, order = probabilities.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p, 0.0)  # the first token always stays
        probabilities = torch.zeros_like(probabilities).scatter_(-1, order, ordered)
    return torch.multinomial(probabilities, 1, generator=generator)[:, 0]


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query [B, Hq, Lq, D], key and value [B, Hkv, Lk, D],
    attention_mask bool [B, 1, Lq, Lk]. The G = Hq / Hkv query heads of each key/value head become
    G x Lq query rows of that head (query head h reads key/value head h // G, as transformers'
    repeat_kv has it), so the keys are read once per key/value head and never copied.
    Returns [B, Lq, Hq, D]."""
    batch, heads, queries, dim = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None:  # a plain causal forward of the same model (generate's top-k pass)
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=queries > 1,
                                                                  scale=scaling, enable_gqa=groups > 1)
        return output.transpose(1, 2).contiguous(), None
    folded = query.reshape(batch, key.shape[1], groups * queries, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * queries, -1)
    call = functools.partial(torch.nn.functional.scaled_dot_product_attention, folded, key, value, attn_mask=mask,
                             scale=scaling)
    if query.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # the fused kernel that takes a mask
            output = call()
    else:
        output = call()
    return output.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None
