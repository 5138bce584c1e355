"""API keys on the request path: who a Bearer key belongs to, without a query per request.

`Authenticate` checks the key of every /v1 and /admin request before the app reads a
byte of its body (an unauthenticated upload is refused, not spooled to disk first) and
leaves the principal in the request's state, where `api.deps` finds it.

`KeyCache` is per process. A key's answer (its principal, or that it is unknown or
revoked) is kept for `ttl_s` (BALLAST_KEY_CACHE_S) and then asked again, so a revoked key
stops working everywhere within that bound (and the one query that finds it revoked) and
at once in the process that revoked it. A known key's requests do not wait for that
query: they are answered from memory while it runs, up to 2 × `ttl_s` after the answer
was fetched (past that, they wait for it), so a slow database never stalls every stream
of a busy key at once. A miss costs one query (a value that is not shaped like a key
costs none: `authenticate` refuses it first); requests for the same key meanwhile share
it. Unknown keys are remembered too, for as long, so a client retrying a bad key does not
cost a query each time, but only the most recent `max_unknown` of them: random keys
cannot grow memory.
Known keys are as many as the database holds, and are kept all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy.ext.asyncio import AsyncEngine

from api.errors import APIError, error_response
from journal import tenant_store
from journal.tenant_store import Principal

log = logging.getLogger(__name__)

Lookup = Callable[[str], Awaitable[Principal | None]]


def from_db(db: AsyncEngine) -> Lookup:
    async def lookup(plaintext: str) -> Principal | None:
        async with db.connect() as conn:
            return await tenant_store.lookup(conn, plaintext)

    return lookup


class KeyCache:
    def __init__(self, lookup: Lookup, ttl_s: float, *, max_unknown: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self._lookup, self.ttl_s, self.max_unknown, self._clock = lookup, ttl_s, max_unknown, clock
        self._known: dict[str, tuple[float, Principal]] = {}  # hash → (fetched at, principal)
        self._unknown: OrderedDict[str, float] = OrderedDict()  # hash → fetched at, oldest first
        self._pending: dict[str, asyncio.Task[Principal | None]] = {}

    @classmethod
    def over(cls, db: AsyncEngine, ttl_s: float) -> KeyCache:
        return cls(from_db(db), ttl_s)

    async def principal(self, plaintext: str) -> Principal | None:
        """The key's principal; None when it is unknown or revoked. Raises when the
        database cannot be asked (a key is never taken on trust)."""
        h = tenant_store.hash_key(plaintext)
        now = self._clock()
        if known := self._known.get(h):
            age = now - known[0]
            if age < self.ttl_s:
                return known[1]
            if age < 2 * self.ttl_s:  # due: asked again while this answer still serves
                self._ask(h, plaintext, now)
                return known[1]
        if (at := self._unknown.get(h)) is not None and now - at < self.ttl_s:
            return None
        return await asyncio.shield(self._ask(h, plaintext, now))

    def _ask(self, h: str, plaintext: str, now: float) -> asyncio.Task[Principal | None]:
        """One query per key however many requests wait on it, in a task of its own so
        that a caller going away does not cancel it for the others."""
        task = self._pending.get(h)
        if task is None:
            task = self._pending[h] = asyncio.create_task(self._fetch(h, plaintext, now))
            task.add_done_callback(_retrieved)
        return task

    async def _fetch(self, h: str, plaintext: str, now: float) -> Principal | None:
        try:
            found = await self._lookup(plaintext)
            self._remember(h, found, now)
            return found
        finally:
            del self._pending[h]

    def _remember(self, h: str, found: Principal | None, at: float) -> None:
        self._known.pop(h, None)
        self._unknown.pop(h, None)
        if found is not None:
            self._known[h] = (at, found)
            return
        self._unknown[h] = at
        while len(self._unknown) > self.max_unknown:
            self._unknown.popitem(last=False)

    def forget(self, key_hash: str) -> None:
        """Drop what is known of a key (this process revoked it): the next use asks again."""
        self._known.pop(key_hash, None)
        self._unknown.pop(key_hash, None)



# -- the check, answered as OpenAI answers ---------------------------------------------

CHALLENGE = {"WWW-Authenticate": "Bearer"}
NO_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
          "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
PROTECTED = ("/v1/", "/admin/")


def masked(key: str) -> str:
    """What an error may show of a key: its first 8 and last 4 characters, as OpenAI does."""
    return f"{key[:8]}***{key[-4:]}" if len(key) >= 16 else "***"


async def authenticate(keys: KeyCache, authorization: str | None) -> Principal:
    """The principal of an `Authorization: Bearer <key>` header, else an APIError: 401
    without a key or with one that is unknown or revoked, 503 when it cannot be checked."""
    scheme, key = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, NO_KEY, headers=CHALLENGE)
    try:
        # A value no key can have costs no query and takes no room in the cache.
        found = await keys.principal(key) if tenant_store.well_formed(key) else None
    except Exception as err:  # never let a key in unchecked
        log.warning("could not check an API key: %s: %s", type(err).__name__, err)
        raise APIError(503, "The API key could not be checked right now; try again shortly.", code="unavailable",
                       headers={"Retry-After": "1"}) from err
    if found is None:
        raise APIError(401, f"Incorrect API key provided: {masked(key)}. Keys are issued with "
                       "`ballast tenants create` or the admin API.", code="invalid_api_key", headers=CHALLENGE)
    return found


class Authenticate:
    """Plain ASGI, as `api.app.LimitBody` (and for the same reason: nothing between a
    streamed token and the client). The keys are `app.state.services.keys`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"] + "/").startswith(PROTECTED):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        try:
            principal = await authenticate(scope["app"].state.services.keys,
                                           header.decode("latin-1") if header is not None else None)
        except APIError as e:
            return await error_response(e.status, e.message, e.param, e.code, e.headers)(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def _retrieved(task: asyncio.Task) -> None:
    # A failed lookup whose callers all went away: not "exception never retrieved".
    if not task.cancelled():
        task.exception()
