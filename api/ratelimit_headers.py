"""OpenAI's `x-ratelimit-*` headers on every /v1 answer to a tenant's key: where the
tenant stands against its per-minute limits, counted as admission counts them.

- `-requests`: its `requests_per_min`; `-tokens`: its `input_tokens_per_min`, else its
  `output_tokens_per_min`. A tenant without such a limit gets none of that pair's headers.
- `limit-*` is the limit, `remaining-*` the limit less what counts against it now (tiers
  with headroom yield before it is 0), `reset-*` the time left in the UTC minute window
  (Go's duration format, as OpenAI writes it: `59.5s`, `1m0s`, `20ms`).
- A chat or completion counts against the tenant's limit for all its models and the one
  for its model: the headers state the one with less remaining, which refuses first.
  Other routes name no model: every limit the tenant has.

Nothing here queries on the request path in the default (`local`) admission mode: the
headers read admission's in-process view (api/services/admission.py), which holds every
tenant's limits and the other processes' usage, re-read every `admission_refresh_s`, and
this process's own admissions exactly, as of the moment the response starts. In `sync`
mode this process's admissions are in the ledger only, so a chat or completion states the
usage its own decision read (itself included), and other routes a per-tenant read of the
ledger kept for `admission_refresh_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence

from api.services.admission import DECIDED, Admission, Decided
from journal import ledger
from journal.ledger import Counts
from policy.admission import DAY_S, MINUTE_S, LimitSet, Usage, window_start
from protocol.limits import ANY_MODEL

log = logging.getLogger(__name__)

# Each header pair: its name, and the limits it may state in order of preference.
PAIRS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests", ("requests_per_min",)),
    ("tokens", ("input_tokens_per_min", "output_tokens_per_min")),
)


def duration(seconds: float) -> str:
    """As Go formats a time.Duration (what OpenAI's reset headers are), to the millisecond."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + secs


def _used(dim: str, u: Usage) -> int:
    return {"requests_per_min": u.requests, "input_tokens_per_min": u.input_tokens,
            "output_tokens_per_min": u.output_tokens}[dim]


def headers(scopes: Sequence[tuple[LimitSet, Usage]], now: float) -> list[tuple[bytes, bytes]]:
    """The headers for these limits with their usage (none for a pair no limit states)."""
    out: list[tuple[bytes, bytes]] = []
    if not scopes:
        return out
    reset = duration(window_start(now, MINUTE_S) + MINUTE_S - now)
    for name, dims in PAIRS:
        dim = next((d for d in dims if any(getattr(s, d) is not None for s, _ in scopes)), None)
        if dim is None:
            continue
        # (remaining, limit) of the scope that refuses first; a tie states the smaller limit.
        remaining, limit = min((max(0, getattr(s, dim) - _used(dim, u)), getattr(s, dim))
                               for s, u in scopes if getattr(s, dim) is not None)
        out += [(f"x-ratelimit-limit-{name}".encode(), str(limit).encode()),
                (f"x-ratelimit-remaining-{name}".encode(), str(remaining).encode()),
                (f"x-ratelimit-reset-{name}".encode(), reset.encode())]
    return out


class LedgerView:
    """Sync mode's per-tenant usage for routes that admit nothing: the ledger's exact
    figures for the current minute, read at most once per `ttl_s` per tenant (concurrent
    requests share the read)."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._kept: dict[str, tuple[float, float, dict[str, Counts]]] = {}  # tenant → (read at, minute, by model)
        self._pending: dict[str, asyncio.Task[dict[str, Counts]]] = {}

    async def standing(self, adm: Admission, tenant: str, now: float) -> list[tuple[LimitSet, Usage]]:
        sets = adm.limits(tenant)
        if not sets:
            return []
        minute = window_start(now, MINUTE_S)
        kept = self._kept.get(tenant)
        if kept is not None and time.monotonic() - kept[0] < self.ttl_s and kept[1] == minute:
            by_model = kept[2]
        else:
            task = self._pending.get(tenant)
            if task is None:
                task = self._pending[tenant] = asyncio.create_task(self._read(adm, tenant, minute, now))
            by_model = await asyncio.shield(task)
        out = []
        for s in sets:
            counts = list(by_model.values()) if s.model == ANY_MODEL else [by_model.get(s.model, Counts())]
            out.append((s, Usage(sum(c.requests for c in counts), sum(c.input_tokens for c in counts),
                                 sum(c.output_tokens for c in counts))))
        return out

    async def _read(self, adm: Admission, tenant: str, minute: float, now: float) -> dict[str, Counts]:
        try:
            async with adm.db.connect() as conn:
                by_model = await ledger.usage(conn, tenant, minute, window_start(now, DAY_S), now, day_tokens=False,
                                              in_flight=False)
            self._kept[tenant] = (time.monotonic(), minute, by_model)
            return by_model
        finally:
            del self._pending[tenant]


class RateLimitHeaders:
    """Plain ASGI, as `api.app.LimitBody`: nothing between a streamed token and the client.
    Inside `Authenticate`, whose principal it reads."""

    def __init__(self, app):
        self.app = app
        self.ledger_view: LedgerView | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        decided = Decided()
        token = DECIDED.set(decided)

        async def stamped(message):
            if message["type"] == "http.response.start":
                extra = await self._headers(scope, decided)
                if extra:
                    message = dict(message, headers=[*message.get("headers", ()), *extra])
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            DECIDED.reset(token)

    async def _headers(self, scope, decided: Decided) -> list[tuple[bytes, bytes]]:
        principal = scope.get("state", {}).get("principal")
        tenant = principal.tenant if principal is not None else None
        svc = getattr(scope["app"].state, "services", None)
        adm: Admission | None = getattr(svc, "admission", None)
        if not tenant or adm is None:
            return []
        now = adm.clock()
        try:
            if decided.tenant == tenant and adm.mode == "sync" and decided.seen is not None:
                scopes = list(decided.seen)
            elif adm.mode == "sync":
                if self.ledger_view is None:
                    self.ledger_view = LedgerView(adm.refresh_s)
                scopes = await self.ledger_view.standing(adm, tenant, now)
            else:
                scopes = adm.standing(tenant, decided.model if decided.tenant == tenant else None)
        except Exception as err:  # headers are advice: the answer goes out without them
            log.warning("no rate-limit headers for this response: %s: %s", type(err).__name__, err)
            return []
        return headers(scopes, now)
