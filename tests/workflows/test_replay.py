"""The replay gate: every recorded history (tests/workflows/histories/, from a suite run
of earlier code; see tests/workflows/histories.py) replays against today's workflows. A
change that breaks determinism fails here, before it breaks the workflows running in a
deployment."""

from pathlib import Path

import pytest
from temporalio.worker import Replayer

from tests.workflows.histories import DIR, load
from workflows.batch import BatchWorkflow
from workflows.finetune import FineTuneWorkflow
from workflows.fleet import FleetWorkflow
from workflows.interactive import InteractiveWorkflow, RequestWindowWorkflow
from workflows.quota import QuotaReconciler
from workflows.webhooks import WebhookDelivery

WORKFLOWS = [BatchWorkflow, FineTuneWorkflow, FleetWorkflow, InteractiveWorkflow, QuotaReconciler,
             RequestWindowWorkflow, WebhookDelivery]
RECORDED = sorted(DIR.glob("*.json.gz"))


def test_every_workflow_type_has_recorded_histories():
    recorded = {p.name.split("-")[0] for p in RECORDED}
    assert recorded >= {getattr(w, "__temporal_workflow_definition").name for w in WORKFLOWS}, recorded


@pytest.mark.parametrize("path", RECORDED, ids=[p.name.removesuffix(".json.gz") for p in RECORDED])
async def test_a_recorded_history_replays_against_todays_code(path: Path):
    await Replayer(workflows=WORKFLOWS).replay_workflow(load(path))
