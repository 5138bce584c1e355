"""Completion-window promises (policy/promises.py), against schedules worked out by hand."""

from __future__ import annotations

from policy.promises import (
    Accept,
    Pace,
    Promised,
    Unattainable,
    describe,
    paced,
    parse_window,
    priority_key,
    promise,
)

W = {"1h": 3600, "4h": 14_400, "24h": 86_400}
NOW = 1_000_000.0


def test_windows_parse_and_refuse_what_is_not_one():
    assert [parse_window(w) for w in ("24h", "90m", "3600s", "1d")] == [86_400, 5400, 3600, 86_400]
    assert [parse_window(w) for w in ("", "h", "24", "1.5h", "-1h", "0h", "24H", "1w")] == [None] * 8


def test_an_empty_pool_promises_what_its_pace_covers():
    # 100 tokens/s for an hour is 360,000 tokens: 300,000 fits, its estimate 3,000 s away.
    got = promise("b", 300_000, "1h", W, NOW, [], 100.0, NOW)
    assert got == Accept(NOW + 3600, NOW + 3000, 300_000, 100.0)
    # 400,000 does not; 4 h (1,440,000) would.
    assert promise("b", 400_000, "1h", W, NOW, [], 100.0, NOW) == Unattainable("1h", "4h", 400_000, 100.0)


def test_work_due_earlier_goes_first_and_later_work_does_not_count():
    # Due in 30 min: 150,000 tokens, 1,500 s of the hour. Due in 20 h: 10M, after ours.
    ahead = [Promised("a", NOW + 1800, 150_000), Promised("z", NOW + 72_000, 1_000_000)]
    got = promise("b", 200_000, "1h", W, NOW, ahead, 100.0, NOW)
    assert isinstance(got, Accept) and got.ahead == 350_000 and got.estimated_at == NOW + 3500
    # 250,000 more: 400,000 due by the hour.
    assert promise("b", 250_000, "1h", W, NOW, ahead, 100.0, NOW) == Unattainable("1h", "4h", 400_000, 100.0)


def test_a_batch_that_would_make_a_later_promise_miss_is_refused():
    # "z", due in 2 h, holds 600,000 of the 720,000 tokens 2 h gives: 120,000 to spare.
    ahead = [Promised("z", NOW + 7200, 600_000)]
    assert isinstance(promise("b", 120_000, "1h", W, NOW, ahead, 100.0, NOW), Accept)
    # 130,000 fits in its own hour, but "z" would miss: the 4 h window puts it after "z".
    refused = promise("b", 130_000, "1h", W, NOW, ahead, 100.0, NOW)
    assert refused == Unattainable("1h", "4h", 130_000, 100.0, displaces=True)
    assert "a batch promised before it would then miss its own window" in describe(refused, 130_000, "m")


def test_at_an_equal_deadline_the_batch_promised_first_goes_first():
    ahead = [Promised("z", NOW + 3600, 300_000)]  # "b" sorts before "z", but "z" was promised first
    assert promise("b", 60_000, "1h", W, NOW, ahead, 100.0, NOW) == Accept(NOW + 3600, NOW + 3600, 360_000, 100.0)
    assert promise("b", 60_001, "1h", W, NOW, ahead, 100.0, NOW) == Unattainable("1h", "4h", 360_001, 100.0)


def test_a_promise_already_broken_does_not_refuse_everything_after_it():
    # "z" cannot make its 2 h already (the pace fell): a batch due before it is judged on its own.
    ahead = [Promised("z", NOW + 7200, 900_000)]
    assert isinstance(promise("b", 100_000, "1h", W, NOW, ahead, 100.0, NOW), Accept)


def test_nothing_fits_and_the_refusal_says_so():
    ahead = [Promised("a", NOW + 3600, 10_000_000)]
    got = promise("b", 1, "1h", W, NOW, ahead, 100.0, NOW)
    assert got == Unattainable("1h", None, 10_000_001, 100.0)
    assert "No window can be promised now" in describe(got, 1, "m")


def test_the_window_runs_from_creation_not_from_validation():
    # Created 50 min ago: 10 min left at 100 tokens/s is 60,000 tokens.
    assert isinstance(promise("b", 60_000, "1h", W, NOW - 3000, [], 100.0, NOW), Accept)
    assert isinstance(promise("b", 60_001, "1h", W, NOW - 3000, [], 100.0, NOW), Unattainable)


def test_an_unmeasured_pool_promises_only_its_longest_window():
    assert promise("b", 10**9, "24h", W, NOW, [], 0.0, NOW) == Accept(NOW + 86_400, None, 10**9, 0.0)
    refused = promise("b", 1, "1h", W, NOW, [], 0.0, NOW)
    assert refused == Unattainable("1h", "24h", 1, 0.0)
    assert "Use 24h" in describe(refused, 1, "m")


def test_shorter_windows_run_ahead_of_the_longest():
    assert priority_key(86_400, W) == 4 and priority_key(3600, W) == 3 and priority_key(14_400, W) == 3


def test_pace_counts_only_seconds_with_batch_work_in_hand():
    p = paced(Pace(), 0.5, 0)
    assert p == Pace()  # under a busy second: no sample yet
    p = paced(p, 1.5, 0)
    assert p == Pace()  # nothing finished yet: the first sample waits for a finished item
    p = paced(p, 2.0, 1000)
    assert p.rate == 500  # 1,000 tokens over two busy seconds
    # Idle time does not move the busy seconds: nothing changes, however long.
    assert paced(p, 2.0, 1000) == p
    # Tokens counted just after the last slot was let go wait for the next busy second.
    late = paced(p, 2.0, 1200)
    assert late == p
    # One busy second more at (200 + 600) tokens moves a 60 s average by 1/60 of the gap.
    q = paced(late, 3.0, 1800)
    assert abs(q.rate - (500 + (800 - 500) / 60)) < 1e-9
    # A restarted counter (lower) is read afresh, not as a negative pace.
    r = paced(q, 0.2, 10)
    assert r.rate == q.rate and (r.busy_s, r.tokens) == (0.2, 10)
