"""connection.py: one client of the front over a real TCP socket on 127.0.0.1 (an asyncio
server whose protocol is Connection), against a front of the test's own that keeps the
Server protocol the module declares: what it was asked, released, forgot and saw closed."""

import asyncio
import logging
import socket
from typing import Any, Callable, Coroutine, Dict, List, Optional, Tuple

import pytest

from exporter.exposition.connection import Connection
from exporter.exposition.heads import Answer, Request

HEAD = "GET {path} HTTP/1.1\r\nHost: shmwatch\r\n{extra}\r\n"


def head(path: str = "/metrics", extra: str = "") -> bytes:
    return HEAD.format(path=path, extra=extra).encode()


class Front:
    """The Server a Connection sees: answers each request with its path (holding a slot),
    optionally held back until `hold` is set, and records every call."""

    def __init__(self, header_timeout: float = 2.0, idle_timeout: float = 2.0, body: Optional[bytes] = None,
                 fail: bool = False) -> None:
        self.loop = asyncio.get_running_loop()
        self.buffer = memoryview(bytearray(64 << 10))
        self.fresh: Dict[Connection, None] = {}
        self.idle: Dict[Connection, None] = {}
        self.tls = False
        self.stopping = False
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.body, self.fail = body, fail
        self.asked: List[str] = []
        self.in_flight = self.most_in_flight = 0
        self.released: List[Answer] = []
        self.forgotten: List[Connection] = []
        self.closed_ones: List[Connection] = []
        self.hold: Optional[asyncio.Event] = None
        self.connections: List[Connection] = []

    def connection(self) -> Connection:
        conn = Connection(self, "127.0.0.1:test")
        self.fresh[conn] = None
        self.connections.append(conn)
        return conn

    async def answer(self, request: Request, peer: str) -> Answer:
        self.asked.append(request.path)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(0.01)  # an answer takes a while: a second one would overlap
            if self.fail:
                raise RuntimeError("the app failed")
            body = self.body if self.body is not None else f"{request.path}\n".encode()
            return Answer("200 OK", [("Content-Type", "text/plain")], body, holds_slot=True)
        finally:
            self.in_flight -= 1

    def release(self, answer: Answer) -> None:
        self.released.append(answer)

    def forget(self, conn: Connection) -> None:
        self.forgotten.append(conn)
        self.fresh.pop(conn, None)
        self.idle.pop(conn, None)

    def closed(self, conn: Connection) -> None:
        self.closed_ones.append(conn)


Scenario = Callable[[Front, asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


def serve(scenario: Scenario, **front_args: Any) -> Front:
    """Runs `scenario` as a client of a real listening socket served by Connection."""

    async def main() -> Front:
        front = Front(**front_args)
        server = await front.loop.create_server(front.connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await asyncio.wait_for(scenario(front, reader, writer), 20)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()
            await asyncio.sleep(0.05)  # connection_lost of the server side
        return front

    return asyncio.run(main())


async def read_answer(reader: asyncio.StreamReader, method: str = "GET") -> Tuple[str, Dict[str, str], bytes]:
    """(status line, headers by lower-case name, body) of one answer."""
    raw = await reader.readuntil(b"\r\n\r\n")
    status, *lines = raw.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    length = 0 if method == "HEAD" else int(headers["content-length"])
    return status, headers, await reader.readexactly(length)


def test_pipelined_requests_are_answered_in_order_one_at_a_time():
    async def scenario(front, reader, writer):
        writer.write(head("/a") + head("/b") + head("/c"))
        bodies = [(await read_answer(reader))[2] for _ in range(3)]
        assert bodies == [b"/a\n", b"/b\n", b"/c\n"]

    front = serve(scenario)
    assert front.asked == ["/a", "/b", "/c"]
    assert front.most_in_flight == 1  # the next waited, unread, until the last was written
    assert [a.body for a in front.released] == [b"/a\n", b"/b\n", b"/c\n"]  # every slot freed


def test_a_head_split_across_reads_is_one_request():
    async def scenario(front, reader, writer):
        data = head("/split")
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        assert (await read_answer(reader))[2] == b"/split\n"

    assert serve(scenario).asked == ["/split"]


def test_connection_close_is_answered_then_hung_up():
    async def scenario(front, reader, writer):
        writer.write(head(extra="Connection: close\r\n"))
        status, headers, body = await read_answer(reader)
        assert (status, headers["connection"], body) == ("HTTP/1.1 200 OK", "close", b"/metrics\n")
        assert await reader.read() == b""  # the server hung up

    front = serve(scenario)
    assert len(front.closed_ones) == 1


def test_a_keep_alive_connection_waits_idle_then_is_closed_unanswered():
    async def scenario(front, reader, writer):
        writer.write(head())
        status, headers, _ = await read_answer(reader)
        assert status == "HTTP/1.1 200 OK" and "connection" not in headers
        await asyncio.sleep(0.05)
        assert list(front.idle) == front.connections  # waiting again, counted as idle
        assert await reader.read() == b""  # the idle timeout: closed, no answer written

    front = serve(scenario, idle_timeout=0.3)
    assert front.forgotten == front.connections and front.closed_ones == front.connections


def test_a_second_request_on_a_kept_connection_leaves_idle():
    async def scenario(front, reader, writer):
        writer.write(head("/1"))
        await read_answer(reader)
        await asyncio.sleep(0.05)
        assert list(front.idle) == front.connections
        writer.write(head("/2")[:5])  # the first byte after the wait: no longer idle
        await writer.drain()
        await asyncio.sleep(0.05)
        assert not front.idle
        writer.write(head("/2")[5:])
        assert (await read_answer(reader))[2] == b"/2\n"

    serve(scenario)


def test_a_head_not_complete_in_time_is_a_408_and_the_end():
    async def scenario(front, reader, writer):
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never complete
        status, headers, _ = await read_answer(reader)
        assert status == "HTTP/1.1 408 Request Timeout" and headers["connection"] == "close"
        assert await reader.read() == b""

    front = serve(scenario, header_timeout=0.2)
    assert front.asked == []


def test_a_client_that_sends_nothing_is_closed_without_an_answer():
    async def scenario(front, reader, writer):
        assert await reader.read() == b""

    front = serve(scenario, header_timeout=0.2)
    assert front.asked == [] and len(front.closed_ones) == 1


@pytest.mark.parametrize("data,status", [
    (b"garbage\r\n\r\n", "400 Bad Request"),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", "505 HTTP Version Not Supported"),
])
def test_a_refused_head_is_answered_and_hung_up_unread(data, status):
    async def scenario(front, reader, writer):
        writer.write(data + head("/never"))
        got, headers, _ = await read_answer(reader)
        assert (got, headers["connection"]) == (f"HTTP/1.1 {status}", "close")
        assert await reader.read() == b""

    front = serve(scenario)
    assert front.asked == []  # what came after the refused head was never read as a request


def test_a_head_request_gets_the_head_only():
    async def scenario(front, reader, writer):
        writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, _ = await read_answer(reader, "HEAD")
        assert status == "HTTP/1.1 200 OK" and headers["content-length"] == "9"
        assert await reader.read() == b""  # no body followed

    serve(scenario)


def test_http_1_0_is_closed_unless_it_asks_to_be_kept():
    async def scenario(front, reader, writer):
        writer.write(b"GET /kept HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, body = await read_answer(reader)
        assert headers["connection"] == "keep-alive" and body == b"/kept\n"
        writer.write(b"GET /last HTTP/1.0\r\n\r\n")
        status, headers, body = await read_answer(reader)
        assert headers["connection"] == "close" and body == b"/last\n"
        assert await reader.read() == b""

    serve(scenario)


def test_a_half_closed_client_still_gets_its_answer():
    async def scenario(front, reader, writer):
        front.hold = asyncio.Event()
        writer.write(head())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write_eof()  # the client is done sending, not reading
        await asyncio.sleep(0.05)
        front.hold.set()
        status, _, body = await read_answer(reader)  # reading was paused: the EOF is seen after
        assert (status, body) == ("HTTP/1.1 200 OK", b"/metrics\n")
        # then the end, not a wait for another request (the idle timeout is far away)
        assert await asyncio.wait_for(reader.read(), 1) == b""

    serve(scenario, idle_timeout=10)


def test_an_answer_that_fails_drops_the_connection_and_is_logged(caplog):
    async def scenario(front, reader, writer):
        writer.write(head())
        assert await reader.read() == b""  # dropped, nothing written

    with caplog.at_level(logging.ERROR, logger="shmwatch.web"):
        front = serve(scenario, fail=True)
    assert set(front.forgotten) == set(front.connections) and front.released == []  # no answer held a slot
    assert "answering 127.0.0.1:test failed" in caplog.text


def test_while_stopping_an_answer_hangs_up_after_it():
    async def scenario(front, reader, writer):
        front.stopping = True
        writer.write(head())
        status, headers, _ = await read_answer(reader)
        assert headers["connection"] == "close"
        assert await reader.read() == b""

    serve(scenario)


def test_a_client_that_does_not_read_its_answer_frees_the_slot_and_is_dropped():
    big = b"x" * (64 << 20)  # more than the socket buffers on both sides hold

    async def scenario(front, reader, writer):
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(head())
        await writer.drain()
        for _ in range(100):  # never read: the server's writes pause, then it gives up
            await asyncio.sleep(0.05)
            if front.forgotten:
                break
        assert set(front.forgotten) == set(front.connections)
        assert [a.body is big for a in front.released] == [True]  # its slot freed, unwritten

    serve(scenario, header_timeout=0.2, body=big)


def test_close_waits_for_an_answer_being_made_and_abort_does_not():
    async def scenario(front, reader, writer):
        front.hold = asyncio.Event()
        writer.write(head())
        await writer.drain()
        await asyncio.sleep(0.05)
        [conn] = front.connections
        conn.close()  # shutdown while the answer is made: it is still written, then the end
        front.stopping = True
        front.hold.set()
        status, headers, body = await read_answer(reader)
        assert (status, headers["connection"], body) == ("HTTP/1.1 200 OK", "close", b"/metrics\n")
        assert await reader.read() == b""

    serve(scenario)

    async def aborted(front, reader, writer):
        front.hold = asyncio.Event()
        writer.write(head())
        await writer.drain()
        await asyncio.sleep(0.05)
        front.connections[0].abort()  # now: nothing more is sent
        front.hold.set()
        assert await reader.read() == b""

    serve(aborted)


def test_a_read_that_comes_while_answering_waits_for_the_answer():
    """Reading pauses while an answer is made; a read the pause did not stop (as the loop may
    deliver one already taken) is kept and parsed after the answer, not answered beside it."""

    async def scenario(front, reader, writer):
        front.hold = asyncio.Event()
        writer.write(head("/first"))
        await writer.drain()
        await asyncio.sleep(0.05)
        [conn] = front.connections
        conn.feed(head("/late"))  # what the loop would hand buffer_updated
        front.hold.set()
        assert [(await read_answer(reader))[2] for _ in range(2)] == [b"/first\n", b"/late\n"]

    front = serve(scenario)
    assert front.asked == ["/first", "/late"] and front.most_in_flight == 1


def test_an_end_of_input_while_answering_keeps_the_socket_for_the_answer():
    """A client that half-closes after its request (EOF while the answer is made) still gets
    the answer, marked as the last, then the end."""

    async def scenario(front, reader, writer):
        front.hold = asyncio.Event()
        writer.write(head())
        await writer.drain()
        await asyncio.sleep(0.05)
        [conn] = front.connections
        assert conn.eof_received() is True  # what the loop calls on EOF: keep the transport open
        front.hold.set()
        status, headers, body = await read_answer(reader)
        assert (status, headers["connection"], body) == ("HTTP/1.1 200 OK", "close", b"/metrics\n")
        assert await asyncio.wait_for(reader.read(), 1) == b""

    serve(scenario, idle_timeout=10)
