"""The fleet controller: its tick (`decide`, pure) and the workflow on the real Temporal
dev server, with scripted engine reports, across continue-as-new and through the Replayer.
(End to end, on real engines: tests/e2e/test_preemption.py.)"""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from protocol.fleet import EngineReport, Surge, SurgePolicy
from protocol.temporal import ApplyFleetInput, FleetInput, ObserveFleetInput
from workflows.fleet import FleetWorkflow, decide

POLICY = SurgePolicy(high=0.5, low=0.25, cool_down_s=0.3, batch_share=0.0)
INP = FleetInput(POLICY, tick_s=0.05, stale_s=5.0, ticks_per_run=3)


def report(id: str, interactive: int = 0, cap: int | None = None) -> EngineReport:
    return EngineReport(id, "m", 4, interactive, 2, 2 + interactive, 0, 0.1, cap)


def test_a_tick_journals_membership_and_surges_and_writes_only_changed_caps():
    pools, members, apply = decide([report("a"), report("b")], {}, [], 100.0, INP)
    assert [(e.type, e.payload) for e in apply.events] == [("engine_joined", {"engine": "a"}),
                                                           ("engine_joined", {"engine": "b"})]
    assert apply.caps == [] and members == ["a", "b"] and pools == {"m": Surge()}

    pools, members, apply = decide([report("a", interactive=3), report("b")], pools, members, 101.0, INP)
    assert apply.caps == [("a", 0), ("b", 0)]
    [started] = apply.events
    assert (started.stream, started.type, started.key) == ("fleet:m", "surge_started", "fleet:m:surge:101.0:started")
    assert started.payload == dict(pressure=0.75, engines=["a", "b"], batch_cap={"a": 0, "b": 0})

    # The engines took the caps: nothing to write while the surge holds; b leaves.
    pools, members, apply = decide([report("a", interactive=3, cap=0)], pools, members, 102.0, INP)
    assert apply.caps == [] and [e.type for e in apply.events] == ["engine_left"] and members == ["a"]

    pools, members, apply = decide([report("a", cap=0)], pools, members, 103.0, INP)
    assert apply == ApplyFleetInput([], []) and pools["m"] == Surge(True, 101.0, 103.0)
    pools, members, apply = decide([report("a", cap=0)], pools, members, 103.5, INP)
    assert apply.caps == [("a", None)]
    [ended] = apply.events
    assert ended.type == "surge_ended" and ended.payload["duration_s"] == 2.5
    assert ended.key == "fleet:m:surge:101.0:ended"
    assert pools == {"m": Surge()}


async def test_the_controller_caps_a_surging_pool_and_lifts_it_after_the_cool_down(temporal_address):
    client = await Client.connect(temporal_address)
    queue = f"fleet-{uuid.uuid4().hex[:8]}"
    chat = {"n": 0}
    caps: dict[str, int | None] = {}
    applied: list[ApplyFleetInput] = []

    @activity.defn(name="observe_fleet")
    async def observe(inp: ObserveFleetInput) -> list[EngineReport]:
        return [report("e1", chat["n"], caps.get("e1")), report("e2", 0, caps.get("e2"))]

    @activity.defn(name="apply_fleet")
    async def apply(inp: ApplyFleetInput) -> None:
        applied.append(inp)
        caps.update(dict(inp.caps))

    async with Worker(client, task_queue=queue, workflows=[FleetWorkflow], activities=[observe, apply]):
        handle = await client.start_workflow(FleetWorkflow.run, INP, id=f"fleet-{queue}", task_queue=queue)

        async def until(cond, what):
            for _ in range(200):
                if cond():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"never: {what}; applied {applied}")

        await until(lambda: any(e.type == "engine_joined" for a in applied for e in a.events), "members journaled")
        chat["n"] = 3  # e1 is pressed
        await until(lambda: caps == {"e1": 0, "e2": 0}, "both engines capped")
        chat["n"] = 0
        await until(lambda: caps == {"e1": None, "e2": None}, "caps lifted")
        await handle.terminate()

    types = [e.type for a in applied for e in a.events]
    assert types == ["engine_joined", "engine_joined", "surge_started", "surge_ended"]
    # It crossed continue-as-new (3 ticks a run) and carried its members: no second join.
    runs, run_id = 0, handle.first_execution_run_id
    while run_id:
        history = await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        await Replayer(workflows=[FleetWorkflow]).replay_workflow(history)
        runs += 1
        last = history.events[-1]
        run_id = (last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                  if last.HasField("workflow_execution_continued_as_new_event_attributes") else None)
    assert runs >= 2
