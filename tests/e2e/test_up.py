"""`ballast up` on embedded defaults: ready, serves a batch and a chat with the key it made (in
data_dir/api-key, shown in its banner; the chat streams from the engine worker, which demands
the engine token `ballast up` made in data_dir/engine-token), stops every child on SIGTERM or
Ctrl-C, and a second `ballast up` finds the first one's jobs, keys and engine token. No process
it starts is handed the Postgres superuser's URL or password: the API and the workers get the
services' role's URL, as /proc shows their environment and command lines."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from ballast import procs
from config.database import SERVICE_ROLES, libpq_url
from protocol import keys as keys_of
from tests.e2e.conftest import start_batch

pytestmark = pytest.mark.e2e


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, however it detached (setsid, own groups)."""
    found, frontier = set(), [pid]
    while frontier:
        kids = procs.children_of(frontier.pop())
        found |= set(kids)
        frontier += kids
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(pid)
        except FileNotFoundError:
            pass
    return out


def start_up(env, log):
    return procs.spawn("ballast up", [sys.executable, "-m", "ballast.cli", "up"], env=env, log_path=log)


def wait_healthy(api: httpx.Client, child: procs.Child) -> None:
    procs.wait_until(lambda: _ok(api), 300, "ballast up to report healthy", child=child, interval=0.5)


def _ok(api: httpx.Client) -> bool:
    try:
        return api.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def banner(log: Path, child: procs.Child) -> str:
    """What `ballast up` printed once ready (it polls health itself, so a little after us)."""
    procs.wait_until(lambda: "Ballast is up" in log.read_text(), 60, "the banner", child=child, interval=0.2)
    return log.read_text()


def keys(data_dir: Path) -> tuple[str, str, str]:
    """The tenant key, the admin key and the engine token `ballast up` keeps, readable by
    this user only."""
    out = []
    for name in ("api-key", "admin-key", "engine-token"):
        path = data_dir / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
        out.append(path.read_text().strip())
    return out[0], out[1], out[2]


def db_secrets(data_dir: Path) -> dict[str, str]:
    """The superuser's password and each service's role's, kept 0600 in the data dir, by
    role; each checked to be the real one: the server lets its role in with it."""
    url = (data_dir / "postgres-url").read_text().strip()
    out = {}
    for name, role in (("postgres-password", "postgres"),
                       *((f"{kind}-db-password", role) for kind, role in SERVICE_ROLES.items())):
        path = data_dir / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
        password = path.read_text().strip()
        login = make_url(url).set(username=role, password=password).render_as_string(hide_password=False)
        with psycopg.connect(libpq_url(login), connect_timeout=10) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (role,)
        out[role] = password
    assert stat.S_IMODE((data_dir / "postgres-url").stat().st_mode) == 0o600
    assert make_url(url).password == out["postgres"]
    assert len(set(out.values())) == len(out)  # a password of its own each
    return out


def _proc(pid: int, what: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None  # gone meanwhile


def check_roles_of_every_process(child: procs.Child, data_dir: Path) -> None:
    """Nothing `ballast up` started (vLLM's processes, Postgres and Temporal included) has
    the superuser's password in its environment or argv; the API and each worker connect
    as its own service's role, with its password, and hold no other role's."""
    passwords = db_secrets(data_dir)
    superuser_password = passwords["postgres"]
    seen: dict[int, tuple[bytes, bytes]] = {}
    for pid in descendants(child.pid):
        cmdline, environ = _proc(pid, "cmdline"), _proc(pid, "environ")
        if cmdline is not None and environ is not None:
            seen[pid] = (cmdline, environ)
    secret = superuser_password.encode()
    leaks = [cmd.replace(b"\0", b" ")[:120] for cmd, env in seen.values() if secret in cmd or secret in env]
    assert not leaks, f"processes with the superuser's password: {leaks}"
    services = {}
    for cmd, env in seen.values():
        argv = cmd.rstrip(b"\0").split(b"\0")
        if b"ballast.cli" in argv and (argv[argv.index(b"ballast.cli") + 1:] or [b""])[0] in (b"api", b"worker"):
            variables = dict(v.split(b"=", 1) for v in env.split(b"\0") if b"=" in v)
            services[b" ".join(argv[argv.index(b"ballast.cli") + 1:]).decode()] = variables
    assert sorted(services) == ["api", "worker control", "worker engine"], sorted(services)
    for name, variables in services.items():
        role = SERVICE_ROLES[name.split()[-1]]
        for key in (b"BALLAST_DATABASE_URL", b"BALLAST_SERVICE_DATABASE_URL"):
            u = make_url(variables[key].decode())
            assert (u.username, u.password) == (role, passwords[role]), f"{name}: {key!r} as {u.username}"
        assert b"DATABASE_URL" not in variables and b"PGPASSWORD" not in variables, name
        others = [p.encode() for r, p in passwords.items() if r != role]
        assert not [v for v in variables.values() for o in others if o in v], f"{name} holds another role's password"
    assert len(seen) > len(services) + 2, seen.keys()  # postgres, temporal and vLLM's were looked at too


def stop_and_check_no_orphans(child: procs.Child, sig: int) -> None:
    tree = descendants(child.pid)
    assert len(tree) >= 4, tree  # postgres, temporal, engine, control, api (+ their own children)
    os.kill(child.pid, sig)
    child.proc.wait(90)
    deadline = time.monotonic() + 30
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(tree), f"orphans after {signal.Signals(sig).name}: {alive(tree)}"


@pytest.fixture
def data_dir():
    d = Path(tempfile.mkdtemp(prefix="ballast-test-up-"))  # see pg_server_url on why not tmp_path
    yield d
    shutil.rmtree(d, ignore_errors=True)


def up_env(data_dir: Path, tiny_model, **extra: str) -> tuple[dict[str, str], int]:
    """`ballast up`'s environment on embedded defaults in `data_dir` (no DATABASE_URL, no
    engine token: it makes its own), on free ports; and its API port."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "BALLAST_DATABASE_URL", "BALLAST_ENGINE_TOKEN")}
    port = procs.free_port()
    env.update(BALLAST_DATA_DIR=str(data_dir), BALLAST_API_PORT=str(port),
               BALLAST_TEMPORAL_PORT=str(procs.free_port()), BALLAST_TEMPORAL_UI_PORT=str(procs.free_port()),
               BALLAST_MODEL=tiny_model.path, BALLAST_SERVED_MODEL_NAME=tiny_model.name,
               BALLAST_MAX_MODEL_LEN=str(tiny_model.max_model_len), BALLAST_KV_CACHE_GIB="0.5", **extra)
    return env, port


def test_ballast_up_serves_stops_cleanly_and_keeps_state(tmp_path, data_dir, tiny_model):
    env, port = up_env(data_dir, tiny_model)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    first = start_up(env, tmp_path / "up-1.log")
    try:
        wait_healthy(api, first)
        check_roles_of_every_process(first, data_dir)
        passwords = db_secrets(data_dir)
        key, admin_key, engine_token = keys(data_dir)
        shown = banner(tmp_path / "up-1.log", first)
        assert key in shown and admin_key in shown  # new: both shown, this once
        assert f"export OPENAI_API_KEY=$(cat {data_dir / 'api-key'})" in shown
        assert str(data_dir / "engine-token") in shown and engine_token not in shown  # where, never what
        # Metrics: the token kept 0600 and named (never shown), the control worker's port in the banner.
        metrics_token = data_dir / "metrics-token"
        assert stat.S_IMODE(metrics_token.stat().st_mode) == 0o600 and metrics_token.read_text() not in shown
        bearer = {"Authorization": f"Bearer {metrics_token.read_text().strip()}"}
        [control] = {u for u in re.findall(r"(http://127\.0\.0\.1:\d+)/metrics", shown)} - {f"http://127.0.0.1:{port}"}
        assert str(metrics_token) in shown, shown
        for url in (f"http://127.0.0.1:{port}/metrics", control + "/metrics"):
            assert httpx.get(url, timeout=10).status_code == 401, url
            assert "ballast_journal_append_seconds" in httpx.get(url, headers=bearer, timeout=10).text, url
        assert httpx.get(control + "/readyz", timeout=10).json()["status"] == "ok"
        assert not [p for p in passwords.values() if p in shown]  # the banner masks the URL
        assert api.get("/v1/batches").status_code == 401  # no key
        api.headers["Authorization"] = f"Bearer {key}"
        assert (data_dir / "postgres-url").exists()  # for `ballast tenants` meanwhile
        parts = api.get("/healthz").json()["parts"]
        assert set(parts.values()) == {"ok"}
        ui = httpx.get(f"http://127.0.0.1:{env['BALLAST_TEMPORAL_UI_PORT']}", timeout=10)
        assert ui.status_code == 200  # the Temporal Web UI is reachable
        _, bid = start_batch(api, tiny_model.name, "persist me", 8)
        deadline = time.monotonic() + 120
        while (b := api.get(f"/v1/batches/{bid}").json())["status"] != "completed":
            assert time.monotonic() < deadline and b["status"] not in ("failed", "cancelled"), b
            time.sleep(0.3)
        output = api.get(f"/v1/files/{b['output_file_id']}/content").text
        # The batch links to its workflow in the Web UI: the UI server's own API, asked the
        # link's query, lists the batch's workflow and nothing else.
        ui_url = f"http://127.0.0.1:{env['BALLAST_TEMPORAL_UI_PORT']}"
        link = httpx.URL(b["ballast"]["workflow_url"])
        assert str(link).startswith(f"{ui_url}/namespaces/default/workflows?query="), link
        found = httpx.get(f"{ui_url}/api/v1/namespaces/default/workflows", params=dict(query=link.params["query"]),
                          timeout=10).json()["executions"]
        assert {e["execution"]["workflowId"] for e in found} == {keys_of.batch(bid)}, found
        # Interactive: the API streams it from the engine worker, presenting the engine token.
        chat = api.post("/v1/chat/completions", json=dict(model=tiny_model.name, max_tokens=4,
                                                          messages=[dict(role="user", content="hi")]))
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1, chat.text
        stop_and_check_no_orphans(first, signal.SIGTERM)
        assert not (data_dir / "postgres-url").exists()
    finally:
        first.stop(30)

    second = start_up(env, tmp_path / "up-2.log")
    try:
        wait_healthy(api, second)
        assert keys(data_dir) == (key, admin_key, engine_token)  # the same keys and engine token
        assert db_secrets(data_dir) == passwords  # made per installation, kept
        check_roles_of_every_process(second, data_dir)
        shown = banner(tmp_path / "up-2.log", second)
        assert key not in shown and admin_key not in shown  # where they are, not what
        assert str(data_dir / "api-key") in shown and str(data_dir / "admin-key") in shown
        again = api.get(f"/v1/batches/{bid}").json()
        assert again["status"] == "completed" and again["request_counts"]["completed"] == 1
        assert api.get(f"/v1/files/{again['output_file_id']}/content").text == output
        assert [x["id"] for x in api.get("/v1/batches").json()["data"]] == [bid]
        stop_and_check_no_orphans(second, signal.SIGINT)  # Ctrl-C
    finally:
        second.stop(30)
