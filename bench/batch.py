"""`ballast bench batch`: the same batch files through raw vLLM, vLLM's own batch runner
and Ballast, on the same vLLM engine arguments.

Arms, each round:
- raw: every request submitted at once to an in-process vLLM AsyncLLM (warm: its start
  and a warm-up request are not counted);
- run-batch: `python -m vllm.entrypoints.openai.run_batch -i in.jsonl -o out.jsonl` on the
  same JSONL file, what a vLLM user runs instead of a batch service. One process per
  file, so its start is part of what it costs: its time is reported with the start (spawn
  to the output file written) and without it (from its "Reading batch from" log line,
  when its engine is up, to the output file written); the ratios use the latter, the
  like-for-like one, and give the former beside it;
- Ballast: the file through `ballast up` end to end — REST upload → batch workflow →
  engine worker → journal checkpoints → output file — on default settings (warm stack);
  the batch ends when the journal records it completed, so the client's polling interval
  does not count;
- Ballast with LoRA support flipped (BALLAST_SERVE_FINE_TUNED, default on): the same
  stack without it (or with it, where the settings turn it off), for LoRA's cost;
- Ballast observed: the same stack as an operator runs it, JSON log lines
  (BALLAST_LOG_FORMAT=json) and a real Prometheus (the OS package) scraping the API's, the
  control worker's and the engine worker's /metrics every 2 s, for what metrics and logs
  cost (Prometheus' own CPU is reported apart: it is the operator's, not Ballast's), and
  how the scrapes fared under load.

Every engine gets vLLM's engine arguments from one function, `engine_args` (engine/
vllm_engine.py), the one the engine worker's Engine.start uses: the raw arm passes them to
AsyncLLM, run-batch gets them as its CLI flags (read back through vLLM's own parser), and
each Ballast stack's are read from its engine worker's log. The JSON prints each arm's,
and the run fails if the raw, run-batch and Ballast arms' differ. vLLM's processes run
at the same lower CPU priority in every arm (BALLAST_ENGINE_NICE).

Two batches: the short one (`requests` chat completions, 256 by default) and a long one
sized so that the raw arm runs at least `long_s` seconds. `runs` rounds, the arms' order
rotating from round to round, each arm with its own engine or stack; ratios are of the
medians over rounds, with a bootstrap interval (bench/stats.py). CPU per process is
sampled from /proc throughout and reported per 1,000 output tokens; the last round's short
batch is drawn (vLLM's running and waiting sequences, when each item reached vLLM and left
it, activity starts, checkpoint commits, CPU per process) into `picture`. One JSON line
last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from ballast import cpus, procs
from bench.stack import Stack, ballast_up
from bench.stats import p50, ratio_ci
from bench.timeline import VLLM_ROLES, CpuSampler, draw
from config import Settings
from engine.sampling import Sampling

SEED = 7
ALPHABET = "abcdefghijklmnopqrstuvwxyz      ,.ABCDEFGHIJ0123456789"
PICTURE = Path(__file__).with_name("batch-timeline.png")
URL = "/v1/chat/completions"  # the one generation endpoint vLLM's batch runner takes
ARMS = ("raw", "run_batch", "ballast", "ballast_lora_flipped", "ballast_observed")
ARGS_LINE = "vLLM engine args: "  # what Engine.from_args logs (engine/vllm_engine.py)
READY_LINE = "Reading batch from"  # run-batch's log, once its engine is up


def workload(n: int, seed: int = SEED) -> list[dict]:
    """n chat completions: a user message of 100-500 characters (byte tokenizer: one
    token each, plus the chat template's), 128-256 output tokens each, greedy, run to
    max_tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(100, 500)))
        out.append(dict(messages=[dict(role="user", content=text)], max_tokens=rng.randint(128, 256),
                        temperature=0, ignore_eos=True))
    return out


def batch_file(reqs: list[dict], model: str) -> bytes:
    """The OpenAI batch input file every arm but raw runs (raw runs its lines' bodies)."""
    return "".join(json.dumps(dict(custom_id=f"r{i}", method="POST", url=URL, body=dict(r, model=model))) + "\n"
                   for i, r in enumerate(reqs)).encode()


# -- the engine arguments ----------------------------------------------------------------


def run_batch_argv(args: dict[str, Any]) -> list[str]:
    """`args` (AsyncEngineArgs keywords) as vLLM's CLI flags, spelled as vLLM's own parser
    (the one run-batch uses) defines them."""
    from vllm.entrypoints.launchers.run_batch import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    actions = {a.dest: a for a in make_arg_parser(FlexibleArgumentParser())._actions}
    argv: list[str] = []
    for key, value in args.items():
        action = actions[key]
        flag = next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))
        if value is True:
            argv.append(flag)
        elif value is False:
            negative = [o for o in action.option_strings if o.startswith("--no-")]
            if negative:
                argv.append(negative[0])
            elif action.default is not False:  # a store_true flag: absent is False only where that's its default
                raise ValueError(f"vLLM's CLI cannot say {key}=False")
        elif isinstance(value, (list, tuple)):  # nargs="+" (logits_processors)
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def parsed_args(argv: list[str], keys: list[str]) -> dict[str, Any]:
    """What vLLM's own parser makes of `argv`: the engine arguments run-batch gets."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.run_batch import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["-i", "in.jsonl", "-o", "out.jsonl", *argv])
    got = vars(AsyncEngineArgs.from_cli_args(ns))
    out = {k: got[k] for k in keys}
    names = out.get("served_model_name")
    if isinstance(names, list) and len(names) == 1:  # the CLI takes a list of names; Python, a name or a list
        out["served_model_name"] = names[0]
    return out


def logged_args(log: Path) -> dict[str, Any]:
    """The engine arguments an engine worker started vLLM with, from its own log."""
    for line in log.read_text(errors="replace").splitlines():
        if ARGS_LINE in line:
            if line.startswith("{"):  # BALLAST_LOG_FORMAT=json: the message is a field of the line
                line = json.loads(line)["message"]
            return json.loads(line.split(ARGS_LINE, 1)[1])
    raise RuntimeError(f"no '{ARGS_LINE}' line in {log}")


# -- arm 1: raw vLLM ---------------------------------------------------------------------


async def raw_arm(settings: Settings, batches: dict[str, list[dict]], long_s: float | None = None) -> dict:
    """Each batch through one in-process engine on `engine_args(spec, settings)`. With
    `long_s`, the "long" batch is sized from the short one's throughput to run that long
    (its requests are returned)."""
    from engine.model_spec import resolve_model
    from engine.vllm_engine import Engine, engine_args

    spec = resolve_model(settings)
    args = engine_args(spec, settings)
    engine = await Engine.from_args(spec, args, nice=settings.engine_nice)
    everywhere = os.sched_getaffinity(0)
    if settings.isolate_engine_cpus:  # as `ballast up` places its processes: the same for both arms
        cpus.keep_off_model_workers(os.getpid())
    out: dict[str, Any] = dict(args=args)
    try:
        async def one(i: int, r: dict, items: list) -> int:
            n, start = 0, time.time()
            async for step in engine.generate(f"raw-{i}", engine.render_chat(r["messages"]),
                                              Sampling(r["max_tokens"], temperature=0.0, ignore_eos=True)):
                n += len(step.token_ids)
            items.append((start, time.time()))
            return n

        async def sample(load: list) -> None:
            while True:
                load.append((time.time(), engine.load.running, engine.load.waiting))
                await asyncio.sleep(0.05)

        await one(-1, dict(messages=[dict(role="user", content="warm up")], max_tokens=8), [])
        for name in ("short", "long"):
            reqs = batches.get(name)
            if name == "long" and reqs is None and long_s is not None:
                per_request = statistics.mean(r["max_tokens"] for r in batches["short"])
                reqs = batches["long"] = workload(math.ceil(long_s * out["short"]["tps"] / per_request), seed=SEED + 1)
            if not reqs:
                continue
            items: list = []
            load: list = []
            sampler = asyncio.create_task(sample(load))
            with CpuSampler(os.getpid(), root_role="vLLM frontend") as cpu:
                t0 = time.time()
                tokens = sum(await asyncio.gather(*(one(i, r, items) for i, r in enumerate(reqs))))
                seconds = time.time() - t0
            sampler.cancel()
            out[name] = dict(seconds=seconds, tokens=tokens, tps=tokens / seconds, requests=len(reqs),
                             cpu=cpu.totals(), timeline=dict(t0=t0, load=load, items=items, cpu=cpu.samples))
        return out
    finally:
        engine.shutdown()
        for tid in map(int, os.listdir(f"/proc/{os.getpid()}/task")):  # the next arm's stack inherits ours
            os.sched_setaffinity(tid, everywhere)


# -- arm 2: vLLM's own batch runner ------------------------------------------------------


def run_batch_arm(settings: Settings, batches: dict[str, list[dict]], log=print) -> dict:
    """Each batch file through one `run_batch` process on the raw arm's engine arguments."""
    from engine.model_spec import resolve_model
    from engine.vllm_engine import engine_args

    spec = resolve_model(settings)
    args = engine_args(spec, settings)
    argv = run_batch_argv(args)
    out: dict[str, Any] = dict(args=parsed_args(argv, list(args)), argv=argv)
    with tempfile.TemporaryDirectory(prefix="ballast-run-batch-") as d:
        for name, reqs in batches.items():
            got = run_batch_file(Path(d) / name, batch_file(reqs, spec.name), len(reqs), argv, settings.engine_nice)
            log(f"  {name}: its engine up in {got['start_s']:.1f} s")
            out[name] = got
    return out


def run_batch_file(work: Path, lines: bytes, n: int, argv: list[str], nice: int, keep_output: bool = False) -> dict:
    work.mkdir()
    infile, outfile, logfile = work / "in.jsonl", work / "out.jsonl", work / "run-batch.log"
    infile.write_bytes(lines)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(infile), "-o", str(outfile), *argv]
    # The V1 model runner, which loads the engine's logits processor, as engine workers run it.
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1",
               VLLM_USE_V2_MODEL_RUNNER=os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0"))
    t_spawn = time.time()
    # Its own session: stop() ends its group (it and the engine processes it forks), nothing else.
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    child = procs.Child("vllm run-batch", proc, logfile)
    ready: list[float] = []
    reader = threading.Thread(target=_follow, args=(proc, logfile, ready), daemon=True)
    reader.start()
    try:
        with CpuSampler(proc.pid, root_role="vLLM frontend") as cpu:
            while not ready and proc.poll() is None:
                _renice_vllm(proc.pid, nice)
                time.sleep(0.1)
            _renice_vllm(proc.pid, nice)  # threads its engine started since
            while not _complete(outfile, n) and proc.poll() is None:
                time.sleep(0.05)
            t_done = time.time()
        rc = proc.wait(120)
        reader.join(10)
    finally:
        child.stop(30)
    if not ready or not _complete(outfile, n) or rc != 0:
        raise RuntimeError(f"run-batch failed (exit {proc.returncode}); log {logfile}:\n{child.log_tail()}")
    results = [json.loads(ln) for ln in outfile.read_text().splitlines()]
    failed = [r for r in results if r["error"] is not None or r["response"]["status_code"] != 200]
    if failed:
        raise RuntimeError(f"run-batch: {len(failed)} of {n} requests failed, e.g. {failed[0]}")
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results)
    seconds, with_start = t_done - ready[0], t_done - t_spawn
    return dict(seconds=seconds, tokens=tokens, tps=tokens / seconds, requests=n, t0=ready[0],
                seconds_with_start=with_start, tps_with_start=tokens / with_start, start_s=ready[0] - t_spawn,
                cpu=cpu_between(cpu.samples, ready[0], t_done)) | (dict(lines=results) if keep_output else {})


def _follow(proc: subprocess.Popen, logfile: Path, ready: list[float]) -> None:
    """Copy run-batch's output to its log, noting when its engine is up (as the line arrives:
    vLLM's logger flushes each line)."""
    assert proc.stdout is not None
    with open(logfile, "wb") as f:
        for line in proc.stdout:
            if not ready and READY_LINE.encode() in line:
                ready.append(time.time())
            f.write(line)
            f.flush()


def _complete(path: Path, n: int) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return data.endswith(b"\n") and data.count(b"\n") >= n


def _renice_vllm(root: int, nice: int) -> None:
    """vLLM's engine processes under `root` (ours) at `nice` more than this process, every
    thread (niceness is per thread on Linux), as Engine.start places its own."""
    if nice <= 0:
        return
    target = os.getpriority(os.PRIO_PROCESS, 0) + nice
    for pid in cpus.descendants(root):
        try:
            if not Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::"):
                continue
            for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                if os.getpriority(os.PRIO_PROCESS, tid) < target:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
        except OSError:
            continue  # gone already


def cpu_between(samples: list[tuple[float, dict[str, float]]], start: float, end: float) -> dict[str, float]:
    """CPU seconds by role between two times, from a CpuSampler's cumulative samples: the
    last sample at or before `start` to the first at or after `end`. A sample holds only
    live processes, so a role whose processes exited meanwhile (run-batch's engine stops as
    soon as its output is written) counts with the most it had reached in between (not
    before `start`: a process renamed itself then, and its earlier role's sum dropped)."""
    first = next((i for i in range(len(samples) - 1, -1, -1) if samples[i][0] <= start), 0)
    before = samples[first][1] if samples and samples[first][0] <= start else {}
    upto = next((i for i, (t, _) in enumerate(samples) if t >= end), len(samples) - 1)
    after: dict[str, float] = {}
    for _, c in samples[first: upto + 1]:
        for k, v in c.items():
            after[k] = max(after.get(k, 0.0), v)
    return {k: round(v - before.get(k, 0.0), 2) for k, v in sorted(after.items(), key=lambda kv: -kv[1])}


# -- arm 3: through Ballast --------------------------------------------------------------


def ballast_arm(settings: Settings, batches: dict[str, list[dict]], log=print, observed: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-") as d:
        trace = Path(d) / "engine-trace.jsonl"
        control_port = procs.free_port()
        extra = dict(BALLAST_LOG_FORMAT="json", BALLAST_CONTROL_PORT=str(control_port)) if observed else {}
        with ballast_up(settings, Path(d), BALLAST_ENGINE_TRACE=str(trace),
                        BALLAST_SERVE_FINE_TUNED=str(settings.serve_fine_tuned).lower(), **extra) as stack, \
                (_prometheus(stack, Path(d), control_port) if observed else contextlib.nullcontext()) as prom:
            out: dict[str, Any] = dict(args=logged_args(Path(d) / "logs" / "engine.log"))
            warm = run_batch(stack, [dict(batches["short"][0], max_tokens=8)], settings)
            log(f"  warm-up batch: {warm['seconds']:.2f} s")
            for name, reqs in batches.items():
                with CpuSampler(stack.pid, root_role="ballast up") as cpu, \
                        (CpuSampler(prom.pid, root_role="prometheus") if prom else contextlib.nullcontext()) as pcpu:
                    got = run_batch(stack, reqs, settings)
                time.sleep(TRACE_FLUSH_S)  # the engine worker writes its trace out once a second
                timeline = _trace(trace, got["t0"], got["t0"] + got["seconds"])
                # From the last item leaving vLLM to the batch completed in the journal.
                last = max((end for _, end in timeline["items"]), default=None)
                got.update(cpu=cpu.totals(), timeline=dict(timeline, t0=got["t0"], cpu=cpu.samples),
                           tail_s=None if last is None else round(got["t0"] + got["seconds"] - last, 3))
                if prom is not None and pcpu is not None:
                    got.update(prometheus_cpu_s=round(sum(pcpu.totals().values()), 2), scrapes=prom.scrapes())
                out[name] = got
            return out


TRACE_FLUSH_S = 1.2  # engine/trace.py writes its buffer every second

SCRAPE_S = 2  # every process, every 2 s: 7 times Prometheus' usual 15 s, for a batch of seconds


class _Prometheus:
    """A real Prometheus scraping the stack's three processes every SCRAPE_S."""

    def __init__(self, child: procs.Child, url: str):
        self.child, self.url, self.pid = child, url, child.pid

    def scrapes(self) -> dict[str, Any]:
        """By job, over the run so far: the share of scrapes that succeeded (one slower than
        SCRAPE_S fails), the slowest, and the most samples one returned."""
        def query(q: str) -> dict[str, float]:
            got = httpx.get(self.url + "/api/v1/query", params=dict(query=q), timeout=10).json()["data"]["result"]
            return {r["metric"]["job"]: round(float(r["value"][1]), 3) for r in got}

        return dict(up=query("avg_over_time(up[10m])"), slowest_s=query("max_over_time(scrape_duration_seconds[10m])"),
                    samples=query("max_over_time(scrape_samples_scraped[10m])"))


@contextlib.contextmanager
def _prometheus(stack: Stack, data: Path, control_port: int):
    import psycopg

    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not installed: `make test-deps` installs it (apt's prometheus)")
    with psycopg.connect(stack.db_url) as conn:
        engines = [u for (u,) in conn.execute("SELECT url FROM engines ORDER BY id").fetchall()]
    targets = {"ballast-api": [str(stack.api.base_url)], "ballast-control": [f"http://127.0.0.1:{control_port}"],
               "ballast-engine": engines}
    every = f"{SCRAPE_S}s"
    config = {"global": dict(scrape_interval=every, scrape_timeout=every), "scrape_configs": [
        dict(job_name=job, authorization=dict(type="Bearer", credentials_file=str(data / "metrics-token")),
             static_configs=[dict(targets=[u.split("://", 1)[1].rstrip("/") for u in urls])])
        for job, urls in targets.items()]}
    (data / "prometheus.yml").write_text(json.dumps(config))
    port = procs.free_port()
    child = procs.spawn("prometheus", [binary, f"--config.file={data / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={data / 'prometheus'}",
                                       f"--web.listen-address=127.0.0.1:{port}"], log_path=data / "prometheus.log")
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_until(lambda: _answers(url + "/-/ready"), 60, "Prometheus to be ready", child=child)
        yield _Prometheus(child, url)
    finally:
        child.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_batch(stack: Stack, reqs: list[dict], settings: Settings, poll_s: float = 0.5) -> dict:
    t0 = time.time()
    seconds, out = submit(stack, batch_file(reqs, settings.model_name), poll_s)
    assert len(out) == len(reqs), (len(out), len(reqs))
    tokens = sum(json.loads(ln)["response"]["body"]["usage"]["completion_tokens"] for ln in out)
    return dict(seconds=seconds, tokens=tokens, tps=tokens / seconds, requests=len(reqs), t0=t0)


def submit(stack: Stack, lines: bytes, poll_s: float = 0.5) -> tuple[float, list[str]]:
    """A batch file through the Files and Batches APIs to its end: the seconds from its upload
    to the journal's record of it completed, and its output file's lines."""
    api, t0 = stack.api, time.time()
    fid = api.post("/v1/files", files={"file": ("bench.jsonl", lines)},
                   data={"purpose": "batch"}).raise_for_status().json()["id"]
    bid = api.post("/v1/batches", json=dict(input_file_id=fid, endpoint=URL,
                                            completion_window="24h")).raise_for_status().json()["id"]
    while (b := api.get(f"/v1/batches/{bid}").json())["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(poll_s)
    assert b["status"] == "completed", b
    return completed_at(stack.db_url, bid) - t0, download(api, b["output_file_id"])


def download(api: httpx.Client, file_id: str) -> list[str]:
    return api.get(f"/v1/files/{file_id}/content").text.splitlines()


def completed_at(db_url: str, batch_id: str) -> float:
    """When the journal recorded the batch completed (wall clock, as `time.time()`)."""
    import psycopg

    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT extract(epoch FROM committed_at)::float FROM events WHERE stream = %s"
                           " AND type = 'batch_status' AND payload->>'status' = 'completed'",
                           (f"batch:{batch_id}",)).fetchone()
    assert row is not None, f"batch {batch_id} has no completed status in the journal"
    return row[0]


def _trace(path: Path, start: float, end: float) -> dict:
    """The engine worker's timeline (engine/trace.py) between start and end."""
    load, activities, commits, submitted, items = [], [], [], {}, []
    lines = path.read_text().splitlines() if path.exists() else []
    for ln in lines:
        e = json.loads(ln)
        if not start <= e["t"] <= end + 0.5:
            continue
        if e["ev"] == "load":
            load.append((e["t"], e["running"], e["waiting"]))
        elif e["ev"] == "activity":
            activities.append(e["t"])
        elif e["ev"] == "commit":
            commits.append((e["at"], e["ms"]))
        elif e["ev"] == "submit":
            submitted[e["item"]] = e["t"]
        elif e["ev"] == "finish" and e["item"] in submitted:
            items.append((submitted.pop(e["item"]), e["t"]))
    return dict(load=load, activities=activities, commits=commits, items=items)


# -- the comparison ------------------------------------------------------------------------


def per_1k(cpu: dict[str, float], tokens: int) -> dict[str, float]:
    return {k: round(1000 * v / tokens, 4) for k, v in cpu.items() if v > 0}


def control_plane(cpu: dict[str, float]) -> float:
    """CPU seconds of everything that is not vLLM's engine core and model worker: in the
    raw and run-batch arms vLLM's frontend (the bench process; run-batch's own), in Ballast
    every other process of the stack (the engine worker, which holds vLLM's frontend, API,
    control worker, Temporal, Postgres)."""
    return sum(v for k, v in cpu.items() if k not in VLLM_ROLES)


def vllm_cpu(cpu: dict[str, float]) -> float:
    return sum(v for k, v in cpu.items() if k in VLLM_ROLES)


def args_differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The engine arguments two arms disagree on (as JSON: how the engine worker logs them)."""
    a, b = json.loads(json.dumps(a)), json.loads(json.dumps(b))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, "<unset>") != b.get(k, "<unset>"))


def median_ratio(arm: list[float], base: list[float]) -> dict:
    """Of the medians over rounds, with a bootstrap interval over the rounds."""
    return ratio_ci(arm, base, stat=p50).as_dict()


def summarise(rounds: list[dict[str, dict]], size: str, lora_on: str = "ballast") -> dict:
    """One batch size over the rounds; `lora_on`: which Ballast arm had LoRA support."""
    runs = {arm: [r[arm][size] for r in rounds if size in r.get(arm, {})] for arm in ARMS}
    tps = {arm: [x["tps"] for x in xs] for arm, xs in runs.items()}
    raw, rb, bal, flipped = runs["raw"], runs["run_batch"], runs["ballast"], runs["ballast_lora_flipped"]
    observed = runs["ballast_observed"]

    def cpu_1k(xs: list[dict], part) -> float:
        return round(p50([1000 * part(x["cpu"]) / x["tokens"] for x in xs]), 4)

    return dict(
        requests=raw[0]["requests"], output_tokens=raw[0]["tokens"],
        tokens_per_s={arm: round(p50(xs), 1) for arm, xs in tps.items()},
        run_batch_tokens_per_s_with_start=round(p50([x["tps_with_start"] for x in rb]), 1),
        # Ballast against each baseline; run-batch's own time excludes its start (its
        # engine up to its output file written), the like-for-like figure.
        ratio=median_ratio(tps["ballast"], tps["raw"]),
        ratio_vs_run_batch=median_ratio(tps["ballast"], tps["run_batch"]),
        ratio_vs_run_batch_with_start=median_ratio(tps["ballast"], [x["tps_with_start"] for x in rb]),
        run_batch_vs_raw=median_ratio(tps["run_batch"], tps["raw"]),
        ratios_per_round={arm: [round(x["tps"] / r["tps"], 3) for r, x in zip(raw, xs, strict=False)]
                          for arm, xs in runs.items() if arm != "raw"},
        seconds={arm: [round(x["seconds"], 2) for x in xs] for arm, xs in runs.items()},
        # Ballast's: from its last item leaving vLLM to the batch completed in the journal.
        tail_s={arm: [x.get("tail_s") for x in xs] for arm, xs in runs.items() if arm.startswith("ballast")},
        run_batch_seconds_with_start=[round(x["seconds_with_start"], 2) for x in rb],
        run_batch_start_s=[round(x["start_s"], 2) for x in rb],
        # CPU per 1,000 output tokens (medians over the rounds): vLLM's own processes (engine
        # core + model worker) and the control plane; and the last round's by process.
        vllm_cpu_per_1k={arm: cpu_1k(xs, vllm_cpu) for arm, xs in runs.items()},
        control_cpu_per_1k={arm: cpu_1k(xs, control_plane) for arm, xs in runs.items()},
        cpu_per_1k={arm: per_1k(xs[-1]["cpu"], xs[-1]["tokens"]) for arm, xs in runs.items()},
        # LoRA's cost: the same stack with LoRA support against without it.
        lora=_lora_line(*((bal, flipped) if lora_on == "ballast" else (flipped, bal))),
        # What metrics and logs cost: the same stack observed (JSON logs, Prometheus scraping
        # every process every SCRAPE_S) against it plain; Prometheus' own CPU apart.
        telemetry=dict(observed_over_plain=median_ratio(tps["ballast_observed"], tps["ballast"]),
                       control_cpu_per_1k=dict(plain=cpu_1k(bal, control_plane),
                                               observed=cpu_1k(observed, control_plane)),
                       prometheus_cpu_per_1k=round(p50([1000 * x["prometheus_cpu_s"] / x["tokens"]
                                                        for x in observed]), 4),
                       scrapes=observed[-1]["scrapes"]),
    )


def _lora_line(on: list[dict], off: list[dict]) -> dict:
    return dict(on_tokens_per_s=round(p50([x["tps"] for x in on]), 1),
                off_tokens_per_s=round(p50([x["tps"] for x in off]), 1),
                on_over_off=median_ratio([x["tps"] for x in on], [x["tps"] for x in off]))


def main(settings: Settings, requests: int = 256, runs: int = 3, long_s: float = 65.0,
         picture: Path | None = PICTURE) -> int:
    batches: dict[str, list[dict]] = {"short": workload(requests)}
    flipped = settings.model_copy(update=dict(serve_fine_tuned=not settings.serve_fine_tuned))
    print(f"bench batch: a short batch of {requests} chat completions and a long one sized to ≥ {long_s:.0f} s on "
          f"raw vLLM; messages of 100-500 characters, 128-256 output tokens; {runs} rounds of raw vLLM, vLLM "
          f"run-batch, Ballast and Ballast with LoRA support {'off' if settings.serve_fine_tuned else 'on'}, "
          f"their order rotating; model {settings.model_name}", flush=True)
    rounds: list[dict[str, dict]] = []
    for n in range(1, runs + 1):
        got: dict[str, dict] = {}
        order = ARMS[(n - 1) % len(ARMS):] + ARMS[:(n - 1) % len(ARMS)]
        if "long" not in batches and long_s > 0:  # the long batch is sized from raw's short one
            order = ("raw", *(a for a in order if a != "raw"))
        for arm in order:
            if arm == "raw":
                print(f"round {n}/{runs}, raw vLLM AsyncLLM (in process) …", flush=True)
                got[arm] = asyncio.run(raw_arm(settings, batches, long_s if long_s > 0 else None))
            elif arm == "run_batch":
                print(f"round {n}/{runs}, vLLM run-batch (a process per file) …", flush=True)
                got[arm] = run_batch_arm(settings, batches, log=lambda m: print(m, flush=True))
            elif arm == "ballast_observed":
                print(f"round {n}/{runs}, Ballast observed (JSON logs; Prometheus scraping every process every "
                      f"{SCRAPE_S} s) …", flush=True)
                got[arm] = ballast_arm(settings, batches, log=lambda m: print(m, flush=True), observed=True)
            else:
                own = settings if arm == "ballast" else flipped
                print(f"round {n}/{runs}, Ballast{'' if arm == 'ballast' else ', LoRA support flipped'} "
                      f"(BALLAST_SERVE_FINE_TUNED={str(own.serve_fine_tuned).lower()}; ballast up: REST → Temporal → "
                      "engine worker → journal) …", flush=True)
                got[arm] = ballast_arm(own, batches, log=lambda m: print(m, flush=True))
            for name in batches:
                r = got[arm][name]
                extra = f", {r['seconds_with_start']:.2f} s with its start" if "seconds_with_start" in r else ""
                if r.get("tail_s") is not None:
                    extra += f"; completed {r['tail_s']:.2f} s after its last item left vLLM"
                print(f"  {name}: {r['tokens']} tokens in {r['seconds']:.2f} s ({r['tps']:.0f} tok/s{extra})",
                      flush=True)
        rounds.append(got)

    # The engine arguments each arm's vLLM got: raw (passed), run-batch (vLLM's parser's
    # reading of its flags), each Ballast stack (its engine worker's log), last round.
    last = rounds[-1]
    engine = {arm: last[arm]["args"] for arm in ARMS}
    unequal = {arm: args_differ(engine["raw"], engine[arm]) for arm in ARMS if arm != "raw"}
    out: dict[str, Any] = dict(bench="batch", rounds=runs, run=uuid.uuid4().hex[:8], endpoint=URL,
                               engine_args=engine, run_batch_argv=last["run_batch"]["argv"],
                               engine_args_differ_from_raw=unequal,
                               engine_args_equal=not (unequal["run_batch"] or unequal["ballast"]),
                               engine_nice=settings.engine_nice)
    # Which Ballast stack served with LoRA support: as its engine worker logged it.
    lora_on = "ballast" if engine["ballast"].get("enable_lora") else "ballast_lora_flipped"
    for size, target in (("short", 0.90), ("long", 0.95)):
        if size not in batches:
            continue
        s = out[size] = summarise(rounds, size, lora_on)
        s["target"] = target
        tps = s["tokens_per_s"]
        print(f"\n{size} batch ({s['requests']} requests, {s['output_tokens']} output tokens), medians of {runs}:")
        print(f"  raw vLLM {tps['raw']:.0f} tok/s, run-batch {tps['run_batch']:.0f} "
              f"({s['run_batch_tokens_per_s_with_start']:.0f} with its start), Ballast {tps['ballast']:.0f}, "
              f"Ballast LoRA flipped {tps['ballast_lora_flipped']:.0f}, Ballast observed {tps['ballast_observed']:.0f}")
        print(f"  Ballast ÷ raw {s['ratio']['ratio']:.3f} {s['ratio']['ci95']} (target ≥ {target}); "
              f"÷ run-batch {s['ratio_vs_run_batch']['ratio']:.3f} {s['ratio_vs_run_batch']['ci95']} "
              f"(with its start {s['ratio_vs_run_batch_with_start']['ratio']:.3f}); "
              f"run-batch ÷ raw {s['run_batch_vs_raw']['ratio']:.3f}")
        print(f"  LoRA support on ÷ off (Ballast): {s['lora']['on_over_off']['ratio']:.3f} "
              f"{s['lora']['on_over_off']['ci95']}")
        print(f"  vLLM CPU s per 1,000 tokens: {s['vllm_cpu_per_1k']}; control plane: {s['control_cpu_per_1k']}")
        t = s["telemetry"]
        print(f"  observed ÷ plain (JSON logs, scraped every {SCRAPE_S} s): {t['observed_over_plain']['ratio']:.3f} "
              f"{t['observed_over_plain']['ci95']}; control-plane CPU s per 1,000 tokens {t['control_cpu_per_1k']}, "
              f"Prometheus' own {t['prometheus_cpu_per_1k']}; scrapes {t['scrapes']}")
    print(f"\nengine args differing from the raw arm's: {unequal}")
    if picture is not None:
        arms = [dict(last["raw"]["short"]["timeline"], name=f"raw vLLM: {last['raw']['short']['tps']:.0f} tok/s"),
                dict(last["ballast"]["short"]["timeline"],
                     name=f"Ballast: {last['ballast']['short']['tps']:.0f} tok/s")]
        draw(picture, arms, f"bench batch, short batch ({requests} chat completions), round {runs}")
        print(f"\ntimeline: {picture}")
        out["picture"] = str(picture)
    print(json.dumps(out))
    return 0 if out["engine_args_equal"] else 1
