"""An activity waiting for an engine slot keeps its heartbeat (activities/heartbeat.py, as a
fine-tuning chunk and a generation use it): else a wait behind chat and batch longer than
the heartbeat timeout had it retried to the back of the queue, and the job failed once its
attempts were spent."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.heartbeat import beating
from engine.slots import EngineSlots


async def test_an_activity_beats_while_it_waits_for_a_slot():
    slots = EngineSlots(1)
    beats: list[object] = []
    release = asyncio.Event()

    async def nothing():
        pass

    async def holder():
        async with slots.batch("chat-long", 10, nothing):
            await release.wait()

    @activity.defn
    async def chunk() -> int:
        waiting = asyncio.create_task(beating(lambda: 7))
        try:
            async with slots.batch("ft:job", 10, nothing):
                waiting.cancel()
                return len(beats)
        finally:
            waiting.cancel()

    env = ActivityEnvironment()
    env.info = replace(env.info, heartbeat_timeout=timedelta(seconds=0.3))
    env.on_heartbeat = lambda *details: beats.append(details)
    held = asyncio.create_task(holder())
    await asyncio.sleep(0)
    running = asyncio.create_task(env.run(chunk))
    await asyncio.sleep(0.5)  # waiting past its heartbeat timeout: beat every 0.1 s
    release.set()
    waited_beats = await running
    await held
    assert waited_beats >= 4 and all(d == (7,) for d in beats)
