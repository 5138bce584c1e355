"""`ballast bench rate` compares like with like: `vllm serve` gets, through its own parser,
the engine arguments the product's engine worker starts vLLM with."""

from __future__ import annotations

import json

from bench import batch, rate
from config import Settings
from engine.model_spec import ModelSpec
from engine.vllm_engine import engine_args


def test_vllm_serve_gets_the_engine_workers_engine_args(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    spec = ModelSpec(str(tmp_path), "tiny", 1024)
    settings = Settings(data_dir=tmp_path / "data", model=spec.path, served_model_name=spec.name,
                        max_model_len=spec.max_model_len, engine_token="t")
    argv = rate.serve_argv(settings, 8123)
    assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert (ns.host, ns.port) == ("127.0.0.1", 8123)
    product = engine_args(spec, settings)
    got = vars(AsyncEngineArgs.from_cli_args(ns))
    parsed = {k: got[k] for k in product} | {"served_model_name": got["served_model_name"][0]}
    assert batch.args_differ(product, parsed) == []


def test_the_requests_are_small_greedy_chats():
    bodies = rate.bodies("m", 40)
    assert sorted({b["max_tokens"] for b in bodies}) == list(range(1, rate.MAX_TOKENS + 1))
    assert all(b["temperature"] == 0 and "stream" not in b for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == 40
