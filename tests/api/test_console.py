"""The console without a browser (tests/e2e/test_console.py drives it in Chromium): its
files are served from the package with their content types and a strict
Content-Security-Policy, and hold nothing that policy would refuse (inline script, inline
style, eval); /console/session says who a key is; /admin/timeline is an admin's, refuses
windows it should not compute (400s in OpenAI's shape), and its buckets are what the
journal holds, recomputed here in Python from the same rows."""

from __future__ import annotations

import asyncio
import math
import re
import tomllib
import uuid
from fnmatch import fnmatch
from pathlib import Path

import pytest
from sqlalchemy import text

from api import console
from journal import leases
from journal.events import NewEvent, append
from protocol.events import EventType
from tests.api.conftest import Untouchable, assert_openai_error, build, new_key

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "api" / "console"


@pytest.fixture(scope="session")
async def admin_key(db) -> str:
    return await new_key(db, None, admin=True)


@pytest.fixture
async def admin_api(settings, db, admin_key):
    async with build(settings, db, Untouchable("temporal"), admin_key) as client:
        yield client


@pytest.fixture
async def anonymous(settings, db):
    async with build(settings, db, Untouchable("temporal"), None) as client:
        yield client


# -- the files -------------------------------------------------------------------------------


@pytest.mark.parametrize("path, media", [
    ("/console", "text/html"), ("/console/", "text/html"), ("/console/console.js", "text/javascript"),
    ("/console/console.css", "text/css"), ("/console/favicon.svg", "image/svg+xml")])
async def test_the_files_are_served_with_their_types_and_a_strict_policy(anonymous, path, media):
    r = await anonymous.get(path)  # no key: the page is public, what it shows is not
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].split(";")[0] == media
    policy = {d.split()[0]: d.split()[1:] for d in r.headers["content-security-policy"].split(";") if d.strip()}
    assert policy["default-src"] == ["'self'"] and policy["script-src"] == ["'self'"]
    assert policy["style-src"] == ["'self'"] and policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["form-action"] == ["'none'"]
    assert not any("unsafe" in s or s in ("*", "data:", "blob:") or "//" in s for v in policy.values() for s in v)
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["cache-control"] == "no-cache" and r.headers["etag"]
    again = await anonymous.get(path, headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and not again.content


async def test_an_unknown_file_is_a_404_in_openai_shape(anonymous):
    for name in ("nothing.js", "index.html", "..%2Fconsole.py", "console.py"):
        assert_openai_error(await anonymous.get(f"/console/{name}"), 404)


def test_nothing_in_the_files_needs_what_the_policy_forbids():
    html = (ASSETS / "index.html").read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="/console/' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html, re.I)  # no inline event handler
    assert not re.search(r"\sstyle\s*=", html, re.I) and "<style" not in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from another origin
    js = (ASSETS / "console.js").read_text()
    assert not re.search(r"\beval\(|new Function\(|setTimeout\(\s*[\"'`]", js)
    assert not re.search(r"style=", js)  # markup written by the script carries no inline style either
    assert not re.search(r"https?://", js + (ASSETS / "console.css").read_text())
    assert "@import" not in (ASSETS / "console.css").read_text()


def test_a_wheel_carries_every_console_file():
    """pyproject's package data names each file of api/console/, so an installed package serves them."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["api"]
    files = sorted(p.name for p in ASSETS.iterdir())
    assert set(files) == set(console.TYPES)
    assert all(any(fnmatch(f"console/{f}", pattern) for pattern in data) for f in files), (files, data)


# -- who is signed in -----------------------------------------------------------------------


async def test_the_session_says_who_the_key_is(api, admin_api, anonymous):
    mine = (await api.get("/console/session")).json()
    assert mine["tenant"] == "default" and mine["admin"] is False and mine["admin_api"] is False
    theirs = (await admin_api.get("/console/session")).json()
    assert theirs["tenant"] is None and theirs["admin"] is True and theirs["admin_api"] is True
    assert_openai_error(await anonymous.get("/console/session"), 401)
    bad = await anonymous.get("/console/session", headers={"Authorization": "Bearer sk-ballast-" + "x" * 43})
    assert_openai_error(bad, 401, code="invalid_api_key")


# -- the timeline ---------------------------------------------------------------------------


async def test_the_timeline_is_for_admin_keys_only(api, anonymous):
    assert_openai_error(await api.get("/admin/timeline"), 403, code="admin_key_required")
    assert_openai_error(await anonymous.get("/admin/timeline"), 401)


@pytest.mark.parametrize("query, param", [
    ("step=0", "step"), ("step=-5", "step"), ("step=86401", "step"), ("step=1.5", "step"), ("step=abc", "step"),
    ("since=abc", "since"), ("since=-1", "since"), ("since=nan", "since"), ("since=inf", "since"),
    ("since=1e300", "since"), ("until=nan", "until"),
    ("since=2000&until=1000", "since"), ("since=1000&until=1000", "since"),
    ("since=0&until=1000000&step=1", "step"),  # 1,000,000 buckets
    ("since=0&until=2001&step=1", "step"),  # 2,001
])
async def test_windows_it_will_not_compute_are_400s(admin_api, query, param):
    assert_openai_error(await admin_api.get(f"/admin/timeline?{query}"), 400, param=param)


async def test_the_window_is_bucketed_from_since_floored_to_the_step(admin_api):
    r = await admin_api.get("/admin/timeline?since=1000&until=3000&step=1")  # exactly 2,000
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2000
    body = (await admin_api.get("/admin/timeline?since=1005&until=1100&step=10")).json()
    assert body["object"] == "list" and body["step"] == 10 and body["since"] == 1000
    assert [b["t"] for b in body["data"]] == list(range(1000, 1100, 10))
    assert all(b == dict(t=b["t"], chat_requests=0, chat_ttft_p50_ms=None, chat_ttft_p99_ms=None, batch_tokens=0,
                         batch_tokens_per_s=0.0, surging=[]) for b in body["data"])
    default = (await admin_api.get("/admin/timeline")).json()  # the last 15 minutes in 10 s buckets
    assert default["step"] == 10 and 90 <= len(default["data"]) <= 91


def _percentile(values: list[float], q: float) -> float | None:
    """percentile_cont: linear between the closest ranks."""
    if not values:
        return None
    v = sorted(values)
    at = q * (len(v) - 1)
    lo, hi = math.floor(at), math.ceil(at)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


async def _committed_at(conn, key: str) -> float:
    return (await conn.execute(text("SELECT extract(epoch FROM committed_at)::float8 FROM events "
                                    "WHERE idempotency_key = :k"), dict(k=key))).scalar_one()


async def test_the_buckets_are_what_the_journal_holds(admin_api, services_db):
    """Requests' TTFTs, batch chunks and a surge journaled here come out in their buckets as
    recomputed in Python from the rows; a surge that began before the window shades its start."""
    tag = uuid.uuid4().hex[:8]
    pool = f"pool-{tag}"
    async with services_db.begin() as conn:
        await append(conn, [NewEvent(f"fleet:{pool}", EventType.SURGE_STARTED, dict(pressure=0.9, engines=[]),
                                     f"console-{tag}:started")])
    async with services_db.connect() as conn:
        started = await _committed_at(conn, f"console-{tag}:started")
    await asyncio.sleep(1.2)  # the next transaction's time lands in a later 1-second bucket
    ttfts = [12.5, 40.0, 7.25, None, 99.0]
    stream = f"item:batch_console_{tag}:0"
    async with services_db.begin() as conn:
        fence = await leases.acquire(conn, stream, "console-test")
    async with services_db.begin() as conn:
        await append(conn, [
            # A window's event listing three requests, and two of the shape journals had before.
            NewEvent(f"finished:console-{tag}", EventType.REQUEST_FINISHED, dict(requests=[
                dict(request_id=f"console-{tag}-{i}", tenant="default", status="completed", ttft_ms=t)
                for i, t in enumerate(ttfts[:3])]), f"finished:console-{tag}"),
            *[NewEvent(f"request:console-{tag}-{i}", EventType.REQUEST_FINISHED,
                       dict(request_id=f"console-{tag}-{i}", tenant="default", status="completed", ttft_ms=t),
                       f"console-{tag}:finished:{i}") for i, t in enumerate(ttfts) if i >= 3],
            *[NewEvent(stream, EventType.ITEM_CHUNK, dict(batch_id=f"batch_console_{tag}", idx=0, offset=n * 16,
                                                          token_ids=list(range(16)), runner="console-test"),
                       f"console-{tag}:chunk:{n}", fence=fence) for n in range(3)],
            NewEvent(f"fleet:{pool}", EventType.SURGE_ENDED, dict(pressure=0.1, engines=[], duration_s=1.2),
                     f"console-{tag}:ended"),
        ])
    async with services_db.connect() as conn:
        ended = await _committed_at(conn, f"console-{tag}:ended")
        since, until = math.floor(started) - 3, math.floor(ended) + 2
        rows = (await conn.execute(text(
            "SELECT extract(epoch FROM committed_at)::float8, type, payload FROM events "
            "WHERE committed_at >= to_timestamp(:a) AND committed_at < to_timestamp(:b) "
            "AND type IN ('request_finished', 'item_chunk')"), dict(a=since, b=until))).all()

    body = (await admin_api.get(f"/admin/timeline?since={since}&until={until}&step=1")).json()
    assert [b["t"] for b in body["data"]] == list(range(since, until))
    for b in body["data"]:
        here = [(kind, p) for at, kind, p in rows if b["t"] <= at < b["t"] + 1]
        chats = [r for kind, p in here if kind == "request_finished" for r in p.get("requests", [p])]
        ttft = [r["ttft_ms"] for r in chats if r.get("ttft_ms") is not None]
        tokens = sum(len(p["token_ids"]) for kind, p in here if kind == "item_chunk")
        assert b["chat_requests"] == len(chats), b
        assert b["chat_ttft_p50_ms"] == pytest.approx(_percentile(ttft, 0.5)), b
        assert b["chat_ttft_p99_ms"] == pytest.approx(_percentile(ttft, 0.99)), b
        assert b["batch_tokens"] == tokens and b["batch_tokens_per_s"] == tokens, b
        assert (pool in b["surging"]) == (b["t"] + 1 > started and b["t"] < ended), (b, started, ended)
    last = next(b for b in body["data"] if b["t"] == math.floor(ended))
    assert last["chat_requests"] >= len(ttfts) and last["batch_tokens"] >= 48

    # A window that opens inside the surge: its first bucket is shaded (the state before it).
    inside = (await admin_api.get(f"/admin/timeline?since={started + 0.5}&until={until}&step=1")).json()["data"]
    assert pool in inside[0]["surging"] and not any(pool in b["surging"] for b in inside if b["t"] > ended)
    # Per second, over a wider step.
    wide = (await admin_api.get(f"/admin/timeline?since={since}&until={until}&step=60")).json()["data"]
    assert sum(b["batch_tokens"] for b in wide) >= 48
    assert all(b["batch_tokens_per_s"] == pytest.approx(b["batch_tokens"] / 60, abs=1e-3) for b in wide)
