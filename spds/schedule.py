"""Which records each update trains on, which rank gets which, and the learning-rate shape.

Update u's global batch is a pure function of (seed, u, number of training records N):
each epoch is a seeded permutation of the N records cut into floor(N/B) batches of B; the last
N mod B records of each permutation wait for a later epoch (a different, random remainder each
time). So a record never appears twice in one update (an update whose batch ran across an epoch
boundary could hold one record twice, counting it double), and once per epoch at most. No world
size, resume or rank count enters, so a run on 1 GPU and on 64 GPUs sees the same batches, and
a resumed run continues where it stopped.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .fsio import SpdsError, sha256_json

RECIPE = "spds-epoch-permutation-v2"  # in every checkpoint cursor; v2: whole batches per epoch


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return generator.permutation(size)


def global_batch(seed: int, update: int, size: int, batch: int) -> np.ndarray:
    """Positions (0..size-1 into the training records) of update `update` (1-based)."""
    if batch > size:
        raise SpdsError(f"optim.effective_batch {batch} exceeds the {size} training records: an update would repeat records")
    epoch, index = divmod(update - 1, size // batch)
    return epoch_permutation(seed, epoch, size)[index * batch:(index + 1) * batch].astype(np.int64)


def batch_digest(indices) -> str:
    return sha256_json([int(i) for i in indices])


def record_cost(length: np.ndarray) -> np.ndarray:
    """Relative cost of a record of `length` positions, used to balance ranks."""
    return np.asarray(length, dtype=np.float64)


def deal_to_ranks(indices: np.ndarray, costs: np.ndarray, world: int) -> list[list[int]]:
    """Longest first, each record to the least-loaded rank that still has room; equal counts.

    Ties go to the lower rank and to the lower index, so every rank computes the same deal."""
    if len(indices) % world:
        raise SpdsError(f"a global batch of {len(indices)} records does not divide by the world size {world}")
    capacity = len(indices) // world
    groups: list[list[int]] = [[] for _ in range(world)]
    loads = [0.0] * world
    for index in sorted((int(i) for i in indices), key=lambda i: (-costs[i], i)):
        rank = min((r for r in range(world) if len(groups[r]) < capacity), key=lambda r: (loads[r], r))
        groups[rank].append(index)
        loads[rank] += float(costs[index])
    return groups


def lr_factor(step: int, optim: dict) -> float:
    """Multiplier of optim.learning_rate for the update after `step` completed updates."""
    warmup, total = optim["warmup_updates"], optim["updates"]
    if warmup and step < warmup:
        return (step + 1) / warmup
    if optim["schedule"] == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    floor = optim["min_lr_ratio"]
    if optim["schedule"] == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
