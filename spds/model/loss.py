"""The loss: a sum over supervised tokens of lm_head(hidden), without materialising the logits.

A 64k-token record times a 152k vocabulary is 10^10 logits (40 GB in fp32): never built.

ce   On CUDA, Liger's fused linear cross entropy (reduction "sum"). Elsewhere, and as the
     reference for Liger, `chunked_linear_cross_entropy`: the logits of `chunk` rows at a time,
     their softmax gradient folded into d(loss)/d(hidden) during the forward pass, so backward is
     one multiply.
kl   (and mix) `_ChunkedLinearLoss`, the same scheme with a teacher: its logits (from its
     hidden states, online) or its top-k (offline) per chunk, the divergence's gradient with
     respect to the student's logits written in closed form (`bucket_divergence`) and folded in
     the same way. One kernel on every device: Liger's fused linear JSD averages over tokens,
     and spds's update is a plain sum divided once by the global token count.

The lm_head weight is frozen: no gradient for it is ever computed. Every backward spds runs is
of the plain sum (grad_output 1); any other scale is applied in fp32 and rounded once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from spds.contract.settings import LossSettings
from spds.errors import SpdsError


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096, softcap: float | None = None
) -> torch.Tensor:
    """sum_i CE(hidden_i @ weight.T, targets_i), fp32 scalar; hidden [N, H], weight [V, H]: the
    chunked kernel below with cross entropy alone (one vocabulary-wide block per row besides the
    logits, as a CE-only kernel would keep). `softcap`: the student's final logit soft cap."""
    spec = CROSS_ENTROPY if softcap is None else dataclasses.replace(CROSS_ENTROPY, softcap=softcap)
    return _ChunkedLinearLoss.apply(hidden, weight, targets, None, None, None, spec, chunk)


def reference_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain definition, logits materialised: for tests only."""
    return torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")


def final_logit_softcap(student) -> float | None:
    """The cap c of a student whose logits are c * tanh(logits / c) (Gemma 2's
    final_logit_softcapping), or None: the loss must see the logits the model's own head gives."""
    cap = getattr(getattr(student, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # ImportError, or Triton missing / failing on this machine
        return False
    return torch.cuda.is_available()


def liger_cross_entropy(softcap: float | None = None):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss(reduction="sum", softcap=softcap)

    def summed(hidden, weight, targets, teacher=None):
        return liger(weight, hidden, targets).float()

    return summed


def chunked_cross_entropy(chunk: int, softcap: float | None = None):
    def summed(hidden, weight, targets, teacher=None):
        return chunked_linear_cross_entropy(hidden, weight, targets, chunk, softcap)

    return summed


# ---------------------------------------------------------------- distillation (kl, mix)


@dataclass
class TeacherTargets:
    """The teacher's next-token distribution at each supervised token, in one of two forms:
    `hidden` [N, H], the teacher's final hidden states (online: the student with the context;
    its logits are hidden @ weight.T, chunk by chunk, never all at once), or `top_ids` and
    `top_logprobs` [N, K] (offline: the K most likely tokens a teacher wrote, the rest of its
    mass one bucket)."""

    hidden: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class Divergence:
    """weight_ce * CE(targets) + weight_kl * D(teacher, student) summed over tokens. D at
    `temperature` (both sides' logits divided by it; no T^2 factor): forward KL(p||q), reverse
    KL(q||p), or the generalised JSD beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q.
    The teacher's side alone is further re-tempered by `teacher_temperature` (p^(1/t), renormalised
    over its buckets): below 1 a sharper target than the teacher itself."""

    ce_weight: float
    kl_weight: float
    direction: str = "forward"
    temperature: float = 1.0
    teacher_temperature: float = 1.0
    beta: float = 0.5
    softcap: float | None = None  # the student's final logit soft cap: both sides' logits c * tanh(z / c)


def bucket_divergence(log_p: torch.Tensor, log_q: torch.Tensor, spec: Divergence):
    """Per row: D over buckets (a vocabulary, or top-K tokens plus a tail), and H = Q * dD/dQ.

    With the softmax's Jacobian, d D / d s_j = (q_j / Q_b(j)) H_b(j) - q_j sum_b H_b, where b(j)
    is j's bucket; H stays finite where Q underflows (forward: H = -P)."""
    p, q = log_p.exp(), log_q.exp()
    if spec.direction == "forward":
        return (p * (log_p - log_q)).sum(-1), -p
    if spec.direction == "reverse":
        difference = log_q - log_p
        return (q * difference).sum(-1), q * (difference + 1.0)
    beta = spec.beta
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    to_q = log_q - log_m
    value = beta * (p * (log_p - log_m)).sum(-1) + (1.0 - beta) * (q * to_q).sum(-1)
    return value, (1.0 - beta) * q * to_q


CROSS_ENTROPY = Divergence(ce_weight=1.0, kl_weight=0.0)


def distillation_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    top_ids: torch.Tensor | None,
    top_logprobs: torch.Tensor | None,
    spec: Divergence,
):
    """fp32 logits [n, V] of the student -> (summed loss, d loss / d logits [n, V])."""
    if teacher_logits is not None and spec.direction == "forward" and (spec.temperature == 1 or not spec.ce_weight):
        return forward_kl_rows(logits, targets, teacher_logits, spec)
    total = logits.new_zeros(())
    grad = None
    if spec.ce_weight:  # softmax - one-hot, in place: one vocabulary-wide block
        log_normaliser = torch.logsumexp(logits, dim=-1)
        total += spec.ce_weight * (log_normaliser - logits.gather(1, targets[:, None]).squeeze(1)).sum()
        grad = torch.exp(logits - log_normaliser[:, None]).mul_(spec.ce_weight)
        grad[torch.arange(len(targets), device=grad.device), targets] -= spec.ce_weight
    if spec.kl_weight:
        s = logits / spec.temperature
        log_z = torch.logsumexp(s, dim=-1, keepdim=True)
        log_q = s - log_z
        if teacher_logits is not None:  # every token its own bucket
            log_p = torch.log_softmax(teacher_logits / (spec.temperature * spec.teacher_temperature), dim=-1)
            value, h = bucket_divergence(log_p, log_q, spec)
            grad_s = h
        else:  # top-K buckets and one tail bucket; log Q_tail from the tail's own logsumexp (no 1 - sum)
            tail_logits = s.scatter(1, top_ids, float("-inf"))
            log_tail_z = torch.logsumexp(tail_logits, dim=-1, keepdim=True)
            tiny = torch.finfo(torch.float32).tiny
            p_tail = (1.0 - top_logprobs.exp().sum(-1, keepdim=True)).clamp_min(tiny)
            log_p = torch.cat([top_logprobs, p_tail.log()], dim=1)
            if spec.teacher_temperature != 1:  # the buckets re-tempered, the tail as one token
                log_p = torch.log_softmax(log_p / spec.teacher_temperature, dim=1)
            log_q_buckets = torch.cat([log_q.gather(1, top_ids), log_tail_z - log_z], dim=1)
            value, h = bucket_divergence(log_p, log_q_buckets, spec)
            grad_s = torch.exp(tail_logits - log_tail_z) * h[:, -1:]  # q_j / Q_tail * H_tail; 0 on the top K
            grad_s.scatter_(1, top_ids, h[:, :-1])  # a top-K token is its own bucket: q_j / Q_j = 1
        grad_s -= log_q.exp() * h.sum(-1, keepdim=True)
        total += spec.kl_weight * value.sum()
        grad_s *= spec.kl_weight / spec.temperature
        grad = grad_s if grad is None else grad.add_(grad_s)
    return total, grad


def forward_kl_rows(logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor, spec: Divergence):
    """`distillation_rows` for a forward KL against the teacher's whole-vocabulary logits (plus CE
    at temperature 1, where both share the student's q): one log-softmax a side, D = sum p (log p -
    log q), dD/ds = q - p, and CE's gradient q - onehot. Half the vocabulary-wide operations of the
    bucket rule, which it equals (there sum_b H_b = -sum p = -1): on a GPU each operation is a
    kernel launch per chunk, and they made the KL step launch-bound (bench/RESULTS.md)."""
    temperature, teacher_divisor = spec.temperature, spec.temperature * spec.teacher_temperature
    log_q = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits if teacher_divisor == 1 else teacher_logits / teacher_divisor, dim=-1)
    p = log_p.exp()
    total = spec.kl_weight * (p * log_p.sub_(log_q)).sum()
    rows = torch.arange(len(targets), device=logits.device)
    if spec.ce_weight:
        total = total - spec.ce_weight * log_q[rows, targets].sum()
    kl_scale = spec.kl_weight / temperature
    grad = log_q.exp_()  # q
    if spec.ce_weight + kl_scale != 1:
        grad.mul_(spec.ce_weight + kl_scale)
    grad.sub_(p, alpha=kl_scale)
    if spec.ce_weight:
        grad[rows, targets] -= spec.ce_weight
    return total, grad


class _ChunkedLinearLoss(torch.autograd.Function):
    """sum over rows of spec's loss of hidden @ weight.T, `chunk` rows at a time; each chunk's
    d(loss)/d(logits) is folded into d(loss)/d(hidden) during the forward pass (the weight is
    frozen), so backward is one multiply."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher_hidden, top_ids, top_logprobs, spec: Divergence, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).float()  # the matmul in the input dtype, the rest in fp32
            teacher = (teacher_hidden[rows] @ weight.t()).float() if teacher_hidden is not None else None
            if spec.softcap is not None:  # the model head's own logits: c * tanh(z / c)
                squashed = torch.tanh(logits / spec.softcap)
                logits = squashed * spec.softcap
                teacher = torch.tanh(teacher / spec.softcap) * spec.softcap if teacher is not None else None
            part, grad = distillation_rows(
                logits,
                targets[rows],
                teacher,
                top_ids[rows] if top_ids is not None else None,
                top_logprobs[rows] if top_logprobs is not None else None,
                spec,
            )
            total += part
            if spec.softcap is not None:
                grad.mul_(1.0 - squashed.square_())  # d(c tanh(z / c)) / dz
            if grad_hidden is not None:
                grad_hidden[rows] = grad.to(hidden.dtype) @ weight
        ctx.save_for_backward(grad_hidden if grad_hidden is not None else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad_hidden,) = ctx.saved_tensors
        # spds backpropagates the plain sum (grad_output 1: exact). Any other scale is applied in
        # fp32 and the product rounded once: a scale rounded to bf16 first would bias every
        # gradient by bf16(s)/s (0.9985 .. 1.0027 for s = 1/N).
        return (grad_hidden.float() * grad_output.float()).to(grad_hidden.dtype), *([None] * 7)


def chunked_distillation(spec: Divergence, chunk: int):
    # A KL keeps about four vocabulary-wide fp32 blocks per row alive (student, teacher, their
    # log-probabilities, the gradient), CE one: a quarter of the rows at a time.
    rows = max(1, chunk // 4)

    def summed(hidden, weight, targets, teacher: TeacherTargets | None = None):
        if teacher is None:
            raise ValueError("a distillation objective needs the teacher's targets")
        return _ChunkedLinearLoss.apply(
            hidden, weight, targets, teacher.hidden, teacher.top_ids, teacher.top_logprobs, spec, rows
        )

    return summed


# ---------------------------------------------------------------- the seam


def divergence_of(settings, softcap: float | None = None) -> Divergence:
    """loss.* -> what the distillation kernel computes."""
    ce, kl = {"ce": (1.0, 0.0), "kl": (0.0, 1.0), "mix": (settings.ce_weight, settings.kl_weight)}[settings.objective]
    return Divergence(
        ce_weight=ce,
        kl_weight=kl,
        direction=settings.kl.direction,
        temperature=settings.kl.temperature,
        teacher_temperature=settings.kl.teacher_temperature,
        beta=settings.kl.jsd_beta,
        softcap=softcap,
    )


class LossFn(Protocol):
    """What make_loss returns: the fp32 summed loss over `hidden` (the rows that predict the
    supervised tokens, [N, H]) against `targets` ([N] token ids) and, for a distillation
    objective, the teacher's targets; `weight` is the student's lm_head ([V, H])."""

    kernel: str  # liger, chunked or chunked-distillation
    softcap: float | None  # the head's final logit soft cap it was built for
    needs_teacher: bool  # the step must hand it the teacher's targets

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, teacher: TeacherTargets | None = None
    ) -> torch.Tensor: ...


def make_loss(settings: LossSettings, softcap: float | None = None) -> LossFn:
    """f(hidden, weight, targets, teacher=None) -> fp32 summed loss, for loss.* (LossSettings), on
    the logits of a head with final logit soft cap `softcap` (final_logit_softcap(student)).

    ce: Liger's fused linear cross entropy on CUDA when installed (kernel auto), else spds's
    chunked one; kl and mix: spds's chunked distillation kernel on every device (Liger's fused
    linear JSD averages over tokens, and spds needs the plain sum: see bench/RESULTS.md).
    f.kernel names the choice; f.needs_teacher says whether the model must supply targets."""
    kernel, chunk = settings.kernel, settings.chunk_tokens
    if kernel == "liger" and not liger_available():
        raise SpdsError(
            "loss.kernel is 'liger' but liger-kernel is not importable or there is no CUDA device "
            "(pip install 'spds[gpu]', or set loss.kernel to 'auto')"
        )
    if settings.objective == "ce":
        chosen = "liger" if kernel == "liger" or (kernel == "auto" and liger_available()) else "chunked"
        loss_fn = liger_cross_entropy(softcap) if chosen == "liger" else chunked_cross_entropy(chunk, softcap)
        loss_fn.needs_teacher = False
    else:
        chosen = "chunked-distillation"
        loss_fn = chunked_distillation(divergence_of(settings, softcap), chunk)
        loss_fn.needs_teacher = True
    loss_fn.kernel, loss_fn.softcap = chosen, softcap
    return loss_fn
