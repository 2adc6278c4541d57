"""Node mode as a container, as the DaemonSet runs it: hostPID, the host's `/` read-only at
/host (no rslave: the root mount is private on these machines), root with SYS_PTRACE and
DAC_READ_SEARCH only. It must find each workload container's shm
(/var/lib/docker/containers/<id>/mounts/shm) with its container_id, and the owners of
the segments in it, which live in other containers."""
from __future__ import annotations

import time

import pytest

from tests.conftest import parse_exposition, select
from tests.containers import engine as eng
from tests.containers.conftest import Container, scrape

# The first test of the session also waits for the base image and the project image.
pytestmark = pytest.mark.timeout(600)

NODE_RUN = ["--pid=host", "-v", "/:/host:ro", "--read-only", "--user", "0:0", "--cap-drop", "ALL",
            "--cap-add", "SYS_PTRACE", "--cap-add", "DAC_READ_SEARCH",
            # The kernel log for OOM kills: the device itself (a bind mount of it is refused by
            # the device cgroup) and CAP_SYSLOG (kernel.dmesg_restrict=1).
            "--device", "/dev/kmsg:/dev/kmsg:r", "--cap-add", "SYSLOG"]
NODE_ARGS = ["--mode=node", "--path.procfs=/host/proc", "--path.sysfs=/host/sys", "--path.rootfs=/host",
             "--no-collector.gpu", "--inventory-interval=1s"]


def test_node_mode_finds_each_container_shm_and_its_owners(root_server, uid_server):
    servers = [root_server, uid_server]
    with Container(eng.PROJECT_IMAGE, *NODE_ARGS, run=NODE_RUN, prefix="node") as node:
        deadline = time.monotonic() + 30
        while True:
            try:
                samples = parse_exposition(scrape(f"http://{node.ip}:9841/metrics"))
            except OSError:
                samples = {}
            owned = [labels for labels, _ in select(samples, "shmwatch_top_segment_bytes")
                     if labels.get("owner") and labels["name"] in {s.info["nccl"] for s in servers}]
            if len(owned) == len(servers) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        logs = node.logs()
    assert select(samples, "shmwatch_collector_success", collector="oom") == [({"collector": "oom"}, 1.0)], \
        logs[-2000:]
    for server in servers:
        mount = f"/var/lib/docker/containers/{server.id}/mounts/shm"
        sizes = select(samples, "shmwatch_mount_size_bytes", container_id=server.id)
        assert [(labels["mount"], v) for labels, v in sizes] == [(mount, 64 * 2**20)], logs[-2000:]
        owner = f"python3[{server.host_pid}]"  # the host's pid of the server's workload
        for segment, state in (("nccl", "linked"), ("psm", "linked"), ("torch", "hidden")):
            found = [labels for labels, _ in select(samples, "shmwatch_top_segment_bytes", container_id=server.id,
                                                    name=server.info[segment])]
            assert [(f["state"], f["owner"]) for f in found] == [(state, owner)], (segment, found)
        held = select(samples, "shmwatch_process_shm_bytes", container_id=server.id, pid=str(server.host_pid))
        assert [v for _, v in held] == [sum(server.info["sizes"][k] for k in ("nccl", "psm", "torch"))]
