"""The GPU collector through the real pynvml against the fake libnvidia-ml.so.1 (no GPU here: the
library is faked, not our code): --collector.gpu.timeout, and it alone, bounds an NVML sweep,
a slow driver within it is not called failed, and nothing else is hurt; `shmwatch check` warns
for a GPU above 98 % used (the driver's reserve counted as used, NVML v1 or v2) and not at 98 %,
and without a driver says so without changing the verdict."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

from tests.conftest import REPO, Exporter, needs_root, value
from tests.system.test_gpu import TWO_GPUS, config, gpu_env, stub_dir  # noqa: F401 - stub_dir: a fixture

GiB, MiB = 1 << 30, 1 << 20
SLACK = 2.5  # the watchdog checks every 0.5 s; a loaded machine
OTHERS = ("--no-collector.segments", "--no-collector.sysv", "--poll-interval=100ms")


@pytest.fixture
def fake_nvml(request: pytest.FixtureRequest) -> str:
    """The directory of the fake libnvidia-ml.so.1 (test_gpu's build of tests/gpu/fake_nvml.c)."""
    return str(request.getfixturevalue("stub_dir"))


def success(exporter: Exporter, collector: str) -> Optional[float]:
    return value(exporter.scrape(), "shmwatch_collector_success", collector=collector)


@needs_root
def test_a_slow_driver_within_the_gpu_timeout_is_not_failed(fake_nvml: str, tmp_path: Path) -> None:
    """Each sweep 1.5 s, the GPU's own timeout 3 s, the general one 1 s: the GPU's binds it."""
    conf = config(tmp_path, TWO_GPUS + "count_delay_ms=1500\n")
    args = ("--collector.timeout=1s", "--collector.gpu.timeout=3s", *OTHERS)
    with Exporter(*args, env=gpu_env(fake_nvml, conf)) as exporter:
        durations: Set[Optional[float]] = set()
        deadline = time.monotonic() + 10
        while len(durations) < 2 and time.monotonic() < deadline:  # two sweeps, each seen done
            s = exporter.scrape()
            assert value(s, "shmwatch_collector_success", collector="gpu") == 1, exporter.log()
            durations.add(value(s, "shmwatch_collector_duration_seconds", collector="gpu"))
            time.sleep(0.2)
    assert len(durations) == 2 and min(d for d in durations if d is not None) >= 1.4, durations


@needs_root
def test_a_hung_driver_is_failed_at_the_gpu_timeout_and_hurts_nothing_else(fake_nvml: str, tmp_path: Path) -> None:
    """The GPU's own timeout 1 s, the general one 60 s: a hung NVML call is failed at 1 s."""
    hang = tmp_path / "hang"
    conf = config(tmp_path, TWO_GPUS + f"hang_file={hang}\n")
    args = ("--collector.timeout=60s", "--collector.gpu.timeout=1s", *OTHERS)
    with Exporter(*args, env=gpu_env(fake_nvml, conf)) as exporter:
        assert success(exporter, "gpu") == 1
        hang.touch()  # the next sweep blocks, as on a GPU fallen off the bus
        started = time.monotonic()
        exporter.wait_for(lambda s: value(s, "shmwatch_collector_success", collector="gpu") == 0, timeout=1 + SLACK)
        failed_after = time.monotonic() - started
        for collector in ("shm_mount", "host_memory", "cgroup"):
            assert success(exporter, collector) == 1, collector
        hang.unlink()
        exporter.wait_for(lambda s: value(s, "shmwatch_collector_success", collector="gpu") == 1, timeout=10)
    assert failed_after <= 1 + SLACK


# (total, used, reserved; reserved None: an NVML v1 driver, which has no v2 memory info)
Gpu = Tuple[int, int, Optional[int]]
AT = 49 * GiB  # 98 % of 50 GiB exactly
GPUS: Dict[str, Gpu] = {
    "v2 at 98 %": (50 * GiB, AT - 512 * MiB, 512 * MiB),
    "v2 above by the reserve": (50 * GiB, AT - 512 * MiB + 1, 512 * MiB),  # used alone is 97 %
    "v1 at 98 %": (50 * GiB, AT, None),
    "v1 above": (50 * GiB, AT + 1, None),
}


def fake_gpus(names: List[str]) -> str:
    lines = ["driver=550.54.15", f"count={len(names)}"]
    for i, name in enumerate(names):
        total, used, reserved = GPUS[name]
        free = total - used - (reserved or 0)
        lines += [f"gpu{i}.name={name}", f"gpu{i}.uuid=GPU-{i:08d}-0000-0000-0000-000000000000"]
        lines += [f"gpu{i}.total={total}", f"gpu{i}.used={used}", f"gpu{i}.free={free}"]
        lines += [f"gpu{i}.reserved={reserved}" if reserved is not None else f"gpu{i}.v2=0"]
    return "\n".join(lines) + "\n"


def check_gpus(fake_nvml: str, conf: str) -> Tuple[int, List[Tuple[str, str]]]:
    """`shmwatch check` judging the GPUs alone -> (exit code, (severity, subject) of each finding)."""
    off = [f"--no-collector.{name}" for name in ("shm_mount", "segments", "sysv", "cgroup", "host_memory")]
    argv = [sys.executable, "-m", "exporter", "check", *off, "--output=json"]
    env = {**os.environ, **gpu_env(fake_nvml, conf)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    findings = json.loads(done.stdout)["findings"]
    return done.returncode, sorted((f["severity"], f["subject"]) for f in findings)


@needs_root
def test_check_warns_above_98_percent_used_and_not_at_it(fake_nvml: str, tmp_path: Path) -> None:
    (tmp_path / "all").mkdir()
    (tmp_path / "at").mkdir()
    every = check_gpus(fake_nvml, config(tmp_path / "all", fake_gpus(list(GPUS))))
    assert every == (1, [
        ("ok", "GPU 0 v2 at 98 %"), ("ok", "GPU 2 v1 at 98 %"),
        ("warn", "GPU 1 v2 above by the reserve"), ("warn", "GPU 3 v1 above"),
    ])  # fmt: skip
    at = check_gpus(fake_nvml, config(tmp_path / "at", fake_gpus(["v2 at 98 %", "v1 at 98 %"])))
    assert at == (0, [("ok", "GPU 0 v2 at 98 %"), ("ok", "GPU 1 v1 at 98 %")])


@needs_root
def test_check_without_a_driver_says_so_and_keeps_its_verdict(fake_nvml: str, tmp_path: Path) -> None:
    """No driver is the normal state of a CPU node: an info finding, exit 0, not a warning."""
    assert check_gpus(fake_nvml, config(tmp_path, "init_error=9\n")) == (0, [("info", "NVML")])
