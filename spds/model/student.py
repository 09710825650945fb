"""The frozen student: its weights (with Liger's kernels when asked), the cost model's
attention/weights crossover drawn from its config.json, its decoder layers, and the soft prompt's
starting value. Its tokenizer and config.json, read without torch: spds/data/student_files.py."""

from __future__ import annotations

import functools
import os
import pickle

import torch
from torch import nn

from spds.contract.model_config import model_config
from spds.data.chat import encode_text
from spds.errors import SpdsError
from spds.kernels.attention import avoid_cpu_flash_without_avx512
from spds.kernels.attention import install as install_attention
from spds.model.kv_prompt import kv_shape, prefilled
from spds.model.loss import liger_available


def load_student(
    model_path, dtype: str, attn_implementation: str, device: torch.device, trust_remote_code: bool = False
) -> nn.Module:
    """An sdpa student runs spds's attention (spds/kernels/attention.py), which computes windows and soft
    caps itself: a family transformers does not offer SDPA for (Gemma 2, for its soft cap) is
    loaded with its eager attention and then given spds's."""
    from transformers import AutoModelForCausalLM

    avoid_cpu_flash_without_avx512()
    load = functools.partial(
        AutoModelForCausalLM.from_pretrained,
        str(model_path),
        local_files_only=True,
        dtype=getattr(torch, dtype),
        trust_remote_code=trust_remote_code,  # explicit: unset, transformers asks on the terminal
    )
    try:
        student = load(attn_implementation=attn_implementation)
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        raise unsafe_weights(error, model_path) or error
    except ValueError as error:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(error):
            raise
        student = load(attn_implementation="eager")
        student.config._attn_implementation = "sdpa"
        install_attention(student)  # spds's from the start: transformers' own sdpa path refuses the cap
    student.requires_grad_(False)
    return student.to(device)


def skeleton(model_path, trust_remote_code: bool = False) -> nn.Module:
    """The student's modules without its weights (on the meta device): its shapes, for a check that
    need not read gigabytes (a prompt against its student, spds export)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def unsafe_weights(error: BaseException, model_path) -> SpdsError | None:
    """The refusal to give when torch's weights-only loader refused a pickled weights file (one that
    would call code as it loads); None for any other loading error."""
    if "weights only load failed" not in str(error).lower() and "weights_only" not in str(error):
        return None
    return SpdsError(
        f"{model_path}: its weights (pytorch_model.bin) are not plain tensors: torch's weights-only loader "
        "refused the pickle (it would run code as it loads); spds loads safetensors or weights-only "
        "checkpoints: convert the weights to safetensors from a source you trust"
    )


def apply_liger_kernels(student: nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels in place of the student's own (its loss is spds's)."""
    if not liger_available():
        raise SpdsError(
            "student.liger_kernels is true but liger-kernel is not importable or there is no CUDA device "
            "(pip install 'spds[gpu]', or set student.liger_kernels to false)"
        )
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if student.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise SpdsError(f"student.liger_kernels: Liger has no kernels for model type {student.config.model_type!r}")
    # Liger 0.8 runs RoPE as a CuTe DSL kernel wherever nvidia-cutlass-dsl imports (spds[fa4] brings
    # it), and that kernel is compiled once per sequence length. A packed micro-batch's length is
    # exact, so nearly every micro-batch of a run is a new length, and the compiles nearly double
    # an update. Liger's Triton RoPE compiles once for every length and runs as fast
    # (bench/RESULTS.md). This is Liger's per-op switch, read at each call; a user's own setting
    # stands.
    os.environ.setdefault("LIGER_KERNEL_IMPL_ROPE", "nvidia-triton")
    _apply_liger_kernel_to_instance(
        model=student, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


def initial_prompt(
    student: nn.Module,
    settings,
    seed: int,
    tokenizer=None,
    context_ids: list[int] | None = None,
    header: list[int] | None = None,
) -> torch.Tensor:
    """The prompt's starting value (soft_prompt: its form, length and init), identical on every
    rank for a seed: FP32 [length, hidden] embeddings, or for the kv form FP32 [layers, 2, kv heads,
    length, head dim] keys and values (spds/model/kv_prompt.py), those of tokens computed after
    `header`, the template's tokens before the prompt."""
    length, init = settings.length, settings.init  # init.method context: `context_ids`, spds.data.context.init_ids
    embeddings = student.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)  # CPU generator: the same values on any device
    shape = kv_shape(student, length) if settings.form == "kv" else (length, embeddings.shape[1])
    if init.method == "random_normal":
        return torch.randn(*shape, generator=generator) * init.std
    if init.method == "vocab_sample":
        ids = torch.randint(0, embeddings.shape[0], (length,), generator=generator)
    elif init.method == "context":  # the context's first tokens (or its slices'), as init_ids chose them
        ids = torch.tensor(context_ids[:length])
    else:  # text: its tokens, repeated or truncated to the prompt length
        ids = torch.tensor(encode_text(tokenizer, init.text))
        ids = ids.repeat((length + len(ids) - 1) // len(ids))[:length]
    if settings.form == "kv":
        return prefilled(student, header or [], ids.tolist())
    return embeddings.detach()[ids.to(embeddings.device)].float().cpu()


def quadratic_length(model_path) -> float | None:
    """The record length at which attention's FLOPs equal the weights' (forward and input
    gradients, causal): 4 P / (6 layers heads head_dim), P the matmul parameters, lm_head
    included. From the student's config.json; None when its shapes are not all there."""
    value = model_config(model_path)
    try:
        hidden, layers, heads = value["hidden_size"], value["num_hidden_layers"], value["num_attention_heads"]
        head_dim = value.get("head_dim") or hidden // heads
        kv_heads = value.get("num_key_value_heads", heads)
        per_layer = (
            2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * value["intermediate_size"]
        )
        matmul_parameters = layers * per_layer + value["vocab_size"] * hidden
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return 4 * matmul_parameters / (6 * layers * heads * head_dim)


def decoder_layers(student: nn.Module) -> nn.ModuleList:
    layers = getattr(student.base_model, "layers", None)
    if layers is None:
        raise SpdsError(f"cannot find the decoder layers of {type(student).__name__} (base_model.layers)")
    return layers
