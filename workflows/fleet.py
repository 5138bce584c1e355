"""The fleet controller: one long-lived workflow that watches every engine pool.

Each tick it reads the engines' reports (queue depth, running and waiting sequences,
KV-cache use, interactive and batch in flight), asks `policy.preemption.pool_step` whether
each pool is surging, and applies the answer: a batch cap on every engine of a surging pool
(the engines preempt their victims by policy to get under it), lifted when the surge has
passed its cool-down. Surges and fleet membership are journaled (streams `fleet:<pool>`
and `fleet`), so "when did chat push batch out, and for how long" is a SQL query.

Engines also preempt on their own, within an engine step, the moment chat reaches them;
the controller is the slower, pool-wide half: it clears batch from the engines chat is
about to be placed on, and holds it out until the pool is calm.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

from protocol.events import EventType

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from policy.preemption import pool_step
    from protocol.fleet import EngineReport, Surge
    from protocol.temporal import ApplyFleetInput, FleetEvent, FleetInput, ObserveFleetInput

FLEET_ID = "fleet"
_LOCAL: dict[str, Any] = dict(start_to_close_timeout=timedelta(seconds=10),
                              retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)))


@workflow.defn(name="Fleet")
class FleetWorkflow:
    @workflow.run
    async def run(self, inp: FleetInput) -> None:
        pools, members = dict(inp.pools), list(inp.members)
        for _ in range(inp.ticks_per_run):
            reports: list[EngineReport] = await workflow.execute_local_activity_method(
                FleetActivities.observe_fleet, ObserveFleetInput(inp.stale_s), **_LOCAL)
            pools, members, apply = decide(reports, pools, members, workflow.now().timestamp(), inp)
            if apply.caps or apply.events:
                await workflow.execute_local_activity_method(FleetActivities.apply_fleet, apply, **_LOCAL)
            await workflow.sleep(inp.tick_s)
        workflow.continue_as_new(FleetInput(inp.policy, inp.tick_s, inp.stale_s, inp.ticks_per_run, pools, members))


def decide(reports: list[EngineReport], pools: dict[str, Surge], members: list[str], now: float,
           inp: FleetInput) -> tuple[dict[str, Surge], list[str], ApplyFleetInput]:
    """One tick, deterministic: the pools' next states, the members, and what to apply
    (only caps that differ from what the engines hold, and the events that explain them)."""
    events: list[FleetEvent] = []
    # 1. Membership: engines that joined or fell silent since the last tick.
    live = sorted(r.id for r in reports)
    for id in sorted(set(live) - set(members)):
        events.append(FleetEvent("fleet", "engine_joined", dict(engine=id), f"fleet:joined:{id}:{now}"))
    for id in sorted(set(members) - set(live)):
        events.append(FleetEvent("fleet", "engine_left", dict(engine=id), f"fleet:left:{id}:{now}"))
    # 2. Each pool's surge state, and the caps that follow from it.
    held = {r.id: r.fleet_cap for r in reports}
    caps: list[tuple[str, int | None]] = []
    next_pools: dict[str, Surge] = {}
    for pool in sorted({r.pool for r in reports} | set(pools)):
        d = pool_step(pool, reports, pools.get(pool, Surge()), now, inp.policy)
        if d.state != Surge() or any(r.pool == pool for r in reports):
            next_pools[pool] = d.state
        caps += [(id, cap) for id, cap in d.caps if held.get(id) != cap]
        engines = [id for id, _ in d.caps]
        stream = f"fleet:{pool}"
        if d.started:
            events.append(FleetEvent(stream, EventType.SURGE_STARTED, dict(pressure=d.pressure, engines=engines,
                                                                   batch_cap=dict(d.caps)),
                                     f"{stream}:surge:{now}:started"))
        if d.ended:
            since = pools[pool].since or now
            events.append(FleetEvent(stream, EventType.SURGE_ENDED, dict(pressure=d.pressure, engines=engines,
                                                                 duration_s=round(now - since, 3)),
                                     f"{stream}:surge:{since}:ended"))
    return next_pools, live, ApplyFleetInput(caps, events)
