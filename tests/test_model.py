"""The soft prompt is spliced where the record says, and the loss is the student's own CE."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import assert_matches_reference, assert_rounding_close

from spds.contract.gate import section
from spds.errors import SpdsError
from spds.model.loss import make_loss
from spds.model.soft_prompt import Segment, SoftPromptModel
from spds.model.student import initial_prompt, load_student


@pytest.fixture(scope="module")
def student(tiny_assets):
    return load_student(tiny_assets / "student", "float32", "sdpa", torch.device("cpu"))


@pytest.fixture(scope="module")
def plain_student(tiny_assets):
    """The same weights for the references, never handed to spds (which installs its attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets / "student", dtype=torch.float32).requires_grad_(False)


def init(length: int, **fields):
    """soft_prompt of `length` with init from these fields and the schema's defaults."""
    return section("soft_prompt", length=length, init=fields)


CHUNKED_16 = make_loss(section("loss", kernel="chunked", chunk_tokens=16))
CHUNKED_64 = make_loss(section("loss", kernel="chunked", chunk_tokens=64))


def make_segment(tokenizer, system: bool = True) -> Segment:
    rows = make_tiny.synthetic_rows(tokenizer, 4)
    row = next(r for r in rows if "input_ids" in r)
    ids = torch.tensor(row["input_ids"])
    return Segment(ids=ids, prefix_tokens=row["prefix_tokens"], insert_at=3 if system else 0)


def reference_loss(student, prompt, segment):
    """Plain HF forward over the joined embeddings, logits materialised, labels -100 on the prompt."""
    embeddings = student.get_input_embeddings()(segment.ids)
    a, P = segment.insert_at, prompt.shape[0]
    joined = torch.cat([embeddings[:a], prompt.to(embeddings.dtype), embeddings[a:]])[None]
    labels = torch.cat([segment.ids[:a], torch.full((P,), -100), segment.ids[a:]]).clone()
    labels[: segment.prefix_tokens + P] = -100
    logits = student(inputs_embeds=joined, position_ids=torch.arange(joined.shape[1])[None]).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:], reduction="sum")


@pytest.mark.numeric
@pytest.mark.parametrize("insert_at", [0, 3])
def test_loss_and_prompt_gradient_match_the_students_own_forward(student, plain_student, insert_at):
    tokenizer = make_tiny.chatml_tokenizer()
    segment = make_segment(tokenizer)
    segment.insert_at = insert_at
    prompt = initial_prompt(student, init(5, method="random_normal", std=0.5), seed=3)
    model = SoftPromptModel(student, prompt, CHUNKED_16)
    assert_matches_reference(model, [segment], lambda p: reference_loss(plain_student, p, segment), prompt)
    assert model.prompt.grad.dtype == torch.float32
    assert all(p.grad is None for p in student.parameters())


def test_the_rounding_bound_tells_a_wrong_splice_from_rounding(student, plain_student):
    """The bound the numeric tests use (tests/helpers.py) is loose enough for any CPU's rounding
    and still far too tight for a wrong result: the prompt spliced one token later fails it."""
    segment = make_segment(make_tiny.chatml_tokenizer())
    prompt = initial_prompt(student, init(5, method="random_normal", std=0.5), seed=3)
    model = SoftPromptModel(student, prompt, CHUNKED_16)
    model([segment]).backward()
    shifted = Segment(segment.ids, segment.prefix_tokens, segment.insert_at + 1)
    wrong = prompt.clone().requires_grad_()
    reference_loss(plain_student, wrong, shifted).backward()
    with pytest.raises(AssertionError, match="exceeds"):
        assert_rounding_close(model.prompt.grad, wrong.grad, what="prompt gradient")


@pytest.mark.numeric
def test_padded_micro_batch_equals_separate_records(student):
    tokenizer = make_tiny.chatml_tokenizer()
    rows = [r for r in make_tiny.synthetic_rows(tokenizer, 8) if "input_ids" in r][:3]
    segments = [Segment(torch.tensor(r["input_ids"]), r["prefix_tokens"], 3) for r in rows]
    assert len({len(s.ids) for s in segments}) > 1  # really padded
    prompt = initial_prompt(student, init(4, method="random_normal", std=0.5), seed=1)
    model = SoftPromptModel(student, prompt, CHUNKED_64)
    together = model(segments)
    separate = sum(model([s]) for s in segments)
    assert_rounding_close(together, separate, what="padded loss")


@pytest.mark.numeric
@pytest.mark.parametrize("recomputed", [False, True])
def test_packed_micro_batch_equals_plain_forwards_of_each_record(student, plain_student, recomputed, monkeypatch):
    """Three records of different lengths and splice points end to end in one forward (each
    record's positions restarting, its attention its own): the loss and the prompt gradient of
    plain transformers forwards, one per record. With every layer recomputed, the recompute
    gets the record boundaries too."""
    tokenizer = make_tiny.chatml_tokenizer()
    rows = [r for r in make_tiny.synthetic_rows(tokenizer, 8) if "input_ids" in r][:3]
    segments = [
        Segment(torch.tensor(r["input_ids"]), r["prefix_tokens"], insert_at) for r, insert_at in zip(rows, [3, 0, 3])
    ]
    assert len({len(s.ids) for s in segments}) == 3
    prompt = initial_prompt(student, init(4, method="random_normal", std=0.5), seed=1)
    model = SoftPromptModel(student, prompt, CHUNKED_16, activation_checkpointing=recomputed, packed=True)
    rows_seen, forward = [], student.model.forward  # what each forward of the student's body is given
    monkeypatch.setattr(
        student.model, "forward", lambda **kw: rows_seen.append(kw["inputs_embeds"].shape) or forward(**kw)
    )
    assert_matches_reference(
        model, segments, lambda p: sum(reference_loss(plain_student, p, s) for s in segments), prompt
    )
    assert rows_seen == [torch.Size([1, sum(len(s.ids) + 4 for s in segments), student.config.hidden_size])]


@pytest.mark.numeric
def test_length_buckets_pad_without_changing_the_loss(student):
    tokenizer = make_tiny.chatml_tokenizer()
    segment = make_segment(tokenizer)
    prompt = initial_prompt(student, init(4, method="random_normal", std=0.5), seed=1)
    exact = SoftPromptModel(student, prompt, CHUNKED_64, pad_to_multiple_of=1)([segment])
    padded = SoftPromptModel(student, prompt, CHUNKED_64, pad_to_multiple_of=97)([segment])
    assert_rounding_close(padded, exact, what="loss with padding")


def test_init_methods(student):
    tokenizer = make_tiny.chatml_tokenizer()
    embeddings = student.get_input_embeddings().weight
    text = initial_prompt(student, init(5, method="text", text="ab"), 0, tokenizer)
    ids = tokenizer.encode("ab", add_special_tokens=False)
    assert torch.equal(text, embeddings[[ids[0], ids[1], ids[0], ids[1], ids[0]]].float())
    sampled = initial_prompt(student, init(6, method="vocab_sample"), 0)
    assert all(any(torch.equal(row, e) for e in embeddings.float()) for row in sampled)
    first = initial_prompt(student, init(4, method="random_normal", std=0.1), 9)
    assert torch.equal(first, initial_prompt(student, init(4, method="random_normal", std=0.1), 9))
    assert first.dtype == torch.float32 and 0.05 < first.std() < 0.2


@pytest.mark.numeric
def test_activation_checkpointing_changes_nothing_but_memory(tiny_assets):
    tokenizer = make_tiny.chatml_tokenizer()
    segment = make_segment(tokenizer)
    results = []
    for count in (0, 1, 2):  # none, the first of the tiny student's two layers, both
        student = load_student(tiny_assets / "student", "float32", "sdpa", torch.device("cpu"))
        prompt = initial_prompt(student, init(4, method="random_normal", std=0.5), seed=2)
        model = SoftPromptModel(student, prompt, CHUNKED_16, activation_checkpointing=count > 0)
        model.recompute = lambda *args, count=count, **kwargs: count
        recomputed = []  # count the layer forwards run again during backward
        for layer in student.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda *_: recomputed.append(True))
        loss = model([segment])
        assert [layer.training for layer in student.model.layers] == [i < count for i in range(2)]
        forwards = len(recomputed)
        loss.backward()
        assert len(recomputed) - forwards == count
        results.append((loss.detach(), model.prompt.grad))
    for loss, grad in results[1:]:  # a recomputed layer runs the same kernels on the same inputs: bit for bit
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


def test_auto_checkpointing_policy(student):
    from spds.kernels.attention import AttentionPlan
    from spds.model.recompute import RecomputePolicy

    policy = RecomputePolicy("auto", student, budget_gib=None, device=torch.device("cpu"))
    assert policy(10**9) == 0  # CPU without a budget: never
    policy.device = torch.device("cuda")  # the decision itself, without a GPU
    policy.layers = 36  # an 8B-deep student (with two layers, recomputing one saves nothing)
    per_position = policy.hidden * 40 * policy.layers  # all layers' activations, one position
    policy.budget = 1000 * per_position
    assert policy(1000) == 0  # fits: nothing recomputed
    assert policy(1001) == 2  # just over: the fewest layers whose saving pays for one recompute
    partial = policy(1500)  # the fewest layers that bring the activations under the budget
    assert 0 < partial < policy.layers
    need = lambda k: 1500 * policy.hidden * ((policy.layers - k) * 40 + k * 2 + 40)  # noqa: E731
    assert need(partial) <= policy.budget < need(partial - 1)
    with pytest.raises(SpdsError, match="100000 positions.*every layer recomputed"):
        policy(100_000)  # beyond what checkpointing can save: a clear stop, not an out-of-memory mid-update
    # A kernel that materialises the scores (math SDPA): [heads, L, L] bf16 kept per plain layer,
    # three while a layer runs. The same micro-batch needs more layers recomputed, and a length the
    # linear model would accept is refused.
    quadratic = RecomputePolicy(
        "auto",
        student,
        budget_gib=None,
        device=torch.device("cpu"),
        attention=AttentionPlan("math", student, torch.device("cpu")),
    )
    quadratic.device, quadratic.layers, quadratic.budget = policy.device, policy.layers, policy.budget
    heads, hidden, layers = quadratic.attention.heads, quadratic.hidden, quadratic.layers

    def quadratic_need(k, positions):
        plain = positions * hidden * 40 + 2 * heads * positions**2
        running = positions * hidden * 40 + 6 * heads * positions**2
        return (layers - k) * plain + k * positions * hidden * 2 + (running if k else 6 * heads * positions**2)

    assert quadratic(1500) > partial
    assert quadratic_need(quadratic(1500), 1500) <= policy.budget < quadratic_need(quadratic(1500) - 1, 1500)
    longest_linear = max(
        n
        for n in range(1000, 20_000, 50)  # every layer recomputed, linear model
        if n * policy.hidden * (2 * policy.layers + 40) <= policy.budget
    )
    policy(longest_linear)  # the linear model accepts it...
    with pytest.raises(SpdsError, match="quadratic in length"):
        quadratic(longest_linear)  # ...the math kernel's scores do not fit
    assert RecomputePolicy(True, student, None, torch.device("cpu"))(1) == student.config.num_hidden_layers
    # FlashAttention-4 keeps O(L), but its backward allocates fp32 accumulators for dQ (every query
    # head) and, with grouped-query heads, dK and dV (every key/value head): counted while a layer runs.
    fa4 = AttentionPlan("fa4", student, torch.device("cuda"))
    config = student.config
    assert config.num_key_value_heads < config.num_attention_heads  # the grouped-query case
    accumulators = 1500 * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim * 4
    assert fa4.memory(1500, 1500) == (0, accumulators)
    assert fa4.memory(1500, 500, packed=True) == (0, accumulators)  # packed: fa4's own varlen kernel
    # Liger's kernels keep 26 bytes per position per hidden unit, not 40 (measured on H200): a
    # micro-batch over the budget at 40 fits whole with them.
    liger = RecomputePolicy("auto", student, budget_gib=None, device=torch.device("cpu"), liger_kernels=True)
    liger.device, liger.layers, liger.budget = policy.device, policy.layers, policy.budget
    assert policy(1500) > 0 and liger(1500) == 0  # 1500 x 26 <= 1000 x 40
    assert liger(1538) == 0 and liger(1539) > 0  # 1539 x 26 = 40,014 > 40,000: the first length over
