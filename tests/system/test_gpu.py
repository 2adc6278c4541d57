"""The GPU collector's real pynvml code path against a fake libnvidia-ml.so.1 (tests/gpu/fake_nvml.c).

No GPU here: the fake sits at the library boundary (pynvml's own CDLL load finds it
through LD_LIBRARY_PATH), so everything from pynvml up is the real thing.
"""
import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict

import pytest

from tests.conftest import REPO, Exporter, mounted_tmpfs, needs_root, select, value

GiB = 1 << 30


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    gcc = shutil.which("gcc") or pytest.fail("gcc is needed to build the fake NVML")
    out = tmp_path_factory.mktemp("fake-nvml")
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wno-format-truncation", "-o",
                    str(out / "libnvidia-ml.so.1"), os.path.join(REPO, "tests", "gpu", "fake_nvml.c"), "-lpthread"],
                   check=True)
    return str(out)


def config(tmp_path: Path, text: str) -> str:
    """Write the stub's configuration atomically: the stub re-reads it on every NVML call, and
    a half-written file (a GPU count of 0) would be a fake driver state, not the one tested."""
    path = tmp_path / "nvml.conf"
    staged = tmp_path / "nvml.conf.new"
    staged.write_text(text)
    os.replace(staged, path)
    return str(path)


def gpu_env(stub_dir: str, conf: str) -> Dict[str, str]:
    return {"LD_LIBRARY_PATH": stub_dir, "FAKE_NVML_CONFIG": conf}


TWO_GPUS = """driver=550.54.15
count=2
gpu0.name=NVIDIA H100 80GB HBM3
gpu0.uuid=GPU-11111111-2222-3333-4444-555555555555
gpu0.total={t}
gpu0.used={u0}
gpu0.free={f0}
gpu0.reserved={r}
gpu0.procs={pid}:{p0},999999:1048576,999998:2097152
gpu1.name=NVIDIA H100 80GB HBM3
gpu1.uuid=GPU-66666666-7777-8888-9999-000000000000
gpu1.total={t}
gpu1.used={u1}
gpu1.free={f1}
gpu1.reserved={r}
""".format(t=80 * GiB, u0=72 * GiB, f0=8 * GiB - (512 << 20), r=512 << 20, u1=GiB, f1=79 * GiB - (512 << 20),
           pid=os.getpid(), p0=70 * GiB)
# NVML's memory info v2: total = reserved + used + free, on both GPUs.
assert all(80 * GiB == (512 << 20) + used + free
           for used, free in ((72 * GiB, 8 * GiB - (512 << 20)), (GiB, 79 * GiB - (512 << 20))))


def exporter_args(shm):
    return [f"--shm.mount={shm}", "--poll-interval=100ms"]


@needs_root
def test_two_gpus_and_processes(stub_dir, tmp_path):
    conf = config(tmp_path, TWO_GPUS)
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), env=gpu_env(stub_dir, conf)) as exporter:
        s = exporter.scrape()
    g0 = {"gpu": "0", "uuid": "GPU-11111111-2222-3333-4444-555555555555"}
    assert value(s, "shmwatch_collector_success", collector="gpu") == 1
    assert value(s, "shmwatch_gpu_info", name="NVIDIA H100 80GB HBM3", driver_version="550.54.15", **g0) == 1
    assert value(s, "shmwatch_gpu_memory_total_bytes", **g0) == 80 * GiB
    # One definition of used in both NVML paths: everything not free, the driver's reserve
    # included (v1's used; v2's used + reserved).
    assert value(s, "shmwatch_gpu_memory_used_bytes", **g0) == 72 * GiB + (512 << 20)
    assert value(s, "shmwatch_gpu_memory_reserved_bytes", **g0) == 512 << 20
    assert value(s, "shmwatch_gpu_memory_free_bytes", **g0) == 8 * GiB - (512 << 20)
    # One definition of "used" in both NVML paths: everything not free, the driver's reserve included.
    assert value(s, "shmwatch_gpu_memory_used_bytes", gpu="1") == GiB + (512 << 20)
    assert value(s, "shmwatch_gpu_memory_free_bytes", gpu="1") == 79 * GiB - (512 << 20)
    for gpu in ("0", "1"):
        total, used, free, reserved = (value(s, f"shmwatch_gpu_memory_{kind}_bytes", gpu=gpu)
                                       for kind in ("total", "used", "free", "reserved"))
        assert total == used + free, gpu
        assert 0 < reserved <= used and free < total, gpu
    me = open(f"/proc/{os.getpid()}/comm").read().strip()
    # Processes by name, never by pid (a series per restart): GPU memory is no two
    # processes', so a name's is their sum.
    assert value(s, "shmwatch_gpu_process_memory_bytes", comm=me, **g0) == 70 * GiB
    # Two pids from another PID namespace resolve to no name here: "unknown", summed.
    assert value(s, "shmwatch_gpu_process_memory_bytes", comm="unknown", **g0) == 3 << 20
    assert not [labels for labels, _ in select(s, "shmwatch_gpu_process_memory_bytes") if "pid" in labels]


@needs_root
def test_one_gpu_lost_and_v2_not_supported(stub_dir, tmp_path):
    conf = config(tmp_path, TWO_GPUS + "gpu1.lost=1\ngpu0.v2=0\n")
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), env=gpu_env(stub_dir, conf)) as exporter:
        s = exporter.scrape()
    assert value(s, "shmwatch_collector_success", collector="gpu") == 1
    # The v1 path gives the same used as the v2 path for the same device state.
    assert value(s, "shmwatch_gpu_memory_used_bytes", gpu="0") == 72 * GiB + (512 << 20)
    assert not select(s, "shmwatch_gpu_memory_used_bytes", gpu="1")  # skipped, the rest still reported
    assert not select(s, "shmwatch_gpu_memory_reserved_bytes")  # v1 has no reserved: absent, not 0


@needs_root
def test_mig_instances(stub_dir, tmp_path):
    conf = config(tmp_path, TWO_GPUS + "gpu0.mig=2\ngpu0.mig0.uuid=MIG-a\ngpu0.mig0.total=10737418240\n"
                                       "gpu0.mig0.used=1073741824\ngpu0.mig1.uuid=MIG-b\ngpu0.mig1.total=10737418240\n")
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), env=gpu_env(stub_dir, conf)) as exporter:
        s = exporter.scrape()
    assert value(s, "shmwatch_gpu_memory_used_bytes", gpu="0/0", uuid="MIG-a") == GiB
    assert value(s, "shmwatch_gpu_memory_total_bytes", gpu="0/1", uuid="MIG-b") == 10 * GiB


@needs_root
def test_init_failure_hurts_nothing_else(stub_dir, tmp_path):
    conf = config(tmp_path, "init_error=9\n")
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), env=gpu_env(stub_dir, conf)) as exporter:
        s = exporter.scrape()
        log = exporter.log()
    assert value(s, "shmwatch_collector_success", collector="gpu") == 0
    assert not [k for k in s if k[0].startswith("shmwatch_gpu_")]
    assert value(s, "shmwatch_collector_success", collector="shm_mount") == 1
    assert value(s, "shmwatch_mount_size_bytes", mount=shm) == 16 << 20
    assert log.count("collector gpu failed") == 1 and "driver is not loaded" in log


@needs_root
def test_no_library(tmp_path):
    """Without a driver the GPU collector fails alone and says why once; with one (a GPU
    machine), the exporter reads the real devices, as many as NVML counts."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        driver = True
    except OSError:
        driver = False
    durations = set()

    def polled_five_times(samples):  # each poll of the collector times it anew
        durations.add(value(samples, "shmwatch_collector_duration_seconds", collector="gpu"))
        return len(durations) >= 5

    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm)) as exporter:
        s = exporter.scrape()
        exporter.wait_for(polled_five_times, timeout=30)
        log = exporter.log()
    if driver:
        import pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        assert value(s, "shmwatch_collector_success", collector="gpu") == 1, log
        assert len(select(s, "shmwatch_gpu_memory_total_bytes")) == count
        return
    assert value(s, "shmwatch_collector_success", collector="gpu") == 0
    assert value(s, "shmwatch_collector_success", collector="host_memory") == 1
    assert log.count("libnvidia-ml.so.1 not found") == 1  # said once, not on every poll


@needs_root
def test_no_collector_gpu_flag(stub_dir, tmp_path):
    conf = config(tmp_path, TWO_GPUS)
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), "--no-collector.gpu",
                                               env=gpu_env(stub_dir, conf)) as exporter:
        s = exporter.scrape()
    assert value(s, "shmwatch_collector_success", collector="gpu") is None
    assert not [k for k in s if k[0].startswith("shmwatch_gpu_")]


@needs_root
def test_hanging_driver_is_bounded(stub_dir, tmp_path):
    hang, stats = tmp_path / "hang", tmp_path / "stats"
    conf = config(tmp_path, TWO_GPUS + f"hang_file={hang}\nstats_file={stats}\n")
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), "--collector.gpu.timeout=1s",
                                               env=gpu_env(stub_dir, conf)) as exporter:
        assert value(exporter.scrape(), "shmwatch_collector_success", collector="gpu") == 1
        hang.touch()  # the next NVML sweep blocks, as on a GPU fallen off the bus
        s = exporter.wait_for(lambda s: value(s, "shmwatch_collector_success", collector="gpu") == 0, timeout=10)
        assert not select(s, "shmwatch_gpu_memory_used_bytes")  # stale values are dropped
        # Everything else keeps its values and keeps moving while the GPU thread is stuck.
        with open(os.path.join(shm, "psm_during_hang"), "wb") as f:
            f.write(b"\1" * (4 << 20))
        s = exporter.wait_for(lambda s: value(s, "shmwatch_mount_used_bytes", mount=shm) >= 4 << 20, timeout=5)
        assert value(s, "shmwatch_collector_success", collector="shm_mount") == 1
        time.sleep(2)
        now_hanging, most, *_ = map(int, stats.read_text().split())
        assert (now_hanging, most) == (1, 1)  # the stuck call is never started a second time
        hang.unlink()
        s = exporter.wait_for(lambda s: value(s, "shmwatch_collector_success", collector="gpu") == 1, timeout=10)
        assert value(s, "shmwatch_gpu_memory_used_bytes", gpu="0") == 72 * GiB + (512 << 20)


@needs_root
def test_driver_error_reinitialises_nvml(stub_dir, tmp_path):
    stats = tmp_path / "stats"
    conf_text = TWO_GPUS + f"stats_file={stats}\n"
    conf = config(tmp_path, conf_text)
    with mounted_tmpfs("16m") as shm, Exporter(*exporter_args(shm), env=gpu_env(stub_dir, conf)) as exporter:
        assert value(exporter.scrape(), "shmwatch_collector_success", collector="gpu") == 1
        config(tmp_path, conf_text + "count_error=15\n")  # the driver loses the GPUs
        exporter.wait_for(lambda s: value(s, "shmwatch_collector_success", collector="gpu") == 0, timeout=5)
        config(tmp_path, conf_text)
        s = exporter.wait_for(lambda s: value(s, "shmwatch_collector_success", collector="gpu") == 1, timeout=5)
        assert value(s, "shmwatch_gpu_memory_used_bytes", gpu="0") == 72 * GiB + (512 << 20)
        _, _, inits, shutdowns = map(int, stats.read_text().split())
    assert inits >= 2 and shutdowns >= 1  # shut down after the error, initialised afresh
