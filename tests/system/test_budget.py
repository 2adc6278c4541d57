"""The shm budget: what a mount can really hold once --shm.size-limit and the memory limit
are counted, each bound tested on both sides so that dropping or double-counting one fails.

The unit cases pin the formulas (exporter/model/summary.py); the end-to-end cases check that the
flag reaches them, through /metrics and through `shmwatch check`.
"""

import json
import subprocess
import sys

from exporter.collectors.cgroup import CgroupCollector
from exporter.host.paths import Paths
from tests.conftest import REPO, Exporter, mounted_tmpfs, needs_root, prerequisite_missing, remove_cgroup, value
from tests.helpers import MiB


@needs_root
def test_v1_limit_is_the_tightest_up_the_tree_on_a_real_kernel():
    """memory.stat's hierarchical_memory_limit is the kernel's min over the cgroup and its
    ancestors, so the collector reads it instead of memory.limit_in_bytes: the parent's
    limit when the child has none, the child's own when tighter."""
    import os
    import uuid

    root = "/sys/fs/cgroup/memory"
    if not os.path.exists(os.path.join(root, "cgroup.procs")):
        prerequisite_missing("needs the cgroup v1 memory controller")
    parent = f"shmwatch-test-{uuid.uuid4().hex[:8]}"
    child = os.path.join(root, parent, "c")
    os.makedirs(child)
    try:
        with open(os.path.join(root, parent, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 * MiB))
        paths = Paths()
        assert CgroupCollector(paths, cgroup_path=f"/{parent}/c").collect()[0].limit_bytes == 512 * MiB
        with open(os.path.join(child, "memory.limit_in_bytes"), "w") as f:
            f.write(str(256 * MiB))
        assert CgroupCollector(paths, cgroup_path=f"/{parent}/c").collect()[0].limit_bytes == 256 * MiB
    finally:
        remove_cgroup(child)
        remove_cgroup(os.path.join(root, parent))


@needs_root
def test_size_limit_flag_reaches_metrics_and_check():
    """--shm.size-limit smaller than the tmpfs (the golden run sets it equal) must show."""
    with mounted_tmpfs("64m") as shm:
        with Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--no-collector.cgroup",
                      "--shm.size-limit=24Mi") as exporter:
            s = exporter.scrape()
        # The exporter's flags: without the cgroup collector no memory limit to wait for (a
        # limit that could not be read leaves the effective size unknown: null).
        result = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu",
                                 "--no-collector.cgroup", f"--shm.mount={shm}", "--shm.size-limit=24Mi", "--output", "json"],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
    assert value(s, "shmwatch_mount_size_bytes", mount=shm) == 64 * MiB
    assert value(s, "shmwatch_mount_effective_size_bytes", mount=shm) == 24 * MiB
    doc = json.loads(result.stdout)
    entry = next(m for m in doc["shm"] if m["mount"] == shm)
    assert (entry["size_bytes"], entry["effective_size_bytes"]) == (64 * MiB, 24 * MiB), result.stderr
