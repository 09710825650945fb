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
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Segment:
    """One record as the model needs it."""
    ids: torch.Tensor  # int64 [L]
    prefix_tokens: int
    insert_at: int

    @property
    def supervised_tokens(self) -> int:
        return len(self.ids) - self.prefix_tokens


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def load_student(model_path, dtype: str, attn_implementation: str, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(str(model_path), local_files_only=True, dtype=getattr(torch, dtype),
                                                   attn_implementation=attn_implementation)
    student.requires_grad_(False)
    return student.to(device)


def initial_prompt(student: nn.Module, length: int, init: dict, seed: int, tokenizer=None) -> torch.Tensor:
    """The prompt's starting value, FP32 [length, hidden], identical on every rank for a seed."""
    embeddings = student.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)  # CPU generator: the same values on any device
    if init["method"] == "random_normal":
        return torch.randn(length, embeddings.shape[1], generator=generator) * init["std"]
    if init["method"] == "vocab_sample":
        ids = torch.randint(0, embeddings.shape[0], (length,), generator=generator)
    else:  # text: its token embeddings, repeated or truncated to the prompt length
        ids = torch.tensor(tokenizer.encode(init["text"], add_special_tokens=False))
        ids = ids.repeat((length + len(ids) - 1) // len(ids))[:length]
    return embeddings.detach()[ids.to(embeddings.device)].float().cpu()


class SoftPromptModel(nn.Module):
    def __init__(self, student: nn.Module, prompt: torch.Tensor, loss_fn, activation_checkpointing: bool = False,
                 sdpa_backend: str = "auto"):
        super().__init__()
        self.student = student
        self.prompt = nn.Parameter(prompt.to(torch.float32).to(student.device))
        self.loss_fn = loss_fn
        self.sdpa_backend = sdpa_backend
        if activation_checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Checkpointing in transformers runs only in train mode; the student has no dropout that
        # matters (a frozen distillation target), and eval mode otherwise keeps it deterministic.
        student.train(activation_checkpointing)

    def _attention_context(self):
        if self.sdpa_backend == "auto":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.sdpa_backend]))

    def joined_embeddings(self, segment: Segment) -> torch.Tensor:
        embed = self.student.get_input_embeddings()
        tokens = embed(segment.ids.to(self.prompt.device))
        a = segment.insert_at
        return torch.cat([tokens[:a], self.prompt.to(tokens.dtype), tokens[a:]], dim=0)

    def hidden_states(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Final hidden states [L+P, H] of each segment; several are right-padded into one batch."""
        joined = [self.joined_embeddings(s) for s in segments]
        longest = max(len(j) for j in joined)
        device = self.prompt.device
        if len(joined) == 1:
            inputs = joined[0][None]
            mask = None
        else:
            inputs = torch.stack([nn.functional.pad(j, (0, 0, 0, longest - len(j))) for j in joined])
            mask = torch.stack([(torch.arange(longest, device=device) < len(j)).long() for j in joined])
        positions = torch.arange(longest, device=device)[None].expand(len(joined), -1)
        with self._attention_context():
            output = self.student.base_model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                                             use_cache=False)
        return [output.last_hidden_state[i, :len(j)] for i, j in enumerate(joined)]

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Summed cross entropy (fp32 scalar) over the supervised tokens of `segments`."""
        P = self.prompt.shape[0]
        rows, targets = [], []
        for segment, hidden in zip(segments, self.hidden_states(segments)):
            L = len(segment.ids)
            rows.append(hidden[segment.prefix_tokens + P - 1:L + P - 1])
            targets.append(segment.ids[segment.prefix_tokens:])
        lm_head = self.student.get_output_embeddings().weight
        return self.loss_fn(torch.cat(rows), lm_head, torch.cat(targets).to(lm_head.device))
