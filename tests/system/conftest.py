"""Fixtures shared by the tests of tests/system/."""

import os
import uuid

import pytest

from tests.conftest import mounted_tmpfs, prerequisite_missing, remove_pod_cgroups
from tests.helpers import V1_MEMORY


@pytest.fixture
def two_pods(tmp_path):
    """Two pods' emptyDirs (real tmpfs at kubelet paths) and their memory cgroups."""
    if not os.path.exists(os.path.join(V1_MEMORY, "cgroup.procs")):
        prerequisite_missing(f"needs the cgroup v1 memory controller at {V1_MEMORY} to put processes in pod cgroups")
    uids = [str(uuid.uuid4()), str(uuid.uuid4())]
    cgroups = [os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{uid}") for uid in uids]
    paths = [f"{tmp_path}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm" for uid in uids]
    for path in cgroups:
        os.makedirs(path)
    try:
        with mounted_tmpfs("16m", path=paths[0]) as a, mounted_tmpfs("16m", path=paths[1]) as b:
            yield [a, b], cgroups
    finally:
        remove_pod_cgroups(cgroups)
