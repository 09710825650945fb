"""How well each dealing rule balances ranks: expected efficiency (the busiest rank's time against
a perfect split) from measured per-record costs, at many ranks.

    python bench/simulate_balance.py [--batches 300]

Per-record time t(L) = a L + b L^2 is fitted to spds's measured throughput on 1x H200 for the
1.7B student at 4k, 16k and 32k positions (bench/results/LOG.md, first table, `spds default`). Each
global batch draws lengths log-uniform in 512..32k (the benchmark's length mix) plus the 256
soft-prompt positions. Rules:

    equal counts   longest first to the least-loaded rank with room (spds before this change)
    by cost        costliest first to the least-loaded rank, costs L + L^2 / quadratic_length
                   from the student's shapes (what spds does now; 20,002 for the 1.7B shapes)
    oracle         the same with the measured t(L) as the cost (the best this greedy rule gets)

Efficiency of a batch = sum of times / (ranks x the busiest rank's time); the mean over batches.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spds.training.schedule import deal_to_ranks, record_cost  # noqa: E402

PROMPT = 256
MEASURED = {4096: 31_411, 16384: 28_418, 32768: 21_447}  # tokens/s, 1.7B, 4 records of each length
QUADRATIC_LENGTH_1_7B = 20001.5  # spds.model.student.quadratic_length of the Qwen3-1.7B shapes


def fit() -> tuple[float, float]:
    lengths = np.array([length + PROMPT for length in MEASURED], dtype=float)
    per_position = np.array([1.0 / rate for rate in MEASURED.values()])  # seconds per position
    b, a = np.polyfit(lengths, per_position, 1)  # t(L) / L = a + b L
    return a, b


def efficiency(groups: list[list[int]], times: np.ndarray) -> float:
    loads = [times[group].sum() for group in groups]
    return float(sum(loads) / (len(loads) * max(loads)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    a, b = fit()
    print(f"t(L) = {a * 1e6:.2f} us x L + {b * 1e12:.3f} ps x L^2 (measured: quadratic length {a / b:,.0f})")
    rng = np.random.default_rng(0)
    print("| ranks | effective batch | equal counts | by cost (spds) | oracle |")
    print("|---|---|---|---|---|")
    for batch, worlds in ((32, (2,)), (64, (8, 64)), (512, (8, 64, 512))):
        for world in worlds:
            scores = {"equal": [], "cost": [], "oracle": []}
            for _ in range(args.batches):
                positions = np.exp(rng.uniform(math.log(512), math.log(32768), batch)).astype(int) + PROMPT
                times = a * positions + b * positions.astype(float) ** 2
                indices = np.arange(batch)
                scores["equal"].append(
                    efficiency(deal_to_ranks(indices, positions.astype(float), world, equal_counts=True), times)
                )
                scores["cost"].append(
                    efficiency(deal_to_ranks(indices, record_cost(positions, QUADRATIC_LENGTH_1_7B), world), times)
                )
                scores["oracle"].append(efficiency(deal_to_ranks(indices, times, world), times))
            cells = [f"{np.mean(scores[k]):.3f}" for k in ("equal", "cost", "oracle")]
            print(f"| {world} | {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
