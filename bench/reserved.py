"""`ballast bench reserved`: a tenant's reserved slots, with the engine full of other work.

One `ballast up` whose engine has few sequence slots (BALLAST_MAX_NUM_SEQS, 8), so that
other work fills it. Tenant `gold` sends short streamed chats, open loop (Poisson,
`--rate` a second, for `--seconds`), in three phases on the same stack:

1. alone: nothing else runs;
2. reserved: gold holds a reservation of `--slots` slots (`PUT /admin/tenants/gold/
   reservations`), while tenant `crowd` keeps `--streams` streamed chats in flight (a closed
   loop, more than the engine's slots) and a batch backlog of its own;
3. shared: the same load without the reservation (what gold gets without one), run
   before the reserved phase, both after the crowd's batch is validated and running.

Gold's TTFT is measured at the client (its first token: not the stream's opening chunk,
sent once an engine accepts), and split by the journal into the API's (from its handler's
start) and the engine worker's (from its receipt of the request), with the time the
response's headers reached the client; the crowd's chats are sent and read by a process
of their own, so that its streams never queue gold's reads.
The engine worker's /stats, sampled every 100 ms in phase 2, says how many of the reserved slots gold left
unused and how many batch generations and interactive requests held slots: the unused
reserved slots batch held (lent) over those it could have held is the share of the
reservation's idle time lent out. Targets: gold's TTFT p99 reserved ≤ 1.10 × alone; lent
≥ 0.9.

Then what a user would run instead: gold's same chats (same seed) on vLLM's own server
with the engine worker's engine arguments, alone; beside the crowd's `--streams` at a
lower priority (vLLM's priority scheduling, the engine worker's too); and beside
BALLAST_MAX_NUM_SEQS of them, a sequence always free for gold.

Prints a table, then one JSON line with the figures.

With `--in-tokens`, the reservation is in output tokens a second instead (`tokens_per_s`,
`--share` of the generation rate the engine measured while full) and gold asks for more
than it: `--gold-streams` chats in flight, closed loop, beside the crowd and the batch, in
two phases (shared, then reserved). Gold's delivered output tokens a second are the sum of
the `usage.completion_tokens` of its chats (the client's own count), each spread evenly
from its first token to its end and counted for the part inside the phase, over the
phase's seconds. Target: delivered ≥ the reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import httpx

from bench.fairness import journaled, make_tenants, owner_url, token_event
from bench.rate import vllm_serve
from bench.stack import Stack, ballast_up
from bench.stats import pct
from config import Settings

SEED = 5
MODEL = "ballast-tiny"
MAX_SEQS = 8


@dataclass(frozen=True)
class Chat:
    """One streamed chat as the client saw it (perf_counter seconds): sent, first content
    token (None: none came), ended; its completion tokens as its usage chunk says (0: it failed)."""

    sent: float
    first: float | None
    ended: float
    tokens: int
    id: str = ""  # the completion's id: its request's in the journal
    opened: float | None = None  # its response's headers (the API sends them once an engine accepted it)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}  # vLLM's own server asks for none


async def _chat(http: httpx.AsyncClient, key: str, max_tokens: int, content: str, **extra: object) -> Chat:
    body = dict(model=MODEL, messages=[dict(role="user", content=content)], max_tokens=max_tokens, stream=True,
                stream_options=dict(include_usage=True), ignore_eos=True, temperature=0, **extra)
    sent, first, n, rid = time.perf_counter(), None, 0, ""
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as r:
        opened = time.perf_counter()
        if r.status_code != 200:
            await r.aread()
            return Chat(sent, None, time.perf_counter(), 0)
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and token_event(chunk):  # not the opening chunk, sent before any token
                first = time.perf_counter()
            rid = rid or chunk.get("id", "")
            if chunk.get("usage"):
                n = chunk["usage"].get("completion_tokens", n)
    return Chat(sent, first, time.perf_counter(), n, rid, opened)


async def _paced(http: httpx.AsyncClient, key: str, rate: float, seconds: float, rng: random.Random,
                 **extra: object) -> list[Chat]:
    """Short chats, Poisson at `rate` a second for `seconds`, each as the client saw it
    (those that got no first token included: the figures count them as failed)."""
    tasks: list[asyncio.Task[Chat]] = []
    t, start = 0.0, time.perf_counter()
    while (t := t + rng.expovariate(rate)) < seconds:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.create_task(_chat(http, key, 16, f"Gold {len(tasks)}: hello?", **extra)))
    return list(await asyncio.gather(*tasks))


def _crowd(base: str, key: str, streams: int, stop: EventType, extra: dict) -> None:
    """The crowd's streamed chats, `streams` in flight until `stop`, in a process of its
    own: read in the measuring process, dozens of streams' chunks queued its event loop
    ahead of the measured tenant's, and the client's own lag was counted as the service's.
    In a session of its own, too: where the kernel shares CPU between sessions (autogroup),
    a busy generator spent the measuring process's share, which then waited up to a second
    on the run queue with a chat's reply in its socket."""
    os.setsid()

    async def run() -> None:
        limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=streams + 2)
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
            async def loop(i: int) -> None:
                n = 0
                while not stop.is_set():
                    body = dict(model=MODEL, messages=[dict(role="user", content=f"Crowd {i}.{n}: tell me more.")],
                                max_tokens=64, stream=True, ignore_eos=True, temperature=0, **extra)
                    with contextlib.suppress(httpx.HTTPError):
                        async with http.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as r:
                            async for _ in r.aiter_raw():
                                pass
                    n += 1

            await asyncio.gather(*(loop(i) for i in range(streams)))

    asyncio.run(run())


@contextlib.asynccontextmanager
async def _crowding(base: str, key: str, streams: int, **extra: object) -> AsyncIterator[None]:
    """The crowd's chats in flight for the block (ended by its process's PID if it hangs)."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    crowd = ctx.Process(target=_crowd, args=(base, key, streams, stop, extra), name="crowd")
    crowd.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(crowd.join, 120)
        if crowd.is_alive():
            crowd.kill()
            crowd.join()


async def _sample(http: httpx.AsyncClient, engine_url: str, headers: dict[str, str], stop: asyncio.Event,
                  out: list[dict]) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            out.append((await http.get(f"{engine_url}/stats", headers=headers)).json())
        await asyncio.sleep(0.1)


async def _delivered(http: httpx.AsyncClient, key: str, streams: int, seconds: float) -> tuple[float, int]:
    """Output tokens a second delivered to `streams` chats kept in flight for `seconds`
    (each chat's tokens spread evenly from its first token to its end, counted for the part
    of that span inside the phase; a chat still running at the end is let finish), and how
    many chats failed."""
    start = time.perf_counter()
    end = start + seconds
    chats: list[Chat] = []

    async def loop(i: int) -> None:
        n = 0
        while time.perf_counter() < end:
            chats.append(await _chat(http, key, 128, f"Gold {i}.{n}: go on."))
            n += 1

    await asyncio.gather(*(loop(i) for i in range(streams)))
    spans = [(c.first or c.ended, c.ended, c.tokens) for c in chats if c.tokens]
    return inside(spans, start, end) / seconds, sum(not c.tokens for c in chats)


def inside(chats: list[tuple[float, float, int]], start: float, end: float) -> float:
    """The tokens of `chats` ((first token, end, tokens) each) that came between `start`
    and `end`, each chat's spread evenly over its span."""
    return sum(k * max(0.0, min(b, end) - max(a, start)) / (b - a) if b > a else k * (start <= b <= end)
               for a, b, k in chats)


def lent_share(samples: list[dict], max_seqs: int = MAX_SEQS) -> tuple[float, int]:
    """(Σ unused reserved slots batch held ÷ Σ unused reserved slots, samples with any unused)."""
    held = idle = n = 0
    for s in samples:
        fair = s["fairness"]
        unused = sum(max(0, r - fair["running_of"].get(t, 0)) for t, r in fair.get("reserved", {}).items())
        if not unused:
            continue
        n += 1
        idle += unused
        held += min(unused, max(0, s["batch"] + fair["running"] + unused - max_seqs))
    return (held / idle if idle else float("nan")), n


def _backlog(lines: int) -> bytes:
    return b"".join(json.dumps(dict(custom_id=f"b{i}", method="POST", url="/v1/chat/completions", body=dict(
        model=MODEL, messages=[dict(role="user", content=f"Backlog {i}")], max_tokens=256, ignore_eos=True))
    ).encode() + b"\n" for i in range(lines))


async def _engine(http: httpx.AsyncClient, admin: dict[str, str]) -> dict:
    """The pool's engine worker as it last announced itself."""
    got = (await http.get("/admin/engines", headers=admin)).json()["data"]
    return next(e["stats"] for e in got if e["model"] == MODEL)


@contextlib.asynccontextmanager
async def _up(settings: Settings, spare: int) -> AsyncIterator[tuple[Stack, httpx.AsyncClient, dict[str, str], str,
                                                                     dict[str, str], str]]:
    """The stack, a client of its API, the tenants' keys, its engine worker's URL, the
    admin's header, its database's URL as the owner."""
    with tempfile.TemporaryDirectory() as d, ballast_up(settings, Path(d), BALLAST_MAX_NUM_SEQS=str(MAX_SEQS),
                                                        BALLAST_SPARE_SEQS=str(spare)) as stack:
        owner = owner_url(stack.db_url, Path(d))
        keys, engine_url = await make_tenants(owner, ["gold", "crowd"])
        admin = {"Authorization": "Bearer " + (Path(d) / "admin-key").read_text().strip()}
        async with httpx.AsyncClient(base_url=str(stack.api.base_url).rstrip("/"), timeout=300) as http:
            yield stack, http, keys, engine_url, admin, owner


async def _run_tokens(settings: Settings, seconds: float, share: float, gold_streams: int, streams: int,
                      spare: int) -> dict:
    async with _up(settings, spare) as (stack, http, keys, engine_url, admin, _):
        crowd_key = {"Authorization": f"Bearer {keys['crowd']}"}
        f = await http.post("/v1/files", files=dict(file=("b.jsonl", io.BytesIO(_backlog(4000)))),
                            data=dict(purpose="batch"), headers=crowd_key)
        assert f.status_code == 200, f.text
        batch = await http.post("/v1/batches", headers=crowd_key, json=dict(
            input_file_id=f.json()["id"], endpoint="/v1/chat/completions", completion_window="24h"))
        assert batch.status_code == 200, batch.text
        async with _crowding(str(http.base_url), keys["crowd"], streams):
            await asyncio.sleep(5)  # the crowd and the batch fill the engine

            async def phase() -> tuple[float, dict]:
                halt, samples = asyncio.Event(), list[dict]()
                sampler = asyncio.create_task(_sample(http, engine_url, stack.engine_headers, halt, samples))
                got, failed = await _delivered(http, keys["gold"], gold_streams, seconds)
                halt.set()
                await sampler
                ok = [x for x in samples if "fairness" in x]
                fair = [x["fairness"] for x in ok]

                def mean(xs: Iterable[float]) -> float:
                    return round(statistics.fmean(xs), 2)

                return got, dict(failed=failed, samples=len(fair),
                                 gold_running=mean(f["running_of"].get("gold", 0) for f in fair),
                                 gold_waiting=mean(f["waiting"].get("gold", 0) for f in fair),
                                 crowd_waiting=mean(f["waiting"].get("crowd", 0) for f in fair),
                                 running=mean(f["running"] for f in fair), batch=mean(x["batch"] for x in ok),
                                 preemptions=ok[-1]["preemptions"] - ok[0]["preemptions"] if ok else 0)

            shared, shared_seen = await phase()
            rate = (await _engine(http, admin))["full_rate"]
            assert rate > 0, "the engine measured no rate at full load"
            tokens_per_s = max(1, round(share * rate))
            r = await http.put("/admin/tenants/gold/reservations", json=dict(model=MODEL, tokens_per_s=tokens_per_s),
                               headers=admin)
            assert r.status_code == 200, r.text
            kept = 0
            for _ in range(100):  # until the engine worker keeps it (it reads its pool's every second)
                got = (await http.get(f"{engine_url}/stats", headers=stack.engine_headers)).json()
                if kept := got["fairness"].get("reserved", {}).get("gold", 0):
                    break
                await asyncio.sleep(0.1)
            assert kept, "the engine never kept gold's reservation"
            reserved, reserved_seen = await phase()
            after = await _engine(http, admin)
        await http.post(f"/v1/batches/{batch.json()['id']}/cancel", headers=crowd_key)
    return dict(seconds=seconds, max_seqs=MAX_SEQS, spare_seqs=spare, streams=streams, gold_streams=gold_streams,
                full_rate=rate, full_rate_after=after["full_rate"], tokens_per_s=tokens_per_s, slots_kept=kept,
                slots_kept_after=after["reserved"].get("gold", 0), delivered_shared=round(shared, 1),
                delivered_reserved=round(reserved, 1), reserved_over_reservation=round(reserved / tokens_per_s, 3),
                shared_engine=shared_seen, reserved_engine=reserved_seen)


async def _run(settings: Settings, seconds: float, rate: float, slots: int, streams: int, spare: int) -> dict:
    rng = random.Random(SEED)
    async with _up(settings, spare) as (stack, http, keys, engine_url, admin, owner):
        async def reserve(n: int) -> None:
            r = await http.put("/admin/tenants/gold/reservations", json=dict(model=MODEL, slots=n), headers=admin)
            assert r.status_code == 200, r.text
            for _ in range(100):  # until the engine worker keeps it (it reads its pool's every second)
                got = (await http.get(f"{engine_url}/stats", headers=stack.engine_headers)).json()
                if got["fairness"].get("reserved", {}).get("gold", 0) == n:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"the engine never kept gold's {n} slots")

        await _chat(http, keys["gold"], 16, "warm up")
        alone = await _paced(http, keys["gold"], rate, seconds, rng)
        chats = dict(alone=alone)

        f = await http.post("/v1/files", files=dict(file=("b.jsonl", io.BytesIO(_backlog(4000)))),
                            data=dict(purpose="batch"), headers={"Authorization": f"Bearer {keys['crowd']}"})
        assert f.status_code == 200, f.text
        crowd_key = {"Authorization": f"Bearer {keys['crowd']}"}
        batch = await http.post("/v1/batches", headers=crowd_key, json=dict(
            input_file_id=f.json()["id"], endpoint="/v1/chat/completions", completion_window="24h"))
        assert batch.status_code == 200, batch.text
        for _ in range(600):  # validated and running before either phase: its start's CPU in neither
            got = (await http.get(f"/v1/batches/{batch.json()['id']}", headers=crowd_key)).json()
            if got["status"] == "in_progress" and got["request_counts"]["completed"]:
                break
            await asyncio.sleep(0.1)
        figures: dict = {}
        for phase, n in (("shared", 0), ("reserved", slots)):
            await reserve(n)
            stop, samples = asyncio.Event(), list[dict]()
            async with _crowding(str(http.base_url), keys["crowd"], streams):
                sampler = asyncio.create_task(_sample(http, engine_url, stack.engine_headers, stop, samples))
                await asyncio.sleep(3)  # the crowd fills the engine
                got = await _paced(http, keys["gold"], rate, seconds, rng)
                stop.set()
                await sampler
            figures[phase] = dict(samples=samples)
            chats[phase] = got
        await http.post(f"/v1/batches/{batch.json()['id']}/cancel", headers=crowd_key)
        # Each chat's TTFT as the API measured it (from its receipt) and as the engine worker
        # did (from its receipt: its fair-share queue, vLLM's queue, the prefill): where it went.
        inside = await asyncio.to_thread(journaled, owner, [c.id for cs in chats.values() for c in cs if c.id])
    lent, n = lent_share(figures["reserved"]["samples"])
    # How often gold asked beyond its reservation: its requests in flight on the engine at
    # each sample, and those of its requests that waited for a slot (the engine's count).
    rs = [s for s in figures["reserved"]["samples"] if "fairness" in s]
    held = [s["fairness"]["running_of"].get("gold", 0) for s in rs]
    waited = (rs[-1]["fairness"].get("queued_by", {}).get("gold", 0) - rs[0]["fairness"].get("queued_by", {}).get(
        "gold", 0)) if rs else 0
    out: dict = dict(seconds=seconds, rate=rate, slots=slots, streams=streams, max_seqs=MAX_SEQS, spare_seqs=spare,
                     lent_share=round(lent, 3), lent_samples=n,
                     gold_in_flight=dict(mean=round(sum(held) / max(1, len(held)), 2), max=max(held, default=0),
                                         at_or_over_reservation=round(sum(h >= slots for h in held) / max(1, len(held)),
                                                                      3)),
                     gold_waited_for_a_slot=waited)
    for phase in ("alone", "reserved", "shared"):
        out[phase] = ttft_figures(chats[phase], inside)
    out["reserved_over_alone_p99"] = round(out["reserved"]["ttft_p99_ms"] / out["alone"]["ttft_p99_ms"], 3)
    out["shared_over_alone_p99"] = round(out["shared"]["ttft_p99_ms"] / out["alone"]["ttft_p99_ms"], 3)
    return out


def ttft_figures(chats: list[Chat], inside: dict[str, tuple[float | None, float | None]]) -> dict:
    """TTFT p50/p99 (ms) at the client over the `n` chats that got a first token (`failed`:
    those that did not), with the response's headers and, where the journal has the chat
    (`inside`: its id's API and engine worker TTFTs, ms), its parts."""
    xs = [c.ttft for c in chats if c.ttft is not None]
    api = [a / 1000 for c in chats if (a := inside.get(c.id, (None, None))[0]) is not None]
    engine = [e / 1000 for c in chats if (e := inside.get(c.id, (None, None))[1]) is not None]
    heads = [c.opened - c.sent for c in chats if c.opened is not None and c.first is not None]

    def ms(xs: list[float], q: float) -> float | None:
        return round(1000 * pct(xs, q), 1) if xs else None

    return dict(n=len(xs), failed=len(chats) - len(xs), ttft_p50_ms=ms(xs, 50), ttft_p99_ms=ms(xs, 99),
                headers_p50_ms=ms(heads, 50), headers_p99_ms=ms(heads, 99), api_p50_ms=ms(api, 50),
                api_p99_ms=ms(api, 99), engine_p50_ms=ms(engine, 50), engine_p99_ms=ms(engine, 99))


async def _vllm(settings: Settings, seconds: float, rate: float, streams: int, spare: int) -> dict[str, list[Chat]]:
    """Gold's same chats on vLLM's own server (what a user would run instead), on the engine
    worker's engine arguments (priority scheduling, MAX_SEQS + `spare` sequences): alone;
    beside `streams` of the crowd's at a lower priority (vLLM's own answer to a tenant who
    comes first: a waiting request of higher priority is first for a free sequence, and
    takes one from a lower only when the KV cache runs out); and beside MAX_SEQS of them,
    so that a sequence is always free for it (no scheduler's choice in it: what the server
    and the engine's steps cost it with the slots full of others' work)."""
    rng = random.Random(SEED)
    same = settings.model_copy(update=dict(max_num_seqs=MAX_SEQS, spare_seqs=spare))
    with tempfile.TemporaryDirectory(prefix="ballast-bench-reserved-vllm-") as d, vllm_serve(same, Path(d)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            await _chat(http, "", 16, "warm up")
            chats = dict(alone=await _paced(http, "", rate, seconds, rng))
            for phase, n, extra in (("priority", streams, dict(priority=1)), ("beside", MAX_SEQS, {})):
                async with _crowding(url, "", n, **extra):
                    await asyncio.sleep(3)  # the crowd fills the engine
                    chats[phase] = await _paced(http, "", rate, seconds, rng)
    return chats


def main_tokens(settings: Settings, seconds: float = 60.0, share: float = 0.5, gold_streams: int = 16,
                streams: int = 24, spare: int = 2) -> int:
    f = asyncio.run(_run_tokens(settings, seconds, share, gold_streams, streams, spare))
    print(f"reservation {f['tokens_per_s']} tokens/s ({share} of the {f['full_rate']} tokens/s the engine measured "
          "at full load), "
          f"kept as {f['slots_kept']} slots; gold delivered {f['delivered_shared']} tokens/s without it, "
          f"{f['delivered_reserved']} with it ({f['reserved_over_reservation']} of the reservation)")
    print(json.dumps(f))
    return 0 if f["reserved_over_reservation"] >= 1.0 else 1


def main(settings: Settings, seconds: float = 60.0, rate: float = 4.0, slots: int = 2, streams: int = 24,
         spare: int = 2) -> int:
    f = asyncio.run(_run(settings, seconds, rate, slots, streams, spare))
    if not all(f[phase]["n"] for phase in ("alone", "reserved", "shared")):
        raise SystemExit(f"gold got no first token in a phase of Ballast's arm: {json.dumps(f)}")
    print("the same chats on vLLM's own server …", flush=True)
    on_vllm = asyncio.run(_vllm(settings, seconds, rate, streams, spare))
    f["vllm"] = {phase: ttft_figures(chats, {}) for phase, chats in on_vllm.items()}
    v = f["vllm"]
    if not all(r["n"] for r in v.values()):
        raise SystemExit(f"vLLM's own server gave gold no first token in a phase: {json.dumps(v)}")
    for phase in ("priority", "beside"):
        f[f"vllm_{phase}_over_alone_p99"] = round(v[phase]["ttft_p99_ms"] / v["alone"]["ttft_p99_ms"], 3)
    f["reserved_over_vllm_priority_p99"] = round(f["reserved"]["ttft_p99_ms"] / v["priority"]["ttft_p99_ms"], 3)
    print(f"{'gold':>15} {'n':>5} {'TTFT p50':>9} {'p99':>8}  {'from the API p50':>16} {'p99':>8}  "
          f"{'from the engine p50':>19} {'p99':>8}  {'headers p50':>11} {'p99':>8}")
    for phase in ("alone", "reserved", "shared"):
        r = f[phase]
        print(f"{phase:>15} {r['n']:>5} {r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>6.1f}ms  "
              f"{r['api_p50_ms']:>14.1f}ms {r['api_p99_ms']:>6.1f}ms  {r['engine_p50_ms']:>17.1f}ms "
              f"{r['engine_p99_ms']:>6.1f}ms  {r['headers_p50_ms']:>9.1f}ms {r['headers_p99_ms']:>6.1f}ms")
    for phase in ("alone", "priority", "beside"):
        r = f["vllm"][phase]
        print(f"{'vLLM ' + phase:>15} {r['n']:>5} {r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>6.1f}ms  "
              f"{'':>36}{'':>30}{r['headers_p50_ms']:>9.1f}ms {r['headers_p99_ms']:>6.1f}ms")
    print(f"failed (no first token): Ballast {[f[p]['failed'] for p in ('alone', 'reserved', 'shared')]}, vLLM "
          f"{[v[p]['failed'] for p in ('alone', 'priority', 'beside')]}")
    print(f"reserved ÷ alone p99 {f['reserved_over_alone_p99']}, shared ÷ alone {f['shared_over_alone_p99']}; "
          f"reserved slots lent while unused {f['lent_share']}")
    print(f"on vLLM's own server, gold at a higher priority ÷ alone p99 {f['vllm_priority_over_alone_p99']}, beside "
          f"{MAX_SEQS} others with a sequence free {f['vllm_beside_over_alone_p99']}; Ballast's reserved ÷ vLLM's "
          f"priority p99 {f['reserved_over_vllm_priority_p99']}")
    print(json.dumps(f))
    return 0 if f["reserved_over_alone_p99"] <= 1.10 and f["lent_share"] >= 0.9 else 1
