"""The batch lifecycle (OpenAI Batch API statuses) as a table of allowed moves.

Writers race (the API marks `cancelling` while the workflow marks `in_progress`), so each
status change is checked against the current one and a stale move is simply dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
    """Whether a cancel request moves the batch to `cancelling` (`cancelling` itself is
    already on its way: asking again is not an error, but not a move either)."""
    return can_move(current, "cancelling")


def finalize_plan(current: str, outcome: str) -> tuple[str, str] | None:
    """How finalize ends a batch that is `current` once the workflow's run ended with
    `outcome` (completed | cancelled | expired): the status the batch holds while its
    files are written, then its final one. None: it is final already (a retry).

    A cancel the API recorded wins over whatever the run reached, even if every item got
    done: the client was told `cancelling`. Otherwise the batch is `finalizing` while its
    files are written, so a cancel arriving then is refused instead of stranding it.
    """
    if current in TERMINAL:
        return None
    if current == "cancelling" or outcome == "cancelled":
        return "cancelling", "cancelled"
    return "finalizing", outcome


def estimated_completion(status: str, in_progress_at: float | None, done: int, total: int,
                         now: float) -> int | None:
    """When an in-progress batch should have every item ended (Unix seconds), at the pace
    its items have ended so far, preemptions and all. None unless it runs, and before its
    first item ends (there is no pace to go by yet)."""
    if status != "in_progress" or in_progress_at is None or done <= 0 or total <= 0:
        return None
    if done >= total:
        return int(now)
    elapsed = max(now - in_progress_at, 0.0)
    return int(max(now, in_progress_at + elapsed * total / done) + 0.5)


def pace_end(row: Mapping[str, Any], now: float) -> float:
    """Until when a batch's pace is measured: its items stopped running when it left
    `in_progress` (the first of those timestamps that is set), else now."""
    ends = [row.get(k) for k in ("finalizing_at", "cancelling_at", "expired_at", "failed_at", "completed_at")]
    return float(min((e for e in ends if e), default=now))
