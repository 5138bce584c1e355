"""Prompt-cache affinity's inputs: a prompt's leading blocks as chained hashes, and the
router's own index of which engine was last sent each block. Pure (no I/O, no clock).

vLLM keys its prefix cache by full blocks of `block_size` tokens, each block's key chained
to the key of the block before it, so a block is a hit only if every block before it is
too. `block_hashes` cuts the prompt the same way (the same token ids, from the engine's own
tokenizer, and the engine's block size), so a match here predicts a hit there. The hash is
Python's over tuples of ints: deterministic across processes (only str and bytes hashes are
salted), and fast.

`PrefixIndex` is the approximate prefix cache of llm-d's router: no engine is asked what it
holds; the router remembers where it sent each block, least recently used first out, sized
to the fleet's KV cache. An engine that left is forgotten: only its keys move.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

ROOT = 0x0BA11A57  # the chain's seed: the hash "before" the first block
MAX_BLOCKS = 512  # a prompt's leading blocks that count (8k tokens at 16 a block)


def root(adapter: str | None = None) -> int:
    """The chain's seed for a request to the base model, or to a LoRA adapter (a fine-tuned
    model): vLLM keys an adapter's blocks by the adapter too, so the same prompt shares no
    cache across adapters or with the base model, and must not match here either."""
    if adapter is None:
        return ROOT
    return int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "big")  # str hashes are salted per process


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int = MAX_BLOCKS,
                 seed: int = ROOT) -> tuple[int, ...]:
    """The chained hashes of the prompt's full leading blocks (a partial last block is
    never cached by vLLM, so it does not count), from `seed` (`root`)."""
    out: list[int] = []
    h = seed
    for start in range(0, min(len(token_ids), limit * block_size) - block_size + 1, block_size):
        h = hash((h, *token_ids[start:start + block_size]))
        out.append(h)
    return tuple(out)


class PrefixIndex:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._where: OrderedDict[int, set[str]] = OrderedDict()  # block hash → engines sent it, LRU first

    def __len__(self) -> int:
        return len(self._where)

    def matched(self, blocks: Sequence[int]) -> dict[str, int]:
        """For each engine holding the first block: how many leading blocks it holds."""
        if not blocks or (first := self._where.get(blocks[0])) is None:
            return {}
        held = dict.fromkeys(first, 1)
        alive = set(first)
        for n, b in enumerate(blocks[1:], start=2):
            alive &= self._where.get(b, set())
            if not alive:
                break
            for e in alive:
                held[e] = n
        return held

    def record(self, engine: str, blocks: Iterable[int]) -> None:
        """`engine` was sent these blocks: it holds them now (most recently used)."""
        for b in blocks:
            where = self._where.pop(b, None) or set()
            where.add(engine)
            self._where[b] = where
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, engine: str) -> int:
        """An engine left the pool; how many blocks it held (now held nowhere else lose it)."""
        gone = 0
        for b in list(self._where):
            where = self._where[b]
            if engine in where:
                gone += 1
                where.discard(engine)
                if not where:
                    del self._where[b]
        return gone


def follows(blocks: Sequence[int], prefilling: Container[int], min_share: float = 0.5,
            min_blocks: int = 0) -> int | None:
    """The block a batch prompt should wait on before it goes to the engine: the deepest of
    its leading blocks that a prompt being prefilled now will leave in vLLM's cache, where
    that covers at least `min_share` of its full blocks and more than `min_blocks`; None:
    go now.

    vLLM shares a block between requests only once one of them has computed it: prompts
    that share a prefix and run together each compute it (SGLang's scheduler holds such
    followers back for the same reason). Waiting for the leader's prefill costs a follower
    that long and the engine nothing while other work fills its steps. It pays only where
    the shared part takes the leader more than a step (`min_blocks`: a step's prefill, in
    blocks; within one step the duplicate is cheaper than the wait, measured in
    bench/RESULTS.md), and where it is most of the prompt (a chat template's opening is
    not worth a wait)."""
    for depth in range(len(blocks), 0, -1):
        if blocks[depth - 1] in prefilling:
            return blocks[depth - 1] if depth >= min_share * len(blocks) and depth > min_blocks else None
    return None
