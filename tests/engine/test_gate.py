"""The engine gate (engine/gate.py) on the real engine: batch generations held at a token
budget the test controls, released, aborted while held; interactive ones never held."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest

from config import Settings
from engine.gate import GatedEngine
from engine.sampling import Sampling
from engine.vllm_engine import Step
from protocol.tiers import RANK

pytestmark = pytest.mark.engine

BATCH = RANK["batch"]


def write(path: Path, budget) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(budget=budget)))
    os.replace(tmp, path)


class Run:
    """One generation consumed in a task of its own: what it has yielded so far."""

    def __init__(self, gate: GatedEngine, prompt: list[int], max_tokens: int, *, priority: int = BATCH,
                 item: str | None = None, resumed_from: int = 0):
        self.request_id = f"gate-{uuid.uuid4().hex}"
        self.steps: list[Step] = []
        self.task = asyncio.create_task(self._run(gate, prompt, max_tokens, priority, item, resumed_from))

    async def _run(self, gate, prompt, max_tokens, priority, item, resumed_from) -> None:
        async for step in gate.generate(self.request_id, prompt, Sampling(max_tokens, temperature=0.0, ignore_eos=True),
                                        priority=priority, item=item, resumed_from=resumed_from):
            self.steps.append(step)

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def reason(self) -> str | None:
        return self.steps[-1].finish_reason if self.steps else None


async def until(what: str, cond, timeout: float = 60) -> None:
    """Wait for an observed state (the timeout only guards against a hang)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def held(gate: GatedEngine, item: str, tokens: int) -> bool:
    return any(r["item"] == item and r["held"] and r["tokens"] == tokens for r in gate.gate_stats()["requests"])


async def reference(engine, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    async for step in engine.generate(f"ref-{uuid.uuid4().hex}", prompt, Sampling(n, temperature=0.0, ignore_eos=True)):
        out += step.token_ids
    return out


@pytest.fixture
def control(tmp_path) -> Path:
    return tmp_path / "gate.json"


@pytest.fixture
async def gate(engine, control):
    g = GatedEngine(engine, control, poll_s=0.01)
    try:
        yield g
    finally:
        if g._poller is not None:  # not g.shutdown(): the session's engine lives on
            g._poller.cancel()


async def test_held_at_its_budget_then_released_to_the_uninterrupted_output(engine, gate, control):
    prompt = engine.render_text("hold me at twelve")
    want = await reference(engine, prompt, 48)
    write(control, {"default": 12})
    run = Run(gate, prompt, 48, item="item:b:0")
    await until("held at 12", lambda: held(gate, "item:b:0", 12))
    await asyncio.sleep(0.2)  # vLLM runs on (buffered); nothing of it gets past the gate
    assert run.tokens == want[:12] and run.reason is None and not run.task.done()

    write(control, {"default": 30})  # the budget grows: on to exactly 30
    await until("held at 30", lambda: held(gate, "item:b:0", 30))
    assert run.tokens == want[:30]

    write(control, None)  # unlimited
    await asyncio.wait_for(run.task, 60)
    assert run.tokens == want and run.reason == "length"
    assert gate.gate_stats()["requests"] == []


async def test_the_budget_counts_the_tokens_an_item_already_had(engine, gate, control):
    prompt = engine.render_text("resumed at six")
    write(control, {"default": 100, "item:b:1": 10})
    run = Run(gate, prompt, 40, item="item:b:1", resumed_from=6)
    await until("held at 10 in all", lambda: held(gate, "item:b:1", 10))
    assert len(run.tokens) == 4
    other = Run(gate, prompt, 40, item="item:b:2", resumed_from=6)  # the default's
    await asyncio.wait_for(other.task, 60)  # 6 + 40 < 100: never held
    assert len(other.tokens) == 40 and other.reason == "length"
    run.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run.task


async def test_aborted_while_held_ends_at_once_with_exactly_its_budget(engine, gate, control):
    prompt = engine.render_text("abort me while held")
    want = await reference(engine, prompt, 64)
    write(control, 17)  # a bare number: every batch item
    run = Run(gate, prompt, 64, item="item:b:3")
    await until("held at 17", lambda: held(gate, "item:b:3", 17))
    await asyncio.sleep(0.1)  # vLLM runs on past 17 meanwhile, buffered behind the gate
    await gate.abort(run.request_id)
    await asyncio.wait_for(run.task, 5)  # no waiting on the budget
    assert run.tokens == want[:17] and run.reason == "abort" and run.steps[-1].token_ids == []
    # As after any vLLM abort, prompt + those tokens resumes to the uninterrupted output.
    assert run.tokens + await reference(engine, prompt + run.tokens, 64 - 17) == want


async def test_aborted_before_it_began_and_held_from_the_start_ends_at_once(engine, gate, control):
    prompt = engine.render_text("preempted before the first step")
    write(control, {"default": 20})
    run_id = f"gate-{uuid.uuid4().hex}"
    await gate.abort(run_id)  # an interactive request arrived between the batch slot and the engine
    steps = [s async for s in gate.generate(run_id, prompt, Sampling(40, temperature=0.0, ignore_eos=True),
                                            priority=BATCH, item="item:b:4", resumed_from=20)]
    assert steps == [Step([], "abort")]


async def test_interactive_requests_are_never_held(engine, gate, control):
    prompt = engine.render_text("chat is never held")
    write(control, 0)
    chat = Run(gate, prompt, 24, priority=RANK["priority"])
    await asyncio.wait_for(chat.task, 60)
    assert len(chat.tokens) == 24 and chat.reason == "length"
    batch = Run(gate, prompt, 24, item="item:b:6")  # while a batch item is held at nothing
    await until("held at 0", lambda: held(gate, "item:b:6", 0))
    assert batch.tokens == []
    batch.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch.task
    assert gate.gate_stats()["requests"] == []


async def test_no_file_or_a_null_budget_is_a_passthrough_and_a_bad_file_keeps_the_last(engine, gate, control):
    prompt = engine.render_text("pass me through")
    want = await reference(engine, prompt, 32)
    run = Run(gate, prompt, 32, item="item:b:7")  # no control file yet
    await asyncio.wait_for(run.task, 60)
    assert run.tokens == want and run.reason == "length"

    write(control, {"default": 5})
    await until("the gate read 5", lambda: gate.budget("item:b:7") == 5)
    control.write_text('{"budget": {"default": ')  # a torn write: ignored, 5 still holds
    run = Run(gate, prompt, 32, item="item:b:7")
    await until("held at 5", lambda: held(gate, "item:b:7", 5))
    control.unlink()  # gone: unlimited
    await asyncio.wait_for(run.task, 60)
    assert run.tokens == want


def test_the_gate_is_off_unless_set(monkeypatch, tmp_path):
    monkeypatch.delenv("BALLAST_ENGINE_GATE", raising=False)
    assert Settings().engine_gate is None  # the engine worker does not wrap its engine
    monkeypatch.setenv("BALLAST_ENGINE_GATE", str(tmp_path / "gate.json"))
    assert Settings().engine_gate == tmp_path / "gate.json"
