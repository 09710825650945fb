"""The kv form of the soft prompt (soft_prompt.form kv): p virtual positions, each a learned key and
value for every layer and key/value head, FP32 [layers, 2, kv heads, p, head dim] (index 0 the
keys, 1 the values): prefix tuning's and a Cartridge's parameterization, which carries a long
context in few positions where input embeddings cannot.

How it runs. The record is laid out exactly as for the embeddings form, x[:a] ++ p positions ++
x[a:], with positions 0 .. L+p-1, so every layout (padded rows, records packed end to end), kernel,
recompute plan and sharding spds has runs it unchanged; the p positions' inputs are zeros. In every
layer spds's attention (spds/kernels/attention.py) puts the prompt's keys and values in place of
the ones computed at those positions before any kernel sees them (`Splice`). A position after
the prompt then sees the learned keys and values where the embeddings form would have computed
them; the p positions' own outputs reach nothing (their keys and values are replaced in the next
layer too, and they predict no label). Per record this costs what the embeddings form costs, plus
a copy of each layer's keys and values.

RoPE. The keys are stored after rotation, at the positions the prompt takes (a .. a+p-1 for
insertion offset a): what a transformers KV cache holds for those positions, so a prompt is used
exactly as trained wherever it goes at the same offset, and the prefix placement's (a = 0) is a
PEFT CARTRIDGE adapter's `past_key_values` as they are (spds/trained/export.py). The offset is the chat
template's header length, the same for every record of a run; export records it.

Starting value: random (init.std), or the keys and values the student itself computes for tokens
placed where the prompt goes (after the header): the context's first tokens (init.method context,
Cartridges' initialization), init.text's, or random vocabulary tokens'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spds.errors import SpdsError
from spds.kernels.attention import head_dim_of


def form_of(prompt: torch.Tensor) -> str:
    """soft_prompt.form of a prompt tensor: kv [layers, 2, kv heads, p, head dim], or embeddings
    [p, hidden]."""
    return "kv" if prompt.dim() == 5 else "embeddings"


def length_of(prompt: torch.Tensor) -> int:
    """p, the virtual positions a prompt of either form takes in every record."""
    return prompt.shape[3] if prompt.dim() == 5 else prompt.shape[0]


def stand_in(prompt: torch.Tensor, hidden: int) -> torch.Tensor:
    """What a record holds where a kv prompt goes: zeros of the hidden size at its p positions,
    whose keys and values the prompt's replace in every layer."""
    return prompt.new_zeros(length_of(prompt), hidden)


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
class Splice:
    """The prompt's keys and values for the forward in flight, and where they go: the flat (row,
    position) of each record's p prompt positions, in order (built once per forward)."""

    prompt: torch.Tensor  # [layers, 2, kv heads, p, head dim], FP32 (the parameter)
    rows: torch.Tensor  # int64 [records x p]
    positions: torch.Tensor  # int64 [records x p]

    @classmethod
    def at(cls, prompt: torch.Tensor, starts: list[tuple[int, int]]) -> Splice:
        """`starts`: (row, first prompt position) of each record."""
        p = prompt.shape[3]
        offsets = torch.arange(p)
        rows = torch.tensor([row for row, _ in starts]).repeat_interleave(p)
        positions = (torch.tensor([start for _, start in starts])[:, None] + offsets).reshape(-1)
        device = prompt.device
        return cls(prompt, rows.to(device, non_blocking=True), positions.to(device, non_blocking=True))

    def apply(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key and value [B, kv heads, L, D] with the prompt's in place at its positions: a new
        tensor each (autograd carries the gradient to the prompt), in the keys' dtype."""
        records = len(self.rows) // self.prompt.shape[3]
        spliced = []
        for index, states in enumerate((key, value)):
            learned = self.prompt[layer, index].to(states.dtype).transpose(0, 1)  # [p, kv heads, D]
            learned = learned.repeat(records, 1, 1)
            spliced.append(states.transpose(1, 2).index_put((self.rows, self.positions), learned).transpose(1, 2))
        return spliced[0], spliced[1]


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
