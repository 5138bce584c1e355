"""`ballast up`'s processes kept running: a crashed one (a worker, the API, the embedded
Postgres or Temporal server) is started again with backoff, and `ballast up` gives up only
on a crash loop (policy/restarts.py decides; this runs it).

Each restart says which process exited, its exit code, when it comes back and the last
lines of its log. Work in flight does not need the process back to be safe (the journal
has it), only to go on: a restarted engine worker resumes its batch items from their
journaled tokens, a restarted API serves again.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ballast import procs
from policy.restarts import RestartPolicy, Streak, after_exit


@dataclass
class Service:
    name: str
    log_path: Path
    respawn: Callable[[], procs.Child]  # starts it again; returns the new process
    child: procs.Child
    started_at: float
    owned: bool = True  # stopped by stop_all; False: its owner stops it (Postgres, Temporal)
    ready_file: Path | None = None  # where it says it serves (procs.notify_ready); None: ready once started
    ready: bool = False
    streak: Streak = field(default_factory=Streak)
    restart_at: float | None = None  # crashed: when it starts again
    restarts: int = 0


class Supervisor:
    def __init__(self, policy: RestartPolicy, *, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic,
                 on_serving: Callable[[Service], object] | None = None):
        """`on_serving`: called when a restarted process serves again (`ballast up` moves
        it off vLLM's cores, as it did every process at the start)."""
        self.policy, self.say, self.clock, self.on_serving = policy, say, clock, on_serving
        self.services: list[Service] = []
        # The cores at the start, before anything was moved off vLLM's: a process started
        # again gets them all back (a restarted engine worker must not inherit a narrowed
        # set, or vLLM binds its model worker inside it).
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path, nice: int = 0) -> Service:
        ready_file = log_path.with_suffix(".ready")
        env = dict(env, **{procs.READY_FILE_ENV: str(ready_file)})

        def spawn() -> procs.Child:
            ready_file.unlink(missing_ok=True)
            # In our session, where the nice values its processes are given rank them
            # against one another (procs.spawn).
            return procs.spawn(name, argv, env=env, log_path=log_path, nice=nice, cpus=self.cpus, session=False)

        service = Service(name, log_path, spawn, spawn(), self.clock(), ready_file=ready_file)
        self.services.append(service)
        return service

    def adopt(self, name: str, child: procs.Child, respawn: Callable[[], procs.Child], log_path: Path) -> Service:
        """Watch a process started elsewhere (the embedded Postgres, the Temporal dev
        server): `respawn` starts it again, as it was, and returns the new process once it
        serves."""
        service = Service(name, log_path, respawn, child, self.clock(), owned=False, ready=True)
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
                    s.restart_at, s.restarts = None, s.restarts + 1
                    try:
                        s.child = s.respawn()
                        s.ready = s.ready_file is None
                        self.say(f"{s.name} restarted (pid {s.child.pid}; restart {s.restarts})")
                        if s.ready and self.on_serving:
                            self.on_serving(s)
                    except (RuntimeError, TimeoutError, OSError) as err:
                        # Its old process stays dead: the next look counts it as a crash.
                        self.say(f"{s.name} did not start again: {err}")
                    s.started_at = self.clock()
                continue
            if not s.ready and s.ready_file is not None and procs.said_ready(s.ready_file, s.child.pid):
                s.ready = True
                if s.restarts:
                    self.say(f"{s.name} is serving again (restart {s.restarts})")
                    if self.on_serving:
                        self.on_serving(s)
            if s.child.alive:
                continue
            code = s.child.stop(5)  # reap it, and whatever of its group survived it
            decision = after_exit(self.policy, s.streak, now - s.started_at, s.ready)
            s.streak = decision.streak
            tail = s.child.log_tail(15)
            if not decision.restart:
                return (f"{s.name} keeps crashing (code {code}; {s.streak.quick_crashes} times in a row before it "
                        f"served, within {self.policy.healthy_after_s:g} s of starting): giving up. Fix what its log "
                        f"says, then run `ballast up` again. Log {s.log_path}, last lines:\n{tail}")
            s.restart_at = now + decision.delay_s
            self.say(f"{s.name} exited (code {code}); restarting in {decision.delay_s:g} s. "
                     f"Last lines of its log ({s.log_path}):\n{tail}")
        return None

    def stop_all(self, timeout: float = 30.0) -> None:
        """The last started first (the API: it stops taking requests and ends its streams),
        then the rest at once, each given `timeout` to end before it is killed: a stop
        takes at most two timeouts however many engine workers there are."""
        owned = [s for s in reversed(self.services) if s.owned]
        if not owned:
            return
        owned[0].child.stop(timeout)
        rest = [threading.Thread(target=s.child.stop, args=(timeout,), name=f"stop {s.name}") for s in owned[1:]]
        for t in rest:
            t.start()
        for t in rest:
            t.join()
