import random

from sim.cache import LruBlocks


class Reference:
    """A plain LRU: a list, most recent last, evicting from the front."""

    def __init__(self, capacity):
        self.capacity, self.items = capacity, []

    def match(self, blocks):
        n = 0
        for b in blocks:
            if b not in self.items:
                break
            n += 1
        return n

    def store(self, blocks):
        for b in reversed(blocks):
            if b in self.items:
                self.items.remove(b)
            self.items.append(b)
        self.items = self.items[max(0, len(self.items) - self.capacity):]


def test_matches_a_plain_lru():
    rng = random.Random(3)
    cache, ref = LruBlocks(8), Reference(8)
    for _ in range(2000):
        blocks = [rng.randrange(20) for _ in range(rng.randrange(1, 6))]
        assert cache.match(blocks) == ref.match(blocks)
        cache.store(blocks)
        ref.store(blocks)
        assert len(cache) == len(ref.items) <= 8
        assert all(b in cache for b in ref.items)


def test_a_hit_stops_at_the_first_miss_and_the_head_outlives_the_tail():
    cache = LruBlocks(3)
    cache.store([1, 2, 3])
    assert cache.match([1, 2, 9, 3]) == 2
    cache.store([4])  # evicts the least recent: the tail, 3
    assert 3 not in cache and cache.match([1, 2, 3]) == 2
