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
every invariant of journal/invariants.py, at rest; every chat the client saw is
journaled; no response was a 500 or hung.

The batches and chats are judged from the client's side, by what it sent and what came
back through the API, never by the product's own tables:
- each input file's lines, as the client wrote them, are kept; every batch the API lists
  from one of them must complete with each of that file's custom_ids exactly once in its
  output and error files (none extra), and request_counts equal to those files;
- every greedy item's text must equal vLLM's own output for the very line the client sent:
  after the run, the lines go through vLLM's batch runner (`vllm run-batch`) in a process
  of its own, on the same model and engine settings;
- a stream counts as a good chat only when it ends with a finish_reason and `[DONE]` and no
  error event; one that ends otherwise (an error event, cut, dropped) is "interrupted"
  when its life overlaps an injected fault (from the fault until its recovery) and
  "failed", a failure of the run, when it does not.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psycopg

from ballast import procs
from bench.stack import Stack, ballast_up
from bench.stats import p50, pct
from config import CPU_KV_CACHE_GIB, Settings
from config.database import libpq_url
from journal.invariants import Finding, audit, examined, passed, report

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
ORACLE_TIMEOUT_S = 900


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
    until: float | None = None  # wall clock when it was recovered from

    def window(self) -> tuple[float, float]:
        """When it was in effect: from the fault until its recovery (open while not recovered)."""
        return self.at, self.until if self.until is not None else float("inf")


@dataclass
class Call:
    """A chat (every one), or another API call that did not succeed."""

    phase: str
    what: str  # chat | upload | batch | poll
    # ok | unavailable (503 + Retry-After) | refused (other 4xx) | error (5xx) | down | hung; a chat's
    # stream that did not complete: cut until judged, then interrupted (by a fault) or failed.
    outcome: str
    status: int | None = None
    request_id: str | None = None
    span: tuple[float, float] = (0.0, 0.0)  # a chat's wall clock, from its request to its stream's end
    ending: str = ""  # a chat's stream: see Stream.ending; "no answer" where the connection failed first
    error: str = ""  # its error event's code (or type)


@dataclass
class Stream:
    """A chat's stream as the client reads it, one SSE line at a time."""

    request_id: str | None = None
    events: int = 0  # data events, [DONE] not counted
    finish_reason: str | None = None
    error: dict | None = None  # the error event's body
    done: bool = False  # `data: [DONE]` read
    dropped: bool = False  # the connection failed under it

    def feed(self, line: str) -> bool:
        """Take one line; True when it was a data event."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        self.events += 1
        event = json.loads(data)
        if "error" in event:
            self.error = event["error"] if isinstance(event["error"], dict) else dict(message=str(event["error"]))
            return True
        self.request_id = self.request_id or event.get("id")
        for choice in event.get("choices") or ():
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True

    @property
    def ending(self) -> str:
        """complete (a finish_reason, then [DONE], no error) | error event | dropped (the
        connection failed) | cut (it ended without a finish_reason or [DONE])."""
        if self.error is not None:
            return "error event"
        if self.dropped:
            return "dropped"
        return "complete" if self.done and self.finish_reason else "cut"


def read_stream(lines: Iterable[str]) -> Stream:
    stream = Stream()
    for line in lines:
        stream.feed(line)
    return stream


def judge_stream(ending: str, span: tuple[float, float], faults: Iterable[tuple[float, float]]) -> str:
    """A chat's outcome: ok when its stream completed; otherwise interrupted when a fault was
    in effect at some moment of its life, failed when none was."""
    if ending == "complete":
        return "ok"
    start, end = span
    return "interrupted" if any(a <= end and start <= b for a, b in faults) else "failed"


@dataclass
class Accounting:
    """The client's own record of what it submitted, against what came back through the API."""

    files_uploaded: int = 0  # input files the API gave the client an id for
    batches_answered: int = 0  # batches whose creation the client got an answer for
    batches_listed: int = 0  # batches the API lists from the client's files
    batches_unanswered: int = 0  # of those, made while the client's create call got no answer
    batches_missing: int = 0  # answered, yet not listed
    batches_foreign: int = 0  # listed from a file the client never uploaded
    batches_completed: int = 0
    batches_counts_equal: int = 0  # request_counts equal to the lines sent and those that came back
    items_submitted: int = 0  # lines of the listed batches' input files, as the client wrote them
    items_once: int = 0  # submitted custom_ids found exactly once in output + error
    items_lost: int = 0  # submitted and found in neither
    items_duplicated: int = 0  # copies beyond the first
    items_extra: int = 0  # lines with a custom_id their batch's file never held
    items_output: int = 0  # lines of the output files (status 200)
    items_error: int = 0  # lines of the error files


@dataclass
class Greedy:
    """Greedy items' texts against vLLM's own for the same lines."""

    how: str = "not checked"
    checked: int = 0
    equal: int = 0
    differ: int = 0
    oracle_missing: int = 0  # lines vLLM gave no text for


@dataclass
class Report:
    plan: Plan
    injections: list[Injection] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    batches: dict[str, str] = field(default_factory=dict)  # id: final status
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the files and the client saw
    store: str = ""  # how the store was filled, or why it could not be
    client: Accounting = field(default_factory=Accounting)
    greedy: Greedy = field(default_factory=Greedy)
    chats_journaled: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        out = list(self.problems)
        out += [f"invariant {f.check.name}: {f.violations} violations" + (f" (could not run: {f.error})" if f.error
                                                                             else "")
                for f in self.findings if not f.ok]
        if not examined(self.findings):  # an audit that saw nothing (or none ran) proves nothing
            out.append("invariants: no rows examined at all")
        out += [f"{i.fault} at {i.at:.1f} ({i.how}) not recovered: {i.note}" for i in self.injections
                if i.recovered_s is None]
        for fault in FAULTS:
            if (n := sum(i.fault == fault for i in self.injections)) < getattr(self.plan, fault):
                out.append(f"{fault}: {n} of {getattr(self.plan, fault)} faults injected")
        bad = Counter((c.phase, c.what, c.outcome) for c in self.calls
                      if c.outcome in ("error", "hung", "failed", "cut") or (c.outcome == "down" and c.phase != "api"))
        out += [f"{n} × {what} {outcome} during {phase}" for (phase, what, outcome), n in sorted(bad.items())]
        return out

    def judge_chats(self) -> None:
        """Each chat whose stream did not complete: interrupted or failed, by the faults' windows."""
        windows = [i.window() for i in self.injections]
        for c in self.calls:
            if c.what == "chat" and c.outcome == "cut":
                c.outcome = judge_stream(c.ending, c.span, windows)

    def summary(self) -> dict:
        out: dict = {}
        for fault in FAULTS:
            inj = [i for i in self.injections if i.fault == fault]
            rec = sorted(i.recovered_s for i in inj if i.recovered_s is not None)
            calls = Counter(f"{c.what} {c.outcome}" for c in self.calls if c.phase == fault)
            out[fault] = dict(injected=len(inj), recovered=len(rec),
                              recovery_p50_s=round(pct(rec, 50), 2) if rec else None,
                              recovery_p99_s=round(pct(rec, 99), 2) if rec else None,
                              recovery_max_s=rec[-1] if rec else None, calls=dict(sorted(calls.items())))
        out["batches"] = dict(Counter(self.batches.values()))
        out["client"] = asdict(self.client)
        out["greedy"] = asdict(self.greedy)
        chats = [c for c in self.calls if c.what == "chat"]
        out["chats"] = dict(sorted(Counter(c.outcome for c in chats).items()))
        out["chat_endings"] = dict(sorted(Counter(f"{c.outcome}: {c.ending}" + (f" ({c.error})" if c.error else "")
                                                  for c in chats if c.outcome != "ok").items()))
        out["chats_journaled"] = self.chats_journaled
        out["server_errors"] = sum(c.outcome in ("error", "hung") for c in self.calls)
        out["invariants"] = {f.check.name: f.violations for f in self.findings}
        out["failures"] = self.failures()
        out["store_how"] = self.store
        return out



class Chaos:
    def __init__(self, stack: Stack, data_dir: Path, model: str, plan: Plan, store: Path | None, log=print):
        self.stack, self.data, self.model, self.plan, self.store_dir = stack, data_dir, model, plan, store
        self.log = log
        self.rng = random.Random(plan.seed)
        self.report = Report(plan)
        self.phase = "start"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        # The client's own record: each input file it stored (file id: its lines, as sent),
        # and each batch whose creation it got an answer for (batch id: its input file id).
        self.uploads: dict[str, list[dict]] = {}
        self.made: dict[str, str] = {}
        self.tags = itertools.count()  # every upload's custom_ids are its own
        self.seen_ids: list[str] = []  # every chat id the client was told
        self.outputs: dict[tuple[str, str], str] = {}  # (batch id, custom id): the text its output file gives
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
        with self._client() as api:
            while not self.stop.is_set():
                running = [b for b, s in self.report.batches.items() if s not in FINAL]
                for bid in running:
                    self.report.batches[bid] = self._status(api, bid)
                if len(running) < 2 and (fid := self._upload(api, "b")) is not None:
                    self._create(api, fid)
                self.stop.wait(0.5)

    def _upload(self, api: httpx.Client, prefix: str) -> str | None:
        """A batch input file of `plan.items` chats; its id, its lines kept as sent.

        Each upload's items have ids of their own: a batch made whose answer was lost runs
        all the same, beside the one the next attempt makes."""
        tag = f"{prefix}{next(self.tags)}"
        lines = []
        for i in range(self.plan.items):
            prompt = f"chaos {tag}-{i}: tell me about the {self.rng.choice(['sea', 'hills', 'rain', 'stars'])}"
            body = dict(model=self.model, messages=[dict(role="user", content=prompt)],
                        max_tokens=self.plan.max_tokens, temperature=0, ignore_eos=True)
            lines.append(dict(custom_id=f"{tag}-{i}", method="POST", url="/v1/chat/completions", body=body))
        text = "".join(json.dumps(ln) + "\n" for ln in lines)
        up = self._http("upload", lambda a: a.post("/v1/files", files={"file": ("in.jsonl", text)},
                                                   data={"purpose": "batch"}), api)
        if up is None:
            return None
        with self.lock:
            self.uploads[up.json()["id"]] = lines
        return up.json()["id"]

    def _create(self, api: httpx.Client, fid: str) -> str | None:
        made = self._http("batch", lambda a: a.post("/v1/batches", json=dict(
            input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")), api)
        if made is None:
            return None  # a batch made whose answer was lost is still checked: the end lists every batch
        bid = made.json()["id"]
        with self.lock:
            self.made[bid] = fid
            self.report.batches[bid] = made.json()["status"]
        return bid

    def chats(self) -> None:
        with self._client(timeout=60) as api:
            # A chat every ~1.2 s: steady interactive use, not a surge (a surge, by design,
            # keeps batch at its floor, which would hide each fault's own recovery).
            while not self.stop.wait(self.rng.uniform(0.5, 2.0)):
                self._chat(api, max_tokens=16)

    def _chat(self, api: httpx.Client, max_tokens: int, on_chunk: Callable[[int], None] | None = None,
              **extra) -> Call | None:
        """One streamed chat; its Call (None where the API answered no stream). Its outcome:
        ok only when the stream completed; one that did not is judged at the end (settle),
        against the faults' windows."""
        body = dict(model=self.model, messages=[dict(role="user", content="are you there?")], max_tokens=max_tokens,
                    stream=True, **extra)
        stream, status, hung, started = Stream(), None, False, time.time()
        try:
            with api.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    self._call("chat", r)
                    return None
                status = 200
                for line in r.iter_lines():
                    if stream.feed(line) and on_chunk:
                        on_chunk(stream.events)
        except httpx.TimeoutException:
            hung = True
        except httpx.TransportError:
            stream.dropped = True
        ending = "no answer" if stream.dropped and status is None else stream.ending
        outcome = "hung" if hung else "ok" if ending == "complete" else "cut"
        err = stream.error or {}
        call = Call(self.phase, "chat", outcome, status, stream.request_id, (started, time.time()), ending,
                    str(err.get("code") or err.get("type") or ""))
        self._record(call)
        if stream.request_id:
            with self.lock:
                self.seen_ids.append(stream.request_id)
        return call

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
        inj.until = time.time()

    def _kill(self, fault: str, match: str, how: str, group: bool = True) -> Injection:
        pid = self._pid(match)
        inj = Injection(fault, time.time(), how)
        # "SIGKILL mid-stream" is a SIGKILL too: a SIGINT would let the API finish its streams.
        sig = signal.SIGKILL if how.startswith("SIGKILL") else signal.SIGINT
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
            # ignore_eos: a long answer (most of a 1,024-token context), so that the kill lands
            # while it streams: one that fits in the sockets' buffers can reach a client that
            # is slow to read (a busy machine) before the kill, and complete.
            chat = self._chat(api, max_tokens=960, on_chunk=kill_at, ignore_eos=True)
        if not killed:
            raise RuntimeError("the chat to kill the API under never streamed 3 chunks")
        killed[0].note = f"the chat streaming: {chat.ending if chat else 'no stream'}"
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
            while (up := self._upload(api, "s")) is None and time.monotonic() < deadline:
                time.sleep(1)
            if up is None:
                raise RuntimeError("no input file could be stored for the store fault")
            filler = self.store_dir / f"chaos-fill-{n}"
            inj = Injection("store", time.time(), "filesystem full (ENOSPC)")
            _fill(filler)
            self.report.injections.append(inj)
            while (bid := self._create(api, up)) is None and time.monotonic() < deadline:
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
            if status == "completed":
                inj.recovered_s, inj.until = round(time.time() - freed, 2), time.time()
            inj.note = f"batch {bid}: {held} while full, then {status}"

    def _status(self, api: httpx.Client, bid: str) -> str:
        r = self._http("poll", lambda a: a.get(f"/v1/batches/{bid}"), api)
        return r.json()["status"] if r is not None else "unknown"

    # -- the end ------------------------------------------------------------------------

    def settle(self, at_rest_timeout: float) -> None:
        """Every batch ended; the invariants at rest (waited for: a request no API reported
        is journaled after BALLAST_UNREPORTED_AFTER_S); the batches judged by the client's
        record, each chat the client saw looked up in the journal, the chats judged."""
        self.phase = "end"
        with self._client() as api:
            batches = self._ended(api, time.monotonic() + RECOVERY_TIMEOUT_S)
            deadline = time.monotonic() + at_rest_timeout
            findings = audit(self.stack.db_url)
            while not passed(findings) and time.monotonic() < deadline:
                time.sleep(2)
                findings = audit(self.stack.db_url)
            self.report.findings = findings
            self._check_files(api, batches)
        self._check_chats()
        self.report.judge_chats()

    def _list(self, api: httpx.Client) -> list[dict] | None:
        """Every batch, as the API lists them; None where it did not answer."""
        out: list[dict] = []
        params: dict[str, str | int] = dict(limit=100)
        while True:
            if (r := self._http("list", lambda a: a.get("/v1/batches", params=params), api)) is None:
                return None
            page = r.json()
            out += page["data"]
            if not page["has_more"]:
                return out
            params["after"] = page["last_id"]

    def _ended(self, api: httpx.Client, deadline: float) -> dict[str, dict]:
        """Every batch the API lists (by id), once those made from the client's files have
        ended (or the deadline passed). The list, not the client's ids: a batch made while
        the create call's answer was lost is judged too."""
        while True:
            listed = self._list(api)
            if listed is not None and (time.monotonic() > deadline or all(
                    b["status"] in FINAL for b in listed if b["input_file_id"] in self.uploads)):
                return {b["id"]: b for b in listed}
            if listed is None and time.monotonic() > deadline:
                self.report.problems.append("the API did not list the batches")
                return {}
            time.sleep(0.5)

    def _check_files(self, api: httpx.Client, batches: dict[str, dict]) -> None:
        """Each batch from one of the client's files against the lines the client sent in it."""
        acc = self.report.client
        acc.files_uploaded, acc.batches_answered = len(self.uploads), len(self.made)
        for bid in sorted(set(self.made) - set(batches)):
            acc.batches_missing += 1
            self.report.problems.append(f"batch {bid}: the API made it, yet does not list it")
        for bid, b in sorted(batches.items()):
            if (lines := self.uploads.get(b["input_file_id"])) is None:
                acc.batches_foreign += 1
                self.report.problems.append(f"batch {bid} runs file {b['input_file_id']}, which the client never sent")
                continue
            self.report.batches[bid] = b["status"]
            acc.batches_listed += 1
            acc.batches_unanswered += bid not in self.made
            self._check_batch(api, b, [ln["custom_id"] for ln in lines])

    def _check_batch(self, api: httpx.Client, b: dict, sent: list[str]) -> None:
        """Every custom_id sent exactly once in the output and error files, none other, and
        request_counts equal to what was sent and what came back."""
        acc, bid = self.report.client, b["id"]
        acc.items_submitted += len(sent)
        if b["status"] != "completed":
            acc.items_lost += len(sent)
            self.report.problems.append(f"batch {bid} ended {b['status']}")
            return
        acc.batches_completed += 1
        got: Counter[str] = Counter()
        lines = dict(output=0, error=0)
        for kind in lines:
            if not (fid := b.get(f"{kind}_file_id")):
                continue
            if (r := self._download(api, fid)) is None:
                self.report.problems.append(f"batch {bid}: its {kind} file {fid} could not be read")
                continue
            for line in map(json.loads, r.text.splitlines()):
                got[line["custom_id"]] += 1
                lines[kind] += 1
                if kind == "output" and (resp := line.get("response")) and resp["status_code"] == 200:
                    self.outputs[(bid, line["custom_id"])] = resp["body"]["choices"][0]["message"]["content"]
        acc.items_output += lines["output"]
        acc.items_error += lines["error"]
        want = set(sent)
        lost = [cid for cid in sent if not got[cid]]
        twice = [cid for cid in sent if got[cid] > 1]
        extra = [cid for cid in got if cid not in want]
        acc.items_once += sum(got[cid] == 1 for cid in want)
        acc.items_lost += len(lost)
        acc.items_duplicated += sum(got[cid] - 1 for cid in twice)
        acc.items_extra += sum(got[cid] for cid in extra)
        if lost or twice or extra:
            self.report.problems.append(f"batch {bid}: lost {lost[:5]}, more than once {twice[:5]}, "
                                        f"never sent {extra[:5]}")
        counts = b.get("request_counts") or {}
        said = (counts.get("total"), counts.get("completed"), counts.get("failed"))
        if said == (len(sent), lines["output"], lines["error"]):
            acc.batches_counts_equal += 1
        else:
            self.report.problems.append(f"batch {bid}: request_counts {said} for {len(sent)} lines sent, "
                                        f"{lines['output']} output and {lines['error']} error lines")

    def _download(self, api: httpx.Client, fid: str) -> httpx.Response | None:
        return self._http("download", lambda a: a.get(f"/v1/files/{fid}/content"), api)

    def _check_chats(self) -> None:
        with psycopg.connect(libpq_url(self.stack.db_url)) as c:
            ids = list(self.seen_ids)
            found = {r for (r,) in c.execute("SELECT request_id FROM finished_requests WHERE request_id = ANY(%s)",
                                             (ids,))}
        self.report.chats_journaled = len(found)
        if missing := [i for i in ids if i not in found]:
            self.report.problems.append(f"{len(missing)} chats the client saw are not journaled: {missing[:5]}")

    def check_greedy(self, settings: Settings, workdir: Path) -> None:
        """Each greedy item's text against vLLM's own output for the very line the client sent."""
        g = self.report.greedy
        sent = {ln["custom_id"]: ln for lines in self.uploads.values() for ln in lines}
        mine = [(key, text) for key, text in sorted(self.outputs.items())
                if key[1] in sent and sent[key[1]]["body"].get("temperature") == 0]
        ids = sorted({cid for (_, cid), _ in mine})
        if not ids:
            g.how = "no greedy item came back"
            return
        try:
            texts = vllm_texts(settings, [sent[cid] for cid in ids], workdir)
        except OracleFailed as err:
            g.how = "vLLM's batch runner failed"
            self.report.problems.append(f"vLLM's batch runner, the greedy oracle, failed: {err}")
            return
        g.how = f"vllm run-batch on the {len(ids)} greedy lines the client sent, same model and engine settings"
        wrong = []
        for (bid, cid), text in mine:
            g.checked += 1
            if (want := texts.get(cid)) is None:
                g.oracle_missing += 1
                wrong.append(f"{bid}/{cid}: vLLM gave no text")
            elif want == text:
                g.equal += 1
            else:
                g.differ += 1
                wrong.append(f"{bid}/{cid}: {text[:40]!r} vs vLLM's {want[:40]!r}")
        if wrong:
            self.report.problems.append(f"{len(wrong)} of {g.checked} greedy items are not vLLM's own output, "
                                        f"e.g. {wrong[:3]}")


class OracleFailed(RuntimeError):
    pass


def oracle_flags(settings: Settings) -> list[str]:
    """vLLM's own flags for the model and the engine settings the engine worker starts
    vLLM with (ballast/workers.py, engine/vllm_engine.py)."""
    from engine.model_spec import resolve_model
    from engine.vllm_engine import _dtype

    spec = resolve_model(settings)
    flags = ["--model", spec.path, "--served-model-name", spec.name, "--max-model-len", str(spec.max_model_len),
             "--dtype", _dtype(spec.path), "--seed", "0", "--enforce-eager", "--enable-prefix-caching",
             "--kv-cache-memory-bytes", str(int((settings.kv_cache_gib or CPU_KV_CACHE_GIB) * (1 << 30))),
             "--max-num-seqs", str(settings.max_num_seqs),
             "--long-prefill-token-threshold", str(settings.long_prefill_tokens), "--disable-log-stats"]
    if settings.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    if settings.serve_fine_tuned:
        flags += ["--enable-lora", "--max-loras", str(settings.max_loras),
                  "--max-lora-rank", str(settings.max_lora_rank)]
    return flags


def vllm_texts(settings: Settings, lines: list[dict], workdir: Path) -> dict[str, str]:
    """vLLM's own answers to chat `lines` (custom_id: message text, where it answered 200):
    its batch runner (what `vllm run-batch` runs) in a process of its own."""
    workdir.mkdir(parents=True, exist_ok=True)
    src, dst, log_path = workdir / "in.jsonl", workdir / "out.jsonl", workdir / "vllm.log"
    src.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", "-i", str(src), "-o", str(dst),
           *oracle_flags(settings)]
    with open(log_path, "wb") as log:
        # Its own session, so that vLLM's engine process goes with it.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, VLLM_NO_USAGE_STATS="1"))
    try:
        rc = proc.wait(ORACLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise OracleFailed(f"{'no end in ' + str(ORACLE_TIMEOUT_S) + ' s' if rc is None else f'exit {rc}'}: {tail}")
    texts = {}
    for line in map(json.loads, dst.read_text().splitlines()):
        if (resp := line.get("response") or {}).get("status_code") == 200:
            texts[line["custom_id"]] = resp["body"]["choices"][0]["message"]["content"]
    return texts


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


def engine_env(settings: Settings) -> dict[str, str]:
    """The engine settings of `settings` as the stack's environment: the engine worker runs
    with the very settings the greedy oracle is given."""
    env = dict(BALLAST_MAX_MODEL_LEN=str(settings.max_model_len),
               BALLAST_KV_CACHE_GIB=str(settings.kv_cache_gib or CPU_KV_CACHE_GIB),
               BALLAST_MAX_NUM_SEQS=str(settings.max_num_seqs),
               BALLAST_LONG_PREFILL_TOKENS=str(settings.long_prefill_tokens),
               BALLAST_SERVE_FINE_TUNED=str(settings.serve_fine_tuned).lower(),
               BALLAST_MAX_LORAS=str(settings.max_loras))
    if settings.max_num_batched_tokens:
        env["BALLAST_MAX_NUM_BATCHED_TOKENS"] = str(settings.max_num_batched_tokens)
    return env


def run(settings: Settings, plan: Plan, log=print, at_rest_timeout: float | None = None, oracle: bool = True,
        **extra_env: str) -> Chaos:
    """The whole run; the Chaos, its report filled. With `oracle`, after the stack has
    stopped, the greedy items' texts are checked against vLLM's own."""
    from engine.model_spec import resolve_model

    model = resolve_model(settings).name
    with tmpfs(STORE_MIB) as (store, how), contextlib.ExitStack() as cleanup:
        data = Path(tempfile.mkdtemp(prefix="ballast-chaos-"))  # short: Postgres's socket path
        cleanup.callback(shutil.rmtree, data, ignore_errors=True)
        env = dict(extra_env, **engine_env(settings))
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
        if oracle:
            log("• vLLM's own greedy outputs for the lines the client sent (its batch runner, same engine settings)")
            chaos.check_greedy(settings, data / "oracle")
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
        print(f"recovery, all faults: median {p50(rec):.1f} s over {len(rec)}")
    print("\nOK" if r.ok else "\nFAILED:\n  " + "\n  ".join(r.failures()))
    return 0 if r.ok else 1

