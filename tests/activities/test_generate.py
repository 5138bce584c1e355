"""The generation activity on a real engine and journal: items are isolated from each
other, and a stale attempt cannot write once a newer one holds the item's lease."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Collection

import pytest
from sqlalchemy import text
from temporalio.testing import ActivityEnvironment

from activities.generate import ITEM_TRIES, GenerationActivities
from engine.slots import EngineSlots
from journal import batch_store
from journal.checkpointer import Checkpointer
from protocol import keys
from protocol.batch import Item
from protocol.temporal import GenerateInput

pytestmark = pytest.mark.engine


class Gated:
    """The real engine, except that chosen requests pause after a few steps until
    released, or raise: a generation held open at a known point, on any machine."""

    def __init__(self, engine, *, hold_after: int | None = None, fail: Collection[str] = frozenset()):
        self._engine, self.hold_after, self.fail = engine, hold_after, fail
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt, sampling, **kw):
        if any(request_id.startswith(f) for f in self.fail):
            raise RuntimeError("engine blew up on this request")
        steps = 0
        async for step in self._engine.generate(request_id, prompt, sampling, **kw):
            yield step
            steps += 1
            if self.hold_after is not None and steps == self.hold_after and not self.release.is_set():
                self.held.set()
                await self.release.wait()


async def _batch(db, bodies: list[dict], endpoint: str = "/v1/completions") -> str:
    batch_id = "batch_" + uuid.uuid4().hex[:24]
    now = int(time.time())
    async with db.begin() as conn:
        await batch_store.create_batch(conn, dict(id=batch_id, tenant="default", endpoint=endpoint,
                                                  input_file_id="file-x",
                                                  completion_window="24h", metadata=None, status="in_progress",
                                                  created_at=now, expires_at=now + 86400))
        await batch_store.add_items(conn, batch_id, "default", [Item(i, i + 1, f"c{i}", b) for i,
                                                                b in enumerate(bodies)])
    return batch_id


def _env(attempt: int = 1) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(ActivityEnvironment.default_info(), attempt=attempt, activity_id="group-0")
    return env


async def _results(db, batch_id: str) -> dict[int, tuple[str, int | None]]:
    async with db.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT (payload->>'idx')::int, type, payload->>'body_json' FROM events "
            "WHERE stream LIKE :s AND type IN ('item_completed', 'item_failed')"), dict(s=f"item:{batch_id}:%"))).all()
    return {idx: (t, json.loads(b).get("error", {}).get("code") if t == "item_failed" else None) for idx, t, b in rows}


def _body(prompt, max_tokens=24):
    return dict(model="ballast-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)


async def test_one_bad_item_fails_alone_and_the_rest_of_its_group_completes(db, engine):
    vocab_top = engine.max_token_id
    bodies = [_body(f"good {i}") for i in range(6)]
    bodies[2] = _body([1, 2, vocab_top + 5])  # vLLM would refuse it: out of vocabulary
    bodies[4] = _body("the engine fails on this one")
    batch_id = await _batch(db, bodies)
    gated = Gated(engine, fail={keys.item(batch_id, 4)})
    async with Checkpointer(db) as cp:
        acts = GenerationActivities(db, gated, cp, EngineSlots(64), checkpoint_tokens=8, retry_delay_s=0)
        results = await _env().run(acts.generate, GenerateInput(batch_id, list(range(6))))
    assert [r.status for r in results] == ["completed", "completed", "failed", "completed", "failed", "completed"]
    got = await _results(db, batch_id)
    assert got[2] == ("item_failed", "invalid_value")  # a 400, naming the prompt
    assert got[4] == ("item_failed", "engine_error")  # a 500 after its own retries, nobody else's
    assert sum(1 for v in got.values() if v[0] == "item_completed") == 4
    async with db.connect() as conn:
        tries = (await conn.execute(text("SELECT count(*) FROM events WHERE stream = :s AND type = 'item_chunk'"),
                                    dict(s=keys.item(batch_id, 4)))).scalar()
    assert tries == 0 and ITEM_TRIES >= 2


async def test_a_stale_attempt_is_refused_once_a_newer_one_holds_the_lease(db, engine):
    batch_id = await _batch(db, [_body("fenced item", max_tokens=64)])
    stream = keys.item(batch_id, 0)
    old = Gated(engine, hold_after=20)  # attempt 1 pauses mid-generation, its first chunks written
    async with Checkpointer(db) as cp:
        acts1 = GenerationActivities(db, old, cp, EngineSlots(64), checkpoint_tokens=8)
        acts2 = GenerationActivities(db, engine, cp, EngineSlots(64), checkpoint_tokens=8)
        first = asyncio.create_task(_env(1).run(acts1.generate, GenerateInput(batch_id, [0])))
        await asyncio.wait_for(old.held.wait(), 60)
        await asyncio.sleep(0.2)  # its chunks so far are committed
        # The retry (after a lost heartbeat, say) takes the lease and finishes the item.
        second = await _env(2).run(acts2.generate, GenerateInput(batch_id, [0]))
        old.release.set()  # the zombie wakes up and tries to write its next chunk and result
        stale = await asyncio.wait_for(first, 60)
    assert [r.status for r in second] == ["completed"]
    assert [r.status for r in stale] == ["superseded"]
    async with db.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT type, payload->>'runner', fence FROM events WHERE stream = :s ORDER BY version"),
            dict(s=stream))).all()
        current = (await conn.execute(text("SELECT token FROM leases WHERE stream = :s"), dict(s=stream))).scalar()
    results = [r for r in rows if r.type in ("item_completed", "item_failed")]
    assert len(results) == 1 and results[0].fence == current  # the retry's, whose lease is the stream's now
    first_fences = {r.fence for r in rows if r.type == "item_chunk" and r[1].endswith(":1")}
    assert first_fences and max(first_fences) < current
    runners = [r[1] for r in rows if r.type == "item_chunk"]
    # Attempt 1's chunks all precede attempt 2's; none of attempt 1 came after the takeover.
    assert runners and runners == sorted(runners, key=lambda r: r.endswith(":2"))
    assert any(r.endswith(":1") for r in runners) and any(r.endswith(":2") for r in runners)


async def test_a_group_returns_once_its_last_result_commits_not_at_the_next_tick(db, engine):
    """Results wait for the checkpointer's tick (here an hour away), but the last of a
    group's items to end commits at once: the group, and the batch's next step, wait for
    no tick. Every result is journaled when the activity returns."""
    bodies = [_body(f"tick {i}", max_tokens=4 + 12 * i) for i in range(4)]
    batch_id = await _batch(db, bodies)
    async with Checkpointer(db, interval_s=3600) as cp:
        acts = GenerationActivities(db, engine, cp, EngineSlots(64), checkpoint_tokens=10_000)
        results = await asyncio.wait_for(_env().run(acts.generate, GenerateInput(batch_id, list(range(4)))), 60)
        assert [r.status for r in results] == ["completed"] * 4
        assert {i: t for i, (t, _) in (await _results(db, batch_id)).items()} == {i: "item_completed" for i in range(4)}
