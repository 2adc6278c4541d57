"""SIGTERM under load, as a rollout or a node drain sends it: a real exporter with 200
connections in assorted states (silent, mid-TLS-handshake, mid-head, kept alive, answers
not read, half-closed, scrapers mid-request) ends within 2 s with exit 0; every stderr line
is a logfmt log line (nothing printed by the interpreter: no traceback, no "Exception
ignored", no "Task was destroyed"), and no scraper reads a cut-short answer."""

import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import pytest

from tests.conftest import Exporter
from tests.system.test_logs import parse_logfmt
from tests.system.test_security import make_cert, write_pem

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: shmwatch\r\n"
PER_STATE = 25  # six states of held connections, and 50 scrapers: 200 connections
SCRAPERS = 50  # of them 10 read slowly: their answers are being written at SIGTERM
SLOW_READERS = 10
INTERPRETER_WORDS = ("Traceback", "Exception ignored", "Task was destroyed", "Event loop is closed")


@dataclass
class Scrapers:
    """Threads scraping over kept-alive connections until the server is gone."""

    connect: Callable[[], http.client.HTTPConnection]
    answers: int = 0
    cut_short: List[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: List[threading.Thread] = field(default_factory=list)

    def start(self, count: int) -> None:
        for _ in range(count):
            thread = threading.Thread(target=self.scrape, daemon=True)
            thread.start()
            self.threads.append(thread)

    def scrape(self) -> None:
        conn: Optional[http.client.HTTPConnection] = None
        while not self.stop.is_set():
            try:
                conn = conn or self.connect()
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                body = response.read()
                if response.status == 200 and b"shmwatch_build_info" in body:
                    self.answers += 1
            except http.client.IncompleteRead as err:  # a body shorter than its Content-Length
                self.cut_short.append(repr(err)[:200])
                conn = None
            except (OSError, http.client.HTTPException):
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.01)

    def read_slowly(self, connect: Callable[[], socket.socket]) -> None:
        """20 pipelined requests on a kept-alive connection read on a small buffer, 2 KiB
        every 5 ms: answers wait in the server's socket most of the time. Each must come
        whole, or not at all."""
        while not self.stop.is_set():
            data, answered = b"", 0
            try:
                with connect() as sock:
                    sock.sendall((REQUEST + b"\r\n") * 20)
                    while answered < 20 and (chunk := sock.recv(2048)):
                        data += chunk
                        whole, data = whole_answers(data)
                        answered += whole
                        time.sleep(0.005)
            except OSError:
                pass  # refused or reset once the server is gone: what came is judged
            self.answers += answered
            if data:
                self.cut_short.append(f"{len(data)} bytes of an answer")

    def start_slow(self, count: int, connect: Callable[[], socket.socket]) -> None:
        for _ in range(count):
            thread = threading.Thread(target=self.read_slowly, args=(connect,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


def client_hello(context: ssl.SSLContext) -> bytes:
    """The first flight of a TLS handshake, as bytes (to send half of it)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


class Load:
    """Connections held in each state; `tls` makes them TLS clients (handshake done but for
    the silent and the mid-handshake ones)."""

    def __init__(self, port: int, context: Optional[ssl.SSLContext]):
        self.port, self.context, self.socks = port, context, []

    def connect(self, handshake: bool = True, small_buffer: bool = False) -> socket.socket:
        sock = socket.socket()
        if small_buffer:  # the answers pile up in the server's buffers, not ours
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        sock.connect(("127.0.0.1", self.port))
        if self.context and handshake:
            sock = self.context.wrap_socket(sock, server_hostname="127.0.0.1")
        self.socks.append(sock)
        return sock

    def hold(self) -> None:
        for _ in range(PER_STATE):
            self.connect(handshake=False)  # silent: no byte (under TLS: no ClientHello)
            partial = self.connect(handshake=False)  # mid-handshake, or mid-request-line
            partial.sendall(client_hello(self.context)[:40] if self.context else b"GET /met")
            self.connect().sendall(REQUEST + b"X-Slow: ")  # mid-head
            kept = self.connect()  # kept alive after one answer
            kept.sendall(REQUEST + b"\r\n")
            read_one_answer(kept)
            self.connect(small_buffer=True).sendall((REQUEST + b"\r\n") * 40)  # answers not read
            half = self.connect()
            half.sendall(REQUEST + b"Connection: close\r\n\r\n")
            if not self.context:
                half.shutdown(socket.SHUT_WR)  # half-closed: the answer is still owed

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def whole_answers(data: bytes) -> Tuple[int, bytes]:
    """How many whole answers `data` begins with, and what follows them."""
    count = 0
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = content_length(head) or 0
        if len(rest) < length:
            break
        count, data = count + 1, rest[length:]
    return count, data


def content_length(head: bytes) -> Optional[int]:
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return int(lengths[0]) if lengths else None


def read_one_answer(sock: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = content_length(head) or 0
    while len(body) < length:
        body += sock.recv(65536)


def stderr_lines(exporter: Exporter) -> List[str]:
    exporter.stderr.flush()
    with open(exporter.stderr_path, "rb") as f:
        return f.read().decode(errors="replace").splitlines()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_sigterm_under_load_ends_in_2_s_with_only_log_lines(tmp_path, tls):
    mount = tmp_path / "shm"
    mount.mkdir()
    args = [f"--shm.mount={mount}", "--no-collector.gpu", "--log.level=debug"]
    context = None
    if tls:
        cert, key = write_pem(str(tmp_path), "server", *make_cert("127.0.0.1", san_ip="127.0.0.1"))
        web = tmp_path / "web.yml"
        web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
        args.append(f"--web.config.file={web}")
        context = ssl.create_default_context(cafile=cert)
    with Exporter(*args, scheme="https" if tls else "http", context=context) as exporter:
        if tls:
            scrapers = Scrapers(lambda: http.client.HTTPSConnection("127.0.0.1", exporter.port, timeout=5,
                                                                    context=context))
        else:
            scrapers = Scrapers(lambda: http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5))
        load = Load(exporter.port, context)
        try:
            load.hold()
            scrapers.start(SCRAPERS - SLOW_READERS)
            scrapers.start_slow(SLOW_READERS, lambda: load.connect(small_buffer=True))
            time.sleep(1)
            assert exporter.proc.poll() is None and scrapers.answers > 0
            started = time.monotonic()
            exporter.proc.terminate()
            code = exporter.proc.wait(10)
            took = time.monotonic() - started
        finally:
            scrapers.join()
            load.close()
        lines = stderr_lines(exporter)
    print(f"\nSIGTERM with {6 * PER_STATE + SCRAPERS} connections ({'https' if tls else 'http'}): exit {code} "
          f"in {took:.2f} s; {scrapers.answers} scrapes answered; {len(lines)} log lines")
    text = "\n".join(lines)
    assert not [word for word in INTERPRETER_WORDS if word in text], text[-3000:]
    records = [parse_logfmt(line) for line in lines]
    assert all({"ts", "level", "msg"} <= set(record) for record in records)
    assert [r for r in records if r["level"] == "error"] == []
    assert any(r["msg"].startswith("received SIGTERM") for r in records)
    assert "HTTP server stopped, 0 connections left open" in [r["msg"] for r in records]
    assert code == 0 and took < 2.0, (code, took)
    assert scrapers.cut_short == []
