"""SoftPromptModel: a frozen student plus one FP32 prompt parameter spliced into its input.

For a record of ids x (length L) with the prompt inserted at position a, the student sees

    embed(x[:a]) ++ prompt ++ embed(x[a:])        positions 0 .. L+P-1 over the joined sequence

(the embeddings form; the kv form reads its prompt as a cache instead, spds/model/kv_prompt.py:
x alone, x[a:] at positions a+P .., so P = 0 positions of the forward are the prompt's)

and the loss is the summed cross entropy of the response ids x[prefix:], each predicted from the
position before it. Those predicting positions are the contiguous rows prefix+P-1 .. L+P-2 of
the final hidden states, so only they reach lm_head (prompt and prefix positions never carry a
label, and never cost vocabulary-sized work).

The prompt is the only trainable parameter of this module, so it is the only tensor DeepSpeed
reduces; it stays FP32 (the student runs in bf16; the prompt is cast on the way in, and its
gradient accumulates in FP32).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from spds.errors import SpdsError
from spds.kernels.attention import PROMPT_CACHE_KEYWORD, AttentionPlan
from spds.kernels.attention import install as install_attention
from spds.model.kv_prompt import PromptCache, form_of, inserted_positions, length_of
from spds.model.layout import Replicated
from spds.model.loss import LossFn, TeacherTargets, final_logit_softcap
from spds.model.recompute import RecomputePolicy, enable_recompute, recompute_first


@dataclass
class Segment:
    """One record as the model needs it."""

    ids: torch.Tensor  # int64 [L], on the model's device
    prefix_tokens: int
    insert_at: int
    index: int = -1  # the record's index in the packed store (-1: not from one)
    top_ids: torch.Tensor | None = None  # int64 [supervised tokens, K]: an offline teacher's top-k (if packed)
    top_logprobs: torch.Tensor | None = None  # float32, the same shape
    # [start, end) of each supervised run when a record trains several assistant turns; None: the
    # one run from prefix_tokens to its end
    spans: tuple[tuple[int, int], ...] | None = None
    header: bytes | None = None  # ids[:insert_at] as int64 bytes, from the host (None: read from ids)

    @property
    def header_key(self) -> bytes:
        """The ids before the insertion point, as bytes: what the online teacher caches a prefix by.
        From the host copy when the record came from the store (no device-to-host wait per record)."""
        if self.header is None:
            self.header = self.ids[: self.insert_at].cpu().numpy().astype("int64").tobytes()
        return self.header

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        return self.spans or ((self.prefix_tokens, len(self.ids)),)

    @property
    def supervised_tokens(self) -> int:
        return sum(end - start for start, end in self.runs)

    def supervised_rows(self, states: torch.Tensor, offset: int) -> torch.Tensor:
        """The rows of `states` that predict the supervised tokens: row r + offset predicts ids[r + 1]."""
        runs = [states[start + offset - 1 : end + offset - 1] for start, end in self.runs]
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    def supervised_ids(self) -> torch.Tensor:
        runs = [self.ids[start:end] for start, end in self.runs]
        return runs[0] if len(runs) == 1 else torch.cat(runs)


def load_segments(store, records: list[int], device: torch.device) -> dict[int, Segment]:
    """`records` of the packed store on the device, copied in one transfer (pinned memory,
    asynchronous): a per-record copy from pageable memory would stall the host every time."""
    import numpy as np

    def to_device(arrays: list) -> list[torch.Tensor]:
        host = torch.from_numpy(np.concatenate(arrays))
        whole = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
        return list(whole.split([len(a) for a in arrays]))

    host_ids = [store.ids(i) for i in records]
    ids = to_device(host_ids)
    segments = {
        i: Segment(
            ids=own,
            prefix_tokens=int(store.prefix_tokens[i]),
            insert_at=int(store.insert_at[i]),
            index=int(i),
            spans=store.spans.get(int(i)),
            header=np.asarray(host[: int(store.insert_at[i])], dtype=np.int64).tobytes(),
        )
        for i, own, host in zip(records, ids, host_ids)
    }
    if store.top_k:  # an offline teacher's top-k: [supervised tokens, K] per record, likewise in one copy each
        tops = [store.top_k_of(i) for i in records]
        for i, top_ids, top_logprobs in zip(records, to_device([t[0] for t in tops]), to_device([t[1] for t in tops])):
            segments[i].top_ids, segments[i].top_logprobs = top_ids, top_logprobs
    return segments


def packed_keywords(lengths: list[int], device: torch.device, first_position: int = 0, skips=None) -> dict:
    """The keywords of a forward over sequences of `lengths` end to end in one row: each one's
    positions from `first_position` on (`skips`: per sequence (a, p), positions a.. moved p on, a kv
    prompt's place), and transformers' variable-length keywords, which spds's attention reads (the
    cumulative lengths copied pinned and asynchronously: no host sync per forward)."""
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if device.type == "cuda":
        starts = starts.pin_memory().to(device, non_blocking=True)
    skips = skips or [(0, 0)] * len(lengths)
    positions = torch.cat([record_positions(n, *skip, device, first_position) for n, skip in zip(lengths, skips)])
    longest = max(lengths)
    return dict(
        position_ids=positions[None],
        cu_seq_lens_q=starts,
        cu_seq_lens_k=starts,
        max_length_q=longest,
        max_length_k=longest,
    )


def record_positions(length: int, a: int, p: int, device, first: int = 0) -> torch.Tensor:
    """The positions of a record's `length` tokens from `first` on, those from index a on moved p
    later (where a kv prompt of p positions sits, read as a cache)."""
    positions = torch.arange(first, first + length, device=device)
    return positions + p * (positions >= first + a) if p else positions


class SoftPromptModel(nn.Module):
    def __init__(
        self,
        student: nn.Module,
        prompt: torch.Tensor,
        loss_fn: LossFn,
        activation_checkpointing: bool | str = False,
        attention_kernel: str | dict = "auto",
        activation_memory_gib: float | None = None,
        pad_to_multiple_of: int | None = None,
        device: torch.device | None = None,
        deterministic: bool = False,
        liger_kernels: bool = False,
        packed: bool = False,
        frozen_positions: int = 0,
    ):
        super().__init__()
        # the prompt's form (soft_prompt.form): [p, hidden] input embeddings, or [layers, 2, kv heads,
        # p, head dim] keys and values every layer reads as a cache (spds/model/kv_prompt.py)
        self.form = form_of(prompt)
        device = device or student.device  # a student still on the host waits to be sharded onto `device`
        if pad_to_multiple_of is None:  # bucket shapes for the GPU kernels; exact lengths on CPU
            pad_to_multiple_of = 256 if device.type == "cuda" else 1
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packed = packed  # several records in one forward: end to end (True) or right-padded rows
        self.student = student
        self.prompt = nn.Parameter(prompt.to(torch.float32).to(device))
        if frozen_positions:  # soft_prompt.frozen_positions: the first positions keep their start (no gradient)
            kept = torch.ones_like(self.prompt)
            (kept[..., :frozen_positions, :] if self.form == "kv" else kept[:frozen_positions]).zero_()
            self.prompt.register_hook(lambda gradient: gradient * kept)
        self.loss_fn = loss_fn
        self.attention = AttentionPlan(attention_kernel, student, device, deterministic)
        self.kernel_choice = install_attention(student)  # None: the student's own attention (eager, ...)
        if packed and self.kernel_choice is None:  # the config check says so first; a library caller learns here
            raise SpdsError("packed micro-batches need spds's attention: load the student with sdpa attention")
        if self.form == "kv" and self.kernel_choice is None:
            raise SpdsError(
                "soft_prompt.form kv puts its keys and values in spds's attention: load the student with sdpa "
                "attention (student.attn_implementation), or use form embeddings"
            )
        self.recompute = RecomputePolicy(
            activation_checkpointing, student, activation_memory_gib, device, self.attention, liger_kernels
        )
        self.layout = Replicated()  # a sharded layout replaces it (spds/training/sharded.py)
        if activation_checkpointing is not False:
            enable_recompute(student)
        student.eval()

    def use_kernel(self, longest: int, packed: bool = False) -> None:
        """The kernel of the next forward (and of its recompute in backward), from the plan."""
        if self.kernel_choice is not None:
            self.kernel_choice.kernel = self.attention.kernel(longest, packed)

    @property
    def prompt_length(self) -> int:
        """p, the virtual positions the prompt takes in every record."""
        return length_of(self.prompt)

    @property
    def inserted_positions(self) -> int:
        return inserted_positions(self.form, self.prompt_length)

    def block_of(self, inserted: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """What goes where the prompt goes: `inserted` (eval: the context's embeddings, nothing),
        or the prompt: its embeddings, or for the kv form nothing (whether every layer reads it as
        a cache)."""
        if inserted is not None:
            return inserted, False
        if self.form == "embeddings":
            return self.prompt, False
        hidden = self.student.get_input_embeddings().embedding_dim  # not the weight: ZeRO-3 partitions it
        return self.prompt.new_zeros(0, hidden), True

    def joined_embeddings(self, segments: list[Segment], block: torch.Tensor) -> list[torch.Tensor]:
        """embed(x[:a]) ++ block ++ embed(x[a:]) for each segment; one embedding call for all."""
        tokens = self.student.get_input_embeddings()(torch.cat([s.ids for s in segments]))
        if not len(block):
            return list(tokens.split([len(s.ids) for s in segments]))
        joined = []
        for segment, own in zip(segments, tokens.split([len(s.ids) for s in segments])):
            a = segment.insert_at
            joined.append(torch.cat([own[:a], block.to(own.dtype), own[a:]], dim=0))
        return joined

    def hidden_states(
        self,
        segments: list[Segment],
        block: torch.Tensor,
        recompute_positions: int | None = None,
        cached: bool = False,
    ) -> list[torch.Tensor]:
        """Final hidden states [L+P, H] of each segment, in one forward pass (`cached`: the kv
        prompt read as a cache, P = 0).

        Several segments are right-padded into one batch, with no attention mask: under causal
        attention a position never sees a later one, so padding after a record's end cannot change
        its outputs, and the fast causal kernels (flash, cuDNN) stay usable. The padded length is
        rounded up to pad_to_multiple_of so that the kernels see few distinct shapes (cuDNN builds
        a plan per shape)."""
        self.layout.before_forward()
        joined = self.joined_embeddings(segments, block)
        p = self.prompt_length if cached else 0
        skips = [(s.insert_at, p) for s in segments]
        if self.packed and len(joined) > 1:
            return self.packed_hidden_states(joined, recompute_positions, skips, cached)
        longest = max(len(j) for j in joined)
        longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if len(joined) == 1 and longest == len(joined[0]):
            inputs = joined[0][None]
        else:
            inputs = torch.stack([nn.functional.pad(j, (0, 0, 0, longest - len(j))) for j in joined])
        device = self.prompt.device
        if cached:  # each row's positions from its own insertion point on moved p later
            positions = torch.stack([record_positions(longest, *skip, device) for skip in skips])
        else:
            positions = torch.arange(longest, device=device)[None].expand(len(joined), -1)
        kv = self.cache([(row * longest, longest, a) for row, (a, _) in enumerate(skips)]) if cached else {}
        # A sharded student's ranks decide alike, from the positions the plan agreed on.
        if recompute_positions:  # the plan's figure, the same on every rank (a rank's own record count is not)
            count = self.recompute(recompute_positions)
        else:
            count = self.recompute(longest * len(joined), longest, prompt_keys=p * len(joined))
        recompute_first(self.student, count)
        self.use_kernel(longest)
        output = self.student.base_model(inputs_embeds=inputs, position_ids=positions, use_cache=False, **kv)
        return [output.last_hidden_state[i, : len(j)] for i, j in enumerate(joined)]

    def cache(self, records: list[tuple[int, int, int]]) -> dict:
        """The keyword that carries the kv prompt, as a cache, to spds's attention in every layer
        (and to a recomputed layer in backward: transformers' checkpointing keeps a layer's keywords)."""
        return {PROMPT_CACHE_KEYWORD: PromptCache.at(self.prompt, records)}

    def packed_hidden_states(
        self, joined: list[torch.Tensor], recompute_positions: int | None, skips: list, cached: bool
    ) -> list[torch.Tensor]:
        """The joined sequences end to end in one row (optim.micro_batch_layout packed): each one's
        positions restart at 0 and its attention sees only itself (attention.packed_causal), so
        each gets the outputs it would get alone, with no padding computed."""
        lengths = [len(j) for j in joined]
        longest = max(lengths)
        self.use_kernel(longest, packed=True)
        # a kv prompt's buffers are counted where the ranks need not agree (a rank's record count is its own)
        prompt_keys = self.prompt_length * len(lengths) if cached and not recompute_positions else 0
        recompute_first(self.student, self.recompute(recompute_positions or sum(lengths), longest, True, prompt_keys))
        kv = {}
        if cached:
            firsts = itertools.accumulate([0, *lengths[:-1]])
            kv = self.cache([(first, n, a) for first, n, (a, _) in zip(firsts, lengths, skips)])
        output = self.student.base_model(
            inputs_embeds=torch.cat(joined)[None],
            use_cache=False,
            **packed_keywords(lengths, self.prompt.device, skips=skips),
            **kv,
        )
        return list(output.last_hidden_state[0].split(lengths))

    def response_states(
        self, segments: list[Segment], inserted: torch.Tensor | None = None, recompute_positions: int | None = None
    ):
        """(hidden rows that predict the response tokens, those tokens), over all `segments`.

        `inserted` replaces the prompt by another block of embeddings at the same place (spds eval:
        the context's token embeddings for the ceiling, nothing for the floor)."""
        block, cached = self.block_of(inserted)
        P = block.shape[0]
        rows, targets = [], []
        for segment, hidden in zip(segments, self.hidden_states(segments, block, recompute_positions, cached)):
            rows.append(segment.supervised_rows(hidden, P))  # the prompt's P rows precede every response token
            targets.append(segment.supervised_ids())
        return torch.cat(rows), torch.cat(targets)

    def forward(
        self,
        segments: list[Segment],
        teacher: TeacherTargets | None = None,
        inserted: torch.Tensor | None = None,
        recompute_positions: int | None = None,
        loss_fn=None,
    ) -> torch.Tensor:
        """The summed loss (fp32 scalar) over the supervised tokens of `segments`: the model's own
        loss (loss.objective), or `loss_fn`; `teacher`: the teacher's targets for the same
        segments, for a loss that needs them (spds/model/teacher.py computes them; the step hands them in)."""
        return self.losses(segments, [loss_fn or self.loss_fn], teacher, inserted, recompute_positions)[0]

    def losses(
        self,
        segments: list[Segment],
        loss_fns: list,
        teacher: TeacherTargets | None = None,
        inserted: torch.Tensor | None = None,
        recompute_positions: int | None = None,
    ) -> list[torch.Tensor]:
        """Each of `loss_fns` over one forward of the student (eval: the NLL and the KL together)."""
        cap = final_logit_softcap(self.student)
        if any(getattr(f, "softcap", None) != cap for f in loss_fns):  # never train on other logits than the head's
            raise SpdsError(
                f"{type(self.student).__name__} soft-caps its logits at {cap}, and a loss was built for "
                f"another cap: build it with make_loss(settings, final_logit_softcap(student))"
            )
        if teacher is None and any(f.needs_teacher for f in loss_fns):
            raise SpdsError(
                "this loss matches a teacher, and no teacher targets were given: compute them with "
                "spds.model.teacher.build_teacher(...).targets(segments) and pass them as teacher="
            )
        rows, targets = self.response_states(segments, inserted, recompute_positions)
        weight = self.student.get_output_embeddings().weight
        with self.layout.gathered([weight]):  # the loss computes d(loss)/d(rows) now: backward needs no weight
            return [loss_fn(rows, weight, targets, teacher) for loss_fn in loss_fns]
