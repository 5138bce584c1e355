"""Temporal search attributes on every workflow Ballast starts, so that `temporal workflow
list --query 'BallastTenant="acme"'` and the Web UI find one tenant's (or one model's, one
tier's, one kind's) work. Keyword attributes; `ballast up`'s dev server registers them, and
another cluster's operator once: `temporal operator search-attribute create --name
BallastTenant --type Keyword` (and the same for the others)."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

TENANT = SearchAttributeKey.for_keyword("BallastTenant")
MODEL = SearchAttributeKey.for_keyword("BallastModel")
TIER = SearchAttributeKey.for_keyword("BallastTier")
KIND = SearchAttributeKey.for_keyword("BallastKind")  # batch | fine_tune | interactive | fleet | quota
ALL = (TENANT, MODEL, TIER, KIND)


def attributes(kind: str, tenant: str = "", model: str = "", tier: str = "") -> TypedSearchAttributes:
    """A workflow's attributes (an empty value is left out)."""
    values = ((KIND, kind), (TENANT, tenant), (MODEL, model), (TIER, tier))
    return TypedSearchAttributes([SearchAttributePair(key, value) for key, value in values if value])


def register_flags() -> list[str]:
    """`temporal server start-dev` flags that register them."""
    return [arg for key in ALL for arg in ("--search-attribute", f"{key.name}=Keyword")]
