"""What yields when interactive traffic surges. Pure: inputs and `now` are arguments.

Two decisions, both per engine:
- `batch_slots`: how many sequences batch work may hold on the engine right now. Interactive
  work is never capped; while any is in flight batch keeps at most `busy_cap` sequences
  (on a CPU or a saturated GPU every extra sequence lengthens each step, so chat latency
  needs batch to step aside, not merely to leave a slot free). With
  hysteresis: the cap drops at once when interactive demand rises, and rises again only
  after demand has stayed lower for `cool_down_s`, so a bursty chat load does not make
  batch thrash between preempted and resumed.
- `victims`: which running batch generations to preempt when they hold more slots than
  the cap allows: lowest tier first, then least progress lost, then newest, then id.
"""

from __future__ import annotations

from dataclasses import dataclass

# Service tiers, as vLLM priorities: lower is served first.
TIERS = {"priority": 0, "default": 1, "flex": 2, "batch": 10}


@dataclass(frozen=True)
class Running:
    """A batch generation holding a slot on the engine."""

    id: str
    tier: int  # vLLM priority value: higher yields first
    unsaved_tokens: int  # produced but not yet in the journal: flushed before it stops
    generated_tokens: int  # re-prefilled when it resumes (cheap with prefix caching)
    started_at: float


@dataclass(frozen=True)
class Demand:
    """Interactive load on the engine, as its worker sees it."""

    interactive: int  # running + waiting interactive requests
    max_seqs: int  # the engine's sequence slots (vLLM max_num_seqs)
    busy_cap: int = 0  # batch sequences allowed while interactive work is in flight


@dataclass(frozen=True)
class SlotState:
    """The cap the engine applied last, and since when demand has been below it."""

    cap: int
    calm_since: float | None = None


def batch_slots(d: Demand, prev: SlotState, now: float, cool_down_s: float = 2.0) -> SlotState:
    room = d.max_seqs - d.interactive
    if d.interactive:
        room = min(room, d.busy_cap)
    wanted = max(0, room)
    if wanted <= prev.cap:  # demand rose or held: apply at once, and calm starts over
        return SlotState(wanted, None)
    calm_since = prev.calm_since if prev.calm_since is not None else now
    if now - calm_since >= cool_down_s:
        return SlotState(wanted, None)
    return SlotState(prev.cap, calm_since)


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
