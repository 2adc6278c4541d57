"""Node mode as a container, as the DaemonSet runs it: hostPID, the host's `/` read-only at
/host (no rslave: the root mount is private on these machines), root with SYS_PTRACE and
DAC_READ_SEARCH only. It must find each workload container's shm
(/var/lib/docker/containers/<id>/mounts/shm) with its container_id, and the owners of
the segments in it, which live in other containers."""
from __future__ import annotations

import time

import pytest

from tests.conftest import select
from tests.containers import engine as eng
from tests.containers.conftest import Container, samples_at

# The first test of the session also waits for the base image and the project image.
pytestmark = pytest.mark.timeout(600)

NODE_RUN = ["--pid=host", "-v", "/:/host:ro", "--read-only", "--user", "0:0", "--cap-drop", "ALL",
            "--cap-add", "SYS_PTRACE", "--cap-add", "DAC_READ_SEARCH",
            # The kernel log for OOM kills: the device itself (a bind mount of it is refused by
            # the device cgroup) and CAP_SYSLOG (kernel.dmesg_restrict=1).
            "--device", "/dev/kmsg:/dev/kmsg:r", "--cap-add", "SYSLOG"]
NODE_ARGS = ["--mode=node", "--path.procfs=/host/proc", "--path.sysfs=/host/sys", "--path.rootfs=/host",
             "--no-collector.gpu", "--inventory-interval=1s",
             "--metric-opt-in-list=.*"]  # every family: the processes' shm (opt-in) is checked too


def test_node_mode_finds_each_container_shm_and_its_owners(root_server, uid_server):
    servers = [root_server, uid_server]
    with Container(eng.PROJECT_IMAGE, *NODE_ARGS, run=NODE_RUN, prefix="node") as node:
        deadline = time.monotonic() + 30
        while True:
            samples = samples_at(f"http://{node.ip}:9841/metrics")
            owned = [labels for labels, _ in select(samples, "shmwatch_top_segment_bytes")
                     if labels.get("owner") and labels["name"] in {s.info["nccl"] for s in servers}]
            if len(owned) == len(servers) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        logs = node.logs()
    assert select(samples, "shmwatch_collector_success", collector="oom") == [({"collector": "oom"}, 1.0)], \
        logs[-2000:]
    for server in servers:
        # The container's shm by its container_id alone: its path would say it again.
        sizes = select(samples, "shmwatch_mount_size_bytes", container_id=server.id)
        assert sizes == [({"container_id": server.id}, 64 * 2**20)], logs[-2000:]
        owner = "python3"  # the server's workload by its process name, never its pid
        for segment, state in (("nccl", "linked"), ("psm", "linked"), ("torch", "hidden")):
            found = [labels for labels, _ in select(samples, "shmwatch_top_segment_bytes", container_id=server.id,
                                                    name=server.info[segment])]
            assert [(f["state"], f["owner"]) for f in found] == [(state, owner)], (segment, found)
        held = select(samples, "shmwatch_process_shm_bytes", container_id=server.id, comm=owner)
        assert [v for _, v in held] == [sum(server.info["sizes"][k] for k in ("nccl", "psm", "torch"))]


def node_scrape(run, until, timeout=30):
    with Container(eng.PROJECT_IMAGE, *NODE_ARGS, run=run, prefix="node") as node:
        deadline = time.monotonic() + timeout
        while True:
            samples = samples_at(f"http://{node.ip}:9841/metrics")
            if until(samples) or time.monotonic() > deadline:
                return samples, node.logs()
            time.sleep(0.3)


@pytest.mark.parametrize("cap_sys_admin", [True, False], ids=["with-SYS_ADMIN", "without"])
def test_node_mode_reads_sysv_per_ipc_namespace(root_server, uid_server, cap_sys_admin):
    """Two servers, each in its own IPC namespace with its own 2 MiB SysV segment. With
    CAP_SYS_ADMIN (setns into each namespace) node mode reports each segment for its own
    container; without it, each namespace is reported as not readable and nothing else —
    never an empty "all clear"."""
    servers = [root_server, uid_server]
    run = NODE_RUN + (["--cap-add", "SYS_ADMIN"] if cap_sys_admin else [])

    def seen(samples):
        return all(select(samples, "shmwatch_sysv_namespace_readable", container_id=s.id) for s in servers)
    samples, logs = node_scrape(run, seen)
    for server in servers:
        readable = select(samples, "shmwatch_sysv_namespace_readable", container_id=server.id)
        assert [v for _, v in readable] == [1.0 if cap_sys_admin else 0.0], (readable, logs[-2000:])
        namespace = readable[0][0]["ipc_namespace"]
        # Not a pod's: no pod_uid label at all (the label contract has no empty labels).
        assert namespace.startswith("ipc:[") and "pod_uid" not in readable[0][0]
        mine = select(samples, "shmwatch_sysv_bytes", container_id=server.id)
        if cap_sys_admin:
            # The workload's segment (2 MiB) is in its own namespace, and only there.
            assert [v for _, v in mine] == [server.info["sizes"]["sysv"]], mine
            assert [v for _, v in select(samples, "shmwatch_sysv_segments", container_id=server.id)] == [1]
        else:
            assert mine == [] and select(samples, "shmwatch_sysv_segments", container_id=server.id) == []
    namespaces = {select(samples, "shmwatch_sysv_namespace_readable", container_id=s.id)[0][0]["ipc_namespace"]
                  for s in servers}
    assert len(namespaces) == 2
