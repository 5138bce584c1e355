"""`ballast bench cells` (root): three regions as cells on this machine, a global daily
limit reconciled between them, and one region lost and back.

Each cell is a host of its own (a network namespace, its own address on a bridge): its own
Postgres on that address, and `ballast up` with it (its own Temporal dev server, engine
worker, control worker and API). In the root namespace, as a global control plane would be:
an HAProxy edge whose backend has a server per cell (health-checked), `ballast cells
reconcile` (the real command) reaching each cell's Postgres through a relay that delays
every packet by that region's one-way latency (this kernel has no netem: the relay holds
each chunk for the delay, in both directions), and the client. One tenant's key is in
every cell, with a global `tokens_per_day` in the cells file and no limit of its own in
any cell.

The run: chats through the edge at a steady rate; a batch (another tenant, whose key one
cell holds) uploaded and made through the edge, which sends it to that cell, the key's
home; that cell's link cut (`ip link set … down`: it runs on, unreachable) and mended;
the load goes on until the global limit is spent. Judged from the outside: what the client
sent and got (status, which cell answered: the edge's header), and each cell's ledger and
batch read back in SQL. Figures: overshoot against the bound (docs/quotas-and-audit.md),
how long the edge took to move traffic off the lost cell, how long the reconciler took to
count it out and back in, and the batch's items, each exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from ballast import procs
from bench.hosts import PG_PORT, Network, _ballast, _wait_http
from bench.tls import haproxy
from config import Settings
from policy.admission import staleness_s
from policy.allowances import overshoot_bound

CELLS = dict(eu=11, us=12, ap=13)  # the hosts' last octets
DELAY_MS = dict(eu=5.0, us=40.0, ap=90.0)  # one way, between the control plane and each region
API_PORT = 8000
LOST = "ap"
FENCE = ("ap", "us")  # a fenced tenant's regions: the lost one and another


@dataclass
class Cell:
    name: str
    addr: str
    dir: Path
    owner_url: str = ""
    api: str = ""
    relay_port: int = 0
    children: list[procs.Child] = field(default_factory=list)


# -- the latency between regions: a relay that holds each chunk for the delay ------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                break
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                queue.put_nowait((loop.time() + delay_s, data))
        queue.put_nowait((loop.time() + delay_s, b""))
        with contextlib.suppress(OSError):
            await sender
    finally:
        sender.cancel()
        writer.close()


class Relays:
    """127.0.0.1:port → a cell's Postgres, each way delayed, on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="relays")
        self.thread.start()

    def add(self, target: tuple[str, int], delay_s: float) -> int:
        port = procs.free_port()

        async def serve() -> None:
            async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                try:
                    r2, w2 = await asyncio.wait_for(asyncio.open_connection(*target), 3)
                    await asyncio.gather(_pipe(r, w2, delay_s), _pipe(r2, w, delay_s))
                except (OSError, TimeoutError, asyncio.CancelledError):
                    w.close()

            await asyncio.start_server(handle, "127.0.0.1", port)

        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        return port

    def close(self) -> None:
        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# -- the cells ----------------------------------------------------------------------------------


def _base_env(cell: Cell) -> dict[str, str]:
    tmp = Path("/tmp") / f"cell-{cell.name}-{cell.dir.parent.name[-6:]}"  # short: vLLM's sockets live here
    tmp.mkdir(exist_ok=True)
    return dict(PATH=f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                HOME=str(cell.dir), TMPDIR=str(tmp), PYTHONUNBUFFERED="1", LANG="C.UTF-8")


def _start_cell(net: Network, cell: Cell, settings: Settings, *, again: bool = False) -> None:
    """The cell's Postgres, then `ballast up` on it; `again`: on what a lost cell left on disk."""
    from engine.tiny import build_tiny_model

    ns = net.ns(cell.name)
    (cell.dir / "pg" / "pg.port").unlink(missing_ok=True)
    pg = procs.spawn(f"postgres on {cell.name}", ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.hosts",
                                                 "postgres", str(cell.dir / "pg"), cell.addr, str(net.subnet)],
                     env=_base_env(cell), log_path=cell.dir / "postgres.log")
    cell.children.append(pg)
    procs.wait_until(lambda: (cell.dir / "pg" / "pg.port").exists(), 120, f"{cell.name}'s Postgres", child=pg)
    password = (cell.dir / "pg" / "postgres-password").read_text().strip()
    admin = f"postgresql://postgres:{password}@{cell.addr}:{PG_PORT}/postgres"
    if not again:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE DATABASE ballast")
    cell.owner_url = admin.rsplit("/", 1)[0] + "/ballast"
    model = build_tiny_model(cell.dir / "models", settings.max_model_len)
    env = _base_env(cell) | dict(
        BALLAST_DATA_DIR=str(cell.dir / "data"), DATABASE_URL=cell.owner_url, BALLAST_API_HOST=cell.addr,
        BALLAST_API_PORT=str(API_PORT), BALLAST_REGION=cell.name, BALLAST_MODEL=str(model),
        BALLAST_SERVED_MODEL_NAME=settings.model_name, BALLAST_MAX_MODEL_LEN=str(settings.max_model_len),
        BALLAST_ENGINES="1", BALLAST_KV_CACHE_GIB="0.5", BALLAST_MAX_NUM_SEQS=str(settings.max_num_seqs))
    up = procs.spawn(f"ballast up on {cell.name}", ["ip", "netns", "exec", ns, *_ballast("up")], env=env,
                     log_path=cell.dir / "up.log")
    cell.children.append(up)
    cell.api = f"http://{cell.addr}:{API_PORT}"


def _crash(net: Network, cell: Cell) -> int:
    """Every process of the cell killed at once (SIGKILL: nothing flushed, nothing said), as
    when a region's hosts go dark: the ones in its network namespace, all this run's own."""
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", net.ns(cell.name)], capture_output=True,
                                           text=True, check=True).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for child in cell.children:
        child.stop(10)  # reaps them
    cell.children.clear()
    return len(pids)


def _owner(cell: Cell, query: str, *params: Any) -> list[tuple]:
    with psycopg.connect(cell.owner_url, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def edge_config(directory: Path, port: int, servers: Mapping[str, str], *, check: bool = True) -> Path:
    """The edge as docs/deployment.md has it, in `directory` (its runtime socket `admin.sock`,
    its fences map `fences.map` and homes map `homes.map`, empty): a backend of every cell (`servers`: cell → its API's
    host:port), one of each cell alone, an empty one, and the lookup of the request's key's
    SHA-256 in the map; `check`: health-checked, a dead cell's sessions ended."""
    health = " check inter 500 fall 2 rise 2 on-marked-down shutdown-sessions" if check else ""
    probe = "  option httpchk GET /healthz\n" if check else ""
    named = "  http-response set-header x-ballast-cell %[srv_name]\n"
    every = "".join(f"  server {c} {a}{health} weight 100\n" for c, a in servers.items())
    own = "".join(f"backend cells_{c}\n{probe}{named}  server {c} {a}{health}\n" for c, a in servers.items())
    fences, homes = directory / "fences.map", directory / "homes.map"
    fences.write_text("")
    homes.write_text("")
    conf = directory / "edge.cfg"
    conf.write_text(f"""global
  stats socket {directory / 'admin.sock'} level admin
defaults
  mode http
  timeout connect 1s
  timeout client 120s
  timeout server 120s
  timeout check 1s
  retries 2
  option redispatch
frontend edge
  bind 127.0.0.1:{port}
  http-request set-var(txn.key) req.hdr(authorization),word(2,' '),digest(sha256),hex,lower
  use_backend %[var(txn.key),map({fences})] if {{ var(txn.key),map({fences}) -m found }}
  acl stateful path_beg /v1/files /v1/batches /v1/fine_tuning
  use_backend %[var(txn.key),map({homes})] if stateful {{ var(txn.key),map({homes}) -m found }}
  default_backend cells
backend cells
  balance roundrobin
{probe}{named}{every}{own}backend cells_none
""")
    return conf


def _stat(sock: Path) -> dict[str, list[str]]:
    """HAProxy's `show stat` for the servers of backend `cells`, by name."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    rows = [line.split(",") for line in raw.decode().splitlines() if line and not line.startswith("#")]
    return {r[1]: r for r in rows if r[0] == "cells" and r[1] not in ("BACKEND", "FRONTEND")}


def _map(sock: Path, path: Path) -> dict[str, str]:
    """An HAProxy map as it holds it now (`show map`): key → value."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(f"show map {path}\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    return {p[1]: p[2] for p in (line.split() for line in raw.decode().splitlines()) if len(p) == 3}


def _server_states(sock: Path) -> dict[str, str]:
    return {name: row[17] for name, row in _stat(sock).items()}  # status: UP, DOWN, …


def _server_weights(sock: Path) -> dict[str, int]:
    return {name: int(row[18]) for name, row in _stat(sock).items()}  # weight


@contextlib.contextmanager
def cells_up(root: Path, settings: Settings, say=print) -> Iterator[tuple[Network, dict[str, Cell]]]:
    net = Network.free(CELLS)
    cells = {n: Cell(n, net.addr(n), root / n) for n in CELLS}
    try:
        net.build()
        t0 = time.monotonic()
        for c in cells.values():
            c.dir.mkdir(parents=True, exist_ok=True)
            _start_cell(net, c, settings)
        for c in cells.values():
            _wait_http(f"{c.api}/healthz", 600, f"the {c.name} cell", c.children[-1])
        say(f"three cells healthy in {time.monotonic() - t0:.0f} s")
        yield net, cells
    finally:
        for c in cells.values():
            for child in reversed(c.children):
                with contextlib.suppress(Exception):
                    child.stop(60)
            shutil.rmtree(Path("/tmp") / f"cell-{c.name}-{c.dir.parent.name[-6:]}", ignore_errors=True)
        net.tear_down()


# -- the run ----------------------------------------------------------------------------------------


def _share_tenant(cells: dict[str, Cell], tenant: str, regions: Sequence[str] | None = None) -> str:
    """The tenant in every cell with one key (its hash copied: a key is a global identity),
    fenced to `regions` where given."""
    from journal.tenant_store import KEY_PREFIX, SHOWN, hash_key

    key = KEY_PREFIX + secrets.token_urlsafe(32)
    for c in cells.values():
        _owner(c, "INSERT INTO tenants (id, regions) VALUES (%s, %s)", tenant,
               None if regions is None else list(regions))
        _owner(c, "INSERT INTO api_keys (id, tenant, hash, prefix, name) VALUES (%s, %s, %s, %s, 'bench')",
               "key_" + secrets.token_hex(12), tenant, hash_key(key), key[:SHOWN])
    return key


def _cells_login(cells: dict[str, Cell]) -> dict[str, str]:
    urls = {}
    for c in cells.values():
        password = secrets.token_urlsafe(16)
        _owner(c, f"CREATE ROLE cells LOGIN PASSWORD '{password}' IN ROLE ballast_cells")
        urls[c.name] = password
    return urls


def _usage(cell: Cell, tenant: str) -> int:
    """What the cell's ledger counts against the tenant's day: settled, and open reservations as reserved."""
    rows = _owner(cell, """
        SELECT coalesce(sum(CASE WHEN s.subject IS NOT NULL THEN s.input_tokens + s.output_tokens
                                 WHEN c.subject IS NOT NULL THEN 0
                                 ELSE r.input_tokens + r.output_tokens END), 0)
          FROM ledger r
          LEFT JOIN ledger s ON s.subject = r.subject AND s.kind = 'settle'
          LEFT JOIN ledger c ON c.subject = r.subject AND c.kind IN ('refund', 'expire')
         WHERE r.tenant = %s AND r.kind = 'reserve' AND r.at >= date_trunc('day', now() AT TIME ZONE 'UTC')
                                                                 AT TIME ZONE 'UTC'""", tenant)
    return int(rows[0][0])


def run(net: Network, cells: dict[str, Cell], settings: Settings, *, seconds: float, rate: float,
        lose: str = "crash", say=print) -> dict[str, Any]:
    tenant = "globex"
    key = _share_tenant(cells, tenant)
    fenced_key = _share_tenant(cells, "zeta", FENCE)
    passwords = _cells_login(cells)
    work = cells[LOST].dir.parent
    relays = Relays()
    env = {"PATH": _base_env(cells[LOST])["PATH"], "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}
    for c in cells.values():
        c.relay_port = relays.add((c.addr, PG_PORT), DELAY_MS[c.name] / 1000)
        env[f"CELL_{c.name.upper()}_URL"] = f"postgresql://cells:{passwords[c.name]}@127.0.0.1:{c.relay_port}/ballast"
    edge_port = procs.free_port()
    edge_dir = work / "edge"
    edge_dir.mkdir(exist_ok=True)
    edge = procs.spawn("edge haproxy", [haproxy(), "-db", "-f", str(edge_config(
        edge_dir, edge_port, {c.name: f"{c.addr}:{API_PORT}" for c in cells.values()}))],
                       env=env, log_path=edge_dir / "haproxy.log")
    sock = edge_dir / "admin.sock"
    procs.wait_until(lambda: sock.exists(), 30, "the edge's runtime socket", child=edge)
    # A limit the run's demand passes within its time: rate × ~(prompt + answer) tokens.
    limit = int(rate * seconds * 0.6 * 60)
    tick_s, settle_s, timeout_s = 2.0, 1.5, 5.0
    (work / "cells.toml").write_text(
        f"tick_s = {tick_s}\nsettle_s = {settle_s}\ntimeout_s = {timeout_s}\n"
        f'[edge]\nhaproxy_socket = "{sock}"\nbackend = "cells"\nfences_map = "{edge_dir / "fences.map"}"\n'
        f'homes_map = "{edge_dir / "homes.map"}"\n'
        + "".join(f'[[cell]]\nname = "{c}"\ndatabase_url_env = "CELL_{c.upper()}_URL"\n' for c in cells)
        + f'[[limit]]\ntenant = "{tenant}"\ntokens_per_day = {limit}\n')
    reconciler = procs.spawn("ballast cells reconcile", [*_ballast("cells", "reconcile", "--file",
                                                                   str(work / "cells.toml"))],
                             env=env, log_path=work / "reconcile.log")
    out: dict[str, Any] = dict(limit=limit, delay_ms=DELAY_MS, rate=rate, seconds=seconds, lose=lose)
    try:
        procs.wait_until(lambda: all(_owner(c, "SELECT count(*) FROM allowances")[0][0] > 0 for c in cells.values()),
                         60, "every cell's first allowance", child=reconciler)
        out |= _drive(net, cells, settings, key, fenced_key, edge_port, sock, seconds=seconds, rate=rate, lose=lose,
                      say=say)
        time.sleep(3 * tick_s + settle_s)
        # The audit across cells, as an operator runs it, against each cell's ledger read here.
        audit = subprocess.run([*_ballast("cells", "usage", "--file", str(work / "cells.toml"), "--json", "--tenant",
                                          tenant, "--days", "1")], env=env, capture_output=True, text=True, timeout=60)
        rows = [json.loads(line) for line in audit.stdout.splitlines()]
        settled = sum(int(_owner(c, "SELECT coalesce(sum(input_tokens + output_tokens), 0) FROM ledger "
                                    "WHERE tenant = %s AND kind = 'settle'", tenant)[0][0]) for c in cells.values())
        across = sum(r["input_tokens"] + r["output_tokens"] for r in rows if r["cell"] == "*")
        out["audit"] = dict(exit=audit.returncode, all_cells_tokens=across, ledgers_settled=settled,
                            agree=audit.returncode == 0 and across == settled)
    finally:
        reconciler.stop(10)
        edge.stop(10)
        relays.close()
    ticks = [json.loads(line.split("cells: tick ", 1)[1]) for line in (work / "reconcile.log").read_text().splitlines()
             if "cells: tick {" in line]
    used = {c.name: _usage(c, tenant) for c in cells.values()}
    peak = out.pop("peak_tokens_per_s")
    lag = staleness_s(settings.admission_flush_s, settings.admission_refresh_s)
    bound = max((overshoot_bound([(limit, peak.get(c, 0.0)) for c in t["read_to_commit_s"]],
                                 lag + max(t["read_to_commit_s"].values(), default=0.0)) for t in ticks), default=0)
    cut, mend = out["cut_at"], out["mended_at"]
    out_ticks = [t for t in ticks if LOST in t["unreachable"]]
    out["reconciler"] = dict(
        ticks=len(ticks), took_s_p50=sorted(t["took_s"] for t in ticks)[len(ticks) // 2],
        read_to_commit_s_max=max((s for t in ticks for s in t["read_to_commit_s"].values()), default=0.0),
        counted_out_after_s=round(out_ticks[0]["at"] - cut, 2) if out_ticks else None,
        counted_back_after_s=round(min((t["at"] for t in ticks if t["at"] > mend and LOST not in t["unreachable"]),
                                       default=math.nan) - mend, 2),
        lost_cell_held=sorted({t["allowances"][f"{tenant}/*"][LOST] for t in out_ticks}),
        weights_while_out=out_ticks[-1]["weights"] if out_ticks else None)
    out["quota"] = dict(used=used, total=sum(used.values()), limit=limit, overshoot=sum(used.values()) - limit,
                        bound=bound, within=sum(used.values()) - limit <= bound)
    say(f"quota: {sum(used.values())} of {limit} used ({used}); overshoot {sum(used.values()) - limit}, "
        f"bound {bound}")
    b = out["batch"]
    out["ok"] = bool(out["quota"]["within"] and b["status"] == "completed" and b["once"] and out["audit"]["agree"]
                     and b["made_at"] == [LOST, LOST]
                     and out["fenced"]["outside_fence"] == 0 and out["fenced"]["ok"] > 0
                     and out["edge"]["failed_after_down"] == 0 and out["quota"]["total"] >= 0.9 * limit)
    return out


def _drive(net: Network, cells: dict[str, Cell], settings: Settings, key: str, fenced_key: str, edge_port: int,
           sock: Path, *, seconds: float, rate: float, lose: str, say=print) -> dict[str, Any]:
    from openai import OpenAI

    lost = cells[LOST]
    model = settings.model_name
    # A batch through the edge, from the lost cell's own `default` tenant (ballast up's key,
    # which only that cell holds): its home is that cell, once the reconciler has put the
    # key in the edge's homes map.
    own_key = (lost.dir / "data" / "api-key").read_text().strip()
    own_hash = hashlib.sha256(own_key.encode()).hexdigest()  # as the edge hashes it
    procs.wait_until(lambda: own_hash in _map(sock, sock.parent / "homes.map"), 30, "the key's home at the edge")
    own = OpenAI(base_url=f"http://127.0.0.1:{edge_port}/v1", api_key=own_key, max_retries=3, timeout=60)
    items = 96  # enough that the cell is lost mid-batch
    body = "\n".join(json.dumps(dict(custom_id=f"item-{i}", method="POST", url="/v1/chat/completions", body=dict(
        model=model, max_tokens=256, temperature=0, ignore_eos=True,
        messages=[{"role": "user", "content": f"count to {i}"}]))) for i in range(items))
    made = own.files.with_raw_response.create(file=("batch.jsonl", body.encode()), purpose="batch")
    upload = made.parse()
    made_at = [made.headers.get("x-ballast-cell")]
    made_batch = own.batches.with_raw_response.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h")
    batch = made_batch.parse()
    made_at.append(made_batch.headers.get("x-ballast-cell"))

    records: list[dict[str, Any]] = []
    fenced: list[dict[str, Any]] = []  # the fenced tenant's, at a chat a second
    lock = threading.Lock()
    client = httpx.Client(base_url=f"http://127.0.0.1:{edge_port}/v1", timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    fenced_client = httpx.Client(base_url=f"http://127.0.0.1:{edge_port}/v1", timeout=60,
                                 headers={"Authorization": f"Bearer {fenced_key}"})

    def one(i: int, client: httpx.Client = client, records: list[dict[str, Any]] = records) -> None:
        """A chat as the official client sends one: tried again (up to twice, 0.5 s apart) on
        a broken connection or a 502/503/504, the edge picking a cell anew each time."""
        sent = time.time()
        row: dict[str, Any] = dict(sent=sent, attempts=0)
        while True:
            row["attempts"] += 1
            try:
                r = client.post("/chat/completions", json=dict(model=model, max_tokens=24, temperature=0, messages=[
                    {"role": "user", "content": f"say something about the number {i}"}]))
                row.update(status=r.status_code, cell=r.headers.get("x-ballast-cell"))
                if r.status_code == 200:
                    u = r.json()["usage"]
                    row["tokens"] = u["prompt_tokens"] + u["completion_tokens"]
                else:
                    row["code"] = (r.json().get("error") or {}).get("code") if r.headers.get(
                        "content-type", "").startswith("application/json") else r.text[:80]
            except httpx.HTTPError as err:
                row.update(status=0, code=type(err).__name__)
            if row["status"] not in (0, 502, 503, 504) or row["attempts"] == 3:
                break
            time.sleep(0.5)
        row["took"] = time.time() - sent
        with lock:
            records.append(row)

    threads: list[threading.Thread] = []
    started = time.time()
    cut_at = mended_at = down_at = math.nan
    i = 0
    killed = done_before = chunks_before = z = 0
    say(f"load: {rate}/s through the edge for {seconds:.0f} s; {LOST} lost ({lose}) at 25 %, back at 55 %")
    while (el := time.time() - started) < seconds:
        if math.isnan(cut_at) and el >= 0.25 * seconds:
            done_before, chunks_before = _owner(
                lost, "SELECT count(DISTINCT stream) FILTER (WHERE type = 'item_completed'), "
                      "count(*) FILTER (WHERE type = 'item_chunk') FROM events WHERE stream LIKE %s",
                f"%{batch.id}%")[0]
            net.cut(LOST)
            cut_at = time.time()
            if lose == "crash":
                killed = _crash(net, lost)
            say(f"{LOST}'s link cut at {el:.0f} s" + (f", its {killed} processes killed" if killed else ""))
        if not math.isnan(cut_at) and math.isnan(down_at) and _server_states(sock).get(LOST) == "DOWN":
            down_at = time.time()
        if math.isnan(mended_at) and el >= 0.55 * seconds:
            net.mend(LOST)
            mended_at = time.time()
            if lose == "crash":
                _start_cell(net, lost, settings, again=True)
            say(f"{LOST}'s link mended at {el:.0f} s" + (", the cell starting again" if lose == "crash" else ""))
        while i < int(el * rate):
            t = threading.Thread(target=one, args=(i,), daemon=True)
            t.start()
            threads.append(t)
            i += 1
        while z < int(el):
            t = threading.Thread(target=one, args=(z, fenced_client, fenced), daemon=True)
            t.start()
            threads.append(t)
            z += 1
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    client.close()
    fenced_client.close()
    t0 = time.monotonic()
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() - t0 < 600:
        time.sleep(2)
        with contextlib.suppress(Exception):  # the cell may still be starting again
            batch = own.batches.retrieve(batch.id)
    finished_after_s = time.time() - mended_at
    seen: dict[str, int] = {}
    if batch.output_file_id:
        for line in own.files.content(batch.output_file_id).text.splitlines():
            cid = json.loads(line)["custom_id"]
            seen[cid] = seen.get(cid, 0) + 1
    journal = _owner(lost, "SELECT count(*), count(DISTINCT stream) FROM events WHERE type = 'item_completed' "
                           "AND stream LIKE %s", f"%{batch.id}%")[0]

    ok = [r for r in records if r["status"] == 200]
    by_cell: dict[str, int] = {}
    for r in ok:
        by_cell[r["cell"]] = by_cell.get(r["cell"], 0) + 1
    peak: dict[str, float] = {}
    for c in cells:
        per_s: dict[int, int] = {}
        for r in ok:
            if r["cell"] == c:
                per_s[int(r["sent"])] = per_s.get(int(r["sent"]), 0) + r["tokens"]
        peak[c] = float(max(per_s.values(), default=0))
    failed = [r for r in records if r["status"] not in (200, 429)]
    refused = [r for r in records if r["status"] == 429]
    first_refusal = min((r["sent"] for r in refused), default=math.nan)
    after_down = [r for r in failed if not math.isnan(down_at) and r["sent"] > down_at]
    in_window = [r for r in records if cut_at <= r["sent"] <= (down_at if not math.isnan(down_at) else cut_at + 5)]
    slow = sorted(r["took"] for r in in_window)
    fenced_ok = [r for r in fenced if r["status"] == 200]
    fenced_by: dict[str, int] = {}
    for r in fenced_ok:
        fenced_by[r["cell"]] = fenced_by.get(r["cell"], 0) + 1
    moved = min((r["sent"] + r["took"] for r in fenced_ok if r["cell"] != LOST and r["sent"] > cut_at),
                default=math.nan)
    out: dict[str, Any] = dict(
        fenced=dict(regions=FENCE, sent=len(fenced), ok=len(fenced_ok), by_cell=fenced_by,
                    outside_fence=sum(1 for r in fenced_ok if r["cell"] not in FENCE),
                    failed=sum(1 for r in fenced if r["status"] != 200),
                    answered_in_fence_after_loss_s=round(moved - cut_at, 2)),
        cut_at=cut_at, mended_at=mended_at, peak_tokens_per_s=peak,
        chats=dict(sent=len(records), ok=len(ok), refused_for_quota=len(refused), failed=len(failed),
                   tried_again=sum(1 for r in records if r["attempts"] > 1),
                   by_cell=by_cell, first_refusal_after_s=round(first_refusal - started, 1),
                   failure_codes=sorted({str(r.get("code")) for r in failed})),
        edge=dict(down_after_s=round(down_at - cut_at, 2), failed_after_down=len(after_down),
                  sent_between_cut_and_down=len(in_window), their_max_s=round(slow[-1], 2) if slow else None,
                  to_lost_after_down=sum(1 for r in ok if r["cell"] == LOST and down_at < r["sent"] < mended_at)),
        batch=dict(status=batch.status, items=items, made_at=made_at, done_when_lost=done_before,
                   chunks_journaled_when_lost=chunks_before, output_lines=sum(seen.values()),
                   finished_after_return_s=round(finished_after_s, 1),
                   once=sorted(seen) == sorted(f"item-{i}" for i in range(items)) and set(seen.values()) == {1}
                   and journal[0] == journal[1] == items))
    say(f"chats: {len(ok)} ok, {len(refused)} refused for quota, {len(failed)} failed of {len(records)}; "
        f"the edge took {LOST} out {out['edge']['down_after_s']} s after the cut; batch {batch.status}, "
        f"{sum(seen.values())} lines for {items} items")
    return out


def main(settings: Settings, *, seconds: float = 90.0, rate: float = 6.0, lose: str = "crash") -> int:
    root = Path(settings.data_dir).resolve() / "cells"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with cells_up(root, settings) as (net, cells):
        report = run(net, cells, settings, seconds=seconds, rate=rate, lose=lose)
    print(json.dumps(report, indent=2, default=str))
    return 0 if report.get("ok") else 1
