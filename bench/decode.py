"""The decode step of `spds generate` against its roofline, on one GPU.

    python bench/decode.py --model 8b --context 32600 --rows 256            (a GPU)
    python bench/decode.py --model 1.7b --rows 1024 --bound-only --device h200   (any machine)

A random-weight Qwen3-shaped teacher (bench/common.py), ROWS prompts of a shared CONTEXT-token
context and a 20-token question, every row decoding to the last step (no end token). The step's
time is taken with CUDA graphs over steps 32..STEPS (the difference of a 32-step and a STEPS-step
batch, so the prefix, the questions' forward and the capture drop out). --profile adds the eager
step's GPU time by kernel class.

The roofline: each part of a step (the projections, the shared context's attention, each row's
own keys' attention) at the slower of its bytes over the HBM bandwidth and its FLOPs over the
dense bf16 peak, summed; the bandwidth bound is all bytes over the bandwidth. Datasheet figures,
not measured ones: a bound. Prints one JSON line (bench/common.py's record).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DEVICES = {"h200": (4.8e12, 989e12), "h100": (3.35e12, 989e12)}  # SXM: HBM bytes/s, dense bf16 FLOP/s
QUESTION = 20


def step_bounds(shape: dict, batch: int, context: int, own: float, device: str) -> dict:
    """Seconds a step of `batch` rows takes at least, with `context` shared positions and `own`
    positions of each row's own (its question and answer so far, on average)."""
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    kv, vocab = shape["num_key_value_heads"], shape["vocab_size"]
    head_dim = shape.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    parameters = layers * (attention + 3 * hidden * shape["intermediate_size"]) + vocab * hidden
    per_token = layers * 2 * kv * head_dim * 2  # bf16 key and value bytes of one position, all layers
    attention_flops = 4 * layers * heads * head_dim * batch  # per key every row's queries read: QK and PV
    parts = {  # (bytes, FLOPs)
        "projections": (2 * parameters, 2 * parameters * batch),
        "shared": (context * per_token, attention_flops * context),
        "own": (batch * own * per_token, attention_flops * own),
    }
    rate, peak = DEVICES[device]
    roofline = {name: max(b / rate, f / peak) for name, (b, f) in parts.items()}
    return dict(bandwidth=sum(b for b, _ in parts.values()) / rate, roofline=sum(roofline.values()), parts=roofline)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for key, label in (
        ("cudnn", "shared part (cuDNN)"),
        ("flash", "flash attention"),
        ("merge_rows", "merge kernel"),
        ("own_keys", "own part (Triton)"),
        ("rms_norm", "Liger"),
        ("rope", "Liger"),
        ("swiglu", "Liger"),
        ("nvjet", "GEMMs"),
        ("gemm", "GEMMs"),
        ("softmax", "sampling"),
        ("multinomial", "sampling"),
    ):
        if key in lowered:
            return label
    return "other"


def measure(args, out: Path) -> dict:
    import torch

    from spds.generation.decode import Decoder
    from spds.generation.generate import load_teacher
    from spds.model.student import apply_liger_kernels

    common.synthetic_run(out / args.model, args.model)
    model = load_teacher(str(out / args.model / "student"), "bfloat16", torch.device("cuda"))
    apply_liger_kernels(model)
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 250, (args.context,), generator=generator).tolist()
    prompts = [shared + torch.randint(2, 250, (QUESTION,), generator=generator).tolist() for _ in range(args.rows)]
    decoder = Decoder(model, [-1], pad_id=0)  # no end token: every row runs to the last step

    def timed(new: int) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        decoder.answer(prompts, new, temperature=1.0, top_p=1.0, seed=0)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    timed(8)  # kernels compiled and plans built before the clock
    short, long = timed(32), timed(args.steps)
    figures = dict(step_ms=round((long - short) / (args.steps - 32) * 1e3, 2))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        decoder.graphs = False
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            decoder.answer(prompts, 33, temperature=1.0, top_p=1.0, seed=0)
        by_class = defaultdict(float)
        for event in trace.key_averages():
            by_class[kernel_class(event.key)] += getattr(event, "self_device_time_total", 0)
        total = sum(by_class.values()) or 1.0
        figures["eager_share_by_kernel"] = {k: round(v / total, 3) for k, v in sorted(by_class.items())}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.7b", choices=sorted(common.SHAPES), help="a Qwen3 shape")
    parser.add_argument("--context", type=int, default=4096, help="shared context tokens (default 4096)")
    parser.add_argument("--rows", type=int, default=1024, help="rows decoded together (default 1024)")
    parser.add_argument("--steps", type=int, default=160, help="decode steps timed (default 160)")
    parser.add_argument("--device", choices=sorted(DEVICES), help="whose datasheet (default: the GPU's name)")
    parser.add_argument("--bound-only", action="store_true", help="the roofline only: no GPU needed")
    parser.add_argument("--profile", action="store_true", help="also the eager step's GPU time by kernel class")
    parser.add_argument("--out", help="raw output directory (default: outside the checkout, bench/common.py)")
    args = parser.parse_args()
    device = args.device
    if not device:
        import torch

        device = "h100" if torch.cuda.is_available() and "H100" in torch.cuda.get_device_name() else "h200"
    own = QUESTION + args.steps / 2  # a row's own positions a step reads, on average
    bounds = step_bounds(common.qwen3_config(args.model).to_dict(), args.rows, args.context + 40, own, device)
    figures = dict(
        figure="decode step",
        model=args.model,
        context=args.context,
        rows=args.rows,
        roofline_ms=round(1e3 * bounds["roofline"], 2),
        bandwidth_bound_ms=round(1e3 * bounds["bandwidth"], 2),
        roofline_parts_ms={k: round(1e3 * v, 2) for k, v in bounds["parts"].items()},
    )
    if not args.bound_only:
        figures.update(measure(args, common.out_dir(args.out, "decode")))
        figures["over_roofline"] = round(figures["step_ms"] / figures["roofline_ms"], 2)
    common.record(**figures)


if __name__ == "__main__":
    main()
