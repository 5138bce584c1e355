"""When a crashed process of `ballast up` starts again, and when to stop trying. Pure:
the run's length and `now` are arguments.

A process that crashes after a healthy run is restarted after `initial_backoff_s`: one
crash is an incident, and the journal lets work resume. A run was healthy if the process
said it was ready (serving: its engine loaded, its worker polling) or lasted
`healthy_after_s`. So a process killed from outside, however often, is always started
again; one that dies before it ever serves is in a crash loop. Such crashes form a streak;
each one doubles the wait (up to `max_backoff_s`), and `max_quick_crashes` in a row is a
loop that a restart will not fix (a bad setting, a port taken, a broken install):
supervision gives up and says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 30.0
    max_quick_crashes: int = 5


@dataclass(frozen=True)
class Streak:
    """Crashes in a row, each before the process was ready and within `healthy_after_s`."""

    quick_crashes: int = 0


@dataclass(frozen=True)
class Restart:
    restart: bool  # False: a crash loop, give up
    delay_s: float
    streak: Streak


def after_exit(p: RestartPolicy, streak: Streak, ran_s: float, ready: bool = False) -> Restart:
    # 1. A run that served, or lasted, was healthy: this crash starts no streak of its own.
    quick = 0 if ready or ran_s >= p.healthy_after_s else streak.quick_crashes + 1
    # 2. Enough quick crashes in a row: a loop, which restarting will not end.
    if quick >= p.max_quick_crashes:
        return Restart(False, 0.0, Streak(quick))
    # 3. Otherwise back off, doubling with the streak.
    return Restart(True, min(p.max_backoff_s, p.initial_backoff_s * 2 ** max(0, quick - 1)), Streak(quick))
