"""`ballast bench placement`: prompt-cache affinity under a load bound against least-loaded
and round-robin placement, on the same pool, in one run.

Each arm is a fresh `ballast up --engines 2` (two engine workers, a vLLM engine each, on
their own cores), default settings but BALLAST_PLACEMENT. Each plays two seeded traces
through the API, the same for every arm, no-reuse first (so the prefix-heavy one finds
nothing of its own cached):

  no-reuse      chats whose prompts share nothing beyond the chat template;
  prefix-heavy  24 tenants' system prompts of 600-1,400 tokens and multi-turn chats: each
                next turn of a conversation resends its history (fixed assistant replies,
                so the history does not depend on what the model said).

The tiny model's context is 2,048 tokens (its tokenizer: a token a character), so the
system prompts are shorter than the 1-4k of a production trace. Arrivals are Poisson;
each chat streams MAX_TOKENS tokens. Each engine's KV cache holds KV_CACHE_TOKENS tokens
(a third of the trace's distinct prefixes): a fleet serving many tenants cannot keep
every tenant's prompt on every engine, and that is what placement decides. The tiny
model's default 1 GiB would hold half a million tokens, every prefix everywhere.

Per arm and trace: the prefix-cache hit rate from vLLM's own counters (hit over queried
prompt tokens, summed over both engines, over the trace), TTFT p50/p99 at the client (its
first token chunk), and load imbalance: max over mean of the requests in flight per
engine (each from the client's start to its end, on the engine its worker recorded serving
it), every 5 ms while at least as many are in flight as there are engines (below that,
one request alone is "imbalance 2"), averaged. One JSON line last.

`--record PATH` (by default the data dir's bench/placement-record.json): per arm, every
request's start, tenant and conversation, its prompt's 128-token blocks as the API's placer
hashes them, its output and the engine that served it, with the arm's figures: what
`ballast sim replay` plays through the simulator to validate it (sim/replay.py). Recording
reads what the bench already gathers; it measures nothing else.

Then, in-process with the API's placer: the decision's cost, and on worker loss the share
of prefixes whose engine changes against the share the lost engine held.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.stack import Stack, ballast_up
from bench.stats import pct
from config import Settings
from config.database import libpq_url
from policy.prefix import block_hashes
from sim import replay

SEED = 5
MAX_TOKENS = 16
SYSTEMS = 24  # tenants' system prompts in the prefix-heavy trace
KV_CACHE_TOKENS = 8192  # per engine: 64 of vLLM CPU's 128-token blocks
ARMS = ("affinity", "least_loaded", "round_robin")
TRACES = ("no_reuse", "prefix_heavy")
WORDS = ("harbour", "compass", "lantern", "anchor", "rigging", "galley", "tide", "squall", "keel", "mast", "chart",
         "ballast", "bosun", "hull", "stern", "bow", "cargo", "reef", "shoal", "beacon")


@dataclass
class Turn:
    at: float  # seconds into the trace
    messages: list[dict[str, str]]
    tenant: int = -1  # its system prompt, for the recording (-1: none)
    conversation: int = -1


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:chars]


def trace(kind: str, seconds: float, rate: float, seed: int = SEED) -> list[Turn]:
    rng = random.Random(f"{seed}:{kind}")
    systems = [_text(rng, rng.randrange(600, 1400)) for _ in range(SYSTEMS)]
    conversations: list[list[dict[str, str]]] = []
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        if kind == "no_reuse":
            out.append(Turn(t, [dict(role="user", content=f"{rng.random()} " + _text(rng, rng.randrange(600, 1400)))]))
            continue
        if conversations and rng.random() < 0.6:  # the next turn of a conversation, its history resent
            history = rng.choice(conversations)
            if sum(len(m["content"]) for m in history) < 1700:
                history += [dict(role="assistant", content=_text(rng, 40)), dict(role="user", content=_text(rng, 60))]
                c = next(i for i, h in enumerate(conversations) if h is history)
                out.append(Turn(t, list(history), systems.index(history[0]["content"]), c))
                continue
        history = [dict(role="system", content=rng.choice(systems)), dict(role="user", content=_text(rng, 60))]
        conversations.append(history)
        out.append(Turn(t, list(history), systems.index(history[0]["content"]), len(conversations) - 1))
    return out


@dataclass
class Chat:
    id: str
    start: float  # perf_counter at the client
    ttft: float  # to the first token chunk (no role, not the last)
    end: float


async def _chat(http: httpx.AsyncClient, model: str, turn: Turn) -> Chat:
    body = dict(model=model, messages=turn.messages, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                stream=True)
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat answered {r.status_code}: {(await r.aread()).decode()[:300]}")
        first, rid = None, ""
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid, choice = chunk["id"], chunk["choices"][0]
                if "role" not in choice["delta"] and choice.get("finish_reason") is None:
                    first = time.perf_counter() - t0
    assert first is not None, "no token streamed back"
    return Chat(rid, t0, first, time.perf_counter())


def _engines(db_url: str) -> dict[str, dict]:
    with psycopg.connect(libpq_url(db_url)) as c:
        return {i: s for i, s in c.execute("SELECT id, stats FROM engines")}


def _served_on(db_url: str, ids: list[str], timeout_s: float = 30) -> dict[str, str]:
    """Where each request ran: its engine worker's own record (`request_served`, written
    a moment after the stream ends). Every request's, or an error naming those missing."""
    q = "SELECT request_id, engine_id FROM served_requests WHERE request_id = ANY(%s)"
    deadline = time.monotonic() + timeout_s
    while True:
        with psycopg.connect(libpq_url(db_url)) as c:
            where: dict[str, str] = dict(c.execute(q, (ids,)).fetchall())
        missing = [i for i in ids if i not in where]
        if not missing:
            return where
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(missing)} of {len(ids)} requests have no request_served record after "
                               f"{timeout_s:.0f} s (e.g. {missing[:5]}): the imbalance would be computed without them")
        time.sleep(0.5)


def _db_now(db_url: str) -> float:
    with psycopg.connect(libpq_url(db_url)) as c:
        row = c.execute("SELECT extract(epoch FROM clock_timestamp())::float").fetchone()
    assert row is not None
    return row[0]


def _engines_after(db_url: str, at: float, engines: int, timeout_s: float = 30) -> dict[str, dict]:
    """Every engine's counters as announced after `at` (database clock): an engine gathers
    them as its announcing transaction starts, once a second, so a row seen later than
    `at` + 1.5 s holds every request that ended by `at`. An error if an engine is silent."""
    q = "SELECT id, stats, extract(epoch FROM seen_at)::float FROM engines"
    deadline = time.monotonic() + timeout_s
    while True:
        with psycopg.connect(libpq_url(db_url)) as c:
            rows = c.execute(q).fetchall()
        stale = [i for i, _, seen in rows if seen < at + 1.5]
        if len(rows) >= engines and not stale:
            return {i: stats for i, stats, _ in rows}
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines {stale or 'missing'} ({len(rows)} of {engines} listed) announced no counters "
                               f"in the {timeout_s:.0f} s after the trace: the hit rate would miss their last requests")
        time.sleep(0.5)


def imbalance(chats: list[Chat], where: dict[str, str], engines: int, step_s: float = 0.005) -> tuple[float, int]:
    """Max over mean of the requests in flight per engine (client start to end, on the
    engine that served it), every `step_s`, at the moments with at least one per engine in
    flight (fewer cannot be balanced); averaged. And how many moments counted."""
    # The simulator's replay measures itself with this same function (sim/replay.py).
    return replay.imbalance([(c.start, c.end, where[c.id]) for c in chats if c.id in where], engines, step_s)


@dataclass(frozen=True)
class HashedPrompt:
    """A turn's prompt as the API's placer sees it, for the recording."""

    tokens: int
    blocks: tuple[int, ...]


def prompts(settings: Settings, model: str, turns: list[Turn], block_size: int = 128) -> list[HashedPrompt]:
    """Each turn's prompt rendered and tokenized as the engine will, and cut into the blocks
    the API's placer hashes (its own code: api/services/placer.py, policy/prefix.py)."""
    from api.services.placer import Placer
    from protocol.requests import CHAT, GenerationRequest, Message

    placer = Placer(settings)
    if placer.load() is None:
        raise RuntimeError("no tokenizer for the model: `ballast up` once builds the tiny one")
    out = []
    for turn in turns:
        req = GenerationRequest(CHAT, model, tuple(Message(m["role"], m["content"]) for m in turn.messages))
        p = placer.prompt(req)
        out.append(HashedPrompt(len(p.ids), block_hashes(p.ids, block_size, seed=placer.seed(req))))
    return out


async def play(stack: Stack, model: str, turns: list[Turn], engines: int = 2,
               played: list[tuple[Chat, str]] | None = None, origin: float | None = None) -> dict[str, Any]:
    """The trace's figures; each chat and its engine appended to `played`, timed from `origin`
    (perf_counter; this trace's start by default)."""
    before = _engines(stack.db_url)
    async with httpx.AsyncClient(base_url=str(stack.api.base_url), headers=dict(stack.api.headers),
                                 timeout=120, limits=httpx.Limits(max_connections=256)) as http:
        t0 = time.perf_counter()
        tasks = []
        for turn in turns:
            await asyncio.sleep(max(0.0, t0 + turn.at - time.perf_counter()))
            tasks.append(asyncio.create_task(_chat(http, model, turn)))
        chats = list(await asyncio.gather(*tasks))
    ended = await asyncio.to_thread(_db_now, stack.db_url)
    after = await asyncio.to_thread(_engines_after, stack.db_url, ended, engines)
    queried = sum(after[e]["prefix_queries"] - before.get(e, {}).get("prefix_queries", 0) for e in after)
    hits = sum(after[e]["prefix_hits"] - before.get(e, {}).get("prefix_hits", 0) for e in after)
    where = await asyncio.to_thread(_served_on, stack.db_url, [c.id for c in chats])
    ratio, moments = imbalance(chats, where, engines)
    ttfts = [c.ttft for c in chats]
    if played is not None:
        o = t0 if origin is None else origin
        played.extend((Chat(c.id, c.start - o, c.ttft, c.end - o), where[c.id]) for c in chats)
    return dict(requests=len(ttfts), ttft_p50_ms=round(1000 * pct(ttfts, 50), 1),
                ttft_p99_ms=round(1000 * pct(ttfts, 99), 1), hit_rate=round(hits / max(1, queried), 3),
                imbalance=ratio, imbalance_moments=moments, served_by=dict(Counter(where.values())))


def kv_bytes_per_token(model_path: str) -> int:
    """K and V × layers × KV heads × head size × the dtype's bytes, from the model's config."""
    c = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dtype = 4 if c.get("torch_dtype", c.get("dtype")) == "float32" else 2
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * dtype


def run_arm(settings: Settings, arm: str, traces: dict[str, list[Turn]], model: str, kv_gib: float,
            hashed: dict[str, list[HashedPrompt]] | None = None) -> tuple[dict[str, Any], replay.ArmRecord | None]:
    """The arm's figures per trace, and with the traces' `hashed` prompts, its recording."""
    with tempfile.TemporaryDirectory(prefix="ballast-bench-placement-") as d, \
            ballast_up(settings, Path(d), BALLAST_ENGINES="2", BALLAST_PLACEMENT=arm,
                       BALLAST_KV_CACHE_GIB=f"{kv_gib:.6f}") as stack:
        deadline = time.monotonic() + 120
        while len(_engines(stack.db_url)) < 2:  # both announced before any request
            assert time.monotonic() < deadline, "the second engine worker never announced itself"
            time.sleep(0.5)
        origin = time.perf_counter()
        played: dict[str, list[tuple[Chat, str]]] = {name: [] for name in traces}
        out = {name: asyncio.run(play(stack, model, turns, played=played[name], origin=origin))
               for name, turns in traces.items()}
        if hashed is None:
            return out, None
        engines = _engines(stack.db_url)
    served = [replay.Served(c.id, name, c.start, turn.tenant, turn.conversation, p.tokens, MAX_TOKENS, p.blocks,
                            engine, c.ttft, c.end)
              for name in traces
              for (c, engine), turn, p in zip(played[name], traces[name], hashed[name], strict=True)]
    figures = tuple((name, replay.Figures(f["requests"], f["hit_rate"], f["imbalance"], f["ttft_p50_ms"],
                                          f["ttft_p99_ms"])) for name, f in out.items())
    return out, replay.ArmRecord(arm, tuple(sorted(engines)), min(s["max_seqs"] for s in engines.values()),
                                 tuple(sorted(served, key=lambda r: r.at)), figures)


def decision_cost(settings: Settings, turns: list[Turn], engines: int = 3) -> dict[str, float]:
    """The API's placement of each turn, in-process, as it runs per request: the prompt
    rendered, tokenized and hashed, then ranked against a local snapshot (nothing called)."""
    from api.services.placer import Placer
    from policy.placement import EngineView
    from protocol.requests import CHAT, GenerationRequest, Message

    placer = Placer(settings)
    pool = [EngineView(f"e{i}", f"http://e{i}", settings.model_name, 0, 0, 64, block_size=128) for i in range(engines)]
    if placer.load() is None:
        raise RuntimeError("no tokenizer for the model: `ballast up` once builds the tiny one")
    costs = []
    for turn in turns * 3:
        messages = tuple(Message(m["role"], m["content"]) for m in turn.messages)
        req = GenerationRequest(CHAT, settings.model_name, messages)
        t0 = time.perf_counter()
        ranked, blocks = placer.rank(req, pool)
        placer.sent(ranked[0], blocks)
        costs.append(time.perf_counter() - t0)
        placer.done(ranked[0].id)
    out = dict(decisions=len(costs), p50_ms=round(1000 * pct(costs, 50), 3), p99_ms=round(1000 * pct(costs, 99), 3))

    # Worker loss: where each conversation's latest turn would go now, and once e0 is gone.
    reqs = {json.dumps(t.messages[:2]): GenerationRequest(CHAT, settings.model_name, tuple(
        Message(m["role"], m["content"]) for m in t.messages)) for t in turns}
    before = {k: placer.rank(r, pool)[0][0].id for k, r in reqs.items()}
    after = {k: placer.rank(r, pool[1:])[0][0].id for k, r in reqs.items()}
    held = sum(1 for k in reqs if before[k] == pool[0].id)
    moved = sum(1 for k in reqs if before[k] != after[k])
    return out | dict(loss_conversations=len(reqs), loss_held_share=round(held / len(reqs), 3),
                      loss_remapped_share=round(moved / len(reqs), 3))


def verdict(out: dict[str, Any]) -> dict[str, bool]:
    heavy = {a: out[a]["prefix_heavy"] for a in ARMS}
    plain = {a: out[a]["no_reuse"] for a in ARMS}
    return dict(
        hit_rate_2x_round_robin=heavy["affinity"]["hit_rate"] >= 2 * heavy["round_robin"]["hit_rate"],
        ttft_p50_best_on_prefix_heavy=heavy["affinity"]["ttft_p50_ms"] < min(
            heavy["least_loaded"]["ttft_p50_ms"], heavy["round_robin"]["ttft_p50_ms"]),
        ttft_p50_within_5pct_of_least_loaded_on_no_reuse=(
            plain["affinity"]["ttft_p50_ms"] <= 1.05 * plain["least_loaded"]["ttft_p50_ms"]),
        imbalance_at_most_1_25=all((out["affinity"][t]["imbalance"] or 1.0) <= 1.25 for t in TRACES),
        only_the_lost_engines_keys_move=out["decision"]["loss_remapped_share"] <= out["decision"]["loss_held_share"],
        decision_p99_under_1ms=out["decision"]["p99_ms"] < 1.0,
    )


def main(settings: Settings, seconds: float = 40.0, rate: float = 3.0, record: Path | None = None) -> int:
    from engine.model_spec import resolve_model

    spec = resolve_model(settings)
    model, kv_gib = spec.name, KV_CACHE_TOKENS * kv_bytes_per_token(spec.path) / 2**30
    traces = {kind: trace(kind, seconds, rate) for kind in TRACES}
    print(f"bench placement: {', '.join(f'{k} {len(v)} chats' for k, v in traces.items())} over {seconds:.0f} s "
          f"each ({rate}/s, {MAX_TOKENS} tokens each); arms {', '.join(ARMS)}, each a fresh `ballast up --engines 2`",
          flush=True)
    out: dict[str, Any] = dict(bench="placement", seconds=seconds, rate=rate)
    hashed = {kind: prompts(settings, model, turns) for kind, turns in traces.items()}
    records = []
    for arm in ARMS:
        print(f"arm {arm} …", flush=True)
        out[arm], rec = run_arm(settings, arm, traces, model, kv_gib, hashed)
        assert rec is not None
        records.append(rec)
    path = record or Path(settings.data_dir) / "bench" / "placement-record.json"
    replay.dump(replay.Recording(128, KV_CACHE_TOKENS, settings.prefix_index_blocks, MAX_TOKENS, seconds, rate,
                                 tuple(records)), path)
    print(f"recorded for `ballast sim replay {path}`", flush=True)
    out["decision"] = decision_cost(settings.model_copy(update=dict(placement="affinity")), traces["prefix_heavy"])
    out["targets"] = verdict(out)
    print(f"\nplacement decision in the API (tokenize, hash, rank): p50 {out['decision']['p50_ms']} ms, "
          f"p99 {out['decision']['p99_ms']} ms over {out['decision']['decisions']}")
    d = out["decision"]
    print(f"an engine of 3 lost: {d['loss_remapped_share']:.1%} of {d['loss_conversations']} conversations move "
          f"(it held {d['loss_held_share']:.1%})")
    print(f"\n{'arm':13} {'trace':13} {'n':>4} {'hit rate':>8} {'TTFT p50':>9} {'p99':>9} {'imbalance':>9}")
    for arm in ARMS:
        for t in TRACES:
            a = out[arm][t]
            print(f"{arm:13} {t:13} {a['requests']:4d} {a['hit_rate']:8.3f} {a['ttft_p50_ms']:7.1f}ms "
                  f"{a['ttft_p99_ms']:7.1f}ms {a['imbalance'] if a['imbalance'] is not None else '-':>9}")
    print(f"targets: {out['targets']}")
    print(json.dumps(out))
    return 0
