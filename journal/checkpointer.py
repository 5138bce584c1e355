"""Group commit for generation checkpoints.

Hundreds of generations on one engine worker each checkpoint every few tokens. Writing
each chunk in its own transaction would put a database round trip on every generation's
path; instead chunks queue here and one background task commits whatever has queued in a
single transaction. `submit` never waits: the engine keeps producing tokens while the
previous chunk commits. Callers await the returned future only where durability matters
(before reporting completion, before yielding to a preemption).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from journal.events import NewEvent, append

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, db: AsyncEngine):
        self.db = db
        self._queue: list[tuple[NewEvent, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Checkpointer":
        self._task = asyncio.create_task(self._run(), name="checkpointer")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.flush()
        if self._task:
            self._task.cancel()

    def submit(self, new: Sequence[NewEvent]) -> asyncio.Future:
        """Queue events for the next commit; the future resolves once they are durable."""
        loop = asyncio.get_running_loop()
        futures = []
        for e in new:
            f = loop.create_future()
            self._queue.append((e, f))
            futures.append(f)
        self._wake.set()
        return asyncio.gather(*futures) if futures else _done(loop)

    async def flush(self) -> None:
        while self._queue:
            await asyncio.sleep(0.001)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            # A zombie attempt and its retry may both checkpoint the same offset: keep one.
            unique = list({e.key: e for e, _ in batch}.values())
            try:
                async with self.db.begin() as conn:
                    await append(conn, unique)
            except Exception as err:  # each waiting generation sees it and fails its attempt
                log.warning("checkpoint commit of %d events failed: %s", len(unique), err)
                for _, f in batch:
                    if not f.done():
                        f.set_exception(err)
                continue
            for _, f in batch:
                if not f.done():
                    f.set_result(None)


def _done(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    f = loop.create_future()
    f.set_result(None)
    return f
