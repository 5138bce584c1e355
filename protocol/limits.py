"""A tenant's limits: one row of table `limits`, as the admin API, `ballast tenants
limits`, the ledger and admission all read it. A new limit is a field here (and a column
its migration adds); the API's, the CLI's and the ledger's lists of limits follow."""

from __future__ import annotations

from dataclasses import dataclass, fields

ANY_MODEL = "*"  # a limit row for all of a tenant's models together


@dataclass(frozen=True)
class LimitSet:
    """A tenant's limits for `model` ('*': all its models together); None: no limit."""

    model: str = ANY_MODEL
    requests_per_min: int | None = None
    input_tokens_per_min: int | None = None
    output_tokens_per_min: int | None = None
    concurrent_requests: int | None = None
    tokens_per_day: int | None = None
    batch_queue_tokens: int | None = None
    concurrent_fine_tunes: int | None = None


# Every limit's name, in the table's order.
LIMITS: tuple[str, ...] = tuple(f.name for f in fields(LimitSet) if f.name != "model")

# How a refusal names each limit (OpenAI's wording where it has one).
LABELS = {
    "requests_per_min": "requests per min (RPM)",
    "input_tokens_per_min": "input tokens per min (ITPM)",
    "output_tokens_per_min": "output tokens per min (OTPM)",
    "concurrent_requests": "concurrent requests",
    "tokens_per_day": "tokens per day (TPD)",
    "batch_queue_tokens": "enqueued batch tokens",
    "concurrent_fine_tunes": "active fine-tuning jobs",
}
assert set(LABELS) == set(LIMITS)  # each limit says what it is
