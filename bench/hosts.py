"""Ballast as separate hosts on this machine: each host a network namespace of its own, with
its own address, data directory, model copy and temporary directory, started with the
deployment's real commands (`ballast migrate|api|worker`) and an environment it is handed
whole (nothing inherited), checked against the deployment contract (ballast/topology.py).

    host      address  runs
    pg        .2       Postgres, listening on its own address only
    temporal  .3       the Temporal dev server on the host's loopback, reachable from other
                       hosts only through HAProxy: TLS, and a client certificate required
    s3        .4       an S3-compatible object store (moto's server): no shared filesystem
    control   .20      `ballast migrate` (as the owner), then `ballast worker control`
    engine1/2 .31/.32  `ballast worker engine`, one vLLM each
    api1/2    .11/.12  `ballast api`

The hosts meet on a bridge in the root namespace, where the client (this process, an
operator's laptop) sits at .1. 127.0.0.1 is a host's own in its namespace, so nothing can
cross hosts through it; a host's files are under its own directory. A run drives both API
hosts with the official client (chats, a batch, a fine-tune), cuts one engine host's link
mid-batch and checks the batch completes exactly once, by the journal's SQL and the
client's own record. Root only (namespaces, veth pairs).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import random
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from ballast import procs, topology
from ballast.temporal_server import temporal_cli
from bench.tls import Pki, haproxy, haproxy_conf, make_pki
from config import Settings
from config.database import SERVICE_ROLES, as_role, libpq_url

BUCKET = "ballast"
S3_PORT = 9000
PG_PORT = 5432
TEMPORAL_PORT = 7233
API_PORT = 8000
ENGINE_PORT = 8100
CONTROL_PORT = 9000

ADDRESSES = dict(pg=2, temporal=3, s3=4, api1=11, api2=12, control=20, engine1=31, engine2=32)


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Network:
    """A bridge in the root namespace and one namespace per host, veth-linked to it."""

    tag: str  # short, unique per run: namespace and link names carry it
    subnet: ipaddress.IPv4Network | ipaddress.IPv6Network
    made: list[str] = field(default_factory=list)
    addresses: Mapping[str, int] = field(default_factory=lambda: ADDRESSES)  # host → its last octet

    @classmethod
    def free(cls, addresses: Mapping[str, int] = ADDRESSES) -> Network:
        used = _run("ip", "-4", "-o", "addr")
        while True:
            subnet = ipaddress.ip_network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
            if f" {subnet.network_address + 1}/" not in used and str(subnet.network_address)[:-1] not in used:
                return cls(f"b{secrets.token_hex(3)}", subnet, addresses=addresses)

    def addr(self, host: str) -> str:
        return str(self.subnet.network_address + (1 if host == "client" else self.addresses[host]))

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def _veth(self, host: str) -> str:
        return f"{self.tag}{host[0]}{self.addresses[host]}"  # the root side; at most 15 characters

    def build(self) -> None:
        bridge = f"{self.tag}br"
        _run("ip", "link", "add", bridge, "type", "bridge")
        self.made.append(f"link:{bridge}")
        _run("ip", "addr", "add", f"{self.addr('client')}/{self.subnet.prefixlen}", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for host in self.addresses:
            ns, outside = self.ns(host), self._veth(host)
            _run("ip", "netns", "add", ns)
            self.made.append(f"netns:{ns}")
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", outside, "master", bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/{self.subnet.prefixlen}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def cut(self, host: str) -> None:
        """The host's link down: it runs on, and nothing reaches it or leaves it."""
        _run("ip", "link", "set", self._veth(host), "down")

    def mend(self, host: str) -> None:
        _run("ip", "link", "set", self._veth(host), "up")

    def tear_down(self) -> None:
        for what in reversed(self.made):
            kind, name = what.split(":", 1)
            subprocess.run(["ip", "netns", "delete", name] if kind == "netns" else ["ip", "link", "delete", name],
                           capture_output=True)
        self.made.clear()


@dataclass
class Fleet:
    net: Network
    root: Path
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # process -> its environment
    children: dict[str, procs.Child] = field(default_factory=dict)
    ran: dict[str, list[str]] = field(default_factory=dict)  # host -> the command lines it ran
    placed: dict[str, str] = field(default_factory=dict)  # Ballast process -> its host
    owner_url: str = ""
    api_key: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def dir(self, host: str) -> Path:
        d = self.root / host
        d.mkdir(parents=True, exist_ok=True)
        return d

    def tmp(self, host: str) -> Path:
        # Short: vLLM's processes meet on Unix sockets here, whose paths fit in 107 bytes.
        d = Path("/tmp") / f"{self.net.tag}-{host}"
        d.mkdir(exist_ok=True)
        return d

    def base_env(self, host: str) -> dict[str, str]:
        """What every host is handed besides its role's settings: a PATH, its own home and
        temporary directory."""
        return dict(PATH=f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    HOME=str(self.dir(host)), TMPDIR=str(self.tmp(host)), PYTHONUNBUFFERED="1", LANG="C.UTF-8")

    def spawn(self, name: str, host: str, argv: list[str], env: Mapping[str, str]) -> procs.Child:
        child = procs.spawn(f"{name} on {host}", ["ip", "netns", "exec", self.net.ns(host), *argv], env=env,
                            log_path=self.dir(host) / f"{name}.log")
        self.children[name] = child
        self.ran.setdefault(host, []).append(" ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv)))
        return child

    def stop(self) -> None:
        # The API hosts first (no new work), then the rest, each by its process group.
        for name in sorted(self.children, key=lambda n: (not n.startswith("api"), n)):
            with contextlib.suppress(Exception):
                self.children[name].stop(30)
        for host in ADDRESSES:
            shutil.rmtree(Path("/tmp") / f"{self.net.tag}-{host}", ignore_errors=True)

    def check_alive(self) -> None:
        """Raises, with its log's tail, if a host's process has exited."""
        for name, child in self.children.items():
            if not child.alive:
                raise RuntimeError(f"{name} exited ({child.proc.returncode}):\n{child.log_tail()}")


def _ballast(*args: str) -> list[str]:
    return [sys.executable, "-m", "ballast.cli", *args]


def _wait_http(url: str, timeout: float, what: str, child: procs.Child, fleet: Fleet | None = None) -> None:
    def up() -> bool:
        if fleet is not None:
            fleet.check_alive()  # a host that died will not become healthy: say so now
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    procs.wait_until(up, timeout, what, child=child, interval=0.5)


def start(fleet: Fleet, settings: Settings, *, say=print) -> None:
    """Every host of the fleet up and healthy (fleet_up stops them)."""
    from engine.tiny import build_tiny_model

    net = fleet.net
    net.build()
    t0 = time.monotonic()

    # Infrastructure hosts: Postgres, Temporal behind TLS, the object store.
    pg = fleet.spawn("postgres", "pg", [sys.executable, "-m", "bench.hosts", "postgres", str(fleet.dir("pg")),
                                        net.addr("pg"), str(net.subnet)], fleet.base_env("pg"))
    pki = make_pki(fleet.dir("temporal") / "pki", server_ips=[net.addr("temporal")])
    temporal = fleet.spawn("temporal", "temporal", [temporal_cli(), "server", "start-dev", "--ip", "127.0.0.1",
                                                    "--port", "7234", "--headless", "--log-level", "warn",
                                                    "--db-filename", str(fleet.dir("temporal") / "temporal.db")],
                           fleet.base_env("temporal"))
    conf = haproxy_conf(pki, fleet.dir("temporal"), accept=f"{net.addr('temporal')}:{TEMPORAL_PORT}",
                        connect="127.0.0.1:7234")
    fleet.spawn("haproxy", "temporal", [haproxy(), "-db", "-f", str(conf)], fleet.base_env("temporal"))
    s3_key, s3_secret = "ballast", secrets.token_urlsafe(16)
    s3 = fleet.spawn("s3", "s3", [sys.executable, "-m", "moto.server", "-H", net.addr("s3"), "-p", str(S3_PORT)],
                     fleet.base_env("s3"))
    _wait_http(f"http://{net.addr('s3')}:{S3_PORT}/moto-api/", 60, "the S3 host", s3)
    _s3_bucket(f"http://{net.addr('s3')}:{S3_PORT}", s3_key, s3_secret)
    procs.wait_until(lambda: (fleet.dir("pg") / "pg.port").exists(), 90, "the Postgres host", child=pg)
    procs.wait_until(lambda: _temporal_answers(f"{net.addr('temporal')}:{TEMPORAL_PORT}", pki), 90,
                     "the Temporal host, through TLS", child=temporal)
    password = (fleet.dir("pg") / "postgres-password").read_text().strip()
    fleet.owner_url = f"postgresql://postgres:{password}@{net.addr('pg')}:{PG_PORT}/postgres"
    with psycopg.connect(fleet.owner_url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE ballast")
    fleet.owner_url = fleet.owner_url.rsplit("/", 1)[0] + "/ballast"
    fleet.timings["infrastructure_s"] = time.monotonic() - t0
    say(f"infrastructure up in {fleet.timings['infrastructure_s']:.1f} s")

    # What every Ballast process shares: the meeting places and the model. Each host has
    # its own copy of the model (the tiny one, built the same everywhere); only its
    # settings name it.
    passwords = {kind: secrets.token_urlsafe(16) for kind in SERVICE_ROLES}
    token = secrets.token_urlsafe(24)
    shared = dict(BALLAST_TEMPORAL_ADDRESS=f"{net.addr('temporal')}:{TEMPORAL_PORT}",
                  BALLAST_TEMPORAL_NAMESPACE="default", BALLAST_CONTROL_QUEUE=settings.control_queue,
                  BALLAST_ENGINE_QUEUE=settings.engine_queue,
                  BALLAST_OBJECT_STORE=f"s3://{BUCKET}/objects",
                  BALLAST_MAX_MODEL_LEN=str(settings.max_model_len),
                  BALLAST_SERVED_MODEL_NAME=settings.model_name,
                  AWS_ENDPOINT_URL_S3=f"http://{net.addr('s3')}:{S3_PORT}", AWS_ACCESS_KEY_ID=s3_key,
                  AWS_SECRET_ACCESS_KEY=s3_secret, AWS_DEFAULT_REGION="us-east-1")

    def env_for(process: str, host: str, **own: str) -> dict[str, str]:
        d = fleet.dir(host)
        model = build_tiny_model(d / "models", settings.max_model_len)
        tls = d / "pki"
        tls.mkdir(exist_ok=True)
        for f in (pki.ca_cert, pki.client_cert, pki.client_key):
            shutil.copy(f, tls / f.name)
        env = fleet.base_env(host) | shared | dict(
            BALLAST_DATA_DIR=str(d / "data"), BALLAST_MODEL=str(model),
            TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(tls / pki.ca_cert.name),
            TEMPORAL_TLS_CLIENT_CERT_PATH=str(tls / pki.client_cert.name),
            TEMPORAL_TLS_CLIENT_KEY_PATH=str(tls / pki.client_key.name)) | own
        fleet.envs[process] = env
        return env

    env_for("migrate", "control", BALLAST_DATABASE_URL=fleet.owner_url,
            **{f"BALLAST_{kind.upper()}_DATABASE_PASSWORD": pw for kind, pw in passwords.items()})

    def login(kind: str) -> dict[str, str]:
        """Service `kind`'s own role's URL, and nothing of another's."""
        url = as_role(fleet.owner_url, SERVICE_ROLES[kind], passwords[kind])
        return dict(BALLAST_DATABASE_URL=url, BALLAST_SERVICE_DATABASE_URL=url)

    hosts = fleet.placed
    metrics = dict(BALLAST_METRICS_TOKEN=secrets.token_urlsafe(32))  # what a Prometheus would present
    hosts.update(control="control", migrate="control")
    for n in (1, 2):
        host = hosts[f"engine-{n}"] = f"engine{n}"
        env_for(f"engine-{n}", host, **login("engine"), **metrics, BALLAST_ENGINE_TOKEN=token,
                BALLAST_ENGINE_HOST=net.addr(host),
                BALLAST_ENGINE_PORT=str(ENGINE_PORT), BALLAST_ENGINE_URL=f"http://{net.addr(host)}:{ENGINE_PORT}",
                BALLAST_KV_CACHE_GIB="0.5", BALLAST_MAX_NUM_SEQS=str(settings.max_num_seqs))
    env_for("control", "control", **login("control"), **metrics, BALLAST_CONTROL_HOST=net.addr("control"),
            BALLAST_CONTROL_PORT=str(CONTROL_PORT))
    for n in (1, 2):
        host = hosts[f"api-{n}"] = f"api{n}"
        env_for(f"api-{n}", host, **login("api"), **metrics, BALLAST_ENGINE_TOKEN=token,
                BALLAST_API_HOST=net.addr(host),
                BALLAST_API_PORT=str(API_PORT))
    # The deployment contract, as docker-compose and the Helm chart are held to it, and
    # nothing that would let one host reach another but through the network.
    if wrong := topology.problems(fleet.envs, exact_model=False) + crossings(fleet, hosts):
        raise RuntimeError("the hosts' environments break the deployment contract:\n" + "\n".join(wrong))

    done = subprocess.run(["ip", "netns", "exec", net.ns("control"), *_ballast("migrate")], env=fleet.envs["migrate"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ballast migrate on the control host failed:\n{done.stdout}{done.stderr}")
    for process, host in hosts.items():
        if process == "migrate":
            continue
        command = topology.PROCESSES[topology.kind(process) or process].command
        fleet.spawn(host, host, _ballast(*command), fleet.envs[process])
    for n in (1, 2):
        host = f"api{n}"
        _wait_http(f"http://{net.addr(host)}:{API_PORT}/healthz", 600, f"the {host} host", fleet.children[host], fleet)
    fleet.timings["healthy_s"] = time.monotonic() - t0
    say(f"every host healthy {fleet.timings['healthy_s']:.1f} s after the first started")


def crossings(fleet: Fleet, hosts: Mapping[str, str]) -> list[str]:
    """What in a process's environment names a loopback address or another host's files."""
    found = []
    for process, env in fleet.envs.items():
        own = fleet.dir(hosts[process])
        for key, value in env.items():
            if "127.0.0.1" in value or "localhost" in value:
                found.append(f"{process}: {key} names a loopback address ({value})")
            for other in (fleet.dir(h) for h in ADDRESSES):
                if other != own and str(other) in value:
                    found.append(f"{process}: {key} names another host's files ({value})")
    return found


def _temporal_answers(address: str, pki: Pki) -> bool:
    """Whether Temporal answers a client holding the fleet's certificates."""
    import asyncio

    from temporalio.client import Client, TLSConfig

    tls = TLSConfig(server_root_ca_cert=pki.ca_cert.read_bytes(), client_cert=pki.client_cert.read_bytes(),
                    client_private_key=pki.client_key.read_bytes())
    try:
        asyncio.run(asyncio.wait_for(Client.connect(address, tls=tls), 5))
    except Exception:
        return False
    return True


def _s3_bucket(endpoint: str, key: str, secret: str) -> None:
    import fsspec

    fsspec.filesystem("s3", endpoint_url=endpoint, key=key, secret=secret).mkdir(BUCKET)


def _postgres_host(data_dir: str, address: str, clients: str) -> None:
    """The Postgres host's one process: the embedded server on the host's own address."""
    import signal

    from ballast.pg import EmbeddedPostgres

    server = EmbeddedPostgres(Path(data_dir), port=PG_PORT, host=address, clients=clients).start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop()


@contextlib.contextmanager
def fleet_up(root: Path, settings: Settings, say=print) -> Iterator[Fleet]:
    fleet = Fleet(Network.free(), root)
    try:
        start(fleet, settings, say=say)
        yield fleet
    finally:
        fleet.stop()
        fleet.net.tear_down()


def main(settings: Settings, *, items: int = 24, chats: int = 8) -> int:
    root = Path(settings.data_dir) / "hosts"
    shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {}
    with fleet_up(root, settings) as fleet:
        report = run(fleet, items=items, chats=chats)
    print(json.dumps(report, indent=2))
    return 0 if report.get("ok") else 1


def _on(fleet: Fleet, host: str, process: str, *args: str) -> str:
    """A one-shot `ballast` command on `host`, with `process`'s environment (an operator's)."""
    done = subprocess.run(["ip", "netns", "exec", fleet.net.ns(host), *_ballast(*args)], env=fleet.envs[process],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"ballast {' '.join(args)} on {host}: {done.stdout}{done.stderr}")
    return done.stdout


def _sql(fleet: Fleet, query: str, *params: Any) -> list[tuple]:
    with psycopg.connect(libpq_url(fleet.owner_url)) as conn:
        return conn.execute(query, params).fetchall()


def run(fleet: Fleet, *, items: int, chats: int, max_tokens: int = 160, say=print) -> dict[str, Any]:
    """The client's session against the fleet, and what the journal says of it."""
    from openai import OpenAI

    for chatty in ("httpx", "httpx2", "openai"):  # one line per poll otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)
    net = fleet.net
    key = _on(fleet, "control", "migrate", "tenants", "create", "acme").strip().splitlines()[-1]
    clients = {h: OpenAI(base_url=f"http://{net.addr(h)}:{API_PORT}/v1", api_key=key, max_retries=0, timeout=300)
               for h in ("api1", "api2")}
    model = fleet.envs["api-1"]["BALLAST_SERVED_MODEL_NAME"]
    out: dict[str, Any] = dict(timings=fleet.timings, hosts=fleet.ran)

    # 1. Chats through both API hosts.
    answered = 0
    for i in range(chats):
        host = ("api1", "api2")[i % 2]
        got = clients[host].chat.completions.create(model=model, max_tokens=16, temperature=0,
                                                    messages=[{"role": "user", "content": f"hello {i}"}])
        answered += bool(got.choices[0].message.content) and got.usage is not None
    out["chats"] = dict(sent=chats, answered=answered)
    say(f"chats: {answered}/{chats} answered through api1 and api2")

    # 2. A fine-tune through api2; its model answers through api1 (adapter via the object store).
    t = time.monotonic()
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
             for i in range(12)]
    training = clients["api2"].files.create(file=("train.jsonl", "\n".join(lines).encode()), purpose="fine-tune")
    job = clients["api2"].fine_tuning.jobs.create(model=model, training_file=training.id,
                                                  hyperparameters={"n_epochs": 1})
    while job.status not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() - t > 600:
            raise TimeoutError(f"fine-tune {job.id} still {job.status} after 600 s")
        time.sleep(2)
        job = clients["api2"].fine_tuning.jobs.retrieve(job.id)
    tuned = None
    if job.status == "succeeded" and job.fine_tuned_model:
        tuned = clients["api1"].chat.completions.create(model=job.fine_tuned_model, max_tokens=8, temperature=0,
                                                        messages=[{"role": "user", "content": "q1"}])
    out["fine_tune"] = dict(status=job.status, seconds=round(time.monotonic() - t, 1),
                            error=job.error.message if job.error else None,
                            fine_tuned_model_answered=bool(tuned and tuned.choices[0].message.content))
    say(f"fine-tune: {job.status} in {out['fine_tune']['seconds']} s; its model answered through api1: "
        f"{out['fine_tune']['fine_tuned_model_answered']}")

    # 3. A batch through api1, one engine host cut mid-batch, read back through api2.
    sent = {f"item-{i}": f"tell me about {i} " * 4 for i in range(items)}
    body = "\n".join(json.dumps(dict(custom_id=cid, method="POST", url="/v1/chat/completions", body=dict(
        # ignore_eos: every item generates its whole max_tokens (an early EOS could end the
        # batch before any engine host had announced holding a generation to cut).
        model=model, max_tokens=max_tokens, temperature=0, ignore_eos=True,
        messages=[{"role": "user", "content": text}])))
        for cid, text in sent.items())
    upload = clients["api1"].files.create(file=("batch.jsonl", body.encode()), purpose="batch")
    batch = clients["api1"].batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
    t = time.monotonic()
    cut_at, cut = None, None
    while True:
        batch = clients["api2"].batches.retrieve(batch.id)
        # The batch's prompts share a prefix, so placement may keep it on one engine host:
        # cut whichever holds its generations.
        busy = sorted(h for h, n in _batch_slots(fleet).items() if n > 0 and h.startswith("engine"))
        if cut_at is None and busy:
            done_then = batch.request_counts.completed if batch.request_counts else 0
            cut = busy[0]
            fleet.net.cut(cut)
            cut_at = time.monotonic() - t
            say(f"{cut}'s link cut {cut_at:.1f} s into the batch ({done_then}/{items} items done)")
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        if time.monotonic() - t > 900:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after 900 s")
        time.sleep(1 if cut_at is not None else 0.2)  # engines announce every second: watch closely until the cut
    took = time.monotonic() - t
    texts: dict[str, int] = {}
    if batch.output_file_id:
        for line in clients["api2"].files.content(batch.output_file_id).text.splitlines():
            row = json.loads(line)
            texts[row["custom_id"]] = texts.get(row["custom_id"], 0) + 1
    results = _sql(fleet, "SELECT stream, count(*) FROM events WHERE type IN ('item_completed', 'item_failed') "
                          "AND stream LIKE %s GROUP BY stream", f"%{batch.id}%")
    out["batch"] = dict(
        status=batch.status, items=items, seconds=round(took, 1), cut=cut, cut_after_s=cut_at and round(cut_at, 1),
        output_lines=sum(texts.values()), custom_ids_once=sorted(texts) == sorted(sent) and set(texts.values()) == {1},
        journal_results=len(results), journal_results_once=all(n == 1 for _, n in results))
    say(f"batch: {batch.status} in {took:.1f} s; {sum(texts.values())} output lines for {items} items")

    # 4. The journal's own invariants, as an auditor runs them.
    verify = subprocess.run(["ip", "netns", "exec", net.ns("control"), *_ballast("verify")],
                            env=fleet.envs["migrate"], capture_output=True, text=True, timeout=300)
    out["verify"] = dict(exit=verify.returncode, tail=verify.stdout.strip().splitlines()[-3:])
    b = out["batch"]
    out["ok"] = bool(answered == chats and job.status == "succeeded" and out["fine_tune"]["fine_tuned_model_answered"]
                     and b["status"] == "completed" and b["custom_ids_once"] and b["journal_results"] == items
                     and b["journal_results_once"] and cut_at is not None and verify.returncode == 0)
    return out


def _batch_slots(fleet: Fleet) -> dict[str, int]:
    """Batch generations each engine host holds, as it last announced them in the journal."""
    hosts = {f"http://{fleet.net.addr(h)}:{ENGINE_PORT}": h for h in ADDRESSES if h.startswith("engine")}
    rows = _sql(fleet, "SELECT url, coalesce((stats->>'batch')::int, 0) FROM engines")
    return {hosts.get(url, url): n for url, n in rows}


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "postgres":
    _postgres_host(*sys.argv[2:5])
