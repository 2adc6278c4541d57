"""Flags, environment variables, and bad configuration: one line on stderr, exit 2."""
import os
import socket
import subprocess
import sys

import pytest

from exporter.config import (ListenAddress, parse_args, parse_duration, parse_duration_or_zero, parse_listen_address,
                             parse_size)
from tests.conftest import REPO, free_port


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("15s", 15), ("1m", 60), ("2h", 7200), ("3", 3)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "", "0s", "-1s", "5 parsecs"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_a_full_scan_interval_may_be_zero_and_nothing_below():
    assert parse_duration_or_zero("0s") == parse_duration_or_zero("0") == 0
    assert parse_duration_or_zero("2m") == 120
    for bad in ("-1s", "abc", ""):
        with pytest.raises(ValueError):
            parse_duration_or_zero(bad)
    assert parse_args(["--segments.full-scan-interval=0s"]).full_scan_interval == 0


@pytest.mark.parametrize("text,size", [
    ("64Mi", 64 << 20), ("16Gi", 16 << 30), ("2g", 2 << 30), ("512k", 512 << 10), ("1048576", 1048576),
    ("1G", 10 ** 9), ("80Gi", 80 << 30), ("1.5Gi", 3 << 29),
])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_listen_address():
    assert parse_listen_address(":9841") == ListenAddress(host="", port=9841)  # every address, IPv6 and IPv4
    assert parse_listen_address("[::]:9841") == ListenAddress(host="::", port=9841)
    assert parse_listen_address("0.0.0.0:9841") == ListenAddress(host="0.0.0.0", port=9841)
    assert parse_listen_address("127.0.0.1:0") == ListenAddress(host="127.0.0.1", port=0)
    assert parse_listen_address("[::1]:9841") == ListenAddress(host="::1", port=9841)
    for bad in ("9841x", "::1:9841", "[::1:9841", "localhost:99999"):
        with pytest.raises(ValueError):
            parse_listen_address(bad)


def test_defaults():
    cfg = parse_args([])
    assert (cfg.listen, cfg.telemetry_path) == (ListenAddress(host="", port=9841), "/metrics")
    assert cfg.shm_mounts == ("/dev/shm",)
    assert (cfg.poll_interval, cfg.inventory_interval, cfg.peak_window) == (1.0, 15.0, 60.0)
    # Every collector on, but the kernel log's: a sidecar has no /dev/kmsg. Node mode reads it.
    assert {name for name, on in cfg.collectors.items() if not on} == {"oom"}
    assert parse_args(["--mode=node"]).collectors["oom"] is True
    assert parse_args(["--mode=node", "--no-collector.oom"]).collectors["oom"] is False
    assert parse_args(["--collector.oom"]).collectors["oom"] is True


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("SHMWATCH_POLL_INTERVAL", "250ms")
    monkeypatch.setenv("SHMWATCH_SHM_MOUNT", "/dev/shm,/mnt/dshm")
    monkeypatch.setenv("SHMWATCH_MEMORY_LIMIT_BYTES", "32Gi")
    monkeypatch.setenv("SHMWATCH_COLLECTOR_GPU", "false")
    cfg = parse_args(["--inventory-interval=1m", "--no-collector.sysv", "--shm.size-limit=16Gi"])
    assert cfg.poll_interval == 0.25 and cfg.inventory_interval == 60
    assert cfg.shm_mounts == ("/dev/shm", "/mnt/dshm")
    assert cfg.memory_limit_bytes == 32 << 30 and cfg.shm_size_limit == 16 << 30
    assert cfg.collectors["gpu"] is False and cfg.collectors["sysv"] is False and cfg.collectors["segments"]
    # The command line wins over the environment.
    assert parse_args(["--poll-interval=2s", "--shm.mount=/x"]).poll_interval == 2.0
    assert parse_args(["--shm.mount=/x"]).shm_mounts == ("/x",)


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


def test_the_metric_and_class_tables_are_rows_of_code():
    """The catalogue and the segment class table are tuples of frozen rows built by keyword
    (no text read by a regex, which would skip a line it does not match). (The flags are
    code too: exporter/config.py's Config, tests/unit/test_config.py.)"""
    import dataclasses
    import re

    from exporter.model import catalogue, classes

    for rows, kind in ((catalogue.CATALOGUE, catalogue.Metric), (classes.CLASSES, classes.ClassRule)):
        assert rows and all(type(row) is kind for row in rows)
        assert kind.__dataclass_params__.frozen and dataclasses.fields(kind)
    for row in classes.CLASSES:
        re.compile(row.pattern)
        assert re.fullmatch(r"\w+", row.cls) and row.source, row
