"""The replay that judges `bench promises`' refusals, on schedules worked out by hand."""

from __future__ import annotations

from bench.promises import Job, busy_seconds, false_refusals, replay


def test_edf_meets_what_fits_and_preempts_for_an_earlier_deadline():
    # 10 tokens/s. A (0 s, 100 tokens, due 20 s); B arrives at 2 s, 30 tokens, due 6 s: B
    # preempts A and ends at 5 s, A at 13 s.
    assert replay([Job(0, 100, 20), Job(2, 30, 6)], 10) == [True, True]
    # Due at 12 s, A misses: 130 tokens need until 13 s.
    assert replay([Job(0, 100, 12), Job(2, 30, 6)], 10) == [False, True]


def test_idle_time_between_arrivals_is_not_work():
    assert replay([Job(0, 10, 1), Job(100, 10, 101)], 10) == [True, True]
    assert replay([Job(0, 10, 1), Job(100, 11, 101)], 10) == [True, False]


def test_a_refusal_is_false_only_when_it_fits_without_costing_an_accepted_batch():
    accepted = [Job(0, 100, 12)]  # ends at 10 s
    fits = Job(0, 10, 20)  # after it: ends at 11 s
    too_big = Job(0, 200, 25)  # 300 tokens by 30 s
    crowds = Job(0, 50, 8)  # meets its own 8 s by going first, but A then ends at 15 s
    assert false_refusals(accepted, [fits, too_big, crowds], 10) == [True, False, False]
    # Where the accepted batches miss already, the fleet was overcommitted: no refusal is false.
    assert false_refusals([Job(0, 200, 12)], [Job(0, 10, 30)], 10) == [False]


def test_busy_seconds_count_overlaps_once():
    assert busy_seconds([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_seconds([]) == 0
