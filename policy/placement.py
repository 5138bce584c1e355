"""Which engine worker serves an interactive request. Pure.

Filters (live, serves the model) → scorers normalised to [0, 1] → a ranking, best first
(the API falls back down it), with the engine id as the deterministic tiebreak. One scorer
today, load; prompt-cache affinity joins it as a second weighted scorer.
"""

from __future__ import annotations

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


def load_score(e: EngineView) -> float:
    """1 for an idle engine, 0 for one whose slots are all taken by interactive work."""
    return max(0.0, 1.0 - e.interactive / max(1, e.max_seqs))


def rank(engines: list[EngineView], model: str) -> list[EngineView]:
    """Engines that serve `model`, best first (the next ones are fallbacks)."""
    return sorted((e for e in engines if e.model == model), key=lambda e: (-load_score(e), e.batch, e.id))
