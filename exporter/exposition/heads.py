"""HTTP/1.x request heads parsed as they arrive, and the answers' bytes. Only the headers the
front reads are kept, the others counted and dropped: a head costs what it keeps."""

import re
from email.utils import formatdate
from http import HTTPStatus
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

MAX_HEADER_BYTES = 1 << 20  # request line and headers: Go's http.DefaultMaxHeaderBytes
MAX_HEADER_LINES = 100  # as Python's http.client: bounds the work one head costs
MAX_KEPT_BYTES = 32 << 10  # of them, the request line and the headers in KEPT
KEPT = {"accept", "accept-encoding", "authorization", "connection"}
KEPT |= {"content-length", "transfer-encoding"}
TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
REQUEST_LINE = re.compile(rb"(%s) (\S+) HTTP/(\d)\.(\d)" % TOKEN)
HEADER_NAME = re.compile(TOKEN)

Answer = Tuple[str, List[Tuple[str, str]], bytes]  # status, headers, body


class Refused(Exception):
    """A request this server does not take; args[0] is the status that says why."""


class Head:
    """One request head as it arrives: the request line and the headers in KEPT."""

    def __init__(self) -> None:
        self.size = self.lines = self.kept_size = 0
        self.line = bytearray()  # the current line while it may be kept
        self.dropping = False  # within a header line that is not kept
        self.first: Optional[re.Match] = None  # the request line's
        self.headers: Dict[str, str] = {}

    def feed(self, data: bytes) -> Optional[bytes]:
        """The bytes after the head once it is complete, else None; Refused."""
        pos, end = 0, len(data)
        while pos < end:
            newline = data.find(b"\n", pos)
            stop = end if newline < 0 else newline + 1
            self.size += stop - pos
            if self.size > MAX_HEADER_BYTES:
                raise Refused(431)
            if self.first and newline >= 0:
                self.lines += 1
                if self.lines > MAX_HEADER_LINES:
                    raise Refused(431)
            if not self.dropping:
                self.line += data[pos:stop]
                # Not kept: dropped once its name is in; only the name counts, however split.
                kept = self.kept(self.line) if self.first else None
                size = self.line.find(b":") if kept is False else len(self.line)
                if self.kept_size + size > MAX_KEPT_BYTES:
                    raise Refused(431)
                if kept is False:
                    self.dropping = True
                    self.line.clear()
            pos = stop
            if newline < 0:
                return None
            if self.dropping:
                self.dropping = False
                continue
            line = bytes(self.line).rstrip(b"\r\n")
            self.line.clear()
            if self.first is None:
                if line:  # empty lines before a request line are allowed
                    self.first = REQUEST_LINE.fullmatch(line)
                    if not self.first:
                        raise Refused(400)  # HTTP/0.9's "GET /" too
                    if self.first[3] != b"1":
                        raise Refused(505)
                    self.kept_size += len(line)
                continue
            if not line:
                return data[pos:]
            if self.kept(line) is None:  # kept, else dropped above
                raise Refused(400)  # no colon; also an obsolete folded line
            self.kept_size += len(line)
            name, _, value = line.partition(b":")
            key = name.lower().decode()
            value = value.strip(b" \t").decode("latin-1")
            known = self.headers.get(key)
            self.headers[key] = value if known is None else f"{known}, {value}"
        return None

    def kept(self, line: bytearray) -> Optional[bool]:
        """Whether a header line is kept; None while its name and colon have not come."""
        colon = line.find(b":")
        if colon < 0:
            return None
        if not HEADER_NAME.fullmatch(line, 0, colon):
            raise Refused(400)  # whitespace before the colon: a smuggling attempt
        return bytes(line[:colon]).lower().decode() in KEPT

    def finish(self) -> "Head":
        """Sets method, path, query, minor and close from the complete head; Refused."""
        method, target, _, minor = self.first.groups()
        self.method, self.minor = method.decode(), int(minor)
        target = target.decode("latin-1")
        headers = self.headers
        if target.startswith(("http://", "https://")):  # absolute-form, as proxies send
            try:
                parts = urlsplit(target)
            except ValueError:  # "http://[::1": a bracket not closed
                raise Refused(400) from None
            path, self.query = parts.path or "/", parts.query
        else:
            path, _, self.query = target.partition("?")
        self.path = unquote(path, "latin-1")  # as wsgiref (PEP 3333: bytes as latin-1)
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        # A body is never read: answer, then hang up rather than parse it as a request.
        length = headers.get("content-length", "0")
        body = "transfer-encoding" in headers or length != "0"
        keep = "close" not in tokens if self.minor else "keep-alive" in tokens
        self.close = body or not keep
        return self


def plain(code: int, headers=()) -> Answer:
    phrase = HTTPStatus(code).phrase
    kind = ("Content-Type", "text/plain; charset=utf-8")
    return f"{code} {phrase}", [kind, *headers], f"{phrase}\n".encode()


def message(answer: Answer, request: Optional[Head], close: bool) -> bytes:
    status, headers, body = answer
    lines = [f"HTTP/1.1 {status}", f"Date: {formatdate(usegmt=True)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    elif request.minor == 0:
        lines.append("Connection: keep-alive")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if request and request.method == "HEAD" else head + body
