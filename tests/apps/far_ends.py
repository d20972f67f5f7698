"""Hostile and slow far ends for the outbound tests (issue 13), each on 127.0.0.1 in threads.

* :class:`ScriptedHttp`: answers per path: a status with a body, a trickle (one byte of the
  status line every ``interval`` seconds), a huge body (``size`` bytes streamed), or a delay.
* :func:`self_signed_cert`: a certificate for 127.0.0.1 made with the ``openssl`` CLI.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Seen:
    path: str
    method: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Script:
    status: int = 200
    body: bytes = b"ok"
    trickle_interval: float | None = None  # send the response one byte at a time
    huge_bytes: int = 0  # stream this many bytes of body
    delay: float = 0.0  # sleep before answering


class ScriptedHttp:
    """A local HTTP server whose answer per path is a :class:`Script` (default 200 ``ok``)."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.streamed = 0
        me = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                path = self.path.split("?", 1)[0]
                with me.lock:
                    me.seen.append(Seen(self.path, self.command, dict(self.headers.items()),
                                        body, time.monotonic()))
                script = me.scripts.get(path, Script())
                # the client hanging up (deadline, body cap) is the point of some scripts
                with contextlib.suppress(OSError):
                    self._answer(script)

            def _answer(self, s: Script) -> None:
                if s.delay:
                    time.sleep(s.delay)
                if s.trickle_interval is not None:
                    raw = (f"HTTP/1.1 {s.status} OK\r\nContent-Length: {len(s.body)}\r\n\r\n"
                           ).encode() + s.body
                    for i in range(len(raw)):
                        self.wfile.write(raw[i:i + 1])
                        self.wfile.flush()
                        time.sleep(s.trickle_interval)
                    return
                if s.huge_bytes:
                    self.send_response(s.status)
                    self.send_header("Content-Length", str(s.huge_bytes))
                    self.end_headers()
                    chunk = b"x" * 65536
                    left = s.huge_bytes
                    while left > 0:
                        n = min(left, len(chunk))
                        self.wfile.write(chunk[:n])
                        left -= n
                        with me.lock:
                            me.streamed += n
                    return
                self.send_response(s.status)
                self.send_header("Content-Length", str(len(s.body)))
                self.end_headers()
                self.wfile.write(s.body)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_GET = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedHttp:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Cert:
    cert: Path
    key: Path
    extra: dict[str, Any] = field(default_factory=dict)


def self_signed_cert(directory: Path) -> Cert:
    """A throw-away certificate for ``127.0.0.1`` (CN and subjectAltName IP)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return Cert(cert, key)


class DroppingSmtp:
    """Plain SMTP that accepts ``accept`` mails per session, then hangs up in the middle of
    the next DATA (no reply): a session lost midway through a batch."""

    def __init__(self, accept: int) -> None:
        import socketserver

        self.accept = accept
        self.received: list[bytes] = []
        me = self

        class _H(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.wfile.write(b"220 dropping ESMTP\r\n")
                taken = 0
                while True:
                    line = self.rfile.readline()
                    if not line:
                        return
                    verb = line.decode("ascii", "replace").strip().split(" ", 1)[0].upper()
                    if verb in ("EHLO", "HELO"):
                        self.wfile.write(b"250-dropping\r\n250 8BITMIME\r\n")
                    elif verb == "DATA":
                        self.wfile.write(b"354 go\r\n")
                        data = b""
                        while (chunk := self.rfile.readline()) not in (b".\r\n", b""):
                            data += chunk
                        if taken >= me.accept:
                            return  # hang up without answering
                        taken += 1
                        me.received.append(data)
                        self.wfile.write(b"250 queued\r\n")
                    elif verb == "QUIT":
                        self.wfile.write(b"221 bye\r\n")
                        return
                    else:
                        self.wfile.write(b"250 ok\r\n")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def __enter__(self) -> DroppingSmtp:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
