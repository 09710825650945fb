"""A random-weight Qwen3-shaped student saved with save_pretrained, the tiny example's byte-level
ChatML tokenizer, synthetic token-form candidates of log-uniform length, and a run config.

    python bench/make_synthetic.py DIR --model 0.6b --records 32 --min-tokens 256 --max-tokens 8192 [--longest 32768]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "tiny"))
sys.path.insert(0, str(REPO / "bench"))
import bench_gpu  # noqa: E402
import make_tiny  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--model", default="0.6b")
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument(
        "--longest",
        type=int,
        default=None,
        help="make the first record exactly this many tokens (a drawn mix may fall short of its most)",
    )
    args = parser.parse_args()
    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny.chatml_tokenizer()
    bench_gpu.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    model = bench_gpu.build_student(args.model)
    model.save_pretrained(directory / "student")
    tokenizer.save_pretrained(directory / "student")
    rng = np.random.default_rng(0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain the archive."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    with open(directory / "candidates.jsonl", "w") as stream:
        for i in range(args.records):
            total = int(math.exp(rng.uniform(math.log(args.min_tokens), math.log(args.max_tokens))))
            if i == 0 and args.longest:
                total = args.longest
            response = rng.integers(32, 127, max(2, total - len(prompt) - 1)).tolist() + [tokenizer.eos_token_id]
            stream.write(
                json.dumps(
                    dict(
                        request_id=f"r{i}",
                        question_id=f"q{i // 2}",
                        sample_index=i % 2,
                        input_ids=list(prompt) + response,
                        prefix_tokens=len(prompt),
                        labels=[-100] * len(prompt) + response,
                        supervised_tokens=len(response),
                        response_sha256=hashlib.sha256(bytes(response[:-1])).hexdigest(),
                    )
                )
                + "\n"
            )
    make_tiny.tiny_config(
        directory,
        soft_prompt={"length": 256, "placement": "system"},
        data={"candidates": [{"path": "candidates.jsonl"}], "packed_dir": "packed", "context_limit": 65536},
        optim={
            "updates": 10,
            "effective_batch": 8,
            "learning_rate": 0.001,
            "seed": 3,
            "warmup_updates": 0,
            "schedule": "constant",
        },
        checkpoint={"every": 5, "keep_last": 3},
        train={"deterministic": True},
    )
    print(directory / "config.json")


if __name__ == "__main__":
    main()
