"""The API's view of the engine fleet: local, at most `refresh_s` stale, off the request path
except for one read when it has gone stale."""

from __future__ import annotations

import time

from sqlalchemy.ext.asyncio import AsyncEngine

from journal import engines as je
from policy.placement import EngineView


class EngineDirectory:
    def __init__(self, db: AsyncEngine, refresh_s: float = 0.5):
        self.db = db
        self.refresh_s = refresh_s
        self._views: list[EngineView] = []
        self._at = float("-inf")

    async def live(self) -> list[EngineView]:
        if time.monotonic() - self._at > self.refresh_s:
            async with self.db.connect() as conn:
                rows = await je.live(conn)
            self._views = [
                EngineView(r["id"], r["url"], r["model"], r["stats"].get("interactive", 0), r["stats"].get("batch", 0),
                           r["stats"].get("max_seqs", 1))
                for r in rows
            ]
            self._at = time.monotonic()
        return self._views
