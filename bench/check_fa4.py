"""Is there an attention kernel on Hopper faster than cuDNN's, for spds's long records?

FlashAttention-4 (flash-attn-4, CuTe DSL, sm90 forward and backward) against the kernels spds
runs today: cuDNN SDPA for long records, FlashAttention-2 (PyTorch's flash SDPA) for short ones.
Causal, bf16, the attention shape of Qwen3-1.7B (16 query heads, 8 key/value heads, head_dim 128),
one sequence. Times forward + backward (all of dQ, dK, dV) with CUDA events after warm-up (FA4's
first calls JIT-compile), and checks each kernel's gradient against cuDNN's.

    python bench/check_fa4.py --lengths 4096,8192,32768
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def milliseconds(step, repeats: int = 5) -> float:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="4096,8192,32768")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cuDNN {torch.backends.cudnn.version()}")
    print("| L | kernel | fwd+bwd ms | TFLOP/s | vs cuDNN | grad max |diff| / max |grad| vs cuDNN |")
    print("|---|---|---|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        torch.manual_seed(0)
        make = dict(device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, length, HEADS, HEAD_DIM, **make).requires_grad_()  # [batch, L, heads, dim]
        k = torch.randn(1, length, KV_HEADS, HEAD_DIM, **make).requires_grad_()
        v = torch.randn(1, length, KV_HEADS, HEAD_DIM, **make).requires_grad_()
        grad_out = torch.randn(1, length, HEADS, HEAD_DIM, **make)

        def sdpa(backend):
            def step():
                q.grad = k.grad = v.grad = None
                with sdpa_kernel(backend):  # [batch, heads, L, dim]; keys and values repeated per group
                    out = F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1),
                        v.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1), is_causal=True)
                out.transpose(1, 2).backward(grad_out)
            return step

        def fa4(deterministic: bool):
            def step():
                q.grad = k.grad = v.grad = None
                out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(grad_out)
            return step

        flops = 6 * HEADS * HEAD_DIM * length * length  # causal: forward 2, backward 4 (x heads x dim x L^2)
        reference = None
        kernels = [("cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION)), ("FA2 (flash SDPA)", sdpa(SDPBackend.FLASH_ATTENTION)),
                   ("FA4", fa4(False)), ("FA4 deterministic", fa4(True))]
        for name, step in kernels:
            try:
                ms = milliseconds(step)
            except Exception as error:  # a kernel this build lacks: say so and go on
                failure = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
                print(f"| {length} | {name} | {failure} | | | |", flush=True)
                continue
            grads = torch.cat([t.grad.float().flatten() for t in (q, k, v)])
            if reference is None:
                reference, reference_ms = grads, ms
            diff = float((grads - reference).abs().max() / reference.abs().max())
            print(f"| {length} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {reference_ms / ms:.2f}x | {diff:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
