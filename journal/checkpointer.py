"""Group commit for generation checkpoints, on a cadence of time and size.

Hundreds of generations run on one engine worker. Writing each one's tokens in its own
transaction would put a database round trip on every generation's path and hand the
engine's CPU to Postgres and psycopg; instead one background task commits, every
`interval_s`, whatever is due in a single multi-row append: every tracked generation's
tokens since its last checkpoint (`track`), and the events callers queued (`submit`).
A generation with `checkpoint_tokens` unsaved, or a caller that must not wait (a
preemption's flush), asks for the next commit now (`soon`). Nothing on the token path
waits: callers await the returned future only where durability matters (before
reporting completion, before yielding to a preemption).

The bound on recomputation after a crash: a generation loses at most the tokens it
produced since the start of the last commit that included it, that is at most
`interval_s` plus one commit's duration of generation, and (because `checkpoint_tokens`
unsaved asks for a commit at once) never more than `checkpoint_tokens` plus what it
produces while one commit runs. tests/journal/test_checkpointer.py measures it. While the
database is unreachable a commit is retried (with backoff) until it lands: the bound then
grows by the outage, and nothing journaled is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from journal.db import unreachable
from journal.events import IdempotencyConflict, NewEvent, StaleAttempt, append
from protocol.events import EventType
from telemetry import families

log = logging.getLogger(__name__)

RETRY_FIRST_S, RETRY_MAX_S = 0.1, 5.0  # a commit the database could not take goes again after these


class Tracked(Protocol):
    """A live generation: what it has not yet checkpointed, taken at each commit."""

    def due(self) -> list[NewEvent]:
        """The events to write now (its tokens since the last call); [] when none."""
        ...

    def committed(self, event: asyncio.Future) -> None:
        """Called with the future of each event `due` returned: done once it commits."""
        ...


class Checkpointer:
    def __init__(self, db: AsyncEngine, interval_s: float = 0.5, *, trace: Callable[..., None] | None = None):
        self.db = db
        self.trace = trace  # engine/trace.py: each commit, for the timeline bench
        self.interval_s = interval_s
        self._queue: list[tuple[NewEvent, asyncio.Future]] = []
        self._tracked: dict[int, Tracked] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._committing = False
        self._took = time.monotonic()  # the last take: tokens produced since wait for the next commit

    async def __aenter__(self) -> Checkpointer:
        self._task = asyncio.create_task(self._run(), name="checkpointer")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.flush()
        if self._task:
            self._task.cancel()

    @contextlib.contextmanager
    def track(self, gen: Tracked) -> Iterator[None]:
        """Checkpoint `gen` every commit while the block runs; the block's end does not
        flush it (its owner submits its last events itself)."""
        self._tracked[id(gen)] = gen
        try:
            yield
        finally:
            self._tracked.pop(id(gen), None)

    def submit(self, new: Sequence[NewEvent], *, urgent: bool = False) -> asyncio.Future:
        """Queue events for the next commit; the future resolves once they are durable.
        `urgent`: commit now rather than at the next tick."""
        loop = asyncio.get_running_loop()
        futures = []
        for e in new:
            f = loop.create_future()
            self._queue.append((e, f))
            futures.append(f)
        if urgent:
            self.soon()
        return asyncio.gather(*futures) if futures else _done(loop)

    def soon(self) -> None:
        """Commit now (or right after the commit running now), not at the next tick."""
        self._wake.set()

    async def flush(self) -> None:
        """Wait until everything submitted so far has committed (or failed)."""
        while self._queue or self._committing:
            self.soon()
            await asyncio.sleep(0.001)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            before, self._took = self._took, time.monotonic()
            batch = self._take()
            if batch:
                self._committing = True
                started = time.time()
                try:
                    await self._commit(batch)
                finally:
                    self._committing = False
                if self._tracked or any(e.type == EventType.ITEM_CHUNK for e, _ in batch):
                    families.CHECKPOINT_LAG.observe(time.monotonic() - before)
                if self.trace:
                    self.trace("commit", at=round(started, 4), events=len(batch),
                               ms=round(1000 * (time.time() - started), 2))

    def _take(self) -> list[tuple[NewEvent, asyncio.Future]]:
        """What this commit writes: the tracked generations' due tokens, then the queue."""
        loop = asyncio.get_running_loop()
        for gen in list(self._tracked.values()):
            for e in gen.due():
                f = loop.create_future()
                self._queue.append((e, f))
                gen.committed(f)
        batch, self._queue = self._queue, []
        return batch

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
        delay = RETRY_FIRST_S
        while todo:
            try:
                async with self.db.begin() as conn:
                    await append(conn, todo)
                break
            except Exception as err:
                if unreachable(err):
                    # Postgres restarting, the network: every event is idempotent, so the
                    # same commit goes again until it lands. Nobody's tokens are dropped
                    # (a gap in an item's chunks), and whoever awaits durability waits.
                    log.warning("checkpoint commit of %d events failed (%s); again in %.1f s", len(todo),
                                type(err).__name__, delay)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX_S, 2 * delay)
                    continue
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
