"""`ballast tenants create | list | keys | new-key | admin-key | revoke | limits | regions | tiers | erase`:
tenants, their keys and their content, straight on the journal's Postgres as its owner.

The database is BALLAST_DATABASE_URL / DATABASE_URL, else the embedded server of a running
`ballast up` in the same data dir (it leaves its URL in data_dir/postgres-url while it
runs). A new key goes to stdout alone, so that `KEY=$(ballast tenants create acme)` works;
everything said about it goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict
from datetime import datetime
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection

from config import Settings
from journal import erasure, tenant_store
from journal.db import connect
from protocol.limits import ANY_MODEL, LIMITS
from protocol.tiers import GRANTED
from storage.objects import ObjectStore

URL_FILE = "postgres-url"  # written by `ballast up` while its embedded Postgres runs


def add_parser(sub: Any) -> None:
    t = sub.add_parser("tenants", help="tenants, their API keys and limits (on the journal's Postgres)")
    cmds = t.add_subparsers(dest="tenants_cmd", required=True)
    c = cmds.add_parser("create", help="a new tenant and its first key (printed once)")
    c.add_argument("name")
    c.add_argument("--weight", type=int, default=1, help="fair share within a tier (default 1)")
    cmds.add_parser("list", help="every tenant")
    k = cmds.add_parser("keys", help="a tenant's keys (never the keys themselves)")
    k.add_argument("name")
    n = cmds.add_parser("new-key", help="another key for a tenant (printed once)")
    n.add_argument("name")
    n.add_argument("--key-name", dest="key_name", help="a label for the key")
    a = cmds.add_parser("admin-key", help="an admin key, of no tenant: it uses /admin and has no /v1 (printed once)")
    a.add_argument("--key-name", dest="key_name", help="a label for the key")
    r = cmds.add_parser("revoke", help="revoke a key by its id (key_…); API processes stop taking it within "
                                       "BALLAST_KEY_CACHE_S")
    r.add_argument("key_id")
    g = cmds.add_parser("regions", help="show where a tenant's work may run, or fence it (API processes apply it "
                                        "within BALLAST_KEY_CACHE_S)")
    g.add_argument("name")
    g.add_argument("--set", dest="regions", metavar="R1,R2", help="only engine workers in these regions "
                                                                 "(their BALLAST_REGION)")
    g.add_argument("--anywhere", action="store_true", help="lift the fence")
    t = cmds.add_parser("tiers", help="show the service tiers a tenant is granted, or set them (API processes "
                                      "apply it within BALLAST_KEY_CACHE_S)")
    t.add_argument("name")
    t.add_argument("--set", dest="tiers", metavar="T1,T2",
                   help=f"grant exactly these (of {', '.join(sorted(GRANTED))}: they run ahead of other tenants')")
    t.add_argument("--none", action="store_true", help="grant none: its requests run at the open tiers")
    lim = cmds.add_parser("limits", help="show a tenant's limits, or set some (others stay; 'none' clears one)")
    lim.add_argument("name")
    lim.add_argument("--model", default=ANY_MODEL,
                     help="the model they apply to (default '*': every model)")
    e = cmds.add_parser("erase", help="erase a tenant's content (files, checkpoints, adapters, and the requests, "
                                      "tokens and responses in its journal events); its events, counts and ledger "
                                      "stay. Refused while its batches or fine-tuning jobs still run")
    e.add_argument("name")
    e.add_argument("--yes", action="store_true", help="do it (without it, say what would be refused and stop)")
    for dim in LIMITS:
        # SUPPRESS: a dimension not given is absent from args, told apart from `none`.
        lim.add_argument("--" + dim.replace("_", "-"), dest=dim, type=_limit, metavar="N|none",
                         default=argparse.SUPPRESS)


def _limit(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number or 'none'") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return n


def database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    path = settings.data_dir.resolve() / URL_FILE
    if path.exists():
        return path.read_text().strip()
    sys.exit(f"ballast: no database: set DATABASE_URL (or BALLAST_DATABASE_URL), or run `ballast up` "
             f"(its embedded Postgres leaves its URL in {path} while it runs)")


def main(args: argparse.Namespace, settings: Settings) -> int:
    url = database_url(settings)
    args.new_limits = settings.new_tenant_limits
    args.store_url = settings.object_store_url
    try:
        return asyncio.run(_run(args, url))
    except OperationalError as err:
        where = "" if settings.database_url else " (is `ballast up` still running?)"
        print(f"ballast: cannot reach Postgres{where}: {err.orig or err}", file=sys.stderr)
        return 1
    except (ValueError, LookupError) as err:  # a bad name, a taken one, an unknown tenant or key
        print(f"ballast: {err}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, url: str) -> int:
    db = connect(url, pool_size=1)
    try:
        async with db.begin() as conn:
            return await _COMMANDS[args.tenants_cmd](conn, args)
    finally:
        await db.dispose()


async def _create(conn: AsyncConnection, args: argparse.Namespace) -> int:
    await tenant_store.create_tenant(conn, args.name, args.weight)
    if args.new_limits:  # BALLAST_NEW_TENANT_LIMITS
        await tenant_store.set_limits(conn, args.name, ANY_MODEL, **args.new_limits)
    key_id, key = await tenant_store.create_key(conn, args.name)
    _say(f"created tenant {args.name} (weight {args.weight}) and key {key_id}; "
         f"its limits: `ballast tenants limits {args.name}`; the key is shown this once:")
    print(key)
    return 0


async def _list(conn: AsyncConnection, args: argparse.Namespace) -> int:
    _table(["TENANT", "WEIGHT", "TIERS", "CREATED"],
           [[t["id"], t["weight"], ",".join(sorted(t["tiers"])) or "-", _when(t["created_at"])]
            for t in await tenant_store.list_tenants(conn)])
    return 0


async def _keys(conn: AsyncConnection, args: argparse.Namespace) -> int:
    rows = await tenant_store.list_keys(conn, args.name)
    _table(["KEY", "PREFIX", "NAME", "ADMIN", "CREATED", "REVOKED"],
           [[k["id"], k["prefix"] + "…", k["name"] or "-", "yes" if k["admin"] else "no", _when(k["created_at"]),
             _when(k["revoked_at"])] for k in rows])
    return 0


async def _new_key(conn: AsyncConnection, args: argparse.Namespace) -> int:
    key_id, key = await tenant_store.create_key(conn, args.name, args.key_name)
    _say(f"created key {key_id} for tenant {args.name}; the key is shown this once:")
    print(key)
    return 0


async def _admin_key(conn: AsyncConnection, args: argparse.Namespace) -> int:
    key_id, key = await tenant_store.create_key(conn, None, args.key_name, admin=True)
    _say(f"created admin key {key_id} (of no tenant: /admin only); the key is shown this once:")
    print(key)
    return 0


async def _revoke(conn: AsyncConnection, args: argparse.Namespace) -> int:
    row = await tenant_store.revoke(conn, args.key_id)
    if row is None:
        raise LookupError(f"No key {args.key_id!r}.")
    print(f"revoked {row['id']} (tenant {row['tenant']}, {row['prefix']}…) at {_when(row['revoked_at'])}")
    return 0


async def _limits(conn: AsyncConnection, args: argparse.Namespace) -> int:
    given = {d: getattr(args, d) for d in LIMITS if hasattr(args, d)}
    if given:
        await tenant_store.set_limits(conn, args.name, args.model, **given)
    rows = await tenant_store.get_limits(conn, args.name)
    if not rows:
        print(f"tenant {args.name} has no limits")
        return 0
    _table(["MODEL", *(d.upper() for d in LIMITS)],
           [[r["model"], *("-" if r[d] is None else r[d] for d in LIMITS)] for r in rows])
    return 0


async def _regions(conn: AsyncConnection, args: argparse.Namespace) -> int:
    if args.regions is not None or args.anywhere:
        regions = None if args.anywhere else [r.strip() for r in args.regions.split(",") if r.strip()]
        if regions is not None and not regions:
            raise ValueError("--set needs at least one region")
        await tenant_store.set_regions(conn, args.name, regions)
    t = await tenant_store.get_tenant(conn, args.name)
    if t is None:
        raise LookupError(f"No tenant {args.name!r}.")
    print(f"tenant {args.name}: " + ("anywhere" if t["regions"] is None else "only in " + ", ".join(t["regions"])))
    return 0


async def _tiers(conn: AsyncConnection, args: argparse.Namespace) -> int:
    if args.tiers is not None or args.none:
        await tenant_store.set_tiers(conn, args.name, [] if args.none else
                                     [t.strip() for t in args.tiers.split(",") if t.strip()])
    t = await tenant_store.get_tenant(conn, args.name)
    if t is None:
        raise LookupError(f"No tenant {args.name!r}.")
    print(f"tenant {args.name}: " + (", ".join(sorted(t["tiers"])) + " granted" if t["tiers"] else
                                     "no tier granted (default and flex are open to every tenant)"))
    return 0


async def _erase(conn: AsyncConnection, args: argparse.Namespace) -> int:
    if await tenant_store.get_tenant(conn, args.name) is None:
        raise tenant_store.UnknownTenant(f"No tenant {args.name!r}.")
    if not args.yes:
        running = await erasure.running_work(conn, args.name)
        _say(f"tenant {args.name}: " + (f"erasing would be refused: still running: {', '.join(running)}" if running
                                        else "nothing runs; `--yes` erases its content, for good"))
        return 1 if running else 0
    try:
        done = await erasure.erase_content(conn, ObjectStore(args.store_url), args.name, "cli", time.time())
    except erasure.StillRunning as err:
        _say(f"ballast: {err}: cancel it, let it end, and erase again")
        return 1
    _say(f"erased the content of tenant {args.name}; its events, counts and ledger stay:")
    _table(["WHAT", "COUNT"], [[k, v] for k, v in asdict(done).items() if isinstance(v, int) and k != "at"])
    return 0


_COMMANDS = dict(create=_create, list=_list, keys=_keys, revoke=_revoke, limits=_limits, regions=_regions,
                 tiers=_tiers, erase=_erase)
_COMMANDS["new-key"] = _new_key
_COMMANDS["admin-key"] = _admin_key


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _when(at: datetime | None) -> str:
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z") if at is not None else "-"


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
