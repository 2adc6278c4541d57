"""One HTTP(S) connection of the front (http.py): an asyncio protocol that parses heads as
they arrive (heads.py), has each request answered by the front, and writes the answers,
one at a time (pipelined requests wait, unread). Every method runs on the front's loop."""

import asyncio
import logging
from typing import Any, Dict, Optional, Protocol, cast

from exporter.exposition.heads import Answer, Complete, Head, Refused, Request
from exporter.exposition.heads import message, plain

LOG = logging.getLogger("shmwatch.web")


class Server(Protocol):
    """What a connection reads and calls of the front that accepted it."""

    loop: asyncio.AbstractEventLoop
    buffer: memoryview  # one read's bytes, shared: each read is parsed before the next
    fresh: Dict["Connection", None]  # never answered, oldest first
    idle: Dict["Connection", None]  # waiting again, longest first
    tls: bool
    stopping: bool  # shutting down: answers close their connection
    header_timeout: float  # a head's, from its first byte; twice it to read an answer
    idle_timeout: float  # between requests

    async def answer(self, request: Request, peer: str) -> Answer:
        """The answer; one the app made holds a slot of --web.max-requests."""

    def release(self, answer: Answer) -> None:
        """Frees the answer's slot, if it holds one: written, or given up."""

    def forget(self, conn: "Connection") -> None:
        """No longer counted against the connection cap."""

    def closed(self, conn: "Connection") -> None:
        """Its socket is closed."""


class Connection(asyncio.BufferedProtocol):
    """One client: its heads parsed as they arrive, one request answered at a time. Every
    method runs on the front's loop thread."""

    def __init__(self, front: "Server", peer: str) -> None:
        self.front, self.peer = front, peer
        # The transport once connected (under TLS, once the handshake is done).
        self.transport: Optional[asyncio.Transport] = None
        self.head: Optional[Head] = None  # the head arriving, from its first byte
        # The handshake's task, then each answer's.
        self.task: Optional["asyncio.Task[Any]"] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.drained: Optional["asyncio.Future[None]"] = None  # while writing is paused
        self.rest = b""  # what came after a head, while it is answered
        self.busy = self.served = self.eof = self.gone = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.deadline(self.front.header_timeout)

    def deadline(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.front.loop.call_later(seconds, self.expire)

    def expire(self) -> None:
        LOG.debug("connection from %s: no complete request in time", self.peer)
        if self.head is not None:
            self.refuse(408)
        elif self.transport is not None:
            self.transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.front.buffer  # shared: each read is parsed before the next

    def buffer_updated(self, nbytes: int) -> None:
        self.feed(bytes(self.front.buffer[:nbytes]))

    def feed(self, data: bytes) -> None:
        if self.busy:  # a read the pause did not stop
            self.rest += data
            return
        if self.head is None:
            self.head = Head()
            if self.served:  # the first byte after a keep-alive wait: a head's deadline
                self.deadline(self.front.header_timeout)
                self.front.idle.pop(self, None)
        try:
            complete = self.head.feed(data)
        except Refused as refused:
            LOG.debug("request from %s refused: %d", self.peer, refused.status)
            return self.refuse(refused.status)
        if complete is not None:
            self.start_answer(complete)

    def start_answer(self, complete: Complete) -> None:
        assert self.transport is not None  # data came through it
        self.head, self.rest, self.busy = None, complete.rest, True
        if self.timer is not None:
            self.timer.cancel()
        self.transport.pause_reading()
        self.front.fresh.pop(self, None)
        self.task = self.front.loop.create_task(self.serve(complete.request))

    async def serve(self, request: Request) -> None:
        answer: Optional[Answer] = None
        try:
            answer = await self.front.answer(request, self.peer)
            if self.transport is None or self.transport.is_closing():
                return
            close = request.close or self.eof or self.front.stopping
            self.transport.write(message(answer, request, close))
            if self.drained is not None:  # a client that does not read frees its slot
                await asyncio.wait_for(self.drained, 2 * self.front.header_timeout)
        except asyncio.TimeoutError:
            LOG.debug("connection from %s: the answer was not read in time", self.peer)
            return self.drop()
        except Exception:
            LOG.exception("answering %s failed", self.peer)
            return self.drop()
        finally:
            if answer is not None:
                self.front.release(answer)
        self.answered(request)

    def answered(self, request: Request) -> None:
        """After an answer: hang up, or wait for the next request (maybe come already)."""
        if self.gone or self.transport is None:
            return
        if request.close or self.eof or self.front.stopping:
            self.transport.close()
            return
        self.busy, self.served = False, True
        self.deadline(self.front.idle_timeout)
        self.front.idle[self] = None
        self.transport.resume_reading()
        rest, self.rest = self.rest, b""
        if rest:
            self.feed(rest)

    def refuse(self, code: int) -> None:
        """Answer and hang up unread, after half a second to read it (as Go does)."""
        assert self.transport is not None  # data came through it
        self.busy = True
        if self.timer is not None:
            self.timer.cancel()
        self.transport.pause_reading()
        self.transport.write(message(plain(code), None, True))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.front.loop.call_later(0.5, self.transport.abort)

    def close(self) -> None:
        """At shutdown: hang up once what was written is sent; an answer being made or
        written first (answered() hangs up after it)."""
        if self.transport is None:
            self.abort()  # a handshake
        elif self.task is None or self.task.done():
            # Once: a second close() of a TLS transport makes its abort() do nothing
            # (CPython 3.11's _SSLProtocolTransport forgets its protocol).
            if not self.transport.is_closing():
                self.transport.close()

    def abort(self) -> None:
        """Hang up now; what was not sent is dropped."""
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # the handshake's: its socket is closed however far it got

    def drop(self) -> None:
        self.front.forget(self)  # now: accept() may not yield before the next one
        self.abort()

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
        if self.timer is not None:
            self.timer.cancel()
        self.resume_writing()
        self.front.forget(self)
        self.front.closed(self)
        self.transport = self.timer = None
