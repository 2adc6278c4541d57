"""The container tier: real Docker containers in the deployment shapes of DESIGN.md.

A session fixture starts Debian's dockerd when none answers, builds the base image with
mmdebstrap when it is missing (no registry can be reached) and builds the repository's own
Dockerfile. Without an engine the tier skips, loudly; under CI=true that is a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import yaml

from tests.conftest import REPO, parse_exposition, select, value
from tests.containers import engine as eng

SERVER_IMAGE = eng.SERVER_IMAGE
SERVER_CONTEXT = os.path.join(os.path.dirname(__file__), "server")
RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-rules.yml")
FIGURES: Dict[str, str] = {}


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.write_sep("-", "container tier figures")
        for name, figure in FIGURES.items():
            terminalreporter.write_line(f"{name}: {figure}")


@pytest.fixture(scope="package")
def images() -> Iterator[None]:
    started = time.monotonic()
    engine = eng.Engine()
    try:
        engine.start()
    except eng.EngineUnavailable as err:
        message = f"CONTAINER TIER NOT RUN: no container engine: {err}"
        if eng.IN_CI:
            pytest.fail(message + " (CI=true: .ci/run must install docker.io and mmdebstrap)")
        FIGURES["tier"] = message  # repeated in the terminal summary, not only behind -rs
        pytest.skip(message)
    try:
        if eng.image_exists(eng.BASE_IMAGE):
            FIGURES["base image"] = f"{eng.BASE_IMAGE} already present, not rebuilt"
        else:
            took = eng.build_base_image()
            FIGURES["base image"] = f"built in {took:.0f} s, {eng.image_size(eng.BASE_IMAGE) / 2**20:.0f} MiB"
        took = eng.build_project_image()
        FIGURES["project image"] = (f"docker build in {took:.0f} s, "
                                    f"{eng.image_size(eng.PROJECT_IMAGE) / 2**20:.0f} MiB")
        eng.build_context_image(SERVER_IMAGE, SERVER_CONTEXT)
        yield
    finally:
        # Only what this tier labelled: other containers on the machine are not ours.
        listed = eng.docker("ps", "-aq", "--filter", f"label={eng.LABEL}", check=False).stdout.decode().split()
        if listed:
            eng.docker("rm", "-f", *listed, check=False)
        engine.stop()
        FIGURES["tier"] = f"{time.monotonic() - started:.0f} s from engine start to cleanup"


def name(prefix: str) -> str:
    return f"shmwatch-{prefix}-{uuid.uuid4().hex[:8]}"


class Container:
    """A detached container of this tier; removed on exit."""

    def __init__(self, image: str, *args: str, run: List[str] = (), prefix: str = "c"):
        self.name = name(prefix)
        self.argv = ["run", "-d", "--name", self.name, "--label", eng.LABEL, *run, image, *args]
        self.id = ""

    def __enter__(self) -> "Container":
        self.id = eng.docker(*self.argv).stdout.decode().strip()
        return self

    def __exit__(self, *exc) -> None:
        eng.docker("rm", "-f", self.name, check=False)

    def inspect(self, template: str) -> str:
        return eng.docker("inspect", "-f", template, self.name).stdout.decode().strip()

    def logs(self) -> str:
        done = eng.docker("logs", self.name, check=False)
        return (done.stdout + done.stderr).decode(errors="replace")

    @property
    def ip(self) -> str:
        return self.inspect("{{.NetworkSettings.IPAddress}}")


class Server(Container):
    """tests/containers/server/workload.py in its own container with a shareable IPC namespace;
    `info` is what it made (segment names, its pid inside the container, sizes)."""

    def __init__(self, user: Optional[str] = None, tag: str = "s", run: List[str] = ()):
        super().__init__(SERVER_IMAGE, tag, run=["--ipc=shareable", *(["--user", user] if user else []), *run],
                         prefix="server")
        self.info: Dict = {}

    def __enter__(self) -> "Server":
        super().__enter__()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in self.logs().splitlines():
                if line.startswith("{"):
                    self.info = json.loads(line)
                    self.host_pid = int(self.inspect("{{.State.Pid}}"))
                    return self
            if self.inspect("{{.State.Running}}") != "true":
                break
            time.sleep(0.2)
        logs = self.logs()
        self.__exit__()
        raise RuntimeError(f"server did not start: {logs[-2000:]}")

    def sidecar_args(self) -> List[str]:
        return [f"--ipc=container:{self.name}", f"--pid=container:{self.name}"]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def samples_at(url: str):
    """The exposition at `url` parsed, or no samples while it does not answer yet."""
    try:
        return parse_exposition(scrape(url))
    except OSError:
        return {}


def wait_for_inventory(container: Container, segments: int, timeout: float = 30.0) -> str:
    """The exposition once every collector has run and the inventory lists `segments` files."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            text = scrape(f"http://{container.ip}:9841/metrics")
        except OSError:
            time.sleep(0.2)
            continue
        samples = parse_exposition(text)
        durations = select(samples, "shmwatch_collector_duration_seconds")
        listed = sum(v for labels, v in select(samples, "shmwatch_segments") if labels.get("state") != "hidden")
        if durations and all(v > 0 for _, v in durations) and listed >= segments:
            return text
        time.sleep(0.2)
    raise AssertionError(f"exporter not ready with {segments} segments in {timeout}s:\n{text[-1500:]}\n"
                         f"{container.logs()[-2000:]}")


def run_check(run: List[str], *args: str, entry: Optional[List[str]] = None) -> Dict:
    """`shmwatch check --output json` in a one-off container; its JSON report."""
    done = eng.docker("run", "--rm", "--label", eng.LABEL, *run, eng.PROJECT_IMAGE, *(entry or []), "check",
                      "--output", "json", *args, check=False, timeout=60)
    assert done.returncode in (0, 1, 2), done.stderr.decode()[-2000:]
    return json.loads(done.stdout)


def promtool_unit_test(input_series: List[Dict[str, str]], alert_tests: List[Dict]) -> subprocess.CompletedProcess:
    """promtool test rules over the shipped alert rules (annotations dropped: promtool would
    compare them too; this checks the firing logic only), scraped every minute."""
    promtool = shutil.which("promtool") or pytest.fail("promtool not installed (Debian 'prometheus'; .ci/run)")
    with open(RULES) as f:
        rules = yaml.safe_load(f)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    work = tempfile.mkdtemp(prefix="shmwatch-promtool-")
    try:
        with open(os.path.join(work, "rules.yml"), "w") as f:
            yaml.safe_dump(rules, f)
        tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m",
                 "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": alert_tests}]}
        with open(os.path.join(work, "tests.yml"), "w") as f:
            yaml.safe_dump(tests, f)
        return subprocess.run([promtool, "test", "rules", "tests.yml"], cwd=work, capture_output=True, text=True,
                              timeout=60)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def leak_alert_test(text: str, expected: List[Dict[str, str]]) -> subprocess.CompletedProcess:
    """promtool unit test of ShmLeakedSegments on a scrape held for 20 minutes: does it fire
    with exactly `expected` (label sets; [] = stays quiet)?"""
    target = {"instance": "sidecar:9841", "job": "shmwatch"}
    series = []
    for (metric, labels), v in parse_exposition(text).items():
        if metric in ("shmwatch_segment_bytes", "shmwatch_mount_size_bytes"):
            pairs = ", ".join(f'{k}="{val}"' for k, val in sorted({**dict(labels), **target}.items()))
            series.append({"series": f"{metric}{{{pairs}}}", "values": f"{v:.0f}x30"})
    exp = [{"exp_labels": {**target, "severity": "warning", **labels}} for labels in expected]
    return promtool_unit_test(series, [{"eval_time": "20m", "alertname": "ShmLeakedSegments", "exp_alerts": exp}])


# Runs as root with SYS_ADMIN only long enough to mount a hidepid=2 /proc over its own, then
# becomes 65534 with no capability left (python, since the bookworm base lacks setpriv).
DROP_TO_NOBODY = ('import os, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); '
                  'os.execvp(sys.argv[1], sys.argv[1:])')
HIDEPID_CMD = ["-c", f'mount -t proc -o hidepid=2 proc /proc && exec python3 -c "{DROP_TO_NOBODY}" "$@"', "--"]

_views: Dict[Tuple[str, str], Tuple[str, Dict, str]] = {}


def view(server: Server, key: str, run: List[str], hidepid: bool = False,
         args: Optional[List[str]] = None) -> Tuple[str, Dict, str]:
    """(exposition, check JSON, /proc pids the sidecar's exporter can list) of a sidecar run
    one way; cached per server and way, since every test of it reads the same state."""
    if (server.name, key) in _views:
        return _views[(server.name, key)]
    base = [*server.sidecar_args(), "--read-only", *run]
    # Every family: the tests of each shape read the opt-in ones too (processes' shm, unattributed bytes).
    args = [*(args or []), "--no-collector.gpu", "--metric-opt-in-list=.*"]
    entry = HIDEPID_CMD + ["shmwatch"] if hidepid else []
    with Container(eng.PROJECT_IMAGE, *entry, *args, "--inventory-interval=1s", run=base,
                   prefix="sidecar") as sidecar:
        text = wait_for_inventory(sidecar, segments=3)
        # The pids the exporter's user can list: 65534 when it runs as the image's user or
        # drops to it under hidepid, else the container's own user.
        user = ["-u", "65534"] if hidepid or not run else []
        pids = eng.docker("exec", *user, sidecar.name, "sh", "-c", "ls /proc | grep -E '^[0-9]+$'",
                          check=False).stdout.decode().split()
    report = run_check(base, *args, entry=entry)
    _views[(server.name, key)] = (text, report, " ".join(pids))
    return _views[(server.name, key)]


def top(samples, name: str) -> Dict[str, str]:
    found = [labels for labels, _ in select(samples, "shmwatch_top_segment_bytes", name=name)]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def rm_advice(report: Dict) -> str:
    return " ".join(f.get("remedy", "") + " " + f.get("message", "") for f in report["findings"])


def rm_targets(report: Dict) -> set:
    """Every path that check's advice tells the operator to `rm`."""
    out = set()
    for finding in report["findings"]:
        for command in re.findall(r"\brm\s+((?:-\S+\s+)*(?:/\S+\s*)+)", finding.get("remedy", "")):
            out |= {word for word in command.split() if word.startswith("/")}
    return out


def assert_full_attribution(server: Server, text: str, report: Dict) -> None:
    """Every live segment attributed to the server's process, the real leak `orphan` with its age."""
    samples = parse_exposition(text)
    info, sizes = server.info, server.info["sizes"]
    owner = "python3"  # the server's process by its name, never its pid (a series per restart)
    assert top(samples, info["nccl"])["state"] == "linked" and top(samples, info["nccl"])["owner"] == owner
    assert top(samples, info["psm"])["state"] == "linked" and top(samples, info["psm"])["owner"] == owner
    assert top(samples, info["torch"])["state"] == "hidden" and top(samples, info["torch"])["owner"] == owner
    assert value(samples, "shmwatch_process_shm_bytes", comm=owner) == \
        sizes["nccl"] + sizes["psm"] + sizes["torch"]
    # The real leak: listed, held by nobody, an hour old (the workload set its mtime back).
    assert top(samples, info["leak"])["state"] == "orphan" and "owner" not in top(samples, info["leak"])
    assert value(samples, "shmwatch_orphan_oldest_age_seconds", mount="/dev/shm") >= 3600
    assert value(samples, "shmwatch_mount_unattributed_bytes", mount="/dev/shm") == 0
    assert value(samples, "shmwatch_proc_unreadable") == 0
    assert value(samples, "shmwatch_sysv_segments") >= 1 and value(samples, "shmwatch_sysv_orphan_segments") == 0
    # check: the leak with its age and the rm that removes it; no live segment.
    orphans = {o["name"]: o for o in report["shm"][0]["orphans"]}
    assert orphans[info["leak"]]["age_seconds"] >= 3600
    assert not {info["nccl"], info["psm"], info["torch"]} & set(orphans)
    assert f"/dev/shm/{info['leak']}" in rm_targets(report)
    assert not {f"/dev/shm/{info[k]}" for k in ("nccl", "psm", "torch")} & rm_targets(report)


@pytest.fixture(scope="package")
def root_server(images) -> Iterator[Server]:
    """The server as its image's user: root (as vLLM's image runs)."""
    with Server(tag="r") as server:
        yield server


@pytest.fixture(scope="package")
def uid_server(images) -> Iterator[Server]:
    """The server at a chosen UID (1000), as the Kubernetes non-root variant runs vLLM."""
    with Server(user="1000:1000", tag="u") as server:
        yield server
