"""The kv form of the soft prompt (soft_prompt.form kv): p virtual positions, each a learned key and
value for every layer and key/value head, FP32 [layers, 2, kv heads, p, head dim] (index 0 the
keys, 1 the values): prefix tuning's and a Cartridge's parameterization, which carries a long
context in few positions where input embeddings cannot.

How it runs: as a cache, not as positions. A record x (L tokens, the prompt inserted at a) is run
over its own L tokens only, x[:a] at positions 0 .. a-1 and x[a:] at a+p .. L+p-1, the positions
they hold with the prompt before them. In every layer spds's attention (spds/kernels/attention.py)
reads, for each record, a key buffer header ++ prompt ++ rest: x[:a]'s queries attend to x[:a]'s
keys, x[a:]'s to all three, each causally from the lower right (`PromptCache`). No projection,
MLP or norm runs for the prompt: its cost is the attention to p more keys (and the buffer's copy),
whatever p, where laying its p positions into every record cost a whole forward over them (at
1.7B on an H100, p = 1,024 cost 2.56x the step of p = 16; bench/RESULTS.md). It is exactly what a transformers
DynamicCache holding the header and the prompt computes for the rest (tests/test_kv_prompt.py).

RoPE. The keys are stored after rotation, at the positions the prompt takes (a .. a+p-1 for
insertion offset a): what a transformers KV cache holds for those positions, so a prompt is used
exactly as trained wherever it goes at the same offset, and the prefix placement's (a = 0) is a
PEFT CARTRIDGE adapter's `past_key_values` as they are (spds/trained/export.py). The offset is the chat
template's header length, the same for every record of a run; export records it.

Starting value: random (init.std), or the keys and values the student itself computes for tokens
placed where the prompt goes (after the header): the context's first tokens (init.method context,
Cartridges' initialization; a corpus's first tokens, or with init.spread its slices' first
tokens in turn), init.text's, or random vocabulary tokens'.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from spds.errors import SpdsError
from spds.kernels.attention import head_dim_of
from spds.kernels.causal import varlen_lower_right


def form_of(prompt: torch.Tensor) -> str:
    """soft_prompt.form of a prompt tensor: kv [layers, 2, kv heads, p, head dim], or embeddings
    [p, hidden]."""
    return "kv" if prompt.dim() == 5 else "embeddings"


def length_of(prompt: torch.Tensor) -> int:
    """p, the virtual positions a prompt of either form takes in every record."""
    return prompt.shape[3] if prompt.dim() == 5 else prompt.shape[0]


def inserted_positions(form: str, length: int) -> int:
    """Positions a prompt adds to each record's forward pass: p for the embeddings form, none for
    the kv form (read as a cache: its cost is the attention to p more keys)."""
    return 0 if form == "kv" else length


def require_fits(prompt: torch.Tensor, student, source: str) -> None:
    """Refuse, naming `source` and the expected and found shapes, a prompt its student cannot run:
    another form's or student's shape (layers, key/value heads, head size or hidden size), or a
    value that is not finite (a NaN decodes as noise, "!!!!", and trains nothing back)."""
    if prompt.dim() not in (2, 5) or not length_of(prompt):
        raise SpdsError(
            f"{source}: the soft prompt's shape {list(prompt.shape)} is neither [p, hidden] nor "
            "[layers, 2, kv heads, p, head dim] with p > 0: rule 'prompt fits its student'"
        )
    name = getattr(student.config, "_name_or_path", "") or type(student).__name__
    if form_of(prompt) == "kv":
        expected = list(kv_shape(student, length_of(prompt)))
    else:
        expected = [length_of(prompt), student.get_input_embeddings().embedding_dim]
    if list(prompt.shape) != expected:
        raise SpdsError(
            f"{source}: the soft prompt is form {form_of(prompt)} {list(prompt.shape)}, and the student {name} takes "
            f"{expected}: rule 'prompt fits its student' (a prompt trained for another student, or another form)"
        )
    if not bool(torch.isfinite(prompt).all()):
        bad = int((~torch.isfinite(prompt)).sum())
        raise SpdsError(
            f"{source}: the soft prompt holds {bad} values that are not finite (NaN or infinity): "
            "rule 'prompt fits its student'; use an earlier checkpoint"
        )


def kv_shape(student, length: int) -> tuple[int, int, int, int, int]:
    """[layers, 2, kv heads, length, head dim] of a kv prompt for `student`; refused for a student
    whose layers differ in their key/value shapes (one tensor holds every layer's)."""
    config = student.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dims = {tuple(m.k_proj.weight.shape) for m in attention_modules(student) if hasattr(m, "k_proj")}
    if len(dims) > 1:
        raise SpdsError(
            f"soft_prompt.form kv: the layers of {type(student).__name__} have keys of different shapes "
            f"({sorted(dims)}): use form embeddings"
        )
    return config.num_hidden_layers, 2, heads, length, head_dim_of(config)


def attention_modules(student) -> list:
    return [m for m in student.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]


@dataclass
class PromptCache:
    """The kv prompt as every layer reads it in the forward in flight: for each record, where its
    key buffer's entries come from (its own keys, the prompt's) and the attention sequences over
    them. Built once per forward from the records' places in the flattened positions ([rows x
    length] padded, or the packed row), read by every layer and by its recompute in backward
    (transformers' checkpointing keeps a layer's keywords).

    The sequences, in the order of the flattened queries: per record, its header's a queries
    against the header's a keys, then its rest's L-a queries against header ++ prompt ++ rest
    (a+p+L-a keys). Each is causal from the lower right, so a rest query at buffer index a+p+i
    (its position) sees every key up to its own; a header query never sees the prompt."""

    prompt: torch.Tensor  # [layers, 2, kv heads, p, head dim], FP32 (the parameter)
    index: torch.Tensor  # int64 [keys]: each buffer entry's row of [the records' own keys ++ the prompt's]
    sequences: list[tuple[int, int, int, int]]  # (first query, queries, first key, keys) of each
    starts_q: torch.Tensor  # int32 [sequences + 1], cumulative query counts (variable-length kernels)
    starts_k: torch.Tensor  # int32 [sequences + 1], cumulative key counts
    longest_q: int  # the most queries of a sequence (the variable-length kernels' bound)
    longest_k: int  # the most keys of a sequence

    @classmethod
    def at(cls, prompt: torch.Tensor, records: list[tuple[int, int, int]]) -> PromptCache:
        """`records`: (first flat position, length, insertion offset a) of each record, in order,
        together covering the flattened positions (a padded row's padding is its record's: it comes
        after every real query, which never sees it)."""
        p = length_of(prompt)
        total = records[-1][0] + records[-1][1]  # the flattened positions: the prompt's rows follow them
        learned = torch.arange(total, total + p)
        pieces, sequences, keys = [], [], 0
        for first, length, a in records:
            header = torch.arange(first, first + a)
            if a:
                pieces.append(header)
                sequences.append((first, a, keys, a))
                keys += a
            pieces += [header, learned, torch.arange(first + a, first + length)]
            sequences.append((first + a, length - a, keys, length + p))
            keys += length + p

        def on_device(values: torch.Tensor) -> torch.Tensor:
            return (values.pin_memory() if prompt.is_cuda else values).to(prompt.device, non_blocking=True)

        def cumulative(counts: list[int]) -> torch.Tensor:
            return on_device(torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32))

        queries, keys = [s[1] for s in sequences], [s[3] for s in sequences]
        index = on_device(torch.cat(pieces))
        return cls(prompt, index, sequences, cumulative(queries), cumulative(keys), max(queries), max(keys))

    def buffer(self, layer: int, states: torch.Tensor, index: int) -> torch.Tensor:
        """The key (index 0) or value (1) buffer [keys, kv heads, D] of `layer` from the records'
        own `states` [B, kv heads, length, D]: one gather from the records' keys and the prompt's.
        Its backward is one scatter-add (index_select's, deterministic under train.deterministic's
        strict mode), which sums every record's share of the gradient into the prompt; a
        concatenation of slices cost a full-size gradient per slice (O(records x positions))."""
        flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])  # [B x length, kv heads, D]
        learned = self.prompt[layer, index].to(states.dtype).transpose(0, 1)  # [p, kv heads, D]
        return torch.cat([flat, learned]).index_select(0, self.index)

    def attention(self, layer: int, query, key, value, scaling, kernel: str, window=None, softcap=None):
        """transformers' attention signature's tensors ([B, H, length, D]) -> [B, length, Hq, D]."""
        batch, heads, length, dim = query.shape
        rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
        output = varlen_lower_right(
            rows,
            self.buffer(layer, key, 0),
            self.buffer(layer, value, 1),
            self,
            scaling,
            kernel,
            window,
            softcap,
        )
        return output.reshape(batch, length, heads, dim)


def cached_states(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers cache's keys and values of `layer` ([1, kv heads, positions, D])."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


@torch.no_grad()
def prefilled(student, header: list[int], tokens: list[int]) -> torch.Tensor:
    """FP32 [layers, 2, kv heads, len(tokens), D]: the keys and values the student computes for
    `tokens` placed after `header` (the chat template's tokens before the prompt), as a prefill:
    the keys rotated at positions len(header) .. len(header)+len(tokens)-1, where the prompt goes."""
    device = student.get_input_embeddings().weight.device
    ids = torch.tensor([header + tokens], device=device)
    output = student.base_model(input_ids=ids, use_cache=True)
    a, layers = len(header), student.config.num_hidden_layers
    states = [cached_states(output.past_key_values, layer) for layer in range(layers)]
    return torch.stack([torch.stack([k[0, :, a:], v[0, :, a:]]) for k, v in states]).float().cpu()


def moved(student, prompt: torch.Tensor, shift: int) -> torch.Tensor:
    """A kv prompt whose keys are rotated as if it sat `shift` positions later: RoPE's rotation by
    m + shift is its rotation by m, then by shift, so the keys stored after rotation at a .. a+p-1
    are turned by shift alone (its scaled frequencies, YaRN's and Llama 3's too; the attention
    factor some scalings fold into cos and sin is already in the keys, and is divided out of the
    turn). The turn's cos and sin come from the student family's own rotary module, and its own
    apply_rotary_pos_emb applies them (in fp64: one rounding, at the end).
    Refused for a family with more than one rotary module (Gemma 3: one per kind of layer) or a
    dynamic scaling (its frequencies depend on the length read)."""
    import sys

    ropes = [m for m in student.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(ropes) != 1:
        raise SpdsError(
            f"composing kv prompts turns their keys to new positions, and {type(student).__name__} has "
            f"{len(ropes)} rotary embeddings (one a kind of layer, or none): compose embeddings prompts instead"
        )
    kind = getattr(ropes[0], "rope_type", "default")
    if kind == "dynamic":
        raise SpdsError("composing kv prompts: a dynamic RoPE scaling's frequencies depend on the length read")
    if shift == 0 or not length_of(prompt):
        return prompt
    with torch.device("cpu"):  # the student's own may sit on the meta device
        rope = type(ropes[0])(config=student.config)
    family = sys.modules[type(student).__module__]
    p = length_of(prompt)
    probe = torch.zeros(1, p, prompt.shape[-1], dtype=torch.float64)
    cos, sin = rope(probe, torch.full((1, p), shift, dtype=torch.long))
    scale = float(getattr(rope, "attention_scaling", 1.0))
    cos, sin = cos.double() / scale, sin.double() / scale
    turned = prompt.clone()
    for layer in range(prompt.shape[0]):
        keys = prompt[layer, 0][None].double()  # [1, kv heads, p, D]
        _, keys = family.apply_rotary_pos_emb(keys, keys, cos, sin)
        turned[layer, 0] = keys[0].to(prompt.dtype)
    return turned
