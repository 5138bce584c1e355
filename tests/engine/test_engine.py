"""The tiny model and the vLLM adapter, against a real engine.

What the rest of Ballast relies on: greedy outputs do not depend on what else is in
the batch, and an aborted request resumed from `prompt + produced` continues exactly.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import uuid
from pathlib import Path

import pytest

from engine.sampling import Sampling
from engine.tiny import build_tiny_model
from engine.vllm_engine import Engine, Step

TEXTS = [
    "", "hello world", "  leading and trailing  ", "héllo wörld", "日本語テキスト",
    "emoji 🚀🧪", "tab\tnew\nline", "<|not special|>",
]
TOPICS = [
    "cats", "the sea", "ballast tanks", "a dragon", "Zürich", "1 + 1 =", "def f(x):",
    "once upon a time", "la mer", "привет", "GPU kernels", "", "x" * 50,
    "the quick brown fox", "haiku", "résumé",
]
PROMPTS = [f"Request {i}: {topic}" for i, topic in enumerate(TOPICS)]


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_build_is_deterministic_and_idempotent(tmp_path, tiny_model):
    a = build_tiny_model(tmp_path / "a", max_model_len=1024)
    b = build_tiny_model(tmp_path / "b", max_model_len=1024)
    assert a.name == b.name == Path(tiny_model.path).name
    assert _digest(a) == _digest(b)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a", max_model_len=1024) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert build_tiny_model(tmp_path / "a", max_model_len=512).name != a.name


def test_concurrent_builders_agree(tmp_path):
    out: list[Path] = []
    def build() -> None:
        out.append(build_tiny_model(tmp_path))

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1 and len(out) == 3
    assert [p.name for p in tmp_path.iterdir()] == [out[0].name]  # no temp dirs left


def test_tokenizer_round_trip(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    for s in TEXTS:
        ids = tok.encode(s, add_special_tokens=False)
        assert len(ids) == len(s.encode())  # one token per byte
        assert tok.decode(ids) == s
        with_bos = tok.encode(s)
        assert with_bos[0] == tok.bos_token_id and with_bos[1:] == ids
    # Like every HF tokenizer, special-token text in the input *is* the special token
    # (the chat template relies on it); so text containing one does not round-trip.
    assert tok.encode("a<|eos|>", add_special_tokens=False) == [97, tok.eos_token_id]
    config = json.loads((Path(tiny_model.path) / "config.json").read_text())
    assert config["head_dim"] >= 64 and config["vocab_size"] == len(tok)


# ---- against the engine -------------------------------------------------------------


def _rid() -> str:
    return uuid.uuid4().hex


async def _run(
    engine: Engine, prompt: list[int], max_tokens: int, priority: int = 0, **sampling
) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    reason = None
    if "stop" in sampling:
        sampling["stop"] = tuple(sampling["stop"])
    async for step in engine.generate(_rid(), prompt, Sampling(max_tokens, temperature=0.0, **sampling),
                                      priority=priority):
        assert isinstance(step, Step) and reason is None  # nothing after the final step
        tokens += step.token_ids
        reason = step.finish_reason
    return tokens, reason


@pytest.mark.engine
async def test_engine_round_trip_and_chat(engine):
    for s in TEXTS:
        assert engine.decode(engine.render_text(s)) == s
    ids = engine.render_chat([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "héllo 🚀"},
    ])
    assert ids[0] == engine.tokenizer.bos_token_id
    text = engine.decode(ids)
    assert "be brief" in text and "héllo 🚀" in text
    assert ids[-1] == engine.tokenizer.convert_tokens_to_ids("<|assistant|>")


@pytest.mark.engine
async def test_greedy_generation(engine):
    for p in PROMPTS[:4]:
        prompt = engine.render_text(p)
        tokens, reason = await _run(engine, prompt, 32, priority=3)
        assert reason in ("length", "stop") and 0 < len(tokens) <= 32
        assert reason == "stop" or len(tokens) == 32
        # Greedy is a function of the prompt.
        assert (await _run(engine, prompt, 32))[0] == tokens


@pytest.mark.engine
async def test_batched_equals_alone(engine):
    prompts = [engine.render_text(p) for p in PROMPTS]
    alone = [await _run(engine, p, 48) for p in prompts]
    together = await asyncio.gather(*(_run(engine, p, 48) for p in prompts))
    assert together == alone


@pytest.mark.engine
@pytest.mark.parametrize("k", [1, 17, 40])
async def test_abort_and_resume_continues_exactly(engine, k):
    n = 64
    prompt = engine.render_chat([{"role": "user", "content": f"resume me after {k}"}])
    reference, _ = await _run(engine, prompt, n)

    rid, produced, last = _rid(), [], None
    async for step in engine.generate(rid, prompt, Sampling(n, temperature=0.0)):
        produced += step.token_ids
        last = step
        if len(produced) >= k and step.finish_reason is None:
            await engine.abort(rid)  # the stream ends with an "abort" step
    assert last.finish_reason == "abort" and len(produced) >= k
    assert produced == reference[: len(produced)]

    # Resume from exactly k tokens (what a checkpoint would hold), while other
    # requests share the batch.
    checkpoint = produced[:k]
    noise = [asyncio.create_task(_run(engine, engine.render_text(p), 24)) for p in PROMPTS[:6]]
    rest, reason = await _run(engine, prompt + checkpoint, n - k)
    await asyncio.gather(*noise)
    assert checkpoint + rest == reference
    assert reason == ("length" if len(reference) == n else "stop")


@pytest.mark.engine
async def test_cancelling_the_iterator_aborts(engine):
    gen = engine.generate(_rid(), engine.render_text("cancel me"), Sampling(500, temperature=0.0))
    first = await anext(gen)
    assert first.token_ids and first.finish_reason is None
    await gen.aclose()  # vLLM aborts the request; the engine stays healthy
    tokens, reason = await _run(engine, engine.render_text("still alive"), 8)
    assert len(tokens) == 8 and reason == "length"


@pytest.mark.engine
async def test_stop_string(engine):
    prompt = engine.render_text(PROMPTS[0])
    reference, _ = await _run(engine, prompt, 64)
    # A stop string the greedy output is known to contain: its first printable ASCII byte.
    i, byte = next((i, t) for i, t in enumerate(reference) if 33 <= t < 127)
    tokens, reason = await _run(engine, prompt, 64, stop=[chr(byte)])
    assert reason == "stop"
    assert tokens == reference[: i + 1]  # the stopping token is included, text aside


@pytest.mark.engine
async def test_load_follows_the_scheduler(engine):
    """The engine reports vLLM's own view after every step: running sequences, queued
    requests and KV-cache use — what the fleet controller reads."""
    prompts = [engine.render_text(p) for p in PROMPTS]
    seen: list[tuple[int, float]] = []

    async def watch(stop: asyncio.Event):
        while not stop.is_set():
            seen.append((engine.load.running, engine.load.kv_cache_usage))
            await asyncio.sleep(0.005)

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(stop))
    await asyncio.gather(*(_run(engine, p, 64, ignore_eos=True) for p in prompts))
    stop.set()
    await watcher
    assert max(r for r, _ in seen) >= 2, seen[:20]
    assert max(kv for _, kv in seen) > 0.0
    # Idle again: the last step reported nothing running.
    await asyncio.sleep(0.05)
    assert engine.load.running == 0 and engine.load.waiting == 0


@pytest.mark.engine
async def test_vllm_runs_on_the_engine_args(engine, tiny_model):
    """Engine.start's knobs reach vLLM as `vllm_args` says (the arguments every benchmark
    arm shares): read back from vLLM's own configuration of the running engine."""
    from engine.vllm_engine import GiB, vllm_args

    args = vllm_args(tiny_model, kv_cache_gib=0.5, max_num_seqs=64)  # as the fixture starts it
    config = engine._llm.vllm_config
    assert args["kv_cache_memory_bytes"] == config.cache_config.kv_cache_memory_bytes == GiB // 2
    assert args["max_num_seqs"] == config.scheduler_config.max_num_seqs == 64
    assert config.scheduler_config.long_prefill_token_threshold == args["long_prefill_token_threshold"] == 0
    assert config.scheduler_config.policy == args["scheduling_policy"] == "priority"
    assert config.cache_config.enable_prefix_caching is args["enable_prefix_caching"] is True
    assert config.lora_config is None and "enable_lora" not in args
    assert str(config.model_config.dtype) == "torch.float32" and args["dtype"] == "float32"


def test_only_our_own_vllm_processes_are_found_for_renicing():
    """Another engine's vLLM on the same machine is not ours: only descendants count."""
    import os
    import subprocess
    import sys
    import time

    from engine.vllm_engine import _vllm_processes

    name_self = "open('/proc/self/comm', 'w').write('VLLM::Test'); import time; time.sleep(30)"
    ours = subprocess.Popen([sys.executable, "-c", name_self])
    # A process that is not ours: started by a child that exits, so init adopts it.
    spawn = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
             "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    stranger = subprocess.run([sys.executable, "-c", spawn, name_self], capture_output=True, text=True, check=True)
    other = int(stranger.stdout)
    try:
        def named(pid: int) -> bool:
            with open(f"/proc/{pid}/comm") as f:
                return f.read().startswith("VLLM::")

        deadline = time.monotonic() + 20
        while not (named(ours.pid) and named(other)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert named(other)  # it is there, named as vLLM names its own
        found = _vllm_processes()
        assert ours.pid in found and other not in found
    finally:
        ours.kill()
        os.kill(other, 9)
