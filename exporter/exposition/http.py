"""The HTTP(S) endpoint: /metrics (or --web.telemetry-path, render.py's), a landing page,
/-/healthy. Each accepted connection is wrapped with the web config's SSLContext current at
that moment (webconfig.py), so a rotated certificate serves from the next connection on.
"""

from __future__ import annotations

import errno
import io
import logging
import socket
import sys
import threading
from typing import Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from exporter import __version__
from exporter.exposition.webconfig import WebConfigSource, wrap_app

LOG = logging.getLogger("shmwatch.web")


class _LogStream(io.StringIO):
    """wsgiref prints an application's traceback to the handler's stderr, line by line:
    collect it and log it as one record, so stderr stays valid logfmt/JSON."""

    def flush(self) -> None:
        if self.getvalue():
            LOG.error("request failed: %s", self.getvalue().rstrip())
            self.seek(0)
            self.truncate()


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # a client that connects and says nothing is dropped, not waited on

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib's name
        pass  # one line per scrape on stderr helps nobody

    def get_stderr(self):
        return _LogStream()


def make_app(
    registry: CollectorRegistry,
    telemetry_path: str = "/metrics",
    web: Optional[WebConfigSource] = None,
    metrics_app=None,
):
    metrics_app = metrics_app or make_wsgi_app(registry)
    landing = (
        f"<html><head><title>shmwatch</title></head><body><h1>shmwatch {__version__}</h1>"
        f'<p><a href="{telemetry_path}">Metrics</a></p></body></html>'
    ).encode()
    pages = {  # path -> status, content type, body
        "/": ("200 OK", "text/html; charset=utf-8", landing),
        "/-/healthy": ("200 OK", "text/plain", b"OK\n"),
    }

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path == telemetry_path:
            return metrics_app(environ, start_response)
        status, kind, body = pages.get(
            path, ("404 Not Found", "text/plain", b"Not Found\n")
        )
        start_response(status, [("Content-Type", kind)])
        return [body]

    return wrap_app(app, web) if web is not None else app


def listen_family(host: str) -> Tuple[int, str, bool]:
    """-> (address family, address, dual-stack?) as node_exporter listens: '' (':9841') and
    '::' take IPv6 and IPv4 both, '0.0.0.0' IPv4 only, '::1' IPv6 only, a name its first."""
    if host in ("", "::"):
        return socket.AF_INET6, "::", True
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    return family, host, False


def bind(
    host: str, port: int, app, web: Optional[WebConfigSource] = None
) -> ThreadingWSGIServer:
    family, address, dual = listen_family(host)
    if dual and not socket.has_ipv6:
        family, address, dual = socket.AF_INET, "0.0.0.0", False
    tls = web is not None and web.tls

    class Server(ThreadingWSGIServer):
        address_family = family
        # socketserver's backlog of 5 drops SYNs under 50 concurrent scrapers (1 s retries).
        request_queue_size = 128

        def server_bind(self):
            if self.address_family == socket.AF_INET6:
                self.socket.setsockopt(
                    socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual else 1
                )
            super().server_bind()

        def get_request(self):
            sock, peer = self.socket.accept()
            if tls:
                # The context current now (rebuilt when the certificate changed); the
                # handshake happens in the request's own thread, so a client that stalls
                # mid-handshake cannot block accept() for everyone else.
                _, context = web.current()
                sock = context.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            return sock, peer

        def handle_error(self, request, client_address):
            # A refused handshake or a client gone mid-answer is the client's problem: one
            # debug line, not socketserver's traceback on stderr.
            err = sys.exc_info()[1]
            LOG.debug("connection from %s failed: %s", client_address[0], err)

    try:
        httpd = Server((address, port), _QuietHandler)
    except OSError as err:
        if not dual or err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
        # A kernel without IPv6 (ipv6.disable=1): all of IPv4 is what ':port' can mean.
        return bind("0.0.0.0", port, app, web)
    httpd.set_app(app)
    return httpd


def serve_in_thread(httpd: ThreadingWSGIServer) -> threading.Thread:
    thread = threading.Thread(
        target=httpd.serve_forever, name="shmwatch-http", daemon=True
    )
    thread.start()
    return thread


def bound_address(httpd: ThreadingWSGIServer) -> Tuple[str, int]:
    return httpd.server_address[0], httpd.server_address[1]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
