"""Who gets in: a tenant's limits against its usage. Pure: usage, limits and `now` are
arguments; the shell (`api/services/admission.py`) keeps the usage and the limits in memory.

Limits (table `limits`, NULL = no limit) exist per tenant (model '*': all its models
together) and per tenant × model; where both exist both apply. Dimensions:
- `requests_per_min`, `input_tokens_per_min`, `output_tokens_per_min`: fixed UTC minute
  windows (`date_trunc('minute', at, 'UTC')` in SQL); `tokens_per_day` (input + output):
  the UTC day. A request counts in the window of its admission (its reserve row's `at`),
  whenever it ends. Until it settles it counts what it reserved: its input estimate
  (corrected to the engine's `prompt_tokens` once the engine has it) and its `max_tokens`
  (absent: the rest of the context); once settled, what it used.
- `concurrent_requests`: reservations not yet settled (interactive only).
- `batch_queue_tokens`: tokens of the tenant's batches still open (estimated at
  validation: input estimate + max_tokens per item); see `admit_batch`.
Interactive limits count interactive traffic only; batch work is bounded by its enqueued
tokens and never refused for capacity once enqueued (it waits).

`admit`, step by step, for each limit that applies ('*' first, then the model's), each
dimension in a fixed order:
1. A request is refused only if admitting it would pass the limit as this view sees it:
   used + needed > limit. Nobody is throttled below quota.
2. Tiers shed in order under pressure: a tier is refused once usage has reached its
   headroom fraction of the limit (`Headroom`: flex 0.8, default 0.95, priority 1.0 by
   default), so as a tenant nears a limit flex goes first, then default; priority may use
   all of it. (With fraction f < 1, a request of that tier is admitted while used < f ×
   limit and used + needed <= limit.)
3. While the fleet is under pressure (every engine of the model busy with interactive
   work), flex is refused outright (`fleet_busy`): OpenAI's "resource unavailable".
The first refusal names the limit, its value and when to retry: the end of the window
(≥ 1 s); 1 s for concurrency.

Overshoot (`overshoot_bound`). Each admitting process decides from its own admissions
(exact) plus the other processes' as last folded into `quota_usage`. An admission becomes
visible to the others within S = 2 × flush interval (a reserve waits at most one tick
for the engine's corrected figures, then the next tick writes it) + 3 × refresh interval
(the reconciler's next fold, the reader's next refresh, and one period for the time the
flush, the fold and the refresh themselves take: all three run at a fixed rate, and
together take milliseconds, far under a period). With the defaults (0.1 s, 1 s) S = 3.2 s.
So with P processes, usage in one window can pass a limit L by at most what the other
P − 1 processes admit within S, each at most L (its own view stops it there):
overshoot ≤ (P − 1) × min(L, ⌈peak admission rate per process × S⌉). One process: 0.
(The last admission in a window, at t by process p, saw every other admission older than
t − S; those newer number at most the others' admissions within S.) Synchronous
admission (one transaction per decision) has no overshoot and costs a database round
trip per request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from protocol.limits import ANY_MODEL, LABELS, LimitSet
from protocol.tiers import Tier

if TYPE_CHECKING:
    from protocol.embeddings import EmbeddingRequest
    from protocol.requests import GenerationRequest

MINUTE_S = 60
DAY_S = 86_400
CONCURRENCY_RETRY_S = 1
FINE_TUNE_RETRY_S = 60  # a job takes minutes at least to end
FLEET_RETRY_S = 1

Dimension = Literal["requests_per_min", "input_tokens_per_min", "output_tokens_per_min", "concurrent_requests",
                    "tokens_per_day"]
# The order a request's dimensions are checked in: the first refusal is the one reported.
DIMENSIONS: tuple[Dimension, ...] = ("concurrent_requests", "requests_per_min", "input_tokens_per_min",
                                     "output_tokens_per_min", "tokens_per_day")

# The estimate of a prompt before the engine has tokenized it (`estimate`): every token
# is at least one byte for byte-level BPE tokenizers (and the tiny model's), so UTF-8
# bytes bound the text; chat templates add role markers per message and a few tokens per
# request (BOS, the assistant's header, a default system preamble).
PER_MESSAGE_TOKENS = 16
PER_REQUEST_TOKENS = 32



@dataclass(frozen=True)
class Usage:
    """What counts against one LimitSet as the deciding process sees it, for the windows
    that hold `now` (the caller drops figures of windows that have ended)."""

    requests: int = 0  # admitted in the current minute
    input_tokens: int = 0  # current minute: reserved until settled, then used
    output_tokens: int = 0
    day_tokens: int = 0  # input + output, current UTC day
    in_flight: int = 0  # interactive reservations not yet settled
    batch_queue_tokens: int = 0  # open batch reservations


@dataclass(frozen=True)
class Demand:
    tier: str  # priority | default | flex
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Headroom:
    """The fraction of each limit a tier may fill before it is shed."""

    priority: float = 1.0
    default: float = 0.95
    flex: float = 0.8

    def of(self, tier: str) -> float:
        shares: dict[str, float] = {Tier.PRIORITY: self.priority, Tier.DEFAULT: self.default, Tier.FLEX: self.flex}
        return shares.get(tier, 1.0)


@dataclass(frozen=True)
class Admit:
    pass


ADMIT = Admit()


@dataclass(frozen=True)
class Refuse:
    limit: str  # the dimension ("requests_per_min", …), or "capacity" (flex shed by the fleet)
    value: int  # the limit's value
    retry_after_s: int  # ≥ 1
    model: str = ANY_MODEL  # the limit's scope
    used: int = 0
    requested: int = 0
    shed_at: float = 1.0  # < 1: refused by its tier's headroom, below the limit itself


def window_start(now: float, size_s: int) -> float:
    """The fixed window holding `now` (unix seconds; UTC-aligned, as date_trunc in UTC)."""
    return math.floor(now / size_s) * size_s


def _retry(now: float, size_s: int) -> int:
    return max(1, math.ceil(window_start(now, size_s) + size_s - now))


def _used_and_needed(dim: Dimension, u: Usage, d: Demand) -> tuple[int, int]:
    if dim == "requests_per_min":
        return u.requests, 1
    if dim == "input_tokens_per_min":
        return u.input_tokens, d.input_tokens
    if dim == "output_tokens_per_min":
        return u.output_tokens, d.output_tokens
    if dim == "concurrent_requests":
        return u.in_flight, 1
    return u.day_tokens, d.input_tokens + d.output_tokens


def fits(used: int, needed: int, limit: int, fraction: float) -> bool:
    """Within the limit, and (for a tier with headroom) usage not yet at its fraction."""
    return used + needed <= limit and (fraction >= 1.0 or used < fraction * limit)


def admit(demand: Demand, scopes: Sequence[tuple[LimitSet, Usage]], now: float, headroom: Headroom = Headroom(),
          fleet_busy: bool = False) -> Admit | Refuse:
    """May `demand` start now? `scopes`: each limit that applies with the usage it sees."""
    # 1. Flex yields first when the fleet itself is short of capacity.
    if fleet_busy and demand.tier == Tier.FLEX:
        return Refuse("capacity", 0, FLEET_RETRY_S)
    fraction = headroom.of(demand.tier)
    # 2. Every dimension of every limit that applies: the first that would pass, refuses.
    for limits, usage in sorted(scopes, key=lambda s: (s[0].model != ANY_MODEL, s[0].model)):
        for dim in DIMENSIONS:
            limit = getattr(limits, dim)
            if limit is None:
                continue
            used, needed = _used_and_needed(dim, usage, demand)
            if fits(used, needed, limit, fraction):
                continue
            if dim == "concurrent_requests":
                retry = CONCURRENCY_RETRY_S
            else:
                retry = _retry(now, DAY_S if dim == "tokens_per_day" else MINUTE_S)
            # Shed by headroom only where the limit itself still had room.
            shed = fraction if used + needed <= limit else 1.0
            return Refuse(dim, limit, retry, limits.model, used, needed, shed)
    return ADMIT


def admit_batch(tokens: int, scopes: Sequence[tuple[LimitSet, int]]) -> Admit | Refuse:
    """May a batch of `tokens` (estimated) be enqueued? `scopes`: each limit that applies
    with the tokens of the tenant's batches already open in its scope. Never shed by tier:
    batch has its own limit, and waits for capacity instead of being refused for it."""
    for limits, open_tokens in sorted(scopes, key=lambda s: (s[0].model != ANY_MODEL, s[0].model)):
        limit = limits.batch_queue_tokens
        if limit is not None and open_tokens + tokens > limit:
            return Refuse("batch_queue_tokens", limit, CONCURRENCY_RETRY_S, limits.model, open_tokens, tokens)
    return ADMIT


def admit_fine_tune(scopes: Sequence[tuple[LimitSet, int]]) -> Admit | Refuse:
    """May the tenant start another fine-tuning job? `scopes`: each limit that applies with
    the tenant's active jobs (not yet succeeded, failed or cancelled) in its scope ('*'
    first). Paused jobs count: they hold their place and resume at will."""
    for limits, active in sorted(scopes, key=lambda s: (s[0].model != ANY_MODEL, s[0].model)):
        limit = limits.concurrent_fine_tunes
        if limit is not None and active + 1 > limit:
            return Refuse("concurrent_fine_tunes", limit, FINE_TUNE_RETRY_S, limits.model, active, 1)
    return ADMIT


def day_spent(scopes: Sequence[tuple[LimitSet, int]]) -> LimitSet | None:
    """The first of the limits that apply ('*' first) whose `tokens_per_day` the tenant's
    tokens of the day (`scopes`: each with the usage in its scope) have reached; None: there
    is room. Training checks it before each chunk: a chunk's tokens are known only once it
    has trained, so a job may pass its limit by one chunk, never more."""
    for limits, used in sorted(scopes, key=lambda s: (s[0].model != ANY_MODEL, s[0].model)):
        if limits.tokens_per_day is not None and used >= limits.tokens_per_day:
            return limits
    return None


def describe(r: Refuse, tenant: str, model: str, tier: str) -> str:
    """The 429's message, in OpenAI's words where it has them."""
    if r.limit == "capacity":
        return ("Resource unavailable: flex processing is temporarily out of capacity for "
                f"{model}. Please retry later or use the default service tier.")
    scope = f"{model} in tenant {tenant}" if r.model != ANY_MODEL else f"all models in tenant {tenant}"
    shed = "" if r.shed_at >= 1.0 else f" for {tier} requests, which yield at {r.shed_at:.0%} of the limit"
    return (f"Rate limit reached for {scope} on {LABELS[r.limit]}{shed}: Limit {r.value}, Used {r.used}, "
            f"Requested {r.requested}. Please try again in {r.retry_after_s}s.")


def describe_fine_tune(r: Refuse, tenant: str, model: str) -> str:
    scope = f"{model} in tenant {tenant}" if r.model != ANY_MODEL else f"all models in tenant {tenant}"
    return (f"You have reached the maximum number of active fine-tuning jobs for {scope}: Limit {r.value}, "
            f"Active {r.used}. Cancel one or wait for one to finish, then try again.")


def describe_batch(r: Refuse, tenant: str, model: str) -> str:
    """OpenAI's words (the limit may be the tenant's, across its models: the batch's model
    is named either way, as OpenAI names it for an organization's limit)."""
    return (f"Enqueued token limit reached for {model} in tenant {tenant}. Limit: {r.value:,} enqueued tokens. "
            "Please try again once some in_progress batches have been completed.")


# -- what a request may take, before the engine has tokenized it --------------------


def estimate_input(texts: Sequence[str], messages: int, token_ids: int = 0) -> int:
    """An upper-bound-ish estimate of a prompt's tokens: UTF-8 bytes of its texts, plus
    template allowances for chat (`messages` > 0); token-id prompts count exactly."""
    if token_ids:
        return token_ids
    text = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if messages:
        return text + PER_MESSAGE_TOKENS * messages + PER_REQUEST_TOKENS
    return text + 2  # completions: BOS, perhaps EOS-less end


def reserve_output(input_tokens: int, max_tokens: int | None, max_model_len: int, choices: int = 1) -> int:
    """The output a request reserves: its max_tokens, else the rest of the context, for
    each of its `choices` (`n`)."""
    if max_tokens is not None:
        return choices * max(1, max_tokens)  # 0, an echo of the prompt alone, still generates one token
    return choices * max(1, max_model_len - input_tokens)


def estimate(req: GenerationRequest, max_model_len: int, counted: int | None = None) -> tuple[int, int]:
    """(input, output) tokens a checked request reserves before the engine has seen it:
    `counted` where the prompt was tokenized as the engine will, else an estimate; the
    input is capped at the context (a longer prompt is refused by the engine)."""
    if counted is not None:
        raw = counted
    elif req.messages:
        # Tools and earlier calls are written into the prompt too.
        texts = [f"{m.role}{m.content}{json.dumps(m.tool_calls) if m.tool_calls else ''}" for m in req.messages]
        texts += [json.dumps(t) for t in req.tools]
        raw = estimate_input(texts, len(req.messages))
    elif isinstance(req.prompt, str):
        raw = estimate_input([req.prompt], 0)
    else:
        raw = estimate_input([], 0, token_ids=len(req.prompt))
    input_tokens = min(raw, max_model_len)
    return input_tokens, reserve_output(input_tokens, req.max_tokens, max_model_len, req.n)


def estimate_embedding(req: EmbeddingRequest, max_model_len: int, counted: int | None = None) -> int:
    """The input tokens an embeddings request reserves (it generates nothing): `counted`
    where its inputs were tokenized as the engine will, else estimated, each input capped at
    the context."""
    if counted is not None:
        return counted
    return sum(min(estimate_input([one], 0) if isinstance(one, str) else len(one), max_model_len)
               for one in req.inputs)


# -- the declared bound -------------------------------------------------------------


def staleness_s(flush_s: float, refresh_s: float) -> float:
    """How long another process may go without seeing an admission (see the module doc)."""
    return 2 * flush_s + 3 * refresh_s


def overshoot_bound(limit: int, processes: int, peak_rate_per_s: float, stale_s: float) -> int:
    """The most a window's usage can pass `limit` by, with `processes` admitting at up to
    `peak_rate_per_s` each and seeing each other `stale_s` late."""
    if processes <= 1:
        return 0
    return (processes - 1) * min(limit, math.ceil(peak_rate_per_s * stale_s))
