"""The HTTP(S) front: /metrics (render.py's), a landing page, /-/healthy. One asyncio loop, on
the thread `Front` is, reads every connection (a slow or idle client costs a socket, never a
thread); heads are parsed by h11 (heads.py); worker threads make the answers. Bounds as Go's
net/http has them: a head within HEADER_TIMEOUT_SECONDS (heads.py bounds its size), again
after each keep-alive wait; --web.max-requests answers in flight (503 beyond; one not read
within twice the head's deadline is dropped); GET and HEAD only (405). Keep-alive,
pipelining; TLS with the SSLContext current at accept (rotated certificates). `shutdown`
stops accepting, lets answers in flight finish for SHUTDOWN_GRACE_SECONDS, closes every
connection and the loop: nothing is left for the interpreter to complain about at exit."""

import asyncio
import errno
import gc
import logging
import socket
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from exporter import __version__
from exporter.exposition.connection import Connection
from exporter.exposition.heads import Answer, Request, plain
from exporter.exposition.webconfig import WebConfigSource
from exporter.exposition.webschema import WebConfig

LOG = logging.getLogger("shmwatch.web")

MAX_CONNECTIONS = 512  # beyond, the oldest not yet answered (or else idle) is dropped
READ_BYTES = 16 << 10  # one read: all a connection holds unparsed while it is answered
BACKLOG = 128  # connections waiting to be accepted; 5 would drop SYNs under 50 scrapers
WORKERS = 4  # threads making answers; rendering holds the GIL, more would only wait
HEADER_TIMEOUT_SECONDS = 5.0
IDLE_TIMEOUT_SECONDS = 120.0
# At shutdown, for the answers in flight; then every socket closes.
SHUTDOWN_GRACE_SECONDS = 0.5
# asyncio's socket transport keeps a bound method of itself once closed (CPython 3.11): each
# closed connection leaves ~1 KB in a reference cycle, for the cyclic collector that
# cli.tune_process makes rare. The front collects the youngest generation itself once its
# last connection is closed, or after this many closed.
COLLECT_AFTER_CLOSED = 256
# Paths that answer without credentials: a readiness probe has none, and "OK" tells nothing.
OPEN_PATHS = ("/-/healthy",)

Environ = Dict[str, str]
StartResponse = Callable[..., object]
WsgiApp = Callable[[Environ, StartResponse], Iterable[bytes]]
# An answer that needs no work (a page, a body already rendered), or None: on the loop.
Ready = Callable[[Environ], Optional[Answer]]


def loop_error(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
    """A client gone or a handshake refused is the client's business: one debug line."""
    err = context.get("exception")
    if isinstance(err, (OSError, EOFError)):
        LOG.debug("%s: %s", context.get("message"), err)
    else:
        LOG.error("%s", context.get("message"), exc_info=err)


class Front(threading.Thread):
    """The listening socket, its connections' loop (run() by start()) and answer threads.
    The loop's state (connections, counts) is the loop thread's; other threads call
    start(), shutdown() and read server_address."""

    def __init__(
        self,
        sock: socket.socket,
        app: WsgiApp,
        web: Optional[WebConfigSource],
        max_requests: int,
        ready: Optional[Ready] = None,
    ) -> None:
        super().__init__(name="shmwatch-http", daemon=True)
        self.socket, self.app, self.web, self.ready = sock, app, web, ready
        self.tls = web is not None and web.tls
        self.max_requests, self.in_flight = max_requests, 0
        self.header_timeout = HEADER_TIMEOUT_SECONDS
        self.idle_timeout = IDLE_TIMEOUT_SECONDS
        self.server_address: Tuple[str, int] = sock.getsockname()[:2]
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(loop_error)
        self.workers = ThreadPoolExecutor(min(WORKERS, max_requests), "shmwatch-http")
        self.buffer = memoryview(bytearray(READ_BYTES))
        self.connections: Dict[Connection, None] = {}  # counted against MAX_CONNECTIONS
        self.fresh: Dict[Connection, None] = {}  # never answered, oldest first
        self.idle: Dict[Connection, None] = {}  # waiting again, longest first
        self.live: Set[Connection] = set()  # whose socket is not closed yet
        self.closed_since_collected = 0  # connections closed since collect_young() ran
        self.answers: Set["Future[Answer]"] = set()  # being made by a worker
        self.stopping = False
        self.stop = asyncio.Event()  # bound to the loop when first awaited
        self.all_closed = asyncio.Event()

    @property
    def open(self) -> int:
        return len(self.connections)

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.serve())
        finally:
            self.close_loop()

    def stop_serving(self) -> None:
        """From another thread: begin to stop (see `serve`), without waiting."""
        with suppress(RuntimeError):  # the loop closed already
            self.loop.call_soon_threadsafe(self.stop_on_loop)

    def shutdown(self) -> None:
        """From another thread: stop serving and wait for the loop to close."""
        if not self.is_alive():  # never started, or already closed
            self.socket.close()
            self.workers.shutdown(wait=False)
            return
        self.stop_serving()
        self.join(4 * SHUTDOWN_GRACE_SECONDS + 1)

    def stop_on_loop(self) -> None:
        self.stopping = True
        self.stop.set()

    async def serve(self) -> None:
        """Accepts until shutdown, then accepts no more; gives the connections
        SHUTDOWN_GRACE_SECONDS to close, each once its answer (if one is being made) is
        written and sent; hangs up on the others; lets no task outlive the loop."""
        self.start_accepting()
        await self.stop.wait()
        self.loop.remove_reader(self.socket.fileno())
        self.socket.close()
        for conn in list(self.live):
            conn.close()
        await self.all_closed_within(SHUTDOWN_GRACE_SECONDS)
        for conn in list(self.live):
            conn.abort()
        await self.cancel_tasks()
        # The transports' last callbacks (a TLS one takes a few loop turns).
        await self.all_closed_within(SHUTDOWN_GRACE_SECONDS)
        LOG.debug("HTTP server stopped, %d connections left open", len(self.live))

    async def all_closed_within(self, seconds: float) -> None:
        if self.live:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.all_closed.wait(), seconds)

    async def cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close_loop(self) -> None:
        """After serve(): answers still being made may finish (their results dropped),
        then the loop closes; no task or coroutine is left to be destroyed pending."""
        try:
            self.loop.run_until_complete(self.cancel_tasks())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.socket.close()
            self.workers.shutdown(wait=False, cancel_futures=True)
            # A worker's result lands on the loop: let the ones under way finish first.
            futures.wait(list(self.answers), SHUTDOWN_GRACE_SECONDS)
            self.loop.close()

    def start_accepting(self) -> None:
        if not self.stopping:
            self.loop.add_reader(self.socket.fileno(), self.accept)

    def accept(self) -> None:
        """The connections waiting in the backlog (the socket is readable). A reader, not
        sock_accept(): that one, cancelled at shutdown just as it accepted, raised
        InvalidStateError and lost the socket."""
        for _ in range(BACKLOG):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of file descriptors: wait for some to close
                LOG.warning("cannot accept a connection: %s", err)
                self.loop.remove_reader(self.socket.fileno())
                self.loop.call_later(0.1, self.start_accepting)
                return
            sock.setblocking(False)
            self.admit(sock, str(address[0]))

    def admit(self, sock: socket.socket, peer: str) -> None:
        if (
            len(self.connections) >= MAX_CONNECTIONS
        ):  # never refuse while one merely waits
            victim = next(iter(self.fresh or self.idle), None)
            if victim is None:
                sock.close()
                return
            victim.drop()
        conn = Connection(self, peer)
        self.connections[conn] = None
        self.fresh[conn] = None
        self.live.add(conn)
        conn.task = self.loop.create_task(self.connect(conn, sock))
        # A task cancelled before it began runs none of its code: cleaned up here.
        conn.task.add_done_callback(lambda task: self.connected(conn, sock, task))

    async def connect(self, conn: Connection, sock: socket.socket) -> None:
        """The transport, after the TLS handshake with the context current now, if any."""
        context = self.web.current()[1] if self.web is not None and self.tls else None
        timeout = HEADER_TIMEOUT_SECONDS if context else None
        try:
            await self.loop.connect_accepted_socket(
                lambda: conn, sock, ssl=context, ssl_handshake_timeout=timeout
            )
        except (OSError, asyncio.TimeoutError) as err:
            LOG.debug("connection from %s failed: %s", conn.peer, err or "timed out")
            err.__traceback__ = None  # its frames hold asyncio's waiter, which holds it

    def connected(
        self, conn: Connection, sock: socket.socket, task: "asyncio.Task[Any]"
    ) -> None:
        if task.cancelled() or task.exception() is not None or conn.transport is None:
            if not task.cancelled() and task.exception() is not None:
                LOG.error(
                    "connection from %s failed", conn.peer, exc_info=task.exception()
                )
            sock.close()  # whatever the handshake got to
            self.forget(conn)
            self.closed(conn)

    def forget(self, conn: Connection) -> None:
        if not conn.gone:
            conn.gone = True
            del self.connections[conn]
            self.fresh.pop(conn, None)
            self.idle.pop(conn, None)

    def closed(self, conn: Connection) -> None:
        self.live.discard(conn)
        if self.stopping and not self.live:
            self.all_closed.set()
        self.closed_since_collected += 1
        if not self.live or self.closed_since_collected >= COLLECT_AFTER_CLOSED:
            self.closed_since_collected = 0
            self.loop.call_soon(
                collect_young
            )  # once the transport has let go of its socket

    async def answer(self, request: Request, peer: str) -> Answer:
        config = self.web.current()[0] if self.web is not None else None
        answer = await self.refusal(config, request, peer)
        if answer is None and self.ready is not None:
            answer = self.ready(environ_of(request))  # no thread: nothing to make
        if answer is None:
            self.in_flight += 1  # until release(), once it is written
            try:
                made = self.workers.submit(self.call, request)
                self.answers.add(made)
                made.add_done_callback(self.answers.discard)
                answer = await asyncio.wrap_future(made)
            except BaseException:
                self.in_flight -= 1
                raise
            answer.holds_slot = True
        if config is not None:
            answer.headers.extend(config.headers)
        return answer

    def release(self, answer: Answer) -> None:
        """An answer written (or given up): its slot of --web.max-requests is free."""
        if answer.holds_slot:
            answer.holds_slot = False
            self.in_flight -= 1

    async def refusal(
        self, config: Optional[WebConfig], request: Request, peer: str
    ) -> Optional[Answer]:
        if request.method not in ("GET", "HEAD"):
            return plain(405, [("Allow", "GET, HEAD")])
        if self.web and config and config.users and request.path not in OPEN_PATHS:
            header = request.headers.get("authorization")
            verdict = self.web.authorize(config, header, peer)
            if isinstance(verdict, Future):
                verdict = await asyncio.wrap_future(verdict)
            if verdict is None:  # bcrypt busy: the password may well be right
                return plain(503, [("Retry-After", "1")])
            if not verdict:
                return plain(401, [("WWW-Authenticate", 'Basic realm="shmwatch"')])
        return plain(503) if self.in_flight >= self.max_requests else None

    def call(self, request: Request) -> Answer:
        """The app's answer, in a worker thread (as GET: HEAD drops the body). The environ
        holds what make_app's and render.py's apps read, not all of WSGI's."""
        started: List[Any] = []
        try:
            environ = environ_of(request)
            body = b"".join(self.app(environ, lambda *args: started.extend(args)))
            return Answer(status=started[0], headers=list(started[1]), body=body)
        except Exception:
            LOG.exception("request for %s failed", request.path)
            return plain(500)


def collect_young() -> None:
    """The youngest generation only: a closed transport not yet collected has been there
    since it was made, unless it was alive through a collection (then the next of the
    interpreter's own, which also collects the generation it moved to)."""
    gc.collect(0)


def environ_of(request: Request) -> Environ:
    """What make_app's and render.py's apps read of WSGI's environ."""
    environ = {"PATH_INFO": request.path, "QUERY_STRING": request.query}
    for name, value in request.headers.items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    return environ


class Site:
    """The pages: /metrics (the exposition's), a landing page, /-/healthy. Called, a WSGI
    app (in a worker); `ready`, what needs no work (on the loop thread)."""

    def __init__(
        self, metrics: WsgiApp, telemetry_path: str, metrics_ready: Optional[Ready]
    ) -> None:
        self.metrics, self.telemetry_path = metrics, telemetry_path
        self.metrics_ready = metrics_ready
        landing = (
            f"<html><head><title>shmwatch</title></head><body><h1>shmwatch {__version__}"
            f'</h1><p><a href="{telemetry_path}">Metrics</a></p></body></html>'
        ).encode()
        self.pages = {
            "/": Answer(
                "200 OK", [("Content-Type", "text/html; charset=utf-8")], landing
            ),
            "/-/healthy": Answer("200 OK", [("Content-Type", "text/plain")], b"OK\n"),
        }
        self.not_found = Answer(
            "404 Not Found", [("Content-Type", "text/plain")], b"Not Found\n"
        )

    def __call__(
        self, environ: Environ, start_response: StartResponse
    ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == self.telemetry_path:
            return self.metrics(environ, start_response)
        page = self.pages.get(path, self.not_found)
        start_response(page.status, page.headers)
        return [page.body]

    def ready(self, environ: Environ) -> Optional[Answer]:
        path = environ.get("PATH_INFO", "/")
        if path != self.telemetry_path:
            page = self.pages.get(path, self.not_found)
            return Answer(page.status, list(page.headers), page.body)
        return self.metrics_ready(environ) if self.metrics_ready else None


def make_app(
    metrics_app: WsgiApp,
    telemetry_path: str = "/metrics",
    metrics_ready: Optional[Ready] = None,
) -> Site:
    return Site(metrics_app, telemetry_path, metrics_ready)


def bind(
    host: str,
    port: int,
    app: WsgiApp,
    web: Optional[WebConfigSource] = None,
    max_requests: int = 40,
    ready: Optional[Ready] = None,
) -> Front:
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
        sock.listen(BACKLOG)
    except OSError as err:
        if sock is not None:
            sock.close()
        if not dual or err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
        # No IPv6 (ipv6.disable=1, or a Python without it): ':port' is all of IPv4.
        return bind("0.0.0.0", port, app, web, max_requests, ready)
    sock.setblocking(False)
    return Front(sock, app, web, max_requests, ready)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
