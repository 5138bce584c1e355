"""The benches' read-backs: each reads everything it asked for or fails saying what is
missing, never a part of it silently; and Postgres's own counters, which the overhead
bench reads rows per request from, count exactly the rows this test writes itself."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from bench import overhead, placement, surge
from config.database import libpq_url
from tests.conftest import migrated_database


@pytest.fixture(scope="module")
def url(pg_server_url) -> Iterator[str]:
    """A database of its own: the hand-made records below are not what an engine writes,
    and the session's test stack reconciles everything in the shared one."""
    with migrated_database(pg_server_url, "ballast_readbacks") as owner:
        yield libpq_url(owner)


def _event(url: str, type_: str, payload: dict) -> None:
    key = f"{type_}:{uuid.uuid4().hex}"
    with psycopg.connect(url) as c:
        c.execute("INSERT INTO events (stream, version, type, payload, idempotency_key, tenant)"
                  " VALUES (%s, 1, %s, %s, %s, 'default')", (key, type_, json.dumps(payload), key))


def served(url: str, request_id: str, engine_id: str) -> None:
    _event(url, "request_served", dict(engine_id=engine_id, requests=[dict(request_id=request_id)]))


def finished(url: str, request_id: str, ttft_ms: float) -> None:
    _event(url, "request_finished", dict(requests=[dict(request_id=request_id, ttft_ms=ttft_ms,
                                                        engine_ttft_ms=ttft_ms / 2)]))


def test_served_on_names_what_is_missing_instead_of_returning_part(url: str) -> None:
    ids = [f"req-{uuid.uuid4().hex}" for _ in range(3)]
    for i in ids[:2]:
        served(url, i, "e1")
    with pytest.raises(RuntimeError, match=f"1 of 3 .*{ids[2]}"):
        placement._served_on(url, ids, timeout_s=0.5)
    served(url, ids[2], "e2")
    assert placement._served_on(url, ids, timeout_s=0.5) == {ids[0]: "e1", ids[1]: "e1", ids[2]: "e2"}


def test_journaled_ttfts_names_what_is_missing_instead_of_returning_part(url: str) -> None:
    ids = [f"req-{uuid.uuid4().hex}" for _ in range(3)]
    for i, ms in zip(ids[:2], (10.0, 20.0), strict=True):
        finished(url, i, ms)
    with pytest.raises(RuntimeError, match=f"1 of 3 .*{ids[2]}"):
        overhead._journaled_ttfts(url, ids, timeout_s=0.5)
    finished(url, ids[2], 30.0)
    api, engine = overhead._journaled_ttfts(url, ids, timeout_s=0.5)
    assert (sorted(api), sorted(engine)) == ([10.0, 20.0, 30.0], [5.0, 10.0, 15.0])


def test_settled_waits_for_transactions_begun_before_the_window_ended(url: str) -> None:
    with psycopg.connect(url) as open_tx:
        open_tx.execute("SELECT 1")  # a transaction now open, begun before `t`
        t = time.time() + 0.2
        time.sleep(0.3)
        with pytest.raises(RuntimeError, match="still open"):
            surge.settled(url, t, timeout_s=0.5)
        done = threading.Timer(0.5, open_tx.commit)
        done.start()
        surge.settled(url, t, timeout_s=10)  # returns once it has ended
        done.join()


def test_pg_stat_counts_the_rows_another_session_writes(url: str) -> None:
    """The overhead bench's per-table counts, against the rows this test writes by hand."""
    table = f"bench_rows_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        before = overhead.table_writes(url)
        c.execute(f"INSERT INTO {table} SELECT g, 0 FROM generate_series(1, 7) g")
        c.execute(f"UPDATE {table} SET v = 1 WHERE id <= 3")
        c.execute(f"DELETE FROM {table} WHERE id = 7")
        c.execute("SELECT pg_stat_force_next_flush()")  # flushed as this session goes idle, not seconds later
        deadline = time.monotonic() + 15
        while (got := overhead._delta(overhead.table_writes(url), before).get(f"public.{table}")) != (7, 3, 1):
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        c.execute(f"DROP TABLE {table}")


def test_arrivals_mark_bursts_and_rounds_differ() -> None:
    plan = surge.arrivals(90, 0.3, seed=11)
    by_burst: dict[int, set[float]] = {}
    for offset, burst, _ in plan:
        by_burst.setdefault(burst, set()).add(offset)
    assert all(len(offsets) == 1 for offsets in by_burst.values())  # a burst arrives at once
    assert sorted(by_burst) == list(range(len(by_burst)))
    assert len(by_burst) < len(plan)  # some bursts are of several requests
    assert plan == surge.arrivals(90, 0.3, seed=11)
    assert [o for o, _, _ in plan] != [o for o, _, _ in surge.arrivals(90, 0.3, seed=12)]


def _arm(name: str, ttfts: list[float], tpot: float) -> surge.Arm:
    chats = [surge.Chat(start=10.0 * i, first=10.0 * i + t, end=10.0 * i + t + 63 * tpot, tokens=64, burst=(0, i))
             for i, t in enumerate(ttfts)]
    return surge.Arm(name, chats, windows=[(0.0, 10.0 * len(ttfts))])


def test_summary_ratios_and_verdict_on_hand_made_arms() -> None:
    """Every ballast request takes twice alone's TTFT and TPOT, which are the same for every
    request: each ratio is 2 and so is every resample's, the interval is [2, 2], and
    both targets are plainly not met."""
    arms = dict(alone=_arm("alone", [0.05] * 100, 0.002), ballast=_arm("ballast", [0.1] * 100, 0.004))
    out = surge.summarise(arms)
    b = out["ballast"]
    for key in ("ttft_p50_ratio", "ttft_p99_ratio", "tpot_ratio"):
        assert (b[key]["ratio"], b[key]["ci95"]) == (2.0, [2.0, 2.0]), key
    assert surge.judged(b["ttft_p99_ratio"], 1.10) == "not met"
    assert surge.judged(dict(ratio=1.0, ci95=[0.8, 1.05]), 1.10) == "met"
    assert surge.judged(dict(ratio=1.0, ci95=[0.8, 1.3]), 1.10) == "undecided"
    # TTFTs of 10, 20, ..., 1,000 ms: p50 the 50th, p99 the 99th (not the slowest).
    ttfts = [0.01 * (i + 1) for i in range(100)]
    spread = surge.summarise(dict(alone=_arm("alone", ttfts, 0.002), ballast=_arm("ballast", ttfts, 0.002)))
    assert (spread["alone"]["ttft_p50_ms"], spread["alone"]["ttft_p99_ms"]) == (500.0, 990.0)
