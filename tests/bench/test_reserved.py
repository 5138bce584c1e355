"""`bench reserved`'s lent share and delivered tokens, on samples worked out by hand."""

from __future__ import annotations

import math

from bench.reserved import inside, lent_share


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
