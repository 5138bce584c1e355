"""policy/grouping.py: which engine worker a batch page's prefix runs go to. Expected
values are worked by hand from the rules in the module's docstring."""

from __future__ import annotations

import random
import zlib

from hypothesis import given
from hypothesis import strategies as st

from policy.grouping import MIN_SHARED, PrefixRun, assign, order, own_queue, runs_of

SYS = {name: f"You are {name}. " + "Answer briefly and well. " * 8 for name in ("Ada", "Brin", "Cole")}


def page(*counts: tuple[str, int]) -> list[str]:
    """Prompts sorted as the journal pages them: a system prompt then a question each."""
    return sorted(f"{SYS[name]}Q{i:03d}" for name, n in counts for i in range(n))


def test_runs_split_where_neighbours_share_less_than_the_minimum():
    prompts = page(("Ada", 3), ("Brin", 2)) + ["a lonely prompt of its own"]
    runs = runs_of(sorted(prompts))
    assert [n for n, _ in runs] == [3, 2, 1]  # "a…" sorts after "You…"
    keyed = [(n, key) for n, key in runs if key is not None]
    assert [(n, SYS["Ada"].startswith(key) or SYS["Brin"].startswith(key)) for n, key in keyed] == \
        [(3, True), (2, True)]
    assert all(len(key) % MIN_SHARED == 0 and len(key) >= MIN_SHARED for _, key in keyed)
    assert [key for _, key in runs if key is None] == [None]


def test_a_runs_key_is_the_same_on_every_page_of_its_prefix():
    one, two = runs_of(page(("Ada", 4))), runs_of(page(("Ada", 9))[5:])
    assert one[0][1] == two[0][1] and one[0][0] == 4 and two[0][0] == 4


def test_prompts_sharing_less_than_the_minimum_are_each_alone():
    prompts = sorted(f"{i:04d} " + "x" * 300 for i in range(5))  # they differ in the 4th character
    assert runs_of(prompts) == [(1, None)] * 5


def test_a_run_goes_whole_to_its_first_worker_in_rendezvous_order():
    workers = {"w1": "q/w1", "w2": "q/w2", "w3": "q/w3"}
    prompts = page(("Ada", 4), ("Brin", 4), ("Cole", 4))  # each worker takes ≤ ceil(1.25·12/3) = 5
    key = runs_of(prompts)[0][1]
    assert key is not None and SYS["Ada"].startswith(key)
    first = max(workers, key=lambda w: zlib.crc32(f"{key}\0{w}".encode()))  # the highest hash wins
    assert assign(prompts, workers)[0] == PrefixRun(4, f"q/{first}")  # Ada's run, first in the page


def test_loose_items_go_to_the_shared_queue():
    assert assign(["alone one", "alone two"], {"w1": "q/w1"}) == [PrefixRun(2, "")]
    assert assign(page(("Ada", 2)), {}) == [PrefixRun(2, "")]  # no live worker: the shared queue


def test_no_worker_takes_more_than_the_bound_and_a_run_moves_whole_where_it_fits():
    workers = {"w1": "q/w1", "w2": "q/w2"}
    prompts = page(("Ada", 6), ("Brin", 6), ("Cole", 6))  # 18 items: each worker takes ≤ ceil(1.25·9) = 12
    runs = assign(prompts, workers)
    per = {q: sum(r.count for r in runs if r.queue == q) for q in workers.values()}
    # Whole runs only: two on one worker, the third on the other, wherever rendezvous put
    # the first ones.
    assert sorted(per.values()) == [6, 12]
    assert all(r.count % 6 == 0 for r in runs)


def test_a_run_bigger_than_any_room_is_split_down_its_order():
    workers = {"w1": "q/w1", "w2": "q/w2"}
    prompts = page(("Ada", 10))  # cap ceil(1.25·5) = 7: 7 on its first worker, 3 on the next
    [(_, key)] = runs_of(prompts)
    first, second = order(key, list(workers))
    assert assign(prompts, workers) == [PrefixRun(7, f"q/{first}"), PrefixRun(3, f"q/{second}")]


def test_a_leaving_worker_moves_only_its_own_keys():
    rng = random.Random(7)
    keys = [f"prefix {rng.random()}" for _ in range(500)]
    workers = [f"w{i}" for i in range(4)]
    before = {k: order(k, workers)[0] for k in keys}
    after = {k: order(k, workers[:-1])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "w3"}


def test_own_queues_sit_under_their_regions():
    assert own_queue("ballast-engine", "eu", "host-1") == "ballast-engine@eu/host-1"
    assert own_queue("ballast-engine", "", "host-1") == "ballast-engine/host-1"


@given(st.lists(st.tuples(st.sampled_from(sorted(SYS)), st.integers(1, 30)), max_size=4),
       st.lists(st.text(alphabet="xyz", min_size=1, max_size=40), max_size=10), st.integers(1, 5))
def test_every_item_is_placed_once_and_no_worker_passes_the_bound(runs, loose, n_workers):
    prompts = sorted(page(*dict(runs).items()) + loose)
    workers = {f"w{i}": f"q/w{i}" for i in range(n_workers)}
    placed = assign(prompts, workers)
    assert sum(r.count for r in placed) == len(prompts)
    sticky = sum(n for n, key in runs_of(prompts) if key is not None)
    cap = -(-5 * sticky // (4 * n_workers))  # ceil(1.25 · sticky / n)
    for q in workers.values():
        assert sum(r.count for r in placed if r.queue == q) <= cap
    assert all(a.queue != b.queue for a, b in zip(placed, placed[1:], strict=False))  # neighbours merged
