"""Logs: plain lines for a terminal, or JSON lines for a log pipeline (BALLAST_LOG_FORMAT=json),
one object a record: time (UTC, RFC 3339), level, logger, message, the process, and the
fields a record carries (`extra=`): request_id, tenant, tier, model, engine, status,
duration_ms and the like, so one request id finds a request in every process's log."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a LogRecord always has: the rest are the fields a caller passed with `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonLines(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = dict(time=datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                    level=record.levelname.lower(), logger=record.name, message=record.getMessage(),
                    process=self.process)
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(fmt: str, process: str) -> None:
    """The root logger's one handler, to stderr, in `fmt` ("text" or "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines(process) if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
