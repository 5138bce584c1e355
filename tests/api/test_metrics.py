"""GET /metrics on the API: only with the metrics token, 404 without one configured, and
what a request did is in it (a real Prometheus scrapes it in tests/e2e/test_metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from tests.api.conftest import assert_openai_error, build

TOKEN = "metrics-token-for-tests-0123456789"


async def test_metrics_need_the_metrics_token(settings, db, temporal_client, default_key):
    async with build(settings.model_copy(update=dict(metrics_token=SecretStr(TOKEN))), db, temporal_client) as api:
        assert_openai_error(await api.get("/metrics", headers={"Authorization": "Bearer nope"}), 401)
        assert_openai_error(await api.get("/metrics", headers={"Authorization": f"Bearer {default_key}"}), 401)
        r = await api.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        names = {f.name for f in text_string_to_metric_families(r.text)}
        assert {"ballast_requests", "ballast_admission_decisions", "ballast_ttft_seconds"} <= names
    async with build(settings, db, temporal_client) as api:
        assert_openai_error(await api.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}), 404)
