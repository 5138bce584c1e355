"""The API ↔ engine worker wire: the job the API posts to `/v1/generate`, the NDJSON lines
the engine streams back, and the stats report each engine worker announces (table
`engines`, read by every API process and the fleet controller).

Lines are told apart by their keys, as they always were, so an API and an engine worker of
different versions still understand each other; a field an older peer does not send takes
its default here.

    {"prompt_tokens": 12}                       Accepted: generation starts now
    {"text": "Hel", "tokens": 1}                Delta: as the engine produces them (and "logprobs")
    {"finish_reason": "stop", "completion_tokens": 17, ...}    Finished
or, instead of all of that, {"error": {...}, "status": 400} before anything is admitted; a
failure after that ends the stream with an {"error": {...}, "status": 500} line (Failed).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from protocol.logprobs import Decoded


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class EngineJob:
    """One interactive request, as the API hands it to an engine worker. The worker orders
    requests by tenant fair share within `tier`; `priority` is for workers that predate
    that. `api`: which API process sent it (its in-flight count per API is reported)."""

    request_id: str
    endpoint: str
    body: dict[str, Any]
    priority: int
    tenant: str = ""
    tier: str | None = None
    weight: float = 1.0
    api: str = ""
    # The HTTP request's x-request-id (api/request_ids.py): in the engine's log and record.
    http_request_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineJob:
        return cls(**dict(_known(cls, d), weight=float(d.get("weight") or 1), priority=int(d["priority"])))


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int  # the engine's own count, which replaces the API's estimate


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: int = 0
    # Each new token's logprob alternatives, decoded (protocol/logprobs.py `Decoded`), where
    # the request asked for logprobs.
    logprobs: list[Decoded] | None = None
    # Where the output is read for tool calls, what the stream shows of this delta, as the
    # model's tool parser made it: {content?, tool_calls?} ({}: held back for now).
    message: dict[str, Any] | None = None
    choice: int = 0  # which of the request's `n` choices (left out when 0)


@dataclass(frozen=True)
class Ending:
    """How one of several choices ended."""

    finish_reason: str
    completion_tokens: int
    message: dict[str, Any] | None = None  # as Finished's


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # the first choice's
    completion_tokens: int  # every choice's
    engine_ttft_ms: float | None = None
    engine_ms: float | None = None
    cached_tokens: int | None = None  # prompt tokens found in vLLM's prefix cache
    # Where the output is read for tool calls (and not streamed): the choice's message,
    # {content, tool_calls}, as the model's tool parser made it of the whole text.
    message: dict[str, Any] | None = None
    choices: list[Ending] | None = None  # with `n` > 1: how each ended, in order
    # An embeddings request's answer (protocol/embeddings.py): a vector per input, in order.
    embeddings: list[list[float]] | None = None

    def endings(self) -> list[Ending]:
        return self.choices or [Ending(self.finish_reason, self.completion_tokens, self.message)]


@dataclass(frozen=True)
class Failed:
    error: dict[str, Any]  # OpenAI's error object: message, type, param, code
    status: int
    # Where the engine refused it for the wait (a 429 resource_unavailable): when to try
    # again, in seconds; the API tries the pool's other engines first.
    retry_after_s: int | None = None

    @property
    def message(self) -> str:
        return str(self.error.get("message", "The engine failed."))


Line = Accepted | Delta | Finished | Failed


# Fields added since the first version, left out while they hold nothing: a line that
# uses no new feature is the JSON it always was.
_LATER = ("logprobs", "cached_tokens", "message", "choices", "embeddings", "retry_after_s")


def encode(line: Line) -> bytes:
    # Once per token delta on the engine's stream: the fields as they are (asdict copies
    # them recursively).
    d = vars(line)
    if any(d.get(k, 0) is None for k in _LATER) or d.get("choice") == 0 or d.get("choices"):
        d = {k: v for k, v in d.items() if not (k in _LATER and v is None or k == "choice" and v == 0)}
        if d.get("choices"):
            d["choices"] = [vars(e) for e in d["choices"]]
    return (json.dumps(d, ensure_ascii=False) + "\n").encode()


def decode(raw: str | bytes) -> Line:
    """One line of the stream; ValueError for anything that is none of them."""
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError(f"not an engine line: {raw!r}")
    if "error" in d:
        retry = d.get("retry_after_s")
        return Failed(d["error"], int(d.get("status", 500)), None if retry is None else int(retry))
    if "finish_reason" in d:
        got = _known(Finished, d)
        if got.get("choices") is not None:
            got["choices"] = [Ending(**_known(Ending, e)) for e in got["choices"]]
        return Finished(**got)
    if "prompt_tokens" in d:
        return Accepted(int(d["prompt_tokens"]))
    if "text" in d:
        return Delta(**_known(Delta, d))
    raise ValueError(f"not an engine line: {raw!r}")


@dataclass(frozen=True)
class EngineStats:
    """What an engine worker announces about itself every `announce_s`. Readers get the
    defaults for what an older engine worker does not say."""

    max_seqs: int = 1
    spare_seqs: int = 0  # sequences vLLM runs beyond max_seqs (BALLAST_SPARE_SEQS)
    interactive: int = 0  # the most interactive requests in flight at once over its last few reports
    # In flight per API process (None: an engine too old to say).
    interactive_by: dict[str, int] | None = None
    batch: int = 0  # batch generations holding slots
    batch_queued: int = 0  # batch generations waiting for a slot
    batch_cap: int | None = None
    fleet_cap: int | None = None
    preemptions: int = 0
    flex: int = 0  # flex requests in flight
    flex_floor: int = 0  # the slots flex gets back once starved
    running: int = 0  # vLLM's running sequences
    waiting: int = 0  # requests queued inside vLLM
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0  # vLLM's prefix-cache counters since start, in prompt tokens
    prefix_hits: int = 0
    full_tokens: int = 0  # output tokens vLLM generated running full (every slot busy), all work
    full_s: float = 0.0  # seconds it stepped so
    # Its rate at full load: output tokens a second while full (0: not measured), which
    # reservations in tokens a second are kept by (policy/reservations.py).
    full_rate: float = 0.0
    block_size: int = 16
    region: str = ""
    # Its model's pool (the model itself is the `engines` row's): the context length its
    # requests are checked against, and where its files are, for the API's tokenizer.
    max_model_len: int = 0
    model_source: str = ""
    task: str = "generate"  # what its model serves: "generate" (chat, completions) or "embed" (embeddings)
    batch_tokens: int = 0  # batch tokens generated and journaled here since it started (its pace, read twice)
    # Its batch pace: tokens a second while it held batch work (policy/promises.py); 0: unmeasured.
    batch_rate: float = 0.0
    # Its part of its pool's reservations (tenant → slots, policy/reservations.py), the slots
    # of each its tenant's requests hold, and the unused ones batch holds meanwhile (lent).
    reserved: dict[str, int] = field(default_factory=dict)
    reserved_used: dict[str, int] = field(default_factory=dict)
    lent: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # anything else it reports, for operators

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return dict(d.pop("extra"), **d)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineStats:
        known = _known(cls, d)
        known.pop("extra", None)
        return cls(**known, extra={k: v for k, v in d.items() if k not in known})
