"""Hand-worked: a page of 8 items, two prefixes of 2 blocks (256 tokens) each, then a block
of its own; two engines. Grouped, each prefix's run lands whole where
`policy.grouping.assign` puts it (the bound, ⌈1.25 × 8 / 2⌉ = 5, keeps the runs apart),
prefilled once there: 3 of its 4 items hit 256 tokens."""

import pytest

from policy.grouping import assign, own_queue
from sim.engine import EngineSpec
from sim.grouping import POOL, GroupingSetup, play
from sim.trace import BatchItem, BatchSpec

SETUP = GroupingSetup(engines=2, batch=BatchSpec(items=8, seed=5), concurrency=8, group_size=2,
                      engine=EngineSpec(max_seqs=8, cache_blocks=64))


def items():
    out = []
    for i in range(8):
        p = i % 2  # the file interleaves them; the page sorts them apart
        head = ("P" if p else "Q") * 200 + f" question {i}"
        out.append(BatchItem(i, head, 384, 2, (10 + p, 20 + p, 100 + i)))
    return out


def test_a_page_lands_as_assign_says_and_hits_as_computed():
    its = items()
    arm = play(SETUP, its, "grouped")
    page = sorted(its, key=lambda it: (it.head, it.idx))
    own = {f"e{i:03d}": own_queue(POOL, "", f"e{i:03d}") for i in range(2)}
    runs = assign([it.head for it in page], own)
    assert [r.count for r in runs] == [4, 4] and runs[0].queue != runs[1].queue
    engine = {j.arrival.id: j.engine for j in arm.jobs}
    at = 0
    for r in runs:
        assert {own[engine[it.idx]] for it in page[at:at + r.count]} == {r.queue}
        at += r.count
    assert arm.hit_rate == pytest.approx(6 * 256 / (8 * 384))
    assert arm.groups == 4  # each run in groups of 2


def test_the_shared_queue_prefills_a_prefix_once_per_engine_it_lands_on():
    arm = play(SETUP, items(), "shared")
    pairs = {(j.engine, j.arrival.blocks[0]) for j in arm.jobs}
    assert arm.hit_rate == pytest.approx((8 - len(pairs)) * 256 / (8 * 384))
    assert arm.hit_rate <= play(SETUP, items(), "grouped").hit_rate
