"""What a tenant may read of an activity's failure, in a batch's or a job's errors."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as ActivityTimeout

INTERNAL = "an internal error (the worker's log has the details)"


def told(err: ActivityError, limit: int = 500) -> str:
    """The message an activity chose to give (an ApplicationError it raised itself, with no
    type of its own), else only what kind of failure it was: an exception's own text can
    name hosts, SQL or paths, and the worker has logged it already."""
    cause = err.cause
    if isinstance(cause, ApplicationError) and cause.type is None:
        return cause.message[:limit]
    if isinstance(cause, ActivityTimeout):
        return "it timed out"
    return INTERNAL
