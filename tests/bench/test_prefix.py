"""`ballast bench prefix`'s file is prefix-heavy and scattered, and its arms compare like
with like."""

from __future__ import annotations

import json
from collections import Counter

from bench import prefix


def test_the_lines_share_few_long_prefixes_scattered_through_the_file():
    reqs = prefix.workload(240, prefixes=12, prefix_chars=600)
    systems = [r["messages"][0]["content"] for r in reqs]
    counts = Counter(systems)
    assert len(counts) == 12 and min(counts.values()) >= 8  # every prefix used, by many lines
    assert all(len(s) >= 600 for s in counts)
    assert len({r["messages"][1]["content"] for r in reqs}) == 240  # each line's question its own
    # Scattered: lines sharing a prefix are seldom neighbours in the file as given.
    neighbours = sum(a == b for a, b in zip(systems, systems[1:], strict=False))
    assert neighbours < 0.2 * len(reqs)
    assert all(r["temperature"] == 0 and r["ignore_eos"] for r in reqs)


def test_the_sorted_reference_holds_the_same_lines_with_their_prefixes_together():
    reqs = prefix.workload(120, prefixes=6, prefix_chars=300)
    order = prefix.sorted_order(reqs)
    assert sorted(order) == list(range(120))
    systems = [reqs[i]["messages"][0]["content"] for i in order]
    assert sum(a != b for a, b in zip(systems, systems[1:], strict=False)) == 5  # one run per prefix
    lines = [json.loads(ln) for ln in prefix.batch_lines(reqs, "m", order).splitlines()]
    assert [ln["custom_id"] for ln in lines] == [f"r{i}" for i in order]  # ids keep the line's own index
    assert {ln["body"]["model"] for ln in lines} == {"m"}
