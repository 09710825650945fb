"""Decoder families (tests/fixtures/models/families.json: the published configs' architecture at a
tiny size): spds's loss and prompt gradient equal a plain transformers forward of the same weights,
padded and packed, for each. The references import nothing from spds's model, loss or engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_reference
from helpers import spliced_reference_loss as plain_loss

from spds.contract.gate import section
from spds.model.loss import final_logit_softcap, make_loss
from spds.model.soft_prompt import Segment, SoftPromptModel
from spds.model.student import load_student

FAMILIES = {
    k: v
    for k, v in json.loads((Path(__file__).parent / "fixtures" / "models" / "families.json").read_text()).items()
    if not k.startswith("_")
}
VOCAB = 300


def save_family(directory: Path, family: str, vocab_size: int = VOCAB, eos: int = 1, pad: int = 0) -> Path:
    """A tiny random student of `family`, saved as a checkpoint directory from_pretrained loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(FAMILIES[family]["config"])
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        vocab_size=vocab_size,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        initializer_range=0.2,
        **fields,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save_family(root / family, family) for family in FAMILIES}


@pytest.mark.numeric
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_prompt_gradient_equal_the_familys_own_forward(saved, family):
    from transformers import AutoModelForCausalLM

    implementation = FAMILIES[family]["attn_implementation"]
    student = load_student(saved[family], "float32", implementation, torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(
        saved[family], dtype=torch.float32, attn_implementation="eager"
    ).requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    segments = [
        Segment(ids=torch.randint(2, VOCAB, (n,), generator=generator), prefix_tokens=p, insert_at=a)
        for n, p, a in ((23, 9, 2), (14, 5, 0), (31, 20, 3))
    ]
    prompt = torch.randn(3, student.config.hidden_size, generator=generator) * 0.3
    layouts = [False, True] if implementation == "sdpa" else [False]  # packed records need spds's attention
    for packed in layouts:
        loss_fn = make_loss(section("loss", kernel="chunked", chunk_tokens=16), final_logit_softcap(student))
        model = SoftPromptModel(student, prompt.clone(), loss_fn, attention_kernel="math", packed=packed)
        assert_matches_reference(
            model,
            segments,
            lambda p: sum(plain_loss(plain, p, s) for s in segments),
            prompt,
            what=f"{family} {'packed' if packed else 'padded'}",
        )


def test_a_loss_built_without_the_students_logit_soft_cap_is_refused(saved):
    """Gemma 2 soft-caps its logits (final_logit_softcapping): a loss over the uncapped logits would
    train against another model's distribution, silently."""
    student = load_student(saved["gemma2"], "float32", "eager", torch.device("cpu"))
    model = SoftPromptModel(student, torch.zeros(2, student.config.hidden_size), make_loss(section("loss")))
    from spds.errors import SpdsError

    with pytest.raises(SpdsError, match="soft-caps its logits at 30.0"):
        model([Segment(ids=torch.arange(2, 12), prefix_tokens=4, insert_at=0)])


def test_the_memory_planner_counts_the_scores_a_soft_capped_layer_materialises(saved):
    """Gemma 2's soft-capped layers keep their score matrices whatever kernel the length chose;
    Gemma 3's windowed layers run an O(L) kernel: the recompute planner must tell them apart."""
    from spds.kernels.attention import AttentionPlan

    for family, quadratic in (("gemma2", True), ("gemma3", False)):
        student = load_student(saved[family], "float32", "sdpa", torch.device("cpu"))
        plan = AttentionPlan("flash", student, torch.device("cpu"))
        kept, transient = plan.memory(positions=4096, longest=4096)
        assert (kept > 0 and transient > kept) == quadratic, family
