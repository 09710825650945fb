"""spds's attention for sliding-window and soft-capped layers on CUDA, against transformers' eager.

    python bench/check.py windowed

Tiny random Gemma 2 (window and soft cap) and Gemma 3 (window) students from
tests/fixtures/models/families.json, with a window of 128 (so flex skips whole key blocks) and
records of 200-700 tokens: the loss and prompt gradient of spds (a row per record: flex with a
windowed block mask and the cap as a score modifier; records packed end to end: FlashAttention-2's
varlen kernel with its left window, or the scores materialised where a cap needs them) against
the family's own eager forward of the same weights. fp32 rows: rounding (~1e-6 relative); bf16
packed rows: bf16 (~1e-2). Prints one line per case.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

from helpers import spliced_reference_loss as plain_loss  # noqa: E402  (the tests' plain-transformers reference)

from spds.contract.gate import section  # noqa: E402
from spds.model.loss import final_logit_softcap, make_loss  # noqa: E402
from spds.model.soft_prompt import Segment, SoftPromptModel  # noqa: E402


def student_pair(family: str, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(json.loads((REPO / "tests" / "fixtures" / "models" / "families.json").read_text())[family]["config"])
    fields.update(sliding_window=128, max_position_embeddings=4096)
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        vocab_size=512,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
        initializer_range=0.2,
        **fields,
    )
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to("cuda", dtype)
    try:
        spds_student = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda", dtype)
    except ValueError:  # Gemma 2: no SDPA in transformers; spds's attention replaces the eager one
        spds_student = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to("cuda", dtype)
        spds_student.config._attn_implementation = "sdpa"
    spds_student.load_state_dict(plain.state_dict())
    return spds_student.requires_grad_(False), plain.requires_grad_(False)


def main(args) -> None:
    generator = torch.Generator().manual_seed(1)
    for family in ("gemma2", "gemma3"):
        for dtype, packed, kernel in (
            (torch.float32, False, "flash"),
            (torch.bfloat16, True, "auto"),
            (torch.bfloat16, False, "flex"),
        ):
            student, plain = student_pair(family, dtype)
            segments = [
                Segment(ids=torch.randint(2, 512, (n,), generator=generator).cuda(), prefix_tokens=p, insert_at=1)
                for n, p in ((700, 300), (250, 40), (431, 200))
            ]
            prompt = (torch.randn(16, student.config.hidden_size, generator=generator) * 0.3).cuda()
            loss_fn = make_loss(section("loss", kernel="chunked"), final_logit_softcap(student))
            model = SoftPromptModel(student, prompt.clone(), loss_fn, attention_kernel=kernel, packed=packed)
            loss = model(segments)
            loss.backward()
            reference = prompt.clone().requires_grad_()
            expected = sum(plain_loss(plain, reference, s) for s in segments)
            expected.backward()
            loss_error = abs(float(loss) - float(expected)) / abs(float(expected))
            grad_error = float((model.prompt.grad - reference.grad).abs().max() / reference.grad.abs().max())
            print(
                f"{family:7s} {str(dtype):15s} {'packed' if packed else 'padded'} kernel {kernel:5s}  "
                f"loss {float(loss):.4f} vs {float(expected):.4f} (relative {loss_error:.1e})  "
                f"prompt gradient max error / max {grad_error:.1e}",
                flush=True,
            )
