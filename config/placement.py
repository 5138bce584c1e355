"""Where work runs: placement's weights, the prefix index, regions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.section import Section


class PlacementSettings(Section):
    # Placement (policy/placement.py): the scorers' weights, and the load bound past which
    # an engine attracts no more of its prefixes (× the pool's mean interactive load).
    # `affinity` (the default: prefix affinity under the load bound), or the baselines the
    # placement bench compares it with: `least_loaded` (load alone), `round_robin`.
    placement: Literal["affinity", "least_loaded", "round_robin"] = "affinity"
    placement_affinity_weight: float = Field(2.0, ge=0)
    placement_load_weight: float = Field(1.0, ge=0)
    placement_load_bound: float = Field(1.25, ge=1)

    # The API's prefix index (policy/prefix.py): prompt blocks remembered, LRU; about the
    # pool's KV-cache blocks.
    prefix_index_blocks: int = Field(200_000, ge=1)

    # This process's region. An engine worker's: requests fenced to other regions never
    # come to it. An API's: its requests stay there while an engine has room (placement).
    region: str = "local"
