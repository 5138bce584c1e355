"""A tenant's limits have one definition (protocol/limits.py); what takes or shows them
follows it."""

from api.admin import Limits
from journal.schema import limits
from protocol.limits import LABELS, LIMITS, LimitSet


def test_the_admin_api_takes_every_limit_there_is():
    assert tuple(Limits.model_fields) == ("model", *LIMITS)


def test_the_table_has_a_column_for_every_limit():
    assert set(LIMITS) <= set(limits.c.keys()) and "model" in limits.c


def test_every_limit_is_named_for_a_refusal():
    assert set(LABELS) == set(LIMITS) and LimitSet().model == "*"
