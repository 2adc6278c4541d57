"""Shared test helpers: real tmpfs mounts, a real shmwatch process, scraping and parsing."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Iterator, List, NoReturn, Optional, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
IS_ROOT = os.geteuid() == 0

UNDER_CI = os.environ.get("CI") == "true"


def prerequisite_missing(why: str) -> NoReturn:
    """A check that cannot run here: a skip that says why, and under CI (CI=true, where
    .ci/run installs everything) a failure, so nothing is silently left untested there."""
    if UNDER_CI:
        pytest.fail(f"prerequisite missing under CI: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def _root() -> None:
    if not IS_ROOT:
        prerequisite_missing("needs root to mount tmpfs / create cgroups")


needs_root = pytest.mark.usefixtures("_root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mounted_tmpfs(size: str = "16m", parent: Optional[str] = None, path: Optional[str] = None,
                  options: str = "") -> Iterator[str]:
    """A real tmpfs, unmounted (lazily, so a leftover holder cannot wedge the suite) at the end."""
    made = path is None
    if path is None:
        path = tempfile.mkdtemp(prefix="shmwatch-tmpfs-", dir=parent)
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777{options}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        if made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmpfs() -> Iterator[str]:
    if not IS_ROOT:
        prerequisite_missing("needs root to mount tmpfs")
    with mounted_tmpfs("16m") as path:
        yield path


Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def parse_exposition(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, /, **labels: str) -> Optional[float]:
    """The one sample of `name` whose labels include `labels`; None when there is none."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0] if found else None


def select(samples: Samples, name: str, /, **labels: str) -> List[Tuple[Dict[str, str], float]]:
    return [(dict(ls), v) for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]


class Exporter:
    """A real `shmwatch` process on a free loopback port."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None, scheme: str = "http", context=None):
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}/metrics"
        self.args = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{self.port}", *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None
        self.context = context  # an SSLContext for https
        self.stderr_path = tempfile.mktemp(prefix="shmwatch-stderr-")

    def __enter__(self) -> "Exporter":
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=self.stderr)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shmwatch exited {self.proc.returncode}: {self.log()}")
            try:
                text = self.scrape_text()
            except OSError:
                time.sleep(0.05)
                continue
            # Ready once every collector has reported at least once.
            if "shmwatch_collector_duration_seconds" in text and self._all_ran(text):
                return
            time.sleep(0.05)
        raise TimeoutError(f"shmwatch not ready: {self.log()}")

    @staticmethod
    def _all_ran(text: str) -> bool:
        samples = parse_exposition(text)
        durations = select(samples, "shmwatch_collector_duration_seconds")
        return bool(durations) and all(v > 0 for _, v in durations)

    def scrape_text(self, context=None) -> str:
        with urllib.request.urlopen(self.url, timeout=5, context=context or self.context) as response:
            return response.read().decode()

    def scrape(self) -> Samples:
        return parse_exposition(self.scrape_text())

    def wait_for(self, predicate, timeout: float = 20.0, interval: float = 0.1) -> Samples:
        deadline = time.monotonic() + timeout
        samples: Samples = {}
        while time.monotonic() < deadline:
            samples = self.scrape()
            if predicate(samples):
                return samples
            time.sleep(interval)
        raise AssertionError(f"condition not met in {timeout}s; last scrape had {len(samples)} samples")

    def log(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, sig_timeout: float = 5.0) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(sig_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else 0

    def __exit__(self, *exc) -> None:
        self.stop()
        self.stderr.close()
        with contextlib.suppress(OSError):
            os.unlink(self.stderr_path)


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not installed (Debian package 'prometheus'; .ci/run installs it)")
    return subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)


def remove_cgroup(path: str, tries: int = 50) -> None:
    """rmdir a cgroup, waiting for its killed processes to be gone (the kernel says EBUSY
    until then); a cgroup still there after `tries` is a failure, not a leftover."""
    error: Optional[OSError] = None
    for _ in range(tries):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as err:
            error = err
            time.sleep(0.1)
    raise AssertionError(f"cgroup {path} could not be removed after {tries} tries: {error}")


def fallocate(path: str, size: int) -> None:
    """A file whose pages are all allocated, as NCCL's segments are after creation."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


PEER = os.path.join(REPO, "tests", "peers", "shm_peer.py")


def in_shm_namespace(tmpfs: str, argv: List[str]) -> List[str]:
    """argv run in a private mount namespace where `tmpfs` is bind-mounted at /dev/shm.

    shm_open() always uses /dev/shm: this puts a real peer's segments in the test's
    tmpfs, seen there under another path, as a sidecar sees the workload's volume.
    """
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /dev/shm && exec "$@"', tmpfs, *argv]


class Peer:
    """A shm_peer.py process; holds its segment until closed."""

    def __init__(self, tmpfs: str, *args: str):
        self.proc = subprocess.Popen(in_shm_namespace(tmpfs, [sys.executable, PEER, *args]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline().decode().split()
        if not line or line[0] != "ready":
            self.proc.kill()
            raise RuntimeError(f"peer {args} failed: {self.proc.stderr.read().decode()[-2000:]}")
        self.info = line[1] if len(line) > 1 else ""
        self.pid = self.proc.pid

    @property
    def comm(self) -> str:
        with open(f"/proc/{self.pid}/comm") as f:
            return f.read().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
