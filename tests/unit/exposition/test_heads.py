"""heads.py: request heads streamed into h11 and judged as Go's net/http judges them, the
same whichever way TCP splits them; and the answers' bytes."""

from typing import Optional, Tuple, Union

import pytest

from exporter.exposition import heads
from exporter.exposition.heads import MAX_HEADER_LINES, Complete, Head, Refused, Request, keep_alive
from exporter.exposition.heads import message, plain, route

HEAD = b"GET /metrics HTTP/1.1\r\nHost: shmwatch\r\n"
Verdict = Union[int, Request, None]  # a status refused, a request, or more needed


def outcome(data: bytes, piece: Optional[int] = None) -> Union[Verdict, Tuple[Request, bytes]]:
    """What `data` comes to in pieces of `piece` bytes (whole by default): a status refused,
    (the request, every byte after its head: the rest handed back and the pieces not fed),
    or None (more needed)."""
    head, step = Head(), piece or len(data)
    try:
        for start in range(0, len(data), step):
            complete: Optional[Complete] = head.feed(data[start:start + step])
            if complete is not None:
                return complete.request, complete.rest + data[start + step:]
        return None
    except Refused as refused:
        return refused.status


def verdict(data: bytes, piece: Optional[int] = None) -> Verdict:
    """The head's verdict when it comes in pieces of `piece` bytes (whole by default)."""
    result = outcome(data, piece)
    return result[0] if isinstance(result, tuple) else result


def every_split(data: bytes) -> Verdict:
    """The one outcome of `data` whole and in pieces of every size, the bytes after the head
    included: a bound or a check that depends on how TCP splits a head (a CR at the end of a
    read), or a pipelined head lost, fails here."""
    outcomes = {str(outcome(data, piece)) for piece in range(1, len(data) + 1)}
    assert len(outcomes) == 1, outcomes
    return verdict(data)


CONTROL_BYTES = [bytes([b]) for b in (*range(0x00, 0x09), *range(0x0B, 0x0D), *range(0x0E, 0x20), 0x7F)]


@pytest.mark.parametrize("byte", CONTROL_BYTES, ids=[f"0x{b[0]:02x}" for b in CONTROL_BYTES])
def test_a_control_byte_anywhere_in_the_head_is_a_400(byte):
    # Go's ValidHeaderFieldValue; h11 alone takes \x01-\x08, \x0e-\x1f and DEL in a value.
    for line in (b"Accept: text/" + byte + b"plain", b"X-Not-Kept: a" + byte + b"b", b"X-Na" + byte + b"me: v"):
        assert every_split(HEAD + line + b"\r\n\r\n") == 400, line
    assert every_split(b"GET /met" + byte + b"rics HTTP/1.1\r\nHost: x\r\n\r\n") == 400


@pytest.mark.parametrize("line", [b"X: a\rb", b"X: a\r\r", b"X: \ra", b"Accept: a\rb", b"X\r: a"])
def test_a_cr_that_does_not_end_a_line_is_a_400(line):
    assert every_split(HEAD + line + b"\r\n\r\n") == 400


def test_htab_obs_text_and_bare_lf_line_ends_are_taken():
    request = every_split(HEAD + b"Accept: text/plain;\tq=1\r\nX: caf\xc3\xa9\n\r\n")
    assert isinstance(request, Request) and request.headers["accept"] == "text/plain;\tq=1"


@pytest.mark.parametrize("version,status", [(b"1.0", None), (b"1.1", None), (b"1.9", 505), (b"1.2", 505),
                                            (b"0.9", 505), (b"2.0", 505), (b"3.0", 505), (b"1.10", 400),
                                            (b"11", 400), (b"1", 400)])
def test_only_http_1_0_and_1_1_are_served_judged_when_the_request_line_ends(version, status):
    line = b"GET /metrics HTTP/" + version + b"\r\n"
    # Nothing after the request line is needed to refuse it: the client may wait for the answer.
    assert verdict(line) == status
    if status is None:
        assert isinstance(every_split(line + b"Host: x\r\n\r\n"), Request)


@pytest.mark.parametrize("line", [b"GET /metrics", b"GET /metrics HTTP/1.1 x", b"GET  /metrics HTTP/1.1",
                                  b"GET /metrics http/1.1", b"/metrics HTTP/1.1"])
def test_what_is_no_request_line_is_a_400_at_once(line):
    assert verdict(line + b"\r\n") == 400  # HTTP/0.9's "GET /metrics" too


@pytest.mark.parametrize("target,routed", [
    ("/metrics", ("/metrics", "")), ("/%6detrics?name[]=a", ("/metrics", "name[]=a")),
    ("/metrics%2F", ("/metrics/", "")), ("http://host:9841/metrics?x", ("/metrics", "x")),
    ("https://host", ("/", "")), ("%2fmetrics", 400), ("metrics", 400), ("*", 400),
    ("ftp://host/metrics", 400), ("http://[::1/metrics", 400),
])
def test_targets_are_routed_on_the_decoded_path_of_a_path_or_absolute_url_only(target, routed):
    # Go: url.ParseRequestURI refuses a target that is neither (400); the path is decoded.
    try:
        assert route(target) == routed
    except Refused as refused:
        assert refused.status == routed


@pytest.mark.parametrize("headers,status", [
    (b"", 400),  # HTTP/1.1 without Host (Go: "missing required Host header")
    (b"Host: a\r\nHost: b\r\n", 400),
    (b"Host: a\r\nTransfer-Encoding: gzip\r\n", 501),  # Go: unsupported transfer encoding
    (b"Host: a\r\nContent-Length: x\r\n", 400),
    (b"Host: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n", 400),
    (b"Host: a\r\nBad Name : x\r\n", 400),  # whitespace before the colon: smuggling
    (b"Host: a\r\n folded\r\n", 400),  # obs-fold
    (b"Host: a\r\nno colon\r\n", 400),
])
def test_h11_refuses_as_go_does(headers, status):
    assert every_split(b"GET /metrics HTTP/1.1\r\n" + headers + b"\r\n") == status


def test_http_1_0_needs_no_host_and_a_body_closes_the_connection():
    request = every_split(b"GET /metrics HTTP/1.0\r\n\r\n")
    assert isinstance(request, Request) and request.minor == 0 and request.close
    request = every_split(HEAD + b"Content-Length: 3\r\n\r\n")
    assert isinstance(request, Request) and request.close  # its body is never read
    request = every_split(HEAD + b"Content-Length: 0\r\n\r\n")
    assert isinstance(request, Request) and not request.close


def test_only_kept_headers_reach_the_request_and_repeats_are_joined():
    request = every_split(HEAD + b"Accept: a\r\nCookie: c\r\nACCEPT: b\r\nX-Y: z\r\n\r\n")
    assert isinstance(request, Request) and dict(request.headers) == {"accept": "a, b"}


def test_header_lines_and_bytes_are_bounded():
    assert isinstance(every_split(HEAD + b"X: y\r\n" * (MAX_HEADER_LINES - 2) + b"\r\n"), Request)
    assert verdict(HEAD + b"X: y\r\n" * (MAX_HEADER_LINES - 1) + b"\r\n") == 431
    assert verdict(HEAD + b"Cookie: " + b"a" * (2 << 20) + b"\r\n\r\n", 1 << 16) == 431  # Go's 1 MiB


def test_the_bytes_after_a_head_are_handed_back():
    complete = Head().feed(b"\r\n" + HEAD + b"\r\nGET /next")  # an empty line before: skipped
    assert complete is not None and complete.rest == b"GET /next"


@pytest.mark.parametrize("first", [b"GET /a HTTP/1.1\nHost: x\n\n", b"GET /a HTTP/1.1\r\nHost: x\n\r\n",
                                   b"GET /a HTTP/1.0\n\n", b"GET /a HTTP/1.1\nHost: x\r\n\r\n"])
def test_a_head_ended_by_bare_lfs_hands_back_the_next_pipelined_head(first):
    """Read whole, a head whose blank line is a bare LF was given to h11 with the pipelined
    head after it, and h11 kept that one: rest was b"", the second request never answered."""
    second = b"GET /b HTTP/1.1\r\nHost: y\r\n\r\n"
    request = every_split(first + second)
    assert isinstance(request, Request) and request.path == "/a"
    complete = Head().feed(first + second)
    assert complete is not None and complete.rest == second
    assert Head().feed(complete.rest) is not None


def test_keep_alive_as_go_keeps_it():
    assert keep_alive(1, "") and not keep_alive(1, "Close") and not keep_alive(1, "x, close")
    assert keep_alive(0, "Keep-Alive") and not keep_alive(0, "")  # h11 would close every 1.0


def test_answers_bytes():
    request = verdict(HEAD + b"\r\n")
    assert isinstance(request, Request)
    answer = message(plain(404), request, close=False)
    assert answer.startswith(b"HTTP/1.1 404 Not Found\r\nDate: ") and answer.endswith(b"\r\n\r\nNot Found\n")
    assert b"Content-Length: 10\r\n" in answer and b"Connection" not in answer
    head = verdict(b"HEAD / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert isinstance(head, Request)
    answer = message(plain(200), head, close=False)
    assert answer.endswith(b"Content-Length: 3\r\nConnection: keep-alive\r\n\r\n")  # HEAD: no body
    assert b"Connection: close\r\n" in message(plain(431), None, close=True)


def test_a_header_that_cannot_be_written_is_dropped_and_logged_once(caplog, monkeypatch):
    """A value with CR LF wrote a header of its own into the answer (response splitting), and
    one beyond latin-1 raised UnicodeEncodeError: the answer was never written."""
    monkeypatch.setattr(heads, "DROPPED", set())
    request = verdict(HEAD + b"\r\n")
    assert isinstance(request, Request)
    bad = [("Content-Security-Policy", "a\r\nSet-Cookie: pwn=1"), ("X-A", "default-src \u2014 self"),
           ("X-B", "a\nb"), ("X-C", "a\x00b"), ("X\r\nSet-Cookie", "pwn=1"), ("X D", "v")]
    answer = plain(200, [*bad, ("X-Frame-Options", "deny"), ("X-E", "a\tb caf\xe9")])
    for _ in range(2):
        written = message(answer, request, close=False)
        head, body = written.split(b"\r\n\r\n", 1)
        assert body == b"OK\n"
        lines = head.split(b"\r\n")
        assert [line.split(b":")[0] for line in lines[2:]] == [b"Content-Type", b"X-Frame-Options", b"X-E",
                                                               b"Content-Length"], lines
        assert b"pwn" not in written and b"\r" not in head.replace(b"\r\n", b"")
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == len(bad), dropped  # once each, not once an answer
