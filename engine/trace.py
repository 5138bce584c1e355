"""An engine worker's timeline, for `ballast bench batch`: off unless BALLAST_ENGINE_TRACE
names a file.

Each line is one JSON object with a wall-clock time `t`: when a generation activity
starts, when each item reaches vLLM and leaves it, each checkpoint commit (events, ms),
and vLLM's running and waiting sequences every `every_s`. Lines are buffered and written
in bulk; a trace costs the token path nothing but a list append per item event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any


class Trace:
    def __init__(self, path: str | None = None):
        self.path = path
        self._lines: list[str] = []

    def __bool__(self) -> bool:
        return self.path is not None

    def __call__(self, ev: str, **fields: Any) -> None:
        if self.path is not None:
            self._lines.append(json.dumps(dict(t=round(time.time(), 4), ev=ev, **fields)))

    def flush(self) -> None:
        if self.path is not None and self._lines:
            lines, self._lines = self._lines, []
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")

    async def run(self, load, every_s: float = 0.05, flush_s: float = 1.0) -> None:
        """Sample vLLM's scheduler (`engine.load`) and write the buffer out, until cancelled."""
        if self.path is None:
            return
        last = time.monotonic()
        try:
            while True:
                self("load", running=load.running, waiting=load.waiting)
                if time.monotonic() - last >= flush_s:
                    self.flush()
                    last = time.monotonic()
                await asyncio.sleep(every_s)
        finally:
            with contextlib.suppress(OSError):
                self.flush()


OFF = Trace()
