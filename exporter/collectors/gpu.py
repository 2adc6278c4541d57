"""GPU memory through NVML (nvidia-ml-py, imported as pynvml), initialised once and kept;
after a driver-level error shut down, and initialised again on the next run. One GPU failing
(lost, not supported) skips that GPU only; --collector.gpu.timeout bounds a hanging call."""

import time
from contextlib import suppress
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Dict, List, NoReturn, Optional

from exporter.collectors.source import RunInput, Source, register
from exporter.host.proctable import ProcessTable
from exporter.model.types import GpuDevice, GpuProcess, GpuSnapshot

# After "no library" / "no driver", try again this much later, not on every poll.
MISSING_DRIVER_RETRY_SECONDS = 60.0


@dataclass(frozen=True)
class _Missing:
    """Why NVML cannot be had (no library, no driver), and when to try again."""

    retry_at: float  # time.monotonic()
    why: str


@dataclass(frozen=True)
class _Memory:
    """A GPU's memory as NVML reports it: "used" is all but free, the driver's reserve
    included (v1's used, v2's used + reserved)."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: Optional[
        int
    ]  # None: before R510 there is no v2, reserved is unknown


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _import_nvml() -> ModuleType:
    import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types

    module: ModuleType = pynvml
    return module


def _no_driver(nvml: ModuleType, err: Exception) -> str:
    """What nvmlInit's error says: no library, no driver loaded; any other error is raised
    as RuntimeError (tried again on the next run)."""
    why: Dict[Any, str] = {
        nvml.NVML_ERROR_LIBRARY_NOT_FOUND: "no NVIDIA driver: libnvidia-ml.so.1 not found",
        nvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
    }
    found = why.get(getattr(err, "value", None))
    if not found:
        raise RuntimeError(f"nvmlInit failed: {err}") from None
    return found


class GpuCollector(Source):
    name = "gpu"

    def __init__(self, table: ProcessTable):
        self.table = table
        self.nvml: Optional[ModuleType] = None  # pynvml, once nvmlInit succeeded
        self.driver_version = ""
        self._missing: Optional[_Missing] = None  # no driver: when to try again

    def _init(self) -> ModuleType:
        """NVML initialised, or RuntimeError: without a library or a driver, the same
        error until MISSING_DRIVER_RETRY_SECONDS have passed."""
        if self._missing and time.monotonic() < self._missing.retry_at:
            raise RuntimeError(self._missing.why)
        try:
            nvml = _import_nvml()
        except ImportError as err:
            self._missing_for_now(f"nvidia-ml-py is not installed ({err})")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            self._missing_for_now(_no_driver(nvml, err))
        self.nvml, self._missing = nvml, None
        self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        return nvml

    def _missing_for_now(self, why: str) -> NoReturn:
        retry_at = time.monotonic() + MISSING_DRIVER_RETRY_SECONDS
        self._missing = _Missing(retry_at=retry_at, why=why)
        raise RuntimeError(why)

    def close(self) -> None:
        if self.nvml is not None:
            with suppress(Exception):  # after a driver error this may fail too
                self.nvml.nvmlShutdown()
        self.nvml = None

    def collect(self, run: RunInput = RunInput()) -> GpuSnapshot:
        nvml = self.nvml or self._init()
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as err:
            self.close()  # driver-level trouble
            raise RuntimeError(f"nvmlDeviceGetCount failed: {err}") from None
        devices: List[GpuDevice] = []
        errors: List[str] = []
        for index in range(count):
            try:
                devices.extend(self._device(nvml, index))
            except nvml.NVMLError as err:
                errors.append(f"gpu {index}: {err}")
        if count and not devices:
            self.close()
            raise RuntimeError("every GPU failed: " + "; ".join(errors))
        return GpuSnapshot(
            driver_version=self.driver_version, devices=devices, errors=errors
        )

    def _device(self, nvml: ModuleType, index: int) -> List[GpuDevice]:
        """A GPU, and each MIG instance of it when MIG is on."""
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        devices = [self._measure(nvml, handle, str(index), name)]
        current_mode = 0
        with suppress(nvml.NVMLError):  # NotSupported on GPUs without MIG
            current_mode, _pending = nvml.nvmlDeviceGetMigMode(handle)
        if current_mode == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
                except nvml.NVMLError:
                    continue  # that MIG slot is not populated
                devices.append(self._measure(nvml, mig, f"{index}/{mig_index}", name))
        return devices

    def _measure(
        self, nvml: ModuleType, handle: object, gpu: str, name: str
    ) -> GpuDevice:
        memory = _memory(nvml, handle)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        # NVML reports host PIDs; from another PID namespace they do not resolve here.
        comm = self.table.comm
        processes = tuple(
            GpuProcess(pid=pid, comm=comm(pid), used_bytes=used)
            for pid, used in sorted(_used_by_pid(nvml, handle).items())
        )
        return GpuDevice(
            gpu=gpu,
            uuid=uuid,
            name=name,
            total_bytes=memory.total_bytes,
            used_bytes=memory.used_bytes,
            free_bytes=memory.free_bytes,
            reserved_bytes=memory.reserved_bytes,
            processes=processes,
        )


def _memory(nvml: ModuleType, handle: object) -> _Memory:
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        reserved: Optional[int] = int(info.reserved)
        used = int(info.used) + int(info.reserved)
    except nvml.NVMLError:
        # Drivers before R510 have no v2: reserved is then unknown, not 0.
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        used, reserved = int(info.used), None
    return _Memory(
        total_bytes=int(info.total),
        used_bytes=used,
        free_bytes=int(info.free),
        reserved_bytes=reserved,
    )


def _used_by_pid(nvml: ModuleType, handle: object) -> Dict[int, int]:
    """pid -> the GPU memory it uses, of compute and graphics processes alike (Graphics is
    NotSupported on many data-centre GPUs)."""
    infos: List[Any] = []
    compute = nvml.nvmlDeviceGetComputeRunningProcesses
    for getter in (compute, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        with suppress(nvml.NVMLError):
            infos += getter(handle)
    by_pid: Dict[int, int] = {}
    for info in infos:
        if info.usedGpuMemory is not None:  # None under WDDM or without permission
            pid = int(info.pid)
            by_pid[pid] = max(by_pid.get(pid, 0), int(info.usedGpuMemory))
    return by_pid


register("gpu", lambda c: GpuCollector(c.table))
