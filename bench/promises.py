"""`ballast bench promises`: mixed completion windows on a fixed fleet asked for more than
it can do. Are the windows Ballast promises kept, and was each refusal a real one?

One `ballast up` (one engine worker), offering short windows (`--windows`, by default
30 s, 60 s and 120 s: a day's windows scaled to a run of minutes). A warm-up batch on the
longest window (the only one a pool with no measured pace promises) lets the engine
worker measure its batch pace; the arrivals are then drawn for `--load` times what that
pace's promised share can do: Poisson arrivals for `--seconds`, each a batch of a size
drawn heavy-tailed (16 × 2^k lines, k geometric) and a window drawn evenly, every line a
chat with `ignore_eos` and `max_tokens` fixed, so its work is known exactly in advance.
The client (the official `openai` client) uploads and creates each batch at its arrival
and records what it was told: accepted, refused at creation (a 400), or refused at
validation (the batch `failed` with `completion_window_unattainable`).

Judged from the journal and the client's record, never from the promise's own figures:
- kept: each accepted batch's final status (`completed` inside its window, or `expired`),
  as the official client reads it; the target is ≥ 99 % kept;
- refusals, replayed: the same arrivals, with each batch's real output tokens (the
  journal's usage for those that ran; lines × max_tokens for those refused), on the pace
  the engine really kept over the run (output tokens ÷ the seconds any batch was in
  progress, from the batches' own timestamps), scheduled earliest deadline first with
  preemption — the optimal order for meeting deadlines on one machine (`replay`). A
  refusal is *false* where, added to the accepted batches, that schedule meets its window
  and every accepted batch's (where the accepted batches alone miss, the fleet was
  overcommitted and no refusal is counted false: the kept share says so). Promises are made on
  BALLAST_BATCH_PROMISE_SHARE (0.8) of the measured pace, so some false refusals are the
  headroom's price: the figure says how many.

Prints a table, then one JSON line with the figures.
"""

from __future__ import annotations

import heapq
import io
import json
import math
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import psycopg

from bench.stack import ballast_up
from bench.stats import p50, pct
from config import Settings
from config.database import libpq_url
from policy.promises import parse_window

SEED = 11
MAX_TOKENS = 256
SHARE = 0.8  # BALLAST_BATCH_PROMISE_SHARE's default, which the stack runs with
REFUSED = "completion_window_unattainable"


@dataclass
class Sent:
    """One batch as the client sent it and what it was told."""

    at: float  # seconds into the arrivals
    lines: int
    window: str
    sent_at: float = 0.0  # unix seconds, the client's clock, as it created the batch
    batch_id: str | None = None  # None: refused at creation
    refusal: str | None = None  # the message of a refusal, at creation or validation
    status: str | None = None  # its final status, as the client read it
    output_tokens: int = 0
    created_at: int = 0
    started: int | None = None  # in_progress_at
    ended: int | None = None

    @property
    def tokens(self) -> int:
        return self.lines * MAX_TOKENS


@dataclass(frozen=True)
class Job:
    arrival: float
    tokens: float
    deadline: float


def replay(jobs: list[Job], rate: float) -> list[bool]:
    """Whether each job meets its deadline when one machine works `rate` tokens a second
    through them earliest deadline first, preempting at each arrival (ties: the earlier
    arrival, then the order given)."""
    order = sorted(range(len(jobs)), key=lambda k: (jobs[k].arrival, k))
    met = [False] * len(jobs)
    ready: list[tuple[float, float, int]] = []  # (deadline, arrival, job): its remaining work in `left`
    left = {k: jobs[k].tokens for k in range(len(jobs))}
    t, i = 0.0, 0
    while i < len(order) or ready:
        if not ready:
            t = max(t, jobs[order[i]].arrival)
        while i < len(order) and jobs[order[i]].arrival <= t:
            k = order[i]
            heapq.heappush(ready, (jobs[k].deadline, jobs[k].arrival, k))
            i += 1
        _, _, k = ready[0]
        nxt = jobs[order[i]].arrival if i < len(order) else math.inf
        finish = t + left[k] / rate
        if finish <= nxt:
            heapq.heappop(ready)
            t = finish
            met[k] = t <= jobs[k].deadline + 1e-9
        else:
            left[k] -= (nxt - t) * rate
            t = nxt
    return met


def false_refusals(accepted: list[Job], refused: list[Job], rate: float) -> list[bool]:
    """For each refused job: could it have been promised after all, on `rate`: would it
    and every accepted job meet their deadlines? (Where the accepted jobs alone could not,
    the fleet was overcommitted already and no refusal is false.)"""
    return [all(replay([*accepted, r], rate)) for r in refused]


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _line(i: int) -> bytes:
    body = dict(model="ballast-tiny", messages=[dict(role="user", content=f"Line {i}: say something.")],
                max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return json.dumps(dict(custom_id=f"l{i}", method="POST", url="/v1/chat/completions", body=body)).encode() + b"\n"


def _submit(client: openai.OpenAI, sent: Sent) -> None:
    f = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(_line(i) for i in range(sent.lines)))),
                            purpose="batch")
    sent.sent_at = time.time()
    try:
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window=sent.window)  # type: ignore[arg-type]
    except openai.BadRequestError as err:
        body = err.body if isinstance(err.body, dict) else {}
        assert body.get("code") == REFUSED, body
        sent.refusal = body.get("message")
        return
    sent.batch_id, sent.created_at = b.id, b.created_at


def _wait(client: openai.OpenAI, sent: Sent, timeout_s: float) -> None:
    assert sent.batch_id is not None
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(sent.batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            break
        assert time.monotonic() < deadline, f"{sent.batch_id} still {b.status}"
        time.sleep(0.5)
    sent.status = b.status
    if b.status == "failed":
        errors = b.errors.data if b.errors and b.errors.data else []
        assert errors and errors[0].code == REFUSED, errors
        sent.refusal = errors[0].message
    sent.output_tokens = b.usage.output_tokens if b.usage else 0
    sent.started = b.in_progress_at
    sent.ended = b.completed_at or b.expired_at


def _pace(db_url: str, timeout_s: float = 60) -> float:
    """The engine workers' announced batch pace, once one has measured it."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        while True:
            rows = conn.execute("SELECT (stats->>'batch_rate')::float FROM engines "
                                "WHERE seen_at > now() - interval '5 seconds'").fetchall()
            pace = sum(r[0] or 0 for r in rows)
            if pace > 0:
                return pace
            assert time.monotonic() < deadline, "no engine worker announced a batch pace"
            time.sleep(0.5)


def _sizes(rng: random.Random) -> int:
    k = 0
    while k < 5 and rng.random() < 0.5:
        k += 1
    return 16 << k  # 16 (½), 32 (¼), … 256 (1/32), 512 (1/32)


MEAN_LINES = sum((16 << k) * 0.5 ** (k + 1) for k in range(5)) + (16 << 5) * 0.5 ** 5  # 56


def main(settings: Settings, seconds: float = 150.0, load: float = 2.0, windows: tuple[str, ...] = ("30s", "60s",
                                                                                                    "120s")) -> int:
    spans = {w: parse_window(w) or 0 for w in windows}
    longest = max(windows, key=lambda w: spans[w])
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory() as d, ballast_up(settings, Path(d), BALLAST_BATCH_WINDOWS=json.dumps(
            list(windows))) as stack:
        key = stack.api.headers["Authorization"][7:]
        client = openai.OpenAI(base_url=str(stack.api.base_url).rstrip("/") + "/v1", api_key=key, max_retries=0,
                               timeout=120)
        warm = Sent(0, 320, longest)  # ~80k tokens: several of the engine's once-a-second readings busy
        _submit(client, warm)
        _wait(client, warm, 300)
        pace = _pace(stack.db_url)
        mean_tokens = MEAN_LINES * MAX_TOKENS
        rate = load * pace * SHARE / mean_tokens  # batches a second
        print(f"measured pace {pace:.0f} output tokens/s; {rate:.2f} batches/s of {mean_tokens:.0f} tokens on "
              f"average for {seconds:.0f} s: {load}× the promised share")
        plan, t = [], 0.0
        while (t := t + rng.expovariate(rate)) < seconds:
            plan.append(Sent(t, _sizes(rng), rng.choice(windows)))
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            futures = []
            for s in plan:
                time.sleep(max(0.0, start + s.at - time.monotonic()))
                futures.append(pool.submit(_submit, client, s))
            for f in futures:
                f.result()
            waits = [pool.submit(_wait, client, s, max(spans.values()) + 120) for s in plan if s.batch_id]
            for f in waits:
                f.result()
        warm_ended = warm.ended or 0
    return report(plan, spans, pace, warm_ended)


def report(plan: list[Sent], spans: dict[str, int], pace: float, warm_ended: int) -> int:
    ran = [s for s in plan if s.batch_id and s.status in ("completed", "expired")]
    at_creation = [s for s in plan if s.batch_id is None]
    at_validation = [s for s in plan if s.status == "failed"]
    kept = [s for s in ran if s.status == "completed"]
    busy = busy_seconds([(s.started, s.ended) for s in ran if s.started and s.ended])
    realized = sum(s.output_tokens for s in ran) / busy if busy else 0.0
    zero = min((s.sent_at for s in plan), default=0.0)

    def job(s: Sent, tokens: int) -> Job:
        created = s.created_at or s.sent_at  # refused at creation: when the client sent it
        return Job(created - zero, tokens, created - zero + spans[s.window])

    accepted = [job(s, s.output_tokens) for s in ran]
    refused = [*at_creation, *at_validation]
    false = false_refusals(accepted, [job(s, s.tokens) for s in refused], realized) if realized else []
    by_window = {}
    for w in spans:
        mine = [s for s in plan if s.window == w]
        done = [s for s in ran if s.window == w]
        by_window[w] = dict(sent=len(mine), accepted=len(done), kept=sum(s.status == "completed" for s in done),
                            refused=sum(s in refused for s in mine),
                            finish_p50_s=p50([s.ended - s.created_at for s in done if s.ended]),
                            finish_p99_s=pct([s.ended - s.created_at for s in done if s.ended], 99))
    figures = dict(
        batches=len(plan), accepted=len(ran), kept=len(kept),
        kept_share=round(len(kept) / len(ran), 4) if ran else None,
        refused_at_creation=len(at_creation), refused_at_validation=len(at_validation),
        false_refusals=sum(false), measured_pace=round(pace, 1), realized_pace=round(realized, 1),
        tokens_sent=sum(s.tokens for s in plan), tokens_accepted=sum(s.tokens for s in ran),
        by_window=by_window,
        refusal_examples=dict(creation=at_creation[0].refusal if at_creation else None,
                              validation=at_validation[0].refusal if at_validation else None),
        warm_up_ended=warm_ended,
    )
    print(f"{'window':>8} {'sent':>5} {'accepted':>8} {'kept':>5} {'refused':>7} {'finish p50':>10} {'p99':>5}")
    for w, r in by_window.items():
        print(f"{w:>8} {r['sent']:>5} {r['accepted']:>8} {r['kept']:>5} {r['refused']:>7} "
              f"{r['finish_p50_s']:>9.0f}s {r['finish_p99_s']:>4.0f}s")
    print(f"kept {len(kept)} of {len(ran)} accepted; refused {len(refused)} ({len(at_creation)} at creation), "
          f"{sum(false)} of them could have been met at the realized pace {realized:.0f} tokens/s "
          f"(measured {pace:.0f}, promised on {SHARE} of it)")
    print(json.dumps(figures))
    return 0 if ran and len(kept) >= 0.99 * len(ran) else 1
