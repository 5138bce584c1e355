"""The split of a global daily limit into regional allowances (policy/allowances.py),
against figures worked by hand."""

from __future__ import annotations

import random

from policy.allowances import CellDay, lowered, overshoot_bound, split


def test_an_even_split_when_nobody_has_demand_yet():
    # 10 000 over three idle cells: 3 333.33 each, the one token left to the first by name.
    got = split(10_000, [CellDay("c", True), CellDay("a", True), CellDay("b", True)])
    assert got == {"a": 3_334, "b": 3_333, "c": 3_333}


def test_what_is_free_goes_a_fifth_evenly_the_rest_by_demand():
    # Used 3 000 + 1 000; free 6 000. Demand 90 / 0 tokens/s: weights 0.2/2 + 0.8 = 0.9 and
    # 0.1: 5 400 and 600.
    got = split(10_000, [CellDay("a", True, 3_000, 90.0), CellDay("b", True, 1_000, 0.0)])
    assert got == {"a": 3_000 + 5_400, "b": 1_000 + 600}
    assert split(10_000, [CellDay("a", True, 3_000, 90.0), CellDay("b", True, 1_000, 0.0)], even=0.05) == {
        "a": 3_000 + 5_850, "b": 1_000 + 150}


def test_a_cell_out_of_reach_keeps_its_allowance_counted_as_spent():
    # c holds 4 000 and cannot be read: the others share 10 000 − 4 000 − 1 000 − 1 000.
    got = split(10_000, [CellDay("a", True, 1_000, 1.0), CellDay("b", True, 1_000, 1.0),
                         CellDay("c", False, allowance=4_000)])
    assert got == {"a": 3_000, "b": 3_000, "c": 4_000}


def test_past_the_limit_nobody_gets_more_than_it_used():
    got = split(1_000, [CellDay("a", True, 700, 5.0), CellDay("b", True, 400, 5.0)])
    assert got == {"a": 700, "b": 400}


def test_allowances_sum_to_the_limit_whatever_the_cells():
    rng = random.Random(7)
    for _ in range(500):
        limit = rng.randrange(0, 10**9)
        cells = []
        for i in range(rng.randrange(1, 40)):
            if rng.random() < 0.2:
                cells.append(CellDay(f"r{i}", False, allowance=rng.randrange(0, limit // 40 + 1)))
            else:
                cells.append(CellDay(f"r{i}", True, rng.randrange(0, limit // 40 + 1), rng.random() * 1e4))
        got = split(limit, cells)
        assert set(got) == {c.cell for c in cells}
        if any(c.reachable for c in cells):  # what the cells hold is within it: all of it is shared out
            assert sum(got.values()) == limit
        else:  # nobody to give it to
            assert got == {c.cell: c.allowance for c in cells}
        assert all(got[c.cell] >= c.used for c in cells if c.reachable)
        assert all(got[c.cell] == c.allowance for c in cells if not c.reachable)
        assert split(limit, list(reversed(cells))) == got  # the order given does not matter


def test_lowered_names_cells_given_less_or_a_bound_for_the_first_time():
    assert lowered({"a": 5, "b": 5, "c": None}, {"a": 4, "b": 6, "c": 100}) == {"a", "c"}


def test_the_bound_takes_the_lesser_of_room_and_demand_over_the_lag():
    # a could admit 500 more under its old allowance, at 300 tokens/s for 1.5 s: 450; b: room 100.
    assert overshoot_bound([(500, 300.0), (100, 300.0)], lag_s=1.5) == 450 + 100
    assert overshoot_bound([(500, 300.0)], lag_s=1.5, in_cell=40) == 490

