"""The real placement bench replayed in virtual time: the simulator validated against the
real stack at small scale.

`ballast bench placement --record PATH` writes what each arm's real run did (a `Recording`):
every request's start at the client, its prompt as the 128-token prefix blocks the API's
placer hashed (`policy.prefix.block_hashes` over the engine's own token ids), its output,
and the engine its worker recorded serving it; and the arm's figures from vLLM's counters.
`replay` plays the same requests, in the same order and at the same moments, through
`sim.loop.run` on two engines with the real ones' ids (the rendezvous tie-break hashes the
id, so the ids decide ties), the bench's KV cache (64 blocks), the API's prefix index size,
and costs fitted to the recording itself (`fit`: the step-time curve, prefill, and the
time from placement to the engine's queue). Each arm's two traces play
in one run, as they did on one stack: the no-reuse trace's blocks are in the caches and
round-robin's turn has moved when the prefix-heavy one starts. `stepwise` makes each
decision again from the real history instead, which separates the policy's reproduction
from the replay's own timing.

Compared per arm and trace: the share of requests placed on the same engine (engines
matched up to relabelling: the labelling that agrees most, said so where it is not the
identity), the prefix-cache hit rate, load imbalance (measured alike: `imbalance`, the
bench's own measure, over each request's start to end), TTFT; and affinity's hit rate over
round-robin's.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from policy.placement import EngineView, Weights
from policy.prefix import PrefixIndex
from protocol.tiers import Tier
from sim.engine import EngineSpec, Job
from sim.loop import FleetSpec, RunSpec, pick, run
from sim.trace import Arrival

IMBALANCE_STEP_S = 0.005  # the bench's sampling step

# The tolerance, stated before the first replay. Round-robin's turn depends on the order of
# arrivals alone, so anything short of every decision is a modelling error. Affinity follows
# the prefix index, which the sim rebuilds exactly; only its load bound and score read the
# requests in flight, which real timing moves. Least-loaded reads only those.
SAME_ENGINE = (("round_robin", 1.0), ("affinity", 0.90), ("least_loaded", 0.80))  # share of all the arm's requests
HIT_RATE_ABS = 0.05  # sim within this of vLLM's counters, every arm and trace
IMBALANCE_ABS = 0.10  # sim within this of the bench's, every arm and trace
RATIO_REL = 0.15  # affinity over round-robin's hit rate (prefix-heavy), sim within this share of the real one


# -- the recording (written by bench/placement.py) ------------------------------------------


@dataclass(frozen=True)
class Served:
    """One request as the real stack served it."""

    id: str  # the API's request id
    trace: str  # "no_reuse" or "prefix_heavy"
    at: float  # its start at the client, seconds from the arm's first
    tenant: int  # its system prompt (-1: none)
    conversation: int  # (-1: none)
    prompt: int  # tokens, as the engine's tokenizer renders the chat
    output: int  # tokens
    blocks: tuple[int, ...]  # the prompt's full leading blocks, as the API's placer hashes them
    engine: str  # where its engine worker recorded serving it
    ttft: float  # seconds, at the client
    end: float  # seconds from the arm's first start


@dataclass(frozen=True)
class Figures:
    """One trace's figures, as the bench measures them."""

    requests: int
    hit_rate: float  # prefix-cache hit over queried prompt tokens (vLLM's counters; the sim's own)
    imbalance: float
    ttft_p50_ms: float
    ttft_p99_ms: float


@dataclass(frozen=True)
class ArmRecord:
    arm: str
    engines: tuple[str, ...]  # the engine workers' ids
    max_seqs: int  # each engine's, as it announced them (the load score's denominator)
    requests: tuple[Served, ...]  # in start order
    figures: tuple[tuple[str, Figures], ...]  # per trace, in play order


@dataclass(frozen=True)
class Recording:
    block_size: int
    kv_cache_tokens: int  # per engine
    index_blocks: int  # the API's prefix index (config's prefix_index_blocks)
    max_tokens: int
    seconds: float
    rate: float
    arms: tuple[ArmRecord, ...]

    def arm(self, name: str) -> ArmRecord:
        return next(a for a in self.arms if a.arm == name)


def dump(rec: Recording, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(rec)))


def load(path: Path) -> Recording:
    d = json.loads(path.read_text())
    arms = tuple(ArmRecord(a["arm"], tuple(a["engines"]), a["max_seqs"],
                           tuple(Served(**(r | dict(blocks=tuple(r["blocks"])))) for r in a["requests"]),
                           tuple((t, Figures(**f)) for t, f in a["figures"])) for a in d["arms"])
    return Recording(d["block_size"], d["kv_cache_tokens"], d["index_blocks"], d["max_tokens"], d["seconds"],
                     d["rate"], arms)


# -- the measure shared with the bench ------------------------------------------------------


def imbalance(spans: Sequence[tuple[float, float, str]], engines: int, step_s: float = IMBALANCE_STEP_S
              ) -> tuple[float, int]:
    """Max over mean of the requests in flight per engine (each span: start, end, engine),
    every `step_s`, at the moments with at least one per engine in flight (fewer cannot be
    balanced); averaged. And how many moments counted."""
    if not spans:
        return 1.0, 0
    seen = set(e for _, _, e in spans)
    t, last, ratios = min(s for s, _, _ in spans), max(e for _, e, _ in spans), []
    while t < last:
        on = Counter(e for s, end, e in spans if s <= t < end)
        if sum(on.values()) >= engines:
            counts = [on.get(e, 0) for e in seen]
            ratios.append(max(counts) / statistics.mean(counts))
        t += step_s
    return (round(statistics.mean(ratios), 3) if ratios else 1.0), len(ratios)


# -- the step-time curve, from the recording ------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """The tiny model's costs on the recording's machine, fitted by least squares."""

    prefill_s_per_token: float  # TTFT's slope in the missed prompt tokens (no-reuse trace: all missed)
    ttft_intercept_s: float  # what a prompt of no tokens would wait: the API, the stream, a step
    step_s: float  # a decode step alone
    seq_s: float  # each sequence in flight on the engine adds this
    samples: int

    @property
    def delay_s(self) -> float:
        """TTFT's intercept less the step it includes: the time a request is in flight
        before the engine takes it up."""
        return max(0.0, self.ttft_intercept_s - self.step_s - self.seq_s)

    def engine(self, rec: Recording, max_seqs: int) -> EngineSpec:
        return EngineSpec(step_s=self.step_s, seq_s=self.seq_s, prefill_s_per_token=self.prefill_s_per_token,
                          max_seqs=max_seqs, delay_s=self.delay_s, block_size=rec.block_size,
                          cache_blocks=rec.kv_cache_tokens // rec.block_size)


def fit(rec: Recording) -> Fit:
    """Prefill from the no-reuse trace's TTFTs against prompt size (nothing of theirs is
    cached); decode from each request's time per token after its first against the mean
    number in flight on its engine meanwhile (the real engines' own records). Floors keep a
    noisy fit from going negative."""
    plain = [r for a in rec.arms for r in a.requests if r.trace == "no_reuse"]
    p, a = _line([r.prompt for r in plain], [r.ttft for r in plain])
    xs, ys = [], []
    for arm in rec.arms:
        for r in arm.requests:
            if r.output < 2:
                continue
            first = r.at + r.ttft
            others = [o for o in arm.requests if o.engine == r.engine and o.at < r.end and o.end > first]
            overlap = sum(min(o.end, r.end) - max(o.at, first) for o in others)
            xs.append(overlap / max(1e-9, r.end - first))
            ys.append((r.end - first) / (r.output - 1))
    seq, step = _line(xs, ys)
    return Fit(max(p, 1e-7), round(a, 4), max(step, 1e-4), max(seq, 0.0), len(ys))


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Slope and intercept; a flat line at the mean where x does not vary."""
    if len(set(xs)) < 2:
        return 0.0, statistics.mean(ys) if ys else 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return slope, intercept


# -- the replay -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceResult:
    trace: str
    real: Figures
    sim: Figures
    same_engine: float  # share of requests placed where the real stack served them


@dataclass(frozen=True)
class ArmResult:
    arm: str
    labels: tuple[tuple[str, str], ...]  # the sim's engine → the real one it is matched to
    traces: tuple[TraceResult, ...]
    placed: tuple[tuple[str, str], ...]  # request id → the sim's engine (relabelled)
    same_engine: float  # over all the arm's requests
    stepwise: float  # the same, each decision made from the real history (`stepwise`)

    @property
    def relabelled(self) -> bool:
        return any(s != r for s, r in self.labels)

    def trace(self, name: str) -> TraceResult:
        return next(t for t in self.traces if t.trace == name)


@dataclass(frozen=True)
class Replay:
    fit: Fit
    arms: tuple[ArmResult, ...]

    def arm(self, name: str) -> ArmResult:
        return next(a for a in self.arms if a.arm == name)

    def ratio(self, side: str, trace: str = "prefix_heavy") -> float:
        """Affinity's hit rate over round-robin's, `real` or `sim`."""
        def rate(arm: str) -> float:
            t = self.arm(arm).trace(trace)
            return (t.real if side == "real" else t.sim).hit_rate
        return rate("affinity") / max(1e-9, rate("round_robin"))


def arrivals(arm: ArmRecord) -> list[Arrival]:
    """The arm's requests as the simulator's arrivals, ids in start order (a tie at one
    instant keeps the real order)."""
    return [Arrival(i, r.at, max(0, r.tenant), Tier.DEFAULT, 0, 0, r.prompt, r.output, r.blocks)
            for i, r in enumerate(arm.requests)]


def replay_arm(rec: Recording, arm: ArmRecord, f: Fit) -> ArmResult:
    engines = tuple(sorted(arm.engines))
    fleet = FleetSpec(engines_per_pool=len(engines), engine=f.engine(rec, arm.max_seqs),
                      engine_ids=engines, index_blocks=rec.index_blocks)
    out = run(fleet, arrivals(arm), RunSpec(arm.arm, keep_jobs=True))
    jobs = {j.arrival.id: j for j in out.jobs}
    labels = relabel([(r.engine, jobs[i].engine) for i, r in enumerate(arm.requests)], engines)
    traces = []
    for name in dict.fromkeys(r.trace for r in arm.requests):
        mine = [(r, jobs[i]) for i, r in enumerate(arm.requests) if r.trace == name]
        traces.append(TraceResult(name, dict(arm.figures)[name], _figures(mine, len(engines)),
                                  sum(labels[j.engine] == r.engine for r, j in mine) / len(mine)))
    placed = tuple((r.id, labels[jobs[i].engine]) for i, r in enumerate(arm.requests))
    same = sum(p == r.engine for (_, p), r in zip(placed, arm.requests, strict=True)) / max(1, len(placed))
    return ArmResult(arm.arm, tuple(sorted(labels.items())), tuple(traces), placed, same, stepwise(rec, arm))


def stepwise(rec: Recording, arm: ArmRecord) -> float:
    """The share of decisions the sim's placement makes as the real stack did when each is
    made from the real history: the prefix index fed where every earlier request was
    served, the loads the requests then in flight at the client on each engine (up to
    relabelling). A closed-loop replay's decisions also follow its own timing, and one
    different decision sends a conversation's later turns after it: this separates the
    policy's reproduction from that."""
    engines = sorted(arm.engines)
    index = PrefixIndex(rec.index_blocks)
    turn, pairs = 0, []
    for i, r in enumerate(arm.requests):
        loads = Counter(o.engine for o in arm.requests[:i] if o.end > r.at)
        views = [EngineView(e, "", "", loads[e], 0, arm.max_seqs, block_size=rec.block_size) for e in engines]
        chosen, turn = pick(views, r.blocks, index, arm.arm, Weights(), turn)
        index.record(r.engine, r.blocks)
        pairs.append((r.engine, chosen))
    labels = relabel(pairs, engines)
    return sum(labels[p] == real for real, p in pairs) / max(1, len(pairs))


def relabel(pairs: Sequence[tuple[str, str]], engines: Sequence[str]) -> dict[str, str]:
    """Sim engine → real engine: the one-to-one matching under which most requests agree
    (ties to the identity). Exhaustive: a replay has a handful of engines."""
    best: dict[str, str] = {}
    score = -1
    for perm in itertools.permutations(engines):
        m = dict(zip(engines, perm, strict=True))
        agree = sum(m[s] == r for r, s in pairs)
        if agree > score:
            best, score = m, agree
    return best


def replay(rec: Recording) -> Replay:
    f = fit(rec)
    return Replay(f, tuple(replay_arm(rec, a, f) for a in rec.arms))


@dataclass(frozen=True)
class Check:
    what: str
    met: bool
    detail: str


def verdict(r: Replay) -> tuple[Check, ...]:
    """Each tolerance, met or not, with the figures it was judged on."""
    out = []
    names = {a.arm for a in r.arms}
    for arm, floor in SAME_ENGINE:
        if arm in names:
            same = r.arm(arm).same_engine
            out.append(Check(f"{arm}: same engine ≥ {floor:.0%}", same >= floor - 1e-9, f"{same:.1%}"))
    for arm, floor in SAME_ENGINE:
        if arm in names:
            step = r.arm(arm).stepwise
            out.append(Check(f"{arm}: same engine step by step ≥ {floor:.0%}", step >= floor - 1e-9, f"{step:.1%}"))
    for a in r.arms:
        for t in a.traces:
            d = t.sim.hit_rate - t.real.hit_rate
            out.append(Check(f"{a.arm} {t.trace}: hit rate within ±{HIT_RATE_ABS}", abs(d) <= HIT_RATE_ABS + 1e-9,
                             f"sim {t.sim.hit_rate:.3f}, real {t.real.hit_rate:.3f} ({d:+.3f})"))
    for a in r.arms:
        for t in a.traces:
            d = t.sim.imbalance - t.real.imbalance
            out.append(Check(f"{a.arm} {t.trace}: imbalance within ±{IMBALANCE_ABS}", abs(d) <= IMBALANCE_ABS + 1e-9,
                             f"sim {t.sim.imbalance:.3f}, real {t.real.imbalance:.3f} ({d:+.3f})"))
    if {"affinity", "round_robin"} <= names:
        real, sim = r.ratio("real"), r.ratio("sim")
        out.append(Check(f"affinity / round-robin hit rate within ±{RATIO_REL:.0%}",
                         abs(sim / real - 1) <= RATIO_REL + 1e-9 if real else False,
                         f"sim {sim:.2f}×, real {real:.2f}× ({sim / real - 1:+.1%})" if real else "real 0"))
    return tuple(out)


def _figures(mine: list[tuple[Served, Job]], engines: int) -> Figures:
    ttfts = sorted((j.first or math.nan) - j.arrival.at for _, j in mine)
    spans = [(j.arrival.at, j.finished or j.arrival.at, j.engine) for _, j in mine]
    queried, cached = sum(j.queried for _, j in mine), sum(j.cached for _, j in mine)
    return Figures(len(mine), round(cached / max(1, queried), 3), imbalance(spans, engines)[0],
                   round(1000 * _pct(ttfts, 50), 1), round(1000 * _pct(ttfts, 99), 1))


def _pct(xs: list[float], p: float) -> float:
    """Nearest-rank, as bench/stats.py's."""
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))] if xs else math.nan
