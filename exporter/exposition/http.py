"""The HTTP(S) front: /metrics (render.py's), a landing page, /-/healthy. One asyncio loop
reads every connection (a slow or idle client costs a socket, never a thread); worker threads
make the answers. Bounds as Go's net/http has them: a head within HEADER_TIMEOUT_SECONDS
(heads.py bounds its size), --web.max-requests answers in flight (503 beyond; one not read
within twice the head's deadline is dropped), GET and HEAD only (405). Keep-alive,
pipelining; TLS with the SSLContext current at accept (rotated certificates)."""

import asyncio
import errno
import logging
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Dict, Optional

from exporter import __version__
from exporter.exposition.heads import Answer, Head, Refused, message, plain
from exporter.exposition.webconfig import WebConfigSource

LOG = logging.getLogger("shmwatch.web")

MAX_CONNECTIONS = 512  # beyond, the oldest not yet answered (or else idle) is dropped
READ_BYTES = 16 << 10  # one read: all a connection holds unparsed while it is answered
WORKERS = 4  # threads making answers; rendering holds the GIL, more would only wait
HEADER_TIMEOUT_SECONDS = 5.0
IDLE_TIMEOUT_SECONDS = 120.0
NOT_FOUND = ("404 Not Found", "text/plain", b"Not Found\n")
# Paths that answer without credentials: a readiness probe has none, and "OK" tells nothing.
OPEN_PATHS = ("/-/healthy",)


class Connection(asyncio.BufferedProtocol):
    """One client: its head parsed as it arrives, one request answered at a time."""

    def __init__(self, front: "Front", peer: str):
        self.front, self.peer, self.head = front, peer, Head()
        # raw: the socket's transport (the same, or the one under TLS); task: the
        # handshake, then an answer; drained: a future while writing is paused.
        self.transport = self.raw = self.task = self.timer = self.drained = None
        self.rest = b""  # what came after a head, while it is answered
        self.busy = self.served = self.eof = self.gone = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        tls = getattr(transport, "_ssl_protocol", None)
        self.raw = getattr(tls, "_transport", transport)
        self.deadline(HEADER_TIMEOUT_SECONDS)

    def deadline(self, seconds: float) -> None:
        if self.timer:
            self.timer.cancel()
        self.timer = self.front.loop.call_later(seconds, self.expire)

    def expire(self) -> None:
        LOG.debug("connection from %s: no complete request in time", self.peer)
        if self.head.size:
            self.refuse(408)
        else:
            self.transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.front.buffer  # shared: each read is parsed before the next

    def buffer_updated(self, nbytes: int) -> None:
        self.feed(bytes(self.front.buffer[:nbytes]))

    def feed(self, data: bytes) -> None:
        if self.busy:  # a read the pause did not stop
            self.rest += data
            return
        if self.served and not self.head.size:  # the first byte after an idle wait
            self.deadline(HEADER_TIMEOUT_SECONDS)
            self.front.idle.pop(self, None)
        try:
            rest = self.head.feed(data)
            request = None if rest is None else self.head.finish()
        except Refused as refused:
            LOG.debug("request from %s refused: %d", self.peer, refused.args[0])
            return self.refuse(refused.args[0])
        if request is not None:
            self.head, self.rest, self.busy = Head(), rest, True
            self.timer.cancel()
            self.transport.pause_reading()
            self.front.fresh.pop(self, None)
            self.task = self.front.loop.create_task(self.serve(request))

    async def serve(self, request: Head) -> None:
        front, counted = self.front, False
        try:
            config = front.web.current()[0] if front.web else None
            answer = await front.refusal(config, request, self.peer)
            if answer is None:
                front.in_flight, counted = front.in_flight + 1, True
                made = front.loop.run_in_executor(front.workers, front.call, request)
                answer = await made
            if self.gone or self.transport.is_closing():
                return
            answer[1].extend(config.headers if config else ())
            self.transport.write(message(answer, request, request.close or self.eof))
            if self.drained is not None:  # a client that does not read frees its slot
                await asyncio.wait_for(self.drained, 2 * HEADER_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            LOG.debug("connection from %s: the answer was not read in time", self.peer)
            return self.drop()
        except Exception:
            LOG.exception("answering %s failed", self.peer)
            return self.drop()
        finally:
            front.in_flight -= counted
        if self.gone:
            return
        if request.close or self.eof:
            return self.transport.close()
        self.busy, self.served = False, True
        self.deadline(IDLE_TIMEOUT_SECONDS)
        front.idle[self] = None
        self.transport.resume_reading()
        rest, self.rest = self.rest, b""
        if rest:
            self.feed(rest)

    def refuse(self, code: int) -> None:
        """Answer and hang up unread, after half a second to read it (as Go does)."""
        self.busy = True
        self.timer.cancel()
        self.transport.pause_reading()
        self.transport.write(message(plain(code), None, True))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.front.loop.call_later(0.5, self.transport.abort)

    def drop(self) -> None:
        self.front.forget(self)  # now: accept() may not yield before the next one
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # Front.handshake()'s: its socket is closed however far it got

    def pause_writing(self) -> None:
        self.drained = self.front.loop.create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def eof_received(self) -> bool:
        # A half-close after a request still gets its answer (not on TLS).
        self.eof = True
        return self.busy and not self.front.tls

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if exc is not None:
            LOG.debug("connection from %s lost: %s", self.peer, exc)
        if self.timer:
            self.timer.cancel()
        self.resume_writing()
        self.front.forget(self)
        # No cycles left for the collector, which cli.tune_process makes rare: the transports
        # refer to this protocol, and asyncio's socket transport to a method of itself.
        if hasattr(self.raw, "_read_ready_cb"):
            self.raw._read_ready_cb = None
        self.transport = self.raw = self.task = self.timer = None


def loop_error(loop, context) -> None:
    """A client gone or a handshake refused is the client's business: one debug line."""
    err = context.get("exception")
    if isinstance(err, (OSError, EOFError)):
        LOG.debug("%s: %s", context.get("message"), err)
    else:
        LOG.error("%s", context.get("message"), exc_info=err)


class Front(threading.Thread):
    """The listening socket, its connections' loop (run() by start()) and answer threads."""

    def __init__(self, sock, app, web: Optional[WebConfigSource], max_requests: int):
        super().__init__(name="shmwatch-http", daemon=True)
        self.socket, self.app, self.web = sock, app, web
        self.tls = web is not None and web.tls
        self.max_requests, self.in_flight, self.open = max_requests, 0, 0
        self.server_address = sock.getsockname()[:2]  # (host, port)
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(loop_error)
        self.workers = ThreadPoolExecutor(min(WORKERS, max_requests), "shmwatch-http")
        self.buffer = memoryview(bytearray(READ_BYTES))
        self.fresh: Dict[Connection, None] = {}  # never answered, oldest first
        self.idle: Dict[Connection, None] = {}  # waiting again, longest first

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        with suppress(RuntimeError):  # the loop stopped by shutdown()
            self.loop.run_until_complete(self.accept())

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.is_alive():  # not when never started
            self.join(IDLE_TIMEOUT_SECONDS)
        self.socket.close()
        self.workers.shutdown(wait=False)

    async def accept(self) -> None:
        while True:
            try:
                sock, peer = await self.loop.sock_accept(self.socket)
            except OSError as err:  # out of file descriptors: wait for some to close
                LOG.warning("cannot accept a connection: %s", err)
                await asyncio.sleep(0.1)
                continue
            if self.open >= MAX_CONNECTIONS:  # never refuse while one merely waits
                victim = next(iter(self.fresh or self.idle), None)
                if victim is None:
                    sock.close()
                    continue
                victim.drop()
            conn = Connection(self, peer[0])
            self.open += 1
            self.fresh[conn] = None
            conn.task = self.loop.create_task(self.handshake(conn, sock))
            # Cancelled before it began, handshake() ran none of its code: close here.
            conn.task.add_done_callback(lambda t, s=sock: t.cancelled() and s.close())

    async def handshake(self, conn: Connection, sock: socket.socket) -> None:
        context = self.web.current()[1] if self.tls else None
        timeout = HEADER_TIMEOUT_SECONDS if context else None
        try:
            await self.loop.connect_accepted_socket(
                lambda: conn, sock, ssl=context, ssl_handshake_timeout=timeout
            )
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError) as err:
            LOG.debug("connection from %s failed: %s", conn.peer, err or "dropped")
            err.__traceback__ = None  # its frames hold asyncio's waiter, which holds it
            sock.close()
            self.forget(conn)

    def forget(self, conn: Connection) -> None:
        if not conn.gone:
            conn.gone = True
            self.open -= 1
            self.fresh.pop(conn, None)
            self.idle.pop(conn, None)

    async def refusal(self, config, request: Head, peer: str) -> Optional[Answer]:
        if request.method not in ("GET", "HEAD"):
            return plain(405, [("Allow", "GET, HEAD")])
        if config and config.users and request.path not in OPEN_PATHS:
            header = request.headers.get("authorization")
            verdict = self.web.authorize(config, header, peer)
            if isinstance(verdict, Future):
                verdict = await asyncio.wrap_future(verdict)
            if verdict is None:  # bcrypt busy: the password may well be right
                return plain(503, [("Retry-After", "1")])
            if not verdict:
                return plain(401, [("WWW-Authenticate", 'Basic realm="shmwatch"')])
        return plain(503) if self.in_flight >= self.max_requests else None

    def call(self, request: Head) -> Answer:
        """The app's answer, in a worker thread (as GET: HEAD drops the body). The environ
        holds what make_app's and render.py's apps read, not all of WSGI's."""
        environ = {"PATH_INFO": request.path, "QUERY_STRING": request.query}
        for name, value in request.headers.items():
            environ["HTTP_" + name.upper().replace("-", "_")] = value
        started: list = []
        try:
            body = b"".join(self.app(environ, lambda *args: started.extend(args)))
            return started[0], list(started[1]), body
        except Exception:
            LOG.exception("request for %s failed", request.path)
            return plain(500)


def make_app(metrics_app, telemetry_path: str = "/metrics"):
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
        status, kind, body = pages.get(path, NOT_FOUND)
        start_response(status, [("Content-Type", kind)])
        return [body]

    return app


def bind(host: str, port: int, app, web=None, max_requests: int = 40) -> Front:
    # As node_exporter listens: '' (':9841') and '::' take IPv6 and IPv4 both, '0.0.0.0'
    # IPv4 only, '::1' IPv6 only, a name its first address's family.
    dual, sock = host in ("", "::"), None
    family, address = socket.AF_INET6, host or "::"
    try:
        if not dual:
            family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, not dual)
        sock.bind((address, port))
        sock.listen(128)  # 5 would drop SYNs under 50 concurrent scrapers (1 s retries)
    except OSError as err:
        if sock is not None:
            sock.close()
        if not dual or err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
        # No IPv6 (ipv6.disable=1, or a Python without it): ':port' is all of IPv4.
        return bind("0.0.0.0", port, app, web, max_requests)
    sock.setblocking(False)
    return Front(sock, app, web, max_requests)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
