"""`shmwatch check`'s verdict on a mount's size, as an initContainer acts on it: exit 0 (good),
1 (a warning: below what --backend recommends), 2 (--require-shm failed). Each requirement and
each recommendation is judged on its own, on the size the mount can really hold: every
combination of --require-shm below or above the mount and --backend below or above it. The
matrix runs on the report itself (fast); its corners run the real command on a real tmpfs."""

import json
import subprocess
import sys
from typing import List, Optional, Tuple

import pytest

from exporter.check.report import BACKEND_SHM, diagnose
from exporter.model.state import MountStates
from exporter.model.step import Model, MountView
from exporter.model.summary import shm_budget
from exporter.model.types import MountUsage
from tests.conftest import REPO, mounted_tmpfs, needs_root

GiB = 1 << 30
MOUNT = "/dev/shm"
FAIL, BACKEND = "fail: --require-shm", "warn: below the backend's"
NO_STATES = MountStates(peaks={}, max_used={}, event_rows={}, inotify={}, overflows={})


def model_with_mount(size: int, memory_limit: Optional[int] = None) -> Model:
    """One empty tmpfs of `size`, no cgroup read; `memory_limit`: --memory.limit-bytes."""
    usage = MountUsage(MOUNT, "tmpfs", "tmpfs", True, size_bytes=size, used_bytes=0, available_bytes=size)
    budget = shm_budget(usage, None, memory_limit=memory_limit)
    view = MountView(MOUNT, {}, usage, None, None, None, None, None, None, budget)
    return Model(False, [], [view], None, [], None, [], None, [], NO_STATES)


def verdict(model: Model, required: Optional[int], backend: Optional[str]) -> Tuple[int, List[str]]:
    """-> (exit code, the shm findings that are problems, as FAIL / BACKEND)."""
    report = diagnose(model, required, backend)
    said = []
    for f in report.findings:
        if f.area == "shm" and f.severity == "fail" and "(--require-shm)" in f.message:
            said.append(FAIL)
        elif f.area == "shm" and f.severity == "warn" and f"recommended for {backend}" in f.message:
            said.append(BACKEND)
        else:
            assert f.severity in ("ok", "info"), f  # nothing else is wrong with an empty tmpfs
    return report.exit_code, sorted(said)


# (mount size, --require-shm, --backend) -> (exit code, problems). vllm recommends 16 GiB,
# trtllm 80 GiB: on a 4 GiB mount vllm is above the mount; on a 20 GiB mount below it.
Cell = Tuple[int, Optional[int], Optional[str], int, List[str]]
CELLS: List[Cell] = [
    # nothing asked
    (4 * GiB, None, None, 0, []),
    # --require-shm alone: below, at, above the mount
    (4 * GiB, 1 * GiB, None, 0, []),
    (4 * GiB, 4 * GiB, None, 0, []),
    (4 * GiB, 8 * GiB, None, 2, [FAIL]),
    # --backend alone: above the mount, below it
    (4 * GiB, None, "vllm", 1, [BACKEND]),
    (20 * GiB, None, "vllm", 0, []),
    # a requirement met says nothing about the backend's recommendation: still judged
    (4 * GiB, 1 * GiB, "vllm", 1, [BACKEND]),
    (4 * GiB, 4 * GiB, "vllm", 1, [BACKEND]),
    (20 * GiB, 1 * GiB, "trtllm", 1, [BACKEND]),
    # both met
    (20 * GiB, 1 * GiB, "vllm", 0, []),
    (20 * GiB, 20 * GiB, "vllm", 0, []),
    # the requirement failed, the backend's recommendation above it: both said
    (4 * GiB, 8 * GiB, "vllm", 2, [FAIL, BACKEND]),
    (20 * GiB, 32 * GiB, "trtllm", 2, [FAIL, BACKEND]),
    # the requirement failed and asks at least the recommendation: the failure says it all
    (4 * GiB, 16 * GiB, "vllm", 2, [FAIL]),
    (4 * GiB, 32 * GiB, "vllm", 2, [FAIL]),
    (20 * GiB, 80 * GiB, "trtllm", 2, [FAIL]),
    # the requirement failed, the backend's recommendation below the mount: met, not said
    (20 * GiB, 32 * GiB, "vllm", 2, [FAIL]),
]


def cell_id(cell: Cell) -> str:
    size, required, backend = cell[:3]
    return f"{size // GiB}Gi-require-{required and required // GiB}Gi-{backend}"


@pytest.mark.parametrize("size, required, backend, code, problems", CELLS, ids=map(cell_id, CELLS))
def test_require_shm_and_backend_are_judged_each_on_its_own(
    size: int, required: Optional[int], backend: Optional[str], code: int, problems: List[str]
) -> None:
    assert verdict(model_with_mount(size), required, backend) == (code, problems)


@pytest.mark.parametrize("backend", sorted(BACKEND_SHM))
def test_the_backend_boundary_is_its_recommendation(backend: str) -> None:
    """A mount of exactly the recommended size is enough; a byte less is not."""
    need = BACKEND_SHM[backend]
    assert verdict(model_with_mount(need), None, backend) == (0, [])
    assert verdict(model_with_mount(need - 1), None, backend) == (1, [BACKEND])
    assert verdict(model_with_mount(need - 1), 1 * GiB, backend) == (1, [BACKEND])


# 20 GiB of tmpfs under --memory.limit-bytes: the limit leaves 8 GiB (below vllm's 16), or 18.
LIMITED = [
    (8 * GiB, None, 1, [BACKEND]),
    (8 * GiB, 1 * GiB, 1, [BACKEND]),
    (8 * GiB, 12 * GiB, 2, [FAIL, BACKEND]),
    (18 * GiB, 1 * GiB, 0, []),
]


@pytest.mark.parametrize("memory_limit, required, code, problems", LIMITED)
def test_both_are_judged_on_what_the_memory_limit_leaves(
    memory_limit: int, required: Optional[int], code: int, problems: List[str]
) -> None:
    """The mount's size is not what it can hold: tmpfs pages are charged to the memory limit."""
    model = model_with_mount(20 * GiB, memory_limit=memory_limit)
    assert verdict(model, required, "vllm") == (code, problems)


def check(mount: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command; only the mount is judged (the machine's own memory and SysV are not
    this test's, and a warning about them would change the exit code)."""
    argv = [sys.executable, "-m", "exporter", "check", f"--shm.mount={mount}", "--output=json"]
    argv += ["--no-collector.gpu", "--no-collector.cgroup", "--no-collector.host_memory", "--no-collector.sysv"]
    return subprocess.run([*argv, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


@needs_root
def test_the_command_exits_on_each_verdict() -> None:
    """The planted bug's own cell (--require-shm 1Gi --backend vllm on a 4 GiB mount: exit 0,
    the warning skipped) and its neighbours, as the shm-preflight initContainer runs them."""
    cells = (("1Gi", "vllm"), ("8Gi", "vllm"), ("16Gi", "vllm"), ("1Gi", None))
    with mounted_tmpfs("4g") as shm:
        runs = {
            (req, backend): check(shm, f"--require-shm={req}", *([f"--backend={backend}"] if backend else []))
            for req, backend in cells
        }
    got = {}
    for cell, run in runs.items():
        doc = json.loads(run.stdout)
        assert doc["exit_code"] == run.returncode, run.stderr
        problems = sorted(f["severity"] for f in doc["findings"] if f["severity"] in ("fail", "warn"))
        got[cell] = run.returncode, problems
    assert got == {
        ("1Gi", "vllm"): (1, ["warn"]),
        ("8Gi", "vllm"): (2, ["fail", "warn"]),
        ("16Gi", "vllm"): (2, ["fail"]),
        ("1Gi", None): (0, []),
    }
    warned = json.loads(runs["1Gi", "vllm"].stdout)["findings"]
    assert any("under the 16.0 GiB recommended for vllm" in f["message"] for f in warned), warned
