"""The batch lifecycle (OpenAI Batch API statuses) as a table of allowed moves.

Writers race (the API marks `cancelling` while the workflow marks `in_progress`), so each
status change is checked against the current one and a stale move is simply dropped.
"""

from __future__ import annotations

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})

_MOVES: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired", "failed"}),
    "finalizing": frozenset({"completed", "failed", "expired"}),
    "cancelling": frozenset({"cancelled", "failed"}),  # failed: the file was invalid after all
}


def can_move(current: str, new: str) -> bool:
    return new in _MOVES.get(current, frozenset())


def cancellable(current: str) -> bool:
    return can_move(current, "cancelling")
