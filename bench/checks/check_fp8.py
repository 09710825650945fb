"""student.fp8_linear's products against bf16, CUDA (Hopper or later).

    python bench/check.py fp8

1. spds.kernels.fp8.quantize_rows's Triton kernel against its PyTorch arithmetic: the same bits.
2. Each linear layer of a Qwen3-8B (and 1.7B) layer at 16,384 tokens: the bf16 product x @ W^T
   and the frozen layer's backward dy @ W, against spds.kernels.fp8's (row quantization included), timed;
   their relative error against an fp32 product.
"""

from __future__ import annotations

import statistics

import torch

from spds.kernels import fp8  # noqa: E402

TOKENS = 16384
SHAPES = {  # (in, out) of q, k, v, o, gate, up, down
    "8b": dict(
        q=(4096, 4096),
        k=(4096, 1024),
        v=(4096, 1024),
        o=(4096, 4096),
        gate=(4096, 12288),
        up=(4096, 12288),
        down=(12288, 4096),
    ),
    "1.7b": dict(
        q=(2048, 2048),
        k=(2048, 1024),
        v=(2048, 1024),
        o=(2048, 2048),
        gate=(2048, 6144),
        up=(2048, 6144),
        down=(6144, 2048),
    ),
}


def timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def relative_error(got, want) -> float:
    return float((got.float() - want).norm() / want.norm())


@torch.no_grad()
def main(args) -> None:
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, columns in ((TOKENS, 4096), (TOKENS, 12288), (1000, 2048)):
        x = torch.randn(rows, columns, device="cuda", generator=g, dtype=torch.bfloat16) * 3
        q, scale = fp8.quantize_rows_triton(x)
        ref_scale = x.abs().amax(-1, keepdim=True).float().clamp(min=fp8.SMALLEST_SCALE) / fp8.FP8_MAX
        ref_q = (x.float() * (1.0 / ref_scale)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        differ = (q.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean().item()
        same = f"{torch.equal(scale, ref_scale) and differ == 0} (elements differing: {differ:.2e})"
        ms = timed(lambda: fp8.quantize_rows_triton(x))
        print(
            f"quantize [{rows}, {columns}]: Triton == PyTorch bits: {same}; {ms * 1000:.0f} us "
            f"({x.nbytes * 1.5 / ms / 1e6:.0f} GB/s)",
            flush=True,
        )
    for model, shapes in SHAPES.items():
        total = {"bf16 fwd": 0.0, "fp8 fwd": 0.0, "bf16 bwd": 0.0, "fp8 bwd": 0.0}
        for name, (inputs, outputs) in shapes.items():
            linear = torch.nn.Linear(inputs, outputs, bias=False, device="cuda", dtype=torch.bfloat16)
            torch.nn.init.normal_(linear.weight, std=inputs**-0.5)
            layer = fp8.FrozenFP8Linear(linear)
            x = torch.randn(TOKENS, inputs, device="cuda", generator=g, dtype=torch.bfloat16)
            dy = torch.randn(TOKENS, outputs, device="cuda", generator=g, dtype=torch.bfloat16)
            w = linear.weight
            flops = 2 * TOKENS * inputs * outputs
            times = {
                "bf16 fwd": timed(lambda: x @ w.t()),
                "fp8 fwd": timed(lambda: fp8.FP8Product.forward(_Ctx(), x, layer)),
                "bf16 bwd": timed(lambda: dy @ w),
                "fp8 bwd": timed(lambda: _backward(layer, dy)),
            }
            for key in total:
                total[key] += times[key]
            forward_error = relative_error(fp8.FP8Product.forward(_Ctx(), x, layer), x.float() @ w.float().t())
            backward_error = relative_error(_backward(layer, dy), dy.float() @ w.float())
            print(
                f"{model} {name:4s} [{TOKENS}x{inputs}] @ [{inputs}x{outputs}]: "
                + ", ".join(f"{k} {v * 1000:.0f} us ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in times.items())
                + f"; error fwd {forward_error:.4f} bwd {backward_error:.4f}",
                flush=True,
            )
        print(
            f"{model} one layer's linears: forward {total['bf16 fwd']:.2f} -> {total['fp8 fwd']:.2f} ms "
            f"({total['bf16 fwd'] / total['fp8 fwd']:.2f}x), backward {total['bf16 bwd']:.2f} -> "
            f"{total['fp8 bwd']:.2f} ms ({total['bf16 bwd'] / total['fp8 bwd']:.2f}x)",
            flush=True,
        )


class _Ctx:
    """Stands in for autograd's context when the Function's forward is timed alone."""


def _backward(layer, dy):
    ctx = _Ctx()
    ctx.layer = layer
    return fp8.FP8Product.backward(ctx, dy)[0]
