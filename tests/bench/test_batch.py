"""`ballast bench batch` compares like with like: every arm's vLLM gets the engine
arguments the product's engine worker starts vLLM with."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from bench import batch
from config import Settings
from engine.model_spec import ModelSpec
from engine.vllm_engine import Engine, engine_args

GiB = 1 << 30


class _Started(Exception):
    """Raised where vLLM would start: carries what it was asked for."""

    def __init__(self, args: dict):
        self.got = args


@pytest.fixture
def spec(tmp_path) -> ModelSpec:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"dtype": "float32"}))
    return ModelSpec(str(model), "tiny", 1024)


def _settings(tmp_path: Path, spec: ModelSpec, **kw) -> Settings:
    return Settings(data_dir=tmp_path / "data", model=spec.path, served_model_name=spec.name,
                    max_model_len=spec.max_model_len, engine_token="t", engine_nice=0, **kw)


async def _engine_worker_args(monkeypatch, settings: Settings) -> dict:
    """What the product's engine worker (ballast/workers.py) asks vLLM for: the engine
    arguments reaching AsyncEngineArgs, caught before anything starts."""
    from ballast import workers

    def caught(cls, spec, args, full_at=0):
        raise _Started(args)

    monkeypatch.setattr(Engine, "_start_blocking", classmethod(caught))
    with pytest.raises(_Started) as got:
        await workers.engine_worker(settings)
    return got.value.got


async def test_engine_worker_starts_vllm_on_engine_args(monkeypatch, tmp_path, spec, caplog):
    settings = _settings(tmp_path, spec)
    with caplog.at_level(logging.INFO, logger="engine.vllm_engine"):
        args = await _engine_worker_args(monkeypatch, settings)
    assert args == engine_args(spec, settings)
    # The settings' documented defaults, by hand: the knobs the raw arm once lacked.
    assert args["long_prefill_token_threshold"] == 64
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 4, 8)
    assert args["kv_cache_memory_bytes"] == GiB and args["max_num_seqs"] == 256
    # Its log says so, and the bench reads Ballast's arm from that line.
    log = tmp_path / "engine.log"
    log.write_text("\n".join(f"2026-01-01 INFO engine.vllm_engine: {r.getMessage()}" for r in caplog.records))
    assert batch.logged_args(log) == json.loads(json.dumps(args))


async def test_serving_no_fine_tunes_drops_lora_only(monkeypatch, tmp_path, spec):
    on = await _engine_worker_args(monkeypatch, _settings(tmp_path, spec))
    off = await _engine_worker_args(monkeypatch, _settings(tmp_path, spec, serve_fine_tuned=False))
    assert batch.args_differ(on, off) == ["enable_lora", "max_lora_rank", "max_loras"]
    assert "enable_lora" not in off


@pytest.mark.parametrize("kw", [{}, dict(serve_fine_tuned=False, max_num_batched_tokens=512, long_prefill_tokens=0)])
async def test_every_arm_gets_equal_engine_args(monkeypatch, tmp_path, spec, kw):
    settings = _settings(tmp_path, spec, **kw)
    product = await _engine_worker_args(monkeypatch, settings)

    # Raw arm: what Engine.from_args would hand vLLM.
    raw = engine_args(spec, settings)
    assert batch.args_differ(product, raw) == []

    # run-batch: its flags as vLLM's own parser reads them, field by field into
    # AsyncEngineArgs, equal those the engine worker passes in Python.
    from vllm.engine.arg_utils import AsyncEngineArgs

    argv = batch.run_batch_argv(raw)
    parsed = batch.parsed_args(argv, list(raw))
    assert batch.args_differ(product, parsed) == []
    direct = vars(AsyncEngineArgs(**product))
    assert {k: direct[k] for k in raw} == parsed
    # and flags left out are vLLM's defaults where the product's Python call leaves them too
    assert "--no-disable-log-stats" not in argv and "--disable-log-stats" in argv


def test_args_differ_sees_a_missing_or_changed_key():
    assert batch.args_differ(dict(a=1, b=True), dict(a=1)) == ["b"]
    assert batch.args_differ(dict(a=1), dict(a=2)) == ["a"]
    assert batch.args_differ(dict(a=[1]), dict(a=(1,))) == []  # as JSON


def test_cpu_between_takes_the_samples_around_the_interval():
    samples = [(0.0, {}), (1.0, {"vLLM worker": 1.0}), (2.0, {"vLLM worker": 3.0, "vLLM frontend": 0.5}),
               (3.0, {"vLLM worker": 6.0, "vLLM frontend": 1.0})]
    assert batch.cpu_between(samples, 1.2, 2.5) == {"vLLM worker": 5.0, "vLLM frontend": 1.0}
    assert batch.cpu_between(samples, 2.0, 2.0) == {"vLLM worker": 0.0, "vLLM frontend": 0.0}
    # vLLM's processes gone by the sample after the end (run-batch stops its engine at once):
    # they count with what they had used.
    exited = [*samples[:3], (2.6, {"vLLM worker": 4.0, "vLLM frontend": 0.8}), (3.0, {"vLLM frontend": 1.0})]
    assert batch.cpu_between(exited, 1.2, 2.9) == {"vLLM worker": 3.0, "vLLM frontend": 1.0}
    # vLLM's engine process starts as "python" (other) and renames itself before `start`.
    renamed = [(0.0, {}), (1.0, {"other": 8.0}), (2.0, {"vLLM engine core": 0.5}), (3.0, {"vLLM engine core": 2.5})]
    assert batch.cpu_between(renamed, 2.5, 3.0) == {"vLLM engine core": 2.0}


def test_the_batch_file_is_chat_completions_run_batch_takes():
    from vllm.entrypoints.launchers.run_batch import BatchRequestInput

    reqs = batch.workload(3)
    lines = batch.batch_file(reqs, "tiny").decode().splitlines()
    assert len(lines) == 3
    for line, req in zip(lines, reqs, strict=True):
        parsed = BatchRequestInput.model_validate_json(line)  # vLLM's own reading of the line
        assert parsed.url == "/v1/chat/completions"
        assert parsed.body.max_tokens == req["max_tokens"] and parsed.body.ignore_eos is True
        assert parsed.body.messages[0]["content"] == req["messages"][0]["content"]


def _round(tps: dict[str, float]) -> dict:
    arm = lambda t, **kw: dict(tps=t, tokens=1000, seconds=1000 / t, requests=10,  # noqa: E731
                               cpu={"vLLM worker": 1.0, "engine worker": 0.05}, **kw)
    run_batch = dict(tps_with_start=tps["run_batch"] / 10, seconds_with_start=10000 / tps["run_batch"], start_s=30.0)
    observed = dict(prometheus_cpu_s=0.02, scrapes=dict(up={"ballast-api": 1.0}))
    extra: dict[str, dict[str, Any]] = dict(run_batch=run_batch, ballast_observed=observed)
    return {name: {"short": arm(t, **extra.get(name, {}))} for name, t in tps.items()}


@pytest.mark.parametrize("lora_on", ["ballast", "ballast_lora_flipped"])
def test_summary_ratios_by_hand(lora_on):
    rounds = [_round(dict(raw=100, run_batch=110, ballast=80, ballast_lora_flipped=88, ballast_observed=76)),
              _round(dict(raw=120, run_batch=100, ballast=90, ballast_lora_flipped=99, ballast_observed=90)),
              _round(dict(raw=110, run_batch=105, ballast=85, ballast_lora_flipped=93.5, ballast_observed=83.3))]
    s = batch.summarise(rounds, "short", lora_on)
    assert s["tokens_per_s"] == dict(raw=110, run_batch=105, ballast=85, ballast_lora_flipped=93.5,
                                     ballast_observed=83.3)  # medians
    assert s["ratio"]["ratio"] == round(85 / 110, 3)
    assert s["ratio_vs_run_batch"]["ratio"] == round(85 / 105, 3)
    assert s["ratio_vs_run_batch_with_start"]["ratio"] == round(85 / 10.5, 3)
    assert s["ratios_per_round"]["ballast"] == [0.8, 0.75, round(85 / 110, 3)]
    on, off = (85, 93.5) if lora_on == "ballast" else (93.5, 85)
    assert (s["lora"]["on_tokens_per_s"], s["lora"]["off_tokens_per_s"]) == (on, off)
    assert s["lora"]["on_over_off"]["ratio"] == round(on / off, 3)
    lo, hi = s["ratio"]["ci95"]
    assert lo <= s["ratio"]["ratio"] <= hi
    # Metrics and logs: observed against plain, and the control plane's CPU (the engine
    # worker's 0.05 s per 1,000 tokens in both), Prometheus' apart (0.02 s).
    t = s["telemetry"]
    assert t["observed_over_plain"]["ratio"] == round(83.3 / 85, 3)
    assert t["control_cpu_per_1k"] == dict(plain=0.05, observed=0.05) and t["prometheus_cpu_per_1k"] == 0.02
