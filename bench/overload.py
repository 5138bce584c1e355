"""`ballast bench overload`: the overload policy (docs/quotas-and-audit.md), measured by class.

One `ballast up` with two engine workers of few sequence slots each
(BALLAST_MAX_NUM_SEQS, 8), so that the load below fills them. Every tenant is made through
the admin API, so each has the limits a new tenant gets (BALLAST_NEW_TENANT_LIMITS):

  gold     default tier, with a reservation of `--reserved` slots on the pool (its
           requests past it in flight run as default)
  prio     priority tier (granted)
  std      default tier
  cheap    flex tier
  bulk     batch: a 24h backlog running throughout, and in each phase one 1h batch (the probe)
  trainer  training: a fine-tuning job running throughout

Each interactive tenant sends streamed chats (`--max-tokens` tokens, ignore_eos) open loop,
Poisson at `--rate` a second. Four phases of `--seconds` each (120: ~180 chats a class at
the normal rate, so that a p99 is not one request), on the same stack:

  normal  both engines, the rate as given;
  shrink  the fleet shrinks: one engine drained (the operator's drain), the same rate;
  double  the work doubles: both engines, twice the rate;
  giant   one tenant floods giant prompts: tenant `giant` (default tier, a new tenant's
          limits) keeps `--giant-streams` chats in flight whose prompts fill ~90 % of the
          context, beside the normal rate.

For each phase and class: requests sent, served, refused (429, by code; `wait_bound`: a
`resource_unavailable` for the wait past the tier's bound), failed otherwise,
downgraded (the response's x-ballast-downgraded-from), and the waiting time (TTFT at the
client: its first content token) p50/p99 of those served. Batch: the tokens journaled in the
phase a second (SQL over `item_chunk` events) and the probe's time from creation to
`completed`, against its 1h promise. Training: the steps the job checkpointed in the phase a
second (its `ft_checkpoint` events). Prints a table, then one JSON line.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.fairness import token_event
from bench.stack import ballast_up
from bench.stats import p50, pct
from bench.training import training_file
from config import Settings

SEED = 11
MODEL = "ballast-tiny"
MAX_SEQS = 8
CLASSES = ("gold", "prio", "std", "cheap")  # the interactive tenants; their classes below
TIER = {"gold": "default", "prio": "priority", "std": "default", "cheap": "flex", "giant": "default"}
CLASS = {"gold": "reserved", "prio": "priority", "std": "default", "cheap": "flex", "giant": "giant prompts"}
PHASES = ("normal", "shrink", "double", "giant")
WAIT = "wait_bound"  # refused for the wait (BALLAST_WAIT_BOUND_*), as the bench counts it
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november")


@dataclass
class Outcome:
    tenant: str
    status: int  # HTTP status; 0: the connection failed
    code: str = ""  # an error's code
    ttft: float | None = None  # seconds to the first content token
    downgraded: bool = False


@dataclass
class Phase:
    name: str
    start: float = 0.0  # unix seconds
    end: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    probe: dict[str, Any] = field(default_factory=dict)
    paces: dict[str, float] = field(default_factory=dict)  # each engine's batch pace as the phase starts


def tally(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per tenant: sent, served, refused by code, other failures, downgraded, TTFT p50/p99 (ms)."""
    out: dict[str, dict[str, Any]] = {}
    for tenant in sorted({o.tenant for o in outcomes}):
        mine = [o for o in outcomes if o.tenant == tenant]
        served = [o.ttft for o in mine if o.status == 200 and o.ttft is not None]
        refused: dict[str, int] = {}
        for o in mine:
            if o.status == 429:
                refused[o.code] = refused.get(o.code, 0) + 1
        out[tenant] = dict(
            sent=len(mine), served=len(served), refused=refused,
            failed=sum(1 for o in mine if o.status not in (200, 429) or (o.status == 200 and o.ttft is None)),
            downgraded=sum(o.downgraded for o in mine),
            ttft_p50_ms=round(1000 * p50(served), 1) if served else None,
            ttft_p99_ms=round(1000 * pct(served, 99), 1) if served else None)
    return out


async def _chat(http: httpx.AsyncClient, tenant: str, key: str, content: str, max_tokens: int) -> Outcome:
    body = dict(model=MODEL, messages=[dict(role="user", content=content)], max_tokens=max_tokens, stream=True,
                ignore_eos=True, temperature=0, service_tier=TIER[tenant])
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    error = json.loads(raw)["error"]
                    code = error["code"] or ""
                except (ValueError, KeyError, TypeError):
                    code, error = "", {}
                if code == "resource_unavailable" and "the bound on the" in str(error.get("message")):
                    code = WAIT  # refused for the wait (at arrival or at the bound), not flex shed for capacity
                return Outcome(tenant, r.status_code, code)
            first = None
            async for line in r.aiter_lines():
                # The first token, not the opening chunk (sent once an engine accepted it).
                if first is None and line.startswith("data: {") and token_event(json.loads(line[6:])):
                    first = time.perf_counter() - t0
            return Outcome(tenant, 200, ttft=first, downgraded="x-ballast-downgraded-from" in r.headers)
    except httpx.HTTPError as err:
        return Outcome(tenant, 0, type(err).__name__)


async def _open_loop(http: httpx.AsyncClient, tenant: str, key: str, rate: float, seconds: float, max_tokens: int,
                     rng: random.Random) -> list[Outcome]:
    tasks: list[asyncio.Task[Outcome]] = []
    t, start = 0.0, time.perf_counter()
    while (t := t + rng.expovariate(rate)) < seconds:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.create_task(_chat(http, tenant, key, f"{tenant} {len(tasks)}: tell me more.",
                                               max_tokens)))
    return list(await asyncio.gather(*tasks))


def giant_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def giant_words(model_path: str, max_model_len: int, share: float = 0.85) -> int:
    """Words of `giant_prompt` whose tokens fill about `share` of the context (the model's
    own tokenizer counts them; the rest leaves room for the chat template and the answer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    per_word = len(tok(giant_prompt(random.Random(0), 1000))["input_ids"]) / 1000
    return int(share * max_model_len / per_word)


async def _giants(http: httpx.AsyncClient, key: str, streams: int, words: int, stop: asyncio.Event,
                  rng: random.Random) -> list[Outcome]:
    out: list[Outcome] = []

    async def loop() -> None:
        while not stop.is_set():
            got = await _chat(http, "giant", key, giant_prompt(rng, words), 8)
            out.append(got)
            if got.status == 429:  # refused: back off as a client told Retry-After would
                await asyncio.sleep(1.0)

    await asyncio.gather(*(loop() for _ in range(streams)))
    return out


def _batch_file(prefix: str, lines: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps(dict(custom_id=f"{prefix}{i}", method="POST", url="/v1/chat/completions", body=dict(
        model=MODEL, messages=[dict(role="user", content=f"{prefix} {i}")], max_tokens=max_tokens,
        ignore_eos=True))).encode() + b"\n" for i in range(lines))


async def _batch(http: httpx.AsyncClient, key: str, content: bytes, window: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"}
    f = await http.post("/v1/files", files=dict(file=("b.jsonl", io.BytesIO(content))), data=dict(purpose="batch"),
                        headers=auth)
    assert f.status_code == 200, f.text
    return await http.post("/v1/batches", headers=auth, json=dict(
        input_file_id=f.json()["id"], endpoint="/v1/chat/completions", completion_window=window))


async def _probe(http: httpx.AsyncClient, key: str, phase: str, timeout: float) -> dict[str, Any]:
    """A 1h batch of 8 short items made as the phase starts: creation to its end."""
    t0 = time.time()
    made = await _batch(http, key, _batch_file(f"probe-{phase}-", 8, 32), "1h")
    if made.status_code != 200:  # a window the pool cannot promise now: refused at creation
        return dict(status=f"refused ({made.status_code} {made.json()['error']['code']})",
                    seconds=round(time.time() - t0, 1), window=None)
    batch_id = made.json()["id"]
    auth = {"Authorization": f"Bearer {key}"}
    while True:
        got = (await http.get(f"/v1/batches/{batch_id}", headers=auth)).json()
        if got["status"] in ("completed", "failed", "expired", "cancelled") or time.time() - t0 > timeout:
            break
        await asyncio.sleep(0.5)
    promise = (got.get("ballast") or {}).get("promise") or {}
    return dict(status=got["status"], seconds=round(time.time() - t0, 1), window=promise.get("window"))


async def _paces(http: httpx.AsyncClient, admin: dict[str, str]) -> dict[str, float]:
    """Each engine worker's batch pace, as it last announced it."""
    listed = (await http.get("/admin/engines", headers=admin)).json()["data"]
    return {e["id"]: (json.loads(e["stats"]) if isinstance(e["stats"], str) else e["stats"]).get("batch_rate", 0.0)
            for e in listed}


def _journal(db_url: str, phases: list[Phase], job_id: str) -> dict[str, dict[str, float]]:
    """Per phase, from the journal: batch tokens a second, training steps a second."""
    out: dict[str, dict[str, float]] = {}
    with psycopg.connect(db_url) as conn:
        ckpts = conn.execute("SELECT (payload->>'step')::int, extract(epoch FROM committed_at) FROM events "
                             "WHERE stream = %s AND type = 'ft_checkpoint' ORDER BY version",
                             (f"ftjob:{job_id}",)).fetchall()
        for ph in phases:
            row = conn.execute(
                "SELECT coalesce(sum(jsonb_array_length(payload->'token_ids')), 0) FROM events "
                "WHERE type = 'item_chunk' AND jsonb_typeof(payload->'token_ids') = 'array' "
                "AND committed_at >= to_timestamp(%s) AND committed_at < to_timestamp(%s)",
                (ph.start, ph.end)).fetchone()
            tokens = row[0] if row else 0
            before = max((s for s, at in ckpts if at < ph.start), default=0)
            by_end = max((s for s, at in ckpts if at < ph.end), default=0)
            span = ph.end - ph.start
            out[ph.name] = dict(batch_tokens_per_s=round(tokens / span, 1),
                                training_steps_per_s=round((by_end - before) / span, 3))
    return out


async def _run(settings: Settings, seconds: float, rate: float, max_tokens: int, reserved: int,
               giant_streams: int) -> dict[str, Any]:
    from engine.model_spec import resolve_model

    rng = random.Random(SEED)
    spec = resolve_model(settings)
    words = giant_words(spec.path, spec.max_model_len)
    with tempfile.TemporaryDirectory() as d, ballast_up(settings, Path(d), BALLAST_ENGINES="2",
                                                        BALLAST_MAX_NUM_SEQS=str(MAX_SEQS)) as stack:
        admin = {"Authorization": "Bearer " + (Path(d) / "admin-key").read_text().strip()}
        base = str(stack.api.base_url).rstrip("/")
        # No cap on connections: the load stands for many clients, each with its own; one
        # pool's default cap (100) would queue requests in this process, past the API's sight.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
            keys: dict[str, str] = {}
            for t in (*CLASSES, "giant", "bulk", "trainer"):
                r = await http.post("/admin/tenants", headers=admin,
                                    json=dict(id=t, tiers=["priority"] if t == "prio" else []))
                assert r.status_code == 200, r.text
                keys[t] = r.json()["key"]["key"]
            r = await http.put("/admin/tenants/gold/reservations", headers=admin, json=dict(model=MODEL,
                                                                                           slots=reserved))
            assert r.status_code == 200, r.text
            for _ in range(600):  # both engine workers announced
                engines = [e["id"] for e in (await http.get("/admin/engines", headers=admin)).json()["data"]]
                if len(engines) == 2:
                    break
                await asyncio.sleep(0.5)
            assert len(engines) == 2, engines
            for t in CLASSES:  # each tenant's first request loads nothing later
                await _chat(http, t, keys[t], "warm up", 4)

            # The backlog and the training job, running before the first phase and throughout.
            made = await _batch(http, keys["bulk"], _batch_file("bulk-", 6000, 256), "24h")
            assert made.status_code == 200, made.text
            backlog = made.json()["id"]
            trainer = {"Authorization": f"Bearer {keys['trainer']}"}
            up = await http.post("/v1/files", files=dict(file=("t.jsonl", io.BytesIO(training_file(SEED, 4000)))),
                                 data=dict(purpose="fine-tune"), headers=trainer)
            assert up.status_code == 200, up.text
            job = await http.post("/v1/fine_tuning/jobs", headers=trainer,
                                  json=dict(model=MODEL, training_file=up.json()["id"], seed=SEED,
                                            hyperparameters=dict(n_epochs=50, batch_size=4)))
            assert job.status_code == 200, job.text
            job_id = job.json()["id"]
            for _ in range(1200):
                got = (await http.get(f"/v1/fine_tuning/jobs/{job_id}", headers=trainer)).json()
                if got["status"] == "running":
                    break
                await asyncio.sleep(0.25)
            bulk = {"Authorization": f"Bearer {keys['bulk']}"}
            for _ in range(1200):  # validated and running before the first phase: its start's CPU in none
                got = (await http.get(f"/v1/batches/{backlog}", headers=bulk)).json()
                if got["status"] == "in_progress" and got["request_counts"]["completed"]:
                    break
                await asyncio.sleep(0.5)
            for _ in range(600):  # and each engine has measured its batch pace: short windows are open
                if all(p > 0 for p in (await _paces(http, admin)).values()):
                    break
                await asyncio.sleep(0.5)

            phases = []
            for name in PHASES:
                ph = Phase(name)
                if name == "shrink":
                    r = await http.post(f"/admin/engines/{engines[1]}/drain", headers=admin)
                    assert r.status_code == 200, r.text
                    await asyncio.sleep(3)  # every API's directory has seen it
                ph.paces = await _paces(http, admin)
                ph.start = time.time()
                each = rate * (2 if name == "double" else 1)
                stop = asyncio.Event()
                giants = (asyncio.create_task(_giants(http, keys["giant"], giant_streams, words, stop, rng))
                          if name == "giant" else None)
                probe = asyncio.create_task(_probe(http, keys["bulk"], name, seconds * 4))
                loops = await asyncio.gather(*(_open_loop(http, t, keys[t], each, seconds, max_tokens,
                                                          random.Random(f"{SEED}:{name}:{t}")) for t in CLASSES))
                stop.set()
                ph.outcomes = [o for xs in loops for o in xs] + (await giants if giants else [])
                ph.end = time.time()
                ph.probe = await probe
                phases.append(ph)
                if name == "shrink":
                    r = await http.post(f"/admin/engines/{engines[1]}/undrain", headers=admin)
                    assert r.status_code == 200, r.text
                    await asyncio.sleep(3)
            await http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=trainer)
        journal = _journal(stack.db_url, phases, job_id)
    return dict(seconds=seconds, rate=rate, max_tokens=max_tokens, reserved=reserved, giant_streams=giant_streams,
                max_seqs=MAX_SEQS, engines=2,
                phases={ph.name: dict(interactive=tally(ph.outcomes), probe=ph.probe, paces=ph.paces,
                                      **journal[ph.name])
                        for ph in phases})


def main(settings: Settings, seconds: float = 120.0, rate: float = 1.5, max_tokens: int = 96, reserved: int = 4,
         giant_streams: int = 8) -> int:
    f = asyncio.run(_run(settings, seconds, rate, max_tokens, reserved, giant_streams))
    print(f"{'phase':>7} {'class':>14} {'sent':>5} {'served':>6} {'429':>14} {'failed':>6} {'down':>4} "
          f"{'TTFT p50':>9} {'p99':>9}")
    for name, ph in f["phases"].items():
        for tenant, r in ph["interactive"].items():
            refused = ",".join(f"{c}:{n}" for c, n in r["refused"].items()) or "-"
            print(f"{name:>7} {CLASS[tenant]:>14} {r['sent']:>5} {r['served']:>6} {refused:>14} {r['failed']:>6} "
                  f"{r['downgraded']:>4} {r['ttft_p50_ms'] or 0:>7.1f}ms {r['ttft_p99_ms'] or 0:>7.1f}ms")
        print(f"{name:>7} {'batch':>14} {ph['batch_tokens_per_s']:>9.0f} tokens/s; 1h probe {ph['probe']['status']} "
              f"in {ph['probe']['seconds']} s; paces at the start {sorted(ph['paces'].values())}")
        print(f"{name:>7} {'training':>14} {ph['training_steps_per_s']:>9.3f} steps/s")
    print(json.dumps(f))
    return 0
