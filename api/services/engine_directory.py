"""The API's view of the engine fleet: local, refreshed every `refresh_s` in the background,
so the request path reads memory, not Postgres."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from journal import engine_registry
from policy.placement import EngineView
from policy.reservations import unused
from protocol.engine_wire import EngineStats

log = logging.getLogger(__name__)


class EngineDirectory:
    def __init__(self, db: AsyncEngine, refresh_s: float = 0.5):
        self.db = db
        self.refresh_s = refresh_s
        self._views: list[EngineView] = []
        self._at = float("-inf")
        # For /v1/models' `created`: stable while this process lives.
        self.started = int(time.time())
        self.on_refresh: Callable[[list[EngineView]], None] | None = None  # told each fresh view
        self.me = ""  # this API process, as engines count its requests (`api` in each job)

    async def live(self) -> list[EngineView]:
        # Read through only when the background refresh is not keeping up (or not running).
        if time.monotonic() - self._at > 4 * self.refresh_s:
            await self.refresh()
        return self._views

    async def refresh(self) -> None:
        async with self.db.connect() as conn:
            rows = await engine_registry.live(conn)
        self._views = []
        for r in rows:
            s = EngineStats.from_json(r["stats"])
            self._views.append(EngineView(r["id"], r["url"], r["model"], s.interactive, s.batch, s.max_seqs, s.flex,
                                          s.flex_floor, s.region, r["draining"], s.block_size, self._others(s),
                                          s.max_model_len, s.model_source, s.task,
                                          frozenset(unused(s.reserved, s.reserved_used))))
        self._at = time.monotonic()
        if self.on_refresh is not None:
            self.on_refresh(self._views)

    def _others(self, stats: EngineStats) -> int | None:
        """What other API processes have in flight there (None: an engine too old to say)."""
        by = stats.interactive_by
        return None if by is None else sum(n for api, n in by.items() if api != self.me)

    async def follow(self) -> None:
        """Keep the view fresh until cancelled."""
        while True:
            try:
                await self.refresh()
            except Exception as err:  # Postgres is back soon; requests read through meanwhile
                log.warning("could not refresh the engine directory: %s", err)
            await asyncio.sleep(self.refresh_s)
