"""/v1/models through the official `openai` client, against the running stack."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.e2e


def test_the_openai_client_lists_and_retrieves_the_served_model(client):
    models = client.models.list().data
    assert models[0].id == "ballast-tiny"
    tiny = client.models.retrieve("ballast-tiny")
    assert tiny.object == "model" and tiny.owned_by == "ballast" and tiny.created > 0
    assert tiny == models[0]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found"
