"""The distillation kernel against the plain definitions (full softmax, autograd), and the online
teacher (the context's keys and values computed once) against a plain forward with the context.

The references here import nothing from spds's loss: each divergence is written as its textbook
formula over materialised probabilities and differentiated by autograd."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import ROUNDING, assert_rounding_close, divergence

from spds.contract.gate import section
from spds.model.loss import TeacherTargets, make_loss


def reference_loss(
    hidden, weight, targets, teacher_hidden, direction, temperature, beta, ce_weight, kl_weight, top=None, sharpen=1.0
):
    """`sharpen`: loss.kl.teacher_temperature, p^(1/sharpen) renormalised over the teacher's support."""
    logits = hidden @ weight.t()
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    if top is None:
        log_p = torch.log_softmax((teacher_hidden @ weight.t()) / temperature / sharpen, dim=-1)
    else:  # the same support: the teacher's top k tokens, and everything else as one bucket
        ids, logprobs = top
        q = log_q.exp()
        q_top = q.gather(1, ids)
        log_q = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], dim=1).log()
        log_p = torch.cat([logprobs, (1 - logprobs.exp().sum(-1, keepdim=True)).log()], dim=1)
        log_p = torch.log_softmax(log_p / sharpen, dim=1)
    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return ce_weight * ce + kl_weight * divergence(log_p, log_q, direction, beta)


def random_top_k(n: int, vocab: int, k: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:k] for _ in range(n)])
    mass = torch.rand(n, 1, generator=generator) * 0.5 + 0.45  # the top k hold 45% to 95%
    shares = torch.softmax(torch.randn(n, k, generator=generator) * 2, dim=-1)
    return ids, (shares * mass).log()


CASES = [  # objective, direction, temperature, teacher[, loss.kl.teacher_temperature]
    ("kl", "forward", 1.0, "context"),
    ("kl", "reverse", 1.0, "context"),
    ("kl", "jsd", 1.0, "context"),
    ("kl", "forward", 2.0, "context"),
    ("kl", "reverse", 0.5, "context"),
    ("mix", "jsd", 1.5, "context"),
    ("mix", "forward", 1.0, "context"),  # CE and KL from one q (loss.forward_kl_rows)
    ("mix", "forward", 2.0, "context"),  # two temperatures: the general rule
    ("kl", "forward", 1.0, "top_k"),
    ("kl", "reverse", 1.0, "top_k"),
    ("mix", "jsd", 1.0, "top_k"),
    ("kl", "forward", 1.0, "context", 0.5),  # a sharpened teacher: the one-q rule
    ("mix", "reverse", 2.0, "context", 0.3),  # and the general rule
    ("kl", "forward", 1.0, "top_k", 0.5),  # its k tokens and its tail re-tempered
    ("mix", "jsd", 1.0, "top_k", 0.3),
]


@pytest.mark.numeric
@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_distillation_loss_and_gradient_equal_the_plain_definitions(case):
    objective, direction, temperature, teacher, sharpen = (*case, 1.0)[:5]
    generator = torch.Generator().manual_seed(0)
    n, vocab, width, beta = 37, 211, 16, 0.3
    hidden = torch.randn(n, width, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64) * 0.5
    teacher_hidden = hidden + 0.7 * torch.randn(n, width, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=generator)
    top = random_top_k(n, vocab, 8, generator) if teacher == "top_k" else None
    settings = section(
        "loss",
        objective=objective,
        ce_weight=0.25,
        kl_weight=2.0,
        kernel="chunked",
        chunk_tokens=20,
        kl={"direction": direction, "temperature": temperature, "jsd_beta": beta, "teacher_temperature": sharpen},
    )
    loss_fn = make_loss(settings)
    assert loss_fn.needs_teacher
    targets_of = (
        TeacherTargets(hidden=teacher_hidden)
        if top is None
        else TeacherTargets(top_ids=top[0], top_logprobs=top[1].float())
    )
    mine = hidden.clone().requires_grad_(True)
    loss = loss_fn(mine, weight, targets, targets_of)  # chunk 20 // 4 = 5 rows at a time: 8 chunks
    loss.backward()
    theirs = hidden.clone().requires_grad_(True)
    ce_weight, kl_weight = (0.25, 2.0) if objective == "mix" else (0.0, 1.0)
    top_exact = None if top is None else (top[0], top[1].float().double())  # what the kernel saw, in float64
    expected = reference_loss(
        theirs, weight, targets, teacher_hidden, direction, temperature, beta, ce_weight, kl_weight, top_exact, sharpen
    )
    expected.backward()
    assert float(expected.detach()) > 0
    # The kernel works in fp32 (as on the GPU), the reference in float64: the kernel's rounding.
    assert_rounding_close(loss, expected, what="loss")
    assert_rounding_close(mine.grad, theirs.grad, what="gradient")


def test_a_different_teacher_moves_the_loss():
    """The kernel reads the teacher: a test that passed with the teacher ignored would be worthless."""
    generator = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=generator), torch.randn(50, 8, generator=generator)
    targets = torch.randint(0, 50, (9,), generator=generator)
    loss_fn = make_loss(section("loss", objective="kl", kernel="chunked"))
    same = loss_fn(hidden, weight, targets, TeacherTargets(hidden=hidden))
    other = loss_fn(hidden, weight, targets, TeacherTargets(hidden=hidden.flip(0)))
    # KL of a distribution to itself is zero up to the rounding of its terms (each of the loss's
    # own scale, a few units per row); another teacher's is of that scale itself
    assert abs(float(same)) <= ROUNDING * float(other) < float(other)


@pytest.mark.numeric
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_context_teacher_computes_the_context_once_and_matches_a_plain_forward(
    tiny_assets, monkeypatch, attn_implementation
):
    """loss.reuse_context_kv: each prefix (header + context) runs once; a pass's records of one
    prefix run packed in one forward against it (an sdpa student: spds's attention), or one by one
    (eager: the student's own); either way each record's states are those of a plain forward over
    header ++ context ++ record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spds.kernels import attention as attention_module
    from spds.model.soft_prompt import Segment, SoftPromptModel
    from spds.model.teacher import ContextTeacher

    calls = []  # the packed records' queries attend the cached keys, then their own
    attention = attention_module.packed_after_cached
    monkeypatch.setattr(
        attention_module, "packed_after_cached", lambda *args, **kwargs: calls.append(1) or attention(*args, **kwargs)
    )

    path = tiny_assets / "student"
    load = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    student = AutoModelForCausalLM.from_pretrained(path, **load).eval().requires_grad_(False)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    context = torch.tensor(tokenizer.encode("Lumen Bay ferries leave at dawn and dusk.", add_special_tokens=False))
    loss = make_loss(section("loss", kernel="chunked"))
    model = SoftPromptModel(student, torch.zeros(3, student.config.hidden_size), loss)
    teacher = ContextTeacher(model, context)
    generator = torch.Generator().manual_seed(2)
    # Two headers (token rows may place the prompt anywhere): a group each, in the pass's order.
    headers = {3: torch.tensor([1, 5, 9]), 2: torch.tensor([7, 2])}
    segments = [
        Segment(
            ids=torch.cat([headers[a], torch.randint(10, 60, (n,), generator=generator)]), prefix_tokens=p, insert_at=a
        )
        for n, p, a in ((12, 7, 3), (20, 3, 3), (9, 4, 2), (6, 4, 3))
    ]
    rows = teacher.targets(segments).hidden
    assert teacher.prefix_forwards == 2  # four records, one forward over each header + context
    layers = student.config.num_hidden_layers
    assert len(calls) == (2 * layers if attn_implementation == "sdpa" else 0)  # one packed forward per header
    embed = plain.get_input_embeddings()
    expected = []
    for segment in segments:
        ids, a = segment.ids, segment.insert_at
        joined = torch.cat([embed(ids[:a]), embed(context), embed(ids[a:])])[None]
        states = plain.model(inputs_embeds=joined).last_hidden_state[0]
        # response token ids[t] sits at t + len(context) and is predicted from the position before
        expected.append(states[segment.prefix_tokens + len(context) - 1 : len(ids) + len(context) - 1])
    assert_rounding_close(rows, torch.cat(expected), what="teacher states")
    # Another record after a forward: the cache was cropped back to the prefix, not grown.
    again = teacher.targets(segments[:1]).hidden
    assert_rounding_close(again, expected[0], what="teacher states after the crop")
    assert teacher.prefix_forwards == 2


def test_teacher_memo_keeps_each_records_states_and_changes_no_number(tiny_assets):
    """loss.teacher_memo_gib: a record's teacher states are computed once, alone, and a later visit
    returns them bit for bit, whatever batch it comes back in; past the budget, records are
    recomputed (alone) instead of kept."""
    from transformers import AutoModelForCausalLM

    from spds.model.soft_prompt import Segment, SoftPromptModel
    from spds.model.teacher import ContextTeacher

    path = tiny_assets / "student"
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    model = SoftPromptModel(student, torch.zeros(3, student.config.hidden_size), make_loss(section("loss")))
    context = torch.arange(20, 40)
    generator = torch.Generator().manual_seed(3)
    segments = [
        Segment(
            ids=torch.cat([torch.tensor([1, 5, 9]), torch.randint(10, 60, (n,), generator=generator)]),
            prefix_tokens=5,
            insert_at=3,
            index=i,
        )
        for i, n in enumerate((12, 20, 6))
    ]
    plain = ContextTeacher(model, context, reuse_context=False)
    alone = [plain.targets([s]).hidden for s in segments]  # each record's own pass, no memo
    memo = ContextTeacher(model, context, reuse_context=False, memo_gib=1.0)
    first = memo.targets(segments).hidden
    assert memo.record_forwards == 3 and sorted(memo.memo) == [0, 1, 2]
    again = memo.targets([segments[2], segments[0]]).hidden  # another batch, another order
    assert memo.record_forwards == 3  # nothing recomputed
    assert torch.equal(first, torch.cat(alone)) and torch.equal(again, torch.cat([alone[2], alone[0]]))
    one_record = alone[1].nbytes / 2**30
    small = ContextTeacher(model, context, reuse_context=False, memo_gib=one_record)  # room for one record
    small.targets(segments[1:2])
    small.targets(segments)
    assert sorted(small.memo) == [1] and small.record_forwards == 3
    assert torch.equal(small.targets(segments).hidden, first)


def test_kl_settings_are_typed_and_frozen():
    settings = section("loss", objective="kl", kl={"direction": "jsd"})
    assert settings.kl.direction == "jsd" and settings.kl.temperature == 1.0 and settings.kl.jsd_beta == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.kl.temperature = 2.0
