"""Service tiers: what a request may ask for (OpenAI's `service_tier`), and the tiers of
the work Ballast runs itself. Ranked: a lower rank runs first and yields last."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args


class Tier(StrEnum):
    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"
    BATCH = "batch"  # batch items
    TRAINING = "training"  # fine-tuning chunks: the ledger's tier of trained tokens


# The ones a request names (what the API accepts in `service_tier`).
ServiceTier = Literal["priority", "default", "flex"]
SERVICE_TIERS: tuple[ServiceTier, ...] = get_args(ServiceTier)
assert set(SERVICE_TIERS) < set(Tier)  # the type spells the same names as the enum

# The tiers a tenant must be granted (they run ahead of other tenants' work); a request for
# one its tenant lacks runs at DEFAULT.
GRANTED: frozenset[str] = frozenset({Tier.PRIORITY})

# An engine's order: interactive tiers ahead of batch; a fine-tuning chunk holds a batch
# slot (vLLM priorities: lower first).
RANK: dict[str, int] = {Tier.PRIORITY: 0, Tier.DEFAULT: 1, Tier.FLEX: 2, Tier.BATCH: 10}
