"""bench/admission.py's judgement on a hand-made ledger and client record: overshoot per
window, the bound of docs/quotas-and-audit.md, refusals below quota, the staleness the ledger proves, and the
client's accepted ids against the reserve rows."""

from bench.admission import Reply, judge, most_within, proven_staleness

W = 1_700_000_040.0  # a UTC minute's start


def test_most_within():
    assert most_within([0.0, 1.0, 1.5, 4.0, 4.1, 4.2], 1.0) == 3
    assert most_within([], 1.0) == 0


def test_the_staleness_the_ledger_proves():
    # L = 3: A, B, A fill the window; B's admission at 5 s means it had not seen A's at 2 s
    # (3 before it, its own 1: it saw at most 1 of A's 2); A's at 6 s, with 4 before it,
    # means A lacked both of B's, the older at 1 s.
    rows = [("r1", "A", W), ("r2", "B", W + 1), ("r3", "A", W + 2), ("r4", "B", W + 5), ("r5", "A", W + 6)]
    assert proven_staleness(rows, 3) == 5.0
    assert proven_staleness(rows, 5) == 0.0  # never over the limit: nothing proven
    # the next window starts afresh
    assert proven_staleness([*rows[:3], ("r6", "B", W + 61)], 3) == 0.0


def test_judge_counts_overshoot_refusals_below_quota_and_the_ledger_against_the_client():
    limit = 3
    reserves = [(f"request:{i}", h, W + t) for i, (h, t) in enumerate(
        [("A", 1.0), ("B", 1.5), ("A", 2.0), ("B", 2.5), ("A", 30.0)])]
    per_minute = {W: 5}
    replies = [Reply(0, W + t - 0.01, W + t + 0.01, 200, id=str(i)) for i, t in enumerate([1.0, 1.5, 2.0, 2.5, 30.0])]
    replies += [
        Reply(1, W + 1.6, W + 1.7, 429, code="rate_limit_exceeded"),  # 2 in the ledger by then: room, wrongly refused
        Reply(1, W + 3.0, W + 3.1, 429, code="rate_limit_exceeded"),  # 4 by then: rightly
        Reply(1, W + 59.95, W + 60.05, 429, code="rate_limit_exceeded"),  # across a minute: not judged
        Reply(1, W + 4.0, W + 4.2, 502, code="engine_error"),
    ]
    f = judge(limit, 2, 3.2, replies, reserves, set(), per_minute)
    assert f["overshoot"] == 2 and f["per_window"] == [5] and f["per_window_client"] == [5]
    # docs/quotas-and-audit.md: (P − 1) × min(L, most one process admitted within S): A's 3 within 3.2 s? 1.0, 2.0 → 2
    assert f["peak_per_process_in_s"] == 2 and f["bound"] == 1 * min(3, 2)
    assert f["wrongly_refused"] == 1 and f["refusals_across_a_minute"] == 1 and f["refused"] == 3
    assert f["other_answers"] == {"502": 1}
    assert f["ledger_matches_client"] and f["holders"] == 2
    assert f["proven_staleness_s"] == 28.5  # A at 30 s, 4 before it: it lacked both of B's, the older at 1.5 s
    # a request the client saw accepted with no reserve row, or one refunded, breaks the match
    assert not judge(limit, 2, 3.2, replies + [Reply(0, W, W, 200, id="ghost")], reserves, set(),
                     per_minute)["ledger_matches_client"]
    assert not judge(limit, 2, 3.2, replies, reserves, {"request:4"}, per_minute)["ledger_matches_client"]
