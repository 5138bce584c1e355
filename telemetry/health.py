"""Readiness, as every process's /readyz reports it: each part it depends on, "ok" or
"down: <why>", and ready only when all are."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

TIMEOUT_S = 3.0  # a part slower than this to answer a probe is as good as down


async def part(check: Awaitable[Any]) -> str:
    """ "ok" where `check` completes in time, else why not; a probe reports, it does not raise."""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            await check
        return "ok"
    except Exception as err:
        return f"down: {type(err).__name__}"


def readiness(parts: dict[str, str]) -> tuple[dict[str, Any], int]:
    """The body and status of /readyz: 200 when every part is ok, else 503 naming them."""
    ready = all(v == "ok" for v in parts.values())
    return dict(status="ok" if ready else "unavailable", parts=parts), 200 if ready else 503
