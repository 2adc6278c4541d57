"""Docker sidecar beside a root "server" container: `--ipc=container:S --pid=container:S
--read-only`, with each level of access a user may give it.

Full access (the server's UID, or SYS_PTRACE) must attribute every live segment to its
process and call the real leak `orphan`. Less access (the image's own user, hidepid=2)
must never call a live segment `orphan` nor advise removing it: deleting a live NCCL
segment crashes the server.
"""
from __future__ import annotations

from typing import List

import pytest

from tests.conftest import parse_exposition, select, value
from tests.containers.conftest import (Server, assert_full_attribution, leak_alert_test, rm_advice, rm_targets, top,
                                       view)

# The first test of the session also waits for the base image and the project image.
pytestmark = pytest.mark.timeout(600)


# How the sidecar is run, beside which server. Each gives full access to the server's /proc.
FULL_ACCESS = {
    # The server's UID (root in vLLM's image), Docker's default capabilities: the kernel lets
    # a process read /proc/<pid>/maps of a same-UID process whose capabilities it covers.
    "server-uid-root": ("root_server", ["--user", "0:0"]),
    # Root with every capability dropped but SYS_PTRACE (deploy/docker-compose.yml's way).
    "root-sys-ptrace": ("root_server", ["--user", "0:0", "--cap-drop", "ALL", "--cap-add", "SYS_PTRACE"]),
    # The server at a chosen UID and the sidecar at the same one, no capability at all.
    "same-chosen-uid": ("uid_server", ["--user", "1000:1000", "--cap-drop", "ALL"]),
}
# As the README's first recipe: the image's own user (65534) beside a root server.
OWN_USER: List[str] = []
# hidepid=2 on the sidecar's /proc: mounted by root (SYS_ADMIN, this run only), then the
# exporter is exec'd as 65534 with no capability left. A read-only root filesystem still
# lets a mount cover /proc.
HIDEPID = ["--user", "0:0", "--cap-drop", "ALL", "--cap-add", "SYS_ADMIN", "--cap-add", "SETUID",
           "--cap-add", "SETGID", "--entrypoint", "sh"]


# ---- full access -------------------------------------------------------------------------

@pytest.mark.parametrize("way", list(FULL_ACCESS))
def test_full_access_attributes_every_live_segment(way, request):
    fixture, run = FULL_ACCESS[way]
    server: Server = request.getfixturevalue(fixture)
    text, report, _ = view(server, way, run)
    assert_full_attribution(server, text, report)


def test_full_access_leak_fires_the_alert(root_server):
    """The promtool harness of the quiet case below can fail: on the same kind of scrape with
    the real leak (16 MiB of 64 MiB) seen as orphan, ShmLeakedSegments fires."""
    text, _, _ = view(root_server, "server-uid-root", FULL_ACCESS["server-uid-root"][1])
    result = leak_alert_test(text, [{"mount": "/dev/shm"}])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_full_access_advises_no_rm_for_a_file_of_class_other(root_server):
    """libpod_lock (class other) is held by nobody, yet not ours to judge: `rm` advice is
    for orphans of classes whose owner is one process (the nccl leak here), never other."""
    _, report, _ = view(root_server, "server-uid-root", FULL_ACCESS["server-uid-root"][1])
    assert f"/dev/shm/{root_server.info['leak']}" in rm_targets(report)
    assert f"/dev/shm/{root_server.info['other']}" not in rm_targets(report)


# ---- the image's own user beside a root server -------------------------------------------

def test_own_user_counts_the_processes_it_cannot_read(root_server):
    text, _, _ = view(root_server, "own-user", OWN_USER)
    assert value(parse_exposition(text), "shmwatch_proc_unreadable") > 0


def test_own_user_calls_no_live_segment_orphan(root_server):
    text, _, _ = view(root_server, "own-user", OWN_USER)
    samples = parse_exposition(text)
    info = root_server.info
    for segment in ("nccl", "psm"):
        assert top(samples, info[segment])["state"] == "unverified", segment
    # Nobody here can prove the leak is one either.
    assert top(samples, info["leak"])["state"] == "unverified"
    assert not [labels for labels, v in select(samples, "shmwatch_segments", state="orphan") if v]


def test_own_user_check_names_no_live_segment_and_advises_no_rm(root_server):
    _, report, _ = view(root_server, "own-user", OWN_USER)
    info = root_server.info
    names = [o["name"] for o in report["shm"][0]["orphans"]]
    assert info["nccl"] not in names and info["psm"] not in names
    assert not rm_targets(report), rm_advice(report)


def test_own_user_leak_alert_stays_quiet(root_server):
    text, _, _ = view(root_server, "own-user", OWN_USER)
    result = leak_alert_test(text, [])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


# ---- hidepid=2 on the sidecar's /proc -----------------------------------------------------

def test_hidepid_hides_the_server_from_the_sidecar(root_server):
    """The setup itself: under hidepid=2 the exporter (65534) lists none of the server's pids."""
    _, _, pids = view(root_server, "hidepid", HIDEPID, hidepid=True)
    assert pids and str(root_server.info["pid"]) not in pids.split()


def test_hidepid_counts_the_hidden_processes(root_server):
    text, _, _ = view(root_server, "hidepid", HIDEPID, hidepid=True)
    assert value(parse_exposition(text), "shmwatch_proc_unreadable") > 0


def test_hidepid_calls_no_live_segment_orphan(root_server):
    text, report, _ = view(root_server, "hidepid", HIDEPID, hidepid=True)
    samples = parse_exposition(text)
    assert not [labels for labels, v in select(samples, "shmwatch_segments", state="orphan") if v]
    assert not rm_targets(report), rm_advice(report)
