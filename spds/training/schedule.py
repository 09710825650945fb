"""Which records each update trains on, which rank gets which, in which forward passes, and the
learning-rate shape. Pure functions of the packed store's columns and the optim settings: no
torch, no devices, no communication (every rank computes the same answers alone).

    Plan.step(u) -> Step: update u's global batch, its deal to ranks (costliest first to the least
                   loaded, by L + L^2/quadratic_length), the global supervised-token count;
                   computed once
    Plan.passes(step, rank, lockstep) -> this rank's forward passes (micro-batches, checkpointing
                   decision, counted or a lockstep filler)

Update u's global batch is a pure function of (seed, u, number of training records N):
each epoch is a seeded permutation of the N records cut into floor(N/B) batches of B; the last
N mod B records of each permutation wait for a later epoch (a different, random remainder each
time). So a record never appears twice in one update (an update whose batch ran across an epoch
boundary could hold one record twice, counting it double), and once per epoch at most. No world
size, resume or rank count enters, so a run on 1 GPU and on 64 GPUs sees the same batches, and
a resumed run continues where it stopped.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from spds.contract.settings import OptimSettings
from spds.errors import SpdsError
from spds.fsio import sha256_json

RECIPE = "spds-epoch-permutation-v2"  # in every checkpoint cursor; v2: whole batches per epoch


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return generator.permutation(size)


def global_batch(seed: int, update: int, size: int, batch: int) -> np.ndarray:
    """Positions (0..size-1 into the training records) of update `update` (1-based)."""
    if batch > size:
        raise SpdsError(
            f"optim.effective_batch {batch} exceeds the {size} training records: an update would repeat records"
        )
    epoch, index = divmod(update - 1, size // batch)
    return epoch_permutation(seed, epoch, size)[index * batch : (index + 1) * batch].astype(np.int64)


def batch_digest(indices) -> str:
    return sha256_json([int(i) for i in indices])


def record_cost(positions: np.ndarray, quadratic_length: float | None = None) -> np.ndarray:
    """Relative cost of records of `positions` positions: L (the weights' matmuls, per position)
    plus L^2 / quadratic_length (attention, per pair of positions). quadratic_length is the
    length at which attention costs as much as everything else (model.quadratic_length derives
    it from the student's shapes); None: linear."""
    positions = np.asarray(positions, dtype=np.float64)
    return positions if not quadratic_length else positions + positions * positions / quadratic_length


def deal_to_ranks(indices: np.ndarray, costs: np.ndarray, world: int, equal_counts: bool = False) -> list[list[int]]:
    """Costliest first, each record to the least-loaded rank (longest-processing-time first).

    Ranks may hold different numbers of records: the gradient is an exact SUM over ranks whatever
    the split, and a sharded student's ranks run lockstep fillers (Plan.passes). With
    `equal_counts` a rank takes no more than its share (the rule before cost balancing, kept for
    comparison). Every rank gets a record while records remain (an empty rank has the least
    load). Ties go to the lower rank and to the lower index, so every rank computes the same deal."""
    if len(indices) % world:
        raise SpdsError(f"a global batch of {len(indices)} records does not divide by the world size {world}")
    order = sorted((int(i) for i in indices), key=lambda i: (-costs[i], i))
    groups: list[list[int]] = [[] for _ in range(world)]
    if not equal_counts:  # a heap of (load, rank): 512 ranks x 512 records in milliseconds
        heap = [(0.0, rank) for rank in range(world)]
        for index in order:
            load, rank = heapq.heappop(heap)
            groups[rank].append(index)
            heapq.heappush(heap, (load + float(costs[index]), rank))
        return groups
    capacity, loads = len(indices) // world, [0.0] * world
    for index in order:
        rank = min((r for r in range(world) if len(groups[r]) < capacity), key=lambda r: (loads[r], r))
        groups[rank].append(index)
        loads[rank] += float(costs[index])
    return groups


def lr_factor(step: int, optim: OptimSettings) -> float:
    """Multiplier of optim.learning_rate for the update after `step` completed updates."""
    warmup, total = optim.warmup_updates, optim.updates
    if warmup and step < warmup:
        return (step + 1) / warmup
    if optim.schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    floor = optim.min_lr_ratio
    if optim.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Step:
    """One update, planned once: its records, their deal to ranks, and its normaliser."""

    update: int
    batch: np.ndarray  # indices into the packed store
    dealt: list  # per rank: record indices, longest first
    supervised_tokens: int  # over the global batch: the loss's denominator
    positions: int  # record + soft-prompt positions over the global batch
    longest_record_positions: int  # what an out-of-memory or a slow update points to

    @property
    def digest(self) -> str:
        return batch_digest(self.batch)


def lockstep_passes(
    every: list[list[list[int]]], rank: int, footprint, filler: list[int]
) -> list[tuple[list[int], int, bool]]:
    """`rank`'s passes when every rank must run as many as the busiest (a sharded student gathers
    its weights collectively in each): `every[r]` is rank r's groups of records; pass j is rank
    `rank`'s group j, or `filler` not counted once it has none left, with the largest footprint
    of any rank's pass j (so that every rank recomputes alike). Training (Plan.passes) and eval
    both pass through here."""
    mine, passes = every[rank], []
    for j in range(max(len(groups) for groups in every)):
        largest = max(footprint(groups[j]) for groups in every if j < len(groups))
        passes.append((mine[j], largest, True) if j < len(mine) else (filler, largest, False))
    return passes


class Plan:
    """Which records are trained, in which update, on which rank, in which micro-batches."""

    def __init__(
        self, store, optim: OptimSettings, prompt_positions: int, world: int, quadratic_length: float | None = None
    ):
        self.store, self.world = store, world
        self.seed, self.batch, self.micro_batch = optim.seed, optim.effective_batch, optim.micro_batch
        self.micro_batch_tokens = optim.micro_batch_tokens
        self.packed = optim.micro_batch_layout == "packed"  # end to end: no padding to count
        self.train_records = np.flatnonzero(store.is_train)
        if not len(self.train_records):
            raise SpdsError("no training records: data.eval_fraction holds out every question")
        # what one record occupies in a forward pass (prompt_positions: an embeddings prompt's p, a kv prompt's none)
        self.positions = store.length + prompt_positions
        self.costs = record_cost(self.positions, quadratic_length)  # what balances ranks

    def step(self, update: int, force_longest: bool = False) -> Step:
        batch = self.train_records[global_batch(self.seed, update, len(self.train_records), self.batch)]
        if force_longest:  # the smoke proves the longest record fits: make sure it is in
            longest = self.longest_record
            if longest not in batch:
                batch = batch.copy()
                batch[0] = longest
        return self.step_of(update, batch)

    @property
    def longest_record(self) -> int:
        return int(self.train_records[int(np.argmax(self.store.length[self.train_records]))])

    @property
    def longest_record_tokens(self) -> int:
        return int(self.store.length[self.longest_record])

    def step_of(self, update: int, batch: np.ndarray) -> Step:
        return Step(
            update=update,
            batch=batch,
            dealt=deal_to_ranks(batch, self.costs, self.world),
            supervised_tokens=int(self.store.supervised_tokens[batch].sum()),
            positions=int(self.positions[batch].sum()),
            longest_record_positions=int(self.positions[batch].max()),
        )

    def footprint(self, group: list[int]) -> int:
        """Positions a forward pass over `group` (longest first) computes: every record padded to
        the first, or (packed) their sum."""
        if self.packed:
            return int(self.positions[group].sum())
        return int(self.positions[group[0]]) * len(group)

    def micro_batches(self, mine: list[int]) -> list[list[int]]:
        """Consecutive records (longest first, as dealt) in groups of at most micro_batch records
        and, when set, micro_batch_tokens positions (padding counted when padded): similar
        lengths share a forward."""
        groups: list[list[int]] = []
        budget = self.micro_batch_tokens
        for index in mine:
            group = groups[-1] if groups else None
            fits = group and (budget is None or self.footprint(group + [index]) <= budget)
            if fits and len(group) < self.micro_batch:
                group.append(index)
            else:
                groups.append([index])
        return groups

    def passes(self, step: Step, rank: int, lockstep: bool) -> list[tuple[list[int], int | None, bool]]:
        """This rank's forward passes in one update: (records, checkpointing positions, counted).

        A sharded student gathers its weights collectively in every forward, and again in every
        layer recomputed in backward, so every rank must run the same passes with the same
        checkpointing. In lockstep each rank runs as many passes as the busiest one; pass j
        decides checkpointing from the largest pass j of any rank; a rank out of records runs its
        shortest record again, not counted (zero gradient). Every rank computes this alike from
        the deal: no communication."""
        if not lockstep:
            return [(group, None, True) for group in self.micro_batches(step.dealt[rank])]
        filler = [min(step.dealt[rank], key=lambda i: int(self.positions[i]))]
        return lockstep_passes([self.micro_batches(records) for records in step.dealt], rank, self.footprint, filler)

    def cursor(self, step: Step, rank: int) -> dict:
        """Where the data stream stands after `step`: saved with every checkpoint, per rank."""
        return dict(
            completed_update=step.update,
            next_update=step.update + 1,
            recipe=RECIPE,
            seed=self.seed,
            training_records=len(self.train_records),
            effective_batch=self.batch,
            global_batch_sha256=step.digest,
            rank_records=[int(i) for i in step.dealt[rank]],
        )
