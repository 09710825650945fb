"""Batches depend only on (seed, update, dataset size); ranks get equal counts, longest first."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from spds.errors import SpdsError
from spds.training.schedule import deal_to_ranks, global_batch, lr_factor


def test_batches_are_pure_whole_per_epoch_and_never_repeat_a_record():
    size, batch = 10, 4  # two batches per epoch; two records of each permutation wait
    epochs = [np.concatenate([global_batch(7, u, size, batch) for u in (2 * e + 1, 2 * e + 2)]) for e in range(3)]
    for e, seen in enumerate(epochs):
        permutation = np.random.Generator(np.random.PCG64(np.random.SeedSequence([7, e]))).permutation(size)
        assert list(seen) == list(permutation[:8])  # the documented recipe, recomputed here
        assert len(set(seen.tolist())) == 8
    assert np.array_equal(global_batch(7, 3, size, batch), global_batch(7, 3, size, batch))
    assert not np.array_equal(global_batch(7, 1, size, batch), global_batch(8, 1, size, batch))
    # The case seen in a real run (48 records, batches of 5): update 154 crossed an epoch boundary
    # and held record 29 twice. No update may hold a record twice.
    for update in range(1, 400):
        chosen = global_batch(0, update, 48, 5)
        assert len(set(chosen.tolist())) == 5, update
    with pytest.raises(SpdsError, match="exceeds the 10 training records"):
        global_batch(7, 1, size, 11)


def test_deal_by_cost_balances_what_equal_counts_cannot():
    """One 32k record and seven of 1k on two ranks: equal counts put the long one with three
    others (cost 32+3 against 4 short: the ranks wait on the first); by cost it goes alone."""
    from spds.training.schedule import record_cost

    positions = np.array([32768] + [1024] * 7)
    costs = record_cost(positions, quadratic_length=20000.0)
    assert costs[0] / costs[1] > 32 * 1.5  # attention makes the long record dearer than its length says
    by_cost = deal_to_ranks(np.arange(8), costs, 2)
    assert by_cost == [[0], [1, 2, 3, 4, 5, 6, 7]]
    equal = deal_to_ranks(np.arange(8), costs, 2, equal_counts=True)
    assert [len(g) for g in equal] == [4, 4]

    def efficiency(groups):
        loads = [costs[g].sum() for g in groups]
        return sum(loads) / (len(loads) * max(loads))

    assert efficiency(by_cost) > efficiency(equal)
    assert deal_to_ranks(np.arange(8), costs, 2) == by_cost  # every rank computes the same deal
    # Each rank gets a record while records remain, even beside one dominant record.
    assert all(deal_to_ranks(np.arange(8), costs, 8))


def test_deal_longest_first_to_least_loaded_with_equal_counts():
    costs = np.array([100, 1, 50, 49, 2, 98], dtype=float)
    groups = deal_to_ranks(np.arange(6), costs, 2, equal_counts=True)
    assert [len(g) for g in groups] == [3, 3]
    # 100 -> r0; 98 -> r1; 50 -> r1 (98 < 100); 49 -> r0 (100 < 148); 2 -> r1; r1 full, so 1 -> r0
    assert groups == [[0, 3, 1], [5, 2, 4]]
    loads = [costs[g].sum() for g in groups]
    assert abs(loads[0] - loads[1]) <= costs.max()
    with pytest.raises(SpdsError, match="does not divide by the world size 4"):
        deal_to_ranks(np.arange(6), costs, 4)


def test_learning_rate_shapes():
    optim = SimpleNamespace(warmup_updates=2, updates=10, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, optim) for step in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[1:], factors[2:]))
    assert lr_factor(5, SimpleNamespace(**{**vars(optim), "schedule": "constant"})) == 1.0
    linear_optim = SimpleNamespace(**{**vars(optim), "schedule": "linear", "min_lr_ratio": 0.0})
    linear = [lr_factor(s, linear_optim) for s in range(2, 10)]
    assert linear[0] == 1.0 and linear[-1] == 0.0


def test_micro_batches_respect_count_and_token_budget():
    from spds.training.schedule import Plan

    plan = Plan.__new__(Plan)
    plan.positions = np.array([1000, 900, 300, 290, 280, 100])
    plan.micro_batch, plan.micro_batch_tokens, plan.packed = 3, 1000, False
    assert plan.micro_batches([0, 1, 2, 3, 4, 5]) == [[0], [1], [2, 3, 4], [5]]
    plan.micro_batch_tokens = None
    assert plan.micro_batches([0, 1, 2, 3, 4, 5]) == [[0, 1, 2], [3, 4, 5]]
    # Padded, four 300-position rows cost 1200 > 1000; packed end to end they cost 970.
    plan.micro_batch, plan.micro_batch_tokens = 4, 1000
    assert plan.micro_batches([0, 1, 2, 3, 4, 5]) == [[0], [1], [2, 3, 4], [5]]
    assert plan.footprint([2, 3, 4]) == 900
    plan.packed = True
    assert plan.micro_batches([0, 1, 2, 3, 4, 5]) == [[0], [1], [2, 3, 4, 5]]
    assert plan.footprint([2, 3, 4, 5]) == 970
