"""Cross-region routing weights: how much of the traffic an edge sends each cell, from its
capacity and health as the cells reconciler last read them, off the request path. Pure.

A cell out of reach, or with no live engine, gets 0: its traffic moves to the others (the
edge's own health checks take a dead cell out sooner; a weight keeps a live cell with no
engine from drawing traffic it can only refuse). The rest share by capacity, each cell's
live slots counted at half where they are busy with chat, so a loaded cell draws less
before it is full.

A tenant fenced to some regions goes to one of them alone (`fenced`): the one of its
regions weighing most now, so its traffic moves within its fence when that cell is lost,
and never outside it.

What a key makes and finds again (files, batches, fine-tuning jobs) lives in one cell's
journal, so those calls of the key go to one cell, its home (`homes`), whatever the
weights; chats, which leave nothing to find, go by weight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

MAX_WEIGHT = 256  # HAProxy's range (0–256); Envoy's and DNS weights scale alike


@dataclass(frozen=True)
class CellCapacity:
    cell: str
    healthy: bool  # read this tick
    slots: int = 0  # sequence slots of its live, non-draining engines
    busy: int = 0  # of them, held by interactive requests


def weights(cells: Sequence[CellCapacity], scale: int = MAX_WEIGHT) -> dict[str, int]:
    """Cell → weight in 0..scale; the largest gets `scale`, every healthy cell with a slot at least 1."""
    worth = {c.cell: (c.slots - 0.5 * min(max(c.busy, 0), c.slots)) if c.healthy and c.slots > 0 else 0.0
             for c in cells}
    top = max(worth.values(), default=0.0)
    return {cell: max(1, round(scale * w / top)) if w > 0 else 0 for cell, w in sorted(worth.items())}


def fenced(fences: Mapping[str, Sequence[str]], weights: Mapping[str, int]) -> dict[str, str]:
    """Key hash → the cell its requests go to: of the key's regions that are cells, the one
    of the highest weight (ties by name); where none weighs anything, still the first of
    them by name (its requests then fail there rather than run outside the fence); "" for
    a key whose regions name no cell (the edge refuses it)."""
    out = {}
    for key, regions in fences.items():
        mine = [r for r in regions if r in weights]
        out[key] = min(mine, key=lambda c: (-weights[c], c)) if mine else ""
    return out


def homes(held: Mapping[str, Collection[str]], current: Mapping[str, str]) -> dict[str, str]:
    """Key hash → its home: its `current` one while that cell still holds the key (a home
    never moves under what was made there); else, of the cells holding the key, the one
    ranking highest for it (rendezvous hashing: every reconciler, and the same one after a
    restart, picks the same). A key no cell holds has none."""
    out = {}
    for key, cells in held.items():
        if cells:
            here = current.get(key)
            out[key] = here if here is not None and here in cells else max(cells, key=lambda c: _rank(key, c))
    return out


def _rank(key: str, cell: str) -> bytes:
    return hashlib.sha256(f"{key}/{cell}".encode()).digest()
