"""Flags, environment variables, and bad configuration: one line on stderr, exit 2."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port


def run_shmwatch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=REPO, capture_output=True, timeout=30,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,env,flag", [
    (["--no-such-flag"], None, "--no-such-flag"),
    (["--poll-interval=abc"], None, "--poll-interval"),
    ([], {"SHMWATCH_POLL_INTERVAL": "abc"}, "--poll-interval"),
    (["--shm.size-limit=lots"], None, "--shm.size-limit"),
    (["--web.listen-address=nowhere"], None, "--web.listen-address"),
    (["--web.tls-cert-file=/nonexistent/cert.pem", "--web.tls-key-file=/nonexistent/key.pem"], None,
     "--web.tls-cert-file"),
    (["--web.tls-key-file=/k.pem"], None, "--web.tls-key-file"),
    (["--cgroup.path=/a", "--cgroup.target-process=vllm"], None, "--cgroup.path"),
    (["--cgroup.target-process=("], None, "--cgroup.target-process"),
])
def test_bad_configuration_exits_2_with_one_line(args, env, flag):
    result = run_shmwatch(*args, "--web.listen-address=127.0.0.1:0" if "listen" not in str(args) else "--log.level=info",
                          env=env)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and "Traceback" not in err


def test_port_in_use_exits_2():
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = run_shmwatch(f"--web.listen-address=127.0.0.1:{port}", "--no-collector.gpu")
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "--web.listen-address" in err and "in use" in err.lower()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unreadable_certificate_exits_2(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate")
    key = tmp_path / "key.pem"
    key.write_text("not a key")
    result = run_shmwatch("--web.listen-address=127.0.0.1:0", f"--web.tls-cert-file={cert}",
                          f"--web.tls-key-file={key}")
    err = result.stderr.decode()
    assert result.returncode == 2 and "--web.tls-cert-file" in err and len(err.strip().splitlines()) == 1, err
