"""Placement, each part alone, then together; and the geo-fence as a property over random
pools, regions and requests."""

import random
from dataclasses import replace

import pytest

from policy.placement import EngineView, Request, Weights, affinity_score, eligible, load_cap, load_score, rank
from policy.prefix import ROOT, PrefixIndex, block_hashes, root


def ev(id, interactive=0, batch=0, model="m", max_seqs=8, region="eu", draining=False):
    return EngineView(id, f"http://{id}", model, interactive, batch, max_seqs, region=region, draining=draining)


def ids(engines):
    return [e.id for e in engines]


# -- filters ------------------------------------------------------------------------------


def test_filters_drop_other_models_draining_engines_and_regions_outside_the_fence():
    engines = [ev("a"), ev("b", model="other"), ev("c", draining=True), ev("d", region="us"), ev("e", region="ap")]
    assert ids(eligible(engines, Request("m"))) == ["a", "d", "e"]
    assert ids(eligible(engines, Request("m", regions=frozenset({"us", "ap"})))) == ["d", "e"]
    assert eligible(engines, Request("m", regions=frozenset({"sa"}))) == []
    assert eligible(engines, Request("nope")) == []


# -- scorers ------------------------------------------------------------------------------


def test_load_score_is_the_share_of_slots_free_of_interactive_work():
    assert load_score(ev("a")) == 1.0
    assert load_score(ev("a", interactive=2)) == 0.75
    assert load_score(ev("a", interactive=8)) == 0.0
    assert load_score(ev("a", interactive=20)) == 0.0
    assert load_score(ev("a", batch=8)) == 1.0  # batch yields: not load for interactive work


def test_affinity_score_is_the_share_of_leading_blocks_held():
    req = Request("m", blocks=(1, 2, 3, 4))
    assert affinity_score(ev("a"), req, {"a": 4}) == 1.0
    assert affinity_score(ev("a"), req, {"a": 1}) == 0.25
    assert affinity_score(ev("b"), req, {"a": 4}) == 0.0
    assert affinity_score(ev("a"), Request("m"), {"a": 4}) == 0.0  # a prompt shorter than a block


# -- the bound ----------------------------------------------------------------------------


def test_the_load_cap_is_the_bound_times_the_mean_counting_this_request():
    assert load_cap([ev("a"), ev("b")], 1.25) == 1  # mean 0.5: floor(0.625) = 0, but above the mean: 1
    assert load_cap([ev("a", interactive=4), ev("b", interactive=0)], 1.25) == 3  # floor(1.25 * 5 / 2)
    assert load_cap([ev("a", interactive=6), ev("b", interactive=6), ev("c", interactive=6)], 1.25) == 7
    # 16 engines at 13 each: floor(1.25 × 209 / 16) = 16, so none passes 1.25 × the mean by placement.
    assert load_cap([ev(str(i), interactive=13) for i in range(16)], 1.25) == 16
    # At 2 each floor(1.25 × 33 / 16) = 2 is the mean, rounded down: one more, 3.
    assert load_cap([ev(str(i), interactive=2) for i in range(16)], 1.25) == 3


# -- the picker ---------------------------------------------------------------------------


def test_without_a_prefix_the_least_loaded_wins_then_less_batch():
    assert ids(rank([ev("a", interactive=3), ev("b", interactive=1)], Request("m"))) == ["b", "a"]
    assert ids(rank([ev("a", batch=2), ev("b", batch=1)], Request("m"))) == ["b", "a"]


def test_a_held_prefix_wins_over_an_idler_engine_until_the_bound_then_spills():
    req = Request("m", blocks=(7, 8, 9, 10))
    # a holds the whole prefix and is busier than b: affinity wins...
    assert ids(rank([ev("a", interactive=3), ev("b", interactive=2)], req, {"a": 4}))[0] == "a"
    # ...until a reaches the bound (1.25 × the mean, this request counted, rounded down: 4): then b.
    assert ids(rank([ev("a", interactive=4), ev("b", interactive=2)], req, {"a": 4}))[0] == "b"
    # A partial match weighs its share.
    assert ids(rank([ev("a", interactive=4), ev("b", interactive=0)], req, {"a": 1}))[0] == "b"


def test_an_engine_keeping_the_tenants_reserved_slot_free_outranks_a_cache_hit_and_an_idle_engine():
    req = Request("m", blocks=(7, 8, 9, 10), tenant="gold")
    keeps = replace(ev("c", interactive=6), reserved_free=frozenset({"gold"}))
    assert ids(rank([ev("a", interactive=1), ev("b"), keeps], req, {"a": 4}))[0] == "c"
    # Another tenant's free reservation is not this one's; nor is one with no tenant named.
    assert ids(rank([ev("a", interactive=1), ev("b"), replace(keeps, reserved_free=frozenset({"x"}))], req,
                    {"a": 4}))[0] == "a"
    assert ids(rank([ev("b"), keeps], Request("m")))[0] == "b"


def test_new_prefixes_spread_over_equal_engines_and_each_sticks():
    engines = [ev(x) for x in "abcd"]
    firsts = [rank(engines, Request("m", blocks=(n,)))[0].id for n in range(400)]
    counts = {e: firsts.count(e) for e in "abcd"}
    assert min(counts.values()) > 60, counts  # rendezvous: about 100 each
    assert firsts == [rank(list(reversed(engines)), Request("m", blocks=(n,)))[0].id for n in range(400)]


def test_weights_are_settings():
    req = Request("m", blocks=(1,))
    engines = [ev("a", interactive=1), ev("b")]
    assert rank(engines, req, {"a": 1})[0].id == "a"
    assert rank(engines, req, {"a": 1}, Weights(affinity=0.1))[0].id == "b"


def place(index: PrefixIndex, load: dict[str, int], blocks: tuple[int, ...]) -> tuple[str, bool]:
    """Rank, send to the best (recorded in the index, its load up one); (engine, was it a hit)."""
    engines = [ev(e, interactive=i, max_seqs=64) for e, i in load.items()]
    best = rank(engines, Request("m", blocks=blocks), index.matched(blocks))[0]
    hit = index.matched(blocks).get(best.id, 0) == len(blocks)
    index.record(best.id, blocks)
    load[best.id] += 1
    return best.id, hit


def test_one_prefix_sticks_to_one_engine_while_its_requests_finish_in_turn():
    index, load = PrefixIndex(), {"a": 0, "b": 0, "c": 0}
    placed = []
    for n in range(10):
        engine, _ = place(index, load, block_hashes(list(range(1000, 1064)) + [n] * 16, 16))
        load[engine] -= 1  # done before the next one comes
        placed.append(engine)
    assert len(set(placed)) == 1


def test_concurrent_requests_of_one_prefix_fill_engines_to_the_bound_and_miss_once_per_engine():
    index, load = PrefixIndex(), {"a": 0, "b": 0, "c": 0}
    hits = [place(index, load, block_hashes(list(range(1000, 1064)), 16))[1] for _ in range(12)]
    assert sorted(load.values()) == [4, 4, 4]  # never above 1.25 × the mean
    assert hits.count(False) == 3  # the prefix is prefilled once on each engine, and hits after


# -- the fence, as a property ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_no_request_is_ever_placed_outside_its_geography(seed):
    rng = random.Random(seed)
    regions = ["eu-west", "eu-north", "us-east", "us-west", "ap-south"]
    index = PrefixIndex()
    for _ in range(300):
        pool = [ev(f"e{i}", interactive=rng.randrange(10), batch=rng.randrange(5), region=rng.choice(regions),
                   draining=rng.random() < 0.1, model=rng.choice(["m", "m", "n"])) for i in range(rng.randrange(1, 8))]
        fence = frozenset(rng.sample(regions, rng.randrange(1, 3))) if rng.random() < 0.8 else None
        blocks = tuple(rng.randrange(50) for _ in range(rng.randrange(4)))
        for e in rng.sample(pool, min(2, len(pool))):
            index.record(e.id, blocks)  # affinity pulling anywhere, inside or outside the fence
        home = rng.choice(regions + [""])
        out = rank(pool, Request("m", blocks=blocks, regions=fence, home=home), index.matched(blocks))
        assert all(e.model == "m" and not e.draining and (fence is None or e.region in fence) for e in out)
        assert ids(out) == ids(sorted(out, key=lambda e: ids(out).index(e.id)))
        assert set(ids(out)) == {e.id for e in pool if e.model == "m" and not e.draining
                                 and (fence is None or e.region in fence)}


def test_a_request_stays_home_while_an_engine_there_has_room_then_spills_to_the_emptiest():
    pool = [ev("eu1", interactive=6, region="eu"), ev("eu2", interactive=7, region="eu"),
            ev("us1", interactive=3, region="us"), ev("ap1", interactive=1, region="ap")]
    req = Request("m", blocks=(1, 2), home="eu")
    index = PrefixIndex()
    index.record("ap1", (1, 2))  # a held prefix elsewhere does not pull it away from home
    assert ids(rank(pool, req, index.matched((1, 2)))) == ["eu1", "eu2", "ap1", "us1"]
    full = [ev("eu1", interactive=8, region="eu"), ev("eu2", interactive=9, region="eu")] + pool[2:]
    assert ids(rank(full, req)) == ["ap1", "us1", "eu1", "eu2"]  # home saturated: the geography, emptiest first
    assert ids(rank(full, Request("m", regions=frozenset({"eu", "us"}), home="eu"))) == ["us1", "eu1", "eu2"]
    nowhere = Request("m", regions=frozenset({"us"}), home="eu")  # home outside the fence: never used
    assert ids(rank(pool, nowhere)) == ["us1"]
    assert ids(rank(pool, Request("m", home="sa"))) == ids(rank(pool, Request("m")))  # no engine at home


# -- the prefix index -----------------------------------------------------------------------


def test_block_hashes_chain_whole_blocks_only():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # 40 tokens: two whole blocks, the partial third is not cached
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # the second block matches only with the first
    assert block_hashes(list(range(40)), 16) == a  # deterministic
    assert block_hashes(list(range(10)), 16) == ()


def test_an_adapters_blocks_chain_from_its_own_root():
    """vLLM's prefix cache keys a LoRA request's blocks by its adapter: one prompt shares no
    block between the base model and an adapter, or between two adapters; an adapter's
    requests share among themselves."""
    ids = list(range(64))
    base, tuned, other = (block_hashes(ids, 16, seed=root(a)) for a in (None, "ft:m::a", "ft:m::b"))
    assert base == block_hashes(ids, 16) and root() == ROOT
    assert not set(base) & set(tuned) and not set(tuned) & set(other)
    assert block_hashes(ids, 16, seed=root("ft:m::a")) == tuned and len(tuned) == 4


def test_the_index_matches_leading_blocks_forgets_least_recent_and_a_lost_engine():
    index = PrefixIndex(capacity=5)
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2])
    assert index.matched([1, 2, 3, 9]) == {"a": 3, "b": 2}
    assert index.matched([2, 3]) == {"a": 2, "b": 1}  # from wherever its first block is
    assert index.matched([9, 1]) == {}
    index.record("c", [7, 8, 9])  # 6 blocks > 5: the least recently sent (3: b was sent 1, 2 after it) goes
    assert index.matched([1, 2, 3]) == {"a": 2, "b": 2} and index.matched([7, 8]) == {"c": 2}
    assert index.forget("a") == 2 and index.matched([2, 3]) == {"b": 1}


def test_an_engine_lost_moves_only_its_own_prefixes():
    """Many prefixes spread over four engines; one leaves. Every prefix that lived elsewhere
    stays where it was; only the lost engine's move: the share remapped is its share."""
    index = PrefixIndex()
    engines = [ev(x, max_seqs=64) for x in "abcd"]
    prefixes = [block_hashes(list(range(n * 1000, n * 1000 + 64)), 16) for n in range(400)]
    home = {}
    for blocks in prefixes:
        best = rank(engines, Request("m", blocks=blocks), index.matched(blocks))[0].id
        index.record(best, blocks)
        home[blocks] = best
    index.forget("c")
    left = [e for e in engines if e.id != "c"]
    after = {b: rank(left, Request("m", blocks=b), index.matched(b))[0].id for b in prefixes}
    moved = [b for b in prefixes if after[b] != home[b]]
    assert set(moved) == {b for b in prefixes if home[b] == "c"}
    assert 0.15 < len(moved) / len(prefixes) < 0.35  # about a quarter: c's share, no more


def test_a_fenced_batch_goes_to_the_allowed_region_with_the_most_free_slots():
    from policy.placement import batch_regions, region_queue

    pool = [ev("a", interactive=6, region="eu"), ev("b", interactive=1, region="us"), ev("c", region="ap"),
            ev("d", region="us", model="other")]
    assert batch_regions(frozenset({"eu", "us"}), pool, "m") == ["us", "eu"]
    assert batch_regions(frozenset({"eu"}), pool, "m") == ["eu"]
    assert batch_regions(frozenset({"sa", "za", "eu"}), pool, "m") == ["eu", "sa", "za"]  # serving first, then by name
    assert region_queue("ballast-engine", "us") == "ballast-engine@us"
