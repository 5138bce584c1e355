"""Quota accuracy: one tenant's global limit admitted in every region from local, bounded-
stale state, against synchronous admission that asks the limit's home region every time.

Both decide with the real `policy.admission.admit`; only the usage each decision sees
differs:
- synchronous: exact (every admission so far in the window), and the request waits one
  round trip to the home region (region 0) first;
- bounded-stale: the region's own admissions (exact) plus the others' as reconciled on a
  timer: every `reconcile_s`, each region sends its window's total to the home region,
  which sends back the sum of everyone's, so a region sees another's admissions at most
  `reconcile_s` + a round trip late. Nothing waits on the request path.

Assumptions: the regions sit evenly round a ring the size of the globe; a round trip costs
`rtt_floor_s` plus `rtt_span_s` × the ring distance over half the ring (5 ms next door,
155 ms to the far side: about what public clouds' inter-region round trips measure). The
tenant's requests come from every region alike, Poisson, at `demand` × its limit, with
lognormal prompts; the limit is on input tokens per (UTC) minute, and all requests are of
one `tier` (the default tier's 0.95 headroom absorbs most of the staleness; priority's 1.0
shows it whole). Control-plane cost counts messages: one round trip per request (growing
with traffic), against two per region per reconcile (one message carries every tenant's
totals, so that figure is the whole fleet's, whatever the traffic).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass

from policy.admission import Admit, Demand, Usage, admit, window_start
from protocol.limits import LimitSet
from protocol.tiers import Tier

MINUTE_S = 60


@dataclass(frozen=True)
class QuotaSetup:
    regions: int = 30
    minutes: int = 5
    limit_per_min: int = 3_000_000  # input tokens
    demand: float = 1.5  # offered input tokens over the limit
    prompt_median: int = 1000
    prompt_sigma: float = 1.0
    reconcile_s: float = 1.0
    tier: str = Tier.DEFAULT
    rtt_floor_s: float = 0.005
    rtt_span_s: float = 0.150
    seed: int = 1


@dataclass(frozen=True)
class Mode:
    name: str  # "synchronous" | "stale"
    admitted_share: float  # admitted input tokens over the limit, mean over full windows
    overshoot: float  # past the limit, over it: the worst window
    added_p50_s: float  # latency a decision adds to a request
    added_p99_s: float
    messages_per_s: float


@dataclass(frozen=True)
class QuotaResult:
    setup: QuotaSetup
    modes: tuple[Mode, ...]


def rtt(a: int, b: int, regions: int, floor_s: float, span_s: float) -> float:
    distance = min((a - b) % regions, (b - a) % regions)
    return floor_s + span_s * distance / max(1, regions // 2)


def simulate(s: QuotaSetup = QuotaSetup()) -> QuotaResult:
    # 1. The arrivals, the same for both modes: (time, region, input tokens).
    rng = random.Random(s.seed)
    mean = s.prompt_median * math.exp(s.prompt_sigma ** 2 / 2)
    rate = s.demand * s.limit_per_min / mean / MINUTE_S
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < s.minutes * MINUTE_S:
        arrivals.append((t, rng.randrange(s.regions),
                         max(1, round(rng.lognormvariate(math.log(s.prompt_median), s.prompt_sigma)))))
    limits = [(LimitSet(input_tokens_per_min=s.limit_per_min), Usage())]
    trip = [rtt(r, 0, s.regions, s.rtt_floor_s, s.rtt_span_s) for r in range(s.regions)]

    def decide(used: int, tokens: int, now: float) -> bool:
        return isinstance(admit(Demand(s.tier, tokens, 0), [(limits[0][0], Usage(input_tokens=used))], now),
                          Admit)

    # 2. Synchronous: the home region decides in the order requests reach it, on exact usage.
    windows: dict[float, int] = {}
    for at, tokens in sorted((at + trip[r] / 2, tokens) for at, r, tokens in arrivals):
        w = window_start(at, MINUTE_S)
        if decide(windows.get(w, 0), tokens, at):
            windows[w] = windows.get(w, 0) + tokens
    synchronous = _mode("synchronous", windows, s, sorted(trip[r] for _, r, _ in arrivals), len(arrivals))

    # 3. Bounded-stale: own admissions exact, the others' as of the last reconcile.
    own: list[dict[float, int]] = [{} for _ in range(s.regions)]
    history: list[list[tuple[float, float, int]]] = [[] for _ in range(s.regions)]  # (time, window, window total)
    windows = {}
    for at, r, tokens in arrivals:
        w = window_start(at, MINUTE_S)
        tick = math.floor(at / s.reconcile_s) * s.reconcile_s
        others = sum(_as_of(history[q], tick - (trip[q] + trip[r]) / 2, w) for q in range(s.regions) if q != r)
        mine = own[r].get(w, 0)
        if decide(mine + others, tokens, at):
            own[r][w] = mine + tokens
            history[r].append((at, w, mine + tokens))
            windows[w] = windows.get(w, 0) + tokens
    cost = 2 * s.regions / s.reconcile_s
    stale = _mode("stale", windows, s, [0.0], 0, cost)
    return QuotaResult(s, (synchronous, stale))


def _as_of(history: list[tuple[float, float, int]], t: float, window: float) -> int:
    """A region's total in `window` as it stood at `t` (0 before its first admission there)."""
    i = bisect.bisect_right(history, (t, math.inf, 0))
    return history[i - 1][2] if i and history[i - 1][1] == window else 0


def _mode(name: str, windows: dict[float, int], s: QuotaSetup, added: list[float], requests: int,
          messages_per_s: float | None = None) -> Mode:
    full = [windows.get(m * MINUTE_S, 0) for m in range(s.minutes)]
    shares = [v / s.limit_per_min for v in full]
    return Mode(name, sum(shares) / len(shares), max(0.0, max(shares) - 1.0), added[len(added) // 2],
                added[min(len(added) - 1, math.ceil(0.99 * len(added)) - 1)],
                requests / (s.minutes * MINUTE_S) if messages_per_s is None else messages_per_s)
