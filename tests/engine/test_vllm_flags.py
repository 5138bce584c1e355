"""vLLM's own engine flags reach an engine worker's vLLM (BALLAST_VLLM_ARGS), read by vLLM's
own parser: what it accepts is what vLLM runs with, what it refuses fails naming itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from config import Settings
from engine.model_spec import ModelSpec
from engine.vllm_engine import BadVllmFlags, Engine, GiB, engine_args, parse_vllm_flags, vllm_args


def test_flags_as_vllm_serve_takes_them():
    got = parse_vllm_flags("--tensor-parallel-size 2 --quantization fp8 --gpu-memory-utilization 0.92 "
                           "--no-enforce-eager --max_cpu_loras 16")
    assert got == dict(tensor_parallel_size=2, quantization="fp8", gpu_memory_utilization=0.92,
                       enforce_eager=False, max_cpu_loras=16)
    assert parse_vllm_flags("  ") == {}


def test_vllm_yaml_config_file(tmp_path):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("tensor-parallel-size: 4\nenable-chunked-prefill: true\n")
    # vLLM's precedence: flags on the line win over the file.
    assert parse_vllm_flags(f"--config {cfg} -tp 2") == dict(tensor_parallel_size=2, enable_chunked_prefill=True)


@pytest.mark.parametrize("flags,named", [
    ("--frobnicate 1", "--frobnicate"),
    ("--tensor-parallel-size two", "--tensor-parallel-size"),
    ("--max-model-len 4096", "BALLAST_MAX_MODEL_LEN"),
    ("--model other --max-num-seqs 8", "BALLAST_MAX_NUM_SEQS"),
    ("--scheduling-policy fcfs", "priority scheduling"),
    ("--max-lora-rank 16", "BALLAST_MAX_LORA_RANK"),  # the API checks fine-tuning jobs' lora_rank against it
])
def test_a_bad_flag_fails_naming_itself(flags, named):
    with pytest.raises(BadVllmFlags, match="BALLAST_VLLM_ARGS") as err:
        parse_vllm_flags(flags)
    assert named in str(err.value)


def _spec(tmp_path) -> ModelSpec:
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    return ModelSpec(str(tmp_path), "m", 512)


def test_the_operators_flags_win_over_ballasts_defaults(tmp_path):
    spec = _spec(tmp_path)
    base = engine_args(spec, Settings(engine_token="t"))
    assert base["enable_prefix_caching"] is True and base["seed"] == 0
    flags = "--no-enable-prefix-caching --seed 7 --block-size 32"
    tuned = engine_args(spec, Settings(engine_token="t", vllm_args=flags))
    assert {k: v for k, v in tuned.items() if base.get(k) != v} == dict(enable_prefix_caching=False, seed=7,
                                                                           block_size=32)


def test_the_largest_lora_rank_served_is_ballasts_setting(tmp_path):
    """BALLAST_MAX_LORA_RANK reaches vLLM as max_lora_rank (the API refuses fine-tuning jobs
    above it), one of the values vLLM takes."""
    from pydantic import ValidationError

    spec = _spec(tmp_path)
    assert engine_args(spec, Settings(engine_token="t"))["max_lora_rank"] == 8
    assert engine_args(spec, Settings(engine_token="t", max_lora_rank=64))["max_lora_rank"] == 64
    assert "max_lora_rank" not in engine_args(spec, Settings(engine_token="t", serve_fine_tuned=False))
    with pytest.raises(ValidationError, match="max_lora_rank is one of 1, 8, 16"):
        Settings(engine_token="t", max_lora_rank=12)


def test_eager_and_a_fixed_kv_budget_only_on_cpu(tmp_path):
    spec = _spec(tmp_path)
    cpu = vllm_args(spec, cpu=True)
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == GiB
    # On an accelerator vLLM compiles and sizes the KV cache from gpu_memory_utilization,
    # unless the operator names a budget.
    gpu = vllm_args(spec, cpu=False)
    assert "enforce_eager" not in gpu and "kv_cache_memory_bytes" not in gpu
    assert vllm_args(spec, cpu=False, kv_cache_gib=40)["kv_cache_memory_bytes"] == 40 * GiB


def test_an_embedding_pool_runs_vllms_pooling_runner_without_sampling_machinery(tmp_path):
    """BALLAST_MODEL_TASK=embed: vLLM's pooling runner (its --convert auto makes a generative
    model an embedding one); no logits processors or LoRA, which only sampling uses."""
    from dataclasses import replace

    spec = replace(_spec(tmp_path), task="embed")
    args = engine_args(spec, Settings(engine_token="t", model_task="embed"))
    assert args["runner"] == "pooling" and "logits_processors" not in args and "enable_lora" not in args
    assert "runner" not in vllm_args(_spec(tmp_path), cpu=True)
    with pytest.raises(BadVllmFlags, match="--runner is Ballast's to set: use BALLAST_MODEL_TASK"):
        parse_vllm_flags("--runner pooling")


def test_an_engine_worker_with_a_bad_flag_exits_naming_it(tmp_path):
    """Before minutes of model loading, not after: the worker process itself."""
    env = dict(BALLAST_DATA_DIR=str(tmp_path), BALLAST_ENGINE_TOKEN="t", BALLAST_VLLM_ARGS="--tensr-parallel-size 2",
               BALLAST_SERVICE_DATABASE_URL="postgresql://nobody@127.0.0.1:9/none",
               BALLAST_TEMPORAL_ADDRESS="127.0.0.1:9",
               PATH="/usr/bin:/bin", HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "ballast.cli", "worker", "engine"], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode != 0
    assert "unrecognized arguments: --tensr-parallel-size" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.engine
async def test_vllm_runs_with_the_flags_it_was_given(tiny_model):
    """vLLM's own config, read back from the running engine, is the oracle."""
    settings = Settings(model=tiny_model.path, served_model_name=tiny_model.name,
                        max_model_len=tiny_model.max_model_len, kv_cache_gib=0.25, max_num_seqs=8,
                        serve_fine_tuned=False, engine_token="t",
                        vllm_args="--block-size 32 --max-logprobs 3")
    engine = await Engine.from_args(tiny_model, engine_args(tiny_model, settings))
    try:
        config = engine._llm.vllm_config
        assert engine.block_size == config.cache_config.block_size == 32
        assert config.model_config.max_logprobs == 3
        assert config.scheduler_config.max_num_seqs == 8
    finally:
        engine.shutdown()
