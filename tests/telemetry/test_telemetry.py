"""The metrics plumbing every process shares: bounded tenant labels, the token check, and
/metrics on the engine worker's and the control worker's listeners (the API's is in
tests/api/test_metrics.py; a real Prometheus scraping all three, tests/e2e/test_metrics.py)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ballast.probes import probes_app
from engine.fair_share import FairShare
from engine.metrics import EngineCollector
from engine.server import create_app
from engine.slots import EngineSlots
from telemetry import exposition, families
from tests.engine.test_server import TOKEN, FakeEngine

METRICS = "metrics-token-for-tests-0123456789"


def test_tenants_past_the_bound_are_folded_into_other():
    bound = families._Tenants(2)
    assert [bound(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "other", "a", "other", "b"]


def test_the_token_check():
    assert exposition.allowed("Bearer x", None) is None  # off
    assert exposition.allowed(f"Bearer {METRICS}", METRICS) is True
    assert exposition.allowed("Bearer wrong", METRICS) is False
    assert exposition.allowed(None, METRICS) is False


async def _get(app, path: str, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        return await http.get(path, headers=headers)


async def test_the_engine_serves_metrics_with_the_metrics_token_only():
    slots, fair = EngineSlots(4), FairShare("fcfs", 4)
    app = create_app(FakeEngine(), slots, fair, token=TOKEN, metrics_token=METRICS)
    assert (await _get(app, "/metrics", None)).status_code == 401
    assert (await _get(app, "/metrics", TOKEN)).status_code == 401  # the engine token opens generation, not this
    ok = await _get(app, "/metrics", METRICS)
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
    assert (await _get(app, "/stats", METRICS)).status_code == 401  # nor does this token open the rest
    off = create_app(FakeEngine(), slots, fair, token=TOKEN)
    assert (await _get(off, "/metrics", METRICS)).status_code == 404


def test_the_engine_collector_reads_its_slots_at_scrape_time():
    slots, fair = EngineSlots(4), FairShare("fcfs", 4)
    collector = EngineCollector(slots, fair, "m", "eu")
    slots.interactive = 3
    fair.running_in["flex"] = 2
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}
    assert got[("ballast_engine_slots", (("kind", "interactive"), ("model", "m")))] == 3
    assert got[("ballast_engine_max_seqs", (("model", "m"),))] == 4
    assert got[("ballast_engine_preemptions_total", (("model", "m"),))] == 0
    assert got[("ballast_engine_interactive_running", (("model", "m"), ("tier", "flex")))] == 2
    assert got[("ballast_engine_info", (("model", "m"), ("region", "eu")))] == 1
    # Of the one slot interactive leaves idle, batch holds none; then interactive holds all.
    assert got[("ballast_engine_harvest_ratio", (("model", "m"),))] == 0
    slots.interactive = 4
    assert "ballast_engine_harvest_ratio" not in {f.name for f in collector.collect()}


async def test_the_control_workers_probes_and_metrics(owner_db):
    class Temporal:
        class service_client:
            @staticmethod
            async def check_health() -> bool:
                return True

    polling = [False]
    app = probes_app(owner_db, Temporal(), lambda: polling[0], METRICS)
    assert (await _get(app, "/healthz", None)).status_code == 200
    r = await _get(app, "/readyz", None)
    assert r.status_code == 503 and r.json()["parts"] == dict(database="ok", temporal="ok", workers="down: not polling")
    polling[0] = True
    assert (await _get(app, "/readyz", None)).status_code == 200
    assert (await _get(app, "/metrics", "wrong")).status_code == 401
    text = (await _get(app, "/metrics", METRICS)).text
    assert "ballast_journal_append_seconds" in {f.name for f in text_string_to_metric_families(text)}


def test_json_lines_carry_a_records_fields(capsys):
    import json
    import logging

    from telemetry import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("json", "api")
        logging.getLogger("ballast.access").info("GET / 200", extra=dict(request_id="req_1", status=200))
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("x").exception("failed")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert {k: first[k] for k in ("level", "logger", "message", "process", "request_id", "status")} == dict(
        level="info", logger="ballast.access", message="GET / 200", process="api", request_id="req_1", status=200)
    assert first["time"].endswith("+00:00") and "ValueError: boom" in second["exception"]
