"""Summed cross entropy of lm_head(hidden) against targets, without materialising the logits.

A 64k-token record times a 152k vocabulary is 10^10 logits (40 GB in fp32): never built.
On CUDA, Liger's fused linear cross entropy (reduction "sum"). Elsewhere, and as the reference
for Liger, `chunked_linear_cross_entropy`: the logits of `chunk` rows at a time, their softmax
gradient folded into d(loss)/d(hidden) during the forward pass, so backward is one multiply.
The lm_head weight is frozen: no gradient for it is ever computed.
"""
from __future__ import annotations

import torch


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            # Like Liger: the matmul in the input dtype, softmax and loss in fp32.
            logits = (hidden[rows] @ weight.t()).float()
            target = targets[rows]
            log_normaliser = torch.logsumexp(logits, dim=-1)
            total += (log_normaliser - logits.gather(1, target[:, None]).squeeze(1)).sum()
            if grad_hidden is not None:
                probabilities = torch.exp(logits - log_normaliser[:, None])
                probabilities[torch.arange(len(target), device=target.device), target] -= 1.0
                grad_hidden[rows] = probabilities.to(hidden.dtype) @ weight
        ctx.save_for_backward(grad_hidden if grad_hidden is not None else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        # spds backpropagates the plain sum (grad_output 1: exact). Any other scale is applied in
        # fp32 and the product rounded once: a scale rounded to bf16 first would bias every
        # gradient by bf16(s)/s (0.9985 .. 1.0027 for s = 1/N).
        return (grad_hidden.float() * grad_output.float()).to(grad_hidden.dtype), None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk: int = 4096) -> torch.Tensor:
    """sum_i CE(hidden_i @ weight.T, targets_i), fp32 scalar; hidden [N, H], weight [V, H]."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)


def reference_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain definition, logits materialised: for tests only."""
    return torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")


def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # ImportError, or Triton missing / failing on this machine
        return False
    return torch.cuda.is_available()


def liger_cross_entropy():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def summed(hidden, weight, targets):
        return liger(weight, hidden, targets).float()

    return summed


def chunked_cross_entropy(chunk: int):
    def summed(hidden, weight, targets):
        return chunked_linear_cross_entropy(hidden, weight, targets, chunk)

    return summed


# The seam for objectives: objective -> kernel -> factory(chunk) of f(hidden, weight, targets) ->
# fp32 sum over the supervised tokens. A new objective (a KL to a teacher, say) is one entry here
# plus its schema enum value; train and eval call whatever make_loss returns.
OBJECTIVES = {
    "ce": {"liger": lambda chunk: liger_cross_entropy(), "chunked": chunked_cross_entropy},
}


def make_loss(objective: str, kernel: str, chunk: int):
    """f(hidden, weight, targets) -> fp32 summed loss, for loss.objective and loss.kernel (auto:
    Liger on CUDA when installed, else spds's chunked implementation). f.kernel names the choice."""
    if kernel == "liger" and not liger_available():
        from .fsio import SpdsError

        raise SpdsError("loss.kernel is 'liger' but liger-kernel is not importable or there is no CUDA device "
                        "(pip install 'spds[gpu]', or set loss.kernel to 'auto')")
    chosen = "liger" if kernel == "liger" or (kernel == "auto" and liger_available()) else "chunked"
    loss_fn = OBJECTIVES[objective][chosen](chunk)
    loss_fn.kernel = chosen
    return loss_fn
