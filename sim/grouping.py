"""Batch grouping: a prefix-heavy batch's pages placed by `policy.grouping.assign` on the
engine workers' own queues ("grouped") against every group on the batch's shared queue
("shared", the batch workflow without sticky groups), on the same pool, in one run.

The batch workflow as workflows/batch.py runs it: at most `concurrency` items in flight;
when its queue runs low it takes the next page (2 × concurrency items by index, sorted by
their prompts' heads, as journal/batch_store.py's pending_page) and, grouped, asks
`assign` where the page's runs go (the pool's engines all live, bound 1.25); then it
sends groups of up to `group_size` consecutive items bound for one queue while there is
room, and a group's items leave the flight together when its last one ends (its
generation activity returns then). A group on an engine's own queue runs there; one on
the shared queue goes to an engine drawn at random (seeded): Temporal hands a task to
whichever poller waits, and every engine worker polls with room to spare, so none is
preferred. (Taking them in turn instead would be a kind of affinity the real queue does
not have: a page sorted by prompt cut into groups dealt in turn sends the same range of
prefixes to the same engine page after page when the groups a page makes divide evenly
among the engines.) Items wait
in their engine's queue for a batch slot as sim/engine.py models it.

Assumptions: no chat on the pool (batch runs alone, so no preemption); engines never
leave, so no group goes back unclaimed from an own queue; one workflow run (no
continue-as-new); an item that starts while another with its prefix is prefilling on the
same engine finds the prefix cached, as the engine worker's prefix leaders make it wait
for (engine/prefix_leaders.py).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

from policy.grouping import PrefixRun, assign, own_queue
from sim.engine import Engine, EngineSpec, Job
from sim.trace import BatchItem, BatchSpec, batch_items

ARMS = ("grouped", "shared")
POOL = "ballast-engine.m0"  # the pool's queue: its engines' own queues are named under it


@dataclass(frozen=True)
class GroupingSetup:
    engines: int = 8
    batch: BatchSpec = BatchSpec()
    concurrency: int = 256  # config/work.py's batch_concurrency
    group_size: int = 16  # … batch_group_size
    engine: EngineSpec = EngineSpec()


@dataclass(frozen=True)
class GroupingArm:
    arm: str
    items: int
    hit_rate: float  # cached over looked-up prompt tokens
    prefilled: int  # prompt tokens computed
    completion_s: float  # from the batch's start to its last item's end
    spread: float  # most items on one engine over the mean
    groups: int  # generation activities sent (a group ends at a run's edge, so grouping makes more)
    cpu_s: float
    jobs: tuple[Job, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class GroupingResult:
    setup: GroupingSetup
    arms: tuple[GroupingArm, ...]  # in ARMS order


def play(setup: GroupingSetup, items: list[BatchItem], arm: str) -> GroupingArm:
    assert arm in ARMS, arm
    cpu = time.process_time()
    engines = [Engine(f"e{i:03d}", setup.engine) for i in range(setup.engines)]
    own = {e.id: own_queue(POOL, "", e.id) for e in engines}
    by_queue = {q: e for e, q in zip(engines, own.values(), strict=True)}
    heap: list[tuple[float, int, int, Engine]] = []
    order = itertools.count()
    pending = deque(items)
    queue: deque[BatchItem] = deque()
    sticky: dict[int, Engine] = {}  # item → the engine whose own queue its run goes to
    group_of: dict[int, int] = {}  # item → its group
    left: dict[int, int] = {}  # group → its items not done
    size: dict[int, int] = {}
    groups = itertools.count()
    jobs: list[Job] = []
    in_flight = 0
    rng = random.Random(setup.batch.seed)

    def schedule(e: Engine) -> None:
        due = e.next_at()
        if due is not None:
            heapq.heappush(heap, (due, next(order), e.version, e))

    def page() -> None:
        taken = [pending.popleft() for _ in range(min(len(pending), 2 * setup.concurrency))]
        taken.sort(key=lambda it: (it.head, it.idx))
        runs = assign([it.head for it in taken], own) if arm == "grouped" else [PrefixRun(len(taken), "")]
        at = 0
        for r in runs:
            if r.queue:
                sticky.update((it.idx, by_queue[r.queue]) for it in taken[at:at + r.count])
            at += r.count
        queue.extend(taken)

    def launch(t: float) -> None:
        nonlocal in_flight
        if pending and len(queue) < setup.concurrency and in_flight < setup.concurrency:
            page()
        while queue and in_flight < setup.concurrency:
            on = sticky.get(queue[0].idx)
            room = min(setup.group_size, setup.concurrency - in_flight)
            group: list[BatchItem] = []
            while queue and len(group) < room and sticky.get(queue[0].idx) is on:
                group.append(queue.popleft())
                sticky.pop(group[-1].idx, None)
            if on is None:
                on = engines[rng.randrange(len(engines))]
            g = next(groups)
            left[g] = size[g] = len(group)
            for it in group:
                group_of[it.idx] = g
                job = Job(it.arrival(t), t)
                jobs.append(job)
                on.offer(job, t)
            schedule(on)
            in_flight += len(group)

    launch(0.0)
    end = 0.0
    while heap:
        now, _, version, e = heapq.heappop(heap)
        if version != e.version:
            continue
        woke = False
        for job in e.fire(now):
            end = now
            g = group_of[job.arrival.id]
            left[g] -= 1
            if not left[g]:
                in_flight -= size[g]
                woke = True
        schedule(e)
        if woke:
            launch(now)
    assert len(jobs) == len(items) and all(j.finished is not None for j in jobs)
    queried = sum(j.queried for j in jobs)
    cached = sum(j.cached for j in jobs)
    per = [sum(1 for j in jobs if j.engine == e.id) for e in engines]
    return GroupingArm(arm, len(jobs), cached / max(1, queried), queried - cached, end,
                       max(per) * len(per) / max(1, sum(per)), len(size), time.process_time() - cpu, tuple(jobs))


def experiment(setup: GroupingSetup = GroupingSetup()) -> GroupingResult:
    items = batch_items(setup.batch)
    return GroupingResult(setup, tuple(play(setup, items, arm) for arm in ARMS))
