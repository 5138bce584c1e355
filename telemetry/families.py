"""Ballast's own metric families, each defined once, in prometheus_client's default registry
(where vLLM's stat logger puts its own). Labels name a tenant through `tenant()`, which
bounds how many distinct tenants one process ever exports."""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

OTHER = "other"

# Latency buckets from a fast GPU's first token to a CPU engine's long answer.
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# -- the API: interactive requests, admission --------------------------------------------
REQUESTS = Counter("ballast_requests", "Interactive requests that ended, by how they ended (status: completed, "
                   "cancelled, failed).", ["tenant", "tier", "model", "endpoint", "status"])
TOKENS = Counter("ballast_tokens", "Tokens of interactive requests that ended (kind: prompt, completion).",
                 ["tenant", "tier", "model", "kind"])
TTFT = Histogram("ballast_ttft_seconds", "Time to first token, as the API saw it (request in, first token out).",
                 ["tier", "model"], buckets=_SECONDS)
TPOT = Histogram("ballast_tpot_seconds", "Time per output token after the first, per request.",
                 ["tier", "model"], buckets=_PER_TOKEN)
DURATION = Histogram("ballast_request_duration_seconds", "Interactive requests from arrival to their last byte.",
                     ["tier", "model", "status"], buckets=_SECONDS)
ADMISSION = Counter("ballast_admission_decisions", "Admission's decisions (decision: admitted, refused, downgraded; "
                    "reason: the limit that refused, e.g. requests_per_min, capacity, or wait: every engine's queue "
                    "past the tier's bound on the wait; the model a flex request was downgraded to).",
                    ["tenant", "tier", "model", "decision", "reason"])

# -- batch generation and fine-tuning (engine workers) -------------------------------------
BATCH_ITEMS = Counter("ballast_batch_items", "Batch items whose generation ended here (outcome: completed, failed, "
                      "preempted: it yielded and will resume).", ["tenant", "model", "outcome"])
BATCH_TOKENS = Counter("ballast_batch_tokens", "Tokens generated for batch items and journaled.", ["tenant", "model"])
REPREFILLED = Counter("ballast_batch_reprefilled_tokens", "Tokens a batch generation prefilled again to resume "
                      "(its prompt and the tokens it had: after a preemption, a retry or another worker's crash), "
                      "before vLLM's prefix cache spares what it still holds: the price of yielding.", ["model"])
TRAINING_STEPS = Counter("ballast_fine_tune_steps", "Fine-tuning steps trained.", ["tenant", "model"])
TRAINING_LOSS = Gauge("ballast_fine_tune_loss", "The loss at the last checkpoint of the tenant's newest job on the "
                      "model to checkpoint here (split: train, valid).", ["tenant", "model", "split"])
CHECKPOINT_LAG = Histogram("ballast_checkpoint_lag_seconds", "At each checkpoint commit of generated tokens, how "
                           "long the oldest tokens it made durable had waited: what a crash just before it would "
                           "have lost, in time.", buckets=_SECONDS)

# -- the journal (every process) ------------------------------------------------------------
APPEND = Histogram("ballast_journal_append_seconds", "One append to the journal (its events and their projections), "
                   "inside the caller's transaction.", buckets=_SECONDS)
APPEND_ERRORS = Counter("ballast_journal_append_errors", "Appends that raised (a conflict, a stale fence, the "
                        "database).", ["error"])


# -- what waits (the control worker, from the journal) ---------------------------------------
BACKLOG_ITEMS = Gauge("ballast_batch_backlog_items", "Pending items of open batches.", ["tenant"])
BACKLOG_OLDEST = Gauge("ballast_batch_oldest_pending_seconds", "Age of the tenant's oldest open batch with pending "
                       "items (the completion window counts from its creation).", ["tenant"])
QUEUED_TOKENS = Gauge("ballast_batch_queued_tokens", "Tokens the open batch reservations of a model hold (the "
                      "quota fold's view).", ["model"])
FOLD_AGE = Gauge("ballast_quota_fold_age_seconds", "Seconds since the quota fold last ran: admission's view of "
                 "usage is as old as this.")
ENGINES = Gauge("ballast_pool_engines", "Engine workers of the model's pool announcing now, by their region.",
                ["model", "region"])
ENGINES_WANTED = Gauge("ballast_engines_wanted", "The engines the model's pool wants now, for interactive load at "
                       "its target and its queued batch tokens drained in time (policy/autoscale.py): the "
                       "autoscaling signal.", ["model"])
QUOTA_USED = Gauge("ballast_quota_used", "What counts now against each limit set on a tenant (limit: a column of "
                   "`limits`, e.g. tokens_per_day; model: the limit's scope, '*' for all models), as admission "
                   "counts it: the current UTC minute or day, requests in flight, queued batch tokens, active "
                   "fine-tunes.", ["tenant", "model", "limit"])
QUOTA_LIMIT = Gauge("ballast_quota_limit", "The limit itself, beside ballast_quota_used.", ["tenant", "model", "limit"])
SURGING = Gauge("ballast_fleet_surging", "1 while the fleet controller calls the pool surging (batch capped on its "
                "engines), else 0.", ["pool"])


class _Tenants:
    """The first `most` tenants seen are labels of their own; later ones are `other`."""

    def __init__(self, most: int):
        self.most, self.seen, self.lock = most, set[str](), threading.Lock()

    def __call__(self, tenant: str) -> str:
        if tenant in self.seen:
            return tenant
        with self.lock:
            if len(self.seen) < self.most:
                self.seen.add(tenant)
                return tenant
        return OTHER


tenant = _Tenants(50)


def total(counter: Counter) -> float:
    """A counter's sum over all its labels, in this process."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def bound_tenants(most: int) -> None:
    """How many tenants this process labels by name (BALLAST_METRICS_MAX_TENANTS); at start."""
    tenant.most = most
