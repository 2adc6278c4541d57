"""Each collector on the fixture trees, values read back from a fresh registry."""
import os
import subprocess
import sys
from collections import namedtuple

import pytest
from prometheus_client import generate_latest

from exporter.model.catalogue import BY_NAME
from exporter.collectors.cgroup import CgroupCollector
from exporter.collectors.host_memory import HostMemoryCollector
from exporter.collectors.shm_mount import ShmMountCollector
from exporter.collectors.sysv import SysvCollector
from exporter.host.paths import Paths
from tests.conftest import FIXTURES, REPO, needs_root, promtool_check_metrics
from tests.helpers import registry_for

PATHS = Paths(procfs=os.path.join(FIXTURES, "proc"), sysfs=os.path.join(FIXTURES, "sys"), rootfs="/")
StatVfs = namedtuple("StatVfs", "f_bsize f_frsize f_blocks f_bfree f_bavail f_files f_ffree")


def fake_statvfs(path):
    if path == "/dev/shm":
        return StatVfs(4096, 4096, 16384, 4096, 4096, 1000, 990)  # 64 MiB, 48 MiB used
    raise FileNotFoundError(2, "No such file or directory", path)


def test_host_memory():
    reg, _ = registry_for(HostMemoryCollector(PATHS))
    assert reg.get_sample_value("shmwatch_host_memory_total_bytes") == 24683568 * 1024
    assert reg.get_sample_value("shmwatch_host_memory_available_bytes") == 24276128 * 1024
    assert reg.get_sample_value("shmwatch_host_memory_shmem_bytes") == 64 << 20
    assert reg.get_sample_value("shmwatch_collector_success", {"collector": "host_memory"}) == 1


def test_shm_mount_and_a_missing_one():
    collector = ShmMountCollector(PATHS, statvfs=fake_statvfs)
    reg, _ = registry_for(collector, mounts=["/dev/shm", "/no/such/mount"])
    m = {"mount": "/dev/shm"}
    assert reg.get_sample_value("shmwatch_mount_size_bytes", m) == 64 << 20
    assert reg.get_sample_value("shmwatch_mount_used_bytes", m) == 48 << 20
    assert reg.get_sample_value("shmwatch_mount_available_bytes", m) == 16 << 20
    assert reg.get_sample_value("shmwatch_mount_usage_ratio", m) == 0.75
    assert reg.get_sample_value("shmwatch_mount_inodes_free", m) == 990
    assert reg.get_sample_value("shmwatch_mount_peak_used_bytes", m) == 48 << 20
    assert reg.get_sample_value("shmwatch_mount_info", {**m, "fstype": "tmpfs", "source": "shm", "noswap": "false"}) == 1
    assert reg.get_sample_value("shmwatch_mount_error", m) is None  # measured: its size says so, not an error 0
    # A missing mount is reported, not fatal: the collector still succeeds.
    assert reg.get_sample_value("shmwatch_mount_error", {"mount": "/no/such/mount"}) == 1
    assert reg.get_sample_value("shmwatch_mount_size_bytes", {"mount": "/no/such/mount"}) is None
    assert reg.get_sample_value("shmwatch_collector_success", {"collector": "shm_mount"}) == 1


def test_sysv():
    reg, _ = registry_for(SysvCollector(PATHS, page_size=4096))
    assert reg.get_sample_value("shmwatch_sysv_segments") == 2
    assert reg.get_sample_value("shmwatch_sysv_bytes") == 24 << 20
    assert reg.get_sample_value("shmwatch_sysv_orphan_segments") == 1
    assert reg.get_sample_value("shmwatch_sysv_limit_shmall_bytes") == 4194304 * 4096
    assert reg.get_sample_value("shmwatch_sysv_limit_shmmni") == 4096


def test_cgroup_v1_fixture_and_projection():
    shm = ShmMountCollector(PATHS, statvfs=fake_statvfs)
    reg, _ = registry_for(shm, CgroupCollector(PATHS), mounts=["/dev/shm"])
    cg = {"cgroup": "/kubepods/burstable/pod0f1e/abc"}
    assert reg.get_sample_value("shmwatch_cgroup_memory_usage_bytes", cg) == 1 << 30
    assert reg.get_sample_value("shmwatch_cgroup_memory_limit_bytes", {**cg, "limit_from": "self"}) == 2 << 30
    assert reg.get_sample_value("shmwatch_cgroup_memory_working_set_bytes", cg) == (1 << 30) - (128 << 20)
    assert reg.get_sample_value("shmwatch_cgroup_memory_shmem_bytes", cg) == 256 << 20
    assert reg.get_sample_value("shmwatch_cgroup_oom_kills_total", cg) == 2
    assert reg.get_sample_value("shmwatch_oom_risk_ratio", cg) == pytest.approx(896 / 2048)
    # (working set - shm used + shm size) / limit = (896 - 48 + 64) MiB / 2 GiB
    assert reg.get_sample_value("shmwatch_shm_oom_projection_ratio", {"mount": "/dev/shm", **cg}) == \
        pytest.approx((896 - 48 + 64) / 2048)
    assert reg.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": "/dev/shm"}) == 64 << 20


def test_failing_collector_is_isolated():
    from exporter.collectors.source import Source

    class Broken(Source):
        name = "sysv"

        def collect(self, run):
            raise OSError(13, "Permission denied", "/proc/sysvipc/shm")

    reg, _ = registry_for(Broken(), HostMemoryCollector(PATHS))
    assert reg.get_sample_value("shmwatch_collector_success", {"collector": "sysv"}) == 0
    assert reg.get_sample_value("shmwatch_collector_success", {"collector": "host_memory"}) == 1
    assert reg.get_sample_value("shmwatch_host_memory_total_bytes") > 0


def test_every_emitted_metric_is_in_the_catalogue_with_its_type():
    shm = ShmMountCollector(PATHS, statvfs=fake_statvfs)
    reg, sampler = registry_for(shm, HostMemoryCollector(PATHS), SysvCollector(PATHS), CgroupCollector(PATHS),
                                mounts=["/dev/shm", "/missing"])
    sampler.state.count_event("/dev/shm", "nccl", "created")
    sampler.state.set_inotify("/dev/shm", True)
    from prometheus_client import ProcessCollector
    ProcessCollector(registry=reg)
    text = generate_latest(reg).decode()
    from prometheus_client.parser import text_string_to_metric_families
    seen = 0
    for family in text_string_to_metric_families(text):
        entry = BY_NAME.get(family.name) or BY_NAME.get(family.name + "_total")
        assert entry is not None, f"{family.name} is emitted but not in exporter/model/catalogue.py"
        assert entry.type == family.type, f"{family.name}: catalogue says {entry.type}, emitted {family.type}"
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            # Its labels, but one it has no value for (a missing mount's source): none is empty.
            assert set(sample.labels) <= set(entry.labels), f"{sample.name}: labels {sorted(sample.labels)}"
            assert all(sample.labels.values()), f"{sample.name}: an empty label {sample.labels}"
        seen += 1
    assert seen > 20
    assert promtool_check_metrics(text).returncode == 0


SHM_CREATOR = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0, 65536, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600; never attached
assert shmid >= 0, ctypes.get_errno()
print(shmid, flush=True)
sys.stdin.read()  # alive until the test closes stdin
"""


@needs_root  # an IPC namespace of its own (unshare --ipc)
def test_sysv_orphan_only_once_its_creator_is_gone():
    """A segment with nothing attached may be about to be attached (created, not yet
    shmat'ed): not an orphan, and not for ipcrm, while its creator lives. In an IPC namespace
    of its own, with a real creator process."""
    script = f"""
import os, subprocess, sys
from exporter.collectors.sysv import SysvCollector
from exporter.host.paths import Paths
creator = subprocess.Popen([sys.executable, "-c", {SHM_CREATOR!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
shmid = int(creator.stdout.readline())
[shm] = SysvCollector(Paths()).collect()
seg = next(s for s in shm.segments if s.shmid == shmid)
assert seg.nattch == 0 and seg.cpid == creator.pid and shm.orphans == 0, (seg, shm.orphans)
creator.stdin.close()
creator.wait()
[shm] = SysvCollector(Paths()).collect()
assert shm.orphans == 1 and next(s for s in shm.segments if s.shmid == shmid).orphan
print("ok")
"""
    done = subprocess.run(["unshare", "--ipc", sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
