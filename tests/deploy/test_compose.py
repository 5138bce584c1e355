"""The compose deployment and the Dockerfile agree with each other and with the code.

No Docker engine is needed: docker-compose.yml is parsed with PyYAML (merge keys and anchors
resolved), `${VAR:-default}` is read as its default and a required `${VAR:?…}` (the secrets,
which have no default) as the value a .env file of this test's gives it, and every
cross-reference is checked:
service names and ports in the URLs, BALLAST_* variables against `config.Settings`,
commands against the CLI's own argparse parser, the GPU reservation and image extras against
pyproject.toml, and Temporal's persistence and fairness setting. Roles: only `migrate` sees the
owner's password; the api and the workers see the service role's URL alone. The whole file is
held to the deployment contract, ballast/topology.py (the Helm chart's test and a multi-host
harness hold theirs to the same): every process there, with its command and what it needs,
the model the same everywhere. Where a compose CLI exists, it validates the file too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Sequence
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
from pydantic import AliasChoices

from ballast import cli, topology
from ballast.procs import READY_FILE_ENV
from config import TINY_MODEL_NAME, Settings
from config.database import SERVICE_ROLES

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

REQUIRED_SERVICES = {"postgres", "temporal", "migrate", "api", "control", "engine"}
BALLAST_COMMANDS = {p.command for p in topology.PROCESSES.values()}
LONG_RUNNING = {p.command for p in topology.PROCESSES.values() if p.long_running}
ENV_PREFIX = Settings.model_config.get("env_prefix", "")

# What an operator's .env would hold: the secrets compose demands (no defaults), each a
# value of its own, so that where one of them shows up tells whose it is.
DOTENV = {
    "POSTGRES_PASSWORD": "owner-" + secrets.token_hex(8),
    **{f"BALLAST_{k.upper()}_DATABASE_PASSWORD": f"{k}-" + secrets.token_hex(8) for k in SERVICE_ROLES},
    "TEMPORAL_DB_PASSWORD": "temporal-" + secrets.token_hex(8),
    "BALLAST_ENGINE_TOKEN": "engine-" + secrets.token_hex(8),
    "BALLAST_METRICS_TOKEN": "metrics-" + secrets.token_hex(8),
}
SERVICE_ROLE_CONTAINERS = tuple(n for n, p in topology.PROCESSES.items() if p.database in SERVICE_ROLES)
# A variable named so holds a secret: it must never have a default.
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|(^|_)API_KEY$|(^|_)KEY$|PRIVATE")

_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$\$")


# --- reading the compose file as compose would, without an environment -----------------------


def _interpolate(value, dotenv: dict[str, str] = DOTENV):
    """`${VAR:-default}` and `${VAR-default}` become the default, `${VAR}` becomes '', `$$` is
    `$`, and `${VAR:?message}` (a secret) becomes `dotenv`'s value, or fails as compose does.

    Apart from the secrets, the file must work with nothing set, so defaults are what it means."""
    if isinstance(value, str):

        def sub(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            name, op, default = m.group(1), m.group(2), m.group(3)
            if op and op.endswith("?"):
                if not dotenv.get(name):
                    raise LookupError(f"${{{name}}} is required: {default}")
                return dotenv[name]
            return default or ""

        return _INTERPOLATION.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, dotenv) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, dotenv) for v in value]
    return value


def _raw() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(_raw())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _build_args(service: dict) -> dict[str, str]:
    build = service.get("build")
    if not isinstance(build, dict):
        return {}
    args = build.get("args") or {}
    if isinstance(args, list):
        args = dict(item.split("=", 1) for item in args)
    return {k: str(v) for k, v in args.items()}


def _command(service: dict) -> tuple[str, ...]:
    cmd = service.get("command")
    if isinstance(cmd, str):
        return tuple(shlex.split(cmd))
    return tuple(cmd or ())


def _depends(service: dict) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _container_port(entry) -> int:
    """The container side of a `ports:` entry, short ([ip:][host:]container[/proto]) or long form."""
    if isinstance(entry, dict):
        return int(entry["target"])
    spec = str(entry).split("/", 1)[0]
    return int(spec.rsplit(":", 1)[-1])


def _ports(service: dict) -> set[int]:
    """Every port the service offers on the compose network: `expose` plus published targets."""
    exposed = {int(str(p).split("/", 1)[0]) for p in service.get("expose") or []}
    return exposed | {_container_port(p) for p in service.get("ports") or []}


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) for each volume entry."""
    out = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            out.append((str(entry.get("source", "")), str(entry["target"])))
        else:
            parts = str(entry).split(":")
            out.append((parts[0], parts[1]) if len(parts) > 1 else ("", parts[0]))
    return out


def _is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def _ballast_services(services: dict) -> dict[str, dict]:
    """The services that run the Ballast image: built from this repository's Dockerfile."""
    return {name: s for name, s in services.items() if "build" in s}


def cli_accepts(argv: Sequence[str]) -> argparse.Namespace | None:
    """What ballast/cli.py's own parser makes of `argv` (None: it refuses it), running
    nothing: the command each subcommand dispatches to is replaced by one that records."""
    if argv and argv[0] in ("bench", "chaos"):  # handed whole to `python -m bench`: not deployable
        return None
    seen: list[argparse.Namespace] = []

    def record(*args) -> int:
        seen.append(next(a for a in args if isinstance(a, argparse.Namespace)))
        return 0

    with mock.patch.dict(cli.COMMANDS, {name: record for name in cli.COMMANDS}), \
            mock.patch.object(cli.tenants_cli, "main", record):
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage, on a refusal
                code = cli.main(list(argv))
        except SystemExit:
            return None
    return seen[0] if code == 0 and seen else None


def settings_env_names() -> set[str]:
    """Every environment variable config.Settings reads, and the one the process supervisor
    reads beside it (ballast/procs.py's readiness file)."""
    return _settings_env_names() | {READY_FILE_ENV}


def _settings_env_names() -> set[str]:
    names = set()
    for field, info in Settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {c for c in alias.choices if isinstance(c, str)}
        elif isinstance(alias, str):
            names.add(alias)
        else:
            names.add(f"{ENV_PREFIX}{field}".upper())
    return names


def _is_settings_var(name: str) -> bool:
    return name.startswith(ENV_PREFIX) or name == "DATABASE_URL"


# --- the tests ------------------------------------------------------------------------------


def test_required_services_exist(services):
    assert REQUIRED_SERVICES <= set(services)
    assert {"migrate", "api", "control", "engine"} <= set(_ballast_services(services))


def test_shared_env_anchor_reaches_every_ballast_service():
    raw = _raw()
    shared = raw.get("x-ballast-env")
    assert isinstance(shared, dict) and shared, "the shared env lives once, in x-ballast-env"
    for name, service in _ballast_services(raw["services"]).items():
        env = service.get("environment")
        assert isinstance(env, dict), name
        for key, value in shared.items():
            assert env.get(key) == value, f"{name}: {key} differs from x-ballast-env"


def test_ballast_env_vars_are_settings_fields(services):
    known = _settings_env_names()
    assert "BALLAST_DATABASE_URL" in known and "DATABASE_URL" in known
    for name, service in services.items():
        for key in _env(service):
            if _is_settings_var(key):
                assert key in known, f"{name}: {key} is not a field of config.Settings"


def test_ballast_env_parses_into_settings(services, monkeypatch):
    """Each Ballast service's environment builds a valid Settings (types included)."""
    for name, service in _ballast_services(services).items():
        settings = _settings_of(service, monkeypatch)
        assert settings.database_url, name
        assert settings.temporal_address, name


def _settings_of(service: dict, monkeypatch) -> Settings:
    """The Settings a service's environment builds, and nothing of this process's."""
    import os

    with monkeypatch.context() as m:
        for key in list(os.environ):
            if _is_settings_var(key):
                m.delenv(key)
        for key, value in _env(service).items():
            m.setenv(key, value)
        return Settings()


def test_database_url_points_at_postgres(services, monkeypatch):
    """Every Ballast service reaches the journal's database; migrate as its owner, the others
    as the role migrate creates, with the password migrate sets on it."""
    pg = services["postgres"]
    pg_env = _env(pg)
    pg_ports = _ports(pg)
    migrate = _settings_of(services["migrate"], monkeypatch)
    for name, service in _ballast_services(services).items():
        env = _env(service)
        url = env.get("BALLAST_DATABASE_URL") or env.get("DATABASE_URL")
        assert url, f"{name} has no BALLAST_DATABASE_URL"
        parts = urlsplit(url)
        assert parts.scheme.split("+")[0] in {"postgresql", "postgres"}, url
        assert parts.hostname == "postgres", f"{name}: {url} does not name the postgres service"
        assert (parts.port or 5432) in pg_ports, f"{name}: postgres offers {pg_ports}, not {parts.port}"
        assert parts.path.lstrip("/") == pg_env.get("POSTGRES_DB", parts.username)
        if name == "migrate":
            assert parts.username == pg_env.get("POSTGRES_USER", "postgres")
            assert parts.password == pg_env["POSTGRES_PASSWORD"] == DOTENV["POSTGRES_PASSWORD"]
        else:
            # Its own role, with the very password migrate sets on that role.
            assert (parts.username, parts.password) == (SERVICE_ROLES[name], migrate.role_password(name)), name
            assert parts.password == DOTENV[f"BALLAST_{name.upper()}_DATABASE_PASSWORD"], name


def test_only_migrate_is_handed_the_owners_credentials(services, monkeypatch):
    """The api and the workers connect as the restricted role and see nothing of the
    owner's: not its password in any variable, not a URL logged in as it."""
    owner = _env(services["postgres"])["POSTGRES_USER"]
    owner_password = _env(services["postgres"])["POSTGRES_PASSWORD"]
    assert owner_password == DOTENV["POSTGRES_PASSWORD"]  # the secret searched for is the owner's
    migrate = _settings_of(services["migrate"], monkeypatch)
    assert urlsplit(migrate.database_url).username == owner
    seen_by = {name for name, s in services.items() if any(owner_password in v for v in _env(s).values())}
    assert seen_by == {"postgres", "migrate"}, seen_by  # Temporal's services included: they have a role of their own
    for name in SERVICE_ROLE_CONTAINERS:
        env = _env(services[name])
        for key, value in env.items():
            if "://" in value:
                assert urlsplit(value).username != owner, f"{name}: {key} logs in as the owner"
        settings = _settings_of(services[name], monkeypatch)
        for url in (settings.database_url, settings.service_db_url):
            parts = urlsplit(url)
            assert parts.username == SERVICE_ROLES[name] != owner, f"{name}: {url}"
        # No role's password but in its own URL: another service's is another's login.
        assert not settings.role_passwords() and not settings.service_database_password, name
        others = [v for k, v in DOTENV.items() if k.endswith("_DATABASE_PASSWORD") and not k.startswith(
            f"BALLAST_{name.upper()}_")]
        assert not [v for v in env.values() for o in others if o in v], name


def test_secrets_have_no_defaults():
    """Compose refuses to start until each secret is set: no public value to forget to change."""
    text = COMPOSE_FILE.read_text()
    for name in DOTENV:
        uses = [m for m in _INTERPOLATION.finditer(text) if m.group(1) == name]
        assert uses, f"{name} is not used"
        assert all(m.group(2) == ":?" for m in uses), f"{name}: {[m.group(0) for m in uses]}"
        with pytest.raises(LookupError, match=name):
            _interpolate(_raw(), {k: v for k, v in DOTENV.items() if k != name})


def test_postgres_asks_every_role_for_its_password(services):
    """The image trusts connections over its socket unless initdb is told otherwise."""
    env = _env(services["postgres"])
    assert env.get("POSTGRES_HOST_AUTH_METHOD") == "scram-sha-256"
    assert "--auth=scram-sha-256" in shlex.split(env.get("POSTGRES_INITDB_ARGS", ""))
    assert not any("trust" in v for s in services.values() for v in _env(s).values())


def test_temporal_address_points_at_temporal(services):
    temporal_ports = _ports(services["temporal"])
    for name, service in _ballast_services(services).items():
        address = _env(service).get("BALLAST_TEMPORAL_ADDRESS")
        assert address, f"{name} has no BALLAST_TEMPORAL_ADDRESS"
        host, _, port = address.rpartition(":")
        assert host == "temporal", f"{name}: {address} does not name the temporal service"
        assert int(port) in temporal_ports, f"{name}: temporal offers {temporal_ports}, not {port}"


def test_processes_share_namespace_queues_and_object_store(services):
    ballast = _ballast_services(services)
    for key in ("BALLAST_TEMPORAL_NAMESPACE", "BALLAST_CONTROL_QUEUE", "BALLAST_ENGINE_QUEUE",
                "BALLAST_OBJECT_STORE"):
        values = {_env(s).get(key) for s in ballast.values()}
        assert len(values) == 1 and None not in values, f"{key} differs across services: {values}"
    ns = _env(services["api"])["BALLAST_TEMPORAL_NAMESPACE"]
    creators = [s for s in services.values() if _env(s).get("NAMESPACE") == ns]
    assert creators, f"nothing registers the Temporal namespace {ns!r}"


def test_object_store_is_a_shared_volume(compose, services):
    """Whoever reads or writes batch files sees the same files: one named volume under the URL."""
    declared = set(compose.get("volumes") or {})
    for name in ("api", "control", "engine"):
        url = _env(services[name])["BALLAST_OBJECT_STORE"]
        parts = urlsplit(url)
        if parts.scheme != "file":
            continue  # a real object store (s3://...) needs no volume
        path = parts.path.rstrip("/")
        covering = [src for src, dst in _mounts(services[name])
                    if path == dst.rstrip("/") or path.startswith(dst.rstrip("/") + "/")]
        assert covering, f"{name}: {path} is not on a volume"
        assert all(src in declared for src in covering), f"{name}: {covering} not named volumes"


def test_named_volumes_are_declared_and_bind_sources_exist(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for source, _target in _mounts(service):
            if not source:
                continue
            if _is_bind(source):
                assert (ROOT / source).exists(), f"{name}: bind source {source} is missing"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"


def test_commands_are_ballast_commands(services):
    for name, service in _ballast_services(services).items():
        assert "entrypoint" not in service, f"{name} overrides the image's `ballast` entrypoint"
        assert _command(service) in BALLAST_COMMANDS, f"{name}: {_command(service)}"
    assert _command(services["migrate"]) == ("migrate",)
    assert _command(services["api"]) == ("api",)
    assert _command(services["control"]) == ("worker", "control")
    assert _command(services["engine"]) == ("worker", "engine")
    for name, service in _ballast_services(services).items():
        if _command(service) in LONG_RUNNING:
            assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, name
        else:
            assert service.get("restart", "no") == "no", f"one-shot {name} must not restart"


def test_depends_on_references_exist_and_are_acyclic(services):
    conditions = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, service in services.items():
        for dep, condition in _depends(service).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert condition in conditions, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits on {dep}'s missing healthcheck"
            if condition == "service_completed_successfully":
                assert services[dep].get("restart", "no") == "no", f"{dep} is not a one-shot"
    # Kahn's algorithm: every service can start.
    pending = {name: set(_depends(s)) for name, s in services.items()}
    while pending:
        ready = [n for n, deps in pending.items() if not deps & pending.keys()]
        assert ready, f"dependency cycle among {sorted(pending)}"
        for n in ready:
            del pending[n]


def test_startup_order(services):
    migrate = _depends(services["migrate"])
    assert migrate.get("postgres") == "service_healthy"
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])
    for name in ("api", "control", "engine"):
        deps = _depends(services[name])
        assert deps.get("migrate") == "service_completed_successfully", name
        assert "temporal" in deps, name


def test_api_publishes_its_port(services):
    api = services["api"]
    env = _env(api)
    port = int(env.get("BALLAST_API_PORT", Settings.model_fields["api_port"].default))
    assert env.get("BALLAST_API_HOST") == "0.0.0.0", "inside a container the API must bind 0.0.0.0"
    assert port in {_container_port(p) for p in api.get("ports") or []}, "api port not published"
    probe = " ".join(map(str, api["healthcheck"]["test"]))
    assert f":{port}/healthz" in probe


def test_the_engine_and_the_control_worker_are_probed_on_their_readyz(services):
    for name, port_var in (("engine", "BALLAST_ENGINE_PORT"), ("control", "BALLAST_CONTROL_PORT")):
        probe = " ".join(map(str, services[name]["healthcheck"]["test"]))
        assert f"127.0.0.1:{_env(services[name])[port_var]}/readyz" in probe, (name, probe)


def test_engine_reserves_a_gpu_and_builds_the_gpu_extra(services):
    engine = services["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia"
        and "gpu" in d.get("capabilities", [])
        and (int(d.get("count", 0)) >= 1 or d.get("device_ids"))
        for d in devices
    ), devices
    assert _build_args(engine).get("EXTRA") == "gpu"
    env = _env(engine)
    int(env["BALLAST_MAX_MODEL_LEN"])
    # On a GPU vLLM sizes its KV cache (gpu_memory_utilization), tuned through its own flags.
    assert "BALLAST_KV_CACHE_GIB" not in env and "BALLAST_VLLM_ARGS" in env
    assert env.get("BALLAST_MODEL")


def test_engine_announces_a_streaming_url_the_api_can_reach(services):
    from urllib.parse import urlparse

    engine = services["engine"]
    env = _env(engine)
    url = urlparse(env["BALLAST_ENGINE_URL"])
    assert url.hostname == "engine" and url.port == int(env["BALLAST_ENGINE_PORT"])
    assert env.get("BALLAST_ENGINE_HOST") == "0.0.0.0", "inside a container the engine must bind 0.0.0.0"
    assert str(url.port) in {str(p) for p in engine.get("expose") or []}


def test_image_extras_exist_in_pyproject(services):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, service in _ballast_services(services).items():
        extra = _build_args(service).get("EXTRA", "gpu")
        assert extra == "none" or extra in extras, f"{name}: unknown extra {extra}"
    # Images that share a tag are built the same way.
    by_image: dict[str, set] = {}
    for service in _ballast_services(services).values():
        by_image.setdefault(service["image"], set()).add(_build_args(service).get("EXTRA", "gpu"))
    assert all(len(v) == 1 for v in by_image.values()), by_image


def test_temporal_persists_to_postgres(services):
    temporal = services["temporal"]
    env = _env(temporal)
    assert env["DB"].startswith("postgres"), env["DB"]
    assert env["POSTGRES_SEEDS"] == "postgres"
    assert int(env.get("DB_PORT", 5432)) in _ports(services["postgres"])
    # As its own role, whose password the postgres service's init script sets.
    pg_env = _env(services["postgres"])
    assert env["POSTGRES_USER"] == pg_env["TEMPORAL_DB_USER"] != pg_env["POSTGRES_USER"]
    assert env["POSTGRES_PWD"] == pg_env["TEMPORAL_DB_PASSWORD"] == DOTENV["TEMPORAL_DB_PASSWORD"]
    assert any(target == "/docker-entrypoint-initdb.d" and (ROOT / source.removeprefix("./")).is_dir()
               for source, target in _mounts(services["postgres"])), _mounts(services["postgres"])
    # Something creates Temporal's schema before the server starts (or the image does it).
    if "auto-setup" not in temporal["image"]:
        schema_jobs = [d for d, c in _depends(temporal).items() if c == "service_completed_successfully"]
        assert schema_jobs, "temporalio/server needs a schema job before it starts"


def test_temporal_dynamic_config_enables_fairness(services):
    temporal = services["temporal"]
    rel = _env(temporal)["DYNAMIC_CONFIG_FILE_PATH"]
    in_container = rel if rel.startswith("/") else f"/etc/temporal/{rel}"
    host_file = None
    for source, target in _mounts(temporal):
        target = target.rstrip("/")
        if _is_bind(source) and (in_container == target or in_container.startswith(target + "/")):
            host_file = ROOT / source / in_container[len(target):].lstrip("/")
    assert host_file is not None, f"{in_container} is not mounted from the repository"
    assert host_file.is_file(), host_file
    config = yaml.safe_load(host_file.read_text())
    fairness = config["matching.enableFairness"]
    assert any(v["value"] is True and not v.get("constraints") for v in fairness), fairness


def test_dockerfile():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"^ARG EXTRA=gpu$", text, re.M)
    assert re.search(r"""pip install\b[^\n]*["']?\.\[\$\{?EXTRA\}?(,s3)?\]""", text)
    assert re.search(r'^ENTRYPOINT \["ballast"\]$', text, re.M)
    cpu_cleanup = re.search(r'"\$EXTRA" = "cpu".*pip uninstall -y ([^;]*)', text)
    assert cpu_cleanup and {"torchvision", "torchaudio", "torchcodec"} <= set(cpu_cleanup[1].split())
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv"} <= ignored


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_cli_accepts_the_file_with_its_secrets_and_not_without(tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose CLI here")
    empty = tmp_path / "empty.env"  # not a .env of the developer's beside the file
    empty.write_text("")
    argv = [*cli, "-f", str(COMPOSE_FILE), "--project-directory", str(ROOT), "--env-file", str(empty), "config", "-q"]
    bare = {k: v for k, v in os.environ.items() if k not in DOTENV}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=dict(bare, **DOTENV))
    assert proc.returncode == 0, proc.stderr
    for name in DOTENV:
        env = dict(bare, **{k: v for k, v in DOTENV.items() if k != name})
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
        assert proc.returncode != 0 and name in proc.stderr, (name, proc.stderr)


def test_only_the_api_is_published_beyond_this_host(services):
    """Postgres, Temporal and its UI have no login of their own: loopback only, if at all."""
    for name, service in services.items():
        for entry in service.get("ports") or []:
            host_ip = entry.get("host_ip", "") if isinstance(entry, dict) else (
                str(entry).rsplit(":", 2)[0] if str(entry).count(":") == 2 else "")
            if name != "api":
                assert host_ip == "127.0.0.1", f"{name} publishes {entry} beyond this host"


def test_the_api_and_the_engines_share_the_engine_token_and_no_one_else_has_it(services):
    """The engine's port answers only requests carrying BALLAST_ENGINE_TOKEN: the api must
    send the very value the engine demands, and no other service is handed the secret."""
    tokens = {name: _env(s).get("BALLAST_ENGINE_TOKEN") for name, s in _ballast_services(services).items()}
    assert tokens["api"] and tokens["api"] == tokens["engine"], tokens
    assert {name for name, t in tokens.items() if t} == {"api", "engine"}, tokens
    assert "BALLAST_ENGINE_TOKEN" not in (_raw().get("x-ballast-env") or {})


# --- the deployment contract (ballast/topology.py) and what broke before it -----------------


def test_every_process_of_the_contract_runs_with_what_it_needs(services):
    """The file starts each process of ballast/topology.py with its command and everything it
    needs; none is handed what it must not have; all agree on where they meet and the model."""
    envs = {name: _env(s) for name, s in _ballast_services(services).items()}
    assert topology.problems(envs) == []
    for name, process in topology.PROCESSES.items():
        assert _command(services[name]) == process.command, name


def test_the_contract_catches_a_model_set_on_the_engine_only(services):
    """The bug this file had: BALLAST_MODEL on the engine alone, so the api and the control
    worker expected the tiny model (the api waited for an engine serving it; every batch line
    failed validation). The contract check names it."""
    envs = {name: _env(s) for name, s in _ballast_services(services).items()}
    for name in ("api", "control", "migrate"):
        envs[name] = {k: v for k, v in envs[name].items() if k not in topology.MODEL_ENV}
    found = topology.problems(envs)
    assert "api: BALLAST_MODEL is not set" in found and "control: BALLAST_MODEL is not set" in found, found
    assert any(p.startswith("the served model differs") for p in found), found


def test_every_ballast_service_sees_the_same_model(services, monkeypatch):
    """One block, x-ballast-model, reaches every Ballast service unchanged; each one's
    Settings then expects the model the engine serves, never the tiny default."""
    raw = _raw()
    model = raw.get("x-ballast-model")
    assert isinstance(model, dict) and {"BALLAST_MODEL", "BALLAST_MAX_MODEL_LEN", "HF_HOME"} <= set(model), model
    for name, service in _ballast_services(raw["services"]).items():
        env = service["environment"]
        for key, value in model.items():
            assert env.get(key) == value, f"{name}: {key} is {env.get(key)!r}, not x-ballast-model's {value!r}"
    seen = {}
    for name, service in _ballast_services(services).items():
        settings = _settings_of(service, monkeypatch)
        seen[name] = (settings.model, settings.model_name, settings.max_model_len)
    assert len(set(seen.values())) == 1, seen
    assert TINY_MODEL_NAME not in {v[1] for v in seen.values()}, seen


def test_the_api_and_the_control_worker_read_the_engines_tokenizer(services):
    """The api tokenizes prompts to place requests by their cached prefix: it needs the
    model's tokenizer files, and its image has no model. They come from the volume the engine
    downloads the model into (same volume, same HF_HOME), read-only and offline, so the control
    plane never fetches from the hub."""
    engine = services["engine"]
    hf_home = _env(engine)["HF_HOME"]

    def cache_volume(service: dict) -> tuple[str, bool]:
        for entry in service.get("volumes") or []:
            source, target, *mode = str(entry).split(":")
            if hf_home == target.rstrip("/") or hf_home.startswith(target.rstrip("/") + "/"):
                return source, "ro" in mode
        raise AssertionError(f"{hf_home} is on no volume")

    engine_volume, engine_ro = cache_volume(engine)
    assert not engine_ro, "the engine downloads the model into its cache"
    for name in ("api", "control"):
        env = _env(services[name])
        assert env.get("HF_HOME") == hf_home, name
        assert cache_volume(services[name]) == (engine_volume, True), name
        assert env.get("HF_HUB_OFFLINE") == "1", name
    # The control-plane image can load a tokenizer (transformers without torch), in the range
    # the engines' vLLM accepts; this machine's install, vLLM's choice, lies in it.
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    text = DOCKERFILE.read_text()
    m = re.search(r'^ARG TOKENIZER_REQUIREMENTS="([^"]+)"', text, re.M)
    assert m, "the control-plane image installs no tokenizer"
    reqs = {}
    for req in m[1].split():
        name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", req).groups()
        reqs[name] = spec
    assert {"transformers", "jinja2"} <= set(reqs), reqs
    assert version("transformers") in SpecifierSet(reqs["transformers"]), (version("transformers"), reqs)
    assert re.search(r'"\$EXTRA" = "none" \]; then for r in \$TOKENIZER_REQUIREMENTS', text)


def test_no_secret_has_a_default():
    """Every interpolation of a password, token or key is `${VAR:?message}`, and no variable
    named so is set to a literal: compose refuses to start without them."""
    raw_text = COMPOSE_FILE.read_text()
    for m in _INTERPOLATION.finditer(raw_text):
        if m.group(1) and SECRET_NAME.search(m.group(1)):
            assert m.group(2) == ":?" and m.group(3), f"{m.group(0)} has a default or no message"
    for name, service in _raw()["services"].items():
        env = service.get("environment") or {}
        for key, value in env.items():
            if SECRET_NAME.search(key) or key in topology.SECRET_ENV:
                assert "${" in str(value) and ":?" in str(value), f"{name}: {key} is a literal"


def test_no_long_running_service_gets_the_owners_url(services):
    """The owner (POSTGRES_USER, the superuser of the image) logs in nowhere but `migrate`."""
    owner = _env(services["postgres"])["POSTGRES_USER"]
    for name, service in _ballast_services(services).items():
        if _command(service) not in LONG_RUNNING:
            continue
        for key, value in _env(service).items():
            if "://" in value:
                assert urlsplit(value).username not in (owner, "postgres"), f"{name}: {key}"


def test_every_ballast_command_is_a_subcommand_of_the_cli():
    """Each service's command, and each `docker compose run` in the file's comments, is what
    ballast/cli.py's parser accepts."""
    for name, service in _ballast_services(_raw()["services"]).items():
        args = cli_accepts(_command(service))
        assert args is not None, f"{name}: `ballast {' '.join(_command(service))}` is not a command"
    runs = re.findall(r"docker compose run --rm (\S+) ([^\n#]+)", COMPOSE_FILE.read_text())
    assert runs
    for service, rest in runs:
        assert service in _ballast_services(_raw()["services"]), service
        assert cli_accepts(shlex.split(rest)) is not None, rest
    assert cli_accepts(["worker", "gpu"]) is None and cli_accepts(["serve"]) is None  # the parser is real


def test_every_ballast_variable_is_a_setting(services):
    """BALLAST_* names anywhere in the file (environments, comments, interpolations) are
    config.Settings' (or the supervisor's readiness file)."""
    known = settings_env_names()
    named = set(re.findall(r"\bBALLAST_[A-Z0-9_]+", COMPOSE_FILE.read_text()))
    deploy_only = {"BALLAST_TAG", "BALLAST_API_PUBLISH_PORT"}  # compose's own knobs, interpolated only
    for key in named - deploy_only:
        assert key in known, f"{key} is not a setting of config.Settings"
    for key in deploy_only:
        assert all(key not in _env(s) for s in services.values()), key


def test_an_engine_pool_of_another_model_agrees_with_itself_not_with_the_control_plane(services):
    """A second pool (`engine-<pool>`) serves a model of its own with its own context length;
    its engines must agree with each other, and some engine must still serve the model the
    API and the control worker expect."""
    envs = {name: _env(s) for name, s in _ballast_services(services).items()}
    other = dict(envs["engine"], BALLAST_MODEL="org/other", BALLAST_MAX_MODEL_LEN="512")
    envs["engine-other"] = other
    assert topology.problems(envs) == []
    envs["engine-other2"] = dict(other, BALLAST_MAX_MODEL_LEN="1024")
    found = topology.problems(envs)
    assert len(found) == 1 and found[0].startswith("BALLAST_MAX_MODEL_LEN differs"), found
    assert "engine-other" in found[0] and "api" not in found[0], found
    del envs["engine"], envs["engine-other2"]
    assert any("no engine serves it" in p for p in topology.problems(envs))
