"""student.fp8_linear: the frozen student's linear layers in FP8 (spds/kernels/fp8.py), against e4m3
arithmetic written out here in plain PyTorch, and built only where training runs."""

from __future__ import annotations

import pytest
import torch
from conftest import edit_config
from torch import nn

from spds.kernels.fp8 import FrozenFP8Linear, fp8_problem, quantize_rows

E4M3 = torch.float8_e4m3fn


def reference_quantized(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one scale per row (its largest magnitude on 448), back in float64."""
    scale = x.double().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
    return (x.double() / scale).to(E4M3).double() * scale


def test_quantize_rows_rounds_each_row_to_e4m3_on_its_own_scale():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=generator) * torch.tensor([1e-6, 1e-2, 1.0, 1e3, 1e6, 0.0])[:, None]
    q, scale = quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == E4M3 and scale.shape == (6, 1)
    back = q.double() * scale.double()
    # e4m3 keeps 3 mantissa bits: a value is off by at most half a unit in its last place (2^-4
    # of itself), or, below e4m3's normal range (2^-6 of the scale's 448), half a subnormal step.
    bound = torch.maximum(2**-4 * x.abs(), 2**-10 * scale).double()
    assert (back - x.to(torch.bfloat16).double()).abs().le(bound).all()
    assert q[:5].float().abs().amax(dim=-1).eq(448).all()  # each row's largest lands on e4m3's largest
    assert q[5].float().eq(0).all() and torch.isfinite(scale).all()  # an all-zero row stays zero


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_is_e4m3_arithmetic_forward_and_backward(dtype):
    """The layer's output equals float64 arithmetic on the e4m3-rounded input and weight (rows of
    the input, output channels of the weight); its input gradient likewise (rows of the gradient,
    input channels of the weight), up to the rounding of the output to `dtype`."""
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=generator))
        linear.bias.copy_(torch.randn(48, generator=generator))
    layer = FrozenFP8Linear(linear)
    x = torch.randn(3, 5, 64, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 48, generator=generator).to(dtype)
    y = layer(x)
    y.backward(grad)

    expected = reference_quantized(x.detach().reshape(-1, 64)) @ reference_quantized(linear.weight.detach()).T
    expected = expected.reshape(3, 5, 48) + linear.bias.double()
    weight_by_input = reference_quantized(linear.weight.detach().T).T  # scaled per input channel
    expected_grad = (reference_quantized(grad.reshape(-1, 48)) @ weight_by_input).reshape(3, 5, 64)

    # bf16: two roundings (the product's output, then the bias's add), each at most 2^-8 of the
    # largest magnitude; fp32: the fp32 accumulation of 64 products, far below 2^-20 of it
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20
    for got, want in ((y, expected), (x.grad, expected_grad)):
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() <= ulp * want.abs().max()
    # and FP8 is really what ran: the plain layer differs by far more than that rounding
    assert (linear(x).double() - expected).abs().max() > 4 * ulp * expected.abs().max()


def test_training_builds_fp8_and_eval_measures_the_student_as_loaded(tiny):
    """fp8_linear replaces every linear layer of the decoder (not the output head) when training
    builds the model, and the prompt's gradient through it points where the bf16 one does; eval
    builds the student as loaded."""
    from spds.contract.gate import load_config
    from spds.model.build import build_soft_prompt_model
    from spds.model.soft_prompt import Segment

    edit_config(tiny, student={"fp8_linear": True, "dtype": "bfloat16"})
    config = load_config(tiny / "config.json")
    device = torch.device("cpu")
    quantized = build_soft_prompt_model(config, device)
    plain = build_soft_prompt_model(config, device, prompt=quantized.prompt.detach().clone(), training=False)
    layers = quantized.student.config.num_hidden_layers
    assert sum(isinstance(m, FrozenFP8Linear) for m in quantized.modules()) == 7 * layers  # q k v o, gate up down
    assert not any(isinstance(m, FrozenFP8Linear) for m in plain.modules())
    assert type(quantized.student.get_output_embeddings()) is nn.Linear

    generator = torch.Generator().manual_seed(2)
    segments = [
        Segment(ids=torch.randint(3, 200, (n,), generator=generator), prefix_tokens=4, insert_at=2) for n in (9, 14)
    ]
    gradients = []
    for model in (quantized, plain):
        model(segments).backward()
        gradients.append(model.prompt.grad.flatten().double())
    cosine = torch.nn.functional.cosine_similarity(*gradients, dim=0)
    # e4m3 rounds each product's operands by up to 2^-4 (about 2% on average, compounding over the
    # layers of a 64-wide student): the direction holds to within about 13 degrees; 1.0 would
    # mean that FP8 never ran
    assert 0.95 < cosine < 1.0


def test_the_projections_of_one_input_quantize_it_once(tiny_assets, monkeypatch):
    """A layer's q, k and v projections read one tensor, as do its MLP's gate and up: it is quantized
    once for each group (4 quantizations a layer, not 7), and the logits and input gradients are
    bit for bit those of every projection quantizing its own input."""
    import copy

    from transformers import AutoModelForCausalLM

    import spds.kernels.fp8 as fp8

    shared = AutoModelForCausalLM.from_pretrained(tiny_assets / "student", dtype=torch.float32).requires_grad_(False)
    alone = copy.deepcopy(shared)
    for model in (shared, alone):
        fp8.quantize_linears(model)
    for module in alone.modules():
        if isinstance(module, FrozenFP8Linear):
            module.shared = None
    calls = []
    quantize = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda x: calls.append(x.shape) or quantize(x))
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(3))
    results = []
    for model in (shared, alone):
        calls.clear()
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings).logits
        forward_calls = len(calls)
        logits.square().sum().backward()
        results.append((logits, embeddings.grad, forward_calls))
    layers = shared.config.num_hidden_layers
    assert [r[2] for r in results] == [4 * layers, 7 * layers]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_gpu_without_fp8_products_is_refused_before_the_student_loads(monkeypatch):
    """torch._scaled_mm's row and column scales need compute capability 9.0; an A100 (8.0) would
    fail inside the first forward with PyTorch's own error."""
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    problem = fp8_problem(torch.device("cuda"))
    assert problem and "compute capability is 8.0" in problem and "student.fp8_linear" in problem
    capability["value"] = (9, 0)
    assert fp8_problem(torch.device("cuda")) is None
    assert fp8_problem(torch.device("cpu")) is None


@pytest.mark.extended
@pytest.mark.slow
def test_an_fp8_run_trains_on_two_ranks(prepared):
    """The whole CLI with fp8_linear on 2 ranks (DeepSpeed's engine holds the FP8 buffers beside
    the frozen student): the run completes and its loss falls. (That FP8 runs where training builds
    the student: test_training_builds_fp8_and_eval_measures_the_student_as_loaded.)"""
    from helpers import FAST, check, metrics, read_json, spds

    edit_config(prepared, output_dir="fp8", student={"dtype": "bfloat16", "fp8_linear": True})
    check(spds(["train", "config.json"], prepared, world=2, launcher="torchrun"))
    assert read_json(prepared / "fp8" / "terminal.json")["status"] == "complete"
    losses = [m["loss"] for m in metrics(prepared / "fp8")]
    assert len(losses) == FAST["optim"]["updates"] and losses[-1] < losses[0]
