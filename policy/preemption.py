"""What yields when interactive traffic surges. Pure: inputs and `now` are arguments.

Two levels. Per engine, within an engine step (the engine worker applies these):
- `batch_slots`: how many sequences batch work may hold on the engine right now. Interactive
  work is never capped; while any is in flight batch keeps at most `busy_cap` sequences
  (on a CPU or a saturated GPU every extra sequence lengthens each step, so chat latency
  needs batch to step aside, not merely to leave a slot free). With
  hysteresis: the cap drops at once when interactive demand rises, and rises again only
  after demand has stayed lower for `cool_down_s`, so a bursty chat load does not make
  batch thrash between preempted and resumed.
- `resume_after`: that wait, priced from the engine's own history: of the calm spells
  between chats seen lately, the wait that yields batch the most engine time net of what
  each resumption costs when chat comes back (re-prefilling the preempted sequences).
  Long gaps between bursts: batch takes them back at once; a surge's short gaps: it
  waits them out.
- `victims`: which running batch generations to preempt when they hold more slots than
  the cap allows: lowest tier first, then least progress lost, then newest, then id.
- `starvation_floor`: a minimum share batch keeps once it has been squeezed below it for
  `starve_after_s`. Short surges take every slot (chat latency first); continuous chat
  cannot take them forever (batch still progresses at its floor).

Per pool, every controller tick (`workflows/fleet.py` applies this):
- `pool_step`: from the engines' reports, is the pool surging? A pool enters a surge when
  an engine's pressure (interactive work and vLLM's queue against its slots, or KV-cache
  use while interactive work is there) reaches `high`, and leaves it only after pressure
  has stayed under `low` for `cool_down_s`. While it surges, every engine of the pool —
  also those no chat has reached yet — caps batch at `batch_share` of its slots, and the
  engines preempt by `victims` to get there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.fleet import EngineReport, Surge, SurgePolicy


@dataclass(frozen=True)
class Running:
    """A batch generation holding a slot on the engine."""

    id: str
    tier: int  # vLLM priority value: higher yields first
    unsaved_tokens: int  # produced but not yet in the journal: flushed before it stops
    generated_tokens: int  # re-prefilled when it resumes (cheap with prefix caching)
    started_at: float


@dataclass(frozen=True)
class SlotDemand:
    """Interactive load on the engine, as its worker sees it."""

    interactive: int  # running + waiting interactive requests
    max_seqs: int  # the engine's sequence slots (vLLM max_num_seqs)
    busy_cap: int = 0  # batch sequences allowed while interactive work is in flight
    batch_max: int | None = None  # a static partition: batch never holds more, busy or not
    # Reserved slots their tenants are not using, which no other interactive request may
    # take (policy/reservations.py): batch may hold them, busy or not, until they are asked for.
    lendable: int = 0


@dataclass(frozen=True)
class SlotState:
    """The cap the engine applied last, and since when demand has been below it."""

    cap: int
    calm_since: float | None = None


def batch_slots(d: SlotDemand, prev: SlotState, now: float, cool_down_s: float = 2.0) -> SlotState:
    room = d.max_seqs - d.interactive
    if d.interactive:
        room = min(room, d.busy_cap)
    room = max(room, d.lendable)
    if d.batch_max is not None:
        room = min(room, d.batch_max)
    wanted = max(0, room)
    if wanted <= prev.cap:  # demand rose or held: apply at once, and calm starts over
        return SlotState(wanted, None)
    # Reserved slots left unused are lent at once: no chat but their tenant's may take them,
    # and its request takes one back within a step, so waiting for calm buys nothing there.
    lent = max(prev.cap, min(wanted, d.lendable))
    if lent >= wanted:
        return SlotState(wanted, None)
    calm_since = prev.calm_since if prev.calm_since is not None else now
    if now - calm_since >= cool_down_s:
        return SlotState(wanted, None)
    return SlotState(lent, calm_since)


def resume_after(spells: Sequence[float], penalty_s: float, default_s: float, min_spells: int = 8) -> float:
    """The calm, in seconds, to wait before batch takes back the slots chat left.

    1. Too few spells seen (`min_spells`): `default_s`, the fixed cool-down.
    2. Each spell g seen lately would have yielded batch g − τ − `penalty_s` seconds of the
       engine had it waited τ and resumed (the penalty: the engine time a resumption
       costs when chat returns, the preempted sequences' re-prefill), and nothing where
       g ≤ τ. The total over the spells falls between spell lengths and jumps up past
       each, so its maximum is at τ = 0 or at a spell's length: the best of those, the
       shortest on a tie. Where no τ yields anything, the longest spell: batch resumes
       only in a spell longer than any seen."""
    if len(spells) < min_spells:
        return default_s
    best_tau, best = max(spells), 0.0
    for tau in sorted({0.0, *spells}):  # shortest first: a tie keeps the shortest
        net = sum(g - tau - penalty_s for g in spells if g > tau)
        if net > best:
            best_tau, best = tau, net
    return best_tau


@dataclass(frozen=True)
class Floor:
    """Batch's guaranteed share, and since when the cap has been below it."""

    min_slots: int = 0
    squeezed_since: float | None = None


def starvation_floor(cap: int, floor: Floor, now: float, starve_after_s: float) -> tuple[int, Floor]:
    """The cap to apply (`cap`, or the floor once batch has starved long enough) and the
    floor's state for the next call."""
    # 1. At or above the floor: nothing to guarantee, and the squeeze is over.
    if cap >= floor.min_slots:
        return cap, Floor(floor.min_slots)
    # 2. Below it: count how long, and hold batch to the floor once that passes the grace.
    since = floor.squeezed_since if floor.squeezed_since is not None else now
    squeezed = Floor(floor.min_slots, since)
    return (floor.min_slots if now - since >= starve_after_s else cap), squeezed


def floor_pause(step_s: float, share: float) -> float:
    """The pause after a training step taken on a slot batch holds by its floor alone (chat
    has the engine): a step takes the whole device, not one sequence's part of it, so the
    trainer keeps to the floor's share of the time, step ÷ (step + pause) = `share`."""
    return 0.0 if share <= 0 else step_s * (1 / share - 1)


def min_slots(share: float, max_seqs: int) -> int:
    """Slots of a `share` of `max_seqs`, at least one for any share above zero."""
    return 0 if share <= 0 else max(1, min(max_seqs, int(share * max_seqs)))


def victims(running: list[Running], cap: int) -> list[str]:
    """The generations to preempt so that at most `cap` batch generations hold slots."""
    excess = len(running) - cap
    if excess <= 0:
        return []
    order = sorted(
        running,
        key=lambda r: (-r.tier, r.unsaved_tokens + r.generated_tokens, -r.started_at, r.id),
    )
    return [r.id for r in order[:excess]]


def pressure(r: EngineReport) -> float:
    """How close interactive work on the engine is to waiting, 0 (idle) .. 1 (full)."""
    # vLLM's queue and a full KV cache count only while interactive work is there: filled by
    # batch alone they are batch doing its job (a batch submits its items at once, so vLLM's
    # queue holds hundreds of them for the first second), and a surge declared on them would
    # preempt that very batch and hold it out for the cool-down.
    queued = r.waiting if r.interactive else 0
    slots = (r.interactive + queued) / max(1, r.max_seqs)
    kv = r.kv_cache_usage if r.interactive else 0.0
    return round(min(1.0, max(slots, kv)), 4)


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    state: Surge
    pressure: float  # the pool's highest engine pressure this tick
    started: bool  # the surge began this tick
    ended: bool  # the surge ended this tick
    caps: tuple[tuple[str, int | None], ...]  # (engine id, batch cap or None: no fleet cap), by id


def pool_step(pool: str, reports: list[EngineReport], prev: Surge, now: float, policy: SurgePolicy) -> PoolDecision:
    mine = sorted((r for r in reports if r.pool == pool), key=lambda r: r.id)
    # 1. The pool's pressure: its most pressed engine (chat placed there waits first).
    p = max((pressure(r) for r in mine), default=0.0)
    # 2. Enter at `high`; leave once pressure has stayed under `low` for the cool-down.
    state = prev
    if not prev.surging and p >= policy.high:
        state = Surge(True, now, None)
    elif prev.surging and p >= policy.low:
        state = Surge(True, prev.since, None)
    elif prev.surging:
        calm = prev.calm_since if prev.calm_since is not None else now
        state = Surge(False) if now - calm >= policy.cool_down_s else Surge(True, prev.since, calm)
    # 3. Caps: during a surge every engine of the pool keeps batch to its share.
    caps = tuple((r.id, int(policy.batch_share * r.max_seqs) if state.surging else None) for r in mine)
    return PoolDecision(pool, state, p, state.surging and not prev.surging, prev.surging and not state.surging, caps)
