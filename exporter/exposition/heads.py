"""HTTP/1.x request heads, parsed by h11 (python-hyper's HTTP/1.1 state machine) as they
arrive, and the answers' bytes. What h11 does not do is done here, as Go's net/http does it:

- the head's bytes (MAX_HEADER_BYTES) and lines (MAX_HEADER_LINES) are bounded as they come;
- h11 is given the request line, the headers the front reads (KEPT) and only the names of
  the others (with an empty value): a head costs at most MAX_KEPT_BYTES, h11's
  max_incomplete_event_size, whatever the client sends, and h11 still checks every name;
- a control byte anywhere in the head is refused (h11 takes most of C0 in a value; Go does
  not), and so is a line folded onto the one before (obs-fold);
- the request line is judged as soon as it ends, not at the end of the head: an HTTP/0.9
  client waits for no more, and only HTTP/1.0 and 1.1 are served (505);
- the target is routed on its decoded path only where it is a path ("/...") or an
  absolute URL ("http://host/..."); anything else ("%2fmetrics", "*") is a 400."""

import functools
import logging
import re
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from enum import Enum
from http import HTTPStatus
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union
from urllib.parse import unquote, urlsplit

import h11

LOG = logging.getLogger("shmwatch.web")

MAX_HEADER_BYTES = 1 << 20  # request line and headers: Go's http.DefaultMaxHeaderBytes
# Lines after the request line, as Python's http.client: the work one head costs.
MAX_HEADER_LINES = 100
# Of the head, what h11 is given: the request line, the KEPT headers, the others' names.
MAX_KEPT_BYTES = 32 << 10
KEPT = frozenset({b"accept", b"accept-encoding", b"authorization", b"connection"})
KEPT |= {b"content-length", b"transfer-encoding"}  # h11 judges a body's framing by them
# The request line's shape, judged when it ends; h11 judges its parts at the end of the head.
REQUEST_LINE = re.compile(rb"\S+ \S+ HTTP/(\d)\.(\d)")
# 1 for the control bytes refused anywhere in a head (Go's ValidHeaderFieldValue): C0 and DEL
# but HTAB, LF and CR; a CR only ends a line (RFC 9112's bare CR), judged apart.
CONTROLS = bytes(int(b < 0x20 and b not in b"\t\n\r" or b == 0x7F) for b in range(256))
FOLDED = (b" ", b"\t")
# The blank line that ends a head, whichever line ends it has (RFC 9112 takes a bare LF).
BLANK_LINE = re.compile(rb"\n\r?\n")

# What an answer's header may be, checked as it is written: a token for a name; no control
# but HTAB in a value, and latin-1 (the web config's headers are checked at load, stricter).
TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
WRITABLE_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# Names of headers dropped and logged: each is logged once (a bound all the same).
DROPPED: Set[str] = set()
MAX_DROPPED_LOGGED = 64

Headers = List[Tuple[str, str]]


class Refused(Exception):
    """A request this server does not take: `status` (args[0] too) says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(status, reason)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # decoded, for routing (PEP 3333: bytes as latin-1)
    query: str
    # The KEPT headers by lower-case name, a repeated one's values joined by ", ".
    headers: Mapping[str, str]
    minor: int  # HTTP/1.minor
    close: bool  # hang up after the answer


@dataclass(frozen=True)
class Complete:
    """A head's end: its request, and the bytes that came after it."""

    request: Request
    rest: bytes


class Part(Enum):
    """Where in the head the next byte goes."""

    REQUEST_LINE = "request line"  # blank lines before it are skipped
    NAME = "header name"  # until the colon (or the blank line that ends the head)
    KEPT_VALUE = "kept value"  # given to h11
    DROPPED_VALUE = "dropped value"  # checked for control bytes, then forgotten


class Head:
    """One request head as it arrives, on the connection's thread."""

    def __init__(self) -> None:
        self.parser = h11.Connection(
            h11.SERVER, max_incomplete_event_size=MAX_KEPT_BYTES
        )
        self.part = Part.REQUEST_LINE
        self.size = 0  # bytes of the head so far
        self.lines = 0  # lines after the request line, the blank one included
        self.held = bytearray()  # the request line, or a header's name, until judged
        self.cr = False  # the last byte was a CR: the next must be LF

    def feed(self, data: bytes) -> Optional[Complete]:
        """The request and what came after its head, once the head is complete; Refused."""
        if self.size == 0 and self.part is Part.REQUEST_LINE:
            complete = self.whole(data)
            if complete is not None:
                return complete
        pos, end = 0, len(data)
        while pos < end:
            newline = data.find(b"\n", pos)
            stop = end if newline < 0 else newline + 1
            segment = data[pos:stop]
            self.take(segment)
            if newline < 0:
                self.piece(segment, ended=False)
            elif self.piece(segment[:-1], ended=True):
                return Complete(self.request(), data[stop:])
            pos = stop
        self.next_event()  # h11's own bound on what it was given: 431 beyond it
        return None

    def whole(self, data: bytes) -> Optional[Complete]:
        """A scrape's head in one read, given to h11 whole: None unless it is complete
        (ends in a blank line), within MAX_KEPT_BYTES and MAX_HEADER_LINES, and holds nothing
        the line-by-line path would refuse or fold (that path then judges it). The head is
        cut at its first blank line, in whichever form (h11 is never given a pipelined head
        after it). Within the bounds nothing need be cut; tests hold both paths to one
        verdict and one rest."""
        blank = BLANK_LINE.search(data)
        if blank is None:
            return None
        end = blank.end()
        head = data[:end]
        if end > MAX_KEPT_BYTES or head.count(b"\n") > MAX_HEADER_LINES + 1:
            return None
        if head.startswith((b"\r", b"\n")) or b"\n " in head or b"\n\t" in head:
            return None  # an empty line before the request, or a folded line
        if head.count(b"\r") != head.count(b"\r\n") or 1 in head.translate(CONTROLS):
            return None
        self.judge_request_line(head[: head.find(b"\n")].removesuffix(b"\r"))
        self.size = end
        self.give(head)
        return Complete(self.request(), data[end:])

    def take(self, segment: bytes) -> None:
        """Counts and checks the head's next bytes, up to a line's end."""
        self.size += len(segment)
        if self.size > MAX_HEADER_BYTES:
            raise Refused(431, "head over MAX_HEADER_BYTES")
        cut_line = self.cr and not segment.startswith(b"\n")
        self.cr = segment.endswith(b"\r")
        # A segment is one line at most: a CR may only be its last byte, or end it with LF.
        bare_cr = 0 <= segment.find(b"\r") < len(segment) - 1 - segment.endswith(b"\n")
        if cut_line or bare_cr or 1 in segment.translate(CONTROLS):
            raise Refused(400, "a control byte in the head")

    def piece(self, piece: bytes, ended: bool) -> bool:
        """Takes a piece of a line (all of what is left of it when `ended`, without its LF);
        True once the head is complete."""
        if self.part is Part.REQUEST_LINE:
            self.request_line(piece, ended)
            return False
        if ended:
            self.lines += 1
            if self.lines > MAX_HEADER_LINES:
                raise Refused(431, "more than MAX_HEADER_LINES lines")
        if self.part is Part.NAME:
            return self.name(piece, ended)
        self.value(piece, ended)
        return False

    def hold(self, piece: bytes) -> None:
        self.held += piece
        if len(self.held) > MAX_KEPT_BYTES:
            raise Refused(431, "a request line or header name over MAX_KEPT_BYTES")

    def request_line(self, piece: bytes, ended: bool) -> None:
        self.hold(piece)
        if not ended:
            return
        line = bytes(self.held).removesuffix(b"\r")
        self.held.clear()
        if line:  # RFC 9112: a server SHOULD ignore an empty line before the request
            self.judge_request_line(line)
            self.give(line + b"\r\n")
            self.part = Part.NAME

    @staticmethod
    def judge_request_line(line: bytes) -> None:
        first = REQUEST_LINE.fullmatch(line)
        if first is None:
            raise Refused(400, "not a request line")  # HTTP/0.9's "GET /" too
        if (first[1], first[2]) not in ((b"1", b"0"), (b"1", b"1")):
            raise Refused(505, "only HTTP/1.0 and HTTP/1.1 are served")

    def name(self, piece: bytes, ended: bool) -> bool:
        """A header line's start: the end of the head, a name, or a name and some value."""
        if not self.held and piece.startswith(FOLDED):
            raise Refused(400, "a header line folded onto the one before")
        if ended and bytes(self.held) + piece in (
            b"",
            b"\r",
        ):  # the blank line: the end
            self.next_event()  # h11's bound, checked on a head given whole as on one in pieces
            self.give(b"\r\n")
            return True
        colon = piece.find(b":")
        if colon < 0:
            self.hold(piece)
            if ended:
                raise Refused(400, "a header line without a colon")
            return False
        self.hold(piece[:colon])
        name = bytes(self.held)
        self.held.clear()
        self.give(name + b":")
        kept = name.lower() in KEPT
        self.part = Part.KEPT_VALUE if kept else Part.DROPPED_VALUE
        self.value(piece[colon + 1 :], ended)
        return False

    def value(self, piece: bytes, ended: bool) -> None:
        if self.part is Part.KEPT_VALUE:
            self.give(piece + b"\n" if ended else piece)
        elif ended:
            self.give(b"\r\n")  # a value not kept: only its end
        if ended:
            self.part = Part.NAME

    def give(self, data: bytes) -> None:
        if data:  # h11 takes b"" for the end of the stream
            self.parser.receive_data(data)

    def next_event(self) -> Union[h11.Event, type[h11.NEED_DATA], type[h11.PAUSED]]:
        try:
            return self.parser.next_event()
        except h11.RemoteProtocolError as err:
            raise Refused(err.error_status_hint, str(err)) from None

    def request(self) -> Request:
        """The complete head as h11 parsed it, routed."""
        event = self.next_event()
        if not isinstance(event, h11.Request):  # h11 was given a whole head
            raise Refused(400, "not a request")
        # Nothing after the head was given to h11: a request with a body needs more data.
        body = not isinstance(self.next_event(), h11.EndOfMessage)
        headers: Dict[str, str] = {}
        for name, value in event.headers:
            if name in KEPT:
                key, text = name.decode("ascii"), value.decode("latin-1")
                known = headers.get(key)
                headers[key] = text if known is None else f"{known}, {text}"
        minor = int(event.http_version[-1:])
        path, query = route(event.target.decode("ascii"))
        return Request(
            method=event.method.decode("ascii"),
            path=path,
            query=query,
            headers=headers,
            minor=minor,
            # A body is never read: answer, then hang up rather than parse it as a request.
            close=body or not keep_alive(minor, headers.get("connection", "")),
        )


def route(target: str) -> Tuple[str, str]:
    """(decoded path, query) of an origin-form ("/p?q") or absolute-form target; Refused
    for any other, as Go's url.ParseRequestURI refuses them."""
    if target.startswith("/"):
        path, _, query = target.partition("?")
    elif target.startswith(("http://", "https://")):  # absolute-form, as proxies send
        try:
            parts = urlsplit(target)
        except ValueError:  # "http://[::1": a bracket not closed
            raise Refused(400, "an absolute URL that does not parse") from None
        path, query = parts.path or "/", parts.query
    else:
        raise Refused(400, "a target neither a path nor an absolute URL")
    return unquote(path, "latin-1"), query


def keep_alive(minor: int, connection: str) -> bool:
    """HTTP/1.1 unless `Connection: close`, HTTP/1.0 with `Connection: keep-alive`, as Go
    keeps them (h11 never keeps an HTTP/1.0 connection)."""
    tokens = {token.strip().lower() for token in connection.split(",")}
    return "close" not in tokens if minor else "keep-alive" in tokens


@dataclass
class Answer:
    status: str  # "200 OK"
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    holds_slot: bool = False  # made by the app: one of --web.max-requests until written


def plain(code: int, headers: Sequence[Tuple[str, str]] = ()) -> Answer:
    phrase = HTTPStatus(code).phrase
    kind = ("Content-Type", "text/plain; charset=utf-8")
    return Answer(f"{code} {phrase}", [kind, *headers], f"{phrase}\n".encode())


@functools.lru_cache(maxsize=2)
def http_date(second: int) -> str:
    """The Date header's value, made once a second."""
    return formatdate(second, usegmt=True)


def message(answer: Answer, request: Optional[Request], close: bool) -> bytes:
    """The answer's bytes, for `request` (None: a refused head; then `close` is True)."""
    lines = [f"HTTP/1.1 {answer.status}", f"Date: {http_date(int(time.time()))}"]
    lines += [f"{name}: {value}" for name, value in writable(answer.headers)]
    lines.append(f"Content-Length: {len(answer.body)}")
    if close:
        lines.append("Connection: close")
    elif request is not None and request.minor == 0:
        lines.append("Connection: keep-alive")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return (
        head if request is not None and request.method == "HEAD" else head + answer.body
    )


def writable(headers: Sequence[Tuple[str, str]]) -> Headers:
    """The headers that can be written as they are; one that cannot (a CR or LF would end
    the head and start a header of its own, a character beyond latin-1 cannot be encoded)
    is dropped, and logged once: the answer goes out without it."""
    kept = []
    for name, value in headers:
        if TOKEN.fullmatch(name) and WRITABLE_VALUE.fullmatch(value):
            kept.append((name, value))
        elif name not in DROPPED and len(DROPPED) < MAX_DROPPED_LOGGED:
            DROPPED.add(name)
            LOG.error("answer header %s dropped: it cannot be written", ascii(name))
    return kept
