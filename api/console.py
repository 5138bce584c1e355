"""/console: the web console, a single page served by this process, and what it reads
that the rest of the API does not answer.

The page, its script, its stylesheet and its icon ship inside the package (api/console/),
are read once, and are served with a strict Content-Security-Policy: scripts and styles
only from this origin (no inline script, no inline style, no eval), nothing fetched from
anywhere else, no frames, no plugins, and no form that posts anywhere (the sign-in form
is handled by the script, so a key typed before it loaded never lands in a URL). The
page holds no secret: the API key the user pastes stays in the tab's sessionStorage and
goes out as `Authorization: Bearer` on each call, as any client's does.

- `GET /console/session`: who the key is (its tenant, whether it administers), so the
  console offers what the key may see without probing routes that would refuse it.
- `GET /admin/timeline`: the fleet's recent past in buckets (journal/timeline.py), for
  the fleet page's live chart; admin keys only.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from importlib import resources

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from api.deps import AdminDep, PrincipalDep, ServicesDep
from api.errors import APIError, not_found
from journal import timeline
from protocol.schema import errors

router = APIRouter(tags=["console"])

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cross-Origin-Opener-Policy": "same-origin"}
TYPES = {"index.html": "text/html; charset=utf-8", "console.js": "text/javascript; charset=utf-8",
         "console.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}

# Timeline bounds: unix seconds no later than 2100; buckets of 1 s to a day.
LATEST = 4_102_444_800
DEFAULT_SPAN_S = 900
DEFAULT_STEP_S = 10


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


_assets: dict[str, _Asset] = {}


def asset(name: str) -> _Asset:
    """One of the console's files, read from the package once."""
    if name not in _assets:
        body = resources.files(__package__ or "api").joinpath("console", name).read_bytes()
        _assets[name] = _Asset(body, TYPES[name], '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return _assets[name]


def _serve(request: Request, name: str) -> Response:
    a = asset(name)
    # Revalidated on every load (an upgrade shows at once), sent again only when it changed.
    headers = dict(HEADERS, ETag=a.etag, **{"Cache-Control": "no-cache"})
    if request.headers.get("if-none-match") == a.etag:
        return Response(status_code=304, headers=headers)
    return Response(a.body, media_type=a.media_type, headers=headers)


@router.get("/console", include_in_schema=False)
@router.get("/console/", include_in_schema=False)
async def page(request: Request) -> Response:
    return _serve(request, "index.html")


@router.get("/console/session", operation_id="consoleSession", responses=errors(401))
async def session(who: PrincipalDep, svc: ServicesDep, request: Request):
    """Who the key is: its tenant ("" for an admin key of no tenant) and whether it may
    administer; `admin_api` says whether /admin answers on this listener (with
    BALLAST_ADMIN_PORT set, it answers only on that one)."""
    port = svc.settings.admin_port
    here = (request.scope.get("server") or (None, None))[1]
    return dict(object="console.session", tenant=who.tenant or None, admin=who.admin, key_id=who.key_id,
                admin_api=who.admin and (port is None or here == port))


@router.get("/console/{name}", include_in_schema=False)
async def file(name: str, request: Request) -> Response:
    if name not in TYPES or name == "index.html":
        raise not_found("console file", name)
    return _serve(request, name)


@router.get("/admin/timeline", operation_id="getTimeline", responses=errors(400, 401, 403))
async def fleet_timeline(svc: ServicesDep, _: AdminDep,
                         since: float | None = Query(None, ge=0, le=LATEST,
                                                     description="Unix seconds (default: 15 minutes ago)."),
                         until: float | None = Query(None, ge=0, le=LATEST, description="Unix seconds (default: now)."),
                         step: int = Query(DEFAULT_STEP_S, ge=1, le=86_400, description="Bucket width, seconds.")):
    """The fleet's recent past, `step`-second buckets from `since` (floored to a multiple
    of `step`) to `until`, at most 2,000 of them: interactive requests and their TTFT
    (p50, p99), batch tokens per second, and the pools surging in each (journal/timeline.py)."""
    now = time.time()
    end = now if until is None else until
    start = end - DEFAULT_SPAN_S if since is None else since
    try:
        w = timeline.window(start, end, step)
    except ValueError as err:
        param = "since" if end <= start else "step"
        raise APIError(400, f"Invalid timeline window: {err}.", param=param, code="invalid_value") from None
    async with svc.db.connect() as conn:
        buckets = await timeline.timeline(conn, w)
    return dict(object="list", step=w.step, since=w.start, until=w.until,
                data=[dict(asdict(b), surging=list(b.surging)) for b in buckets])
