"""A synthetic, seeded request trace, made lazily (a generator: millions of requests never
sit in memory at once).

Assumptions, each a `TraceSpec` field:
- Arrivals are Poisson at `rate_per_s`, modulated by a diurnal curve (a sine of
  `diurnal` amplitude over `day_s`, rising through the mean at the start) and by bursts (starting at
  Poisson times, `burst_every_s` apart on average, lasting `burst_s`, multiplying the rate
  by `burst_factor`); drawn by thinning, so the modulation is exact.
- Each region has `tenants` tenants of its own (their home) and an even share of the
  traffic; within a region, tenants' popularity is Zipf-like (weight 1/rank^`zipf`). A
  tenant has a model (its pool in its region) and a system prompt of lognormal length.
- A request is the next turn of one of the recent conversations with probability
  `follow_up` (it resends the history: system prompt, earlier turns and replies), else a
  new conversation. Token counts are lognormal (heavy-tailed), clipped.
- Classes: interactive tiers priority / default / flex and batch, by `mix`. Batch items
  share their tenant's system prompt and are never follow-ups.
- A prompt's full leading blocks (of `block_size` tokens) are chained hashes as vLLM keys
  them: blocks wholly inside the system prompt are the tenant's (shared by all its
  conversations), the rest the conversation's.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from protocol.tiers import Tier


@dataclass(frozen=True)
class Arrival:
    id: int
    at: float  # seconds into the trace
    tenant: int
    tier: str  # a protocol.tiers.Tier value
    region: int  # its home region
    model: int  # its pool in the region
    prompt: int  # tokens
    output: int  # tokens
    blocks: tuple[int, ...]  # the prompt's full leading blocks, chained hashes


@dataclass(frozen=True)
class TraceSpec:
    seconds: float = 60.0
    rate_per_s: float = 100.0  # the mean over a whole day, bursts aside
    seed: int = 1
    regions: int = 1
    models: int = 1  # pools per region; a tenant uses one
    tenants: int = 400  # per region
    zipf: float = 0.8
    system_median: int = 1500  # tokens
    system_sigma: float = 0.6
    user_median: int = 80
    user_sigma: float = 0.8
    output_median: int = 120
    output_sigma: float = 0.9
    max_output: int = 2048
    max_prompt: int = 16_384  # a conversation longer than this starts over
    follow_up: float = 0.6
    conversations: int = 2000  # recent conversations a follow-up picks from
    mix: tuple[tuple[str, float], ...] = ((Tier.PRIORITY, 0.1), (Tier.DEFAULT, 0.55), (Tier.FLEX, 0.15),
                                          (Tier.BATCH, 0.2))
    diurnal: float = 0.5  # the rate swings between (1 - d) and (1 + d) × the mean
    day_s: float = 86_400.0
    burst_every_s: float = 0.0  # 0: no bursts
    burst_s: float = 10.0
    burst_factor: float = 3.0
    block_size: int = 128


def rate_at(spec: TraceSpec, t: float, bursting: bool) -> float:
    diurnal = 1 + spec.diurnal * math.sin(2 * math.pi * t / spec.day_s)
    return spec.rate_per_s * diurnal * (spec.burst_factor if bursting else 1.0)


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def chain(blocks: tuple[int, ...], n: int, key: tuple[int, int], system_blocks: int, conversation: int
          ) -> tuple[int, ...]:
    """`blocks` extended to `n` blocks: those inside the system prompt keyed by its tenant,
    the rest by the conversation (Python's hash of int tuples is the same in every process)."""
    out = list(blocks[:n])
    h = out[-1] if out else 0x0BA11A57
    for i in range(len(out), n):
        h = hash((h, *key, i)) if i < system_blocks else hash((h, 2, conversation, i))
        out.append(h)
    return tuple(out)


@dataclass
class _Conversation:
    id: int
    tenant: int
    tokens: int
    blocks: tuple[int, ...]


def arrivals(spec: TraceSpec) -> Iterator[Arrival]:
    rng = random.Random(spec.seed)
    # 1. Tenants (region-major ids): popularity within their region, model, system prompt.
    cumulative = _cumsum([1 / (i + 1) ** spec.zipf for i in range(spec.tenants)])
    everyone = spec.tenants * spec.regions
    model = [rng.randrange(spec.models) for _ in range(everyone)]
    system = [lognormal(rng, spec.system_median, spec.system_sigma, spec.block_size, spec.max_prompt // 2)
              for _ in range(everyone)]
    tiers = [t for t, _ in spec.mix]
    tier_cumulative = _cumsum([w for _, w in spec.mix])
    recent: deque[_Conversation] = deque(maxlen=spec.conversations)
    peak = rate_at(spec, spec.day_s / 4, bool(spec.burst_every_s))
    next_burst = rng.expovariate(1 / spec.burst_every_s) if spec.burst_every_s else math.inf
    t, n, conversations = 0.0, 0, 0
    while True:
        # 2. The next arrival: a Poisson process at the peak rate, thinned to the rate now.
        t += rng.expovariate(peak)
        if t >= spec.seconds:
            return
        while next_burst + spec.burst_s < t:
            next_burst += spec.burst_s + rng.expovariate(1 / spec.burst_every_s)
        if rng.random() * peak > rate_at(spec, t, next_burst <= t):
            continue
        # 3. Its class, and the conversation it continues or starts.
        tier = tiers[min(len(tiers) - 1, bisect.bisect_left(tier_cumulative, rng.random() * tier_cumulative[-1]))]
        user = lognormal(rng, spec.user_median, spec.user_sigma, 1, spec.max_prompt)
        conv = recent[rng.randrange(len(recent))] if recent and tier != Tier.BATCH and rng.random() < spec.follow_up \
            else None
        if conv is not None and conv.tokens + user < spec.max_prompt:
            conv.tokens += user
        else:
            region = rng.randrange(spec.regions)
            tenant = region * spec.tenants + min(spec.tenants - 1,
                                                 bisect.bisect_left(cumulative, rng.random() * cumulative[-1]))
            conv = _Conversation(conversations, tenant, system[tenant] + user, ())
            conversations += 1
            if tier != Tier.BATCH:
                recent.append(conv)
        # 4. Its blocks: the history's, extended.
        tenant = conv.tenant
        conv.blocks = chain(conv.blocks, conv.tokens // spec.block_size, (1, tenant),
                            system[tenant] // spec.block_size, conv.id)
        output = lognormal(rng, spec.output_median, spec.output_sigma, 1, spec.max_output)
        yield Arrival(n, t, tenant, tier, tenant // spec.tenants, model[tenant], conv.tokens, output, conv.blocks)
        n += 1
        conv.tokens += output  # the reply is history for the next turn


def _cumsum(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


@dataclass(frozen=True)
class BatchItem:
    """One line of a batch file: its prompt's head as text (what `policy.grouping` reads:
    the first `head_chars` characters, activities/batch.py's PREFIX_KEY_CHARS) and as
    blocks (what the engine's cache reads)."""

    idx: int
    head: str
    prompt: int  # tokens
    output: int
    blocks: tuple[int, ...]

    def arrival(self, at: float) -> Arrival:
        return Arrival(self.idx, at, 0, Tier.BATCH, 0, 0, self.prompt, self.output, self.blocks)


@dataclass(frozen=True)
class BatchSpec:
    """A prefix-heavy batch: every item is one of `prefixes` long shared prompts (a system
    prompt, few-shot examples or a document: lognormal, median `prefix_median` tokens)
    and its own question, in file order at random."""

    items: int = 10_000
    prefixes: int = 8
    prefix_median: int = 2000
    prefix_sigma: float = 0.3
    user_median: int = 150
    output_median: int = 100
    output_sigma: float = 0.6
    seed: int = 1
    chars_per_token: int = 4
    head_chars: int = 4096
    block_size: int = 128
    max_prefix: int = 12_288


def batch_items(spec: BatchSpec) -> list[BatchItem]:
    rng = random.Random(spec.seed)
    tokens = [lognormal(rng, spec.prefix_median, spec.prefix_sigma, spec.block_size, spec.max_prefix)
              for _ in range(spec.prefixes)]
    letters = "abcdefghijklmnopqrstuvwxyz "
    texts = [f"[prefix {k}] " + "".join(rng.choices(letters, k=min(spec.head_chars, t * spec.chars_per_token)))
             for k, t in enumerate(tokens)]
    out = []
    for i in range(spec.items):
        k = rng.randrange(spec.prefixes)
        user = lognormal(rng, spec.user_median, 0.5, 1, 4096)
        prompt = tokens[k] + user
        head = (texts[k] + f" [question {i}] ")[:spec.head_chars]
        blocks = chain((), prompt // spec.block_size, (3, k), tokens[k] // spec.block_size, i)
        out.append(BatchItem(i, head, prompt, lognormal(rng, spec.output_median, spec.output_sigma, 1, 2048), blocks))
    return out
