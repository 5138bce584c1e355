"""Reserved capacity on the real stack: an admin's reservation reaches the pool's engine
worker (through its own database login), which keeps it and says so; a request of the
tenant's holds a reserved slot while it runs; withdrawn, it is gone from the engine too.
The engine's word is read over the admin API, the request is the official client's."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.conftest import make_admin_key, make_key, vllm_paused

pytestmark = pytest.mark.e2e

MODEL = "ballast-tiny"


def _until(check, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)
    return got


def test_a_reservation_reaches_the_engine_which_keeps_it_and_counts_its_use(stack, db_url):
    tenant = f"gold-{uuid.uuid4().hex[:8]}"
    key, admin = make_key(db_url, tenant), make_admin_key(db_url)
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {admin}"}, timeout=30) as a:
        def engines() -> list[dict]:
            return [e["stats"] for e in a.get("/admin/engines").json()["data"] if e["model"] == MODEL]

        r = a.put(f"/admin/tenants/{tenant}/reservations", json=dict(model=MODEL, slots=3))
        assert r.status_code == 200, r.text
        try:
            _until(lambda: sum(s.get("reserved", {}).get(tenant, 0) for s in engines()) == 3,
                   "the pool's engine workers keep the 3 slots")
            done = threading.Event()

            def chat() -> None:
                client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)
                stream = client.chat.completions.create(
                    model=MODEL, messages=[dict(role="user", content="Tell me a long story.")], max_tokens=900,
                    stream=True, extra_body=dict(ignore_eos=True))
                for _ in stream:
                    if done.is_set():
                        break
                stream.close()

            talking = threading.Thread(target=chat)
            try:
                # vLLM held still: the request holds its slot until the engine has said so,
                # however fast the machine generates its 900 tokens.
                with vllm_paused(stack):
                    talking.start()
                    _until(lambda: sum(s.get("reserved_used", {}).get(tenant, 0) for s in engines()) == 1,
                           "the engine says the tenant's request holds one of its reserved slots")
                    live = [d for d in a.get("/admin/reservations").json()["data"] if d["tenant"] == tenant]
                    assert [(d["slots"], d["on_engines"]) for d in live] == [(3, 3)]
            finally:
                done.set()
                if talking.is_alive():
                    talking.join(120)
        finally:
            assert a.put(f"/admin/tenants/{tenant}/reservations", json=dict(model=MODEL, slots=0)).status_code == 200
        _until(lambda: not any(s.get("reserved", {}).get(tenant) for s in engines()), "the engine lets the slots go")
        history = a.get(f"/admin/tenants/{tenant}/reservations").json()["history"]
        assert [c["slots"] for c in history] == [3, 0]


def test_a_reservation_in_tokens_a_second_reaches_the_engine_which_keeps_a_slot_until_it_has_run_full(
        stack, db_url):
    tenant = f"gold-{uuid.uuid4().hex[:8]}"
    make_key(db_url, tenant)  # the tenant, with a key
    admin = make_admin_key(db_url)
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {admin}"}, timeout=30) as a:
        def engines() -> list[dict]:
            return [e["stats"] for e in a.get("/admin/engines").json()["data"] if e["model"] == MODEL]

        def kept() -> int:
            return sum(s.get("reserved", {}).get(tenant, 0) for s in engines())

        # This stack's engines have far more slots than the tests ever fill: no rate at full load.
        assert engines() and not any(s["full_rate"] for s in engines())
        try:
            r = a.put(f"/admin/tenants/{tenant}/reservations", json=dict(model=MODEL, tokens_per_s=10**8))
            assert r.status_code == 200 and r.json()["tokens_per_s"] == 10**8, r.text
            _until(lambda: kept() == 1, "the pool's engine workers keep one slot")
            live = [d for d in a.get("/admin/reservations").json()["data"] if d["tenant"] == tenant]
            assert [(d["slots"], d["tokens_per_s"], d["on_engines"]) for d in live] == [(None, 10**8, 1)]
        finally:
            assert a.put(f"/admin/tenants/{tenant}/reservations",
                         json=dict(model=MODEL, tokens_per_s=0)).status_code == 200
        _until(lambda: not kept(), "the engine lets the slot go")
        history = a.get(f"/admin/tenants/{tenant}/reservations").json()["history"]
        assert [(c["slots"], c["tokens_per_s"]) for c in history] == [(None, 10**8), (0, None)]
