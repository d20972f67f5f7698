"""Local far ends for the outbox tests: an HTTP recorder and a tiny SMTP sink.

Both run in a daemon thread on 127.0.0.1 and record every request / e-mail they receive.
"""

from __future__ import annotations

import json
import socketserver
import threading
from dataclasses import dataclass, field
from email import message_from_bytes
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class HttpRecord:
    path: str
    headers: dict[str, str]
    body: Any


class HttpRecorder:
    """Records each request; answers with the next status of ``statuses`` (then 200)."""

    def __init__(self) -> None:
        self.requests: list[HttpRecord] = []
        self.statuses: dict[str, list[int]] = {}  # path -> statuses to answer in turn
        self.lock = threading.Lock()
        recorder = self

        class _H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                with recorder.lock:
                    body = json.loads(raw or b"null")
                    headers = dict(self.headers.items())
                    recorder.requests.append(HttpRecord(self.path, headers, body))
                    queue = recorder.statuses.get(self.path, [])
                    status = queue.pop(0) if queue else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HttpRecorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class SmtpSink:
    """Accepts every e-mail (just enough SMTP for smtplib) and keeps the parsed messages."""

    messages: list[Message] = field(default_factory=list)
    envelopes: list[tuple[str, list[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        sink = self

        class _H(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.wfile.write(b"220 sink ESMTP\r\n")
                mail_from, rcpts = "", []
                while True:
                    line = self.rfile.readline()
                    if not line:
                        return
                    cmd = line.decode("ascii", "replace").strip()
                    verb = cmd.split(" ", 1)[0].upper()
                    if verb in ("EHLO", "HELO"):
                        self.wfile.write(b"250-sink\r\n250 8BITMIME\r\n")
                    elif verb == "MAIL":
                        mail_from, rcpts = cmd[10:].strip("<> "), []
                        self.wfile.write(b"250 ok\r\n")
                    elif verb == "RCPT":
                        rcpts.append(cmd[8:].strip("<> "))
                        self.wfile.write(b"250 ok\r\n")
                    elif verb == "DATA":
                        self.wfile.write(b"354 go\r\n")
                        data = b""
                        while True:
                            chunk = self.rfile.readline()
                            if chunk in (b".\r\n", b""):
                                break
                            data += chunk[1:] if chunk.startswith(b"..") else chunk
                        sink.messages.append(message_from_bytes(data))
                        sink.envelopes.append((mail_from, rcpts))
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

    def __enter__(self) -> SmtpSink:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
