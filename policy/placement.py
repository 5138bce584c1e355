"""Which engine worker serves a request: filters → scorers → picker (llm-d's shape). Pure.

1. Filters drop the engines that cannot take it: not serving its model, outside its
   geography, draining.
2. Scorers rate each one left in [0, 1], each alone:
   - reserved: 1 where the request's tenant has a reserved slot unused
     (policy/reservations.py): capacity it bought, kept free for it there, outranks a
     cache hit;
   - affinity: the share of the request's leading prompt blocks the engine holds, as the
     router's prefix index predicts (policy/prefix.py): a hit in vLLM's prefix cache;
   - load: the share of its slots not taken by interactive work (batch yields to it).
3. A bound keeps affinity from piling onto one engine: an engine whose interactive load
   has reached `load_bound` × the mean, rounded down (`load_cap`; consistent hashing with
   bounded loads, Mirrokni, Thorup and Zadimoghaddam) scores no affinity, so the prefix spills to the next best
   and, being sent there, is cached there too.
4. The picker ranks by the weighted sum, best first (the caller falls back down the list);
   ties go to the engine with less batch work (fewer to preempt), then to the highest
   rendezvous hash of the request's first block and the engine's id, so new prefixes
   spread evenly and stably, then to the id.
5. Regions: a request stays in its home region (the placing API's) while an engine there
   has a free slot; a saturated or empty home region spills across the rest of the
   request's geography, ranked by steps 2–4 over all of it, so the emptiest region there
   takes the overflow. A region whose engines stop reporting has left the directory.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineView:
    id: str
    url: str
    model: str
    interactive: int  # requests in flight
    batch: int  # batch sequences holding slots (they yield to interactive work)
    max_seqs: int
    flex: int = 0  # flex requests running or waiting there
    flex_floor: int = 0  # the slots flex gets back there when starved (its minimum share)
    region: str = ""
    draining: bool = False
    block_size: int = 16  # vLLM's KV block: prefix-cache keys are whole blocks of it
    others: int | None = None  # interactive in flight there from other API processes, as last reported
    max_model_len: int = 0  # its model's context length (0: an engine too old to say)
    source: str = ""  # where its model's files are (a hub id or a path on its host): the tokenizer's
    task: str = "generate"  # what its model serves: "generate" or "embed" (protocol/embeddings.py)
    reserved_free: frozenset[str] = frozenset()  # tenants with a reserved slot unused there


@dataclass(frozen=True)
class Request:
    model: str
    blocks: tuple[int, ...] = ()  # policy.prefix.block_hashes of its prompt
    regions: frozenset[str] | None = None  # where it may run; None: anywhere
    home: str = ""  # the region it is placed from, preferred while it has room; "": none
    tenant: str = ""


@dataclass(frozen=True)
class Weights:
    affinity: float = 2.0  # above load's: a full prefix hit outweighs an idle engine, up to the bound
    load: float = 1.0
    load_bound: float = 1.25  # no affinity for an engine at this × the mean interactive load (+1)
    reserved: float = 4.0  # above affinity's and load's together: a reservation is a promise


# -- 1. filters ---------------------------------------------------------------------------


def eligible(engines: list[EngineView], req: Request) -> list[EngineView]:
    return [e for e in engines
            if e.model == req.model and not e.draining and (req.regions is None or e.region in req.regions)]


# -- 2. scorers ---------------------------------------------------------------------------


def affinity_score(e: EngineView, req: Request, matched: Mapping[str, int]) -> float:
    """The share of the request's leading blocks this engine holds."""
    return matched.get(e.id, 0) / len(req.blocks) if req.blocks else 0.0


def reserved_score(e: EngineView, req: Request) -> float:
    return 1.0 if req.tenant and req.tenant in e.reserved_free else 0.0


def load_score(e: EngineView) -> float:
    """1 for an idle engine, 0 for one whose slots are all taken by interactive work."""
    return max(0.0, 1.0 - e.interactive / max(1, e.max_seqs))


# -- 3. the bound -------------------------------------------------------------------------


def load_cap(engines: list[EngineView], bound: float) -> int:
    """The interactive load at which an engine stops attracting its prefixes: `bound` ×
    the mean once this request is counted, rounded down, so that no engine passes the
    bound by placement; but above the mean, rounded down, so that an engine at the mean can
    always take one more (at a mean of a few requests the bound then allows more than
    `bound` × the mean: a request is whole)."""
    mean = (sum(e.interactive for e in engines) + 1) / max(1, len(engines))
    return max(math.floor(bound * mean), math.floor(mean) + 1)


# -- 4. the picker ------------------------------------------------------------------------


def rendezvous(anchor: int, engine_id: str) -> int:
    """Stable across processes (unlike hash() of a str): every API replica agrees."""
    return zlib.crc32(f"{anchor}:{engine_id}".encode())


def rank(engines: list[EngineView], req: Request, matched: Mapping[str, int] | None = None,
         w: Weights = Weights()) -> list[EngineView]:
    """The engines that can take `req`, best first. `matched`: engine id → leading blocks
    it holds (PrefixIndex.matched)."""
    candidates = eligible(engines, req)
    home = [e for e in candidates if e.region == req.home]
    if any(e.interactive < e.max_seqs for e in home):  # 5. room at home: the rest only as fallbacks
        away = [e for e in candidates if e.region != req.home]
        return _ranked(home, req, matched or {}, w) + _ranked(away, req, matched or {}, w)
    return _ranked(candidates, req, matched or {}, w)


def _ranked(candidates: list[EngineView], req: Request, matched: Mapping[str, int], w: Weights) -> list[EngineView]:
    cap = load_cap(candidates, w.load_bound)
    anchor = req.blocks[0] if req.blocks else 0

    def key(e: EngineView) -> tuple[float, int, int, str]:
        affinity = affinity_score(e, req, matched) if e.interactive < cap else 0.0
        score = w.reserved * reserved_score(e, req) + w.affinity * affinity + w.load * load_score(e)
        return -round(score, 9), e.batch, -rendezvous(anchor, e.id), e.id

    return sorted(candidates, key=key)


# -- batch work, by queue -------------------------------------------------------------------


def region_queue(base: str, region: str) -> str:
    """The task queue of one region's engine workers (each polls it and the pool's own)."""
    return f"{base}@{region}"


def batch_regions(regions: frozenset[str], engines: list[EngineView], model: str) -> list[str]:
    """Where a fenced tenant's batch runs, in the order it tries them: the allowed regions
    by free slots among their serving engines now, most first (then by name); a region
    where none serves last. The batch starts on the first and moves down the list (then
    round again) when a group waits unclaimed (workflows/batch.py)."""
    free: dict[str, int] = dict.fromkeys(sorted(regions), 0)
    for e in eligible(engines, Request(model, regions=regions)):
        free[e.region] += max(0, e.max_seqs - e.interactive - e.batch) + 1  # +1: serving at all counts
    return sorted(free, key=lambda r: (-free[r], r))
