"""Completion windows Ballast can keep: whether a batch can be promised to finish inside
its window, on a pool's measured batch pace, behind the work already promised there.

The model is a fluid earliest-deadline-first schedule (Liu & Layland's test for one
machine): the pool works through promised batches in deadline order at `rate` output
tokens a second, so a batch finishes when every batch due no later than it is done. A
batch can be promised its window when, with it added,

    for each batch k due at or after it:  work due by d_k  ≤  rate × (d_k − now)

and no batch that met that before it came misses it after. Work is counted in output
tokens (a reservation's `max_tokens`, an upper bound) since decode is what a batch's pace
measures; a pool whose pace nobody has measured yet promises only its longest window, as
best effort, as a batch always was.

Pure: `now` is an argument, every sort ends in an id tiebreak.
"""

from __future__ import annotations

from dataclasses import dataclass

# Temporal priority keys run 1 (first) to 5; unset is 3. A batch on its longest window
# yields to anything queued at the default; one on a shorter window goes with it, ahead
# of the long ones: earliest deadline first between window classes (within a class
# tenants share by weight, matching's fairness).
BATCH_PRIORITY_KEY = 4
SHORT_WINDOW_PRIORITY_KEY = 3


@dataclass(frozen=True)
class Promised:
    """A batch already promised on the pool: what it has left and when it is due."""

    batch_id: str
    deadline: float  # unix seconds
    tokens: int  # output tokens still to generate (at most)


@dataclass(frozen=True)
class Accept:
    deadline: float
    estimated_at: float | None  # when the schedule above finishes it; None: pace not measured
    ahead: int  # output tokens due no later than it, its own included
    rate: float  # the pace it was promised on, output tokens a second (0: not measured)


@dataclass(frozen=True)
class Unattainable:
    window: str
    earliest: str | None  # the shortest window that could be promised now; None: none
    ahead: int  # output tokens due no later than its deadline, its own included
    rate: float  # the pace it was checked against, output tokens a second
    displaces: bool = False  # it would fit, but a batch promised before it would then miss


def parse_window(window: str) -> int | None:
    """`24h`, `90m`, `3600s` → seconds; None where it is not one."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if len(window) < 2 or window[-1] not in units or not window[:-1].isdigit():
        return None
    seconds = int(window[:-1]) * units[window[-1]]
    return seconds or None


def priority_key(window_s: float, windows: dict[str, int]) -> int:
    return BATCH_PRIORITY_KEY if window_s >= max(windows.values()) else SHORT_WINDOW_PRIORITY_KEY


def promise(batch_id: str, tokens: int, window: str, windows: dict[str, int], created_at: float,
            promised: list[Promised], rate: float, now: float) -> Accept | Unattainable:
    """Whether `batch_id` (`tokens` output tokens, created at `created_at`) can be promised
    `window`; `windows`: every window offered, by name; `rate`: the pool's batch pace that
    may be promised (0: not measured)."""
    deadline = created_at + windows[window]
    longest = max(windows, key=lambda w: (windows[w], w))

    # 1. No measured pace: only the longest window, as best effort.
    if rate <= 0:
        if window == longest:
            return Accept(deadline, None, tokens + sum(p.tokens for p in promised if p.deadline <= deadline), 0.0)
        return Unattainable(window, longest, tokens, 0.0)

    # 2. The window asked for, checked whole; else the shortest one that would pass.
    ok, ahead, displaces = _fits(batch_id, tokens, deadline, promised, rate, now)
    if ok:
        return Accept(deadline, now + ahead / rate, ahead, rate)
    later = sorted((s, w) for w, s in windows.items() if s > windows[window])
    earliest = next((w for s, w in later if _fits(batch_id, tokens, created_at + s, promised, rate, now)[0]), None)
    return Unattainable(window, earliest, ahead, rate, displaces)


def describe(refused: Unattainable, tokens: int, model: str) -> str:
    """What the tenant reads at a refusal: why, and what it can do instead."""
    if refused.rate <= 0:
        return (f"The {refused.window} completion window cannot be promised yet: no engine of {model} has measured "
                f"its batch pace. Use {refused.earliest}, the window promised until one has.")
    why = (f"The {refused.window} completion window cannot be met: {refused.ahead} output tokens"
           f"{f' (this batch: up to {tokens})' if tokens else ''} are due on {model} by then, "
           f"at {refused.rate:.0f} tokens a second"
           f"{', and a batch promised before it would then miss its own window' if refused.displaces else ''}.")
    if refused.earliest is None:
        return why + " No window can be promised now; create the batch again later."
    return why + f" The shortest window that can be promised now is {refused.earliest}."


def _fits(batch_id: str, tokens: int, deadline: float, promised: list[Promised], rate: float,
          now: float) -> tuple[bool, int, bool]:
    """Whether the EDF test passes with the batch due at `deadline`; the work due no later
    than it, its own included; and whether it failed for another's sake. At an equal
    deadline the batch promised first goes first."""
    new = Promised(batch_id, deadline, tokens)
    order = sorted([*promised, new], key=lambda p: (p.deadline, p is new, p.batch_id))
    due, ahead, after = 0, 0, False
    for p in order:
        due += p.tokens
        if p is new:
            ahead, after = due, True
            if due > rate * (deadline - now):
                return False, ahead, False
        elif after and due > rate * (p.deadline - now) >= due - tokens:
            return False, ahead, True  # a batch due later that met its window would now miss it
    return True, ahead, False


@dataclass(frozen=True)
class Pace:
    """An engine's batch pace: output tokens a second over the seconds it had batch work
    in hand (idle seconds say nothing of what it can do), averaged over about `memory_s`
    of them. Tokens are counted as items finish, so a sample spans at least `min_busy_s`
    of busy time and the first waits for a finished item. An engine that holds few batch
    items measures less than it could do: promises err short."""

    rate: float = 0.0  # 0: not measured yet
    busy_s: float = 0.0  # the engine's busy seconds at the last sample
    tokens: int = 0  # its batch tokens at the last sample


def paced(prev: Pace, busy_s: float, tokens: int, memory_s: float = 60.0, min_busy_s: float = 1.0) -> Pace:
    """`busy_s`: seconds so far that batch work held a slot; `tokens`: batch tokens so far."""
    if tokens < prev.tokens or busy_s < prev.busy_s:  # counters restarted: read afresh
        return Pace(prev.rate, busy_s, tokens)
    spent = busy_s - prev.busy_s
    if spent < min_busy_s or (prev.rate == 0 and tokens == prev.tokens):
        return prev
    sample = (tokens - prev.tokens) / spent
    rate = sample if prev.rate == 0 else prev.rate + min(1.0, spent / memory_s) * (sample - prev.rate)
    return Pace(rate, busy_s, tokens)
