"""`ballast batch|files|models|ft|usage|webhooks|admin|profile|completion`: Ballast's API from a shell.

Every command talks HTTP to the API (ballast/client.py says where and with which key), prints
a table or, with `--json`, the API's own objects (one JSON document on stdout), and exits with
a documented code (`ballast --help`). `batch submit --wait` and `ft create --follow` show live
progress read from the objects the API returns, nothing else.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from functools import update_wrapper
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ballast.client import ApiError, Client, Exit, Profile, config_path, read_profiles, resolve, write_profile
from journal.finetune_store import FINAL
from policy.lifecycle import TERMINAL
from protocol.limits import LIMITS
from protocol.webhooks import EVENT_TYPES

EXIT_CODES = """\b
Exit codes:
  0    success
  1    the batch or job waited on ended failed, expired or cancelled
  2    bad command line
  3    the API refused the request (its message is printed)
  4    no key, or the key may not do this (401, 403)
  5    the API could not be reached, or failed (5xx)
  130  interrupted (submitted work goes on)"""

out = Console(highlight=False, soft_wrap=True)
if not out.is_terminal:  # piped: whole lines, never cut to a terminal's width
    out = Console(highlight=False, soft_wrap=True, width=4096)
err = Console(stderr=True, highlight=False)
if not err.is_terminal:
    err = Console(stderr=True, highlight=False, soft_wrap=True, width=4096)


def _version() -> str:
    try:
        return version("ballast-llm")
    except PackageNotFoundError:
        return "unknown"


class State:
    def __init__(self, flags: tuple[str | None, ...], as_json: bool):
        self.flags, self.as_json = flags, as_json
        self._client: Client | None = None

    @property
    def profile(self) -> Profile:
        """Where to and with which keys, resolved when a command first needs it (so that
        `profile set` can make the profile named)."""
        return resolve(*self.flags)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.profile)
        return self._client


def command(group: click.Group, name: str | None = None, **kw: Any) -> Callable[[Callable[..., Any]], click.Command]:
    """A subcommand with `--json`, whose API errors become their exit codes."""

    def wrap(fn: Callable[..., Any]) -> click.Command:
        def run(state: State, *args: Any, **kwargs: Any) -> None:
            flag = kwargs.pop("as_json")  # `ballast --json …` or `… --json`
            state.as_json = state.as_json or flag
            try:
                code = fn(state, *args, **kwargs)
            except ApiError as e:
                err.print(f"[red]error:[/red] {e}")
                sys.exit(e.code)
            except KeyboardInterrupt:
                err.print("interrupted")
                sys.exit(Exit.INTERRUPTED)
            sys.exit(code or Exit.OK)

        update_wrapper(run, fn)  # its name, help and click parameters
        flagged = click.option("--json", "as_json", is_flag=True, help="Print the API's objects as JSON.")(
            click.pass_obj(run))
        return group.command(name, **kw)(flagged)

    return wrap


@click.group(context_settings=dict(help_option_names=["-h", "--help"], max_content_width=110), epilog=EXIT_CODES)
@click.version_option(_version(), "--version", prog_name="ballast", message="%(prog)s %(version)s")
@click.option("--profile", envvar="BALLAST_PROFILE", help="A profile of the config file (`ballast profile set`).")
@click.option("--base-url", help="The API's URL (BALLAST_BASE_URL, OPENAI_BASE_URL; default http://127.0.0.1:8000).")
@click.option("--api-key", help="A tenant's API key (BALLAST_API_KEY, OPENAI_API_KEY).")
@click.option("--admin-key", help="An admin key, for `ballast admin` (BALLAST_ADMIN_KEY).")
@click.option("--json", "as_json", is_flag=True, help="Print the API's objects as JSON (any command).")
@click.pass_context
def cli(ctx: click.Context, profile: str | None, base_url: str | None, api_key: str | None, admin_key: str | None,
        as_json: bool) -> None:
    """Ballast: durable workload manager for LLM inference on vLLM.

    The client commands (batch, files, models, ft, usage, webhooks, admin) talk to a running API over
    HTTP; the others run Ballast itself (`ballast up` runs everything on this machine).
    """
    ctx.obj = State((profile, base_url, api_key, admin_key), as_json)


# -- output ------------------------------------------------------------------------------


def when(at: float | None) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def emit(state: State, obj: Any, columns: Sequence[tuple[str, Callable[[dict[str, Any]], Any]]] | None = None,
         rows: Iterable[dict[str, Any]] | None = None) -> None:
    """`--json`: the object as the API returned it. Otherwise a table of `rows` (default: the
    object's `data`, or the object itself) by `columns`, or the object's fields."""
    if state.as_json:
        out.print_json(json.dumps(obj)) if out.is_terminal else print(json.dumps(obj, indent=2))
        return
    items = list(rows if rows is not None else obj.get("data", [obj]) if isinstance(obj, dict) else obj)
    if columns is None:
        t = Table(show_header=False, box=None)
        for k, v in (items[0] if items else {}).items():
            t.add_row(k, json.dumps(v) if isinstance(v, dict | list) else str(v))
    else:
        cells = [["-" if (v := get(item)) is None else str(v) for _, get in columns] for item in items]
        t = Table(box=None, header_style="bold")
        for k, (name, _) in enumerate(columns):  # the first column (an id) is never cut short
            t.add_column(name, no_wrap=k == 0, min_width=max((len(r[0]) for r in cells), default=0) if k == 0 else None)
        for row in cells:
            t.add_row(*row)
    out.print(t)


# -- batches ----------------------------------------------------------------------------


@cli.group()
def batch() -> None:
    """Batch jobs (OpenAI's Batch API): submit a JSONL file and wait for its output."""


BATCH_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("ID", lambda b: b["id"]), ("STATUS", lambda b: b["status"]),
    ("DONE", lambda b: f"{b['request_counts']['completed'] + b['request_counts']['failed']}/"
                       f"{b['request_counts']['total']}"),
    ("FAILED", lambda b: b["request_counts"]["failed"]),
    ("PREEMPTIONS", lambda b: (b.get("ballast") or {}).get("preemptions")),
    ("ETA", lambda b: when((b.get("ballast") or {}).get("estimated_completion"))),
    ("CREATED", lambda b: when(b["created_at"])), ("ENDPOINT", lambda b: b["endpoint"])]


def _endpoint_of(path: Path) -> str:
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    url = json.loads(line).get("url")
                except (ValueError, AttributeError):
                    url = None
                if isinstance(url, str):
                    return url
                break
    raise ApiError(Exit.USAGE, f"{path}: its first line names no `url`; give --endpoint")


@command(batch, "submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", help="/v1/chat/completions or /v1/completions (default: the first line's url).")
@click.option("--window", "completion_window", default="24h", show_default=True, help="The completion window.")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Metadata on the batch (repeatable).")
@click.option("--wait", is_flag=True, help="Show progress until it ends, then download its output and errors.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="With --wait: where the output goes (default FILE's name + .output.jsonl).")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False, path_type=Path),
              help="With --wait: where the errors go (default FILE's name + .errors.jsonl).")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between polls while waiting.")
def batch_submit(state: State, file: Path, endpoint: str | None, completion_window: str, metadata: tuple[str, ...],
                 wait: bool, output: Path | None, errors_path: Path | None, interval: float) -> int:
    """Upload FILE, create a batch of it, and with --wait follow it to the end."""
    meta = dict(_pair(m) for m in metadata) or None
    endpoint = endpoint or _endpoint_of(file)
    c = state.client
    with file.open("rb") as f:
        uploaded = c.post("/v1/files", files={"file": (file.name, f)}, data={"purpose": "batch"}, body=None)
    created = c.post("/v1/batches", dict(input_file_id=uploaded["id"], endpoint=endpoint,
                                         completion_window=completion_window, metadata=meta))
    err.print(f"batch {created['id']} created from {file} ({uploaded['bytes']} bytes, {uploaded['id']})")
    if not wait:
        emit(state, created, BATCH_COLUMNS)
        return Exit.OK
    done = _follow_batch(state, created["id"], interval)
    stem = file.with_suffix("") if file.suffix == ".jsonl" else file
    return _finish_batch(state, done, output or Path(f"{stem}.output.jsonl"),
                         errors_path or Path(f"{stem}.errors.jsonl"))


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ApiError(Exit.USAGE, f"--metadata {text!r}: give KEY=VALUE")
    return key, value


def _batch_line(b: dict[str, Any]) -> str:
    n, x = b["request_counts"], b.get("ballast") or {}
    rate = x.get("output_tokens_per_s")
    return (f"{b['status']}: {n['completed']} completed, {n['failed']} failed of {n['total']}"
            f" · {x.get('output_tokens', 0)} tokens" + (f" ({rate:.1f}/s)" if rate else "")
            + f" · {x.get('preemptions', 0)} preemptions"
            + (f" · ETA {when(x['estimated_completion'])}" if x.get("estimated_completion") else ""))


def _follow_batch(state: State, batch_id: str, interval: float) -> dict[str, Any]:
    """Poll the batch until it ends: a live bar on a terminal, a line per change elsewhere
    (stderr either way: stdout keeps what --json prints)."""
    c = state.client
    b = c.get(f"/v1/batches/{batch_id}")
    if err.is_terminal:
        with Progress(TextColumn("[bold]{task.fields[status]}"), BarColumn(), TextColumn("{task.fields[counts]}"),
                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=err, transient=False) as bar:
            task = bar.add_task("batch", total=None, status=b["status"], counts="", detail="")
            while True:
                n, x = b["request_counts"], b.get("ballast") or {}
                rate = x.get("output_tokens_per_s")
                eta = x.get("estimated_completion")
                done = n["completed"] + n["failed"]
                detail = (f"{n['failed']} failed · {rate or 0:.1f} tok/s · {x.get('preemptions', 0)} preemptions"
                          + (f" · ETA {max(0, int(eta - time.time()))}s" if eta else ""))
                bar.update(task, completed=done, total=n["total"] or None, status=b["status"],
                           counts=f"{done}/{n['total']}" if n["total"] else "", detail=detail)
                if b["status"] in TERMINAL:
                    return b
                time.sleep(interval)
                b = c.get(f"/v1/batches/{batch_id}")
    said = ""
    while True:
        line = _batch_line(b)
        if line != said:
            err.print(f"{time.strftime('%H:%M:%S')} {b['id']} {line}")
            said = line
        if b["status"] in TERMINAL:
            return b
        time.sleep(interval)
        b = c.get(f"/v1/batches/{batch_id}")


def _finish_batch(state: State, b: dict[str, Any], output: Path, errors_path: Path) -> int:
    for file_id, dest in ((b.get("output_file_id"), output), (b.get("error_file_id"), errors_path)):
        if file_id:
            size = state.client.download(file_id, dest)
            err.print(f"{dest} ({size} bytes, {file_id})")
    emit(state, b, BATCH_COLUMNS)
    return Exit.OK if b["status"] == "completed" else Exit.UNSUCCESSFUL


@command(batch, "list")
@click.option("--limit", default=20, show_default=True, help="At most this many, newest first (0: all).")
def batch_list(state: State, limit: int) -> int:
    """The tenant's batches, newest first."""
    found = list(state.client.pages("/v1/batches", limit or None))
    emit(state, dict(object="list", data=found), BATCH_COLUMNS)
    return Exit.OK


@command(batch, "get")
@click.argument("batch_id")
def batch_get(state: State, batch_id: str) -> int:
    """One batch: its status, counts, tokens, preemptions and ETA."""
    emit(state, state.client.get(f"/v1/batches/{batch_id}"))
    return Exit.OK


@command(batch, "wait")
@click.argument("batch_id")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between polls.")
def batch_wait(state: State, batch_id: str, interval: float) -> int:
    """Follow a batch to its end (exit 1 unless it completed)."""
    b = _follow_batch(state, batch_id, interval)
    emit(state, b, BATCH_COLUMNS)
    return Exit.OK if b["status"] == "completed" else Exit.UNSUCCESSFUL


@command(batch, "cancel")
@click.argument("batch_id")
def batch_cancel(state: State, batch_id: str) -> int:
    """Cancel a batch: items running stop; what finished is kept in its files."""
    emit(state, state.client.post(f"/v1/batches/{batch_id}/cancel"), BATCH_COLUMNS)
    return Exit.OK


@command(batch, "download")
@click.argument("batch_id")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Default BATCH_ID.output.jsonl.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Default BATCH_ID.errors.jsonl.")
def batch_download(state: State, batch_id: str, output: Path | None, errors_path: Path | None) -> int:
    """Download a batch's output and error files (exit 1 if it has neither yet)."""
    b = state.client.get(f"/v1/batches/{batch_id}")
    if not b.get("output_file_id") and not b.get("error_file_id"):
        err.print(f"batch {batch_id} is {b['status']} and has no output or error file yet")
        return Exit.UNSUCCESSFUL
    _finish_batch(state, b, output or Path(f"{batch_id}.output.jsonl"), errors_path or Path(f"{batch_id}.errors.jsonl"))
    return Exit.OK


# -- files ------------------------------------------------------------------------------


@cli.group()
def files() -> None:
    """Uploaded files, and batches' and fine-tunes' output files."""


FILE_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("ID", lambda f: f["id"]), ("PURPOSE", lambda f: f["purpose"]), ("BYTES", lambda f: f["bytes"]),
    ("CREATED", lambda f: when(f["created_at"])), ("EXPIRES", lambda f: when(f.get("expires_at"))),
    ("FILENAME", lambda f: f["filename"])]


@command(files, "list")
@click.option("--purpose", help="Only files of this purpose (batch, batch_output, fine-tune, …).")
@click.option("--limit", default=100, show_default=True, help="At most this many, newest first (0: all).")
def files_list(state: State, purpose: str | None, limit: int) -> int:
    """The tenant's files, newest first."""
    page = state.client.get("/v1/files", purpose=purpose, limit=limit or None)
    emit(state, page, FILE_COLUMNS)
    return Exit.OK


@command(files, "get")
@click.argument("file_id")
def files_get(state: State, file_id: str) -> int:
    """One file's object."""
    emit(state, state.client.get(f"/v1/files/{file_id}"))
    return Exit.OK


@command(files, "upload")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--purpose", type=click.Choice(["batch", "fine-tune"]), required=True)
def files_upload(state: State, file: Path, purpose: str) -> int:
    """Upload a JSONL file."""
    with file.open("rb") as f:
        emit(state, state.client.post("/v1/files", files={"file": (file.name, f)}, data={"purpose": purpose}),
             FILE_COLUMNS)
    return Exit.OK


@command(files, "delete")
@click.argument("file_id")
def files_delete(state: State, file_id: str) -> int:
    """Delete a file (refused while an open batch reads it)."""
    emit(state, state.client.delete(f"/v1/files/{file_id}"))
    return Exit.OK


@command(files, "download")
@click.argument("file_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Default: FILE_ID.jsonl.")
def files_download(state: State, file_id: str, output: Path | None) -> int:
    """Download a file's content."""
    dest = output or Path(f"{file_id}.jsonl")
    size = state.client.download(file_id, dest)
    emit(state, dict(id=file_id, path=str(dest), bytes=size))
    return Exit.OK


# -- models -----------------------------------------------------------------------------


@cli.group()
def models() -> None:
    """The models this deployment serves, and the tenant's fine-tuned ones."""


@command(models, "list")
def models_list(state: State) -> int:
    """Every model the key may call."""
    emit(state, state.client.get("/v1/models"), [("ID", lambda m: m["id"]), ("OWNED BY", lambda m: m["owned_by"]),
                                                 ("CREATED", lambda m: when(m["created"]))])
    return Exit.OK


# -- fine-tuning ------------------------------------------------------------------------


@cli.group()
def ft() -> None:
    """Fine-tuning jobs (OpenAI's fine-tuning API): train a LoRA adapter, checkpointed."""


JOB_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("ID", lambda j: j["id"]), ("STATUS", lambda j: j["status"]), ("MODEL", lambda j: j["model"]),
    ("FINE-TUNED MODEL", lambda j: j["fine_tuned_model"]), ("TRAINED TOKENS", lambda j: j["trained_tokens"]),
    ("ETA", lambda j: when(j.get("estimated_finish"))), ("CREATED", lambda j: when(j["created_at"]))]


@command(ft, "create")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="The base model.")
@click.option("--validation", "validation", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A validation file (JSONL of chats).")
@click.option("--epochs", "n_epochs", type=int)
@click.option("--batch-size", type=int)
@click.option("--lr-multiplier", "learning_rate_multiplier", type=float)
@click.option("--suffix")
@click.option("--seed", type=int)
@click.option("--follow", is_flag=True, help="Show step, train and validation loss until it ends.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between polls while following.")
def ft_create(state: State, file: Path, model: str, validation: Path | None, n_epochs: int | None,
              batch_size: int | None, learning_rate_multiplier: float | None, suffix: str | None, seed: int | None,
              follow: bool, interval: float) -> int:
    """Upload FILE (and --validation), create a fine-tuning job, and with --follow watch it."""
    c = state.client

    def upload(path: Path) -> str:
        with path.open("rb") as f:
            return c.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "fine-tune"})["id"]

    hp = {k: v for k, v in dict(n_epochs=n_epochs, batch_size=batch_size,
                                learning_rate_multiplier=learning_rate_multiplier).items() if v is not None}
    body: dict[str, Any] = dict(model=model, training_file=upload(file), suffix=suffix, seed=seed,
                                hyperparameters=hp or None)
    if validation is not None:
        body["validation_file"] = upload(validation)
    job = c.post("/v1/fine_tuning/jobs", {k: v for k, v in body.items() if v is not None})
    err.print(f"fine-tuning job {job['id']} created")
    if not follow:
        emit(state, job, JOB_COLUMNS)
        return Exit.OK
    return _follow_job(state, job["id"], interval)


def _follow_job(state: State, job_id: str, interval: float) -> int:
    """Print each new event (steps with their losses) until the job ends."""
    c = state.client
    seen: set[str] = set()
    while True:
        job = c.get(f"/v1/fine_tuning/jobs/{job_id}")
        fresh = [e for e in reversed(c.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=100)["data"])
                 if e["id"] not in seen]
        for e in fresh:
            seen.add(e["id"])
            d = e.get("data") or {}
            if "step" in d:
                loss = f"step {d['step']}" + (f"/{d['total_steps']}" if d.get("total_steps") else "") + \
                    f" · train loss {d['train_loss']:.4f}" + \
                    (f" · validation loss {d['valid_loss']:.4f}" if d.get("valid_loss") is not None else "")
                err.print(f"{when(e['created_at'])} {loss}")
            else:
                err.print(f"{when(e['created_at'])} {e['message']}")
        if job["status"] in FINAL:
            if job.get("error"):
                err.print(f"{job['status']}: {job['error'].get('message')}")
            emit(state, job, JOB_COLUMNS)
            return Exit.OK if job["status"] == "succeeded" else Exit.UNSUCCESSFUL
        time.sleep(interval)


@command(ft, "list")
@click.option("--limit", default=20, show_default=True, help="At most this many, newest first (0: all).")
def ft_list(state: State, limit: int) -> int:
    """The tenant's fine-tuning jobs, newest first."""
    emit(state, dict(object="list", data=list(state.client.pages("/v1/fine_tuning/jobs", limit or None))), JOB_COLUMNS)
    return Exit.OK


@command(ft, "get")
@click.argument("job_id")
def ft_get(state: State, job_id: str) -> int:
    """One job."""
    emit(state, state.client.get(f"/v1/fine_tuning/jobs/{job_id}"))
    return Exit.OK


@command(ft, "follow")
@click.argument("job_id")
@click.option("--interval", default=2.0, show_default=True)
def ft_follow(state: State, job_id: str, interval: float) -> int:
    """Watch a job's steps and losses until it ends (exit 1 unless it succeeded)."""
    return _follow_job(state, job_id, interval)


@command(ft, "events")
@click.argument("job_id")
@click.option("--limit", default=20, show_default=True)
def ft_events(state: State, job_id: str, limit: int) -> int:
    """A job's events, newest first."""
    emit(state, state.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=limit),
         [("CREATED", lambda e: when(e["created_at"])), ("LEVEL", lambda e: e["level"]),
          ("MESSAGE", lambda e: e["message"])])
    return Exit.OK


@command(ft, "checkpoints")
@click.argument("job_id")
@click.option("--limit", default=10, show_default=True)
def ft_checkpoints(state: State, job_id: str, limit: int) -> int:
    """A job's checkpoints, newest first."""
    emit(state, state.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", limit=limit),
         [("ID", lambda k: k["id"]), ("STEP", lambda k: k["step_number"]),
          ("TRAIN LOSS", lambda k: k["metrics"].get("train_loss")), ("CREATED", lambda k: when(k["created_at"])),
          ("CHECKPOINT", lambda k: k["fine_tuned_model_checkpoint"])])
    return Exit.OK


for _verb, _help in (("pause", "Pause a running job at its next checkpoint."),
                     ("resume", "Resume a paused job from its last checkpoint."),
                     ("cancel", "Cancel a job.")):
    def _act(state: State, job_id: str, verb: str = _verb) -> int:
        emit(state, state.client.post(f"/v1/fine_tuning/jobs/{job_id}/{verb}"), JOB_COLUMNS)
        return Exit.OK

    _act.__doc__ = _help
    click.argument("job_id")(command(ft, _verb)(_act))


# -- usage ------------------------------------------------------------------------------


def since_time(text: str) -> int:
    """`7d`, `12h`, `30m` ago; a date or time (ISO 8601, UTC unless it says); or Unix seconds."""
    if m := re.fullmatch(r"(\d+)([mhd])", text):
        return int(time.time()) - int(m[1]) * dict(m=60, h=3600, d=86400)[m[2]]
    if text.isdigit():
        return int(text)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: give 7d, 12h, 30m, an ISO date or Unix seconds") from None
    return int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp())


@command(cli, "usage")
@click.option("--since", default="7d", show_default=True, help="From: 7d, 12h, 30m ago, an ISO date or Unix seconds.")
@click.option("--until", "until", help="To (default now), as --since.")
@click.option("--by", type=click.Choice(["day", "hour", "model", "tier"]), default="day", show_default=True,
              help="One row per day or hour, or per model or service tier over the whole span.")
@click.option("--tenant", help="With an admin key: this tenant only (default every tenant).")
def usage(state: State, since: str, until: str | None, by: str, tenant: str | None) -> int:
    """Settled usage (requests, input and output tokens), as the audit views count it."""
    start = since_time(since)
    end = since_time(until) if until else int(time.time()) + 1
    width = "1h" if by == "hour" else "1d"
    group = dict(model=["model"], tier=["service_tier"]).get(by)
    c = state.client  # a tenant's key sees its own books; an admin key (alone) every tenant's
    buckets, page = [], None
    while True:
        got = c.get("/v1/usage/completions", start_time=start, end_time=end, bucket_width=width,
                    limit=168 if width == "1h" else 31, group_by=group, tenant=tenant, page=page)
        buckets += got["data"]
        if not got["has_more"]:
            break
        page = got["next_page"]
    if state.as_json:
        emit(state, dict(object="page", data=buckets, has_more=False, next_page=None))
        return Exit.OK
    totals: dict[Any, list[int]] = {}
    for b in buckets:
        for r in b["results"]:
            key = r["model"] if by == "model" else r["service_tier"] if by == "tier" else b["start_time"]
            t = totals.setdefault(key, [0, 0, 0])
            t[0] += r["num_model_requests"]
            t[1] += r["input_tokens"]
            t[2] += r["output_tokens"]
    label = {"day": "DAY", "hour": "HOUR", "model": "MODEL", "tier": "TIER"}[by]
    show = (lambda k: when(k)[:10 if by == "day" else 16]) if by in ("day", "hour") else str
    rows: list[dict[str, Any]] = [dict(k=show(k), n=v[0], i=v[1], o=v[2])
                                  for k, v in sorted(totals.items(), key=lambda kv: str(kv[0]))]
    rows.append(dict(k="total", n=sum(r["n"] for r in rows), i=sum(r["i"] for r in rows), o=sum(r["o"] for r in rows)))
    emit(state, rows, [(label, lambda r: r["k"]), ("REQUESTS", lambda r: r["n"]), ("INPUT TOKENS", lambda r: r["i"]),
                       ("OUTPUT TOKENS", lambda r: r["o"])], rows)
    return Exit.OK


# -- admin ------------------------------------------------------------------------------


@cli.group()
def admin() -> None:
    """Tenants, keys, limits, regions, tiers and engine workers, with an admin key (over HTTP:
    no database credentials)."""


TENANT_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("TENANT", lambda t: t["id"]), ("WEIGHT", lambda t: t["weight"]), ("TIERS", lambda t: ",".join(t["tiers"]) or "-"),
    ("REGIONS", lambda t: ",".join(t["regions"]) if t.get("regions") is not None else "anywhere"),
    ("CREATED", lambda t: when(t["created_at"]))]
KEY_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("ID", lambda k: k["id"]), ("TENANT", lambda k: k["tenant"]), ("PREFIX", lambda k: k["prefix"]),
    ("NAME", lambda k: k["name"]), ("CREATED", lambda k: when(k["created_at"])),
    ("REVOKED", lambda k: when(k["revoked_at"]))]


@admin.group("tenants")
def tenants() -> None:
    """Tenants: list, create, erase their content."""


@command(tenants, "list")
def tenants_list(state: State) -> int:
    """Every tenant."""
    emit(state, state.client.get("/admin/tenants"), TENANT_COLUMNS)
    return Exit.OK


@command(tenants, "create")
@click.argument("tenant")
@click.option("--weight", default=1, show_default=True, help="Its fair share within a tier.")
@click.option("--tiers", default="", help="Granted tiers, comma-separated (e.g. priority).")
def tenants_create(state: State, tenant: str, weight: int, tiers: str) -> int:
    """A tenant and its first key (printed once: with --json, in `key.key`)."""
    made = state.client.post("/admin/tenants", dict(id=tenant, weight=weight, tiers=_csv(tiers)))
    if state.as_json:
        emit(state, made)
    else:
        err.print(f"tenant {tenant} created; its key (shown once):")
        print(made["key"]["key"])
    return Exit.OK


@command(tenants, "erase")
@click.argument("tenant")
@click.option("--yes", is_flag=True, help="Do not ask.")
def tenants_erase(state: State, tenant: str, yes: bool) -> int:
    """Erase a tenant's content (files, adapters, requests and outputs); the books stay."""
    if not yes and not click.confirm(f"Erase every file, adapter and generated text of {tenant}?", err=True):
        return Exit.UNSUCCESSFUL
    emit(state, state.client.post(f"/admin/tenants/{tenant}/erase"))
    return Exit.OK


@admin.group("keys")
def keys_group() -> None:
    """API keys: list, create, revoke."""


@command(keys_group, "list")
@click.argument("tenant", required=False)
def keys_list(state: State, tenant: str | None) -> int:
    """A tenant's keys (never the keys themselves); without TENANT, the admin keys."""
    emit(state, state.client.get(f"/admin/tenants/{tenant}/keys" if tenant else "/admin/keys"), KEY_COLUMNS)
    return Exit.OK


@command(keys_group, "create")
@click.argument("tenant", required=False)
@click.option("--name", help="A label for the key.")
def keys_create(state: State, tenant: str | None, name: str | None) -> int:
    """Another key of TENANT; without TENANT, an admin key. Printed once."""
    made = state.client.post(f"/admin/tenants/{tenant}/keys" if tenant else "/admin/keys", dict(name=name))
    if state.as_json:
        emit(state, made)
    else:
        err.print(f"key {made['id']} (shown once):")
        print(made["key"])
    return Exit.OK


@command(keys_group, "revoke")
@click.argument("key_id")
def keys_revoke(state: State, key_id: str) -> int:
    """Revoke a key by its id (key_…)."""
    emit(state, state.client.post(f"/admin/keys/{key_id}/revoke"), KEY_COLUMNS)
    return Exit.OK


@command(admin, "limits")
@click.argument("tenant")
@click.option("--model", default="*", show_default=True, help="The limits' model ('*': every model together).")
@click.option("--set", "sets", multiple=True, metavar="NAME=N|none",
              help=f"Set a limit (repeatable; others of the model stay): {', '.join(LIMITS)}.")
def admin_limits(state: State, tenant: str, model: str, sets: tuple[str, ...]) -> int:
    """Show a tenant's limits, or set some."""
    c = state.client
    if sets:
        held = c.get(f"/admin/tenants/{tenant}/limits")["data"]
        current: dict[str, Any] = next((r for r in held if r["model"] == model), {})
        body = {n: current.get(n) for n in LIMITS}
        for s in sets:
            name, value = _pair(s)
            if name not in LIMITS:
                raise ApiError(Exit.USAGE, f"--set {s!r}: no limit {name!r}; the limits are {', '.join(LIMITS)}")
            if value != "none" and not value.isdigit():
                raise ApiError(Exit.USAGE, f"--set {s!r}: give a whole number or 'none'")
            body[name] = None if value == "none" else int(value)
        c.put(f"/admin/tenants/{tenant}/limits", dict(model=model, **body))
    emit(state, c.get(f"/admin/tenants/{tenant}/limits"),
         [("MODEL", lambda r: r["model"]), *((n.upper(), lambda r, n=n: r[n]) for n in LIMITS)])
    return Exit.OK


@command(admin, "regions")
@click.argument("tenant")
@click.option("--set", "regions", metavar="R1,R2", help="Only engine workers in these regions.")
@click.option("--anywhere", is_flag=True, help="Lift the fence.")
def admin_regions(state: State, tenant: str, regions: str | None, anywhere: bool) -> int:
    """Show where a tenant's work may run, or fence it."""
    c = state.client
    if regions is not None or anywhere:
        emit(state, c.put(f"/admin/tenants/{tenant}/regions", dict(regions=None if anywhere else _csv(regions or ""))),
             TENANT_COLUMNS)
    else:
        emit(state, dict(object="list", data=[t for t in c.get("/admin/tenants")["data"] if t["id"] == tenant]),
             TENANT_COLUMNS)
    return Exit.OK


@command(admin, "tiers")
@click.argument("tenant")
@click.option("--set", "tiers", metavar="T1,T2", help="Grant exactly these tiers ('' for none).")
def admin_tiers(state: State, tenant: str, tiers: str | None) -> int:
    """Show the service tiers a tenant is entitled to, or set them."""
    c = state.client
    if tiers is not None:
        emit(state, c.put(f"/admin/tenants/{tenant}/tiers", dict(tiers=_csv(tiers))), TENANT_COLUMNS)
    else:
        emit(state, dict(object="list", data=[t for t in c.get("/admin/tenants")["data"] if t["id"] == tenant]),
             TENANT_COLUMNS)
    return Exit.OK


@command(admin, "reservations")
@click.argument("tenant", required=False)
@click.option("--model", help="The model's pool the reservation is on (with --slots or --tokens-per-s).")
@click.option("--slots", type=click.IntRange(0), help="Sequence slots to keep for TENANT on --model's pool (0: none).")
@click.option("--tokens-per-s", type=click.IntRange(0),
              help="Or output tokens a second: kept as the slots that give them at the pool's measured rate (0: none).")
@click.option("--region", default="", help="Keep them on that region's engine workers alone (default: anywhere).")
def admin_reservations(state: State, tenant: str | None, model: str | None, slots: int | None,
                       tokens_per_s: int | None, region: str) -> int:
    """Reserved capacity: every reservation in force with what its pool's engine workers
    keep and its requests use now; or TENANT's, with every change to them; or set one."""
    c = state.client
    if slots is not None or tokens_per_s is not None:
        if not tenant or not model:
            raise ApiError(Exit.USAGE, "--slots or --tokens-per-s needs a TENANT and --model")
        if slots is not None and tokens_per_s is not None:
            raise ApiError(Exit.USAGE, "a reservation is in --slots or in --tokens-per-s, not both")
        body = dict(model=model, region=region, **(dict(slots=slots) if slots is not None else
                                                   dict(tokens_per_s=tokens_per_s)))
        c.put(f"/admin/tenants/{tenant}/reservations", body)
    size = [("SLOTS", lambda r: "-" if r["slots"] is None else r["slots"]),
            ("TOKENS/S", lambda r: r.get("tokens_per_s") or "-")]
    if tenant is None:
        emit(state, c.get("/admin/reservations"), [("TENANT", lambda r: r["tenant"]), ("MODEL", lambda r: r["model"]),
                                                   ("REGION", lambda r: r["region"] or "-"), *size,
                                                   ("ON ENGINES", lambda r: r["on_engines"]),
                                                   ("USED", lambda r: r["used"])])
        return Exit.OK
    got = c.get(f"/admin/tenants/{tenant}/reservations")
    emit(state, dict(object="list", data=got["history"]),
         [("MODEL", lambda r: r["model"]), ("REGION", lambda r: r["region"] or "-"), *size,
          ("SET AT", lambda r: r["set_at"]),
          ("BY", lambda r: r["by"])])
    return Exit.OK


@admin.group("engines")
def engines() -> None:
    """Engine workers: list, drain, undrain."""


ENGINE_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("ID", lambda e: e["id"]), ("MODEL", lambda e: e["model"]), ("REGION", lambda e: e["region"] or "-"),
    ("STATE", lambda e: e["state"]), ("RUNNING", lambda e: e["running"]), ("WAITING", lambda e: e["waiting"]),
    ("KV", lambda e: f"{e['kv_cache_usage']:.0%}"), ("INTERACTIVE", lambda e: e["interactive"]),
    ("BATCH", lambda e: e["batch"]), ("URL", lambda e: e["url"])]


@command(engines, "list")
def engines_list(state: State) -> int:
    """The engine workers seen in the last minute, with their load."""
    emit(state, state.client.get("/admin/engines"), ENGINE_COLUMNS)
    return Exit.OK


@command(engines, "drain")
@click.argument("engine_id")
def engines_drain(state: State, engine_id: str) -> int:
    """It takes no new work; its generations finish or move to the others."""
    emit(state, state.client.post(f"/admin/engines/{engine_id}/drain"), ENGINE_COLUMNS)
    return Exit.OK


@command(engines, "undrain")
@click.argument("engine_id")
def engines_undrain(state: State, engine_id: str) -> int:
    """It takes new work again."""
    emit(state, state.client.post(f"/admin/engines/{engine_id}/undrain"), ENGINE_COLUMNS)
    return Exit.OK


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# -- webhooks ---------------------------------------------------------------------------


@cli.group()
def webhooks() -> None:
    """Endpoints that get a signed event when a batch or fine-tuning job ends."""


WEBHOOK_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("ID", lambda w: w["id"]), ("URL", lambda w: w["url"]), ("EVENTS", lambda w: ",".join(w["events"])),
    ("CREATED", lambda w: when(w["created_at"]))]


@command(webhooks, "create")
@click.argument("url")
@click.option("--event", "events", multiple=True, type=click.Choice(EVENT_TYPES),
              help="An event to deliver (repeatable; default every one).")
@click.option("--description")
def webhooks_create(state: State, url: str, events: tuple[str, ...], description: str | None) -> int:
    """Register URL; its signing secret is printed once (with --json, in `secret`)."""
    body: dict[str, Any] = dict(url=url, description=description)
    if events:
        body["events"] = list(events)
    made = state.client.post("/v1/webhooks", body)
    if state.as_json:
        emit(state, made)
    else:
        err.print(f"webhook {made['id']} delivers {', '.join(made['events'])} to {made['url']}; its secret "
                  "(shown once; verify deliveries with it):")
        print(made["secret"])
    return Exit.OK


@command(webhooks, "list")
def webhooks_list(state: State) -> int:
    """The tenant's endpoints."""
    emit(state, state.client.get("/v1/webhooks"), WEBHOOK_COLUMNS)
    return Exit.OK


@command(webhooks, "delete")
@click.argument("webhook_id")
def webhooks_delete(state: State, webhook_id: str) -> int:
    """Deliver nothing more to it (retries of earlier events included)."""
    emit(state, state.client.delete(f"/v1/webhooks/{webhook_id}"))
    return Exit.OK


@command(webhooks, "deliveries")
@click.argument("webhook_id")
@click.option("--limit", default=20, show_default=True)
def webhooks_deliveries(state: State, webhook_id: str, limit: int) -> int:
    """Its recent deliveries: each event, its attempts and how the last one went."""
    emit(state, state.client.get(f"/v1/webhooks/{webhook_id}/deliveries", limit=limit),
         [("EVENT", lambda d: d["event_id"]), ("TYPE", lambda d: d["type"]), ("STATUS", lambda d: d["status"]),
          ("ATTEMPTS", lambda d: d["attempts"]), ("LAST", lambda d: d["last_status_code"] or d["last_error"]),
          ("DELIVERED", lambda d: when(d["delivered_at"]))])
    return Exit.OK


# -- profiles and completion ------------------------------------------------------------


@cli.group()
def profile() -> None:
    """Where the API is and which keys to send, saved in the config file."""


@command(profile, "set")
@click.option("--name", "name", default=None, help="The profile (default: --profile, else `default`).")
@click.option("--url", "url", help="The API's URL.")
@click.option("--key", "key", help="A tenant's API key.")
@click.option("--admin", "admin_key", help="An admin key.")
@click.pass_context
def profile_set(ctx: click.Context, state: State, name: str | None, url: str | None, key: str | None,
                admin_key: str | None) -> int:
    """Save a profile's URL and keys (others it has stay), readable by you alone."""
    name = name or ctx.find_root().params.get("profile") or "default"
    path = write_profile(name, Profile(url, key, admin_key))
    err.print(f"profile {name} saved in {path}")
    return Exit.OK


@command(profile, "show")
def profile_show(state: State) -> int:
    """The profiles saved (keys shown by their first characters), and what this command line resolves to."""
    def masked(p: Profile) -> dict[str, Any]:
        return dict(base_url=p.base_url, api_key=_mask(p.api_key), admin_key=_mask(p.admin_key))

    saved = {n: masked(p) for n, p in read_profiles().items()}
    emit(state, dict(config=str(config_path()), profiles=saved, resolved=masked(state.profile)))
    return Exit.OK


def _mask(key: str | None) -> str | None:
    return key[:14] + "…" if key else None


@cli.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script: `eval "$(ballast completion bash)"` (in ~/.bashrc)."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None
    print(cls(cli, {}, "ballast", "_BALLAST_COMPLETE").source())


def add_passthrough(name: str, help: str, run: Callable[[list[str]], int]) -> None:
    """A command of the server side (argparse: `ballast up -h` is its own help), listed here so
    that `ballast --help` and shell completion show every command."""

    @cli.command(name, help=help, add_help_option=False,
                 context_settings=dict(ignore_unknown_options=True, allow_extra_args=True))
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def passthrough(args: tuple[str, ...]) -> None:
        sys.exit(run([name, *args]))
