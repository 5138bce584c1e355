"""Placement over a pool: `ballast up --engines 2`, two engine workers with a vLLM engine
each. Chats that share a long system prompt, one after another, all land on one engine,
which vLLM itself then reports as prefix-cache hits; chats of another prompt land where
theirs goes; a burst of one prompt fills its engine to the load bound, then spills to the
other. Where each request ran is the engine worker's own record of it (`request_served`)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from ballast import procs
from tests.e2e.test_supervise import sql, started

pytestmark = pytest.mark.e2e

SYSTEM = {name: f"You are {name}, the ship's {role}. Answer in one word, always, whatever is asked. " * 2
          for name, role in (("Ada", "navigator"), ("Brin", "cook"), ("Cole", "lookout"))}


def chat(api: httpx.Client, system: str, question: str, max_tokens: int = 8) -> str:
    r = api.post("/v1/chat/completions", json=dict(model="ballast-tiny", max_tokens=max_tokens, messages=[
        dict(role="system", content=system), dict(role="user", content=question)]))
    assert r.status_code == 200, r.text
    return r.json()["id"]


def served_on(up_dir, ids: list[str], up: procs.Child) -> list[str]:
    """The engine each request ran on, as its engine worker recorded it."""
    q = "SELECT payload->>'request_id', payload->>'engine_id' FROM events WHERE type = 'request_served'"
    procs.wait_until(lambda: set(ids) <= {r for r, _ in sql(up_dir, q)}, 60, "every request served recorded",
                     child=up)
    where = dict(sql(up_dir, q))
    return [where[i] for i in ids]


def engine_stats(up_dir) -> dict[str, dict]:
    return {id_: stats for id_, stats in sql(up_dir, "SELECT id, stats FROM engines")}


def test_a_prefix_sticks_to_its_engine_vllm_hits_it_and_a_burst_spills_at_the_bound(tmp_path, up_dir, tiny_model):
    up, api, _ = started(tmp_path, up_dir, tiny_model, BALLAST_ENGINES="2")
    try:
        procs.wait_until(lambda: len(engine_stats(up_dir)) == 2, 120, "both engine workers announced", child=up)

        # One after another: each prompt's chats follow it.
        ids = {name: [chat(api, SYSTEM[name], f"question {i}?") for i in range(5)] for name in ("Ada", "Brin")}
        where = {name: served_on(up_dir, got, up) for name, got in ids.items()}
        assert all(len(set(engines)) == 1 for engines in where.values()), where

        # vLLM's own counters: every chat after the first found the system prompt cached.
        tok = AutoTokenizer.from_pretrained(tiny_model.path)
        block = engine_stats(up_dir)[where["Ada"][0]]["block_size"]
        shared = (len(tok.encode(SYSTEM["Ada"], add_special_tokens=False)) // block - 1) * block
        time.sleep(2)  # the engines' figures are announced every second
        hits = sum(s["prefix_hits"] for s in engine_stats(up_dir).values())
        assert hits >= 2 * 4 * shared > 0, (hits, shared)

        # A burst of one prompt, all in flight at once: the bound spreads it over both.
        burst: list[str] = []
        opened = threading.Barrier(8)

        def stream(i: int) -> None:
            body = dict(model="ballast-tiny", max_tokens=600, stream=True, messages=[
                dict(role="system", content=SYSTEM["Cole"]), dict(role="user", content=f"burst {i}")])
            with api.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(ln for ln in lines if ln.startswith("data: "))
                burst.append(json.loads(first[6:])["id"])
                opened.wait(60)
                for _ in lines:
                    pass

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(180)
        spread = served_on(up_dir, burst, up)
        counts = sorted(spread.count(e) for e in set(spread))
        assert len(counts) == 2 and counts[-1] <= 5, spread  # 1.25 × the mean of 8 over 2, rounded up
    finally:
        up.stop(60)
