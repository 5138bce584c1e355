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

from journal.events import IdempotencyConflict, NewEvent, StaleAttempt, append

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, db: AsyncEngine):
        self.db = db
        self._queue: list[tuple[NewEvent, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._committing = False

    async def __aenter__(self) -> Checkpointer:
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
        """Wait until everything submitted so far has committed (or failed)."""
        while self._queue or self._committing:
            await asyncio.sleep(0.001)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if batch:
                self._committing = True
                try:
                    await self._commit(batch)
                finally:
                    self._committing = False

    async def _commit(self, batch: list[tuple[NewEvent, asyncio.Future]]) -> None:
        # A zombie attempt and its retry may both checkpoint the same offset: the first
        # queued is written; a twin with the same content shares its outcome, one with
        # other content is a conflict, as it would be in a later commit.
        waiting: dict[str, tuple[NewEvent, list[asyncio.Future]]] = {}
        for e, f in batch:
            first, futures = waiting.setdefault(e.key, (e, []))
            if _content(first) == _content(e):
                futures.append(f)
            else:
                _fail([f], IdempotencyConflict([e.key]))
        todo = [e for e, _ in waiting.values()]
        while todo:
            try:
                async with self.db.begin() as conn:
                    await append(conn, todo)
                break
            except Exception as err:
                # One attempt's stale or conflicting events must not fail every other
                # generation's checkpoint: fail just theirs and commit the rest again. Any
                # other error: each waiting generation sees it and fails its attempt.
                bad = {e.key for e in todo if _caused(err, e)} or {e.key for e in todo}
                log.warning("checkpoint commit of %d events failed for %d: %s", len(todo), len(bad), err)
                for key in bad:
                    _fail(waiting[key][1], err)
                todo = [e for e in todo if e.key not in bad]
        for e in todo:
            for f in waiting[e.key][1]:
                if not f.done():
                    f.set_result(None)


def _content(e: NewEvent) -> tuple:
    return e.stream, e.type, e.payload, e.tenant


def _caused(err: Exception, e: NewEvent) -> bool:
    if isinstance(err, IdempotencyConflict):
        return e.key in err.keys
    return isinstance(err, StaleAttempt) and e.fence is not None and (e.stream, e.fence) == (err.stream, err.fence)


def _fail(futures: list[asyncio.Future], err: Exception) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(err)


def _done(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    f = loop.create_future()
    f.set_result(None)
    return f
