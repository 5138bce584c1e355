"""Child-process supervision for `ballast up` and test fixtures.

Every child runs in its own session (so its process group holds it and everything it
forks, e.g. vLLM's engine-core process) and, on Linux, gets a parent-death signal so it
does not outlive a parent that was SIGKILLed. `Child.stop()` signals the whole group.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pwd
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# Where a supervised process says it serves (notify_ready): ballast/supervise.py sets it.
READY_FILE_ENV = "BALLAST_READY_FILE"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may still take it first),
    from below the kernel's ephemeral range: a port from that range can be handed to any
    outgoing connection in the moments before its server binds it (an engine worker binds
    ~20 s after its port is chosen, once vLLM is up), and the bind then fails."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(max(1024, low - 12_000), low)
        if port_is_free(port, host):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # that range is full: any
        s.bind((host, 0))
        return s.getsockname()[1]


_PORTS = random.Random()  # its own: a test seeding the module's random must not repeat our ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def listen_nodelay(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose accepted connections have TCP_NODELAY (Linux inherits
    it). A streamed response is written as headers, then small chunks; without NODELAY,
    Nagle holds each chunk for the client's delayed ACK, ~40 ms, once the connection
    leaves quick-ACK mode, and every streamed token pays it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind((host, port))
    s.listen(1024)
    s.set_inheritable(True)
    return s


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on host:port now.

    SO_REUSEADDR as servers (Postgres, Go) use it: connections lingering in TIME_WAIT
    after a restart do not make the port busy.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgrp) of every live, non-zombie process, from /proc (Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited while we looked
            continue
        # Fields after the command name, which may itself contain spaces and parentheses.
        state, ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if state not in ("Z", "X"):
            out.append((int(entry), int(ppid), int(pgrp)))
    return out


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group `pgid`.

    Reads /proc rather than probing with killpg(pgid, 0): zombies still count for kill(),
    and PID 1 in a container does not always reap the grandchildren it inherits.
    """
    if not os.path.isdir("/proc"):  # not Linux: the best we have counts zombies too
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    return [pid for pid, _, pgrp in live_processes() if pgrp == pgid]


def children_of(pid: int) -> list[int]:
    """Live direct children of `pid` (Linux; [] elsewhere). For children that leave our
    process group, as every Postgres backend does (each calls setsid)."""
    if not os.path.isdir("/proc"):
        return []
    return [child for child, ppid, _ in live_processes() if ppid == pid]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the whole process group, wait up to `timeout`, then SIGKILL what is left.

        Returns the leader's exit code. Safe to call more than once.
        """
        pgid = self.proc.pid  # a session or a group of its own: the leader's pid is the group id
        if self.proc.poll() is not None and not group_members(pgid):
            return self.proc.returncode  # all gone: signalling now could hit a reused id
        self._signal_group(pgid, signal.SIGTERM)
        if not self._wait_group(pgid, timeout):
            self._signal_group(pgid, signal.SIGKILL)
            self._wait_group(pgid, 5.0)
        return self.proc.poll()

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def _wait_group(self, pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            # Reaped, not just a zombie in /proc: a multi-threaded leader (Go, Python) shows
            # state Z while its other threads are still tearing down.
            reaped = self.proc.poll() is not None
            if reaped and not group_members(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _pdeathsig_preexec(sig: int, nice: int = 0, cpus: Collection[int] | None = None) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return (lambda: os.nice(nice)) if nice else None  # noqa: E731
    # Resolve prctl before fork: the child should do as little as possible.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        if nice:  # before exec: every thread the child starts inherits it
            os.nice(nice)
        if cpus:
            os.sched_setaffinity(0, cpus)
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def spawn(
    name: str,
    argv: Sequence[str | os.PathLike],
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    cwd: Path | None = None,
    user: str | None = None,
    death_signal: int = signal.SIGTERM,
    nice: int = 0,
    cpus: Collection[int] | None = None,
    session: bool = True,
) -> Child:
    """Start `argv` in a session of its own (`session` False: a process group of its own);
    stdout and stderr go to `log_path` (appended) if given.

    `death_signal` reaches the child when the thread that spawned it exits (Linux ties
    PR_SET_PDEATHSIG to the thread), so spawn from a long-lived thread, not a pool worker.
    Grandchildren do not inherit it; stop() and their own parent watch cover them.
    `user` runs the child as that user (the preexec hook runs after the uid change, which
    matters because changing credentials clears the death signal). `nice` > 0 runs it at a
    lower CPU priority. `cpus`: the cores it may run on (Linux), whatever ours are.

    `session` False: a process group of its own in our session, not a session of its own.
    Where the kernel groups scheduling by session (autogroup, on in most distributions),
    each session shares the CPU as one and `nice` orders only the processes inside one:
    a stack whose processes rank one another (vLLM below the request path) keeps them in
    one session, or a niced vLLM still takes a whole session's share from the API.
    """
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    # The child holds its own copy of the log's descriptor: ours closes once it has started.
    with open(log_path, "ab") if log_path is not None else contextlib.nullcontext() as log:
        proc = subprocess.Popen(
            [os.fspath(a) for a in argv],
            env=dict(env) if env is not None else None,
            cwd=cwd,
            **as_user(user),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=session,
            process_group=None if session else 0,
            preexec_fn=_pdeathsig_preexec(death_signal, nice, cpus),
        )
    return Child(name, proc, log_path)


def as_user(user: str | None) -> dict:
    """Popen keywords that run a child as `user` with that user's group and no others.

    Without the group change the child keeps root's groups, and a root-owned 0700
    directory then denies it even the access 'others' have.
    """
    if user is None:
        return {}
    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


def notify_ready() -> None:
    """Tell this process's supervisor that it serves now (sd_notify's READY=1, as a file):
    its pid, written atomically to the file BALLAST_READY_FILE names, if set. A crash after
    this is an incident to restart from, not a crash loop (policy/restarts.py)."""
    path = os.environ.get(READY_FILE_ENV)
    if path:
        tmp = Path(f"{path}.{os.getpid()}")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, path)


def freeze_heap() -> None:
    """A serving process's heap so far (modules, settings, the model's frontend) lives as
    long as the process: out of the garbage collector's sight from here on, so that a full
    collection walks what requests made since, not everything. Under load the API's full
    collections took the event loop for 120-450 ms each, a tail on every stream it relays."""
    gc.freeze()


def said_ready(path: Path, pid: int) -> bool:
    try:
        return path.read_text().strip() == str(pid)
    except OSError:
        return False


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    child: Child | None = None,
    interval: float = 0.1,
) -> None:
    """Poll `predicate` until true; raise TimeoutError naming `what` (and the child's log).

    With `child`, fail at once if it exits instead of waiting out the timeout.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if child is not None and not child.alive:
            raise RuntimeError(
                f"{child.name} exited with code {child.proc.returncode} while waiting for "
                f"{what}{_log_hint(child)}"
            )
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}{_log_hint(child)}")
        time.sleep(interval)


def _log_hint(child: Child | None) -> str:
    if child is None or child.log_path is None:
        return ""
    return f"; log: {child.log_path}\n--- last lines ---\n{child.log_tail()}"
