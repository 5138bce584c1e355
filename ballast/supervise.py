"""`ballast up`'s children kept running: a crashed one is started again with backoff, and
`ballast up` gives up only on a crash loop (policy/restarts.py decides; this runs it).

Each restart says which process exited, its exit code, when it comes back and the last
lines of its log. Work in flight does not need the process back to be safe (the journal
has it), only to go on: a restarted engine worker resumes its batch items from their
journaled tokens, a restarted API serves again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ballast import procs
from policy.restarts import RestartPolicy, Streak, after_exit


@dataclass
class Service:
    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    nice: int
    child: procs.Child
    started_at: float
    streak: Streak = field(default_factory=Streak)
    restart_at: float | None = None  # crashed: when it starts again
    restarts: int = 0


class Supervisor:
    def __init__(self, policy: RestartPolicy, *, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic):
        self.policy, self.say, self.clock = policy, say, clock
        self.services: list[Service] = []

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path, nice: int = 0) -> Service:
        child = procs.spawn(name, argv, env=env, log_path=log_path, nice=nice)
        service = Service(name, argv, env, log_path, nice, child, self.clock())
        self.services.append(service)
        return service

    @property
    def children(self) -> list[procs.Child]:
        return [s.child for s in self.services]

    def tick(self) -> str | None:
        """Restart what is due, schedule what crashed; a message if a crash loop ends it."""
        now = self.clock()
        for s in self.services:
            if s.restart_at is not None:
                if now >= s.restart_at:
                    s.child = procs.spawn(s.name, s.argv, env=s.env, log_path=s.log_path, nice=s.nice)
                    s.started_at, s.restart_at = now, None
                    s.restarts += 1
                    self.say(f"{s.name} restarted (pid {s.child.pid}; restart {s.restarts})")
                continue
            if s.child.alive:
                continue
            code = s.child.stop(5)  # reap it, and whatever of its group survived it
            decision = after_exit(self.policy, s.streak, now - s.started_at)
            s.streak = decision.streak
            tail = s.child.log_tail(15)
            if not decision.restart:
                return (f"{s.name} keeps crashing (code {code}; {s.streak.quick_crashes} times in a row within "
                        f"{self.policy.healthy_after_s:g} s of starting): giving up. Fix what its log says, then run "
                        f"`ballast up` again. Log {s.log_path}, last lines:\n{tail}")
            s.restart_at = now + decision.delay_s
            self.say(f"{s.name} exited (code {code}); restarting in {decision.delay_s:g} s. "
                     f"Last lines of its log ({s.log_path}):\n{tail}")
        return None

    def stop_all(self, timeout: float = 30.0) -> None:
        for s in reversed(self.services):
            s.child.stop(timeout)
