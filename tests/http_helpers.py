"""Loopback HTTP servers for tests: one around any handler, and one with a single fixed answer (what a trainer
or follower meets at a URL that is not, or no longer, the server it expects)."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from typing import Any


def url_of(server: http.server.HTTPServer) -> str:
    """The base URL of a server :func:`serving` started."""
    return f"http://127.0.0.1:{server.server_address[1]}"


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler], **attributes: Any) -> Iterator[http.server.HTTPServer]:
    """A threaded server on 127.0.0.1 with ``handler``, ``attributes`` set on it (for the handler to read as
    ``self.server.<name>``); stopped and joined after the block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in attributes.items():
        setattr(server, name, value)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def answering(body: bytes, length: int | None = None) -> Iterator[str]:
    """A server answering every GET and POST with status 200 and ``body``, under a ``Content-Length`` of
    ``length`` where given (longer: the answer breaks off); yields its base URL."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.do_GET()

        def log_message(self, *args: Any) -> None:
            pass

    with serving(Answer) as server:
        yield url_of(server)
