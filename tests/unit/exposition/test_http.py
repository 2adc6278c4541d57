# mypy: allow-untyped-calls
"""The HTTP front's answers and deadlines as a client meets them, through real sockets on
loopback with the deadlines shortened: a head must arrive within the header deadline (a
trickling one gets 408, a silent one is closed), a keep-alive connection waits for the idle
deadline and re-arms the header deadline at the next request's first byte, requests beyond
--web.max-requests get 503, the oldest unanswered connection makes room at the cap.
Behaviour only (no internals): the front's request parsing may change beneath it. Part of
the mutation selection."""

import asyncio
import base64
import logging
import socket
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional

import bcrypt
import pytest

from exporter.exposition import http
from exporter.exposition.http import Site, bind, loop_error, make_app, url_host
from exporter.exposition.webconfig import WebConfigSource
from exporter.exposition.webschema import WebConfig

Environ = Dict[str, str]
StartResponse = Callable[..., object]
HEADER, IDLE = 0.2, 0.7  # the deadlines, shortened


def metrics(environ: Environ, start_response: StartResponse) -> List[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"shmwatch_up 1\n"]


class Server:
    def __init__(
        self,
        app: Optional[Site] = None,
        web: Optional[WebConfigSource] = None,
        max_requests: int = 40,
    ) -> None:
        self.front = bind("127.0.0.1", 0, app or make_app(metrics), web, max_requests)
        self.front.start()
        self.port = self.front.server_address[1]

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        return sock

    def ask(self, data: bytes, sock: Optional[socket.socket] = None) -> bytes:
        """Sends `data` on a new connection (or `sock`) and reads until the server closes."""
        sock = sock or self.connect()
        with sock:
            sock.sendall(data)
            return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def read_answer(sock: socket.socket) -> bytes:
    """One answer (head and Content-Length body) from a kept-alive connection, and not a byte
    of the next one; EOFError when the server hangs up first."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        if not byte:
            raise EOFError(f"closed after {head!r}")
        head += byte
    lengths = [
        line.split(b":")[1]
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    ]
    body, length = b"", int(lengths[0])
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise EOFError(f"closed after {head + body!r}")
        body += chunk
    return head + body


def status(answer: bytes) -> bytes:
    return answer.split(b"\r\n", 1)[0]


@pytest.fixture
def short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "HEADER_TIMEOUT_SECONDS", HEADER)
    monkeypatch.setattr(http, "IDLE_TIMEOUT_SECONDS", IDLE)


@pytest.fixture
def server(short: None) -> Iterator[Server]:
    s = Server()
    yield s
    s.front.shutdown()


# Every HTTP/1.1 request names its Host: the front (h11) answers 400 to one without.
GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def test_the_pages_and_methods(server: Server) -> None:
    close = b"Connection: close\r\n\r\n"
    answer = server.ask(GET[:-2] + close)
    assert status(answer) == b"HTTP/1.1 200 OK" and answer.endswith(
        b"\r\n\r\nshmwatch_up 1\n"
    )
    assert b"Connection: close" in answer and b"Content-Length: 14" in answer
    head = server.ask(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n" + close)
    assert (
        status(head) == b"HTTP/1.1 200 OK"
        and head.endswith(b"\r\n\r\n")
        and b"Content-Length: 14" in head
    )
    post = server.ask(b"POST /metrics HTTP/1.1\r\nHost: x\r\n" + close)
    assert (
        status(post) == b"HTTP/1.1 405 Method Not Allowed"
        and b"Allow: GET, HEAD" in post
    )
    landing = server.ask(b"GET / HTTP/1.1\r\nHost: x\r\n" + close)
    assert (
        b'<a href="/metrics">Metrics</a>' in landing
        and b"text/html; charset=utf-8" in landing
    )
    assert server.ask(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n" + close).endswith(b"\r\n\r\nOK\n")
    assert (
        status(server.ask(b"GET /nope HTTP/1.1\r\nHost: x\r\n" + close))
        == b"HTTP/1.1 404 Not Found"
    )
    assert (
        status(server.ask(b"GET / HTTP/2.0\r\n\r\n"))
        == b"HTTP/1.1 505 HTTP Version Not Supported"
    )


def test_keep_alive_and_pipelining(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(GET + b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        first, second = read_answer(sock), read_answer(sock)
        assert first.endswith(b"shmwatch_up 1\n") and second.endswith(b"OK\n")
        sock.sendall(GET)
        assert read_answer(sock).endswith(b"shmwatch_up 1\n")


def test_http_1_0_keeps_alive_only_when_asked(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /-/healthy HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        answer = read_answer(sock)
        assert b"Connection: keep-alive" in answer
    assert b"Connection: close" in server.ask(b"GET /-/healthy HTTP/1.0\r\n\r\n")


def test_a_silent_connection_is_closed_at_the_header_deadline(server: Server) -> None:
    with server.connect() as sock:
        started = time.monotonic()
        assert read_all(sock) == b""
        assert HEADER * 0.8 < time.monotonic() - started < IDLE


def test_a_trickling_head_gets_408_at_the_header_deadline(server: Server) -> None:
    with server.connect() as sock:
        started = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        answer = read_all(sock)
        assert status(answer) == b"HTTP/1.1 408 Request Timeout"
        assert HEADER * 0.8 < time.monotonic() - started < IDLE


def test_a_kept_alive_connection_waits_for_the_idle_deadline(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(GET)
        read_answer(sock)
        time.sleep(HEADER * 2)  # past the header deadline: idle, not timed out
        sock.sendall(GET)
        assert read_answer(sock).endswith(b"shmwatch_up 1\n")
        started = time.monotonic()
        assert read_all(sock) == b""  # then closed at the idle deadline
        assert IDLE * 0.8 < time.monotonic() - started < IDLE * 3


def test_the_header_deadline_is_rearmed_at_the_next_requests_first_byte(
    server: Server,
) -> None:
    """A second request trickling after a keep-alive wait is held to the header deadline from
    its first byte, not to the idle one (the issue's planted bug: held up to 120 s)."""
    with server.connect() as sock:
        sock.sendall(GET)
        read_answer(sock)
        time.sleep(HEADER / 2)
        started = time.monotonic()
        sock.sendall(b"G")
        answer = read_all(sock)
        assert status(answer) == b"HTTP/1.1 408 Request Timeout"
        assert time.monotonic() - started < IDLE * 0.8


def test_requests_beyond_max_requests_get_503_at_once(short: None) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(environ: Environ, start_response: StartResponse) -> List[bytes]:
        entered.set()
        release.wait(5)
        return metrics(environ, start_response)

    s = Server(make_app(slow), max_requests=1)
    try:
        first = s.connect()
        first.sendall(GET)
        assert entered.wait(5)
        started = time.monotonic()
        busy = s.ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (
            status(busy) == b"HTTP/1.1 503 Service Unavailable"
            and time.monotonic() - started < 1
        )
        release.set()
        assert read_answer(first).endswith(b"shmwatch_up 1\n")
        first.close()
        ok = s.ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status(ok) == b"HTTP/1.1 200 OK"  # its slot is free again
    finally:
        release.set()
        s.front.shutdown()


def test_an_app_that_fails_answers_500_and_the_connection_goes_on(
    server: Server, short: None
) -> None:
    def broken(environ: Environ, start_response: StartResponse) -> List[bytes]:
        raise RuntimeError("bug")

    s = Server(make_app(broken))
    try:
        with s.connect() as sock:
            sock.sendall(GET)
            assert status(read_answer(sock)) == b"HTTP/1.1 500 Internal Server Error"
            sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(sock).endswith(b"OK\n")
    finally:
        s.front.shutdown()


def test_the_app_sees_the_path_query_and_headers(short: None) -> None:
    seen: List[Environ] = []

    def app(environ: Environ, start_response: StartResponse) -> List[bytes]:
        seen.append(environ)
        return metrics(environ, start_response)

    s = Server(make_app(app, "/m"))
    try:
        s.ask(
            b"GET /m?name[]=x HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n"
        )
    finally:
        s.front.shutdown()
    [environ] = seen
    assert (
        environ["PATH_INFO"],
        environ["QUERY_STRING"],
        environ["HTTP_ACCEPT_ENCODING"],
    ) == ("/m", "name[]=x", "gzip")


def test_a_half_closed_client_still_gets_its_answer(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(GET)
        sock.shutdown(socket.SHUT_WR)
        answer = read_all(sock)
    assert answer.endswith(b"shmwatch_up 1\n")  # and then the connection closed


def test_at_the_connection_cap_the_oldest_unanswered_connection_makes_room(
    short: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    s = Server()
    try:
        oldest, newer = s.connect(), s.connect()
        time.sleep(0.05)
        answer = s.ask(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.endswith(b"OK\n")
        assert oldest.recv(10) == b""  # dropped to make room
        newer.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(newer).endswith(b"OK\n")
        oldest.close()
        newer.close()
    finally:
        s.front.shutdown()


def basic(user: str, password: str) -> bytes:
    return (
        b"Authorization: Basic "
        + base64.b64encode(f"{user}:{password}".encode())
        + b"\r\n"
    )


def test_basic_auth_guards_every_page_but_health(short: None) -> None:
    users = {"alice": bcrypt.hashpw(b"wonderland", bcrypt.gensalt(4))}
    web = WebConfigSource(
        fixed=WebConfig(users=users, headers=(("X-Frame-Options", "deny"),))
    )
    s = Server(web=web)
    try:
        refused = s.ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (
            status(refused) == b"HTTP/1.1 401 Unauthorized"
            and b'WWW-Authenticate: Basic realm="shmwatch"' in refused
        )
        wrong = s.ask(
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
            + basic("alice", "x")
            + b"Connection: close\r\n\r\n"
        )
        assert status(wrong) == b"HTTP/1.1 401 Unauthorized"
        right = s.ask(
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
            + basic("alice", "wonderland")
            + b"Connection: close\r\n\r\n"
        )
        assert status(right) == b"HTTP/1.1 200 OK" and b"X-Frame-Options: deny" in right
        health = s.ask(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status(health) == b"HTTP/1.1 200 OK"
    finally:
        s.front.shutdown()


def test_listening_addresses() -> None:
    assert (url_host("::1"), url_host("127.0.0.1")) == ("[::1]", "127.0.0.1")
    front = bind("", 0, make_app(metrics))
    try:
        assert front.socket.family == socket.AF_INET6
        assert front.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    finally:
        front.shutdown()
    front = bind("::1", 0, make_app(metrics))
    try:
        assert front.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert front.server_address[0] == "::1"
    finally:
        front.shutdown()
    taken = bind("127.0.0.1", 0, make_app(metrics))
    try:
        with pytest.raises(OSError):
            bind("127.0.0.1", taken.server_address[1], make_app(metrics)).shutdown()
    finally:
        taken.shutdown()


def slow_server(
    entered: threading.Event, release: threading.Event, max_requests: int = 40
) -> Server:
    def slow(environ: Environ, start_response: StartResponse) -> List[bytes]:
        entered.set()
        release.wait(2)
        return metrics(environ, start_response)

    return Server(make_app(slow), max_requests=max_requests)


def test_what_arrives_while_a_request_is_answered_is_answered_next(short: None) -> None:
    entered, release = threading.Event(), threading.Event()
    s = slow_server(entered, release)
    try:
        with s.connect() as sock:
            sock.sendall(GET)
            assert entered.wait(2)
            sock.sendall(
                b"GET /-/hea"
            )  # the next request, in pieces, while the first is answered
            time.sleep(0.05)
            sock.sendall(b"lthy HTTP/1.1\r\nHost: x\r\n\r\n")
            release.set()
            assert read_answer(sock).endswith(b"shmwatch_up 1\n")
            assert read_answer(sock).endswith(b"OK\n")
            sock.sendall(GET)  # and the one after
            assert read_answer(sock).endswith(b"shmwatch_up 1\n")
    finally:
        release.set()
        s.front.shutdown()


def test_a_client_that_half_closes_while_answered_gets_its_answer(short: None) -> None:
    entered, release = threading.Event(), threading.Event()
    s = slow_server(entered, release)
    try:
        with s.connect() as sock:
            sock.sendall(GET)
            assert entered.wait(2)
            sock.shutdown(socket.SHUT_WR)
            time.sleep(0.05)
            release.set()
            answer = read_answer(sock)
            answered = time.monotonic()
            assert (
                read_all(sock) == b""
            )  # closed after it, not left to the idle deadline
            assert time.monotonic() - answered < IDLE / 2
        assert answer.endswith(b"shmwatch_up 1\n")
    finally:
        release.set()
        s.front.shutdown()


def test_a_client_that_does_not_read_its_answer_frees_its_slot(short: None) -> None:
    big = b"x" * (16 << 20)

    def large(environ: Environ, start_response: StartResponse) -> List[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [big]

    s = Server(make_app(large), max_requests=1)
    try:
        stuck = s.connect()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
        time.sleep(2 * HEADER + 0.3)
        ok = s.ask(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status(ok) == b"HTTP/1.1 200 OK"
        stuck.close()
    finally:
        s.front.shutdown()


def test_at_the_cap_an_idle_connection_makes_room_when_none_is_unanswered(
    short: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    s = Server()
    try:
        idle = s.connect()
        idle.sendall(GET)
        read_answer(idle)  # answered: idle since
        fresh = s.connect()
        time.sleep(0.05)
        third = s.connect()  # the fresh one is dropped, not the idle one
        time.sleep(0.05)
        assert fresh.recv(10) == b""
        idle.sendall(GET)
        assert read_answer(idle).endswith(b"shmwatch_up 1\n")
        fourth = s.ask(
            b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )  # only idle and third
        assert status(fourth) == b"HTTP/1.1 200 OK"
        for sock in (idle, fresh, third):
            sock.close()
    finally:
        s.front.shutdown()


def test_the_front_runs_on_a_daemon_thread_named_for_stack_dumps(
    server: Server,
) -> None:
    [thread] = [t for t in threading.enumerate() if t is server.front]
    assert (thread.name, thread.daemon) == ("shmwatch-http", True)


def test_loop_errors_from_clients_are_debug_and_bugs_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="shmwatch.web")
    loop = asyncio.new_event_loop()  # what the front hands its handler; not run
    try:
        loop_error(
            loop,
            {
                "message": "handshake failed",
                "exception": ConnectionResetError(104, "reset"),
            },
        )
        loop_error(loop, {"message": "eof", "exception": EOFError("x")})
        loop_error(loop, {"message": "bug", "exception": KeyError("k")})
        loop_error(loop, {"message": "no exception"})
    finally:
        loop.close()
    said = [
        (
            r.levelname,
            r.getMessage(),
            r.exc_info is not None and r.exc_info[0] is not None,
        )
        for r in caplog.records
    ]
    assert said == [
        ("DEBUG", "handshake failed: [Errno 104] reset", False),
        ("DEBUG", "eof: x", False),
        ("ERROR", "bug", True),
        ("ERROR", "no exception", False),
    ]


def test_every_page_says_its_status_and_type(server: Server) -> None:
    for path, kind in (
        (b"/", b"text/html; charset=utf-8"),
        (b"/-/healthy", b"text/plain"),
        (b"/nope", b"text/plain"),
    ):
        answer = server.ask(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b"\r\nContent-Type: " + kind + b"\r\n" in answer
    assert (
        status(server.ask(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        == b"HTTP/1.1 200 OK"
    )


def test_connections_closed_free_their_place_at_the_cap(
    short: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    s = Server()
    try:
        for _ in range(3):  # each pair closed before the next: none ever dropped
            pair = [s.connect(), s.connect()]
            for sock in pair:
                sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert read_all(sock).endswith(b"OK\n")
                sock.close()
            time.sleep(0.05)
    finally:
        s.front.shutdown()


def test_at_the_cap_an_active_connection_is_never_dropped(
    short: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oldest idle one makes room; one answering its second request is not idle."""
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    entered, release = threading.Event(), threading.Event()

    def app(environ: Environ, start_response: StartResponse) -> List[bytes]:
        if environ["PATH_INFO"] == "/metrics":
            entered.set()
            release.wait(2)
        return metrics(environ, start_response)

    s = Server(make_app(app))
    try:
        active, idle = s.connect(), s.connect()
        for sock in (active, idle):
            sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            read_answer(sock)
        active.sendall(GET)  # idle a moment, now answering again
        assert entered.wait(2)
        third = s.connect()
        time.sleep(0.05)
        release.set()
        assert read_answer(active).endswith(b"shmwatch_up 1\n")
        assert idle.recv(10) == b""  # the idle one made room
        for sock in (active, idle, third):
            sock.close()
    finally:
        release.set()
        s.front.shutdown()


def test_at_the_cap_with_none_to_drop_a_new_connection_waits_its_turn(
    short: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 1)
    entered, release = threading.Event(), threading.Event()
    s = slow_server(entered, release)
    try:
        busy = s.connect()
        busy.sendall(GET)
        assert entered.wait(2)
        refused = s.connect()  # nothing idle or unanswered to drop: closed
        assert refused.recv(10) == b""
        release.set()
        assert read_answer(busy).endswith(b"shmwatch_up 1\n")
        busy.close()
        time.sleep(0.05)
        later = s.ask(
            b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )  # accepting still
        assert status(later) == b"HTTP/1.1 200 OK"
        refused.close()
    finally:
        release.set()
        s.front.shutdown()


def test_shutdown_stops_the_front(short: None) -> None:
    s = Server()
    s.front.shutdown()
    assert not s.front.is_alive()
    with pytest.raises(OSError):
        s.connect()
