"""A webhook receiver for the tests: a threaded HTTP server on 127.0.0.1 that checks every
delivery with the official `openai` client (`webhooks.unwrap`, its signature and
timestamp checks), not with Ballast's code, and keeps what it was sent.

It answers `failing` (say 503) to the first `fail_first` deliveries, as a receiver in an
outage would, 400 to one whose signature does not verify, and 200 to the rest. Started on
a port given beforehand, it can be down first and come up later (`listen`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from openai import InvalidWebhookSignatureError, OpenAI

_SDK = OpenAI(api_key="unused")


@dataclass(frozen=True)
class Delivery:
    webhook_id: str
    timestamp: int
    body: bytes
    headers: dict[str, str]
    answered: int  # the status this receiver answered
    event: Any = None  # what unwrap parsed; None when it refused the signature, or we failed it first


@dataclass
class Receiver:
    port: int = 0  # 0: any free port
    fail_first: int = 0
    failing: int = 503
    secret: str | None = None  # the endpoint's, once registered: every delivery is checked with it
    deliveries: list[Delivery] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/ballast"

    def listen(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, event = receiver._judge(body, headers)
                with receiver._lock:
                    receiver.deliveries.append(Delivery(headers.get("webhook-id", ""),
                                                        int(headers.get("webhook-timestamp", 0) or 0), body, headers,
                                                        status, event))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def _judge(self, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        with self._lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                return self.failing, None
        try:
            return 200, _SDK.webhooks.unwrap(body, headers, secret=self.secret)
        except (InvalidWebhookSignatureError, ValueError):
            return 400, None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def accepted(self) -> list[Delivery]:
        """The deliveries it verified and answered 200."""
        with self._lock:
            return [d for d in self.deliveries if d.answered == 200]

    def wait(self, until: Callable[[Receiver], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not until(self):
            assert time.monotonic() < deadline, f"{what}: {self.deliveries}"
            time.sleep(0.05)
