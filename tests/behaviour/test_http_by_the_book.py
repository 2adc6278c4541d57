"""HTTP by the book, over the wire to a real exporter: what a hostile or careless client
sends gets the answer Go's net/http (node_exporter's server) would give, and nothing else
is served: gzip only where Accept-Encoding's weights ask for it, no control byte in a
header, HTTP/1.0 and 1.1 only, routing on a decoded path only where the target is a path.
And a kept-alive connection's next head has the head's deadline again, not the idle one."""

import gzip
import http.client as http_client
import socket
import time
import urllib.request

import pytest

from exporter.exposition import http
from tests.conftest import Exporter
from tests.system.test_http_front import raw


@pytest.fixture(scope="module")
def exporter(tmp_path_factory):
    mount = tmp_path_factory.mktemp("shm")  # a plain directory: measured or not, it serves
    with Exporter(f"--shm.mount={mount}", "--no-collector.gpu") as running:
        yield running


def status(port, data):
    answer, _ = raw(port, data, timeout=5)
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else answer


CLOSE = b"Host: x\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("accept_encoding,gzipped", [
    ("gzip", True), ("gzip;q=0.5", True), ("*", True),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("identity, gzip;q=0", False), ("*;q=0", False),
    ("gzip;q=0.5, identity", False),
])
def test_gzip_only_where_accept_encoding_weighs_it_above_0(exporter, accept_encoding, gzipped):
    request = urllib.request.Request(exporter.url, headers={"Accept-Encoding": accept_encoding})
    with urllib.request.urlopen(request, timeout=5) as response:
        body, encoding = response.read(), response.headers.get("Content-Encoding")
    assert (encoding == "gzip") is gzipped
    assert b"shmwatch_build_info" in (gzip.decompress(body) if gzipped else body)


CONTROL_BYTES = (b"\x00", b"\r", b"\x01", b"\x08", b"\x0b", b"\x1b", b"\x1f", b"\x7f")


@pytest.mark.parametrize("byte", CONTROL_BYTES, ids=[f"0x{b[0]:02x}" for b in CONTROL_BYTES])
def test_a_control_byte_in_a_header_value_is_a_400(exporter, byte):
    for name in (b"Accept", b"User-Agent"):  # read by the exporter, and not
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + name + b": text/" + byte + b"plain\r\n\r\n"
        assert status(exporter.port, head) == 400, name
    # HTAB is whitespace, bytes above 0x7f are obs-text: both taken.
    assert status(exporter.port, b"GET /metrics HTTP/1.1\r\nUser-Agent: a\tb\xe9\r\n" + CLOSE) == 200


@pytest.mark.parametrize("version,code", [(b"1.9", 505), (b"1.2", 505), (b"2.0", 505), (b"0.9", 505),
                                          (b"3.0", 505), (b"1.10", 400), (b"1.0", 200), (b"1.1", 200)])
def test_http_versions_other_than_1_0_and_1_1_are_refused(exporter, version, code):
    assert status(exporter.port, b"GET /metrics HTTP/" + version + b"\r\n" + CLOSE) == code


@pytest.mark.parametrize("target,code", [
    (b"%2fmetrics", 400), (b"metrics", 400), (b"*", 400),  # Go: "invalid URI for request"
    (b"/%6detrics", 200), (b"http://x/metrics", 200), (b"/metrics%2f", 404),
])
def test_only_a_target_that_is_a_path_or_an_absolute_url_is_routed(exporter, target, code):
    assert status(exporter.port, b"GET " + target + b" HTTP/1.1\r\n" + CLOSE) == code


@pytest.mark.parametrize("head,code", [
    (b"GET /metrics HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
])
def test_what_h11_refuses_is_refused_as_go_does(exporter, head, code):
    assert status(exporter.port, head) == code


def test_an_http_1_0_keep_alive_is_kept_as_go_keeps_it(exporter):
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as sock:
        for _ in range(2):  # the same connection twice
            sock.sendall(b"GET /-/healthy HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 ") and b"Connection: keep-alive\r\n" in answer


def test_a_kept_alive_connection_has_the_head_deadline_again(monkeypatch):
    """One request answered, an idle wait longer than the head's deadline (idle is allowed),
    then a second head trickled a byte at a time: refused at the head's deadline from its
    first byte (408), not held until the idle timeout."""
    monkeypatch.setattr(http, "HEADER_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(http, "IDLE_TIMEOUT_SECONDS", 30.0)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    httpd = http.bind("127.0.0.1", 0, app)
    httpd.start()
    try:
        conn = http_client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=10)
        conn.request("GET", "/")
        assert conn.getresponse().read() == b"ok\n"
        time.sleep(1.5)  # idle, past the head's deadline: still open
        sock, answer = conn.sock, b""
        started = time.monotonic()
        sock.settimeout(0.2)
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            sock.sendall(bytes([byte]))
            try:
                answer = sock.recv(4096)
                break
            except socket.timeout:
                continue
        held = time.monotonic() - started
        conn.close()
    finally:
        httpd.shutdown()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert 0.9 < held < 2.0, f"the second head was held {held:.1f}s"


def test_pipelined_heads_ended_by_bare_lfs_are_each_answered(exporter):
    """Two heads in one write, the first ended by bare LFs (RFC 9112 lets a server take
    them), the second by CRLFs: read whole, both went to h11, which kept the second; one
    answer came, and the second request was never answered."""
    heads = b"GET /-/healthy HTTP/1.1\nHost: x\n\nGET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer, _ = raw(exporter.port, heads, timeout=5)
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer[:300]
    assert b"shmwatch_build_info" in answer
