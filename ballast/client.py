"""The client side of `ballast batch|files|models|ft|usage|admin`: where the API is, which
key to send, and the calls, over HTTP only (no database credentials).

Configured as the `openai` and `temporal` CLIs are: flags first, then the environment
(BALLAST_BASE_URL or OPENAI_BASE_URL, BALLAST_API_KEY or OPENAI_API_KEY, BALLAST_ADMIN_KEY),
then a profile in the config file (BALLAST_CONFIG, default ~/.config/ballast/config.toml,
written by `ballast profile set`; BALLAST_PROFILE or --profile picks one, else `default`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000"  # `ballast up`'s API
# What the client reads of the environment: a client's, never a setting of Ballast's processes.
CLIENT_ENV = ("BALLAST_BASE_URL", "BALLAST_API_KEY", "BALLAST_ADMIN_KEY", "BALLAST_PROFILE", "BALLAST_CONFIG")


# Exit codes, documented in docs/cli.md and `ballast --help`.
class Exit:
    OK = 0
    UNSUCCESSFUL = 1  # the work waited on ended failed, expired or cancelled
    USAGE = 2  # a bad command line (click's own code)
    REFUSED = 3  # the API refused the request (a 4xx other than a key's): what it said is printed
    AUTH = 4  # no key, or the key may not do this (401, 403)
    UNREACHABLE = 5  # the API could not be reached, or failed (5xx)
    INTERRUPTED = 130  # Ctrl-C (work already submitted goes on)


class ApiError(Exception):
    """A call that did not succeed, with the exit code it means and OpenAI's error body."""

    def __init__(self, code: int, message: str, status: int | None = None, error: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.status, self.error = code, status, error or {}


@dataclass(frozen=True)
class Profile:
    base_url: str | None = None
    api_key: str | None = None
    admin_key: str | None = None


def config_path() -> Path:
    return Path(os.environ.get("BALLAST_CONFIG") or Path.home() / ".config" / "ballast" / "config.toml")


def read_profiles(path: Path | None = None) -> dict[str, Profile]:
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ApiError(Exit.USAGE, f"cannot read {path}: {err}") from None
    names = {f.name for f in fields(Profile)}
    return {name: Profile(**{k: str(v) for k, v in (body or {}).items() if k in names})
            for name, body in (raw.get("profile") or {}).items()}


def write_profile(name: str, profile: Profile, path: Path | None = None) -> Path:
    """Set the profile's given fields (others kept), in a file only its owner may read."""
    path = path or config_path()
    profiles = read_profiles(path)
    old = profiles.get(name, Profile())
    profiles[name] = replace(old, **{f.name: getattr(profile, f.name) for f in fields(Profile)
                                     if getattr(profile, f.name) is not None})
    lines = []
    for pname, p in sorted(profiles.items()):
        lines.append(f"[profile.{_toml_key(pname)}]")
        lines += [f"{f.name} = {_toml_str(getattr(p, f.name))}" for f in fields(Profile) if getattr(p, f.name)]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines))
    os.chmod(path, 0o600)
    return path


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_key(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else _toml_str(key)


def resolve(profile: str | None, base_url: str | None, api_key: str | None, admin_key: str | None) -> Profile:
    """Flags, then the environment, then the profile."""
    env = os.environ
    name = profile or env.get("BALLAST_PROFILE") or "default"
    saved = read_profiles().get(name)
    if profile and saved is None:
        raise ApiError(Exit.USAGE, f"no profile {profile!r} in {config_path()}; `ballast --profile {profile} "
                                   "profile set --url URL --key KEY` makes one")
    saved = saved or Profile()
    url = base_url or env.get("BALLAST_BASE_URL") or env.get("OPENAI_BASE_URL") or saved.base_url or DEFAULT_BASE_URL
    url = url.rstrip("/")
    url = url[:-3] if url.endswith("/v1") else url  # an OpenAI base URL names /v1 itself
    return Profile(url, api_key or env.get("BALLAST_API_KEY") or env.get("OPENAI_API_KEY") or saved.api_key,
                   admin_key or env.get("BALLAST_ADMIN_KEY") or saved.admin_key)


class Client:
    """The API's /v1 with a tenant's key, and /admin with an admin key."""

    def __init__(self, profile: Profile, timeout: float = 60.0):
        self.profile = profile
        self.http = httpx.Client(base_url=profile.base_url or DEFAULT_BASE_URL, timeout=timeout,
                                 headers={"User-Agent": "ballast-cli"})

    def close(self) -> None:
        self.http.close()

    def _key(self, path: str) -> str:
        admin = path.startswith("/admin")
        key = self.profile.admin_key if admin else (self.profile.api_key or self.profile.admin_key)
        if not key:
            what = "an admin key (BALLAST_ADMIN_KEY, --admin-key)" if admin else \
                "an API key (BALLAST_API_KEY or OPENAI_API_KEY, --api-key)"
            raise ApiError(Exit.AUTH, f"{path} needs {what}, or a profile holding one (`ballast profile set`)")
        return key

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = dict(kw.pop("headers", None) or {}, Authorization=f"Bearer {self._key(path)}")
        try:
            r = self.http.request(method, path, headers=headers, **kw)
        except httpx.HTTPError as err:
            raise ApiError(Exit.UNREACHABLE, f"cannot reach the Ballast API at {self.http.base_url}: {err}. Is it "
                                             "running (`ballast up`), and is BALLAST_BASE_URL right?") from None
        check(r)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()

    def get(self, path: str, **params: Any) -> Any:
        return self.json("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.json("POST", path, json=body, **kw)

    def put(self, path: str, body: Any) -> Any:
        return self.json("PUT", path, json=body)

    def delete(self, path: str) -> Any:
        return self.json("DELETE", path)

    def pages(self, path: str, limit: int | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        """Every object of a cursor-paged list (`after` = the last id seen), up to `limit`."""
        after, seen = None, 0
        while True:
            page = self.get(path, after=after, limit=min(100, limit - seen) if limit else 100, **params)
            for obj in page["data"]:
                yield obj
                seen += 1
                if limit and seen >= limit:
                    return
            if not page.get("has_more") or not page["data"]:
                return
            after = page["data"][-1]["id"]

    def download(self, file_id: str, dest: Path) -> int:
        """A file's content to `dest` (written whole, then moved into place); its size."""
        tmp = dest.with_name(dest.name + ".part")
        try:
            with self.http.stream("GET", f"/v1/files/{file_id}/content",
                                  headers={"Authorization": f"Bearer {self._key('/v1')}"}) as r:
                if r.status_code >= 400:
                    r.read()
                    check(r)
                size = 0
                with tmp.open("wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
                        size += len(chunk)
        except httpx.HTTPError as err:
            tmp.unlink(missing_ok=True)
            raise ApiError(Exit.UNREACHABLE, f"download of {file_id} failed: {err}") from None
        tmp.replace(dest)
        return size


def check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        error = r.json().get("error") or {}
    except ValueError:
        error = {}
    message = error.get("message") or r.text[:500] or r.reason_phrase
    code = Exit.AUTH if r.status_code in (401, 403) else Exit.UNREACHABLE if r.status_code >= 500 else Exit.REFUSED
    raise ApiError(code, f"{r.status_code} {message}", r.status_code, error)
