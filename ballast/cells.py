"""`ballast cells reconcile | status`: a tenant's global daily limits across regions that are
cells, each with its own journal.

Every cell admits from its own state against its allowance (journal/allowances.py), so it
keeps serving when the others, or this reconciler, are out of reach. Each tick this
reconciler reads every cell's usage of the day, splits what is left of each global limit by
the cells' demand (policy/allowances.py), writes the allowances that go down, waits for the
cells to read them, then writes the ones that go up. It also weighs each cell's share of
the traffic from its live capacity and whether it answered (policy/routing.py) and sets the
weights on an HAProxy edge in front of the cells, where one is named, with the maps that
keep a fenced tenant in its regions and send a key's files, batches and fine-tuning jobs to
its home cell. It holds nothing of
its own: a restarted reconciler picks up from the allowances in force in the cells.

The cells file (TOML), no secret in it: each cell names the environment variable that holds
its URL (a login granted `ballast_cells` there):

    tick_s = 2
    [edge]                 # optional: an HAProxy whose backend `cells` has a server per cell
    haproxy_socket = "/run/haproxy/admin.sock"
    fences_map = "/etc/haproxy/fences.map"   # optional: fenced tenants to their regions
    homes_map = "/etc/haproxy/homes.map"     # optional: a key's files, batches, fine-tunes to one cell
    [[cell]]
    name = "eu-west"
    database_url_env = "CELL_EU_WEST_DATABASE_URL"
    [[limit]]
    tenant = "acme"
    model = "*"            # all its models (the default), or one model
    tokens_per_day = 50_000_000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
import tomllib
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from journal import allowances as store
from journal.db import connect
from policy.admission import DAY_S, window_start
from policy.allowances import CellDay, lowered, split
from policy.routing import CellCapacity, fenced, homes, weights
from protocol.limits import ANY_MODEL

log = logging.getLogger("ballast.cells")
# A cell's demand is smoothed over ticks: the weight of the last tick's rate.
DEMAND_ALPHA = 0.3
# A cell whose quota fold is older than this is named: its usage is stale, and the bound
# assumes its control worker folds every BALLAST_ADMISSION_REFRESH_S.
STALE_FOLD_S = 10.0


def fold_age(s: Seen, now: float) -> float | None:
    """Seconds since the cell's quota fold last ran, as read (None: never, or not read)."""
    at = s.usage.folded_at if s.usage is not None else None
    return None if at is None else max(0.0, now - at.timestamp())
T = TypeVar("T")


@dataclass(frozen=True)
class GlobalLimit:
    tenant: str
    tokens_per_day: int
    model: str = ANY_MODEL


@dataclass(frozen=True)
class Edge:
    """An HAProxy in front of the cells: backend `backend` has a server per cell (named as
    the cell), backend `{backend}_{cell}` that cell's server alone and `{backend}_none` none;
    `fences` is the map file its frontend looks a key's SHA-256 up in to send a fenced
    tenant to its backend, `homes` the one it looks the key up in for calls that make or
    find a file, batch or fine-tuning job (docs/deployment.md). The reconciler sets the
    weights and the maps through its runtime API each tick."""

    socket: str  # its `stats socket … level admin`
    backend: str = "cells"
    fences: str | None = None  # the map files, as the frontend names them
    homes: str | None = None

    async def _ask(self, command: str) -> str:
        reader, writer = await asyncio.open_unix_connection(self.socket)
        try:
            writer.write(command.encode() + b"\n")
            await writer.drain()
            return (await reader.read()).decode().strip()
        finally:
            writer.close()

    async def set_weights(self, weights: Mapping[str, int]) -> None:
        command = "; ".join(f"set server {self.backend}/{c} weight {w}" for c, w in sorted(weights.items()))
        if answer := await self._ask(command):  # it says nothing when every command took
            raise RuntimeError(f"haproxy at {self.socket}: {answer} (to `{command}`)")

    async def set_fences(self, routes: Mapping[str, str]) -> int:
        """Key hash → cell ("": none) in the fences map, changing only what differs; changes made."""
        return 0 if self.fences is None else await self._set_map(self.fences, routes)

    async def held_homes(self) -> dict[str, str]:
        """Key hash → cell, as the homes map has it now."""
        if self.homes is None:
            return {}
        cut = len(self.backend) + 1
        return {k: v[cut:] for k, v in (await self._map(self.homes)).items()}

    async def set_homes(self, routes: Mapping[str, str]) -> int:
        """Key hash → cell in the homes map, changing only what differs; changes made."""
        return 0 if self.homes is None else await self._set_map(self.homes, routes)

    async def _map(self, path: str) -> dict[str, str]:
        held = {}
        for line in (await self._ask(f"show map {path}")).splitlines():
            parts = line.split()
            if len(parts) == 3:  # "<ref> <key> <value>"
                held[parts[1]] = parts[2]
        return held

    async def _set_map(self, path: str, routes: Mapping[str, str]) -> int:
        held = await self._map(path)
        want = {k: f"{self.backend}_{c or 'none'}" for k, c in routes.items()}
        commands = [f"del map {path} {k}" for k in sorted(held.keys() - want.keys())]
        commands += [f"{'set' if k in held else 'add'} map {path} {k} {v}"
                     for k, v in sorted(want.items()) if held.get(k) != v]
        for command in commands:  # one at a time: an answer names the command it is for
            answer = await self._ask(command)
            if answer and not answer.startswith("Done"):
                raise RuntimeError(f"haproxy at {self.socket}: {answer} (to `{command}`)")
        return len(commands)


@dataclass(frozen=True)
class CellsFile:
    cells: dict[str, str]  # name → its database URL
    limits: tuple[GlobalLimit, ...]
    edge: Edge | None = None
    tick_s: float = 2.0
    # How long a cell takes to apply a lower allowance: its API processes read limits every
    # BALLAST_ADMISSION_REFRESH_S (1 s); a margin for a loaded host.
    settle_s: float = 1.5
    # A cell not answering within it is out of reach this tick: a read is ~10 round trips
    # on a new connection (its first), ~6 after; at 250 ms between regions, 2.5 s and 1.5 s.
    timeout_s: float = 5.0


class CellsError(ValueError):
    """The cells file is wrong: the message says where."""


def load(path: Path, env: Mapping[str, str] = os.environ) -> CellsFile:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise CellsError(f"{path}: {err}") from err
    cells: dict[str, str] = {}
    for i, c in enumerate(raw.get("cell", [])):
        name, var = c.get("name"), c.get("database_url_env")
        if not name or not var:
            raise CellsError(f"{path}: [[cell]] #{i + 1} needs `name` and `database_url_env`")
        if name in cells:
            raise CellsError(f"{path}: cell {name!r} is named twice")
        if not env.get(var):
            raise CellsError(f"{path}: cell {name!r}: set {var} to its database URL (a login granted ballast_cells)")
        cells[name] = env[var]
    if not cells:
        raise CellsError(f"{path}: no [[cell]]")
    limits: list[GlobalLimit] = []
    for i, g in enumerate(raw.get("limit", [])):
        n = g.get("tokens_per_day")
        if not g.get("tenant") or not isinstance(n, int) or n < 0:
            raise CellsError(f"{path}: [[limit]] #{i + 1} needs `tenant` and `tokens_per_day` (a whole number ≥ 0)")
        limits.append(GlobalLimit(g["tenant"], n, g.get("model", ANY_MODEL)))
    if len({(g.tenant, g.model) for g in limits}) < len(limits):
        raise CellsError(f"{path}: a tenant × model has two [[limit]]s")
    edge = None
    if (e := raw.get("edge")) is not None:
        if not e.get("haproxy_socket"):
            raise CellsError(f"{path}: [edge] needs `haproxy_socket` (HAProxy's `stats socket … level admin`)")
        edge = Edge(e["haproxy_socket"], e.get("backend", "cells"), e.get("fences_map"), e.get("homes_map"))
    knobs = {k: float(raw[k]) for k in ("tick_s", "settle_s", "timeout_s") if k in raw}
    return CellsFile(cells, tuple(limits), edge, **knobs)


@dataclass
class Seen:
    """A cell as one tick found it."""

    reachable: bool
    usage: store.DayUsage | None = None
    in_force: dict[tuple[str, str], int | None] = field(default_factory=dict)
    capacity: tuple[int, int] = (0, 0)  # its live slots, and those busy with chat
    fenced: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key hash → its tenant's regions
    free: frozenset[str] = frozenset()  # the hash of each live key of a tenant fenced nowhere
    read_at: float = 0.0
    error: str = ""


Scope = tuple[str, str]  # (tenant, model)


@dataclass(frozen=True)
class Plan:
    """A global limit's split this tick: cell → allowance, and each reachable cell's usage
    it was computed from."""

    limit: int
    allowances: dict[str, int]
    used: dict[str, int]


@dataclass(frozen=True)
class Tick:
    """What one tick did: each limit's plan; the cells it could not reach or write (each
    keeps what it holds); for each cell whose allowance went down, the seconds from reading
    it to the lower allowance committed (the reconciler's part of the lag in the bound)."""

    id: str
    day: float
    plans: dict[Scope, Plan]
    unreachable: tuple[str, ...]
    read_to_commit_s: dict[str, float]
    weights: dict[str, int]  # the routing weight of each cell
    fold_age_s: dict[str, float]  # how old each reachable cell's usage was: its fold's last tick


async def within(work: Awaitable[T], timeout_s: float, abandoned: set[asyncio.Future]) -> T:
    """`work`'s result, or TimeoutError after `timeout_s`. A cell cut off mid-query may hold
    its task for as long as TCP takes to give up on the connection (tens of seconds): it is
    cancelled and left in `abandoned` to finish on its own, not waited for."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        abandoned.add(task)
        task.add_done_callback(abandoned.discard)
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return task.result()


class Reconciler:
    def __init__(self, cells: Mapping[str, AsyncEngine], limits: Sequence[GlobalLimit], *,
                 settle_s: float = 1.5, timeout_s: float = 5.0, even: float = 0.2, edge: Edge | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cells = dict(cells)
        self.edge = edge
        self.limits = tuple(limits)
        self.settle_s, self.timeout_s, self.even, self.clock = settle_s, timeout_s, even, clock
        self._last: dict[str, tuple[float, float, dict[tuple[str, str], int]]] = {}  # cell → (day, at, used)
        self._rates: dict[tuple[str, Scope], float] = {}
        # What each cell holds, as this reconciler last read or wrote it: what a cell out of
        # reach is counted as holding.
        self._known: dict[str, dict[tuple[str, str], int | None]] = {}
        self._abandoned: set[asyncio.Future] = set()
        self._fenced: dict[str, str] = {}  # key hash → its cell at the edge

    async def _within(self, work: Awaitable[T]) -> T:
        return await within(work, self.timeout_s, self._abandoned)

    async def read(self, name: str, day: float) -> Seen:
        async def read() -> Seen:
            async with self.cells[name].connect() as conn:
                v = await store.view(conn, day)
            return Seen(True, v.usage, v.in_force, v.capacity, v.fenced, v.free)

        at = self.clock()
        try:
            seen = await self._within(read())
        except Exception as err:  # noqa: BLE001 (any failure leaves the cell out of reach this tick)
            return Seen(False, read_at=at, error=f"{type(err).__name__}: {err}"[:200])
        seen.read_at = at
        return seen

    async def _write(self, name: str, rows: Sequence[store.Allowance]) -> bool:
        async def write() -> None:  # one INSERT: all of it or none, no transaction to open and close
            async with self.cells[name].connect() as conn:
                await store.append(conn, rows)

        try:
            await self._within(write())
        except Exception as err:  # noqa: BLE001 (unknown whether it committed: counted as not)
            log.warning("cells: could not write %s's allowances: %s", name, err)
            return False
        return True

    def _demand(self, seen: Mapping[str, Seen], now: float, day: float) -> dict[tuple[str, Scope], float]:
        """Each reachable cell's demand per limit: the tokens a second it admitted since the
        last tick, smoothed (DEMAND_ALPHA), so that one quiet tick does not take its part."""
        out = {}
        for name, s in seen.items():
            last = self._last.get(name)
            if s.usage is None or not last or last[0] != day or now <= last[1]:
                continue
            for g in self.limits:
                scope = (g.tenant, g.model)
                n, before = s.usage.of(*scope), sum(v for (t, m), v in last[2].items()
                                                     if t == g.tenant and (g.model == ANY_MODEL or m == g.model))
                rate = max(0, n - before) / (now - last[1])
                prev = self._rates.get((name, scope))
                out[(name, scope)] = rate if prev is None else DEMAND_ALPHA * rate + (1 - DEMAND_ALPHA) * prev
        return out

    def _plan(self, seen: Mapping[str, Seen], out: set[str], rates: Mapping[tuple[str, Scope], float]
              ) -> dict[Scope, Plan]:
        plans: dict[Scope, Plan] = {}
        for g in self.limits:
            scope = (g.tenant, g.model)
            days = []
            for name, s in sorted(seen.items()):
                if not s.reachable or name in out:
                    days.append(CellDay(name, False, allowance=self._known.get(name, {}).get(scope)))
                    continue
                assert s.usage is not None
                days.append(CellDay(name, True, s.usage.of(*scope), rates.get((name, scope), 0.0),
                                    s.in_force.get(scope)))
            if any(not d.reachable and d.allowance is None for d in days):
                # A cell out of reach with no allowance known to hold it: nothing bounds what
                # it admits, so no other cell gets more until it is read again.
                log.warning("cells: %s × %s unchanged: a cell out of reach holds no allowance known here", *scope)
                continue
            plans[scope] = Plan(g.tokens_per_day, split(g.tokens_per_day, days, even=self.even),
                                {d.cell: d.used for d in days if d.reachable})
        return plans

    async def tick(self) -> Tick:
        now = self.clock()
        day = window_start(now, DAY_S)
        tick_id = f"{int(now)}-{uuid.uuid4().hex[:8]}"
        names = sorted(self.cells)
        seen = dict(zip(names, await asyncio.gather(*(self.read(n, day) for n in names)), strict=True))
        for name, s in seen.items():
            if s.reachable:
                self._known[name] = dict(s.in_force)
        live = [n for n in names if seen[n].reachable]
        out: set[str] = set()
        committed: dict[str, float] = {}
        # Lower first: until every lowered allowance is in force, no cell gets more. A cell
        # whose write fails may hold its old allowance still: plan again with it out of reach.
        rates = self._demand(seen, now, day)
        while True:
            plans = self._plan(seen, out, rates)
            down = set()
            for scope, plan in plans.items():
                mine = {c: a for c, a in plan.allowances.items() if c in live and c not in out}
                down |= lowered({c: seen[c].in_force.get(scope) for c in mine}, mine)
            failed = set()
            changes = {name: self._changes(name, plans, seen[name], tick_id) for name in sorted(down)}
            wrote = await asyncio.gather(*(self._write(name, rows) for name, rows in changes.items()))
            for (name, rows), ok in zip(changes.items(), wrote, strict=True):
                if ok:
                    committed[name] = self.clock() - seen[name].read_at
                    self._applied(name, rows, seen[name])
                else:
                    failed.add(name)
            if not failed:
                break
            out |= failed
        if committed:
            await asyncio.sleep(self.settle_s)  # the cells read their lower allowances
        raises = {name: rows for name in live if name not in out
                  and (rows := self._changes(name, plans, seen[name], tick_id))}
        wrote = await asyncio.gather(*(self._write(name, rows) for name, rows in raises.items()))
        for (name, rows), ok in zip(raises.items(), wrote, strict=True):
            if ok:
                self._applied(name, rows, seen[name])
        # A global limit taken out of the file: lift what the cells hold for it.
        configured = {(g.tenant, g.model) for g in self.limits}
        for name in live:
            s = seen[name]
            lifted = [store.Allowance(t, m, None, None, s.usage.of(t, m) if s.usage else 0, tick_id)
                      for (t, m), a in s.in_force.items() if a is not None and (t, m) not in configured]
            if name not in out and lifted and await self._write(name, lifted):
                self._applied(name, lifted, s)
        for name in live:
            usage = seen[name].usage
            assert usage is not None
            self._last[name] = (day, seen[name].read_at, dict(usage.tokens))
        self._rates.update(rates)
        unreachable = tuple(n for n in names if n in out or not seen[n].reachable)
        if unreachable:
            log.warning("cells: out of reach this tick: %s (each keeps the allowance it holds)",
                        ", ".join(f"{n} ({seen[n].error or 'write failed'})" for n in unreachable))
        weighed = weights([CellCapacity(n, n not in unreachable, *seen[n].capacity) for n in names])
        if self.edge is not None:
            try:
                await asyncio.wait_for(self.edge.set_weights(weighed), self.timeout_s)
                # A fenced key's regions as its cells that answered say them (a key a cell out
                # of reach holds alone keeps its route: the map is changed, never cleared).
                fences: dict[str, set[str]] = {}
                for n in live:
                    for key, regions in seen[n].fenced.items():
                        fences.setdefault(key, set(regions)).intersection_update(regions)
                routes = fenced({k: sorted(r) for k, r in fences.items()}, weighed)
                if unreachable:  # a key only a cell out of reach still holds keeps its route
                    self._fenced.update(routes)
                else:  # every cell answered: a key none holds any more (revoked) goes
                    self._fenced = routes
                await asyncio.wait_for(self.edge.set_fences(self._fenced), self.timeout_s)
                if not unreachable:  # a home is never moved on a partial read: only a cell holding
                    # the key decides, and one out of reach may be its home
                    held: dict[str, list[str]] = {}
                    for n in names:
                        for key in seen[n].free:
                            held.setdefault(key, []).append(n)
                    routes = homes(held, await asyncio.wait_for(self.edge.held_homes(), self.timeout_s))
                    await asyncio.wait_for(self.edge.set_homes(routes), self.timeout_s)
            except Exception as err:  # noqa: BLE001 (the edge keeps what it had; its own checks go on)
                log.warning("cells: could not update the edge: %s", err)
        ages = {n: age for n in live if (age := fold_age(seen[n], now)) is not None}
        if stale := sorted(n for n in live if ages.get(n, math.inf) > STALE_FOLD_S):
            log.warning("cells: the quota fold of %s is stale or never ran (is its control worker up?): their "
                        "usage is old, and the overshoot bound assumes a fold every refresh", ", ".join(stale))
        return Tick(tick_id, day, plans, unreachable, committed, weighed, ages)

    @staticmethod
    def _changes(name: str, plans: Mapping[Scope, Plan], s: Seen, tick_id: str) -> list[store.Allowance]:
        """The cell's allowances that change this tick."""
        return [store.Allowance(t, m, p.allowances[name], p.limit, p.used.get(name, 0), tick_id)
                for (t, m), p in plans.items() if name in p.allowances and s.in_force.get((t, m)) != p.allowances[name]]

    def _applied(self, name: str, rows: Sequence[store.Allowance], s: Seen) -> None:
        for r in rows:
            s.in_force[(r.tenant, r.model)] = r.tokens_per_day
            self._known.setdefault(name, {})[(r.tenant, r.model)] = r.tokens_per_day


# -- the command -------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ballast cells", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reconcile", help="rebalance the allowances every tick_s until stopped")
    r.add_argument("--once", action="store_true", help="one tick, then exit")
    sub.add_parser("status", help="each cell's usage of the day and allowances in force")
    u = sub.add_parser("usage", help="settled usage per tenant and day in every cell (each one's usage_by_day) "
                                     "and across them all")
    u.add_argument("--days", type=int, default=7, help="from this many UTC days back, today included (7)")
    u.add_argument("--tenant", default=None, help="one tenant only")
    u.add_argument("--json", action="store_true", help="one JSON object a line (an export), not a table")
    for s in (r, sub.choices["status"], u):
        s.add_argument("--file", type=Path, default=Path(os.environ.get("BALLAST_CELLS_FILE", "cells.toml")),
                       help="the cells file (BALLAST_CELLS_FILE, cells.toml)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        conf = load(args.file)
    except CellsError as err:
        print(f"ballast cells: {err}", file=sys.stderr)
        return 2
    if args.cmd == "usage":
        return asyncio.run(_usage(conf, days=args.days, tenant=args.tenant, as_json=args.json))
    return asyncio.run(_reconcile(conf, once=args.once) if args.cmd == "reconcile" else _status(conf))


def _engines(conf: CellsFile) -> dict[str, AsyncEngine]:
    return {n: cell_engine(url, n) for n, url in conf.cells.items()}


def cell_engine(url: str, name: str) -> AsyncEngine:
    """A cell's connections: autocommit, each read and write one statement, and no ping
    before each (a connection that died fails its statement, and the cell is out of reach
    for that tick): one round trip apiece, over a link of a tenth of a second or more."""
    return connect(url, pool_size=2, name=f"ballast-cells:{name}", pre_ping=False).execution_options(
        isolation_level="AUTOCOMMIT")


async def _reconcile(conf: CellsFile, *, once: bool) -> int:
    engines = _engines(conf)
    rec = Reconciler(engines, conf.limits, settle_s=conf.settle_s, timeout_s=conf.timeout_s, edge=conf.edge)
    try:
        while True:
            started = time.monotonic()
            t = await rec.tick()
            # One line a tick, its figures as JSON: what an operator greps, what a bench reads.
            log.info("cells: tick %s", json.dumps(dict(
                id=t.id, at=round(time.time(), 3), took_s=round(time.monotonic() - started, 3),
                unreachable=t.unreachable,
                read_to_commit_s={c: round(s, 4) for c, s in t.read_to_commit_s.items()}, weights=t.weights,
                fold_age_s={c: round(a, 1) for c, a in t.fold_age_s.items()},
                allowances={f"{tenant}/{model}": p.allowances for (tenant, model), p in t.plans.items()})))
            if once:
                return 1 if t.unreachable else 0
            await asyncio.sleep(max(0.0, conf.tick_s - (time.monotonic() - started)))
    finally:
        for e in engines.values():
            await e.dispose()


async def _status(conf: CellsFile) -> int:
    engines = _engines(conf)
    rec = Reconciler(engines, conf.limits, timeout_s=conf.timeout_s)
    now = time.time()
    day = window_start(now, DAY_S)
    try:
        seen = {n: await rec.read(n, day) for n in sorted(engines)}
    finally:
        for e in engines.values():
            await e.dispose()
    rows: list[dict[str, Any]] = []
    for g in conf.limits:
        scope = (g.tenant, g.model)
        for n, s in seen.items():
            rows.append(dict(tenant=g.tenant, model=g.model, limit=g.tokens_per_day, cell=n,
                             used=s.usage.of(*scope) if s.usage else None,
                             allowance=s.in_force.get(scope) if s.reachable else None,
                             state=_state(s, now)))
    print(f"{'tenant':<16} {'model':<16} {'global':>14} {'cell':<12} {'used today':>14} {'allowance':>14}  state")
    for x in rows:
        print(f"{x['tenant']:<16} {x['model']:<16} {x['limit']:>14,} {x['cell']:<12} "
              f"{'' if x['used'] is None else format(x['used'], ','):>14} "
              f"{'' if x['allowance'] is None else format(x['allowance'], ','):>14}  {x['state']}")
    return 0 if all(s.reachable for s in seen.values()) else 1


def _state(s: Seen, now: float) -> str:
    if not s.reachable:
        return f"out of reach: {s.error}"
    age = fold_age(s, now)
    if age is None:
        return "its quota fold never ran: is its control worker up?"
    return f"ok, folded {age:.0f} s ago" if age <= STALE_FOLD_S else f"fold {age:.0f} s old: is its control worker up?"


async def _usage(conf: CellsFile, *, days: int, tenant: str | None, as_json: bool) -> int:
    """Every cell's settled usage by tenant and day, and the sum over the cells that answered."""
    engines = _engines(conf)
    abandoned: set[asyncio.Future] = set()
    since = window_start(time.time(), DAY_S) - (max(1, days) - 1) * DAY_S

    async def one(name: str) -> list[dict[str, Any]]:
        async with engines[name].connect() as conn:
            return await store.settled_by_day(conn, since, tenant)

    names = sorted(engines)
    try:
        got = await asyncio.gather(*(within(one(n), conf.timeout_s, abandoned) for n in names),
                                   return_exceptions=True)
    finally:
        for e in engines.values():
            await e.dispose()
    rows, missing = [], []
    for name, result in zip(names, got, strict=True):
        if isinstance(result, BaseException):
            missing.append(name)
            print(f"ballast cells: {name} did not answer ({type(result).__name__}: {result}); "
                  "the totals leave it out", file=sys.stderr)
            continue
        rows += [dict(r, cell=name) for r in result]
    totals: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        t = totals.setdefault((r["day"], r["tenant"]), dict(day=r["day"], tenant=r["tenant"], cell="*", requests=0,
                                                            input_tokens=0, output_tokens=0))
        for k in ("requests", "input_tokens", "output_tokens"):
            t[k] += r[k]
    out = sorted(rows + list(totals.values()), key=lambda r: (r["day"], r["tenant"], r["cell"] == "*", r["cell"]))
    if as_json:
        for r in out:
            print(json.dumps(dict(r, day=time.strftime("%Y-%m-%d", time.gmtime(r["day"])))))
    else:
        print(f"{'day':<10} {'tenant':<20} {'cell':<12} {'requests':>10} {'input':>14} {'output':>14}")
        for r in out:
            print(f"{time.strftime('%Y-%m-%d', time.gmtime(r['day'])):<10} {r['tenant']:<20} "
                  f"{'all cells' if r['cell'] == '*' else r['cell']:<12} {r['requests']:>10,} "
                  f"{r['input_tokens']:>14,} {r['output_tokens']:>14,}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

