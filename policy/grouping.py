"""Which engine worker a batch page's items go to, so that a shared prefix is prefilled
once per worker, not once per group. Pure.

A page arrives sorted by prompt text (journal/batch_store.py), so items that share a prefix
are neighbours. Then:

1. Runs: neighbours whose prompts share at least `min_shared` leading characters form a
   run; an item that shares less with both neighbours is a run of its own and goes to
   whichever worker claims it (no affinity to keep).
2. Keys: a run's key is its common prefix cut down to a multiple of `min_shared`
   characters, so the same prefix gives the same key on every page of the batch, and in
   every batch.
3. The bound: no worker takes more than `bound` × its even share of the page's items
   (consistent hashing with bounded loads, as for chats: policy/placement.py).
4. The picker: each run, in page order, goes whole to the first worker in its key's
   rendezvous order with room for all of it; if none has, it is split down that order.
   Rendezvous order moves only the keys of a worker that leaves.

A worker's own queue is polled by it alone; a group sent there and left unclaimed (the
worker died, hangs or drains) goes back to the batch's shared queue
(workflows/batch.py).
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

MIN_SHARED = 128  # characters, ~2 of vLLM's 16-token KV blocks of English text


@dataclass(frozen=True)
class PrefixRun:
    count: int  # consecutive items of the page
    queue: str  # "": the batch's shared queue (any worker of it)


def own_queue(pool_queue: str, region: str, engine_id: str) -> str:
    """The queue one engine worker alone polls, named under its region's (`pool@region`)."""
    return f"{pool_queue}@{region}/{engine_id}" if region else f"{pool_queue}/{engine_id}"


def shared(a: str, b: str) -> int:
    """The length of the common prefix of `a` and `b`."""
    return len(os.path.commonprefix([a, b]))


def runs_of(prompts: list[str], min_shared: int = MIN_SHARED) -> list[tuple[int, str | None]]:
    """1–2. The page's runs in order: (items, key), key None for an item alone."""
    out: list[tuple[int, str | None]] = []
    start = 0
    for i in range(1, len(prompts) + 1):
        if i < len(prompts) and shared(prompts[i - 1], prompts[i]) >= min_shared:
            continue
        n = i - start
        if n == 1:
            out.append((1, None))
        else:
            common = min(shared(prompts[j - 1], prompts[j]) for j in range(start + 1, i))
            out.append((n, prompts[start][: common - common % min_shared]))
        start = i
    return out


def order(key: str, workers: list[str]) -> list[str]:
    """The rendezvous order of `workers` for `key` (crc32: stable across processes), ids last."""
    return sorted(workers, key=lambda w: (-zlib.crc32(f"{key}\0{w}".encode()), w))


def assign(prompts: list[str], workers: dict[str, str], bound: float = 1.25,
           min_shared: int = MIN_SHARED) -> list[PrefixRun]:
    """The page's items, in page order, as runs bound for a worker's own queue or the shared
    one. `workers`: worker id → its own queue (the live ones the batch may run on)."""
    runs = runs_of(prompts, min_shared)
    if not workers:
        return [PrefixRun(len(prompts), "")] if prompts else []
    cap = math.ceil(bound * sum(n for n, key in runs if key is not None) / len(workers))  # 3.
    room = dict.fromkeys(workers, cap)
    out: list[PrefixRun] = []
    for n, key in runs:
        if key is None:
            out.append(PrefixRun(n, ""))
            continue
        ranked = order(key, list(workers))  # 4.
        whole = next((w for w in ranked if room[w] >= n), None)
        for w in [whole] if whole is not None else ranked:
            take = min(n, room[w])
            if take:
                out.append(PrefixRun(take, workers[w]))
                room[w] -= take
                n -= take
            if not n:
                break
        if n:  # only with bound < 1: more than every worker's room
            out.append(PrefixRun(n, ""))
    return _merged(out)


def _merged(runs: list[PrefixRun]) -> list[PrefixRun]:
    """Neighbouring runs bound for the same queue, as one."""
    out: list[PrefixRun] = []
    for r in runs:
        if out and out[-1].queue == r.queue:
            out[-1] = PrefixRun(out[-1].count + r.count, r.queue)
        else:
            out.append(r)
    return out
