"""On CUDA: Liger's fused linear CE and spds's chunked implementation agree (value and gradient),
and both agree with the plain definition computed in fp32. Prints relative errors."""

import torch

from spds.contract.gate import section
from spds.model.loss import chunked_linear_cross_entropy, make_loss, reference_linear_cross_entropy


def relative(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(args) -> None:
    torch.manual_seed(0)
    for rows, hidden_size, vocab in [(4096, 2048, 151936), (1000, 4096, 151936)]:
        hidden = (torch.randn(rows, hidden_size, device="cuda") * 0.5).to(torch.bfloat16)
        weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).to(torch.bfloat16)
        targets = torch.randint(0, vocab, (rows,), device="cuda")
        results = {}
        liger = make_loss(section("loss", kernel="liger", chunk_tokens=4096))
        for name, fn in [
            ("liger", lambda h: liger(h, weight, targets)),
            ("chunked", lambda h: chunked_linear_cross_entropy(h, weight, targets, 4096)),
            ("fp32 reference", lambda h: reference_linear_cross_entropy(h.float(), weight.float(), targets)),
        ]:
            h = hidden.detach().clone().requires_grad_()
            loss = fn(h)
            loss.backward()
            results[name] = (loss.detach(), h.grad)
        ref_loss, ref_grad = results["fp32 reference"]
        for name in ("liger", "chunked"):
            loss, grad = results[name]
            print(
                f"rows {rows} hidden {hidden_size}: {name:8s} loss rel err {relative(loss, ref_loss):.2e}  "
                f"grad rel err {relative(grad, ref_grad):.2e}  loss dtype {loss.dtype}"
            )
        assert relative(results["liger"][0], ref_loss) < 1e-3 and relative(results["liger"][1], ref_grad) < 2e-2
