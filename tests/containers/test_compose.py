"""deploy/docker-compose.yml under the compose Debian ships (docker-compose 1.29, which
rejects `cgroup:`): the whole file must load, and the workload + shmwatch part must run
for real. Prometheus, Alertmanager, Grafana and vLLM images cannot be pulled here (no
registry), so those services are only loaded, never faked."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.conftest import REPO, free_port, select, value
from tests.containers import engine as eng
from tests.containers.conftest import samples_at

# The first test of the session also waits for the base image and the project image.
pytestmark = pytest.mark.timeout(600)

COMPOSE_FILE = os.path.join(REPO, "deploy", "docker-compose.yml")


def compose_v1():
    found = shutil.which("docker-compose")
    if not found:
        message = "CONTAINER TIER: no docker-compose (Debian package docker-compose, compose v1.29; .ci/run installs it)"
        if eng.IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


def compose(*args: str, project: str, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([compose_v1(), "-f", COMPOSE_FILE, "-p", project, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]], ids=["default", "gpu"])
def test_compose_v1_loads_the_whole_file(profile):
    """Loading needs no engine: compose 1.29 validates the file on its own."""
    done = compose(*profile, "config", "-q", project="shmwatchconfig")
    assert done.returncode == 0, done.stderr


def test_compose_v1_runs_workload_and_shmwatch(images):
    project = f"shmwatchtest{uuid.uuid4().hex[:8]}"
    env = {"SHMWATCH_PORT": str(free_port())}
    try:
        done = compose("up", "-d", "--build", "workload", "shmwatch", project=project, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        deadline = time.monotonic() + 60
        samples = {}
        while time.monotonic() < deadline:
            samples = samples_at(f"http://127.0.0.1:{env['SHMWATCH_PORT']}/metrics")
            hidden = value(samples, "shmwatch_segments", mount="/dev/shm", state="hidden", **{"class": "nccl"})
            if hidden:
                break
            time.sleep(0.5)
        logs = compose("logs", "--no-color", "shmwatch", project=project, env=env).stdout[-2000:]
        # The workload's /dev/shm (shm_size: 256mb), seen through its IPC namespace.
        assert value(samples, "shmwatch_mount_size_bytes", mount="/dev/shm") == 256 * 2**20, logs
        # Its unlinked-but-mapped NCCL-like segments (one at start, more now and then): hidden,
        # so found in the workload's maps (pid 1 of its PID namespace, which shmwatch shares).
        # Not named: only mapped, their time cannot be read without CAP_SYS_ADMIN (check names them).
        assert hidden and hidden >= 1, logs
        assert value(samples, "shmwatch_proc_unreadable") == 0
        if eng.docker("info", "--format", "{{.CgroupVersion}}").stdout.decode().strip() == "1":
            # cgroup v1: the workload's memory cgroup, found through --cgroup.target-process.
            workload = compose("ps", "-q", "workload", project=project, env=env).stdout.strip()
            usage = select(samples, "shmwatch_cgroup_memory_working_set_bytes")
            assert [labels["cgroup"] for labels, _ in usage] == [f"/docker/{workload}"], logs
            assert usage[0][1] > 0
    finally:
        compose("down", "-v", "--rmi", "local", "-t", "2", project=project, env=env)
