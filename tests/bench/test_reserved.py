"""`bench reserved`'s lent share, delivered tokens and TTFT figures, on samples worked out by hand."""

from __future__ import annotations

import math

from bench.reserved import Chat, inside, lent_share, ttft_figures


def sample(reserved: dict, running_of: dict, running: int, batch: int) -> dict:
    return dict(batch=batch, fairness=dict(reserved=reserved, running_of=running_of, running=running))


def test_the_unused_reserved_slots_batch_holds_over_those_it_could():
    samples = [
        sample({"gold": 2}, {"crowd": 6}, 6, 2),  # 8 slots: crowd 6, batch in gold's 2: both lent
        sample({"gold": 2}, {"crowd": 6}, 6, 1),  # one idle: half lent
        sample({"gold": 2}, {"crowd": 6, "gold": 2}, 8, 0),  # all used by gold: not counted
        sample({"gold": 2}, {"crowd": 4}, 4, 3),  # 2 free besides: batch's 3 fill them and 1 reserved
    ]
    share, n = lent_share(samples, max_seqs=8)
    assert n == 3 and share == (2 + 1 + 1) / (2 + 2 + 2)
    assert math.isnan(lent_share([], max_seqs=8)[0])


def test_tokens_delivered_inside_a_phase_spread_over_each_chats_span():
    chats = [(0.0, 10.0, 100),  # wholly inside [0, 20]: 100
             (15.0, 25.0, 50),  # half inside: 25
             (20.0, 21.0, 9),  # after: 0
             (5.0, 5.0, 4)]  # one instant, inside: 4
    assert inside(chats, 0.0, 20.0) == 100 + 25 + 0 + 4
    assert inside([], 0.0, 1.0) == 0


def test_ttft_figures_at_the_client_and_where_the_journal_has_them_its_parts():
    # 100 chats sent at 0: first token at 0.01 … 1.00 s, headers half-way; one with no token.
    chats = [Chat(0.0, i / 100, 2.0, 16, f"c{i}", i / 200) for i in range(1, 101)] + [Chat(0.0, None, 1.0, 0)]
    got = ttft_figures(chats, {"c1": (5.0, 3.0), "c2": (7.0, None)})
    assert got == dict(n=100, failed=1, ttft_p50_ms=500.0, ttft_p99_ms=990.0, headers_p50_ms=250.0,
                       headers_p99_ms=495.0, api_p50_ms=5.0, api_p99_ms=7.0, engine_p50_ms=3.0, engine_p99_ms=3.0)
    # vLLM's own server journals nothing: its parts are absent, not zero.
    assert ttft_figures(chats, {})["api_p99_ms"] is None and ttft_figures(chats, {})["engine_p50_ms"] is None
