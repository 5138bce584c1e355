"""`ballast up | api | worker ... | migrate | tenants ... | verify`, `bench ...` / `chaos`,
which run `python -m bench`, and `sim ...` (the simulator, sim/): Ballast itself. Every other
command (`batch`, `files`, `models`, `ft`, `usage`, `admin`, `profile`, `completion`, and
`--help`, `--version`) is the client's, over HTTP (ballast/client_cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from pydantic import ValidationError

from ballast import tenants_cli
from config import Settings
from telemetry import logs

# What to set for each setting a command needs: the services need only their own role's URL.
_ENV = dict(service_db_url="BALLAST_SERVICE_DATABASE_URL (or BALLAST_DATABASE_URL)",
            temporal_address="TEMPORAL_ADDRESS (or BALLAST_TEMPORAL_ADDRESS, or a Temporal profile)")


def _need(settings: Settings, *names: str) -> None:
    missing = [n for n in names if not getattr(settings, n)]
    if missing:
        env = ", ".join(_ENV.get(n, "BALLAST_" + n.upper()) for n in missing)
        sys.exit(f"ballast: set {env} (or run `ballast up`, which starts embedded services)")


def _need_engine_token(settings: Settings) -> None:
    """The API and every engine worker share BALLAST_ENGINE_TOKEN: an engine serves only
    requests that carry it, so neither starts without it."""
    from ballast.workers import engine_token

    try:
        engine_token(settings)
    except RuntimeError as err:
        sys.exit(f"ballast: {err}")


# The server side's commands, and what `ballast --help` says of each.
SERVER = dict(up="Run everything on this machine (embedded Postgres and Temporal unless configured).",
              api="Serve the OpenAI-compatible API.",
              worker="Run a Temporal worker (control, engine); or list, drain, undrain engine workers.",
              migrate="Upgrade the journal's schema and grant each service's role (as the database owner).",
              tenants="Tenants, keys and limits straight on the journal's Postgres (as its owner).",
              verify="Check the journal's invariants in SQL.",
              bench="Benchmarks that print ratios measured side by side.",
              chaos="Faults injected into a fresh `ballast up` under load.",
              sim="The real policies at fleet scale in virtual time.",
              cells="Global daily limits across regions that are cells: reconcile, status.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVER:
        return server_main(argv)
    from ballast import client_cli

    for name, what in SERVER.items():
        client_cli.add_passthrough(name, what, server_main)
    return client_cli.cli.main(args=argv, prog_name="ballast")  # exits with its code


def server_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ballast", description="Durable workload manager for LLM inference on vLLM.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="run everything on this machine (embedded Postgres and Temporal unless configured)")
    u.add_argument("--engines", type=int, default=None, help="engine workers to run here, one vLLM engine each "
                                                             "(BALLAST_ENGINES, 1)")
    sub.add_parser("api", help="serve the OpenAI-compatible API")
    w = sub.add_parser("worker", help="run a Temporal worker; or list the engine workers, or drain or undrain one")
    w.add_argument("kind", choices=["control", "engine", "list", "drain", "undrain"])
    w.add_argument("id", nargs="?", help="drain, undrain: the engine worker's id (as `ballast worker list` shows it)")
    sub.add_parser("migrate",
                   help="alembic upgrade head on BALLAST_DATABASE_URL (the owner), granting each service's "
                        "role and setting the passwords given (BALLAST_{API,CONTROL,ENGINE}_DATABASE_PASSWORD)")
    tenants_cli.add_parser(sub)
    # The benchmarks are their own program, above this one (they start stacks with it).
    for name, what in (("bench", "benchmarks that print ratios measured side by side (`ballast bench -h`)"),
                       ("chaos", "faults injected into a fresh `ballast up` under load (`ballast chaos -h`)")):
        sub.add_parser(name, help=what, add_help=False).add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("sim", help="the real policies at fleet scale in virtual time (`ballast sim -h`)",
                   add_help=False).add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("cells", help="global daily limits across regions that are cells: reconcile, status "
                                 "(`ballast cells -h`)", add_help=False).add_argument("rest", nargs=argparse.REMAINDER)
    v = sub.add_parser("verify", help="check the journal's invariants (SQL) on BALLAST_DATABASE_URL: each check's "
                                      "rows examined; exits 1 on a violation, or when nothing at all was examined")
    v.add_argument("--tokenizer", default=None, help="a model directory (or hub id): also re-tokenize each completed "
                                                     "batch item's prompt with transformers against its settle")
    v.add_argument("--model", default=None, help="with --tokenizer: only the items of this served model name (and "
                                                 "its fine-tuned models)")
    if argv and argv[0] in ("bench", "chaos"):  # all they are given is theirs, -h included
        os.execv(sys.executable, [sys.executable, "-m", "bench", *(["chaos"] if argv[0] == "chaos" else []), *argv[1:]])
    if argv and argv[0] == "sim":  # pure and in-process: no settings, no services
        from sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv and argv[0] == "cells":  # its own file names each cell's database: no BALLAST_* settings
        from ballast.cells import main as cells_main

        return cells_main(argv[1:])
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format=logs.TEXT)
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        settings = Settings()
    except ValidationError as err:  # a bad BALLAST_* variable: say which, no traceback
        print(f"ballast: invalid settings (BALLAST_* environment variables):\n{err}", file=sys.stderr)
        return 2
    if settings.log_format == "json":
        logs.configure("json", "-".join([args.cmd, *([args.kind] if args.cmd == "worker" and args.kind else [])]))
    if args.cmd == "worker" and args.kind in ("drain", "undrain") and not args.id:
        parser.error(f"ballast worker {args.kind} ID: which engine worker (`ballast worker list` shows them)")
    if args.cmd == "up" and args.engines is not None and args.engines < 1:
        parser.error("--engines must be at least 1")
    if args.cmd == "tenants":
        return tenants_cli.main(args, settings)
    return COMMANDS[args.cmd](settings, args)


def _up(settings: Settings, args: argparse.Namespace) -> int:
    from ballast.stack import up

    if args.engines is not None:
        settings = settings.model_copy(update=dict(engines=args.engines))
    return up(settings)


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from ballast.pg import set_password
    from journal.migrate import upgrade

    _need(settings, "database_url")
    owner = settings.require("database_url")
    upgrade(owner, service_url=settings.service_db_url)  # as the owner
    if settings.service_database_password:
        # The migration that creates the role sets its password once; a password changed
        # since (or a role made without one) is applied on every migrate.
        set_password(owner, settings.service_role, settings.service_database_password)
    # Each service's own role is made without one: its password is applied on every migrate.
    for role, password in settings.role_passwords().items():
        set_password(owner, role, password)
    return 0


def _api(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from ballast.procs import freeze_heap, listen_nodelay, notify_ready
    from telemetry import tracing

    _need(settings, "service_db_url", "temporal_address")
    _need_engine_token(settings)
    tracing.setup("ballast-api", settings)  # before the app connects to Temporal: its starts are traced

    def ready() -> None:
        freeze_heap()
        notify_ready()

    config = uvicorn.Config(create_app(settings, on_ready=ready), log_level="warning")
    sockets = [listen_nodelay(settings.api_host, settings.api_port)]
    if settings.admin_port is not None:  # /admin only there (api/app.py, AdminListener)
        sockets.append(listen_nodelay(settings.admin_host, settings.admin_port))
    uvicorn.Server(config).run(sockets=sockets)
    return 0


def _worker(settings: Settings, args: argparse.Namespace) -> int:
    from ballast import workers

    if args.kind in ("list", "drain", "undrain"):
        # As `ballast tenants`: DATABASE_URL, or the running `ballast up`'s embedded Postgres.
        settings = settings.model_copy(update=dict(database_url=tenants_cli.database_url(settings)))
        return asyncio.run(workers.list_or_drain(settings, args.id if args.kind != "list" else None,
                                                 draining=args.kind == "drain"))
    _need(settings, "service_db_url", "temporal_address")
    if args.kind == "control":
        asyncio.run(workers.control_worker(settings))
        return 0
    from engine.vllm_engine import BadVllmFlags

    _need_engine_token(settings)
    try:
        asyncio.run(workers.engine_worker(settings))
    except BadVllmFlags as err:
        sys.exit(f"ballast: {err}")
    return 0


def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from journal.invariants import audit, passed, report

    _need(settings, "database_url")
    findings = audit(settings.require("database_url"), tokenizer=args.tokenizer, model=args.model)
    print(report(findings))
    return 0 if passed(findings) else 1


COMMANDS: dict[str, Callable[[Settings, argparse.Namespace], int]] = dict(
    up=_up, migrate=_migrate, api=_api, worker=_worker, verify=_verify)


if __name__ == "__main__":
    sys.exit(main())
