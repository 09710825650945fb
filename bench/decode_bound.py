"""What a decode step of `spds generate` cannot go below on a GPU, two ways:

  * the memory-bandwidth bound: the bytes a step must read (the weights once, the shared context's
    keys and values once, each row's own keys and values) over the HBM bandwidth;
  * the roofline: each part of the step at the slower of its bytes over the bandwidth and its
    FLOPs over the dense bf16 peak, summed. At a batch of ~1,000 rows the projections' FLOPs
    (2 x parameters x rows) take longer than reading their weights, and the shared context's
    attention (every row's queries against its keys) is FLOP-bound too, so the roofline is the
    tighter of the two.

Both use NVIDIA's H200 figures (4.8 TB/s, 989 TFLOP/s dense bf16), not measured ones: a bound.

    python3 bench/decode_bound.py 1.7b --batch 1024 --context 4136 --own 296
    python3 bench/decode_bound.py path/to/config.json ...      (a saved model's shapes)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
PEAK = 989e12  # H200 dense bf16, FLOP/s
DEVICES = {"h200": (4.8e12, 989e12), "h100": (3.35e12, 989e12)}  # SXM: HBM bytes/s, dense bf16 FLOP/s


def shape_of(name: str) -> dict:
    """A transformers config's keys, from a config.json or one of bench_gpu's Qwen3 shapes."""
    if name.endswith(".json"):
        return json.loads(Path(name).read_text())
    from bench_gpu import qwen3_config

    return qwen3_config(name).to_dict()


def step_bounds(shape: dict, batch: int, context: int, own: float, device: str = "h200") -> dict:
    """Seconds a step of `batch` rows takes at least, with `context` shared positions and `own`
    positions of each row's own (its question and answer so far, on average)."""
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    kv, vocab = shape["num_key_value_heads"], shape["vocab_size"]
    head_dim = shape.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    parameters = layers * (attention + 3 * hidden * shape["intermediate_size"]) + vocab * hidden  # and the output head
    per_token = layers * 2 * kv * head_dim * 2  # bf16 key and value bytes of one position, all layers
    attention_flops = 4 * layers * heads * head_dim * batch  # per key every row's queries read: QK and PV
    parts = {  # (bytes, FLOPs)
        "projections": (2 * parameters, 2 * parameters * batch),
        "shared context's attention": (context * per_token, attention_flops * context),
        "own keys' attention": (batch * own * per_token, attention_flops * own),
    }
    rate, peak = DEVICES[device]
    bandwidth = sum(b for b, _ in parts.values()) / rate
    roofline = {name: max(b / rate, f / peak) for name, (b, f) in parts.items()}
    return dict(bandwidth=bandwidth, roofline=sum(roofline.values()), parts=roofline)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a bench_gpu shape (1.7b, 8b, ...) or a config.json")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--context", type=int, default=4136, help="shared positions (the context and template)")
    parser.add_argument("--own", type=float, default=40 + 512 / 2, help="a row's own positions, on average")
    parser.add_argument("--step-ms", type=float, default=None, help="a measured step, to compare")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200", help="whose datasheet figures")
    args = parser.parse_args()
    bounds = step_bounds(shape_of(args.model), args.batch, args.context, args.own, args.device)
    report = dict(
        model=args.model,
        device=args.device,
        batch=args.batch,
        bandwidth_bound_step_ms=round(1e3 * bounds["bandwidth"], 2),
        roofline_step_ms=round(1e3 * bounds["roofline"], 2),
        roofline_parts_ms={k: round(1e3 * v, 2) for k, v in bounds["parts"].items()},
        bandwidth_bound_tokens_per_second=round(args.batch / bounds["bandwidth"]),
        roofline_tokens_per_second=round(args.batch / bounds["roofline"]),
    )
    if args.step_ms:
        report["step_over_bandwidth_bound"] = round(args.step_ms / report["bandwidth_bound_step_ms"], 2)
        report["step_over_roofline"] = round(args.step_ms / report["roofline_step_ms"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
