"""--log.format: every line the exporter writes parses as logfmt (values with spaces,
quotes, '=' and newlines quoted and escaped) or, with json, as one JSON object."""
import json
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

import pytest

from exporter.cli import logfmt_value
from tests.conftest import REPO, free_port
from tests.system.test_security import make_cert, write_pem

_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n", "r": "\r", "t": "\t"}


def parse_logfmt(line):
    """A strict logfmt reader (go-logfmt's grammar): key=value pairs separated by one space,
    a bare value without space, '=' or '"', a quoted value with backslash escapes."""
    pairs, i = {}, 0
    while i < len(line):
        match = re.compile(r'([^\s="]+)=').match(line, i)
        if not match:
            raise ValueError(f"no key at {i}: {line!r}")
        key, i = match.group(1), match.end()
        if line.startswith('"', i):
            out, i = [], i + 1
            while True:
                if i >= len(line):
                    raise ValueError(f"unterminated quote: {line!r}")
                c = line[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\":
                    nxt = line[i + 1]
                    if nxt == "u":
                        out.append(chr(int(line[i + 2:i + 6], 16)))
                        i += 6
                        continue
                    if nxt not in _UNESCAPE:
                        raise ValueError(f"bad escape \\{nxt}: {line!r}")
                    out.append(_UNESCAPE[nxt])
                    i += 2
                    continue
                if ord(c) < 0x20:
                    raise ValueError(f"raw control character in {line!r}")
                out.append(c)
                i += 1
            value = "".join(out)
        else:
            match = re.compile(r'[^\s="]*').match(line, i)
            value, i = match.group(0), match.end()
        if key in pairs:
            raise ValueError(f"duplicate key {key}: {line!r}")
        pairs[key] = value
        if i < len(line):
            if line[i] != " ":
                raise ValueError(f"expected a space at {i}: {line!r}")
            i += 1
    return pairs


@pytest.mark.parametrize("text", ["", "plain", "two words", 'say "hi"', "a=b", "back\\slash", "new\nline",
                                  "tab\there", "bell\x07", "ünïcødé ✓", "mount /dev/shm: inotify on", " ", "=", '"'])
def test_logfmt_values_round_trip(text):
    assert parse_logfmt(f"msg={logfmt_value(text)}") == {"msg": text}


def scrape(port, context):
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context, timeout=5) as r:
        return r.read()


def run(tmp_path, fmt):
    """A short real run over TLS that logs warnings, errors, debug lines, refused handshakes
    (plain HTTP and garbage to the TLS port), a web config reload that fails, and shutdown;
    returns its stderr lines."""
    weird = tmp_path / 'no such "mount"=here\tx'
    cert, key = write_pem(str(tmp_path), "server", *make_cert("127.0.0.1", san_ip="127.0.0.1"))
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
                             f"--shm.mount={weird}", f"--shm.mount={tmp_path}", "--log.level=debug",
                             f"--log.format={fmt}", "--cgroup.path=/nonexistent", "--poll-interval=100ms",
                             f"--web.config.file={web}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    insecure = ssl.create_default_context(cafile=cert)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # plain HTTP to TLS: refused
                    s.recv(1 << 16)
                break
            except OSError:
                time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"\x16\x03\x01\x00\x05garbage")
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=insecure, timeout=5) as r:
            assert b"shmwatch_build_info" in r.read()
        web.write_text("tls_server_config: [\n")  # a broken edit: kept the old, logged
        deadline = time.monotonic() + 10  # the watcher's next look, within a second
        while b"shmwatch_web_config_last_reload_successful 0" not in scrape(port, insecure):
            assert time.monotonic() < deadline, "the broken edit was not seen"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err[-2000:]
    lines = err.splitlines()
    assert len(lines) >= 5, err
    return lines, str(weird)


def test_every_logfmt_line_parses(tmp_path):
    lines, weird = run(tmp_path, "logfmt")
    records = [parse_logfmt(line) for line in lines]
    for record in records:
        assert {"ts", "level", "logger", "msg"} <= set(record), record
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["ts"]), record
        assert record["level"] in ("debug", "info", "warn", "error"), record
    assert any(weird in r["msg"] for r in records), "the mount name with quotes, '=' and a tab came back whole"
    assert any(r["msg"].startswith("received SIGTERM") for r in records)
    assert any(r["msg"].startswith("connection from 127.0.0.1 failed") for r in records)
    assert any("web config not reloaded" in r["msg"] for r in records)
    assert {"debug", "info", "warn", "error"} <= {r["level"] for r in records}


def test_every_json_line_parses(tmp_path):
    lines, weird = run(tmp_path, "json")
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) and {"ts", "level", "logger", "msg"} <= set(r) for r in records), records
    assert any(weird in r["msg"] for r in records)
    assert {"info", "warn", "error"} <= {r["level"] for r in records}


def test_a_bad_log_format_is_refused():
    result = subprocess.run([sys.executable, "-m", "exporter", "--log.format=xml"], cwd=REPO, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "--log.format" in result.stderr


