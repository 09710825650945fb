"""The chunked fused linear cross entropy equals the plain definition, value and gradient."""

from __future__ import annotations

import pytest
import torch
from helpers import BF16_EPS, ROUNDING, assert_rounding_close

from spds.contract.gate import section
from spds.model.loss import chunked_linear_cross_entropy, make_loss, reference_linear_cross_entropy


# fp32: reordered sums (chunks of rows) round within ROUNDING of the tensor's scale. bf16: the
# kernel and the reference each round the logits' matmul to bf16 (eps 2**-7) in a different
# grouping, a few roundings deep: 4 bf16 eps of the scale.
@pytest.mark.numeric
@pytest.mark.parametrize("dtype,bound", [(torch.float32, ROUNDING), (torch.bfloat16, 4 * BF16_EPS)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_matches_reference(dtype, bound, chunk):
    generator = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(37, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(53, 16, generator=generator).to(dtype)
    targets = torch.randint(0, 53, (37,), generator=generator)
    reference_hidden = hidden.detach().clone().requires_grad_()
    expected = reference_linear_cross_entropy(reference_hidden, weight, targets)
    (expected * 0.5).backward()
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk)
    (loss * 0.5).backward()
    assert loss.dtype == torch.float32
    assert_rounding_close(loss, expected, bound, what="loss")
    assert_rounding_close(hidden.grad, reference_hidden.grad, bound, what="gradient")


def test_weight_gets_no_gradient_and_auto_backend_on_cpu():
    loss_fn = make_loss(section("loss", kernel="auto", chunk_tokens=4))
    assert loss_fn.kernel == "chunked"  # no CUDA here
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=False)
    loss_fn(hidden, weight, torch.arange(5)).backward()
    assert weight.grad is None and hidden.grad is not None


def test_a_backward_scale_is_applied_in_fp32_not_rounded_to_bf16_first():
    """1/N rounded to bf16 before it multiplies the gradient scales every update by bf16(1/N)*N
    (0.9985 .. 1.0027): the scale must reach the bf16 gradient as one fp32 product, rounded once."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 16, generator=generator).to(torch.bfloat16)
    weight = torch.randn(41, 16, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, 41, (29,), generator=generator)
    n = 1020  # bf16(1/1020) * 1020 = 1.0039: a 0.4% bias on every element, if rounded first
    unscaled = hidden.clone().requires_grad_()
    chunked_linear_cross_entropy(unscaled, weight, targets, 8).backward()
    scaled = hidden.clone().requires_grad_()
    (chunked_linear_cross_entropy(scaled, weight, targets, 8) / n).backward()
    expected = (unscaled.grad.float() / n).to(torch.bfloat16)  # plain torch: one fp32 product, one rounding
    assert torch.equal(scaled.grad, expected)
    assert not torch.equal(scaled.grad, unscaled.grad * torch.tensor(1 / n).to(torch.bfloat16))


@pytest.mark.numeric
@pytest.mark.parametrize("objective", ["ce", "kl"])
def test_a_soft_capped_head_is_the_loss_of_its_capped_logits(objective):
    """Gemma 2's head returns c * tanh(logits / c): the kernels' value and gradient are those of
    the capped logits, written out (fp32 kernel against a float64 reference: its rounding)."""
    from spds.model.loss import TeacherTargets

    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(19, 8, generator=generator, dtype=torch.float64) * 4  # logits well past the cap
    weight = torch.randn(23, 8, generator=generator, dtype=torch.float64)
    teacher_hidden = hidden + torch.randn(19, 8, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 23, (19,), generator=generator)
    cap = 5.0
    loss_fn = make_loss(section("loss", objective=objective, kernel="chunked", chunk_tokens=8), softcap=cap)
    mine = hidden.clone().requires_grad_()
    loss = loss_fn(mine, weight, targets, TeacherTargets(hidden=teacher_hidden) if objective == "kl" else None)
    loss.backward()
    theirs = hidden.clone().requires_grad_()
    student = cap * torch.tanh(theirs @ weight.t() / cap)
    if objective == "ce":
        expected = torch.nn.functional.cross_entropy(student, targets, reduction="sum")
    else:
        teacher = torch.log_softmax(cap * torch.tanh(teacher_hidden @ weight.t() / cap), -1)
        expected = (teacher.exp() * (teacher - torch.log_softmax(student, -1))).sum()
    expected.backward()
    assert_rounding_close(loss, expected, what="loss")
    assert_rounding_close(mine.grad, theirs.grad, what="gradient")
    uncapped = make_loss(section("loss", objective=objective, kernel="chunked", chunk_tokens=8))
    assert (
        abs(
            float(
                uncapped(hidden, weight, targets, TeacherTargets(hidden=teacher_hidden) if objective == "kl" else None)
            )
            - float(expected)
        )
        > 1.0
    )  # the cap matters here
