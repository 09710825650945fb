"""Which attention kernels give a bit-identical backward run to run, how close to fp32, at what
time and memory (CUDA)?

    python bench/check.py determinism [--model 1.7b] [--lengths 8192,32768]

1. Kernel level, the student's attention shape (grouped-query heads, bf16, causal), through
   spds's own attention paths (spds/kernels/attention.py): SDPA flash, memory-efficient, cuDNN and math
   (where its O(L^2) fits), and flex (compiled, spds's causal block mask), under
   torch.use_deterministic_algorithms with warn_only (what spds used before) and strict. Three
   fwd+bwd runs on the same inputs: dQ, dK, dV equal bit for bit? Their largest error against
   fp32 math (at 8k), median time, peak memory above the inputs.
2. spds's student (SoftPromptModel, train.deterministic's kernel choice, strict mode), one record
   of the longest length, twice, then on flash: is the prompt gradient bit-identical, and how
   far from flash's?
"""

from __future__ import annotations

import os
import statistics
import time

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
from step import HEAD_DIM, SHAPES, build_student  # noqa: E402


def inputs(length: int, heads: int, kv_heads: int, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def draw(h):
        return torch.randn(1, h, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)

    return draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)


def run_kernel(kernel: str, q, k, v, grad_out):
    """spds's own attention paths: SDPA with a named kernel, or flex."""
    from spds.kernels import causal

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = causal.flex_causal(q, k, v, None) if kernel == "flex" else causal.sdpa_causal(kernel, q, k, v, None)
    out.backward(grad_out)
    return q.grad, k.grad, v.grad


def reference_grads(q, k, v, grad_out):
    """fp32 math with the keys repeated to the query heads: what every kernel should approach."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )
    out.backward(grad_out.float())
    return q.grad, k.grad, v.grad


def measure(run, tensors, repeats: int = 3, expected=None) -> dict:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    try:
        first = run(*tensors)  # warm-up (plans, compilation), and the result the others must equal
    except Exception as error:  # noqa: BLE001 - a kernel refusing these inputs is a result
        return dict(error=str(error).splitlines()[0][:140])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, identical = [], True
    for _ in range(repeats):
        started = time.perf_counter()
        grads = run(*tensors)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        identical &= all(torch.equal(a, b) for a, b in zip(first, grads))
    result = dict(
        bit_identical=identical,
        ms=round(1000 * statistics.median(times), 2),
        peak_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
    )
    if expected is not None:  # dQ, dK, dV's largest error relative to the reference's largest entry
        error = max(float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(first, expected))
        result["rel_err_vs_fp32"] = f"{error:.1e}"
    return result


def kernel_level(model: str, lengths: list[int]) -> None:
    _, _, heads, kv_heads, _, _ = SHAPES[model]
    for length in lengths:
        tensors = inputs(length, heads, kv_heads)
        expected = reference_grads(*tensors) if length <= 8192 else None
        for mode in ("warn_only", "strict"):
            torch.use_deterministic_algorithms(True, warn_only=mode == "warn_only")
            for kernel in ("flash", "efficient", "cudnn", "math", "flex"):
                if kernel == "math" and length * length * heads * 2 * 6 > 60 * 2**30:
                    continue  # its scores alone would not fit
                started = time.perf_counter()
                result = measure(lambda *t, k=kernel: run_kernel(k, *t), tensors, expected=expected)
                print(
                    f"{model} L={length:6d} {mode:9s} {kernel:9s} {result} "
                    f"({time.perf_counter() - started:.0f} s in all)",
                    flush=True,
                )
        del tensors, expected
        torch.cuda.empty_cache()
    torch.use_deterministic_algorithms(False)


def model_level(model: str, length: int) -> None:
    from spds.contract.gate import section
    from spds.kernels.attention import kernel_setting, use_deterministic_kernels
    from spds.model.loss import make_loss
    from spds.model.soft_prompt import Segment, SoftPromptModel
    from spds.model.student import initial_prompt

    use_deterministic_kernels()
    student = build_student(model)
    chosen = kernel_setting("auto", True, student, torch.device("cuda"))
    ids = torch.randint(0, 150000, (length,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    segment = Segment(ids=ids, prefix_tokens=128, insert_at=3)
    grads, seconds = [], []
    for kernel in (chosen, chosen, "flash"):  # twice the deterministic choice, then flash as a cross-check
        prompt = initial_prompt(student, section("soft_prompt", length=256), 0)
        loss_fn = make_loss(section("loss", kernel="auto", chunk_tokens=4096))
        spds_model = SoftPromptModel(student, prompt, loss_fn, True, kernel, deterministic=True)
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        spds_model([segment]).backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        grads.append(spds_model.prompt.grad.clone())
    relative = float((grads[0] - grads[2]).abs().max() / grads[2].abs().max())
    print(
        f"spds {model} one {length}-token record, train.deterministic ({chosen}, strict, all layers recomputed): "
        f"prompt gradient bit-identical over 2 runs: {torch.equal(grads[0], grads[1])}; fwd+bwd {seconds[1]:.2f} s "
        f"(flash {seconds[2]:.2f} s); largest difference from flash's gradient {relative:.1e} of its largest entry",
        flush=True,
    )


def options(parser) -> None:
    parser.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--skip-kernels", action="store_true")


def main(args) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cuDNN {torch.backends.cudnn.version()}",
        flush=True,
    )
    if not args.skip_kernels:
        kernel_level(args.model, lengths)
    model_level(args.model, max(lengths))
