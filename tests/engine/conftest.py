"""One real vLLM engine over the tiny model, shared by the whole session (start ~20 s)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from engine.models import ModelSpec
from engine.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> ModelSpec:
    path = build_tiny_model(tmp_path_factory.mktemp("models"), max_model_len=1024)
    return ModelSpec(str(path), "ballast-tiny", 1024)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(tiny_model):
    from engine.vllm_engine import Engine

    eng = await Engine.start(tiny_model, kv_cache_gib=0.5, max_num_seqs=64)
    try:
        yield eng
    finally:
        eng.shutdown()
