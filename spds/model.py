"""SoftPromptModel: a frozen student plus one FP32 prompt parameter spliced into its input.

For a record of ids x (length L) with the prompt inserted at position a, the student sees

    embed(x[:a]) ++ prompt ++ embed(x[a:])        positions 0 .. L+P-1 over the joined sequence

and the loss is the summed cross entropy of the response ids x[prefix:], each predicted from the
position before it. Those predicting positions are the contiguous rows prefix+P-1 .. L+P-2 of
the final hidden states, so only they reach lm_head (prompt and prefix positions never carry a
label, and never cost vocabulary-sized work).

The prompt is the only trainable parameter of this module, so it is the only tensor DeepSpeed
reduces; it stays FP32 (the student runs in bf16; the prompt is cast on the way in, and its
gradient accumulates in FP32).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from .attention import NAME as SPDS_ATTENTION
from .attention import QUADRATIC_ATTENTION_BYTES, head_dim_of, kernel_for, packed_kernel
from .attention import install as install_attention
from .attention import resolve as resolve_kernels
from .fsio import SpdsError
from .loss import final_logit_softcap


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

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        return self.spans or ((self.prefix_tokens, len(self.ids)),)

    @property
    def supervised_tokens(self) -> int:
        return sum(end - start for start, end in self.runs)

    def supervised_rows(self, states: torch.Tensor, offset: int) -> torch.Tensor:
        """The rows of `states` that predict the supervised tokens: row r + offset predicts ids[r + 1]."""
        runs = [states[start + offset - 1:end + offset - 1] for start, end in self.runs]
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

    ids = to_device([store.ids(i) for i in records])
    segments = {i: Segment(ids=own, prefix_tokens=int(store.prefix_tokens[i]), insert_at=int(store.insert_at[i]),
                           index=int(i), spans=store.spans.get(int(i))) for i, own in zip(records, ids)}
    if store.top_k:  # an offline teacher's top-k: [supervised tokens, K] per record, likewise in one copy each
        tops = [store.top_k_of(i) for i in records]
        for i, top_ids, top_logprobs in zip(records, to_device([t[0] for t in tops]), to_device([t[1] for t in tops])):
            segments[i].top_ids, segments[i].top_logprobs = top_ids, top_logprobs
    return segments


def load_student(model_path, dtype: str, attn_implementation: str, device: torch.device) -> nn.Module:
    """An sdpa student runs spds's attention (spds/attention.py), which computes windows and soft
    caps itself: a family transformers does not offer SDPA for (Gemma 2, for its soft cap) is
    loaded with its eager attention and then given spds's."""
    from transformers import AutoModelForCausalLM

    load = functools.partial(AutoModelForCausalLM.from_pretrained, str(model_path), local_files_only=True,
                             dtype=getattr(torch, dtype))
    try:
        student = load(attn_implementation=attn_implementation)
    except ValueError as error:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(error):
            raise
        student = load(attn_implementation="eager")
        student.config._attn_implementation = "sdpa"
        install_attention(student)  # spds's from the start: transformers' own sdpa path refuses the cap
    student.requires_grad_(False)
    return student.to(device)


def apply_liger_kernels(student: nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels in place of the student's own (its loss is spds's)."""
    from .fsio import SpdsError
    from .loss import liger_available

    if not liger_available():
        raise SpdsError("student.liger_kernels is true but liger-kernel is not importable or there is no CUDA device "
                        "(pip install 'spds[gpu]', or set student.liger_kernels to false)")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if student.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise SpdsError(f"student.liger_kernels: Liger has no kernels for model type {student.config.model_type!r}")
    # Liger 0.8 runs RoPE as a CuTe DSL kernel wherever nvidia-cutlass-dsl imports (spds[fa4] brings
    # it), and that kernel is compiled once per sequence length. A packed micro-batch's length is
    # exact, so nearly every micro-batch of a run is a new length: on H200 an update of the 1.7B
    # length mix took 20.7 s instead of 11.2. Liger's Triton RoPE compiles once for every length
    # and runs as fast (bench/RESULTS.md, ninth session). This is Liger's per-op switch, read at
    # each call; a user's own setting stands.
    os.environ.setdefault("LIGER_KERNEL_IMPL_ROPE", "nvidia-triton")
    _apply_liger_kernel_to_instance(model=student, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def initial_prompt(student: nn.Module, length: int, init: dict, seed: int, tokenizer=None) -> torch.Tensor:
    """The prompt's starting value, FP32 [length, hidden], identical on every rank for a seed."""
    embeddings = student.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)  # CPU generator: the same values on any device
    if init.method == "random_normal":
        return torch.randn(length, embeddings.shape[1], generator=generator) * init.std
    if init.method == "vocab_sample":
        ids = torch.randint(0, embeddings.shape[0], (length,), generator=generator)
    else:  # text: its token embeddings, repeated or truncated to the prompt length
        ids = torch.tensor(tokenizer.encode(init.text, add_special_tokens=False))
        ids = ids.repeat((length + len(ids) - 1) // len(ids))[:length]
    return embeddings.detach()[ids.to(embeddings.device)].float().cpu()


def student_config(model_path) -> dict:
    """The student's config.json (a multimodal model's text part), read strictly; {} if not an object."""
    from pathlib import Path

    from .fsio import read_json

    value = read_json(Path(model_path) / "config.json")
    value = value.get("text_config", value) if isinstance(value, dict) else {}
    return value if isinstance(value, dict) else {}


def quadratic_length(model_path) -> float | None:
    """The record length at which attention's FLOPs equal the weights' (forward and input
    gradients, causal): 4 P / (6 layers heads head_dim), P the matmul parameters, lm_head
    included. From the student's config.json; None when its shapes are not all there."""
    value = student_config(model_path)
    try:
        hidden, layers, heads = value["hidden_size"], value["num_hidden_layers"], value["num_attention_heads"]
        head_dim = value.get("head_dim") or hidden // heads
        kv_heads = value.get("num_key_value_heads", heads)
        per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * value[
            "intermediate_size"]
        matmul_parameters = layers * per_layer + value["vocab_size"] * hidden
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return 4 * matmul_parameters / (6 * layers * heads * head_dim)


# Stored activations of a bf16 decoder layer, in bytes per position per hidden unit, without
# checkpointing, by the kernels the layer runs (bench/check_activation_bytes.py, H200, Qwen3
# 1.7B and 8B shapes: the model's own 38.5 and 36.3, Liger's RMSNorm/SwiGLU/RoPE 25.3 and 23.7;
# rounded up). Planning Liger's layers with the larger figure recomputed layers that fit. A
# checkpointed layer keeps only its bf16 input (2 bytes) and, while it is recomputed in
# backward, one layer's full activations.
ACTIVATION_BYTES_PER_HIDDEN = {"own": 40, "liger": 26}
CHECKPOINTED_BYTES_PER_HIDDEN = 2


def decoder_layers(student: nn.Module) -> nn.ModuleList:
    layers = getattr(student.base_model, "layers", None)
    if layers is None:
        from .fsio import SpdsError

        raise SpdsError(f"cannot find the decoder layers of {type(student).__name__} (base_model.layers)")
    return layers


class CheckpointPolicy:
    """Decides per micro-batch how many decoder layers recompute their activations in backward.

    A recomputed layer costs another forward (about half again its forward plus input-gradient
    backward), so spds recomputes only as many layers as memory needs: for "auto", the fewest k
    that bring the micro-batch's activations under the budget, counted as

        positions x hidden x (40 bytes per plain layer (26 with Liger's kernels), 2 per checkpointed
                              one, + one layer's recompute)
      + the attention kernel's memory: a quadratic kernel's score matrices (kept by each plain
        layer, and one layer's transient), FlashAttention-2's deterministic dQ accumulators
        (one fp32 copy of dQ per split of the SMs over the heads, during one layer's backward).

    When even k = all layers cannot fit, it stops the run with the sizes and what to change,
    rather than run out of memory mid-update (the smoke meets the longest micro-batch first).
    True and False: all layers, none."""

    def __init__(self, setting, student: nn.Module, budget_gib: float | None, device: torch.device,
                 kernel_at=lambda length: "auto", deterministic: bool = False, liger_kernels: bool = False):
        self.setting = setting
        self.activation_bytes = ACTIVATION_BYTES_PER_HIDDEN["liger" if liger_kernels else "own"]
        config = student.config
        self.layers, self.hidden = config.num_hidden_layers, config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = head_dim_of(config)
        self.attn_implementation = config._attn_implementation
        # a soft-capped layer (Gemma 2) materialises its scores whatever the kernel (spds/attention.py)
        self.materialised = bool(getattr(config, "attn_logit_softcapping", None))
        self.kernel_at = kernel_at  # padded sequence length -> the SDPA kernel name
        self.budget = budget_gib * 2**30 if budget_gib else None
        self.device = device
        # flash's deterministic backward keeps one fp32 dQ per split of the SMs over the heads
        self.dq_splits = 0
        if deterministic and device.type == "cuda":
            self.dq_splits = math.ceil(torch.cuda.get_device_properties(device).multi_processor_count / self.heads)

    def attention_bytes(self, positions: int, longest: int, packed: bool = False) -> tuple[float, float]:
        """(bytes each plain layer keeps, bytes one running layer needs at most) for attention.
        Records packed end to end run attention.packed_kernel. fa4 keeps O(L), like flash; its
        backward allocates fp32 accumulators for dQ and, with grouped-query heads, for dK and dV
        (flash_attn.cute's _flash_attn_bwd), one layer at a time."""
        implementation = self.attn_implementation
        kernel = self.kernel_at(longest) if implementation in ("sdpa", SPDS_ATTENTION) else implementation
        if packed:
            kernel = packed_kernel(kernel, self.device)
        if self.materialised:
            kernel = "eager"  # the scores in the inputs' dtype, their softmax in fp32, as eager keeps them
        kept, transient = QUADRATIC_ATTENTION_BYTES.get(kernel, (0, 0))
        square = positions * longest * self.heads  # batch x L^2 x heads: every sequence padded to `longest`
        workspace = 0
        if kernel == "flash":
            workspace = positions * self.dq_splits * self.heads * self.head_dim * 4
        elif kernel == "fa4":
            accumulated_heads = self.heads + (2 * self.kv_heads if self.kv_heads != self.heads else 0)
            workspace = positions * accumulated_heads * self.head_dim * 4
        return kept * square, transient * square + workspace

    def __call__(self, positions: int, longest: int | None = None, packed: bool = False) -> int:
        if self.setting in (True, False):
            return self.layers if self.setting else 0
        if self.device.type != "cuda" and self.budget is None:  # CPU: only with a budget given
            return 0
        if self.budget is None:  # measured once, after the student and engine are in memory
            self.budget = 0.9 * free_device_memory(self.device)
        plain, kept = self.activation_bytes, CHECKPOINTED_BYTES_PER_HIDDEN
        attention_kept, attention_transient = self.attention_bytes(positions, longest or positions, packed)
        per_plain_layer = positions * self.hidden * plain + attention_kept
        per_kept_layer = positions * self.hidden * kept
        running = positions * self.hidden * plain + attention_transient

        def need(k: int) -> float:  # bytes with the first k layers recomputed
            held = (self.layers - k) * per_plain_layer + k * per_kept_layer
            return held + (running if k else attention_transient)

        if need(0) <= self.budget:
            return 0
        if need(self.layers) > self.budget:
            from .fsio import SpdsError

            raise SpdsError(
                f"a micro-batch of {positions} positions (longest sequence {longest or positions}) needs about "
                f"{need(self.layers) / 2**30:.1f} GiB of activations with every layer recomputed, over the "
                f"{self.budget / 2**30:.1f} GiB budget (student.activation_memory_gib, or 90% of the free GPU memory); "
                f"attention kernel {self.kernel_at(longest or positions)!r}"
                f"{' (memory quadratic in length)' if attention_kept else ''}: shorten the longest records, lower "
                "optim.micro_batch or optim.micro_batch_tokens, or choose an O(L) kernel (student.sdpa_backend flex, "
                "flash)")
        # need(k) falls linearly in k from k = 1: the fewest layers that fit
        needed = math.ceil((self.layers * per_plain_layer + running - self.budget) / (per_plain_layer - per_kept_layer))
        return int(min(self.layers, max(1, needed)))


def free_device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate: the device's free memory plus what PyTorch's caching
    allocator holds but no tensor uses (blocks freed by earlier work in this process, which
    mem_get_info counts as taken: a budget from it alone, taken after HF+PEFT had run in the same
    process, recomputed 433 layers of an 8B update instead of 20)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def enable_checkpointing(student: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(student, "activation_checkpointing_enable"):  # transformers >= 5.2x
        student.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpoint_first(student: nn.Module, count: int) -> None:
    """Recompute the first `count` decoder layers in backward, keep the others' activations.

    transformers checkpoints a layer only in train mode; the frozen student has no dropout, so
    each layer's mode is its checkpointing switch and nothing else."""
    for index, layer in enumerate(decoder_layers(student)):
        if layer.training != (index < count):
            layer.train(index < count)


class Replicated:
    """The student's layout when every rank holds it whole: nothing to gather or mark. Sharded
    layouts (spds/sharded.py) offer the same two methods."""

    name = "replicated"
    lockstep = False  # no collective inside a forward: ranks may run different passes

    def before_forward(self) -> None:
        pass

    def gathered(self, parameters):
        """A context in which `parameters` are whole (read outside their module's forward)."""
        return contextlib.nullcontext()


class SoftPromptModel(nn.Module):
    def __init__(self, student: nn.Module, prompt: torch.Tensor, loss_fn, activation_checkpointing=False,
                 sdpa_backend="auto", activation_memory_gib: float | None = None, pad_to_multiple_of: int | None = None,
                 device: torch.device | None = None, deterministic: bool = False, liger_kernels: bool = False,
                 packed: bool = False):
        super().__init__()
        device = device or student.device  # a student still on the host waits to be sharded onto `device`
        if pad_to_multiple_of is None:  # bucket shapes for the GPU kernels; exact lengths on CPU
            pad_to_multiple_of = 256 if device.type == "cuda" else 1
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packed = packed  # several records in one forward: end to end (True) or right-padded rows
        self.student = student
        self.prompt = nn.Parameter(prompt.to(torch.float32).to(device))
        self.loss_fn = loss_fn
        self.sdpa_backend = sdpa_backend
        self.kernel_choice = install_attention(student)  # None: the student's own attention (eager, ...)
        if packed and self.kernel_choice is None:  # the config check says so first; a library caller learns here
            from .fsio import SpdsError

            raise SpdsError("packed micro-batches need spds's attention: load the student with sdpa attention")
        self.checkpointing = CheckpointPolicy(activation_checkpointing, student, activation_memory_gib, device,
                                              self.attention_kernel, deterministic, liger_kernels)
        self.layout = Replicated()  # a sharded layout replaces it (spds/sharded.py)
        self.teacher = None  # spds/teacher.py, for a loss that needs one
        if activation_checkpointing is not False:
            enable_checkpointing(student)
        student.eval()

    def attention_kernel(self, positions: int) -> str:
        """The attention kernel for a sequence of `positions` (padded): "auto" lets PyTorch choose."""
        return kernel_for(self.sdpa_backend, positions)

    def use_kernel(self, positions: int) -> None:
        """The kernel of the next forward (and of its recompute in backward)."""
        if self.kernel_choice is not None:
            self.kernel_choice.kernel = self.attention_kernel(positions)

    def joined_embeddings(self, segments: list[Segment], block: torch.Tensor) -> list[torch.Tensor]:
        """embed(x[:a]) ++ block ++ embed(x[a:]) for each segment; one embedding call for all."""
        tokens = self.student.get_input_embeddings()(torch.cat([s.ids for s in segments]))
        joined = []
        for segment, own in zip(segments, tokens.split([len(s.ids) for s in segments])):
            a = segment.insert_at
            joined.append(torch.cat([own[:a], block.to(own.dtype), own[a:]], dim=0))
        return joined

    def hidden_states(self, segments: list[Segment], block: torch.Tensor,
                      checkpoint_positions: int | None = None) -> list[torch.Tensor]:
        """Final hidden states [L+P, H] of each segment, in one forward pass.

        Several segments are right-padded into one batch, with no attention mask: under causal
        attention a position never sees a later one, so padding after a record's end cannot change
        its outputs, and the fast causal kernels (flash, cuDNN) stay usable. The padded length is
        rounded up to pad_to_multiple_of so that the kernels see few distinct shapes (cuDNN builds
        a plan per shape)."""
        self.layout.before_forward()
        joined = self.joined_embeddings(segments, block)
        if self.packed and len(joined) > 1:
            return self.packed_hidden_states(joined, checkpoint_positions)
        longest = max(len(j) for j in joined)
        longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if len(joined) == 1 and longest == len(joined[0]):
            inputs = joined[0][None]
        else:
            inputs = torch.stack([nn.functional.pad(j, (0, 0, 0, longest - len(j))) for j in joined])
        positions = torch.arange(longest, device=self.prompt.device)[None].expand(len(joined), -1)
        # A sharded student's ranks decide alike, from the positions the plan agreed on.
        if checkpoint_positions:  # the plan's figure, the same on every rank
            count = self.checkpointing(checkpoint_positions)
        else:
            count = self.checkpointing(longest * len(joined), longest)
        checkpoint_first(self.student, count)
        self.use_kernel(longest)
        output = self.student.base_model(inputs_embeds=inputs, position_ids=positions, use_cache=False)
        return [output.last_hidden_state[i, :len(j)] for i, j in enumerate(joined)]

    def packed_hidden_states(self, joined: list[torch.Tensor], checkpoint_positions: int | None) -> list[torch.Tensor]:
        """The joined sequences end to end in one row (optim.micro_batch_layout packed): each one's
        positions restart at 0 and its attention sees only itself (attention.packed_causal), so
        each gets the outputs it would get alone, with no padding computed."""
        lengths = [len(j) for j in joined]
        longest = max(lengths)
        starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        if self.prompt.device.type == "cuda":  # a pinned, asynchronous copy: no host sync per micro-batch
            starts = starts.pin_memory().to(self.prompt.device, non_blocking=True)
        positions = torch.cat([torch.arange(n, device=self.prompt.device) for n in lengths])[None]
        self.use_kernel(longest)  # fa4 runs its own variable-length kernel; any other, FlashAttention-2's
        checkpoint_first(self.student, self.checkpointing(checkpoint_positions or sum(lengths), longest, packed=True))
        output = self.student.base_model(inputs_embeds=torch.cat(joined)[None], position_ids=positions, use_cache=False,
                                         cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=longest,
                                         max_length_k=longest)
        return list(output.last_hidden_state[0].split(lengths))

    def response_states(self, segments: list[Segment], inserted: torch.Tensor | None = None,
                        checkpoint_positions: int | None = None):
        """(hidden rows that predict the response tokens, those tokens), over all `segments`.

        `inserted` replaces the prompt by another block of embeddings at the same place (spds eval:
        the context's token embeddings for the ceiling, nothing for the floor)."""
        block = self.prompt if inserted is None else inserted
        P = block.shape[0]
        rows, targets = [], []
        for segment, hidden in zip(segments, self.hidden_states(segments, block, checkpoint_positions)):
            rows.append(segment.supervised_rows(hidden, P))  # the prompt's P rows precede every response token
            targets.append(segment.supervised_ids())
        return torch.cat(rows), torch.cat(targets)

    def forward(self, segments: list[Segment], inserted: torch.Tensor | None = None,
                checkpoint_positions: int | None = None, loss_fn=None) -> torch.Tensor:
        """The summed loss (fp32 scalar) over the supervised tokens of `segments`: the model's own
        loss (loss.objective), or `loss_fn`."""
        return self.losses(segments, [loss_fn or self.loss_fn], inserted, checkpoint_positions)[0]

    def losses(self, segments: list[Segment], loss_fns: list, inserted: torch.Tensor | None = None,
               checkpoint_positions: int | None = None) -> list[torch.Tensor]:
        """Each of `loss_fns` over one forward of the student (eval: the NLL and the KL together)."""
        # The teacher first: its activations are freed before the student's are stored.
        cap = final_logit_softcap(self.student)
        if any(getattr(f, "softcap", None) != cap for f in loss_fns):  # never train on other logits than the head's
            raise SpdsError(f"{type(self.student).__name__} soft-caps its logits at {cap}, and a loss was built for "
                            f"another cap: build it with make_loss(settings, final_logit_softcap(student))")
        teacher = self.teacher.targets(segments) if any(f.needs_teacher for f in loss_fns) else None
        rows, targets = self.response_states(segments, inserted, checkpoint_positions)
        weight = self.student.get_output_embeddings().weight
        with self.layout.gathered([weight]):  # the loss computes d(loss)/d(rows) now: backward needs no weight
            return [loss_fn(rows, weight, targets, teacher) for loss_fn in loss_fns]


def build_soft_prompt_model(config, device: torch.device, prompt: torch.Tensor | None = None, training: bool = True,
                            student: nn.Module | None = None, store=None) -> SoftPromptModel:
    """The student as every command runs it: train, smoke, eval and the GPU benchmark build it here,
    so they share the kernels (Liger), the attention choice (deterministic or by length), the
    loss kernel, the teacher and the placement of a student to be sharded. `prompt` is the initial
    value (training) or a checkpoint's (eval); `student` lets the benchmark reuse one it holds;
    `store` (the packed data) decides an `auto` teacher, for a loss that needs one."""
    from .loss import make_loss

    student_cfg, prompt_cfg = config.student, config.soft_prompt
    if student is None:
        # A student to be sharded is loaded on the host; its layout puts each shard on the device.
        host = torch.device("cpu") if config.shards_student else device
        student = load_student(config.model_path, student_cfg.dtype, student_cfg.attn_implementation, host)
        if student_cfg.liger_kernels:
            apply_liger_kernels(student)
    sdpa_backend = resolve_kernels(student_cfg.sdpa_backend, config.train.deterministic, student, device)
    if prompt is None:
        tokenizer = None
        if prompt_cfg.init.method == "text":
            from .data.prepare import load_tokenizer

            tokenizer = load_tokenizer(config)
        prompt = initial_prompt(student, prompt_cfg.length, prompt_cfg.init, config.optim.seed, tokenizer)
    loss_fn = make_loss(config.loss, final_logit_softcap(student))
    checkpointing = student_cfg.activation_checkpointing if training else False  # nothing to recompute
    model = SoftPromptModel(student, prompt, loss_fn, checkpointing, sdpa_backend, student_cfg.activation_memory_gib,
                            student_cfg.pad_to_multiple_of, device, config.train.deterministic,
                            student_cfg.liger_kernels, config.optim.micro_batch_layout == "packed")
    if loss_fn.needs_teacher:
        from .teacher import build_teacher

        model.teacher = build_teacher(config, model, store, memo=training)
    return model
