"""One engine in virtual time: sequence slots, a step-time curve, a prefix cache, and batch
work yielding to interactive work through the real `policy.preemption`.

The model (continuous batching, as vLLM's scheduler):
1. A request waits in the engine's queue until a slot frees. Interactive requests wait
   as the engine worker holds them (`fair_share="vtc"`, its default: sim/fair.py, the
   real `policy.fairness`): the highest tier, then the tenant served least, with its
   guards; with `"fcfs"` by tier, then arrival. Batch waits behind them, by arrival.
2. Batch holds at most the cap `policy.preemption.batch_slots` gives (hysteresis on
   interactive demand), raised to `starvation_floor`'s share once squeezed long enough;
   batch above the cap is preempted by `victims`, waits again, and on resuming re-prefills
   its prompt and the tokens it had produced (its prompt's blocks hit the cache). While
   its pool surges (`policy.preemption.pool_step`, applied by the loop every tick), the
   fleet controller's cap applies too.
3. On taking a slot, the prompt's leading blocks held in the cache are not prefilled (vLLM
   recomputes at least the last token); the rest is, and every running sequence stalls
   for `prefill_s_per_token` × those tokens (a prefill is compute-bound, and the decodes
   batched with it wait for it; chunked prefill would spread the stall, not shrink it).
4. Every step gives each running sequence one token, the first included; a step with n
   running takes `step_s + seq_s × n` (decode is memory-bound: the weights are read once a
   step, each sequence adds its KV reads).
5. A sequence leaves when its output is done; its slot goes to the head of the queue.
Progress is kept in (fractional) steps between events, so the cost is per request, not
per step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from policy.fairness import engine_priority
from policy.placement import EngineView
from policy.preemption import Floor, Running, SlotDemand, SlotState, batch_slots, min_slots, starvation_floor, victims
from protocol.fleet import EngineReport
from protocol.tiers import RANK, Tier
from sim.cache import LruBlocks
from sim.fair import FairQueue
from sim.trace import Arrival

EPS_STEPS = 1e-6  # float slack when an event lands on the step it was computed for


@dataclass(frozen=True)
class EngineSpec:
    # Assumed, not measured here: an 8B model in bf16 on one H100 under vLLM, as vLLM's
    # published serving figures put it: ~8 ms a decode step alone, ~21 ms with 64
    # sequences, prefill at ~30k tokens/s.
    step_s: float = 0.008
    seq_s: float = 0.0002
    prefill_s_per_token: float = 1 / 30_000
    max_seqs: int = 64
    # From placement to the engine's queue (the API's handling, the worker's, the HTTP hops):
    # in flight, as the router counts it, but holding no slot. 0 at scale; a replay of the
    # real stack fits it (sim/replay.py).
    delay_s: float = 0.0
    block_size: int = 128  # vLLM CPU's KV block
    cache_blocks: int = 2048  # 262k tokens: ~32 GiB of an 8B model's KV at 128 KiB a token
    # Batch's yielding: config/scheduling.py's defaults.
    busy_cap: int = 0
    cool_down_s: float = 2.0
    batch_min_share: float = 0.05
    starve_after_s: float = 30.0
    # Tenants' turns within a tier: config/scheduling.py's defaults (engine/fair_share.py).
    fair_share: str = "vtc"  # or "fcfs": by arrival within a tier
    fair_headroom: float = 0.05  # of the slots, kept from one tenant while another is about
    fair_recent_s: float = 60.0  # "about": active or seen this recently
    flex_min_share: float = 0.05
    flex_starve_after_s: float = 30.0
    fair_long_prompt: int = 1024  # tokens; 0: no limit on long prefills at once
    fair_long_prefills: int = 1

    def step(self, seqs: int) -> float:
        return self.step_s + self.seq_s * seqs


class Job:
    """A request's progress through the fleet (simulation state, so mutable)."""

    __slots__ = ("arrival", "batch", "priority", "done", "epoch", "base", "placed", "first", "finished", "queried",
                 "cached", "preempted", "engine", "charged", "long")

    def __init__(self, arrival: Arrival, placed: float):
        self.arrival = arrival
        self.batch = arrival.tier == Tier.BATCH
        self.priority = engine_priority(arrival.tier)
        self.done = 0  # output tokens produced so far (kept across preemptions)
        self.epoch = 0  # bumped on each start: marks of an earlier run are stale
        self.base = 0.0  # the engine's steps when this run's decoding began
        self.placed = placed
        self.first: float | None = None
        self.finished: float | None = None
        self.queried = 0  # prompt tokens the engine looked up in its cache (re-prefills too)
        self.cached = 0  # of those, hits
        self.preempted = 0
        self.engine = ""
        self.charged = 0  # output tokens charged to its tenant's counter (vtc)
        self.long = False  # holds one of the long-prefill places until its first token (vtc)


def batch_cap(spec: EngineSpec, interactive: int, slot: SlotState, floor: Floor, now: float
              ) -> tuple[int, SlotState, Floor]:
    """The batch sequences the engine allows now, and the policy's state for next time."""
    # 1. Interactive demand against the slots, with hysteresis.
    slot = batch_slots(SlotDemand(interactive, spec.max_seqs, spec.busy_cap), slot, now, spec.cool_down_s)
    # 2. Squeezed below its floor for long enough, batch gets the floor back.
    cap, floor = starvation_floor(slot.cap, floor, now, spec.starve_after_s)
    return cap, slot, floor


class Engine:
    def __init__(self, id: str, spec: EngineSpec, region: str = "", model: str = ""):
        self.id, self.spec, self.region, self.model = id, spec, region, model
        self.cache = LruBlocks(spec.cache_blocks)
        self.running: dict[int, Job] = {}
        self._marks: list[tuple[float, int, int, int]] = []  # (step, 0 first token | 1 done, job id, epoch)
        self._waiting: list[tuple[int, float, int, Job]] = []  # (priority, arrived, id, job)
        self._arriving: list[tuple[float, int, Job]] = []  # (reaches the queue at, id, job): `delay_s`
        self.steps = 0.0  # steps every running sequence has been given, since the start
        self.at = 0.0  # the time `steps` and the integrals are up to
        self.stall_until = 0.0  # decoding waits for prefills until then
        self.interactive = 0  # interactive jobs here, running or waiting
        self.batch = 0  # batch jobs running
        self.batch_waiting = 0
        self.slot = SlotState(spec.max_seqs)
        self.floor = Floor(min_slots(spec.batch_min_share, spec.max_seqs))
        self.cap = spec.max_seqs
        self.fleet_cap: int | None = None  # the fleet controller's, while its pool surges
        self.wake: float | None = None  # when the batch cap may rise with no other event
        self.version = 0  # bumped whenever the next event moves: older ones are stale
        self.up = True
        self.busy_s = 0.0  # time with a sequence running
        self.seq_time = 0.0  # ∫ running sequences dt
        self._view: EngineView | None = None
        self.fair = self._fair()
        self._synced = -1.0  # `steps` when the running requests' output was last charged

    def _fair(self) -> FairQueue[Job] | None:
        s = self.spec
        if s.fair_share == "fcfs":
            return None
        assert s.fair_share == "vtc", s.fair_share
        return FairQueue(s.max_seqs, headroom=min_slots(s.fair_headroom, s.max_seqs),
                         floors={Tier.FLEX: min_slots(s.flex_min_share, s.max_seqs)},
                         starve_after_s=s.flex_starve_after_s, long_prompt=s.fair_long_prompt,
                         long_prefills=s.fair_long_prefills, recent_s=s.fair_recent_s)

    @property
    def inflight(self) -> int:
        return len(self.running) + len(self._waiting) + len(self._arriving) + (self.fair.waiting if self.fair else 0)

    def view(self) -> EngineView:
        """What the router sees: the in-flight counts as the placing API counts them."""
        if self._view is None:
            self._view = EngineView(self.id, "", self.model, self.interactive, self.batch, self.spec.max_seqs,
                                    region=self.region, block_size=self.spec.block_size)
        return self._view

    def advance(self, t: float) -> None:
        dt = t - self.at
        if dt <= 0:
            return
        n = len(self.running)
        if n:
            self.busy_s += dt
            self.seq_time += n * dt
            moving = t - max(self.at, self.stall_until)
            if moving > 0:
                self.steps += moving / self.spec.step(n)
        self.at = t

    def offer(self, job: Job, t: float) -> None:
        """A job placed here joins the queue (and starts at once if there is room)."""
        self.advance(t)
        job.engine = self.id
        if job.batch:
            self.batch_waiting += 1
        else:
            self.interactive += 1
        if self.spec.delay_s > 0:
            heapq.heappush(self._arriving, (t + self.spec.delay_s, job.arrival.id, job))
        else:
            self._enqueue(job, t)
        self._settle(t)

    def _enqueue(self, job: Job, t: float) -> None:
        """The job reaches the engine's queue (its worker's, for an interactive one under vtc)."""
        a = job.arrival
        if self.fair is None or job.batch:
            heapq.heappush(self._waiting, (job.priority, a.at, a.id, job))
            return
        if str(a.tenant) not in self.fair.load:
            self._sync()  # the lift reads the active tenants' counters
        self.fair.enter(job, str(a.tenant), a.tier, a.prompt, t)

    def _sync(self) -> None:
        """Charge every running interactive request's output so far (the worker charges each
        step's tokens as they come; the sim, before each read of the counters)."""
        if self.fair is None or self._synced == self.steps:
            return
        self._synced = self.steps
        owed: dict[str, int] = {}
        for job in self.running.values():
            if not job.batch:
                n = min(job.arrival.output, job.done + int(self.steps - job.base + EPS_STEPS)) - job.charged
                if n > 0:
                    job.charged += n
                    owed[str(job.arrival.tenant)] = owed.get(str(job.arrival.tenant), 0) + n
        for tenant, n in sorted(owed.items()):
            self.fair.produced(tenant, n)

    def fire(self, t: float) -> list[Job]:
        """Take the marks due by `t`; the jobs that finished."""
        self.advance(t)
        while self._arriving and self._arriving[0][0] <= t:
            self._enqueue(heapq.heappop(self._arriving)[2], t)
        done: list[Job] = []
        marks = self._marks
        while marks and marks[0][0] <= self.steps + EPS_STEPS:
            _, kind, jid, epoch = heapq.heappop(marks)
            job = self.running.get(jid)
            if job is None or job.epoch != epoch:
                continue
            if kind == 0:
                job.first = t
                if self.fair is not None and not job.batch:
                    self.fair.first_token(job.long)
                continue
            del self.running[jid]
            job.done = job.arrival.output
            job.finished = t
            if job.batch:
                self.batch -= 1
            else:
                self.interactive -= 1
                if self.fair is not None:
                    a = job.arrival
                    self.fair.produced(str(a.tenant), a.output - job.charged)
                    job.charged = a.output
                    self.fair.leave(str(a.tenant), a.tier, t)
            done.append(job)
        self._settle(t)
        return done

    def drop(self, t: float) -> list[Job]:
        """The engine is gone: every job it held, to be placed again from scratch."""
        self.advance(t)
        self.up = False
        queued = [w.item for q in self.fair.queues.values() for w in q] if self.fair else []
        jobs = sorted([*self.running.values(), *(w[3] for w in self._waiting), *(a[2] for a in self._arriving),
                       *queued], key=lambda j: j.arrival.id)
        for job in self.running.values():
            job.done += self._produced(job)
            job.charged = job.done  # its tenant's counter here is gone with the engine
        self.running.clear()
        self._waiting.clear()
        self._arriving.clear()
        self._marks.clear()
        self.fair = self._fair()
        self.interactive = self.batch = self.batch_waiting = 0
        self.version += 1
        self._view = None
        return jobs

    def report(self, pool: str) -> EngineReport:
        """What the engine worker tells the fleet controller (the KV cache's use is not modelled)."""
        chat_waiting = self.interactive - (len(self.running) - self.batch)
        return EngineReport(self.id, pool, self.spec.max_seqs, self.interactive, self.batch, len(self.running),
                            chat_waiting, 0.0, self.fleet_cap, self.batch_waiting)

    def surge_cap(self, cap: int | None, t: float) -> None:
        """The controller's batch cap for this engine (None: none)."""
        if cap != self.fleet_cap:
            self.advance(t)
            self.fleet_cap = cap
            self._settle(t)

    def next_at(self) -> float | None:
        due = None
        if self._marks and self.running:
            ahead = max(0.0, self._marks[0][0] - self.steps)
            due = max(self.at, self.stall_until) + ahead * self.spec.step(len(self.running))
        if self.wake is not None and (due is None or self.wake < due):
            due = self.wake
        if self._arriving and (due is None or self._arriving[0][0] < due):
            due = self._arriving[0][0]
        return due

    # -- internals ----------------------------------------------------------------------

    def _settle(self, t: float) -> None:
        """After any change: the batch cap, its victims, the free slots filled."""
        self.cap, self.slot, self.floor = batch_cap(self.spec, self.interactive, self.slot, self.floor, t)
        if self.fleet_cap is not None:
            self.cap = min(self.cap, self.fleet_cap)
        if self.batch > self.cap:
            for jid in victims(self._batch_running(), self.cap):
                self._preempt(self.running[int(jid)], t)
        fair = self.fair
        if fair is not None and fair.waiting:
            self._sync()
        while len(self.running) < self.spec.max_seqs:
            w = fair.pick(t, len(self.running) - self.batch) if fair is not None and fair.waiting else None
            if w is not None:
                job = w.item
                job.long = w.long
            elif self._waiting and not (self._waiting[0][3].batch and self.batch >= self.cap):
                job = heapq.heappop(self._waiting)[3]
                if job.batch:
                    self.batch_waiting -= 1
            else:
                break  # batch waits last in the queue: nothing behind it may go
            self._start(job, t)
        if not self.running:
            self._marks.clear()  # a preempted run's, all stale: steps stand still until a start
        self.wake = self._wake(t)
        self.version += 1
        self._view = None

    def _wake(self, t: float) -> float | None:
        """When the cap may rise by itself (the cool-down's end, the floor's grace), if batch waits for it."""
        if not self.batch_waiting:
            return None
        times = []
        if self.slot.calm_since is not None:
            times.append(self.slot.calm_since + self.spec.cool_down_s)
        if self.floor.squeezed_since is not None and self.cap < self.floor.min_slots:
            times.append(self.floor.squeezed_since + self.spec.starve_after_s)
        # A hair late: at the exact sum, `now - since >= wait` may round to just under it. A grace
        # already over (the floor given, but the fleet controller's cap below it) wakes nothing.
        later = [x + 1e-9 for x in times if x + 1e-9 > t]
        return min(later) if later else None

    def _batch_running(self) -> list[Running]:
        return [Running(str(j.arrival.id), RANK[Tier.BATCH], 0, j.done + self._produced(j), j.placed)
                for j in self.running.values() if j.batch]

    def _produced(self, job: Job) -> int:
        """Output tokens the job has made in its current run: whole steps since it began
        (fewer than it had left, or it would have finished)."""
        return max(0, min(job.arrival.output - job.done - 1, int(self.steps - job.base + EPS_STEPS)))

    def _start(self, job: Job, t: float) -> None:
        s, a = self.spec, job.arrival
        prompt = a.prompt + job.done  # a resumed job re-prefills what it had produced
        hit = max(0, min(self.cache.match(a.blocks) * s.block_size, prompt - 1))
        self.cache.store(a.blocks)
        self.stall_until = max(self.stall_until, t) + s.prefill_s_per_token * (prompt - hit)
        job.queried += prompt
        job.cached += hit
        job.epoch += 1
        job.base = self.steps  # frozen through the stall
        if job.first is None:
            heapq.heappush(self._marks, (job.base + 1, 0, a.id, job.epoch))
        elif self.fair is not None and not job.batch:
            self.fair.first_token(job.long)  # placed again after its first token: no mark to free its place
        heapq.heappush(self._marks, (job.base + a.output - job.done, 1, a.id, job.epoch))
        self.running[a.id] = job
        assert len(self.running) <= s.max_seqs
        if job.batch:
            self.batch += 1

    def _preempt(self, job: Job, t: float) -> None:
        job.done += self._produced(job)
        job.preempted += 1
        del self.running[job.arrival.id]
        self.batch -= 1
        self.batch_waiting += 1
        heapq.heappush(self._waiting, (job.priority, job.arrival.at, job.arrival.id, job))
