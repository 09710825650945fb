"""The soft-prompt model as every command builds it (train, smoke, eval, the GPU benchmark)."""

from __future__ import annotations

import torch
from torch import nn

from spds.contract.config import Config
from spds.data.chat import prompt_header, scaffold_for
from spds.data.context import init_ids
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError
from spds.kernels.attention import kernel_setting
from spds.kernels.fp8 import fp8_problem, quantize_linears
from spds.model.kv_prompt import require_fits
from spds.model.loss import final_logit_softcap, make_loss
from spds.model.soft_prompt import SoftPromptModel
from spds.model.student import apply_liger_kernels, initial_prompt, load_student


def build_soft_prompt_model(
    config: Config,
    device: torch.device,
    prompt: torch.Tensor | None = None,
    training: bool = True,
    student: nn.Module | None = None,
    prompt_source: str = "the soft prompt",
) -> SoftPromptModel:
    """The student as every command runs it: train, smoke, eval and the GPU benchmark build it here,
    so they share the kernels (Liger), the attention choice (deterministic or by length), the
    loss kernel and the placement of a student to be sharded. `prompt` is the initial value
    (training) or a checkpoint's (eval); `student` lets the benchmark reuse one it holds. The
    teacher, for a loss that needs one, is spds.model.teacher.build_teacher's: the step hands its
    targets to the model."""
    student_cfg, prompt_cfg = config.student, config.soft_prompt
    fp8 = training and student_cfg.fp8_linear  # eval measures the prompt on the student as loaded
    problem = fp8 and fp8_problem(device)
    if problem:  # before the student's weights are read
        raise SpdsError(problem)
    if student is None:
        # A student to be sharded is loaded on the host; its layout puts each shard on the device.
        host = torch.device("cpu") if config.shards_student else device
        student = load_student(
            config.model_path, student_cfg.dtype, student_cfg.attn_implementation, host, student_cfg.trust_remote_code
        )
        if student_cfg.liger_kernels:
            apply_liger_kernels(student)
        if fp8:
            quantize_linears(student)
    attention_kernel = kernel_setting(student_cfg.attention_kernel, config.train.deterministic, student, device)
    if prompt is not None:  # a checkpoint's: for this student?
        require_fits(prompt, student, prompt_source)
    if prompt is None:
        tokenizer, header = None, None
        from_tokens = prompt_cfg.form == "kv" and prompt_cfg.init.method != "random_normal"
        if prompt_cfg.init.method in ("text", "context") or from_tokens:
            tokenizer = load_tokenizer(config)
        if from_tokens:  # their keys and values are computed where the prompt goes: after the template's header
            kwargs = config.data.chat_template_kwargs
            header = prompt_header(scaffold_for(config, tokenizer), prompt_cfg.placement, tokenizer, kwargs)
        context_ids = init_ids(config, tokenizer, prompt_cfg.length) if prompt_cfg.init.method == "context" else None
        prompt = initial_prompt(student, prompt_cfg, config.optim.seed, tokenizer, context_ids, header)
    loss_fn = make_loss(config.loss, final_logit_softcap(student))
    checkpointing = student_cfg.activation_checkpointing if training else False  # nothing to recompute
    model = SoftPromptModel(
        student,
        prompt,
        loss_fn,
        checkpointing,
        attention_kernel,
        student_cfg.activation_memory_gib,
        student_cfg.pad_to_multiple_of,
        device,
        config.train.deterministic,
        student_cfg.liger_kernels,
        config.optim.micro_batch_layout == "packed",
        prompt_cfg.frozen_positions,
    )
    return model
