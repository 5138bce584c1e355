"""`ballast chaos`: faults injected into `ballast up` as shipped, under load, and then the
journal's invariants checked in SQL.

One stack (bench/stack.py: a fresh data dir, embedded Postgres and Temporal, default
settings), its object store on a small tmpfs where this machine lets us mount one, so that
"disk full" is the kernel's own ENOSPC. Throughout, a batch pump keeps two batches in
flight through the Batches API, and a chat client streams a chat every ~1.2 s. Faults come
in phases, in this order, each waited out before the next:

- engine: SIGKILL of the engine worker's process group (vLLM with it) at a random moment;
- postgres: the embedded Postgres stopped every few seconds, by fast shutdown and by
  SIGKILL of its process group in turn;
- temporal: SIGKILL of the Temporal dev server;
- api: SIGKILL of the API while a chat streams from it;
- store: the object store's filesystem full while a batch finalizes, then space freed.

A fault's recovery time runs from the fault until the service works again: the supervisor
has the process back (it says so), /healthz answers 200 and the journal shows the path
working (engine: batch tokens; Postgres: any write; Temporal: a request's outcome
journaled through its workflow). (The store's runs from the space freed
to the batch completed.) At the end the load stops, every batch ends, and then must hold:
every invariant of journal/invariants.py, at rest; each batch's output and error files
hold each of its items exactly once; every chat the client saw is journaled; no response
was a 500 or hung.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg

from ballast import procs
from ballast.settings import Settings
from bench.stack import Stack, ballast_up
from journal.db import libpq_url
from journal.invariants import Finding, audit, report

FAULTS = ("engine", "postgres", "temporal", "api", "store")
FINAL = ("completed", "failed", "cancelled", "expired")
RECOVERY_TIMEOUT_S = 300
# What shows each fault's path working again, in the journal: the engine generating batch
# items; Postgres taking writes (any); workflows running activities (a request's outcome
# journaled by its workflow, or by the reconciler's).
BATCH_PROGRESS = ("item_chunk", "item_completed")
ANY_WRITE = ("item_chunk", "item_completed", "item_preempted", "request_served", "request_finished", "engine_joined")
WORKFLOW_WRITE = ("request_finished",)
STORE_MIB = 64


@dataclass
class Plan:
    """How many of each fault, and the batch load they land on."""

    engine: int = 2
    postgres: int = 3
    temporal: int = 1
    api: int = 1
    store: int = 1
    items: int = 32  # per batch
    max_tokens: int = 64
    seed: int = 7

    @classmethod
    def for_minutes(cls, minutes: float) -> Plan:
        """About `minutes` of faults on this machine, 70 % of them engine kills: one costs
        ~30 s (a restart loads vLLM), a Postgres restart ~5 s, the others ~10-15 s. 15
        minutes: 21 engine kills."""
        s, m = minutes * 60, minutes
        return cls(engine=max(2, round(s * 0.7 / 30)), postgres=max(3, round(s * 0.15 / 5)),
                   temporal=max(1, round(m / 4)), api=max(1, round(m / 4)), store=max(1, round(m / 8)))


@dataclass
class Injection:
    fault: str
    at: float  # wall clock
    how: str
    recovered_s: float | None = None
    note: str = ""
    steps: dict[str, float] = field(default_factory=dict)  # seconds from the fault to each step of recovery


@dataclass
class Call:
    """A chat (every one), or another API call that did not succeed."""

    phase: str
    what: str  # chat | upload | batch | poll
    outcome: str  # ok | unavailable (503 + Retry-After) | refused (other 4xx) | error (5xx) | down | broken | hung
    status: int | None = None
    request_id: str | None = None


@dataclass
class Report:
    plan: Plan
    injections: list[Injection] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    batches: dict[str, str] = field(default_factory=dict)  # id: final status
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the files and the client saw
    store: str = ""  # how the store was filled, or why it could not be
    batch_items: int = 0
    chats_journaled: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        out = list(self.problems)
        out += [f"invariant {f.check.name}: {f.violations} violations" for f in self.findings if not f.ok]
        out += [f"{i.fault} at {i.at:.1f} ({i.how}) not recovered: {i.note}" for i in self.injections
                if i.recovered_s is None]
        for fault in FAULTS:
            if (n := sum(i.fault == fault for i in self.injections)) < getattr(self.plan, fault):
                out.append(f"{fault}: {n} of {getattr(self.plan, fault)} faults injected")
        bad = Counter((c.phase, c.what, c.outcome) for c in self.calls
                      if c.outcome in ("error", "hung") or (c.outcome == "down" and c.phase != "api"))
        out += [f"{n} × {what} {outcome} during {phase}" for (phase, what, outcome), n in sorted(bad.items())]
        return out

    def summary(self) -> dict:
        out: dict = {}
        for fault in FAULTS:
            inj = [i for i in self.injections if i.fault == fault]
            rec = sorted(i.recovered_s for i in inj if i.recovered_s is not None)
            calls = Counter(f"{c.what} {c.outcome}" for c in self.calls if c.phase == fault)
            out[fault] = dict(injected=len(inj), recovered=len(rec),
                              recovery_p50_s=_pct(rec, 50), recovery_p99_s=_pct(rec, 99),
                              recovery_max_s=rec[-1] if rec else None, calls=dict(sorted(calls.items())))
        out["batches"] = dict(Counter(self.batches.values()))
        out["batch_items"] = self.batch_items
        out["chats_journaled"] = self.chats_journaled
        out["server_errors"] = sum(c.outcome in ("error", "hung") for c in self.calls)
        out["invariants"] = {f.check.name: f.violations for f in self.findings}
        out["failures"] = self.failures()
        out["store_how"] = self.store
        return out


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))], 2)


class Chaos:
    def __init__(self, stack: Stack, data_dir: Path, model: str, plan: Plan, store: Path | None, log=print):
        self.stack, self.data, self.model, self.plan, self.store_dir = stack, data_dir, model, plan, store
        self.log = log
        self.rng = random.Random(plan.seed)
        self.report = Report(plan)
        self.phase = "start"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.submitted: dict[str, list[str]] = {}  # batch id: its custom ids
        self.prompts: dict[str, str] = {}  # custom id: prompt
        self.seen_ids: list[str] = []  # every chat id the client was told
        self.outputs: dict[str, str] = {}  # custom id: the text its batch's output file gives
        self.up_log = data_dir / "up.log"

    # -- load ---------------------------------------------------------------------------

    def _call(self, what: str, r: httpx.Response) -> str:
        if r.status_code < 400:
            outcome = "ok"
        elif r.status_code == 503 and r.headers.get("retry-after"):
            outcome = "unavailable"
        elif r.status_code < 500:
            outcome = "refused"
        else:
            outcome = "error"
        if outcome != "ok":
            self._record(Call(self.phase, what, outcome, r.status_code))
        return outcome

    def _record(self, call: Call) -> None:
        with self.lock:
            self.report.calls.append(call)

    def _http(self, what: str, fn: Callable[[httpx.Client], httpx.Response],
              api: httpx.Client) -> httpx.Response | None:
        try:
            r = fn(api)
        except httpx.TimeoutException:
            self._record(Call(self.phase, what, "hung"))
            return None
        except httpx.TransportError:
            self._record(Call(self.phase, what, "down"))
            return None
        return r if self._call(what, r) == "ok" else None

    def _client(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=str(self.stack.api.base_url), headers=dict(self.stack.api.headers),
                            timeout=timeout)

    def pump(self) -> None:
        """Two batches in flight, always: a new one as soon as one ends."""
        attempt = 0
        with self._client() as api:
            while not self.stop.is_set():
                running = [b for b, s in self.report.batches.items() if s not in FINAL]
                for bid in running:
                    self.report.batches[bid] = self._status(api, bid)
                if len(running) < 2:
                    # Each attempt's items have ids of their own: a batch made whose answer
                    # was lost runs all the same, beside the one the next attempt makes.
                    self._submit(api, attempt)
                    attempt += 1
                self.stop.wait(0.5)

    def _submit(self, api: httpx.Client, attempt: int) -> None:
        if (up := self._upload(api, f"b{attempt}")) is not None:
            self._create(api, *up)

    def _upload(self, api: httpx.Client, tag: str) -> tuple[str, list[str]] | None:
        """A batch input file of `plan.items` chats: (its id, their custom ids)."""
        ids = [f"{tag}-{i}" for i in range(self.plan.items)]
        lines = []
        for cid in ids:
            self.prompts[cid] = f"chaos {cid}: tell me about the {self.rng.choice(['sea', 'hills', 'rain', 'stars'])}"
            body = dict(model=self.model, messages=[dict(role="user", content=self.prompts[cid])],
                        max_tokens=self.plan.max_tokens, temperature=0, ignore_eos=True)
            lines.append(json.dumps(dict(custom_id=cid, method="POST", url="/v1/chat/completions", body=body)))
        up = self._http("upload", lambda a: a.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines) + "\n")},
                                                   data={"purpose": "batch"}), api)
        return None if up is None else (up.json()["id"], ids)

    def _create(self, api: httpx.Client, fid: str, ids: list[str]) -> str | None:
        made = self._http("batch", lambda a: a.post("/v1/batches", json=dict(
            input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")), api)
        if made is None:
            return None  # a batch made whose answer was lost is still checked: the end reads every batch
        bid = made.json()["id"]
        with self.lock:
            self.submitted[bid] = ids
            self.report.batches[bid] = made.json()["status"]
        return bid

    def chats(self) -> None:
        with self._client(timeout=60) as api:
            # A chat every ~1.2 s: steady interactive use, not a surge (a surge, by design,
            # keeps batch at its floor, which would hide each fault's own recovery).
            while not self.stop.wait(self.rng.uniform(0.5, 2.0)):
                self._chat(api, max_tokens=16)

    def _chat(self, api: httpx.Client, max_tokens: int, on_chunk: Callable[[int], None] | None = None) -> None:
        body = dict(model=self.model, messages=[dict(role="user", content="are you there?")], max_tokens=max_tokens,
                    stream=True)
        rid, chunks, done = None, 0, False
        try:
            with api.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    self._call("chat", r)
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        rid = rid or json.loads(line[6:]).get("id")
                        chunks += 1
                        if on_chunk:
                            on_chunk(chunks)
        except httpx.TimeoutException:
            self._record(Call(self.phase, "chat", "hung", request_id=rid))
        except httpx.TransportError:
            self._record(Call(self.phase, "chat", "broken" if rid else "down", request_id=rid))
        else:
            self._record(Call(self.phase, "chat", "ok" if done else "broken", 200, rid))
        if rid:
            with self.lock:
                self.seen_ids.append(rid)

    # -- faults -------------------------------------------------------------------------

    def _pid(self, match: str) -> int:
        for pid in procs.children_of(self.stack.pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if match in f.read().replace(b"\0", b" ").decode():
                    return pid
        raise RuntimeError(f"`ballast up` runs no {match!r}")

    def _said(self, text: str) -> int:
        return self.up_log.read_text(errors="replace").count(text)

    def _journaled_since(self, wall: float, types: tuple[str, ...]) -> bool:
        with contextlib.suppress(psycopg.Error), psycopg.connect(libpq_url(self.stack.db_url), connect_timeout=3) as c:
            row = c.execute("SELECT EXISTS (SELECT FROM events WHERE type = ANY(%s) "
                            "AND committed_at > to_timestamp(%s))", (list(types), wall)).fetchone()
            return bool(row and row[0])
        return False

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.stack.api.base_url}/healthz", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def _recover(self, inj: Injection, back: str, before: int, progress: tuple[str, ...] = ()) -> None:
        """Wait until the supervisor says `back` once more, /healthz is 200 and, if
        `progress` names event types, the journal records one of them after that."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        steps: list[tuple[str, Callable[[], bool]]] = [("back", lambda: self._said(back) > before),
                                                       ("healthy", self._healthy)]
        if progress:
            steps.append(("progress", lambda: self._journaled_since(inj.at + inj.steps["healthy"], progress)))
        for name, done in steps:
            while not done():
                if time.monotonic() > deadline:
                    inj.note = f"not {name} {RECOVERY_TIMEOUT_S} s after the fault"
                    return
                time.sleep(0.1)
            inj.steps[name] = round(time.time() - inj.at, 2)
        inj.recovered_s = inj.steps[steps[-1][0]]

    def _kill(self, fault: str, match: str, how: str, group: bool = True) -> Injection:
        pid = self._pid(match)
        inj = Injection(fault, time.time(), how)
        sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGINT
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
        self.report.injections.append(inj)
        return inj

    def engine(self, n: int) -> None:
        time.sleep(self.rng.uniform(0, 8))  # a random moment of the batches' run
        before = self._said("engine worker is serving again")
        inj = self._kill("engine", "ballast.cli worker engine", "SIGKILL")
        self._recover(inj, "engine worker is serving again", before, BATCH_PROGRESS)

    def postgres(self, n: int) -> None:
        time.sleep(self.rng.uniform(1, 4))  # every few seconds
        before = self._said("embedded postgres restarted")
        # In turn: a clean restart (fast shutdown of the postmaster) and a crash.
        inj = (self._kill("postgres", " -D ", "SIGKILL") if n % 2 else
               self._kill("postgres", " -D ", "fast shutdown", group=False))
        self._recover(inj, "embedded postgres restarted", before, ANY_WRITE)

    def temporal(self, n: int) -> None:
        time.sleep(self.rng.uniform(0, 8))
        before = self._said("temporal dev server restarted")
        inj = self._kill("temporal", "start-dev", "SIGKILL")
        self._recover(inj, "temporal dev server restarted", before, WORKFLOW_WRITE)

    def api(self, n: int) -> None:
        """A chat streaming when the API dies: its id must still be journaled."""
        before = self._said("api is serving again")
        killed: list[Injection] = []

        def kill_at(chunks: int) -> None:
            if chunks == 3 and not killed:
                killed.append(self._kill("api", "ballast.cli api", "SIGKILL mid-stream"))

        with self._client() as api:
            self._chat(api, max_tokens=400, on_chunk=kill_at)
        if not killed:
            raise RuntimeError("the chat to kill the API under never streamed 3 chunks")
        self._recover(killed[0], "api is serving again", before)

    def store(self, n: int) -> None:
        """The store full while a batch finalizes: it must wait (retrying) or fail with a
        reason, never complete without its files; once space is back, it completes."""
        if self.store_dir is None:
            self.report.problems.append(f"store fault not injected: {self.report.store}")
            return
        with self._client() as api:
            # Its input is stored first; then the store fills; then the batch is made, so
            # it cannot finalize before the store is full.
            deadline = time.monotonic() + RECOVERY_TIMEOUT_S
            while (up := self._upload(api, f"s{n}")) is None and time.monotonic() < deadline:
                time.sleep(1)
            if up is None:
                raise RuntimeError("no input file could be stored for the store fault")
            filler = self.store_dir / f"chaos-fill-{n}"
            inj = Injection("store", time.time(), "filesystem full (ENOSPC)")
            _fill(filler)
            self.report.injections.append(inj)
            while (bid := self._create(api, *up)) is None and time.monotonic() < deadline:
                time.sleep(1)
            if bid is None:
                raise RuntimeError("the batch for the store fault could not be made")
            while (status := self._status(api, bid)) != "finalizing":
                if status in FINAL or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            time.sleep(6)  # a few attempts fail (backoff 1 s, 2 s, ...)
            held = self._status(api, bid)
            if held != "finalizing":
                self.report.problems.append(f"store full: batch {bid} was {held!r}, not waiting in 'finalizing'")
            filler.unlink()
            freed = time.time()
            while (status := self._status(api, bid)) not in FINAL:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            inj.recovered_s = round(time.time() - freed, 2) if status == "completed" else None
            inj.note = f"batch {bid}: {held} while full, then {status}"

    def _status(self, api: httpx.Client, bid: str) -> str:
        r = self._http("poll", lambda a: a.get(f"/v1/batches/{bid}"), api)
        return r.json()["status"] if r is not None else "unknown"

    # -- the end ------------------------------------------------------------------------

    def settle(self, at_rest_timeout: float) -> None:
        """Every batch ended; the invariants at rest (waited for: a request no API reported
        is journaled after BALLAST_UNREPORTED_AFTER_S); files and chats checked."""
        self.phase = "end"
        with self._client() as api:
            deadline = time.monotonic() + RECOVERY_TIMEOUT_S
            for bid in list(self.report.batches):
                while (status := self._status(api, bid)) not in FINAL and time.monotonic() < deadline:
                    time.sleep(0.5)
                self.report.batches[bid] = status
            deadline = time.monotonic() + at_rest_timeout
            findings = audit(self.stack.db_url)
            while not all(f.ok for f in findings) and time.monotonic() < deadline:
                time.sleep(2)
                findings = audit(self.stack.db_url)
            self.report.findings = findings
            self._check_files(api)
        self._check_chats()

    def _check_files(self, api: httpx.Client) -> None:
        with psycopg.connect(libpq_url(self.stack.db_url)) as c:
            rows = c.execute("SELECT id, status, output_file_id, error_file_id FROM batches").fetchall()
            for bid, status, *files in rows:
                expected = Counter(cid for (cid,) in c.execute(
                    "SELECT custom_id FROM batch_items WHERE batch_id = %s", (bid,)))
                self.report.batch_items += sum(expected.values())
                if status != "completed":
                    self.report.problems.append(f"batch {bid} ended {status}")
                    continue
                got: Counter[str] = Counter()
                for fid in filter(None, files):
                    r = api.get(f"/v1/files/{fid}/content")
                    if r.status_code != 200:
                        self.report.problems.append(f"batch {bid}: file {fid} unreadable ({r.status_code})")
                        continue
                    for line in map(json.loads, r.text.splitlines()):
                        got[line["custom_id"]] += 1
                        if (resp := line["response"]) and resp["status_code"] == 200:
                            self.outputs[line["custom_id"]] = resp["body"]["choices"][0]["message"]["content"]
                if got != expected:
                    lost, twice = expected - got, got - expected
                    self.report.problems.append(f"batch {bid}: lost {sorted(lost)[:5]}, duplicated {sorted(twice)[:5]}")

    def _check_chats(self) -> None:
        with psycopg.connect(libpq_url(self.stack.db_url)) as c:
            keys = [f"request:{rid}:finished" for rid in self.seen_ids]
            found = {k for (k,) in c.execute("SELECT idempotency_key FROM events WHERE idempotency_key = ANY(%s)",
                                             (keys,))}
        self.report.chats_journaled = len(found)
        if missing := [k for k in keys if k not in found]:
            self.report.problems.append(f"{len(missing)} chats the client saw are not journaled: {missing[:5]}")


def _fill(path: Path) -> None:
    """Write zeros to `path` until the filesystem is full."""
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    with open(path, "ab", buffering=0) as f:  # the last partial block
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)


@contextlib.contextmanager
def tmpfs(mib: int) -> Iterator[tuple[Path | None, str]]:
    """A tmpfs of `mib` MiB for the object store, so that full means ENOSPC; (None, why)
    where this machine does not let us mount one."""
    d = Path(tempfile.mkdtemp(prefix="ballast-chaos-store-"))
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(d)],
                              capture_output=True, text=True)
    except FileNotFoundError as err:
        done = subprocess.CompletedProcess([], 1, "", str(err))
    if done.returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        yield None, f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})"
        return
    try:
        yield d, f"a {mib} MiB tmpfs, filled to ENOSPC"
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def run(settings: Settings, plan: Plan, log=print, at_rest_timeout: float | None = None, **extra_env: str) -> Chaos:
    """The whole run; the Chaos, its report filled."""
    from engine.models import resolve_model

    model = resolve_model(settings).name
    with tmpfs(STORE_MIB) as (store, how), contextlib.ExitStack() as cleanup:
        data = Path(tempfile.mkdtemp(prefix="ballast-chaos-"))  # short: Postgres's socket path
        cleanup.callback(shutil.rmtree, data, ignore_errors=True)
        env = dict(extra_env)
        if store is not None:
            env["BALLAST_OBJECT_STORE"] = store.as_uri()
        log(f"• starting `ballast up` in {data}; object store: {how}")
        with ballast_up(settings, data, **env) as stack:
            chaos = Chaos(stack, data, model, plan, store, log)
            chaos.report.store = how
            load = [threading.Thread(target=chaos.pump, daemon=True), threading.Thread(target=chaos.chats, daemon=True)]
            for t in load:
                t.start()
            try:
                for fault in FAULTS:
                    count = getattr(plan, fault)
                    chaos.phase = fault
                    for n in range(count):
                        getattr(chaos, fault)(n)
                        last = chaos.report.injections[-1] if chaos.report.injections else None
                        if last is not None and last.fault == fault:
                            log(f"  {fault} {n + 1}/{count}: {last.how}; recovered in {last.recovered_s} s "
                                f"{last.steps or ''} {last.note}".rstrip())
            finally:
                chaos.stop.set()
                for t in load:
                    t.join(120)
            log("• load stopped; waiting for every batch to end and the journal to come to rest")
            chaos.settle(at_rest_timeout if at_rest_timeout is not None else settings.unreported_after_s + 120)
        return chaos


def main(settings: Settings, minutes: float | None = None, plan: Plan | None = None) -> int:
    plan = plan or Plan.for_minutes(minutes or 15)
    print(f"ballast chaos: {plan}")
    t0 = time.monotonic()
    chaos = run(settings, plan)
    r = chaos.report
    print(f"\nran {time.monotonic() - t0:.0f} s\n")
    print(report(r.findings))
    print(json.dumps(r.summary(), indent=2))
    for inj in r.injections:
        if inj.recovered_s is None:
            print(f"NOT RECOVERED: {inj}")
    rec = [i.recovered_s for i in r.injections if i.recovered_s is not None]
    if rec:
        print(f"recovery, all faults: median {statistics.median(rec):.1f} s over {len(rec)}")
    print("\nOK" if r.ok else "\nFAILED:\n  " + "\n  ".join(r.failures()))
    return 0 if r.ok else 1

