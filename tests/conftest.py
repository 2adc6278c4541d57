"""Shared test helpers: real tmpfs mounts, a real shmwatch process, scraping and parsing."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Iterator, List, NoReturn, Optional, Set, Tuple

import pytest
from hypothesis import HealthCheck, settings
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


def _uninspectable() -> Set[Tuple[str, int]]:
    """(comm, uid) of the processes whose maps even root may not read on this machine: here
    the VM's agent, Firecracker's process_api, as pid 1, which holds capabilities our bounding
    set lacks, and whatever it starts with them. Those come and go: the likely reason why, on
    CI, five orphan tests saw `unverified` for up to 10 s while the tests around them passed
    (the terminal summary lists the ones seen during the run)."""
    found = set()
    if not IS_ROOT:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/maps", "rb") as f:
                f.read(1)
        except PermissionError:
            try:
                with open(f"/proc/{name}/comm") as f:
                    found.add((f.read().strip(), os.stat(f"/proc/{name}").st_uid))
            except OSError:
                pass
        except OSError:
            pass
    return found


UNINSPECTABLE = _uninspectable()
# Where root cannot read some root process at the start, the host-namespace tests that expect
# `orphan` excuse every root process it cannot read (--segments.ignore-unreadable matches comm,
# and the agent's helpers have names nobody can list beforehand), as an operator of such a host
# would. Their peers are root's and readable, so nothing the tests start is excused; the tests of
# `unverified` run the strict view: env={"SHMWATCH_SEGMENTS_IGNORE_UNREADABLE": ""}, and the
# container tier never sets it.
HOST_EXCUSED = ".*" if any(uid == 0 for _, uid in UNINSPECTABLE) else None
if HOST_EXCUSED:
    os.environ.setdefault("SHMWATCH_SEGMENTS_IGNORE_UNREADABLE", HOST_EXCUSED)
HOST_EXCUSED_RE = re.compile(HOST_EXCUSED) if HOST_EXCUSED else None


@pytest.fixture(scope="session", autouse=True)
def _watch_uninspectable() -> Iterator[None]:
    """Records, every 2 s, the processes root could not read during the run: the terminal
    summary lists them, so a CI machine's surprises reach whoever reads its output."""
    if not IS_ROOT:
        yield
        return
    import threading
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(2.0):
            SEEN_UNINSPECTABLE.update(_uninspectable())

    worker = threading.Thread(target=watch, daemon=True, name="uninspectable-watch")
    worker.start()
    yield
    stop.set()


SEEN_UNINSPECTABLE: Set[Tuple[str, int]] = set(UNINSPECTABLE)


def pytest_terminal_summary(terminalreporter) -> None:
    if SEEN_UNINSPECTABLE:
        terminalreporter.write_sep("-", "processes root could not read during the run")
        terminalreporter.write_line(", ".join(f"{comm} (uid {uid})" for comm, uid in sorted(SEEN_UNINSPECTABLE))
                                    + f"; excused in host-namespace tests: {HOST_EXCUSED or 'none'}")


def stop_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


# Every family, the opt-in ones too: for a test of an opt-in family's values.
EVERY_FAMILY = "--metric-opt-in-list=.*"


class Exporter:
    """A real `shmwatch` process on a free loopback port."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None, scheme: str = "http", context=None,
                 headers: Optional[Dict[str, str]] = None, listen: str = "127.0.0.1",
                 run_as: Optional[List[str]] = None, tree: str = REPO):
        """`run_as`: the command prefix that starts Python, e.g. nonroot_python's (another UID).
        `tree`: the checkout whose `exporter` runs (a benchmark's older code beside this one)."""
        self.port = free_port()
        # listen: the host part of --web.listen-address ("" for ":PORT", "[::1]", ...).
        host = "127.0.0.1" if listen in ("", "[::]", "0.0.0.0") else listen
        self.url = f"{scheme}://{host}:{self.port}/metrics"
        self.headers = headers or {}  # e.g. Authorization for a web config with basic auth
        self.args = [*(run_as or [sys.executable]), "-m", "exporter", f"--web.listen-address={listen}:{self.port}",
                     *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None
        self.context = context  # an SSLContext for https
        self.stderr_path = tempfile.mktemp(prefix="shmwatch-stderr-")
        self.tree = tree

    def __enter__(self) -> "Exporter":
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.args, cwd=self.tree, env=self.env, stdout=subprocess.DEVNULL,
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
        request = urllib.request.Request(self.url, headers=self.headers)
        with urllib.request.urlopen(request, timeout=5, context=context or self.context) as response:
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
        # What the segments looked like, and the exporter's own account of why (its log says
        # which processes it could not read when a segment stays `unverified`).
        states = sorted(f"{dict(ls).get('mount')}:{dict(ls).get('state')}:{dict(ls).get('class')}={v:g}"
                        for (n, ls), v in samples.items() if n == "shmwatch_segments")
        raise AssertionError(f"condition not met in {timeout}s; last scrape had {len(samples)} samples; "
                             f"segments {states[:12]}; proc_unreadable "
                             f"{value(samples, 'shmwatch_proc_unreadable')}; log: {self.log()[-1500:]}")

    def log(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, sig_timeout: float = 5.0) -> int:
        if self.proc:
            stop_process(self.proc, sig_timeout)
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


def remove_pod_cgroups(paths: List[str]) -> None:
    """Pod memory cgroups made under V1_MEMORY/kubepods/burstable removed, then those two
    parents, unless another test's pod cgroups are still in them."""
    from tests.helpers import V1_MEMORY

    for path in paths:
        remove_cgroup(path)
    for parent in ("kubepods/burstable", "kubepods"):
        try:
            os.rmdir(os.path.join(V1_MEMORY, parent))
        except OSError:
            pass  # absent, or not empty


def fallocate(path: str, size: int) -> None:
    """A file whose pages are all allocated, as NCCL's segments are after creation."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


PEER = os.path.join(REPO, "tests", "peers", "shm_peer.py")
ENGINES = os.path.join(REPO, "tests", "peers", "engines.py")  # the engines' kinds (issue 32)


def in_shm_namespace(tmpfs: str, argv: List[str]) -> List[str]:
    """argv run in a private mount namespace where `tmpfs` is bind-mounted at /dev/shm.

    shm_open() always uses /dev/shm: this puts a real peer's segments in the test's
    tmpfs, seen there under another path, as a sidecar sees the workload's volume.
    """
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /dev/shm && exec "$@"', tmpfs, *argv]


def in_own_mount_namespace(scenario: str, *args: str, pid: bool = False) -> None:
    """Runs `scenario` (Python that prints "ok") in a private mount namespace, apart from the
    host's mount table that other tests change; `pid`: as pid 1 of a PID namespace of its own
    (its /proc mounted anew)."""
    unshare = ["unshare", "--mount", "--propagation", "private"]
    unshare += ["--pid", "--fork", "--mount-proc"] if pid else []
    done = subprocess.run([*unshare, sys.executable, "-c", scenario, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


class Peer:
    """A shm_peer.py process; holds its segment until closed."""

    def __init__(self, tmpfs: str, *args: str, script: str = PEER):
        self.proc = subprocess.Popen(in_shm_namespace(tmpfs, [sys.executable, script, *args]),
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


def _runtime_deps() -> List[str]:
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


RUNTIME_DEPS = _runtime_deps()
NOBODY = 65534


@pytest.fixture(scope="session")
def nonroot_venv() -> str:
    """The python3 of a venv any UID may run, with the runtime dependencies. The test
    interpreter lives under /root (0700 here), so a venv of Debian's python3 is made outside
    the checkout, once per machine."""
    if not IS_ROOT:
        prerequisite_missing("needs root to switch to another UID")
    base = "/usr/bin/python3"
    venv = os.path.join(tempfile.gettempdir(), "shmwatch-nonroot-venv")
    python = os.path.join(venv, "bin", "python3")
    stamp = os.path.join(venv, "deps.txt")
    wanted = "\n".join(RUNTIME_DEPS)
    if not (os.path.exists(stamp) and open(stamp).read() == wanted):
        if not os.path.exists(base):
            pytest.fail("needs Debian's python3 with venv (packages python3, python3-venv; .ci/run installs them)")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([base, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *RUNTIME_DEPS],
                       check=True)
        with open(stamp, "w") as f:
            f.write(wanted)
    return python


@pytest.fixture(scope="session")
def nonroot_python(nonroot_venv: str) -> List[str]:
    """A command prefix that runs this checkout's exporter as UID/GID 65534 with no
    capabilities, as the image's user runs it."""
    python = nonroot_venv
    return ["env", f"PYTHONPATH={REPO}", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", python]


# database=None: Hypothesis would otherwise keep its examples in .hypothesis/ in the
# checkout. Under mutmut (MUTANT_UNDER_TEST set) each mutant reruns these: fewer examples.
settings.register_profile("shmwatch", max_examples=150, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("mutmut", max_examples=30, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("mutmut" if os.environ.get("MUTANT_UNDER_TEST") else "shmwatch")
