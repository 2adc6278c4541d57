# mypy: allow-untyped-calls
"""The GPU collector against a fake NVML library (no GPU here): the `pynvml` module it
imports is a stand-in at the library boundary, answering as the driver does. Used memory is
all but free (the driver's reserve included); a GPU lost is skipped and named; every GPU
lost or the driver gone fails the collector, which initialises NVML again next time; no
driver is said once and retried later, never every poll. Part of the mutation selection."""

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from exporter.collectors.gpu import GpuCollector
from exporter.host.proctable import ProcessTable
from exporter.model.types import GpuDevice, GpuProcess
from tests.helpers import FakeProc

GiB, MiB = 1 << 30, 1 << 20
Used = Tuple[int, Optional[int]]  # a process on a GPU: (pid, bytes, None when not told)
NOT_SUPPORTED, GPU_IS_LOST, LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, UNKNOWN = (
    3,
    15,
    12,
    9,
    999,
)


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class Gpu:
    name: object = b"NVIDIA H100 80GB HBM3"
    uuid: object = "GPU-1111"
    total: int = 80 * GiB
    used: int = 70 * GiB
    free: int = 10 * GiB - 512 * MiB
    reserved: Optional[int] = (
        512 * MiB
    )  # None: a driver before R510, without memory info v2
    compute: List[Used] = field(default_factory=list)
    graphics: Optional[List[Used]] = None  # None: not supported
    migs: Optional[Dict[int, "Gpu"]] = None  # MIG on: slot -> instance
    mig_slots: int = 7
    lost: bool = False


class FakeNvml(types.ModuleType):
    """pynvml as the driver answers it, from `gpus`; `init_error`, `count_error`: an NVML
    error code nvmlInit / nvmlDeviceGetCount raise."""

    NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED = (
        LIBRARY_NOT_FOUND,
        DRIVER_NOT_LOADED,
    )
    NVML_DEVICE_MIG_ENABLE = 1
    nvmlMemory_v2 = 0x02000028
    NVMLError = NVMLError

    def __init__(self, gpus: List[Gpu], driver: object = b"550.54.15") -> None:
        super().__init__("pynvml")
        self.gpus, self.driver = gpus, driver
        self.init_error: Optional[int] = None
        self.count_error: Optional[int] = None
        self.calls: List[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")
        raise NVMLError(UNKNOWN)  # after a driver error it may well fail too

    def nvmlSystemGetDriverVersion(self) -> object:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise NVMLError(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Gpu:
        if self.gpus[index].lost:
            raise NVMLError(GPU_IS_LOST)
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: Gpu) -> object:
        return gpu.name

    def nvmlDeviceGetUUID(self, gpu: Gpu) -> object:
        return gpu.uuid

    def nvmlDeviceGetMigMode(self, gpu: Gpu) -> Tuple[int, int]:
        if gpu.migs is None:
            raise NVMLError(NOT_SUPPORTED)
        return 1, 1

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: Gpu) -> int:
        if gpu.migs is None:
            raise NVMLError(NOT_SUPPORTED)
        return gpu.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: Gpu, index: int) -> Gpu:
        migs = gpu.migs or {}
        if index not in migs:
            raise NVMLError(NOT_SUPPORTED)
        return migs[index]

    def nvmlDeviceGetMemoryInfo(
        self, gpu: Gpu, version: Optional[int] = None
    ) -> types.SimpleNamespace:
        if version is not None and gpu.reserved is None:
            raise NVMLError(NOT_SUPPORTED)
        if version is None:  # v1: the reserve counts as used
            return types.SimpleNamespace(
                total=gpu.total, used=gpu.used + (gpu.reserved or 0), free=gpu.free
            )
        return types.SimpleNamespace(
            total=gpu.total, used=gpu.used, free=gpu.free, reserved=gpu.reserved
        )

    def nvmlDeviceGetComputeRunningProcesses(
        self, gpu: Gpu
    ) -> List[types.SimpleNamespace]:
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in gpu.compute]

    def nvmlDeviceGetGraphicsRunningProcesses(
        self, gpu: Gpu
    ) -> List[types.SimpleNamespace]:
        if gpu.graphics is None:
            raise NVMLError(NOT_SUPPORTED)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in gpu.graphics]


@pytest.fixture
def table(tmp_path: Path) -> ProcessTable:
    proc = FakeProc(str(tmp_path / "proc"))
    proc.add(100, "vllm")
    proc.add(200, "python3")
    return ProcessTable(proc.paths)


def collector(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable, nvml: Optional[FakeNvml]
) -> GpuCollector:
    monkeypatch.setitem(
        sys.modules, "pynvml", nvml
    )  # None: import fails, as without the package
    return GpuCollector(table)


def test_each_gpus_memory_used_is_all_but_free_and_its_processes(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    gpus = [
        Gpu(
            compute=[(100, 61 * GiB), (200, None), (400, 0), (500, 2 * GiB)],
            graphics=[(100, 60 * GiB), (300, GiB)],
        ),
        Gpu(
            name="NVIDIA L4",
            uuid=b"GPU-2222",
            total=24 * GiB,
            used=GiB,
            free=22 * GiB,
            reserved=None,
        ),
    ]
    nvml = FakeNvml(gpus)
    snapshot = collector(monkeypatch, table, nvml).collect()
    assert snapshot.driver_version == "550.54.15" and snapshot.errors == []
    assert snapshot.devices == [
        GpuDevice(
            "0",
            "GPU-1111",
            "NVIDIA H100 80GB HBM3",
            80 * GiB,
            70 * GiB + 512 * MiB,
            10 * GiB - 512 * MiB,
            512 * MiB,
            (
                GpuProcess(
                    100, "vllm", 61 * GiB
                ),  # the larger of its compute and graphics use
                GpuProcess(300, "unknown", GiB),
                GpuProcess(400, "unknown", 0),
                GpuProcess(500, "unknown", 2 * GiB),
            ),
        ),
        # memory info v2 not supported: the reserve is unknown (not 0), and in used
        GpuDevice("1", "GPU-2222", "NVIDIA L4", 24 * GiB, GiB, 22 * GiB, None, ()),
    ]
    assert nvml.calls == ["init"]


def test_mig_instances_are_reported_beside_their_gpu(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    mig = Gpu(
        uuid="MIG-a",
        total=10 * GiB,
        used=GiB,
        free=9 * GiB,
        reserved=0,
        compute=[(200, GiB)],
    )
    gpus = [
        Gpu(
            migs={
                0: mig,
                3: Gpu(uuid="MIG-b", total=20 * GiB, used=0, free=20 * GiB, reserved=0),
            },
            mig_slots=4,
        )
    ]
    snapshot = collector(monkeypatch, table, FakeNvml(gpus)).collect()
    assert [
        (d.gpu, d.uuid, d.name, d.total_bytes, d.processes) for d in snapshot.devices
    ] == [
        ("0", "GPU-1111", "NVIDIA H100 80GB HBM3", 80 * GiB, ()),
        (
            "0/0",
            "MIG-a",
            "NVIDIA H100 80GB HBM3",
            10 * GiB,
            (GpuProcess(200, "python3", GiB),),
        ),
        ("0/3", "MIG-b", "NVIDIA H100 80GB HBM3", 20 * GiB, ()),
    ]


def test_a_lost_gpu_is_skipped_and_named(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    gpus = [Gpu(lost=True), Gpu(uuid="GPU-2"), Gpu(lost=True)]
    snapshot = collector(monkeypatch, table, FakeNvml(gpus)).collect()
    assert [d.uuid for d in snapshot.devices] == ["GPU-2"]
    assert snapshot.errors == ["gpu 0: NVML error 15", "gpu 2: NVML error 15"]


def test_every_gpu_lost_fails_and_nvml_is_started_again(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    nvml = FakeNvml([Gpu(lost=True), Gpu(lost=True)])
    gpu = collector(monkeypatch, table, nvml)
    with pytest.raises(RuntimeError) as raised:
        gpu.collect()
    assert (
        str(raised.value)
        == "every GPU failed: gpu 0: NVML error 15; gpu 1: NVML error 15"
    )
    nvml.gpus = [Gpu()]
    assert [d.uuid for d in gpu.collect().devices] == ["GPU-1111"]
    assert nvml.calls == ["init", "shutdown", "init"]


def test_the_driver_failing_fails_the_collector_and_nvml_is_started_again(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    nvml = FakeNvml([Gpu()])
    gpu = collector(monkeypatch, table, nvml)
    gpu.collect()
    nvml.count_error = UNKNOWN
    with pytest.raises(
        RuntimeError, match="^nvmlDeviceGetCount failed: NVML error 999$"
    ):
        gpu.collect()
    nvml.count_error = None
    assert len(gpu.collect().devices) == 1
    assert nvml.calls == ["init", "shutdown", "init"]


def test_no_gpu_is_no_failure(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    snapshot = collector(monkeypatch, table, FakeNvml([], driver="535.1")).collect()
    assert (snapshot.driver_version, snapshot.devices, snapshot.errors) == (
        "535.1",
        [],
        [],
    )


@pytest.mark.parametrize(
    "code, why",
    [
        (LIBRARY_NOT_FOUND, "no NVIDIA driver: libnvidia-ml.so.1 not found"),
        (DRIVER_NOT_LOADED, "the NVIDIA driver is not loaded"),
    ],
)
def test_no_driver_is_said_and_not_tried_again_at_once(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable, code: int, why: str
) -> None:
    nvml = FakeNvml([Gpu()])
    nvml.init_error = code
    gpu = collector(monkeypatch, table, nvml)
    for _ in range(3):
        with pytest.raises(RuntimeError) as raised:
            gpu.collect()
        assert str(raised.value) == why
    assert nvml.calls == ["init"]  # retried after a minute, not every poll


def test_without_nvidia_ml_py_the_collector_says_so(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    gpu = collector(monkeypatch, table, None)
    with pytest.raises(RuntimeError, match=r"^nvidia-ml-py is not installed \(.*\)$"):
        gpu.collect()
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([Gpu()]))
    with pytest.raises(RuntimeError, match="^nvidia-ml-py is not installed"):
        gpu.collect()  # not retried at once


def test_another_init_failure_is_tried_again_next_time(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    nvml = FakeNvml([Gpu()])
    nvml.init_error = UNKNOWN
    gpu = collector(monkeypatch, table, nvml)
    with pytest.raises(RuntimeError, match="^nvmlInit failed: NVML error 999$"):
        gpu.collect()
    nvml.init_error = None
    assert len(gpu.collect().devices) == 1
    assert nvml.calls == ["init", "init"]


def test_close_shuts_nvml_down_once(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    nvml = FakeNvml([Gpu()])
    gpu = collector(monkeypatch, table, nvml)
    gpu.close()
    gpu.collect()
    gpu.close()
    gpu.close()
    assert nvml.calls == ["init", "shutdown"]


def test_a_name_that_is_not_utf8_is_read_with_replacements(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    snapshot = collector(
        monkeypatch, table, FakeNvml([Gpu(name=b"H100 \xff", uuid=b"GPU-\xfe")])
    ).collect()
    assert (snapshot.devices[0].name, snapshot.devices[0].uuid) == (
        "H100 \ufffd",
        "GPU-\ufffd",
    )


def test_an_older_library_without_the_mig_constant_still_finds_mig_instances(
    monkeypatch: pytest.MonkeyPatch, table: ProcessTable
) -> None:
    nvml = FakeNvml([Gpu(migs={1: Gpu(uuid="MIG-c", reserved=0)}, mig_slots=2)])
    monkeypatch.delattr(FakeNvml, "NVML_DEVICE_MIG_ENABLE")
    assert [d.gpu for d in collector(monkeypatch, table, nvml).collect().devices] == [
        "0",
        "0/1",
    ]
