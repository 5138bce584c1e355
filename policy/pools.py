"""Model pools: a deployment serves every model some engine worker announces, each from its
own pool of engines. Pure.

A request names a model; its pool is that model's, or for a fine-tuned model
(`ft:<base>:…`) its base model's, whose engines load the adapter. Each pool has its own
context length (the shortest any of its engines announces, so a request that fits one
fits all of them), its own batch task queue (engines of another model never claim its
generations), and its own surge state (the fleet controller's pools are models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from policy.placement import EngineView
from protocol import keys
from protocol.tiers import Tier


def served_models(engines: Iterable[EngineView], own: str, own_len: int) -> dict[str, int]:
    """Model → context length, for every model callable here: the deployment's own (its
    settings'; requests for it wait for an engine rather than 404 while one starts) and
    each one a serving engine announces: the own first, then by name, so every API replica
    lists them alike."""
    others: dict[str, int] = {}
    for e in engines:
        if e.draining or e.model == own:
            continue
        length = e.max_model_len or own_len  # an engine too old to say has the deployment's
        others[e.model] = min(others.get(e.model, length), length)
    return {own: own_len, **dict(sorted(others.items()))}


def embedding_models(engines: Iterable[EngineView], own: str, own_task: str) -> frozenset[str]:
    """The models that serve embeddings, not generation: the deployment's own by its
    settings, another by what its serving engines announce."""
    found = {e.model for e in engines if not e.draining and e.model != own and e.task == "embed"}
    return frozenset(found | ({own} if own_task == "embed" else set()))


def base_model(name: object, models: Mapping[str, int]) -> str | None:
    """The pool that serves `name`: itself, or a fine-tuned model's base; None for neither."""
    if not isinstance(name, str):
        return None
    if name in models:
        return name
    if keys.is_fine_tuned(name):
        # The longest base whose prefix it carries: a base may itself contain a colon.
        bases = [m for m in models if name.startswith(keys.fine_tuned_prefix(m))]
        return max(bases, key=len, default=None)
    return None


def downgrade(model: str, tier: str, to: Mapping[str, str], models: Mapping[str, int],
              busy: Callable[[str], bool]) -> str | None:
    """The model a flex request for `model` is served by instead (cost-aware routing): the
    smaller one configured for it, while every engine of `model` is busy and that one's
    are not; None: served as asked, or shed. One step only: the smaller model's own
    downgrade is not followed, so a request moves at most once. A fine-tuned model is
    never downgraded (its adapter lives on its own base)."""
    small = to.get(model)
    if tier != Tier.FLEX or small is None or small not in models or not busy(model) or busy(small):
        return None
    return small


def pool_queue(base: str, model: str) -> str:
    """The batch task queue of one model's engine workers (its regions' and each worker's
    own are named under it: policy.placement.region_queue, policy.grouping.own_queue)."""
    return f"{base}:{model}"
