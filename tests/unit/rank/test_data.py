"""Each step's samples in an elastic job (:mod:`mindft.rank.data`): every sample of every epoch used
once across any sequence of world sizes, in an order that depends only on the seed, and each rank's
weight such that the ranks average the global batch."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from mindft.rank.data import GlobalBatches


def trained(data: GlobalBatches, worlds: list[int]) -> list[int]:
    """The samples a job trains on, step by step and rank by rank, with world ``worlds[s - 1]`` at step s."""
    used: list[int] = []
    for step, world in enumerate(worlds, start=1):
        shares = [data.share(step, rank, world) for rank in range(world)]
        # The mean over ranks of weight x per-rank mean loss weighs every sample of the step 1 / global_batch.
        assert all(s.weight / (world * len(s.indices)) == pytest.approx(1 / data.global_batch) for s in shares)
        for share in shares:
            used += share.indices.tolist()
    return used


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_of_every_epoch_is_used_once_whatever_the_world_sizes(seed: int) -> None:
    draw = random.Random(seed)
    data = GlobalBatches(samples=draw.randint(5, 60), global_batch=draw.randint(1, 12), seed=seed)
    worlds = [draw.choice([w for w in (1, 2, 3, 4, 6) if w <= data.global_batch]) for _ in range(draw.randint(1, 40))]
    used = trained(data, worlds)
    assert used == trained(data, [1] * len(worlds))  # the world splits the stream, it does not reorder it
    epochs, rest = divmod(len(used), data.samples)
    for epoch in range(epochs):
        assert sorted(used[epoch * data.samples:(epoch + 1) * data.samples]) == list(range(data.samples))
    assert max(Counter(used[epochs * data.samples:]).values(), default=1) == 1  # the epoch under way: none twice


def test_the_order_depends_on_the_seed_and_the_epoch_only() -> None:
    a, b = GlobalBatches(32, 8, seed=1), GlobalBatches(32, 8, seed=2)
    assert np.array_equal(a.batch(5), GlobalBatches(32, 8, seed=1).batch(5))
    assert not np.array_equal(a.epoch_order(0), b.epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert GlobalBatches(10, 4, shuffle=False).batch(3).tolist() == [8, 9, 0, 1]  # across the epoch's end


def test_an_uneven_split_weights_each_rank_by_its_share_and_says_so() -> None:
    data = GlobalBatches(30, 3, shuffle=False)
    shares = [data.share(1, rank, 2) for rank in range(2)]
    assert [s.indices.tolist() for s in shares] == [[0, 1], [2]]
    assert [s.weight for s in shares] == [pytest.approx(4 / 3), pytest.approx(2 / 3)]
    assert "ranks 0..0 take 2 samples and the others 1" in data.uneven(2)
    assert data.uneven(3) == "" and data.share(1, 2, 3).weight == 1.0


@pytest.mark.parametrize("call, match", [
    (lambda: GlobalBatches(0, 4), "samples .0. and global_batch .4. must be at least 1"),
    (lambda: GlobalBatches(8, 4).batch(0), "steps count from 1"),
    (lambda: GlobalBatches(8, 4).share(1, 2, 2), r"rank 2 is not in 0..1"),
    (lambda: GlobalBatches(8, 2).share(1, 0, 3), "a world of 3 ranks cannot split a global batch of 2"),
])
def test_bad_input_names_what_is_valid(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
