"""The heartbeat a long activity sends while it waits or works between its own beats."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from temporalio import activity


async def beating(details: Callable[[], Any]) -> None:
    """Heartbeat `details()` until cancelled. It beats while the activity waits for a slot
    or in the engine's queue too: silent past the heartbeat timeout, the attempt would be
    retried at the back of the queue. Three beats per timeout is enough and keeps hundreds
    of activities cheap."""
    timeout = activity.info().heartbeat_timeout
    every = timeout.total_seconds() / 3 if timeout else 5.0
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            activity.heartbeat(details())
            await asyncio.sleep(every)
