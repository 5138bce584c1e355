"""The journal's event types have one home: what the migrations' fencing trigger refuses
unfenced, and what the projections read, are all names it defines."""

import importlib
import re

from journal import projections
from protocol.events import EventType


def test_the_fenced_types_of_the_migrations_are_event_types():
    migration = importlib.import_module("migrations.versions.0011_fences_enforced")
    fenced = set(re.findall(r"'(\w+)'", migration._ATTEMPT_EVENTS))
    assert fenced and fenced <= set(EventType)


def test_every_projected_type_is_an_event_type():
    assert projections._projectors and set(projections._projectors) <= set(EventType)
