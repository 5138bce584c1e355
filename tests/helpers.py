"""What many tests build the same way."""

from __future__ import annotations

import uuid


def uid(prefix: str) -> str:
    """A name no other test (or earlier run on the same database) has used."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Clock:
    """A clock the test moves by hand: `clock.now = 5.0`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
