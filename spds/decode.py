"""Decoding for spds generate: a batch of prompts that share the context, answered token by token.

Every prompt of a generate run is the chat template's opening, the context, then a question:
the same first tokens, thousands of them, in every row. transformers' `generate` computes them
again for every batch and grows its cache by concatenation at every step (each step copies the
whole cache). Here:

  * the prompts' longest common prefix is run once and its keys and values kept (keyed by the
    prefix's ids): every batch that shares it copies them instead of computing them;
  * each batch gets one cache allocated once for its whole length ([rows, kv heads, prefix +
    longest question + max_new_tokens, head dim] per layer), written in place (`BatchCache`);
  * the questions, of different lengths, are right-aligned after the prefix, so that every row
    writes its next token at the same index; the holes before a short question are masked;
    positions (RoPE) count only a row's own tokens, as if it had never been padded;
  * the keys are the whole cache at every step (unwritten positions masked), and attention is
    spds's `grouped_attention`: the query heads that share a key/value head are folded into its
    query rows, so grouped-query keys are read as they are (transformers' sdpa path repeats the
    whole cache to every query head when a mask is given) and PyTorch's memory-efficient kernel
    takes the mask; a soft-capped Gemma 2 runs transformers' eager attention. The mask goes in
    as a 4D tensor (or a dict of them per layer kind), which transformers uses as given;
  * a decode step reads and writes only buffers that live as long as the batch (`Step`), so on
    CUDA it is captured once per batch as a CUDA graph and replayed: the model's Python (tens of
    milliseconds a step, more than the GPU's work at these sizes) runs once, not once per token.
    A model whose forward cannot be captured (a host sync inside) decodes eagerly, the same
    numbers, and says so once.

Deterministic for a given seed: the same batch, on the same device and versions, samples the same
tokens (one torch.Generator per batch, sampling outside the graph; no kernel here accumulates
with atomics in a forward). Over 300 lines with this account of it: the cache, the step and its
graph, and the attention they need are one mechanism, each part shaped by the others.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    """The keys and values of one batch, in buffers allocated once and written in place at the
    cache indices `index` (a tensor, so that a captured step writes where the replay says). Offers
    what transformers' decoder layers call on a cache (`update`, `get_seq_length`)."""

    def __init__(self, layers: int, rows: int, capacity: int, device: torch.device):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.rows = rows
        self.capacity = -(-capacity // 16) * 16  # the efficient kernel's alignment for the mask's rows
        self.index = torch.zeros(1, dtype=torch.long, device=device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *_, **__):  # the rest: per version
        if self.keys[layer] is None:  # the first write of a layer: its buffers, now that its shapes are known
            shape = (self.rows, key.shape[1], self.capacity, key.shape[3])
            # zeros, not garbage: a masked key's weight is 0, and 0 x NaN would still be NaN
            self.keys[layer] = key.new_zeros(shape)
            self.values[layer] = value.new_zeros(shape)
        self.keys[layer].index_copy_(2, self.index, key)
        self.values[layer].index_copy_(2, self.index, value)
        return self.keys[layer], self.values[layer]

    def get_seq_length(self, layer: int = 0) -> int:
        return 0  # never asked: every forward passes its cache_position


class Decoder:
    """Answers batches of prompts with one model. Keeps the keys and values of the last common
    prefix it ran (a generate run's context, shared by all its batches). It sets the model's
    attention to `grouped_attention` (an sdpa model; eager stays eager): the model is its own."""

    def __init__(self, model, end_ids: list[int], pad_id: int, graphs: bool = True):
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
        self.graphs = graphs and model.device.type == "cuda"  # False: every step eagerly (the same numbers)
        self.prefix_ids: list[int] | None = None  # the prefix whose keys and values are kept
        self.prefix_states: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prefix_forwards = 0  # how many times a prefix was run (the tests read it)
        self.captured = 0  # batches whose decode step ran as a CUDA graph (the benchmark reads it)
        # transformers renamed past_key_values to cache (5.2x); both name the same object
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @torch.no_grad()
    def answer(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[list[int]]:
        """Each prompt's answer ids: up to and including its first end token, or max_new_tokens
        ids with an end token appended (a cut answer is closed, as spds's rows must end)."""
        device = self.model.device
        prefix = common_prefix(prompts)
        rows, longest = len(prompts), max(len(p) - prefix for p in prompts)
        cache = BatchCache(self.layers, rows, prefix + longest + max_new_tokens, device)
        # a row's logical position at each cache index (-1: a hole, or not written yet), and the
        # questions right-aligned after the prefix: every row's last prompt token at one index.
        # Built on the host and copied once.
        positions = torch.full((rows, cache.capacity), -1, dtype=torch.long)
        positions[:, :prefix] = torch.arange(prefix)
        ids = torch.full((rows, longest), self.pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            own = prompt[prefix:]
            ids[row, longest - len(own) :] = torch.tensor(own)
            positions[row, prefix + longest - len(own) : prefix + longest] = torch.arange(prefix, len(prompt))
        positions, ids = positions.to(device), ids.to(device)
        if prefix:
            self.load_prefix(prompts[0][:prefix], cache)
        generator = torch.Generator(device=device).manual_seed(seed)
        logits = self.forward(ids, positions, cache, start=prefix)
        step = Step(
            self, cache, positions, next_position=positions[:, prefix + longest - 1] + 1, write_at=prefix + longest
        )
        answers = torch.full((rows, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        ends = torch.tensor(self.end_ids, device=device)
        for number in range(max_new_tokens):
            token = torch.where(ended, self.pad_id, pick(logits, temperature, top_p, generator))
            answers[:, number] = token
            ended |= torch.isin(token, ends)
            if number + 1 == max_new_tokens or (number % 8 == 7 and bool(ended.all())):  # a host sync every 8 steps
                break
            logits = step(token)
        result = []
        for row in answers.tolist():
            end = next((i for i, t in enumerate(row) if t in self.end_ids), None)
            result.append(row[: end + 1] if end is not None else row + [self.end_ids[0]])
        return result

    def load_prefix(self, ids: list[int], cache: BatchCache) -> None:
        """The prefix's keys and values into `cache` (every row, indices 0..len-1): computed once
        per distinct prefix, then copied."""
        device = cache.index.device
        if ids != self.prefix_ids:
            self.prefix_ids, self.prefix_states = None, []  # never keep a half-made prefix
            single = BatchCache(self.layers, 1, len(ids), device)
            positions = torch.full((1, single.capacity), -1, dtype=torch.long, device=device)
            positions[0, : len(ids)] = torch.arange(len(ids), device=device)
            self.forward(torch.tensor([ids], device=device), positions, single, start=0, logits=False, causal=True)
            self.prefix_states = [
                (k[:, :, : len(ids)], v[:, :, : len(ids)]) for k, v in zip(single.keys, single.values)
            ]
            self.prefix_ids = list(ids)
            self.prefix_forwards += 1
        cache.index = torch.arange(len(ids), device=device)
        for layer, (keys, values) in enumerate(self.prefix_states):
            cache.update(keys.expand(cache.rows, -1, -1, -1), values.expand(cache.rows, -1, -1, -1), layer)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: BatchCache,
        start: int,
        logits: bool = True,
        causal: bool = False,
    ):
        """Run `ids` ([rows, n], written at cache indices start..start+n-1) against everything the
        cache holds; the next-token logits (fp32) of each row's last column. `causal`: one row with
        no holes from index 0 (the prefix), where the kernel's own causal rule needs no mask."""
        count = ids.shape[1]
        cache.index = torch.arange(start, start + count, device=ids.device)
        queries = positions[:, start : start + count]
        if causal and not (self.eager or self.window):  # no [n, n] mask: a 64k-token context fits
            return self.run(ids, queries, None, cache, logits)
        # a query sees its row's keys at or before its own position; a hole sees only itself (its
        # outputs are never read, but must stay finite: they become keys the mask then hides)
        visible = (positions[:, None, :] >= 0) & (positions[:, None, :] <= queries[:, :, None])
        visible[:, torch.arange(count, device=ids.device), cache.index] = True
        return self.run(ids, queries, self.masks(visible, queries, positions), cache, logits)

    def masks(self, visible: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor):
        """The attention mask(s) for queries at logical positions `queries` ([rows, n]) that may see
        the keys `visible` marks ([rows, n, cache capacity]; `positions`: each key's logical
        position), windowed where the model's layers are."""
        windowed = None
        if self.window:  # transformers' window: a key is seen while query - key < window
            windowed = visible & (queries[:, :, None] - positions[:, None, :] < self.window)
        if "sliding_attention" in self.layer_types:
            return {"full_attention": self.as_mask(visible), "sliding_attention": self.as_mask(windowed)}
        return self.as_mask(windowed if self.window_everywhere else visible)  # a 4D mask is used as given

    def run(self, ids: torch.Tensor, queries: torch.Tensor, masks, cache: BatchCache, logits: bool = True):
        """The model over `ids` at logical positions `queries` under `masks` (None: causal),
        writing its keys and values at cache.index."""
        arguments = dict(
            input_ids=ids,
            position_ids=queries.clamp(min=0),
            attention_mask=masks,
            use_cache=True,
            cache_position=cache.index,
            **{self.cache_argument: cache},
        )
        if not logits:  # the prefix: its keys and values only, no vocabulary-sized work
            self.model.base_model(**arguments)
            return None
        return self.model(**arguments, logits_to_keep=1).logits[:, -1].float()

    def as_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[rows, 1, queries, keys]: boolean for sdpa, additive for eager attention."""
        visible = visible[:, None]
        if not self.eager:
            return visible
        dtype = self.model.dtype
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(dtype).min
        )


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
        queries = self.next_position[:, None]
        masks = self.decoder.masks((positions >= 0)[:, None, :], queries, positions)
        return self.decoder.run(self.token[:, None], queries, masks, self.cache)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        if self.capture:
            self.capture = False
            self.graph = captured(self)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits.clone()  # the graph's output buffer is overwritten by the next replay
        else:
            logits = self.compute()
        self.next_position += 1
        self.cache.index += 1
        return logits


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
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if attention_mask is None:  # the prefix from cache index 0, or a plain forward (generate's top-k pass):
        # its keys are its own tokens, the first `queries` of the cache; equal lengths leave no doubt
        # about where a kernel aligns the causal rule (top left in PyTorch's math, lower right in flash)
        key, value = key[:, :, :queries], value[:, :, :queries]
        with backend(query, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            output = sdpa(query, key, value, is_causal=queries > 1, scale=scaling, enable_gqa=groups > 1)
        return output.transpose(1, 2).contiguous(), None
    folded = query.reshape(batch, key.shape[1], groups * queries, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * queries, -1)
    with backend(query, SDPBackend.EFFICIENT_ATTENTION):  # the fused kernel that takes a mask
        output = sdpa(folded, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


def backend(query: torch.Tensor, *cuda_kernels):
    """The SDPA kernels to run on CUDA; on the CPU, PyTorch's choice (which
    attention.avoid_cpu_flash_without_avx512 keeps off a kernel that CPU cannot run)."""
    return sdpa_kernel(list(cuda_kernels)) if query.is_cuda else contextlib.nullcontext()
