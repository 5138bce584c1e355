"""The deployment contract: the processes a Ballast deployment runs, the `ballast` command
each runs, and the environment each must be handed.

docker-compose.yml, the Helm chart (deploy/helm/ballast) and a multi-host harness start the
same processes; their tests hold what each of them hands a process against this, so a
setting one of them forgets (the model on the API, the owner's URL on a worker) fails a
test rather than every batch line. The shape is plain data:

    PROCESSES[name] = Process(command=("worker", "engine"), long_running=True,
                              database="engine", needs={...}, never={...})

and `problems(envs)` checks a whole deployment, {process name: its environment}, at once
(`engine-<pool>` names one of several engine pools).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from config.database import SERVICE_ROLES
from config.engine import TINY_MODEL_NAME

# The deployment's model, which the API, the control worker and its engine pool must agree
# on: the API lists it before any engine serves it and the control worker validates batch
# lines against it. Unset anywhere, that process assumes the tiny model. An engine pool of
# another model (`engine-<pool>`) agrees with itself: the API learns that model, and its
# context length, from what its engines announce (policy/pools.py).
MODEL_ENV = ("BALLAST_MODEL", "BALLAST_MAX_MODEL_LEN")

# Where the processes meet: one value in every process that is handed it.
MEETING_ENV = ("BALLAST_TEMPORAL_ADDRESS", "BALLAST_TEMPORAL_NAMESPACE", "BALLAST_CONTROL_QUEUE",
               "BALLAST_ENGINE_QUEUE", "BALLAST_OBJECT_STORE")
SHARED_ENV = (*MEETING_ENV, *MODEL_ENV)

# Never a default, never in a file under version control: a secret store (Kubernetes
# Secrets, compose's .env) hands them over.
# The password `migrate` sets on each service's role (config.database.SERVICE_ROLES).
ROLE_PASSWORD_ENV = tuple(f"BALLAST_{k.upper()}_DATABASE_PASSWORD" for k in SERVICE_ROLES)
SECRET_ENV = ("BALLAST_DATABASE_URL", "DATABASE_URL", "BALLAST_SERVICE_DATABASE_URL",
              "BALLAST_SERVICE_DATABASE_PASSWORD", *ROLE_PASSWORD_ENV, "BALLAST_ENGINE_TOKEN", "BALLAST_METRICS_TOKEN",
              "TEMPORAL_API_KEY")

# A variable a process may be handed under another name, which config reads when it is
# unset: DATABASE_URL, what platforms hand a service; the Temporal SDK's own (config/temporal.py).
ALIASES: dict[str, tuple[str, ...]] = {
    "BALLAST_DATABASE_URL": ("DATABASE_URL",),
    "BALLAST_TEMPORAL_ADDRESS": ("TEMPORAL_ADDRESS",),
    "BALLAST_TEMPORAL_NAMESPACE": ("TEMPORAL_NAMESPACE",),
}

# Every long-running process serves /metrics to whoever holds the metrics token.
_SERVICE = frozenset({*SHARED_ENV, "BALLAST_DATABASE_URL", "BALLAST_METRICS_TOKEN"})
# A service is handed its own role's URL: no role's password, nor the owner's.
_NEVER = frozenset({"BALLAST_SERVICE_DATABASE_PASSWORD", *ROLE_PASSWORD_ENV})


@dataclass(frozen=True)
class Process:
    command: tuple[str, ...]  # argv after `ballast`
    long_running: bool  # False: a one-shot job, run to completion before the others start
    database: Literal["owner", "api", "control", "engine"]  # whose login BALLAST_DATABASE_URL is
    needs: frozenset[str]  # environment variables it must be handed (or one of their ALIASES)
    never: frozenset[str] = frozenset()  # ... and must not be


PROCESSES: dict[str, Process] = {
    # Migrations, as the owner; it also sets each service's role's password.
    "migrate": Process(("migrate",), False, "owner", frozenset({"BALLAST_DATABASE_URL", *ROLE_PASSWORD_ENV})),
    "api": Process(("api",), True, "api",
                   _SERVICE | {"BALLAST_ENGINE_TOKEN", "BALLAST_API_HOST", "BALLAST_API_PORT"}, never=_NEVER),
    # Its probes (/healthz, /readyz) and /metrics listen on a port of their own.
    "control": Process(("worker", "control"), True, "control",
                       _SERVICE | {"BALLAST_CONTROL_HOST", "BALLAST_CONTROL_PORT"},
                       never=_NEVER | {"BALLAST_ENGINE_TOKEN"}),
    "engine": Process(("worker", "engine"), True, "engine",
                      _SERVICE | {"BALLAST_ENGINE_TOKEN", "BALLAST_ENGINE_HOST", "BALLAST_ENGINE_PORT",
                                  "BALLAST_ENGINE_URL"}, never=_NEVER),
}


def kind(name: str) -> str | None:
    """Which process `name` is: a key of PROCESSES, or one of several of a kind
    (`engine-<pool>`, `api-2`)."""
    k = name.split("-", 1)[0]
    return k if k in PROCESSES else None


def value(env: Mapping[str, str], key: str) -> str | None:
    """`key`'s value in `env`, under its own name or, unset, an alias's."""
    for name in (key, *ALIASES.get(key, ())):
        if env.get(name):
            return env[name]
    return None


def served_model(env: Mapping[str, str]) -> str:
    """The model name a process with this environment serves or expects (as
    config.EngineSettings.model_name has it): engines of one pool may load the model from
    another place (a node's directory, a hub id) and still serve the same name."""
    if env.get("BALLAST_SERVED_MODEL_NAME"):
        return env["BALLAST_SERVED_MODEL_NAME"]
    if env.get("BALLAST_MODEL"):
        return env["BALLAST_MODEL"].rstrip("/").split("/")[-1]
    return TINY_MODEL_NAME


def problems(envs: Mapping[str, Mapping[str, str]], *, roles: Mapping[str, str] = SERVICE_ROLES,
             exact_model: bool = True) -> list[str]:
    """What is wrong with a deployment, {process name: its environment}: empty when every
    process is there and handed what it needs, nothing it must not have, the same meeting
    places as the others, the model of its pool (the API's and control worker's, or an engine
    pool's own), and its own role's database login. `exact_model=False` lets the engines of
    a pool load the model from another place, the served name and context length agreeing."""
    found: list[str] = []
    kinds = {name: kind(name) for name in envs}
    found += [f"{name}: not a Ballast process ({', '.join(PROCESSES)})" for name, k in kinds.items() if k is None]
    found += [f"no {k} process" for k in PROCESSES if k not in kinds.values()]
    served: dict[str, str] = {}
    for name, env in envs.items():
        k = kinds[name]
        if k is None:
            continue
        spec = PROCESSES[k]
        found += [f"{name}: {key} is not set" for key in sorted(spec.needs) if not value(env, key)]
        found += [f"{name}: is handed {key}" for key in sorted(spec.never) if key in env]
        url = value(env, "BALLAST_DATABASE_URL")
        user = urlsplit(url).username if url else None
        role = roles.get(spec.database)
        if url and role and user != role:
            found.append(f"{name}: logs in to the journal as {user!r}, not the {spec.database} role {role!r}")
        if url and spec.database == "owner" and user in roles.values():
            found.append(f"{name}: runs migrations as a service's role {user!r}")
        own = env.get("BALLAST_SERVICE_DATABASE_URL")
        if own and role and urlsplit(own).username != role:
            found.append(f"{name}: BALLAST_SERVICE_DATABASE_URL is not the {spec.database} role's ({role!r})")
        if "BALLAST_MODEL" in spec.needs:
            served[name] = served_model(env)
    found += _differing(MEETING_ENV, envs)
    # The control plane's model, and each pool of engines with the processes that expect its model.
    plane = {name: model for name, model in served.items() if kinds[name] != "engine"}
    if len(set(plane.values())) > 1:
        found.append(f"the served model differs: {plane}")
    own = min(plane.values(), default=None)
    pools: dict[str, dict[str, Mapping[str, str]]] = {}
    for name, model in served.items():
        if kinds[name] == "engine" or model == own:
            pools.setdefault(model, {})[name] = envs[name]
    engines = {name: model for name, model in served.items() if kinds[name] == "engine"}
    if own is not None and engines and own not in engines.values():
        found.append(f"the served model differs: the control plane expects {own!r}, no engine serves it: {engines}")
    for members in pools.values():
        found += _differing(MODEL_ENV if exact_model else ("BALLAST_MAX_MODEL_LEN",), members)
    return found


def _differing(keys: tuple[str, ...], envs: Mapping[str, Mapping[str, str]]) -> list[str]:
    found = []
    for key in keys:
        values = {name: v for name, env in envs.items() if (v := value(env, key)) is not None}
        if len(set(values.values())) > 1:
            found.append(f"{key} differs: {values}")
    return found
